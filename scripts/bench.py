"""Benchmark jit-compiled prefill and decode throughput and memory; prints one JSON line.

Compilation and warm-up are excluded. Decode runs at position `--context` so attention reads a
cache of that length (its contents do not change the cost). `--hf` also times HF transformers
on the same model and machine (needs the `golden` extra: torch, transformers).
"""

from __future__ import annotations

import os
import time

from tqjax.cli import ArgumentParser, add_model_args, cache_spec, print_json, run_main


def tree_bytes(tree: object) -> int:
    import jax

    return sum(x.nbytes for x in jax.tree_util.tree_leaves(tree))


def rss_bytes() -> int:
    """Resident set size of this process (Linux /proc), 0 where unavailable."""
    try:
        with open("/proc/self/status") as f:
            for line in f:
                if line.startswith("VmRSS:"):
                    return int(line.split()[1]) * 1024
    except OSError:
        pass
    return 0


def bench_tqjax(model: object, spec: object, prompt_tokens: int, context: int, decode_tokens: int,
                repeats: int) -> dict:
    import jax
    import jax.numpy as jnp
    import numpy as np

    from tqjax.decode.generate import decode_step, new_cache, prefill
    from tqjax.decode.sampling import SamplingParams

    cfg = model.config
    rng = np.random.default_rng(0)
    tokens = jnp.asarray(rng.integers(0, cfg.vocab_size, (1, prompt_tokens)), jnp.int32)
    lengths = jnp.asarray([prompt_tokens], jnp.int32)
    slots = max(context, prompt_tokens) + decode_tokens + 2

    def run_prefill() -> object:
        cache = new_cache(model.params, cfg, spec, 1, slots, model.calibration(spec))
        logits, cache = prefill(model.params, cfg, tokens, lengths, cache)
        jax.block_until_ready(logits)
        return cache

    run_prefill()  # compile
    times = []
    for _ in range(repeats):
        t0 = time.perf_counter()
        cache = run_prefill()
        times.append(time.perf_counter() - t0)
    prefill_s = min(times)

    sampling = SamplingParams()
    seen = jnp.zeros((1, cfg.vocab_size), bool)
    key = jax.random.PRNGKey(0)
    tok = jnp.asarray([1], jnp.int32)
    pos = max(context, prompt_tokens)
    for i in range(2):  # compile + warm-up
        tok, cache, seen = decode_step(model.params, cfg, cache, tok, jnp.asarray([pos + i]), key,
                                       sampling, seen)
        tok.block_until_ready()
    t0 = time.perf_counter()
    for i in range(decode_tokens):
        tok, cache, seen = decode_step(model.params, cfg, cache, tok,
                                       jnp.asarray([pos + 2 + i]), key, sampling, seen)
        int(tok[0])  # a real generation loop needs the token on the host every step
    decode_s = time.perf_counter() - t0
    cache_bytes = tree_bytes(cache)
    return {
        "prefill_tok_s": round(prompt_tokens / prefill_s, 2),
        "decode_tok_s": round(decode_tokens / decode_s, 2),
        "decode_ms_per_token": round(1000 * decode_s / decode_tokens, 3),
        "param_bytes": tree_bytes(model.params),
        "cache_bytes": cache_bytes,
        "cache_slots": slots,
        "kv_bytes_per_token": cache_bytes / slots,
        "rss_bytes": rss_bytes(),
    }


def bench_hf(gguf_path: str, prompt_tokens: int, context: int, decode_tokens: int) -> dict:
    """HF transformers (torch, f32, all cores) on the same GGUF: prefill and decode tok/s."""
    from pathlib import Path

    import torch
    from transformers import AutoModelForCausalLM

    torch.set_num_threads(os.cpu_count() or 1)
    path = Path(gguf_path)
    model = AutoModelForCausalLM.from_pretrained(str(path.parent), gguf_file=path.name,
                                                 torch_dtype=torch.float32).eval()
    g = torch.Generator().manual_seed(0)
    ids = torch.randint(0, model.config.vocab_size, (1, max(prompt_tokens, context)), generator=g)
    with torch.no_grad():
        model(ids[:, :prompt_tokens])  # warm-up
        t0 = time.perf_counter()
        out = model(ids[:, :prompt_tokens], use_cache=True)
        prefill_s = time.perf_counter() - t0
        out = model(ids, use_cache=True)  # fill the cache to `context`
        past, tok = out.past_key_values, out.logits[:, -1:].argmax(-1)
        for _ in range(2):
            out = model(tok, past_key_values=past, use_cache=True)
            past, tok = out.past_key_values, out.logits[:, -1:].argmax(-1)
        t0 = time.perf_counter()
        for _ in range(decode_tokens):
            out = model(tok, past_key_values=past, use_cache=True)
            past, tok = out.past_key_values, out.logits[:, -1:].argmax(-1)
        decode_s = time.perf_counter() - t0
    return {"prefill_tok_s": round(prompt_tokens / prefill_s, 2),
            "decode_tok_s": round(decode_tokens / decode_s, 2),
            "torch": torch.__version__, "threads": torch.get_num_threads()}


def main() -> int:
    p = ArgumentParser(description=__doc__.splitlines()[0])
    add_model_args(p)
    p.add_argument("--prompt-tokens", type=int, default=128)
    p.add_argument("--context", type=int, default=0,
                   help="cache position at which decode is timed (default: --prompt-tokens)")
    p.add_argument("--decode-tokens", type=int, default=64)
    p.add_argument("--repeats", type=int, default=3, help="prefill repeats (best is kept)")
    p.add_argument("--hf", action="store_true", help="also time HF transformers (GGUF models)")
    args = p.parse_args()

    import jax

    import tqjax
    from tqjax.api import kv_footprint
    from tqjax.errors import TqjaxError
    from tqjax.pallas.backend import use_backend

    spec = cache_spec(args)
    if min(args.prompt_tokens, args.decode_tokens, args.repeats) < 1:
        raise TqjaxError("--prompt-tokens, --decode-tokens and --repeats must be >= 1")
    model = tqjax.load(args.model, dtype=args.dtype, weights=args.weights, bpw=args.bpw,
                       quantize_embeddings=args.quantize_embeddings)
    result = {"model": model.source, "dtype": args.dtype, "backend": jax.default_backend(),
              "device": str(jax.devices()[0]), "cpu_count": os.cpu_count(),
              "cache_type_k": spec.k, "cache_type_v": spec.v,
              "prompt_tokens": args.prompt_tokens,
              "context": max(args.context, args.prompt_tokens),
              "decode_tokens": args.decode_tokens}
    with use_backend(args.backend):
        result["tqjax"] = bench_tqjax(model, spec, args.prompt_tokens, args.context,
                                      args.decode_tokens, args.repeats)
    result |= {"backend": args.backend,
               **kv_footprint(model, spec, max(args.context, args.prompt_tokens))}
    if args.hf:
        if not model.source.endswith(".gguf"):
            raise TqjaxError("--hf compares against a GGUF model loaded by transformers")
        hf = bench_hf(model.source, args.prompt_tokens, result["context"], args.decode_tokens)
        result["hf"] = hf
        result["decode_ratio_vs_hf"] = round(result["tqjax"]["decode_tok_s"]
                                             / hf["decode_tok_s"], 3)
        result["prefill_ratio_vs_hf"] = round(result["tqjax"]["prefill_tok_s"]
                                              / hf["prefill_tok_s"], 3)
    print_json(result)
    return 0


if __name__ == "__main__":
    run_main(main)
