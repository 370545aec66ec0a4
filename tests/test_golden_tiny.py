"""Tiny random HF models: our logits against HF transformers' (golden/tiny, f32)."""

import json

import chex
import jax
import jax.numpy as jnp
import numpy as np
import pytest
from safetensors.numpy import load_file

import tqjax
from tqjax.decode.generate import new_cache
from tqjax.models.config import config_from_hf
from tqjax.models.transformer import forward

from .conftest import GOLDEN

NAMES = sorted(p.name for p in (GOLDEN / "tiny").iterdir() if p.is_dir())
TOL = 1e-4
# forward jitted as the product runs it (eager, every attention loop compiles on its own:
# 3-4x the time)
step = jax.jit(forward, static_argnums=(1,))


@pytest.fixture(scope="module", params=NAMES)
def case(request):
    path = GOLDEN / "tiny" / request.param
    return tqjax.load(path), load_file(path / "reference.safetensors")


def test_all_architectures_present():
    assert {"llama", "llama3_rope", "llama_tied", "qwen2", "qwen2_gqa7", "qwen3"} <= set(NAMES)


def test_full_sequence_logits(case):
    model, ref = case
    for row in range(ref["input_ids"].shape[0]):
        got = tqjax.logits(model, ref["input_ids"][row].tolist())
        chex.assert_shape(got, ref["logits"][row].shape)
        np.testing.assert_allclose(got, ref["logits"][row], atol=TOL, rtol=0)


def test_prefill_then_token_by_token_decode(case):
    model, ref = case
    ids, want = ref["input_ids"], ref["logits"]
    b, t = ids.shape
    split = 5
    cache = new_cache(model.params, model.config, tqjax.CacheSpec(), b, t)
    logits, cache = step(model.params, model.config, jnp.asarray(ids[:, :split]),
                         jnp.zeros(b, jnp.int32), cache)
    got = [np.asarray(logits)]
    for pos in range(split, t):
        logits, cache = step(model.params, model.config, jnp.asarray(ids[:, pos:pos + 1]),
                             jnp.full(b, pos, jnp.int32), cache)
        got.append(np.asarray(logits))
    np.testing.assert_allclose(np.concatenate(got, axis=1), want, atol=TOL, rtol=0)


def test_ragged_batch_matches_unbatched(case):
    """Rows of different lengths, right-padded in one batch, give each row's own logits."""
    model, ref = case
    ids, want = ref["input_ids"], ref["logits"]
    lengths = [ids.shape[1], 9]
    tokens = ids.copy()
    tokens[1, lengths[1]:] = 0  # padding
    cache = new_cache(model.params, model.config, tqjax.CacheSpec(), 2, ids.shape[1] + 4)
    logits, cache = step(model.params, model.config, jnp.asarray(tokens),
                         jnp.zeros(2, jnp.int32), cache)
    np.testing.assert_allclose(np.asarray(logits)[1, :9], want[1, :9], atol=TOL, rtol=0)
    # decode one more step for the short row at its own position: matches HF's next logits
    nxt = jnp.asarray([[ids[0, -1]], [ids[1, 9]]])
    logits, _ = step(model.params, model.config, nxt, jnp.asarray([15, 9], jnp.int32), cache)
    np.testing.assert_allclose(np.asarray(logits)[1, 0], want[1, 9], atol=TOL, rtol=0)


def test_bfloat16_close_to_f32(case):
    model, ref = case
    path = model.source
    m16 = tqjax.load(path, dtype="bfloat16")
    got = tqjax.logits(m16, ref["input_ids"][0].tolist())
    err = np.abs(got - ref["logits"][0]).max()
    assert err < 0.15 * np.abs(ref["logits"][0]).max(), err
    assert (got.argmax(-1) == ref["logits"][0].argmax(-1)).mean() >= 0.8


@pytest.mark.parametrize("name", ["llama", "llama3_rope"])
def test_legacy_and_new_config_formats_agree(name):
    d = GOLDEN / "tiny" / name
    new = config_from_hf(json.loads((d / "config.json").read_text()))
    legacy = config_from_hf(json.loads((d / "config.legacy.json").read_text()))
    assert new == legacy
