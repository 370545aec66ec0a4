import os

os.environ.setdefault("JAX_PLATFORMS", "cpu")

from pathlib import Path  # noqa: E402

import pytest  # noqa: E402

ROOT = Path(__file__).resolve().parent.parent
GOLDEN = ROOT / "golden"


@pytest.fixture(scope="session")
def golden_dir() -> Path:
    return GOLDEN
