"""Time `decode_step` at position P in a cache of S slots, several configurations interleaved in
one process (median of rounds); prints one JSON line per configuration.

    python scripts/research/bench_decode.py f32:1024:512 f32:16384:512 turbo4:8256:8192
"""

from __future__ import annotations

import argparse
import json
import statistics
import time


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("runs", nargs="+", help="CACHE:SLOTS:POSITION, e.g. turbo4:16384:512")
    p.add_argument("-m", "--model", default="smollm2-135m-instruct")
    p.add_argument("--steps", type=int, default=6, help="decode steps per round")
    p.add_argument("--rounds", type=int, default=2, help="timed rounds (after one warm-up)")
    args = p.parse_args()

    import jax.numpy as jnp

    import tqjax
    from tqjax.decode.generate import decode_step, new_cache
    from tqjax.decode.sampling import SamplingParams, row_keys, row_sampling
    from tqjax.kv.cache import CacheSpec, parse_kv

    model = tqjax.load(args.model)
    cfg, sampling = model.config, row_sampling([SamplingParams()])
    runs = {}
    for run in args.runs:
        kind, slots, pos = run.split(":")
        spec = CacheSpec(*parse_kv(kind))
        cache = new_cache(model.params, cfg, spec, 1, int(slots), model.calibration(spec))
        runs[run] = {"cache": cache, "pos": int(pos), "times": [],
                     "seen": jnp.zeros((1, cfg.vocab_size), bool)}
    key, tok = row_keys(0, 1), jnp.asarray([1], jnp.int32)
    for r in range(args.rounds + 1):
        for st in runs.values():
            t0 = time.perf_counter()
            for i in range(args.steps):
                t, st["cache"], st["seen"], _, _ = decode_step(
                    model.params, cfg, st["cache"], tok, jnp.asarray([st["pos"] + i], jnp.int32),
                    key, sampling, st["seen"])
                int(t[0])
            if r:  # round 0 compiles
                st["times"].append((time.perf_counter() - t0) / args.steps)
    for run, st in runs.items():
        med = statistics.median(st["times"])
        print(json.dumps({"run": run, "model": args.model, "ms_per_token": round(1000 * med, 2),
                          "tok_s": round(1 / med, 2)}), flush=True)


if __name__ == "__main__":
    main()
