"""Generation: chunked prefill, ragged batches, sampling rules, streaming and stop strings."""

import jax
import jax.numpy as jnp
import numpy as np
import pytest

import tqjax
from tqjax.decode import generate as gen
from tqjax.decode.sampling import SamplingParams, apply_repeat_penalty, sample
from tqjax.errors import TqjaxError

from .conftest import GOLDEN
from .test_cli import make_byte_tokenizer


@pytest.fixture(scope="module")
def model():
    return tqjax.load(GOLDEN / "tiny" / "llama")


@pytest.fixture(scope="module")
def text_model(tmp_path_factory):
    import shutil

    d = tmp_path_factory.mktemp("tiny") / "llama"
    shutil.copytree(GOLDEN / "tiny" / "llama", d)
    make_byte_tokenizer(d)
    return tqjax.load(d)


def greedy(model, prompts, n=6):
    steps = list(gen.generate_tokens(model.params, model.config, prompts, max_new_tokens=n,
                                     sampling=SamplingParams(), eos_ids=(), ctx_size=256))
    return [s.ids for s in steps[-1][0]]


def test_ragged_batch_and_chunked_prefill_match_full_logits(model, monkeypatch):
    rng = np.random.default_rng(0)
    prompts = [rng.integers(0, 256, 150).tolist(), rng.integers(0, 256, 70).tolist()]
    one_chunk = greedy(model, prompts)
    monkeypatch.setattr(gen, "PREFILL_CHUNK", 64)
    assert greedy(model, prompts) == one_chunk
    for prompt, ids in zip(prompts, one_chunk, strict=True):
        seq = list(prompt)
        for t in ids:  # every greedy token is the argmax of an independent full forward
            assert tqjax.logits(model, seq)[-1].argmax() == t
            seq.append(t)


def test_sampling_rules():
    logits = jnp.asarray([[2.0, 1.0, 0.5, -1.0]])
    seen = jnp.zeros((1, 4), bool)
    key = jax.random.PRNGKey(0)
    assert int(sample(logits, seen, key, SamplingParams())[0]) == 0
    assert int(sample(logits, seen, key, SamplingParams(temperature=5.0, top_k=1))[0]) == 0
    assert int(sample(logits, seen, key, SamplingParams(temperature=5.0, top_p=0.01))[0]) == 0
    assert int(sample(logits, seen, key, SamplingParams(temperature=1.0, min_p=0.9))[0]) == 0
    draws = [int(sample(logits, seen, jax.random.PRNGKey(i), SamplingParams(temperature=1.0,
                                                                           top_k=2))[0])
             for i in range(200)]
    assert set(draws) == {0, 1}
    assert 0.6 < draws.count(0) / 200 < 0.85  # softmax([2, 1]) = 0.73
    pen = apply_repeat_penalty(logits, jnp.asarray([[True, False, False, True]]), 2.0)
    np.testing.assert_allclose(pen, [[1.0, 1.0, 0.5, -2.0]])
    seen0 = jnp.asarray([[True, False, False, False]])
    assert int(sample(logits, seen0, key, SamplingParams(repeat_penalty=4.0))[0]) == 1


@pytest.mark.parametrize("kwargs", [dict(temperature=-0.1), dict(top_p=0.0), dict(top_p=1.01),
                                    dict(min_p=1.0), dict(top_k=-1), dict(repeat_penalty=0.0),
                                    dict(temperature=float("nan")), dict(temperature=float("inf")),
                                    dict(repeat_penalty=float("inf")),
                                    # of the wrong type: refused, not truncated (int(2.7) = 2)
                                    dict(top_k=2.7), dict(seed=1.5), dict(top_k=True),
                                    dict(seed="3"), dict(temperature="0.5"), dict(top_p=None)])
def test_invalid_sampling_values(kwargs):
    with pytest.raises(TqjaxError):
        SamplingParams(**kwargs)


def test_seeded_sampling_is_reproducible(text_model):
    a = tqjax.generate(text_model, "abc", max_new_tokens=8, temperature=1.0, seed=3)
    b = tqjax.generate(text_model, "abc", max_new_tokens=8, temperature=1.0, seed=3)
    c = tqjax.generate(text_model, "abc", max_new_tokens=8, temperature=1.0, seed=4)
    assert a.token_ids == b.token_ids and a.token_ids != c.token_ids


