"""Where a load's RSS peaks: `load_memory.py`'s child for one model and mode, with every
quantizer step (`drop_programs`, Gram, Hessian factor, `quantize_linear`, the Fisher pass,
the stacking) logged with its RSS, and the child's RSS sampled every 10 ms from outside.

    python scripts/research/load_phases.py -m qwen2.5-coder-0.5b-instruct --mode mixed-5.5+emb \
        --min-mib 500

Prints the run's figures (as `load_memory.py --breakdown` does), then one line per logged step:
seconds into the load, RSS over the base at the step, and the highest sample until the next
step (MiB), for steps whose highest sample reaches --min-mib and every program drop.
"""

from __future__ import annotations

import argparse
import bisect
import json
import os
import subprocess
import sys
import tempfile
import time
from typing import Any

from tqjax.commands.bench import proc_status_bytes

MIB = 2**20


def child(model: str, mode: str) -> None:
    """Run the load with its steps logged to stderr ("EVENT time rss label")."""
    sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
    import load_memory

    import tqjax.api as api
    import tqjax.models.quantize as mq

    def log(label: str) -> None:
        print(f"EVENT {time.time():.3f} {proc_status_bytes('VmRSS')} {label}", file=sys.stderr,
              flush=True)

    def wrap(module: Any, name: str, label: str) -> None:
        f = getattr(module, name)

        def logged(*args: Any, **kwargs: Any) -> Any:
            shape = (f" {getattr(args[0], 'shape', '')} {args[1]}"
                     if name == "quantize_linear" else "")
            log(f"> {label}{shape}")
            out = f(*args, **kwargs)
            log(f"< {label}")
            return out

        setattr(module, name, logged)

    for name in ("quantize_linear", "hessian_factor", "_gram", "fisher_diagonal",
                 "weight_formats", "drop_programs", "_window_rows"):
        wrap(mq, name, name)
    for name in ("drop_programs", "stack_layers", "quantize_params", "open_model"):
        wrap(api, name, "api." + name)
    log("start")
    out = load_memory.child(model, mode, 0, mmap_threshold=True, breakdown=True)
    print("RESULT " + json.dumps(out), file=sys.stderr, flush=True)


def report(samples: list[tuple[float, int]], log: str, min_mib: float) -> None:
    events, result = [], None
    for line in log.splitlines():
        if line.startswith("EVENT "):
            _, t, r, label = line.split(" ", 3)
            events.append((float(t), int(r), label))
        elif line.startswith("RESULT "):
            result = json.loads(line.removeprefix("RESULT "))
    if result is None or not events:
        last = [line for line in log.splitlines() if line.strip()
                and not line.startswith("EVENT ")][-1:] or ["no output"]
        print(f"error: the load did not finish: {last[0]}", file=sys.stderr)
        raise SystemExit(2)
    base, params = result["base_hwm"], result["params"]
    peak = max(r for _, r in samples)
    print(json.dumps({**result, "sampled_peak_ratio": round((peak - base) / params, 3)}))
    times = [t for t, _ in samples]
    t0 = events[0][0]
    for (t, r, label), (t_next, _, _) in zip(events, [*events[1:], (times[-1], 0, "")],
                                              strict=True):
        window = samples[bisect.bisect_left(times, t):bisect.bisect_right(times, t_next)]
        high = max((s for _, s in window), default=r)
        if (high - base) / MIB >= min_mib or "drop_programs" in label or "api." in label:
            print(f"{t - t0:7.1f} s  at {(r - base) / MIB:6.1f}  high {(high - base) / MIB:6.1f} "
                  f"MiB  {label}")


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--model", "-m", default="qwen2.5-coder-0.5b-instruct")
    p.add_argument("--mode", default="mixed-5.5+emb", help="a load_memory.py mode")
    p.add_argument("--min-mib", type=float, default=0.0,
                   help="print only steps whose highest sample reaches this (MiB over the base)")
    p.add_argument("--child", action="store_true", help=argparse.SUPPRESS)
    a = p.parse_args()
    if a.child:
        child(a.model, a.mode)
        return
    with tempfile.TemporaryFile("w+") as err:
        proc = subprocess.Popen([sys.executable, __file__, "--child", "-m", a.model,
                                 "--mode", a.mode], stderr=err)
        samples = []
        while proc.poll() is None:
            samples.append((time.time(), proc_status_bytes("VmRSS", proc.pid)))
            time.sleep(0.01)
        err.seek(0)
        report(samples, err.read(), a.min_mib)


if __name__ == "__main__":
    main()
