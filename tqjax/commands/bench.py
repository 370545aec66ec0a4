"""Benchmark prefill and decode throughput, memory and the memory-bandwidth roofline; one JSON.

    python scripts/bench.py -m smollm2-135m-instruct --context 8192 --kv turbo4 --out run.json
    python scripts/bench.py --prompt-tokens 512 --context 512 --slots 16384   # a big, empty cache
    python scripts/bench.py --context 1024 --peers hf,llamacpp                # the same, by peers

Compilation and warm-up are excluded; prefill and decode speeds are medians over --repeats.
Decode is timed at position --context (the cache past the prompt holds zeros: its contents do not
change the cost) in a cache of --slots slots (default: just enough).

Bytes one decode step reads (the roofline's numerator):
    bytes_per_step = param_read_bytes + live_cache_bytes
    param_read_bytes = Σ nbytes of the parameter leaves, less (1 − 1/V) of the input embedding
                       when the head is untied (an untied embedding is only gathered, one row)
    live_cache_bytes = cache bytes per token slot × L + the cache's constant bytes (sink slots,
                       recent rings, centres, rotations), L = the mean live length of the timed
                       steps (context + (decode_tokens + 5) / 2)
    roofline_fraction = (bytes_per_step / copy bandwidth) / measured seconds per step
The copy bandwidth is measured once per run in its own process (so it does not count in this
process's peak RSS): a numpy copy of a 1 GiB array split over all cores, best of 5, counting
bytes read + written (the STREAM "copy" convention), GB/s = 1e9 bytes/s. `--bandwidth` reuses a
figure measured before (bench_sweep.py measures once per sweep).

Peak RSS is the process's VmHWM (Linux). Peers (`--peers hf,llamacpp`) each run in their own
subprocess, on the same model, prompt length, position and decode count: HF transformers (torch,
f32, all threads; its decode cache is filled to --context with random keys and values) and
llama.cpp through llama-cpp-python (the same .gguf, all threads; a prompt of --context tokens is
evaluated, then single-token evals are timed; without that package, llama.cpp's own
`llama-bench` from $LLAMA_BENCH or PATH, whose generation starts from an empty cache). A peer
that is not installed gives a one-line note in the JSON.
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path

from tqjax.cli import (
    ArgumentParser,
    add_model_args,
    cache_spec,
    check_writable,
    model_mesh,
    positive_float,
    print_json,
    run_main,
)
from tqjax.commands.provenance import git_info, machine_info

SCHEMA = "tqjax-bench/1"
PEERS = ("hf", "llamacpp")
PEER_MODULES = {"hf": ("torch", "transformers"), "llamacpp": ("llama_cpp",)}
BANDWIDTH_BYTES = 1 << 30
BANDWIDTH_REPEATS = 5
SELF = (sys.executable, "-m", "tqjax.commands.bench")  # this program, for its child processes


# --- process and machine facts -------------------------------------------------------------

def proc_status_bytes(field: str, pid: int | str = "self") -> int:
    """A `/proc/<pid>/status` memory field (e.g. "VmHWM" peak RSS, "VmRSS") in bytes; 0 where
    unavailable."""
    try:
        with open(f"/proc/{pid}/status") as f:
            for line in f:
                if line.startswith(field + ":"):
                    return int(line.split()[1]) * 1024
    except OSError:
        pass
    return 0


def measure_copy_bandwidth(nbytes: int = BANDWIDTH_BYTES, repeats: int = BANDWIDTH_REPEATS,
                           threads: int | None = None) -> dict:
    """Copy bandwidth in GB/s (1e9 bytes/s, bytes read + written) of a numpy copy of `nbytes`
    split over `threads` threads (default: every core), best of `repeats`."""
    import threading

    import numpy as np

    threads = threads or os.cpu_count() or 1
    src = np.ones(nbytes // 8, np.float64)
    dst = np.empty_like(src)
    edges = np.linspace(0, src.size, threads + 1).astype(int)

    def part(i: int) -> None:
        np.copyto(dst[edges[i]:edges[i + 1]], src[edges[i]:edges[i + 1]])

    best = float("inf")
    for _ in range(repeats):
        workers = [threading.Thread(target=part, args=(i,)) for i in range(threads)]
        t0 = time.perf_counter()
        for w in workers:
            w.start()
        for w in workers:
            w.join()
        best = min(best, time.perf_counter() - t0)
    return {"copy_gbps": round(2 * src.nbytes / best / 1e9, 3), "bytes": int(src.nbytes),
            "threads": threads, "repeats": repeats,
            "method": "numpy copy split over threads, best of repeats, (read + write) / time"}


def bandwidth_in_subprocess() -> dict:
    """measure_copy_bandwidth in a child process (its 2 GiB never count in our peak RSS)."""
    proc = subprocess.run([*SELF, "--measure-bandwidth"], capture_output=True,
                          text=True, timeout=600)
    if proc.returncode != 0:
        from tqjax.errors import TqjaxError

        raise TqjaxError(f"copy-bandwidth measurement failed: {last_line(proc.stderr)}")
    return json.loads(proc.stdout.strip().splitlines()[-1])


def last_line(text: str) -> str:
    lines = [ln for ln in text.strip().splitlines() if ln.strip()]
    return lines[-1] if lines else ""


# --- the bytes a decode step reads -----------------------------------------------------------

def param_read_bytes(params: object, vocab_size: int) -> int:
    """Parameter bytes one decode step reads: every leaf (a shared lut once), except that an
    untied input embedding (lm_head present) is only gathered, so only 1/V of it counts."""
    from tqjax.quant.accounting import unique_bytes

    total = unique_bytes(params)
    if params.lm_head is not None:
        embed = unique_bytes(params.embed)
        total -= embed - embed // vocab_size
    return total


def weight_types(params: object) -> dict[str, str]:
    """The storage type of the embedding, head and first layer's linears (e.g. "ArrayImpl",
    "QuantizedLinear", "GGMLLinear"): what a default --weights actually loaded."""
    first = params.layers[0]
    names = {"embed": params.embed, "lm_head": params.lm_head,
             **{f: getattr(first, f) for f in ("wq", "wk", "wv", "wo", "w_gate", "w_up",
                                                "w_down")}}
    return {k: type(v).__name__ for k, v in names.items() if v is not None}


def live_cache_bytes(cache: object, length: float) -> float:
    """Bytes of a cache that `length` live tokens occupy: per-slot bytes × length + the
    constant bytes (sink slots, recent rings, centres, rotations, codebooks)."""
    from tqjax.kv.cache import bytes_per_token, constant_bytes

    return bytes_per_token(cache) * length + constant_bytes(cache)


def mean_live_length(context: int, decode_tokens: int) -> float:
    """Mean number of tokens attended to over the timed steps: after two untimed warm-up steps
    at context, context+1, step i reads position context + 2 + i, i.e. context + 3 + i tokens."""
    return context + 3 + (decode_tokens - 1) / 2


def roofline(bytes_per_step: float, gbps: float, seconds_per_step: float) -> dict:
    """The memory roofline: the time the bytes take at `gbps` over the measured time."""
    t = bytes_per_step / (gbps * 1e9)
    return {"roofline_ms_per_token": round(1000 * t, 3),
            "roofline_tok_s": round(1 / t, 2),
            "roofline_fraction": round(t / seconds_per_step, 4)}


# --- tqjax -----------------------------------------------------------------------------------

def bench_tqjax(model: object, spec: object, prompt_tokens: int, context: int, slots: int,
                decode_tokens: int, repeats: int) -> dict:
    """Prefill `prompt_tokens` random tokens (median of `repeats`), then time `decode_tokens`
    greedy steps at position `context` `repeats` times (median); one cache alive at a time."""
    import jax
    import jax.numpy as jnp
    import numpy as np

    from tqjax.decode.generate import decode_step, new_cache, prefill
    from tqjax.decode.sampling import SamplingParams, row_keys, row_sampling
    from tqjax.quant.accounting import unique_bytes

    cfg = model.config
    rng = np.random.default_rng(0)
    tokens = rng.integers(0, cfg.vocab_size, (1, prompt_tokens)).astype(np.int32)
    lengths = np.asarray([prompt_tokens], np.int32)
    calibration = model.calibration(spec)

    def fresh_cache() -> object:
        cache = new_cache(model.params, cfg, spec, 1, slots, calibration)
        jax.block_until_ready(cache)
        return cache

    cache = fresh_cache()
    cache_alloc = unique_bytes(cache)
    prefill_times = []
    for i in range(repeats + 1):  # the first compiles
        if i:
            del cache
            cache = fresh_cache()
        t0 = time.perf_counter()
        logits, cache = prefill(model.params, cfg, tokens, lengths, cache)
        jax.block_until_ready(logits)
        if i:
            prefill_times.append(time.perf_counter() - t0)

    sampling = row_sampling([SamplingParams()])
    seen = jnp.zeros((1, cfg.vocab_size), bool)
    key = row_keys(0, 1)
    tok = jnp.asarray([1], jnp.int32)
    step_s, run_s = [], []
    for _ in range(repeats):
        for i in range(2):  # warm-up (the first call also compiles)
            tok, cache, seen, key, _ = decode_step(model.params, cfg, cache, tok,
                                                   jnp.asarray([context + i], jnp.int32), key,
                                                   sampling, seen)
            tok.block_until_ready()
        t_run = time.perf_counter()
        for i in range(decode_tokens):
            t0 = time.perf_counter()
            tok, cache, seen, key, _ = decode_step(model.params, cfg, cache, tok,
                                                   jnp.asarray([context + 2 + i], jnp.int32),
                                                   key, sampling, seen)
            int(tok[0])  # a real generation loop needs the token on the host every step
            step_s.append(time.perf_counter() - t0)
        run_s.append(time.perf_counter() - t_run)
    decode_s = statistics.median(run_s) / decode_tokens
    prefill_s = statistics.median(prefill_times)
    length = mean_live_length(context, decode_tokens)
    params_read = param_read_bytes(model.params, cfg.vocab_size)
    live = live_cache_bytes(cache, length)
    return {
        "prefill_tok_s": round(prompt_tokens / prefill_s, 2),
        "prefill_s_runs": [round(t, 4) for t in prefill_times],
        "decode_tok_s": round(1 / decode_s, 2),
        "decode_ms_per_token": round(1000 * decode_s, 3),
        "decode_tok_s_runs": [round(decode_tokens / t, 2) for t in run_s],
        "decode_ms_per_step_min": round(1000 * min(step_s), 3),
        "param_bytes": unique_bytes(model.params),
        "param_read_bytes": params_read,
        "cache_alloc_bytes": cache_alloc,
        "live_length": length,
        "live_cache_bytes": round(live),
        "bytes_per_step": round(params_read + live),
    }


# --- peers (each in its own process) ---------------------------------------------------------

def _peer_speeds(prompt_tokens: int, prefill_times: list[float], decode_tokens: int,
                 run_s: list[float]) -> dict:
    """A peer's speeds: prompt tokens per second of the median prefill, and decode tokens per
    second of the median run (each run `decode_tokens` steps), with every run's figure."""
    decode_s = statistics.median(run_s) / decode_tokens
    return {"prefill_tok_s": round(prompt_tokens / statistics.median(prefill_times), 2),
            "decode_tok_s": round(1 / decode_s, 2),
            "decode_ms_per_token": round(1000 * decode_s, 3),
            "decode_tok_s_runs": [round(decode_tokens / t, 2) for t in run_s]}


