"""One prepared GPU run for the Pallas kernels; writes JSON ($OUT/gpu_check.json, else
./gpu_check.json, or --out), rewritten after every section so a cut-off run keeps what it has.

Sections, at Qwen2.5-Coder-0.5B shapes (hidden 896, FFN 4864, 14 heads / 2 KV heads, hd 64):
- copy: device-to-device copy bandwidth (the roofline the kernels are compared with);
- dequant_matmul: max error (f32 x) against x @ dequantize_weight(w) at HIGHEST precision, and
  time per call (bf16 x) against the XLA path (dequantize + dot) and a dense bf16 matmul;
  bytes/s counts the quantized weight plus x and y. Timed over a scan through enough distinct
  weights to defeat the L2;
- attention: turbo_decode_attention against the XLA attention math (ragged batch of 2), and time
  per layer for dense bf16 (XLA and Pallas) and turbo4-K (centred) / turbo3-V (XLA and Pallas) at
  4k and 32k, scanning over 24 layers of cache;
- decode: tok/s of the whole model (batch 1) at 4k and 32k context, bf16 vs tq4 weights, dense
  bf16 vs a calibrated turbo4-K / turbo3-V cache (4 sink slots), xla vs pallas backend;
  runs are ordered by importance and skipped (marked) once the time budget is spent. Uses the
  real checkpoint when --model is given or the fetch cache holds it (no download), else random
  weights of the same architecture (speed does not depend on the values).

Without a GPU it writes {"error": ...} and exits 1.
"""

from __future__ import annotations

import argparse
import math
import os
import sys
import time
import traceback
from collections.abc import Callable
from pathlib import Path

MODEL_NAME = "qwen2.5-coder-0.5b-instruct"
HIDDEN, FFN, HEADS, KV_HEADS, HEAD_DIM, LAYERS, VOCAB = 896, 4864, 14, 2, 64, 24, 151936
L2_DEFEAT_BYTES = 256 << 20  # bytes of distinct weights/caches per timed scan


class Report:
    """The JSON result, written atomically after every update."""

    def __init__(self, path: Path) -> None:
        self.path, self.data, self.t0 = path, {"error": None}, time.perf_counter()

    def elapsed(self) -> float:
        return time.perf_counter() - self.t0

    def set(self, key: str, value: object) -> None:
        self.data[key] = value
        self.data["elapsed_s"] = round(self.elapsed(), 1)
        from tqjax.atomic import write_json

        write_json(self.path, self.data, indent=1)


def timed(fn: Callable[[], object], repeats: int = 5) -> float:
    """Best wall time of fn() (compiled and warmed first), seconds."""
    import jax

    jax.block_until_ready(fn())
    best = math.inf
    for _ in range(repeats):
        t0 = time.perf_counter()
        jax.block_until_ready(fn())
        best = min(best, time.perf_counter() - t0)
    return best


def section(report: Report, name: str, fn: Callable[[], dict]) -> dict | None:
    """Run one section; a failure is recorded under its name and the run goes on."""
    try:
        out = fn()
    except Exception as e:  # noqa: BLE001 - any failure becomes part of the report
        report.set(name, {"error": f"{type(e).__name__}: {e}",
                          "traceback": traceback.format_exc()[-4000:]})
        return None
    report.set(name, out)
    return out


def copy_bandwidth() -> dict:
    import jax
    import jax.numpy as jnp

    x = jnp.zeros(1 << 30, jnp.uint8)
    f = jax.jit(lambda x: x + jnp.uint8(1))
    t = timed(lambda: f(x))
    return {"bytes": 2 << 30, "seconds": t, "bytes_per_s": (2 << 30) / t}


# ---------------------------------------------------------------- dequant-matmul


def layer_scan(op: Callable, proto: object, layers: int,
               big: Callable[[object], bool]) -> tuple[Callable, list]:
    """`layers` distinct copies of the `big` leaves of pytree `proto` and a jitted
    run(x, copies) applying op(x, layer) to each in a scan (the other leaves are shared), so a
    timed run streams from memory, not from the L2."""
    import jax
    import jax.numpy as jnp

    leaves, tree = jax.tree_util.tree_flatten(proto)
    picked = [i for i, a in enumerate(leaves) if big(a)]
    copies = [jnp.stack([leaves[i]] * layers) for i in picked]

    def run(x: jax.Array, copies: list) -> jax.Array:
        def body(carry: int, sliced: list) -> tuple[int, jax.Array]:
            mine = list(leaves)
            for i, a in zip(picked, sliced, strict=True):
                mine[i] = a
            return carry, op(x, jax.tree_util.tree_unflatten(tree, mine))
        return jax.lax.scan(body, 0, copies)[1]

    return jax.jit(run), copies


