"""Output-column tiling shared by the XLA paths of the quantized linears (`weights`, `ggml`)."""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

import jax
import jax.numpy as jnp


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
