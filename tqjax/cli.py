"""Shared command-line plumbing for scripts/: common flags and one-line errors (exit 2)."""

from __future__ import annotations

import argparse
import json
import math
import os
import re
import signal
import sys
import threading
import warnings
from collections.abc import Callable
from pathlib import Path

from tqjax.atomic import check_writable as check_writable  # (for the commands)
from tqjax.dtypes import DTYPES
from tqjax.errors import TqjaxError

EXIT_USAGE = 2
DEFAULT_KV_PRESET = "turbo4"


class DefaultsFormatter(argparse.HelpFormatter):
    """Help that states each option's default where its text does not already."""

    def _get_help_string(self, action: argparse.Action) -> str | None:
        text = action.help or ""
        if (action.option_strings and "default" not in text and "%(default)" not in text
                and action.default is not None and action.default is not False
                and action.default not in ("", [], argparse.SUPPRESS)):
            text += (" " if text else "") + "(default: %(default)s)"
        return text


class RawDescriptionDefaultsFormatter(DefaultsFormatter, argparse.RawDescriptionHelpFormatter):
    """DefaultsFormatter that keeps the description's own line breaks."""


class ArgumentParser(argparse.ArgumentParser):
    """argparse that reports errors as one line and exits 2, and states defaults in --help."""

    def __init__(self, *args: object, **kwargs: object) -> None:
        kwargs.setdefault("formatter_class", DefaultsFormatter)
        super().__init__(*args, **kwargs)  # type: ignore[arg-type]

    def error(self, message: str) -> None:  # type: ignore[override]
        print(f"{self.prog}: error: {message}", file=sys.stderr)
        raise SystemExit(EXIT_USAGE)


def positive_float(text: str) -> float:
    """argparse type: a finite number > 0 (a bandwidth, a timeout); inf and nan are refused."""
    try:
        value = float(text)
    except ValueError:
        raise argparse.ArgumentTypeError(f"not a number: {text!r}") from None
    if not (math.isfinite(value) and value > 0):
        raise argparse.ArgumentTypeError(f"must be a finite number > 0, got {text!r}")
    return value


def add_model_arg(p: argparse.ArgumentParser) -> None:
    """--model and --dtype alone (a program that runs the model as it is)."""
    from tqjax.fetch import DEFAULT_MODEL, MODEL_NAMES

    p.add_argument("--model", "-m", default=DEFAULT_MODEL,
                   help=f"model name ({', '.join(MODEL_NAMES)}), HF directory or .gguf file "
                        f"(default: {DEFAULT_MODEL})")
    p.add_argument("--dtype", default="float32", choices=list(DTYPES),
                   help="parameter and compute dtype (default float32: fastest on CPU)")


def add_model_args(p: argparse.ArgumentParser, batches: bool = False) -> None:
    """The model, weights, cache, backend and mesh options; `--dp` (the batch over devices)
    only where the program decodes batches (`batches`: the server's slots), as one sequence
    on a data-parallel mesh is only copied to every group."""
    from tqjax.kv.cache import STORE_FACTORIES
    from tqjax.models.loading import GGUF_WEIGHTS
    from tqjax.models.quantize import METHODS, MIXED

    add_model_arg(p)
    p.add_argument("--weights", default=None, choices=[*METHODS, MIXED, GGUF_WEIGHTS],
                   help="quantize the weights on the fly (tqjax-quantize saves them); "
                        f"{GGUF_WEIGHTS}: keep a .gguf file's quantized blocks as they are")
    p.add_argument("--bpw", type=float, default=None, help="target bits per weight for mixed")
    p.add_argument("--quantize-embeddings", action="store_true",
                   help="with --weights: also quantize the embedding table and an untied head "
                        "(8-bit TurboQuant)")
    types = ", ".join(STORE_FACTORIES)  # every cache type, from the registry
    p.add_argument("--cache-type-k", default=None, metavar="TYPE",
                   help=f"KV cache format for keys (default f32; one of: {types}); given "
                        f"alone it also sets the values' format")
    p.add_argument("--cache-type-v", default=None, metavar="TYPE",
                   help="KV cache format for values (same types)")
    p.add_argument("--kv", nargs="?", const=DEFAULT_KV_PRESET, default=None, metavar="K[/V]",
                   help=f"KV cache shorthand: keys' and values' types (e.g. turbo4/turbo3, "
                        f"q4_0h); alone: the default preset ({DEFAULT_KV_PRESET}); "
                        f"--cache-type-k / --cache-type-v, where given, replace its parts")
    # tqjax.pallas.backend.CHOICES, spelled out so that parsing does not import JAX
    p.add_argument("--backend", default="auto", choices=["auto", "xla", "pallas"],
                   help="hot-path implementation: plain XLA or Pallas kernels (interpret mode "
                        "on CPU); auto (default): Pallas on a GPU, XLA otherwise")
    p.add_argument("--tp", type=int, default=1, metavar="N",
                   help="tensor parallel: split attention heads, the MLP and the vocabulary over "
                        "N devices (N must divide the attention heads; on CPU, N host devices "
                        "are made)")
    if batches:
        p.add_argument("--dp", type=int, default=1, metavar="M",
                       help="data parallel: split the batch over M devices (a mesh of M x N)")
    p.add_argument("--kv-recent", type=int, default=None, metavar="N",
                   help="turbo caches: each query sees its N most recent tokens exactly (a "
                        "per-layer ring of N fp16 keys and values; default 32, 0 = off)")
    p.add_argument("--kv-boundary-layers", type=int, default=0, metavar="N",
                   help="keep the first and last N layers' cache in q8 (default 0)")


