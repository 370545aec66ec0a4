"""Run benchmark sweeps: each configuration is one `tqjax-bench` run in its own process (so
peak RSS is per configuration), written as one JSON into an output folder.

    python scripts/bench_sweep.py --preset all \
        --models smollm2-135m-instruct,qwen2.5-coder-0.5b-instruct
    python scripts/bench_sweep.py --preset context --models smollm2-135m-instruct --quick
    python scripts/bench_sweep.py --preset all --dry-run      # list the runs and their commands

Presets (per model):
  context     decode at 1k, 4k, 8k, 16k (Qwen2.5: also 32704, its 32k positions less the decode;
              SmolLM2: 1k, 4k and 8128, its 8192 positions less the decode)
              with f32, bf16, turbo4 and turbo4/turbo3 caches; 512-token prompt, dense weights
  slots       a 512-token prompt decoded in a 1k- and a 16k-slot cache (f32 and turbo4): decode
              cost must follow the live context, not the allocation
  weights     dense f32, int8, tq4, mixed 4.25 bpw and gguf weights (those `--weights` offers,
              read from tqjax.cli) at a short context (128), f32 cache
  checkpoint  a saved tq4 checkpoint with 8-bit embeddings (made once with scripts/quantize.py
              into ~/.cache/tqjax/bench/) against the dense model, short context
  peers       dense f32 at 1k and 4k with --peers hf,llamacpp in the same run
  all         every preset above
`--quick` shrinks every preset to a smoke test (1k context at most, 8 decode tokens, 1 repeat)
and writes to results/current/bench-quick/ instead of results/current/bench/.

A run whose JSON is already in the output folder, made at this commit from a clean checkout on
this CPU, is skipped unless --force (one made elsewhere is run again); a failed run leaves
`<name>.failed.json` (its error) and the sweep goes on. The copy bandwidth is measured once per
sweep and given to every run (`--bandwidth` reuses a figure).
"""

from __future__ import annotations

import argparse
import dataclasses
import json
import os
import subprocess
import sys
import time
from pathlib import Path

from tqjax.cli import (
    ArgumentParser,
    RawDescriptionDefaultsFormatter,
    check_writable,
    positive_float,
    print_json,
    run_main,
)
from tqjax.commands.provenance import git_info, machine_info, source_checkout

BENCH = (sys.executable, "-m", "tqjax.commands.bench")
QUANTIZE = (sys.executable, "-m", "tqjax.commands.quantize")
# results/ of the checkout tqjax runs from; an installed copy writes under the working directory
RESULTS = (source_checkout() or Path()) / "results" / "current"
DEFAULT_OUT = RESULTS / "bench"
QUICK_OUT = RESULTS / "bench-quick"
MODELS = ("smollm2-135m-instruct",)
# SmolLM2-135M has 8192 positions: its longest context leaves room for the decode (no 16k)
CONTEXTS = {"qwen2.5-coder-0.5b-instruct": (1024, 4096, 8192, 16384, 32704),
            "smollm2-135m-instruct": (1024, 4096, 8128)}
DEFAULT_CONTEXTS = (1024, 4096, 8192, 16384)
CACHES = ("f32", "bf16", "turbo4", "turbo4/turbo3")
WEIGHTS = (("none", None), ("int8", None), ("tq4", None), ("mixed", 4.25), ("gguf", None))
SLOT_COUNTS = (1024, 16384)
SHORT_CONTEXT = 128
PEER_CONTEXTS = (1024, 4096)
DENSE_CHOICES = ("none", "dense", "f32", "float32")  # an explicit "no quantization" --weights
PRESETS = ("context", "slots", "weights", "checkpoint", "peers")
CHECKPOINT_ARGS = ("--weights", "tq4", "--quantize-embeddings", "--calibration-windows", "8")


