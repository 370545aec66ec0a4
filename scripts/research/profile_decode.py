"""Where a decode step's time goes, kernel by kernel: XLA:CPU's own trace events of `decode_step`
(`jax.profiler`), summed over steps and grouped by kernel kind (research, CPU).

    python scripts/research/profile_decode.py -m smollm2-135m-instruct --weights tq4
    python scripts/research/profile_decode.py --kv turbo4 --slots 8064 --position 8000

Times are per step and per thread (a kernel split over both cores counts once per part, and a
conditional or loop counts with the kernels inside it), so read them against each other, not
against the step's wall time, which is printed too.
"""

from __future__ import annotations

import argparse
import collections
import re
import tempfile
import time
from pathlib import Path


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("-m", "--model", default="smollm2-135m-instruct")
    p.add_argument("--weights", default=None, help="as tqjax.load's weights= (e.g. tq4, gguf)")
    p.add_argument("--kv", default="f32", help="cache type (tqjax.kv.cache.parse_kv)")
    p.add_argument("--slots", type=int, default=256)
    p.add_argument("--position", type=int, default=128)
    p.add_argument("--steps", type=int, default=10)
    p.add_argument("--top", type=int, default=15)
    args = p.parse_args()

    import jax
    import jax.numpy as jnp

    import tqjax
    from tqjax.decode.generate import decode_step, new_cache
    from tqjax.decode.sampling import SamplingParams, row_keys, row_sampling
    from tqjax.kv.cache import CacheSpec, parse_kv

    model = tqjax.load(args.model, **({"weights": args.weights} if args.weights else {}))
    cfg, sampling = model.config, row_sampling([SamplingParams()])
    spec = CacheSpec(*parse_kv(args.kv))
    state = {"cache": new_cache(model.params, cfg, spec, 1, args.slots, model.calibration(spec)),
             "seen": jnp.zeros((1, cfg.vocab_size), bool), "i": 0}
    key, tok = row_keys(0, 1), jnp.asarray([1], jnp.int32)

    def step() -> jax.Array:
        pos = jnp.asarray([args.position + state["i"] % 16], jnp.int32)
        t, state["cache"], state["seen"], _, _ = decode_step(
            model.params, cfg, state["cache"], tok, pos, key, sampling, state["seen"])
        state["i"] += 1
        return t

    for _ in range(3):  # compile and warm up
        jax.block_until_ready(step())
    with tempfile.TemporaryDirectory() as d:
        jax.profiler.start_trace(d)
        t0 = time.perf_counter()
        for _ in range(args.steps):
            jax.block_until_ready(step())
        wall = (time.perf_counter() - t0) / args.steps
        jax.profiler.stop_trace()
        data = jax.profiler.ProfileData.from_file(str(next(Path(d).rglob("*.xplane.pb"))))
    per_kind, calls = collections.Counter(), collections.Counter()
    for plane in data.planes:
        for line in plane.lines:
            if "Eigen" not in line.name and "PjRtCpuClient" not in line.name:
                continue
            for ev in line.events:
                if ev.name.startswith(("ThunkExecutor", "$")):
                    continue
                kind = re.sub(r"\.\d+$", "", ev.name)
                per_kind[kind] += ev.duration_ns
                calls[kind] += 1
    print(f"wall {1000 * wall:.1f} ms/step; per kind: us/step, calls/step")
    for kind, ns in per_kind.most_common(args.top):
        print(f"{ns / args.steps / 1e3:10.1f} {calls[kind] / args.steps:7.1f}  {kind}")


if __name__ == "__main__":
    main()
