"""Pallas kernels (interpret mode on CPU) against the plain-JAX reference paths, their Triton
lowering for CUDA (built on the CPU, no GPU needed), and the backend switch end to end."""

import dataclasses
import math

import chex
import jax
import jax.numpy as jnp
import numpy as np
import pytest

import tqjax
from tqjax.decode.calibrate import calibrate
from tqjax.decode.generate import generate_tokens
from tqjax.decode.sampling import SamplingParams
from tqjax.errors import TqjaxError
from tqjax.kv import cache as kvc
from tqjax.kv import store as kvs
from tqjax.pallas import dequant_matmul as dm
from tqjax.pallas import turbo_attention as ta
from tqjax.pallas.backend import current, use_backend
from tqjax.quant import lloyd_max, make_rotation, pack_bits, rotate
from tqjax.quant.weights import QuantizedLinear, dequantize_weight, linear

from .conftest import GOLDEN

RNG = np.random.default_rng(0)


# ---------------------------------------------------------------- fused dequant-matmul


def random_weight(bits: int, k: int, n: int, group: int, affine: bool = False,
                  lut: np.ndarray | None = None) -> QuantizedLinear:
    """Random codes, scales (and offsets) in the QuantizedLinear format: any codes must match."""
    codes = RNG.integers(0, 2**bits, (k, n)).astype(np.uint8)
    lut = np.sort(RNG.normal(size=2**bits)) if lut is None else lut
    return QuantizedLinear(
        packed=pack_bits(jnp.asarray(codes.T), bits),
        scale=jnp.asarray(RNG.uniform(0.5, 2.0, (n, k // group)), jnp.float16),
        lut=jnp.asarray(lut, jnp.float32),
        offset=jnp.asarray(RNG.normal(size=(n, k // group)), jnp.float16) if affine else None,
        bits=bits, group=group, in_features=k)


WEIGHTS = {
    "tq2": lambda: random_weight(2, 256, 48, 64),
    "tq3": lambda: random_weight(3, 256, 32, 64),
    "tq4": lambda: random_weight(4, 128, 64, 32),
    "int8": lambda: random_weight(8, 96, 32, 96, lut=np.arange(-128, 128)),  # per channel
    "int4": lambda: random_weight(4, 128, 32, 32, affine=True, lut=np.arange(16)),
}


@pytest.mark.parametrize("name", sorted(WEIGHTS))
@pytest.mark.parametrize("rows", [1, 5, 24])
def test_dequant_matmul_matches_reference(name, rows):
    w = WEIGHTS[name]()
    x = jnp.asarray(RNG.normal(size=(rows, w.padded_in)), jnp.float32)
    got = dm.dequant_matmul(x, w)
    want = x @ dequantize_weight(w)
    chex.assert_shape(got, want.shape)
    chex.assert_trees_all_close(got, want, atol=1e-4 * float(jnp.abs(want).max()), rtol=0)


def test_dequant_matmul_bf16_and_split_k():
    w = random_weight(4, 256, 32, 64)
    x = jnp.asarray(RNG.normal(size=(3, 256)), jnp.bfloat16)
    got = dm.dequant_matmul(x, w, tiling=dm.Tiling(None, 16, 4))
    want = jnp.dot(x, dequantize_weight(w).astype(x.dtype), preferred_element_type=jnp.float32)
    assert got.dtype == jnp.bfloat16
    chex.assert_trees_all_close(got.astype(jnp.float32), want, atol=0.02 * float(
        jnp.abs(want).max()), rtol=0)


def test_dequant_matmul_rejects_unsupported_shapes():
    w = random_weight(4, 64, 24, 64)  # N not a multiple of 16
    assert not dm.supported((1, 64), w)
    with pytest.raises(TqjaxError, match="does not handle"):
        dm.dequant_matmul(jnp.zeros((1, 64)), w)


# ---------------------------------------------------------------- decode attention


def filled_layer(k_type, v_type, batch, kv_heads, slots, hd, center, sink=0, v_center=False):
    """A layer cache filled with random keys/values. `center`: centred and balanced keys
    (pre-RoPE mean, channel scales); `sink`: dense sink slots in turbo stores; `v_center`:
    centred values."""
    shape = kvc.StoreShape(batch, kv_heads, slots, hd, layer=1, sink_tokens=sink)
    kshape, vshape = shape, shape
    if center:
        inv_freq = (10000.0 ** (-np.arange(0, hd, 2) / hd)).astype(np.float32)
        kshape = dataclasses.replace(shape, center=3 * RNG.normal(size=(kv_heads, hd)),
                                     inv_freq=inv_freq,
                                     chan_scale=RNG.uniform(0.5, 2.0, (kv_heads, hd)))
    if v_center:
        vshape = dataclasses.replace(shape, center=RNG.normal(size=(kv_heads, hd)))
    k = kvc.STORE_FACTORIES[k_type](kshape)
    v = kvc.STORE_FACTORIES[v_type](vshape)
    data = lambda: jnp.asarray(RNG.normal(size=(batch, kv_heads, slots, hd)), jnp.float32)  # noqa: E731
    zero = jnp.zeros(batch, jnp.int32)
    return kvc.LayerCache(kvs.write(k, data(), zero), kvs.write(v, data(), zero))


def reference_attention(layer, q, positions):
    """The XLA path of `tqjax.kv.cache.attend` for one token: q [B, H, hd] -> [B, H, hd]."""
    b, h, hd = q.shape
    kv = jax.tree_util.tree_leaves(layer.k)[0].shape[1]
    s = kvs.scores(layer.k, q.reshape(b, kv, h // kv, hd)) / math.sqrt(hd)
    visible = jnp.arange(s.shape[-1])[None, :] <= positions[:, None]
    p = jax.nn.softmax(jnp.where(visible[:, None, None], s, -jnp.inf), axis=-1)
    return kvs.mix(layer.v, p).reshape(b, h, hd)


ATTENTION_CASES = [
    # k, v, hd, G (query heads per KV head), slots, centred+balanced keys, splits, sink slots,
    # centred values
    ("turbo4", "turbo3", 64, 3, 70, True, 2, 4, True),
    ("turbo2", "turbo4", 128, 7, 50, False, None, 0, False),
    ("turbo3.5", "turbo2.5", 64, 1, 37, True, 3, 0, False),
    ("turbo3", "bf16", 64, 2, 40, True, 2, 3, False),
    ("bf16", "bf16", 64, 7, 45, False, 2, 0, False),
]


@pytest.mark.parametrize("k_type,v_type,hd,g,slots,center,splits,sink,v_center",
                         ATTENTION_CASES)
def test_decode_attention_matches_reference(k_type, v_type, hd, g, slots, center, splits, sink,
                                            v_center):
    batch, kv_heads = 2, 2
    layer = filled_layer(k_type, v_type, batch, kv_heads, slots, hd, center, sink, v_center)
    q = jnp.asarray(RNG.normal(size=(batch, kv_heads * g, hd)), jnp.float32)
    positions = jnp.asarray([slots - 1, 1], jnp.int32)  # ragged: full cache, sinks only
    got = ta.turbo_decode_attention(q, layer.k, layer.v, positions, block=16, splits=splits)
    want = reference_attention(layer, q, positions)
    chex.assert_shape(got, q.shape)
    chex.assert_trees_all_close(got, want, atol=2e-5 * float(jnp.abs(want).max()), rtol=0)


def test_decode_attention_rejects_unsupported_stores():
    layer = filled_layer("q8", "turbo4", 1, 1, 16, 64, False)
    q = jnp.zeros((1, 1, 64))
    assert not ta.supported(q.shape, layer.k, layer.v)
    with pytest.raises(TqjaxError, match="turbo_decode_attention needs"):
        ta.turbo_decode_attention(q, layer.k, layer.v, jnp.zeros(1, jnp.int32))


# ---------------------------------------------------------------- Triton lowering (no GPU)


def lower_for_cuda(fn, *args):
    """Trace and lower to CUDA: runs the Pallas Triton lowering and builds the Triton IR."""
    return jax.jit(fn).trace(*args).lower(lowering_platforms=("cuda",)).as_text()


@pytest.mark.parametrize("bits,rows", [(3, 1), (4, 64)])
def test_dequant_matmul_lowers_to_triton(bits, rows):
    w = random_weight(bits, 896, 128, 64)
    x = jnp.zeros((rows, 896), jnp.bfloat16)
    tiling = dm.choose_tiling(rows, 896, 128, 64)
    text = lower_for_cuda(lambda x, w: dm._dequant_matmul(x, w, False, tiling), x, w)
    assert "__gpu$xla.gpu.triton" in text


@pytest.mark.parametrize("k_type,v_type,center", [("turbo3", "turbo4", True),
                                                  ("bf16", "bf16", False)])
def test_decode_attention_lowers_to_triton(k_type, v_type, center):
    layer = filled_layer(k_type, v_type, 1, 2, 256, 64, center)
    q = jnp.zeros((1, 14, 64), jnp.bfloat16)
    window = (jnp.zeros((1, 2, 32, 64), jnp.float16), jnp.zeros((1, 2, 32, 64), jnp.float16),
              jnp.zeros((1, 32), jnp.int32))  # an exact recent window, merged outside

    def fn(q, k, v, p):
        return ta._decode_attention(q, k, v, p, p - 32, window, 64, 2, False)

    text = lower_for_cuda(fn, q, layer.k, layer.v, jnp.zeros(1, jnp.int32))
    assert "__gpu$xla.gpu.triton" in text


# ---------------------------------------------------------------- backend switch


def test_backend_switch_retraces_and_rejects_unknown_names():
    w = random_weight(4, 64, 16, 64)
    x = jnp.ones((2, 64))
    f = jax.jit(lambda x: linear(x, w))
    assert current() == "xla"
    assert "pallas_call" not in str(jax.make_jaxpr(f)(x))
    with use_backend("pallas"):
        assert current() == "pallas"
        assert "pallas_call" in str(jax.make_jaxpr(f)(x))
        got = f(x)
    chex.assert_trees_all_close(got, f(x), atol=1e-4)
    chex.assert_trees_all_close(linear(x, w, backend="pallas"), got, atol=1e-6)
    with pytest.raises(TqjaxError, match="unknown backend"):
        linear(x, w, backend="cuda")


def test_auto_backend_is_xla_on_cpu_and_pallas_on_gpu(monkeypatch):
    """"auto" (the default) resolves by JAX's default device: XLA here, Pallas where
    JAX runs on a GPU (the first GPU run measured every decode configuration faster there)."""
    from tqjax.pallas import backend

    assert backend.auto() == "xla" and backend.check_backend("auto") == "xla"
    with use_backend("auto"):
        assert current() == "xla"
    monkeypatch.setattr(backend.jax, "default_backend", lambda: "gpu")
    assert backend.check_backend("auto") == "pallas" and current() == "pallas"  # the default
    with use_backend("auto"):
        assert current() == "pallas"


def quantize_tq(w: jax.Array, bits: int = 4, group: int = 32) -> QuantizedLinear:
    """Round-to-nearest TurboQuant weights (rotated groups, Lloyd–Max grid, rms scale)."""
    k, n = w.shape
    rot = make_rotation(group, 0)
    v = rotate(w.T.reshape(n, k // group, group), rot)  # [N, G, group] rotated rows
    scale = jnp.sqrt(jnp.mean(v * v, axis=-1)).astype(jnp.float16)
    lut = jnp.asarray(lloyd_max(bits, group).centroids * math.sqrt(group), jnp.float32)
    y = v / jnp.where(scale > 0, scale, 1).astype(jnp.float32)[..., None]
    codes = jnp.sum(y[..., None] > 0.5 * (lut[1:] + lut[:-1]), axis=-1, dtype=jnp.uint8)
    return QuantizedLinear(packed=pack_bits(codes.reshape(n, k), bits), scale=scale,
                           lut=lut, rotation=rot, bits=bits, group=group, in_features=k)


def test_greedy_text_identical_with_pallas_backend():
    """Tiny Qwen3 with tq4 weights and a calibrated turbo3-K / turbo4-V cache (centred and
    balanced keys, centred values, 2 sink slots), ragged batch."""
    model = tqjax.load(GOLDEN / "tiny" / "qwen3")
    names = ("wq", "wk", "wv", "wo", "w_gate", "w_up", "w_down")
    layers = [lp.replace(**{n: quantize_tq(getattr(lp, n)) for n in names})
              for lp in model.params.layers]
    params = model.params.replace(layers=layers)
    spec = tqjax.CacheSpec(k="turbo3", v="turbo4", sink_tokens=2)
    calibration = calibrate(params, model.config, list(range(3, 60)))

    def greedy():
        last = None
        for seqs, _, _ in generate_tokens(params, model.config, [[5, 17, 99, 3, 42], [7, 8]],
                                          max_new_tokens=4, sampling=SamplingParams(),
                                          eos_ids=(), ctx_size=256, cache_spec=spec,
                                          calibration=calibration):
            last = [list(s.ids) for s in seqs]
        return last

    want = greedy()
    with use_backend("pallas"):
        assert greedy() == want
