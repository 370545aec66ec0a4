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


REAL_MODELS = ("smollm2-135m-instruct", "qwen2.5-coder-0.5b-instruct")


def check_golden(golden: Path, real: bool) -> None:
    """The reference files the report reads are all there (else a one-line TqjaxError)."""
    from tqjax.errors import TqjaxError

    if not (golden / "tiny").is_dir():
        raise TqjaxError(f"no golden reference data in {golden} (missing {golden / 'tiny'}; "
                         f"regenerate it with scripts/make_golden.py)")
    needed = [d / "reference.safetensors" for d in sorted((golden / "tiny").iterdir())
              if d.is_dir()]
    if real:
        needed += [golden / "real" / f"{n}{ext}" for n in REAL_MODELS
                   for ext in (".json", ".safetensors")]
    missing = [f for f in needed if not f.is_file()]
    if missing:
        raise TqjaxError(f"missing golden reference file {missing[0]} "
                         f"(regenerate it with scripts/make_golden.py)")


def real_report(name: str, golden: Path = GOLDEN) -> dict:
    import numpy as np
    from safetensors.numpy import load_file

    import tqjax
    from tqjax.decode.generate import generate_tokens
    from tqjax.decode.sampling import SamplingParams
    from tqjax.eval import perplexity

    ref = load_file(golden / "real" / f"{name}.safetensors")
    meta = json.loads((golden / "real" / f"{name}.json").read_text())
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
    p = ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--skip-real", action="store_true")
    p.add_argument("--golden", type=Path, default=GOLDEN,
                   help="reference data folder (default: the repository's golden/)")
    args = p.parse_args()
    check_golden(args.golden, not args.skip_real)
    out = {"tiny": {d.name: tiny_errors(d) for d in sorted((args.golden / "tiny").iterdir())
                    if d.is_dir()}}
    if not args.skip_real:
        out["real"] = {n: real_report(n, args.golden) for n in REAL_MODELS}
    print_json(out)
    return 0


if __name__ == "__main__":
    run_main(main)
