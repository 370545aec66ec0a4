"""`tqjax.atomic.replace_dir`: the destination is always a whole folder, old or new."""

from __future__ import annotations

import os
import signal
import subprocess
import sys
import time
from pathlib import Path

import pytest

from tqjax import atomic


def _fill(text: str):
    def build(tmp):
        (tmp / "a.txt").write_text(text)
        (tmp / "sub").mkdir()
        (tmp / "sub" / "b.txt").write_text(text * 2)

    return build


def _read(d) -> tuple[str, str]:
    return (d / "a.txt").read_text(), (d / "sub" / "b.txt").read_text()


@pytest.mark.parametrize("exchange", [True, False])
def test_replace_dir_swaps_and_cleans_up(tmp_path, monkeypatch, exchange):
    if not exchange:
        monkeypatch.setattr(atomic, "_exchange", lambda a, b: False)
    dest = tmp_path / "ckpt"
    atomic.replace_dir(dest, _fill("one"))
    atomic.replace_dir(dest, _fill("two"))
    assert _read(dest) == ("two", "twotwo")
    assert sorted(p.name for p in tmp_path.iterdir()) == ["ckpt"]  # no temp or .old left


def test_failed_build_leaves_previous_folder(tmp_path):
    dest = tmp_path / "ckpt"
    atomic.replace_dir(dest, _fill("one"))

    def broken(tmp):
        (tmp / "a.txt").write_text("partial")
        raise RuntimeError("disk full")

    with pytest.raises(RuntimeError):
        atomic.replace_dir(dest, broken)
    assert _read(dest) == ("one", "oneone")
    assert sorted(p.name for p in tmp_path.iterdir()) == ["ckpt"]


def test_crash_between_renames_is_recovered(tmp_path, monkeypatch):
    """Fallback path (no atomic exchange): a crash after dest was moved aside must not lose the
    previous folder, and the next replace (or a loader's recover_dir) puts it back first."""
    monkeypatch.setattr(atomic, "_exchange", lambda a, b: False)
    dest = tmp_path / "ckpt"
    atomic.replace_dir(dest, _fill("one"))
    real_rename, calls = os.rename, []

    def crash_on_second(src, dst):
        calls.append((src, dst))
        if len(calls) == 2:
            raise KeyboardInterrupt("power cut")
        real_rename(src, dst)

    monkeypatch.setattr(atomic.os, "rename", crash_on_second)
    with pytest.raises(KeyboardInterrupt):
        atomic.replace_dir(dest, _fill("two"))
    monkeypatch.setattr(atomic.os, "rename", real_rename)
    assert not dest.exists()  # the crash window of the two-rename fallback
    old = tmp_path / ".ckpt.old"
    assert _read(old) == ("one", "oneone")  # ... but the previous folder is intact
    atomic.recover_dir(dest)
    assert _read(dest) == ("one", "oneone")
    atomic.replace_dir(dest, _fill("three"))
    assert _read(dest) == ("three", "threethree")


def test_stale_old_is_restored_not_deleted(tmp_path, monkeypatch):
    """A leftover .old with dest missing is the only copy: replace_dir restores it before
    building, and removes it only after the new folder is in place."""
    monkeypatch.setattr(atomic, "_exchange", lambda a, b: False)
    dest, old = tmp_path / "ckpt", tmp_path / ".ckpt.old"
    old.mkdir()
    (old / "a.txt").write_text("previous")

    def check_restored(tmp):
        assert (dest / "a.txt").read_text() == "previous"
        _fill("new")(tmp)

    atomic.replace_dir(dest, check_restored)
    assert _read(dest) == ("new", "newnew") and not old.exists()


def test_errors_name_the_destination_not_the_temporary_path(tmp_path, monkeypatch):
    """A failed write names the path the caller gave, not its temporary sibling (internal);
    a folder that cannot be made keeps its own name (the real problem)."""
    blocker = tmp_path / "file"
    blocker.write_text("x")
    with pytest.raises(OSError) as e, atomic.atomic_path(blocker / "out.json"):
        pass
    assert e.value.filename == str(blocker)
    with pytest.raises(OSError) as e:
        atomic.replace_dir(blocker / "ckpt", _fill("a"))
    assert e.value.filename == str(blocker)

    def refuse(*a, prefix: str, dir, **k):  # noqa: A002  (an unwritable folder: /proc)
        raise PermissionError(13, "Permission denied", os.path.join(dir, prefix + "x1y2"))

    monkeypatch.setattr(atomic.tempfile, "mkstemp", refuse)
    monkeypatch.setattr(atomic.tempfile, "mkdtemp", refuse)
    with pytest.raises(OSError) as e, atomic.atomic_path(tmp_path / "out.json"):
        pass
    assert e.value.filename == str(tmp_path / "out.json")
    with pytest.raises(OSError) as e:
        atomic.replace_dir(tmp_path / "ckpt", _fill("a"))
    assert e.value.filename == str(tmp_path / "ckpt")
    monkeypatch.undo()

    def fail(tmp):
        raise OSError(28, "No space left on device", str(tmp))

    with pytest.raises(OSError) as e, atomic.atomic_path(tmp_path / "x.json") as tmp:
        fail(tmp)
    assert e.value.filename == str(tmp_path / "x.json") and not list(tmp_path.glob(".x.json*"))


