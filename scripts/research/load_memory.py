"""Peak memory of `tqjax.load` per model and mode; prints one JSON line per run.

Each (model, mode) runs in a fresh subprocess that imports jax and tqjax, runs one tiny jitted op
(the runtime base: its VmHWM then), loads the model and reports, from /proc/self/status:
  base_hwm   peak RSS before the load (the runtime's own base), bytes
  peak_hwm   peak RSS after the load (and after the generate, with --generate), bytes
  rss        RSS after the load, bytes
  gen_rss    RSS after the generate (with --generate): what the running program holds, bytes
  params     resident parameter bytes (every array leaf of model.params counted once)
  ratio      (peak_hwm - base_hwm) / params  (the issue asks for <= 1.3)
Modes: float32, bfloat16, float16 (dtype), gguf (`weights="gguf"`, blocks kept), int8, tq4, ...
(`weights=`, quantized on the fly; "tq4+emb": with `quantize_embeddings`; "mixed-4.25": mixed
at 4.25 bpw), and ckpt:PATH (a
saved quantized checkpoint; the model is then PATH). `--generate N` also runs an N-token greedy
generate after the load. `--breakdown` adds where the load's growth over the base lies, after
the load (bytes, "breakdown"): anonymous and file-backed pages (/proc/self/smaps_rollup; file:
the code pages of the libraries the load ran), the C heap's allocations (glibc `mallinfo2`,
in use), the params, and the tokenizer (RSS freed by dropping it, measured last).

    python scripts/research/load_memory.py -m smollm2-135m-instruct qwen2.5-coder-0.5b-instruct \
        --modes float32 bfloat16 float16 gguf
    python scripts/research/load_memory.py -m - --modes ckpt:/tmp/qwen-tq4 --generate 64
    python scripts/research/load_memory.py --hf-copy /tmp/smol-hf -m smollm2-135m-instruct
    python scripts/research/load_memory.py -m /tmp/smol-hf --modes float32 bfloat16

`--hf-copy DIR` writes the (dequantized) model as an HF safetensors directory, float32, to
measure the safetensors path on a real-sized model.
"""

from __future__ import annotations

import argparse
import json
import os
import subprocess
import sys
import time


def status_bytes(key: str) -> int:
    """A /proc/self/status memory field (VmHWM, VmRSS) in bytes."""
    with open("/proc/self/status") as f:
        for line in f:
            if line.startswith(key + ":"):
                return int(line.split()[1]) * 1024
    return 0


def rollup() -> dict[str, int]:
    """Resident bytes of the process, anonymous and file-backed (/proc/self/smaps_rollup)."""
    fields = {}
    with open("/proc/self/smaps_rollup") as f:
        for line in f:
            key, _, rest = line.partition(":")
            if key in ("Rss", "Anonymous"):
                fields[key] = int(rest.split()[0]) * 1024
    return {"anon": fields["Anonymous"], "file": fields["Rss"] - fields["Anonymous"]}


def malloc_in_use() -> int:
    """Bytes the C heap has handed out and not had back (glibc `mallinfo2`: arenas + mmap)."""
    import ctypes

    class MallInfo2(ctypes.Structure):
        _fields_ = [(n, ctypes.c_size_t) for n in ("arena", "ordblks", "smblks", "hblks",
                                                   "hblkhd", "usmblks", "fsmblks", "uordblks",
                                                   "fordblks", "keepcost")]

    libc = ctypes.CDLL(None)
    libc.mallinfo2.restype = MallInfo2
    info = libc.mallinfo2()
    return info.uordblks + info.hblkhd


def child(model: str, mode: str, generate: int, mmap_threshold: bool,
          breakdown: bool = False) -> dict:
    import jax
    import jax.numpy as jnp

    import tqjax

    if mmap_threshold:
        from tqjax.host import release_large_buffers

        release_large_buffers()
    jax.jit(lambda x: x * 2 + 1)(jnp.ones(8)).block_until_ready()
    base = status_bytes("VmHWM")
    pages, heap = (rollup(), malloc_in_use()) if breakdown else ({}, 0)
    kwargs: dict = {}
    if mode.startswith("ckpt:"):
        model = mode.removeprefix("ckpt:")
    elif mode in ("float32", "bfloat16", "float16"):
        kwargs["dtype"] = mode
    else:  # a weights method, "+emb": with quantize_embeddings; "mixed-4.25": mixed at 4.25 bpw
        method = mode.removesuffix("+emb")
        if method.startswith("mixed-"):
            method, kwargs["bpw"] = "mixed", float(method.removeprefix("mixed-"))
        kwargs["weights"] = method
        kwargs["quantize_embeddings"] = mode.endswith("+emb")
    t0 = time.perf_counter()
    m = tqjax.load(model, **kwargs)
    jax.block_until_ready(m.params)
    load_s = time.perf_counter() - t0
    seen, params = set(), 0
    for leaf in jax.tree_util.tree_leaves(m.params):
        if id(leaf) not in seen:
            seen.add(id(leaf))
            params += leaf.nbytes
    out = {"model": model, "mode": mode, "base_hwm": base, "load_hwm": status_bytes("VmHWM"),
           "rss": status_bytes("VmRSS"), "params": params, "load_s": round(load_s, 1)}
    if breakdown:
        now = rollup()
        out["breakdown"] = {"anon": now["anon"] - pages["anon"],
                            "file": now["file"] - pages["file"],
                            "malloc_in_use": malloc_in_use() - heap, "params": params}
    if generate:
        tqjax.generate(m, "Once upon a time", max_new_tokens=generate)
        out["gen_rss"] = status_bytes("VmRSS")
    out["peak_hwm"] = status_bytes("VmHWM")
    out["ratio"] = round((out["load_hwm"] - base) / params, 3)
    if generate:
        out["generate"] = generate
    if breakdown and m.tokenizer is not None:
        import dataclasses
        import gc

        from tqjax.host import trim_heap

        rss = status_bytes("VmRSS")
        m = dataclasses.replace(m, tokenizer=None)
        gc.collect()
        trim_heap()
        out["breakdown"]["tokenizer"] = rss - status_bytes("VmRSS")
    return out


