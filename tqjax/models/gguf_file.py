"""A GGUF file's header: its key/values and tensor index, read straight into Python values.

Why not `gguf.GGUFReader` (which `tests/test_gguf_file.py` keeps as the reference): it makes
two numpy memmap views for every string of the file (a length and the bytes, ~1.5 KB of
objects each) before a value is read, so Qwen2.5's 151k tokens and 151k merges held ~530 MB
for the length of the parse: more than the model's tq4 weights, the peak of a GGUF load's
first seconds. Here each value is made once, as the str, int, float, bool or list that
`ReaderField.contents()` gives, from one read-only memory map that is closed afterwards.
The value and tensor types, numeric dtypes and block sizes are gguf's own; the layout is the
GGUF specification's (versions 2 and 3, little-endian).
"""

from __future__ import annotations

import dataclasses
import mmap
import struct
from pathlib import Path
from typing import Any

import numpy as np
from gguf import GGML_QUANT_SIZES, GGMLQuantizationType, GGUFReader, GGUFValueType

from tqjax.errors import TqjaxError

GGUF_MAGIC = b"GGUF"
VERSIONS = (2, 3)
DEFAULT_ALIGNMENT = 32
# GGUF's numeric value types -> their little-endian numpy dtypes (gguf's own table)
NUMERIC = {int(kind): np.dtype(t).newbyteorder("<")
           for kind, t in GGUFReader.gguf_scalar_to_np.items()}


@dataclasses.dataclass(frozen=True)
class GGUFTensor:
    """One tensor's entry in the index: `shape` in GGUF order (fastest axis first), its
    ggml type, and where its `nbytes` bytes start in the file."""

    name: str
    shape: tuple[int, ...]
    ggml_type: GGMLQuantizationType
    offset: int  # bytes from the start of the file
    nbytes: int


class _Cursor:
    """Reads little-endian GGUF values from a buffer, advancing an offset."""

    def __init__(self, buf: Any) -> None:
        self.buf, self.pos = buf, 0

    def scalar(self, fmt: str) -> Any:
        (value,) = struct.unpack_from("<" + fmt, self.buf, self.pos)
        self.pos += struct.calcsize(fmt)
        return value

    def string(self) -> str:
        n = self.scalar("Q")
        end = self.pos + n
        if end > len(self.buf):
            raise ValueError("a string runs past the end of the file")
        text = str(self.buf[self.pos:end], "utf-8")
        self.pos = end
        return text

    def numbers(self, dtype: np.dtype, count: int) -> list[Any]:
        values = np.frombuffer(self.buf, dtype, count, self.pos)
        self.pos += values.nbytes
        return values.tolist()

    def value(self, kind: int) -> Any:
        if kind == GGUFValueType.STRING:
            return self.string()
        if kind in NUMERIC:
            return self.numbers(NUMERIC[kind], 1)[0]
        if kind != GGUFValueType.ARRAY:
            raise ValueError(f"unknown value type {kind}")
        item, count = self.scalar("I"), self.scalar("Q")
        if item in NUMERIC:  # a numeric array in one read
            return self.numbers(NUMERIC[item], count)
        return [self.value(item) for _ in range(count)]


def read_header(path: Path) -> tuple[dict[str, Any], list[GGUFTensor]]:
    """The key/values (with "GGUF.version", "GGUF.tensor_count" and "GGUF.kv_count", as
    `gguf.GGUFReader` lists them) and the tensor index of the GGUF file at `path`.
    A file that is not GGUF, truncated or corrupt raises `TqjaxError` (one line)."""
    try:
        with (open(path, "rb") as f, mmap.mmap(f.fileno(), 0, access=mmap.ACCESS_READ) as m,
              memoryview(m) as buf):
            return _parse(buf)
    except (ValueError, KeyError, struct.error, OSError, OverflowError) as e:
        raise TqjaxError(f"cannot read GGUF file {path} (truncated or corrupt?): {e}") from None


def _parse(buf: memoryview) -> tuple[dict[str, Any], list[GGUFTensor]]:
    c = _Cursor(buf)
    if bytes(buf[:4]) != GGUF_MAGIC:
        raise ValueError("no GGUF magic")
    c.pos = 4
    version = c.scalar("I")
    if version & 0xFFFF == 0:
        raise ValueError("a big-endian GGUF file (only little-endian files are read)")
    if version not in VERSIONS:
        raise ValueError(f"GGUF version {version} (versions {VERSIONS} are read)")
    n_tensors, n_kv = c.scalar("Q"), c.scalar("Q")
    meta: dict[str, Any] = {"GGUF.version": version, "GGUF.tensor_count": n_tensors,
                            "GGUF.kv_count": n_kv}
    kinds: dict[str, int] = {}
    for _ in range(n_kv):
        key = c.string()
        kinds[key] = kind = c.scalar("I")
        meta[key] = c.value(kind)
    infos = []
    for _ in range(n_tensors):
        name = c.string()
        dims = tuple(c.scalar("Q") for _ in range(c.scalar("I")))
        infos.append((name, dims, c.scalar("I"), c.scalar("Q")))
    align = meta.get("general.alignment", DEFAULT_ALIGNMENT)
    if "general.alignment" in meta and (kinds["general.alignment"] != GGUFValueType.UINT32
                                        or align <= 0 or align & (align - 1)):
        raise ValueError(f"bad general.alignment {align!r}")
    start = -(-c.pos // align) * align  # the tensor data, aligned
    tensors, names = [], set()
    for name, dims, raw_type, offset in infos:
        if name in names:
            raise ValueError(f"tensor {name!r} twice")
        names.add(name)
        ggml_type = GGMLQuantizationType(raw_type)
        block, size = GGML_QUANT_SIZES[ggml_type]
        elements = int(np.prod(dims, dtype=np.int64)) if dims else 1
        t = GGUFTensor(name, dims, ggml_type, start + offset, elements * size // block)
        if t.offset + t.nbytes > len(buf):
            raise ValueError(f"tensor {name!r} runs past the end of the file")
        tensors.append(t)
    return meta, tensors
