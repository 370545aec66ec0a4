"""Split one layer's f32 decode attention on the XLA CPU path into its operations, each timed
alone on a static, contiguous cache, beside the product's `attend` (the blockwise loop, donated
cache) on the same shapes: where the long-context decode time goes (issue 22).

    python scripts/research/bench_attention_ops.py --kv-heads 3 --group 3 --slots 8192
    python scripts/research/bench_attention_ops.py --kv-heads 2 --group 7 --slots 16384

One JSON line per operation: median and fastest ms over 7 rounds of 20 calls, and the GB/s of
reading one K (or V) array [1, KV, S, 64] f32 in that time.
"""

from __future__ import annotations

import argparse
import json
import time
from collections.abc import Callable


def _rounds(f: Callable[[], object], rounds: int = 7, calls: int = 20) -> list[float]:
    import jax

    jax.block_until_ready(f())
    out = []
    for _ in range(rounds):
        t0 = time.perf_counter()
        for _ in range(calls):
            r = f()
        jax.block_until_ready(r)
        out.append((time.perf_counter() - t0) / calls * 1e3)
    return out


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--kv-heads", type=int, default=3)
    p.add_argument("--group", type=int, default=3, help="query heads per KV head")
    p.add_argument("--slots", type=int, default=8192)
    p.add_argument("--head-dim", type=int, default=64)
    args = p.parse_args()

    import jax
    import jax.numpy as jnp
    import numpy as np

    from tqjax.kv.cache import CacheSpec, attend, make_cache

    kv, g, s, hd = args.kv_heads, args.group, args.slots, args.head_dim
    rng = np.random.default_rng(0)
    k = jnp.asarray(rng.normal(size=(1, kv, s, hd)), jnp.float32)
    v = k * 0.5
    kt = jnp.swapaxes(k, 2, 3)  # [1, KV, hd, S]: keys stored transposed
    q = jnp.asarray(rng.normal(size=(1, kv, g, hd)), jnp.float32)
    p_ns = jnp.asarray(rng.random(size=(1, kv, g, s)), jnp.float32)  # probabilities [N, S]
    p_sn = jnp.swapaxes(p_ns, 2, 3)

    def softmax_ns(x: jax.Array) -> jax.Array:
        e = jnp.exp(x - jnp.max(x, -1, keepdims=True))
        return e / jnp.sum(e, -1, keepdims=True)

    ops: dict[str, tuple[Callable[..., jax.Array], tuple[jax.Array, ...]]] = {
        "whole attention, one pass (q·kᵀ, softmax, p·v)": (
            lambda q, k, v: jnp.einsum("bkns,bksd->bknd",
                                       softmax_ns(jnp.einsum("bknd,bksd->bkns", q, k) / hd**0.5),
                                       v), (q, k, v)),
        "scores q·kᵀ -> [N, S]": (lambda q, k: jnp.einsum("bknd,bksd->bkns", q, k), (q, k)),
        "scores k·q -> [S, N]": (lambda q, k: jnp.einsum("bksd,bknd->bksn", k, q), (q, k)),
        "scores, keys stored [hd, S]": (lambda q, kt: jnp.einsum("bknd,bkds->bkns", q, kt),
                                        (q, kt)),
        "scores as multiply-reduce": (lambda q, k: jnp.sum(q[:, :, :, None] * k[:, :, None], -1),
                                      (q, k)),
        "mix p·v, p [N, S]": (lambda p, v: jnp.einsum("bkns,bksd->bknd", p, v), (p_ns, v)),
        "mix p·v, p [S, N]": (lambda p, v: jnp.einsum("bksn,bksd->bknd", p, v), (p_sn, v)),
        "mix as multiply-reduce": (lambda p, v: jnp.sum(p[..., None] * v[:, :, None], -2),
                                   (p_ns, v)),
        "softmax over [N, S]": (softmax_ns, (p_ns,)),
        "max over [N, S] (last axis)": (lambda p: jnp.max(p, -1), (p_ns,)),
        "max over [S, N] (slot axis)": (lambda p: jnp.max(p, -2), (p_sn,)),
        "copy of k (one read, one write)": (lambda k: k + 1.0, (k,)),
    }
    mb = k.nbytes / 1e6
    rows = []
    for name, (f, xs) in ops.items():
        jf = jax.jit(f)
        rows.append((name, _rounds(lambda jf=jf, xs=xs: jf(*xs))))

    # the product: attend over a donated f32 layer of `slots` slots, 192 short of full
    live = s - 192
    layer = make_cache(CacheSpec("f32", "f32"), batch=1, slots=s, num_layers=1, kv_heads=kv,
                       head_dim=hd).layers[0]
    x = jnp.asarray(rng.normal(size=(1, live, kv, hd)), jnp.float32)
    _, layer = jax.jit(attend)(layer, jnp.repeat(x, g, axis=2), x, x, jnp.zeros(1, jnp.int32))
    step = jax.jit(lambda lc, q, k, v, p: attend(lc, q, k, v, p), donate_argnums=0)
    one, qq, pos = x[:, -1:], jnp.repeat(x[:, -1:], g, axis=2), jnp.asarray([live], jnp.int32)
    state = {"layer": layer}

    def product() -> jax.Array:
        out, state["layer"] = step(state["layer"], qq, one, one, pos)
        return out

    rows.append((f"product attend (blockwise, {live} live slots, donated)", _rounds(product)))
    for name, ms in rows:
        med = sorted(ms)[len(ms) // 2]
        print(json.dumps({"op": name, "kv_heads": kv, "group": g, "slots": s, "head_dim": hd,
                          "median_ms": round(med, 4), "min_ms": round(min(ms), 4),
                          "gb_s_one_array": round(mb / med, 2), "jax": jax.__version__}))


if __name__ == "__main__":
    main()
