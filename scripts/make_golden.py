"""Generate the golden reference data under ``golden/`` with HF transformers (torch, CPU, float32).

Needs the optional extra ``golden`` (torch, transformers, accelerate, gguf). Two parts:

* ``tiny``: six tiny random Llama/Qwen2/Qwen3 models saved with ``save_pretrained`` plus their
  float32 logits on fixed random input ids (``golden/tiny/<name>/``).
* ``real``: the real GGUF checkpoints of :mod:`tqjax.fetch`: top-k / sampled logits on a fixed
  passage, greedy continuations, tokenizations, the rendered chat template, the perplexity on
  Hamlet and HF's CPU speed (``golden/real/<name>.{safetensors,json}``).

Usage::

    python scripts/make_golden.py               # both parts
    python scripts/make_golden.py --only tiny
    python scripts/make_golden.py --only real --models smollm2-135m-instruct

Every file is written atomically (temp file in the same folder + ``os.replace``).
"""

from __future__ import annotations

import argparse
import json
import math
import os
import platform
import shutil
import sys
import tempfile
import time
from pathlib import Path
from typing import Any

import numpy as np

REPO = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(REPO))

from tqjax.atomic import replace_dir, write_json, write_safetensors, write_text  # noqa: E402
from tqjax.fetch import MODEL_NAMES, corpus_text, fetch_model  # noqa: E402

NUM_THREADS = 2
TINY_SEED = 1234

# ~70-token English passage for the logits checks.
PASSAGE = (
    "The old lighthouse keeper climbed the narrow stairs every evening at dusk. From the top, he "
    "could see the fishing boats returning to the harbor, their lanterns swaying gently with the "
    "waves. He had lived on the island for forty-two years, and he knew every rock, every current, "
    "and every storm that had ever passed."
)
GREEDY_PROMPTS = {
    "smollm2-135m-instruct": "Once upon a time, there was a little girl named Lily. She",
    "qwen2.5-coder-0.5b-instruct": (
        'def fibonacci(n):\n    """Return the n-th Fibonacci number."""\n'
    ),
    "qwen2.5-coder-1.5b-instruct": (
        'def fibonacci(n):\n    """Return the n-th Fibonacci number."""\n'
    ),
}
TOKENIZATION_STRINGS = (
    "Hello, world! How's it going? I'm fine -- thanks for asking; really...",
    "In 1984 there were 12,345 people.",
    "def add(a, b):\n    if a > b:\n        return a - b\n\treturn a + b  # tab\n",
    "Café naïve résumé — 東京 😀👍🏽 Ünïcödé",
    "<|im_start|>user\nhi<|im_end|>\n<|im_start|>assistant\n",
)
CHAT_MESSAGES = [
    {"role": "system", "content": "You are helpful."},
    {"role": "user", "content": "Hi!"},
]
N_GREEDY = 32
TOPK = 32
N_SAMPLE = 256
PPL_CORPUS = "shakespeare:hamlet"
PPL_TOKENS = 4096
PPL_CTX = 512
# The 1.5B model is slow on a shared 2-core CPU: a shorter perplexity text (2 windows of 256) and
# no HF speed fields (its golden test must stay under ~2 minutes).
PPL_OVERRIDES = {"qwen2.5-coder-1.5b-instruct": (512, 256)}  # name -> (tokens, ctx)
NO_SPEED = {"qwen2.5-coder-1.5b-instruct"}


# --------------------------------------------------------------------------------------------------
def versions() -> dict[str, str]:
    """Versions of the libraries that produced the data."""
    import gguf
    import tokenizers
    import torch
    import transformers

    try:
        gguf_version = gguf.__version__  # type: ignore[attr-defined]
    except AttributeError:
        from importlib.metadata import version

        gguf_version = version("gguf")
    return {
        "python": platform.python_version(),
        "torch": torch.__version__,
        "transformers": transformers.__version__,
        "tokenizers": tokenizers.__version__,
        "gguf": gguf_version,
        "numpy": np.__version__,
    }


# --------------------------------------------------------------------------------------------------
# tiny random models

COMMON = dict(
    vocab_size=256,
    hidden_size=64,
    intermediate_size=128,
    num_hidden_layers=2,
    max_position_embeddings=256,
    initializer_range=0.1,
)