def peer_hf(model_path: str, prompt_tokens: int, context: int, decode_tokens: int,
            repeats: int) -> dict:
    """HF transformers, torch f32 on all cores: prefill of `prompt_tokens`, then decode at
    position `context` over a DynamicCache filled with random keys/values."""
    import torch
    import transformers
    from transformers import AutoModelForCausalLM, DynamicCache

    torch.set_num_threads(os.cpu_count() or 1)
    path = Path(model_path)
    kwargs = {"gguf_file": path.name} if path.suffix == ".gguf" else {}
    t0 = time.perf_counter()
    model = AutoModelForCausalLM.from_pretrained(str(path.parent if kwargs else path),
                                                 dtype=torch.float32, **kwargs).eval()
    load_s = time.perf_counter() - t0
    rss_load = proc_status_bytes("VmRSS")
    cfg = model.config
    g = torch.Generator().manual_seed(0)
    ids = torch.randint(0, cfg.vocab_size, (1, prompt_tokens), generator=g)
    kv_heads = getattr(cfg, "num_key_value_heads", cfg.num_attention_heads)
    head_dim = getattr(cfg, "head_dim", None) or cfg.hidden_size // cfg.num_attention_heads
    with torch.no_grad():
        prefill_times = []
        for i in range(repeats + 1):
            t0 = time.perf_counter()
            model(ids, use_cache=True)
            if i:
                prefill_times.append(time.perf_counter() - t0)
        run_s = []
        for _ in range(repeats):
            past = DynamicCache()
            for layer in range(cfg.num_hidden_layers):
                k = torch.randn(1, kv_heads, context, head_dim, generator=g)
                past.update(k, torch.randn_like(k), layer)
            tok = ids[:, -1:]
            for _ in range(2):
                out = model(tok, past_key_values=past, use_cache=True)
                past, tok = out.past_key_values, out.logits[:, -1:].argmax(-1)
            t0 = time.perf_counter()
            for _ in range(decode_tokens):
                out = model(tok, past_key_values=past, use_cache=True)
                past, tok = out.past_key_values, out.logits[:, -1:].argmax(-1)
            run_s.append(time.perf_counter() - t0)
            del past, out
    return {**_peer_speeds(prompt_tokens, prefill_times, decode_tokens, run_s),
            "load_s": round(load_s, 2), "rss_after_load_bytes": rss_load,
            "version": f"transformers {transformers.__version__}, torch {torch.__version__}",
            "threads": torch.get_num_threads(), "dtype": "float32"}


