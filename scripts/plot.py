"""Plot the benchmark and quality results as PNGs (needs the `bench` extra: matplotlib).

    python scripts/plot.py                       # results/current/bench -> docs/*.png
    python scripts/plot.py --bench results/current/bench-quick --note "smoke (--quick)"

Writes into --out (default docs/):
  bench_decode_vs_context.png   decode tok/s against the decode position, one line per model,
                                weights and KV cache (dense weights, default slots), peers dashed,
                                the f32 cache's memory roofline dotted
  bench_rss_vs_context.png      peak RSS (VmHWM) of the same runs
  bench_weights.png             decode tok/s and peak RSS per weight format at short context
  weights_dppl_vs_bits.png      ΔPPL against bits per weight, from weights_table.py JSONs
Every figure names the commits (and JAX version and CPU) its data came from.
"""

from __future__ import annotations

import subprocess
import sys
from collections import defaultdict
from pathlib import Path

from tqjax.atomic import read_json
from tqjax.cli import ArgumentParser, check_writable, print_json, run_main
from tqjax.errors import TqjaxError

ROOT = Path(__file__).resolve().parent.parent
DEFAULT_BENCH = ROOT / "results" / "current" / "bench"
WEIGHTS = ROOT / "results" / "current" / "weights"  # weights_table.py JSONs: every one is drawn
PEER_NAMES = {"hf": "HF transformers", "llamacpp": "llama.cpp"}
MIB = 1 << 20


def load_bench(folder: Path) -> list[dict]:
    """Every bench JSON under `folder` (failed runs and other files skipped)."""
    runs = []
    for path in sorted(folder.rglob("*.json")):
        if path.name.endswith(".failed.json"):
            continue
        data = read_json(path, dict)
        if str(data.get("schema", "")).startswith("tqjax-bench/"):
            runs.append(data | {"file": path})
    return runs


def default_slots(run: dict) -> bool:
    """Whether the run used the just-enough slot count (not a big empty cache)."""
    return run["slots"] <= max(run["context"] + run["decode_tokens"] + 2, 512)


def series_key(run: dict) -> str:
    w = run["weights"] if run["weights"] != "none" else run.get("weights_loaded", "dense")
    w = "f32" if w == "dense" else w
    return f"{run['model']} · {w} weights · {run['kv']} KV"


def provenance(runs: list[dict], files: list[Path] = ()) -> str:
    """One line naming the commits, JAX versions and CPUs the data came from."""
    commits = sorted({(r.get("commit") or "?")[:9] + ("+dirty" if r.get("dirty") else "")
                      for r in runs})
    for f in files:
        out = subprocess.run(["git", "-C", str(ROOT), "log", "-1", "--format=%h", "--", str(f)],
                             capture_output=True, text=True)
        commits.append(f"{f.name}@{out.stdout.strip() or 'uncommitted'}")
    parts = [f"commit {', '.join(dict.fromkeys(commits))}"]
    jax = sorted({r.get("jax", "?") for r in runs})
    cpus = sorted({f"{r['machine']['cpu']} ×{r['machine']['cpu_count']}" for r in runs
                   if "machine" in r})
    if jax and runs:
        parts.append(f"JAX {', '.join(jax)}")
    if cpus:
        parts.append(", ".join(cpus))
    return " · ".join(parts)


