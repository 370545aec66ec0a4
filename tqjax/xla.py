"""The XLA flags tqjax runs with, added to XLA_FLAGS when tqjax is imported (`set_flags`);
the time spent compiling (`compile_timer`).

`--xla_cpu_use_fusion_emitters=false`: XLA:CPU emits its fused loops as LLVM IR directly, not
through its MLIR fusion emitters, which keep an MLIR context per fusion while a program
compiles. Compiling SmolLM2's decode step with a turbo4 cache then takes 90 MB of heap instead
of 169 MB (f32 cache: 75 MB instead of 102; `scripts/research/compile_heap.py`). That was most
of what a compressed cache's run added to its peak RSS. Decode speed changes by -9% to +23%
depending on the path (docs/research.md, stop 40). Other backends ignore the flag.

XLA reads XLA_FLAGS once, when the first computation starts, so importing tqjax after JAX has
run something leaves the flags as they were. A flag already in XLA_FLAGS is left alone (pass
`--xla_cpu_use_fusion_emitters=true` to keep the MLIR emitters). The flags are only added for
the jaxlib versions they were measured on, because an unknown flag in XLA_FLAGS aborts the
process.
"""

from __future__ import annotations

import contextlib
import os
import re
import threading
from collections.abc import Iterator

import jaxlib

TESTED_JAXLIB = ((0, 10),)  # (major, minor) versions the flags below were measured on
FLAGS = {"xla_cpu_use_fusion_emitters": "false"}


def flag_value(name: str, flags: str) -> bool | None:
    """The boolean XLA flag `name` as the last mention in `flags` sets it (absl forms:
    --name=true|false|1|0, --name, --noname), or None where `flags` does not mention it."""
    found = re.findall(rf"--(no)?{name}(?:=(\w+))?(?=\s|$)", flags)
    if not found:
        return None
    no, value = found[-1]
    return (value.lower() not in ("false", "0")) if value else not no


def flags_for(version: str, current: str = "") -> str:
    """XLA_FLAGS with tqjax's flags added to `current`: only those it does not set already (in
    any form: that is the user's choice), and nothing under a jaxlib `version` that has not
    been tested."""
    found = re.match(r"(\d+)\.(\d+)", version)
    if found is None or (int(found[1]), int(found[2])) not in TESTED_JAXLIB:
        return current
    missing = [f"--{k}={v}" for k, v in FLAGS.items() if flag_value(k, current) is None]
    return " ".join([current, *missing]).strip()


def set_flags() -> None:
    """Add tqjax's flags to the XLA_FLAGS environment variable (see the module docstring)."""
    current = os.environ.get("XLA_FLAGS", "")
    flags = flags_for(jaxlib.__version__, current)
    if flags != current:
        os.environ["XLA_FLAGS"] = flags


def llvm_emitters() -> bool:
    """Whether XLA_FLAGS selects XLA:CPU's LLVM fusion emitters (tqjax's default, above): the
    memory planner's constants were measured with them."""
    return flag_value("xla_cpu_use_fusion_emitters", os.environ.get("XLA_FLAGS", "")) is False


set_flags()


# the events JAX reports for each top-level compilation: lowering to MLIR and XLA's compile
# (tracing is left out: a nested jit's trace is reported inside its caller's, so summing the
# trace events would count it twice)
COMPILE_EVENTS = ("/jax/core/compile/jaxpr_to_mlir_module_duration",
                  "/jax/core/compile/backend_compile_duration")
_timers: list[CompileTimer] = []
_listening = False


class CompileTimer:
    """Seconds its thread spent lowering and compiling programs while it is active
    (`compile_timer`)."""

    def __init__(self) -> None:
        self.seconds, self.thread = 0.0, threading.get_ident()


def _on_event(name: str, seconds: float, **_: object) -> None:
    if name in COMPILE_EVENTS:  # (JAX reports a compile on the thread that asked for it)
        me = threading.get_ident()
        for t in list(_timers):
            if t.thread == me:
                t.seconds += seconds


@contextlib.contextmanager
def compile_timer() -> Iterator[CompileTimer]:
    """Count the seconds JAX spends compiling for this thread inside the `with`, so a timing
    can leave them out: a first prefill's wall time is mostly its compile (another thread's
    compiles, e.g. a server's other work, are not this timing's)."""
    global _listening
    if not _listening:
        from jax import monitoring

        monitoring.register_event_duration_secs_listener(_on_event)
        _listening = True
    timer = CompileTimer()
    _timers.append(timer)
    try:
        yield timer
    finally:
        _timers.remove(timer)
