"""Host buffers the CPU runtime adopts without a copy (`host_buffer`)."""

from __future__ import annotations

import ctypes
import math
import sys
from typing import Any

import jax
import numpy as np

M_MMAP_THRESHOLD = -3  # glibc mallopt parameter
HOST_ALIGN = 64  # bytes: the CPU runtime adopts a host buffer this aligned without a copy


def host_buffer(shape: tuple[int, ...], dtype: Any) -> np.ndarray:
    """An uninitialised C-contiguous host array, its data `HOST_ALIGN`-aligned, so that
    `jax.device_put` of it on CPU aliases it (no copy: measured, jax 0.10) instead of copying
    (numpy's own large allocations are 16-byte aligned). Fill it, then `device_put` it: the
    device array is then the only copy."""
    dtype = np.dtype(dtype)
    nbytes = math.prod(shape) * dtype.itemsize
    raw = np.empty(nbytes + HOST_ALIGN, np.uint8)
    start = -raw.ctypes.data % HOST_ALIGN
    return raw[start:start + nbytes].view(dtype).reshape(shape)


def release_adopted() -> None:
    """Let jax free the host buffers it adopted (`host_buffer` then `device_put`) whose arrays
    have been dropped. jax releases such a buffer only at its next transfer (a deferred
    reference count: measured, jax 0.10), so host-only work that follows (reading the next
    tensor) would otherwise run with the dropped buffers still resident."""
    jax.device_put(np.zeros(1, np.float32)).delete()


def trim_heap() -> None:
    """Return the C heap's free pages to the system (glibc's `malloc_trim`; elsewhere nothing).
    Small allocations that were freed (compiled programs, Python objects) otherwise stay
    resident, and a large read that follows (served by mmap) does not reuse them. Costs ~40 ms
    on a fragmented 1 GB heap: call it between phases, not per tensor."""
    try:
        ctypes.CDLL(None).malloc_trim(0)
    except (OSError, AttributeError):  # not glibc
        pass


# the modules whose jitted functions only a load or a quantization runs (`drop_programs`),
# and jax's own (jax.numpy's functions, run eagerly, are jitted functions of jax's modules)
LOAD_MODULES = ("tqjax.models", "tqjax.quant", "jax")
_JITTED = type(jax.jit(lambda: None))  # what jax.jit returns


def drop_programs() -> None:
    """Free the compiled programs of work that does not run them again (a load's conversions,
    a quantizer's), so that none stays beside the model: those of every jitted function in
    `LOAD_MODULES`, and jax's tracing, lowering and eager-operation caches (jax.numpy outside a
    jit: small programs, compiled again in milliseconds when next run); then return the freed
    heap (`trim_heap`). A caller's own jitted functions and tqjax's decode programs stay
    compiled: their calls are served by each function's own cache (`jax.clear_caches` would
    drop them too, and a decode step compiles for seconds). A function that jax cannot serve
    from that cache (one with side effects, e.g. `jax.debug.print`) is traced again."""
    for name, module in list(sys.modules.items()):
        if module is None or not any(name == m or name.startswith(m + ".") for m in LOAD_MODULES):
            continue
        for value in list(vars(module).values()):
            if isinstance(value, _JITTED):
                value.clear_cache()
    try:  # (private: where a jax release has moved it, the cached traces stay)
        from jax._src import util

        util.clear_all_caches()
    except (ImportError, AttributeError):
        pass
    trim_heap()


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