def context_figure(runs: list[dict], metric: str, out: Path, note: str) -> Path | None:
    """Decode tok/s (metric "decode") or peak RSS ("rss") against the decode position."""
    import matplotlib.pyplot as plt

    chosen = [r for r in runs if default_slots(r) and r["weights"] == "none"
              and r.get("weights_loaded", "dense") == "dense"
              and r.get("label") in ("context", "peers", None)]
    if not chosen:
        return None
    models = list(dict.fromkeys(model_of(r) for r in chosen))
    fig, axes = plt.subplots(1, len(models), figsize=(6.5 * len(models), 4.8), squeeze=False)
    for ax, model in zip(axes[0], models, strict=True):
        mine = [r for r in chosen if model_of(r) == model]
        lines: dict[str, dict[int, float]] = defaultdict(dict)
        peers: dict[str, dict[int, float]] = defaultdict(dict)
        roof: dict[int, float] = {}
        for r in sorted(mine, key=lambda r: r.get("label") == "context"):  # context runs win
            t = r["tqjax"]
            y = t["decode_tok_s"] if metric == "decode" else t["peak_rss_bytes"] / MIB
            lines[series_key(r).split(" · ", 1)[1]][r["context"]] = y
            if metric == "decode" and r["kv"] == "f32":
                roof[r["context"]] = t["roofline_tok_s"]
            for name, p in r.get("peers", {}).items():
                if "decode_tok_s" in p:
                    py = p["decode_tok_s"] if metric == "decode" else p["peak_rss_bytes"] / MIB
                    peers[PEER_NAMES.get(name, name)][r["context"]] = py
        for label, pts in sorted(lines.items()):
            xs = sorted(pts)
            ax.plot(xs, [pts[x] for x in xs], "o-", label=label)
        for label, pts in sorted(peers.items()):
            xs = sorted(pts)
            ax.plot(xs, [pts[x] for x in xs], "s--", label=label)
        if roof:
            xs = sorted(roof)
            ax.plot(xs, [roof[x] for x in xs], ":x", color="gray",
                    label="f32 memory roofline (weights + live cache)")
        ax.set_xscale("log", base=2)
        ax.set_xticks(sorted({r["context"] for r in mine}))
        ax.get_xaxis().set_major_formatter(
            plt.FuncFormatter(lambda v, _: f"{v / 1024:g}k" if v >= 1024 else f"{v:g}"))
        ax.set_xlabel("decode position (tokens of context)")
        ax.set_ylabel("decode tokens/s" if metric == "decode" else "peak RSS (MiB)")
        ax.set_ylim(bottom=0)
        ax.set_title(model)
        ax.grid(alpha=0.3)
        ax.legend(fontsize=8)
    title = "Decode speed vs context" if metric == "decode" else "Peak RSS vs context"
    finish(fig, f"{title}{f' — {note}' if note else ''}", provenance(chosen))
    return save(fig, out)


def weights_figure(runs: list[dict], out: Path, note: str) -> Path | None:
    """Decode tok/s and peak RSS per weight format (f32 cache, short context)."""
    import matplotlib.pyplot as plt

    chosen = [r for r in runs if default_slots(r) and r["kv"] == "f32"
              and r.get("label") in ("weights", "checkpoint") and not r.get("peers")]
    if not chosen:
        return None
    models = list(dict.fromkeys(model_of(r) for r in chosen))
    fig, axes = plt.subplots(2, len(models), figsize=(6 * len(models), 7), squeeze=False)
    for j, model in enumerate(models):
        mine = sorted((r for r in chosen if model_of(r) == model),
                      key=lambda r: -r["tqjax"]["param_bytes"])
        names = [weight_label(r) for r in mine]
        for i, (key, scale, ylabel) in enumerate((("decode_tok_s", 1, "decode tokens/s"),
                                                  ("peak_rss_bytes", MIB, "peak RSS (MiB)"))):
            ax = axes[i][j]
            vals = [r["tqjax"][key] / scale for r in mine]
            ax.bar(range(len(mine)), vals, color="tab:blue" if i == 0 else "tab:orange")
            ax.set_xticks(range(len(mine)), names, rotation=20, fontsize=8)
            ax.set_ylabel(ylabel)
            ax.grid(alpha=0.3, axis="y")
            if i == 0:
                ax.set_title(f"{model} (context {mine[0]['context']}, f32 KV)")
    finish(fig, f"Weight formats{f' — {note}' if note else ''}", provenance(chosen))
    return save(fig, out)


def weight_label(run: dict) -> str:
    """f32, int8, tq4, mixed 4.25, gguf, or for a saved checkpoint "tq4 (checkpoint)" (the
    format its results file names) or "checkpoint (QuantizedLinear)"."""
    w, loaded = run["weights"], run.get("weights_loaded", "dense")
    if w != "none":
        return f"{w} {run['bpw']:g}" if run.get("bpw") else w
    if loaded != "dense" and not run["model_path"].endswith(".gguf"):
        name = Path(run.get("file", "")).name  # results/current: w-<format>_kv-...json
        fmt = name[2:name.index("_kv-")] if name.startswith("w-") and "_kv-" in name else None
        return f"{fmt} (checkpoint)" if fmt else f"checkpoint ({loaded})"
    return "f32" if loaded == "dense" else loaded


def model_of(run: dict) -> str:
    """The model a run belongs to: the sweep's or the results folder (a checkpoint counts as
    its source)."""
    if "sweep" in run:
        return run["sweep"]["model"]
    return Path(run["file"]).parent.name if "file" in run else run["model"]


