"""Token sampling: repetition penalty, temperature, top-k, top-p, min-p; greedy at T=0."""

from __future__ import annotations

import dataclasses

import jax
import jax.numpy as jnp

from tqjax.errors import TqjaxError


@dataclasses.dataclass(frozen=True)
class SamplingParams:
    """Sampling settings (static under jit). temperature 0 means greedy decoding."""

    temperature: float = 0.0
    top_k: int = 0  # 0: off
    top_p: float = 1.0  # 1: off
    min_p: float = 0.0  # 0: off
    repeat_penalty: float = 1.0  # 1: off; HF/CTRL style over every token in the context
    seed: int = 0

    def __post_init__(self) -> None:
        if not self.temperature >= 0:
            raise TqjaxError(f"temperature must be >= 0, got {self.temperature}")
        if not 0 < self.top_p <= 1:
            raise TqjaxError(f"top-p must be in (0, 1], got {self.top_p}")
        if not 0 <= self.min_p < 1:
            raise TqjaxError(f"min-p must be in [0, 1), got {self.min_p}")
        if self.top_k < 0:
            raise TqjaxError(f"top-k must be >= 0, got {self.top_k}")
        if not self.repeat_penalty > 0:
            raise TqjaxError(f"repeat penalty must be > 0, got {self.repeat_penalty}")


def apply_repeat_penalty(logits: jax.Array, seen: jax.Array, penalty: float) -> jax.Array:
    """Divide positive / multiply negative logits of tokens already in the context."""
    penalised = jnp.where(logits > 0, logits / penalty, logits * penalty)
    return jnp.where(seen, penalised, logits)


def sample(logits: jax.Array, seen: jax.Array, key: jax.Array, sp: SamplingParams) -> jax.Array:
    """logits f32 [B, V], seen bool [B, V] (tokens in context) -> next token ids int32 [B]."""
    if sp.repeat_penalty != 1.0:
        logits = apply_repeat_penalty(logits, seen, sp.repeat_penalty)
    if sp.temperature == 0:
        return jnp.argmax(logits, axis=-1).astype(jnp.int32)
    logits = logits / sp.temperature
    k = sp.top_k if 0 < sp.top_k < logits.shape[-1] else logits.shape[-1]
    top_logits, top_ids = jax.lax.top_k(logits, k)  # sorted descending, [B, k]
    probs = jax.nn.softmax(top_logits, axis=-1)
    keep = jnp.ones_like(top_logits, dtype=bool)
    if sp.top_p < 1.0:  # smallest prefix whose mass reaches top_p (always keeps the first)
        keep &= (jnp.cumsum(probs, axis=-1) - probs) < sp.top_p
    if sp.min_p > 0.0:
        keep &= probs >= sp.min_p * probs[:, :1]
    choice = jax.random.categorical(key, jnp.where(keep, top_logits, -jnp.inf), axis=-1)
    return jnp.take_along_axis(top_ids, choice[:, None], axis=-1)[:, 0].astype(jnp.int32)
