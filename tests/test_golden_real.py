"""Real GGUF checkpoints against HF transformers (golden/real): logits, greedy text,
tokenizer, chat template and perplexity. Downloads the models on first use (cached)."""

import json

import jax.numpy as jnp
import numpy as np
import pytest
from safetensors.numpy import load_file

import tqjax
from tqjax.decode.generate import generate_tokens
from tqjax.decode.sampling import SamplingParams
from tqjax.eval import perplexity
from tqjax.fetch import corpus_text

from .conftest import GOLDEN

NAMES = ["smollm2-135m-instruct", "qwen2.5-coder-0.5b-instruct"]
# The agreement README.md's "Measured results" states, per model: (max |logit - HF| over the
# golden top-k and sampled logits, |PPL / HF PPL - 1| on the golden Hamlet windows). Measured
# 2026-12-02 at commit 3acd96d (`python -m pytest -s -q tests/test_golden_real.py -k
# "logits or perplexity"` prints them):
# SmolLM2 7.0e-5 and 8.1e-6 (README: 1.0e-4, +0.0008%); Qwen2.5-Coder-0.5B 3.8e-5 and 2.9e-5
# (README: +0.003%). Bounds are those figures rounded up to the next README-sized step.
# The logit figures depend on the CPU (XLA picks other dot kernels, so f32 sums round
# differently): on an AMD EPYC with AVX-512 (2026-12-04) SmolLM2 measures 1.04e-4 and
# Qwen2.5-Coder-0.5B 1.9e-5, hence SmolLM2's 1.2e-4.
# A model without its own entry gets the loosest pair.
TOLERANCE = {
    "smollm2-135m-instruct": (1.2e-4, 2.0e-5),
    "qwen2.5-coder-0.5b-instruct": (5.0e-5, 5.0e-5),
    # measured 2026-12-03 (f32 load, 2 windows of 256): 1.01e-4 and 6.2e-5 (+0.0062%)
    "qwen2.5-coder-1.5b-instruct": (2.0e-4, 1.0e-4),
}
LOOSEST = tuple(max(t[i] for t in TOLERANCE.values()) for i in range(2))


# Qwen2.5-Coder-1.5B (head_dim 128; golden on a shorter text: 2 windows of 256) is `slow`
# (7.1 GB of f32 weights; 9 minutes under heavy shared load, 4 of them loading). Keeping its
# GGUF blocks instead (weights="gguf") matches HF's logits as closely (5.2e-5) but decodes
# every block at every greedy step: over 20 minutes here. It is also `large`: skipped in the
# default run (CI's 20-minute budget) unless --run-large or TQJAX_TEST_LARGE=1.
SLOW = {"qwen2.5-coder-1.5b-instruct": {}}


@pytest.fixture(scope="module", params=[
    *NAMES, *(pytest.param(n, marks=[pytest.mark.slow, pytest.mark.large]) for n in SLOW)])
def case(request, real_model):
    name = request.param
    ref = load_file(GOLDEN / "real" / f"{name}.safetensors")
    meta = json.loads((GOLDEN / "real" / f"{name}.json").read_text())
    # the session's shared copy (other files load these two too); the large one stays local
    model = tqjax.load(name, **SLOW[name]) if name in SLOW else real_model(name)
    return model, ref, meta


def test_logits_match_hf(case):
    model, ref, meta = case
    got = tqjax.logits(model, ref["prompt_ids"].tolist())
    assert got.shape == (len(ref["prompt_ids"]), model.config.vocab_size)
    top = np.take_along_axis(got, ref["topk_ids"], axis=1)
    sampled = got[:, ref["sample_ids"]]
    err = max(np.abs(top - ref["topk_logits"]).max(), np.abs(sampled - ref["sample_logits"]).max())
    print(f"{meta['model']}: max |logit - HF| {err:.2e}")
    assert err <= TOLERANCE.get(meta["model"], LOOSEST)[0], err
    assert (got.argmax(-1) == ref["topk_ids"][:, 0]).all()


