"""Peak memory of `tqjax.load` per model and mode; prints one JSON line per run.

Each (model, mode) runs in a fresh subprocess that imports jax and tqjax, runs one tiny jitted op
(the runtime base: its VmHWM then), loads the model and reports, from /proc/self/status:
  base_hwm   peak RSS before the load (the runtime's own base), bytes
  peak_hwm   peak RSS after the load (and after the generate, with --generate), bytes
  rss        RSS after the load, bytes
  params     resident parameter bytes (every array leaf of model.params counted once)
  ratio      (peak_hwm - base_hwm) / params  (the issue asks for <= 1.3)
Modes: float32, bfloat16, float16 (dtype), gguf (`weights="gguf"`, blocks kept), int8, tq4, ...
(`weights=`, quantized on the fly), and ckpt:PATH (a saved quantized checkpoint; the model is
then PATH). `--generate N` also runs an N-token greedy generate after the load.

    python scripts/research/load_memory.py -m smollm2-135m-instruct qwen2.5-coder-0.5b-instruct \
        --modes float32 bfloat16 float16 gguf
    python scripts/research/load_memory.py -m - --modes ckpt:/tmp/qwen-tq4 --generate 64
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


def child(model: str, mode: str, generate: int, mmap_threshold: bool) -> dict:
    import jax
    import jax.numpy as jnp

    import tqjax

    if mmap_threshold:
        from tqjax.cli import release_large_buffers

        release_large_buffers()
    jax.jit(lambda x: x * 2 + 1)(jnp.ones(8)).block_until_ready()
    base = status_bytes("VmHWM")
    kwargs: dict = {}
    if mode.startswith("ckpt:"):
        model = mode.removeprefix("ckpt:")
    elif mode in ("float32", "bfloat16", "float16"):
        kwargs["dtype"] = mode
    else:
        kwargs["weights"] = mode
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
    if generate:
        tqjax.generate(m, "Once upon a time", max_new_tokens=generate)
    out["peak_hwm"] = status_bytes("VmHWM")
    out["ratio"] = round((out["load_hwm"] - base) / params, 3)
    if generate:
        out["generate"] = generate
    return out


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--model", "-m", nargs="+", default=["smollm2-135m-instruct"])
    p.add_argument("--modes", nargs="+", default=["float32", "bfloat16", "float16"])
    p.add_argument("--generate", type=int, default=0, help="tokens to generate after the load")
    p.add_argument("--mmap-threshold", action="store_true",
                   help="serve large heap blocks from mmap as the CLI scripts do "
                        "(tqjax.cli.release_large_buffers)")
    p.add_argument("--child", nargs=2, metavar=("MODEL", "MODE"), help=argparse.SUPPRESS)
    args = p.parse_args()
    if args.child:
        print(json.dumps(child(*args.child, args.generate, args.mmap_threshold)), flush=True)
        return
    env = dict(os.environ, JAX_PLATFORMS=os.environ.get("JAX_PLATFORMS", "cpu"))
    for model in args.model:
        for mode in args.modes:
            cmd = [sys.executable, __file__, "--child", model, mode, "--generate",
                   str(args.generate)] + (["--mmap-threshold"] if args.mmap_threshold else [])
            proc = subprocess.run(cmd, capture_output=True, text=True, env=env)
            if proc.returncode != 0:
                lines = proc.stderr.strip().splitlines() or ["(no output)"]
                print(json.dumps({"model": model, "mode": mode, "error": lines[-1]}), flush=True)
            else:
                print(proc.stdout.strip().splitlines()[-1], flush=True)


if __name__ == "__main__":
    main()
