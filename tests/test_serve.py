"""The OpenAI-compatible server against live uvicorn servers on loopback, driven by the real
`openai` client (and httpx for raw HTTP): greedy outputs equal offline `tqjax.generate` token for
token (also 16 concurrent requests, and a turbo4 cache), prefix reuse skips prefill, sampling
settings never recompile, faults give their status and the server keeps serving."""

import concurrent.futures
import functools
import json
import shutil
import socket
import threading
import time

import httpx
import numpy as np
import pytest

import tqjax
from tqjax.decode import generate as gen
from tqjax.kv.cache import CacheSpec

from .conftest import GOLDEN
from .test_cli import make_byte_tokenizer

openai = pytest.importorskip("openai")
uvicorn = pytest.importorskip("uvicorn")

CTX = 256
post = functools.partial(httpx.post, timeout=300)
get = functools.partial(httpx.get, timeout=300)
TEMPLATE = ("{% for m in messages %}<{{ m['role'] }}>{{ m['content'] }}\n{% endfor %}"
            "{% if add_generation_prompt %}<assistant>{% endif %}")


@pytest.fixture(scope="module")
def model(tmp_path_factory):
    d = tmp_path_factory.mktemp("tiny") / "llama"
    shutil.copytree(GOLDEN / "tiny" / "llama", d)
    make_byte_tokenizer(d)
    (d / "tokenizer_config.json").write_text(json.dumps({"chat_template": TEMPLATE}))
    return tqjax.load(d)


class Live:
    """A uvicorn server on a free loopback port in a thread."""

    def __init__(self, model, spec=CacheSpec(), slots=4, tmp=None, ctx=CTX, max_body=4096,
                 graceful_s=None, **kw):
        from tqjax.serve.engine import Engine
        from tqjax.serve.server import Server, create_app

        self.engine = Engine(model, spec, slots=slots, ctx_size=ctx, **kw)
        self.server = Server(self.engine, "tiny", slot_save_path=tmp,
                             max_body_bytes=max_body)
        with socket.socket() as s:
            s.bind(("127.0.0.1", 0))
            self.port = s.getsockname()[1]
        self.uv = uvicorn.Server(uvicorn.Config(create_app(self.server, shutdown_grace_s=2),
                                                host="127.0.0.1", port=self.port,
                                                log_level="warning",
                                                timeout_graceful_shutdown=graceful_s))
        self.thread = threading.Thread(target=self.uv.run, daemon=True)
        self.thread.start()
        while not self.uv.started:
            time.sleep(0.02)
        self.url = f"http://127.0.0.1:{self.port}"
        self.client = openai.OpenAI(base_url=self.url + "/v1", api_key="none", max_retries=0,
                                    timeout=300)

    def metric(self, name):
        text = get(self.url + "/metrics").text
        return next(float(line.split()[-1]) for line in text.splitlines()
                    if line.startswith(name + " ") or line.startswith(name + "_total "))

    def close(self):
        self.uv.should_exit = True
        self.thread.join(30)


@pytest.fixture(scope="module")
def live(model, tmp_path_factory):
    srv = Live(model, tmp=tmp_path_factory.mktemp("slots"))
    yield srv
    srv.close()


def offline(model, prompt, n, **kw):
    return tqjax.generate(model, prompt, max_new_tokens=n, ctx_size=CTX, **kw)


def chat_ids(model, text):
    return model.tokenizer.encode(model.tokenizer.apply_chat_template(
        [{"role": "user", "content": text}]), add_bos=False)


def test_completions_and_chat_equal_offline_greedy(model, live):
    ref = offline(model, "Once upon a time", 12)
    out = live.client.completions.create(model="tiny", prompt="Once upon a time", max_tokens=12,
                                         temperature=0)
    assert out.choices[0].text == ref.text
    assert out.usage.completion_tokens == ref.generated_tokens
    assert out.usage.prompt_tokens == ref.prompt_tokens
    assert out.choices[0].finish_reason == ("stop" if ref.finish_reason == "eos" else "length")
    pieces = list(live.client.completions.create(model="tiny", prompt="Once upon a time",
                                                 max_tokens=12, temperature=0, stream=True))
    assert "".join(c.choices[0].text for c in pieces) == ref.text

    ids = chat_ids(model, "Hi there")
    ref = offline(model, ids, 10)
    msgs = [{"role": "user", "content": "Hi there"}]
    out = live.client.chat.completions.create(model="tiny", messages=msgs, max_tokens=10,
                                              temperature=0)
    assert out.choices[0].message.content == ref.text
    stream = live.client.chat.completions.create(model="tiny", messages=msgs, max_tokens=10,
                                                 temperature=0, stream=True,
                                                 stream_options={"include_usage": True})
    chunks = list(stream)
    assert "".join(c.choices[0].delta.content or "" for c in chunks if c.choices) == ref.text
    assert chunks[-1].usage.completion_tokens == ref.generated_tokens


def run_many(client, prompts, n, **kw):
    with concurrent.futures.ThreadPoolExecutor(len(prompts)) as pool:
        futs = [pool.submit(client.completions.create, model="tiny", prompt=p, max_tokens=n,
                            temperature=0, **kw) for p in prompts]
        return [f.result().choices[0].text for f in futs]


def prompts16():
    rng = np.random.default_rng(1)
    words = "the a cat dog sat on mat and ran far away over hill".split()
    # 1-12 words (< 64 bytes with the 8 new tokens): one padded shape, so the offline
    # references compile once
    return [" ".join(rng.choice(words, int(k))) for k in rng.integers(1, 13, 16)]


