"""Check the memory planner against real runs, and fit its runtime constants.

Check (default): for each case (model, weights, KV, budget) the planner's longest context for
that budget is filled by a `scripts/bench.py` subprocess (prompt = context - 6 tokens, 4 timed
decode steps, one repeat); its peak RSS (VmHWM) must be under the budget and within 10% of the
prediction. The exact parts are compared too: the planner's parameter bytes against the loaded
pytree's, its cache bytes against the allocated cache's. Exit status 1 when a case fails.

Fit (`--fit`): bench.py runs at two prompt lengths on two models (f32 weights and cache); the
residual peak RSS - params - cache is fitted (least squares) as base + b·chunk·hidden, the
constants of `tqjax.planner.RUNTIME`; the same runs with bf16 and GGUF-block weights report how
far they fall from that fit; runs with turbo caches measure what their calibration pass (and
their larger decode step) add beyond it, per weights preset (`calibrated`: the largest per
vocabulary entry of each).
A vocabulary term a·batch·vocab (logits, sampling) is not measurable at batch 1 (bench.py
runs one sequence; its fitted coefficient came out negative) and is left at 0.

    python scripts/plan_check.py --out results/current/plan/check.json
    python scripts/plan_check.py --fit --out results/current/plan/fit.json
    python scripts/plan_check.py --cases smollm2-135m-instruct:f32:f32:1GiB
"""

from __future__ import annotations

import json
import os
import subprocess
import sys
import tempfile
import time
from pathlib import Path

from tqjax.cli import ArgumentParser, print_json, run_main

REPO = Path(__file__).resolve().parents[1]
SMOL, QWEN = "smollm2-135m-instruct", "qwen2.5-coder-0.5b-instruct"
# model:weights:kv:budget
# budgets chosen (with the planner's constants of this commit) to plan 3072, 8192, 8192 and
# 5120 tokens on SmolLM2 with f32 weights, 5632, 19968 and 8192 on Qwen; 4096 and 8192 with
# GGUF blocks and bf16 weights on each
CASES = (
    f"{SMOL}:f32:f32:1123MiB",
    f"{SMOL}:f32:q8:1079MiB",
    f"{SMOL}:f32:turbo4/turbo3:1116MiB",
    f"{SMOL}:f32:bf16:1099MiB",
    f"{QWEN}:f32:f32:3128MiB",
    f"{QWEN}:f32:q8:3116MiB",
    f"{QWEN}:f32:turbo3:3288MiB",
    f"{SMOL}:gguf:f32:725MiB",
    f"{SMOL}:bf16:turbo4:830MiB",
    f"{QWEN}:gguf:turbo3:1303MiB",
    f"{QWEN}:bf16:f32:1816MiB",
)
# model, prompt tokens, slots for the fit (f32 weights and cache)
FIT_RUNS = ((SMOL, 58, 64), (SMOL, 1018, 1024), (QWEN, 58, 64), (QWEN, 1018, 1024))
# bf16 and GGUF-block weights with an f32 cache: how far they fall from that fit (no term of
# their own since stop 46)
FIT_WEIGHT_RUNS = tuple((model, weights, prompt, slots) for weights in ("bf16", "gguf")
                        for model, prompt, slots in FIT_RUNS)
# model, weights, turbo cache, prompt tokens, slots for the calibration term (per weights)
FIT_TURBO_RUNS = ((SMOL, "f32", "turbo4", 1018, 1024), (SMOL, "f32", "turbo4/turbo3", 1018, 1024),
                  (QWEN, "f32", "turbo3", 1018, 1024),
                  (SMOL, "bf16", "turbo4", 1018, 1024), (QWEN, "bf16", "turbo3", 1018, 1024),
                  (SMOL, "gguf", "turbo4/turbo3", 1018, 1024), (QWEN, "gguf", "turbo3", 1018, 1024))
TOLERANCE = 0.10
DECODE_TOKENS = 4


