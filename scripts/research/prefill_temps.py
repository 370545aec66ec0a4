"""XLA's buffer plan for one prefill chunk: temporaries of `prefill_chunk` at batch 1 and 2
(`memory_analysis`), and what each further row adds per (chunk token · hidden unit), the
coefficient `tqjax.planner.Runtime.row_activation` takes per cache kind.

    python scripts/research/prefill_temps.py -m smollm2-135m-instruct --kv f32 q8 turbo4 turbo3

One JSON line per cache type: temp MiB at batch 1 and 2, the difference per row, and that
difference in bytes per chunk token per hidden unit. Only compiles (nothing runs).
"""

from __future__ import annotations

import argparse
import json

import jax.numpy as jnp


def main() -> None:
    import tqjax
    from tqjax.decode.generate import PREFILL_CHUNK, new_cache, prefill_chunk
    from tqjax.kv.cache import as_cache_spec

    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--model", "-m", default="smollm2-135m-instruct")
    p.add_argument("--kv", nargs="+", default=["f32", "q8", "turbo4", "turbo3"])
    p.add_argument("--slots", type=int, default=1024)
    args = p.parse_args()
    m = tqjax.load(args.model)
    t = PREFILL_CHUNK
    for kv in args.kv:
        spec = as_cache_spec(kv)
        temps = []
        for b in (1, 2):
            cache = new_cache(m.params, m.config, spec, b, args.slots, m.calibration(spec))
            lowered = prefill_chunk.lower(
                m.params, m.config, jnp.zeros((b, t), jnp.int32), jnp.full((b,), t, jnp.int32),
                jnp.zeros((b,), jnp.int32), cache, jnp.full((b,), t, jnp.int32))
            temps.append(lowered.compile().memory_analysis().temp_size_in_bytes)
        row = temps[1] - temps[0]
        print(json.dumps({"model": args.model, "kv": kv, "chunk": t, "slots": args.slots,
                          "temp_mib": [round(x / 2**20, 1) for x in temps],
                          "row_mib": round(row / 2**20, 1),
                          "row_bytes_per_token_hidden": round(row / (t * m.config.hidden_size),
                                                              1)}), flush=True)


if __name__ == "__main__":
    main()