def test_sixteen_concurrent_requests_equal_offline(model, live):
    prompts = prompts16()
    got = run_many(live.client, prompts, 8)
    want = [offline(model, p, 8).text for p in prompts]
    assert got == want  # no lost, duplicated or mixed-up responses


def test_turbo4_cache_equals_offline(model):
    spec = CacheSpec("turbo4", "turbo4")
    srv = Live(model, spec, slots=16)
    try:
        prompts = prompts16()
        got = run_many(srv.client, prompts, 8)
        assert got == [offline(model, p, 8, cache=spec).text for p in prompts]
        # a prefix reused short of what the slot holds gives back the recent ring's 32 tokens
        # (prompt_cache.reusable_prefix): they are prefilled again, into the ring
        system = "You are a helpful assistant who answers briefly. " * 3
        a, b = system + "First question?", system + "Second one!"
        ids_a, ids_b = model.tokenizer.encode(a), model.tokenizer.encode(b)
        common = next(i for i, (x, y) in enumerate(zip(ids_a, ids_b, strict=False)) if x != y)
        srv.client.completions.create(model="tiny", prompt=a, max_tokens=4, temperature=0)
        out = srv.client.completions.create(model="tiny", prompt=b, max_tokens=6, temperature=0)
        assert out.usage.prompt_tokens_details.cached_tokens == common - spec.recent_tokens
        assert out.choices[0].text == offline(model, b, 6, cache=spec).text
    finally:
        srv.close()


def test_prefix_reuse_prefills_only_the_rest(model, live):
    system = "You are a helpful assistant who answers briefly. " * 3
    a, b = system + "First question?", system + "Second one!"
    ids_a, ids_b = model.tokenizer.encode(a), model.tokenizer.encode(b)
    common = next(i for i, (x, y) in enumerate(zip(ids_a, ids_b, strict=False)) if x != y)
    live.client.completions.create(model="tiny", prompt=a, max_tokens=4, temperature=0)
    before = live.metric("tqjax_prefill_tokens")
    hits = live.metric("tqjax_prefix_cache_hits")
    out = live.client.completions.create(model="tiny", prompt=b, max_tokens=6, temperature=0)
    assert live.metric("tqjax_prefill_tokens") - before == len(ids_b) - common
    assert live.metric("tqjax_prefix_cache_hits") == hits + 1
    assert out.usage.prompt_tokens_details.cached_tokens == common
    assert out.choices[0].text == offline(model, b, 6).text


def test_sampling_settings_never_recompile(model, live):
    live.client.completions.create(model="tiny", prompt="warm", max_tokens=3, temperature=0)
    compiled = gen.decode_step._cache_size()
    outs = {}
    for t, k, p, seed in [(0.7, 0, 1.0, 1), (1.3, 5, 0.9, 2), (0.5, 40, 0.5, 3), (0, 0, 1, 4)]:
        outs[seed] = live.client.completions.create(
            model="tiny", prompt="abc", max_tokens=6, temperature=t, top_p=p, seed=seed,
            extra_body={"top_k": k, "min_p": 0.05, "repeat_penalty": 1.1}).choices[0].text
    assert gen.decode_step._cache_size() == compiled
    # a seeded sampled request draws exactly what the offline run with that seed draws
    assert outs[2] == offline(model, "abc", 6, temperature=1.3, top_k=5, top_p=0.9, min_p=0.05,
                              repeat_penalty=1.1, seed=2).text


def test_logprobs_match_the_model(model, live):
    out = live.client.chat.completions.create(
        model="tiny", messages=[{"role": "user", "content": "xy"}], max_tokens=3,
        temperature=0, logprobs=True, top_logprobs=3)
    ids = chat_ids(model, "xy")
    gen_ids = offline(model, ids, 3).token_ids
    content = out.choices[0].logprobs.content
    assert len(content) == len(gen_ids)
    for i, entry in enumerate(content):
        logits = tqjax.logits(model, ids + gen_ids[:i])[-1].astype(np.float64)
        logp = logits - np.log(np.exp(logits - logits.max()).sum()) - logits.max()
        assert entry.logprob == pytest.approx(logp[gen_ids[i]], abs=1e-4)
        assert [t.logprob for t in entry.top_logprobs] == pytest.approx(
            np.sort(logp)[::-1][:3], abs=1e-4)
    for extra in ({}, {"logprobs": False}):  # top_logprobs alone: 400, as OpenAI and vLLM
        r = post(live.url + "/v1/chat/completions", json={
            "messages": [{"role": "user", "content": "xy"}], "max_tokens": 2,
            "top_logprobs": 3, **extra})
        assert status_and_error(r) == 400 and r.json()["error"]["param"] == "top_logprobs"


def test_stop_strings_cut_the_text(model, live):
    ref = offline(model, "Hello", 12).text
    stop = ref[3:5]
    out = live.client.completions.create(model="tiny", prompt="Hello", max_tokens=12,
                                         temperature=0, stop=[stop])
    assert out.choices[0].text == ref[: ref.find(stop)]
    assert out.choices[0].finish_reason == "stop"


