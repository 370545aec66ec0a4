"""Quantize a model's weights into a checkpoint directory: `tqjax-quantize --out DIR`.

The directory loads anywhere a model path is accepted (`--model DIR`, `tqjax.load(DIR)`).
`--json` prints one final JSON line (bpw, bytes, seconds, ...) instead of a summary. The
checkpoint's quantization.json records the spec, the calibration choice, its token count and
the sha256 of the calibration text.
"""

from __future__ import annotations

import argparse
import time
from pathlib import Path

from tqjax.cli import ArgumentParser, check_writable, print_json, run_main

CALIBRATION_HELP = ("calibration text for GPTQ and mixed-precision sensitivities: 'default' "
                    "(shipped in tqjax/data: built-in text, Milton, stdlib modules outside the "
                    "evaluation set), 'builtin' (tqjax/data/calibration.txt only: ~530 tokens, "
                    "for quick runs with fewer, shorter --calibration-windows), 'none' "
                    "(data-free), or corpus specs joined by '+' (e.g. "
                    "'shakespeare:hamlet+milton:comus'); never evaluate on it")


def parse_args(argv: list[str] | None = None) -> argparse.Namespace:
    """The command line (sys.argv[1:] when argv is None)."""
    from tqjax.dtypes import DTYPES
    from tqjax.fetch import DEFAULT_MODEL, MODEL_NAMES
    from tqjax.models.calibration import CALIBRATION_WINDOWS
    from tqjax.models.quantize import METHODS, MIXED

    p = ArgumentParser(prog="tqjax-quantize", description=__doc__.split("\n\n")[0])
    p.add_argument("--model", "-m", default=DEFAULT_MODEL,
                   help=f"model name ({', '.join(MODEL_NAMES)}), HF directory or .gguf file")
    p.add_argument("--out", "-o", required=True, type=Path, help="checkpoint directory to write")
    p.add_argument("--weights", default="tq4", choices=[*METHODS, MIXED],
                   help="quantization method (default tq4)")
    p.add_argument("--bpw", type=float, default=None,
                   help="target bits per weight of the quantized tensors, every stored byte "
                        "counted (with --weights mixed)")
    p.add_argument("--quantize-embeddings", action="store_true",
                   help="also quantize the token embedding and an untied output head (8-bit "
                        "TurboQuant): far less memory for large-vocabulary models")
    p.add_argument("--dense-dtype", default="float16", choices=list(DTYPES),
                   help="storage dtype of the tensors kept dense (embedding, norms, biases)")
    p.add_argument("--json", action="store_true", help="print one JSON line at the end")
    study = p.add_argument_group("calibration options (the defaults are the recipe)")
    study.add_argument("--calibration", default="default", help=CALIBRATION_HELP)
    study.add_argument("--calibration-windows", type=int, default=CALIBRATION_WINDOWS,
                       help=f"windows of calibration text (default {CALIBRATION_WINDOWS})")
    study.add_argument("--calibration-length", type=int, default=1024, help="tokens per window")
    study.add_argument("--group-size", type=int, default=None,
                       help="input rows per scale (default: 64 for tq, 32 for int4, "
                            "per-channel for int8; mixed picks 64 or 128 per tensor unless "
                            "this fixes one)")
    study.add_argument("--seed", type=int, default=0, help="rotation seed")
    return p.parse_args(argv)


def run(argv: list[str] | None = None) -> int:
    """Quantize and save; returns the exit status (user errors raise TqjaxError)."""
    args = parse_args(argv)
    import dataclasses

    import tqjax
    from tqjax.api import open_model, resolve_path
    from tqjax.models.calibration import calibration_source, calibration_windows, text_sha256
    from tqjax.models.checkpoint import check_target, save_quantized
    from tqjax.models.orbax_checkpoint import is_orbax_checkpoint
    from tqjax.models.quantize import WeightSpec, quantize_params
    from tqjax.quant.accounting import params_bits

    spec = WeightSpec(args.weights, bpw=args.bpw, group_size=args.group_size,
                      quantize_embeddings=args.quantize_embeddings, seed=args.seed)
    if args.calibration_windows < 1 or args.calibration_length < 2:
        raise tqjax.TqjaxError("--calibration-windows must be >= 1 and --calibration-length >= 2")
    check_target(check_writable(args.out, whole=True))  # before minutes of quantizing
    t0 = time.perf_counter()
    path = resolve_path(args.model, progress=not args.json)
    if is_orbax_checkpoint(path):  # sharded pytrees: restored whole, then quantized
        model = tqjax.load(path, progress=not args.json)
        source, config, tokenizer = model.params, model.config, model.tokenizer
    else:  # read a layer at a time as it is quantized
        source, tokenizer = open_model(path, progress=not args.json)
        config = source.config
    text = calibration_source(args.calibration)
    windows = None
    if text is not None:
        if tokenizer is None:
            raise tqjax.TqjaxError(f"{path} has no tokenizer; use --calibration none")
        length = min(args.calibration_length, config.max_position)
        windows = calibration_windows(tokenizer, text, args.calibration_windows, length)
    t1 = time.perf_counter()
    params = quantize_params(source, config, spec, windows, progress=not args.json)
    quantize_s = time.perf_counter() - t1
    meta = save_quantized(args.out, params, config, method=dataclasses.asdict(spec) | {
        "calibration": args.calibration,
        "calibration_sha256": None if text is None else text_sha256(text),
        "calibration_tokens": 0 if windows is None else int(windows.size)},
        tokenizer=tokenizer, source=path, dense_dtype=args.dense_dtype)
    bits = params_bits(params)
    result = {
        "out": str(args.out), "model": str(path), "weights": args.weights,
        "bpw": round(bits["quantized_bpw"], 6), "bpw_overall_disk": round(
            meta["disk"]["weights_bpw"], 6),
        "bytes": sum(f.stat().st_size for f in args.out.iterdir()),
        "params": bits["params"], "quantized_params": bits["quantized_params"],
        "calibration_tokens": 0 if windows is None else int(windows.size),
        "seconds": round(time.perf_counter() - t0, 2),
        "quantize_seconds": round(quantize_s, 2),  # the reading included
    }
    if args.json:
        print_json(result)
    else:
        print(f"wrote {args.out}: {result['bytes'] / 2**20:.1f} MiB, {result['bpw']:.4f} bits per "
              f"quantized weight, {result['bpw_overall_disk']:.3f} overall "
              f"({result['seconds']:.1f} s)")
    return 0


def main(argv: list[str] | None = None) -> None:
    """Entry point `tqjax-quantize`: one-line errors, exit 2 on bad input."""
    run_main(lambda: run(argv))


if __name__ == "__main__":
    main()
