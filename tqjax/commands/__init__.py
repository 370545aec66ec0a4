"""The command-line programs, each an importable `main(argv=None)` (one-line errors, exit 2):
the `[project.scripts]` entry points (`tqjax-quantize`, `tqjax-bench`, ...) and the thin
wrappers in scripts/ call them. `python -m tqjax.commands.<name>` runs one too."""