@dataclasses.dataclass(frozen=True)
class Run:
    """One bench.py configuration."""

    preset: str = dataclasses.field(compare=False)  # runs shared by presets run once
    model: str  # a model name or path given to bench.py
    model_name: str  # the folder name in the output
    weights: str = "none"
    bpw: float | None = None
    quantize_embeddings: bool = False
    kv: str = "f32"
    prompt: int = 512
    context: int = 512
    slots: int = 0  # 0: bench.py's default (just enough)
    decode: int = 32
    repeats: int = 3
    peers: str = ""
    checkpoint: str | None = None  # label of a saved checkpoint that `model` points to
    source: str | None = None  # the model a checkpoint is made from
    dense_flag: str | None = None  # the --weights value that asks for dense weights, if any

    @property
    def name(self) -> str:
        w = self.checkpoint or self.weights
        w += f"{self.bpw:g}" if self.bpw else ""
        w += "-emb" if self.quantize_embeddings else ""
        parts = [f"w-{w}", f"kv-{self.kv.replace('/', '-')}", f"p{self.prompt}",
                 f"c{self.context}", f"d{self.decode}"]
        if self.slots:
            parts.append(f"s{self.slots}")
        if self.peers:
            parts.append("peers-" + self.peers.replace(",", "-"))
        return "_".join(parts)

    def command(self, bandwidth: float | None) -> list[str]:
        cmd = [*BENCH, "--model", self.model, "--kv", self.kv,
               "--prompt-tokens", str(self.prompt), "--context", str(self.context),
               "--decode-tokens", str(self.decode), "--repeats", str(self.repeats),
               "--label", self.preset]
        if self.weights != "none":
            cmd += ["--weights", self.weights]
        elif self.dense_flag:
            cmd += ["--weights", self.dense_flag]
        if self.bpw:
            cmd += ["--bpw", f"{self.bpw:g}"]
        if self.quantize_embeddings:
            cmd.append("--quantize-embeddings")
        if self.slots:
            cmd += ["--slots", str(self.slots)]
        if self.peers:
            cmd += ["--peers", self.peers]
        if bandwidth:
            cmd += ["--bandwidth", f"{bandwidth:g}"]
        return cmd


def cli_weight_choices() -> list[str]:
    """The `--weights` choices the command line offers today (read from tqjax.cli)."""
    from tqjax.cli import add_model_args

    p = argparse.ArgumentParser()
    add_model_args(p)
    for action in p._actions:
        if "--weights" in action.option_strings:
            return list(action.choices or [])
    return []


def checkpoint_dir(model: str) -> Path:
    from tqjax.fetch import cache_dir

    return cache_dir() / "bench" / f"{Path(model).name.removesuffix('.gguf')}-tq4-emb"


def plan(presets: list[str], models: list[str], quick: bool) -> tuple[list[Run], list[str]]:
    """The runs of `presets` on `models` (and notes on runs left out)."""
    choices = cli_weight_choices()
    runs, notes = [], []
    size = {"decode": 8, "repeats": 1} if quick else {}
    for model in models:
        name = Path(model).name.removesuffix(".gguf")
        contexts = CONTEXTS.get(name, DEFAULT_CONTEXTS)
        if quick:
            contexts = [c for c in contexts if c <= 1024]
        dense = next((c for c in DENSE_CHOICES if c in choices), None)
        base = {"model": model, "model_name": name, "dense_flag": dense, **size}
        prompt = 128 if quick else 512
        for preset in presets:
            if preset == "context":
                runs += [Run("context", kv=kv, prompt=prompt, context=c, **base)
                         for c in contexts for kv in CACHES]
            elif preset == "slots":
                slots = [c for c in SLOT_COUNTS if c <= 2048] if quick else SLOT_COUNTS
                slots = slots if len(slots) > 1 else [slots[0], 2048]
                runs += [Run("slots", kv=kv, prompt=prompt, context=prompt, slots=s, **base)
                         for kv in ("f32", "turbo4") for s in slots]
            elif preset in ("weights", "checkpoint"):
                short = {"prompt": SHORT_CONTEXT, "context": SHORT_CONTEXT}
                runs.append(Run(preset, **short, **base))
                if preset == "checkpoint":
                    ckpt = checkpoint_dir(model)
                    runs.append(Run(preset, checkpoint="ckpt-tq4-emb", source=model, **short,
                                    **(base | {"model": str(ckpt)})))
                    continue
                for weights, bpw in WEIGHTS[1:]:
                    if weights in choices:
                        runs.append(Run(preset, weights=weights, bpw=bpw, **short, **base))
                    else:
                        notes.append(f"--weights {weights} is not offered by tqjax.cli "
                                     f"(choices: {', '.join(choices)}): skipped")
            elif preset == "peers":
                peer_contexts = [c for c in PEER_CONTEXTS if c in contexts] or contexts[:1]
                runs += [Run("peers", prompt=prompt, context=c, peers="hf,llamacpp", **base)
                         for c in peer_contexts]
    return list(dict.fromkeys(runs)), notes  # a run shared by two presets once


