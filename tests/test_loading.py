"""Streaming load: params equal to an eager numpy reference (safetensors and GGUF, every dtype),
GGUF blocks kept as the file has them (`weights="gguf"`), clean errors."""

import gguf
import jax
import jax.numpy as jnp
import numpy as np
import pytest
from gguf import GGMLQuantizationType as T
from safetensors.numpy import load_file

import tqjax
from tqjax.api import Model
from tqjax.errors import TqjaxError
from tqjax.models import loading
from tqjax.models.loading import load_checkpoint, read_hf_config
from tqjax.quant import half
from tqjax.quant.half import HalfLinear

from .conftest import GOLDEN

DTYPES = {"float32": jnp.float32, "bfloat16": jnp.bfloat16, "float16": jnp.float16}
LINEAR_FIELDS = {"wq": "self_attn.q_proj", "wk": "self_attn.k_proj", "wv": "self_attn.v_proj",
                 "wo": "self_attn.o_proj", "w_gate": "mlp.gate_proj", "w_up": "mlp.up_proj",
                 "w_down": "mlp.down_proj"}
DENSE_FIELDS = {"attn_norm": "input_layernorm.weight",
                "mlp_norm": "post_attention_layernorm.weight",
                "bq": "self_attn.q_proj.bias", "bk": "self_attn.k_proj.bias",
                "bv": "self_attn.v_proj.bias", "q_norm": "self_attn.q_norm.weight",
                "k_norm": "self_attn.k_norm.weight"}


def expected_params(hf: dict[str, np.ndarray], params, dtype):
    """(got, want) pairs: every leaf of `params` against the HF f32 tensors `hf`, cast with
    jnp.asarray like the eager loader did; linears transposed to [in, out], or in a half
    dtype kept [out, in] as a `HalfLinear` (which must be what a half dtype loads)."""
    def linear(got, stored: np.ndarray):
        assert isinstance(got, HalfLinear) == (dtype != jnp.float32)
        if isinstance(got, HalfLinear):
            assert got.dtype == jnp.dtype(dtype).name
            return jax.lax.bitcast_convert_type(got.bits, dtype), jnp.asarray(stored, dtype)
        return got, jnp.asarray(stored.T, dtype)

    pairs = [(params.embed, jnp.asarray(hf["model.embed_tokens.weight"], dtype)),
             (params.final_norm, jnp.asarray(hf["model.norm.weight"], dtype))]
    if params.lm_head is not None:
        pairs.append(linear(params.lm_head, hf["lm_head.weight"]))
    for i, lp in enumerate(params.layers):
        p = f"model.layers.{i}."
        pairs += [linear(getattr(lp, f), hf[p + n + ".weight"]) for f, n in LINEAR_FIELDS.items()]
        pairs += [(getattr(lp, f), jnp.asarray(hf[p + n], dtype))
                  for f, n in DENSE_FIELDS.items() if getattr(lp, f) is not None]
    return pairs


@pytest.mark.parametrize("name", ["llama", "llama_tied", "qwen2", "qwen3"])
@pytest.mark.parametrize("dtype", list(DTYPES))
def test_safetensors_stream_equals_eager(name, dtype):
    path = GOLDEN / "tiny" / name
    _, params, _ = load_checkpoint(path, dtype)
    pairs = expected_params(load_file(path / "model.safetensors"), params, DTYPES[dtype])
    assert len(pairs) == 2 + (params.lm_head is not None) + sum(
        9 + 3 * (lp.bq is not None) + 2 * (lp.q_norm is not None) for lp in params.layers)
    for got, want in pairs:
        assert got.dtype == want.dtype
        np.testing.assert_array_equal(np.asarray(got), np.asarray(want))


# ---------------------------------------------------------------- tiny GGUF files

# ggml types per HF tensor (by suffix; layer 1's v_proj is F16: dense even with blocks kept)
GGUF_TYPES = {"embed_tokens": T.Q8_0, "lm_head": T.Q8_0, "q_proj.weight": T.Q4_0,
              "k_proj.weight": T.Q4_1, "v_proj.weight": T.Q5_0, "o_proj": T.Q5_1,
              "gate_proj": T.Q8_0, "up_proj": T.Q4_1, "down_proj": T.Q4_0}