TINY: dict[str, tuple[str, dict[str, Any]]] = {
    "llama": (
        "LlamaForCausalLM",
        dict(
            COMMON,
            num_attention_heads=4,
            num_key_value_heads=2,
            rope_theta=10000.0,
            rms_norm_eps=1e-5,
            tie_word_embeddings=False,
        ),
    ),
    "llama3_rope": (
        "LlamaForCausalLM",
        dict(
            COMMON,
            num_attention_heads=4,
            num_key_value_heads=1,
            rope_theta=500000.0,
            rope_scaling={
                "rope_type": "llama3",
                "factor": 8.0,
                "low_freq_factor": 1.0,
                "high_freq_factor": 4.0,
                "original_max_position_embeddings": 64,
            },
            rms_norm_eps=1e-5,
            tie_word_embeddings=False,
        ),
    ),
    "llama_tied": (
        "LlamaForCausalLM",
        dict(
            COMMON,
            num_attention_heads=4,
            num_key_value_heads=4,
            rope_theta=10000.0,
            rms_norm_eps=1e-5,
            tie_word_embeddings=True,
        ),
    ),
    "qwen2": (
        "Qwen2ForCausalLM",
        dict(
            COMMON,
            num_attention_heads=4,
            num_key_value_heads=2,
            rope_theta=1e6,
            rms_norm_eps=1e-6,
            tie_word_embeddings=False,
        ),
    ),
    "qwen2_gqa7": (
        "Qwen2ForCausalLM",
        dict(
            COMMON,
            hidden_size=112,
            num_attention_heads=14,
            num_key_value_heads=2,
            rope_theta=1e6,
            rms_norm_eps=1e-6,
            tie_word_embeddings=False,
        ),
    ),
    "qwen3": (
        "Qwen3ForCausalLM",
        dict(
            COMMON,
            num_attention_heads=4,
            num_key_value_heads=2,
            head_dim=32,
            rope_theta=1e6,
            rms_norm_eps=1e-6,
            tie_word_embeddings=True,
        ),
    ),
}

# These two also get a config.legacy.json in the other config style (see golden/tiny/README.md).
LEGACY_COPIES = ("llama", "llama3_rope")


def _other_style(cfg: dict[str, Any]) -> dict[str, Any]:
    """Convert a transformers config dict between the new style (``rope_parameters``, ``dtype``;
    transformers >= 5) and the legacy style (top-level ``rope_theta``/``rope_scaling``,
    ``torch_dtype``)."""
    out = dict(cfg)
    if "rope_parameters" in out:
        rp = dict(out.pop("rope_parameters") or {})
        theta = rp.pop("rope_theta", None)
        if theta is not None:
            out["rope_theta"] = theta
        out["rope_scaling"] = None if rp.get("rope_type", "default") == "default" else rp
        if "dtype" in out:
            out["torch_dtype"] = out.pop("dtype")
    else:
        rp = dict(out.pop("rope_scaling", None) or {"rope_type": "default"})
        if "type" in rp and "rope_type" not in rp:
            rp["rope_type"] = rp.pop("type")
        rp["rope_theta"] = out.pop("rope_theta", 10000.0)
        out["rope_parameters"] = rp
        if "torch_dtype" in out:
            out["dtype"] = out.pop("torch_dtype")
    return dict(sorted(out.items()))


def _randomize(model: Any, gen: Any) -> None:  # noqa: ANN401
    """RMSNorm weights (incl. Qwen3 q/k norms) -> 1 + 0.2*randn; all biases -> 0.5*randn."""
    import torch

    with torch.no_grad():
        for name, p in model.named_parameters():
            if name.endswith("norm.weight"):
                p.copy_(1.0 + 0.2 * torch.randn(p.shape, generator=gen))
            elif name.endswith(".bias"):
                p.copy_(0.5 * torch.randn(p.shape, generator=gen))


def _logits(model: Any, ids: np.ndarray) -> np.ndarray:  # noqa: ANN401
    import torch

    with torch.no_grad():
        out = model(input_ids=torch.from_numpy(ids.astype(np.int64)))
    return out.logits.float().numpy()


