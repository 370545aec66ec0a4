"""tqjax's XLA flags: added to XLA_FLAGS on import, never over a flag the user set, and only
under the jaxlib versions they were measured on."""

from __future__ import annotations

import os
import subprocess
import sys

from tqjax.xla import FLAGS, flags_for, llvm_emitters

OURS = " ".join(f"--{k}={v}" for k, v in FLAGS.items())


def test_flags_are_added_under_a_tested_jaxlib() -> None:
    assert flags_for("0.10.2") == OURS == "--xla_cpu_use_fusion_emitters=false"
    assert flags_for("0.10.0", "--xla_dump_to=/tmp/d") == f"--xla_dump_to=/tmp/d {OURS}"


def test_a_flag_the_user_set_is_kept() -> None:
    for mine in ("--xla_cpu_use_fusion_emitters=true --xla_dump_to=/tmp/d",
                 "--xla_cpu_use_fusion_emitters", "--noxla_cpu_use_fusion_emitters"):
        assert flags_for("0.10.2", mine) == mine
    # the name inside another flag's value is not the flag
    other = "--xla_dump_to=/tmp/xla_cpu_use_fusion_emitters_dump"
    assert flags_for("0.10.2", other) == f"{other} {OURS}"


def test_llvm_emitters_reads_the_flag(monkeypatch) -> None:
    for flags, want in ((OURS, True), ("", False), ("--xla_cpu_use_fusion_emitters=true", False),
                        ("--xla_cpu_use_fusion_emitters", False),
                        ("--noxla_cpu_use_fusion_emitters", True),
                        (f"{OURS} --xla_cpu_use_fusion_emitters=1", False),
                        ("--noxla_cpu_use_fusion_emitters_other", False)):
        monkeypatch.setenv("XLA_FLAGS", flags)
        assert llvm_emitters() is want, flags


def test_no_flags_under_an_untested_jaxlib() -> None:
    assert flags_for("0.11.0", "") == ""
    assert flags_for("1.0.0", "--xla_dump_to=/tmp/d") == "--xla_dump_to=/tmp/d"
    assert flags_for("0.10rc1") == OURS and flags_for("0.11.0.dev20260101") == ""
    assert flags_for("unknown") == ""


def test_importing_tqjax_sets_them_before_xla_starts() -> None:
    code = ("import os, jax.numpy as jnp, tqjax, tqjax.serve.engine, tqjax.commands.bench; "
            "from jax._src import xla_bridge; assert not xla_bridge.backends_are_initialized(); "
            "assert float(jnp.ones(2).sum()) == 2.0; print(os.environ['XLA_FLAGS'])")
    env = {k: v for k, v in os.environ.items() if k != "XLA_FLAGS"} | {"JAX_PLATFORMS": "cpu"}
    out = subprocess.run([sys.executable, "-c", code], env=env, capture_output=True, text=True,
                         check=True).stdout.strip()
    assert out == flags_for(__import__("jaxlib").__version__)


def test_compile_timer_counts_its_own_threads_compiles() -> None:
    """A compile in another thread (a server's other work) is not the timed thread's: it made
    a first prefill's compile time larger than its wall time."""
    import threading

    import jax
    import jax.numpy as jnp

    from tqjax.xla import compile_timer

    with compile_timer() as mine:
        other = threading.Thread(target=lambda: jax.jit(lambda x: x * 3.0 + 1.0)(jnp.ones(7)))
        other.start()
        other.join()
        assert mine.seconds == 0.0
        jax.jit(lambda x: x * 5.0 - 2.0)(jnp.ones(9)).block_until_ready()
    assert mine.seconds > 0.0