GGUF_NAMES = {v: k for k, v in loading.GGUF_LAYER_NAMES.items()}


def llama_cpp_permute(w: np.ndarray, n_head: int) -> np.ndarray:
    """llama.cpp's convert_hf_to_gguf permutation of Q/K rows (half-split -> interleaved)."""
    return w.reshape(n_head, 2, w.shape[0] // n_head // 2, *w.shape[1:]).swapaxes(1, 2).reshape(
        w.shape)


def ggml_type(hf_name: str) -> T:
    if hf_name == "model.layers.1.self_attn.v_proj.weight":
        return T.F16
    if hf_name.endswith(("norm.weight", ".bias")):
        return T.F32
    return next(t for k, t in GGUF_TYPES.items() if k in hf_name)


def write_gguf(name: str, path):
    """golden/tiny/<name> as a GGUF file with quantized matrices; returns the HF tensors as the
    file's ggml types round them (gguf's own quantize + dequantize), in HF row order, and the
    quantized bytes of each quantized matrix in HF row order."""
    src = GOLDEN / "tiny" / name
    cfg = read_hf_config(src)
    hf = load_file(src / "model.safetensors")
    w = gguf.GGUFWriter(str(path), cfg.arch)
    w.add_block_count(cfg.num_layers)
    w.add_context_length(cfg.max_position)
    w.add_embedding_length(cfg.hidden_size)
    w.add_feed_forward_length(cfg.intermediate_size)
    w.add_head_count(cfg.num_heads)
    w.add_head_count_kv(cfg.num_kv_heads)
    w.add_layer_norm_rms_eps(cfg.rms_eps)
    w.add_rope_freq_base(cfg.rope_theta)
    w.add_vocab_size(cfg.vocab_size)
    rounded, blocks = {}, {}
    for hf_name, value in hf.items():
        if hf_name.startswith("model.layers."):
            _, _, i, rest = hf_name.split(".", 3)
            gguf_name = f"blk.{i}.{GGUF_NAMES[rest]}"
        else:
            gguf_name = {v: k for k, v in loading.GGUF_GLOBAL_NAMES.items()}[hf_name]
        t = ggml_type(hf_name)
        stored = value
        if cfg.arch == "llama" and hf_name.endswith(("q_proj.weight", "k_proj.weight")):
            heads = cfg.num_heads if "q_proj" in hf_name else cfg.num_kv_heads
            stored = llama_cpp_permute(value, heads)
        if t == T.F32:
            w.add_tensor(gguf_name, stored)
            rounded[hf_name] = value
            continue
        data = gguf.quants.quantize(stored, t)
        w.add_tensor(gguf_name, data, raw_dtype=t)
        rounded[hf_name] = gguf.quants.dequantize(gguf.quants.quantize(value, t), t)
        if t != T.F16:
            blocks[hf_name] = gguf.quants.quantize(value, t)  # row-wise: commutes with permuting
    w.write_header_to_file()
    w.write_kv_data_to_file()
    w.write_tensors_to_file()
    w.close()
    return rounded, blocks


@pytest.fixture(scope="module", params=["llama", "qwen2"])
def tiny_gguf(request, tmp_path_factory):
    path = tmp_path_factory.mktemp("gguf") / f"{request.param}.gguf"
    rounded, blocks = write_gguf(request.param, path)
    return path, rounded, blocks


def test_adopted_host_buffers_go_at_release_adopted():
    """jax adopts a host_buffer without a copy and, once its array is dropped, frees it only at
    its next transfer: `release_adopted` is that transfer (the buffer then has no owner left)."""
    import weakref

    from tqjax.host import host_buffer, release_adopted

    m = host_buffer((256, 256), np.float32)
    m[:] = 1
    root = m
    while isinstance(root.base, np.ndarray):
        root = root.base
    owner = weakref.ref(root)
    a = jax.device_put(m)
    assert a.unsafe_buffer_pointer() == m.ctypes.data  # adopted, not copied
    del m, a, root
    assert owner() is not None  # still held by the runtime
    release_adopted()
    assert owner() is None


