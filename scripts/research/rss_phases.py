"""Peak RSS of a decode run, phase by phase (Linux): VmHWM is reset (`/proc/self/clear_refs` = 5)
before each phase, and the phase's peak is printed beside the RSS it started from.

    python scripts/research/rss_phases.py MODEL KV PROMPT_TOKENS CONTEXT [--trim] [--xla-cache]
    e.g. smollm2-135m-instruct turbo4 512 8000

Phases: load; cache allocation (a centred turbo cache's calibration runs just before it); prefill
twice (the first call compiles); one decode step (compiles); eight more. --trim calls glibc's
malloc_trim(0) before each phase (what the compiler freed goes back first); --xla-cache turns
on the CLI's persistent XLA cache.
"""

from __future__ import annotations

import argparse
import ctypes
import time
from collections.abc import Callable

import jax
import jax.numpy as jnp
import numpy as np

import tqjax
from tqjax.cli import enable_compilation_cache
from tqjax.commands.bench import proc_status_bytes
from tqjax.decode.generate import decode_step, new_cache, prefill
from tqjax.decode.sampling import SamplingParams, row_keys, row_sampling
from tqjax.kv.cache import parse_kv


def phase(name: str, fn: Callable[[], object], trim: bool) -> object:
    """Run fn with VmHWM reset first; print RSS before, the phase's peak, RSS after (MB)."""
    if trim:
        ctypes.CDLL("libc.so.6").malloc_trim(0)
    before = proc_status_bytes("VmRSS")
    with open("/proc/self/clear_refs", "w") as f:
        f.write("5")
    t0 = time.perf_counter()
    out = jax.block_until_ready(fn())
    peak = proc_status_bytes("VmHWM")
    print(f"{name:26s} before {before / 1e6:7.1f}  peak {peak / 1e6:7.1f} "
          f"(+{(peak - before) / 1e6:6.1f})  after {proc_status_bytes('VmRSS') / 1e6:7.1f} MB"
          f"  {time.perf_counter() - t0:5.1f} s", flush=True)
    return out


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("model")
    p.add_argument("kv", help='cache type, "K" or "K/V"')
    p.add_argument("prompt_tokens", type=int)
    p.add_argument("context", type=int)
    p.add_argument("--trim", action="store_true")
    p.add_argument("--xla-cache", action="store_true")
    a = p.parse_args()
    if a.xla_cache:
        enable_compilation_cache()
    m = phase("load", lambda: tqjax.load(a.model), a.trim)
    cfg = m.config
    spec = tqjax.CacheSpec(*parse_kv(a.kv))
    cal = m.calibration(spec)
    cache = phase("alloc cache", lambda: new_cache(m.params, cfg, spec, 1, a.context + 50, cal),
                  a.trim)
    toks = np.random.default_rng(0).integers(0, cfg.vocab_size, (1, a.prompt_tokens), np.int32)
    lens = np.asarray([a.prompt_tokens], np.int32)
    for name in ("prefill #1 (compile+run)", "prefill #2 (run)"):
        _, cache = phase(name, lambda c=cache: prefill(m.params, cfg, toks, lens, c), a.trim)
    state = {"tok": jnp.asarray([1], jnp.int32), "cache": cache, "key": row_keys(0, 1),
             "seen": jnp.zeros((1, cfg.vocab_size), bool)}
    sampling = row_sampling([SamplingParams()])

    def decode(steps: int) -> jax.Array:
        for i in range(steps):
            pos = jnp.asarray([a.context + i], jnp.int32)
            (state["tok"], state["cache"], state["seen"], state["key"], _) = decode_step(
                m.params, cfg, state["cache"], state["tok"], pos, state["key"], sampling,
                state["seen"])
        return state["tok"]

    phase("decode #1 (compile+run)", lambda: decode(1), a.trim)
    phase("decode x8 (run)", lambda: decode(8), a.trim)


if __name__ == "__main__":
    main()
