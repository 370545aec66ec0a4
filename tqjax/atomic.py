"""Atomic file writes: write next to the target, fsync, then rename over it, so a crash never
leaves a partial file (or folder) in its place (the hidden temp a kill -9 leaves beside it is
removed by the next write to that target); and the one checked read of a JSON file."""

from __future__ import annotations

import ctypes
import errno
import json
import os
import re
import shutil
import sys
import tempfile
import time
from collections.abc import Callable, Iterator
from contextlib import contextmanager
from pathlib import Path
from typing import Any

from tqjax.errors import TqjaxError


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


def _followed(dest: str | Path) -> Path:
    """`dest`, or where it links to when it is a symbolic link: an output path that is a link
    (e.g. to a folder on a larger disk) is written through, the link kept (replacing the link
    itself put the output beside it and left the link, renamed, as a hidden leftover)."""
    dest = Path(dest)
    return Path(os.path.realpath(dest)) if dest.is_symlink() else dest


@contextmanager
def atomic_path(dest: str | Path) -> Iterator[Path]:
    """Yield a temp path next to `dest`; on clean exit it is fsynced and renamed onto `dest`,
    on an exception it is removed and `dest` is left untouched. A `dest` that is a symbolic
    link is written through (`_followed`)."""
    dest = _followed(dest)
    with _about(dest):
        _make_parents(dest)
        _sweep_stale(dest)
        fd, name = tempfile.mkstemp(prefix=f".{dest.name}.", suffix=".tmp", dir=dest.parent)
        os.close(fd)
        tmp = Path(name)
        try:
            with _held(tmp):
                yield tmp
            with open(tmp, "rb+") as f:
                os.fsync(f.fileno())
            os.chmod(tmp, 0o644)
            os.replace(tmp, dest)
        except BaseException:
            tmp.unlink(missing_ok=True)
            raise
    fsync_dir(dest.parent)


TEMP_RANDOM = 8  # the random part of tempfile's names
STALE_AFTER_S = 60.0  # a temp younger than this may be a writer's that has not locked it yet