def test_files_are_readable_by_others(tmp_path):
    """Every file of a replaced folder is 0644, as `atomic_path`'s are, whatever mode its
    writer made (safetensors' writer makes 0600 files)."""
    def build(tmp):
        (tmp / "w.bin").write_bytes(b"1")
        os.chmod(tmp / "w.bin", 0o600)

    atomic.replace_dir(tmp_path / "d", build)
    assert (tmp_path / "d" / "w.bin").stat().st_mode & 0o777 == 0o644
    with atomic.atomic_path(tmp_path / "f") as tmp:
        tmp.write_text("x")
    assert (tmp_path / "f").stat().st_mode & 0o777 == 0o644


def test_sigterm_removes_the_half_built_folder(tmp_path):
    """A CLI stopped with SIGTERM (kill, a job scheduler) exits 143 through Python's unwinding,
    so `replace_dir` removes its temp folder and the previous output stays as it was (the
    default action killed the process and left `.out.XXXX` behind: 160 MB per quantize).

    The child's work is short sleeps, as real work returns to Python often: a signal that
    lands after Python's last check but before a long sleep begins runs its handler only when
    that sleep ends (CPython checks after the syscall, not before), which made a single
    120 s sleep fail the 60 s wait once in CI."""
    dest = tmp_path / "out"
    dest.mkdir()
    (dest / "old").write_text("previous")
    script = ("import sys, time\n"
              "from tqjax.atomic import replace_dir\n"
              "from tqjax.cli import run_main\n"
              "def build(tmp):\n"
              "    (tmp / 'part').write_text('half')\n"
              "    for _ in range(1200):\n"
              "        time.sleep(0.1)\n"
              f"run_main(lambda: replace_dir({str(dest)!r}, build))\n")
    proc = subprocess.Popen([sys.executable, "-c", script], stderr=subprocess.PIPE, text=True)
    deadline = time.monotonic() + 120
    while not any(tmp_path.glob(".out.*/part")):
        assert proc.poll() is None and time.monotonic() < deadline, proc.stderr.read()
        time.sleep(0.05)
    proc.send_signal(signal.SIGTERM)
    assert proc.wait(60) == 143, proc.stderr.read()
    assert sorted(p.name for p in tmp_path.iterdir()) == ["out"]
    assert (dest / "old").read_text() == "previous"


def test_read_json_says_missing_for_a_missing_file_and_corrupt_for_a_corrupt_one(tmp_path):
    from tqjax.errors import TqjaxError

    with pytest.raises(TqjaxError, match=r"^cannot read .*nowhere\.json: No such file"):
        atomic.read_json(tmp_path / "nowhere.json")
    (tmp_path / "half.json").write_text('{"a": ')
    with pytest.raises(TqjaxError, match=r"half\.json \(corrupt\?\)"):
        atomic.read_json(tmp_path / "half.json")
    (tmp_path / "list.json").write_text("[1]")
    with pytest.raises(TqjaxError, match="expected a JSON dict, found a list"):
        atomic.read_json(tmp_path / "list.json", dict)
    assert atomic.read_json(tmp_path / "list.json") == [1]


def _writer(dest, tmp_path, sleep_s=120):
    """A child process in the middle of a `replace_dir` to `dest`; returns it and its temp."""
    script = ("import time\n"
              "from tqjax.atomic import replace_dir\n"
              "def build(tmp):\n"
              "    (tmp / 'part').write_text('half')\n"
              f"    time.sleep({sleep_s})\n"
              f"replace_dir({str(dest)!r}, build)\n")
    before = set(tmp_path.glob(f".{dest.name}.*/part"))
    proc = subprocess.Popen([sys.executable, "-c", script], stderr=subprocess.PIPE, text=True)
    deadline = time.monotonic() + 120
    while not (found := list(set(tmp_path.glob(f".{dest.name}.*/part")) - before)):
        assert proc.poll() is None and time.monotonic() < deadline, proc.stderr.read()
        time.sleep(0.05)
    return proc, found[0].parent


def test_a_killed_writers_temp_is_removed_by_the_next_write(tmp_path):
    """kill -9 leaves the hidden temp folder (no unwinding); the next write to the same target
    removes it once it is a minute old. A live writer's temp (it holds a lock on it) is kept,
    however old, and so are other targets' temps and young ones."""
    dest = tmp_path / "out"
    dead, dead_tmp = _writer(dest, tmp_path)
    dead.kill()
    dead.wait(60)
    live, live_tmp = _writer(dest, tmp_path)
    young = tmp_path / ".out.abcdefgh.tmp"  # no lock yet, just made: a writer's first moment
    young.write_text("x")
    other = tmp_path / ".out.abcdefgh.ijklmnop"  # the temp of a target named "out.abcdefgh"
    other.mkdir()
    old = time.time() - 3600
    for p in (dead_tmp, live_tmp, other):
        os.utime(p, (old, old))
    try:
        atomic.replace_dir(dest, lambda tmp: (tmp / "new").write_text("whole"))
        left = sorted(p.name for p in tmp_path.iterdir())
        assert left == sorted([live_tmp.name, young.name, other.name, "out"]), left
        assert (dest / "new").read_text() == "whole"
    finally:
        live.kill()
        live.wait(60)
    os.utime(young, (old, old))
    atomic.replace_dir(dest, lambda tmp: None)  # the writer is dead now; the old file goes too
    assert not young.exists() and not live_tmp.exists()
    stale = tmp_path / ".f.abcdefgh.tmp"  # a file target's own temp file
    stale.write_text("half")
    os.utime(stale, (old, old))
    atomic.write_text(tmp_path / "f", "whole")
    assert sorted(p.name for p in tmp_path.iterdir()) == sorted(["out", "f", other.name])