def test_browsers_may_call_from_any_origin(live, monkeypatch):
    """CORS as llama-server and vLLM answer it: a preflight (which carries no API key) is
    allowed, and responses name the allowed origin (a page's fetch was refused: OPTIONS 405
    and no Access-Control headers)."""
    monkeypatch.setattr(live.server, "api_key", "k")
    origin = {"Origin": "http://localhost:5173"}
    pre = httpx.options(live.url + "/v1/chat/completions", timeout=60, headers={
        **origin, "Access-Control-Request-Method": "POST",
        "Access-Control-Request-Headers": "authorization, content-type"})
    assert pre.status_code == 200, pre.text
    assert pre.headers["access-control-allow-origin"] in ("*", origin["Origin"])
    assert "authorization" in pre.headers["access-control-allow-headers"].lower()
    r = get(live.url + "/v1/models", headers={**origin, "Authorization": "Bearer k"})
    assert r.status_code == 200 and r.headers["access-control-allow-origin"] == "*"
    r = get(live.url + "/v1/models", headers=origin)  # the key is still required
    assert r.status_code == 401 and r.headers["access-control-allow-origin"] == "*"


def test_other_endpoints(model, live):
    assert get(live.url + "/health").json() == {"status": "ok"}
    assert [m.id for m in live.client.models.list().data] == ["tiny"]
    toks = post(live.url + "/tokenize", json={"content": "hi there"}).json()["tokens"]
    assert toks == model.tokenizer.encode("hi there", add_bos=False)
    back = post(live.url + "/detokenize", json={"tokens": toks}).json()
    assert back == {"content": "hi there"}
    text = get(live.url + "/metrics").text
    for name in ("tqjax_requests_running", "tqjax_requests_waiting", "tqjax_kv_slots_in_use",
                 "tqjax_tokens_per_second", "tqjax_prefix_cache_hits_total"):
        assert name in text


def status_and_error(resp):
    body = resp.json()
    assert set(body["error"]) == {"message", "type", "param", "code"}
    return resp.status_code


def test_faults_give_their_status_and_the_server_keeps_serving(model, live, monkeypatch):
    url = live.url + "/v1/completions"
    ok = {"prompt": "ab", "max_tokens": 2, "temperature": 0}
    cases = [
        (post(url, content=b"{not json", headers={"content-type": "application/json"}),
         400),
        (post(url, json={**ok, "temperature": -1}), 400),
        (post(url, json={**ok, "top_p": 0}), 400),
        (post(url, json={**ok, "max_tokens": 0}), 400),
        (post(url, json={**ok, "max_tokens": CTX + 1}), 400),
        (post(url, json={**ok, "prompt": "x" * CTX}), 400),
        (post(url, json={**ok, "prompt": [100000]}), 400),
        (post(url, json={**ok, "n": 2}), 400),
        (post(url, json={"max_tokens": 2}), 400),
        (post(live.url + "/v1/chat/completions", json={"messages": []}), 400),
        (post(url, json={**ok, "prompt": "x" * 5000}), 413),
        (get(live.url + "/v1/nothing"), 404),
        (post(live.url + "/detokenize", json={"tokens": [-1]}), 400),
        # a lone surrogate (valid JSON, not valid Unicode)
        (post(url, content=b'{"prompt": "a\\ud800", "max_tokens": 2}'), 400),
        (post(live.url + "/tokenize", content=b'{"content": "\\udc00"}'), 400),
        (post(url, json={**ok, "logit_bias": {"5": -100}}), 400),  # refused, not ignored
        (post(url, json={**ok, "best_of": 3}), 400),
        (post(url, json={**ok, "suffix": "end"}), 400),
        (post(live.url + "/v1/chat/completions", json={
            "messages": [{"role": "user", "content": "hi"}], "tools": [{"type": "function"}]}),
         400),
        (post(live.url + "/v1/chat/completions", json={
            "messages": [{"role": "user", "content": "hi"}],
            "response_format": {"type": "json_object"}}), 400),
        # a chunked body (no Content-Length) is held to the same limit
        (post(url, content=iter([b'{"prompt": "', b"x" * 3000, b"x" * 3000, b'"}']),
              headers={"content-type": "application/json"}), 413),
    ]
    assert [status_and_error(r) for r, _ in cases] == [s for _, s in cases]
    chunked = post(url, content=iter([json.dumps(ok).encode()[:5], json.dumps(ok).encode()[5:]]))
    assert chunked.status_code == 200 and chunked.request.headers["transfer-encoding"] == "chunked"
    assert chunked.json()["choices"][0]["text"] == offline(model, "ab", 2).text
    # seeds of any size (the key takes a seed mod 2^32) and a top_k past int32 are accepted
    for extra in ({"seed": 2**64 + 7}, {"seed": -(2**63) - 1}, {"top_k": 2**31}):
        assert post(url, json={**ok, "temperature": 0.7, **extra}).status_code == 200, extra
    same = [post(url, json={**ok, "temperature": 1.0, "max_tokens": 6, "seed": s}).json()
            for s in (7, 2**64 + 7)]
    assert same[0]["choices"][0]["text"] == same[1]["choices"][0]["text"]
    with pytest.raises(openai.BadRequestError):
        live.client.completions.create(model="tiny", prompt="ab", max_tokens=2, temperature=3)

    monkeypatch.setattr(live.server, "api_key", "secret")
    assert status_and_error(post(url, json=ok)) == 401
    assert status_and_error(post(url, json=ok, headers={"authorization": "Basic secret"})) == 401
    for scheme in ("Bearer", "bearer"):  # the scheme is case-insensitive
        assert post(url, json=ok, headers={"authorization": f"{scheme} secret"}
                    ).status_code == 200
    monkeypatch.setattr(live.server, "api_key", None)

    real, marker = live.engine._prefill, model.tokenizer.encode("FAIL")

    def broken(row):  # an internal failure in one request only
        if live.engine.slots[row].req.prompt[:4] == marker:
            raise RuntimeError("injected")
        return real(row)

    monkeypatch.setattr(live.engine, "_prefill", broken)
    with concurrent.futures.ThreadPoolExecutor(2) as pool:
        bad = pool.submit(httpx.post, url, json={**ok, "prompt": "FAIL now"})
        good = pool.submit(live.client.completions.create, model="tiny", prompt="fine",
                           max_tokens=5, temperature=0)
        assert status_and_error(bad.result()) == 500
        assert good.result().choices[0].text == offline(model, "fine", 5).text
    out = live.client.completions.create(model="tiny", prompt="after", max_tokens=4,
                                         temperature=0)
    assert out.choices[0].text == offline(model, "after", 4).text


