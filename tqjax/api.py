"""Public API: `load`, `logits`, `generate`, `Session` (names kept stable for research code and
CI)."""

from __future__ import annotations

import dataclasses
import os
from collections.abc import Callable, Mapping, Sequence
from pathlib import Path

import jax
import jax.numpy as jnp
import numpy as np
from jax.sharding import Mesh

from tqjax import fetch
from tqjax.atomic import check_writable
from tqjax.data import calibration_text
from tqjax.decode.calibrate import calibrate
from tqjax.decode.generate import (
    CacheState,
    GenerationResult,
    full_logits,
    generate_tokens,
    new_cache,
    padded_length,
)
from tqjax.decode.generate import token_ids as check_ids
from tqjax.decode.prompt_cache import (
    CacheMeta,
    cache_meta,
    load_prompt_cache,
    reusable_prefix,
    ring_size,
    save_prompt_cache,
    saved_length,
)
from tqjax.decode.sampling import SamplingParams
from tqjax.errors import TqjaxError, is_int
from tqjax.fetch import resolve_path
from tqjax.host import drop_programs
from tqjax.kv.cache import (
    CacheSpec,
    Calibration,
    as_cache_spec,
    bytes_per_token,
    constant_bytes,
)
from tqjax.models.calibration import calibration_corpus, calibration_windows
from tqjax.models.checkpoint import is_quantized_checkpoint
from tqjax.models.config import ModelConfig
from tqjax.models.loading import GGUF_WEIGHTS, Checkpoint, load_checkpoint, open_checkpoint
from tqjax.models.quantize import WeightSpec, quantize_params
from tqjax.models.tokenizer import Tokenizer, tokenizer_from_gguf, tokenizer_from_hf_dir
from tqjax.models.transformer import FUSED, LINEARS, Params, stack_layers


@dataclasses.dataclass
class Model:
    """A loaded model: static config, parameter pytree and tokenizer."""

    config: ModelConfig
    params: Params
    tokenizer: Tokenizer | None  # None for a weights-only directory (logits still work)
    source: str
    dtype: str
    _calibration: Calibration | None = dataclasses.field(default=None, repr=False)
    _metas: dict[CacheSpec, tuple[Params, CacheMeta]] = dataclasses.field(default_factory=dict,
                                                                         repr=False)

    def calibration(self, spec: CacheSpec) -> Calibration | None:
        """KV means from the built-in calibration text when `spec` centres a turbo store
        (computed once per model)."""
        if not spec.needs_calibration:
            return None
        if self._calibration is None:
            if self.tokenizer is None:
                raise TqjaxError("centred or balanced turbo caches calibrate on text and need "
                                 "a tokenizer; pass CacheSpec(..., center_keys=False, "
                                 "center_values=False, balance_keys=False)")
            ids = self.tokenizer.encode(calibration_text(), add_bos=False)
            self._calibration = calibrate(self.params, self.config, ids)
        return self._calibration

    def cache_meta(self, spec: CacheSpec) -> CacheMeta:
        """What a saved prompt cache of this model in format `spec` must match (the first call
        hashes every parameter: about a second per 500 MB)."""
        params, meta = self._metas.get(spec, (None, None))
        if params is not self.params:  # (a dataclasses.replace'd Model shares this dict)
            meta = cache_meta(self.config, self.params, self.tokenizer, spec,
                              self.calibration(spec))
            self._metas[spec] = (self.params, meta)
        return meta


def _hf_tokenizer(path: Path, config: ModelConfig) -> Tokenizer | None:
    """The tokenizer of an HF-style directory (tokenizer.json or .model), or None."""
    if any((path / f).is_file() for f in ("tokenizer.json", "tokenizer.model")):
        return tokenizer_from_hf_dir(path, config.eos_token_ids, config.bos_token_id)
    return None


def open_model(path_or_name: str | Path, dtype: str = "float32", progress: bool = False,
               blocks: bool = False) -> tuple[Checkpoint, Tokenizer | None]:
    """An HF directory or .gguf file opened, not read (`loading.Checkpoint`: its config, and
    its tensors read on demand; `blocks`: GGUF blocks kept), and its tokenizer (None for a
    weights-only directory or GGUF), built before any tensor is read: what `load` reads a
    tensor at a time and `quantize_params` a layer at a time. A GGUF file's metadata is
    dropped once the tokenizer is built (Qwen2.5's vocabulary: tens of MB)."""
    path = resolve_path(path_or_name, progress)
    gguf_tokenizer: list[Tokenizer | None] = []
    source = open_checkpoint(path, dtype, blocks, on_metadata=lambda meta: gguf_tokenizer.append(
        tokenizer_from_gguf(meta)))
    source.meta = {}
    return source, gguf_tokenizer[0] if gguf_tokenizer else _hf_tokenizer(path, source.config)


