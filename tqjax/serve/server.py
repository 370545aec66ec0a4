"""An OpenAI-compatible HTTP server over the continuous-batching `Engine`.

FastAPI + uvicorn: FastAPI validates the OpenAI request bodies with pydantic models and serves
server-sent events (`stream: true`) from async generators; uvicorn is its standard ASGI
server. Metrics use prometheus_client (text exposition format).

Endpoints: POST /v1/completions, POST /v1/chat/completions (OpenAI shapes, streaming as SSE
chunks ending in `data: [DONE]`, usage, max_tokens, temperature, top_p, top_k, min_p,
repeat_penalty, seed, stop, logprobs / top_logprobs), GET /v1/models, GET /health,
GET /metrics, POST /tokenize, POST /detokenize, POST /slots/{id}?action=save|restore|erase
(llama-server's; files inside --slot-save-path via `tqjax.decode.prompt_cache`).

Errors are OpenAI error objects {"error": {"message", "type", "param", "code"}}: 400 bad
request (malformed JSON, bad parameters, text that is not Unicode, prompt longer than the
context, a field that would change the answer and is not implemented: logit_bias, best_of,
suffix, tools, ...), 401 missing or wrong API key, 404, 409 slot busy, 413 body too large
(chunked or not), 429 waiting queue full, 500 an internal error
in one request (the others go on), 501 slot files not enabled, 503 shutting down.
"""

from __future__ import annotations

import asyncio
import codecs
import hmac
import json
import time
import types
import typing
import uuid
from collections.abc import AsyncIterator
from pathlib import Path
from typing import Any, Literal

from fastapi import FastAPI, Request
from fastapi.exceptions import RequestValidationError
from fastapi.middleware.cors import CORSMiddleware
from fastapi.responses import JSONResponse, PlainTextResponse, StreamingResponse
from prometheus_client import CollectorRegistry, generate_latest
from prometheus_client.core import CounterMetricFamily, GaugeMetricFamily
from pydantic import BaseModel, ConfigDict, Field, ValidationError, model_validator
from starlette.exceptions import HTTPException as StarletteHTTPException

from tqjax.api import _TextStream
from tqjax.decode.sampling import RANDOM_SEED, SamplingParams, random_seed
from tqjax.errors import TqjaxError
from tqjax.serve.engine import (
    TOP_LOGPROBS,
    Engine,
    Failed,
    Finished,
    QueueFull,
    SlotBusy,
    Token,
)
from tqjax.serve.engine import (
    Request as EngineRequest,
)

MAX_BODY_BYTES = 1 << 20
MAX_STOP = 4


class ApiError(Exception):
    """An HTTP error with an OpenAI error object."""

    def __init__(self, status: int, message: str, type_: str = "invalid_request_error",
                 param: str | None = None, code: str | None = None) -> None:
        super().__init__(message)
        self.status, self.message, self.type, self.param, self.code = (status, message, type_,
                                                                       param, code)

    def body(self) -> dict:
        return {"error": {"message": self.message, "type": self.type, "param": self.param,
                          "code": self.code}}


def error_response(err: ApiError) -> JSONResponse:
    return JSONResponse(err.body(), status_code=err.status)


class _Strict(BaseModel):
    """A request object whose types are strict, as OpenAI's: "5" or true for an integer,
    "yes" or 1 for a boolean are a 400, not read as 5, 1 and true (an integer is still a
    number)."""

    model_config = ConfigDict(strict=True)


class _NullIsDefault(_Strict):
    """A request object in which a field given as JSON null takes its default, as OpenAI's
    API and llama-server read it (the OpenAI client sends null for an explicit None)."""

    @model_validator(mode="before")
    @classmethod
    def _drop_nulls(cls, data: Any) -> Any:  # noqa: ANN401
        return {k: v for k, v in data.items() if v is not None} if isinstance(data, dict) else data


class StreamOptions(_NullIsDefault):
    include_usage: bool = False