def test_streaming_pieces_add_up_and_stop_strings_cut(text_model):
    pieces = []
    res = tqjax.generate(text_model, "hello", max_new_tokens=12, on_text=pieces.append)
    assert "".join(pieces) == res.text and len(res.text) >= 5
    stop = res.text[3:5]
    cut = tqjax.generate(text_model, "hello", max_new_tokens=12, stop=[stop])
    assert cut.finish_reason == "stop" and cut.text == res.text[: res.text.find(stop)]


def test_batch_generate_returns_one_result_per_prompt(text_model):
    with pytest.raises(TqjaxError, match="on_text"):  # it was ignored: no text came to it
        tqjax.generate(text_model, ["a", "b"], max_new_tokens=4, on_text=print)
    with pytest.raises(TqjaxError, match="on_text must be a function"):  # (a TypeError)
        tqjax.generate(text_model, "a", max_new_tokens=4, on_text=5)
    np_settings = tqjax.generate(text_model, "a", max_new_tokens=4, temperature=np.float32(0.7),
                                 top_k=np.int64(5), seed=np.int32(2))  # numpy numbers accepted
    assert np_settings.token_ids == tqjax.generate(text_model, "a", max_new_tokens=4,
                                                   temperature=0.7, top_k=5, seed=2).token_ids
    out = tqjax.generate(text_model, ["a", "longer prompt"], max_new_tokens=4)
    single = tqjax.generate(text_model, "longer prompt", max_new_tokens=4)
    assert len(out) == 2 and out[1].token_ids == single.token_ids


def test_context_limits(text_model):
    with pytest.raises(TqjaxError, match="longer than the context"):
        tqjax.generate(text_model, "x" * 30, ctx_size=16)
    n = len(text_model.tokenizer.encode("x" * 15))
    with pytest.raises(TqjaxError, match=f"prompt is {n} tokens, the whole context size {n}: "
                                         "no room to generate"):
        tqjax.generate(text_model, "x" * 15, ctx_size=n)
    assert tqjax.generate(text_model, "x" * 15, ctx_size=n + 1).generated_tokens == 1
    limit = text_model.config.max_position
    for size in (1, limit + 1):  # refused, not clamped to the model's context
        with pytest.raises(TqjaxError, match=rf"outside \[2, {limit}\]"):
            tqjax.generate(text_model, "x", ctx_size=size, max_new_tokens=1)
    res = tqjax.generate(text_model, "x" * 10, ctx_size=16, max_new_tokens=50)
    assert res.finish_reason == "length" and res.prompt_tokens + res.generated_tokens <= 16


def test_sweep_paired_statistics_match_a_direct_computation(model):
    """sweep's KL, top-1, ΔNLL and its standard error against logits computed here directly."""
    import dataclasses

    from tqjax.eval import sweep
    from tqjax.models.quantize import WeightSpec, quantize_params

    quantized = dataclasses.replace(
        model, params=quantize_params(model.params, model.config, WeightSpec("int4")))
    rng = np.random.default_rng(0)
    ids = rng.integers(0, model.config.vocab_size, 2 * 16 + 5)
    res = sweep(ids, 16, {"ref": (model, tqjax.CacheSpec()), "q4": (quantized, tqjax.CacheSpec())},
                reference="ref")

    def logp(m):
        out = [tqjax.logits(m, ids[w * 16:(w + 1) * 16].tolist())[:-1] for w in (0, 1)]
        return np.asarray(jax.nn.log_softmax(jnp.asarray(np.concatenate(out)), axis=-1))

    ref, q = logp(model), logp(quantized)
    targets = np.concatenate([ids[w * 16 + 1:(w + 1) * 16] for w in (0, 1)])
    d = -q[np.arange(30), targets] + ref[np.arange(30), targets]
    r = res["q4"]
    assert r.tokens == 30 and res["ref"].dnll_se == 0.0 and res["ref"].nll_delta == 0.0
    np.testing.assert_allclose(r.nll_delta, d.mean(), atol=2e-5)
    np.testing.assert_allclose(r.dnll_se, d.std(ddof=1) / np.sqrt(30), rtol=1e-3, atol=1e-6)
    np.testing.assert_allclose(r.kl, np.mean(np.sum(np.exp(ref) * (ref - q), -1)), atol=2e-5)
    assert r.dnll_se > 0 and r.top1 == np.mean(ref.argmax(-1) == q.argmax(-1))
    np.testing.assert_allclose(r.ppl / res["ref"].ppl, np.exp(d.mean()), rtol=1e-4)