def test_trim_heap_returns_freed_small_allocations():
    """Freed small allocations stay resident in glibc's heap until `trim_heap` (malloc_trim)
    hands their pages back: RSS falls by most of what was freed."""
    import platform

    from tqjax.host import trim_heap

    if platform.libc_ver()[0] != "glibc":
        pytest.skip("malloc_trim is glibc's")

    def rss() -> int:
        with open("/proc/self/status") as f:
            return next(int(line.split()[1]) for line in f if line.startswith("VmRSS")) << 10

    blocks = [bytearray(4000) for _ in range(50_000)]  # 200 MB of small heap blocks
    keep = blocks[::50]  # a few stay, so the heap's top is not simply given back
    del blocks
    before = rss()
    trim_heap()
    assert before - rss() > 150e6
    del keep


@pytest.mark.parametrize("dtype", list(DTYPES))
def test_gguf_stream_equals_eager(tiny_gguf, dtype):
    path, rounded, _ = tiny_gguf
    _, params, _ = load_checkpoint(path, dtype)
    for got, want in expected_params(rounded, params, DTYPES[dtype]):
        assert got.dtype == want.dtype
        np.testing.assert_array_equal(np.asarray(got), np.asarray(want))


def test_gguf_metadata_comes_before_any_tensor_read(tiny_gguf, monkeypatch):
    """`on_metadata` (where tqjax.load builds the tokenizer) runs before a tensor byte is read,
    so its transient memory peaks while no params are resident."""
    reads: list[int] = []
    seen: list[tuple[int, int]] = []
    real = loading.read_file_bytes
    monkeypatch.setattr(loading, "read_file_bytes", lambda *a: reads.append(1) or real(*a))
    _, _, meta = load_checkpoint(tiny_gguf[0], blocks=True,
                                 on_metadata=lambda m: seen.append((len(reads), len(m))))
    assert seen == [(0, len(meta))] and len(reads) > 0


def test_unsupported_architecture_is_named_before_the_tokenizer(tmp_path):
    """The config is read before the tokenizer is built: a model tqjax cannot run says so,
    not that its tokenizer is unsupported."""
    path = tmp_path / "mamba.gguf"
    w = gguf.GGUFWriter(str(path), "mamba")
    w.add_key_value("tokenizer.ggml.model", "bert", gguf.GGUFValueType.STRING)
    w.add_key_value("tokenizer.ggml.tokens", ["a", "b"], gguf.GGUFValueType.ARRAY)
    w.add_tensor("token_embd.weight", np.zeros((2, 8), np.float32))
    w.write_header_to_file()
    w.write_kv_data_to_file()
    w.write_tensors_to_file()
    w.close()
    with pytest.raises(TqjaxError, match="unsupported GGUF architecture 'mamba'"):
        tqjax.load(path)


def test_gguf_blocks_are_the_files_bytes_in_hf_order(tiny_gguf):
    from tqjax.quant import ggml

    path, rounded, blocks = tiny_gguf
    config, params, _ = load_checkpoint(path, blocks=True)
    assert isinstance(params.embed, ggml.GGMLLinear) and params.embed.ggml_type == T.Q8_0
    np.testing.assert_array_equal(np.asarray(ggml.file_blocks(params.embed)),
                                  blocks["model.embed_tokens.weight"])
    np.testing.assert_array_equal(np.asarray(ggml.file_blocks(params.lm_head)),
                                  blocks["lm_head.weight"])
    for i, lp in enumerate(params.layers):
        for field, hf_name in LINEAR_FIELDS.items():
            w, name = getattr(lp, field), f"model.layers.{i}.{hf_name}.weight"
            if name not in blocks:  # F16: dense [in, out]
                assert not isinstance(w, ggml.GGMLLinear)
                np.testing.assert_array_equal(np.asarray(w), rounded[name].T)
                continue
            assert w.ggml_type == ggml_type(name) and w.in_features == rounded[name].shape[1]
            np.testing.assert_array_equal(np.asarray(ggml.file_blocks(w)), blocks[name])
    # dense tensors stay dense, in the requested dtype
    _, p16, _ = load_checkpoint(path, "bfloat16", blocks=True)
    assert p16.final_norm.dtype == jnp.bfloat16 and p16.layers[0].wq.ggml_type == T.Q4_0