class _Common(_NullIsDefault):
    """Fields shared by completions and chat (OpenAI names plus llama-server's top_k, min_p,
    repeat_penalty); unknown fields are ignored as OpenAI clients send many."""

    model_config = ConfigDict(extra="ignore", allow_inf_nan=False)  # (NaN read as "> 2")
    model: str | None = None
    max_tokens: int | None = Field(None, ge=1)
    temperature: float = Field(1.0, ge=0.0, le=2.0)
    top_p: float = Field(1.0, gt=0.0, le=1.0)
    top_k: int = Field(0, ge=0)
    min_p: float = Field(0.0, ge=0.0, lt=1.0)
    repeat_penalty: float = Field(1.0, gt=0.0)
    presence_penalty: float = 0.0
    frequency_penalty: float = 0.0
    logit_bias: dict[str, float] | None = None
    best_of: int | None = None
    seed: int | None = None
    stop: str | list[str] | None = None
    stream: bool = False
    stream_options: StreamOptions | None = None
    n: int = 1
    user: str | None = None


class CompletionRequest(_Common):
    prompt: str | list[int] | list[str]
    logprobs: int | None = Field(None, ge=0, le=TOP_LOGPROBS)
    echo: bool = False
    suffix: str | None = None


class ContentPart(_Strict):
    model_config = ConfigDict(extra="ignore")
    type: Literal["text"]
    text: str


class Message(_Strict):
    """One chat message: content is required except for an assistant's (null reads as empty);
    "developer" (OpenAI's newer name for system instructions) is read as "system"; the server
    has no tools, so no "tool" role."""

    model_config = ConfigDict(extra="ignore")
    role: Literal["system", "developer", "user", "assistant"]
    content: str | list[ContentPart] | None = None


class ChatRequest(_Common):
    messages: list[Message] = Field(min_length=1)
    max_completion_tokens: int | None = Field(None, ge=1)
    logprobs: bool = False
    top_logprobs: int | None = Field(None, ge=0, le=TOP_LOGPROBS)
    tools: list[Any] | None = None
    response_format: dict[str, Any] | None = None


class TokenizeRequest(_Strict):
    content: str
    add_special: bool = False


class DetokenizeRequest(_Strict):
    tokens: list[int]


class SlotRequest(_Strict):
    model_config = ConfigDict(extra="ignore")
    filename: str | None = None


class _Metrics:
    """A prometheus_client collector reading the engine's counters at scrape time."""

    def __init__(self, engine: Engine) -> None:
        self.engine = engine

    def collect(self) -> Any:  # noqa: ANN401 - prometheus collector protocol
        e, c = self.engine, self.engine.counts()
        st = e.stats
        gauges = [("tqjax_requests_running", "requests holding a slot", c["running"]),
                  ("tqjax_requests_waiting", "requests in the waiting queue", c["waiting"]),
                  ("tqjax_kv_slots_in_use", "KV cache rows holding a request", c["slots_in_use"]),
                  ("tqjax_kv_slots_total", "KV cache rows", e.n),
                  ("tqjax_tokens_per_second", "generated tokens/s over the last 10 s",
                   st.tokens_per_second())]
        for name, doc, value in gauges:
            yield GaugeMetricFamily(name, doc, value=value)
        counters = [("tqjax_requests", "requests admitted", st.requests),
                    ("tqjax_prompt_tokens", "prompt tokens admitted", st.prompt_tokens),
                    ("tqjax_prefill_tokens", "prompt tokens prefilled", st.prefill_tokens),
                    ("tqjax_generated_tokens", "tokens generated", st.generated_tokens),
                    ("tqjax_prefix_cache_hits", "requests that reused a cached prefix",
                     st.prefix_hits),
                    ("tqjax_prefix_cache_reused_tokens", "prompt tokens not prefilled",
                     st.reused_tokens),
                    ("tqjax_decode_steps", "batched decode steps", st.decode_steps),
                    ("tqjax_requests_failed", "requests ended by an internal error", st.failed),
                    ("tqjax_requests_rejected", "requests refused (queue full)", st.rejected)]
        for name, doc, value in counters:
            yield CounterMetricFamily(name, doc, value=value)


def _param(loc: tuple) -> str | None:
    """A pydantic error location as a field path, e.g. messages[0].role."""
    out = ""
    for x in loc:
        if isinstance(x, int):
            out += f"[{x}]"
        elif x != "body":
            out += f".{x}" if out else str(x)
    return out or None