def test_first_order_nll_is_the_slope_of_the_nll_along_the_weight_errors(model):
    """weight_errors are the quantized model's real errors (w + Δ reproduces its NLL), and
    first_order_nll matches a central finite difference of the NLL along them."""
    import dataclasses

    from tqjax.eval import sweep
    from tqjax.models.quantize import WeightSpec, get_path, linear_paths, quantize_params, set_paths
    from tqjax.research.first_order import first_order_nll, weight_errors

    spec = WeightSpec("int4", quantize_embeddings=True)
    quantized = quantize_params(model.params, model.config, spec)
    errors = weight_errors(model.params, quantized)
    assert set(errors) == {*linear_paths(model.params), "embed"}
    ids = np.random.default_rng(1).integers(0, model.config.vocab_size, 2 * 16)

    def moved(t):
        params = set_paths(model.params, {p: get_path(model.params, p) + t * d
                                          for p, d in errors.items() if p != "embed"})
        return dataclasses.replace(model, params=params.replace(
            embed=model.params.embed + t * errors["embed"]))

    def nll(t):
        return sweep(ids, 16, {"m": (moved(t), tqjax.CacheSpec())})["m"].nll

    q_nll = sweep(ids, 16, {"q": (dataclasses.replace(model, params=quantized),
                                  tqjax.CacheSpec())})["q"].nll
    np.testing.assert_allclose(nll(1.0), q_nll, atol=2e-5)
    eps = 0.05
    slope = (nll(eps) - nll(-eps)) / (2 * eps)
    got = first_order_nll(model, quantized, ids, 16)
    assert abs(slope) > 1e-3  # a slope the check can see
    np.testing.assert_allclose(got, slope, rtol=0.02, atol=2e-4)


def test_token_ids_outside_the_vocabulary_are_refused(text_model):
    vocab = text_model.config.vocab_size
    for bad in ([1, vocab], [-1, 2]):
        with pytest.raises(TqjaxError, match=r"out of range \[0, 256\)"):
            tqjax.generate(text_model, bad, max_new_tokens=2)


def test_no_write_past_the_cache_slots(model):
    """A prefill whose padded chunks would run past the slots is refused (XLA would clamp the
    write onto the last live slots); a starting cache too small for the prompt is grown."""
    cache = gen.new_cache(model.params, model.config, tqjax.CacheSpec(), 1, 64)
    tokens = np.ones((1, 64), np.int32)
    with pytest.raises(TqjaxError, match="needs 74 cache slots, the cache has 64"):
        gen.prefill(model.params, model.config, tokens, np.asarray([64]), cache,
                    start=np.asarray([10]))
    prompt = list(range(3, 60))
    _, full = gen.prefill(model.params, model.config, np.asarray([prompt + [0] * 7], np.int32),
                          np.asarray([57]), cache)
    steps = gen.generate_tokens(model.params, model.config, [prompt + [5, 6]], max_new_tokens=3,
                                sampling=SamplingParams(), eos_ids=(), ctx_size=256,
                                cache=full, cached=[57])
    seen = []
    while True:
        try:
            seen.append(next(steps))
        except StopIteration as end:
            state = end.value
            break
    last = seen[-1]
    assert last[0][0].cached == 57 and last[0][0].ids == greedy(model, [prompt + [5, 6]], 3)[0]
    # grown on the padding grid (slot 57 + a 64-token chunk = 121 -> 128 slots): every other
    # count would be one more decode-step compilation
    assert state.cache.slots == 128


@pytest.mark.parametrize("kwargs,needle", [
    (dict(stop=[""]), "stop strings"),  # (it would stop at once)
    (dict(stop=["ok", 3]), "stop strings"),
    (dict(system="be brief"), "system message"),  # without chat: it would be ignored
    (dict(n_keep=4), "context_shift"),  # without context_shift: it would be ignored
    # wrong types were TypeErrors, or taken (found by QA)
    (dict(context_shift=True, n_keep="a"), "n_keep must be an integer >= -1"),
    (dict(context_shift=True, n_keep=1.5), "n_keep must be an integer >= -1"),
    (dict(context_shift=True, n_keep=-2), "n_keep must be an integer >= -1"),
    (dict(chat=True, system=5), "system must be a string"),
    (dict(chat="yes"), "chat must be True or False"),
    (dict(prompt_cache=5), "prompt_cache must be a file path"),
])
def test_options_that_would_do_nothing_or_stop_at_once_are_refused(text_model, kwargs, needle):
    with pytest.raises(TqjaxError, match=needle):
        tqjax.generate(text_model, "abc", max_new_tokens=2, **kwargs)