def test_gguf_blocks_logits_match_the_dequantized_model(tiny_gguf):
    path = tiny_gguf[0]
    config, dense, _ = load_checkpoint(path)
    _, kept, _ = load_checkpoint(path, blocks=True)
    ids = list(range(3, 40))
    want = tqjax.logits(Model(config, dense, None, str(path), "float32"), ids)
    got = tqjax.logits(Model(config, kept, None, str(path), "float32"), ids)
    assert np.abs(got - want).max() <= 1e-4 * np.abs(want).max()


def test_params_bits_counts_gguf_blocks_as_quantized_weights(tiny_gguf):
    """With `weights="gguf"` the blocks are quantized linears: `params_bits` counts their
    in·out values as parameters and their bytes as quantized bytes, as for our formats (it
    counted each stored byte as a dense parameter: bpw 8.0, nothing quantized; found by QA)."""
    from tqjax.quant.accounting import params_bits
    from tqjax.quant.ggml import GGMLLinear, weight_bytes

    path, _, blocks = tiny_gguf
    dense = params_bits(tqjax.load(path).params)
    kept = tqjax.load(path, weights="gguf").params
    bits = params_bits(kept)
    linears = [w for w in jax.tree_util.tree_leaves(
        kept, is_leaf=lambda x: isinstance(x, GGMLLinear)) if isinstance(w, GGMLLinear)]
    assert linears and bits["params"] == dense["params"]
    assert bits["quantized_bytes"] == sum(weight_bytes(w) for w in linears)
    assert bits["quantized_bytes"] == sum(b.nbytes for b in blocks.values())  # the file's blocks
    assert bits["quantized_params"] == sum(
        np.prod(w.fields[0].shape[:-3], dtype=int) * w.in_features * w.out_features
        for w in linears)
    assert bits["bpw"] < dense["bpw"] / 3


def test_a_load_drops_the_programs_it_compiled(tiny_gguf, monkeypatch):
    """The programs a load compiles (the blocks' conversions, the stacking by format) do not
    run again: jax's caches are cleared once the layers are stacked, so none stays resident
    beside the model (42 MB for SmolLM2's GGUF); the params are the same bytes."""
    import tqjax.api as api

    path = tiny_gguf[0]
    want = tqjax.load(path, weights="gguf")
    assert want.tokenizer is None  # (a GGUF without a vocabulary: weights only)
    events: list[str] = []
    stack = api.stack_layers
    monkeypatch.setattr(api, "stack_layers",
                        lambda *a, **k: events.append("stack") or stack(*a, **k))
    monkeypatch.setattr(api, "drop_programs", lambda: events.append("clear"))
    got = tqjax.load(path, weights="gguf")
    assert events == ["stack", "clear"]
    for a, b in zip(jax.tree_util.tree_leaves(got.params), jax.tree_util.tree_leaves(want.params),
                    strict=True):
        np.testing.assert_array_equal(np.asarray(a), np.asarray(b))


@pytest.mark.parametrize("weights", ["tq4", "gguf"])
def test_a_load_keeps_the_callers_programs(tiny_gguf, weights):
    """What a load drops is its own: the quantizer's and the conversions' programs, and the
    eager operations'; a caller's jitted function and a forward pass compiled for another
    model stay compiled (`jax.clear_caches` dropped them too: a decode step compiles again for
    seconds), and no more programs are alive than before the load."""
    import gc

    import jax.extend

    from tqjax.decode.generate import full_logits
    from tqjax.host import drop_programs
    from tqjax.quant.weights import _quantize_block

    backend = jax.extend.backend.get_backend()
    tqjax.logits(tqjax.load(GOLDEN / "tiny" / "llama"), [1, 2, 3])
    steps = full_logits._cache_size()
    mine = jax.jit(lambda x: jnp.tanh(x) * 2)
    mine(jnp.ones(8))
    jnp.sum(jnp.ones(8) + 1)  # eager operations: their programs are jax's, cheap to make again
    assert steps >= 1 and mine._cache_size() == 1
    drop_programs()  # (what earlier tests left) the caller's stay
    gc.collect()
    assert mine._cache_size() == 1 and full_logits._cache_size() == steps
    before = len(backend.live_executables())
    path = GOLDEN / "tiny" / "llama" if weights == "tq4" else tiny_gguf[0]
    tqjax.load(path, weights=weights)
    assert mine._cache_size() == 1 and full_logits._cache_size() == steps
    assert _quantize_block._cache_size() == 0
    assert len(backend.live_executables()) <= before


