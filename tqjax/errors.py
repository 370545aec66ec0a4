"""User-facing errors: anything a caller can fix (bad path, bad option, unsupported model)."""


class TqjaxError(Exception):
    """An error with a one-line message meant for the user; the CLI prints it and exits 2."""