def model_mesh(args: argparse.Namespace) -> object:
    """The device mesh --tp/--dp ask for (`tqjax.sharding.make_mesh`), or None for one device.

    Before JAX starts its backends, the CPU platform is asked for tp x dp host devices
    (XLA_FLAGS), so `--tp` also runs on a CPU-only machine; accelerators are unaffected."""
    import jax

    from tqjax.sharding import make_mesh

    dp = getattr(args, "dp", 1)
    n = args.tp * dp
    if args.tp == dp == 1:
        return None
    flags = os.environ.get("XLA_FLAGS", "")
    if n > 1 and "xla_force_host_platform_device_count" not in flags:
        from jax._src import xla_bridge  # no public "has JAX started" query

        if not xla_bridge.backends_are_initialized():
            os.environ["XLA_FLAGS"] = f"{flags} --xla_force_host_platform_device_count={n}"
    return make_mesh(tp=args.tp, dp=dp, devices=jax.devices())


def cache_spec(args: argparse.Namespace) -> object:
    """The CacheSpec that --kv / --cache-type-k/v / --kv-* ask for (validated)."""
    from tqjax.kv.cache import CacheSpec, check_spec, parse_kv

    k, v = args.cache_type_k, args.cache_type_v
    if args.kv is not None:
        kv_k, kv_v = parse_kv(args.kv)
        k, v = k or kv_k, v or kv_v
    k = k or v or "f32"
    v = v or k
    options = {"boundary_layers": args.kv_boundary_layers}
    if args.kv_recent is not None:
        options["recent_tokens"] = args.kv_recent
    spec = CacheSpec(k, v, **options)
    check_spec(spec)
    return spec


def read_text_file(path: Path, chars: int | None = None) -> tuple[str, bool]:
    """Up to `chars` characters (None: all) of the UTF-8 text file at `path`, and whether that
    is the whole file. TqjaxError, one line, for a missing file, a folder, bytes that are not
    UTF-8 within what is returned, or a NUL character (a binary file: scoring or prompting with
    it is never meant)."""
    if not path.is_file():
        raise TqjaxError(f"{path} is not a file" if path.exists() else f"no such text file: {path}")
    try:  # (bad bytes read as lone surrogates: only those in the returned text count)
        with open(path, encoding="utf-8", errors="surrogateescape") as f:
            text = f.read(-1 if chars is None else chars)
            whole = chars is None or not f.read(1)
    except OSError as e:
        raise TqjaxError(f"cannot read {path}: {e.strerror or e}") from None
    if _SURROGATE.search(text):  # replacement characters would be scored as text
        where = _first_bad_utf8(path)
        at = "" if where is None else f"{where[2]} at byte {where[0]}: {where[1]!r}"
        raise TqjaxError(f"{path} is not UTF-8 text ({at or 'a byte that is not UTF-8'})")
    nul = text.find("\0")
    if nul >= 0:
        raise TqjaxError(f"{path} is not a text file (a NUL character at character {nul})")
    return text, whole


_SURROGATE = re.compile("[\udc80-\udcff]")  # what surrogateescape makes of a bad byte


