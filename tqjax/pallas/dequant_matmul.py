"""Fused dequantize-and-multiply for `tqjax.quant.weights.QuantizedLinear` (Pallas, Triton dialect).

y = x_rot @ Ŵ with Ŵ[k, n] = scale[n, k // group] · lut[code[n, k]] (+ offset[n, k // group]),
never writing Ŵ to memory. Each program owns `block_n` output columns and a contiguous range of
input tiles (split-K); a tile is the largest power of two (at most 128 rows) that divides the
group, so it never straddles two groups. Per tile it

1. gathers the packed bytes of the tile's codes straight from each output's bit stream
   (code k starts at stream bit k·bits: byte (k·bits) >> 3, shift (k·bits) & 7, plus the next
   byte when a code can straddle two, i.e. when bits does not divide 8 — the 3-bit case, where
   8 codes fill 3 bytes); a byte shared by several codes is re-read from L1, not from memory,
2. looks the codes up in the LUT (a gather from a ≤ 256-entry table),
3. multiplies: `decode` tiling (M ≤ 8 rows) does a row-wise multiply-and-reduce per output row,
   `prefill` tiling a [block_m, group] × [group, block_n] dot,
4. applies the group's scale to the partial product (and offset · Σx over the tile).

Split-K partials come back as f32 [splits, M, N] and are summed in plain JAX.
The input rotation (`rotate_input`) stays outside: it only touches the activation.
"""

from __future__ import annotations

import dataclasses
import functools
import math
from collections.abc import Callable
from typing import Protocol

import jax
import jax.numpy as jnp
from jax.experimental import pallas as pl
from jax.experimental.pallas import triton as plgpu

from tqjax.errors import TqjaxError
from tqjax.pallas.backend import default_interpret


class PackedWeight(Protocol):
    """What the kernel reads of a `tqjax.quant.weights.QuantizedLinear` (structural type, so
    this ground-layer module imports nothing above it)."""

    packed: jax.Array  # uint8 [N, K_pad·bits/8]: each output's code bit stream along K
    scale: jax.Array  # f16 [N, K_pad/group]
    offset: jax.Array | None  # f16 [N, K_pad/group] (affine formats)
    lut: jax.Array  # [2^bits] code values
    bits: int
    group: int

    @property
    def padded_in(self) -> int: ...  # K_pad: input features padded to whole groups

    @property
    def out_features(self) -> int: ...  # N

DECODE_ROWS = 8  # up to this many rows use the row-wise (GEMV-like) tiling
TARGET_PROGRAMS = 256  # aim for about two programs per SM on a large GPU
MAX_TILE = 128  # input rows per loop step


@dataclasses.dataclass(frozen=True)
class Tiling:
    """Launch shape: rows per program (`block_m`, None = all rows, row-wise), output columns per
    program (`block_n`), and how many programs split the input tiles (`splits`)."""

    block_m: int | None
    block_n: int
    splits: int


def _pow2(n: int) -> bool:
    return n > 0 and n & (n - 1) == 0


def tile_rows(group: int) -> int:
    """Input rows per loop step: the largest power of two <= MAX_TILE dividing `group`."""
    return min(group & -group, MAX_TILE)


def supported(x_shape: tuple[int, ...], w: PackedWeight) -> bool:
    """Whether `dequant_matmul` handles x [M, K_pad] with w (else use the XLA reference)."""
    return (len(x_shape) == 2 and w.packed.ndim == 2  # (one layer's weight, not a stack)
            and x_shape[1] == w.padded_in and tile_rows(w.group) >= 16
            and w.out_features % 16 == 0 and 1 <= w.bits <= 8)


