"""Whether a caller's compiled programs survive a second load: a model's generate is compiled
and timed warm, a second model is loaded (converted or quantized on the fly), and the first
model's generate is timed again (a recompile shows as seconds). One JSON line.

    python scripts/research/caller_programs.py -m smollm2-135m-instruct --second gguf
    python scripts/research/caller_programs.py --second tq4
"""

from __future__ import annotations

import argparse
import json
import time

import tqjax


def timed_generate(model: tqjax.Model, tokens: int) -> float:
    """Seconds for one greedy generate of `tokens` tokens from a fixed prompt."""
    start = time.perf_counter()
    tqjax.generate(model, "Hello", max_new_tokens=tokens)
    return time.perf_counter() - start


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("-m", "--model", default="smollm2-135m-instruct")
    ap.add_argument("--second", default="gguf", help="weights of the second load (gguf, tq4, ...)")
    ap.add_argument("--tokens", type=int, default=8)
    args = ap.parse_args()
    first = tqjax.load(args.model)
    cold = timed_generate(first, args.tokens)
    warm = timed_generate(first, args.tokens)
    start = time.perf_counter()
    tqjax.load(args.model, weights=args.second)
    load = time.perf_counter() - start
    after = timed_generate(first, args.tokens)
    print(json.dumps({"model": args.model, "second": args.second, "tokens": args.tokens,
                      "cold_s": round(cold, 2), "warm_s": round(warm, 2),
                      "second_load_s": round(load, 1), "after_second_load_s": round(after, 2)}))


if __name__ == "__main__":
    main()
