"""Time one half-precision vector-matrix product in its forms on this machine (issue 22, stop 46).

    python scripts/research/bench_half_linear.py [--dtype bfloat16] [--shapes 576x1536 4864x896]

Forms, for x f32 [1, K] and a weight [K, N]: the f32 weight's dot; the half weight stored
[K, N] and converted in the dot (`x @ w.astype(f32)`: XLA:CPU writes the f32 weight first,
what a dense bf16 model ran before stop 46); and the product's `quant.half.matmul` on the
weight stored output-major [N, K] (the conversion fused into the dot). One JSON line per
shape: the fastest of 5 rounds of back-to-back calls, in microseconds a call.
"""

from __future__ import annotations

import argparse
import json
import time
from collections.abc import Callable

import jax
import jax.numpy as jnp
import numpy as np

from tqjax.dtypes import resolve_dtype
from tqjax.quant import half


def per_call_us(f: Callable[..., jax.Array], *args: jax.Array, calls: int = 40) -> float:
    f(*args).block_until_ready()
    best = float("inf")
    for _ in range(5):
        t0 = time.perf_counter()
        for _ in range(calls):
            y = f(*args)
        y.block_until_ready()
        best = min(best, (time.perf_counter() - t0) / calls)
    return best * 1e6


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--dtype", default="bfloat16", choices=["bfloat16", "float16"])
    p.add_argument("--shapes", nargs="+", default=["576x1536", "1536x576", "896x4864",
                                                    "4864x896", "576x49152"])
    a = p.parse_args()
    dt = resolve_dtype(a.dtype)
    rng = np.random.default_rng(0)
    for shape in a.shapes:
        k, n = (int(s) for s in shape.split("x"))
        w = rng.standard_normal((k, n), dtype=np.float32) / k**0.5
        x = jnp.asarray(rng.standard_normal((1, k), dtype=np.float32))
        w32, w_kn = jnp.asarray(w), jnp.asarray(w).astype(dt)
        w_nk = jnp.asarray(np.ascontiguousarray(np.asarray(w_kn).T))
        forms = {"f32_us": (jax.jit(lambda x, w: x @ w), w32),
                 "half_converted_first_us": (jax.jit(lambda x, w: x @ w.astype(jnp.float32)),
                                             w_kn),
                 "half_output_major_us": (jax.jit(half.matmul), w_nk)}
        row = {"k": k, "n": n, "dtype": a.dtype}
        row |= {name: round(per_call_us(f, x, w), 1) for name, (f, w) in forms.items()}
        print(json.dumps(row), flush=True)


if __name__ == "__main__":
    main()