def choose_tiling(m: int, k: int, n: int, group: int) -> Tiling:
    """Default tiling for x [m, k] @ w [k, n]: decode (m <= 8) or prefill."""
    tiles = k // tile_rows(group)
    if m <= DECODE_ROWS:
        block_m, block_n, row_blocks = None, 64, 1
    else:
        block_m = min(64, max(16, 1 << (m - 1).bit_length()))
        block_n, row_blocks = 64, -(-m // block_m)
    while n % block_n:
        block_n //= 2
    want = max(1, TARGET_PROGRAMS // (row_blocks * (n // block_n)))
    splits = max(d for d in range(1, tiles + 1) if tiles % d == 0 and d <= want)
    return Tiling(block_m, block_n, splits)


def _codes(packed_ref: object, first_row: jax.Array, rows: int, bits: int, n_bytes: int,
           block_n: int) -> jax.Array:
    """Codes int32 [rows, block_n] of input rows first_row .. first_row + rows − 1."""
    k = first_row + jnp.arange(rows, dtype=jnp.int32)
    byte, shift = (k * bits) >> 3, (k * bits) & 7
    shape = (rows, block_n)
    cols = jnp.broadcast_to(jnp.arange(block_n, dtype=jnp.int32)[None, :], shape)
    word = packed_ref[cols, jnp.broadcast_to(byte[:, None], shape)].astype(jnp.int32)
    if 8 % bits:  # a code may continue in the next byte
        nxt = jnp.broadcast_to(jnp.minimum(byte + 1, n_bytes - 1)[:, None], shape)
        word = word | (packed_ref[cols, nxt].astype(jnp.int32) << 8)
    return (word >> shift[:, None]) & ((1 << bits) - 1)


def _kernel(x_ref: object, packed_ref: object, scale_ref: object, offset_ref: object,
            lut_ref: object, o_ref: object, *, bits: int, group: int, tile: int,
            tiles_per_split: int, n_bytes: int, rows: int | None, block_n: int) -> None:
    split = pl.program_id(2)
    dtype = x_ref.dtype

    def body(i: jax.Array, acc: tuple[jax.Array, ...]) -> tuple[jax.Array, ...]:
        first = (split * tiles_per_split + i) * tile
        g = first // group
        vals = lut_ref[_codes(packed_ref, first, tile, bits, n_bytes, block_n)]
        vals = vals.astype(dtype)  # as the reference casts Ŵ to x's dtype
        scale = scale_ref[:, g].astype(jnp.float32)
        offset = None if offset_ref is None else offset_ref[:, g].astype(jnp.float32)
        return fold(acc, x_ref, pl.ds(first, tile), vals, scale, offset, rows)

    accumulate(o_ref, rows, block_n, tiles_per_split, body)


def fold(acc: tuple[jax.Array, ...], x_ref: object, cols: object, w: jax.Array,
         scale: jax.Array, offset: jax.Array | None, rows: int | None,
         trans_b: bool = False) -> tuple[jax.Array, ...]:
    """acc + (x[:, cols] · w) · scale (+ Σ x[:, cols] · offset), per output column: w [L,
    block_n] ([block_n, L] with `trans_b`) the decoded weights of the L input rows `cols`,
    scale and offset f32 [block_n]. Prefill (`rows` None): one [block_m, block_n] tile, a dot
    in x's dtype; decode: one multiply-and-reduce per row, in f32."""
    if rows is None:
        xs = x_ref[:, cols]
        part = plgpu.dot(xs, w.astype(xs.dtype), trans_b=trans_b).astype(jnp.float32)
        part = part * scale[None, :]
        if offset is not None:
            part += jnp.sum(xs.astype(jnp.float32), axis=1)[:, None] * offset[None, :]
        return (acc[0] + part,)
    wf = w.astype(jnp.float32)
    out = []
    for r in range(rows):
        xr = x_ref[r, cols].astype(jnp.float32)
        part = (jnp.sum(wf * xr[None, :], axis=1) if trans_b
                else jnp.sum(xr[:, None] * wf, axis=0)) * scale
        if offset is not None:
            part += jnp.sum(xr) * offset
        out.append(acc[r] + part)
    return tuple(out)


def accumulate(o_ref: object, rows: int | None, block_n: int, steps: int,
               body: Callable[[jax.Array, tuple[jax.Array, ...]], tuple[jax.Array, ...]]
               ) -> None:
    """Run `body` (step, accumulators) for `steps` steps from zeros and store the result in
    o_ref: one [block_m, block_n] tile (`rows` None), or one [block_n] vector per row."""
    if rows is None:
        init = (jnp.zeros(o_ref.shape, jnp.float32),)
    else:
        init = tuple(jnp.zeros((block_n,), jnp.float32) for _ in range(rows))
    acc = jax.lax.fori_loop(0, steps, body, init)
    if rows is None:
        o_ref[...] = acc[0]
    else:
        for r in range(rows):
            o_ref[r, :] = acc[r]


@functools.partial(jax.jit, static_argnames=("interpret", "tiling"))
def _dequant_matmul(x: jax.Array, w: PackedWeight, interpret: bool,
                    tiling: Tiling) -> jax.Array:
    m, k = x.shape
    n, groups, tile = w.out_features, k // w.group, tile_rows(w.group)
    block_m, block_n, splits = tiling.block_m, tiling.block_n, tiling.splits
    if n % block_n or (k // tile) % splits or not _pow2(block_n):
        raise TqjaxError(f"bad tiling {tiling} for [{m}, {k}] @ [{k}, {n}], group {w.group}")
    if block_m is None:
        xp, rows, row_blocks = x, m, 1
        x_spec = pl.BlockSpec((m, k), lambda i, j, s: (0, 0))
    else:
        row_blocks = -(-m // block_m)
        xp, rows = jnp.pad(x, ((0, row_blocks * block_m - m), (0, 0))), None
        x_spec = pl.BlockSpec((block_m, k), lambda i, j, s: (i, 0))
    mp = xp.shape[0]
    row_spec = lambda r: pl.BlockSpec((block_n, r), lambda i, j, s: (j, 0))  # noqa: E731
    kernel = functools.partial(
        _kernel, bits=w.bits, group=w.group, tile=tile, tiles_per_split=k // tile // splits,
        n_bytes=w.packed.shape[-1], rows=rows, block_n=block_n)
    out = pl.pallas_call(
        kernel,
        grid=(row_blocks, n // block_n, splits),
        in_specs=[
            x_spec,
            row_spec(w.packed.shape[-1]),
            row_spec(groups),
            None if w.offset is None else row_spec(groups),
            pl.BlockSpec(w.lut.shape, lambda i, j, s: (0,)),
        ],
        out_specs=pl.BlockSpec((None, mp if block_m is None else block_m, block_n),
                               lambda i, j, s: (s, i, j)),
        out_shape=jax.ShapeDtypeStruct((splits, mp, n), jnp.float32),
        compiler_params=plgpu.CompilerParams(num_warps=4, num_stages=2),
        interpret=interpret,
        name=f"dequant_matmul_{w.bits}bit",
    )(xp, w.packed, w.scale, w.offset, w.lut.astype(jnp.float32))
    return jnp.sum(out, axis=0)[:m].astype(x.dtype)


def dequant_matmul(x_rotated: jax.Array, w: PackedWeight, *, interpret: bool | None = None,
                   tiling: Tiling | None = None) -> jax.Array:
    """x_rotated [M, K_pad] (already `rotate_input`-ed) @ dequantize_weight(w) → [M, N] in x's
    dtype, without materialising the weight. interpret: None = automatic (CPU → interpret mode);
    tiling: None = `choose_tiling`. Raises TqjaxError for shapes `supported` rejects."""
    if not supported(x_rotated.shape, w):
        raise TqjaxError(f"dequant_matmul does not handle x {x_rotated.shape} with a {w.bits}-bit "
                         f"[{w.padded_in}, {w.out_features}] weight, group {w.group} "
                         "(needs 2-D x, a group divisible by 16 and N % 16 == 0)")
    if tiling is None:
        tiling = choose_tiling(x_rotated.shape[0], w.padded_in, w.out_features, w.group)
    interpret = default_interpret() if interpret is None else interpret
    return _dequant_matmul(x_rotated, w, interpret, tiling)


def weight_bytes(w: PackedWeight) -> int:
    """Bytes a dequant_matmul call must read for w (codes, scales, offsets, LUT)."""
    leaves = [w.packed, w.scale, w.lut] + ([] if w.offset is None else [w.offset])
    return sum(math.prod(a.shape) * a.dtype.itemsize for a in leaves)