def test_gguf_weights_need_a_gguf_file(tmp_path):
    for path in (GOLDEN / "tiny" / "llama", tmp_path / "missing.gguf"):
        with pytest.raises(TqjaxError) as e:
            tqjax.load(path, weights="gguf")
        assert "\n" not in str(e.value)
    with pytest.raises(TqjaxError, match="gguf"):
        tqjax.load(GOLDEN / "tiny" / "llama", weights="gguf")
    with pytest.raises(TqjaxError, match="gguf"):
        tqjax.load(GOLDEN / "tiny" / "llama", weights="gguf", quantize_embeddings=True)


def test_truncated_gguf_tensor_is_a_clean_error(tiny_gguf, tmp_path):
    path = tmp_path / "cut.gguf"
    data = tiny_gguf[0].read_bytes()
    path.write_bytes(data[: len(data) - 100])
    with pytest.raises(TqjaxError, match="truncated") as e:
        load_checkpoint(path)
    assert "\n" not in str(e.value)


# ---------------------------------------------------------------- real model (slow)


@pytest.mark.slow
def test_smollm2_gguf_blocks_logits_match_dequantized(real_model):
    from tqjax.quant import ggml

    dense = real_model("smollm2-135m-instruct")
    kept = tqjax.load("smollm2-135m-instruct", weights="gguf")
    assert isinstance(kept.params.embed, ggml.GGMLLinear)
    assert all(isinstance(getattr(lp, f), ggml.GGMLLinear)
               for lp in kept.params.layers for f in LINEAR_FIELDS)
    ids = dense.tokenizer.encode("The quick brown fox jumps over the lazy dog. " * 3)
    want, got = tqjax.logits(dense, ids), tqjax.logits(kept, ids)
    assert np.abs(got - want).max() <= 1e-4 * np.abs(want).max()


# ---------------------------------------------------------------- quantized checkpoints


@pytest.mark.parametrize("dtype", list(DTYPES))
def test_quantized_checkpoint_stream_equals_eager(tmp_path, dtype, monkeypatch):
    from tqjax.models import checkpoint as ckpt
    from tqjax.models.quantize import WeightSpec, quantize_params

    monkeypatch.setattr(ckpt, "PLACE_BYTES", 256)  # each tensor placed a few rows at a time

    tiny = tqjax.load(GOLDEN / "tiny" / "qwen2")
    q = quantize_params(tiny.params, tiny.config, WeightSpec("int4-affine"))
    path = tmp_path / "q"
    ckpt.save_quantized(path, q, tiny.config, method={}, dense_dtype="float16")
    stored = load_file(path / "model.safetensors")
    _, params, _ = load_checkpoint(path, dtype)
    flat = ckpt.flatten_params(params)
    assert flat["rope_inv_freq"].dtype == jnp.float32
    for name, value in flat.items():
        if name == "rope_inv_freq":
            np.testing.assert_array_equal(np.asarray(value), stored[name])
        elif hasattr(value, "packed"):  # quantized: stored types, stored bytes
            for part in ("packed", "scale", "offset"):
                np.testing.assert_array_equal(np.asarray(getattr(value, part)),
                                              stored[f"{name}.{part}"])
        else:  # dense: the stored f16 cast like the eager loader (jnp astype)
            want = jnp.asarray(stored[name]).astype(DTYPES[dtype])
            # a linear in a half dtype comes output-major, as the model runs it
            assert isinstance(value, HalfLinear) == (dtype != "float32" and (
                name == "lm_head" or name.split(".")[-1] in LINEAR_FIELDS))
            value = half.dense(value)
            assert value.dtype == want.dtype
            np.testing.assert_array_equal(np.asarray(value), np.asarray(want))


# ---------------------------------------------------------------- quantized as read


STREAM_SPECS = [("tq4", True, True), ("int4-affine", False, False), ("int8", True, False),
                ("mixed", True, True), ("mixed", False, False)]


@pytest.mark.parametrize("method,emb,calibrated,dtype", [
    *((*spec, "float32") for spec in STREAM_SPECS), ("tq4", True, True, "bfloat16")])
