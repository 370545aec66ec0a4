"""Atomic file writes: write next to the target, fsync, then rename over it, so a crash never
leaves a partial file (or folder) behind."""

from __future__ import annotations

import json
import os
import shutil
import tempfile
from collections.abc import Callable, Iterator
from contextlib import contextmanager
from pathlib import Path
from typing import Any


def fsync_dir(path: Path) -> None:
    """Persist a folder's entries (the rename itself); a no-op where unsupported."""
    try:
        fd = os.open(path, os.O_RDONLY)
    except OSError:
        return
    try:
        os.fsync(fd)
    except OSError:
        pass
    finally:
        os.close(fd)


@contextmanager
def atomic_path(dest: str | Path) -> Iterator[Path]:
    """Yield a temp path next to `dest`; on clean exit it is fsynced and renamed onto `dest`,
    on an exception it is removed and `dest` is left untouched."""
    dest = Path(dest)
    dest.parent.mkdir(parents=True, exist_ok=True)
    fd, name = tempfile.mkstemp(prefix=f".{dest.name}.", suffix=".tmp", dir=dest.parent)
    os.close(fd)
    tmp = Path(name)
    try:
        yield tmp
        with open(tmp, "rb+") as f:
            os.fsync(f.fileno())
        os.chmod(tmp, 0o644)
        os.replace(tmp, dest)
    except BaseException:
        tmp.unlink(missing_ok=True)
        raise
    fsync_dir(dest.parent)


def write_text(dest: str | Path, text: str) -> None:
    with atomic_path(dest) as tmp:
        tmp.write_text(text, encoding="utf-8")


def write_json(dest: str | Path, obj: Any, indent: int | None = 2) -> None:  # noqa: ANN401
    write_text(dest, json.dumps(obj, indent=indent, ensure_ascii=False, default=str) + "\n")


def write_safetensors(dest: str | Path, tensors: dict[str, Any],
                      metadata: dict[str, str] | None = None) -> None:
    """Numpy arrays as one safetensors file."""
    import numpy as np
    from safetensors.numpy import save_file

    arrays = {k: np.ascontiguousarray(v) for k, v in tensors.items()}
    with atomic_path(dest) as tmp:
        save_file(arrays, str(tmp), metadata=metadata)


def _fsync_file(path: Path) -> None:
    fd = os.open(path, os.O_RDONLY)
    try:
        os.fsync(fd)
    finally:
        os.close(fd)


def replace_dir(dest: str | Path, build: Callable[[Path], None]) -> None:
    """Build a folder in a temp dir next to `dest` (build(tmp)), fsync its files, then swap it
    into place (a previous `dest` is replaced)."""
    dest = Path(dest)
    dest.parent.mkdir(parents=True, exist_ok=True)
    tmp = Path(tempfile.mkdtemp(prefix=f".{dest.name}.", dir=dest.parent))
    old = dest.parent / f".{dest.name}.old"
    try:
        build(tmp)
        for f in tmp.rglob("*"):
            if f.is_file():
                _fsync_file(f)
        fsync_dir(tmp)
        os.chmod(tmp, 0o755)
        if old.exists():
            shutil.rmtree(old)
        if dest.exists():
            os.rename(dest, old)
        os.rename(tmp, dest)
    except BaseException:
        shutil.rmtree(tmp, ignore_errors=True)
        raise
    shutil.rmtree(old, ignore_errors=True)
    fsync_dir(dest.parent)