def test_an_empty_system_message_is_kept(tmp_path):
    """system="" is an explicit (empty) system message, as HF's template renders it; only
    None means none (the template's own default, if it has one)."""
    import shutil

    from tqjax.api import encode_prompt

    d = tmp_path / "llama"
    shutil.copytree(GOLDEN / "tiny" / "llama", d)
    make_byte_tokenizer(d)
    (d / "tokenizer_config.json").write_text(
        '{"chat_template": "{% for m in messages %}<{{ m.role }}>{{ m.content }}{% endfor %}"}')
    model = tqjax.load(d)
    tok = model.tokenizer
    assert encode_prompt(model, "hi", chat=True, system="") == tok.encode(
        "<system><user>hi", add_bos=False)
    assert encode_prompt(model, "hi", chat=True) == tok.encode("<user>hi", add_bos=False)
    with pytest.raises(TqjaxError, match="system message goes with the chat template"):
        encode_prompt(model, "hi", system="")


def test_a_conversation_goes_through_the_chat_template_and_a_session_reuses_it(tmp_path):
    """A list of messages is rendered by the model's template (a multi-turn chat: Session
    had only a one-message chat=True); the second turn prefills only what is new and gives
    what a fresh run gives."""
    import shutil

    from tqjax.api import encode_prompt

    d = tmp_path / "llama"
    shutil.copytree(GOLDEN / "tiny" / "llama", d)
    make_byte_tokenizer(d)
    (d / "tokenizer_config.json").write_text(
        '{"chat_template": "{% for m in messages %}<{{ m.role }}>{{ m.content }}{% endfor %}'
        '{% if add_generation_prompt %}<assistant>{% endif %}"}')
    model = tqjax.load(d)
    tok = model.tokenizer
    chat = [{"role": "system", "content": "S"}, {"role": "user", "content": "hi"}]
    assert encode_prompt(model, chat) == tok.encode("<system>S<user>hi<assistant>",
                                                    add_bos=False)
    assert encode_prompt(model, chat, chat=True) == encode_prompt(model, chat)
    s = tqjax.Session(model, cache="f32", ctx_size=128)
    first = s.generate(chat, max_new_tokens=4)
    chat2 = chat + [{"role": "assistant", "content": "ok"}, {"role": "user", "content": "more"}]
    second = s.generate(chat2, max_new_tokens=4)
    assert second.cached_tokens >= len(encode_prompt(model, chat)), first.token_ids
    fresh = tqjax.generate(model, chat2, max_new_tokens=4, ctx_size=128)
    assert second.token_ids == fresh.token_ids and fresh.cached_tokens == 0
    for bad, needle in (([{"role": "user", "content": 5}], r"messages\[0\]: content must be"),
                        ([{"role": "bot", "content": "x"}], r"messages\[0\]: role must be"),
                        ([{"role": "user", "content": "x"}, "y"], r"messages\[1\] is a str")):
        with pytest.raises(TqjaxError, match=needle):
            encode_prompt(model, bad)
    with pytest.raises(TqjaxError, match="begin the messages with a system message"):
        encode_prompt(model, chat, chat=True, system="S")
    batch = tqjax.generate(model, [chat, "plain text"], max_new_tokens=4, ctx_size=128)
    assert batch[0].token_ids == tqjax.generate(model, chat, max_new_tokens=4,
                                                ctx_size=128).token_ids
    # a batch of conversations, texts and token id lists; a bad item is named by its index
    # ([chat, []] was read as one prompt of token ids: "token ids must be a 1-D sequence")
    ids = tok.encode("plain text")
    mixed = tqjax.generate(model, [chat, ids, "plain text"], max_new_tokens=4, ctx_size=128)
    assert [r.token_ids for r in mixed] == [batch[0].token_ids, batch[1].token_ids,
                                            batch[1].token_ids]
    for bad, needle in (([chat, []], "prompt 1 of the batch is empty"),
                        ([chat, ["x"]], "prompt 1 of the batch: token ids must be"),
                        (["a", [{"role": "bot", "content": "x"}]],
                         r"prompt 1 of the batch: messages\[0\]: role must be"),
                        ([], "empty prompt")):
        with pytest.raises(TqjaxError, match=needle):
            tqjax.generate(model, bad, max_new_tokens=2, ctx_size=128)
    (d / "tokenizer_config.json").write_text("{}")
    with pytest.raises(TqjaxError, match="no chat template, so it takes no conversation"):
        encode_prompt(tqjax.load(d), chat)


