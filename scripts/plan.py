"""Memory planner: for each weights × KV preset, the longest context that fits a memory budget
(and, with --context, the largest batch), from exact parameter and cache bytes plus the
measured runtime working set (`tqjax.planner`).

    python scripts/plan.py -m qwen2.5-coder-0.5b-instruct --memory 8GiB
    python scripts/plan.py -m smollm2-135m-instruct --memory 2GiB --context 4096 --json
"""

from __future__ import annotations

import dataclasses

from tqjax.cli import ArgumentParser, print_json, run_main


def _mib(x: float) -> str:
    return f"{x / 2**20:,.0f}" if x >= 10 * 2**20 else f"{x / 2**20:.3f}".rstrip("0").rstrip(".")


def main() -> int:
    from tqjax.fetch import DEFAULT_MODEL, MODEL_NAMES
    from tqjax.planner import plan

    p = ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--model", "-m", default=DEFAULT_MODEL,
                   help=f"model name ({', '.join(MODEL_NAMES)}), .gguf file or HF directory")
    p.add_argument("--memory", required=True, help="budget per device, e.g. 8GiB, 7.5GB, 512MiB")
    p.add_argument("--devices", type=int, default=1, help="devices the model is split over")
    p.add_argument("--batch", type=int, default=1, help="sequences decoded together")
    p.add_argument("--context", type=int, default=None,
                   help="also report the largest batch that fits at this context")
    p.add_argument("--json", action="store_true", help="print one JSON object")
    args = p.parse_args()
    result = plan(args.model, args.memory, devices=args.devices, batch=args.batch,
                  context=args.context)
    if args.json:
        print_json(dataclasses.asdict(result))
        return 0
    print(f"{result.model}: {_mib(result.memory_bytes)} MiB per device, {result.devices} "
          f"device(s), batch {result.batch}, model context {result.max_position}")
    head = f"{'weights':<11} {'kv':<14} {'params MiB':>11} {'KV B/token':>11} {'max context':>12}"
    if result.context is not None:
        head += f" {'batch@' + str(result.context):>12}"
    print(head + f" {'peak MiB':>9}")
    for r in result.rows:
        line = (f"{r.weights:<11} {r.kv:<14} {_mib(r.param_bytes):>11} "
                f"{r.kv_bytes_per_token:>11,.0f} {r.max_context:>12,}")
        if result.context is not None:
            line += f" {r.max_batch:>12,}"
        print(line + f" {_mib(r.peak_bytes):>9}")
    at = "one token" if result.context is None else f"context {result.context}"
    if not any(r.max_context for r in result.rows):
        smallest = min(result.rows, key=lambda r: r.peak_bytes)
        print(f"nothing fits in {_mib(result.memory_bytes)} MiB per device, even at one token: "
              f"the smallest, {smallest.weights} with a {smallest.kv} cache, needs "
              f"{_mib(smallest.peak_bytes)} MiB at {at}")
    elif not all(r.max_context for r in result.rows):
        print(f"max context 0: the preset does not fit even at one token (peak MiB is its "
              f"peak at {at})")
    return 0


if __name__ == "__main__":
    run_main(main)