def _validate(model: type[BaseModel], raw: bytes) -> Any:  # noqa: ANN401
    """Parse a JSON body into `model`, or ApiError 400."""
    try:
        data = json.loads(raw)
    except (ValueError, RecursionError) as e:  # (JSONDecodeError and UnicodeDecodeError are
        # ValueErrors, as is an integer of over 4300 digits; deep nesting is a RecursionError)
        raise ApiError(400, f"malformed JSON body: {str(e).splitlines()[0][:200]}") from None
    try:
        return model.model_validate(data)
    except ValidationError as e:
        errors = e.errors()
        loc = tuple(errors[0].get("loc", ()))
        for k in range(len(loc) - 1, 0, -1):  # a field of several types: name them all
            if _is_union(model, loc[:k]):
                branch = [x for x in errors if tuple(x["loc"][:k]) == loc[:k]
                          and len(x["loc"]) > k]
                inside = [x for x in branch if len(x["loc"]) > k + 1]
                if len({x["loc"][k] for x in inside}) == 1:  # one type fits, not its contents
                    at = tuple(inside[0]["loc"])
                    param = _param(at[:k] + at[k + 1:])
                    raise ApiError(400, f"{param}: {inside[0].get('msg')}", param=param) from None
                kinds = list(dict.fromkeys(str(x["loc"][k]) for x in branch))
                param = _param(loc[:k])
                names = [_KINDS.get(t, t) for t in kinds]
                raise ApiError(400, f"{param}: expected {', '.join(names[:-1])} or {names[-1]}"
                               if len(names) > 1 else f"{param}: expected {names[0]}",
                               param=param) from None
        param = _param(loc)
        raise ApiError(400, f"{param or 'body'}: {errors[0].get('msg')}", param=param) from None


_KINDS = {"str": "a string", "list[int]": "a list of integers (token ids)",
          "list[str]": "a list of strings",
          "list[ContentPart]": 'a list of content parts ({"type": "text", "text": ...})'}


def _is_union(model: type[BaseModel], path: tuple) -> bool:
    """Whether the field at `path` (names and list indices from `model`) has several types."""
    t: Any = model
    for x in path:
        if isinstance(x, int):
            args = typing.get_args(t)
            if typing.get_origin(t) is not list or not args:
                return False
            t = args[0]
        elif isinstance(t, type) and issubclass(t, BaseModel) and x in t.model_fields:
            t = t.model_fields[x].annotation
        else:
            return False
    members = [a for a in typing.get_args(t) if a is not type(None)]
    return typing.get_origin(t) in (typing.Union, types.UnionType) and len(members) > 1


def _sampling(body: _Common) -> SamplingParams:
    if body.n != 1:
        raise ApiError(400, "only n = 1 is supported", param="n")
    for name in ("presence_penalty", "frequency_penalty"):
        if getattr(body, name):
            raise ApiError(400, f"{name} is not supported (use repeat_penalty)", param=name)
    # fields that would change the answer: refused, not ignored
    if body.logit_bias:
        raise ApiError(400, "logit_bias is not supported", param="logit_bias")
    if body.best_of not in (None, 1):
        raise ApiError(400, "only best_of = 1 is supported", param="best_of")
    try:
        return SamplingParams(body.temperature, body.top_k, body.top_p, body.min_p,
                              body.repeat_penalty,
                              random_seed() if body.seed in (None, RANDOM_SEED) else body.seed)
    except TqjaxError as e:
        raise ApiError(400, str(e)) from None


def _stops(body: _Common) -> list[str]:
    stop = [body.stop] if isinstance(body.stop, str) else list(body.stop or [])
    if len(stop) > MAX_STOP or any(not s for s in stop):
        raise ApiError(400, f"stop: at most {MAX_STOP} non-empty strings", param="stop")
    return stop


