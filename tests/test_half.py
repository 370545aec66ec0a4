"""Half-precision linears (`tqjax.quant.half`): bf16 / f16 weights stored output-major, converted
inside the dot. Checked against float64 products of the same rounded weights, and a bf16 / f16
model against the same weights run as dense [in, out] arrays (the form they had before)."""

from __future__ import annotations

import dataclasses

import jax
import jax.numpy as jnp
import numpy as np
import pytest

import tqjax
from tqjax.models.transformer import LINEARS, LayerStack, forward
from tqjax.quant import half
from tqjax.quant.weights import linear

from .conftest import GOLDEN
from .test_stacked_cache import SPECS, new

HALF = {"bfloat16": jnp.bfloat16, "float16": jnp.float16}


@pytest.mark.parametrize("dtype", list(HALF))
@pytest.mark.parametrize("k,n", [(96, 300), (4864, 200)])  # 4864: 3 runs of a fused row
@pytest.mark.parametrize("rows", [1, 3, 37])  # fused (decode) and tiled (prefill)
def test_half_linear_equals_the_float64_product(dtype, k, n, rows):
    rng = np.random.default_rng(k + rows)
    w = jnp.asarray(rng.standard_normal((n, k)), HALF[dtype])  # [out, in]
    x = jnp.asarray(rng.standard_normal((rows, k)), jnp.float32)
    want = np.asarray(x, np.float64) @ np.asarray(w, np.float64).T
    hl = half.output_major(w)
    assert hl.bits.dtype == jnp.uint16 and hl.dtype == dtype
    got = jax.jit(linear)(x, hl)
    assert got.dtype == jnp.float32 and got.shape == (rows, n)
    # f32 sums of k terms, so as exact as XLA's own f32 dot of the same values, whose error
    # depends on the CPU's dot kernels: up to 5.1e-7 of the largest output on an Intel Xeon
    # (AMX); on an AMD EPYC 1.6e-6 (bf16, 37 rows) where the f32 dot's is 1.3e-6
    f32_dot = jax.jit(lambda x, w: x @ w.astype(jnp.float32).T)(x, w)
    bound = max(1e-6, 1.5 * np.max(np.abs(np.asarray(f32_dot) - want)) / np.max(np.abs(want)))
    assert np.max(np.abs(np.asarray(got) - want)) <= bound * np.max(np.abs(want))
    np.testing.assert_array_equal(np.asarray(half.values(hl.bits, dtype)),
                                  np.asarray(w, np.float32))
    np.testing.assert_array_equal(np.asarray(half.dense(hl)), np.asarray(w).T)


def _as_dense(params):
    """The params with every `HalfLinear` as the dense [in, out] array it stands for."""
    layers = [lp.replace(**{f: half.dense(getattr(lp, f)) for f in LINEARS})
              for lp in params.layers]
    return params.replace(layers=layers, lm_head=half.dense(params.lm_head))


def _logits(params, config):
    """Last-token logits f32 [3, 2, V] of a 7-token prefill of two rows and two decode steps
    (the fused dots)."""
    step = jax.jit(lambda p, c, t, s: forward(p, config, t, s, c))
    tokens = jnp.asarray([[3, 17, 5, 9, 2, 40, 7], [8, 1, 4, 4, 11, 60, 9]], jnp.int32)
    logits, cache = step(params, new(params, config, SPECS["f32"]), tokens,
                         jnp.zeros(2, jnp.int32))
    steps = [logits[:, -1]]
    for t in (21, 33):
        logits, cache = step(params, cache, jnp.asarray([[t], [t + 1]], jnp.int32),
                             jnp.asarray([7 + len(steps) - 1] * 2, jnp.int32))
        steps.append(logits[:, -1])
    return np.stack([np.asarray(s, np.float32) for s in steps])


@pytest.mark.parametrize("dtype", list(HALF))
@pytest.mark.parametrize("name", ["llama", "llama_tied", "qwen2"])
def test_half_model_runs_its_linears_output_major(name, dtype):
    """A half dtype loads every linear (and an untied head) as a `HalfLinear`, the layers
    stacked; prefill and
    decode logits match the same weights run as dense [in, out] arrays (XLA's own
    half-precision dots) to the activations' rounding."""
    m = tqjax.load(GOLDEN / "tiny" / name, dtype=dtype)
    p = m.params
    assert isinstance(p.layers, LayerStack)  # each linear compiled once (uint16 stacks)
    assert all(isinstance(getattr(lp, f), half.HalfLinear) for lp in p.layers for f in LINEARS)
    assert (p.lm_head is None) == m.config.tie_embeddings
    assert p.lm_head is None or isinstance(p.lm_head, half.HalfLinear)
    assert p.embed.dtype == HALF[dtype]  # [V, D]: the token lookup reads rows
    out = {"half": _logits(p, m.config), "dense": _logits(_as_dense(p), m.config)}
    scale = np.max(np.abs(out["dense"]))
    # the same products summed in another order, rounded to bf16 or f16 between layers:
    # measured 0.0 (bf16, all three) and up to 8.2e-4 (f16) of the largest logit; the bf16
    # bound is one rounding of an activation (2^-8)
    assert np.max(np.abs(out["half"] - out["dense"])) <= {"bfloat16": 4e-3, "float16": 2e-3}[
        dtype] * scale
    np.testing.assert_array_equal(out["half"].argmax(-1), out["dense"].argmax(-1))


@pytest.mark.parametrize("how", ["checkpoint", "on the fly", "loaded model"])
def test_a_dense_half_head_beside_quantized_layers_runs_output_major(tmp_path, how,
                                                                    monkeypatch):
    """An untied head left dense beside quantized layers (a quantized checkpoint loaded in
    bf16; quantizing on the fly in bf16 without quantized embeddings, or a loaded bf16 model)
    comes as a `HalfLinear`, not a dense bf16 array that XLA:CPU converts whole at every
    step; the logits are those of the same head run dense."""
    from tqjax.models import checkpoint
    from tqjax.models.checkpoint import save_quantized
    from tqjax.models.quantize import WeightSpec, quantize_params

    path = GOLDEN / "tiny" / "llama"  # untied
    if how == "checkpoint":
        tiny = tqjax.load(path)
        q = quantize_params(tiny.params, tiny.config, WeightSpec("int8"))
        save_quantized(tmp_path / "q", q, tiny.config, method={}, dense_dtype="bfloat16")
        monkeypatch.setattr(checkpoint, "PLACE_BYTES", 256)  # placed a few rows at a time
        m = tqjax.load(tmp_path / "q", dtype="bfloat16")
        np.testing.assert_array_equal(np.asarray(half.dense(m.params.lm_head)),
                                      np.asarray(tiny.params.lm_head, jnp.bfloat16))
    elif how == "on the fly":
        m = tqjax.load(path, dtype="bfloat16", weights="int8")
    else:
        m = tqjax.load(path, dtype="bfloat16")
        m = dataclasses.replace(m, params=quantize_params(m.params, m.config, WeightSpec("int8")))
    assert isinstance(m.params.lm_head, half.HalfLinear) and m.params.lm_head.dtype == "bfloat16"
    got = _logits(m.params, m.config)
    want = _logits(m.params.replace(lm_head=half.dense(m.params.lm_head)), m.config)
    # the same head, summed in another order: within one bf16 rounding of the largest logit
    assert np.max(np.abs(got - want)) <= 4e-3 * np.max(np.abs(want))
    np.testing.assert_array_equal(got.argmax(-1), want.argmax(-1))

