"""Benchmark an OpenAI-compatible server: `python scripts/bench_serve.py -m smollm2-135m-instruct`.

Starts `scripts/serve.py` with the given model flags on a free loopback port (or measures the
server at --url, e.g. llama-server or llama_cpp.server), then sends --requests streamed
completions with Poisson arrivals (--rate per second; 0 = all at once) from at most --clients
concurrent clients. Prompts are paragraphs of the shipped calibration prose (Milton). Prints
one JSON object: TTFT, TPOT, ITL and end-to-end latency (mean, p50, p99, in ms) and request and
output-token throughput; --out also writes it (atomically).
"""

from __future__ import annotations

import asyncio
import json
import math
import os
import socket
import subprocess
import sys
import time
from pathlib import Path

from tqjax.cli import ArgumentParser, add_model_args, print_json, run_main

ROOT = Path(__file__).resolve().parent.parent


def parse_args(argv: list[str] | None = None) -> object:
    p = ArgumentParser(description=__doc__.split("\n\n")[0])
    add_model_args(p, batches=True)
    p.add_argument("--url", default=None,
                   help="measure this server (base URL, e.g. http://127.0.0.1:8080) instead "
                        "of starting scripts/serve.py")
    p.add_argument("--clients", type=int, default=16, help="concurrent clients (default 16)")
    p.add_argument("--requests", type=int, default=48, help="requests in all (default 48)")
    p.add_argument("--rate", type=float, default=4.0,
                   help="Poisson arrival rate, requests/s (0: all at once; default 4)")
    p.add_argument("--max-tokens", type=int, default=64, help="tokens per request")
    p.add_argument("--prompt-words", type=int, default=120,
                   help="words per prompt, roughly (default 120)")
    p.add_argument("--slots", type=int, default=16, help="server slots (when started here)")
    p.add_argument("--ctx-size", type=int, default=1024, help="server context (started here)")
    p.add_argument("--api-key", default=None)
    p.add_argument("--model-id", default=None, help="the 'model' field sent (default: -m)")
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--startup-timeout", type=float, default=600.0)
    p.add_argument("--out", default=None, help="also write the JSON here")
    return p.parse_args(argv)


def prompts(count: int, words: int, seed: int) -> list[str]:
    """`count` prompts of about `words` words: consecutive runs of the calibration prose,
    starting at seeded random offsets."""
    import numpy as np

    from tqjax.data import calibration_part
    from tqjax.errors import TqjaxError

    text = calibration_part("prose").split()
    if words >= len(text):
        raise TqjaxError(f"--prompt-words must be < {len(text)} (the built-in prose's words)")
    rng = np.random.default_rng(seed)
    starts = rng.integers(0, len(text) - words, count)
    return [" ".join(text[s:s + words]) for s in starts]


def summary(xs: list[float]) -> dict[str, float]:
    """mean, p50 and p99 in milliseconds of values in seconds."""
    import numpy as np

    if not xs:  # (null in the JSON: NaN is not JSON)
        return {"mean": None, "p50": None, "p99": None}
    a = 1000 * np.asarray(xs)
    return {"mean": round(float(a.mean()), 2), "p50": round(float(np.percentile(a, 50)), 2),
            "p99": round(float(np.percentile(a, 99)), 2)}


async def one(client: object, url: str, body: dict, headers: dict) -> dict:
    """One streamed completion: arrival-to-first-text, gaps between text chunks, total."""
    t0 = time.perf_counter()
    first, last, gaps, tokens, err = None, None, [], 0, None
    async with client.stream("POST", url + "/v1/completions", json=body,
                             headers=headers) as r:
        if r.status_code != 200:
            err = f"HTTP {r.status_code}: {(await r.aread())[:200]!r}"
        else:
            async for line in r.aiter_lines():
                if not line.startswith("data: ") or line == "data: [DONE]":
                    continue
                try:
                    obj = json.loads(line[6:])
                except ValueError:
                    err = f"not a JSON event: {line[:100]!r}"
                    break
                if not isinstance(obj, dict):
                    err = f"not a JSON object event: {line[:100]!r}"
                    break
                if "error" in obj:
                    err = obj["error"].get("message")
                    break
                if obj.get("usage"):
                    tokens = obj["usage"].get("completion_tokens", tokens)
                if obj.get("choices") and obj["choices"][0].get("text"):
                    now = time.perf_counter()
                    if first is None:
                        first = now
                    else:
                        gaps.append(now - last)
                    last = now
    end = time.perf_counter()
    return {"ttft": None if first is None else first - t0, "e2e": end - t0, "gaps": gaps,
            "tokens": tokens, "error": err}