@pytest.mark.parametrize("source", ["llama_tied", "qwen2", "gguf:llama", "gguf:qwen2"])
@pytest.mark.usefixtures("keep_quantizer_programs")
def test_quantized_as_read_equals_quantizing_the_loaded_model(source, method, emb, calibrated,
                                                              dtype, tmp_path, monkeypatch):
    """`quantize_params` over an opened checkpoint (one layer read at a time, the embedding
    and head by blocks of columns) gives the same bytes as over the whole loaded model, in
    that model's dtype; the column blocks are made small so that the embedding and head span
    several, one ragged."""
    from tqjax.models.quantize import WeightSpec, quantize_params
    from tqjax.quant import weights

    monkeypatch.setattr(weights, "QUANTIZE_COLUMNS", 48)
    monkeypatch.setattr(weights, "ROUND_COLUMNS", 48)
    path = GOLDEN / "tiny" / source
    if source.startswith("gguf:"):
        path = tmp_path / "model.gguf"
        write_gguf(source.removeprefix("gguf:"), path)
    config, dense, _ = load_checkpoint(path, dtype)
    spec = WeightSpec(method, quantize_embeddings=emb, bpw=4.25 if method == "mixed" else None)
    cal = (np.random.default_rng(1).integers(0, config.vocab_size, (2, 24)).astype(np.int32)
           if calibrated else None)
    want = quantize_params(dense, config, spec, cal)
    got = quantize_params(loading.open_checkpoint(path, dtype), config, spec, cal)
    flat = [jax.tree_util.tree_flatten_with_path(p) for p in (got, want)]
    assert flat[0][1] == flat[1][1]  # the same tree: formats, static fields
    assert len(flat[0][0]) == len(flat[1][0])
    for (key, a), (_, b) in zip(flat[0][0], flat[1][0], strict=True):
        assert a.dtype == b.dtype, key
        np.testing.assert_array_equal(np.asarray(a), np.asarray(b), err_msg=str(key))
    if emb:
        assert got.embed.out_features == config.vocab_size > 48


@pytest.mark.parametrize("calibrated", [True, False])
@pytest.mark.usefixtures("keep_quantizer_programs")
def test_mixed_as_read_holds_one_dense_layer(tiny_gguf, calibrated, monkeypatch):
    """"mixed" reads the checkpoint a layer at a time too: the Fisher pass (a forward and a
    backward sweep), the measuring and the quantizing each read every layer once, and no
    dense layer is alive (weak references) when the next one is read."""
    import gc
    import weakref

    from tqjax.models import quantize as mq

    ckpt = loading.open_checkpoint(tiny_gguf[0])
    refs: list[weakref.ref] = []
    alive_at_read: list[int] = []
    reads: list[int] = []
    layer = ckpt.layer

    def read_layer(i, placed=None):
        gc.collect()
        alive_at_read.append(sum(r() is not None for r in refs))
        reads.append(i)
        lp = layer(i, placed)
        refs.extend(weakref.ref(getattr(lp, f)) for f in mq.LINEARS)
        return lp

    monkeypatch.setattr(ckpt, "layer", read_layer)
    cal = np.arange(24, dtype=np.int32)[None] % ckpt.config.vocab_size
    spec = mq.WeightSpec("mixed", bpw=4.25)
    q = mq.quantize_params(ckpt, ckpt.config, spec, cal if calibrated else None)
    n = ckpt.config.num_layers
    sweeps = [list(range(n)), list(range(n))[::-1]] if calibrated else []
    assert reads == [i for sweep in [*sweeps, range(n), range(n)] for i in sweep]
    assert alive_at_read == [0] * len(reads)
    assert isinstance(q.layers[-1].w_down, mq.QuantizedLinear)


