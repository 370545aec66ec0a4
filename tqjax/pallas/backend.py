"""Which implementation the hot paths use: plain XLA or the Pallas kernels; by default ("auto")
the Pallas kernels where JAX runs on a GPU and XLA elsewhere (`auto`).

The choice is a static, trace-time setting, read by `tqjax.quant.weights.linear` and
`tqjax.kv.cache.attend` when they are traced:

    with use_backend("pallas"):
        tqjax.generate(model, prompt)

It is a JAX configuration state that takes part in the jit cache key (like the default matmul
precision), so a function jitted under one backend is retraced, not reused, under the other.
Thread-local: each thread has its own setting. Functions that take an explicit `backend`
argument use it instead of this default.
"""

from __future__ import annotations

import contextlib
import threading
from collections.abc import Iterator

import jax

from tqjax.errors import TqjaxError

BACKENDS = ("xla", "pallas")
CHOICES = ("auto", *BACKENDS)  # what the CLI's --backend takes; "auto" = `auto()`


def _make_state() -> object | None:
    """A JAX config state keyed into the jit cache; None if this JAX has no such (internal) API,
    in which case a thread-local setting is used and jit caches are cleared on every switch."""
    try:
        from jax._src import config as jax_config

        return jax_config.enum_state(
            "tqjax_kernel_backend", list(CHOICES), "auto",
            help="tqjax hot-path implementation: plain XLA or Pallas kernels.",
            include_in_jit_key=True, include_in_trace_context=True)
    except (ImportError, AttributeError, TypeError):
        return None


_state = _make_state()
_local = threading.local()


def auto() -> str:
    """The backend for this machine: "pallas" where JAX's default device is a GPU (on one H200
    every decode configuration of `scripts/gpu_check.sh` ran 1.2-7.2x faster with it:
    results/current/gpu/gpu_check.json), else "xla" (on CPU the kernels only interpret)."""
    return "pallas" if jax.default_backend() == "gpu" else "xla"


def check_backend(name: str) -> str:
    """`name` if it is a known backend, "auto" resolved (`auto`), else a TqjaxError naming
    the choices."""
    if name == "auto":
        return auto()
    if name not in BACKENDS:
        raise TqjaxError(f"unknown backend {name!r} (choose from: {', '.join(CHOICES)})")
    return name


def current() -> str:
    """The backend in effect here: the innermost `use_backend`, else `auto()`."""
    name = _state.value if _state is not None else getattr(_local, "backend", "auto")
    return auto() if name == "auto" else name


def resolve(backend: str | None) -> str:
    """An explicit backend (checked) or, for None, the current default."""
    return current() if backend is None else check_backend(backend)


@contextlib.contextmanager
def use_backend(name: str) -> Iterator[None]:
    """Run the enclosed code (and everything it traces) with backend `name` ("auto": `auto`)."""
    name = check_backend(name)
    if _state is not None:
        with _state(name):
            yield
        return
    previous = current()
    _local.backend = name
    if name != previous:
        jax.clear_caches()
    try:
        yield
    finally:
        _local.backend = previous
        if name != previous:
            jax.clear_caches()


def default_interpret() -> bool:
    """Pallas interpret mode where no GPU backs JAX (CPU): kernels run as plain JAX ops."""
    return jax.default_backend() == "cpu"