def make_tiny(out_root: Path) -> None:
    """Write golden/tiny/<name>/ for every tiny config, plus golden/tiny/README.md."""
    import torch
    import transformers

    torch.set_num_threads(NUM_THREADS)
    vers = versions()
    ids = np.random.default_rng(TINY_SEED).integers(0, 256, size=(2, 16)).astype(np.int32)
    summary = []
    for i, (name, (arch, kwargs)) in enumerate(TINY.items()):
        config_cls = getattr(transformers, arch.replace("ForCausalLM", "Config"))
        model_cls = getattr(transformers, arch)
        config = config_cls(**kwargs, attn_implementation="eager")
        torch.manual_seed(TINY_SEED + i)
        model = model_cls(config).float().eval()
        gen = torch.Generator().manual_seed(TINY_SEED + 100 + i)
        _randomize(model, gen)
        logits = _logits(model, ids)

        replace_dir(
            out_root / "tiny" / name,
            lambda d, m=model, n=name, lg=logits, mc=model_cls: _save_tiny(
                d, m, mc, n, ids, lg, vers
            ),
        )
        head_dim = (
            getattr(config, "head_dim", None) or config.hidden_size // config.num_attention_heads
        )
        summary.append(
            f"| `{name}` | {arch} | {config.num_attention_heads}/{config.num_key_value_heads} | "
            f"{head_dim} | "
            f"{config.tie_word_embeddings} | "
            f"{float(np.abs(logits).max()):.3f} | {float(logits.std()):.3f} |"
        )
        print(f"tiny/{name}: logits std {logits.std():.3f}, max |x| {np.abs(logits).max():.3f}")
    cfg_style = json.loads((out_root / "tiny" / "llama" / "config.json").read_text())
    new_style = "rope_parameters" in cfg_style
    write_text(out_root / "tiny" / "README.md", _tiny_readme(vers, summary, new_style))


def _save_tiny(
    d: Path,
    model: Any,  # noqa: ANN401
    model_cls: Any,  # noqa: ANN401
    name: str,
    ids: np.ndarray,
    logits: np.ndarray,
    vers: dict[str, str],
) -> None:
    """Fill folder ``d`` with the HF files, the reference tensors and (maybe) a legacy config."""
    model.save_pretrained(d, safe_serialization=True)
    for extra in d.iterdir():
        if extra.name not in ("config.json", "model.safetensors", "generation_config.json"):
            extra.unlink()
    cfg = json.loads((d / "config.json").read_text())
    if name in LEGACY_COPIES:
        legacy = json.dumps(_other_style(cfg), indent=2) + "\n"
        (d / "config.legacy.json").write_text(legacy)
    meta = {"model": name, "seed": str(TINY_SEED), **vers}
    tensors = {"input_ids": ids, "logits": logits.astype(np.float32)}
    write_safetensors(d / "reference.safetensors", tensors, meta)
    _check_reload(d, model_cls, ids, logits)
    for f in d.iterdir():
        os.chmod(f, 0o644)


def _check_reload(d: Path, model_cls: Any, ids: np.ndarray, logits: np.ndarray) -> None:  # noqa: ANN401
    """Reload the saved folder (and the legacy config, if any) and require identical logits."""
    configs = ["config.json"] + (
        ["config.legacy.json"] if (d / "config.legacy.json").exists() else []
    )
    for cfg_name in configs:
        with tempfile.TemporaryDirectory() as t:
            shutil.copy(d / "model.safetensors", Path(t) / "model.safetensors")
            shutil.copy(d / cfg_name, Path(t) / "config.json")
            m = model_cls.from_pretrained(t, attn_implementation="eager").float().eval()
            got = _logits(m, ids)
        err = float(np.abs(got - logits).max())
        if err > 1e-5:
            raise RuntimeError(f"{d.name}: reloaded logits via {cfg_name} differ by {err}")


