"""Prompt caches: rows of a cache (take_row/put_row), saved caches, prefix reuse, context shift."""

import jax
import jax.numpy as jnp
import numpy as np
import pytest

import tqjax
from tqjax.decode import generate as gen
from tqjax.decode import prompt_cache as pc
from tqjax.errors import TqjaxError
from tqjax.kv.cache import CacheSpec

from .conftest import GOLDEN
from .test_cli import make_byte_tokenizer

SPECS = {"f32": CacheSpec(), "q8": CacheSpec("q8", "q8"), "turbo4": CacheSpec("turbo4", "turbo4"),
         "turbo4/turbo3": CacheSpec("turbo4", "turbo3", recent_tokens=8)}


@pytest.fixture(scope="module")
def model(tmp_path_factory):
    """The tiny random Llama with a byte tokenizer (turbo caches calibrate on text)."""
    import shutil

    d = tmp_path_factory.mktemp("tiny") / "llama"
    shutil.copytree(GOLDEN / "tiny" / "llama", d)
    make_byte_tokenizer(d)
    return tqjax.load(d)


def filled(model, spec, prompts, slots):
    """A cache of len(prompts) rows holding the prompts (right-padded, one prefill)."""
    width = max(len(p) for p in prompts)
    tokens = np.zeros((len(prompts), gen.padded_length(width)), np.int32)
    for b, p in enumerate(prompts):
        tokens[b, :len(p)] = p
    cache = gen.new_cache(model.params, model.config, spec, len(prompts), slots,
                          model.calibration(spec))
    _, cache = gen.prefill(model.params, model.config, tokens,
                           np.asarray([len(p) for p in prompts]), cache)
    return cache


def row_leaves(cache):
    """(path, array) of every leaf, numpy."""
    return [(jax.tree_util.keystr(k), np.asarray(x))
            for k, x in jax.tree_util.tree_leaves_with_path(cache)]


@pytest.mark.parametrize("name", list(SPECS))
def test_take_row_and_put_row_copy_exactly_the_row(model, name):
    spec = SPECS[name]
    rng = np.random.default_rng(0)
    prompts = [rng.integers(3, 256, 40).tolist(), rng.integers(3, 256, 23).tolist()]
    cache = filled(model, spec, prompts, 128)
    one = pc.take_row(cache, 1)
    for (path, a), (_, b) in zip(row_leaves(cache), row_leaves(one), strict=True):
        if b.shape != a.shape:  # a per-row array: exactly row 1
            assert b.shape == (1, *a.shape[1:]), path
            np.testing.assert_array_equal(b[0], a[1], err_msg=path)
        else:  # a per-layer constant, shared
            np.testing.assert_array_equal(b, a, err_msg=path)
    # into row 0 of another 2-row cache: row 0 becomes the copy, row 1 and constants unchanged
    other = filled(model, spec, [rng.integers(3, 256, 30).tolist()] * 2, 128)
    before = row_leaves(other)
    merged = pc.put_row(other, 0, one)
    for (path, a), (_, o), (_, m), (_, r) in zip(row_leaves(cache), before, row_leaves(merged),
                                                 row_leaves(one), strict=True):
        if r.shape != a.shape:  # per-row
            np.testing.assert_array_equal(m[0], a[1], err_msg=path)
            np.testing.assert_array_equal(m[1], o[1], err_msg=path)
        else:
            np.testing.assert_array_equal(m, o, err_msg=path)
    # the next decode step of the moved row gives the original row's logits, bit for bit
    step = jax.jit(lambda c, t, s: gen.forward(model.params, model.config, t, s, c,
                                               out_index=jnp.zeros(2, jnp.int32)))
    want, _ = step(cache, jnp.asarray([[5], [7]]), jnp.asarray([40, 23], jnp.int32))
    got, _ = step(merged, jnp.asarray([[7], [9]]), jnp.asarray([23, 30], jnp.int32))
    np.testing.assert_array_equal(np.asarray(got[0]), np.asarray(want[1]))


def test_put_row_with_fewer_slots_fills_the_first(model):
    spec = SPECS["turbo4/turbo3"]
    rng = np.random.default_rng(1)
    prompt = rng.integers(3, 256, 50).tolist()
    small = filled(model, spec, [prompt], 64)
    big = gen.new_cache(model.params, model.config, spec, 3, 256, model.calibration(spec))
    merged = pc.put_row(big, 2, small)
    assert merged.slots == 256
    lk = merged.layers[1].k
    np.testing.assert_array_equal(np.asarray(lk.packed[2, :, :64]),
                                  np.asarray(small.layers[1].k.packed[0]))
    assert not np.asarray(lk.packed[2, :, 64:]).any() and not np.asarray(lk.packed[:2]).any()
    np.testing.assert_array_equal(np.asarray(merged.layers[0].recent.pos[2]),
                                  np.asarray(small.layers[0].recent.pos[0]))
    with pytest.raises(TqjaxError, match="does not fit"):
        pc.put_row(small, 0, pc.take_row(merged, 2))
    with pytest.raises(TqjaxError, match="out of range"):
        pc.take_row(merged, 3)
    with pytest.raises(TqjaxError, match="does not match"):
        pc.put_row(gen.new_cache(model.params, model.config, CacheSpec(), 1, 64), 0, small)


