"""Shared command-line plumbing for scripts/: common flags and one-line errors (exit 2)."""

from __future__ import annotations

import argparse
import ctypes
import json
import os
import sys
from collections.abc import Callable

from tqjax.errors import TqjaxError

EXIT_USAGE = 2
DEFAULT_KV_PRESET = "turbo4"


class ArgumentParser(argparse.ArgumentParser):
    """argparse that reports errors as one line and exits 2."""

    def error(self, message: str) -> None:  # type: ignore[override]
        print(f"{self.prog}: error: {message}", file=sys.stderr)
        raise SystemExit(EXIT_USAGE)


def add_model_args(p: argparse.ArgumentParser) -> None:
    from tqjax.fetch import DEFAULT_MODEL, MODEL_NAMES
    from tqjax.models.loading import GGUF_WEIGHTS
    from tqjax.models.quantize import METHODS, MIXED

    p.add_argument("--model", "-m", default=DEFAULT_MODEL,
                   help=f"model name ({', '.join(MODEL_NAMES)}), HF directory or .gguf file "
                        f"(default: {DEFAULT_MODEL})")
    p.add_argument("--dtype", default="float32", choices=["float32", "bfloat16", "float16"],
                   help="parameter and compute dtype (default float32: fastest on CPU)")
    p.add_argument("--weights", default=None, choices=[*METHODS, MIXED, GGUF_WEIGHTS],
                   help="quantize the weights on the fly (see scripts/quantize.py to save them); "
                        f"{GGUF_WEIGHTS}: keep a .gguf file's quantized blocks as they are")
    p.add_argument("--bpw", type=float, default=None, help="target bits per weight for mixed")
    p.add_argument("--quantize-embeddings", action="store_true",
                   help="with --weights: also quantize the embedding table and an untied head "
                        "(8-bit TurboQuant)")
    p.add_argument("--cache-type-k", default=None,
                   help="KV cache format for keys: f32 (default), bf16, f16, q8, q4, turbo2, "
                        "turbo2.5, turbo3, turbo3.5, turbo4, turboN-prod; given alone it "
                        "also sets the values' format")
    p.add_argument("--cache-type-v", default=None, help="KV cache format for values")
    p.add_argument("--kv", nargs="?", const=DEFAULT_KV_PRESET, default=None, metavar="K[/V]",
                   help=f"compressed KV cache shorthand; alone: the default preset "
                        f"({DEFAULT_KV_PRESET})")
    p.add_argument("--backend", default="xla", choices=["xla", "pallas"],
                   help="hot-path implementation: plain XLA or Pallas kernels "
                        "(interpret mode on CPU)")
    study = p.add_argument_group("research options (the KV cache's robustness steps; the "
                                 "defaults are the recipe)")
    study.add_argument("--kv-naive", action="store_true",
                       help="turn off TurboQuant's outlier handling (centring, key balancing, "
                            "sink slots, exact recent window), for study")
    study.add_argument("--kv-recent", type=int, default=None, metavar="N",
                       help="turbo caches: each query sees its N most recent tokens exactly "
                            "(a per-layer ring of N fp16 keys and values; default 32, 0 = off)")
    study.add_argument("--kv-boundary-layers", type=int, default=0,
                       help="keep the first and last N layers' cache in q8")


def cache_spec(args: argparse.Namespace) -> object:
    """The CacheSpec that --kv / --cache-type-k/v / --kv-* ask for (validated)."""
    from tqjax.kv.cache import NAIVE, CacheSpec, check_spec

    k, v = args.cache_type_k, args.cache_type_v
    if args.kv is not None:
        kv_k, _, kv_v = args.kv.partition("/")
        k, v = k or kv_k, v or kv_v or kv_k
    k = k or v or "f32"
    v = v or k
    options = {"boundary_layers": args.kv_boundary_layers}
    if args.kv_naive:
        options |= NAIVE
    if args.kv_recent is not None:
        options["recent_tokens"] = args.kv_recent
    spec = CacheSpec(k, v, **options)
    check_spec(spec)
    return spec


def enable_compilation_cache() -> None:
    """Persist compiled XLA programs so a second run skips most compilation."""
    import jax

    from tqjax.fetch import cache_dir

    jax.config.update("jax_compilation_cache_dir", str(cache_dir() / "xla"))
    jax.config.update("jax_persistent_cache_min_compile_time_secs", 0.5)


M_MMAP_THRESHOLD = -3  # glibc mallopt parameter


def release_large_buffers(threshold: int = 1 << 20) -> bool:
    """Serve heap blocks of `threshold` bytes and more from mmap, so they go back to the OS
    when freed (glibc; the same as MALLOC_MMAP_THRESHOLD_). glibc otherwise raises its
    threshold after large frees, and the transient per-window activations of a calibration
    pass then fragment the heap: a Qwen2.5-0.5B mixed quantization peaked at 24 GB of RSS
    (killed) instead of 8.8 GB. Returns False where there is no glibc."""
    try:
        return bool(ctypes.CDLL(None).mallopt(M_MMAP_THRESHOLD, threshold))
    except (OSError, AttributeError):
        return False


def run_main(main: Callable[[], int | None]) -> None:
    """Run a CLI entry point: user errors print one line to stderr and exit 2."""
    os.environ.setdefault("TF_CPP_MIN_LOG_LEVEL", "3")
    release_large_buffers()
    enable_compilation_cache()
    try:
        code = main()
    except TqjaxError as e:
        print(f"error: {e}", file=sys.stderr)
        raise SystemExit(EXIT_USAGE) from None
    except KeyboardInterrupt:
        raise SystemExit(130) from None
    raise SystemExit(code or 0)


def print_json(obj: dict) -> None:
    print(json.dumps(obj, ensure_ascii=False), flush=True)