def hf_copy(model: str, out: str) -> None:
    """Write `model` (dequantized, f32) as an HF directory: config.json + model.safetensors."""
    from pathlib import Path

    import numpy as np
    from safetensors.numpy import save_file

    import tqjax
    from tqjax.models.loading import GGUF_LAYER_NAMES

    m = tqjax.load(model)
    cfg, p = m.config, m.params
    fields = {"attn_norm": "attn_norm.weight", "mlp_norm": "ffn_norm.weight",
              "wq": "attn_q.weight", "wk": "attn_k.weight", "wv": "attn_v.weight",
              "wo": "attn_output.weight", "w_gate": "ffn_gate.weight", "w_up": "ffn_up.weight",
              "w_down": "ffn_down.weight", "bq": "attn_q.bias", "bk": "attn_k.bias",
              "bv": "attn_v.bias", "q_norm": "attn_q_norm.weight", "k_norm": "attn_k_norm.weight"}
    tensors = {"model.embed_tokens.weight": np.asarray(p.embed),
               "model.norm.weight": np.asarray(p.final_norm)}
    if p.lm_head is not None:
        tensors["lm_head.weight"] = np.ascontiguousarray(np.asarray(p.lm_head).T)
    for i, lp in enumerate(p.layers):
        for f, g in fields.items():
            v = getattr(lp, f)
            if v is not None:
                v = np.asarray(v)
                tensors[f"model.layers.{i}.{GGUF_LAYER_NAMES[g]}"] = np.ascontiguousarray(
                    v.T if v.ndim == 2 else v)
    arch = {"llama": "LlamaForCausalLM", "qwen2": "Qwen2ForCausalLM"}[cfg.arch]
    config = {"architectures": [arch], "vocab_size": cfg.vocab_size,
              "hidden_size": cfg.hidden_size, "intermediate_size": cfg.intermediate_size,
              "num_hidden_layers": cfg.num_layers, "num_attention_heads": cfg.num_heads,
              "num_key_value_heads": cfg.num_kv_heads, "head_dim": cfg.head_dim,
              "rms_norm_eps": cfg.rms_eps, "rope_theta": cfg.rope_theta,
              "max_position_embeddings": cfg.max_position,
              "tie_word_embeddings": cfg.tie_embeddings}
    Path(out).mkdir(parents=True, exist_ok=True)
    (Path(out) / "config.json").write_text(json.dumps(config, indent=1))
    save_file(tensors, str(Path(out) / "model.safetensors"))


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--model", "-m", nargs="+", default=["smollm2-135m-instruct"])
    p.add_argument("--modes", nargs="+", default=["float32", "bfloat16", "float16"])
    p.add_argument("--generate", type=int, default=0, help="tokens to generate after the load")
    p.add_argument("--mmap-threshold", action="store_true",
                   help="serve large heap blocks from mmap as the CLI scripts do "
                        "(tqjax.host.release_large_buffers)")
    p.add_argument("--breakdown", action="store_true",
                   help="also report where the load's growth lies (anonymous and file pages, "
                        "the C heap, params, the tokenizer)")
    p.add_argument("--hf-copy", metavar="DIR", help="write the first --model as an HF "
                   "safetensors directory (f32) and exit")
    p.add_argument("--child", nargs=2, metavar=("MODEL", "MODE"), help=argparse.SUPPRESS)
    args = p.parse_args()
    if args.hf_copy:
        hf_copy(args.model[0], args.hf_copy)
        return
    if args.child:
        print(json.dumps(child(*args.child, args.generate, args.mmap_threshold,
                               args.breakdown)), flush=True)
        return
    env = dict(os.environ, JAX_PLATFORMS=os.environ.get("JAX_PLATFORMS", "cpu"))
    for model in args.model:
        for mode in args.modes:
            cmd = [sys.executable, __file__, "--child", model, mode, "--generate",
                   str(args.generate)] + (["--mmap-threshold"] if args.mmap_threshold else [])
            cmd += ["--breakdown"] if args.breakdown else []
            proc = subprocess.run(cmd, capture_output=True, text=True, env=env)
            if proc.returncode != 0:
                lines = proc.stderr.strip().splitlines() or ["(no output)"]
                print(json.dumps({"model": model, "mode": mode, "error": lines[-1]}), flush=True)
            else:
                print(proc.stdout.strip().splitlines()[-1], flush=True)


if __name__ == "__main__":
    main()
