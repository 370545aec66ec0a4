"""Regenerate results/current/ (and the docs/ plots) with one command: every step is one
committed script run in its own process, and every file it writes names the commit, the JAX
version and the machine.

    python scripts/results.py                    # everything (hours on a 2-core CPU)
    python scripts/results.py --only golden,weights --models smollm2-135m-instruct
    python scripts/results.py --dry-run          # the commands, nothing run

Steps (in order; outputs under results/current/):
  golden   golden_report.json: logits, greedy text and perplexity against HF transformers
  kv       kv/kv_table.jsonl: KV-cache ΔPPL, KL, top-1 per cache type (scripts/kv_table.py)
  weights  weights/weights_<short>.{json,md}: the weight formats against f32, with the
           first-order split (scripts/weights_table.py)
  bench    bench/<model>/*.json: decode speed and memory sweeps (scripts/bench_sweep.py)
  plan     plan/check.json: the memory planner against measured runs (scripts/plan_check.py)
  plots    docs/*.png from bench/ and weights/ (scripts/plot.py)

A JSON a step writes without a "commit" key gets a "provenance" object (commit, dirty, JAX,
machine, command); results/current/manifest.json lists every step run, its command, wall
time and the files it wrote. A step that fails stops the run (exit 1) unless --keep-going.
"""

from __future__ import annotations

import json
import shlex
import subprocess
import sys
import time
from pathlib import Path

from tqjax.cli import ArgumentParser, print_json, run_main
from tqjax.errors import TqjaxError

ROOT = Path(__file__).resolve().parent.parent
CURRENT = ROOT / "results" / "current"
MODELS = ("smollm2-135m-instruct", "qwen2.5-coder-0.5b-instruct")
SHORT = {"smollm2-135m-instruct": "smollm2", "qwen2.5-coder-0.5b-instruct": "qwen"}
STEPS = ("golden", "kv", "weights", "bench", "plan", "plots")
KV_TYPES = "bf16,q8,turbo4,turbo4/turbo3,turbo3,turbo4:naive"
WEIGHT_RUNS = "int8,int4,int4-affine,tq4,mixed-4.25"
TEXTS_KV = "shakespeare:hamlet,python-stdlib"
TEXTS_WEIGHTS = "shakespeare:macbeth,python-stdlib"


def short_name(model: str) -> str:
    """The file-name form of a model name (weights_<short>.json)."""
    return SHORT.get(model, Path(model).name.removesuffix(".gguf"))


def commands(step: str, models: list[str]) -> list[tuple[list[str], Path | None]]:
    """(argv after `python`, file that receives stdout or None) for each process of a step."""
    s, out = str(ROOT / "scripts"), CURRENT
    if step == "golden":
        return [([f"{s}/golden_report.py"], out / "golden_report.json")]
    if step == "kv":
        return [([f"{s}/kv_table.py", "--models", ",".join(models), "--texts", TEXTS_KV,
                  "--types", KV_TYPES, "--ctx-size", "2048", "--max-tokens", "8192",
                  "--out", str(out / "kv" / "kv_table.jsonl")], None)]
    if step == "weights":
        return [([f"{s}/weights_table.py", "--models", m, "--texts", TEXTS_WEIGHTS,
                  "--runs", WEIGHT_RUNS, "--kv", "", "--ctx-size", "2048", "--max-tokens", "8192",
                  "--checkpoint-run", "tq4", "--first-order",
                  "--out", str(out / "weights" / f"weights_{short_name(m)}.json")], None)
                for m in models]
    if step == "bench":
        return [([f"{s}/bench_sweep.py", "--preset", "all", "--models", ",".join(models),
                  "--out", str(out / "bench")], None)]
    if step == "plan":
        return [([f"{s}/plan_check.py", "--out", str(out / "plan" / "check.json")], None)]
    if step == "plots":
        # (plot.py's default --weights-json: every table in results/current/weights, so the
        # plots step runs on its own as well as after the weights step)
        return [([f"{s}/plot.py", "--bench", str(out / "bench"), "--out", str(ROOT / "docs")],
                 None)]
    raise TqjaxError(f"unknown step {step!r} (choose from: {', '.join(STEPS)})")


