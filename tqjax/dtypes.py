"""The one table of the floating-point types tqjax keeps parameters, activations and dense
caches in: full names (`--dtype`, checkpoints) and the cache types' short names."""

from __future__ import annotations

import jax.numpy as jnp

from tqjax.errors import TqjaxError

DTYPES = {"float32": jnp.float32, "bfloat16": jnp.bfloat16, "float16": jnp.float16}
HALF_DTYPES = (jnp.bfloat16, jnp.float16)  # dense weights of these run as `quant.half.HalfLinear`
SHORT_NAMES = {"f32": "float32", "bf16": "bfloat16", "f16": "float16"}  # dense KV cache types


def resolve_dtype(name: str, what: str = "dtype") -> jnp.dtype:
    """A full dtype name ("float32", "bfloat16", "float16") -> the JAX dtype; anything else
    (the cache types' short names included) is a TqjaxError naming the choices."""
    if name not in DTYPES:
        raise TqjaxError(f"unknown {what} {name!r} (choose from: {', '.join(DTYPES)})")
    return DTYPES[name]