async def run(args: object, url: str) -> dict:
    import httpx
    import numpy as np

    texts = prompts(args.requests, args.prompt_words, args.seed)
    rng = np.random.default_rng(args.seed + 1)
    gaps = (rng.exponential(1 / args.rate, args.requests) if args.rate > 0
            else np.zeros(args.requests))
    sem = asyncio.Semaphore(args.clients)
    headers = {"authorization": f"Bearer {args.api_key}"} if args.api_key else {}
    model_id = args.model_id or Path(str(args.model)).name
    # a fresh connection per request: servers close idle keep-alive connections on their own
    # schedule (llama-server after 5 s), and a reused closed one fails the request
    limits = httpx.Limits(max_connections=args.clients + 4, max_keepalive_connections=0)
    async with httpx.AsyncClient(timeout=3600, limits=limits) as client:
        async def client_task(i: int, delay: float) -> dict:
            await asyncio.sleep(delay)
            async with sem:
                body = {"model": model_id, "prompt": texts[i], "max_tokens": args.max_tokens,
                        "temperature": 0, "stream": True,
                        "stream_options": {"include_usage": True}}
                return await one(client, url, body, headers)

        t0 = time.perf_counter()
        results = await asyncio.gather(*[client_task(i, d) for i, d in
                                         enumerate(np.cumsum(gaps))])
        wall = time.perf_counter() - t0
    ok = [r for r in results if r["error"] is None and r["ttft"] is not None]
    tpot = [(r["e2e"] - r["ttft"]) / (r["tokens"] - 1) for r in ok if r["tokens"] > 1]
    out_tokens = sum(r["tokens"] for r in ok)
    return {
        "url": url, "clients": args.clients, "requests": args.requests, "rate": args.rate,
        "max_tokens": args.max_tokens, "prompt_words": args.prompt_words,
        "completed": len(ok), "failed": len(results) - len(ok),
        "errors": sorted({r["error"] for r in results if r["error"]})[:5],
        "ttft_ms": summary([r["ttft"] for r in ok]), "tpot_ms": summary(tpot),
        "itl_ms": summary([g for r in ok for g in r["gaps"]]),
        "e2e_ms": summary([r["e2e"] for r in ok]), "wall_s": round(wall, 2),
        "output_tokens": out_tokens, "output_tok_s": round(out_tokens / wall, 2),
        "requests_per_s": round(len(ok) / wall, 3),
    }


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def start_server(args: object) -> tuple[subprocess.Popen, str]:
    """scripts/serve.py with this run's model flags; waits for /health."""
    import httpx

    from tqjax.errors import TqjaxError

    port = free_port()
    flags = ["--model", str(args.model), "--dtype", args.dtype, "--backend", args.backend,
             "--slots", str(args.slots), "--ctx-size", str(args.ctx_size), "--port", str(port)]
    for name in ("weights", "bpw", "cache_type_k", "cache_type_v", "kv", "kv_recent"):
        value = getattr(args, name)
        if value is not None:
            flags += [f"--{name.replace('_', '-')}", str(value)]
    for name in ("tp", "dp", "kv_boundary_layers"):
        flags += [f"--{name.replace('_', '-')}", str(getattr(args, name))]
    for name in ("quantize_embeddings",):
        if getattr(args, name):
            flags.append(f"--{name.replace('_', '-')}")
    if args.api_key:
        flags += ["--api-key", args.api_key]
    proc = subprocess.Popen([sys.executable, str(ROOT / "scripts" / "serve.py"), *flags],
                            env=dict(os.environ), stdout=subprocess.DEVNULL)
    url = f"http://127.0.0.1:{port}"
    end = time.time() + args.startup_timeout
    while time.time() < end:
        if proc.poll() is not None:
            raise TqjaxError(f"the server exited with status {proc.returncode}")
        try:
            if httpx.get(url + "/health", timeout=2).status_code == 200:
                return proc, url
        except httpx.HTTPError:
            pass
        time.sleep(0.5)
    proc.terminate()
    raise TqjaxError(f"the server did not start within {args.startup_timeout:.0f} s")


def main() -> int:
    args = parse_args()
    from tqjax.atomic import write_json
    from tqjax.errors import TqjaxError

    if min(args.clients, args.requests, args.max_tokens, args.prompt_words) < 1 or not (
            0 <= args.rate < math.inf):
        raise TqjaxError("--clients, --requests, --max-tokens and --prompt-words must be >= 1, "
                         "--rate finite and >= 0")
    prompts(args.requests, args.prompt_words, args.seed)  # (checks --prompt-words, before a load)
    proc = None
    url = args.url.rstrip("/") if args.url else None
    if url is None:
        proc, url = start_server(args)
    try:
        import httpx

        try:
            result = asyncio.run(run(args, url))
            models = httpx.get(url + "/v1/models", timeout=10)  # the server's own identity
        except httpx.HTTPError as e:
            raise TqjaxError(f"cannot reach {url}: {e}") from None
        try:
            served = models.json() if models.status_code == 200 else None
        except ValueError:  # (not JSON)
            served = None
    finally:
        if proc is not None:
            proc.terminate()
            proc.wait(60)
    from tqjax.commands.provenance import git_info, machine_info

    result["server"] = "tqjax scripts/serve.py" if proc is not None else "external"
    result |= {"served_models": served, "load_average": os.getloadavg(),
               **git_info(Path(__file__).resolve().parent.parent), "machine": machine_info()}
    if proc is not None:
        result |= {"model": str(args.model), "slots": args.slots, "ctx_size": args.ctx_size,
                   "kv": args.kv or args.cache_type_k or "f32", "tp": args.tp, "dp": args.dp}
    print_json(result)
    if args.out:
        write_json(args.out, result)
    if not result["completed"]:
        print(f"error: no request completed ({'; '.join(result['errors']) or 'no text came back'})",
              file=sys.stderr)
        return 1
    return 0


if __name__ == "__main__":
    run_main(main)
