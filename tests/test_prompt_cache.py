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