def test_the_chat_template_needs_text(text_model):
    with pytest.raises(TqjaxError, match="text prompt"):  # (token ids skipped it silently)
        tqjax.generate(text_model, [1, 2, 3], max_new_tokens=2, chat=True)


def test_a_stop_string_given_alone_is_one_string(text_model):
    """stop="ab" stops at "ab", not at the first "a" or "b" (its characters as stops)."""
    text = tqjax.generate(text_model, "hello", max_new_tokens=24).text
    at, stop = next((p, text[p:p + 2]) for p in range(1, len(text) - 1)
                    if text.find(text[p:p + 2]) == p and text[p] in text[:p])
    cut = tqjax.generate(text_model, "hello", max_new_tokens=24, stop=stop)
    assert cut.finish_reason == "stop" and cut.text == text[:at]
    assert min(text.find(c) for c in stop) < at  # (so a per-character stop would cut sooner)


@pytest.mark.parametrize("ids", [[1.7, 2.0], [True, False], b"Hello", "hello", None,
                                 [[3, 4]], ["a", 1], [1, None]])
def test_token_ids_that_are_not_integers_are_refused(text_model, ids):
    """Floats were truncated, bytes read as ids, bools and nested lists failed deep in numpy:
    each API that takes ids says so in one line."""
    from tqjax.eval import perplexity

    with pytest.raises(TqjaxError, match="token ids must be"):
        tqjax.logits(text_model, ids)
    if ids == [[3, 4]]:  # a batch of one prompt of ids, for generate
        batch = tqjax.generate(text_model, ids, max_new_tokens=2)
        assert [r.token_ids for r in batch] == [
            tqjax.generate(text_model, [3, 4], max_new_tokens=2).token_ids]
    elif not isinstance(ids, str):  # (text is a prompt to generate)
        with pytest.raises(TqjaxError, match="token ids must be"):
            tqjax.generate(text_model, ids, max_new_tokens=2)
    with pytest.raises(TqjaxError, match="token ids must be"):
        perplexity(text_model, ids, 2)


def test_perplexity_refuses_ids_outside_the_vocabulary(text_model):
    """An id past the vocabulary gave PPL nan, a negative one a huge PPL, 2^40 an
    OverflowError."""
    from tqjax.eval import perplexity

    vocab = text_model.config.vocab_size
    for bad in (vocab + 5, -3, 2**40):
        with pytest.raises(TqjaxError, match=f"token id {bad} out of range"):
            perplexity(text_model, [5, 6, bad, 7], 2)
    good = perplexity(text_model, np.arange(3, 11), 4)
    assert good.tokens == 6 and np.isfinite(good.ppl)


def test_cache_given_as_text_and_options_of_the_wrong_type(text_model):
    ids = [5, 9, 13, 2]
    np.testing.assert_array_equal(tqjax.logits(text_model, ids, cache="q8/turbo3"),
                                  tqjax.logits(text_model, ids, cache=tqjax.CacheSpec("q8",
                                                                                      "turbo3")))
    for bad, needle in ((5, "cache must be a CacheSpec"), ("turbo9", "unknown cache type")):
        with pytest.raises(TqjaxError, match=needle):
            tqjax.generate(text_model, "ab", max_new_tokens=2, cache=bad)
    with pytest.raises(TqjaxError, match="max new tokens must be an integer"):
        tqjax.generate(text_model, "ab", max_new_tokens=2.5)
    with pytest.raises(TqjaxError, match="context size must be an integer"):
        tqjax.generate(text_model, "ab", max_new_tokens=2, ctx_size="16")
    # numpy integers are integers, as max_new_tokens already took them
    assert len(tqjax.generate(text_model, "ab", max_new_tokens=np.int64(2),
                              ctx_size=np.int64(16)).token_ids) <= 2


def test_prefill_speed_leaves_the_compile_out(text_model):
    """A first call compiles its prefill; prefill_tok_s counts the prefill's time without the
    seconds JAX reports compiling (the figure was mostly the compile); a second call of the
    same shapes compiles nothing."""
    jax.clear_caches()  # (another test may have compiled these shapes in this process)
    first = tqjax.generate(text_model, "abcdefg", max_new_tokens=3, ctx_size=200)
    again = tqjax.generate(text_model, "abcdefh", max_new_tokens=3, ctx_size=200)
    assert 0 < first.prefill_compile_s < first.prefill_s
    assert first.prefill_tok_s == pytest.approx(
        first.prompt_tokens / (first.prefill_s - first.prefill_compile_s))
    assert again.prefill_compile_s == 0.0
    assert again.prefill_tok_s == pytest.approx(again.prompt_tokens / again.prefill_s)