ON_THE_FLY_CALIBRATION = (4, 512)  # windows x tokens of calibration text for `weights=`


def load(path_or_name: str | Path = fetch.DEFAULT_MODEL, dtype: str = "float32",
         progress: bool = False, weights: str | None = None, bpw: float | None = None,
         quantize_embeddings: bool = False, mesh: Mesh | None = None) -> Model:
    """Load a model by name (e.g. "smollm2-135m-instruct"), HF directory, .gguf file,
    quantized checkpoint directory or orbax checkpoint directory (`tqjax.models.
    orbax_checkpoint`). `weights` ("tq8", "tq4", "tq3", "mixed" with `bpw`, "int8",
    "int8-rot", "int4", "int4-affine") quantizes the linear layers on the fly (GPTQ on a short
    built-in calibration text; `scripts/quantize.py` saves the result instead);
    `quantize_embeddings` quantizes the embedding table and an untied head too, in 8 bits.
    `weights="gguf"` keeps a .gguf file's quantized matrices (embedding and head included) in
    the file's own blocks (`tqjax.quant.ggml`), no re-quantization. `mesh`
    (`tqjax.sharding.make_mesh(tp=..., dp=...)`) shards the weights over its devices (and the
    caches made for them); an orbax checkpoint is read straight onto it. Quantized and
    bf16/f16 linears (`quant.half.HalfLinear`) are stacked by linear and weight format
    (`transformer.LayerStack`): each linear compiled once per format it takes."""
    from tqjax.models.orbax_checkpoint import is_orbax_checkpoint, restore_sharded
    from tqjax.sharding import shard_params

    if weights is None and (bpw is not None or quantize_embeddings):
        raise TqjaxError("a bpw target and quantized embeddings go with a weights method "
                         "(e.g. --weights tq4)")
    blocks = weights == GGUF_WEIGHTS
    if blocks and (bpw is not None or quantize_embeddings):
        raise TqjaxError("weights 'gguf' keeps the file's blocks as they are: no bpw target or "
                         "quantized embeddings")
    path = resolve_path(path_or_name, progress)
    orbax = is_orbax_checkpoint(path)
    if orbax and weights is not None:
        raise TqjaxError(f"{path} is an orbax checkpoint of finished weights; load it without "
                         f"a weights method")
    if orbax:
        config, params, _ = restore_sharded(path, mesh, dtype)
        tokenizer = _hf_tokenizer(path, config)
    elif is_quantized_checkpoint(path) and weights is None:
        config, params, _ = load_checkpoint(path, dtype)
        tokenizer = _hf_tokenizer(path, config)
    else:  # read a tensor at a time (quantizing: a layer at a time, never the whole model)
        source, tokenizer = open_model(path, dtype, blocks=blocks)
        config = source.config
        if weights is None or blocks:
            params = source.params(f"loading {path.name}" if progress else None)
        else:
            windows = None
            if tokenizer is not None:
                count, length = ON_THE_FLY_CALIBRATION
                windows = calibration_windows(tokenizer, calibration_corpus(), count,
                                              min(length, config.max_position))
            spec = WeightSpec(weights, bpw=bpw, quantize_embeddings=quantize_embeddings)
            params = quantize_params(source, config, spec, windows, progress=progress)
    if not orbax and any(isinstance(getattr(lp, f), FUSED)  # quantized: each linear
                         for lp in params.layers for f in LINEARS):  # compiled once per format
        params = params.replace(layers=stack_layers(params.layers, consume=True))
        drop_programs()  # the conversions' and the stacking's programs do not run again
    if mesh is not None and not orbax:
        params = shard_params(params, config, mesh)
    return Model(config, params, tokenizer, str(path), dtype)