def weight_args(weights: str) -> list[str]:
    """bench.py flags for a planner weights preset (on-the-fly quantization is not a resident
    format: its GPTQ pass dominates the peak, so only stored formats are run here)."""
    flags = {"f32": ["--dtype", "float32"], "bf16": ["--dtype", "bfloat16"],
             "gguf": ["--weights", "gguf"]}
    if weights not in flags:
        from tqjax.errors import TqjaxError

        raise TqjaxError(f"plan_check runs weights f32, bf16 or gguf, not {weights!r}")
    return flags[weights]


def bench(model: str, weights: str, kv: str, prompt: int, slots: int) -> dict:
    """One bench.py subprocess; its JSON (peak_rss_bytes = VmHWM, param_bytes,
    cache_alloc_bytes)."""
    with tempfile.TemporaryDirectory() as tmp:
        out = Path(tmp) / "bench.json"
        cmd = [sys.executable, str(REPO / "scripts" / "bench.py"), "-m", model,
               *weight_args(weights), "--kv", kv, "--prompt-tokens", str(prompt),
               "--slots", str(slots), "--decode-tokens", str(DECODE_TOKENS), "--repeats", "1",
               "--bandwidth", "10", "--out", str(out)]
        t0 = time.perf_counter()
        proc = subprocess.run(cmd, capture_output=True, text=True, check=False,
                              env={**os.environ, "PYTHONPATH": str(REPO)})
        if proc.returncode != 0:
            from tqjax.errors import TqjaxError

            tail = (proc.stderr.strip().splitlines() or ["?"])[-1]
            raise TqjaxError(f"bench.py failed for {model} {weights} {kv}: {tail}")
        result = json.loads(out.read_text())
        result["wall_s"] = round(time.perf_counter() - t0, 1)
        return result


def check_case(case: str) -> dict:
    """Plan one case, run its planned context, compare."""
    from tqjax.errors import TqjaxError
    from tqjax.planner import parse_bytes, plan

    try:
        model, weights, kv, budget = case.rsplit(":", 3)
    except ValueError:
        raise TqjaxError(f"a case is model:weights:kv:budget, got {case!r}") from None
    weight_args(weights)
    row = plan(model, budget, weights=(weights,), kv=(kv,)).rows[0]
    if row.max_context < 64:
        raise TqjaxError(f"{case}: nothing fits the budget")
    r = bench(model, weights, kv, row.max_context - 6, row.max_context)
    peak = r["tqjax"]["peak_rss_bytes"] if "tqjax" in r else r["peak_rss_bytes"]
    tq = r.get("tqjax", r)
    budget_b = parse_bytes(budget)
    err = peak / row.peak_bytes - 1
    return {
        "case": case, "model": model, "weights": weights, "kv": kv, "budget_bytes": budget_b,
        "planned_context": row.max_context, "predicted_peak_bytes": row.peak_bytes,
        "measured_peak_bytes": peak, "relative_error": round(err, 4),
        "under_budget": peak <= budget_b, "within_tolerance": abs(err) <= TOLERANCE,
        "planned_param_bytes": row.param_bytes, "loaded_param_bytes": tq["param_bytes"],
        "planned_cache_bytes": round(row.max_context * row.kv_bytes_per_token
                                     + row.kv_constant_bytes),
        "allocated_cache_bytes": tq["cache_alloc_bytes"], "bench_wall_s": r["wall_s"],
        "loadavg_1min": os.getloadavg()[0],
    }


