"""Continuous batching: one thread owns the JAX state and serves every request from a fixed
pool of cache rows ("slots").

The pool is one `KVCache` of batch N and `ctx_size` positions (rounded up to the prompt padding
multiple). Each loop iteration runs at most one prefill chunk of one admitting request (so a
long prompt never stalls the others for more than a chunk) and then ONE decode step for all N
rows with the compiled `decode_step`: the rows' sampling settings and PRNG keys are traced
arrays, so any request mix runs the same program. Requests join at step boundaries and leave
when done or cancelled; a cancelled request frees its slot at the next iteration.

Prefill of a request runs on its row alone: the row is taken out of the pool, run through a
batch-1 forward and put back inside one jitted, donating function (`tqjax.decode.prompt_cache`
row copies), chunked and padded exactly as the offline `tqjax.generate` pads a single prompt, so
greedy outputs equal the offline ones token for token.

Prefix reuse (llama-server's cache_prompt): every slot remembers the tokens whose keys and
values it holds, in the cache's own (compressed) form; a new request goes to the free slot with
the longest common token prefix and prefills only the rest. Idle rows re-feed their last real
token at its own position every step (the same values written again), so they never corrupt a
cached prefix or its recent-token ring. With a turbo cache's exact recent ring, a prefix reused
short of the slot's end gives back its last 32 tokens, which are prefilled again so that they
enter the ring as in a fresh run (`prompt_cache.reusable_prefix`); reuse at the slot's end
(multi-turn chat) is exact.
"""

from __future__ import annotations

import collections
import concurrent.futures
import dataclasses
import functools
import threading
import time
from collections.abc import Callable

import jax
import jax.numpy as jnp
import numpy as np

from tqjax.api import Model
from tqjax.decode import prompt_cache
from tqjax.decode.generate import (
    PREFILL_CHUNK,
    decode_step,
    new_cache,
    padded_length,
    token_ids,
)
from tqjax.decode.sampling import (
    RowSampling,
    SamplingParams,
    request_key,
    row_sampling,
    sample_rows,
    token_logprobs,
)
from tqjax.errors import TqjaxError
from tqjax.kv.cache import CacheSpec, KVCache
from tqjax.models.config import ModelConfig
from tqjax.models.transformer import Params, forward
from tqjax.pallas.backend import check_backend, use_backend

TOP_LOGPROBS = 20  # every step computes this many top log-probabilities (OpenAI's maximum)


@dataclasses.dataclass
class Token:
    """One generated token: id, its log-probability and the top TOP_LOGPROBS (id, logprob)."""

    id: int
    logprob: float
    top: list[tuple[int, float]]


@dataclasses.dataclass
class Finished:
    """The end of a request: reason "stop" (EOS), "length" (max_tokens or context) or
    "cancelled"; token counts."""

    reason: str
    prompt_tokens: int
    completion_tokens: int
    cached_tokens: int  # prompt tokens reused from the slot's cache (not prefilled)


@dataclasses.dataclass
class Failed:
    """An internal error that ended this request only."""

    message: str


Event = Token | Finished | Failed


@dataclasses.dataclass(eq=False)
class Request:
    """A generation request. `emit` is called on the engine thread with each Event."""

    prompt: list[int]
    max_tokens: int
    sampling: SamplingParams
    emit: Callable[[Event], None]
    cancelled: bool = False
    submitted: float = dataclasses.field(default_factory=time.perf_counter)
    cached: int = 0  # prompt tokens reused from its slot's cache (set when it gets a slot)


@dataclasses.dataclass(eq=False)
class Slot:
    """One cache row: tokens[:valid] have correct keys/values in the row."""

    tokens: list[int] = dataclasses.field(default_factory=list)
    valid: int = 0
    req: Request | None = None
    state: str = "idle"  # idle | prefill | decode
    next_pos: int = 0  # prefill: next prompt position to prefill
    chunk: int = 0  # prefill chunk length of this request (fixed per request)
    generated: int = 0
    last_used: float = 0.0