def is_current(path: Path, here: dict) -> bool:
    """Whether the saved run at `path` was made where this sweep runs: the same commit, a clean
    checkout, the same CPU (`here`: {"commit", "cpu"}; commit None: this checkout has
    changes). A run from another commit or machine is not this code's figure on this machine,
    so the sweep makes it again."""
    try:
        saved = json.loads(path.read_text())
    except (OSError, ValueError):
        return False
    return (isinstance(saved, dict) and here["commit"] is not None
            and saved.get("commit") == here["commit"] and saved.get("dirty") is False
            and (saved.get("machine") or {}).get("cpu") == here["cpu"])


def ensure_checkpoint(run: Run) -> None:
    """Make the saved checkpoint a `checkpoint` run needs, once (scripts/quantize.py)."""
    path = Path(run.model)
    if path.exists():
        return
    cmd = [*QUANTIZE, "--model", run.source, "--out", str(path),
           *CHECKPOINT_ARGS]
    print(f"making the checkpoint: {' '.join(cmd[1:])}", file=sys.stderr, flush=True)
    subprocess.run(cmd, check=True)


def measure_bandwidth() -> float:
    from tqjax.errors import TqjaxError

    proc = subprocess.run([*BENCH, "--measure-bandwidth"],
                          capture_output=True, text=True)
    if proc.returncode != 0:
        raise TqjaxError(f"copy-bandwidth measurement failed: {proc.stderr.strip()[-300:]}")
    return float(json.loads(proc.stdout.strip().splitlines()[-1])["copy_gbps"])


def run_one(run: Run, dest: Path, bandwidth: float, timeout: float | None) -> tuple[bool, str]:
    """Run one configuration; on success its JSON (with the sweep's wall time added) is written
    to `dest` atomically, on failure `<name>.failed.json` holds the error."""
    from tqjax.atomic import write_json

    failed = dest.with_name(dest.stem + ".failed.json")
    cmd = run.command(bandwidth)
    t0 = time.perf_counter()
    try:
        if run.checkpoint:
            ensure_checkpoint(run)
        # the persistent XLA cache off, so a warm or cold cache does not move a run's peak
        env = dict(os.environ, TQJAX_XLA_CACHE="0")
        proc = subprocess.run(cmd, capture_output=True, text=True, timeout=timeout, env=env)
        ok = proc.returncode == 0
        error = "" if ok else (proc.stderr.strip().splitlines() or [f"exit {proc.returncode}"])[-1]
    except subprocess.TimeoutExpired:
        ok, error = False, f"timed out after {timeout} s"
    except subprocess.CalledProcessError as e:
        ok, error = False, f"making the checkpoint failed (exit {e.returncode})"
    wall = round(time.perf_counter() - t0, 1)
    if ok:
        result = json.loads(proc.stdout.strip().splitlines()[-1])
        result["sweep"] = {"preset": run.preset, "model": run.model_name, "name": run.name,
                           "wall_s": wall,
                           "command": " ".join(cmd[1:])}
        write_json(dest, result)
        failed.unlink(missing_ok=True)
        return True, f"{wall} s"
    write_json(failed, {"name": run.name, "preset": run.preset, "error": error,
                        "command": " ".join(cmd[1:]), "wall_s": wall})
    return False, error


