"""Perplexity over non-overlapping windows, and agreement with a reference configuration."""

from __future__ import annotations

import dataclasses
import functools

import jax
import jax.numpy as jnp
import numpy as np

from tqjax.api import Model
from tqjax.decode.generate import new_cache
from tqjax.errors import TqjaxError
from tqjax.kv.cache import CacheSpec, KVCache
from tqjax.models.config import ModelConfig
from tqjax.models.transformer import Params, forward


@dataclasses.dataclass
class PerplexityResult:
    """ppl = exp(mean NLL) over every predicted token; kl/top1 only against a reference."""

    ppl: float
    nll: float
    tokens: int  # predicted tokens: windows * (ctx - 1)
    windows: int
    kl: float | None = None  # mean KL(reference || model), nats per token
    top1: float | None = None  # fraction of positions whose argmax agrees with the reference


@functools.partial(jax.jit, static_argnums=(1,), donate_argnums=(3,))
def window_logprobs(params: Params, config: ModelConfig, tokens: jax.Array,
                    cache: KVCache) -> tuple[jax.Array, jax.Array]:
    """tokens int32 [1, T] -> (log-probs f32 [T-1, V] predicting tokens 1..T-1, NLL [T-1])."""
    logits, _ = forward(params, config, tokens, jnp.zeros(1, jnp.int32), cache)
    logp = jax.nn.log_softmax(logits[0, :-1], axis=-1)
    nll = -jnp.take_along_axis(logp, tokens[0, 1:, None], axis=-1)[:, 0]
    return logp, nll


@jax.jit
def _compare(ref_logp: jax.Array, logp: jax.Array) -> tuple[jax.Array, jax.Array]:
    kl = jnp.sum(jnp.exp(ref_logp) * (ref_logp - logp), axis=-1)
    agree = jnp.argmax(ref_logp, axis=-1) == jnp.argmax(logp, axis=-1)
    return jnp.sum(kl), jnp.sum(agree)


def perplexity(model: Model, ids: list[int] | np.ndarray, ctx: int,
               cache: CacheSpec = CacheSpec(), reference: CacheSpec | None = None,
               reference_model: Model | None = None) -> PerplexityResult:
    """Perplexity of `ids` in independent windows of `ctx` tokens (a partial tail is dropped).

    With `reference` (a cache spec) and/or `reference_model` (e.g. unquantized weights), also
    report KL divergence and top-1 agreement of next-token distributions against it.
    """
    ids = np.asarray(ids, np.int32)
    if ctx < 2:
        raise TqjaxError(f"ctx must be >= 2, got {ctx}")
    if ctx > model.config.max_position:
        raise TqjaxError(f"ctx {ctx} exceeds the model's context {model.config.max_position}")
    windows = len(ids) // ctx
    if windows == 0:
        raise TqjaxError(f"need at least {ctx} tokens for one window, got {len(ids)}")
    compare = reference is not None or reference_model is not None
    ref_model = reference_model or model
    ref_spec = reference or CacheSpec()
    nll_sum, kl_sum, agree_sum = 0.0, 0.0, 0
    for w in range(windows):
        tokens = jnp.asarray(ids[None, w * ctx:(w + 1) * ctx])
        logp, nll = window_logprobs(model.params, model.config, tokens,
                                    new_cache(model.config, cache, 1, ctx))
        nll_sum += float(jnp.sum(nll))
        if compare:
            ref_logp, _ = window_logprobs(ref_model.params, ref_model.config, tokens,
                                          new_cache(ref_model.config, ref_spec, 1, ctx))
            kl, agree = _compare(ref_logp, logp)
            kl_sum, agree_sum = kl_sum + float(kl), agree_sum + int(agree)
    n = windows * (ctx - 1)
    return PerplexityResult(
        ppl=float(np.exp(nll_sum / n)), nll=nll_sum / n, tokens=n, windows=windows,
        kl=kl_sum / n if compare else None, top1=agree_sum / n if compare else None)
