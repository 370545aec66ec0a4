"""Generate text with a Llama/Qwen model: `tqjax-generate --prompt "Once upon"`.

Streams text to stdout; `--json` prints one final JSON line instead; `--interactive` chats turn
by turn, reading your messages from stdin.
"""

from __future__ import annotations

import argparse
import sys
from collections.abc import Callable
from pathlib import Path
from typing import TYPE_CHECKING

from tqjax.cli import (
    ArgumentParser,
    add_model_args,
    cache_spec,
    check_writable,
    model_mesh,
    print_json,
    run_main,
)

if TYPE_CHECKING:
    from tqjax.api import Model
    from tqjax.decode.generate import GenerationResult
    from tqjax.kv.cache import CacheSpec

DEFAULT_PROMPT = "Once upon a time,"


def parse_args(argv: list[str] | None = None) -> argparse.Namespace:
    p = ArgumentParser(prog="tqjax-generate", description=__doc__.split("\n\n")[0])
    add_model_args(p)
    p.add_argument("--prompt", "-p", default=None,
                   help='prompt text (default "Once upon a time,"; with --interactive, the '
                        "first message)")
    p.add_argument("--chat", action="store_true", help="wrap the prompt in the chat template")
    p.add_argument("--interactive", "-i", action="store_true",
                   help="a conversation: your messages are read from stdin, a line each, and "
                        "each turn reuses the cache of the turns before it (/reset forgets "
                        "them; /exit or end of input ends; a turn that no longer fits the "
                        "context is refused, and /reset starts over)")
    p.add_argument("--system", default=None, help="system message (with --chat)")
    p.add_argument("-n", "--max-new-tokens", type=int, default=128,
                   help="tokens to generate at most")
    p.add_argument("--temperature", type=float, default=0.0, help="0 = greedy (default)")
    p.add_argument("--top-k", type=int, default=0, help="0 = off")
    p.add_argument("--top-p", type=float, default=1.0, help="in (0, 1]; 1 = off")
    p.add_argument("--min-p", type=float, default=0.0, help="in [0, 1); 0 = off")
    p.add_argument("--repeat-penalty", type=float, default=1.0, help="1 = off")
    p.add_argument("--seed", type=int, default=0,
                   help="sampling seed; -1 draws one (as llama.cpp; --json reports it)")
    p.add_argument("--stop", action="append", default=[], help="stop string (repeatable)")
    p.add_argument("--ctx-size", type=int, default=None,
                   help="context size in tokens (default: the model's)")
    p.add_argument("--prompt-cache", default=None, metavar="FILE",
                   help="reuse the cached prefix of the prompt from FILE if it matches, then "
                        "save the prompt's cache there (llama.cpp's --prompt-cache)")
    p.add_argument("--prompt-cache-ro", action="store_true",
                   help="with --prompt-cache: read the file, never write it")
    p.add_argument("--context-shift", action="store_true",
                   help="when the context is full, drop half of the tokens after the first "
                        "--keep and go on (dense key caches); default: stop")
    p.add_argument("--keep", type=int, default=0, metavar="N",
                   help="with --context-shift: tokens kept at the start, at most the prompt "
                        "(-1: the whole prompt)")
    p.add_argument("--json", action="store_true", help="print one JSON line at the end")
    return p.parse_args(argv)


