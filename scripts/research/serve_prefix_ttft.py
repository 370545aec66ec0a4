"""Prefix reuse in the server: TTFT of a chat request with a ~1k-token system prompt, then of a
second request sharing that system prompt (prefilled only past the common prefix), and whether
the greedy output equals offline `tqjax.generate`. One JSON line.

python scripts/research/serve_prefix_ttft.py -m smollm2-135m-instruct [--kv turbo4]
"""

from __future__ import annotations

import socket
import threading
import time

from tqjax.cli import ArgumentParser, add_model_args, cache_spec, print_json, run_main


def main() -> int:
    p = ArgumentParser(description=__doc__.split("\n\n")[0])
    add_model_args(p)
    p.add_argument("--system-words", type=int, default=700)
    p.add_argument("--ctx-size", type=int, default=1536)
    p.add_argument("--max-tokens", type=int, default=8)
    args = p.parse_args()
    import openai
    import uvicorn

    import tqjax
    from tqjax.data import calibration_part
    from tqjax.serve.engine import Engine
    from tqjax.serve.server import Server, create_app

    spec = cache_spec(args)
    model = tqjax.load(args.model, dtype=args.dtype, weights=args.weights)
    engine = Engine(model, spec, slots=2, ctx_size=args.ctx_size, backend=args.backend)
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        port = s.getsockname()[1]
    uv = uvicorn.Server(uvicorn.Config(create_app(Server(engine, "m")), host="127.0.0.1",
                                       port=port, log_level="warning"))
    thread = threading.Thread(target=uv.run, daemon=True)
    thread.start()
    while not uv.started:
        time.sleep(0.05)
    client = openai.OpenAI(base_url=f"http://127.0.0.1:{port}/v1", api_key="-", timeout=3600)
    system = " ".join(calibration_part("prose").split()[: args.system_words])

    def ask(question: str) -> tuple[float, str, object, list]:
        msgs = [{"role": "system", "content": system}, {"role": "user", "content": question}]
        t0, ttft, text, usage = time.perf_counter(), None, "", None
        for chunk in client.chat.completions.create(
                model="m", messages=msgs, max_tokens=args.max_tokens, temperature=0,
                stream=True, stream_options={"include_usage": True}):
            if chunk.choices and chunk.choices[0].delta.content and ttft is None:
                ttft = time.perf_counter() - t0
            text += (chunk.choices[0].delta.content or "") if chunk.choices else ""
            usage = chunk.usage or usage
        return ttft, text, usage, msgs

    ask("Warm up: say hi.")  # compiles the prefill chunk shapes and the decode step,
    ask("Warm up again.")  # and the short chunk of a reused prefix
    engine.call(lambda: [engine.erase_slot(i) for i in range(engine.n)])
    t1, _, u1, _ = ask("Who speaks first?")
    t2, text2, u2, msgs = ask("Name the poem.")
    ids = model.tokenizer.encode(model.tokenizer.apply_chat_template(msgs), add_bos=False)
    ref = tqjax.generate(model, ids, max_new_tokens=args.max_tokens, ctx_size=args.ctx_size,
                         cache=spec)
    uv.should_exit = True
    thread.join(60)
    print_json({"model": args.model, "kv": f"{spec.k}/{spec.v}", "prompt_tokens": len(ids),
                "first_cached_tokens": u1.prompt_tokens_details.cached_tokens,
                "second_cached_tokens": u2.prompt_tokens_details.cached_tokens,
                "ttft_first_ms": round(1000 * t1, 1), "ttft_second_ms": round(1000 * t2, 1),
                "ttft_ratio": round(t1 / t2, 2), "second_equals_offline": text2 == ref.text})
    return 0


if __name__ == "__main__":
    run_main(main)