def logits(model: Model, token_ids: Sequence[int], cache: CacheSpec | str = CacheSpec()
           ) -> np.ndarray:
    """Full-sequence logits, float32 [len(token_ids), vocab] (one causal pass, no sampling)."""
    token_ids, cache = check_ids(token_ids, model.config.vocab_size), as_cache_spec(cache)
    n = len(token_ids)
    if n == 0:
        raise TqjaxError("empty token sequence")
    if n > model.config.max_position:
        raise TqjaxError(f"{n} tokens exceed the model's context of {model.config.max_position}")
    size = padded_length(n)
    tokens = np.zeros((1, size), np.int32)
    tokens[0, :n] = token_ids
    kv = new_cache(model.params, model.config, cache, 1, size, model.calibration(cache))
    out, _ = full_logits(model.params, model.config, jnp.asarray(tokens),
                         jnp.zeros(1, jnp.int32), kv)
    return np.asarray(out[0, :n])


def kv_footprint(model: Model, cache: CacheSpec, context: int | None = None
                 ) -> dict[str, float]:
    """KV-cache storage for one sequence: bytes per token (all layers, K+V), bits per value and
    compression vs a bf16 cache, plus the bytes that do not grow with the context (sink slots,
    recent-token rings, centres, rotations); with `context`, the effective bits per value of a
    cache that long, constants included."""
    cfg = model.config
    kv = new_cache(model.params, cfg, cache, 1, 64, model.calibration(cache))
    per_token, constant = bytes_per_token(kv), constant_bytes(kv)
    values = cfg.num_layers * 2 * cfg.num_kv_heads * cfg.head_dim
    out = {"kv_bytes_per_token": per_token, "kv_bits_per_value": 8 * per_token / values,
           "kv_compression_vs_bf16": 2 * values / per_token, "kv_constant_bytes": constant}
    if context is not None:
        out["kv_context"] = context
        out["kv_effective_bits_per_value"] = 8 * (per_token + constant / context) / values
    return out


def check_options(stop: Sequence[str] = (), chat: bool = False, system: str | None = None,
                  n_keep: int = 0, context_shift: bool = False) -> list[str]:
    """The stop strings as a list (a lone string is one), once the generation options are
    checked: a TqjaxError for those that would stop at once (an empty stop string) or do
    nothing (a system message without chat, n_keep without context_shift). Callable before a
    model is loaded (the CLI does)."""
    try:
        stop = [stop] if isinstance(stop, str) else list(stop)
    except TypeError:
        raise TqjaxError(f"stop must be a string or strings, got {stop!r}") from None
    if not all(isinstance(s, str) and s for s in stop):
        raise TqjaxError("stop strings must be non-empty strings (--stop)")
    for name, value in (("chat", chat), ("context_shift", context_shift)):
        if not isinstance(value, bool | np.bool_):
            raise TqjaxError(f"{name} must be True or False, got {value!r}")
    if system is not None and not isinstance(system, str):
        raise TqjaxError(f"system must be a string (the system message), got "
                         f"{type(system).__name__}")
    if not is_int(n_keep) or n_keep < -1:
        raise TqjaxError(f"n_keep must be an integer >= -1 (-1: the whole prompt), got "
                         f"{n_keep!r}")
    if system is not None and not chat:
        raise TqjaxError("a system message goes with the chat template (chat=True, --chat)")
    if n_keep and not context_shift:
        raise TqjaxError("n_keep (--keep) goes with context_shift (--context-shift)")
    return stop


Prompt = str | Sequence[int] | Sequence[Mapping[str, str]]
CHAT_ROLES = ("system", "user", "assistant")


def encode_prompt(model: Model, prompt: Prompt, chat: bool = False,
                  system: str | None = None) -> list[int]:
    """Token ids for a prompt: ids pass through; text is encoded, through the chat template
    with `chat` (and `system` as its system message); a conversation, a list of messages
    ``{"role": "system" | "user" | "assistant", "content": str}``, always goes through the
    chat template, ready for the assistant's next turn."""
    check_options(chat=chat, system=system)
    messages = _messages(prompt)
    if messages is None and not isinstance(prompt, str):
        if chat:
            raise TqjaxError("the chat template needs a text prompt or messages, not token ids")
        return check_ids(prompt, model.config.vocab_size).tolist()
    if model.tokenizer is None:
        raise TqjaxError(f"{model.source} has no tokenizer; pass token ids instead of text")
    if messages is not None:
        if not model.tokenizer.chat_template:
            raise TqjaxError(f"{model.source} has no chat template, so it takes no "
                             f"conversation (a list of messages); pass text instead")
        if system is not None:
            raise TqjaxError("system= goes with a text prompt; begin the messages with a "
                             "system message instead")
    elif chat:
        messages = ([{"role": "system", "content": system}] if system is not None else []) + [
            {"role": "user", "content": prompt}]
    else:
        return model.tokenizer.encode(prompt)
    text = model.tokenizer.apply_chat_template(messages)
    return model.tokenizer.encode(text, add_bos=False)