def fit() -> dict:
    """Least-squares fit of the runtime working set over FIT_RUNS."""
    import numpy as np

    from tqjax.fetch import fetch_model
    from tqjax.planner import _tensor_table

    rows, runs = [], []
    for model, prompt, slots in FIT_RUNS:
        config, _ = _tensor_table(fetch_model(model, progress=False))
        r = bench(model, "f32", "f32", prompt, slots)
        tq = r.get("tqjax", r)
        resid = tq["peak_rss_bytes"] - tq["param_bytes"] - tq["cache_alloc_bytes"]
        chunk = min(512, slots)
        rows.append((1.0, config.vocab_size, chunk * config.hidden_size, resid))
        runs.append({"model": model, "prompt_tokens": prompt, "slots": slots,
                     "peak_rss_bytes": tq["peak_rss_bytes"], "param_bytes": tq["param_bytes"],
                     "cache_alloc_bytes": tq["cache_alloc_bytes"], "residual_bytes": resid,
                     "wall_s": r["wall_s"]})
        print(json.dumps(runs[-1]), file=sys.stderr, flush=True)
    a = np.array([(r[0], r[2]) for r in rows])
    y = np.array([r[3] for r in rows])
    coef, *_ = np.linalg.lstsq(a, y, rcond=None)
    pred = a @ coef
    def beyond(model: str, weights: str, kv: str, prompt: int, slots: int) -> dict:
        """One run's residual beyond the fit (peak - params - cache - fitted runtime)."""
        config, _ = _tensor_table(fetch_model(model, progress=False))
        tq = (r := bench(model, weights, kv, prompt, slots)).get("tqjax", r)
        resid = tq["peak_rss_bytes"] - tq["param_bytes"] - tq["cache_alloc_bytes"]
        extra = resid - coef[0] - coef[1] * min(512, slots) * config.hidden_size
        row = {"model": model, "weights": weights, "kv": kv, "prompt_tokens": prompt,
               "slots": slots, "peak_rss_bytes": tq["peak_rss_bytes"],
               "param_bytes": tq["param_bytes"], "cache_alloc_bytes": tq["cache_alloc_bytes"],
               "residual_bytes": resid, "beyond_fit_bytes": float(extra), "wall_s": r["wall_s"]}
        print(json.dumps(row), file=sys.stderr, flush=True)
        return row

    weights_runs = [beyond(m, w, "f32", p, s) for m, w, p, s in FIT_WEIGHT_RUNS]
    turbo = [beyond(*run) for run in FIT_TURBO_RUNS]  # what a turbo cache's calibration adds
    calibrated: dict[str, float] = {}  # bytes per vocabulary entry, the largest per preset
    for t in turbo:
        config, _ = _tensor_table(fetch_model(t["model"], progress=False))
        calibrated[t["weights"]] = max(0.0, calibrated.get(t["weights"], 0.0),
                                       t["beyond_fit_bytes"] / config.vocab_size)
    return {"runs": runs, "base": float(coef[0]), "per_logit": 0.0,
            "per_activation": float(coef[1]),
            "max_abs_residual_bytes": float(np.abs(pred - y).max()),
            "weights_runs": weights_runs,
            "weights_beyond_fit_bytes": [min(w["beyond_fit_bytes"] for w in weights_runs),
                                         max(w["beyond_fit_bytes"] for w in weights_runs)],
            "turbo_runs": turbo, "calibrated": calibrated,
            "command": "python scripts/plan_check.py --fit"}


def main() -> int:
    from tqjax.atomic import write_json

    p = ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--cases", nargs="+", default=list(CASES), help="model:weights:kv:budget")
    p.add_argument("--fit", action="store_true", help="fit the runtime constants instead")
    p.add_argument("--out", type=Path, default=None, help="also write the JSON here")
    args = p.parse_args()
    if args.fit:
        result = fit()
    else:
        checks = []
        for case in args.cases:
            checks.append(check_case(case))
            print(json.dumps(checks[-1]), file=sys.stderr, flush=True)
        result = {"tolerance": TOLERANCE, "checks": checks,
                  "all_pass": all(c["under_budget"] and c["within_tolerance"]
                                  and c["planned_param_bytes"] == c["loaded_param_bytes"]
                                  and c["planned_cache_bytes"] == c["allocated_cache_bytes"]
                                  for c in checks)}
    if args.out:
        write_json(args.out, result)
    print_json(result)
    return 0 if result.get("all_pass", True) else 1  # (a check that fails is a failed run)


if __name__ == "__main__":
    run_main(main)