def test_greedy_continuation_matches_hf(case):
    model, ref, meta = case
    steps = list(generate_tokens(model.params, model.config, [ref["greedy_prompt_ids"].tolist()],
                                 max_new_tokens=32, sampling=SamplingParams(), eos_ids=(),
                                 ctx_size=256))
    ids = steps[-1][0][0].ids
    assert ids == ref["greedy_ids"].tolist()
    assert model.tokenizer.decode(ids) == meta["greedy_text"]


def test_tokenizer_and_chat_template_match_hf(case):
    model, ref, meta = case
    for item in meta["tokenization"]:
        assert model.tokenizer.encode(item["text"], add_bos=False) == item["ids"], item["text"]
        assert model.tokenizer.decode(item["ids"], skip_special=False) == item["text"]
        # each token's own bytes (the server's logprobs), parts of characters included
        assert b"".join(map(model.tokenizer.token_bytes, item["ids"])) == item["text"].encode()
    rendered = model.tokenizer.apply_chat_template(
        [{"role": "system", "content": "You are helpful."}, {"role": "user", "content": "Hi!"}])
    assert rendered == meta["chat_template_rendered"]
    assert model.tokenizer.encode(meta["prompt_text"], add_bos=False) == ref["prompt_ids"].tolist()


# llama.cpp's end-of-generation tokens for each GGUF (its load log's "EOG token" lines);
# HF's generation_config.json ends Qwen2.5 on 151645 and 151643 too
END_OF_GENERATION = {
    "smollm2-135m-instruct": {"<|im_end|>", "<|endoftext|>", "<reponame>"},
    "qwen2.5-coder-0.5b-instruct": {"<|im_end|>", "<|endoftext|>", "<|fim_pad|>",
                                    "<|repo_name|>", "<|file_sep|>"},
    "qwen2.5-coder-1.5b-instruct": {"<|im_end|>", "<|endoftext|>", "<|fim_pad|>",
                                    "<|repo_name|>", "<|file_sep|>"},
}


def test_generation_ends_on_every_end_token(case):
    """Each model's end tokens are llama.cpp's set, the GGUF's named eos first; a reply that
    begins with <|endoftext|> ends there (Qwen2.5 did, and generated a new reply after it)."""
    model, _, meta = case
    tok = model.tokenizer
    assert {tok.decode([i], skip_special=False) for i in tok.eos_ids} == \
        END_OF_GENERATION[meta["model"]]
    assert tok.decode([tok.eos_ids[0]], skip_special=False) == "<|im_end|>"
    prompt = "<|im_start|>user\nSay OK.<|im_end|>\n<|im_start|>assistant\nOK<|im_end|>\n"
    r = tqjax.generate(model, prompt, max_new_tokens=8, ctx_size=64)
    assert not set(r.token_ids[:-1]) & set(tok.eos_ids)  # generation stops at the first
    assert (r.finish_reason == "eos") == (r.token_ids[-1] in tok.eos_ids)
    if meta["model"] == "qwen2.5-coder-0.5b-instruct":  # (measured: its first token)
        assert tok.decode(r.token_ids, skip_special=False) == "<|endoftext|>"
        assert (r.finish_reason, r.text) == ("eos", "")


def test_perplexity_matches_hf(case):
    model, ref, meta = case
    spec = meta["perplexity"]
    ours = model.tokenizer.encode(corpus_text(spec["corpus"]), add_bos=False)[: spec["tokens"]]
    assert ours == ref["ppl_ids"].tolist()
    res = perplexity(model, jnp.asarray(ref["ppl_ids"]), spec["ctx"])
    assert res.tokens == (spec["tokens"] // spec["ctx"]) * (spec["ctx"] - 1)
    print(f"{meta['model']}: PPL {res.ppl:.6f} vs HF {spec['ppl']:.6f}")
    assert abs(res.ppl / spec["ppl"] - 1) <= TOLERANCE.get(meta["model"], LOOSEST)[1], (
        res.ppl, spec["ppl"])
