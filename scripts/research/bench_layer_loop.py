"""Can one compiled layer body serve every layer without slowing decode on XLA:CPU?

    python scripts/research/bench_layer_loop.py [--layers 30] [--dim 576] [--ffn 1536]
        [--slots 2048] [--block 512] [--repeats 40]

A synthetic decode step shaped like SmolLM2's: per layer, one cache-slot write, a blockwise
online-softmax attention over a [slots, dim] cache, and a gated MLP. Three forms:

- unrolled: a Python loop over per-layer weight and cache arrays (what `forward` does now);
  the HLO holds one attention body per layer.
- loop + stacked cache: `fori_loop` over layers, the weights picked by `lax.switch` (each
  branch reads its own arrays in place), the cache one [L, slots, dim] array updated in the
  loop carry; the HLO holds one attention body.
- loop + per-layer caches: the same loop, the caches a tuple picked and written by
  `lax.switch`; XLA copies the tuple through the conditional.

Prints one JSON line per form: median and min ms per step, optimized-HLO instructions, and the
largest difference from the unrolled outputs (must be 0).
"""

from __future__ import annotations

import argparse
import json
import time
from collections.abc import Callable

import jax
import jax.numpy as jnp
import numpy as np


def block_attention(x: jax.Array, read: Callable[[jax.Array], jax.Array], slots: int,
                    block: int) -> jax.Array:
    """Online-softmax attention of x [1, D] over `slots` rows fetched `block` at a time by
    `read(lo)` -> [block, D]."""

    def body(j: jax.Array, carry: tuple[jax.Array, ...]) -> tuple[jax.Array, ...]:
        m, lsum, acc = carry
        blk = read(j * block)
        s = (x @ blk.T)[0]
        m_new = jnp.maximum(m, s.max())
        p, corr = jnp.exp(s - m_new), jnp.exp(m - m_new)
        return m_new, lsum * corr + p.sum(), acc * corr + p @ blk

    init = (jnp.float32(-1e30), jnp.float32(0), jnp.zeros((x.shape[1],), jnp.float32))
    _, lsum, acc = jax.lax.fori_loop(0, slots // block, body, init)
    return (acc / lsum)[None]


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--layers", type=int, default=30)
    p.add_argument("--dim", type=int, default=576)
    p.add_argument("--ffn", type=int, default=1536)
    p.add_argument("--slots", type=int, default=2048)
    p.add_argument("--block", type=int, default=512)
    p.add_argument("--repeats", type=int, default=40)
    a = p.parse_args()
    n_layers, slots, block = a.layers, a.slots, a.block
    rng = np.random.default_rng(0)

    def normal(*shape: int, scale: float) -> jax.Array:
        return jnp.asarray(rng.standard_normal(shape, np.float32) * scale)

    up = [normal(a.dim, a.ffn, scale=0.02) for _ in range(n_layers)]
    down = [normal(a.ffn, a.dim, scale=0.02) for _ in range(n_layers)]
    caches = [normal(slots, a.dim, scale=0.1) for _ in range(n_layers)]

    def mlp(i: int) -> Callable[[jax.Array], jax.Array]:
        return lambda x: jax.nn.silu(x @ up[i]) @ down[i]

    def unrolled(x: jax.Array, cs: tuple[jax.Array, ...], pos: jax.Array):
        cs = list(cs)
        for i in range(n_layers):
            cs[i] = jax.lax.dynamic_update_slice(cs[i], x * 0.5, (pos, 0))
            x = x + block_attention(
                x, lambda lo, c=cs[i]: jax.lax.dynamic_slice_in_dim(c, lo, block), slots, block)
            x = x + mlp(i)(x)
        return x, tuple(cs)

    def stacked(x: jax.Array, cache: jax.Array, pos: jax.Array):
        mlps = [mlp(i) for i in range(n_layers)]

        def layer(i: jax.Array, carry: tuple[jax.Array, jax.Array]):
            x, cache = carry
            cache = jax.lax.dynamic_update_slice(cache, (x * 0.5)[None], (i, pos, 0))
            x = x + block_attention(
                x, lambda lo: jax.lax.dynamic_slice(cache, (i, lo, 0), (1, block, a.dim))[0],
                slots, block)
            return x + jax.lax.switch(i, mlps, x), cache

        return jax.lax.fori_loop(0, n_layers, layer, (x, cache))

    def switched(x: jax.Array, cs: tuple[jax.Array, ...], pos: jax.Array):
        mlps = [mlp(i) for i in range(n_layers)]

        def writer(j: int) -> Callable[..., tuple[jax.Array, ...]]:
            return lambda cs, new: (*cs[:j], jax.lax.dynamic_update_slice(cs[j], new, (pos, 0)),
                                    *cs[j + 1:])

        def reader(j: int) -> Callable[..., jax.Array]:
            return lambda cs, lo: jax.lax.dynamic_slice_in_dim(cs[j], lo, block)

        writers = [writer(j) for j in range(n_layers)]
        readers = [reader(j) for j in range(n_layers)]

        def layer(i: jax.Array, carry: tuple[jax.Array, tuple[jax.Array, ...]]):
            x, cs = carry
            cs = jax.lax.switch(i, writers, cs, x * 0.5)
            x = x + block_attention(x, lambda lo: jax.lax.switch(i, readers, cs, lo), slots,
                                    block)
            return x + jax.lax.switch(i, mlps, x), cs

        return jax.lax.fori_loop(0, n_layers, layer, (x, cs))

    x = jnp.ones((1, a.dim), jnp.float32)
    forms = {"unrolled": (unrolled, lambda: tuple(c + 0 for c in caches)),
             "loop + stacked cache": (stacked, lambda: jnp.stack(caches)),
             "loop + per-layer caches": (switched, lambda: tuple(c + 0 for c in caches))}
    reference = None
    for name, (fn, fresh) in forms.items():
        step = jax.jit(fn, donate_argnums=1)
        cache = fresh()
        instructions = step.lower(x, cache, 7).compile().as_text().count(" = ")
        out, cache = step(x, cache, jnp.int32(7))
        reference = out if reference is None else reference
        diff = float(jnp.abs(out - reference).max())
        times = []
        for k in range(a.repeats):
            t0 = time.perf_counter()
            out, cache = step(x, cache, jnp.int32(8 + k))
            out.block_until_ready()
            times.append(time.perf_counter() - t0)
        print(json.dumps({"form": name, "ms_median": round(1e3 * float(np.median(times)), 2),
                          "ms_min": round(1e3 * min(times), 2), "hlo_instructions": instructions,
                          "max_abs_diff_vs_unrolled": diff}), flush=True)


if __name__ == "__main__":
    main()