def peer_llamacpp(model_path: str, prompt_tokens: int, context: int, decode_tokens: int,
                  repeats: int) -> dict:
    """llama.cpp (llama-cpp-python) on the same .gguf, all threads: prefill of `prompt_tokens`,
    a prompt of `context` tokens evaluated, then single-token evals timed from that position."""
    import llama_cpp
    import numpy as np

    threads = os.cpu_count() or 1
    t0 = time.perf_counter()
    llm = llama_cpp.Llama(model_path=model_path, n_ctx=context + decode_tokens + 8,
                          n_batch=512, n_threads=threads, n_threads_batch=threads,
                          verbose=False)
    load_s = time.perf_counter() - t0
    rss_load = proc_status_bytes("VmRSS")
    rng = np.random.default_rng(0)
    vocab = llm.n_vocab()
    ids = [int(t) for t in rng.integers(0, vocab, max(context, prompt_tokens))]
    prefill_times = []
    for i in range(repeats + 1):
        llm.reset()
        t0 = time.perf_counter()
        llm.eval(ids[:prompt_tokens])
        if i:
            prefill_times.append(time.perf_counter() - t0)
    if context > prompt_tokens:
        llm.eval(ids[prompt_tokens:context])
    steps = [int(t) for t in rng.integers(0, vocab, decode_tokens + 2)]
    run_s = []
    for _ in range(repeats):
        llm.n_tokens = context  # back to the same position (eval drops the cache beyond it)
        for t in steps[:2]:
            llm.eval([t])
        t0 = time.perf_counter()
        for t in steps[2:]:
            llm.eval([t])
        run_s.append(time.perf_counter() - t0)
    return {**_peer_speeds(prompt_tokens, prefill_times, decode_tokens, run_s),
            "load_s": round(load_s, 2), "rss_after_load_bytes": rss_load,
            "version": f"llama-cpp-python {llama_cpp.__version__}", "threads": threads,
            "n_ctx": llm.n_ctx()}