class Server:
    """The HTTP front end: builds OpenAI responses from engine events."""

    def __init__(self, engine: Engine, model_name: str, api_key: str | None = None,
                 slot_save_path: str | Path | None = None,
                 max_body_bytes: int = MAX_BODY_BYTES) -> None:
        self.engine, self.model_name, self.api_key = engine, model_name, api_key
        self.tokenizer = engine.model.tokenizer
        self.slot_dir = Path(slot_save_path) if slot_save_path else None
        self.max_body = max_body_bytes
        self.created = int(time.time())
        self.registry = CollectorRegistry()
        self.registry.register(_Metrics(engine))
        self._meta = None

    # ---- generation ----

    async def encode(self, text: str, add_bos: bool | None = None) -> list[int]:
        """Token ids of a request's text, computed in a worker thread that lets the event loop
        run meanwhile (other requests' streams go on)."""
        return await asyncio.to_thread(self.tokenizer.encode, text, add_bos, True)

    def _limit(self, max_tokens: int | None, default: int) -> int:
        n = default if max_tokens is None else max_tokens
        if n > self.engine.ctx_size:
            raise ApiError(400, f"max_tokens {n} exceeds the context size "
                                f"{self.engine.ctx_size}", param="max_tokens")
        return n

    async def _events(self, http: Request, ids: list[int], max_tokens: int,
                      sampling: SamplingParams, stop: list[str], watch: bool,
                      field: str = "prompt"
                      ) -> AsyncIterator[tuple[str, list[Token], Finished | None]]:
        """Run one request: yields (new text, new tokens, None) as tokens arrive and finally
        (last text, tokens, Finished) with finish_reason "stop"/"length"; ApiError 500 on an
        internal failure. A client that goes away cancels the request: it is polled for until
        the first event (a stream's response has not started: a queued or prefilling request
        is dropped too) and throughout where `watch` (a non-streamed response); a started
        stream's task is cancelled by the server instead. The events then end without a
        Finished."""
        loop = asyncio.get_running_loop()
        queue: asyncio.Queue = asyncio.Queue()
        req = EngineRequest(ids, max_tokens, sampling,
                            lambda ev: loop.call_soon_threadsafe(queue.put_nowait, ev))
        try:
            self.engine.submit(req)
        except QueueFull as e:
            raise ApiError(429, str(e), "rate_limit_error", code="queue_full") from None
        except TqjaxError as e:
            status = 503 if "shutting down" in str(e) else 400
            raise ApiError(status, str(e), param=None if status == 503 else field) from None
        stream = _TextStream(self.tokenizer, stop)
        eos = set(self.tokenizer.eos_ids)
        text_ids: list[int] = []
        pending: list[Token] = []
        count = 0
        checked, started = time.monotonic(), False
        try:
            while True:
                if (watch or not started) and time.monotonic() - checked >= 1.0:
                    # (polled every second: tokens may never pause)
                    checked = time.monotonic()
                    if await http.is_disconnected():
                        return
                try:
                    ev = await asyncio.wait_for(queue.get(), timeout=1.0)
                except TimeoutError:
                    continue
                if isinstance(ev, Failed):
                    raise ApiError(500, ev.message, "server_error")
                if isinstance(ev, Finished):
                    piece = stream.piece(text_ids, True)
                    yield piece, pending, Finished(
                        "stop" if ev.reason == "stop" else "length", len(ids), count,
                        ev.cached_tokens)
                    return
                count += 1
                pending.append(ev)
                if ev.id not in eos:
                    text_ids.append(ev.id)
                if stop and stream.stopped(text_ids):
                    self.engine.cancel(req)
                    yield stream.piece(text_ids, True), pending, Finished(
                        "stop", len(ids), count, req.cached)
                    return
                piece = stream.piece(text_ids, False)
                if piece:
                    started = True
                    yield piece, pending, None
                    pending = []
        finally:
            self.engine.cancel(req)  # no-op when finished; frees the slot otherwise

    def _token_str(self, tid: int) -> str:
        return self.tokenizer.decode([tid], skip_special=False)

    def _completion_logprobs(self, tokens: list[Token], n: int, offsets: _TextOffsets
                             ) -> dict:
        """OpenAI's completion logprobs for `tokens`; `offsets` follows the text returned so
        far (across a stream's chunks), so that each text_offset is the character where the
        token starts in the returned text (a token inside a character: that character's
        start)."""
        out = {"tokens": [], "token_logprobs": [], "top_logprobs": [], "text_offset": []}
        eos = set(self.tokenizer.eos_ids)
        for t in tokens:
            out["tokens"].append(self._token_str(t.id))
            out["token_logprobs"].append(t.logprob)
            out["top_logprobs"].append({self._token_str(i): lp for i, lp in t.top[:n]})
            out["text_offset"].append(offsets.chars)
            if t.id not in eos:  # (the text leaves the end-of-sequence token out)
                offsets.add(self.tokenizer.token_bytes(t.id))
        return out

    def _chat_logprobs(self, tokens: list[Token], n: int) -> dict:
        def entry(tid: int, lp: float) -> dict:
            return {"token": self._token_str(tid), "logprob": lp,
                    "bytes": list(self.tokenizer.token_bytes(tid))}

        return {"content": [{**entry(t.id, t.logprob),
                             "top_logprobs": [entry(i, lp) for i, lp in t.top[:n]]}
                            for t in tokens]}

    @staticmethod
    def _usage(fin: Finished) -> dict:
        return {"prompt_tokens": fin.prompt_tokens, "completion_tokens": fin.completion_tokens,
                "total_tokens": fin.prompt_tokens + fin.completion_tokens,
                "prompt_tokens_details": {"cached_tokens": fin.cached_tokens}}

    async def completions(self, http: Request) -> Any:  # noqa: ANN401
        body: CompletionRequest = _validate(CompletionRequest, await http.body())
        if body.echo:
            raise ApiError(400, "echo is not supported", param="echo")
        if body.suffix:
            raise ApiError(400, "suffix is not supported", param="suffix")
        prompt = body.prompt
        if isinstance(prompt, list) and prompt and isinstance(prompt[0], str):
            if len(prompt) != 1:
                raise ApiError(400, "one prompt per request", param="prompt")
            prompt = prompt[0]
        ids = await self.encode(prompt) if isinstance(prompt, str) else list(prompt)
        if not ids:
            raise ApiError(400, "empty prompt", param="prompt")
        sampling, stop = _sampling(body), _stops(body)
        max_tokens = self._limit(body.max_tokens, 16)
        cid, created = f"cmpl-{uuid.uuid4().hex}", int(time.time())
        nlp = body.logprobs
        events = self._events(http, ids, max_tokens, sampling, stop, not body.stream)
        base = {"id": cid, "object": "text_completion", "created": created,
                "model": self.model_name}

        def choice(text: str, toks: list[Token], reason: str | None, offsets: _TextOffsets
                   ) -> dict:
            lp = None if nlp is None else self._completion_logprobs(toks, nlp, offsets)
            return {"text": text, "index": 0, "logprobs": lp, "finish_reason": reason}

        if body.stream:
            first = await _first(events)
            include_usage = bool(body.stream_options and body.stream_options.include_usage)

            async def sse() -> AsyncIterator[str]:
                offsets = _TextOffsets()
                async for text, toks, fin in _chain(first, events):
                    yield _sse({**base, "choices": [choice(text, toks, fin and fin.reason,
                                                           offsets)]})
                    if fin is not None and include_usage:
                        yield _sse({**base, "choices": [], "usage": self._usage(fin)})
                yield "data: [DONE]\n\n"

            return StreamingResponse(_guard(sse()), media_type="text/event-stream")
        text, toks, fin = await _collect(events)
        return {**base, "choices": [choice(text, toks, fin.reason, _TextOffsets())],
                "usage": self._usage(fin)}

    async def chat(self, http: Request) -> Any:  # noqa: ANN401
        body: ChatRequest = _validate(ChatRequest, await http.body())
        if body.tools:
            raise ApiError(400, "tools are not supported", param="tools")
        if body.response_format and body.response_format.get("type", "text") != "text":
            raise ApiError(400, "only response_format {\"type\": \"text\"} is supported",
                           param="response_format")
        messages = []
        for i, m in enumerate(body.messages):
            content = m.content
            if content is None and m.role != "assistant":
                param = f"messages[{i}].content"
                raise ApiError(400, f"{param}: a {m.role} message needs content", param=param)
            if isinstance(content, list):
                content = "".join(p.text for p in content)
            role = "system" if m.role == "developer" else m.role
            messages.append({"role": role, "content": content or ""})
        try:
            ids = await self.encode(self.tokenizer.apply_chat_template(messages), False)
        except TqjaxError as e:
            raise ApiError(400, str(e), param="messages") from None
        sampling, stop = _sampling(body), _stops(body)
        max_tokens = self._limit(body.max_completion_tokens or body.max_tokens,
                                 self.engine.ctx_size)
        if body.top_logprobs is not None and not body.logprobs:  # (as OpenAI and vLLM)
            raise ApiError(400, "top_logprobs needs logprobs: true", param="top_logprobs")
        nlp = (body.top_logprobs or 0) if body.logprobs else None
        cid, created = f"chatcmpl-{uuid.uuid4().hex}", int(time.time())
        events = self._events(http, ids, max_tokens, sampling, stop, not body.stream,
                              "messages")

        def lp(toks: list[Token]) -> dict | None:
            return None if nlp is None else self._chat_logprobs(toks, nlp)

        if body.stream:
            first = await _first(events)
            include_usage = bool(body.stream_options and body.stream_options.include_usage)
            base = {"id": cid, "object": "chat.completion.chunk", "created": created,
                    "model": self.model_name}

            async def sse() -> AsyncIterator[str]:
                yield _sse({**base, "choices": [{"index": 0, "delta": {"role": "assistant",
                                                                        "content": ""},
                                                 "logprobs": None, "finish_reason": None}]})
                async for text, toks, fin in _chain(first, events):
                    delta = {"content": text} if text or fin is None else {}
                    yield _sse({**base, "choices": [{"index": 0, "delta": delta,
                                                     "logprobs": lp(toks),
                                                     "finish_reason": fin and fin.reason}]})
                    if fin is not None and include_usage:
                        yield _sse({**base, "choices": [], "usage": self._usage(fin)})
                yield "data: [DONE]\n\n"

            return StreamingResponse(_guard(sse()), media_type="text/event-stream")
        text, toks, fin = await _collect(events)
        return {"id": cid, "object": "chat.completion", "created": created,
                "model": self.model_name,
                "choices": [{"index": 0, "message": {"role": "assistant", "content": text},
                             "logprobs": lp(toks), "finish_reason": fin.reason}],
                "usage": self._usage(fin)}

    # ---- slots ----

    def _meta_for_slots(self) -> object:
        from tqjax.decode.prompt_cache import cache_meta

        if self._meta is None:
            m = self.engine.model
            self._meta = cache_meta(m.config, m.params, m.tokenizer, self.engine.spec,
                                    self.engine.calibration)
        return self._meta

    async def slots(self, slot_id: int, action: str, http: Request) -> dict:
        if action not in ("save", "restore", "erase"):
            raise ApiError(400, f"unknown slot action {action!r} (save, restore, erase)",
                           param="action")
        if not 0 <= slot_id < self.engine.n:
            raise ApiError(400, f"no slot {slot_id}: the server has slots 0..{self.engine.n - 1}",
                           param="id_slot")
        e = self.engine
        t0 = time.perf_counter()
        try:
            if action == "erase":
                n = await asyncio.to_thread(e.call, lambda: e.erase_slot(slot_id))
                return {"id_slot": slot_id, "n_erased": n}
            if self.slot_dir is None:
                raise ApiError(501, "slot save/restore needs --slot-save-path", "not_supported")
            raw = await http.body()
            body: SlotRequest = _validate(SlotRequest, raw or b"{}")
            name = body.filename or ""
            if (not name or Path(name).name != name or name in (".", "..")
                    or any(c in name for c in "\\\0")):
                raise ApiError(400, "filename must be a plain file name inside the slot save "
                                    "path", param="filename")
            path = self.slot_dir / name
            meta = await asyncio.to_thread(self._meta_for_slots)
            if action == "save":
                n = await asyncio.to_thread(e.call, lambda: e.save_slot(slot_id, str(path),
                                                                        meta))
                return {"id_slot": slot_id, "filename": name, "n_saved": n,
                        "n_written": path.stat().st_size,
                        "timings": {"save_ms": 1000 * (time.perf_counter() - t0)}}
            n = await asyncio.to_thread(e.call, lambda: e.restore_slot(slot_id, str(path), meta))
            return {"id_slot": slot_id, "filename": name, "n_restored": n,
                    "n_read": path.stat().st_size,
                    "timings": {"restore_ms": 1000 * (time.perf_counter() - t0)}}
        except SlotBusy as err:
            raise ApiError(409, str(err), code="slot_busy") from None
        except TqjaxError as err:
            raise ApiError(400, str(err)) from None


