"""Half-precision (bf16 / f16) linears stored output-major, converted inside the dot.

XLA on CPU has no bf16 or f16 matrix-vector kernel: it converts a half-precision dot's
operands to f32 first, so a dense [in, out] bf16 weight was written out as an f32 copy before
every dot (a decode step of SmolLM2 in bf16 ran at 0.47x of f32, and the tied 151936 x 896
head of Qwen2.5-Coder-0.5B held a 545 MB f32 temporary). Stored output-major ([out, in], as
the files store linears), the conversion fuses into the vector-matrix dot like a quantized
weight's decoding (`tqjax.quant.tiling`), which then reads only the half-precision bytes:
576 -> 1536 bf16 50 us against 67 for the f32 weight and 269 converted first, a
151936 x 896 head 1.2 ms against 2.5 and 27.6 (issue 22, stop 46,
`scripts/research/bench_half_linear.py`). The values are kept as their uint16 bit patterns,
so that a model's layers stack by format (`transformer.LayerStack`) and each layer's slice is
read in place. Prefill rows convert a tile of outputs at a time; other backends run their
own half-precision dots.
"""

from __future__ import annotations

import math
from typing import Any

import jax
import jax.numpy as jnp
from flax import struct

from tqjax.dtypes import HALF_DTYPES
from tqjax.quant.tiling import column_tiles, run_edges, sum_parts, tile_rows, use_fused


@struct.dataclass
class HalfLinear:
    """An [in, out] weight of a half-precision dtype, stored output-major as its bit patterns
    (uint16: XLA:CPU computes a bf16 array's slices in f32, and out of a stack of layers it
    then converted the whole stack to f32 at every step; a uint16 slice is read as it is)."""

    bits: jax.Array  # [N, K] uint16
    dtype: str = struct.field(pytree_node=False, default="bfloat16")  # "bfloat16" / "float16"

    @property
    def in_features(self) -> int:
        return self.bits.shape[-1]

    @property
    def out_features(self) -> int:
        return self.bits.shape[-2]


def output_major(w: jax.Array) -> HalfLinear:
    """A half-precision [N, K] (output-major) array as a `HalfLinear` (a bitcast)."""
    return HalfLinear(jax.lax.bitcast_convert_type(w, jnp.uint16), jnp.dtype(w.dtype).name)


def values(bits: jax.Array, dtype: str) -> jax.Array:
    """uint16 bit patterns of `dtype` values -> those values in f32 (exact)."""
    if dtype == "bfloat16":  # a bf16 is the top half of the f32 with the same value
        return jax.lax.bitcast_convert_type(bits.astype(jnp.uint32) << 16, jnp.float32)
    return jax.lax.bitcast_convert_type(bits, jnp.float16).astype(jnp.float32)


def dense(w: Any) -> Any:
    """A `HalfLinear` as the dense [in, out] array of its dtype it stands for (a transposed
    copy); any other weight as it is."""
    if not isinstance(w, HalfLinear):
        return w
    return jax.lax.bitcast_convert_type(w.bits, jnp.dtype(w.dtype)).T


def is_half(w: Any) -> bool:
    """Whether w is a dense array of a half-precision dtype (`tqjax.dtypes.HALF_DTYPES`)."""
    return isinstance(w, jax.Array) and w.dtype in HALF_DTYPES


def _fused(x: jax.Array, bits: jax.Array, dtype: str) -> jax.Array:
    """x f32 [M, K] @ Wᵀ (W [N, K] as bits) -> f32 [M, N], M a few rows (decode, CPU): per
    row, one vector-matrix dot per run of inputs under `tiling.FUSED_BYTES` bytes of each
    weight row (the fused loop's limit), converting each value where the dot reads it."""
    edges = run_edges(bits.shape[1], 2)
    runs = list(zip(edges[:-1], edges[1:], strict=True))

    def row(xv: jax.Array) -> jax.Array:  # [K] -> [N]
        return sum_parts([jnp.dot(xv[a:b], values(bits[:, a:b], dtype).T) for a, b in runs])

    return jnp.stack([row(x[i]) for i in range(x.shape[0])])


def _tiled(x: jax.Array, bits: jax.Array, dtype: str) -> jax.Array:
    """x f32 [M, K] @ Wᵀ -> f32 [M, N], converting a tile of outputs (`tiling.tile_rows`) at a
    time, so the f32 temporary stays tile-sized (prefill, CPU)."""
    n, k = bits.shape
    rows = tile_rows(k, n)

    def tile(start: Any, size: int) -> jax.Array:
        wt = values(jax.lax.dynamic_slice_in_dim(bits, start, size, axis=0), dtype)
        return jax.lax.dot_general(x, wt, (((1,), (1,)), ((), ())))  # [M, size]

    return column_tiles(tile, x.shape[0], n, rows, jnp.float32)


def matmul(x: jax.Array, bits: jax.Array, dtype: str) -> jax.Array:
    """x [..., K] @ Wᵀ for W [N, K] of `dtype` given as its uint16 bits (a `HalfLinear`, or a
    tied [V, D] embedding as the head) -> [..., N] in x's dtype, accumulated in f32."""
    if jax.default_backend() != "cpu":
        w = jax.lax.bitcast_convert_type(bits, jnp.dtype(dtype)).astype(x.dtype)
        return jnp.einsum("...k,nk->...n", x, w,
                          preferred_element_type=jnp.float32).astype(x.dtype)
    rows = math.prod(x.shape[:-1])
    x2 = x.reshape(rows, x.shape[-1]).astype(jnp.float32)
    y = _fused(x2, bits, dtype) if use_fused(rows) else _tiled(x2, bits, dtype)
    return y.reshape(*x.shape[:-1], bits.shape[0]).astype(x.dtype)


def linear(x: jax.Array, w: HalfLinear) -> jax.Array:
    """x [..., in] @ w -> [..., out] in x's dtype."""
    return matmul(x, w.bits, w.dtype)