def _first_bad_utf8(path: Path, chunk: int = 1 << 20) -> tuple[int, bytes, str] | None:
    """(file offset, bytes, reason) of the first byte sequence in `path` that is not UTF-8
    (a text reader's error counts from its own buffer, not the file's start); None if none."""
    import codecs

    decoder = codecs.getincrementaldecoder("utf-8")()
    offset = 0  # bytes of the file given to the decoder so far
    try:
        with open(path, "rb") as f:
            while True:
                data = f.read(chunk)
                pending = len(decoder.getstate()[0])  # bytes held from the previous chunk
                try:
                    decoder.decode(data, final=not data)
                except UnicodeDecodeError as e:
                    return offset - pending + e.start, e.object[e.start:e.end], e.reason
                if not data:
                    return None
                offset += len(data)
    except OSError:
        return None


def enable_compilation_cache() -> None:
    """Persist compiled XLA programs in `$TQJAX_CACHE/xla` so a second run skips most
    compilation (`TQJAX_XLA_CACHE=0` turns it off). A folder that cannot be made or written
    (a shared read-only cache) leaves it off; an unreadable entry (a write cut short: jax
    writes entries in place and never replaces one) is removed with a one-line warning
    instead of jax's two-line warning at every run."""
    import jax

    if os.environ.get("TQJAX_XLA_CACHE", "1").lower() in ("0", "off", "false", "no"):
        return

    from tqjax.fetch import cache_dir

    folder = cache_dir() / "xla"
    try:
        folder.mkdir(parents=True, exist_ok=True)
    except OSError:
        return
    if not os.access(folder, os.W_OK | os.X_OK):
        return
    jax.config.update("jax_compilation_cache_dir", str(folder))
    jax.config.update("jax_persistent_cache_min_compile_time_secs", 0.5)
    if getattr(warnings.showwarning, "tqjax_cache", None) != folder:  # (once per folder)
        warnings.showwarning = _cache_warning_hook(folder, warnings.showwarning)


_UNREADABLE_ENTRY = "Error reading persistent compilation cache entry"  # (jax's warning)


def _cache_warning_hook(folder: Path, previous: Callable[..., None]) -> Callable[..., None]:
    """`warnings.showwarning` that answers jax's unreadable-cache-entry warning by removing
    the entries of `folder` that do not decompress (one line on stderr); others go on."""

    def show(message: Warning | str, category: type[Warning], filename: str, lineno: int,
             file: object = None, line: str | None = None) -> None:
        if _UNREADABLE_ENTRY not in str(message):
            previous(message, category, filename, lineno, file, line)
            return
        removed = drop_unreadable_entries(folder)
        print(f"warning: a compiled program in {folder} could not be read; recompiling "
              f"({removed} unreadable entr{'y' if removed == 1 else 'ies'} removed)",
              file=sys.stderr)

    show.tqjax_cache = folder  # type: ignore[attr-defined]
    return show


def drop_unreadable_entries(folder: Path) -> int:
    """Remove the compilation-cache entries in `folder` that do not decompress; their count."""
    try:
        from jax._src.compilation_cache import decompress_executable  # (no public reader)
    except ImportError:
        return 0
    removed = 0
    for entry in folder.glob("*-cache"):
        try:
            decompress_executable(entry.read_bytes())
        except OSError:
            continue
        except Exception:  # noqa: BLE001 (zlib.error, zstd errors: a cut-short entry)
            entry.unlink(missing_ok=True)
            entry.with_name(entry.name.removesuffix("-cache") + "-atime").unlink(missing_ok=True)
            removed += 1
    return removed


OUT_OF_MEMORY = "RESOURCE_EXHAUSTED"  # XLA's status code for a failed allocation
MEMORY_HINT = ("try a smaller --ctx-size or batch, a compressed cache (--kv) or quantized "
               "weights (--weights)")


def _one_line(text: str, limit: int = 300) -> str:
    """The first non-empty line of `text`, at most `limit` characters."""
    line = next((ln.strip() for ln in text.splitlines() if ln.strip()), "")
    return line if len(line) <= limit else line[: limit - 1] + "…"