class _TextOffsets:
    """The characters of the returned text so far, from its tokens' bytes decoded as the
    tokenizer decodes them (U+FFFD for an invalid sequence), an unfinished character at the
    end not yet counted; kept incrementally, so a long completion is not decoded again per
    token."""

    def __init__(self) -> None:
        self.decoder = codecs.getincrementaldecoder("utf-8")("replace")
        self.chars = 0

    def add(self, data: bytes) -> None:
        self.chars += len(self.decoder.decode(data))


def _sse(obj: dict) -> str:
    return f"data: {json.dumps(obj, ensure_ascii=False)}\n\n"


async def _first(events: AsyncIterator) -> tuple | None:
    """The first event, awaited before the response starts, so that a rejected request (400,
    429, 500) still gets its status code instead of a 200 stream."""
    try:
        return await events.__anext__()
    except StopAsyncIteration:
        return None


async def _collect(events: AsyncIterator) -> tuple[str, list[Token], Finished]:
    """A non-streamed response's whole text, tokens and end, from its events; ApiError 499
    (nginx's "client closed request": nobody reads it) where the client went away first."""
    pieces, toks, fin = [], [], None
    async for piece, new, f in events:
        pieces.append(piece)
        toks += new
        fin = f
    if fin is None:
        raise ApiError(499, "the client closed the request")
    return "".join(pieces), toks, fin