def llama_bench_binary() -> str | None:
    """llama.cpp's own `llama-bench` ($LLAMA_BENCH, else on PATH), used for the llamacpp peer
    where the llama-cpp-python package is not installed (it has no wheel for every platform)."""
    import shutil

    path = os.environ.get("LLAMA_BENCH") or shutil.which("llama-bench")
    return path if path and os.access(path, os.X_OK) else None


def peer_llama_bench(binary: str, model_path: str, prompt_tokens: int, decode_tokens: int,
                     repeats: int) -> dict:
    """llama.cpp's `llama-bench` on the same .gguf, all threads: prompt processing of
    `prompt_tokens` and generation of `decode_tokens` (from an empty cache: builds without
    `-d` cannot start the generation at a depth) and the process's peak RSS."""
    threads = os.cpu_count() or 1
    cmd = [binary, "-m", model_path, "-p", str(prompt_tokens), "-n", str(decode_tokens),
           "-t", str(threads), "-r", str(repeats), "-o", "json"]
    with tempfile.TemporaryFile("w+") as out_f, tempfile.TemporaryFile("w+") as err_f:
        proc = subprocess.Popen(cmd, stdout=out_f, stderr=err_f, text=True)
        peak = 0  # VmHWM polled while it runs (getrusage's maxrss counts the forked parent)
        while proc.poll() is None:
            peak = max(peak, proc_status_bytes("VmHWM", proc.pid))
            time.sleep(0.05)
        code = proc.returncode
        out_f.seek(0), err_f.seek(0)
        out, err = out_f.read(), err_f.read()
    if code:
        return {"error": last_line(err) or f"llama-bench exit status {code}"}
    try:
        rows = json.loads(out)
        pp = next(r for r in rows if r["n_gen"] == 0)
        tg = next(r for r in rows if r["n_prompt"] == 0)
        float(tg["avg_ts"]), float(pp["avg_ts"])
    except (ValueError, TypeError, KeyError, StopIteration) as e:  # (JSONDecodeError: ValueError)
        return {"error": f"llama-bench's output is not the JSON expected "
                         f"({type(e).__name__}: {e}): {out.strip()[:100]!r}"}
    return {"prefill_tok_s": round(pp["avg_ts"], 2), "decode_tok_s": round(tg["avg_ts"], 2),
            "decode_ms_per_token": round(1000 / tg["avg_ts"], 3),
            "decode_tok_s_runs": [round(x, 2) for x in tg.get("samples_ts", [])],
            "decode_from_position": 0,
            "version": f"llama.cpp llama-bench {pp.get('build_commit', '?')} "
                       f"(build {pp.get('build_number', '?')})",
            "threads": threads, "type_k": pp.get("type_k"), "type_v": pp.get("type_v"),
            "command": " ".join(cmd), "peak_rss_bytes": peak}


