"""KV-cache quality table: perplexity change, KL divergence and top-1 agreement against an f32
cache for many cache types, on several models and texts. Results are appended to a JSONL file as
they finish (so a long run can be read while it goes) and a markdown table is printed at the end.

    python scripts/kv_table.py --models smollm2-135m-instruct --texts shakespeare:hamlet \
        --types turbo4,turbo4/turbo3,turbo3 --ctx-size 2048 --max-tokens 8192 --out kv.jsonl
"""

from __future__ import annotations

import json
import time
from pathlib import Path

from tqjax.cli import ArgumentParser, check_writable, run_main
from tqjax.errors import TqjaxError
from tqjax.kv.cache import NAIVE, parse_kv

DEFAULT_TYPES = ("bf16,q8,q4,turbo4,turbo3.5,turbo3,turbo2.5,turbo2,turbo4/turbo3,"
                 "turbo3.5/turbo3,turbo4-prod,turbo4:nowindow,turbo4:naive,turbo3:naive")
# named --types lists; "baselines": llama.cpp-style caches with and without turbo's aids (issue 25)
PRESETS = {
    "default": DEFAULT_TYPES,
    "baselines": "q8,q8_0,q4,q4:aids,q4_0,q4_0:aids,q4_0h,q4_0h:aids,turbo4,turbo3,turbo4:naive",
}


def parse_type(item: str) -> tuple[str, dict]:
    """"K[/V][:flag]" -> (label, CacheSpec kwargs). Flags: naive (every robustness step off),
    nowindow (no exact recent window), window16/window64 (other window lengths), aids (q8/q4
    baselines get turbo's centring, balancing, sinks and window)."""
    body, _, flag = item.partition(":")
    if flag not in FLAGS:
        raise TqjaxError(f"unknown flag {flag!r} in {item!r} (choose from: {', '.join(FLAGS)})")
    k, v = parse_kv(body)
    return item, {"k": k, "v": v, **FLAGS[flag]}


FLAGS = {
    "": {},
    "naive": NAIVE,
    "nowindow": {"recent_tokens": 0},
    "window16": {"recent_tokens": 16},
    "window64": {"recent_tokens": 64},
    "aids": {"baseline_aids": True},
}


def main() -> int:
    p = ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--models", default="smollm2-135m-instruct,qwen2.5-coder-0.5b-instruct")
    p.add_argument("--texts", default="shakespeare:hamlet,python-stdlib")
    p.add_argument("--types", default=DEFAULT_TYPES,
                   help="comma list of K[/V][:flag], flag: naive, nowindow, window16, window64, "
                        f"aids; or a preset name ({', '.join(PRESETS)})")
    p.add_argument("--ctx-size", type=int, default=2048)
    p.add_argument("--max-tokens", type=int, default=8192)
    p.add_argument("--out", type=Path, default=Path("kv_table.jsonl"))
    p.add_argument("--report", type=Path, default=None,
                   help="only print the markdown table of an existing JSONL file")
    args = p.parse_args()
    if args.report is not None:
        print_markdown(read_rows(args.report))
        return 0
    check_writable(args.out)
    args.out.parent.mkdir(parents=True, exist_ok=True)  # (appended to, not written atomically)

    import dataclasses

    import tqjax
    from tqjax.api import kv_footprint
    from tqjax.eval import sweep
    from tqjax.fetch import corpus_text
    from tqjax.kv.cache import check_spec

    types = [parse_type(t) for t in PRESETS.get(args.types, args.types).split(",") if t]
    for _, kw in types:
        check_spec(tqjax.CacheSpec(**kw))
    rows = []
    for name in args.models.split(","):
        model = tqjax.load(name)
        if model.tokenizer is None:
            raise TqjaxError(f"{model.source} has no tokenizer to encode the texts with")
        for text in args.texts.split(","):
            ids = model.tokenizer.encode(corpus_text(text), add_bos=False)[: args.max_tokens]
            runs = {"f32": (model, tqjax.CacheSpec())}
            runs |= {label: (model, tqjax.CacheSpec(**kw)) for label, kw in types}
            t0 = time.perf_counter()
            res = sweep(ids, args.ctx_size, runs, reference="f32")
            base = res["f32"].ppl
            for label, r in res.items():
                spec = runs[label][1]
                size = kv_footprint(model, spec, args.ctx_size)
                row = {"model": name, "text": text, "type": label, "ppl": r.ppl,
                       "dppl_pct": 100 * (r.ppl / base - 1), "dppl_se_pct": r.dppl_se_pct,
                       "kl": r.kl, "top1": r.top1,
                       "bits_per_value": size["kv_bits_per_value"],
                       "effective_bits": size["kv_effective_bits_per_value"], "tokens": r.tokens,
                       "ctx": args.ctx_size, "spec": dataclasses.asdict(spec),
                       "seconds": time.perf_counter() - t0}
                rows.append(row)
                with args.out.open("a") as f:  # append-only log of finished rows
                    f.write(json.dumps(row) + "\n")
    print_markdown(rows)
    return 0


ROW_KEYS = ("model", "text", "type", "ppl", "dppl_pct", "kl", "top1", "bits_per_value")


def read_rows(path: Path) -> list[dict]:
    """The rows of a kv_table JSONL file (each must carry `ROW_KEYS`); anything else is a
    one-line TqjaxError."""
    try:
        rows = [json.loads(line) for line in path.read_text(encoding="utf-8").splitlines()
                if line.strip()]
        for r in rows:
            missing = [k for k in ROW_KEYS if k not in r]
            if missing:
                raise KeyError(", ".join(missing))
    except (OSError, UnicodeDecodeError, ValueError, KeyError, TypeError) as e:
        raise TqjaxError(f"{path}: not a kv_table JSONL file ({e!r})") from None
    return rows


def print_markdown(rows: list[dict]) -> None:
    """Bits/value: per stored token; "at ctx" adds the per-layer constants (sinks, recent
    window, centres) spread over the context (rows from before that field show "–")."""
    from tqjax.eval import dppl_text

    print("| model | text | cache K/V | bits/value | at ctx | PPL | ΔPPL ± s.e. | KL | top-1 |")
    print("|---|---|---|---|---|---|---|---|---|")
    for r in rows:
        eff = f"{r['effective_bits']:.2f}" if "effective_bits" in r else "–"
        print(f"| {r['model']} | {r['text']} | {r['type']} | {r['bits_per_value']:.2f} | {eff} | "
              f"{r['ppl']:.3f} | {dppl_text(r)} | {r['kl']:.4f} | {r['top1']:.3f} |")


if __name__ == "__main__":
    run_main(main)
