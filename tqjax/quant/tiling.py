"""How the XLA paths of the quantized linears (`weights`, `ggml`) cut their work: output tiles
for decode-then-dot, and the fused vector-matrix dots of a decode step.

The fused form (measured on CPU, scripts/research/bench_linear.py): XLA emits a dot of a rank-1
vector with an operand stored [out, in] (input minor) whose values are an elementwise function
of packed bytes as *one loop* (`copy_dot_fusion` in the HLO) that decodes each value where the
dot reads it, so only the packed bytes are read and no decoded weight is written. That loop
slows down 5-30x once it reads 4096 or more bytes of each packed row (measured for int8, int4,
tq4 and GGUF blocks: int8 N=896 K=3968 0.48 ms, K=4096 13 ms; int4/tq4 K=7936 (3968 bytes)
1.5/4.1 ms, K=8192 25/35 ms), so a long row is cut into runs of whole groups of fewer than
FUSED_BYTES bytes each, each its own dot, and otherwise left whole (cutting a row that is
under the limit costs up to 3x with a codebook lookup: tq4 896 -> 4864 in 2 runs 6.1 ms, in
one 1.9 ms). `sum_parts` adds the runs' outputs behind a `reduce_precision` (an exact no-op
on f32) that keeps XLA from folding the sum into an output fusion that would write the
decoded weight out again.
"""

from __future__ import annotations

from collections.abc import Callable, Sequence
from typing import Any

import jax
import jax.numpy as jnp

FUSED_ROWS = 4  # inputs of up to this many rows (decode steps) take the fused dots on CPU
FUSED_BYTES = 4096  # a fused vector-matrix dot reads fewer than this many bytes of each row
# A GGUF dot reads one code plane (`tqjax.quant.ggml`) of at most this many values per run:
# with the codes read from whole blocks, runs of more slowed down well under the byte limit
# (4864x896 Q4_K: 2.7 ms in runs of <= 2048 values, 7.6 ms as one run); with planes, runs of
# 1024, 2048 and 4096 values measured alike (8960x1536 Q6_K 2.2 / 2.1 / 2.4 ms, stop 44)
GGML_FUSED_VALUES = 2048


TILE_WEIGHTS = 1 << 18  # weights decoded per tile of a prefill's decode-then-dot (1 MiB of f32)


def tile_rows(k: int, n: int, weights: int = TILE_WEIGHTS, multiple: int = 128) -> int:
    """Outputs per tile of a decode-then-dot over an [out n, in k] weight: about `weights`
    weights, a multiple of `multiple` outputs, at most n."""
    return min(n, max(multiple, weights // k // multiple * multiple))


def use_fused(rows: int) -> bool:
    """Whether an input of `rows` rows takes the fused vector-matrix dots (CPU, decode)."""
    return 0 < rows <= FUSED_ROWS and jax.default_backend() == "cpu"


def run_edges(pieces: int, piece_bytes: int, piece_values: int = 1,
              max_values: int | None = None) -> list[int]:
    """Offsets (in pieces) of the fewest runs of whole pieces (`piece_bytes` bytes of a row,
    `piece_values` inputs each) that keep every run under FUSED_BYTES bytes and at most
    `max_values` inputs, as even as possible (a piece over a limit is a run of its own)."""
    per = max(1, (FUSED_BYTES - 1) // piece_bytes)  # pieces per run at most
    if max_values is not None:
        per = max(1, min(per, max_values // piece_values))
    runs = max(1, -(-pieces // per))
    return [round(i * pieces / runs) for i in range(runs + 1)]


def sum_parts(parts: Sequence[jax.Array]) -> jax.Array:
    """Σ parts (f32 [N] each, the fused dots of one input row) kept apart from the dots."""
    y = parts[0]
    for part in parts[1:]:
        y = y + jax.lax.reduce_precision(part, 8, 23)
    return y


def column_tiles(tile: Callable[[Any, int], jax.Array], m: int, n: int, cols: int,
                 dtype: jnp.dtype) -> jax.Array:
    """y [M, N] from tile(start, size) -> y[:, start:start + size] [M, size]: a fori_loop over
    whole tiles of `cols` columns (so the decoded weight temporary stays tile-sized), then
    the remainder; one call when a single tile covers N."""
    tiles, rest = divmod(n, cols)
    if tiles == 1 and not rest:
        return tile(0, n)

    def body(j: jax.Array, y: jax.Array) -> jax.Array:
        return jax.lax.dynamic_update_slice_in_dim(y, tile(j * cols, cols), j * cols, axis=1)

    y = jax.lax.fori_loop(0, tiles, body, jnp.zeros((m, n), dtype))
    return y.at[:, tiles * cols:].set(tile(tiles * cols, rest)) if rest else y
