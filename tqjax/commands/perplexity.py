"""Perplexity of a model on a text, in non-overlapping windows of --ctx-size tokens.

Like llama.cpp's perplexity tool each window is evaluated independently (no BOS is added);
unlike it, every predicted position of a window is scored, not only its second half.
"""

from __future__ import annotations

import time
from collections.abc import Callable
from pathlib import Path
from typing import TYPE_CHECKING

from tqjax.cli import (
    ArgumentParser,
    add_model_args,
    cache_spec,
    model_mesh,
    print_json,
    read_text_file,
    run_main,
)

if TYPE_CHECKING:
    from tqjax.models.tokenizer import Tokenizer

HEAD_MARGIN = 64  # ids encoded past --max-tokens and dropped: those near a text cut


def first_tokens(tokenizer: Tokenizer, read: Callable[[int | None], tuple[str, bool]],
                 n: int) -> list[int]:
    """The first n ids (0: all) of the text `read` gives (read(chars) -> up to that many
    characters, None: all, and whether that is the whole text), without reading or encoding
    more of a long text than they need: a prefix is encoded, 4x longer each time, until it
    gives n + HEAD_MARGIN ids; the margin, near the cut where a word may be split, is
    dropped. No BOS."""
    if n <= 0:
        return tokenizer.encode(read(None)[0], add_bos=False)
    chars = max(1 << 16, 8 * (n + HEAD_MARGIN))
    while True:
        text, whole = read(chars)
        ids = tokenizer.encode(text, add_bos=False)
        if whole or len(ids) >= n + HEAD_MARGIN:
            return ids[:n]
        chars *= 4


def run(argv: list[str] | None = None) -> int:
    """Measure; returns the exit status (user errors raise TqjaxError)."""
    p = ArgumentParser(prog="tqjax-perplexity", description=__doc__.split("\n\n")[0])
    add_model_args(p)
    src = p.add_mutually_exclusive_group()
    src.add_argument("--text-file", type=Path, help="a UTF-8 text file")
    src.add_argument("--corpus", default="shakespeare:hamlet",
                     help="named corpus: shakespeare:<play>, milton:<name> or python-stdlib "
                          "(default shakespeare:hamlet)")
    p.add_argument("--ctx-size", type=int, default=512, help="tokens per window")
    p.add_argument("--max-tokens", type=int, default=4096,
                   help="tokens of the text to use (0 = all)")
    p.add_argument("--compare", action="store_true",
                   help="also report ΔPPL ± its standard error, KL divergence and top-1 "
                        "agreement against a reference with an f32 cache: the same model "
                        "unquantized when --weights is given, else the model itself")
    p.add_argument("--reference", default=None, metavar="MODEL",
                   help="compare against this model (e.g. the original of a quantized "
                        "checkpoint) instead; implies --compare")
    p.add_argument("--json", action="store_true", help="print one JSON line")
    args = p.parse_args(argv)

    import numpy as np

    import tqjax
    from tqjax.api import kv_footprint
    from tqjax.errors import TqjaxError
    from tqjax.eval import perplexity
    from tqjax.fetch import corpus_text
    from tqjax.pallas.backend import check_backend, use_backend
    from tqjax.sharding import device_bytes

    spec = cache_spec(args)
    mesh = model_mesh(args)
    if args.max_tokens < 0:
        raise TqjaxError(f"--max-tokens must be >= 0 (0 = all), got {args.max_tokens}")
    if args.ctx_size < 2:
        raise TqjaxError(f"--ctx-size must be >= 2, got {args.ctx_size}")
    if args.text_file is not None:
        def read(chars: int | None) -> tuple[str, bool]:
            return read_text_file(args.text_file, chars)

        read(1 << 16)  # (a missing or binary file is refused before the model loads)
        source = str(args.text_file)
    else:
        corpus, source = corpus_text(args.corpus), args.corpus

        def read(chars: int | None) -> tuple[str, bool]:
            return (corpus, True) if chars is None else (corpus[:chars], chars >= len(corpus))
    model = tqjax.load(args.model, dtype=args.dtype, weights=args.weights, bpw=args.bpw,
                       quantize_embeddings=args.quantize_embeddings,
                       progress=not args.json, mesh=mesh)
    reference_model, reference_name = None, "an f32 cache"
    if args.reference is not None or (args.compare and args.weights is not None):
        reference_name = args.reference or f"{args.model} unquantized"
        reference_model = tqjax.load(args.reference or args.model, dtype=args.dtype,
                                     progress=not args.json, mesh=mesh)
        if reference_model.config.vocab_size != model.config.vocab_size:
            raise TqjaxError(f"the reference {reference_name} has another vocabulary "
                             f"({reference_model.config.vocab_size} vs "
                             f"{model.config.vocab_size} tokens)")
    compare = args.compare or reference_model is not None
    ids = first_tokens(model.tokenizer, read, args.max_tokens)
    t0 = time.perf_counter()
    args.backend = check_backend(args.backend)  # "auto" resolved, now that JAX runs
    with use_backend(args.backend):
        res = perplexity(model, ids, args.ctx_size, cache=spec,
                         reference=tqjax.CacheSpec() if compare else None,
                         reference_model=reference_model)
    out = {"ppl": round(res.ppl, 4), "nll": round(res.nll, 6), "tokens": res.tokens,
           "windows": res.windows, "ctx": args.ctx_size, "text": source,
           "model": model.source, "dtype": args.dtype,
           "cache_type_k": spec.k, "cache_type_v": spec.v, "backend": args.backend,
           "tp": args.tp, "devices": len(device_bytes(model.params)),
           **kv_footprint(model, spec, args.ctx_size),
           "seconds": round(time.perf_counter() - t0, 2)}
    if res.kl is not None:
        out |= {"reference": reference_name, "kl": res.kl, "top1": res.top1,
                "dppl_pct": 100 * float(np.expm1(res.nll_delta)),
                "dppl_se_pct": res.dppl_se_pct}
    if args.json:
        print_json(out)
    else:
        print(f"perplexity {res.ppl:.4f} over {res.tokens} predicted tokens "
              f"({res.windows} windows of {args.ctx_size}) on {source}")
        if res.kl is not None:
            print(f"vs {reference_name}: ΔPPL {100 * np.expm1(res.nll_delta):+.2f}% ± "
                  f"{res.dppl_se_pct:.2f}, KL {res.kl:.5f} nats/token, "
                  f"top-1 agreement {res.top1:.4f}")
    return 0


def main(argv: list[str] | None = None) -> None:
    """Entry point `tqjax-perplexity`: one-line errors, exit 2 on bad input."""
    run_main(lambda: run(argv))


if __name__ == "__main__":
    main()
