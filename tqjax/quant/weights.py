"""Linear layers over dense or quantized weights.

One quantized format covers TurboQuant (rotated input groups + Lloyd–Max codebook) and the
int8/int4 baselines: for input row i in group g = i // group and output column j,

    W[i, j] ≈ scale[g, j] * lut[code[i, j]] + offset[g, j]        (offset only for affine int4)

and, when `rotation` is set, W is stored for the *rotated* input: x @ W ≈ rot(x) @ Ŵ, where rot
applies the same randomized Hadamard to every group of `group` input features. Codes are packed
along the input axis with `tqjax.quant.packing` (a group of 8 rows of 3-bit codes fills 3 bytes).
The input dim is zero-padded up to a multiple of `group` (`in_features` keeps the true size).
"""

from __future__ import annotations

from typing import Any

import jax
import jax.numpy as jnp
from flax import struct

from tqjax.pallas.backend import resolve as resolve_backend
from tqjax.pallas.dequant_matmul import dequant_matmul
from tqjax.pallas.dequant_matmul import supported as dequant_supported
from tqjax.quant.packing import unpack_bits
from tqjax.quant.rotation import Rotation, rotate


@struct.dataclass
class QuantizedLinear:
    """A quantized [in, out] weight; see the module docstring for the formula."""

    packed: jax.Array  # [K_pad * bits / 8, N] uint8, codes packed along the input axis
    scale: jax.Array  # [K_pad / group, N] f16
    lut: jax.Array  # [2^bits] f32 code -> value (codebook centroids, or integer levels)
    offset: jax.Array | None = None  # [K_pad / group, N] f16, affine formats only
    rotation: Rotation | None = None  # per-group input rotation (TurboQuant), dim == group
    bits: int = struct.field(pytree_node=False, default=4)
    group: int = struct.field(pytree_node=False, default=64)
    in_features: int = struct.field(pytree_node=False, default=0)

    @property
    def out_features(self) -> int:
        return self.packed.shape[1]

    @property
    def padded_in(self) -> int:
        return self.packed.shape[0] * 8 // self.bits


def rotate_input(x: jax.Array, w: QuantizedLinear) -> jax.Array:
    """Zero-pad x [..., in] to the padded input dim and rotate each group (if w is rotated)."""
    pad = w.padded_in - x.shape[-1]
    if pad:
        x = jnp.pad(x, [(0, 0)] * (x.ndim - 1) + [(0, pad)])
    if w.rotation is None:
        return x
    xg = x.reshape(*x.shape[:-1], w.padded_in // w.group, w.group)
    return rotate(xg, w.rotation).reshape(x.shape)


def dequantize_weight(w: QuantizedLinear) -> jax.Array:
    """The stored weight in the rotated input basis, f32 [K_pad, N] (reference path)."""
    codes = unpack_bits(w.packed.T, w.bits, w.padded_in).T  # [K_pad, N]
    values = w.lut[codes.astype(jnp.int32)]
    k, n = values.shape
    values = values.reshape(k // w.group, w.group, n) * w.scale.astype(jnp.float32)[:, None]
    if w.offset is not None:
        values = values + w.offset.astype(jnp.float32)[:, None]
    return values.reshape(k, n)


def linear(x: jax.Array, w: Any, backend: str | None = None) -> jax.Array:
    """x [..., in] @ w [in, out] -> [..., out] in x's dtype; w dense or QuantizedLinear.

    backend: "xla" (dequantize, then dot) or "pallas" (the fused `dequant_matmul` kernel where
    it applies); None = `tqjax.pallas.backend.current()`.
    """
    if isinstance(w, QuantizedLinear):
        xr = rotate_input(x, w)
        x2 = xr.reshape(-1, xr.shape[-1])
        if resolve_backend(backend) == "pallas" and dequant_supported(x2.shape, w):
            return dequant_matmul(x2, w).reshape(*x.shape[:-1], w.out_features)
        return jnp.dot(xr, dequantize_weight(w).astype(x.dtype))
    return jnp.dot(x, w.astype(x.dtype))
