"""Prefill and decode: jitted steps over a preallocated KV cache, batching and streaming.

Prompts of different lengths are right-padded into one batch; each sequence keeps its own
position, so a sequence's padding slots are simply overwritten by its generated tokens
(causal masking hides them until then).
"""

from __future__ import annotations

import dataclasses
import functools
import time
from collections.abc import Callable, Generator, Sequence

import jax
import jax.numpy as jnp
import numpy as np

from tqjax.decode.sampling import (
    RowSampling,
    SamplingParams,
    TokenLogprobs,
    row_keys,
    row_sampling,
    sample_rows,
    token_logprobs,
)
from tqjax.errors import TqjaxError, is_int
from tqjax.kv.cache import CacheSpec, Calibration, KVCache, LayerCache, group_size, make_cache
from tqjax.kv.rope import apply_rope, rope_cos_sin
from tqjax.models.config import ModelConfig
from tqjax.models.transformer import Params, forward
from tqjax.xla import compile_timer

PAD_MULTIPLE = 64  # prompt lengths are padded to this multiple to bound recompilation
PREFILL_CHUNK = 512  # long prompts are prefilled in chunks: bounded memory, one compilation


def padded_length(n: int, multiple: int = PAD_MULTIPLE) -> int:
    return -(-n // multiple) * multiple


def new_cache(params: Params, config: ModelConfig, spec: CacheSpec, batch: int, slots: int,
              calibration: Calibration | None = None) -> KVCache:
    """An empty cache; `calibration` (from `calibrate.calibrate`) for centred turbo stores.
    The cache of a sharded model is sharded on its mesh (`tqjax.sharding.cache_shardings`).
    Its constants are made on the host from the params: call it outside jax.jit / jax.grad and
    pass the cache in (traced params are a TqjaxError)."""
    from tqjax.sharding import mesh_of, shard_cache

    if isinstance(params.rope_inv_freq, jax.core.Tracer):
        raise TqjaxError("new_cache makes the cache's constants on the host: call it outside "
                         "jax.jit / jax.grad and pass the cache in as an argument")

    cache = make_cache(spec, batch=batch, slots=slots, num_layers=config.num_layers,
                       kv_heads=config.num_kv_heads, head_dim=config.head_dim,
                       calibration=calibration, inv_freq=np.asarray(params.rope_inv_freq))
    mesh = mesh_of(params)
    return cache if mesh is None else shard_cache(cache, mesh)


@functools.partial(jax.jit, static_argnums=(1,), donate_argnums=(5,))
def prefill_chunk(params: Params, config: ModelConfig, tokens: jax.Array, start: jax.Array,
                  out_index: jax.Array, cache: KVCache, valid: jax.Array | None = None
                  ) -> tuple[jax.Array, KVCache]:
    """tokens int32 [B, T] at positions start..start+T-1 -> logits [B, V] at out_index [B];
    valid int32 [B]: each row's real (not padding) tokens in the chunk, the ones that enter the
    recent-token rings (None: all T; `prefill` always passes it, a traced array)."""
    return forward(params, config, tokens, start, cache, out_index=out_index, valid=valid)


def prefill(params: Params, config: ModelConfig, tokens: np.ndarray, lengths: np.ndarray,
            cache: KVCache, start: np.ndarray | None = None) -> tuple[jax.Array, KVCache]:
    """Right-padded prompts tokens int32 [B, T], lengths [B] -> each prompt's last-token
    logits [B, V], in chunks of PREFILL_CHUNK tokens. Row b's tokens go to slots start[b]..
    (default 0: a cache whose first start[b] slots already hold the row's prefix); every
    chunk, padding included, must fit the cache's slots (a TqjaxError otherwise)."""
    batch, total = tokens.shape
    chunk = min(total, PREFILL_CHUNK)
    start = np.zeros(batch, np.int32) if start is None else np.asarray(start, np.int32)
    check_fits(start, -(-total // chunk) * chunk, cache.slots)
    last = np.asarray(lengths) - 1
    logits = None
    for c0 in range(0, total, chunk):
        part = tokens[:, c0:c0 + chunk]
        if part.shape[1] < chunk:
            part = np.pad(part, ((0, 0), (0, chunk - part.shape[1])))
        out_index = np.clip(last - c0, 0, chunk - 1).astype(np.int32)
        valid = np.clip(np.asarray(lengths) - c0, 0, chunk).astype(np.int32)
        chunk_logits, cache = prefill_chunk(params, config, jnp.asarray(part),
                                            jnp.asarray(start + c0, jnp.int32),
                                            jnp.asarray(out_index), cache, jnp.asarray(valid))
        here = jnp.asarray((last >= c0) & (last < c0 + chunk))[:, None]
        logits = chunk_logits if logits is None else jnp.where(here, chunk_logits, logits)
    return logits, cache


def check_fits(start: np.ndarray, count: int, slots: int) -> None:
    """Raise TqjaxError unless writing `count` tokens at slots start[b].. stays inside `slots`
    (XLA clamps an out-of-range update start, which would overwrite the last live slots)."""
    end = int(np.max(np.asarray(start))) + count
    if end > slots:
        raise TqjaxError(f"writing {count} tokens from slot {int(np.max(start))} needs {end} "
                         f"cache slots, the cache has {slots}")


@functools.partial(jax.jit, static_argnums=(1,), donate_argnums=(4,))
def full_logits(params: Params, config: ModelConfig, tokens: jax.Array, start: jax.Array,
                cache: KVCache) -> tuple[jax.Array, KVCache]:
    """Logits for every position of a chunk: tokens int32 [B, T] -> f32 [B, T, V]."""
    return forward(params, config, tokens, start, cache)


@functools.partial(jax.jit, static_argnums=(1, 8), donate_argnums=(2,))
def decode_step(params: Params, config: ModelConfig, cache: KVCache, tokens: jax.Array,
                positions: jax.Array, keys: jax.Array, sampling: RowSampling, seen: jax.Array,
                top_logprobs: int = 0
                ) -> tuple[jax.Array, KVCache, jax.Array, jax.Array, TokenLogprobs | None]:
    """Feed tokens int32 [B] at positions int32 [B]; sample the next ones with each row's own
    settings (`sampling`: traced arrays [B]) and PRNG key (keys uint32 [B, 2]).

    Returns (next tokens int32 [B], cache, seen bool [B, V] updated with the next tokens, the
    rows' next keys [B, 2], and with `top_logprobs` > 0 (static) the log-probabilities of the
    next tokens and of each row's `top_logprobs` most likely ones, else None).
    """
    logits, cache = forward(params, config, tokens[:, None], positions, cache,
                            out_index=jnp.zeros_like(positions))
    nxt, keys = sample_rows(logits, seen, keys, sampling)
    logprobs = token_logprobs(logits, nxt, top_logprobs) if top_logprobs else None
    return nxt, cache, seen.at[jnp.arange(nxt.shape[0]), nxt].set(True), keys, logprobs


@jax.jit
def first_tokens(logits: jax.Array, seen: jax.Array, keys: jax.Array, sampling: RowSampling
                 ) -> tuple[jax.Array, jax.Array, jax.Array]:
    """The first tokens after a prefill: logits f32 [B, V], seen bool [B, V] (the prompts'
    tokens), keys uint32 [B, 2] -> (next tokens int32 [B], seen updated with them, the rows'
    next keys). Jitted once per shape: the settings are traced, so a new seed or temperature
    runs the same program (eager, `sample_rows`' `lax.cond` was traced and compiled afresh on
    every call, ~0.7 s on CPU)."""
    nxt, keys = sample_rows(logits, seen, keys, sampling)
    return nxt, seen.at[jnp.arange(nxt.shape[0]), nxt].set(True), keys


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
    cached_tokens: int = 0  # prompt tokens reused from a prompt cache or session, not prefilled
    context_shifts: int = 0  # times the context was shifted (context_shift=True)
    prefill_compile_s: float = 0.0  # the part of prefill_s spent compiling (a first call)

    @property
    def prefill_tok_s(self) -> float:
        """Prompt tokens prefilled (not taken from a cache) per second of prefill, with the
        time JAX reports lowering and compiling (or reading a compiled program from the
        persistent cache) left out: a first call's prefill is mostly its compile (SmolLM2, an
        11-token prompt on a 2-core CPU: 4.4 s, 3.2 s of it compiling, 0.27 s once compiled).
        Other first-call costs stay in: tracing, and ~0.6 s more in a run whose programs come
        from the persistent cache, so a first call's figure is still low. In a batch each row's
        prefill_s is the batch's (every row waited for all of it), so the rows' figures add up
        to the batch's throughput."""
        done = self.prompt_tokens - self.cached_tokens
        run = self.prefill_s - self.prefill_compile_s
        if run <= 0:  # (a guard: compiling is timed inside the prefill)
            run = self.prefill_s
        return done / run if run > 0 else 0.0

    @property
    def decode_tok_s(self) -> float | None:
        """Steady-state decode speed: the first token comes from the prefill and the first
        decode step (which compiles) is not timed; None where nothing was (under 3 tokens)."""
        steps = self.generated_tokens - 2
        return steps / self.decode_s if steps > 0 and self.decode_s > 0 else None


@dataclasses.dataclass
class _Sequence:
    prompt_len: int
    ids: list[int] = dataclasses.field(default_factory=list)
    done: str | None = None
    cached: int = 0  # prompt tokens taken from a starting cache (not prefilled)
    shifts: int = 0  # context shifts applied
    prefill_compile_s: float = 0.0  # of the (batch's) prefill time, compiling


@dataclasses.dataclass
class CacheState:
    """A cache after generation and, per row, the token ids its live slots hold (slot i holds
    tokens[b][i]): prompt + generated tokens fed so far, minus any context-shifted ones."""

    cache: KVCache
    tokens: list[list[int]]


def context_shift(cache: KVCache, row: int, keep: int, discard: int,
                  inv_freq: jax.Array) -> KVCache:
    """llama.cpp's context shift on row `row`: slots keep..keep+discard-1 are dropped and the
    later ones move down by `discard`, keys re-rotated to their new positions (RoPE is a
    rotation: a rotation by −discard·θ). Dense key stores (f32/bf16/f16) only, and value stores
    without sink slots or a recent-token ring (a compressed key would have to be decoded,
    rotated and re-quantized): anything else is a TqjaxError."""
    check_shiftable(cache)
    return _shift(cache, jnp.int32(row), jnp.int32(keep), jnp.int32(discard), inv_freq)


def check_shiftable(cache: KVCache) -> None:
    """Raise TqjaxError unless `context_shift` supports the cache's stores."""
    from tqjax.kv.store import DenseStore

    first = 0
    for group in cache.groups:  # each group: alike layers first, first + 1, ...
        sinks = any(jax.tree_util.keystr(p).endswith(".sink")
                    for p, _ in jax.tree_util.tree_leaves_with_path(group.v))
        if type(group.k) is not DenseStore or group.recent is not None or sinks:
            raise TqjaxError(f"context shift needs dense keys (f32/bf16/f16) and values without "
                             f"turbo aids; layer {first} has {type(group.k).__name__} keys and "
                             f"{type(group.v).__name__} values")
        first += group_size(group)


@jax.jit
def _shift(cache: KVCache, row: jax.Array, keep: jax.Array, discard: jax.Array,
           inv_freq: jax.Array) -> KVCache:
    slots = cache.slots
    idx = jnp.arange(slots)
    moved = idx >= keep
    src = jnp.minimum(jnp.where(moved, idx + discard, idx), slots - 1)  # [S]
    cos, sin = rope_cos_sin(-discard, inv_freq)  # [hd/2]

    def gather(x: jax.Array, turn: Callable[[jax.Array], jax.Array] | None = None
               ) -> jax.Array:
        """Row `row` of x [B, KV, S, ...] with slot s taken from src[s] (`turn`: the keys'
        re-rotation of the moved slots, as the store holds them)."""
        one = jnp.take(jax.lax.dynamic_index_in_dim(x, row, 0, keepdims=False), src, axis=1)
        if turn is not None:
            one = jnp.where(moved[None, :, None], turn(one), one)
        return jax.lax.dynamic_update_index_in_dim(x, one, row, 0)

    def values(store: object) -> object:
        return jax.tree_util.tree_map(lambda x: gather(x) if x.ndim >= 3 else x, store)

    def layer(lc: LayerCache) -> LayerCache:  # one layer; vmapped over each stacked group
        def turn(held: jax.Array) -> jax.Array:  # (a bf16 store's bits: gathered as bits)
            keys = lc.k.replace(data=held).values().astype(jnp.float32)
            return lc.k.encode(apply_rope(keys, cos, sin))

        return dataclasses.replace(lc, k=lc.k.replace(data=gather(lc.k.data, turn)),
                                   v=values(lc.v))

    return KVCache(tuple(jax.vmap(layer)(group) for group in cache.groups))


def _start_cache(params: Params, config: ModelConfig, spec: CacheSpec, batch: int, slots: int,
                 calibration: Calibration | None, cache: KVCache | None) -> KVCache:
    """The cache to generate in: `cache` itself when it has at least `slots` slots, else a new
    one of `slots` slots with its rows copied into the first slots."""
    if cache is not None and cache.slots >= slots:
        return cache
    out = new_cache(params, config, spec, batch, slots, calibration)
    if cache is not None:
        from tqjax.decode.prompt_cache import put_row, take_row

        for b in range(batch):
            out = put_row(out, b, take_row(cache, b) if batch > 1 else cache)
    return out


def generate_tokens(params: Params, config: ModelConfig, prompts: list[list[int]], *,
                    max_new_tokens: int, sampling: SamplingParams, eos_ids: tuple[int, ...],
                    ctx_size: int, cache_spec: CacheSpec = CacheSpec(),
                    calibration: Calibration | None = None,
                    stop: Callable[[int, list[int]], bool] | None = None,
                    cache: KVCache | None = None, cached: Sequence[int] | None = None,
                    context_shift_keep: int | None = None,
                    on_prefill: Callable[[KVCache], None] | None = None
                    ) -> Generator[tuple[list[_Sequence], float, float], None, CacheState]:
    """Generate for a batch of tokenized prompts; yields (sequences, prefill_s, decode_s)
    after the prefill and after every decode step, so callers can stream, and returns the
    final `CacheState` (the generator's return value).

    `stop(b, ids)` may end sequence b early (stop strings). The cache holds
    min(ctx_size, longest prompt + max_new_tokens) slots (rounded up), or more when given.
    `cache` (batch rows, consumed) whose row b already holds prompts[b][:cached[b]] in its
    first slots: only the rest of each prompt is prefilled (cached[b] < len(prompts[b]): the
    last prompt token is always run, for its logits). `on_prefill(cache)` sees the cache
    right after the prefill (before any decode step reuses its buffers), e.g. to save it.
    `context_shift_keep` = n_keep turns on llama.cpp's context shift: a sequence that reaches
    the context keeps its first n_keep tokens (-1: its whole prompt), drops half of the rest
    and goes on (`context_shift`); None (default): it stops with finish reason "length".
    """
    empty = [i for i, p in enumerate(prompts) if len(p) == 0]
    if not prompts or empty:
        raise TqjaxError(f"prompt {empty[0]} of the batch is empty" if len(prompts) > 1
                         else "empty prompt")
    if not is_int(max_new_tokens) or max_new_tokens < 1:
        raise TqjaxError(f"max new tokens must be an integer >= 1, got {max_new_tokens!r}")
    batch = len(prompts)
    prompts = [token_ids(p, config.vocab_size).tolist() for p in prompts]
    longest = max(len(p) for p in prompts)
    if longest >= ctx_size:
        raise TqjaxError(f"prompt is {longest} tokens, "
                         + (f"longer than the context size {ctx_size}" if longest > ctx_size else
                            f"the whole context size {ctx_size}: no room to generate"))
    start = np.zeros(batch, np.int32) if cached is None else np.asarray(cached, np.int32)
    if start.shape != (batch,) or (cache is None and start.any()):
        raise TqjaxError("cached lengths need a starting cache, one per prompt")
    if np.any(start < 0) or np.any(start >= [len(p) for p in prompts]):
        raise TqjaxError("a starting cache must leave at least one prompt token to prefill")
    if context_shift_keep is not None:  # refuse before any work, not when the context fills
        check_shiftable(new_cache(params, config, cache_spec, 1, 1, calibration))
        for p in prompts:  # a full row holds ctx_size - 1 tokens; a shift drops half the rest
            keep = _kept(context_shift_keep, len(p))
            if len(p) + max_new_tokens > ctx_size and (ctx_size - 1 - keep) // 2 < 1:
                raise TqjaxError(f"context shift: keeping {keep} of a {len(p)}-token prompt "
                                 f"leaves nothing to drop in a context of {ctx_size}; lower "
                                 f"--keep or raise --ctx-size")
    limit = min(ctx_size, padded_length(longest + max_new_tokens))  # positions 0..limit-1
    rest = [p[c:] for p, c in zip(prompts, start, strict=True)]
    tokens = np.zeros((batch, padded_length(max(len(r) for r in rest))), np.int32)
    seen = np.zeros((batch, config.vocab_size), bool)
    for b, p in enumerate(prompts):
        tokens[b, : len(rest[b])] = rest[b]
        seen[b, p] = True
    lengths = np.asarray([len(r) for r in rest], np.int32)
    written = tokens.shape[1]  # prefill writes whole (padded) chunks
    if written > PREFILL_CHUNK:
        written = -(-written // PREFILL_CHUNK) * PREFILL_CHUNK
    # past the limit, the slot count stays on the padding grid: each distinct count is
    # another decode-step compilation (a restored prompt of any length would make one)
    slots = max(limit, padded_length(int(start.max()) + written))
    cache = _start_cache(params, config, cache_spec, batch, slots, calibration, cache)
    slots = cache.slots
    keys, rows = row_keys(sampling.seed, batch), row_sampling([sampling] * batch)

    with compile_timer() as compiling:
        t0 = time.perf_counter()
        logits, cache = prefill(params, config, tokens, lengths, cache, start)
        if on_prefill is not None:
            on_prefill(cache)
        nxt, seen_j, keys = first_tokens(logits, jnp.asarray(seen), keys, rows)
        nxt_host = np.asarray(nxt)
        prefill_s = time.perf_counter() - t0
    seqs = [_Sequence(len(p), cached=int(c), prefill_compile_s=compiling.seconds)
            for p, c in zip(prompts, start, strict=True)]
    live = [list(p) for p in prompts]  # tokens in the cache's slots, per row
    positions = np.asarray([len(p) for p in prompts], np.int32)  # each row's next slot
    t1 = time.perf_counter()  # reset after the first decode step, which includes compilation
    for step in range(max_new_tokens):
        for b, s in enumerate(seqs):
            if s.done:
                positions[b] = len(live[b])  # a finished row idles on its first free slot
                continue
            s.ids.append(int(nxt_host[b]))
            if s.ids[-1] in eos_ids:
                s.done = "eos"
            elif stop is not None and stop(b, s.ids):
                s.done = "stop"
            elif len(s.ids) >= max_new_tokens:
                s.done = "length"
            elif positions[b] + 1 >= limit:  # the context is full after this token
                cache = _shift_or_stop(s, b, cache, live, positions, context_shift_keep,
                                       params.rope_inv_freq)
            if not s.done:  # the next decode step writes this token at positions[b]
                live[b].append(s.ids[-1])
        yield seqs, prefill_s, time.perf_counter() - t1
        if all(s.done for s in seqs) or step == max_new_tokens - 1:
            return CacheState(cache, live)
        check_fits(positions, 1, slots)
        nxt, cache, seen_j, keys, _ = decode_step(params, config, cache, jnp.asarray(nxt_host),
                                                  jnp.asarray(positions), keys, rows, seen_j)
        positions = positions + 1
        nxt_host = np.asarray(nxt)
        if step == 0:
            t1 = time.perf_counter()
    return CacheState(cache, live)


def token_ids(ids: object, vocab_size: int) -> np.ndarray:
    """Token ids as int64 [N], checked: a 1-D sequence of integers (list, tuple, numpy array),
    each in [0, vocab_size); anything else (text, bytes, floats, bools, nested, None) is a
    TqjaxError, not an id taken by truncation or a numpy error from deep inside."""
    if ids is None or isinstance(ids, (str, bytes, bytearray)):
        raise TqjaxError(f"token ids must be a sequence of integers, got "
                         f"{type(ids).__name__}")
    try:
        arr = np.asarray(ids)
    except (TypeError, ValueError):
        arr = None
    if arr is None or arr.ndim != 1 or (arr.size and arr.dtype.kind not in "iu"):
        raise TqjaxError("token ids must be a 1-D sequence of integers")
    if arr.size and (arr.min() < 0 or arr.max() >= vocab_size):
        bad = next(int(t) for t in arr if not 0 <= t < vocab_size)
        raise TqjaxError(f"token id {bad} out of range [0, {vocab_size})")
    return arr.astype(np.int64)


def _kept(keep: int, prompt_len: int) -> int:
    """Tokens a context shift keeps for n_keep = `keep`: -1 or more than the prompt, the
    prompt (llama.cpp's clamp)."""
    return prompt_len if keep < 0 else min(keep, prompt_len)


def _shift_or_stop(s: _Sequence, b: int, cache: KVCache, live: list[list[int]],
                   positions: np.ndarray, keep: int | None, inv_freq: jax.Array) -> KVCache:
    """Row b's context is full: shift it (keep tokens, drop half the rest) or end it."""
    n_past = len(live[b])
    keep = None if keep is None else _kept(keep, s.prompt_len)
    discard = 0 if keep is None else (n_past - min(keep, n_past)) // 2
    if discard < 1:
        s.done = "length"
        return cache
    cache = context_shift(cache, b, keep, discard, inv_freq)
    live[b][keep:keep + discard] = []
    positions[b] -= discard
    s.shifts += 1
    return cache
