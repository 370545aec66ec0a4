"""Decoder weights as a list of layers against stacked by format (`transformer.LayerStack`).

    python scripts/research/stacked_weights.py MODEL [--weights gguf] [--dtype bfloat16]
        [--context 200]
        [--steps 16] [--prompt-tokens 0]

`tqjax.load` stacks quantized layers' parts by weight format (`transformer.stack_layers`),
so `forward` compiles each linear once per format it takes (in a Q4_K_M file, v and down
take two), where a list of layers compiles each once per layer (each `lax.switch` branch
reads its own weights).
This runs the same params both ways, on the same cache: for each, the decode step's (or,
with `--prompt-tokens N`, an N-token prefill chunk's) compile seconds, its optimized HLO
instructions and fusions, the RSS its compiled program keeps (trimmed heap), the median time
over `--steps` donated calls, and the largest logit difference. One JSON line per form on stdout.
"""

from __future__ import annotations

import argparse
import ctypes
import gc
import json
import re
import time
from typing import Any

import jax
import jax.numpy as jnp
import numpy as np

import tqjax
from tqjax.commands.bench import proc_status_bytes
from tqjax.decode.generate import new_cache
from tqjax.kv import cache as kvc
from tqjax.kv.cache import parse_kv
from tqjax.models import transformer as tr


def trimmed_rss() -> float:
    """VmRSS in MB after returning the freed heap to the OS."""
    gc.collect()
    ctypes.CDLL("libc.so.6").malloc_trim(0)
    return proc_status_bytes("VmRSS") / 1e6


def measure(name: str, step: Any, args: tuple, cache: kvc.KVCache, steps: int,
            tokens: int) -> tuple[dict, np.ndarray]:
    """Compile `step(*args, cache)` (donating the cache), run it `steps` times."""
    base = trimmed_rss()
    t0 = time.perf_counter()
    compiled = step.lower(*args, cache).compile()
    compile_s = time.perf_counter() - t0
    text = compiled.as_text()
    logits, cache = jax.block_until_ready(compiled(*args, cache))
    resident = trimmed_rss() - base
    times = []
    for _ in range(steps):
        t0 = time.perf_counter()
        _, cache = jax.block_until_ready(compiled(*args, cache))
        times.append(time.perf_counter() - t0)
    row = {"form": name, "tokens": tokens, "compile_s": round(compile_s, 1),
           "hlo_instructions": text.count(" = "), "fusions": len(re.findall(r" fusion\(", text)),
           "resident_mb": round(resident, 1),
           "step_ms_median": round(1e3 * float(np.median(times)), 2) if times else None}
    return row, np.asarray(logits)


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("model")
    p.add_argument("--weights", default=None)
    p.add_argument("--dtype", default="float32")
    p.add_argument("--kv", default="f32")
    p.add_argument("--context", type=int, default=200)
    p.add_argument("--steps", type=int, default=16)
    p.add_argument("--prompt-tokens", type=int, default=0, help="a prefill chunk instead")
    a = p.parse_args()
    m = tqjax.load(a.model, dtype=a.dtype, weights=a.weights)
    cfg = m.config
    spec = tqjax.CacheSpec(*parse_kv(a.kv))
    t = max(1, a.prompt_tokens)
    tokens = jnp.asarray(np.random.default_rng(0).integers(0, cfg.vocab_size, (1, t)),
                         jnp.int32)
    start = jnp.asarray([0 if a.prompt_tokens else 100], jnp.int32)
    out_index = jnp.asarray([t - 1], jnp.int32)
    caches = [new_cache(m.params, cfg, spec, 1, a.context + t, m.calibration(spec))
              for _ in range(2)]
    step = jax.jit(lambda params, tokens, start, out_index, cache: tr.forward(
        params, cfg, tokens, start, cache, out_index=out_index), donate_argnums=(4,))
    listed = m.params.replace(layers=list(m.params.layers))
    del m
    row, want = measure("list", step, (listed, tokens, start, out_index), caches[0],
                        a.steps, t)
    print(json.dumps({"model": a.model, "weights": a.weights, **row}), flush=True)
    jax.clear_caches()
    stack = tr.stack_layers(listed.layers, consume=True)
    stacked = listed.replace(layers=stack)
    del listed
    row, got = measure("stacked", step, (stacked, tokens, start, out_index), caches[1],
                       a.steps, t)
    formats = {name: len(part) for name, part in zip(tr.PARTS, stack.stacks, strict=True)}
    print(json.dumps({"model": a.model, "weights": a.weights, "formats": formats, **row,
                      "max_abs_logit_diff": float(np.max(np.abs(got - want)))}), flush=True)


if __name__ == "__main__":
    main()