def random_quantized(key: object, k: int, n: int, bits: int, group: int, kind: str) -> object:
    """A QuantizedLinear with random codes and scales in format `kind` ("tq", "sym", "affine")."""
    import jax
    import jax.numpy as jnp

    from tqjax.quant.codebook import lloyd_max
    from tqjax.quant.weights import QuantizedLinear

    k1, k2, k3 = jax.random.split(key, 3)
    packed = jax.random.randint(k1, (n, k * bits // 8), 0, 256, jnp.int32)
    scale = jax.random.uniform(k2, (n, k // group), jnp.float32, 0.005, 0.02)
    if kind == "tq":
        lut = jnp.asarray(lloyd_max(bits, group).centroids * math.sqrt(group), jnp.float32)
    elif kind == "sym":
        lut = jnp.arange(-(1 << (bits - 1)), 1 << (bits - 1), dtype=jnp.float32)
    else:
        lut = jnp.arange(1 << bits, dtype=jnp.float32)
    offset = None
    if kind == "affine":
        offset = jax.random.normal(k3, (n, k // group)).astype(jnp.float16) * 0.05
    return QuantizedLinear(packed=packed.astype(jnp.uint8), scale=scale.astype(jnp.float16),
                           lut=lut, offset=offset, bits=bits, group=group, in_features=k,
                           kind=kind)


def dequant_case(name: str, k: int, n: int, bits: int, group: int, kind: str,
                 rows: int, copy_bps: float) -> dict:
    import jax
    import jax.numpy as jnp

    from tqjax.pallas import dequant_matmul as dm
    from tqjax.quant.weights import dequantize_weight

    key = jax.random.PRNGKey(0)
    w = random_quantized(key, k, n, bits, group, kind)
    x = jax.random.normal(key, (rows, k), jnp.float32)
    got = dm.dequant_matmul(x, w)
    want = jnp.dot(x, dequantize_weight(w), precision=jax.lax.Precision.HIGHEST)
    err = float(jnp.max(jnp.abs(got - want)) / jnp.max(jnp.abs(want)))
    xb = x.astype(jnp.bfloat16)

    wbytes = dm.weight_bytes(w)
    layers = max(2, min(8192, L2_DEFEAT_BYTES // wbytes))
    dense_layers = max(2, L2_DEFEAT_BYTES // (2 * k * n))
    matrix = lambda a: a.ndim == 2  # noqa: E731 - codes, scales, offsets (not the LUT)
    kernel, stack = layer_scan(dm.dequant_matmul, w, layers, matrix)
    xla, _ = layer_scan(lambda x, wl: jnp.dot(x, dequantize_weight(wl).astype(x.dtype)), w, 1,
                        matrix)
    bf16, dense = layer_scan(jnp.dot, jnp.zeros((k, n), jnp.bfloat16), dense_layers, matrix)
    t_kernel = timed(lambda: kernel(xb, stack)) / layers
    t_xla = timed(lambda: xla(xb, stack)) / layers
    t_bf16 = timed(lambda: bf16(xb, dense)) / dense_layers
    moved = wbytes + rows * (k + n) * 2
    return {
        "shape": [rows, k, n], "format": f"{kind}{bits}g{group}", "weight": name,
        "tiling": str(dm.choose_tiling(rows, k, n, group)),
        "max_rel_err_f32": err,
        "kernel_us": 1e6 * t_kernel, "xla_dequant_us": 1e6 * t_xla, "bf16_dense_us": 1e6 * t_bf16,
        "weight_bytes": wbytes, "bytes_per_s": moved / t_kernel,
        "fraction_of_copy": moved / t_kernel / copy_bps,
        "speedup_vs_bf16": t_bf16 / t_kernel,
    }


def dequant_cases(copy_bps: float) -> list[dict]:
    shapes = {"q/o proj": (HIDDEN, HIDDEN), "k/v proj": (HIDDEN, KV_HEADS * HEAD_DIM),
              "gate/up": (HIDDEN, FFN), "down": (FFN, HIDDEN), "lm_head": (HIDDEN, VOCAB)}
    cases = [(name, k, n, 4, 64, "tq", rows) for name, (k, n) in shapes.items()
             for rows in (1, 512)]
    cases += [("gate/up", HIDDEN, FFN, 4, 64, "tq", 8)]
    cases += [("gate/up", HIDDEN, FFN, bits, group, kind, 1)
              for bits, group, kind in ((3, 64, "tq"), (2, 64, "tq"), (8, HIDDEN, "sym"),
                                        (4, 32, "affine"))]
    out = []
    for case in cases:
        try:
            out.append(dequant_case(*case, copy_bps))
        except Exception as e:  # noqa: BLE001
            out.append({"case": list(case), "error": f"{type(e).__name__}: {e}"})
    return out


# ---------------------------------------------------------------- decode attention


def filled_layer(k_type: str, v_type: str, batch: int, slots: int) -> object:
    import jax
    import jax.numpy as jnp
    import numpy as np

    from tqjax.kv import cache as kvc
    from tqjax.kv import store as kvs
    from tqjax.models.config import rope_inv_freq

    shape = kvc.StoreShape(batch, KV_HEADS, slots, HEAD_DIM, layer=3)
    kshape = shape
    if k_type.startswith("turbo"):
        rng = np.random.default_rng(0)
        kshape = kvc.StoreShape(batch, KV_HEADS, slots, HEAD_DIM, 3,
                                center=rng.normal(size=(KV_HEADS, HEAD_DIM)).astype(np.float32),
                                inv_freq=rope_inv_freq(qwen_config()))
    key = jax.random.PRNGKey(1)
    data = jax.random.normal(key, (batch, KV_HEADS, slots, HEAD_DIM), jnp.float32)
    zero = jnp.zeros(batch, jnp.int32)
    return kvc.LayerCache(kvs.write(kvc.STORE_FACTORIES[k_type](kshape), data, zero),
                          kvs.write(kvc.STORE_FACTORIES[v_type](shape), data * 0.5, zero))


def xla_attention(layer: object, q: object, positions: object) -> object:
    """The XLA path of `tqjax.kv.cache.attend` for one token: q [B, H, hd] -> f32 [B, H, hd]."""
    import jax
    import jax.numpy as jnp

    from tqjax.kv import store as kvs

    b = q.shape[0]
    s = kvs.scores(layer.k, q.reshape(b, KV_HEADS, HEADS // KV_HEADS, HEAD_DIM)) / HEAD_DIM**0.5
    visible = jnp.arange(s.shape[-1])[None, :] <= positions[:, None]
    p = jax.nn.softmax(jnp.where(visible[:, None, None], s, -jnp.inf), axis=-1)
    return kvs.mix(layer.v, p).reshape(b, HEADS, HEAD_DIM)


def attention_case(k_type: str, v_type: str, context: int) -> dict:
    import jax
    import jax.numpy as jnp

    from tqjax.pallas.turbo_attention import turbo_decode_attention

    key = jax.random.PRNGKey(2)
    slots = context + 64
    layer = filled_layer(k_type, v_type, 2, slots)
    q = jax.random.normal(key, (2, HEADS, HEAD_DIM), jnp.float32)
    pos = jnp.asarray([context - 1, context // 3], jnp.int32)
    with jax.default_matmul_precision("highest"):
        want = jax.jit(xla_attention)(layer, q, pos)
    got = jax.jit(turbo_decode_attention)(q, layer.k, layer.v, pos)
    err = float(jnp.max(jnp.abs(got - want)) / jnp.max(jnp.abs(want)))

    cache = lambda a: a.ndim >= 3  # noqa: E731 - [B, KV, S, ...] arrays
    one = jax.tree_util.tree_map(lambda a: a[:1] if cache(a) else a, layer)
    q1 = q[:1].astype(jnp.bfloat16)
    pos1 = jnp.asarray([context], jnp.int32)
    xla, layers = layer_scan(lambda q, lay: xla_attention(lay, q, pos1), one, LAYERS, cache)
    kern, _ = layer_scan(lambda q, lay: turbo_decode_attention(q, lay.k, lay.v, pos1), one, 1,
                         cache)
    t_xla = timed(lambda: xla(q1, layers)) / LAYERS
    t_pallas = timed(lambda: kern(q1, layers)) / LAYERS
    kv_bytes = sum(a.nbytes for a in jax.tree_util.tree_leaves(one) if a.ndim >= 3)
    return {"k": k_type, "v": v_type, "context": context, "max_rel_err": err,
            "xla_us_per_layer": 1e6 * t_xla, "pallas_us_per_layer": 1e6 * t_pallas,
            "cache_bytes_per_layer": kv_bytes * context // slots,
            "pallas_bytes_per_s": kv_bytes * context / slots / t_pallas}


def attention_cases() -> dict:
    rows = []
    for context in (4096, 32768):
        for k_type, v_type in (("bf16", "bf16"), ("turbo4", "turbo3")):
            try:
                rows.append(attention_case(k_type, v_type, context))
            except Exception as e:  # noqa: BLE001
                rows.append({"k": k_type, "v": v_type, "context": context,
                             "error": f"{type(e).__name__}: {e}"})
    summary = {}
    for context in (4096, 32768):
        by = {r["k"]: r for r in rows if r.get("context") == context and "error" not in r}
        if "bf16" in by and "turbo4" in by:
            dense = min(by["bf16"]["xla_us_per_layer"], by["bf16"]["pallas_us_per_layer"])
            summary[f"turbo_speedup_vs_best_dense_at_{context}"] = (
                dense / by["turbo4"]["pallas_us_per_layer"])
    return {"cases": rows, "summary": summary}


# ---------------------------------------------------------------- whole-model decode


def qwen_config() -> object:
    from tqjax.models.config import ModelConfig

    return ModelConfig(arch="qwen2", vocab_size=VOCAB, hidden_size=HIDDEN,
                       intermediate_size=FFN, num_layers=LAYERS, num_heads=HEADS,
                       num_kv_heads=KV_HEADS, head_dim=HEAD_DIM, rms_eps=1e-6,
                       rope_theta=1e6, max_position=32768, tie_embeddings=True)


def random_params(config: object) -> object:
    import jax
    import jax.numpy as jnp

    from tqjax.models.config import rope_inv_freq
    from tqjax.models.transformer import LayerParams, Params

    keys = iter(jax.random.split(jax.random.PRNGKey(3), 16 * config.num_layers + 4))
    d, f = config.hidden_size, config.intermediate_size
    q, kv = config.num_heads * config.head_dim, config.num_kv_heads * config.head_dim
    mat = lambda *s: (jax.random.normal(next(keys), s) * 0.02).astype(jnp.bfloat16)  # noqa: E731
    ones = lambda n: jnp.ones((n,), jnp.bfloat16)  # noqa: E731
    layers = [LayerParams(attn_norm=ones(d), wq=mat(d, q), wk=mat(d, kv), wv=mat(d, kv),
                          wo=mat(q, d), mlp_norm=ones(d), w_gate=mat(d, f), w_up=mat(d, f),
                          w_down=mat(f, d), bq=mat(q), bk=mat(kv), bv=mat(kv))
              for _ in range(config.num_layers)]
    return Params(embed=mat(config.vocab_size, d), layers=layers, final_norm=ones(d),
                  lm_head=None, rope_inv_freq=jnp.asarray(rope_inv_freq(config)))


def load_model(path: str | None) -> tuple[object, object, str]:
    """(config, bf16 params, source): the real checkpoint if available locally, else random."""
    from tqjax import fetch

    cached = fetch.cache_dir() / "models" / f"{MODEL_NAME}.gguf"
    chosen = Path(path) if path else (cached if cached.is_file() else None)
    if chosen is not None:
        import tqjax

        model = tqjax.load(chosen, dtype="bfloat16")
        return model.config, model.params, str(chosen)
    config = qwen_config()
    return config, random_params(config), "random weights (Qwen2.5-Coder-0.5B architecture)"


def tq4_params(params: object) -> tuple[object, str]:
    """Decoder linears as tq4 g64: `quantize_linear` (round to nearest) when the weights module
    has it, else random codes in the same format (same speed)."""
    import jax

    from tqjax.quant import weights
    from tqjax.quant.rotation import make_rotation

    names = ("wq", "wk", "wv", "wo", "w_gate", "w_up", "w_down")
    if hasattr(weights, "quantize_linear") and hasattr(weights, "WeightFormat"):
        fmt = weights.WeightFormat("tq", 4, 64)
        make = lambda w: weights.quantize_linear(w, fmt)  # noqa: E731
        how = "quantize_linear tq4g64 (round to nearest)"
    else:
        rot = make_rotation(64, 0)
        make = lambda w: random_quantized(  # noqa: E731
            jax.random.PRNGKey(0), w.shape[0], w.shape[1], 4, 64, "tq").replace(rotation=rot)
        how = "random tq4g64 codes (no quantize_linear in tqjax.quant.weights)"
    layers = [lp.replace(**{n: make(getattr(lp, n)) for n in names}) for lp in params.layers]
    return params.replace(layers=layers), how


def decode_speed(config: object, params: object, cache_type: str, backend: str,
                 context: int, steps: int = 32) -> dict:
    import jax.numpy as jnp
    import numpy as np

    from tqjax.decode.calibrate import calibrate
    from tqjax.decode.generate import decode_step, new_cache
    from tqjax.decode.sampling import SamplingParams, row_keys, row_sampling
    from tqjax.kv import cache as kvc
    from tqjax.pallas.backend import use_backend

    spec, calibration = kvc.CacheSpec(k="bf16", v="bf16"), None
    if cache_type == "turbo":  # the default turbo cache, calibrated on random token ids
        spec = kvc.CacheSpec(k="turbo4", v="turbo3", sink_tokens=4)
        ids = np.random.default_rng(0).integers(0, config.vocab_size, 256).tolist()
        calibration = calibrate(params, config, ids)
    with use_backend(backend):
        cache = new_cache(params, config, spec, 1, context + 64, calibration)
        seen = jnp.zeros((1, config.vocab_size), bool)
        key, tok = row_keys(0, 1), jnp.asarray([1], jnp.int32)
        sampling = row_sampling([SamplingParams()])
        t0 = time.perf_counter()
        for i in range(2):  # compile + warm-up
            tok, cache, seen, key, _ = decode_step(params, config, cache, tok,
                                                   jnp.asarray([context + i]), key, sampling,
                                                   seen)
            tok.block_until_ready()
        compile_s = time.perf_counter() - t0
        t0 = time.perf_counter()
        for i in range(steps):
            tok, cache, seen, key, _ = decode_step(params, config, cache, tok,
                                                   jnp.asarray([context + 2 + i]), key,
                                                   sampling, seen)
            int(tok[0])  # the token goes to the host every step, as in generation
        dt = time.perf_counter() - t0
    return {"tok_s": steps / dt, "ms_per_token": 1000 * dt / steps,
            "compile_and_warmup_s": compile_s}


def decode_runs(report: Report, model_path: str | None, budget_s: float) -> None:
    config, params, source = load_model(model_path)
    q_params, how = tq4_params(params)
    runs = [("bf16", "bf16", "xla"), ("bf16", "turbo", "pallas"), ("tq4", "turbo", "pallas"),
            ("tq4", "bf16", "pallas"), ("bf16", "bf16", "pallas"), ("bf16", "turbo", "xla"),
            ("tq4", "bf16", "xla")]
    out = {"model": source, "tq4_weights": how, "runs": []}
    for context in (4096, 32768):
        for weights, cache, backend in runs:
            row = {"weights": weights, "cache": cache, "backend": backend, "context": context}
            if report.elapsed() > budget_s:
                row["skipped"] = "time budget spent"
            else:
                try:
                    row |= decode_speed(config, q_params if weights == "tq4" else params,
                                        cache, backend, context)
                except Exception as e:  # noqa: BLE001
                    row["error"] = f"{type(e).__name__}: {e}"
            out["runs"].append(row)
            report.set("decode", out)


def main() -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    default_out = Path(os.environ["OUT"]) / "gpu_check.json" if os.environ.get("OUT") else Path(
        "gpu_check.json")
    p.add_argument("--out", type=Path, default=default_out)
    p.add_argument("--model", default=None, help="checkpoint path (default: fetch cache, else "
                                                 "random weights of the same architecture)")
    p.add_argument("--budget-s", type=float, default=400.0,
                   help="start no new decode run after this many seconds")
    p.add_argument("--skip", nargs="*", default=[],
                   choices=["dequant_matmul", "attention", "decode"])
    args = p.parse_args()
    args.out.parent.mkdir(parents=True, exist_ok=True)
    report = Report(args.out)
    try:
        import jax

        backend = jax.default_backend()
        report.set("device", {"backend": backend, "devices": [str(d) for d in jax.devices()],
                              "jax": jax.__version__})
    except Exception as e:  # noqa: BLE001
        report.set("error", f"JAX failed to start: {type(e).__name__}: {e}")
        return 1
    if backend != "gpu":
        report.set("error", f"no GPU: JAX's default backend is {backend!r}; nothing was timed")
        return 1
    copy = section(report, "copy", copy_bandwidth)
    copy_bps = copy["bytes_per_s"] if copy else math.nan
    if "dequant_matmul" not in args.skip:
        section(report, "dequant_matmul", lambda: {"cases": dequant_cases(copy_bps)})
    if "attention" not in args.skip:
        section(report, "attention", attention_cases)
    if "decode" not in args.skip:
        try:
            decode_runs(report, args.model, args.budget_s)
        except Exception as e:  # noqa: BLE001
            report.set("decode", {"error": f"{type(e).__name__}: {e}",
                                  "traceback": traceback.format_exc()[-4000:]})
    report.set("done", True)
    print(f"wrote {args.out}", file=sys.stderr)
    return 0


if __name__ == "__main__":
    sys.exit(main())
