"""Data shipped with the package, so that calibration never needs the network or pip.

- calibration.txt: prose and code written for calibration (~530 tokens).
- calibration_prose.txt: the first 330,000 characters of Milton's Paradise Lost (public
  domain; the `miltondata` text as `tqjax.fetch.corpus_text("milton:paradiselost")` returns it).
- calibration_code.txt: the first 330,000 characters of CPython 3.11's textwrap, heapq, shutil,
  tarfile, ast, difflib and enum modules joined by newlines (PSF licence), none of them in the
  evaluation text `python-stdlib` (`tqjax.fetch.PYTHON_STDLIB_MODULES`); the licence is
  LICENSE-PSF.txt here.
"""

from importlib import resources

CALIBRATION_PARTS = ("prose", "code")


def calibration_text() -> str:
    """Prose and code written for calibration (KV-cache statistics, weight quantization); never
    an evaluation text. About 530 tokens."""
    return resources.files(__name__).joinpath("calibration.txt").read_text(encoding="utf-8")


def calibration_part(name: str) -> str:
    """One shipped part of the default weight-calibration corpus ("prose" or "code"), 330,000
    characters."""
    if name not in CALIBRATION_PARTS:
        raise ValueError(f"unknown calibration part {name!r}")
    path = resources.files(__name__).joinpath(f"calibration_{name}.txt")
    return path.read_text(encoding="utf-8")
