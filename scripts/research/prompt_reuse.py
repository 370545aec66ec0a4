"""Time to first token with and without prefix reuse (`tqjax.Session`), one process: a long
system prompt (~1k tokens of built-in calibration text) + two different questions, greedy.

Prints one JSON line: full-prefill and reused time to first token (call to the first streamed
text piece) and prefill time (seconds, medians of rounds after a warm-up round that compiles
every shape), their ratios, the prefilled token counts and whether the reused generation's
tokens equal a fresh `tqjax.generate`'s.

    python scripts/research/prompt_reuse.py -m smollm2-135m-instruct --system-tokens 1000
"""

from __future__ import annotations

import argparse
import json
import statistics
import time


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("-m", "--model", default="smollm2-135m-instruct")
    p.add_argument("--system-tokens", type=int, default=1000)
    p.add_argument("--kv", default="f32", metavar="K[/V]", help="cache types (keys[/values])")
    p.add_argument("-n", "--max-new-tokens", type=int, default=16)
    p.add_argument("--rounds", type=int, default=3)
    args = p.parse_args()

    import tqjax
    from tqjax.api import Session
    from tqjax.data import calibration_text
    from tqjax.kv.cache import parse_kv

    model = tqjax.load(args.model)
    spec = tqjax.CacheSpec(*parse_kv(args.kv))
    text = " ".join([calibration_text()] * 20)
    ids = model.tokenizer.encode(text, add_bos=False)[: args.system_tokens]
    system = model.tokenizer.decode(ids)
    questions = ["What is the main subject of the text above?",
                 "Summarize the text above in one sentence."]

    def prompt(q: str) -> list[int]:
        return tqjax.api.encode_prompt(model, q, chat=True, system=system)

    def ttft(session: Session, q: str) -> tuple[float, object]:
        ids = prompt(q)
        first = []
        t0 = time.perf_counter()
        out = session.generate(ids, max_new_tokens=args.max_new_tokens,
                               on_text=lambda _: first.append(time.perf_counter() - t0))
        return first[0], out

    full, reused, outs = [], [], None
    for r in range(args.rounds + 1):  # round 0 compiles
        session = Session(model, cache=spec)
        t_full, a = ttft(session, questions[0])
        t_reuse, b = ttft(session, questions[1])
        if r:
            full.append((t_full, a.prefill_s))
            reused.append((t_reuse, b.prefill_s))
        outs = (a, b)
    def med(runs: list[tuple[float, float]], i: int) -> float:
        return round(statistics.median(r[i] for r in runs), 4)

    fresh = tqjax.generate(model, prompt(questions[1]), max_new_tokens=args.max_new_tokens,
                           cache=spec)
    a, b = outs
    print(json.dumps({
        "model": args.model, "kv": args.kv, "prompt_tokens": [a.prompt_tokens, b.prompt_tokens],
        "prefilled_tokens": [a.prompt_tokens - a.cached_tokens, b.prompt_tokens - b.cached_tokens],
        "ttft_full_s": med(full, 0), "ttft_reused_s": med(reused, 0),
        "ratio": round(med(full, 0) / med(reused, 0), 2),
        "prefill_full_s": med(full, 1), "prefill_reused_s": med(reused, 1),
        "prefill_ratio": round(med(full, 1) / med(reused, 1), 2),
        "rounds": args.rounds, "same_tokens_as_fresh": b.token_ids == fresh.token_ids,
        "note": "ttft: call to the first streamed text piece; prefill: prefill_s (prefill + "
                "first sample); median of rounds on a shared, loaded CPU"}))


if __name__ == "__main__":
    main()