def hold_prefills(srv, model, monkeypatch, release):
    """Make the prefill of a prompt that starts with "HOLD" wait for `release` (an Event)."""
    real, holding = srv.engine._prefill, model.tokenizer.encode("HOLD")

    def held(row):
        if srv.engine.slots[row].req.prompt[:4] == holding:
            release.wait(60)
        return real(row)

    monkeypatch.setattr(srv.engine, "_prefill", held)


@pytest.mark.parametrize("max_queue", [0, 1])
def test_max_queue_counts_requests_beyond_the_free_slots(model, monkeypatch, max_queue):
    """--max-queue N: N requests may wait for a busy slot; a free slot always takes one (0 is
    not "refuse everything"). One slot, held by a request whose prefill waits on an event."""
    srv, release = Live(model, slots=1, max_queue=max_queue), threading.Event()
    try:
        url, ok = srv.url + "/v1/completions", {"prompt": "ab", "max_tokens": 2,
                                                "temperature": 0}
        assert post(url, json=ok).status_code == 200  # idle: the free slot takes it
        hold_prefills(srv, model, monkeypatch, release)
        with concurrent.futures.ThreadPoolExecutor(1 + max_queue) as pool:
            first = pool.submit(post, url, json={**ok, "prompt": "HOLD on"})
            while srv.engine.counts()["running"] == 0:
                time.sleep(0.01)
            waiting = [pool.submit(post, url, json=ok) for _ in range(max_queue)]
            while srv.engine.counts()["waiting"] < max_queue:
                time.sleep(0.01)
            assert status_and_error(post(url, json=ok)) == 429
            release.set()
            assert [f.result().status_code for f in [first, *waiting]] == [200] * (1 + max_queue)
    finally:
        release.set()
        srv.close()


def test_prompts_are_tokenized_off_the_event_loop(model, live, monkeypatch):
    """Tokenizing a long prompt (1 MB: ~1.5 s with Qwen's tokenizer) ran on the event loop,
    holding every other stream still; now it runs in a worker thread, with the GIL released."""
    calls = []
    encode = model.tokenizer.encode
    ab = encode("ab", add_bos=False)

    def spy(text, add_bos=None, release_gil=False):
        calls.append((threading.current_thread() is threading.main_thread()
                      or threading.current_thread() is live.thread, release_gil))
        return encode(text, add_bos, release_gil)

    monkeypatch.setattr(model.tokenizer, "encode", spy)
    r = post(live.url + "/v1/completions", json={"prompt": "ab", "max_tokens": 2})
    assert r.status_code == 200, r.text
    r = post(live.url + "/v1/chat/completions",
             json={"messages": [{"role": "user", "content": "ab"}], "max_tokens": 2})
    assert r.status_code == 200, r.text
    assert post(live.url + "/tokenize", json={"content": "ab"}).json()["tokens"] == ab
    assert calls == [(False, True)] * 3


def test_bodies_json_cannot_hold_are_400_and_null_fields_take_their_defaults(model, live):
    """Deep nesting (RecursionError) and a 5000-digit integer (ValueError) were 500s; JSON null
    for temperature, top_p, n, stream, ... was a 400 (OpenAI's client sends null for None)."""
    from tqjax.serve.server import ApiError, CompletionRequest, _validate

    url = live.url + "/v1/completions"
    raw = '{"prompt": ' + "[" * 2000 + "]" * 2000 + "}"  # (within this server's 4 KB bodies)
    r = post(url, content=raw.encode(), headers={"content-type": "application/json"})
    assert status_and_error(r) == 400 and "malformed JSON body" in r.json()["error"]["message"]
    for raw in ('{"prompt": ' + "[" * 100000 + "]" * 100000 + "}",
                '{"prompt": "ab", "max_tokens": ' + "9" * 5000 + "}"):
        with pytest.raises(ApiError, match="malformed JSON body") as e:
            _validate(CompletionRequest, raw.encode())
        assert e.value.status == 400
    r = post(live.url + "/slots/0?action=save", json={"filename": "a\u0000b"})
    assert status_and_error(r) == 400
    nulls = dict.fromkeys(("temperature", "top_p", "top_k", "n", "presence_penalty",
                           "frequency_penalty", "stream", "echo", "stream_options", "logprobs",
                           "seed", "stop"))
    r = post(url, json={"prompt": "ab", "max_tokens": 3, **nulls,
                        "temperature": 0, "stream_options": {"include_usage": None}})
    assert r.status_code == 200, r.text
    assert r.json()["choices"][0]["text"] == offline(model, "ab", 3).text
    r = post(live.url + "/v1/chat/completions", json={
        "messages": [{"role": "user", "content": "ab"}], "max_tokens": 2, "temperature": None,
        "logprobs": None, "top_logprobs": None})
    assert r.status_code == 200, r.text
    # NaN is not a temperature (it was reported as "less than or equal to 2")
    r = post(url, content=b'{"prompt": "ab", "max_tokens": 2, "temperature": NaN}',
             headers={"content-type": "application/json"})
    assert status_and_error(r) == 400 and "finite" in r.json()["error"]["message"], r.text
    # an over-long chat names its field: messages (chat has no prompt)
    r = post(live.url + "/v1/chat/completions", json={
        "messages": [{"role": "user", "content": "x" * (CTX + 10)}], "max_tokens": 2})
    assert status_and_error(r) == 400 and r.json()["error"]["param"] == "messages", r.text
    assert httpx.head(live.url + "/health", timeout=60).status_code == 200
    # seed -1 draws a seed, as llama-server reads it (it was one fixed stream)
    texts = {post(url, json={"prompt": "ab", "max_tokens": 8, "temperature": 1.5,
                             "seed": -1}).json()["choices"][0]["text"] for _ in range(4)}
    assert len(texts) > 1, texts