def _messages(prompt: object) -> list[dict[str, str]] | None:
    """A conversation's messages as plain dicts, checked; None when `prompt` is not one (a
    list with no mapping in it)."""
    if (isinstance(prompt, str | bytes) or not isinstance(prompt, Sequence)
            or not any(isinstance(m, Mapping) for m in prompt)):
        return None
    out = []
    for i, m in enumerate(prompt):
        if not isinstance(m, Mapping):
            raise TqjaxError(f"messages[{i}] is a {type(m).__name__}, not a message "
                             '({"role": ..., "content": ...})')
        role, content = m.get("role"), m.get("content")
        if role not in CHAT_ROLES:
            raise TqjaxError(f"messages[{i}]: role must be one of {', '.join(CHAT_ROLES)}; "
                             f"got {role!r}")
        if not isinstance(content, str):
            raise TqjaxError(f"messages[{i}]: content must be a string, got "
                             f"{type(content).__name__}")
        out.append({"role": role, "content": content})
    return out


class _TextStream:
    """Incremental detokenization that holds back partial UTF-8 and possible stop strings.

    The text is kept up to date a few tokens at a time (the text of the tokens since the last
    whole character, against the same tokens without the newest: vLLM's and HF's incremental
    detokenizing), so each step decodes only its new tokens, and stop strings are looked for
    only where the new text could complete one; only the end that could begin a stop string
    is held back (llama.cpp's partial stop). The final text is decoded once, whole."""

    def __init__(self, tokenizer: Tokenizer, stop: Sequence[str]) -> None:
        self.tokenizer, self.stop, self.emitted = tokenizer, stop, 0
        self.holdback = max((len(s) for s in stop), default=1) - 1
        self.text, self.lo, self.hi, self.seen, self.cut = "", 0, 0, 0, -1

    def _held(self) -> int:
        """Characters at the end of `text` that may begin a stop string (held back)."""
        for k in range(min(self.holdback, len(self.text)), 0, -1):
            if any(len(s) > k and self.text.endswith(s[:k]) for s in self.stop):
                return k
        return 0

    def _advance(self, ids: list[int]) -> None:
        """Bring `text` (and `cut`, the first stop string's index or -1) up to `ids`, which
        only ever grow by appending."""
        if len(ids) < self.seen:  # not a continuation: start again
            self.text, self.lo, self.hi, self.seen, self.cut = "", 0, 0, 0, -1
        if len(ids) == self.seen:
            return
        self.seen = len(ids)
        before = self.tokenizer.decode(ids[self.lo:self.hi])
        after = self.tokenizer.decode(ids[self.lo:])
        new = after[len(before):]
        start = max(0, len(self.text) - self.holdback)
        if new and not after.endswith("\ufffd") and not self._open_run(ids):
            self.text += new
            self.lo, self.hi = self.hi, len(ids)
            seen = self.text
        else:  # no whole new character yet: its text so far may still complete a stop
            seen = self.text + new.rstrip("\ufffd")
        if self.cut < 0:
            found = [i for s in self.stop if (i := seen.find(s, start)) >= 0]
            self.cut = min(found) if found else -1

    def _open_run(self, ids: list[int]) -> bool:
        """Whether `ids` end in a run of byte pieces, which the decoder reads whole, so that it
        stays open until a token ends it (a token that decodes to nothing, e.g. a skipped
        special one, does not)."""
        if not self.tokenizer.byte_fallback:  # (byte-level BPE: no such runs)
            return False
        for tid in reversed(ids):
            if self.tokenizer.is_byte_piece(tid):
                return True
            if self.tokenizer.decode([tid]):
                return False
        return False

    def stopped(self, ids: list[int]) -> bool:
        """Whether the text of `ids` holds a stop string."""
        self._advance(ids)
        return self.cut >= 0

    def final_text(self, ids: list[int]) -> tuple[str, bool]:
        """(the text of `ids` cut before its first stop string, whether one was found)."""
        text = self.tokenizer.decode(ids)
        cut = [text.find(s) for s in self.stop if s in text]
        return (text[: min(cut)], True) if cut else (text, False)

    def piece(self, ids: list[int], done: bool) -> str:
        """The text of `ids` not yet returned: all of it (up to a stop string) when `done`,
        else only what no later token or stop string can change."""
        if done:
            text, _ = self.final_text(ids)
        else:
            self._advance(ids)
            text = self.text[:self.cut] if self.cut >= 0 else self.text[
                :max(self.emitted, len(self.text) - self._held())]  # (cut may be past text)
        out, self.emitted = text[self.emitted:], max(self.emitted, len(text))
        return out