def _tiny_readme(vers: dict[str, str], rows: list[str], new_style: bool) -> str:
    saved, other = (
        (
            "new style (`rope_parameters` dict holding `rope_theta`/`rope_type`/scaling, `dtype`)",
            "legacy style (top-level `rope_theta`, `rope_scaling` (null or the llama3 dict), "
            "`torch_dtype`)",
        )
        if new_style
        else (
            "legacy style (top-level `rope_theta`, `rope_scaling`, `torch_dtype`)",
            "new style (`rope_parameters`, `dtype`)",
        )
    )
    table = "\n".join(rows)
    return f"""# Tiny random HF models

Generated by `python scripts/make_golden.py --only tiny` with transformers {vers["transformers"]},
torch {vers["torch"]}, Python {vers["python"]} (CPU, float32, `attn_implementation="eager"`).

Each folder holds what `model.save_pretrained(dir, safe_serialization=True)` wrote
(`config.json`, `model.safetensors` in float32, `generation_config.json`) plus
`reference.safetensors`:

- `input_ids` int32 [2, 16]: `np.random.default_rng({TINY_SEED}).integers(0, 256, (2, 16))`, no
  padding, same ids for every model;
- `logits` float32 [2, 16, 256]: HF forward in float32, `model.eval()`, `torch.no_grad()`.

All models: vocab 256, hidden 64 (112 for `qwen2_gqa7`), intermediate 128, 2 layers,
max_position_embeddings 256, initializer_range 0.1. All RMSNorm weights (Qwen3 q/k norms too) are
`1 + 0.2*randn`; Qwen2 q/k/v biases are `0.5*randn`. rms_norm_eps is 1e-5 for the llama models and
1e-6 for the qwen ones. Reloading each folder with `from_pretrained` reproduces the logits.

| model | class | heads/kv | head_dim | tied | max abs logit | logit std |
|---|---|---|---|---|---|---|
{table}

`llama3_rope`: rope_theta 500000 and llama3 scaling (factor 8, low 1, high 4, original context
64), so the scaling really changes the frequencies: with head_dim 16 the inverse frequencies are
divided by [1, 2.442, 8, 8, 8, 8, 8, 8], i.e. all three wavelength bands (kept / smoothly
interpolated / divided by the factor) are hit (an original context of 32 would skip the middle
one). `qwen3`: explicit head_dim 32 (hidden/heads = 16), tied embeddings.

## Config formats

transformers {vers["transformers"]} writes `config.json` in the {saved}.

`llama/config.legacy.json` and `llama3_rope/config.legacy.json` are the same configs rewritten in
the {other}.

transformers loads both to the same logits; a config loader should accept both.
"""


# --------------------------------------------------------------------------------------------------
# real GGUF models


def _tok_ids(tok: Any, text: str) -> list[int]:  # noqa: ANN401
    return list(tok(text, add_special_tokens=False)["input_ids"])


def _perplexity(model: Any, ids: np.ndarray, ctx: int = PPL_CTX) -> float:  # noqa: ANN401
    """exp(mean NLL) over non-overlapping ``ctx``-token windows, each run independently (no
    BOS)."""
    import torch

    nll, count = 0.0, 0
    for start in range(0, len(ids), ctx):
        win = torch.from_numpy(ids[start : start + ctx].astype(np.int64))[None]
        with torch.no_grad():
            logits = model(input_ids=win).logits[0].float()
        logp = torch.log_softmax(logits[:-1], dim=-1)
        tgt = win[0, 1:]
        nll -= float(logp.gather(1, tgt[:, None]).double().sum())
        count += int(tgt.numel())
    return math.exp(nll / count)


def speed_fields(model: Any, ids: np.ndarray, eos: int, repeats: int = 3) -> dict[str, Any]:  # noqa: ANN401
    """HF CPU speed as JSON fields: greedy decode tok/s (32-token prompt ``ids[:32]``, 64 new
    tokens, 64 / wall time of the whole ``generate`` call), the same without the prefill
    (63 / (t(64 new) - t(1 new))), and prefill tok/s (one 512-token forward). Best of ``repeats``
    after a warm-up; the machine's load average is recorded because the cores are shared."""
    import torch

    torch.set_num_threads(NUM_THREADS)
    prompt = torch.from_numpy(ids[:32].astype(np.int64))[None]

    def gen(n_new: int) -> float:
        t0 = time.perf_counter()
        with torch.no_grad():
            model.generate(
                prompt,
                attention_mask=torch.ones_like(prompt),
                do_sample=False,
                max_new_tokens=n_new,
                min_new_tokens=n_new,
                pad_token_id=eos,
            )
        return time.perf_counter() - t0

    load_before = os.getloadavg()[0]
    gen(8)  # warm-up
    t64 = min(gen(64) for _ in range(repeats))
    t1 = min(gen(1) for _ in range(repeats))  # prefill + first token

    prefill_ids = torch.from_numpy(ids[:512].astype(np.int64))[None]
    with torch.no_grad():
        model(input_ids=prefill_ids[:, :64])  # warm-up
        times = []
        for _ in range(repeats):
            t0 = time.perf_counter()
            model(input_ids=prefill_ids)
            times.append(time.perf_counter() - t0)
    return {
        "hf_decode_tok_s": round(64 / t64, 2),
        "hf_decode_tok_s_excl_prefill": round(63 / max(t64 - t1, 1e-9), 2),
        "hf_prefill_tok_s": round(512 / min(times), 2),
        "speed_note": f"CPU float32, torch.set_num_threads({NUM_THREADS}), best of {repeats} after "
        "a warm-up. decode: 32-token prompt, 64 new tokens, 64 / time of the whole generate call "
        "(excl_prefill: 63 / (t(64 new) - t(1 new))); prefill: one 512-token forward. "
        "The 2 cores are shared with other jobs, so expect noise.",
        "speed_loadavg_1min": [round(load_before, 2), round(os.getloadavg()[0], 2)],
        "speed_cpu": platform.processor() or platform.machine(),
        "speed_cpu_count": os.cpu_count(),
    }