@pytest.mark.parametrize("field,value", [
    ("max_tokens", "5"), ("max_tokens", True), ("max_tokens", 5.0), ("stream", "yes"),
    ("stream", 1), ("logprobs", True), ("seed", "7"), ("top_k", "3"), ("temperature", "0.5"),
    ("prompt", [1, True]), ("stream_options", {"include_usage": "yes"})])
def test_a_value_of_the_wrong_type_is_400_not_converted(field, value):
    """"5" was read as max_tokens 5, true as 1 and "yes" as stream on (pydantic's lax mode);
    OpenAI's API refuses them. An integer for a number field stays fine."""
    from tqjax.serve.server import ApiError, ChatRequest, CompletionRequest, _validate

    body = {"prompt": "ab", "max_tokens": 3, field: value}
    with pytest.raises(ApiError) as e:
        _validate(CompletionRequest, json.dumps(body).encode())
    assert e.value.status == 400 and field in e.value.message, e.value.message
    ok = _validate(CompletionRequest, b'{"prompt": [1, 2], "temperature": 0, "top_p": 1}')
    assert (ok.temperature, ok.top_p, ok.prompt) == (0.0, 1.0, [1, 2])
    chat = {"messages": [{"role": "user", "content": [{"type": "text", "text": "hi"}]}],
            "logprobs": 1}
    with pytest.raises(ApiError, match="logprobs"):
        _validate(ChatRequest, json.dumps(chat).encode())
    chat["logprobs"] = True
    assert _validate(ChatRequest, json.dumps(chat).encode()).messages[0].content[0].text == "hi"


