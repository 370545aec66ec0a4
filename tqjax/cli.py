"""Shared command-line plumbing for scripts/: common flags and one-line errors (exit 2)."""

from __future__ import annotations

import argparse
import json
import os
import sys
from collections.abc import Callable

from tqjax.errors import TqjaxError

EXIT_USAGE = 2


class ArgumentParser(argparse.ArgumentParser):
    """argparse that reports errors as one line and exits 2."""

    def error(self, message: str) -> None:  # type: ignore[override]
        print(f"{self.prog}: error: {message}", file=sys.stderr)
        raise SystemExit(EXIT_USAGE)


def add_model_args(p: argparse.ArgumentParser) -> None:
    from tqjax.fetch import DEFAULT_MODEL, MODEL_NAMES

    p.add_argument("--model", "-m", default=DEFAULT_MODEL,
                   help=f"model name ({', '.join(MODEL_NAMES)}), HF directory or .gguf file "
                        f"(default: {DEFAULT_MODEL})")
    p.add_argument("--dtype", default="float32", choices=["float32", "bfloat16", "float16"],
                   help="parameter and compute dtype (default float32: fastest on CPU)")
    p.add_argument("--cache-type-k", default="f32", help="KV cache format for keys")
    p.add_argument("--cache-type-v", default="f32", help="KV cache format for values")


def enable_compilation_cache() -> None:
    """Persist compiled XLA programs so a second run skips most compilation."""
    import jax

    from tqjax.fetch import cache_dir

    jax.config.update("jax_compilation_cache_dir", str(cache_dir() / "xla"))
    jax.config.update("jax_persistent_cache_min_compile_time_secs", 0.5)


def run_main(main: Callable[[], int | None]) -> None:
    """Run a CLI entry point: user errors print one line to stderr and exit 2."""
    os.environ.setdefault("TF_CPP_MIN_LOG_LEVEL", "3")
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
