"""The GGUF header reader (`tqjax.models.gguf_file`) against gguf's own `GGUFReader`: the same
key/values (values, Python types and order) and tensor index for files written by
`gguf.GGUFWriter` with every value type and several tensor types, and on the real models;
clean one-line errors on damaged files; and the memory it takes on a 151k-token vocabulary."""

import gguf
import numpy as np
import pytest
from gguf import GGMLQuantizationType as T

from tqjax.errors import TqjaxError
from tqjax.models.gguf_file import read_header


def reader_header(path):
    """The reference: gguf.GGUFReader's fields (`contents()`, where a field has one) and its
    tensors as (name, shape in GGUF order, type, offset, bytes)."""
    r = gguf.GGUFReader(str(path))
    meta = {}
    for key, field in r.fields.items():
        try:
            meta[key] = field.contents()
        except Exception:  # noqa: S112 - a few structural fields have no content
            continue
    tensors = [(t.name, tuple(int(d) for d in t.shape), t.tensor_type, int(t.data_offset),
                int(t.n_bytes)) for t in r.tensors]
    return meta, tensors


def assert_same_as_reader(path):
    meta, tensors = read_header(path)
    want_meta, want_tensors = reader_header(path)
    assert meta == want_meta and list(meta) == list(want_meta)
    for key, value in want_meta.items():
        assert type(meta[key]) is type(value), key
        if isinstance(value, list):
            assert [type(x) for x in meta[key]] == [type(x) for x in value], key
    assert [(t.name, t.shape, t.ggml_type, t.offset, t.nbytes) for t in tensors] == want_tensors
    return meta, tensors


def write(path, alignment=None, endian=gguf.GGUFEndian.LITTLE):
    """A GGUF with one key of every value type and tensors of four ggml types."""
    V = gguf.GGUFValueType
    w = gguf.GGUFWriter(str(path), "llama", endianess=endian)
    if alignment:
        w.add_custom_alignment(alignment)
    values = {"u8": (200, V.UINT8), "i8": (-100, V.INT8), "u16": (60000, V.UINT16),
              "i16": (-30000, V.INT16), "u32": (4_000_000_000, V.UINT32),
              "i32": (-2_000_000_000, V.INT32), "u64": (2**63 + 5, V.UINT64),
              "i64": (-(2**62), V.INT64), "f32": (0.1, V.FLOAT32), "f64": (0.1, V.FLOAT64),
              "bool": (True, V.BOOL), "str": ("héllo ✓", V.STRING)}
    for key, (value, kind) in values.items():
        w.add_key_value(f"test.{key}", value, kind)
    w.add_key_value("test.empty", "", V.STRING)
    w.add_array("test.strings", ["a", "", "Ġthe", "日本", "\n"])
    w.add_array("test.ints", [1, -2, 3])
    w.add_array("test.floats", [0.5, -1.25, 1e-8])
    w.add_array("test.bools", [True, False])
    rng = np.random.default_rng(0)
    x = rng.standard_normal((4, 256)).astype(np.float32)
    w.add_tensor("token_embd.weight", x)
    w.add_tensor("output_norm.weight", x[0].astype(np.float16))
    for kind in (T.Q8_0, T.Q4_K):  # blocks as bytes (any bytes: only the index is read)
        block, size = gguf.GGML_QUANT_SIZES[kind]
        w.add_tensor(f"blk.0.{kind.name}.weight",
                     rng.integers(0, 256, (4, 256 // block * size), np.uint8), raw_dtype=kind)
    w.write_header_to_file()
    w.write_kv_data_to_file()
    w.write_tensors_to_file()
    w.close()
    return path


@pytest.mark.parametrize("alignment", [None, 64])
def test_header_equals_the_readers(tmp_path, alignment):
    meta, tensors = assert_same_as_reader(write(tmp_path / "t.gguf", alignment))
    assert meta["test.u64"] == 2**63 + 5 and meta["test.f32"] == float(np.float32(0.1))
    assert meta["test.strings"][3] == "日本"
    assert [t.ggml_type for t in tensors] == [T.F32, T.F16, T.Q8_0, T.Q4_K]
    assert all(t.offset % (alignment or 32) == 0 for t in tensors)
    data = (tmp_path / "t.gguf").read_bytes()  # the F32 tensor's bytes are where it says
    t = tensors[0]
    got = np.frombuffer(data, np.float32, t.nbytes // 4, t.offset).reshape(4, 256)
    np.testing.assert_array_equal(got, np.random.default_rng(0).standard_normal(
        (4, 256)).astype(np.float32))


@pytest.mark.parametrize("damage", ["magic", "cut_header", "cut_tensor", "big_endian",
                                    "version", "type"])
def test_damaged_files_are_one_line_errors(tmp_path, damage):
    path = write(tmp_path / "t.gguf", endian=gguf.GGUFEndian.BIG if damage == "big_endian"
                 else gguf.GGUFEndian.LITTLE)
    data = bytearray(path.read_bytes())
    meta, tensors = read_header(path) if damage != "big_endian" else ({}, [])
    if damage == "magic":
        data[:4] = b"GGML"
    elif damage == "cut_header":
        data = data[:200]
    elif damage == "cut_tensor":
        data = data[:-10]
    elif damage == "version":
        data[4:8] = (1).to_bytes(4, "little")
    elif damage == "type":  # the last tensor info's type field -> an unknown ggml type
        at = tensors[0].offset - 1
        while data[at - 12:at - 8] != int(T.Q4_K).to_bytes(4, "little"):
            at -= 1
        data[at - 12:at - 8] = (999).to_bytes(4, "little")
    path.write_bytes(bytes(data))
    with pytest.raises(TqjaxError, match="cannot read GGUF") as e:
        read_header(path)
    assert "\n" not in str(e.value)


@pytest.mark.slow
@pytest.mark.parametrize("name", ["smollm2-135m-instruct", "qwen2.5-coder-0.5b-instruct",
                                  pytest.param("qwen2.5-coder-1.5b-instruct",
                                               marks=pytest.mark.large)])
def test_real_model_headers_equal_the_readers(name):
    import tracemalloc

    from tqjax.fetch import fetch_model

    path = fetch_model(name)
    tracemalloc.start()
    meta, _ = read_header(path)
    held, peak = tracemalloc.get_traced_memory()
    tracemalloc.stop()
    assert_same_as_reader(path)
    # the header of a 151k-token vocabulary (tokens and merges): 26 MB measured, held as the
    # values themselves (gguf.GGUFReader: ~530 MB of views while it parses)
    assert peak < 32 << 20 and peak - held < 2 << 20
    assert len(meta["tokenizer.ggml.tokens"]) in (49152, 151936)