def test_logprobs_bytes_and_offsets_follow_the_text_through_split_characters(model, live):
    """A token that holds part of a character: chat's `bytes` are its own bytes (they were the
    bytes of U+FFFD, decoding it alone), and completions' text_offset counts characters of the
    returned text (it counted one per token). Prompt tokens of a stop-ended request that came
    from the slot's cache are counted (they read 0)."""
    prompt = "\u00e9\u00e9\U0001f600 caf\u00e9 \u6771\u4eac"  # (byte tokens: 2-4 per char)
    out = post(live.url + "/v1/chat/completions", json={
        "messages": [{"role": "user", "content": prompt}], "max_tokens": 12, "temperature": 0,
        "logprobs": True}).json()
    content = out["choices"][0]["logprobs"]["content"]
    joined = b"".join(bytes(e["bytes"]) for e in content)
    assert joined.decode("utf-8", "replace").startswith(out["choices"][0]["message"]["content"])
    ids = model.tokenizer.encode(prompt)
    full = post(live.url + "/v1/completions", json={
        "prompt": ids, "max_tokens": 12, "temperature": 0, "logprobs": 0}).json()["choices"][0]
    text, lp = full["text"], full["logprobs"]
    offsets = lp["text_offset"]
    assert offsets == sorted(offsets) and all(0 <= o <= len(text) for o in offsets)
    from tqjax.serve.engine import Token

    # one token per byte: "é" (2 bytes), "😀" (4), "a", an invalid byte, "é"
    pieces = [b"\xc3", b"\xa9", b"\xf0", b"\x9f", b"\x98", b"\x80", b"a", b"\xff", b"\xc3"]
    tokens = [Token(_byte_token(model, p), 0.0, []) for p in pieces]
    from tqjax.serve.server import _TextOffsets

    got = live.server._completion_logprobs(tokens, 0, _TextOffsets())["text_offset"]
    assert got == [0, 0, 1, 1, 1, 1, 2, 3, 4]
    stop = text[len(text) // 2:][:2] or text
    again = post(live.url + "/v1/completions", json={
        "prompt": ids, "max_tokens": 12, "temperature": 0, "stop": [stop]}).json()
    assert again["usage"]["prompt_tokens_details"]["cached_tokens"] > 0, again


def _byte_token(model, b: bytes) -> int:
    """The byte tokenizer's id for one byte."""
    return next(i for i in range(model.config.vocab_size) if model.tokenizer.token_bytes(i) == b)


def test_invalid_chat_messages_are_400_naming_the_field(live):
    url = live.url + "/v1/chat/completions"
    cases = [
        ([{"role": "user"}], "messages[0].content"),
        ([{"role": "system", "content": None}], "messages[0].content"),
        ([{"role": "bogus", "content": "hi"}], "messages[0].role"),
        ([{"role": "user", "content": "hi"}, {"content": "hi"}], "messages[1].role"),
        ([], "messages"),
    ]
    for messages, field in cases:
        resp = post(url, json={"messages": messages, "max_tokens": 3})
        assert status_and_error(resp) == 400, messages
        err = resp.json()["error"]
        assert err["message"].startswith(field + ":") and err["param"] == field, err
    # an assistant's null content reads as empty
    msgs = [{"role": "user", "content": "hi"}, {"role": "assistant", "content": None},
            {"role": "user", "content": "again"}]
    assert post(url, json={"messages": msgs, "max_tokens": 3}).status_code == 200
    # "developer" (OpenAI's newer name) is the system role: the same prompt, the same reply
    replies = [post(url, json={"messages": [{"role": role, "content": "Be brief."},
                                            {"role": "user", "content": "hi"}],
                               "max_tokens": 4, "temperature": 0}).json()
               for role in ("system", "developer")]
    assert replies[0]["usage"]["prompt_tokens"] == replies[1]["usage"]["prompt_tokens"]
    assert (replies[0]["choices"][0]["message"]["content"]
            == replies[1]["choices"][0]["message"]["content"])


@pytest.mark.parametrize("stream", [True, False])
def test_disconnect_frees_the_slot(live, monkeypatch, stream):
    """A client that goes away cancels its request, streamed or not (a non-streamed one was
    checked only when no token came for 1 s, so on a model that kept producing tokens it ran
    to its end)."""
    real = live.engine._decode

    def slow():  # 20 ms per step: the request would run for ~5 s
        time.sleep(0.02)
        real()

    monkeypatch.setattr(live.engine, "_decode", slow)
    before = live.metric("tqjax_generated_tokens")
    body = {"prompt": "go", "max_tokens": CTX - 8, "temperature": 0, "stream": stream}
    if stream:
        with httpx.stream("POST", live.url + "/v1/completions", timeout=300, json=body) as r:
            lines = r.iter_lines()  # kept: dropping the iterator closes the response
            next(lines)
            assert live.metric("tqjax_kv_slots_in_use") == 1
    else:
        with pytest.raises(httpx.ReadTimeout):
            httpx.post(live.url + "/v1/completions", timeout=1.0, json=body)
    t0 = time.time()
    while live.metric("tqjax_kv_slots_in_use") > 0 and time.time() < t0 + 30:
        time.sleep(0.02)
    assert live.metric("tqjax_kv_slots_in_use") == 0
    assert live.metric("tqjax_generated_tokens") - before < (CTX - 8) / 2  # stopped early


def test_a_closed_client_is_dropped_quietly_and_never_admitted_from_the_queue(model,
                                                                               monkeypatch):
    """One slot, held by a request whose prefill waits on an event: a streamed and a
    non-streamed request queued behind it whose clients go away are dropped without ever
    taking the slot (they were admitted, prefilled and run for a few tokens), and a
    non-streamed request whose client goes away while it runs leaves no traceback in the log
    (it was an AttributeError on its missing end)."""
    import logging

    logged = []

    class Keep(logging.Handler):
        def emit(self, record):
            logged.append(record)

    handler = Keep(logging.ERROR)
    srv, release = Live(model, slots=1), threading.Event()
    logging.getLogger("uvicorn.error").addHandler(handler)  # (after uvicorn's dictConfig)
    try:
        url = srv.url + "/v1/completions"
        hold_prefills(srv, model, monkeypatch, release)
        with concurrent.futures.ThreadPoolExecutor(1) as pool:
            first = pool.submit(post, url, json={"prompt": "HOLD on", "max_tokens": 2,
                                                 "temperature": 0})
            while srv.engine.counts()["running"] == 0:
                time.sleep(0.01)
            for stream in (True, False):
                with pytest.raises(httpx.ReadTimeout):
                    httpx.post(url, timeout=1.5, json={"prompt": "gone", "max_tokens": 4,
                                                       "stream": stream})
            assert srv.engine.counts()["waiting"] == 2
            time.sleep(1.5)  # the server polls a waiting client every second
            release.set()
            assert first.result().status_code == 200
        assert srv.metric("tqjax_requests") == 1  # only the held request took the slot
        real_decode = srv.engine._decode

        def slow():
            time.sleep(0.02)
            real_decode()

        monkeypatch.setattr(srv.engine, "_decode", slow)
        try:  # runs, then its client goes
            r = httpx.post(url, timeout=1.0, json={"prompt": "go", "max_tokens": CTX - 8,
                                                   "temperature": 0})
            pytest.fail(f"answered {r.status_code} within 1 s: {r.text[:200]}")
        except httpx.ReadTimeout:
            pass
        t0 = time.time()
        while srv.metric("tqjax_kv_slots_in_use") > 0 and time.time() < t0 + 30:
            time.sleep(0.02)
        time.sleep(0.2)
        assert srv.metric("tqjax_requests") == 2
        assert not logged, [r.getMessage() for r in logged]
    finally:
        release.set()
        srv.close()
        logging.getLogger("uvicorn.error").removeHandler(handler)


def stream_in_thread(url, prompt, n):
    """Stream a greedy completion on a thread: returns (thread, record) where record gets
    "chunks" (text pieces as they come), "finish" (the last finish_reason) and "error" (the
    exception that ended the stream, if any)."""
    rec = {"chunks": [], "finish": None, "error": None}

    def run():
        try:
            with httpx.stream("POST", url + "/v1/completions", timeout=60,
                              json={"prompt": prompt, "max_tokens": n, "temperature": 0,
                                    "stream": True}) as r:
                for line in r.iter_lines():
                    if line.startswith("data: {"):
                        choice = json.loads(line[6:])["choices"][0]
                        rec["chunks"].append(choice["text"])
                        rec["finish"] = choice["finish_reason"] or rec["finish"]
        except Exception as e:  # noqa: BLE001 - recorded for the test
            rec["error"] = e

    thread = threading.Thread(target=run, daemon=True)
    thread.start()
    return thread, rec


@pytest.mark.parametrize("graceful_s", [None, 0.5])
def test_shutdown_finishes_or_cancels_a_running_stream(model, graceful_s):
    """uvicorn's shutdown (should_exit, as on SIGTERM) during a streamed request: by default
    the stream runs to its end (the complete greedy text, finish_reason "length") before the
    engine drains; with a graceful-shutdown timeout shorter than the stream, the request is
    cancelled and the connection closed (an incomplete body, never a hang). Either way the
    server thread, the engine thread and the request's slot end within a few seconds."""
    n, prompt = 40, "Once upon a time"
    want = offline(model, prompt, n)
    assert want.finish_reason == "length"  # no EOS: the stream lasts all n steps
    srv = Live(model, graceful_s=graceful_s)  # the module server's shapes: compiled already
    real = srv.engine._decode

    def slow():  # 50 ms per step: the stream runs for ~2 s
        time.sleep(0.05)
        real()

    srv.engine._decode = slow
    thread, rec = stream_in_thread(srv.url, prompt, n)
    t0 = time.time()
    while not rec["chunks"] and time.time() < t0 + 20:
        time.sleep(0.01)
    assert rec["chunks"] and rec["finish"] is None  # streaming, not done
    srv.uv.should_exit = True
    t0 = time.time()
    thread.join(20)
    srv.thread.join(20)
    took = time.time() - t0
    assert not thread.is_alive() and not srv.thread.is_alive() and took < 15
    assert not srv.engine.thread.is_alive() and not srv.engine.accepting
    assert all(s.req is None for s in srv.engine.slots)
    if graceful_s is None:  # finished
        assert rec["error"] is None and rec["finish"] == "length"
        assert "".join(rec["chunks"]) == want.text
    else:  # cancelled: the client sees the body end early (an incomplete chunked body)
        assert isinstance(rec["error"], httpx.RemoteProtocolError), rec["error"]
        text = "".join(rec["chunks"])
        assert rec["finish"] is None and want.text.startswith(text) and text != want.text
    with pytest.raises(httpx.ConnectError):  # no longer listening
        get(srv.url + "/health", timeout=2)


def test_engine_shutdown_cancels_what_outlasts_the_grace(model):
    """Engine.shutdown(grace) stops accepting at once, lets a running request go on for the
    grace period, then cancels it (Finished "cancelled" after some tokens) and stops its
    thread; a request submitted after is refused."""
    from tqjax.decode.sampling import SamplingParams
    from tqjax.serve.engine import Engine, Finished, Request, Token

    engine = Engine(model, slots=4, ctx_size=CTX)  # the module server's shapes
    real = engine._decode

    def slow():
        time.sleep(0.05)
        real()

    engine._decode = slow
    events, got_one = [], threading.Event()

    def emit(ev):
        events.append(ev)
        got_one.set()

    engine.submit(Request(model.tokenizer.encode("Once upon a time"), 100, SamplingParams(),
                          emit))
    assert got_one.wait(20)
    t0 = time.time()
    engine.shutdown(grace_s=0.5)
    assert 0.4 < time.time() - t0 < 5 and not engine.thread.is_alive()
    tokens = [e for e in events if isinstance(e, Token)]
    assert isinstance(events[-1], Finished) and events[-1].reason == "cancelled"
    assert 1 < len(tokens) < 100 and events[-1].completion_tokens == len(tokens)
    with pytest.raises(tqjax.TqjaxError, match="shutting down"):
        engine.submit(Request([5, 6], 2, SamplingParams(), emit))


def test_slot_save_restore_erase(model, live):
    prompt = "Saved prefix for the slot test. " * 2
    ids = model.tokenizer.encode(prompt)
    ok = live.client.completions.create(model="tiny", prompt=prompt, max_tokens=3, temperature=0)
    row = max(range(live.engine.n), key=lambda i: len(
        [1 for a, b in zip(live.engine.slots[i].tokens, ids, strict=False) if a == b]))
    slot = f"{live.url}/slots/{row}"
    saved = post(slot, params={"action": "save"}, json={"filename": "a.bin"}).json()
    assert saved["n_saved"] >= len(ids)
    assert status_and_error(post(slot, params={"action": "save"},
                                       json={"filename": "../x.bin"})) == 400
    assert status_and_error(post(slot, params={"action": "restore"},
                                       json={"filename": "missing.bin"})) == 400
    assert status_and_error(post(slot, params={"action": "fly"})) == 400
    for i in range(live.engine.n):  # forget every cached prefix
        post(f"{live.url}/slots/{i}", params={"action": "erase"}).raise_for_status()
    assert post(slot, params={"action": "restore"},
                      json={"filename": "a.bin"}).json()["n_restored"] == saved["n_saved"]
    again = live.client.completions.create(model="tiny", prompt=prompt, max_tokens=3,
                                           temperature=0)
    assert again.usage.prompt_tokens_details.cached_tokens == len(ids) - 1
    assert again.choices[0].text == ok.choices[0].text


@pytest.mark.slow
def test_smollm2_system_prompt_reuse_and_equal_greedy_output(real_model):
    from tqjax.data import calibration_part

    model = real_model("smollm2-135m-instruct")
    system = " ".join(calibration_part("prose").split()[:700])
    msgs = lambda q: [{"role": "system", "content": system}, {"role": "user", "content": q}]
    srv = Live(model, slots=2, ctx=1536, max_body=1 << 20)
    try:
        srv.client.chat.completions.create(model="m", messages=msgs("Summarise."),
                                           max_tokens=4, temperature=0)
        before = srv.metric("tqjax_prefill_tokens")
        second = srv.client.chat.completions.create(model="m", messages=msgs("Name a colour."),
                                                    max_tokens=8, temperature=0)
        ids = model.tokenizer.encode(model.tokenizer.apply_chat_template(msgs("Name a colour.")),
                                     add_bos=False)
        cached = second.usage.prompt_tokens_details.cached_tokens
        assert len(ids) > 900 and cached > 900
        assert srv.metric("tqjax_prefill_tokens") - before == len(ids) - cached
        assert second.choices[0].message.content == tqjax.generate(
            model, ids, max_new_tokens=8, ctx_size=1536).text
    finally:
        srv.close()


def test_serve_command_checks_grace_and_mesh_before_loading():
    """tqjax-serve refuses a negative --shutdown-grace, a --max-body-bytes below 1, an unknown
    host and a port in use, and builds the --tp/--dp mesh (here: too few devices, a one-line
    error), all before loading the model."""
    import jax

    from tqjax.commands import serve

    with pytest.raises(tqjax.TqjaxError, match="--shutdown-grace"):
        serve.run(["-m", "nowhere", "--shutdown-grace", "-1"])
    with pytest.raises(tqjax.TqjaxError, match="--max-body-bytes must be >= 1"):
        serve.run(["-m", "nowhere", "--max-body-bytes", "0"])
    with pytest.raises(tqjax.TqjaxError, match="--host 999.1.1.1"):
        serve.run(["-m", "nowhere", "--host", "999.1.1.1"])
    with socket.socket() as taken:  # a port in use: refused before the model loads
        taken.bind(("127.0.0.1", 0))
        taken.listen()
        port = taken.getsockname()[1]
        with pytest.raises(tqjax.TqjaxError, match=f"cannot listen on 127.0.0.1:{port}"):
            serve.run(["-m", "nowhere", "--port", str(port)])
    if jax.device_count() < 4:
        with pytest.raises(tqjax.TqjaxError, match="needs 4 devices"):
            serve.run(["-m", "nowhere", "--tp", "2", "--dp", "2"])


def test_serve_without_its_extra_is_one_line(monkeypatch):
    """A base install (no `serve` extra) has the tqjax-serve command but no uvicorn: a
    one-line error naming the extra, not a traceback (found by QA of an installed wheel)."""
    import sys

    from tqjax.commands import serve

    monkeypatch.setitem(sys.modules, "uvicorn", None)  # (import uvicorn: ModuleNotFoundError)
    with pytest.raises(tqjax.TqjaxError, match=r"needs the serve extra \(no module 'uvicorn'\): "
                                               r"pip install 'tqjax\[serve\]'"):
        serve.run(["-m", "nowhere"])


def test_a_field_of_several_types_is_named_with_all_of_them():
    """A body field that takes several types gets one message naming them (pydantic's first
    error named the string branch only: "prompt.str: Input should be a valid string" for
    [1, "a"]), or, where one type fits but its contents do not, the contents' own error."""
    from tqjax.serve.server import ApiError, ChatRequest, CompletionRequest, _validate

    def message(model, body):
        with pytest.raises(ApiError) as e:
            _validate(model, json.dumps(body).encode())
        assert e.value.status == 400
        return e.value.body()["error"]["message"], e.value.body()["error"]["param"]

    for prompt in (5, [1, "a"], [[1]]):
        assert message(CompletionRequest, {"prompt": prompt}) == (
            "prompt: expected a string, a list of integers (token ids) or a list of strings",
            "prompt")
    assert message(CompletionRequest, {"prompt": "x", "stop": 5}) == (
        "stop: expected a string or a list of strings", "stop")
    assert message(CompletionRequest, {"prompt": "x", "stop": ["a", 5]}) == (
        "stop[1]: Input should be a valid string", "stop[1]")
    chat = {"role": "user", "content": 5}
    assert message(ChatRequest, {"messages": [chat]})[0].startswith(
        "messages[0].content: expected a string or a list of content parts")
    assert message(ChatRequest, {"messages": [{**chat, "content": [{"type": "text"}]}]}) == (
        "messages[0].content[0].text: Field required", "messages[0].content[0].text")
    assert message(ChatRequest, {"messages": [{**chat, "role": 5}]})[0].startswith(
        "messages[0].role: Input should be")
    assert message(CompletionRequest, {"prompt": "x", "max_tokens": "a"})[0].startswith(
        "max_tokens: Input should be a valid integer")