def run_peer(name: str, model_path: str, prompt_tokens: int, context: int, decode_tokens: int,
             repeats: int) -> dict:
    """One peer in its own subprocess (so its peak RSS is its own); a missing package or a
    failure is a one-line note ({"note": ...} / {"error": ...}), never an exception."""
    import importlib.util

    missing = [m for m in PEER_MODULES[name] if importlib.util.find_spec(m) is None]
    binary = llama_bench_binary() if name == "llamacpp" else None
    if missing and binary and model_path.endswith(".gguf"):
        return peer_llama_bench(binary, model_path, prompt_tokens, decode_tokens, repeats)
    if missing:
        return {"note": f"not installed: {', '.join(missing)} (pip install 'tqjax[peers]', "
                        f"or -e '.[peers]' in a checkout)"}
    if name == "llamacpp" and not model_path.endswith(".gguf"):
        return {"note": "llama.cpp needs a .gguf model"}
    if name == "hf" and not (model_path.endswith(".gguf")
                             or (Path(model_path) / "config.json").is_file()):
        return {"note": "HF transformers needs a .gguf or an HF model directory"}
    cmd = [*SELF, "--peer-worker", name, "--model", model_path,
           "--prompt-tokens", str(prompt_tokens), "--context", str(context),
           "--decode-tokens", str(decode_tokens), "--repeats", str(repeats)]
    proc = subprocess.run(cmd, capture_output=True, text=True)
    if proc.returncode != 0:
        return {"error": last_line(proc.stderr) or f"exit status {proc.returncode}"}
    try:
        return dict(json.loads(proc.stdout.strip().splitlines()[-1]))
    except (ValueError, TypeError, IndexError):
        return {"error": f"the peer's output is not one JSON object: {proc.stdout[-100:]!r}"}


