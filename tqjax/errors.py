"""User-facing errors: anything a caller can fix (bad path, bad option, unsupported model),
and the type checks of what callers pass."""

import numpy as np


class TqjaxError(Exception):
    """An error with a one-line message meant for the user; the CLI prints it and exits 2."""


def is_int(x: object) -> bool:
    """Whether x is an integer (Python's or numpy's), not a bool: the check of every count,
    size and seed a caller passes."""
    return isinstance(x, (int, np.integer)) and not isinstance(x, bool)


def is_real(x: object) -> bool:
    """Whether x is a real number (an integer or a float, Python's or numpy's), not a bool."""
    return isinstance(x, (int, float, np.integer, np.floating)) and not isinstance(x, bool)
