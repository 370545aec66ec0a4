"""Weight quantization table: perplexity change, KL and top-1 agreement against the f32 weights,
exact bits per weight, quantize time and quantized-checkpoint load time, on several models and
texts, plus tq4 weights combined with a compressed KV cache (total memory at 8k tokens).
With `--first-order`, each quantized run's ΔNLL is also split into g·Δ, the first-order term
(the luck of how the rounding falls against the text), and the rest (see
`tqjax.research.first_order`).

    python scripts/weights_table.py --models smollm2-135m-instruct --texts shakespeare:macbeth \
        --runs int8,int4,tq4 --ctx-size 2048 --max-tokens 8192 --out weights_table.json

Each run is measured as soon as it is quantized (one quantized copy held at a time; the f32
model runs again beside each as the reference). Writes the JSON (rewritten atomically after
every run and text, so a long run can be read while it goes) and a markdown table next to it
(`.md`): one table per model and text, then, for a model measured on several texts, one pooled
over all of them (every predicted token weighs the same). `--report A.json [B.json ...]` only prints
the tables of saved runs, merged. GPTQ and mixed-precision runs calibrate on
`tqjax.models.calibration.calibration_corpus()`, which never overlaps the evaluation texts.
"""

from __future__ import annotations

import json
import math
import tempfile
import time
from pathlib import Path

from tqjax.cli import ArgumentParser, check_writable, run_main

# run name -> (method, bpw, calibrated, quantized embeddings)
RUNS = {
    "int8": ("int8", None, False, False),
    "int8-gptq": ("int8", None, True, False),
    "int8-rot": ("int8-rot", None, True, False),
    "tq8": ("tq8", None, True, False),
    "int4": ("int4", None, False, False),
    "int4-gptq": ("int4", None, True, False),
    "int4-affine": ("int4-affine", None, False, False),
    "tq4-free": ("tq4", None, False, False),
    "tq4": ("tq4", None, True, False),
    "tq4-emb": ("tq4", None, True, True),
    "tq3": ("tq3", None, True, False),
    "mixed-4.25": ("mixed", 4.25, True, False),
    "mixed-3.5": ("mixed", 3.5, True, False),
}
KV_CONTEXT = 8192
# What every row needs for the tables (the rest is shown where a row has it).
REPORT_KEYS = ("model", "text", "run", "kv", "dppl_pct", "kl", "top1", "tokens")


def pooled(rows: list[dict]) -> list[dict]:
    """Each (model, run, KV) measured on every text of its model, pooled over the texts: ΔPPL
    from the token-weighted mean ΔNLL (PPL ratio = exp ΔNLL), its standard error from the
    per-text ones (independent texts), KL and top-1 token-weighted. Runs missing a text are left
    out. Rows as `markdown` takes them; "text" lists the texts joined by "+"."""
    out = []
    for model in dict.fromkeys(r["model"] for r in rows):
        mine = [r for r in rows if r["model"] == model]
        texts = list(dict.fromkeys(r["text"] for r in mine))
        if len(texts) < 2:
            continue
        for key in dict.fromkeys((r["run"], r["kv"]) for r in mine):
            by_text = {r["text"]: r for r in mine if (r["run"], r["kv"]) == key}
            if set(by_text) != set(texts):
                continue
            parts = [by_text[t] for t in texts]
            n = sum(r["tokens"] for r in parts)
            dnll = [math.log1p(r["dppl_pct"] / 100) for r in parts]
            mean = sum(r["tokens"] * d for r, d in zip(parts, dnll, strict=True)) / n
            row = {k: parts[0][k] for k in ("model", "run", "kv", "bpw", "total_bytes_8k")
                   if k in parts[0]}
            row |= {"text": "+".join(texts), "tokens": n, "dppl_pct": 100 * math.expm1(mean),
                    "kl": sum(r["tokens"] * r["kl"] for r in parts) / n,
                    "top1": sum(r["tokens"] * r["top1"] for r in parts) / n}
            if all(r.get("dppl_se_pct") is not None for r in parts):  # se of each text's ΔNLL
                se = [r["dppl_se_pct"] / 100 / math.exp(d)
                      for r, d in zip(parts, dnll, strict=True)]
                row["dppl_se_pct"] = 100 * math.exp(mean) * math.sqrt(
                    sum((r["tokens"] * e) ** 2 for r, e in zip(parts, se, strict=True))) / n
            for k in ("nll_delta", "first_order", "nll_rest"):  # the first-order split, if made
                if all(k in r for r in parts):
                    row[k] = sum(r["tokens"] * r[k] for r in parts) / n
            out.append(row)
    return out


