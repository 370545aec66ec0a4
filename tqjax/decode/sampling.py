"""Token sampling: repetition penalty, temperature, top-k, top-p, min-p; greedy at T=0.

Settings are per row and traced (`RowSampling`: arrays [B]), so one compiled decode step serves
any mix of requests (a server's continuous batch) and a new seed or temperature never
recompiles. Each row has its own PRNG key, split once per sampled token. Greedy rows
(temperature 0) take the argmax of the (penalised) logits exactly; the sorted-vocabulary
sampling path runs only when some row samples.
"""

from __future__ import annotations

import dataclasses
import secrets
from collections.abc import Sequence

import jax
import jax.numpy as jnp
import numpy as np
from flax import struct

from tqjax.errors import TqjaxError, is_int, is_real

FLOAT32_MAX = float(np.finfo(np.float32).max)  # a larger setting would be inf in the draws


@dataclasses.dataclass(frozen=True)
class SamplingParams:
    """One request's sampling settings (host side, validated). temperature 0 means greedy."""

    temperature: float = 0.0
    top_k: int = 0  # 0: off
    top_p: float = 1.0  # 1: off
    min_p: float = 0.0  # 0: off
    repeat_penalty: float = 1.0  # 1: off; HF/CTRL style over every token in the context
    seed: int = 0  # any integer: the PRNG key depends on its low 32 bits (`request_key`)

    def __post_init__(self) -> None:
        for name in ("temperature", "top_p", "min_p", "repeat_penalty"):
            if not is_real(getattr(self, name)):
                raise TqjaxError(f"{name.replace('_', '-')} must be a number, got "
                                 f"{getattr(self, name)!r}")
        for name in ("top_k", "seed"):
            if not is_int(getattr(self, name)):
                raise TqjaxError(f"{name.replace('_', '-')} must be an integer, got "
                                 f"{getattr(self, name)!r}")
        # kept as the draws already take them, so no size of int fails downstream: a seed
        # mod 2^32 (jax's key for seed s is that of s mod 2^32), a top-k of at most 2^31 - 1
        # (int32; any k >= the vocabulary keeps every token)
        object.__setattr__(self, "seed", int(self.seed) % (1 << 32))
        object.__setattr__(self, "top_k", min(int(self.top_k), (1 << 31) - 1))
        if not 0 <= self.temperature <= FLOAT32_MAX:  # (the draws run in float32)
            raise TqjaxError(f"temperature must be finite (in float32) and >= 0, got "
                             f"{self.temperature}")
        if not 0 < self.top_p <= 1:
            raise TqjaxError(f"top-p must be in (0, 1], got {self.top_p}")
        if not 0 <= self.min_p < 1:
            raise TqjaxError(f"min-p must be in [0, 1), got {self.min_p}")
        if self.top_k < 0:
            raise TqjaxError(f"top-k must be >= 0, got {self.top_k}")
        if not 0 < self.repeat_penalty <= FLOAT32_MAX:
            raise TqjaxError(f"repeat penalty must be finite (in float32) and > 0, got "
                             f"{self.repeat_penalty}")


@struct.dataclass
class RowSampling:
    """Per-row sampling settings as traced arrays (one entry per batch row)."""

    temperature: jax.Array  # f32 [B]; 0 = greedy
    top_k: jax.Array  # int32 [B]; 0 = off
    top_p: jax.Array  # f32 [B]; 1 = off
    min_p: jax.Array  # f32 [B]; 0 = off
    repeat_penalty: jax.Array  # f32 [B]; 1 = off


def row_sampling(settings: Sequence[SamplingParams]) -> RowSampling:
    """Stack per-request settings into the traced arrays [B] a decode step takes."""
    col = lambda name, dtype: jnp.asarray(np.asarray([getattr(s, name) for s in settings], dtype))
    return RowSampling(col("temperature", np.float32), col("top_k", np.int32),
                       col("top_p", np.float32), col("min_p", np.float32),
                       col("repeat_penalty", np.float32))


RANDOM_SEED = -1  # as llama.cpp: a seed of -1 asks for a fresh one (`random_seed`)


def random_seed() -> int:
    """A fresh seed, for a request that gave none or gave `RANDOM_SEED`."""
    return secrets.randbits(31)


def request_key(seed: int, index: int = 0) -> jax.Array:
    """The PRNG key of a request's row: uint32 [2], fold_in(PRNGKey(seed), index). Row b of an
    offline batch uses index b; a server request uses index 0, so it draws exactly what an
    offline single-prompt run with the same seed draws."""
    return jax.random.fold_in(jax.random.PRNGKey(seed), index)


