"""Measure tqjax against the committed HF reference data (golden/): max logit errors of the tiny
models (full-sequence and prefill + token-by-token decode paths) and of the real GGUF models,
greedy-continuation agreement and perplexity. Prints one JSON line.
"""

from __future__ import annotations

import json
from pathlib import Path

from tqjax.cli import ArgumentParser, print_json, run_main

GOLDEN = Path(__file__).resolve().parent.parent / "golden"


def tiny_errors(path: Path) -> dict[str, float]:
    import jax.numpy as jnp
    import numpy as np
    from safetensors.numpy import load_file

    import tqjax
    from tqjax.decode.generate import new_cache
    from tqjax.models.transformer import forward

    model = tqjax.load(path)
    ref = load_file(path / "reference.safetensors")
    ids, want = ref["input_ids"], ref["logits"]
    full = np.stack([tqjax.logits(model, row.tolist()) for row in ids])
    b, t = ids.shape
    cache = new_cache(model.params, model.config, tqjax.CacheSpec(), b, t)
    logits, cache = forward(model.params, model.config, jnp.asarray(ids[:, :1]),
                            jnp.zeros(b, jnp.int32), cache)
    steps = [np.asarray(logits)]
    for pos in range(1, t):
        logits, cache = forward(model.params, model.config, jnp.asarray(ids[:, pos:pos + 1]),
                                jnp.full(b, pos, jnp.int32), cache)
        steps.append(np.asarray(logits))
    return {"full": float(np.abs(full - want).max()),
            "decode": float(np.abs(np.concatenate(steps, 1) - want).max())}


def real_report(name: str) -> dict:
    import numpy as np
    from safetensors.numpy import load_file

    import tqjax
    from tqjax.decode.generate import generate_tokens
    from tqjax.decode.sampling import SamplingParams
    from tqjax.eval import perplexity

    ref = load_file(GOLDEN / "real" / f"{name}.safetensors")
    meta = json.loads((GOLDEN / "real" / f"{name}.json").read_text())
    model = tqjax.load(name)
    got = tqjax.logits(model, ref["prompt_ids"].tolist())
    err = max(np.abs(np.take_along_axis(got, ref["topk_ids"], 1) - ref["topk_logits"]).max(),
              np.abs(got[:, ref["sample_ids"]] - ref["sample_logits"]).max())
    steps = list(generate_tokens(model.params, model.config, [ref["greedy_prompt_ids"].tolist()],
                                 max_new_tokens=32, sampling=SamplingParams(), eos_ids=(),
                                 ctx_size=256))
    ids = steps[-1][0][0].ids
    spec = meta["perplexity"]
    ppl = perplexity(model, ref["ppl_ids"], spec["ctx"]).ppl
    return {"prompt_tokens": len(ref["prompt_ids"]), "max_abs_logit_err": float(err),
            "greedy_32_identical": ids == ref["greedy_ids"].tolist(),
            "greedy_text": model.tokenizer.decode(ids),
            "ppl": ppl, "hf_ppl": spec["ppl"], "ppl_rel_diff_pct": 100 * (ppl / spec["ppl"] - 1),
            "ppl_setup": f"{spec['corpus']}, {spec['tokens']} tokens, ctx {spec['ctx']}"}


def main() -> int:
    p = ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--skip-real", action="store_true")
    args = p.parse_args()
    out = {"tiny": {d.name: tiny_errors(d) for d in sorted((GOLDEN / "tiny").iterdir())
                    if d.is_dir()}}
    if not args.skip_real:
        out["real"] = {n: real_report(n) for n in ("smollm2-135m-instruct",
                                                   "qwen2.5-coder-0.5b-instruct")}
    print_json(out)
    return 0


if __name__ == "__main__":
    run_main(main)