def markdown(rows: list[dict]) -> str:
    """One table per model and text, then the `pooled` tables (which have no PPL; a cell a
    row lacks, as in a hand-made results file, shows "—")."""
    from tqjax.eval import dppl_text

    rows = rows + pooled(rows)
    out = []
    for model in dict.fromkeys(r["model"] for r in rows):
        for text in dict.fromkeys(r["text"] for r in rows if r["model"] == model):
            these = [r for r in rows if (r["model"], r["text"]) == (model, text)]
            split = any("first_order" in r for r in these)
            out += [f"### {model} — {text}", "",
                    "| run | weights bpw | KV | PPL | ΔPPL ± s.e. | KL | top-1 "
                    "| params+KV@8k MiB |" + (" ΔNLL | g·Δ | ΔNLL − g·Δ |" if split else ""),
                    "|---|---|---|---|---|---|---|---|" + ("---|---|---|" if split else "")]
            for r in these:
                ppl = f"{r['ppl']:.3f}" if "ppl" in r else "—"
                bpw = f"{r['bpw']:.4f}" if "bpw" in r else "—"
                total = f"{r['total_bytes_8k'] / 2**20:.1f}" if "total_bytes_8k" in r else "—"
                cells = [r["run"], bpw, r["kv"], ppl, dppl_text(r), f"{r['kl']:.4f}",
                         f"{r['top1']:.3f}", total]
                if split:
                    cells += [f"{r[k]:+.4f}" if k in r else ""
                              for k in ("nll_delta", "first_order", "nll_rest")]
                out.append("| " + " | ".join(cells) + " |")
            out.append("")
    return "\n".join(out)


def report_rows(paths: list[Path]) -> list[dict]:
    """The rows of saved weights_table JSON files, merged (the last file wins a duplicate);
    every row must carry `REPORT_KEYS`."""
    from tqjax.errors import TqjaxError

    merged: dict[tuple, dict] = {}
    for path in paths:
        try:
            rows = json.loads(path.read_text(encoding="utf-8"))["rows"]
            for r in rows:
                missing = [k for k in REPORT_KEYS if k not in r]
                if missing:
                    raise KeyError(", ".join(missing))
                merged[r["model"], r["text"], r["run"], r["kv"]] = r
        except (OSError, ValueError, KeyError, TypeError) as e:
            raise TqjaxError(f"{path}: not a weights_table JSON file ({e!r})") from None
    return list(merged.values())


def measure(report: dict, name: str, model: object, texts: dict[str, list[int]],
            group: dict, args: object, save: object) -> None:
    """Append to report["rows"] the rows of the (model, cache) variants in `group` on every
    text, against the f32 `model` (its own row only when `group` holds "f32"); save() after
    each text."""
    import tqjax
    from tqjax.api import kv_footprint
    from tqjax.eval import sweep
    from tqjax.quant.accounting import params_bits
    from tqjax.research.first_order import first_order_nll

    ref = {"f32": (model, tqjax.CacheSpec())}
    for text, ids in texts.items():
        results = sweep(ids, args.ctx_size, ref | group, reference="f32")
        for run, res in results.items():
            if run not in group:
                continue
            m, spec = group[run]
            bits, kv = params_bits(m.params), kv_footprint(m, spec)
            kv_8k = KV_CONTEXT * kv["kv_bytes_per_token"] + kv["kv_constant_bytes"]
            report["rows"].append({
                "model": name, "text": text, "run": run, "kv": spec.k + "/" + spec.v,
                "bpw": bits["quantized_bpw"] if run.split("+")[0] != "f32" else 32.0,
                "bpw_overall": bits["bpw"], "params_bytes": bits["bytes"],
                "kv_bytes_per_token": kv["kv_bytes_per_token"],
                "total_bytes_8k": bits["bytes"] + kv_8k,
                "ppl": res.ppl, "dppl_pct": 100 * (res.ppl / results["f32"].ppl - 1),
                "dppl_se_pct": res.dppl_se_pct, "kl": res.kl,
                "top1": res.top1, "nll_delta": res.nll_delta, "tokens": res.tokens,
                "windows": res.windows})
            if args.first_order and m.params is not model.params and spec == tqjax.CacheSpec():
                g = first_order_nll(model, m.params, ids, args.ctx_size)
                report["rows"][-1] |= {"first_order": g, "nll_rest": res.nll_delta - g}
            print(json.dumps(report["rows"][-1]), flush=True)
        save()