def dppl_figure(files: list[Path], out: Path, note: str) -> Path | None:
    """ΔPPL (%) against bits per weight, one panel per model, one marker per text."""
    import matplotlib.pyplot as plt

    rows = []
    for f in files:
        table = read_json(f, dict)
        if not isinstance(table.get("rows"), list):
            raise TqjaxError(f"{f} has no \"rows\" list (not a weights_table.py JSON)")
        rows += [r | {"file": f.name} for r in table["rows"]
                 if r.get("kv") == "f32/f32" and r.get("run") != "f32" and r.get("bpw")
                 and r.get("dppl_pct") != 0.0]  # exactly 0: not a measurement (a placeholder)
    if not rows:
        return None
    models = list(dict.fromkeys(r["model"] for r in rows))
    fig, axes = plt.subplots(1, len(models), figsize=(6.5 * len(models), 4.8), squeeze=False)
    markers = "os^Dv"
    for ax, model in zip(axes[0], models, strict=True):
        mine = [r for r in rows if r["model"] == model]
        texts = list(dict.fromkeys(r["text"] for r in mine))
        for t, text in enumerate(texts):
            pts = [r for r in mine if r["text"] == text]
            ax.scatter([r["bpw"] for r in pts], [r["dppl_pct"] for r in pts],
                       marker=markers[t % len(markers)], label=text, s=36)
            for r in pts:
                ax.annotate(r["run"], (r["bpw"], r["dppl_pct"]), fontsize=7,
                            xytext=(3, 3), textcoords="offset points")
        values = [abs(r["dppl_pct"]) for r in mine]
        if max(values) > 10 * max(min(values), 1.0):  # over a decade: log-like, else linear
            ax.set_yscale("symlog", linthresh=1.0)
        bits = [r["bpw"] for r in mine]
        if max(bits) - min(bits) < 1.0:  # formats of one size: a bit's width either side
            ax.set_xlim((max(bits) + min(bits)) / 2 - 1.0, (max(bits) + min(bits)) / 2 + 1.0)
        ax.ticklabel_format(axis="x", useOffset=False)
        ax.set_xlabel("bits per weight (quantized tensors, every stored byte)")
        ax.set_ylabel("ΔPPL vs f32 weights (%)")
        ax.set_title(model)
        ax.grid(alpha=0.3)
        ax.legend(fontsize=8)
    finish(fig, f"Weight quantization: ΔPPL vs bits{f' — {note}' if note else ''}",
           provenance([], files))
    return save(fig, out)


def finish(fig: object, title: str, footer: str) -> None:
    fig.suptitle(title)
    fig.text(0.01, 0.005, footer, fontsize=7, color="dimgray")
    fig.tight_layout(rect=(0, 0.03, 1, 1))


def save(fig: object, out: Path) -> Path:
    import matplotlib.pyplot as plt

    from tqjax.atomic import atomic_path

    out.parent.mkdir(parents=True, exist_ok=True)
    with atomic_path(out) as tmp:
        fig.savefig(tmp, dpi=110, format="png")
    plt.close(fig)
    return out


def main() -> int:
    p = ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--bench", default=str(DEFAULT_BENCH), help="folder of bench JSONs")
    p.add_argument("--weights-json", nargs="*",
                   default=[str(f) for f in sorted(WEIGHTS.glob("weights_*.json"))],
                   help="weights_table.py JSON files for ΔPPL vs bits (default: every one in "
                        "results/current/weights)")
    p.add_argument("--out", default=str(ROOT / "docs"), help="folder for the PNGs")
    p.add_argument("--note", default="", help="added to every title (e.g. 'smoke test')")
    args = p.parse_args()

    import matplotlib

    matplotlib.use("Agg")
    bench = Path(args.bench)
    if not bench.is_dir():
        raise TqjaxError(f"no bench folder {bench} (run scripts/bench_sweep.py first)")
    files = [Path(f) for f in args.weights_json]
    missing = [f for f in files if not f.is_file()]
    if missing:
        raise TqjaxError(f"no such weights JSON: {missing[0]}")
    out = check_writable(Path(args.out), folder=True)
    runs = load_bench(bench)
    if not runs and not files:
        raise TqjaxError(f"nothing to draw: no bench JSONs under {bench} and no --weights-json")
    if not runs:
        print(f"note: no bench JSONs under {bench}: only the ΔPPL figure is drawn",
              file=sys.stderr)
    made = [context_figure(runs, "decode", out / "bench_decode_vs_context.png", args.note),
            context_figure(runs, "rss", out / "bench_rss_vs_context.png", args.note),
            weights_figure(runs, out / "bench_weights.png", args.note),
            dppl_figure(files, out / "weights_dppl_vs_bits.png", args.note)]
    print_json({"runs": len(runs), "written": [str(m) for m in made if m]})
    return 0


if __name__ == "__main__":
    run_main(main)
