"""The one table of the floating-point types tqjax keeps parameters, activations and dense
caches in: full names (`--dtype`, checkpoints) and the cache types' short names."""

from __future__ import annotations

import jax.numpy as jnp

DTYPES = {"float32": jnp.float32, "bfloat16": jnp.bfloat16, "float16": jnp.float16}
SHORT_NAMES = {"f32": "float32", "bf16": "bfloat16", "f16": "float16"}  # dense KV cache types

