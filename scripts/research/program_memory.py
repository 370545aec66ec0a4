"""Resident memory of the compiled prefill and decode programs, beside their HLO size (Linux).

    python scripts/research/program_memory.py MODEL KV CONTEXT [--prompt-tokens 512]
        [--weights gguf]
    e.g. smollm2-135m-instruct turbo4 8000

An XLA:CPU executable stays resident while JAX caches it, and what it holds grows with its
optimized HLO: this script loads the model, allocates the cache, then for prefill and for one
decode step reports the RSS the first call leaves behind (glibc's malloc_trim(0) before each
reading, so freed heap is not counted), the program's optimized HLO instructions and fusions,
the peak RSS while compiling it once more, and the RSS returned when every compiled program is
dropped (`jax.clear_caches()`). One JSON line per program on stdout.
"""

from __future__ import annotations

import argparse
import ctypes
import gc
import json
import re

import jax
import jax.numpy as jnp
import numpy as np

import tqjax
from tqjax.commands.bench import proc_status_bytes
from tqjax.decode.generate import decode_step, new_cache, prefill_chunk
from tqjax.decode.sampling import SamplingParams, row_keys, row_sampling
from tqjax.kv.cache import parse_kv


def trimmed_rss() -> float:
    """VmRSS in MB after returning the freed heap to the OS."""
    gc.collect()
    ctypes.CDLL("libc.so.6").malloc_trim(0)
    return proc_status_bytes("VmRSS") / 1e6


def hlo_size(jitted: object, *args: object) -> dict[str, int | float]:
    """Instructions (every computation, fusion bodies included) and fusions of the optimized
    HLO of `jitted` at `args`, and the peak RSS above the trimmed RSS while compiling it
    again (MB; VmHWM reset first)."""
    lowered = jitted.lower(*args)
    base = trimmed_rss()
    with open("/proc/self/clear_refs", "w") as f:
        f.write("5")
    text = lowered.compile().as_text()
    return {"hlo_instructions": text.count(" = "),
            "fusions": len(re.findall(r" fusion\(", text)),
            "compile_peak_mb": round(proc_status_bytes("VmHWM") / 1e6 - base, 1)}


def parser(doc: str) -> argparse.ArgumentParser:
    """The arguments MODEL KV CONTEXT (shared with compile_heap.py)."""
    p = argparse.ArgumentParser(description=doc.splitlines()[0])
    p.add_argument("model")
    p.add_argument("kv", help='cache type, "K" or "K/V"')
    p.add_argument("context", type=int)
    p.add_argument("--weights", default=None, help='a weight method, e.g. "gguf" (default: f32)')
    return p


def model_and_cache(a: argparse.Namespace) -> tuple[tqjax.Model, object]:
    """The model and a batch-1 cache of a.context + 50 slots in format a.kv."""
    m = tqjax.load(a.model, weights=a.weights)
    spec = tqjax.CacheSpec(*parse_kv(a.kv))
    return m, new_cache(m.params, m.config, spec, 1, a.context + 50, m.calibration(spec))


def decode_args(m: tqjax.Model, cache: object, position: int) -> tuple:
    """`decode_step`'s arguments for one greedy token at `position`."""
    return (m.params, m.config, cache, jnp.asarray([1], jnp.int32),
            jnp.asarray([position], jnp.int32), row_keys(0, 1),
            row_sampling([SamplingParams()]), jnp.zeros((1, m.config.vocab_size), bool))


def main() -> None:
    p = parser(__doc__)
    p.add_argument("--prompt-tokens", type=int, default=512)
    a = p.parse_args()
    m, cache = model_and_cache(a)
    cfg = m.config
    toks = jnp.asarray(np.random.default_rng(0).integers(0, cfg.vocab_size,
                                                         (1, a.prompt_tokens), np.int32))
    start = jnp.zeros(1, jnp.int32)
    out_index = jnp.asarray([a.prompt_tokens - 1], jnp.int32)
    valid = jnp.asarray([a.prompt_tokens], jnp.int32)
    pre_args = (m.params, cfg, toks, start, out_index, cache, valid)
    base = trimmed_rss()
    _, cache = jax.block_until_ready(prefill_chunk(*pre_args))
    after_prefill = trimmed_rss()
    dec_args = decode_args(m, cache, a.prompt_tokens)
    shapes = jax.tree.map(lambda x: jax.ShapeDtypeStruct(x.shape, x.dtype)
                          if isinstance(x, jax.Array) else x, dec_args[2])
    out = jax.block_until_ready(decode_step(*dec_args))
    after_decode = trimmed_rss()
    jax.clear_caches()
    dropped = trimmed_rss()  # `out` (the cache) still held
    del out
    rows = {"prefill": (after_prefill - base, prefill_chunk, (*pre_args[:5], shapes, valid)),
            "decode_step": (after_decode - after_prefill, decode_step,
                            (*dec_args[:2], shapes, *dec_args[3:]))}
    for name, (resident, fn, args) in rows.items():
        print(json.dumps({"model": a.model, "kv": a.kv, "context": a.context, "program": name,
                          "resident_mb": round(resident, 1), **hlo_size(fn, *args)}))
    print(json.dumps({"model": a.model, "kv": a.kv, "context": a.context,
                      "all_programs_dropped_mb": round(after_decode - dropped, 1)}))


if __name__ == "__main__":
    main()
