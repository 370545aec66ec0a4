"""Data shipped with the package: the built-in calibration text."""

from importlib import resources


def calibration_text() -> str:
    """Prose and code written for calibration (KV-cache statistics, weight quantization); never
    an evaluation text. About 530 tokens."""
    return resources.files(__name__).joinpath("calibration.txt").read_text(encoding="utf-8")