def main() -> int:
    from tqjax.models.calibration import CALIBRATION_CHARS, CALIBRATION_WINDOWS

    p = ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--models", default="smollm2-135m-instruct,qwen2.5-coder-0.5b-instruct")
    p.add_argument("--texts", default="shakespeare:macbeth,python-stdlib")
    p.add_argument("--runs", default=",".join(RUNS), help=f"comma list of {', '.join(RUNS)}")
    p.add_argument("--kv", default="turbo4", metavar="K[/V]",
                   help="compressed KV cache combined with f32 and tq4 weights ('' = none)")
    p.add_argument("--ctx-size", type=int, default=2048)
    p.add_argument("--max-tokens", type=int, default=8192)
    p.add_argument("--calibration-windows", type=int, default=CALIBRATION_WINDOWS)
    p.add_argument("--calibration-length", type=int, default=1024)
    p.add_argument("--calibration-chars", type=int, default=CALIBRATION_CHARS,
                   help="characters per part (prose, code) of the calibration corpus")
    p.add_argument("--seed", type=int, default=0,
                   help="rotation seed of the quantized runs (a different quantization noise)")
    p.add_argument("--checkpoint-run", default="tq4",
                   help="run saved as a quantized checkpoint to time its load and size")
    p.add_argument("--first-order", action="store_true",
                   help="split each quantized run's ΔNLL into g·Δ and the rest (a JVP per window)")
    p.add_argument("--out", type=Path, default=Path("weights_table.json"))
    p.add_argument("--report", type=Path, nargs="+", default=None, metavar="JSON",
                   help="only print the tables of saved runs (rows merged; a later file's row "
                        "replaces an earlier one for the same model, text, run and KV)")
    args = p.parse_args()
    if args.report is not None:
        print(markdown(report_rows(args.report)))
        return 0
    check_writable(args.out)
    check_writable(args.out.with_suffix(".md"))

    import dataclasses

    import tqjax
    from tqjax.atomic import write_text
    from tqjax.fetch import corpus_text
    from tqjax.kv.cache import parse_kv
    from tqjax.models.calibration import calibration_corpus, calibration_windows
    from tqjax.models.checkpoint import save_quantized
    from tqjax.models.quantize import WeightSpec, get_path, linear_paths, quantize_params
    from tqjax.quant.accounting import params_bits

    if args.calibration_chars < 1:
        raise tqjax.TqjaxError(f"--calibration-chars must be >= 1, got {args.calibration_chars}")
    runs = [r for r in args.runs.split(",") if r]
    for r in runs:
        if r not in RUNS:
            raise tqjax.TqjaxError(f"unknown run {r!r} (choose from: {', '.join(RUNS)})")
    kv_spec = None
    if args.kv:
        kv_spec = tqjax.CacheSpec(*parse_kv(args.kv))
    report: dict = {"args": {k: str(v) for k, v in vars(args).items()}, "models": {}, "rows": []}

    def save() -> None:
        write_text(args.out, json.dumps(report, indent=1))
        write_text(args.out.with_suffix(".md"), markdown(report["rows"]))

    for name in args.models.split(","):
        t0 = time.perf_counter()
        model = tqjax.load(name)
        if model.tokenizer is None:
            raise tqjax.TqjaxError(f"{model.source} has no tokenizer to encode the texts with")
        info: dict = {"source": model.source, "load_seconds": time.perf_counter() - t0,
                      "f32": params_bits(model.params), "runs": {}}
        report["models"][name] = info
        windows = calibration_windows(model.tokenizer, calibration_corpus(args.calibration_chars),
                                      args.calibration_windows, args.calibration_length)
        texts = {text: model.tokenizer.encode(corpus_text(text))[:args.max_tokens]
                 for text in args.texts.split(",")}
        f32 = {"f32": (model, tqjax.CacheSpec())}
        # the f32 model first (with the KV cache), then each run measured as soon as it is
        # made and dropped after: one quantized copy held at a time, rows saved as they come
        first = {f"f32+kv {args.kv}": (model, kv_spec)} if kv_spec else {}
        measure(report, name, model, texts, f32 | first, args, save)
        for run in runs:
            method, bpw, calibrated, embeddings = RUNS[run]
            spec = WeightSpec(method, bpw=bpw, quantize_embeddings=embeddings, seed=args.seed)
            t0 = time.perf_counter()
            params = quantize_params(model.params, model.config, spec,
                                     windows if calibrated else None, progress=True)
            entry = {"quantize_seconds": time.perf_counter() - t0, "memory": params_bits(params),
                     "calibration_tokens": int(windows.size) if calibrated else 0,
                     "formats": {p: f"{w.bits}g{w.group}" for p in linear_paths(
                         params, spec.quantize_embeddings) for w in [get_path(params, p)]}}
            if run == args.checkpoint_run:  # size on disk, load time vs the source file
                with tempfile.TemporaryDirectory(dir=args.out.parent.absolute()) as tmp:
                    meta = save_quantized(Path(tmp) / "ckpt", params, model.config,
                                          method=dataclasses.asdict(spec),
                                          tokenizer=model.tokenizer, source=Path(model.source),
                                          dense_dtype="float16")
                    t0 = time.perf_counter()
                    tqjax.load(Path(tmp) / "ckpt")
                    entry |= {"checkpoint_load_seconds": time.perf_counter() - t0,
                              "disk": meta["disk"]}
            info["runs"][run] = entry
            print(json.dumps({"model": name, "run": run, "bpw": entry["memory"]["quantized_bpw"],
                              "seconds": round(entry["quantize_seconds"], 1)}), flush=True)
            quantized = dataclasses.replace(model, params=params)
            group = {run: (quantized, tqjax.CacheSpec())}
            if kv_spec is not None and run in ("tq4", "tq4-emb"):
                group[f"{run}+kv {args.kv}"] = (quantized, kv_spec)
            del params, quantized
            measure(report, name, model, texts, group, args, save)
            del group
    print(markdown(report["rows"]))
    return 0


if __name__ == "__main__":
    run_main(main)
