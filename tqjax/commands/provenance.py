"""Where a measurement was made: the checkout's commit and the machine (one place for every
results JSON: the benchmarks and scripts/results.py)."""

from __future__ import annotations

import os
import platform
import subprocess
from pathlib import Path

SOURCE = Path(__file__).resolve().parents[2]  # the checkout, when tqjax runs from one


def source_checkout() -> Path | None:
    """The git checkout tqjax runs from (its scripts, an editable install), or None for an
    installed copy (in site-packages, whose enclosing repository, if any, is the user's)."""
    ok = ((SOURCE / ".git").exists() and (SOURCE / "pyproject.toml").is_file()
          and (SOURCE / "tqjax" / "__init__.py").is_file())
    return SOURCE if ok else None


def git_info(root: Path | None = None) -> dict:
    """{"tqjax": its version, "commit": HEAD sha or None, "dirty": tracked files modified?} of
    the checkout at `root` (default: the one tqjax runs from; commit and dirty are None for
    an installed copy, or a root that is no checkout)."""
    import tqjax

    root = source_checkout() if root is None else root

    def git(*args: str) -> str | None:
        if root is None or not (root / ".git").exists():
            return None
        try:
            out = subprocess.run(["git", "-C", str(root), *args], capture_output=True,
                                 text=True, timeout=30)
        except (OSError, subprocess.SubprocessError):
            return None
        return out.stdout.strip() if out.returncode == 0 else None

    commit = git("rev-parse", "HEAD")
    status = git("status", "--porcelain", "--untracked-files=no")
    return {"tqjax": tqjax.__version__, "commit": commit,
            "dirty": bool(status) if status is not None else None}


def machine_info() -> dict:
    """CPU model, core count, memory, OS and Python of this machine."""
    cpu = platform.processor() or platform.machine()
    try:
        with open("/proc/cpuinfo") as f:
            for line in f:
                if line.startswith("model name"):
                    cpu = line.split(":", 1)[1].strip()
                    break
    except OSError:
        pass
    mem = 0
    try:
        with open("/proc/meminfo") as f:
            for line in f:
                if line.startswith("MemTotal:"):
                    mem = int(line.split()[1]) * 1024
                    break
    except OSError:
        pass
    return {"cpu": cpu, "cpu_count": os.cpu_count(), "mem_total_bytes": mem,
            "platform": platform.platform(), "python": platform.python_version(),
            "node": platform.node()}