def peer_worker(args: argparse.Namespace) -> int:
    """The body of a peer subprocess: run one peer, add its VmHWM, print its JSON."""
    fn = {"hf": peer_hf, "llamacpp": peer_llamacpp}[args.peer_worker]
    out = fn(args.model, args.prompt_tokens, args.context, args.decode_tokens, args.repeats)
    out["peak_rss_bytes"] = proc_status_bytes("VmHWM")
    print_json(out)
    return 0


# --- command line ----------------------------------------------------------------------------

def parse_peers(text: str) -> list[str]:
    from tqjax.errors import TqjaxError

    names = [p.strip() for p in text.split(",") if p.strip()]
    bad = [p for p in names if p not in PEERS]
    if bad:
        raise TqjaxError(f"unknown peer {bad[0]!r} (choose from {', '.join(PEERS)})")
    return list(dict.fromkeys(names))


def check_sizes(args: argparse.Namespace, max_position: int | None = None) -> tuple[int, int]:
    """Validated (context, slots): the decode position and the cache's slot count."""
    from tqjax.decode.generate import PREFILL_CHUNK, padded_length
    from tqjax.errors import TqjaxError

    if min(args.prompt_tokens, args.decode_tokens, args.repeats) < 1:
        raise TqjaxError("--prompt-tokens, --decode-tokens and --repeats must be >= 1")
    context = args.context or args.prompt_tokens
    if context < args.prompt_tokens:
        raise TqjaxError(f"--context {context} is shorter than --prompt-tokens "
                         f"{args.prompt_tokens}")
    written = (args.prompt_tokens if args.prompt_tokens <= PREFILL_CHUNK
               else padded_length(args.prompt_tokens, PREFILL_CHUNK))  # whole prefill chunks
    need = max(context + args.decode_tokens + 2, written)
    slots = args.slots or need
    if slots < need:
        raise TqjaxError(f"--slots {slots} is too few: decode at {context} for "
                         f"{args.decode_tokens}+2 tokens needs {need}")
    if max_position is not None and context + args.decode_tokens + 2 > max_position:
        raise TqjaxError(f"context {context} + {args.decode_tokens + 2} decode tokens exceeds "
                         f"the model's {max_position} positions")
    return context, slots


def build_parser() -> ArgumentParser:
    p = ArgumentParser(prog="tqjax-bench", description=__doc__.split("\n\n")[0])
    add_model_args(p)
    p.add_argument("--prompt-tokens", type=int, default=128, help="prompt tokens prefilled")
    p.add_argument("--context", type=int, default=0,
                   help="cache position at which decode is timed (default: --prompt-tokens)")
    p.add_argument("--slots", type=int, default=0,
                   help="cache slots to allocate (default: just enough for the decode)")
    p.add_argument("--decode-tokens", type=int, default=64, help="tokens decoded per repeat")
    p.add_argument("--repeats", type=int, default=3, help="repeats (the median is reported)")
    p.add_argument("--peers", default="", metavar="hf,llamacpp",
                   help="also time these on the same model and sizes, each in a subprocess")
    p.add_argument("--hf", action="store_true", help="the same as --peers hf")
    p.add_argument("--bandwidth", type=positive_float, default=None, metavar="GBPS",
                   help="copy bandwidth measured before (GB/s, read + write); default: measure")
    p.add_argument("--out", default=None, help="also write the JSON to this file (atomically)")
    p.add_argument("--label", default=None, help="a free-form label stored in the JSON")
    p.add_argument("--measure-bandwidth", action="store_true", help=argparse.SUPPRESS)
    p.add_argument("--peer-worker", choices=PEERS, default=None, help=argparse.SUPPRESS)
    return p