def user_error_text(e: BaseException) -> str | None:
    """The one-line message for an error the user can act on, or None for a bug (a traceback
    is then the right report). Covers TqjaxError, running out of memory (host MemoryError or
    XLA RESOURCE_EXHAUSTED), OS errors on files (missing, unwritable, disk full) and a model
    without a tokenizer used where one is needed."""
    import dataclasses

    from tqjax.models.tokenizer import Tokenizer

    tokenizer_names = {*dir(Tokenizer), *(f.name for f in dataclasses.fields(Tokenizer))}
    if isinstance(e, TqjaxError):
        return _one_line(str(e))
    if isinstance(e, MemoryError):
        return f"out of memory (host allocation failed); {MEMORY_HINT}"
    if isinstance(e, RuntimeError) and OUT_OF_MEMORY in str(e):
        return f"out of memory ({_one_line(str(e), 160)}); {MEMORY_HINT}"
    if isinstance(e, OSError) and e.strerror:
        where = " -> ".join(str(f) for f in (e.filename, e.filename2) if f is not None)
        return f"{e.strerror}: {where}" if where else e.strerror
    if (isinstance(e, AttributeError) and getattr(e, "obj", False) is None
            and e.name in tokenizer_names):  # model.tokenizer is None
        return ("the model has no tokenizer (no tokenizer.json or tokenizer.model next to its "
                "weights, nor GGUF metadata) and this command needs one")
    return None


def run_main(main: Callable[[], int | None]) -> None:
    """Run a CLI entry point: user errors (see `user_error_text`) print one line to stderr
    and exit 2. SIGTERM exits 143 through Python's unwinding (as Ctrl-C does, 130), so a
    half-written output's temp file or folder is removed, not left beside it; the process then
    ends at once (`_exit_now`), without the interpreter's teardown, which segfaulted when the
    signal had come while XLA compiled."""
    os.environ.setdefault("TF_CPP_MIN_LOG_LEVEL", "3")
    from tqjax.host import release_large_buffers

    release_large_buffers()
    enable_compilation_cache()
    previous = None
    if threading.current_thread() is threading.main_thread():
        previous = signal.signal(signal.SIGTERM, _terminated)
    try:
        code = main()
        sys.stdout.flush()  # (here, not at exit: a closed pipe must meet the handler below)
    except KeyboardInterrupt:
        _exit_now(130)
    except _Terminated as e:
        _exit_now(e.code)
    except Exception as e:
        if isinstance(e, BrokenPipeError) and _stdout_closed():
            _stdout_to_null()  # stdout's reader went away (`generate.py | head`): stop quietly
            _exit_now(141)
        message = user_error_text(e)
        if message is None:
            raise
        print(f"error: {message}", file=sys.stderr)
        raise SystemExit(EXIT_USAGE) from None
    finally:
        if previous is not None:
            signal.signal(signal.SIGTERM, previous)
    raise SystemExit(code or 0)


class _Terminated(SystemExit):
    """SIGTERM, raised where the main thread runs (as Ctrl-C raises KeyboardInterrupt)."""


def _terminated(signum: int, frame: object) -> None:
    raise _Terminated(128 + signum)


def _exit_now(code: int) -> None:
    """End the process with `code` once a signal's unwinding is done (every `finally` has
    run): streams flushed, then `os._exit`. The interpreter's teardown is skipped: after a
    signal that came while XLA compiled, it crashed (SIGSEGV or SIGABRT in a native thread,
    Ctrl-C during the decode step's compile: 3 of 3 runs) instead of exiting 130 or 143."""
    for stream in (sys.stdout, sys.stderr):
        try:
            stream.flush()
        except (OSError, ValueError):  # (a closed pipe or stream)
            pass
    os._exit(code)


def _stdout_closed() -> bool:
    """Whether stdout is a pipe whose reader has gone (poll reports an error on it)."""
    import select

    try:
        poller = select.poll()
        poller.register(sys.stdout.fileno(), select.POLLOUT)
        return any(ev & select.POLLERR for _, ev in poller.poll(0))
    except (AttributeError, OSError, ValueError):  # (no poll here, or no real stdout)
        return False


def _stdout_to_null() -> None:
    """Point stdout's descriptor at /dev/null, so that the flush at exit does not raise again
    on a closed pipe (the recipe in Python's `signal` docs)."""
    try:
        devnull = os.open(os.devnull, os.O_WRONLY)
        os.dup2(devnull, sys.stdout.fileno())
    except (OSError, ValueError):
        pass


def print_json(obj: dict) -> None:
    print(json.dumps(obj, ensure_ascii=False), flush=True)