async def _chain(first: tuple | None, events: AsyncIterator) -> AsyncIterator:
    if first is not None:
        yield first
        async for ev in events:
            yield ev


async def _guard(chunks: AsyncIterator[str]) -> AsyncIterator[str]:
    """An error in the middle of a stream becomes an SSE error event, then [DONE]."""
    try:
        async for c in chunks:
            yield c
    except ApiError as e:
        yield _sse(e.body())
        yield "data: [DONE]\n\n"


def create_app(server: Server, shutdown_grace_s: float = 10.0) -> FastAPI:
    """The FastAPI application; shutting it down drains the engine for `shutdown_grace_s`."""
    import contextlib

    @contextlib.asynccontextmanager
    async def lifespan(_: FastAPI) -> AsyncIterator[None]:
        yield
        try:  # a thread, so that running streams keep receiving tokens while they finish
            await asyncio.to_thread(server.engine.shutdown, shutdown_grace_s)
        except RuntimeError:  # the interpreter is exiting: no new threads, cancel at once
            server.engine.shutdown(0.0)

    app = FastAPI(title="tqjax", lifespan=lifespan)

    app.add_middleware(_Guard, server=server)
    # outermost: a browser's preflight (OPTIONS, which carries no API key) is answered here;
    # any origin may call, as llama-server and vLLM allow by default (no cookies are used)
    app.add_middleware(CORSMiddleware, allow_origins=["*"], allow_methods=["*"],
                       allow_headers=["*"])

    @app.exception_handler(ApiError)
    async def api_error(_: Request, e: ApiError) -> JSONResponse:
        return error_response(e)

    @app.exception_handler(TqjaxError)
    async def bad_input(_: Request, e: TqjaxError) -> JSONResponse:
        return error_response(ApiError(400, str(e)))

    @app.exception_handler(RequestValidationError)
    async def invalid(_: Request, e: RequestValidationError) -> JSONResponse:
        err = e.errors()[0] if e.errors() else {}
        param = _param(tuple(err.get("loc", ())))
        return error_response(ApiError(400, f"{param or 'body'}: {err.get('msg', 'invalid')}",
                                       param=param))

    @app.exception_handler(StarletteHTTPException)
    async def http_error(_: Request, e: StarletteHTTPException) -> JSONResponse:
        return error_response(ApiError(e.status_code, str(e.detail),
                                       "not_found_error" if e.status_code == 404
                                       else "invalid_request_error"))

    @app.exception_handler(Exception)
    async def internal(_: Request, e: Exception) -> JSONResponse:
        return error_response(ApiError(500, f"internal error: {type(e).__name__}",
                                       "server_error"))

    @app.post("/v1/completions")
    async def completions(request: Request) -> Any:  # noqa: ANN401
        return await server.completions(request)

    @app.post("/v1/chat/completions")
    async def chat(request: Request) -> Any:  # noqa: ANN401
        return await server.chat(request)

    @app.get("/v1/models")
    async def models() -> dict:
        return {"object": "list", "data": [{"id": server.model_name, "object": "model",
                                            "created": server.created, "owned_by": "tqjax"}]}

    @app.api_route("/health", methods=["GET", "HEAD"])
    async def health() -> dict:
        return {"status": "ok"}

    @app.get("/metrics")
    async def metrics() -> PlainTextResponse:
        return PlainTextResponse(generate_latest(server.registry).decode(),
                                 media_type="text/plain; version=0.0.4")

    @app.post("/tokenize")
    async def tokenize(request: Request) -> dict:
        body: TokenizeRequest = _validate(TokenizeRequest, await request.body())
        add = None if body.add_special else False
        return {"tokens": await server.encode(body.content, add)}

    @app.post("/detokenize")
    async def detokenize(request: Request) -> dict:
        body: DetokenizeRequest = _validate(DetokenizeRequest, await request.body())
        vocab = server.engine.model.config.vocab_size
        if any(not 0 <= t < vocab for t in body.tokens):
            raise ApiError(400, f"token id out of range [0, {vocab})", param="tokens")
        return {"content": server.tokenizer.decode(body.tokens)}

    @app.post("/slots/{slot_id}")
    async def slots(slot_id: int, request: Request, action: str = "") -> dict:
        return await server.slots(slot_id, action, request)

    return app