def _try_lock(path: Path) -> int | None:
    """A descriptor of `path` holding its advisory lock (`flock`), or None where another
    process holds it, or locks do not work here."""
    try:
        import fcntl

        fd = os.open(path, os.O_RDONLY)
    except (ImportError, OSError):
        return None
    try:
        fcntl.flock(fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
    except OSError:
        os.close(fd)
        return None
    return fd


@contextmanager
def _held(path: Path) -> Iterator[None]:
    """Hold an advisory lock on a temp file or folder while it is written: the kernel drops it
    when the process dies, however it dies, so a later writer can tell a dead writer's temp
    (unlocked) from a live one's, in any PID namespace and, where locks work, on NFS. (Without
    locks the temp is not swept, as before.)"""
    fd = _try_lock(path)
    try:
        yield
    finally:
        if fd is not None:
            os.close(fd)


def _sweep_stale(dest: Path) -> None:
    """Remove the temps beside `dest` (its own names only: `.<name>.` + 8 random characters
    [+ `.tmp`]) that no live writer holds (`_held`), left by a writer killed without unwinding
    (kill -9, a lost machine): a quantize killed so left a hidden folder of its output's size.
    Best effort: what cannot be checked or removed (another user's file) is left."""
    pattern = re.compile(re.escape(f".{dest.name}.") + rf"[A-Za-z0-9_]{{{TEMP_RANDOM}}}"
                         r"(\.tmp)?")
    try:
        siblings = [p for p in dest.parent.iterdir() if pattern.fullmatch(p.name)]
    except OSError:
        return
    for path in siblings:
        try:
            if path.is_symlink() or time.time() - path.stat().st_mtime < STALE_AFTER_S:
                continue
        except OSError:
            continue
        fd = _try_lock(path)  # (None while a writer holds it)
        if fd is None:
            continue
        try:
            if path.is_dir():
                shutil.rmtree(path, ignore_errors=True)
            else:
                path.unlink(missing_ok=True)
        except OSError:
            pass
        finally:
            os.close(fd)


@contextmanager
def temp_dir_beside(dest: str | Path) -> Iterator[Path]:
    """Yield a scratch folder next to `dest` (`.<name>.` + random), held (`_held`) while in use
    and removed on exit; one left by a process killed without unwinding is swept by the next
    `temp_dir_beside` or write of `dest`."""
    dest = _followed(dest)
    with _about(dest):
        _make_parents(dest)
        _sweep_stale(dest)
        tmp = Path(tempfile.mkdtemp(prefix=f".{dest.name}.", dir=dest.parent))
    try:
        with _held(tmp):
            yield tmp
    finally:
        shutil.rmtree(tmp, ignore_errors=True)


@contextmanager
def exclusive(lock: str | Path, on_wait: Callable[[], None] | None = None) -> Iterator[bool]:
    """Hold an exclusive advisory lock (`flock`) on the file `lock` (made if missing) for the
    block, waiting for another process that holds it (`on_wait()` is called first, so that
    the wait can be announced); yields whether it had to wait. Where locks do not work, or
    the file can be neither made nor read, the block runs unlocked."""
    lock = Path(lock)
    fd = None
    try:
        import fcntl

        _make_parents(lock)
        try:
            fd = os.open(lock, os.O_RDWR | os.O_CREAT, 0o644)
        except PermissionError:  # (another user's lock file: flock works on a read-only one)
            fd = os.open(lock, os.O_RDONLY)
    except (ImportError, OSError):
        pass
    if fd is None:
        yield False
        return
    try:
        waited = False
        try:
            fcntl.flock(fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
        except BlockingIOError:
            waited = True
            if on_wait is not None:
                on_wait()
            fcntl.flock(fd, fcntl.LOCK_EX)
        except OSError:
            pass  # (no locks on this file system)
        yield waited
    finally:
        os.close(fd)


def _make_parents(dest: Path) -> None:
    """Make dest's missing folders; a file where a folder must be is NotADirectoryError (mkdir
    says "File exists")."""
    above = dest.parent
    while not above.exists() and above != above.parent:
        above = above.parent
    if not above.is_dir():
        raise NotADirectoryError(errno.ENOTDIR, os.strerror(errno.ENOTDIR), str(above))
    dest.parent.mkdir(parents=True, exist_ok=True)


@contextmanager
def _about(dest: Path) -> Iterator[None]:
    """An OSError about a temporary sibling of `dest` (".<name>.…"), or about no file at all
    (a write that failed), raised as the same error about `dest`, which the user knows; any
    other error as it is (a missing or unwritable folder keeps its own name)."""
    try:
        yield
    except OSError as e:
        name = Path(e.filename) if isinstance(e.filename, (str, os.PathLike)) else None
        if name is None and e.strerror:  # (a failed write or close names no file: a full disk)
            raise OSError(e.errno, e.strerror, str(dest)) from None
        if name is None or name.parent != dest.parent or not name.name.startswith(
                f".{dest.name}."):
            raise
        raise OSError(e.errno, e.strerror, str(dest)) from None


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
    with atomic_path(dest) as tmp, safetensors_io(dest):
        save_file(arrays, str(tmp), metadata=metadata)


@contextmanager
def safetensors_io(dest: str | Path) -> Iterator[None]:
    """safetensors' failed writes (a full disk: `SafetensorError`, "I/O error: No space left
    on device (os error 28)") raised as the OSError they are, about `dest`."""
    from safetensors import SafetensorError

    try:
        yield
    except SafetensorError as e:
        m = re.search(r"I/O error: (.*?) \(os error (\d+)\)", str(e))
        if m is None:
            raise
        raise OSError(int(m.group(2)), m.group(1), str(dest)) from None


def _fsync_file(path: Path) -> None:
    fd = os.open(path, os.O_RDONLY)
    try:
        os.fsync(fd)
    finally:
        os.close(fd)


def _exchange(a: Path, b: Path) -> bool:
    """Swap two paths in one atomic step (Linux renameat2 RENAME_EXCHANGE); False where the
    platform or file system cannot, so the caller falls back to two renames."""
    if sys.platform != "linux":
        return False
    try:
        libc = ctypes.CDLL(None, use_errno=True)
        fn = libc.renameat2
    except (OSError, AttributeError):
        return False
    at_fdcwd, rename_exchange = -100, 2
    if fn(at_fdcwd, os.fsencode(a), at_fdcwd, os.fsencode(b), rename_exchange) == 0:
        return True
    err = ctypes.get_errno()
    if err in (errno.ENOSYS, errno.EINVAL, errno.EOPNOTSUPP):
        return False
    raise OSError(err, f"cannot swap {a} and {b}: {os.strerror(err)}")


def recover_dir(dest: str | Path) -> None:
    """Finish a `replace_dir` that crashed between its two renames (fallback path): a missing
    `dest` whose previous version still sits at `.<name>.old` gets it back."""
    dest = Path(dest)
    old = dest.parent / f".{dest.name}.old"
    if not dest.exists() and old.is_dir():
        os.rename(old, dest)
        fsync_dir(dest.parent)


def replace_dir(dest: str | Path, build: Callable[[Path], None]) -> None:
    """Build a folder in a temp dir next to `dest` (build(tmp)), fsync its files, then swap it
    into place (a previous `dest` is replaced).

    At every instant `dest` is either the complete previous folder or the complete new one:
    the swap is one atomic exchange where the OS supports it; elsewhere `dest` is renamed to
    `.<name>.old` first, and a crash between the two renames is undone by `recover_dir` (which
    this function, and loaders, call first). The previous folder is deleted only once the new
    one is in place. A `dest` that is a symbolic link is written through (`_followed`).
    """
    dest = _followed(dest)
    with _about(dest):
        _make_parents(dest)
        recover_dir(dest)
        _sweep_stale(dest)
        tmp = Path(tempfile.mkdtemp(prefix=f".{dest.name}.", dir=dest.parent))
    with _held(tmp):
        _build_and_swap(dest, tmp, build)


def _build_and_swap(dest: Path, tmp: Path, build: Callable[[Path], None]) -> None:
    old = dest.parent / f".{dest.name}.old"
    try:
        build(tmp)
        for f in tmp.rglob("*"):
            if f.is_file() and not f.is_symlink():
                _fsync_file(f)
                os.chmod(f, 0o644)  # (as `atomic_path`'s files: some writers make 0600 files)
        fsync_dir(tmp)
        os.chmod(tmp, 0o755)
    except BaseException:
        shutil.rmtree(tmp, ignore_errors=True)
        raise
    if not dest.exists():
        os.rename(tmp, dest)
    elif _exchange(tmp, dest):
        old = tmp  # the exchange left the previous folder at tmp
    else:
        if old.exists():  # a stale leftover: dest exists, so this is not its only copy
            shutil.rmtree(old)
        os.rename(dest, old)
        os.rename(tmp, dest)
    fsync_dir(dest.parent)
    shutil.rmtree(old, ignore_errors=True)
    fsync_dir(dest.parent)


def read_json(path: str | Path, kind: type | None = None) -> Any:  # noqa: ANN401
    """The JSON in `path`; a missing, unreadable or corrupt file (or, with `kind`, one whose
    top level is not a `kind`, e.g. dict) is a TqjaxError with one line."""
    try:
        data = json.loads(Path(path).read_text(encoding="utf-8"))
    except OSError as e:
        raise TqjaxError(f"cannot read {path}: {e.strerror or e}") from None
    except (UnicodeDecodeError, json.JSONDecodeError) as e:
        raise TqjaxError(f"cannot read {path} (corrupt?): {e}") from None
    if kind is not None and not isinstance(data, kind):
        raise TqjaxError(f"cannot read {path}: expected a JSON {kind.__name__}, "
                         f"found a {type(data).__name__}")
    return data


def check_writable(path: Path, what: str = "--out", folder: bool = False,
                   whole: bool = False) -> Path:
    """Fail early, before any work, when `path` cannot be written: its nearest existing folder
    must take a new entry (missing folders are made when the output is written). A file output
    must not be a folder; `folder=True`: a folder that files are written into, created now if
    missing; `whole=True`: a folder written whole and swapped into place
    (`atomic.replace_dir`), so it may exist. Returns `path`; raises TqjaxError with one line
    otherwise."""
    path = Path(path)
    try:
        real = _followed(path)  # (checked where it will be written)
        if not (folder or whole) and real.is_dir():
            raise IsADirectoryError(21, "is a directory", str(path))
        if folder:
            real.mkdir(parents=True, exist_ok=True)
        target = real if folder else real.absolute().parent
        while not target.exists() and target != target.parent:
            target = target.parent
        with tempfile.TemporaryFile(dir=target):
            pass
    except OSError as e:
        raise TqjaxError(f"cannot write {what} {path}: {e.strerror or e}") from None
    return path
