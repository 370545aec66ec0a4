"""Capture real key and value vectors from a model, for `scripts/research/distortion.py --vectors`.

Runs one window of a text through the model with a dense cache and saves a random sample of the
cached per-head vectors (all layers; the first 4 positions skipped) as safetensors files
PREFIX_k.safetensors / PREFIX_v.safetensors, each with one tensor `x` [N, head_dim].
Keys are saved as attention sees them (after RoPE, without centring).
"""

from __future__ import annotations

from pathlib import Path

from tqjax.atomic import write_safetensors
from tqjax.cli import ArgumentParser, add_model_arg, run_main


def main() -> int:
    p = ArgumentParser(description=__doc__.split("\n\n")[0])
    add_model_arg(p)  # (the unquantized model on one device: what the KV tables study)
    p.add_argument("--corpus", default="shakespeare:hamlet")
    p.add_argument("--tokens", type=int, default=1024)
    p.add_argument("--samples", type=int, default=10_000)
    p.add_argument("--out-prefix", type=Path, required=True)
    args = p.parse_args()

    import jax.numpy as jnp
    import numpy as np

    import tqjax
    from tqjax.decode.generate import full_logits, new_cache
    from tqjax.fetch import corpus_text

    model = tqjax.load(args.model, dtype=args.dtype)
    ids = model.tokenizer.encode(corpus_text(args.corpus), add_bos=False)[: args.tokens]
    cache = new_cache(model.params, model.config, tqjax.CacheSpec(), 1, len(ids))
    _, cache = full_logits(model.params, model.config, jnp.asarray([ids], jnp.int32),
                           jnp.zeros(1, jnp.int32), cache)
    rng = np.random.default_rng(0)
    args.out_prefix.parent.mkdir(parents=True, exist_ok=True)
    for which in ("k", "v"):
        vecs = np.concatenate([np.asarray(getattr(layer, which).data[0, :, 4:], np.float32)
                               .reshape(-1, model.config.head_dim) for layer in cache.layers])
        pick = rng.choice(len(vecs), size=min(args.samples, len(vecs)), replace=False)
        out = Path(f"{args.out_prefix}_{which}.safetensors")
        write_safetensors(out, {"x": vecs[pick]})
        print(f"{out}: {len(pick)} vectors of dim {vecs.shape[1]}")
    return 0


if __name__ == "__main__":
    run_main(main)