def _load_hf(name: str) -> tuple[Any, Any, Path]:
    """(tokenizer, float32 model in eval mode, gguf path) for a named model."""
    import torch
    from transformers import AutoModelForCausalLM, AutoTokenizer

    gguf_path = fetch_model(name)
    t0 = time.perf_counter()
    tok = AutoTokenizer.from_pretrained(gguf_path.parent, gguf_file=gguf_path.name)
    model = AutoModelForCausalLM.from_pretrained(
        gguf_path.parent, gguf_file=gguf_path.name, dtype=torch.float32
    ).eval()
    print(f"{name}: loaded in {time.perf_counter() - t0:.1f}s", flush=True)
    return tok, model, gguf_path


def remeasure_speed(out_root: Path, names: list[str]) -> None:
    """Re-measure only the speed fields of existing golden/real/<name>.json files."""
    from safetensors.numpy import load_file

    for name in names:
        path = out_root / "real" / f"{name}.json"
        info = json.loads(path.read_text(encoding="utf-8"))
        ppl_ids = load_file(str(out_root / "real" / f"{name}.safetensors"))["ppl_ids"]
        tok, model, _ = _load_hf(name)
        fields = speed_fields(model, ppl_ids, int(tok.eos_token_id))
        print(f"{name}: {json.dumps(fields)}", flush=True)
        info.update(fields)
        write_json(path, info)
        del model