@dataclasses.dataclass
class Stats:
    """Counters since start (read by /metrics; ints updated on the engine thread)."""

    requests: int = 0
    prompt_tokens: int = 0
    prefill_tokens: int = 0  # tokens actually run through prefill (padding excluded)
    generated_tokens: int = 0
    prefix_hits: int = 0
    reused_tokens: int = 0
    decode_steps: int = 0
    failed: int = 0
    rejected: int = 0
    recent: collections.deque = dataclasses.field(  # (time, tokens) per generated token
        default_factory=lambda: collections.deque(maxlen=4096), repr=False)

    def tokens_per_second(self, window: float = 10.0) -> float:
        """Generated tokens per second over the last `window` seconds."""
        now = time.perf_counter()
        hits = [(t, n) for t, n in list(self.recent) if now - t <= window]
        if not hits:
            return 0.0
        span = max(now - hits[0][0], 1e-3)
        return sum(n for _, n in hits) / span


class QueueFull(TqjaxError):
    """The waiting queue is full (HTTP 429)."""


@functools.partial(jax.jit, static_argnums=(1,), donate_argnums=(5,))
def prefill_row(params: Params, config: ModelConfig, tokens: jax.Array, start: jax.Array,
                row: jax.Array, cache: KVCache, out_index: jax.Array, valid: jax.Array
                ) -> tuple[jax.Array, KVCache]:
    """Prefill one row of the pool: tokens int32 [1, T] at positions start int32 [1].. of row
    `row` (int32 scalar, traced) -> logits [1, V] at out_index [1], the pool updated in place;
    valid int32 [1]: the chunk's real tokens (the rest is padding, kept out of the
    recent-token ring)."""
    one = prompt_cache._take_row(cache, row)
    logits, one = forward(params, config, tokens, start, one, out_index=out_index, valid=valid)
    return logits, prompt_cache._put_row(cache, row, one)


@functools.partial(jax.jit, static_argnums=(4,))
def first_token(logits: jax.Array, seen: jax.Array, keys: jax.Array, rs: RowSampling,
                top: int) -> tuple[jax.Array, jax.Array, object]:
    """Sample a prefilled request's first token: logits [1, V], seen [1, V], keys [1, 2]."""
    nxt, keys = sample_rows(logits, seen, keys, rs)
    return nxt, keys, token_logprobs(logits, nxt, top)


@functools.partial(jax.jit, donate_argnums=(0,))
def set_row(buf: jax.Array, row: jax.Array, value: jax.Array) -> jax.Array:
    """buf [N, ...] with buf[row] = value [...] (in place)."""
    return buf.at[row].set(value)


