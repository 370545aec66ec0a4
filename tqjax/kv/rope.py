"""Rotary position embedding, half-split layout (HF `rotate_half` convention)."""

import jax
import jax.numpy as jnp


def rope_cos_sin(positions: jax.Array, inv_freq: jax.Array) -> tuple[jax.Array, jax.Array]:
    """positions int [...], inv_freq f32 [hd/2] -> (cos, sin) f32 [..., hd/2]."""
    angles = positions.astype(jnp.float32)[..., None] * inv_freq
    return jnp.cos(angles), jnp.sin(angles)


def apply_rope(x: jax.Array, cos: jax.Array, sin: jax.Array, inverse: bool = False) -> jax.Array:
    """Rotate x [..., hd] by angles given as cos/sin broadcastable to [..., hd/2].

    `inverse=True` undoes the rotation (used to recover pre-RoPE keys).
    """
    half = x.shape[-1] // 2
    x1, x2 = x[..., :half].astype(jnp.float32), x[..., half:].astype(jnp.float32)
    if inverse:
        sin = -sin
    out = jnp.concatenate([x1 * cos - x2 * sin, x2 * cos + x1 * sin], axis=-1)
    return out.astype(x.dtype)
