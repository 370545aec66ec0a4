"""TurboQuant distortion table: measured against the Lloyd–Max prediction and the paper's bounds.

For each dimension d and bit width b: the empirical D_mse = mean ‖x − x̂‖²/‖x‖² of the paper's plain
TurboQuant_mse (scale ‖x‖/√d) and of the norm-corrected default (scale ‖x‖/‖c‖), the codebook's
predicted d·mse, the paper's D_mse, its bounds 4^−b ≤ D_mse ≤ (√3·π/2)·4^−b, and for random unit
queries y the RMS and least-squares slope of the inner-product error (⟨y, x̂⟩ − ⟨y, x⟩)/(‖y‖‖x‖)
for the MSE quantizer and TurboQuant_prod (b ≥ 2). Vectors are uniformly random unit vectors, or
the rows of tensor `x` [N, d] of `--vectors FILE.safetensors` (e.g. real keys or values).

    python scripts/research/distortion.py [--json] [--out FILE] [--vectors FILE.safetensors]
"""

from __future__ import annotations

import json
import math

import numpy as np

from tqjax.atomic import write_text
from tqjax.cli import ArgumentParser, run_main
from tqjax.errors import TqjaxError

PAPER_D_MSE = {1: 0.36, 2: 0.117, 3: 0.03, 4: 0.009}
COLUMNS = [
    ("d", "d", "{:d}"),
    ("bits", "b", "{:d}"),
    ("bits_per_value", "bits/val", "{:.3f}"),
    ("mse", "mse", "{:.4f}"),
    ("mse_norm_corrected", "mse_nc", "{:.4f}"),
    ("mse_predicted", "predicted", "{:.4f}"),
    ("mse_paper", "paper", "{:.4f}"),
    ("lower_bound", "lower", "{:.4f}"),
    ("upper_bound", "upper", "{:.4f}"),
    ("ip_rmse_mse", "ip_rms", "{:.4f}"),
    ("ip_slope_mse", "slope", "{:.3f}"),
    ("ip_rmse_prod", "ip_rms_prod", "{:.4f}"),
    ("ip_slope_prod", "slope_prod", "{:.3f}"),
]


def load_vectors(path: str) -> np.ndarray:
    """Tensor `x` [N, d] of a safetensors file, as float32."""
    from safetensors import SafetensorError
    from safetensors.numpy import load_file

    try:
        tensors = load_file(path)
    except (OSError, SafetensorError) as e:
        raise TqjaxError(f"cannot read {path}: {e}") from None
    if "x" not in tensors:
        raise TqjaxError(f"{path} has no tensor named 'x' (found: {', '.join(sorted(tensors))})")
    x = tensors["x"]
    if x.ndim != 2 or x.shape[0] < 1:
        raise TqjaxError(f"tensor 'x' in {path} must be [N, d], got shape {x.shape}")
    return x.astype(np.float32)


def random_unit_vectors(n: int, d: int, seed: int) -> np.ndarray:
    x = np.random.default_rng(seed).standard_normal((n, d))
    return (x / np.linalg.norm(x, axis=-1, keepdims=True)).astype(np.float32)


def table_row(x: np.ndarray, bits: int, seed: int) -> dict:
    """One row of the table for vectors x [N, d] at `bits` per coordinate."""
    from tqjax.quant import (
        bits_per_value,
        distortion,
        lloyd_max,
        make_prod_quantizer,
        make_quantizer,
    )

    d = x.shape[-1]
    plain = distortion(make_quantizer(d, bits, seed, norm_correction=False), x, seed=seed + 1)
    corrected = distortion(make_quantizer(d, bits, seed), x, seed=seed + 1)
    prod = distortion(make_prod_quantizer(d, bits, seed), x, seed=seed + 1) if bits >= 2 else {}
    return {
        "d": d,
        "bits": bits,
        "bits_per_value": bits_per_value(bits, d),
        "mse": plain["mse"],
        "mse_norm_corrected": corrected["mse"],
        "mse_predicted": d * lloyd_max(bits, d).mse,
        "mse_paper": PAPER_D_MSE.get(bits),
        "lower_bound": 4.0**-bits,
        "upper_bound": math.sqrt(3) * math.pi / 2 * 4.0**-bits,
        "ip_rmse_mse": plain["ip_rmse"],
        "ip_slope_mse": plain["ip_slope"],
        "ip_rmse_norm_corrected": corrected["ip_rmse"],
        "ip_slope_norm_corrected": corrected["ip_slope"],
        "ip_rmse_prod": prod.get("ip_rmse"),
        "ip_slope_prod": prod.get("ip_slope"),
    }


def format_table(rows: list[dict]) -> str:
    cells = [[head for _, head, _ in COLUMNS]]
    for row in rows:
        cells.append(
            ["-" if row[key] is None else fmt.format(row[key]) for key, _, fmt in COLUMNS]
        )
    widths = [max(len(line[i]) for line in cells) for i in range(len(COLUMNS))]
    lines = ("  ".join(c.rjust(w) for c, w in zip(line, widths, strict=True)) for line in cells)
    return "\n".join(lines)


def main() -> None:
    p = ArgumentParser(description=__doc__.split("\n")[0])
    p.add_argument("--json", action="store_true", help="emit JSON instead of a text table")
    p.add_argument("--out", help="write the output to this file (atomically) instead of stdout")
    p.add_argument("--vectors", help="safetensors file with a tensor 'x' [N, d] to measure")
    p.add_argument("--dims", type=int, nargs="+", default=[64, 128], help="for random vectors")
    p.add_argument("--bits", type=int, nargs="+", default=[1, 2, 3, 4])
    p.add_argument("-n", type=int, default=10_000, help="number of random unit vectors")
    p.add_argument("--seed", type=int, default=0, help="rotation / data seed")
    args = p.parse_args()
    if args.n < 1:
        p.error("-n must be positive")

    if args.vectors:
        sets = [(args.vectors, load_vectors(args.vectors))]
    else:
        sets = [("random unit", random_unit_vectors(args.n, d, args.seed)) for d in args.dims]
    rows = [
        {"vectors": name, **table_row(x, bits, args.seed)} for name, x in sets for bits in args.bits
    ]
    if args.json:
        text = json.dumps({"n": int(sets[0][1].shape[0]), "rows": rows}, indent=1) + "\n"
    else:
        text = f"{sets[0][0]} vectors, N = {sets[0][1].shape[0]}\n{format_table(rows)}\n"
    if args.out:
        write_text(args.out, text)
    else:
        print(text, end="")


if __name__ == "__main__":
    run_main(main)