class _Guard:
    """Body size and API key checks, a plain ASGI middleware (BaseHTTPMiddleware would break
    request.is_disconnected). A body without a Content-Length (chunked) is read here, at most
    `max_body` bytes of it, and handed on whole."""

    def __init__(self, app: Any, server: Server) -> None:  # noqa: ANN401
        self.app, self.server = app, server

    def _authorized(self, value: str | None) -> bool:
        scheme, _, key = (value or "").partition(" ")  # the scheme is case-insensitive
        return scheme.lower() == "bearer" and hmac.compare_digest(key.strip().encode(),
                                                                  self.server.api_key.encode())

    async def __call__(self, scope: dict, receive: Any, send: Any) -> None:  # noqa: ANN401
        if scope["type"] == "http":
            srv = self.server
            headers = {k.decode("latin-1").lower(): v.decode("latin-1")
                       for k, v in scope.get("headers", [])}
            size = headers.get("content-length")
            too_large = ApiError(413, f"request body over {srv.max_body} bytes",
                                 code="body_too_large")
            err = None
            if size is not None and (not size.isdigit() or int(size) > srv.max_body):
                err = too_large
            elif srv.api_key and scope.get("path") != "/health" and \
                    not self._authorized(headers.get("authorization")):
                err = ApiError(401, "invalid or missing API key", "authentication_error",
                               code="invalid_api_key")
            elif size is None and "chunked" in headers.get("transfer-encoding", "").lower():
                parts, total = [], 0
                while True:
                    message = await receive()
                    if message["type"] != "http.request":
                        return  # the client went away
                    parts.append(message.get("body", b""))
                    total += len(parts[-1])
                    if total > srv.max_body:
                        err = too_large
                        break
                    if not message.get("more_body", False):
                        receive = _replay(b"".join(parts), receive)
                        break
            if err is not None:
                await error_response(err)(scope, receive, send)
                return
        await self.app(scope, receive, send)


def _replay(body: bytes, receive: Any) -> Any:  # noqa: ANN401
    """An ASGI receive that gives `body` as one message, then defers to `receive`."""
    sent = False

    async def replayed() -> dict:
        nonlocal sent
        if not sent:
            sent = True
            return {"type": "http.request", "body": body, "more_body": False}
        return await receive()

    return replayed