def make_real(out_root: Path, names: list[str]) -> None:
    """Write golden/real/<name>.safetensors and .json for each named GGUF model."""
    import torch

    torch.set_num_threads(NUM_THREADS)
    vers = versions()
    hamlet = corpus_text(PPL_CORPUS)
    for name in names:
        tok, model, gguf_path = _load_hf(name)
        eos = int(tok.eos_token_id)

        prompt_ids = np.array(_tok_ids(tok, PASSAGE), dtype=np.int32)
        assert len(prompt_ids) >= 64, len(prompt_ids)
        with torch.no_grad():
            logits = model(input_ids=torch.from_numpy(prompt_ids.astype(np.int64))[None]).logits
        logits = logits[0].float()
        vocab = int(logits.shape[-1])
        topv, topi = torch.topk(logits, TOPK, dim=-1)
        rng = np.random.default_rng(0)
        sample_ids = np.sort(rng.choice(vocab, size=N_SAMPLE, replace=False)).astype(np.int32)
        sample_logits = logits[:, torch.from_numpy(sample_ids.astype(np.int64))].numpy()

        greedy_prompt = GREEDY_PROMPTS[name]
        gp = np.array(_tok_ids(tok, greedy_prompt), dtype=np.int32)
        gp_t = torch.from_numpy(gp.astype(np.int64))[None]
        with torch.no_grad():
            out = model.generate(
                gp_t,
                attention_mask=torch.ones_like(gp_t),
                do_sample=False,
                max_new_tokens=N_GREEDY,
                min_new_tokens=N_GREEDY,
                pad_token_id=eos,
                temperature=None,
                top_p=None,
                top_k=None,
                repetition_penalty=None,
            )
        greedy_ids = out[0, len(gp) :].numpy().astype(np.int32)
        assert len(greedy_ids) == N_GREEDY
        # consistency: a full (no-cache) forward over prompt+continuation picks the same tokens
        with torch.no_grad():
            full = model(input_ids=out).logits[0, len(gp) - 1 : -1].float()
        full_argmax = full.argmax(-1).numpy()
        greedy_matches = bool((full_argmax == greedy_ids).all())

        ppl_tokens, ppl_ctx = PPL_OVERRIDES.get(name, (PPL_TOKENS, PPL_CTX))
        ppl_ids = np.array(_tok_ids(tok, hamlet)[:ppl_tokens], dtype=np.int32)
        assert len(ppl_ids) == ppl_tokens
        t0 = time.perf_counter()
        ppl = _perplexity(model, ppl_ids, ppl_ctx)
        print(f"{name}: ppl {ppl:.4f} ({time.perf_counter() - t0:.0f}s)", flush=True)

        speed = {} if name in NO_SPEED else speed_fields(model, ppl_ids, eos)
        print(f"{name}: {json.dumps(speed)}", flush=True)

        tensors = {
            "prompt_ids": prompt_ids,
            "topk_ids": topi.numpy().astype(np.int32),
            "topk_logits": topv.numpy().astype(np.float32),
            "sample_ids": sample_ids,
            "sample_logits": sample_logits.astype(np.float32),
            "greedy_prompt_ids": gp,
            "greedy_ids": greedy_ids,
            "ppl_ids": ppl_ids,
        }
        meta = {"model": name, **vers}
        write_safetensors(out_root / "real" / f"{name}.safetensors", tensors, meta)
        info = {
            "model": name,
            "gguf_file": gguf_path.name,
            "versions": vers,
            "torch_threads": NUM_THREADS,
            "hf_load": "AutoModelForCausalLM.from_pretrained(dir, gguf_file=..., dtype=float32)",
            "vocab_size_logits": vocab,
            "tokenizer_len": len(tok),
            "special_tokens": {
                "bos": [tok.bos_token, tok.bos_token_id],
                "eos": [tok.eos_token, tok.eos_token_id],
                "pad": [tok.pad_token, tok.pad_token_id],
            },
            "prompt_text": PASSAGE,
            "prompt_tokens": len(prompt_ids),
            "greedy_prompt": greedy_prompt,
            "greedy_text": tok.decode(greedy_ids.tolist()),
            "greedy_settings": "do_sample=False, max_new_tokens=min_new_tokens=32 (eos masked)",
            "greedy_matches_full_forward_argmax": greedy_matches,
            "eos_in_full_forward_argmax": bool((full_argmax == eos).any()),
            "topk": TOPK,
            "sample_ids": f"np.sort(np.random.default_rng(0).choice({vocab}, {N_SAMPLE}, "
            "replace=False))",
            "tokenization": [{"text": s, "ids": _tok_ids(tok, s)} for s in TOKENIZATION_STRINGS],
            "chat_template_rendered": tok.apply_chat_template(
                CHAT_MESSAGES, tokenize=False, add_generation_prompt=True
            ),
            "perplexity": {
                "corpus": PPL_CORPUS,
                "ctx": ppl_ctx,
                "tokens": ppl_tokens,
                "definition": f"non-overlapping {ppl_ctx}-token windows of ppl_ids, no BOS; "
                f"exp(mean NLL of positions 1..{ppl_ctx - 1} over all "
                f"{ppl_tokens // ppl_ctx} windows)",
                "ppl": ppl,
            },
            **speed,
        }
        write_json(out_root / "real" / f"{name}.json", info)
        print(f"{name}: greedy {info['greedy_text']!r}", flush=True)
        del model


def main(argv: list[str] | None = None) -> None:
    """Command-line entry point."""
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--only", choices=["tiny", "real"], help="generate only one part")
    ap.add_argument(
        "--speed-only",
        action="store_true",
        help="only re-measure the HF speed fields of existing golden/real/*.json",
    )
    ap.add_argument("--out", type=Path, default=REPO / "golden", help="output folder")
    ap.add_argument(
        "--models", nargs="+", default=list(MODEL_NAMES), choices=MODEL_NAMES, help="real models"
    )
    args = ap.parse_args(argv)
    if args.speed_only:
        remeasure_speed(args.out, args.models)
        return
    if args.only in (None, "tiny"):
        make_tiny(args.out)
    if args.only in (None, "real"):
        make_real(args.out, args.models)


if __name__ == "__main__":
    main()
