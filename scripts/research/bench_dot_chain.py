"""Time a dense model's decode-step weight dots alone, chained as the model chains them, against
the weight-read roofline (issue 22's short-context target): what XLA on CPU reaches when
nothing but the dots runs.

    python scripts/research/bench_dot_chain.py -m smollm2-135m-instruct
    python scripts/research/bench_dot_chain.py -m qwen2.5-coder-0.5b-instruct

Per layer, from x [1, D]: q, k, v = x·Wq, x·Wk, x·Wv; x += q·Wo (k, v folded into x by a
negligible sum, so they are computed); x += (silu(x·Wg) ∘ x·Wu)·Wd; then the head. No norms,
RoPE, attention or sampling. Also one square [D, D] f32 matvec repeated 100 times,
independently (each from the same x) and as a dependent chain (each from the last one's output),
which shows the per-dot latency a chain pays. One JSON line per form: median and fastest ms of
9 rounds, the GB/s of the weights read, and the fraction of this machine's copy bandwidth
(`tqjax.commands.bench.measure_copy_bandwidth`) they reach.
"""

from __future__ import annotations

import argparse
import json
import time
from collections.abc import Callable

import jax
import jax.numpy as jnp
import numpy as np

import tqjax
from tqjax.commands.bench import measure_copy_bandwidth
from tqjax.models.transformer import Params


def _rounds(f: Callable[[], jax.Array], rounds: int = 9) -> list[float]:
    """ms per call of f, one per round (after a warm-up call that compiles)."""
    jax.block_until_ready(f())
    out = []
    for _ in range(rounds):
        t0 = time.perf_counter()
        jax.block_until_ready(f())
        out.append((time.perf_counter() - t0) * 1e3)
    return out


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("-m", "--model", default="smollm2-135m-instruct")
    args = p.parse_args()

    model = tqjax.load(args.model)
    params = model.params
    d = params.final_norm.shape[0]

    @jax.jit
    def step(params: Params, x: jax.Array) -> jax.Array:
        for lp in params.layers:
            q, k, v = x @ lp.wq, x @ lp.wk, x @ lp.wv
            x = x + (q @ lp.wo) + 1e-9 * (jnp.sum(k) + jnp.sum(v))
            x = x + (jax.nn.silu(x @ lp.w_gate) * (x @ lp.w_up)) @ lp.w_down
        if params.lm_head is None:  # tied: the [V, D] embedding, as the model reads it
            return jnp.einsum("bd,vd->bv", x, params.embed)
        return x @ params.lm_head  # [D, V]

    rng = np.random.default_rng(0)
    square = [jnp.asarray(rng.normal(size=(d, d)) / d**0.5, jnp.float32) for _ in range(100)]

    @jax.jit
    def independent(ws: list[jax.Array], x: jax.Array) -> jax.Array:
        return sum(x @ w for w in ws)

    @jax.jit
    def dependent(ws: list[jax.Array], x: jax.Array) -> jax.Array:
        for w in ws:
            x = x @ w
        return x

    x = jnp.ones((1, d), jnp.float32)
    weight_bytes = sum(a.nbytes for a in jax.tree_util.tree_leaves(params.layers)) + (
        params.embed if params.lm_head is None else params.lm_head).nbytes
    square_bytes = sum(w.nbytes for w in square)
    gbps = measure_copy_bandwidth()["copy_gbps"]
    forms = {
        f"{args.model} decode-step dots alone": (lambda: step(params, x), weight_bytes),
        f"{len(square)} independent [{d}, {d}] matvecs": (lambda: independent(square, x),
                                                          square_bytes),
        f"{len(square)} dependent [{d}, {d}] matvecs": (lambda: dependent(square, x),
                                                        square_bytes),
    }
    for name, (f, nbytes) in forms.items():
        ms = sorted(_rounds(f))
        med = ms[len(ms) // 2]
        print(json.dumps({"form": name, "median_ms": round(med, 3), "min_ms": round(ms[0], 3),
                          "weight_bytes": int(nbytes), "gb_s": round(nbytes / med / 1e6, 2),
                          "copy_gbps": gbps,
                          "roofline_fraction": round(nbytes / med / 1e6 / gbps, 3),
                          "jax": jax.__version__}), flush=True)


if __name__ == "__main__":
    main()