def test_a_session_keeps_its_cache_when_a_call_is_refused(text_model):
    s = tqjax.Session(text_model, cache="f32")
    first = s.generate("abcdef", max_new_tokens=3)
    held = list(s.tokens)
    for kwargs in (dict(max_new_tokens=2.5), dict(stop=3), dict(max_new_tokens=0)):
        with pytest.raises(TqjaxError):
            s.generate("abcdefgh", **kwargs)
        assert s.tokens == held
    again = s.generate("abcdef", max_new_tokens=3)
    assert again.text == first.text and again.cached_tokens == 5


def test_forward_refuses_a_chunk_its_cache_does_not_fit(model):
    """Shapes XLA would run anyway, clamping a cache row or slot index (a batch-1 cache under a
    batch-2 chunk gave row 0 logits 6.1 away from the reference, with no error): each a
    TqjaxError as `forward` is traced. Layers of a cache count from the end like a list."""
    from tqjax.models.transformer import forward

    p, cfg = model.params, model.config
    tokens = jnp.ones((2, 8), jnp.int32)

    def run(tokens, start, batch=2, slots=16):
        cache = gen.new_cache(p, cfg, tqjax.CacheSpec(), batch, slots)
        return forward(p, cfg, tokens, start, cache)

    for args, needle in (((tokens, jnp.zeros(2, jnp.int32), 1), "cache of batch 1"),
                         ((tokens, jnp.zeros(2, jnp.int32), 2, 4), "4 slots"),
                         ((tokens[0], jnp.zeros(1, jnp.int32)), "tokens \\[B, T\\]"),
                         ((tokens, 0), "start \\[B\\]")):
        with pytest.raises(TqjaxError, match=needle):
            run(*args)
    logits, cache = run(tokens, jnp.zeros(2, jnp.int32))
    assert logits.shape == (2, 8, cfg.vocab_size)
    from tqjax.kv.cache import make_cache

    spec = tqjax.CacheSpec("q8", "q8", boundary_layers=1, boundary_type="f32")
    cache = make_cache(spec, batch=1, slots=16, num_layers=5, kv_heads=2, head_dim=8)
    kinds = [type(layer.k).__name__ for layer in cache.layers]
    assert kinds[0] == kinds[4] != kinds[1] == kinds[3]  # f32 at both ends, q8 between
    assert [type(cache.layer(i - 5).k).__name__ for i in range(5)] == kinds
    with pytest.raises(IndexError):
        cache.layer(5)


def test_the_calibration_hint_works(model):
    """A model without a tokenizer cannot calibrate a turbo cache; the error's hint, followed,
    runs (it left out balance_keys, so following it raised the same error)."""
    with pytest.raises(TqjaxError, match="balance_keys=False") as e:
        tqjax.logits(model, [1, 2, 3], cache="turbo4")
    hint = str(e.value).split("pass CacheSpec(..., ")[1].rstrip(")")
    flags = dict(kv.split("=") for kv in hint.split(", "))
    assert set(flags.values()) == {"False"}
    flags = dict.fromkeys(flags, False)
    out = tqjax.logits(model, [1, 2, 3], cache=tqjax.CacheSpec("turbo4", "turbo4", **flags))
    assert out.shape == (3, model.config.vocab_size) and np.isfinite(out).all()


def test_a_cache_is_made_outside_a_traced_function(model):
    """new_cache makes host constants from the params: inside jax.jit it was a raw
    TracerArrayConversionError; made outside and passed in, a jitted forward runs."""
    from tqjax.kv.cache import CacheSpec
    from tqjax.models.transformer import forward

    cfg = model.config
    with pytest.raises(TqjaxError, match="outside jax.jit / jax.grad"):
        jax.jit(lambda p: gen.new_cache(p, cfg, CacheSpec(), 1, 16))(model.params)
    cache = gen.new_cache(model.params, cfg, CacheSpec(), 1, 16)
    toks = jnp.asarray([[1, 2, 3]], jnp.int32)
    run = jax.jit(lambda p, c: forward(p, cfg, toks, jnp.zeros((1,), jnp.int32), c)[0])
    np.testing.assert_allclose(np.asarray(run(model.params, cache))[0, -1],
                               tqjax.logits(model, [1, 2, 3])[-1], rtol=1e-5, atol=1e-5)