class Engine:
    """The continuous-batching loop over `slots` rows of `ctx_size` positions (a thread)."""

    def __init__(self, model: Model, spec: CacheSpec = CacheSpec(), slots: int = 4,
                 ctx_size: int = 2048, max_queue: int = 64, backend: str = "auto") -> None:
        if model.tokenizer is None:
            raise TqjaxError(f"{model.source} has no tokenizer; the server needs one")
        if slots < 1:
            raise TqjaxError(f"slots must be >= 1, got {slots}")
        if not 2 <= ctx_size <= model.config.max_position:
            raise TqjaxError(f"context size must be in [2, {model.config.max_position}] "
                             f"(the model's context), got {ctx_size}")
        self.model, self.spec, self.n, self.ctx_size = model, spec, slots, ctx_size
        self.backend = check_backend(backend)
        self.alloc = padded_length(ctx_size)  # allocated positions per row
        self.max_queue = max_queue
        self.eos = set(model.tokenizer.eos_ids)
        cfg = model.config
        self.calibration = model.calibration(spec)
        self.cache = new_cache(model.params, cfg, spec, slots, self.alloc, self.calibration)
        self.seen = jnp.zeros((slots, cfg.vocab_size), bool)
        self.keys = jnp.zeros((slots, 2), jnp.uint32)
        self.ring = prompt_cache.ring_size(self.cache)  # recent-token ring positions (0: none)
        self.slots = [Slot() for _ in range(slots)]
        self.settings = [SamplingParams() for _ in range(slots)]
        self.stats = Stats()
        self.waiting: collections.deque[Request] = collections.deque()
        self.calls: collections.deque[tuple[Callable[[], object],
                                            concurrent.futures.Future]] = collections.deque()
        self.cond = threading.Condition()
        self.accepting, self.running = True, True
        self.thread = threading.Thread(target=self._loop, name="tqjax-engine", daemon=True)
        self.thread.start()

    # ---- client side (any thread) ----

    def submit(self, req: Request) -> None:
        """Queue a request; raises QueueFull or TqjaxError (bad request, shutting down)."""
        if not req.prompt:
            raise TqjaxError("empty prompt")
        if len(req.prompt) >= self.ctx_size:
            raise TqjaxError(f"prompt is {len(req.prompt)} tokens, the context size is "
                             f"{self.ctx_size}")
        token_ids(req.prompt, self.model.config.vocab_size)  # the one check of ids
        with self.cond:
            if not self.accepting:
                raise TqjaxError("the server is shutting down")
            # max_queue counts the requests that wait for a slot: those beyond the free slots
            # (a request waits here until the engine's next step places it, free slot or not)
            free = sum(s.req is None for s in self.slots)
            if len(self.waiting) >= free + self.max_queue:
                self.stats.rejected += 1
                raise QueueFull(f"too many waiting requests ({len(self.waiting)})")
            self.waiting.append(req)
            self.cond.notify()

    def cancel(self, req: Request) -> None:
        """Stop a request (a disconnected client, a stop string): its slot frees at once."""
        with self.cond:
            req.cancelled = True
            self.cond.notify()

    def call(self, fn: Callable[[], object], timeout: float = 60.0) -> object:
        """Run fn() on the engine thread between steps (it owns the cache) and return its
        result (exceptions re-raised here)."""
        fut: concurrent.futures.Future = concurrent.futures.Future()
        with self.cond:
            self.calls.append((fn, fut))
            self.cond.notify()
        return fut.result(timeout)

    def counts(self) -> dict[str, int]:
        """Requests running (in a slot) and waiting, and slots holding a request."""
        with self.cond:
            running = sum(s.req is not None for s in self.slots)
            return {"running": running, "waiting": len(self.waiting), "slots_in_use": running}

    def shutdown(self, grace_s: float = 10.0) -> None:
        """Stop accepting; let running and waiting requests finish for up to `grace_s`, cancel
        the rest, stop the thread."""
        with self.cond:
            self.accepting = False
        end = time.perf_counter() + grace_s
        while time.perf_counter() < end:
            c = self.counts()
            if c["running"] == 0 and c["waiting"] == 0:
                break
            time.sleep(0.05)
        with self.cond:
            for s in self.slots:
                if s.req is not None:
                    s.req.cancelled = True
            for r in self.waiting:
                r.cancelled = True
            self.running = False
            self.cond.notify()
        self.thread.join(timeout=60)

    # ---- slot files (engine thread, via call) ----

    def slot_tokens(self, row: int) -> list[int]:
        return list(self.slots[row].tokens[: self.slots[row].valid])

    def check_idle(self, row: int) -> None:
        if not 0 <= row < self.n:
            raise TqjaxError(f"no slot {row}: the server has slots 0..{self.n - 1}")
        if self.slots[row].req is not None:
            raise SlotBusy(f"slot {row} is processing a request")

    def save_slot(self, row: int, path: str, meta: object) -> int:
        """Save slot `row`'s cached tokens and their cache rows; returns the token count."""
        self.check_idle(row)
        tokens = self.slot_tokens(row)
        if not tokens:
            raise TqjaxError(f"slot {row} holds no tokens")
        prompt_cache.save_prompt_cache(path, prompt_cache.take_row(self.cache, row), tokens,
                                       meta)
        return len(tokens)

    def restore_slot(self, row: int, path: str, meta: object) -> int:
        """Restore a saved prompt cache into slot `row`; returns the token count."""
        self.check_idle(row)
        one, tokens = prompt_cache.load_prompt_cache(path, meta, self.alloc)
        if len(tokens) >= self.ctx_size:
            raise TqjaxError(f"saved cache holds {len(tokens)} tokens, the context size is "
                             f"{self.ctx_size}")
        self.cache = prompt_cache.put_row(self.cache, row, one)
        self.slots[row] = Slot(tokens, len(tokens), last_used=time.perf_counter())
        return len(tokens)

    def erase_slot(self, row: int) -> int:
        """Forget slot `row`'s cached tokens; returns how many there were."""
        self.check_idle(row)
        n = self.slots[row].valid
        self.slots[row] = Slot()
        return n

    # ---- engine thread ----

    def _loop(self) -> None:
        with use_backend(self.backend):  # a thread-local JAX setting: set on this thread
            self._run()

    def _run(self) -> None:
        while True:
            with self.cond:
                while (self.running and not self.waiting and not self.calls
                       and all(s.req is None for s in self.slots)):
                    self.cond.wait()
                if not self.running and all(s.req is None for s in self.slots):
                    for r in self.waiting:
                        _send(r, Finished("cancelled", len(r.prompt), 0, 0))
                    self.waiting.clear()
                    return
                calls = list(self.calls)
                self.calls.clear()
                self._admit()
            for fn, fut in calls:
                try:
                    fut.set_result(fn())
                except Exception as e:  # noqa: BLE001 - handed back to the caller
                    fut.set_exception(e)
            self._drop_cancelled()
            prefilling = [i for i, s in enumerate(self.slots) if s.state == "prefill"]
            if prefilling:
                row = min(prefilling, key=lambda i: self.slots[i].req.submitted)
                try:
                    self._prefill(row)
                except Exception as e:  # noqa: BLE001 - this request fails, the rest go on
                    self._fail(row, e)
            if any(s.state == "decode" for s in self.slots):
                try:
                    self._decode()
                except Exception as e:  # noqa: BLE001 - a failed step fails its requests
                    for row, s in enumerate(self.slots):
                        if s.state == "decode":
                            self._fail(row, e)
                    self._reset_if_lost()

    def _admit(self) -> None:
        """Move waiting requests into free slots (longest cached prefix first). Lock held."""
        while self.waiting:
            req = self.waiting.popleft()
            if req.cancelled:
                _send(req, Finished("cancelled", len(req.prompt), 0, 0))
                continue
            free = [i for i, s in enumerate(self.slots) if s.req is None]
            if not free:
                self.waiting.appendleft(req)
                return

            reuse = {i: prompt_cache.reusable_prefix(
                self.slots[i].tokens[: self.slots[i].valid], req.prompt, self.ring) for i in free}
            row = max(free, key=lambda i: (reuse[i], -self.slots[i].last_used))
            p = reuse[row]
            s = self.slots[row]
            s.req, s.state, s.generated, req.cached = req, "prefill", 0, p
            s.tokens, s.valid, s.next_pos = s.tokens[:p], p, p
            s.chunk = min(padded_length(len(req.prompt) - p), PREFILL_CHUNK)
            self.settings[row] = req.sampling
            self.stats.requests += 1
            self.stats.prompt_tokens += len(req.prompt)
            if p:
                self.stats.prefix_hits += 1
                self.stats.reused_tokens += p

    def _drop_cancelled(self) -> None:
        for s in self.slots:
            if s.req is not None and s.req.cancelled:
                self._finish(s, "cancelled")

    def _finish(self, s: Slot, reason: str) -> None:
        req = s.req
        s.req, s.state, s.last_used = None, "idle", time.perf_counter()
        if s.valid > len(s.tokens):
            s.valid = len(s.tokens)
        _send(req, Finished(reason, len(req.prompt), s.generated, req.cached))

    def _fail(self, row: int, err: Exception) -> None:
        s = self.slots[row]
        req = s.req
        self.stats.failed += 1
        self.slots[row] = Slot()  # the row's contents are unknown: forget them
        if req is not None:
            msg = str(err).splitlines()[0] if str(err) else type(err).__name__
            _send(req, Failed(f"internal error: {msg}"))

    def _reset_if_lost(self) -> None:
        """A step that failed after consuming its donated buffers leaves no cache: rebuild."""
        leaves = jax.tree_util.tree_leaves((self.cache, self.seen, self.keys))
        if any(x.is_deleted() for x in leaves):
            m = self.model
            self.cache = new_cache(m.params, m.config, self.spec, self.n, self.alloc,
                                   self.calibration)
            self.seen = jnp.zeros((self.n, m.config.vocab_size), bool)
            self.keys = jnp.zeros((self.n, 2), jnp.uint32)
            self.slots = [Slot() if s.req is None else s for s in self.slots]
            for s in self.slots:
                s.tokens, s.valid = [], 0

    def _rows(self) -> RowSampling:
        col = lambda f, dt: jnp.asarray(np.asarray([getattr(sp, f) for sp in self.settings], dt))
        greedy = [s.state != "decode" for s in self.slots]  # idle rows: cheap argmax
        temp = np.asarray([0.0 if g else sp.temperature
                           for g, sp in zip(greedy, self.settings, strict=True)], np.float32)
        return RowSampling(jnp.asarray(temp), col("top_k", np.int32), col("top_p", np.float32),
                           col("min_p", np.float32), col("repeat_penalty", np.float32))

    def _prefill(self, row: int) -> None:
        """One prefill chunk of the request in `row`; after the last, its first token."""
        s, m = self.slots[row], self.model
        prompt = s.req.prompt
        c0 = min(s.next_pos, self.alloc - s.chunk)  # near the end: re-run a few cached tokens
        part = prompt[c0:c0 + s.chunk]
        tokens = np.zeros((1, s.chunk), np.int32)
        tokens[0, : len(part)] = part
        logits, self.cache = prefill_row(
            m.params, m.config, jnp.asarray(tokens), jnp.asarray([c0], jnp.int32),
            jnp.int32(row), self.cache, jnp.asarray([len(part) - 1], jnp.int32),
            jnp.asarray([len(part)], jnp.int32))
        self.stats.prefill_tokens += c0 + len(part) - s.next_pos
        s.next_pos = s.valid = c0 + len(part)
        s.tokens = list(prompt[: s.valid])
        if s.next_pos < len(prompt):
            return
        mask = np.zeros(m.config.vocab_size, bool)
        mask[prompt] = True
        sp = s.req.sampling
        nxt, key, lp = first_token(logits, jnp.asarray(mask)[None],
                                   request_key(sp.seed)[None], row_sampling([sp]), TOP_LOGPROBS)
        tok = int(nxt[0])
        mask[tok] = True
        self.seen = set_row(self.seen, jnp.int32(row), jnp.asarray(mask))
        self.keys = set_row(self.keys, jnp.int32(row), key[0])
        s.state = "decode"
        self._emit(row, tok, float(lp.chosen[0]), np.asarray(lp.top_ids[0]),
                   np.asarray(lp.top[0]))

    def _decode(self) -> None:
        """One decode step for every row. Decoding rows feed their last token, and idle rows a
        sampled token not yet written (both real writes). Other rows must not disturb what
        they hold: without a recent-token ring they write past their valid prefix (overwritten
        before it is ever visible); with a ring, any write replaces a ring entry, so they
        re-feed their last valid token at its own position (the same values again, up to the
        rounding of a decode vs a prefill matmul, which the fp16 ring and the codes absorb)."""
        m = self.model
        tokens = np.zeros(self.n, np.int32)
        positions = np.zeros(self.n, np.int32)
        real = np.zeros(self.n, bool)
        for i, s in enumerate(self.slots):
            if s.state == "decode" or (s.state == "idle" and s.valid < len(s.tokens)):
                positions[i], tokens[i], real[i] = s.valid, s.tokens[s.valid], True
            elif s.valid > 0 and (self.ring or s.valid >= self.alloc):
                positions[i], tokens[i] = s.valid - 1, s.tokens[s.valid - 1]
            else:
                positions[i] = s.valid
        rows = self._rows()
        nxt, self.cache, self.seen, self.keys, lp = decode_step(
            m.params, m.config, self.cache, jnp.asarray(tokens), jnp.asarray(positions),
            self.keys, rows, self.seen, TOP_LOGPROBS)
        nxt = np.asarray(nxt)
        chosen, top_ids, top = np.asarray(lp.chosen), np.asarray(lp.top_ids), np.asarray(lp.top)
        self.stats.decode_steps += 1
        for i, s in enumerate(self.slots):
            if real[i]:
                s.valid += 1
            if s.state == "decode":
                self._emit(i, int(nxt[i]), float(chosen[i]), top_ids[i], top[i])

    def _emit(self, row: int, tok: int, logprob: float, top_ids: np.ndarray,
              top: np.ndarray) -> None:
        """Record a sampled token for the request in `row`, send it, finish if done."""
        s = self.slots[row]
        s.tokens.append(tok)
        s.generated += 1
        self.stats.generated_tokens += 1
        self.stats.recent.append((time.perf_counter(), 1))
        _send(s.req, Token(tok, logprob, [(int(a), float(b)) for a, b in
                                          zip(top_ids, top, strict=True)]))
        if tok in self.eos:
            self._finish(s, "stop")
        elif s.generated >= s.req.max_tokens or len(s.tokens) >= self.ctx_size:
            self._finish(s, "length")


class SlotBusy(TqjaxError):
    """The slot is processing a request (HTTP 409)."""


def _send(req: Request, ev: Event) -> None:
    """Hand an event to a request's consumer; a broken consumer (a closed event loop) ends
    its own request only."""
    try:
        req.emit(ev)
    except Exception:  # noqa: BLE001
        req.cancelled = True
