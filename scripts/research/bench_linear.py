"""Time candidate XLA forms of the quantized linear on realistic shapes (research, CPU).

Each form computes y = x_rot @ Ŵ for a `QuantizedLinear` (Ŵ = scale · lut[code] (+ offset)) and
is checked against the dequantize-then-dot reference. Timings are medians of interleaved repeats
(forms alternate within one process, so machine load hits them alike); `temp_MB` is XLA's
`memory_analysis()` temporary allocation of the compiled form (a dequantized f32 [K, N] weight
shows up there).

    python scripts/research/bench_linear.py                      # every shape, M = 1 and 512
    python scripts/research/bench_linear.py --m 1 --formats tq4 int8 --shapes smol
    python scripts/research/bench_linear.py --ggml      # GGUF blocks at M = 1: decode forms

`--ggml` times the GGUF block formats (`tqjax.quant.ggml`) on the real models' shapes and types
at M = 1: the f32 dot of a dense weight, decode-then-dot (`_decode_then_dot`, the M > FUSED_ROWS
path) and the decode fused into vector-matrix dots (`_linear_fused`, the decode path), plus,
for an int8 weight stored [out, in] (input minor, as GGUF stores rows), the same fused dot:
the layout a QuantizedLinear would need to take that path (it is stored [in, out]).
"""

from __future__ import annotations

import argparse
import json
import statistics
import sys
import time

import jax
import jax.numpy as jnp
import numpy as np

from tqjax.quant import weights as qw
from tqjax.quant.packing import unpack_bits, unpack_leading

SHAPES = {  # name -> (in, out)
    "smol.up": (576, 1536), "smol.down": (1536, 576), "smol.head": (576, 49152),
    "qwen.up": (896, 4864), "qwen.down": (4864, 896), "qwen.head": (896, 151936),
}
FORMATS = {  # name -> WeightFormat (the CLI's presets)
    "tq4": qw.WeightFormat("tq", 4, 64), "tq3": qw.WeightFormat("tq", 3, 64),
    "tq8": qw.WeightFormat("tq", 8, 64), "int8": qw.WeightFormat("sym", 8, 0),
    "int4": qw.WeightFormat("sym", 4, 32), "int4-affine": qw.WeightFormat("affine", 4, 32),
}


