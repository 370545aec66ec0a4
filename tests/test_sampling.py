"""Per-row traced sampling: a batch mixing settings equals each row sampled alone, greedy rows
are the exact argmax, draws follow the softmax, and new settings never recompile."""

import dataclasses

import jax
import jax.numpy as jnp
import numpy as np
import pytest

from tqjax.decode.sampling import (
    SamplingParams,
    request_key,
    row_sampling,
    sample_rows,
    token_logprobs,
)

MIX = [SamplingParams(), SamplingParams(temperature=0.8, top_k=3, seed=1),
       SamplingParams(temperature=1.5, top_p=0.5, seed=2),
       SamplingParams(temperature=1.0, min_p=0.2, repeat_penalty=1.3, seed=3),
       SamplingParams(repeat_penalty=2.0)]


def test_mixed_rows_equal_rows_alone_and_greedy_is_argmax():
    rng = np.random.default_rng(0)
    logits = jnp.asarray(rng.normal(size=(len(MIX), 50)).astype(np.float32))
    seen = jnp.asarray(rng.random((len(MIX), 50)) < 0.2)
    keys = jnp.stack([request_key(s.seed) for s in MIX])
    step = jax.jit(sample_rows)
    together, next_keys = step(logits, seen, keys, row_sampling(MIX))
    for b, sp in enumerate(MIX):
        alone, k = step(logits[b:b + 1], seen[b:b + 1], keys[b:b + 1], row_sampling([sp]))
        assert int(alone[0]) == int(together[b])
        np.testing.assert_array_equal(k[0], next_keys[b])
    assert int(together[0]) == int(np.argmax(logits[0]))
    pen = np.where(seen[4], np.where(logits[4] > 0, logits[4] / 2, logits[4] * 2), logits[4])
    assert int(together[4]) == int(np.argmax(pen))
    assert step._cache_size() == 2  # batch 5 and batch 1: settings never recompile


def test_draws_follow_the_truncated_softmax():
    logits = jnp.asarray([[2.0, 1.0, 0.5, -1.0]] * 400)
    seen = jnp.zeros((400, 4), bool)
    keys = jnp.stack([request_key(i) for i in range(400)])
    draws = np.asarray(sample_rows(logits, seen, keys, row_sampling(
        [SamplingParams(temperature=1.0, top_k=2)] * 400))[0])
    assert set(draws.tolist()) == {0, 1}
    assert abs((draws == 0).mean() - 1 / (1 + np.exp(-1.0))) < 0.07  # softmax([2, 1])[0]
    draws = np.asarray(sample_rows(logits, seen, keys, row_sampling(
        [SamplingParams(temperature=1.0, top_p=0.6)] * 400))[0])
    assert set(draws.tolist()) == {0}  # p(0) = 0.61 >= top_p: only the first is kept


def test_token_logprobs_are_the_log_softmax():
    logits = jnp.asarray([[2.0, 1.0, 0.5, -1.0], [0.0, 3.0, 0.0, 1.0]])
    lp = token_logprobs(logits, jnp.asarray([2, 1]), 2)
    ref = np.asarray(logits) - np.log(np.exp(np.asarray(logits)).sum(-1, keepdims=True))
    np.testing.assert_allclose(lp.chosen, [ref[0, 2], ref[1, 1]], rtol=1e-6)
    np.testing.assert_array_equal(lp.top_ids, [[0, 1], [1, 3]])
    np.testing.assert_allclose(lp.top, [[ref[0, 0], ref[0, 1]], [ref[1, 1], ref[1, 3]]],
                               rtol=1e-6)


def test_any_integer_seed_and_top_k_are_taken_as_the_draws_take_them():
    """A seed is kept mod 2^32 (jax's key of a seed s is the key of s mod 2^32, so every seed
    that worked draws as before), a top_k past int32 as 2^31 - 1 (any k >= the vocabulary
    keeps every token): no size of integer fails when the settings become arrays."""
    for seed in (0, 7, -1, 2**31, 2**32 + 5, 2**63 - 1, -(2**63)):
        np.testing.assert_array_equal(np.asarray(request_key(SamplingParams(seed=seed).seed)),
                                      np.asarray(request_key(seed)))
    for seed in (2**64 + 5, -(2**63) - 1, 10**30):
        assert SamplingParams(seed=seed).seed == seed % 2**32
    big = SamplingParams(temperature=1.0, top_k=2**40, seed=3)
    assert big.top_k == 2**31 - 1
    logits = jnp.asarray(np.random.default_rng(0).normal(size=(1, 50)).astype(np.float32))
    seen = jnp.zeros((1, 50), bool)
    keys = request_key(3)[None]
    off = dataclasses.replace(big, top_k=0)  # top-k off: the same draw
    assert (np.asarray(sample_rows(logits, seen, keys, row_sampling([big]))[0])
            == np.asarray(sample_rows(logits, seen, keys, row_sampling([off]))[0])).all()


def test_settings_that_overflow_float32_are_refused():
    """The draws run in float32: a temperature or repeat penalty past its largest value was
    inf there (a RuntimeWarning, then a request served with it); the largest is kept."""
    from tqjax.errors import TqjaxError

    top = float(np.finfo(np.float32).max)
    for name in ("temperature", "repeat_penalty"):
        assert getattr(SamplingParams(**{name: top}), name) == top
        with pytest.raises(TqjaxError, match=r"must be finite \(in float32\)"):
            SamplingParams(**{name: 1e300})
