"""GGUF weights kept in their own blocks (tqjax.quant.ggml, tqjax.pallas.ggml_matmul) against
gguf's own dequantizer: random blocks of every supported type, the real tensors of both real
models, the Pallas kernel in interpret mode, and whole-model logits."""

import dataclasses

import gguf
import jax
import jax.numpy as jnp
import numpy as np
import pytest
from gguf.quants import dequantize as gguf_dequantize
from gguf.quants import quantize as gguf_quantize

import tqjax
from tqjax.errors import TqjaxError
from tqjax.fetch import fetch_model
from tqjax.models.loading import GGUF_GLOBAL_NAMES, GGUF_LAYER_NAMES, unpermute_rope_rows
from tqjax.models.transformer import embed_tokens
from tqjax.pallas import ggml_matmul as gm
from tqjax.pallas.backend import use_backend
from tqjax.quant import ggml
from tqjax.quant.weights import linear

T = gguf.GGMLQuantizationType
RNG = np.random.default_rng(0)
TYPES = [T(t).name for t in ggml.SUPPORTED_TYPES]


def random_blocks(name: str, n: int, k: int) -> np.ndarray:
    """uint8 [n, k / block · type_size]: gguf's own quantization of random weights where gguf
    has a quantizer, else random bytes with finite f16 scales (every code pattern occurs)."""
    t = T[name]
    block, type_size = gguf.GGML_QUANT_SIZES[t]
    try:
        return gguf_quantize(RNG.normal(size=(n, k)).astype(np.float32), t)
    except NotImplementedError:
        raw = RNG.integers(0, 256, (n, k // block, type_size), dtype=np.uint8)
        halves = {"Q4_K": (0, 2), "Q5_K": (0, 2), "Q6_K": (208,)}[name]
        for at in halves:
            f16 = RNG.uniform(-1, 1, (n, k // block)).astype(np.float16)
            raw[..., at:at + 2] = f16.view(np.uint8).reshape(n, k // block, 2)
        return raw.reshape(n, -1)


@pytest.mark.parametrize("name", TYPES)
def test_dequantize_matches_gguf_exactly(name):
    n, k = 24, 512
    raw = random_blocks(name, n, k)
    w = ggml.from_gguf(raw, T[name], (n, k))
    ref = gguf_dequantize(raw, T[name])  # [n, k]
    np.testing.assert_array_equal(np.asarray(jax.jit(ggml.dequantize)(w)), ref.T)
    ids = np.array([[3, 0], [23, 3]])
    np.testing.assert_array_equal(np.asarray(ggml.gather_rows(w, jnp.asarray(ids))), ref[ids])


@pytest.mark.parametrize("name", TYPES)
def test_fields_tile_each_block_and_file_blocks_round_trips(name):
    """FIELDS covers every byte of a block once, each field in whole planes of whole chunks,
    and a weight's field arrays give back the file's exact bytes."""
    block, type_size = gguf.GGML_QUANT_SIZES[T[name]]
    at = 0
    for start, size, planes, chunk in gm.FIELDS[int(T[name])]:
        assert start == at and size % (planes * chunk) == 0
        at += size
    assert at == type_size
    raw = random_blocks(name, 6, 2 * block)
    w = ggml.from_gguf(raw, T[name], (6, 2 * block))
    np.testing.assert_array_equal(np.asarray(ggml.file_blocks(w)), raw)
    assert ggml.weight_bytes(w) == raw.size
    order = ggml.code_order(w)  # every input read exactly once by the fused dots
    np.testing.assert_array_equal(np.sort(order), np.arange(2 * block))


@pytest.mark.parametrize("name", TYPES)
@pytest.mark.parametrize("rows", [1, 7])
def test_linear_matches_dequantized_reference(name, rows):
    n, k = 40, 768
    raw = random_blocks(name, n, k)
    w = ggml.from_gguf(raw, T[name], (n, k))
    x = RNG.normal(size=(2, rows, k)).astype(np.float32)
    ref = x @ gguf_dequantize(raw, T[name]).T.astype(np.float64)
    got = np.asarray(linear(jnp.asarray(x), w))  # through the weights.linear dispatch
    assert got.shape == (2, rows, n) and got.dtype == np.float32
    np.testing.assert_allclose(got, ref, atol=1e-5 * np.abs(ref).max(), rtol=0)
    tiled = np.asarray(ggml._linear_tiled(jnp.asarray(x[0]), w, 8 * k))  # 8-row tiles + rest
    np.testing.assert_allclose(tiled, ref[0], atol=1e-5 * np.abs(ref).max(), rtol=0)
    half = np.asarray(ggml.linear(jnp.asarray(x, jnp.bfloat16), w))
    assert half.dtype == jnp.bfloat16
    np.testing.assert_allclose(half.astype(np.float32), ref, atol=2e-2 * np.abs(ref).max())


@pytest.mark.parametrize("name", TYPES)
def test_fused_decode_cut_into_runs_matches_reference(name, monkeypatch):
    # three runs of whole blocks per row, summed across the reduce_precision barrier
    n, k = 24, 768
    monkeypatch.setattr("tqjax.quant.tiling.GGML_FUSED_VALUES", 256)
    raw = random_blocks(name, n, k)
    w = ggml.from_gguf(raw, T[name], (n, k))
    x = RNG.normal(size=(3, k)).astype(np.float32)
    ref = x @ gguf_dequantize(raw, T[name]).T.astype(np.float64)
    got = np.asarray(jax.jit(ggml._linear_fused)(jnp.asarray(x), w))
    np.testing.assert_allclose(got, ref, atol=1e-5 * np.abs(ref).max(), rtol=0)


def test_permute_rows_moves_whole_rows():
    raw = random_blocks("Q4_K", 8, 256)
    perm = unpermute_rope_rows(np.arange(8), 2)  # llama's Q/K un-permutation of 2 heads
    w = ggml.permute_rows(ggml.from_gguf(raw, T.Q4_K, (8, 256)), perm)
    ref = unpermute_rope_rows(gguf_dequantize(raw, T.Q4_K), 2)
    np.testing.assert_array_equal(np.asarray(ggml.dequantize(w)).T, ref)


def test_bad_inputs_raise_tqjax_error():
    with pytest.raises(TqjaxError, match="not supported"):
        ggml.from_gguf(np.zeros((4, 6), np.uint8), T.IQ2_XXS, (4, 256))
    with pytest.raises(TqjaxError, match="multiple"):
        ggml.from_gguf(np.zeros((4, 34), np.uint8), T.Q8_0, (4, 48))
    with pytest.raises(TqjaxError, match="bytes"):
        ggml.from_gguf(np.zeros((4, 33), np.uint8), T.Q8_0, (4, 32))
    w = ggml.from_gguf(random_blocks("Q8_0", 4, 64), T.Q8_0, (4, 64))
    with pytest.raises(TqjaxError, match="features"):
        ggml.linear(jnp.zeros((1, 32)), w)
    assert ggml.weight_bytes(w) == 4 * 2 * 34 and ggml.bits_per_weight(w) == 8.5


def test_tied_embedding_lookup_and_head():
    v, d = 48, 64
    raw = random_blocks("Q8_0", v, d)
    table = gguf_dequantize(raw, T.Q8_0)  # [V, D]
    w = ggml.from_gguf(raw, T.Q8_0, (v, d))
    ids = jnp.asarray([[5, 47, 0]])
    np.testing.assert_array_equal(np.asarray(embed_tokens(w, ids)), table[np.asarray(ids)])
    x = RNG.normal(size=(3, d)).astype(np.float32)
    np.testing.assert_allclose(np.asarray(linear(jnp.asarray(x), w)), x @ table.T,
                               atol=1e-5 * np.abs(x @ table.T).max())


# ---------------------------------------------------------------- Pallas kernel (interpret)


@pytest.mark.parametrize("name", TYPES)
@pytest.mark.parametrize("rows", [1, 3, 20])
def test_ggml_matmul_matches_dequantize(name, rows):
    block = gguf.GGML_QUANT_SIZES[T[name]][0]
    n, k = 32, 2 * max(block, 64)
    w = ggml.from_gguf(random_blocks(name, n, k), T[name], (n, k))
    x = jnp.asarray(RNG.normal(size=(rows, k)), jnp.float32)
    ref = np.asarray(x) @ np.asarray(ggml.dequantize(w), np.float64)
    got = np.asarray(gm.ggml_matmul(x, w, tiling=gm.choose_tiling(rows, k // block, n)))
    np.testing.assert_allclose(got, ref, atol=1e-5 * np.abs(ref).max(), rtol=0)


def test_ggml_matmul_split_k_and_backend_dispatch():
    n, k = 32, 128
    w = ggml.from_gguf(random_blocks("Q4_1", n, k), T.Q4_1, (n, k))
    x = jnp.asarray(RNG.normal(size=(2, k)), jnp.float32)
    ref = np.asarray(x) @ np.asarray(ggml.dequantize(w), np.float64)
    split = gm.ggml_matmul(x, w, tiling=gm.Tiling(None, 16, 4))
    np.testing.assert_allclose(np.asarray(split), ref, atol=1e-5 * np.abs(ref).max())
    with use_backend("pallas"):
        np.testing.assert_allclose(np.asarray(linear(x, w)), ref, atol=1e-5 * np.abs(ref).max())
    odd = ggml.from_gguf(random_blocks("Q8_0", 20, 64), T.Q8_0, (20, 64))
    assert not gm.supported((1, 64), odd)  # N % 16: the XLA path serves it
    with pytest.raises(TqjaxError, match="does not handle"):
        gm.ggml_matmul(jnp.zeros((1, 64)), odd)


def test_ggml_matmul_lowers_to_triton():
    w = ggml.from_gguf(random_blocks("Q6_K", 32, 256), T.Q6_K, (32, 256))
    for rows, tiling in ((1, gm.Tiling(None, 32, 1)), (20, gm.Tiling(32, 32, 1))):
        x = jnp.zeros((rows, 256), jnp.float32)
        text = jax.jit(lambda x, w, t=tiling: gm._ggml_matmul(x, w, False, t)).trace(
            x, w).lower(lowering_platforms=("cuda",)).as_text()
        assert "ggml_matmul_q6_k" in text


# ---------------------------------------------------------------- real models


FIELDS = {"self_attn.q_proj.weight": "wq", "self_attn.k_proj.weight": "wk",
          "self_attn.v_proj.weight": "wv", "self_attn.o_proj.weight": "wo",
          "mlp.gate_proj.weight": "w_gate", "mlp.up_proj.weight": "w_up",
          "mlp.down_proj.weight": "w_down"}


def ggml_model(model: tqjax.api.Model, path: str) -> tqjax.api.Model:
    """`model` (loaded from the GGUF file at `path`, dequantized) with every quantized matrix
    replaced by its GGMLLinear read from the file, un-permuted as loading.py does."""
    cfg, p = model.config, model.params
    layers: list[dict] = [{} for _ in p.layers]
    top = {}
    for t in gguf.GGUFReader(path).tensors:
        if int(t.tensor_type) not in ggml.SUPPORTED_TYPES:
            continue
        shape = tuple(int(d) for d in reversed(t.shape))  # HF (out, in)
        w = ggml.from_gguf(t.data, t.tensor_type, shape)
        if t.name in GGUF_GLOBAL_NAMES:
            top[{"token_embd.weight": "embed", "output.weight": "lm_head"}[t.name]] = w
            continue
        _, i, rest = t.name.split(".", 2)
        name = GGUF_LAYER_NAMES[rest]
        if cfg.arch == "llama" and name.endswith(("q_proj.weight", "k_proj.weight")):
            heads = cfg.num_heads if "q_proj" in name else cfg.num_kv_heads
            w = ggml.permute_rows(w, unpermute_rope_rows(np.arange(shape[0]), heads))
        layers[int(i)][FIELDS[name]] = w
    params = p.replace(layers=[lp.replace(**d) for lp, d in zip(p.layers, layers, strict=True)],
                       **top)
    return dataclasses.replace(model, params=params)


@pytest.mark.slow
@pytest.mark.parametrize("model_name", ["smollm2-135m-instruct", "qwen2.5-coder-0.5b-instruct"])
def test_real_tensors_match_gguf(model_name):
    """Every tensor type present in the file, sampled rows, bit for bit."""
    reader = gguf.GGUFReader(str(fetch_model(model_name)))
    seen = set()
    for t in reader.tensors:
        if int(t.tensor_type) not in ggml.SUPPORTED_TYPES or t.tensor_type in seen:
            continue
        seen.add(t.tensor_type)
        out, inp = (int(d) for d in reversed(t.shape))
        rows = np.sort(RNG.choice(out, size=min(out, 64), replace=False))
        w = ggml.from_gguf(t.data, t.tensor_type, (out, inp))
        ref = gguf_dequantize(t.data[rows], t.tensor_type)
        np.testing.assert_array_equal(np.asarray(ggml.gather_rows(w, jnp.asarray(rows))), ref)
    expected = {"smollm2-135m-instruct": {"Q4_1", "Q8_0"},
                "qwen2.5-coder-0.5b-instruct": {"Q4_K", "Q5_0", "Q6_K", "Q8_0"}}[model_name]
    assert {t.name for t in seen} == expected


@pytest.mark.slow
@pytest.mark.parametrize("model_name", ["smollm2-135m-instruct", "qwen2.5-coder-0.5b-instruct"])
def test_real_model_logits_match_dequantized(model_name, real_model):
    """Whole model on GGUF blocks vs the f32 model gguf dequantized at load: 1e-4 relative."""
    path = str(fetch_model(model_name))
    ref = real_model(model_name)  # tqjax.load of that same file, shared with other tests
    model = ggml_model(ref, path)
    kinds = {type(lp.wq) for lp in model.params.layers} | {type(model.params.embed)}
    assert kinds == {ggml.GGMLLinear}
    ids = ref.tokenizer.encode("def fibonacci(n):\n    return n if n < 2 else")
    want, got = tqjax.logits(ref, ids), tqjax.logits(model, ids)
    assert np.abs(got - want).max() <= 1e-4 * np.abs(want).max()
    assert (got.argmax(-1) == want.argmax(-1)).all()


def test_orbax_names_the_old_gguf_layouts():
    """An orbax checkpoint whose GGUF weights were saved as whole blocks (`data`) or as codes
    and the rest of each block (`head`, `codes`) gets a one-line error that says to save it
    again; the current layout's structure round-trips."""
    from tqjax.models.orbax_checkpoint import _decode, _encode
    static = {"ggml_type": int(T.Q8_0), "in_features": 32}
    u8 = {"dtype": "uint8"}
    for old in ({"data": {"shape": [4, 34], **u8}},
                {"head": {"shape": [4, 2], **u8}, "codes": {"shape": [4, 32], **u8}}):
        with pytest.raises(TqjaxError, match="save the checkpoint again"):
            _decode({"type": "GGMLLinear", "fields": old, "static": static})
    w = ggml.from_gguf(random_blocks("Q8_0", 4, 32), T.Q8_0, (4, 32))
    back = _decode(_encode(w))
    assert jax.tree.structure(back) == jax.tree.structure(w)
    assert [a.shape for a in back.fields] == [(4, 1, 2), (4, 1, 32)]