def run(argv: list[str] | None = None) -> int:
    """Generate; returns the exit status (user errors raise TqjaxError)."""
    args = parse_args(argv)
    import tqjax
    from tqjax.api import check_options, kv_footprint
    from tqjax.decode.sampling import RANDOM_SEED, SamplingParams, random_seed
    from tqjax.pallas.backend import check_backend, use_backend

    # Validate every option before the (slow) model load.
    SamplingParams(args.temperature, args.top_k, args.top_p, args.min_p, args.repeat_penalty)
    if args.seed == RANDOM_SEED:
        args.seed = random_seed()
    spec = cache_spec(args)
    mesh = model_mesh(args)
    if args.ctx_size is not None and args.ctx_size < 2:
        raise tqjax.TqjaxError(f"--ctx-size must be >= 2, got {args.ctx_size}")
    if args.prompt_cache_ro and args.prompt_cache is None:
        raise tqjax.TqjaxError("--prompt-cache-ro goes with --prompt-cache FILE")
    if args.prompt_cache is not None and not args.prompt_cache_ro:
        check_writable(Path(args.prompt_cache), "--prompt-cache")
    if args.prompt_cache_ro and not Path(args.prompt_cache).exists():  # (before the load)
        raise tqjax.TqjaxError(f"prompt cache {args.prompt_cache} does not exist "
                               f"(--prompt-cache-ro reads a saved one)")
    if args.keep < -1:
        raise tqjax.TqjaxError(f"--keep must be >= -1, got {args.keep}")
    if args.interactive and (args.json or args.prompt_cache is not None):
        raise tqjax.TqjaxError("--interactive goes without --json and --prompt-cache")
    check_options(args.stop, args.chat or args.interactive, args.system, args.keep,
                  args.context_shift)
    model = tqjax.load(args.model, dtype=args.dtype, weights=args.weights, bpw=args.bpw,
                       quantize_embeddings=args.quantize_embeddings,
                       progress=not args.json, mesh=mesh)

    def stream(piece: str) -> None:
        sys.stdout.write(piece)
        sys.stdout.flush()

    args.backend = check_backend(args.backend)  # "auto" resolved, now that JAX runs
    if args.interactive:
        with use_backend(args.backend):
            return converse(model, args, spec, stream)
    with use_backend(args.backend):
        result = tqjax.generate(
            model, args.prompt or DEFAULT_PROMPT, max_new_tokens=args.max_new_tokens,
            temperature=args.temperature, top_k=args.top_k, top_p=args.top_p, min_p=args.min_p,
            repeat_penalty=args.repeat_penalty, seed=args.seed, stop=args.stop,
            chat=args.chat, system=args.system, ctx_size=args.ctx_size, cache=spec,
            on_text=None if args.json else stream, context_shift=args.context_shift,
            n_keep=args.keep, prompt_cache=args.prompt_cache,
            prompt_cache_ro=args.prompt_cache_ro)
    timed = result.decode_tok_s  # (None: too few tokens were timed)
    if args.json:
        print_json({
            "text": result.text, "token_ids": result.token_ids,
            "prompt_tokens": result.prompt_tokens, "generated_tokens": result.generated_tokens,
            "finish_reason": result.finish_reason, "seed": args.seed,
            "cached_tokens": result.cached_tokens,
            "context_shifts": result.context_shifts,
            "prefill_tok_s": round(result.prefill_tok_s, 2),
            "prefill_compile_s": round(result.prefill_compile_s, 3),
            "decode_tok_s": None if timed is None else round(timed, 2),
            "model": model.source, "dtype": args.dtype, "backend": args.backend,
            "cache_type_k": spec.k, "cache_type_v": spec.v,
            **kv_footprint(model, spec, args.ctx_size),
        })
    else:
        sys.stdout.write("\n")
        print_stats(result, "from the prompt cache")
    return 0


def print_stats(result: GenerationResult, reused: str) -> None:
    """The stats line on stderr: prompt tokens (those reused), prefill and decode speed."""
    timed = result.decode_tok_s
    cached = f" ({result.cached_tokens} {reused})" if result.cached_tokens else ""
    compiled = (f" (+{result.prefill_compile_s:.1f} s compiling)"
                if result.prefill_compile_s >= 0.05 else "")
    print(f"[{result.prompt_tokens} prompt tokens{cached} at {result.prefill_tok_s:.1f} tok/s"
          f"{compiled}, {result.generated_tokens} generated"
          f"{'' if timed is None else f' at {timed:.1f} tok/s'}]", file=sys.stderr, flush=True)


def converse(model: Model, args: argparse.Namespace, spec: CacheSpec,
             stream: Callable[[str], None]) -> int:
    """`--interactive`: a chat read from stdin a line at a time, in one `Session`, so that each
    turn prefills only its own message (the turns before are in the cache). A turn the context
    cannot hold is refused with its error and the conversation goes on (/reset starts over)."""
    import tqjax

    if not model.tokenizer.chat_template:
        raise tqjax.TqjaxError(f"{model.source} has no chat template; --interactive chats")
    if args.context_shift:  # (refused once here: every turn would be refused the same way)
        from tqjax.decode.generate import check_shiftable, new_cache

        check_shiftable(new_cache(model.params, model.config, spec, 1, 1,
                                  model.calibration(spec)))
    session = tqjax.Session(model, cache=spec, ctx_size=args.ctx_size)
    system = [] if args.system is None else [{"role": "system", "content": args.system}]
    messages = list(system)
    first = args.prompt
    while True:
        if first is not None:
            line, first = first, None
        else:
            sys.stderr.write("> ")
            sys.stderr.flush()
            raw = sys.stdin.buffer.readline()
            if not raw:  # end of input
                return 0
            try:
                line = raw.decode("utf-8").rstrip("\r\n")
            except UnicodeDecodeError as e:
                print(f"error: that line is not UTF-8 (byte 0x{raw[e.start]:02x} at {e.start}); "
                      f"nothing was sent", file=sys.stderr)
                continue
        if line.strip() in ("/exit", "/quit"):
            return 0
        if line.strip() == "/reset":
            messages = list(system)
            session.reset()
            continue
        if not line.strip():
            continue
        messages.append({"role": "user", "content": line})
        try:
            result = session.generate(
                messages, max_new_tokens=args.max_new_tokens, temperature=args.temperature,
                top_k=args.top_k, top_p=args.top_p, min_p=args.min_p,
                repeat_penalty=args.repeat_penalty, seed=args.seed, stop=args.stop,
                on_text=stream, context_shift=args.context_shift, n_keep=args.keep)
        except tqjax.TqjaxError as e:
            messages.pop()
            print(f"error: {e} (/reset starts the conversation over)", file=sys.stderr)
            continue
        messages.append({"role": "assistant", "content": result.text})
        sys.stdout.write("\n")
        print_stats(result, "reused")


def main(argv: list[str] | None = None) -> None:
    """Entry point `tqjax-generate`: one-line errors, exit 2 on bad input."""
    run_main(lambda: run(argv))


if __name__ == "__main__":
    main()
