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

from tqjax.cli import ArgumentParser, run_main

DEFAULT_TYPES = ("bf16,q8,q4,turbo4,turbo3.5,turbo3,turbo2.5,turbo2,turbo4/turbo3,"
                 "turbo3.5/turbo3,turbo4-prod,turbo4:naive,turbo3:naive")


def parse_type(item: str) -> tuple[str, dict]:
    """"K[/V][:naive]" -> (label, CacheSpec kwargs); naive turns every robustness step off."""
    body, _, flag = item.partition(":")
    k, _, v = body.partition("/")
    kw: dict = {"k": k, "v": v or k}
    if flag == "naive":
        kw |= {"center_keys": False, "center_values": False, "balance_keys": False,
                "sink_tokens": 0}
    return item, kw


def bits_per_value(model: object, spec: object) -> float:
    from tqjax.decode.generate import new_cache
    from tqjax.kv.cache import bytes_per_token

    cfg = model.config
    cache = new_cache(model.params, cfg, spec, 1, 64, model.calibration(spec))
    return 8 * bytes_per_token(cache) / (cfg.num_layers * 2 * cfg.num_kv_heads * cfg.head_dim)


def main() -> int:
    p = ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--models", default="smollm2-135m-instruct,qwen2.5-coder-0.5b-instruct")
    p.add_argument("--texts", default="shakespeare:hamlet,python-stdlib")
    p.add_argument("--types", default=DEFAULT_TYPES, help="comma list of K[/V][:naive]")
    p.add_argument("--ctx-size", type=int, default=2048)
    p.add_argument("--max-tokens", type=int, default=8192)
    p.add_argument("--out", type=Path, default=Path("kv_table.jsonl"))
    p.add_argument("--report", type=Path, default=None,
                   help="only print the markdown table of an existing JSONL file")
    args = p.parse_args()
    if args.report is not None:
        print_markdown([json.loads(line) for line in args.report.read_text().splitlines()])
        return 0

    import dataclasses

    import tqjax
    from tqjax.eval import sweep
    from tqjax.fetch import corpus_text
    from tqjax.kv.cache import check_spec

    types = [parse_type(t) for t in args.types.split(",") if t]
    for _, kw in types:
        check_spec(tqjax.CacheSpec(**kw))
    rows = []
    for name in args.models.split(","):
        model = tqjax.load(name)
        for text in args.texts.split(","):
            ids = model.tokenizer.encode(corpus_text(text), add_bos=False)[: args.max_tokens]
            runs = {"f32": (model, tqjax.CacheSpec())}
            runs |= {label: (model, tqjax.CacheSpec(**kw)) for label, kw in types}
            t0 = time.perf_counter()
            res = sweep(ids, args.ctx_size, runs, reference="f32")
            base = res["f32"].ppl
            for label, r in res.items():
                spec = runs[label][1]
                row = {"model": name, "text": text, "type": label, "ppl": r.ppl,
                       "dppl_pct": 100 * (r.ppl / base - 1), "kl": r.kl, "top1": r.top1,
                       "bits_per_value": bits_per_value(model, spec), "tokens": r.tokens,
                       "ctx": args.ctx_size, "spec": dataclasses.asdict(spec),
                       "seconds": time.perf_counter() - t0}
                rows.append(row)
                with args.out.open("a") as f:  # append-only log of finished rows
                    f.write(json.dumps(row) + "\n")
    print_markdown(rows)
    return 0


def print_markdown(rows: list[dict]) -> None:
    print("| model | text | cache K/V | bits/value | PPL | ΔPPL | KL | top-1 |")
    print("|---|---|---|---|---|---|---|---|")
    for r in rows:
        print(f"| {r['model']} | {r['text']} | {r['type']} | {r['bits_per_value']:.2f} | "
              f"{r['ppl']:.3f} | {r['dppl_pct']:+.2f}% | {r['kl']:.4f} | {r['top1']:.3f} |")


if __name__ == "__main__":
    run_main(main)