def run(argv: list[str] | None = None) -> int:
    """Benchmark; returns the exit status (user errors raise TqjaxError)."""
    args = build_parser().parse_args(argv)
    if args.measure_bandwidth:
        print_json(measure_copy_bandwidth())
        return 0
    if args.peer_worker:
        return peer_worker(args)

    import jax

    import tqjax
    from tqjax.api import kv_footprint, resolve_path
    from tqjax.pallas.backend import check_backend, use_backend

    spec = cache_spec(args)
    peers = parse_peers(args.peers) + (["hf"] if args.hf and "hf" not in args.peers else [])
    context, slots = check_sizes(args)
    if args.out:
        check_writable(Path(args.out))  # before the run, not after it
    path = str(resolve_path(args.model))
    bandwidth = ({"copy_gbps": args.bandwidth, "method": "given (--bandwidth)"}
                 if args.bandwidth is not None else bandwidth_in_subprocess())

    mesh = model_mesh(args)
    rss_start = proc_status_bytes("VmRSS")
    t0 = time.perf_counter()
    model = tqjax.load(path, dtype=args.dtype, weights=args.weights, bpw=args.bpw,
                       quantize_embeddings=args.quantize_embeddings, mesh=mesh)
    jax.block_until_ready(model.params)
    load_s = time.perf_counter() - t0
    rss_load = proc_status_bytes("VmRSS")
    check_sizes(args, model.config.max_position)
    args.backend = check_backend(args.backend)  # "auto" resolved, now that JAX runs
    with use_backend(args.backend):
        tq = bench_tqjax(model, spec, args.prompt_tokens, context, slots, args.decode_tokens,
                         args.repeats)
    tq |= {"load_s": round(load_s, 2), "rss_start_bytes": rss_start,
           "rss_after_load_bytes": rss_load, "peak_rss_bytes": proc_status_bytes("VmHWM")}
    tq |= roofline(tq["bytes_per_step"], bandwidth["copy_gbps"],
                   tq["decode_ms_per_token"] / 1000)
    cfg = model.config
    types = weight_types(model.params)
    result = {
        "schema": SCHEMA, "label": args.label,
        "model": Path(path).name.removesuffix(".gguf"), "model_path": path,
        **git_info(), "jax": jax.__version__, "machine": machine_info(),
        "backend": args.backend, "device": str(jax.devices()[0]),
        "tp": args.tp, "devices": 1 if mesh is None else mesh.size,
        "dtype": args.dtype, "weights": args.weights or "none", "bpw": args.bpw,
        "quantize_embeddings": args.quantize_embeddings,
        "cache_type_k": spec.k, "cache_type_v": spec.v,
        "kv": spec.k if spec.k == spec.v else f"{spec.k}/{spec.v}",
        "prompt_tokens": args.prompt_tokens, "context": context, "slots": slots,
        "decode_tokens": args.decode_tokens, "repeats": args.repeats,
        "weight_types": types,
        "weights_loaded": ("dense" if set(types.values()) <= {"ArrayImpl"}
                           else "+".join(sorted(set(types.values()) - {"ArrayImpl"}))),
        "config": {"layers": cfg.num_layers, "heads": cfg.num_heads,
                   "kv_heads": cfg.num_kv_heads, "head_dim": cfg.head_dim,
                   "vocab": cfg.vocab_size, "tied_embeddings": cfg.tie_embeddings},
        "bandwidth": bandwidth,
        "bytes_per_step_formula": "param_read_bytes + kv bytes per slot * live_length + kv "
                                  "constant bytes; live_length = context + 3 + "
                                  "(decode_tokens - 1) / 2; an untied input embedding counts "
                                  "1/V",
        "tqjax": tq,
        **kv_footprint(model, spec, context),
        "peers": {},
    }
    del model
    for name in peers:
        peer = run_peer(name, path, args.prompt_tokens, context, args.decode_tokens,
                        args.repeats)
        result["peers"][name] = peer
        if "decode_tok_s" in peer:
            peer["tqjax_decode_ratio"] = round(tq["decode_tok_s"] / peer["decode_tok_s"], 3)
            peer["tqjax_prefill_ratio"] = round(tq["prefill_tok_s"] / peer["prefill_tok_s"], 3)
    print_json(result)  # (first: a failed write of --out does not lose the run)
    if args.out:
        from tqjax.atomic import write_json

        write_json(args.out, result)
    return 0


def main(argv: list[str] | None = None) -> None:
    """Entry point `tqjax-bench`: one-line errors, exit 2 on bad input."""
    run_main(lambda: run(argv))


if __name__ == "__main__":
    main()
