"""Prefill and decode: jitted steps over a preallocated KV cache, batching and streaming.

Prompts of different lengths are right-padded into one batch; each sequence keeps its own
position, so a sequence's padding slots are simply overwritten by its generated tokens
(causal masking hides them until then).
"""

from __future__ import annotations

import dataclasses
import functools
import time
from collections.abc import Callable, Iterator

import jax
import jax.numpy as jnp
import numpy as np

from tqjax.decode.sampling import SamplingParams, sample
from tqjax.errors import TqjaxError
from tqjax.kv.cache import CacheSpec, Calibration, KVCache, make_cache
from tqjax.models.config import ModelConfig
from tqjax.models.transformer import Params, forward

PAD_MULTIPLE = 64  # prompt lengths are padded to this multiple to bound recompilation
PREFILL_CHUNK = 512  # long prompts are prefilled in chunks: bounded memory, one compilation


def padded_length(n: int, multiple: int = PAD_MULTIPLE) -> int:
    return -(-n // multiple) * multiple


def new_cache(params: Params, config: ModelConfig, spec: CacheSpec, batch: int, slots: int,
              calibration: Calibration | None = None) -> KVCache:
    """An empty cache; `calibration` (from `calibrate.calibrate`) for centred turbo stores.
    The cache of a sharded model is sharded on its mesh (`tqjax.sharding.cache_shardings`)."""
    from tqjax.sharding import mesh_of, shard_cache

    cache = make_cache(spec, batch=batch, slots=slots, num_layers=config.num_layers,
                       kv_heads=config.num_kv_heads, head_dim=config.head_dim,
                       calibration=calibration, inv_freq=np.asarray(params.rope_inv_freq))
    mesh = mesh_of(params)
    return cache if mesh is None else shard_cache(cache, mesh)


@functools.partial(jax.jit, static_argnums=(1,), donate_argnums=(5,))
def prefill_chunk(params: Params, config: ModelConfig, tokens: jax.Array, start: jax.Array,
                  out_index: jax.Array, cache: KVCache) -> tuple[jax.Array, KVCache]:
    """tokens int32 [B, T] at positions start..start+T-1 -> logits [B, V] at out_index [B]."""
    return forward(params, config, tokens, start, cache, out_index=out_index)


def prefill(params: Params, config: ModelConfig, tokens: np.ndarray, lengths: np.ndarray,
            cache: KVCache) -> tuple[jax.Array, KVCache]:
    """Right-padded prompts tokens int32 [B, T], lengths [B] -> each prompt's last-token
    logits [B, V], in chunks of PREFILL_CHUNK tokens."""
    batch, total = tokens.shape
    chunk = min(total, PREFILL_CHUNK)
    last = np.asarray(lengths) - 1
    logits = None
    for c0 in range(0, total, chunk):
        part = tokens[:, c0:c0 + chunk]
        if part.shape[1] < chunk:
            part = np.pad(part, ((0, 0), (0, chunk - part.shape[1])))
        out_index = np.clip(last - c0, 0, chunk - 1).astype(np.int32)
        chunk_logits, cache = prefill_chunk(params, config, jnp.asarray(part),
                                            jnp.full(batch, c0, jnp.int32),
                                            jnp.asarray(out_index), cache)
        here = jnp.asarray((last >= c0) & (last < c0 + chunk))[:, None]
        logits = chunk_logits if logits is None else jnp.where(here, chunk_logits, logits)
    return logits, cache


@functools.partial(jax.jit, static_argnums=(1,), donate_argnums=(4,))
def full_logits(params: Params, config: ModelConfig, tokens: jax.Array, start: jax.Array,
                cache: KVCache) -> tuple[jax.Array, KVCache]:
    """Logits for every position of a chunk: tokens int32 [B, T] -> f32 [B, T, V]."""
    return forward(params, config, tokens, start, cache)


@functools.partial(jax.jit, static_argnums=(1, 6), donate_argnums=(2,))
def decode_step(params: Params, config: ModelConfig, cache: KVCache, tokens: jax.Array,
                positions: jax.Array, key: jax.Array, sampling: SamplingParams,
                seen: jax.Array) -> tuple[jax.Array, KVCache, jax.Array]:
    """Feed tokens int32 [B] at positions int32 [B]; sample the next ones.

    Returns (next tokens int32 [B], cache, seen bool [B, V] updated with the next tokens).
    """
    logits, cache = forward(params, config, tokens[:, None], positions, cache,
                            out_index=jnp.zeros_like(positions))
    nxt = sample(logits, seen, key, sampling)
    return nxt, cache, seen.at[jnp.arange(nxt.shape[0]), nxt].set(True)


@dataclasses.dataclass
class GenerationResult:
    """One sequence's output and timings (seconds; throughput in tokens/s)."""

    text: str
    token_ids: list[int]
    prompt_tokens: int
    generated_tokens: int
    finish_reason: str  # "eos", "stop", or "length"
    prefill_s: float
    decode_s: float

    @property
    def prefill_tok_s(self) -> float:
        return self.prompt_tokens / self.prefill_s if self.prefill_s > 0 else 0.0

    @property
    def decode_tok_s(self) -> float:
        """Steady-state decode speed: the first token comes from the prefill and the first
        decode step (which compiles) is not timed."""
        steps = self.generated_tokens - 2
        return steps / self.decode_s if steps > 0 and self.decode_s > 0 else 0.0


@dataclasses.dataclass
class _Sequence:
    prompt_len: int
    ids: list[int] = dataclasses.field(default_factory=list)
    done: str | None = None


def generate_tokens(params: Params, config: ModelConfig, prompts: list[list[int]], *,
                    max_new_tokens: int, sampling: SamplingParams, eos_ids: tuple[int, ...],
                    ctx_size: int, cache_spec: CacheSpec = CacheSpec(),
                    calibration: Calibration | None = None,
                    stop: Callable[[int, list[int]], bool] | None = None
                    ) -> Iterator[tuple[list[_Sequence], float, float]]:
    """Generate for a batch of tokenized prompts; yields (sequences, prefill_s, decode_s)
    after the prefill and after every decode step, so callers can stream.

    `stop(b, ids)` may end sequence b early (stop strings). The cache holds
    min(ctx_size, longest prompt + max_new_tokens) slots.
    """
    if not prompts or any(len(p) == 0 for p in prompts):
        raise TqjaxError("empty prompt")
    if max_new_tokens < 1:
        raise TqjaxError(f"max new tokens must be >= 1, got {max_new_tokens}")
    longest = max(len(p) for p in prompts)
    if longest >= ctx_size:
        raise TqjaxError(f"prompt is {longest} tokens, longer than the context size {ctx_size}")
    slots = min(ctx_size, padded_length(longest + max_new_tokens))
    batch = len(prompts)
    tokens = np.zeros((batch, padded_length(longest)), np.int32)
    seen = np.zeros((batch, config.vocab_size), bool)
    for b, p in enumerate(prompts):
        tokens[b, : len(p)] = p
        seen[b, p] = True
    lengths = np.asarray([len(p) for p in prompts], np.int32)
    written = tokens.shape[1]  # prefill writes whole (padded) chunks
    if written > PREFILL_CHUNK:
        written = -(-written // PREFILL_CHUNK) * PREFILL_CHUNK
    cache = new_cache(params, config, cache_spec, batch, max(slots, written), calibration)
    key = jax.random.PRNGKey(sampling.seed)

    t0 = time.perf_counter()
    logits, cache = prefill(params, config, tokens, lengths, cache)
    key, sub = jax.random.split(key)
    nxt = sample(logits, jnp.asarray(seen), sub, sampling)
    seen_j = jnp.asarray(seen).at[jnp.arange(batch), nxt].set(True)
    nxt_host = np.asarray(nxt)
    prefill_s = time.perf_counter() - t0
    seqs = [_Sequence(len(p)) for p in prompts]
    positions = np.asarray(lengths)
    t1 = time.perf_counter()  # reset after the first decode step, which includes compilation
    for step in range(max_new_tokens):
        for b, s in enumerate(seqs):
            if s.done:
                continue
            s.ids.append(int(nxt_host[b]))
            if s.ids[-1] in eos_ids:
                s.done = "eos"
            elif stop is not None and stop(b, s.ids):
                s.done = "stop"
            elif len(s.ids) >= max_new_tokens or s.prompt_len + len(s.ids) >= slots:
                s.done = "length"
        yield seqs, prefill_s, time.perf_counter() - t1
        if all(s.done for s in seqs) or step == max_new_tokens - 1:
            return
        key, sub = jax.random.split(key)
        nxt, cache, seen_j = decode_step(params, config, cache, jnp.asarray(nxt_host),
                                         jnp.asarray(positions), sub, sampling, seen_j)
        positions = positions + 1
        nxt_host = np.asarray(nxt)
        if step == 0:
            t1 = time.perf_counter()