def row_keys(seed: int, batch: int) -> jax.Array:
    """Keys uint32 [B, 2] for an offline batch sharing one seed (row b: index b)."""
    return jnp.stack([request_key(seed, b) for b in range(batch)])


def apply_repeat_penalty(logits: jax.Array, seen: jax.Array, penalty: jax.Array | float
                         ) -> jax.Array:
    """Divide positive / multiply negative logits of tokens already in the context.
    logits f32 [B, V], seen bool [B, V], penalty scalar or f32 [B, 1]."""
    penalised = jnp.where(logits > 0, logits / penalty, logits * penalty)
    return jnp.where(seen, penalised, logits)


def _draw(logits: jax.Array, keys: jax.Array, rs: RowSampling) -> jax.Array:
    """Temperature, top-k, top-p, min-p over the sorted vocabulary, then one categorical draw
    per row with its own key: logits f32 [B, V], keys [B, 2] -> token ids int32 [B]."""
    vocab = logits.shape[-1]
    temp = jnp.where(rs.temperature > 0, rs.temperature, 1.0)[:, None]
    top_logits, top_ids = jax.lax.top_k(logits / temp, vocab)  # sorted descending, [B, V]
    rank = jnp.arange(vocab)[None, :]
    k = jnp.where((rs.top_k > 0) & (rs.top_k < vocab), rs.top_k, vocab)[:, None]
    keep = rank < k
    probs = jax.nn.softmax(jnp.where(keep, top_logits, -jnp.inf), axis=-1)
    # top-p: the smallest prefix whose mass reaches top_p (always keeps the first)
    keep &= (rs.top_p[:, None] >= 1.0) | ((jnp.cumsum(probs, axis=-1) - probs)
                                          < rs.top_p[:, None])
    keep &= probs >= rs.min_p[:, None] * probs[:, :1]
    masked = jnp.where(keep, top_logits, -jnp.inf)
    choice = jax.vmap(jax.random.categorical)(keys, masked)  # [B]
    return jnp.take_along_axis(top_ids, choice[:, None], axis=-1)[:, 0].astype(jnp.int32)


@jax.jit
def sample_rows(logits: jax.Array, seen: jax.Array, keys: jax.Array, rs: RowSampling
                ) -> tuple[jax.Array, jax.Array]:
    """logits f32 [B, V], seen bool [B, V] (tokens in context), keys uint32 [B, 2] ->
    (next token ids int32 [B], the rows' next keys [B, 2]). Rows with temperature 0 get the
    argmax of the penalised logits, bit for bit. Jitted, so an eager call compiles once per
    shape (its `lax.cond` would otherwise be traced and compiled again at every call)."""
    logits = apply_repeat_penalty(logits, seen & (rs.repeat_penalty[:, None] != 1.0),
                                  rs.repeat_penalty[:, None])
    greedy = jnp.argmax(logits, axis=-1).astype(jnp.int32)
    split = jax.vmap(jax.random.split)(keys)  # [B, 2, 2]
    nxt_keys, subs = split[:, 0], split[:, 1]
    sampled = jax.lax.cond(jnp.any(rs.temperature > 0), lambda: _draw(logits, subs, rs),
                           lambda: greedy)
    return jnp.where(rs.temperature > 0, sampled, greedy), nxt_keys


@struct.dataclass
class TokenLogprobs:
    """Log-probabilities under the model's distribution (raw logits, before penalties and
    temperature) of the chosen tokens and each row's `n` most likely tokens."""

    chosen: jax.Array  # f32 [B]
    top_ids: jax.Array  # int32 [B, n]
    top: jax.Array  # f32 [B, n], descending


def token_logprobs(logits: jax.Array, chosen: jax.Array, n: int) -> TokenLogprobs:
    """logits f32 [B, V], chosen int32 [B], n >= 1 (static) -> TokenLogprobs."""
    logp = jax.nn.log_softmax(logits, axis=-1)
    top, top_ids = jax.lax.top_k(logp, n)
    return TokenLogprobs(jnp.take_along_axis(logp, chosen[:, None], axis=-1)[:, 0],
                         top_ids.astype(jnp.int32), top)


def sample(logits: jax.Array, seen: jax.Array, key: jax.Array, sp: SamplingParams) -> jax.Array:
    """One setting for every row: logits f32 [B, V], seen bool [B, V], key -> ids int32 [B]
    (row b draws with key fold_in(key, b))."""
    batch = logits.shape[0]
    keys = jnp.stack([jax.random.fold_in(key, b) for b in range(batch)])
    return sample_rows(logits, seen, keys, row_sampling([sp] * batch))[0]
