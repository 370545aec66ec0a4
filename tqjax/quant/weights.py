"""Linear layers over dense or quantized weights."""

from __future__ import annotations

from typing import Any

import jax
import jax.numpy as jnp


def linear(x: jax.Array, w: Any) -> jax.Array:
    """x [..., in] @ w [in, out] -> [..., out] in x's dtype."""
    return jnp.dot(x, w.astype(x.dtype))