def _text_ids(ids: list[int], eos_ids: Sequence[int]) -> list[int]:
    """A sequence's ids without its end-of-sequence token (an EOS ends a sequence, so only the
    last id can be one): the list itself otherwise, not a copy made at every step."""
    return ids[:-1] if ids and ids[-1] in eos_ids else ids


def _run(model: Model, prompts: list[list[int]], sampling: SamplingParams, *, max_new_tokens: int,
         stop: Sequence[str], ctx: int, cache: CacheSpec, on_text: Callable[[str], None] | None,
         start: tuple[object, list[int]] | None = None, context_shift: bool = False,
         n_keep: int = 0, on_prefill: Callable[[object], None] | None = None
         ) -> tuple[list[GenerationResult], CacheState]:
    """Generate for tokenized prompts (streaming row 0 when `on_text`); `start` = (starting
    cache, cached token counts). Returns the results and the final cache state."""
    stop = check_options(stop, n_keep=n_keep, context_shift=context_shift)
    if on_text is not None and not callable(on_text):
        raise TqjaxError(f"on_text must be a function (it gets each piece of text), got "
                         f"{type(on_text).__name__}")
    streams = [_TextStream(model.tokenizer, stop) for _ in prompts]
    stop_fn = (lambda b, ids: streams[b].stopped(ids)) if stop else None
    kv, cached = start if start is not None else (None, None)
    steps = generate_tokens(
        model.params, model.config, prompts, max_new_tokens=max_new_tokens, sampling=sampling,
        eos_ids=model.tokenizer.eos_ids, ctx_size=ctx, cache_spec=cache,
        calibration=model.calibration(cache), stop=stop_fn, cache=kv, cached=cached,
        context_shift_keep=n_keep if context_shift else None, on_prefill=on_prefill)
    seqs, prefill_s, decode_s = [], 0.0, 0.0
    while True:
        try:
            seqs, prefill_s, decode_s = next(steps)
        except StopIteration as end:
            state = end.value
            break
        if on_text is not None:
            ids = _text_ids(seqs[0].ids, model.tokenizer.eos_ids)
            piece = streams[0].piece(ids, seqs[0].done is not None)
            if piece:
                on_text(piece)
    results = []
    for s, st, p in zip(seqs, streams, prompts, strict=True):
        text, _ = st.final_text(_text_ids(s.ids, model.tokenizer.eos_ids))
        results.append(GenerationResult(text, s.ids, len(p), len(s.ids), s.done or "length",
                                        prefill_s, decode_s, s.cached, s.shifts,
                                        s.prefill_compile_s))
    return results, state


def _context(model: Model, ctx_size: int | None) -> int:
    """The context in tokens: `ctx_size`, or the model's for None or 0; outside [2, the
    model's] a TqjaxError (not clamped: the caller asked for another size)."""
    limit = model.config.max_position
    if ctx_size is not None and not is_int(ctx_size):
        raise TqjaxError(f"context size must be an integer, got {ctx_size!r}")
    if ctx_size and not 2 <= ctx_size <= limit:
        raise TqjaxError(f"context size {ctx_size} is outside [2, {limit}] (the model's context)")
    return ctx_size or limit


def _encode_batch_item(model: Model, prompt: Prompt, index: int, chat: bool,
                       system: str | None) -> list[int]:
    """`encode_prompt` for prompt `index` of a batch, its errors naming it."""
    try:
        return encode_prompt(model, prompt, chat, system)
    except TqjaxError as e:
        raise TqjaxError(f"prompt {index} of the batch: {e}") from None


