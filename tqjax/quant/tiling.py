"""How the XLA paths of the quantized linears (`weights`, `ggml`) cut their work: output tiles
for decode-then-dot, and the fused vector-matrix dots of a decode step.

The fused form (measured on CPU, scripts/research/bench_linear.py): XLA emits a dot of a rank-1
vector with an operand stored [out, in] (input minor) whose values are an elementwise function
of packed bytes as *one loop* (`copy_dot_fusion` in the HLO) that decodes each value where the
dot reads it, so only the packed bytes are read and no decoded weight is written. That loop
slows down ~5x from about 4096 inputs, so the input dim is cut into runs of at most FUSED_K
values, each its own dot; `sum_parts` adds the runs' outputs behind a `reduce_precision` (an
exact no-op on f32) that keeps XLA from folding the sum into an output fusion that would
write the decoded weight out again.
"""

from __future__ import annotations

from collections.abc import Callable, Sequence
from typing import Any

import jax
import jax.numpy as jnp

FUSED_ROWS = 4  # inputs of up to this many rows (decode steps) take the fused dots on CPU
FUSED_K = 2048  # input values per fused vector-matrix dot


def use_fused(rows: int) -> bool:
    """Whether an input of `rows` rows takes the fused vector-matrix dots (CPU, decode)."""
    return 0 < rows <= FUSED_ROWS and jax.default_backend() == "cpu"


def run_edges(pieces: int, piece: int) -> list[int]:
    """Offsets (in pieces) of runs of whole pieces of `piece` input values each, as even as
    possible and at most FUSED_K values per run (a longer piece is a run of its own)."""
    runs = max(1, min(pieces, -(-pieces * piece // FUSED_K)))
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