def provenance(command: list[str]) -> dict:
    """Commit (and whether tracked files differ from it), JAX version, machine, command."""
    import jax

    from tqjax.commands.provenance import git_info, machine_info

    shown = [Path(c).relative_to(ROOT).as_posix() if c.startswith(str(ROOT)) else c
             for c in command]
    return git_info(ROOT) | {"jax": jax.__version__, "machine": machine_info(),
                             "command": "python " + shlex.join(shown)}


def written_since(folder: Path, t0: float) -> list[Path]:
    """Files under `folder` modified at or after t0."""
    if not folder.exists():
        return []
    return sorted(f for f in folder.rglob("*") if f.is_file() and f.stat().st_mtime >= t0)


def stamp(files: list[Path], prov: dict) -> None:
    """Add "provenance" to every JSON object file in `files` that names no commit itself."""
    from tqjax.atomic import write_json

    for f in files:
        if f.suffix != ".json" or f.name.endswith(".failed.json"):
            continue
        try:
            data = json.loads(f.read_text())
        except (OSError, json.JSONDecodeError):
            continue
        if isinstance(data, dict) and "commit" not in data and "provenance" not in data:
            write_json(f, data | {"provenance": prov})


def main() -> int:
    p = ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--only", default=",".join(STEPS),
                   help=f"comma-separated steps to run, in this order: {', '.join(STEPS)}")
    p.add_argument("--models", default=",".join(MODELS), help="comma-separated model names")
    p.add_argument("--dry-run", action="store_true", help="print the commands, run nothing")
    p.add_argument("--keep-going", action="store_true", help="go on after a failed step")
    args = p.parse_args()
    steps = [s.strip() for s in args.only.split(",") if s.strip()]
    bad = [s for s in steps if s not in STEPS]
    if bad or not steps:
        raise TqjaxError(f"unknown step {bad[0] if bad else '(none)'!r} "
                         f"(choose from: {', '.join(STEPS)})")
    models = [m.strip() for m in args.models.split(",") if m.strip()]
    if not models:
        raise TqjaxError("--models is empty")
    plan = [(s, cmd, dest) for s in STEPS if s in steps for cmd, dest in commands(s, models)]
    if args.dry_run:
        for step, cmd, dest in plan:
            to = f" > {dest.relative_to(ROOT).as_posix()}" if dest else ""
            print(f"{step}: {provenance(cmd)['command']}{to}")
        return 0

    from tqjax.atomic import write_json

    manifest_path = CURRENT / "manifest.json"
    failures = 0
    for step, cmd, dest in plan:
        prov = provenance(cmd)
        print(f"[{step}] {prov['command']}", file=sys.stderr, flush=True)
        for i, arg in enumerate(cmd[:-1]):  # the scripts expect their output folder to exist
            if arg == "--out":
                out = Path(cmd[i + 1])
                (out if step == "bench" else out.parent).mkdir(parents=True, exist_ok=True)
        t0 = time.time()
        proc = subprocess.run([sys.executable, *cmd], text=True,
                              stdout=subprocess.PIPE if dest else None)
        wall = round(time.time() - t0, 1)
        if proc.returncode == 0 and dest is not None:
            dest.parent.mkdir(parents=True, exist_ok=True)
            write_json(dest, json.loads(proc.stdout.strip().splitlines()[-1]))
        folder = ROOT / "docs" if step == "plots" else CURRENT
        files = written_since(folder, t0)
        stamp(files, prov)
        # read again: another results.py run may have written it meanwhile
        manifest = json.loads(manifest_path.read_text()) if manifest_path.exists() else {}
        manifest[f"{step}:{prov['command']}"] = prov | {
            "step": step, "exit": proc.returncode, "wall_s": wall,
            "files": [f.relative_to(ROOT).as_posix() for f in files if f != manifest_path]}
        write_json(manifest_path, manifest)
        print(f"[{step}] exit {proc.returncode} after {wall} s", file=sys.stderr, flush=True)
        if proc.returncode != 0:
            failures += 1
            if not args.keep_going:
                break
    print_json({"steps": len(plan), "failed": failures, "manifest": str(manifest_path)})
    return 1 if failures else 0


if __name__ == "__main__":
    run_main(main)