def generate(model: Model, prompt: Prompt | list[str], *,
             max_new_tokens: int = 128, temperature: float = 0.0, top_k: int = 0,
             top_p: float = 1.0, min_p: float = 0.0, repeat_penalty: float = 1.0, seed: int = 0,
             stop: Sequence[str] = (), chat: bool = False, system: str | None = None,
             ctx_size: int | None = None, cache: CacheSpec | str = CacheSpec(),
             on_text: Callable[[str], None] | None = None, context_shift: bool = False,
             n_keep: int = 0, prompt_cache: str | Path | None = None,
             prompt_cache_ro: bool = False) -> GenerationResult | list[GenerationResult]:
    """Generate a continuation; a list of prompts (strings, conversations or token id lists)
    is run as one batch (one result each).

    Greedy when temperature is 0; otherwise `seed` fixes the draws: a batch's first row
    draws as that prompt alone does, row b from the seed and its index b (so a prompt's
    sampled text depends on its place in the batch). Every integer is a fixed seed here, -1
    too (the CLI and the server draw one for -1: `tqjax.decode.sampling.random_seed`).
    `on_text` receives streamed text pieces
    (a single prompt only: with a batch it is a TqjaxError).
    `stop`: strings that end the text (a lone string is one; an empty one is a TqjaxError).
    `chat` applies the chat template, with `system` as its system message (a TqjaxError
    without `chat`); a list of messages (``{"role": "user", "content": "..."}``, roles
    system/user/assistant) is a conversation, rendered by the chat template.
    `ctx_size`: the context, the model's by default; outside [2, the
    model's] a TqjaxError.
    `context_shift`: when a sequence fills the context (`ctx_size`), keep its first `n_keep`
    tokens (-1: the whole prompt), drop half of the rest and go on, like llama.cpp (dense
    key caches only); off: stop with finish reason "length".
    `prompt_cache` (a file, llama.cpp's --prompt-cache): if it exists and its tokens share a
    prefix with the prompt, that prefix is restored instead of prefilled
    (`GenerationResult.cached_tokens`); then, unless `prompt_cache_ro`, the prompt's own
    cache is saved there (atomically). A file from another model or cache format is a
    TqjaxError. For repeated calls in one process, `Session` keeps the cache in memory.
    """
    sampling = SamplingParams(temperature, top_k, top_p, min_p, repeat_penalty, seed)
    cache = as_cache_spec(cache)
    if model.tokenizer is None:
        raise TqjaxError(f"{model.source} has no tokenizer; use tqjax.logits for raw ids")
    # a list of prompts (texts, conversations, token id lists) is a batch; a list of ids or
    # of messages is one prompt
    batched = (isinstance(prompt, list) and bool(prompt) and all(
        isinstance(p, Sequence) and not isinstance(p, bytes) for p in prompt))
    if batched and on_text is not None:
        raise TqjaxError("on_text streams one prompt's text; a batch returns its results")
    prompts = ([_encode_batch_item(model, p, i, chat, system) for i, p in enumerate(prompt)]
               if batched else [encode_prompt(model, prompt, chat, system)])
    if prompt_cache is None:
        results, _ = _run(model, prompts, sampling, max_new_tokens=max_new_tokens, stop=stop,
                          ctx=_context(model, ctx_size), cache=cache,
                          on_text=on_text,
                          context_shift=context_shift, n_keep=n_keep)
        return results if batched else results[0]
    if batched:
        raise TqjaxError("a prompt cache file goes with a single prompt")
    if not isinstance(prompt_cache, str | os.PathLike):
        raise TqjaxError(f"prompt_cache must be a file path, got {type(prompt_cache).__name__}")
    ids, path, meta = prompts[0], Path(prompt_cache), model.cache_meta(cache)
    if not prompt_cache_ro:  # before any work (a folder, or a file where a folder must be)
        check_writable(path, "prompt cache")
    elif not path.exists():  # (read-only: nothing would be written, so a typo would pass)
        raise TqjaxError(f"prompt cache {path} does not exist (read-only use reads a saved "
                         f"one: make it first without --prompt-cache-ro)")
    start, saved = None, []
    if path.exists():
        kv, saved = load_prompt_cache(path, meta, saved_length(path))
        reuse = reusable_prefix(saved, ids, ring_size(kv))
        start = (kv, [reuse]) if reuse > 0 else None

    def save(kv: object) -> None:
        save_prompt_cache(path, kv, ids, meta)

    keep = prompt_cache_ro or saved == ids
    results, _ = _run(model, prompts, sampling, max_new_tokens=max_new_tokens, stop=stop,
                      ctx=_context(model, ctx_size), cache=cache, on_text=on_text, start=start,
                      context_shift=context_shift, n_keep=n_keep,
                      on_prefill=None if keep else save)
    return results[0]