@pytest.mark.parametrize("exchange", [True, False])
def test_an_output_that_is_a_link_is_written_through_it(tmp_path, monkeypatch, exchange):
    """A link to a folder (or file) elsewhere: the output goes where it points and the link
    stays (the link itself was replaced: the output landed beside it and the link, renamed
    to a hidden name, was never removed)."""
    if not exchange:
        monkeypatch.setattr(atomic, "_exchange", lambda a, b: False)
    elsewhere = tmp_path / "disk" / "ckpt"
    elsewhere.mkdir(parents=True)
    (elsewhere / "old.txt").write_text("old")
    link = tmp_path / "out" / "ckpt"
    link.parent.mkdir()
    link.symlink_to(elsewhere)
    assert atomic.check_writable(link, whole=True) == link
    atomic.replace_dir(link, lambda d: (d / "new.txt").write_text("new"))
    assert link.is_symlink() and os.readlink(link) == str(elsewhere)
    assert sorted(p.name for p in elsewhere.iterdir()) == ["new.txt"]
    assert sorted(p.name for p in link.parent.iterdir()) == ["ckpt"]
    assert sorted(p.name for p in elsewhere.parent.iterdir()) == ["ckpt"]
    file_link, target = tmp_path / "out" / "run.json", tmp_path / "disk" / "run.json"
    file_link.symlink_to(target)  # dangling until written
    atomic.write_json(file_link, {"a": 1})
    assert file_link.is_symlink() and target.read_text().startswith("{")


def test_a_full_disk_is_an_oserror_about_the_target(tmp_path, monkeypatch):
    """safetensors reports a full disk as a SafetensorError ("I/O error: No space left on
    device (os error 28)": a traceback and exit 1 from --prompt-cache and tqjax-quantize), and
    a failed write names no file ("error: No space left on device"): both are now the OSError
    they are, about the target the user named, with nothing left beside it (found by QA)."""
    import errno

    import numpy as np
    import safetensors.numpy
    from safetensors import SafetensorError

    from tqjax.cli import user_error_text

    def full(*a, **k):
        raise SafetensorError("Error while serializing: I/O error: No space left on device "
                              "(os error 28)")

    monkeypatch.setattr(safetensors.numpy, "save_file", full)
    dest = tmp_path / "pc.safetensors"
    with pytest.raises(OSError) as e:
        atomic.write_safetensors(dest, {"a": np.zeros(3, np.float32)})
    assert (e.value.errno, e.value.filename) == (errno.ENOSPC, str(dest))
    assert user_error_text(e.value) == f"No space left on device: {dest}"
    assert list(tmp_path.iterdir()) == []

    def write_fails(self, *a, **k):
        raise OSError(errno.ENOSPC, "No space left on device")

    monkeypatch.setattr(Path, "write_text", write_fails)
    with pytest.raises(OSError) as e:
        atomic.write_text(tmp_path / "b.json", "{}")
    assert (e.value.errno, e.value.filename) == (errno.ENOSPC, str(tmp_path / "b.json"))
    assert list(tmp_path.iterdir()) == []


def test_exclusive_waits_for_the_holder_and_says_so_first(tmp_path):
    """A second holder waits; `on_wait` runs before the wait (a fetch says it is waiting,
    instead of hanging silently for a download's minutes), and an error inside the block
    carries no lock-file error as its context."""
    import threading

    from tqjax.atomic import exclusive

    lock = tmp_path / "locks" / "m.lock"  # (the folder is made)
    events: list[str] = []
    with exclusive(lock) as waited:
        assert waited is False
        t = threading.Thread(target=lambda: events.append(
            "waited" if _enter(lock, events) else "free"))
        t.start()
        time.sleep(0.3)
        assert events == ["on_wait"]
    t.join(10)
    assert events == ["on_wait", "waited"]
    (tmp_path / "f").write_text("a file where the lock's folder would be")
    with pytest.raises(ValueError) as e, exclusive(tmp_path / "f" / "x.lock") as waited:
        assert waited is False  # (no lock to be had: the block runs unlocked)
        raise ValueError("inside")
    assert e.value.__context__ is None


def _enter(lock, events) -> bool:
    from tqjax.atomic import exclusive

    with exclusive(lock, lambda: events.append("on_wait")) as waited:
        return waited
