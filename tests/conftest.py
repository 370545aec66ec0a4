import os

os.environ.setdefault("JAX_PLATFORMS", "cpu")
# In-process CLI entry points (tqjax.cli.run_main) would otherwise switch on XLA's persistent
# compilation cache for the rest of the pytest process; writing some of the suite's executables
# to it crashed CI (SIGSEGV in compilation_cache.put_executable_and_time).
os.environ.setdefault("TQJAX_XLA_CACHE", "0")

from pathlib import Path  # noqa: E402

import pytest  # noqa: E402

ROOT = Path(__file__).resolve().parent.parent
GOLDEN = ROOT / "golden"


@pytest.fixture(scope="session")
def golden_dir() -> Path:
    return GOLDEN