@pytest.mark.parametrize("calibrated", [True, False])
def test_quantized_as_read_holds_one_dense_layer(tiny_gguf, calibrated, monkeypatch):
    """Reading and quantizing interleave layer by layer: no tensor of layer i + 1 is read
    before every linear of layer i is quantized, each linear is read once, and layer i's
    dense arrays are gone (weak references) when layer i + 1 is read; calibrated, each dense
    linear goes as soon as its stage is quantized (only w_down's is alive at its turn), and
    so does each stage's Gram (none is alive when the next layer is read)."""
    import gc
    import weakref

    from tqjax.host import release_adopted
    from tqjax.models import quantize as mq

    events: list[str] = []
    path = tiny_gguf[0]
    ckpt = loading.open_checkpoint(path)
    dense: list[list[weakref.ref]] = []
    alive_at_read: list[int] = []
    layer = ckpt.layer

    grams: list[weakref.ref] = []
    grams_at_read: list[int] = []
    real_gram = mq._gram

    def gram(acts):
        g = real_gram(acts)
        grams.append(weakref.ref(g))
        return g

    def read_layer(i, placed=None):
        gc.collect()
        release_adopted()
        alive_at_read.append(sum(r() is not None for refs in dense for r in refs))
        grams_at_read.append(sum(r() is not None for r in grams))
        lp = layer(i, placed)
        dense.append([weakref.ref(getattr(lp, f)) for f in mq.LINEARS])
        return lp

    monkeypatch.setattr(ckpt, "layer", read_layer)
    monkeypatch.setattr(mq, "_gram", gram)
    for name, t in list(ckpt.tensors.items()):
        read = t.read
        ckpt.tensors[name] = loading.StoredTensor(
            t.shape, lambda rows, name=name, read=read: events.append("read " + name) or read(rows),
            t.ggml_type, t.raw)
    real = mq.quantize_linear
    alive_at_quantize: list[int] = []

    def quantize_linear(w, *a, **k):
        gc.collect()
        alive_at_quantize.append(sum(r() is not None for r in dense[-1]) if dense else -1)
        events.append("quantize")
        return real(w, *a, **k)

    monkeypatch.setattr(mq, "quantize_linear", quantize_linear)
    cal = np.arange(24, dtype=np.int32)[None] % ckpt.config.vocab_size
    mq.quantize_params(ckpt, ckpt.config, mq.WeightSpec("tq4"), cal if calibrated else None)
    assert alive_at_read == grams_at_read == [0] * ckpt.config.num_layers
    assert len(grams) == (4 * ckpt.config.num_layers if calibrated else 0)
    n = ckpt.config.num_layers
    per_layer = np.array(alive_at_quantize[:7 * n]).reshape(n, 7)  # q k v | o | gate up | down
    assert per_layer.tolist() == [[7, 7, 7, 4, 3, 3, 1] if calibrated else [7] * 7] * n
    layer_reads = [e for e in events if e.startswith("read model.layers.")]
    linears = [e for e in layer_reads if e.endswith("proj.weight")]
    assert len(linears) == len(set(linears)) == 7 * ckpt.config.num_layers
    for i in range(1, ckpt.config.num_layers):
        first = next(k for k, e in enumerate(events) if e.startswith(f"read model.layers.{i}."))
        assert events[:first].count("quantize") == 7 * i


# ------------------------------------------------------------ what a user's HF directory may hold
def _edited_copy(tmp_path, name="llama", config=None, tensors=None, extra_files=None):
    """golden/tiny/<name> copied, its config.json edited by `config(cfg)` and its tensors by
    `tensors(dict)`; `extra_files`: {file name: bytes or a tensor dict}."""
    import json
    import shutil

    from safetensors.numpy import save_file

    d = tmp_path / f"{name}-edited"
    shutil.copytree(GOLDEN / "tiny" / name, d)
    if config is not None:
        cfg = json.loads((d / "config.json").read_text())
        config(cfg)
        (d / "config.json").write_text(json.dumps(cfg))
    if tensors is not None:
        t = load_file(d / "model.safetensors")
        tensors(t)
        save_file(t, d / "model.safetensors")
    for fname, content in (extra_files or {}).items():
        if isinstance(content, dict):
            save_file(content, d / fname)
        else:
            (d / fname).write_bytes(content)
    return d


