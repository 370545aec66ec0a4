"""Time the XLA attention over one layer's cache for several cache specs (the per-block decode
cost behind issue 22's turbo-vs-f32 ratio), and the code→centroid lookup forms.

    python scripts/research/bench_turbo_block.py --slots 8192
"""

from __future__ import annotations

import argparse
import json
import time


def _time(f: object, *args: object, n: int = 20) -> float:
    import jax

    jax.block_until_ready(f(*args))
    t0 = time.perf_counter()
    for _ in range(n):
        out = f(*args)
    jax.block_until_ready(out)
    return (time.perf_counter() - t0) / n


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("-m", "--model", default="smollm2-135m-instruct")
    p.add_argument("--slots", type=int, default=8192)
    p.add_argument("--layer", type=int, default=5)
    args = p.parse_args()

    import jax
    import jax.numpy as jnp

    import tqjax
    import tqjax.kv.store as kvs
    from tqjax.decode.generate import new_cache
    from tqjax.kv.cache import NAIVE, CacheSpec, blockwise_attention
    from tqjax.quant.packing import unpack_bits
    from tqjax.quant.turboquant import make_quantizer, quantize

    model = tqjax.load(args.model)
    cfg = model.config
    g, kvh, hd, s = cfg.num_heads // cfg.num_kv_heads, cfg.num_kv_heads, cfg.head_dim, args.slots
    specs = {"f32": CacheSpec("f32", "f32"), "turbo4": CacheSpec("turbo4", "turbo4"),
             "turbo4-naive": CacheSpec("turbo4", "turbo4", **NAIVE),
             "turbo4-no-sinks": CacheSpec("turbo4", "turbo4", sink_tokens=0),
             "turbo4-no-key-centre": CacheSpec("turbo4", "turbo4", center_keys=False)}
    q = jax.random.normal(jax.random.PRNGKey(1), (1, kvh, g, hd))
    x = jax.random.normal(jax.random.PRNGKey(2), (1, kvh, s, hd))
    bound = jnp.full((1, g), s - 1, jnp.int32)
    attend = jax.jit(lambda k, v, q, b: blockwise_attention(k, v, q, b, b, None))
    for name, spec in specs.items():
        layer = new_cache(model.params, cfg, spec, 1, s, model.calibration(spec)).layers[args.layer]
        zero = jnp.zeros(1, jnp.int32)
        k, v = kvs.write(layer.k, x, zero), kvs.write(layer.v, x, zero)
        ms = 1000 * _time(attend, k, v, q, bound)
        print(json.dumps({"what": "layer attention", "spec": name, "slots": s,
                          "ms": round(ms, 3)}), flush=True)

    # the centred keys' ⟨q, R_p μ⟩ over all blocks: factored table vs rotated centres
    from tqjax.kv.quantized import _centre_at, _centre_scores

    store = new_cache(model.params, cfg, specs["turbo4"], 1, s,
                      model.calibration(specs["turbo4"])).layers[args.layer].k
    size = min(512, s)
    centre_forms = {
        "factored": lambda st, q, lo: _centre_scores(st, q, lo, size),
        "rotated centres": lambda st, q, lo: jnp.einsum(
            "bknd,skd->bkns", q, _centre_at(st, lo + jnp.arange(size)))}
    for name, f in centre_forms.items():
        def over_blocks(st: object, q: jax.Array, f: object = f) -> jax.Array:
            body = lambda i, acc: acc + jnp.sum(f(st, q, i * size))  # noqa: E731
            return jax.lax.fori_loop(0, s // size, body, 0.0)
        ms = 1000 * _time(jax.jit(over_blocks), store, q)
        print(json.dumps({"what": "centre scores, all blocks", "form": name, "slots": s,
                          "ms": round(ms, 3)}), flush=True)

    quant = make_quantizer(hd, 4, seed=0)
    codes, _ = quantize(quant, x)
    packed = jnp.asarray(codes[..., ::2] | (codes[..., 1::2] << 4))
    table = quant.centroids
    forms = {"take fill": lambda p: jnp.take(table, unpack_bits(p, 4, hd), axis=0),
             "take clip": lambda p: jnp.take(table, unpack_bits(p, 4, hd), axis=0, mode="clip")}
    for name, f in forms.items():
        ms = 1000 * _time(jax.jit(lambda p, f=f: jnp.sum(f(p), -1)), packed)
        print(json.dumps({"what": "unpack+lookup", "form": name, "slots": s,
                          "ms": round(ms, 3)}), flush=True)


if __name__ == "__main__":
    main()