class Session:
    """A model with a KV cache kept between calls, for chats and repeated long prefixes.

    Each `generate` reuses the longest common token prefix of the new prompt and the tokens
    already in the cache (the previous prompt + output), and prefills only the rest, as
    llama-cpp-python's `Llama` does between calls; `GenerationResult.cached_tokens` says how
    many prompt tokens were reused. `save(path)` / `load(path)` write and read the cache as a
    prompt-cache file (`tqjax.decode.prompt_cache`; llama-cpp-python's save_state/load_state).

        s = tqjax.Session(model, cache="turbo4")
        a = s.generate(system_prompt + question_1)   # prefills everything
        b = s.generate(system_prompt + question_2)   # prefills only question_2

    A multi-turn chat passes the conversation so far; each turn prefills only what is new:

        chat = [{"role": "user", "content": "Name a prime."}]
        r = s.generate(chat)
        chat += [{"role": "assistant", "content": r.text},
                 {"role": "user", "content": "And the next one?"}]
        r = s.generate(chat)                          # r.cached_tokens: the first turn
    """

    def __init__(self, model: Model, cache: CacheSpec | str = CacheSpec(),
                 ctx_size: int | None = None) -> None:
        if model.tokenizer is None:
            raise TqjaxError(f"{model.source} has no tokenizer; a session generates text")
        self.model, self.spec, self.ctx = model, as_cache_spec(cache), _context(model, ctx_size)
        self._kv: object | None = None
        self.tokens: list[int] = []  # the token ids held by the cache, slot by slot

    def reset(self) -> None:
        """Forget the cache."""
        self._kv, self.tokens = None, []

    def generate(self, prompt: Prompt, *, max_new_tokens: int = 128,
                 temperature: float = 0.0, top_k: int = 0, top_p: float = 1.0,
                 min_p: float = 0.0, repeat_penalty: float = 1.0, seed: int = 0,
                 stop: Sequence[str] = (), chat: bool = False, system: str | None = None,
                 on_text: Callable[[str], None] | None = None, context_shift: bool = False,
                 n_keep: int = 0) -> GenerationResult:
        """`tqjax.generate` for one prompt, reusing the cached common prefix."""
        sampling = SamplingParams(temperature, top_k, top_p, min_p, repeat_penalty, seed)
        ids = encode_prompt(self.model, prompt, chat, system)
        reuse = 0 if self._kv is None else reusable_prefix(self.tokens, ids, ring_size(self._kv))
        start = (self._kv, [reuse]) if reuse > 0 else None
        kv, tokens = self._kv, self.tokens
        self.reset()  # generation consumes the cache (the decode steps donate its buffers)
        try:
            results, state = _run(self.model, [ids], sampling, max_new_tokens=max_new_tokens,
                                  stop=stop, ctx=self.ctx, cache=self.spec, on_text=on_text,
                                  start=start, context_shift=context_shift, n_keep=n_keep)
        except BaseException:  # (a refusal, or a caller's on_text that raised)
            if kv is not None and not any(x.is_deleted() for x in jax.tree_util.tree_leaves(kv)):
                self._kv, self.tokens = kv, tokens  # not yet used: still valid
            raise
        self._kv, self.tokens = state.cache, state.tokens[0]
        return results[0]

    def save(self, path: str | Path) -> None:
        """Write the session's cache and tokens to a prompt-cache file (atomically)."""
        if self._kv is None:
            raise TqjaxError("the session has no cache to save yet")
        save_prompt_cache(path, self._kv, self.tokens, self.model.cache_meta(self.spec))

    def load(self, path: str | Path) -> None:
        """Replace the session's cache with a saved prompt cache of this model and format (no
        longer than the session's context)."""
        meta = self.model.cache_meta(self.spec)
        n = saved_length(path)
        if n > self.ctx:
            raise TqjaxError(f"prompt cache {path} holds {n} tokens, more than the session's "
                             f"context of {self.ctx}")
        self._kv, self.tokens = load_prompt_cache(path, meta, n)