@pytest.mark.parametrize("edit,needle", [
    # tensor shapes against the config (a short table's ids were clamped, a [1] norm broadcast,
    # a wrong q_proj failed deep in a dot)
    (dict(tensors=lambda t: t.update({"model.embed_tokens.weight":
                                      t["model.embed_tokens.weight"][:200]})),
     "model.embed_tokens.weight has shape (200, 64), but the model's configuration gives "
     "(256, 64)"),
    (dict(tensors=lambda t: t.update({"model.norm.weight": np.ones(1, np.float32)})),
     "model.norm.weight has shape (1,)"),
    (dict(tensors=lambda t: t.update({"model.layers.0.self_attn.q_proj.weight":
                                      t["model.layers.0.self_attn.q_proj.weight"][:32]})),
     "model.layers.0.self_attn.q_proj.weight has shape (32, 64)"),
    (dict(config=lambda c: c.update(vocab_size=300)), "gives (300, 64)"),
    (dict(config=lambda c: c.update(head_dim=32)), "q_proj.weight has shape"),
    # config fields (KeyError / ValueError tracebacks)
    (dict(config=lambda c: c.pop("vocab_size")), "config.json has no 'vocab_size'"),
    (dict(config=lambda c: c.update(num_attention_heads="four")), "config.json has a bad value"),
    (dict(config=lambda c: c.update(rope_parameters={"rope_type": "linear"})),
     "config.json has no 'factor'"),
    (dict(config=lambda c: c.update(num_key_value_heads=3)),
     "4 attention heads are not a multiple of its 3 key/value heads"),
    (dict(config=lambda c: c.update(quantization_config={"quant_method": "fp8"})),
     "a quantized HF checkpoint (quantization_config 'fp8')"),
    # the files (a JSONDecodeError / AttributeError; a duplicate silently won; float8 read)
    (dict(extra_files={"model.safetensors.index.json": b"{not json"}), "corrupt?"),
    (dict(extra_files={"model.safetensors.index.json": b"[]"}), "expected a JSON dict"),
    (dict(extra_files={"zz-extra.safetensors": {"model.norm.weight": np.full(64, 5.0,
                                                                             np.float32)}}),
     "tensor model.norm.weight is in both model.safetensors and zz-extra.safetensors"),
    (dict(tensors=lambda t: t.update({"model.norm.weight": np.ones(64, np.int8)})),
     "tensor model.norm.weight is I8, which tqjax does not read (F32, F16, BF16)"),
])
def test_a_directory_that_does_not_make_its_model_is_one_line(tmp_path, edit, needle):
    d = _edited_copy(tmp_path, **edit)
    with pytest.raises(TqjaxError) as e:
        tqjax.load(d)
    assert needle in str(e.value) and "\n" not in str(e.value), str(e.value)


def test_config_variants_a_user_may_bring(tmp_path):
    """No "architectures" but a known model_type reads as that model (as HF's AutoModel does);
    rope scaling given in rope_parameters without rope_theta is read, not ignored; Qwen3 with
    attention_bias is refused (the biases were ignored)."""
    ids = np.arange(1, 17, dtype=np.int32)
    want = tqjax.logits(tqjax.load(GOLDEN / "tiny" / "llama"), ids)
    plain = _edited_copy(tmp_path, config=lambda c: c.pop("architectures"))
    np.testing.assert_array_equal(tqjax.logits(tqjax.load(plain), ids), want)
    scaled = _edited_copy(tmp_path / "s", config=lambda c: c.update(
        rope_parameters={"rope_type": "linear", "factor": 4.0}))
    assert tqjax.load(scaled).config.rope_scaling.factor == 4.0
    with pytest.raises(TqjaxError, match="unsupported qwen3 variant: attention_bias"):
        tqjax.load(_edited_copy(tmp_path, "qwen3", config=lambda c: c.update(
            attention_bias=True)))


def test_hf_generation_config_end_tokens_are_end_tokens(tmp_path):
    """HF's generate ends on generation_config.json's eos_token_id (Qwen2.5 lists <|im_end|>
    and <|endoftext|>); they follow config.json's own (found by review: only config.json's
    was read). A bad value is one line."""
    import json
    import shutil

    d = tmp_path / "qwen2"
    shutil.copytree(GOLDEN / "tiny" / "qwen2", d)
    gen = json.loads((d / "generation_config.json").read_text())
    base = tqjax.load(d).config.eos_token_ids
    (d / "generation_config.json").write_text(json.dumps({**gen, "eos_token_id": [7, *base]}))
    assert tqjax.load(d).config.eos_token_ids == (*base, 7)
    (d / "generation_config.json").write_text(json.dumps({**gen, "eos_token_id": "x"}))
    with pytest.raises(TqjaxError, match="generation_config.json: eos_token_id must be"):
        tqjax.load(d)