def meta_for(model, spec, params=None):
    return pc.cache_meta(model.config, params or model.params, model.tokenizer, spec,
                         model.calibration(spec))


@pytest.mark.parametrize("name", list(SPECS))
def test_saved_cache_restores_bit_for_bit(model, name, tmp_path):
    """Save after a prefill of n tokens, restore into a cache of the same slots: the next two
    decode steps give the same logits bit for bit; only the live positions are stored."""
    spec = SPECS[name]
    prompt = np.random.default_rng(2).integers(3, 256, 45).tolist()
    cache = filled(model, spec, [prompt], 128)
    meta = meta_for(model, spec)
    path = tmp_path / "p.tqkv"
    pc.save_prompt_cache(path, cache, prompt, meta)
    restored, ids = pc.load_prompt_cache(path, meta, 128)
    assert ids == prompt and restored.slots == 128

    step = jax.jit(lambda c, t, s: gen.forward(model.params, model.config, t, s, c,
                                               out_index=jnp.zeros(1, jnp.int32)))
    for pos, tok in ((45, 9), (46, 77)):
        want, cache = step(cache, jnp.asarray([[tok]]), jnp.asarray([pos], jnp.int32))
        got, restored = step(restored, jnp.asarray([[tok]]), jnp.asarray([pos], jnp.int32))
        np.testing.assert_array_equal(np.asarray(got), np.asarray(want))
    # a bigger row works too (other attention blocks: equal to rounding)
    bigger, _ = pc.load_prompt_cache(path, meta, 1024)
    got, _ = step(bigger, jnp.asarray([[9]]), jnp.asarray([45], jnp.int32))
    first, _ = step(filled(model, spec, [prompt], 128), jnp.asarray([[9]]),
                    jnp.asarray([45], jnp.int32))
    np.testing.assert_allclose(np.asarray(got), np.asarray(first), atol=1e-5, rtol=1e-5)
    from safetensors import safe_open

    with safe_open(str(path), "numpy") as f:  # stored: 45 positions, not the 128 slots
        shapes = {k: f.get_slice(k).get_shape() for k in f.keys()}  # noqa: SIM118
    slot_axes = [s[2] for k, s in shapes.items() if k.endswith((".data", ".packed", ".q"))]
    assert slot_axes and set(slot_axes) == {45}


def test_bad_prompt_cache_files_are_refused(model, tmp_path):
    spec = SPECS["turbo4"]
    prompt = np.random.default_rng(3).integers(3, 256, 20).tolist()
    meta = meta_for(model, spec)
    good = tmp_path / "good.tqkv"
    pc.save_prompt_cache(good, filled(model, spec, [prompt], 64), prompt, meta)
    data = good.read_bytes()

    def refused(blob, match, m=meta, slots=64):
        bad = tmp_path / "bad.tqkv"
        bad.write_bytes(blob)
        with pytest.raises(TqjaxError, match=match) as e:
            pc.load_prompt_cache(bad, m, slots)
        assert "\n" not in str(e.value)

    other = model.params.replace(final_norm=model.params.final_norm * 1.5)
    refused(data, "another model", meta_for(model, spec, other))
    refused(data, "another cache type", meta_for(model, SPECS["turbo4/turbo3"]))
    refused(data, "another cache type", meta_for(model, CacheSpec("turbo4", "turbo4", seed=1)))
    refused(data[: len(data) - 100], "truncated or corrupt")
    refused(data[:40], "truncated or corrupt")
    for at in (len(data) - 50, len(data) // 2):  # a flipped byte in the arrays
        flipped = bytearray(data)
        flipped[at] ^= 0x10
        refused(bytes(flipped), "corrupt")
    header_len = int.from_bytes(data[:8], "little")
    text = data[8:8 + header_len].replace(b'"version":"1"', b'"version":"2"')
    assert len(text) == header_len
    refused(data[:8] + text + data[8 + header_len:], "format version 2")
    refused(data, "holds 20 tokens, more than the 16 slots", slots=16)
    with pytest.raises(TqjaxError, match="no such"):
        pc.load_prompt_cache(tmp_path / "missing.tqkv", meta, 64)
