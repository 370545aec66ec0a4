"""Time the XLA forms of the quantized linears on the real models' shapes (research, CPU).

For a `QuantizedLinear` in each weight preset's format (random codes and scales; timing needs no
real fit) and each row count M, three forms of y = x_rot @ Ŵ, checked against each other:
`f32_dot` (a dense f32 weight of the same shape, the baseline), `tiled` (`_tiled_matmul`:
dequantize a tile of outputs, then dot; the prefill path) and `fused` (`_linear_fused`, the
decode path for M <= tiling.FUSED_ROWS). Timings are medians of interleaved repeats (the forms
alternate within one process, so machine load hits them alike); `temp_MB` is XLA's
`memory_analysis()` temporary allocation of the compiled form.

    python scripts/research/bench_linear.py                      # every shape and format, M = 1
    python scripts/research/bench_linear.py --formats tq4 int8 --shapes qwen --m 1 4
    python scripts/research/bench_linear.py --ggml      # GGUF blocks at M = 1

`--ggml` times the GGUF block formats (`tqjax.quant.ggml`) on the real models' shapes and types
at M = 1: the f32 dot of a dense weight, decode-then-dot (`_decode_then_dot`, the prefill path)
and the decode fused into vector-matrix dots (`_linear_fused`, the decode path).
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

SHAPES = {  # name -> (in, out): SmolLM2-135M, Qwen2.5-Coder-0.5B and -1.5B MLPs, heads
    "smol.up": (576, 1536), "smol.down": (1536, 576), "smol.head": (576, 49152),
    "qwen.up": (896, 4864), "qwen.down": (4864, 896), "qwen.head": (896, 151936),
    "qwen15.up": (1536, 8960), "qwen15.down": (8960, 1536),
}
FORMATS = {  # name -> WeightFormat (the CLI's presets)
    "tq4": qw.WeightFormat("tq", 4, 64), "tq3": qw.WeightFormat("tq", 3, 64),
    "tq2": qw.WeightFormat("tq", 2, 64), "tq8": qw.WeightFormat("tq", 8, 64),
    "int8": qw.WeightFormat("sym", 8, 0), "int4": qw.WeightFormat("sym", 4, 32),
    "int4-affine": qw.WeightFormat("affine", 4, 32),
}


def random_weight(fmt: qw.WeightFormat, k: int, n: int, seed: int = 0) -> qw.QuantizedLinear:
    """A QuantizedLinear of random codes and scales in `fmt`'s layout."""
    rng = np.random.default_rng(seed)
    g, kp = fmt.group_size(k), fmt.padded_in(k)
    scale = rng.uniform(0.5, 1.5, (n, kp // g)).astype(np.float16) * np.float16(0.01)
    offset = (-scale * 8).astype(np.float16) if fmt.kind == "affine" else None
    return qw.QuantizedLinear(
        packed=jnp.asarray(rng.integers(0, 256, (n, kp * fmt.bits // 8), dtype=np.uint8)),
        scale=jnp.asarray(scale), lut=qw.format_lut(fmt),
        offset=None if offset is None else jnp.asarray(offset),
        rotation=qw.format_rotation(fmt.rotation_block, 0) if fmt.rotation_block else None,
        bits=fmt.bits, group=g, in_features=k, kind=fmt.kind)


def _time(comps: dict, args: tuple, repeats: int) -> dict[str, list[float]]:
    """Interleaved wall times (s) of compiled callables comps[name](*args[name])."""
    times: dict[str, list[float]] = {f: [] for f in comps}
    for _ in range(repeats):
        for f, c in comps.items():
            t0 = time.perf_counter()
            c(*args[f]).block_until_ready()
            times[f].append(time.perf_counter() - t0)
    return times


GGML_CASES = (  # (in, out, type): SmolLM2 (Q4_1, Q8_0 head), Qwen2.5-Coder 0.5B / 1.5B (Q4_K_M,
    # the 1.5B's untied Q6_K head); Q5_K (Q5_K_M files) on a 0.5B shape
    (576, 1536, "Q4_1"), (1536, 576, "Q4_1"), (576, 49152, "Q8_0"), (896, 4864, "Q5_0"),
    (4864, 896, "Q4_K"), (4864, 896, "Q6_K"), (4864, 896, "Q5_K"), (896, 151936, "Q8_0"),
    (1536, 8960, "Q4_K"), (8960, 1536, "Q6_K"), (1536, 1536, "Q4_K"), (1536, 151936, "Q6_K"))


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
        w = ggml.from_gguf(data, int(t), (n, k))
        x = jnp.asarray(rng.standard_normal((1, k)), jnp.float32)
        dense = jnp.asarray(rng.standard_normal((k, n)), jnp.float32)
        forms = {
            "f32_dot": (lambda x, d: jnp.dot(x, d), dense),
            "decode_then_dot": (ggml._decode_then_dot, w),
            "fused": (ggml._linear_fused, w),
        }
        call = {f: (x, a) for f, (_, a) in forms.items()}
        comps = {f: jax.jit(fn).lower(x, a).compile() for f, (fn, a) in forms.items()}
        for f, ts in _time(comps, call, repeats).items():
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
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--shapes", nargs="*", default=list(SHAPES), help="names or prefixes")
    ap.add_argument("--formats", nargs="*", default=list(FORMATS))
    ap.add_argument("--m", nargs="*", type=int, default=[1])
    ap.add_argument("--repeats", type=int, default=9)
    ap.add_argument("--json", action="store_true")
    ap.add_argument("--ggml", action="store_true", help="time the GGUF block forms instead")
    args = ap.parse_args(argv)
    if args.ggml:
        return ggml_main(args.repeats, args.json)
    shapes = [s for s in SHAPES if any(s.startswith(p) for p in args.shapes)]
    forms = {"f32_dot": lambda x, d: jnp.dot(x, d), "tiled": qw._tiled_matmul,
             "fused": qw._linear_fused}
    rows = []
    for shape in shapes:
        k, n = SHAPES[shape]
        dense = jax.random.normal(jax.random.PRNGKey(1), (k, n), jnp.float32)
        for fname in args.formats:
            w = random_weight(FORMATS[fname], k, n)
            for m in args.m:
                x = jax.random.normal(jax.random.PRNGKey(m), (m, w.padded_in))
                use = {f: fn for f, fn in forms.items() if f != "fused" or m <= 4}
                call = {f: (x[:, :k], dense) if f == "f32_dot" else (x, w) for f in use}
                comps = {f: jax.jit(fn).lower(*call[f]).compile() for f, fn in use.items()}
                ref = np.asarray(comps["tiled"](x, w))
                if "fused" in comps:
                    got = np.asarray(comps["fused"](x, w))
                    err = np.abs(got - ref).max() / (np.abs(ref).max() + 1e-30)
                    assert err < 1e-4, (shape, fname, m, err)
                times = _time(comps, call, args.repeats)
                for f, ts in times.items():
                    temp = comps[f].memory_analysis().temp_size_in_bytes / 2**20
                    row = dict(shape=f"{shape} {k}x{n}", format=fname, m=m, form=f,
                               ms=round(1e3 * statistics.median(ts), 3), temp_MB=round(temp, 1))
                    rows.append(row)
                    if not args.json:
                        print(f"{row['shape']:24s} {fname:12s} M={m:<4d} {f:8s} {row['ms']:9.3f} ms"
                              f"  temp {row['temp_MB']:8.1f} MB", flush=True)
    if args.json:
        json.dump(rows, sys.stdout, indent=1)
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