def run(argv: list[str] | None = None) -> int:
    """The sweep; returns the exit status (1 if a run failed; user errors raise TqjaxError)."""
    p = ArgumentParser(prog="tqjax-bench-sweep", description=__doc__.split("\n\n")[0],
                       formatter_class=RawDescriptionDefaultsFormatter)
    p.add_argument("--preset", default="all",
                   help=f"comma-separated presets: {', '.join(PRESETS)}, or all")
    p.add_argument("--models", default=",".join(MODELS),
                   help="comma-separated model names or paths")
    p.add_argument("--out", default=None,
                   help="output folder (default results/current/bench, or bench-quick with "
                        "--quick, in the tqjax checkout; an installed tqjax: in the working "
                        "directory); one subfolder per model")
    p.add_argument("--quick", action="store_true", help="a smoke test: small sizes")
    p.add_argument("--force", action="store_true",
                   help="re-run runs already saved at this commit on this CPU")
    p.add_argument("--dry-run", action="store_true", help="list the runs, run nothing")
    p.add_argument("--bandwidth", type=positive_float, default=None, metavar="GBPS",
                   help="copy bandwidth (GB/s) to use instead of measuring it")
    p.add_argument("--timeout", type=positive_float, default=None, help="seconds per run")
    p.add_argument("--decode-tokens", type=int, default=None,
                   help="override every run's decode count (default 32, --quick 8)")
    p.add_argument("--repeats", type=int, default=None,
                   help="override every run's repeats (default 3, --quick 1)")
    args = p.parse_args(argv)

    from tqjax.errors import TqjaxError

    presets = [s.strip() for s in args.preset.split(",") if s.strip()]
    presets = list(PRESETS) if presets == ["all"] else presets
    bad = [s for s in presets if s not in PRESETS]
    if bad or not presets:
        raise TqjaxError(f"unknown preset {bad[0] if bad else '(none)'!r} "
                         f"(choose from {', '.join(PRESETS)}, all)")
    models = [m.strip() for m in args.models.split(",") if m.strip()]
    if not models:
        raise TqjaxError("--models is empty")
    out = Path(args.out) if args.out else (QUICK_OUT if args.quick else DEFAULT_OUT)
    if not args.dry_run:
        check_writable(out, folder=True)  # before the bandwidth and the first run
    if any(v is not None and v < 1 for v in (args.decode_tokens, args.repeats)):
        raise TqjaxError("--decode-tokens and --repeats must be >= 1")
    runs, notes = plan(presets, models, args.quick)
    overrides = {k: v for k, v in (("decode", args.decode_tokens), ("repeats", args.repeats))
                 if v is not None}
    runs = list(dict.fromkeys(dataclasses.replace(r, **overrides) for r in runs))
    for note in notes:
        print(f"note: {note}", file=sys.stderr)
    git = git_info()  # a checkout with changes (or none: installed) has no saved runs of its own
    here = {"commit": None if git["dirty"] is not False else git["commit"],
            "cpu": machine_info()["cpu"]}
    todo = [r for r in runs
            if args.force or not is_current(out / r.model_name / f"{r.name}.json", here)]
    print(f"{len(runs)} runs, {len(runs) - len(todo)} already saved in {out} at this commit "
          "on this CPU", file=sys.stderr)
    if args.dry_run:
        for r in runs:
            state = "todo" if r in todo else "saved"
            print(f"{state}  {r.model_name}/{r.name}.json  python {' '.join(r.command(None)[1:])}")
        return 0
    bandwidth = args.bandwidth or (measure_bandwidth() if todo else 0.0)
    if todo:
        print(f"copy bandwidth {bandwidth:g} GB/s", file=sys.stderr, flush=True)
    failures = 0
    for i, r in enumerate(todo, 1):
        dest = out / r.model_name / f"{r.name}.json"
        print(f"[{i}/{len(todo)}] {r.model_name}/{r.name} ...", file=sys.stderr, flush=True)
        ok, msg = run_one(r, dest, bandwidth, args.timeout)
        failures += not ok
        print(f"    {'ok' if ok else 'FAILED'}: {msg}", file=sys.stderr, flush=True)
    print_json({"out": str(out), "runs": len(runs), "ran": len(todo), "failed": failures,
                "bandwidth_gbps": bandwidth, "cpu_count": os.cpu_count()})
    return 1 if failures else 0


def main(argv: list[str] | None = None) -> None:
    """Entry point `tqjax-bench-sweep`: one-line errors, exit 2 on bad input."""
    run_main(lambda: run(argv))


if __name__ == "__main__":
    main()