def random_weight(fmt: qw.WeightFormat, k: int, n: int, seed: int = 0) -> qw.QuantizedLinear:
    """A QuantizedLinear of random codes and scales in `fmt`'s layout (timing needs no real fit)."""
    rng = np.random.default_rng(seed)
    g, kp = fmt.group_size(k), fmt.padded_in(k)
    scale = rng.uniform(0.5, 1.5, (kp // g, n)).astype(np.float16) * np.float16(0.01)
    offset = (-scale * 8).astype(np.float16) if fmt.kind == "affine" else None
    return qw.QuantizedLinear(
        packed=jnp.asarray(rng.integers(0, 256, (kp * fmt.bits // 8, n), dtype=np.uint8)),
        scale=jnp.asarray(scale), lut=qw.format_lut(fmt),
        offset=None if offset is None else jnp.asarray(offset),
        rotation=qw.format_rotation(fmt.rotation_block, 0) if fmt.rotation_block else None,
        bits=fmt.bits, group=g, in_features=k)


# ---------------------------------------------------------------- candidate forms
# All take the rotated, padded input xr f32 [M, K_pad] and return f32 [M, N].


def _offset_term(xr: jax.Array, w: qw.QuantizedLinear) -> jax.Array:
    """Σ_g offset[g, n] · Σ_{k in g} x[m, k] -> [M, N] (0 without offsets)."""
    if w.offset is None:
        return jnp.zeros((), xr.dtype)
    xs = xr.reshape(xr.shape[0], -1, w.group).sum(-1)  # [M, G]
    return jnp.dot(xs, w.offset.astype(jnp.float32))


def _grouped_values(packed: jax.Array, w: qw.QuantizedLinear) -> jax.Array:
    """lut[code] f32 [G', group, N'] of a row block of packed bytes (no scale)."""
    v = w.lut[unpack_leading(packed, w.bits)]
    return v.reshape(-1, w.group, packed.shape[1])


def _deq(packed: jax.Array, scale: jax.Array, offset: jax.Array | None,
         w: qw.QuantizedLinear) -> jax.Array:
    v = _grouped_values(packed, w) * scale.astype(jnp.float32)[:, None]
    if offset is not None:
        v = v + offset.astype(jnp.float32)[:, None]
    return v.reshape(-1, packed.shape[1])


def form_a0_bitstream_dequant_dot(xr: jax.Array, w: qw.QuantizedLinear) -> jax.Array:
    """(a0) the path before issue 22: bit-stream unpack of packed.T, LUT, scale, then dot."""
    v = w.lut[unpack_bits(w.packed.T, w.bits, w.padded_in).T.astype(jnp.int32)]
    v = v.reshape(-1, w.group, v.shape[1]) * w.scale.astype(jnp.float32)[:, None]
    if w.offset is not None:
        v = v + w.offset.astype(jnp.float32)[:, None]
    return jnp.dot(xr, v.reshape(w.padded_in, -1))


def form_a_dequant_dot(xr: jax.Array, w: qw.QuantizedLinear) -> jax.Array:
    """(a) `dequantize_weight` (shift unpack along K, `packing.unpack_leading`), then dot."""
    return jnp.dot(xr, qw.dequantize_weight(w))


def form_b_group_dot(xr: jax.Array, w: qw.QuantizedLinear) -> jax.Array:
    """(b) per-group dot of x with lut[code] -> [M, G, N] partials, scale outside, reduce G."""
    v = _grouped_values(w.packed, w)  # [G, g, N]
    part = jnp.einsum("mgk,gkn->mgn", xr.reshape(xr.shape[0], -1, w.group), v)
    return (part * w.scale.astype(jnp.float32)).sum(1) + _offset_term(xr, w)


def form_c_fused_reduce(xr: jax.Array, w: qw.QuantizedLinear) -> jax.Array:
    """(c) multiply and reduce elementwise: (x · lut[code]).sum(group) then · scale, sum G."""
    v = _grouped_values(w.packed, w)  # [G, g, N]
    part = (xr.reshape(xr.shape[0], -1, w.group, 1) * v[None]).sum(2)  # [M, G, N]
    return (part * w.scale.astype(jnp.float32)).sum(1) + _offset_term(xr, w)


def form_c2_fused_reduce_scaled(xr: jax.Array, w: qw.QuantizedLinear) -> jax.Array:
    """(c2) one reduce over K of x · (scale · lut[code] + offset)."""
    return (xr[:, :, None] * _deq(w.packed, w.scale, w.offset, w)[None]).sum(1)


def form_d_int8_convert_dot(xr: jax.Array, w: qw.QuantizedLinear) -> jax.Array:
    """(d) 8-bit per-channel only: dot with the codes converted in the dot, scale after."""
    assert w.bits == 8 and w.packed.shape[0] == w.group
    v = w.lut[w.packed.astype(jnp.int32)]
    return jnp.dot(xr, v) * w.scale.astype(jnp.float32)[0] + _offset_term(xr, w)


def form_d2_int8_mixed_dot(xr: jax.Array, w: qw.QuantizedLinear) -> jax.Array:
    """(d2) 8-bit sym per-channel: f32 x int8 dot_general (values = code - 128) then scale."""
    assert w.bits == 8 and w.packed.shape[0] == w.group
    wi = jax.lax.bitcast_convert_type(w.packed ^ jnp.uint8(0x80), jnp.int8)
    y = jax.lax.dot_general(xr, wi, (((1,), (0,)), ((), ())), preferred_element_type=jnp.float32)
    return y * w.scale.astype(jnp.float32)[0]


def form_e_nibble_split(xr: jax.Array, w: qw.QuantizedLinear) -> jax.Array:
    """(e) 4-bit only: the low and high nibbles as two half-K dots (even and odd rows)."""
    assert w.bits == 4
    kp = w.padded_in
    s = jnp.repeat(w.scale.astype(jnp.float32), w.group // 2, axis=0)  # [K/2, N]
    lo = w.lut[(w.packed & 15).astype(jnp.int32)] * s
    hi = w.lut[(w.packed >> 4).astype(jnp.int32)] * s
    x2 = xr.reshape(xr.shape[0], kp // 2, 2)
    return jnp.dot(x2[..., 0], lo) + jnp.dot(x2[..., 1], hi) + _offset_term(xr, w)


def _row_tiles(xr: jax.Array, w: qw.QuantizedLinear, rows: int) -> jax.Array:
    """(f) loop over row tiles of `rows` inputs: acc += x[:, tile] @ dequant(tile)."""
    rows = max(rows // w.group, 1) * w.group
    kp, n = w.padded_in, w.out_features
    if kp % rows:
        rows = w.group
    tb, tg = rows * w.bits // 8, rows // w.group

    def body(i: jax.Array, acc: jax.Array) -> jax.Array:
        p = jax.lax.dynamic_slice_in_dim(w.packed, i * tb, tb)
        s = jax.lax.dynamic_slice_in_dim(w.scale, i * tg, tg)
        o = None if w.offset is None else jax.lax.dynamic_slice_in_dim(w.offset, i * tg, tg)
        xt = jax.lax.dynamic_slice_in_dim(xr, i * rows, rows, axis=1)
        return acc + jnp.dot(xt, _deq(p, s, o, w))

    return jax.lax.fori_loop(0, kp // rows, body, jnp.zeros((xr.shape[0], n), jnp.float32))


def form_f_row_tiles_64k(xr: jax.Array, w: qw.QuantizedLinear) -> jax.Array:
    """(f) row tiles holding ~64k weights (an L2-sized f32 temp)."""
    return _row_tiles(xr, w, max(8, 65536 // w.out_features))


def form_f_row_tiles_256(xr: jax.Array, w: qw.QuantizedLinear) -> jax.Array:
    """(f) row tiles of 256 inputs."""
    return _row_tiles(xr, w, 256)


def form_f_row_tiles_64(xr: jax.Array, w: qw.QuantizedLinear) -> jax.Array:
    """(f) row tiles of 64 inputs."""
    return _row_tiles(xr, w, 64)


def _col_tiles(xr: jax.Array, w: qw.QuantizedLinear, cols: int) -> jax.Array:
    """(g) loop over output-column tiles: y[:, tile] = x @ dequant(packed[:, tile])."""
    n = w.out_features
    cols = cols if n % cols == 0 else n

    def cut(a: jax.Array | None, j: jax.Array) -> jax.Array | None:
        return None if a is None else jax.lax.dynamic_slice_in_dim(a, j * cols, cols, axis=1)

    def body(j: jax.Array, y: jax.Array) -> jax.Array:
        t = jnp.dot(xr, _deq(cut(w.packed, j), cut(w.scale, j), cut(w.offset, j), w))
        return jax.lax.dynamic_update_slice_in_dim(y, t, j * cols, axis=1)

    return jax.lax.fori_loop(0, n // cols, body, jnp.zeros((xr.shape[0], n), jnp.float32))


def form_g_col_tiles_512(xr: jax.Array, w: qw.QuantizedLinear) -> jax.Array:
    """(g) column tiles of 512 outputs."""
    return _col_tiles(xr, w, 512)


def form_g_col_tiles_64k(xr: jax.Array, w: qw.QuantizedLinear) -> jax.Array:
    """(g) column tiles holding ~64k weights."""
    return _col_tiles(xr, w, max(64, 65536 // w.padded_in // 64 * 64))


def form_z_chosen(xr: jax.Array, w: qw.QuantizedLinear) -> jax.Array:
    """The form `tqjax.quant.weights.linear` uses on XLA (column tiles of ~TILE_WEIGHTS)."""
    return qw._tiled_matmul(xr, w)


FORMS = {name[5:]: f for name, f in dict(globals()).items() if name.startswith("form_")}


def _applies(form: str, w: qw.QuantizedLinear) -> bool:
    if form.startswith("d"):
        return w.bits == 8 and w.packed.shape[0] == w.group and (
            form == "d_int8_convert_dot" or w.offset is None)
    if form.startswith("e"):
        return w.bits == 4
    return True


GGML_CASES = (  # (in, out, type): SmolLM2 (Q4_1, Q8_0 head), Qwen2.5-Coder 0.5B / 1.5B (Q4_K_M)
    (576, 1536, "Q4_1"), (1536, 576, "Q4_1"), (576, 49152, "Q8_0"), (896, 4864, "Q5_0"),
    (4864, 896, "Q4_K"), (4864, 896, "Q6_K"), (896, 151936, "Q8_0"), (1536, 8960, "Q4_K"),
    (8960, 1536, "Q6_K"), (1536, 1536, "Q4_K"))


def ggml_main(repeats: int, as_json: bool) -> int:
    """Time the GGUF forms at M = 1 (see the module docstring); rows as in `main`."""
    from gguf import GGML_QUANT_SIZES, GGMLQuantizationType

    from tqjax.quant import ggml

    rng = np.random.default_rng(0)
    rows = []
    for k, n, tname in GGML_CASES:
        t = GGMLQuantizationType[tname]
        block, size = GGML_QUANT_SIZES[t]
        data = rng.integers(0, 256, (n, k // block * size), dtype=np.uint8)
        w = ggml.GGMLLinear(data=jnp.asarray(data), ggml_type=int(t), in_features=k)
        x = jnp.asarray(rng.standard_normal((1, k)), jnp.float32)
        dense = jnp.asarray(rng.standard_normal((k, n)), jnp.float32)
        int8_nk = jnp.asarray(rng.integers(-127, 128, (n, k), dtype=np.int8))
        forms = {
            "f32_dot": (lambda x, d: jnp.dot(x, d), dense),
            "decode_then_dot": (ggml._decode_then_dot, w),
            "fused": (ggml._linear_fused, w),
            "int8_out_in_fused": (lambda x, q: jnp.dot(x, q.astype(jnp.float32).T), int8_nk),
        }
        comp = {f: (jax.jit(fn).lower(x, a).compile(), a) for f, (fn, a) in forms.items()}
        times: dict[str, list[float]] = {f: [] for f in comp}
        for _ in range(repeats):
            for f, (c, a) in comp.items():
                t0 = time.perf_counter()
                c(x, a).block_until_ready()
                times[f].append(time.perf_counter() - t0)
        for f, ts in times.items():
            row = dict(shape=f"{k}x{n}", format=tname, m=1, form=f,
                       ms=round(1e3 * statistics.median(ts), 3),
                       ms_min=round(1e3 * min(ts), 3))
            rows.append(row)
            if not as_json:
                print(f"{row['shape']:12s} {tname:5s} {f:18s} {row['ms']:9.3f} ms "
                      f"(min {row['ms_min']:.3f})", flush=True)
    if as_json:
        json.dump(rows, sys.stdout, indent=1)
    return 0


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--shapes", nargs="*", default=list(SHAPES), help="names or prefixes")
    ap.add_argument("--formats", nargs="*", default=list(FORMATS))
    ap.add_argument("--forms", nargs="*", default=list(FORMS), help="names or prefixes")
    ap.add_argument("--m", nargs="*", type=int, default=[1, 512])
    ap.add_argument("--repeats", type=int, default=7)
    ap.add_argument("--max-work", type=float, default=4e10,
                    help="skip elementwise (c*) forms above this many M·K·N multiplies")
    ap.add_argument("--json", action="store_true")
    ap.add_argument("--ggml", action="store_true", help="time the GGUF block forms instead")
    args = ap.parse_args(argv)
    if args.ggml:
        return ggml_main(args.repeats, args.json)
    shapes = [s for s in SHAPES if any(s.startswith(p) for p in args.shapes)]
    forms = [f for f in FORMS if any(f.startswith(p) for p in args.forms)]
    rows = []
    for shape in shapes:
        k, n = SHAPES[shape]
        for fname in args.formats:
            w = random_weight(FORMATS[fname], k, n)
            for m in args.m:
                x = jax.random.normal(jax.random.PRNGKey(m), (m, w.padded_in))
                cands = {}
                for f in forms:
                    if not _applies(f, w) or (f.startswith("c") and m * k * n > args.max_work):
                        continue
                    fn = jax.jit(FORMS[f])
                    comp = fn.lower(x, w).compile()
                    temp = comp.memory_analysis().temp_size_in_bytes / 2**20
                    comp(x, w).block_until_ready()
                    cands[f] = (comp, temp, [])
                ref = np.asarray(cands[next(iter(cands))][0](x, w))
                for f, (comp, _, _) in cands.items():
                    got = np.asarray(comp(x, w))
                    err = np.abs(got - ref).max() / (np.abs(ref).max() + 1e-30)
                    assert err < 1e-4, (shape, fname, m, f, err)
                reps = max(2, args.repeats if m * k * n < 1e10 else args.repeats // 2)
                for _ in range(reps):
                    for comp, _, times in cands.values():
                        t0 = time.perf_counter()
                        comp(x, w).block_until_ready()
                        times.append(time.perf_counter() - t0)
                for f, (_, temp, times) in cands.items():
                    row = dict(shape=shape, format=fname, m=m, form=f,
                               ms=round(1e3 * statistics.median(times), 3), temp_MB=round(temp, 1))
                    rows.append(row)
                    if not args.json:
                        print(f"{shape:10s} {fname:12s} M={m:<4d} {f:24s} {row['ms']:9.3f} ms"
                              f"  temp {row['temp_MB']:8.1f} MB", flush=True)
    if args.json:
        json.dump(rows, sys.stdout, indent=1)
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
