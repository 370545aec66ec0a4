"""Linear layers over dense or quantized weights.

One quantized format covers TurboQuant (rotated input groups + Lloyd–Max codebook) and the
int8/int4 baselines: for input row i in group g = i // group and output column j,

    W[i, j] ≈ scale[g, j] * lut[code[i, j]] + offset[g, j]        (offset only for affine int4)

and, when `rotation` is set, W is stored for the *rotated* input: x @ W ≈ rot(x) @ Ŵ, where rot
applies the same randomized Hadamard to every block of `rotation.dim` input features (the group
for "tq"). Storage is output-major, as GGUF stores rows: for each output j, its codes along the
input packed with `tqjax.quant.packing` (8 codes of 3 bits fill 3 bytes), and its scales per
group — the layout in which XLA on CPU fuses the decoding into a decode step's vector-matrix
dot (`tqjax.quant.tiling`). The input dim is zero-padded up to a multiple of `group` (and of the
rotation block); `in_features` keeps the true size.

Quantizers (`quantize_linear`) produce this format for a `WeightFormat`:
- "tq": TurboQuant. Rows are rotated per group by the shared randomized Hadamard
  (`tqjax.quant.rotation`), codes index the Lloyd–Max codebook of one coordinate of a random unit
  vector in R^group times √group (`tqjax.quant.codebook`), and each group's scale is searched to
  minimise the (importance-weighted) squared error, then refitted by least squares.
- "sym": integer levels −2^(b−1)..2^(b−1)−1, scale = the group's signed absmax / −2^(b−1)
  (llama.cpp's Q4_0 rule; int8 with group 0 is per-output-channel absmax).
- "affine": levels 0..2^b−1, scale = (max − min)/(2^b − 1), offset = min (Q4_1).
"sym" and "affine" can also be stored in TurboQuant's rotated basis (`WeightFormat.rotation`):
"int8-rot" is per-channel int8 over the 64-row Hadamard blocks, which spreads outlier weights
before the per-channel absmax is taken.
With a Hessian H = Σ x xᵀ of the layer's inputs (calibration text), codes are chosen by GPTQ
(Frantar et al. 2022) in the stored (rotated) basis: rows are quantized one at a time and each
row's error, weighted by the inverse Hessian's Cholesky factor, is pushed onto the rows not yet
quantized; a group's scale is fitted when its first row is reached. The order is GPTQ's
act-order kept to whole groups (so the stored layout is unchanged): the group with the most
Hessian mass first, and within a group the rows by descending diagonal.
"""

from __future__ import annotations

import dataclasses
import functools
import math
from collections.abc import Callable
from typing import Any

import jax
import jax.numpy as jnp
import numpy as np
from flax import struct

from tqjax.errors import TqjaxError
from tqjax.host import HOST_ALIGN, host_buffer
from tqjax.pallas.backend import resolve as resolve_backend
from tqjax.pallas.dequant_matmul import dequant_matmul
from tqjax.pallas.dequant_matmul import supported as dequant_supported
from tqjax.quant import ggml, half, tiling
from tqjax.quant.codebook import lloyd_max
from tqjax.quant.packing import pack_bits, unit, unpack_bits, unpack_planes
from tqjax.quant.rotation import (
    MATMUL_MAX_DIM,
    Rotation,
    make_rotation,
    rotate,
    rotate_blocks_flat,
    unrotate,
)
from tqjax.quant.tiling import column_tiles, run_edges, sum_parts, use_fused

KINDS = ("tq", "sym", "affine")
SCALE_DTYPE = jnp.float16
SCALE_BITS = 16


@struct.dataclass
class QuantizedLinear:
    """A quantized [in, out] weight stored output-major; see the module docstring."""

    packed: jax.Array  # [N, K_pad * bits / 8] uint8: each output's codes packed along the input
    scale: jax.Array  # [N, K_pad / group] f16
    lut: jax.Array  # [2^bits] f32 code -> value (codebook centroids, or integer levels)
    offset: jax.Array | None = None  # [N, K_pad / group] f16, affine formats only
    rotation: Rotation | None = None  # input rotation per block of rotation.dim rows (| group)
    bits: int = struct.field(pytree_node=False, default=4)
    group: int = struct.field(pytree_node=False, default=64)
    in_features: int = struct.field(pytree_node=False, default=0)
    kind: str = struct.field(pytree_node=False, default="tq")  # one of KINDS

    @property
    def out_features(self) -> int:
        return self.packed.shape[-2]  # (a `LayerStack`'s leading axis over layers before it)

    @property
    def padded_in(self) -> int:
        return self.packed.shape[-1] * 8 // self.bits


def _per_block(fn: Any, x: jax.Array, rot: Rotation) -> jax.Array:
    """`rotate` or `unrotate` on each block of rot.dim along x's last axis [..., K_pad]."""
    b = rot.dim
    return fn(x.reshape(*x.shape[:-1], x.shape[-1] // b, b), rot).reshape(x.shape)


def rotate_input(x: jax.Array, w: QuantizedLinear, flat: bool = False) -> jax.Array:
    """Zero-pad x [..., in] to the padded input dim and rotate each group (if w is rotated).
    flat: computed as `rotate_blocks_flat` (for the fused decode dots; rotation blocks up to
    `rotation.MATMUL_MAX_DIM`)."""
    pad = w.padded_in - x.shape[-1]
    if pad:
        x = jnp.pad(x, [(0, 0)] * (x.ndim - 1) + [(0, pad)])
    if w.rotation is None:
        return x
    if flat and w.rotation.dim <= MATMUL_MAX_DIM:
        return rotate_blocks_flat(x, w.rotation)
    return _per_block(rotate, x, w.rotation)


def _dequantize(packed: jax.Array, scale: jax.Array, offset: jax.Array | None, lut: jax.Array,
                bits: int, group: int) -> jax.Array:
    """Codes packed uint8 [..., n, K·bits/8] with scale (offset) f16 [..., n, K/group] -> f32
    [..., n, K] (leading axes: a stack's layers)."""
    k = packed.shape[-1] * 8 // bits
    values = lut[unpack_bits(packed, bits, k)].reshape(*packed.shape[:-1], k // group, group)
    values = values * scale.astype(jnp.float32)[..., None]
    if offset is not None:
        values = values + offset.astype(jnp.float32)[..., None]
    return values.reshape(*packed.shape[:-1], k)


def dequantize_weight(w: QuantizedLinear) -> jax.Array:
    """The stored weight in the rotated input basis, f32 [..., K_pad, N] (reference path;
    leading axes: a stack's layers)."""
    return jnp.swapaxes(_dequantize(w.packed, w.scale, w.offset, w.lut, w.bits, w.group), -1, -2)


TILE_WEIGHTS = tiling.TILE_WEIGHTS  # weights dequantized per step of `_tiled_matmul`


def _tiled_matmul(x: jax.Array, w: QuantizedLinear) -> jax.Array:
    """x [M, K_pad] (rotated) @ Ŵ -> [M, N] in x's dtype, dequantizing a tile of outputs at a
    time (prefill: more rows than `tiling.FUSED_ROWS`).

    XLA on CPU runs a matrix-matrix dot as a library call that cannot fuse the unpack, so the
    dequantized weight is always written out; a tile of ~TILE_WEIGHTS (a multiple of 128
    outputs) keeps that temporary in cache and the packed bytes the only full-size copy.
    Other backends get one tile (XLA on GPU can fuse the dequantization into its dot).
    """
    k, n = w.padded_in, w.out_features
    rows = tiling.tile_rows(k, n, TILE_WEIGHTS)
    if jax.default_backend() != "cpu":
        rows = n

    def tile(start: Any, size: int) -> jax.Array:  # y[:, start:start + size]
        def cut(a: jax.Array | None) -> jax.Array | None:
            return None if a is None else jax.lax.dynamic_slice_in_dim(a, start, size, axis=0)

        wt = _dequantize(cut(w.packed), cut(w.scale), cut(w.offset), w.lut, w.bits, w.group)
        return jax.lax.dot_general(x, wt.astype(x.dtype), (((1,), (1,)), ((), ())))  # [M, size]

    return column_tiles(tile, x.shape[0], n, rows, x.dtype)


def _linear_fused(x: jax.Array, w: QuantizedLinear) -> jax.Array:
    """x [M, K_pad] (rotated) @ Ŵ -> [M, N] f32 for a few rows M (decode, CPU), never writing
    Ŵ: per row and per run of input groups (`tqjax.quant.tiling`), one vector-matrix dot per
    code position j in a unit of whole bytes (`packing.unit`: the two nibbles of a byte, the
    8 codes of 3 bytes), whose operand decodes code j of every unit where the dot reads it:
    shift and mask, the level (codes + lowest level for integer formats, a LUT lookup for
    "tq"), scale (+ offset).

    x must come flat (`rotate_input(..., flat=True)`): read through a reshape of the
    rotation's [blocks, dim] output, each element of x was fetched on its own (SmolLM2's
    576 -> 1536 tq4 projection, 30 in a chain: 0.51 ms a call against 0.19 flat, the f32
    weight's dot 0.11; issue 22, stop 39). Older measurements (research/bench_linear.py,
    M = 1, runs under `tiling.FUSED_BYTES` per row): int8 1.3-2.7x faster than the f32
    weight's dot, int4 0.6-1.9x as fast; `_tiled_matmul` 0.3-0.6x.
    """
    c, ub = unit(w.bits)
    n, units, gu = w.out_features, w.padded_in // c, w.group // c  # gu: units per group
    groups = units // gu
    if gu * ub < tiling.FUSED_BYTES:  # runs of whole groups
        edges = [e * gu for e in run_edges(groups, gu * ub)]
    else:  # each group cut into runs of units
        per = run_edges(gu, ub)
        edges = sorted({g * gu + e for g in range(groups) for e in per})
    lowest = w.lut[0]  # integer levels (sym, affine): lut[code] = code + lut[0]

    def values(a: int, b: int, code: jax.Array) -> jax.Array:
        """Code j of units a..b-1 (uint8 [n, b - a], a `packing.unpack_planes` plane) -> the
        weights they stand for, f32 [n, b - a]."""
        v = w.lut[code] if w.kind == "tq" else code.astype(jnp.float32) + lowest
        g0, g1 = a // gu, -(-b // gu)
        s = w.scale[:, g0:g1].astype(jnp.float32)
        o = None if w.offset is None else w.offset[:, g0:g1].astype(jnp.float32)
        if g1 - g0 == 1:  # inside one group
            return v * s + (0 if o is None else o)
        v = v.reshape(n, g1 - g0, gu) * s[..., None] + (0 if o is None else o[..., None])
        return v.reshape(n, b - a)

    runs = list(zip(edges[:-1], edges[1:], strict=True))
    vals = {(a, j): values(a, b, code) for a, b in runs for j, code in enumerate(
        unpack_planes(w.packed[:, a * ub:b * ub], w.bits, (b - a) * c))}

    def row(xv: jax.Array) -> jax.Array:  # [K_pad] -> [N]
        xu = xv.reshape(units, c)
        return sum_parts([jnp.dot(xu[a:b, j], vals[a, j].T) for a, b in runs for j in range(c)])

    return jnp.stack([row(x[i].astype(jnp.float32)) for i in range(x.shape[0])])


def linear(x: jax.Array, w: Any, backend: str | None = None) -> jax.Array:
    """x [..., in] @ w [in, out] -> [..., out] in x's dtype; w dense, QuantizedLinear,
    `ggml.GGMLLinear` or `half.HalfLinear`.

    backend "xla": on CPU with at most `tiling.FUSED_ROWS` rows (decode), the decoding fused
    into vector-matrix dots (`_linear_fused`), otherwise `_tiled_matmul` (dequantize a
    cache-sized tile of outputs, then dot); "pallas": the fused `dequant_matmul` kernel
    where it applies. None = `tqjax.pallas.backend.current()`.
    """
    if isinstance(w, ggml.GGMLLinear):  # GGUF blocks kept as the file has them
        return ggml.linear(x, w, backend)
    if isinstance(w, half.HalfLinear):  # bf16 / f16 stored output-major
        return half.linear(x, w)
    if isinstance(w, QuantizedLinear):
        rows = math.prod(x.shape[:-1])
        pallas = resolve_backend(backend) == "pallas" and dequant_supported(
            (rows, w.padded_in), w)
        fused = not pallas and use_fused(rows)
        xr = rotate_input(x, w, flat=fused)
        x2 = xr.reshape(-1, xr.shape[-1])
        if pallas:
            y = dequant_matmul(x2, w)
        elif fused:
            y = _linear_fused(x2, w).astype(x.dtype)
        else:
            y = _tiled_matmul(x2, w)
        return y.reshape(*x.shape[:-1], w.out_features)
    return jnp.dot(x, w.astype(x.dtype))


def gather_columns(w: QuantizedLinear, ids: jax.Array) -> jax.Array:
    """Columns `ids` int [...] of the dense weight, in the original basis: f32 [..., in_features].

    A quantized embedding table is stored as the QuantizedLinear of embedᵀ [D, V], so this is
    the token lookup (it unpacks only the gathered columns) and `linear` is the tied head.
    """
    codes = unpack_bits(w.packed[ids], w.bits, w.padded_in)  # [..., K_pad]
    values = w.lut[codes.astype(jnp.int32)].reshape(*ids.shape, -1, w.group)
    values = values * w.scale[ids].astype(jnp.float32)[..., None]
    if w.offset is not None:
        values = values + w.offset[ids].astype(jnp.float32)[..., None]
    values = values.reshape(*ids.shape, -1)
    if w.rotation is not None:
        values = _per_block(unrotate, values, w.rotation)
    return values[..., : w.in_features]


def effective_weight(w: QuantizedLinear) -> jax.Array:
    """The dense weight the quantized one stands for, f32 [in_features, N] (original basis)."""
    return gather_columns(w, jnp.arange(w.out_features)).T


# ---------------------------------------------------------------- formats


@dataclasses.dataclass(frozen=True)
class WeightFormat:
    """How one linear is quantized: `kind` in KINDS (see the module docstring), `bits` per weight
    (1..8), `group` input rows per scale (a multiple of 8; 0 = the whole input dim, "sym" and
    "affine" only; "tq" needs a power of two for the Hadamard rotation), `rotation` rows per
    Hadamard block for "sym"/"affine" (a power of two dividing a nonzero group; 0 = unrotated;
    "tq" always rotates by its group)."""

    kind: str
    bits: int
    group: int
    rotation: int = 0

    def __post_init__(self) -> None:
        if self.kind not in KINDS:
            raise TqjaxError(f"unknown weight format kind {self.kind!r} (choose from {KINDS})")
        if not isinstance(self.bits, int) or not 1 <= self.bits <= 8:
            raise TqjaxError(f"weight bits must be an integer in 1..8, got {self.bits!r}")
        g = self.group
        if not isinstance(g, int) or g < 0 or g % 8 or (self.kind == "tq" and g & (g - 1)):
            need = "a power of two >= 8" if self.kind == "tq" else "0 or a multiple of 8"
            raise TqjaxError(f"{self.kind} group size must be {need}, got {g!r}")
        if self.kind == "tq" and g == 0:
            raise TqjaxError("tq needs a group size (a power of two >= 8), not 0")
        r = self.rotation
        if r and (self.kind == "tq" or r < 8 or r & (r - 1) or (g and g % r)):
            raise TqjaxError(f"a {self.kind} rotation block must be a power of two >= 8 dividing "
                             f"the group ({g}), for sym/affine only; got {r!r}")

    @property
    def name(self) -> str:
        """Short label, e.g. "tq4g64", "sym8" (per channel), "sym8r64", "affine4g32"."""
        return (f"{self.kind}{self.bits}" + (f"g{self.group}" if self.group else "")
                + (f"r{self.rotation}" if self.rotation else ""))

    @property
    def rotation_block(self) -> int:
        """Input rows per Hadamard block of the stored basis (0 = unrotated)."""
        return self.group if self.kind == "tq" else self.rotation

    def group_size(self, in_features: int) -> int:
        """Input rows per scale (a per-channel group covers the rotation-padded input)."""
        r = self.rotation_block or 1
        return self.group or -(-in_features // r) * r

    def padded_in(self, in_features: int) -> int:
        g = self.group_size(in_features)
        return -(-in_features // g) * g

    def tensor_bits(self, in_features: int, out_features: int) -> int:
        """Bits stored for one [in, out] weight: codes, scales and offsets (not the lut or the
        rotation, which are shared by every tensor of the format)."""
        k = self.padded_in(in_features)
        per_scale = SCALE_BITS * (2 if self.kind == "affine" else 1)
        return out_features * (k * self.bits + k // self.group_size(in_features) * per_scale)


@functools.lru_cache(maxsize=64)
def format_lut(fmt: WeightFormat) -> jax.Array:
    """Code -> value table f32 [2^bits], ascending (shared: one array per format; built
    eagerly even under a trace, so the cache never holds a tracer)."""
    with jax.ensure_compile_time_eval():
        return _lut(fmt)


def _lut(fmt: WeightFormat) -> jax.Array:
    if fmt.kind == "tq":
        values = lloyd_max(fmt.bits, fmt.group).centroids * math.sqrt(fmt.group)
    elif fmt.kind == "sym":
        values = np.arange(-(1 << (fmt.bits - 1)), 1 << (fmt.bits - 1))
    else:
        values = np.arange(1 << fmt.bits)
    return jnp.asarray(values, jnp.float32)


@functools.lru_cache(maxsize=16)
def format_rotation(block: int, seed: int) -> Rotation:
    """The rotation shared by every rotated tensor with this block size and seed (built
    eagerly even under a trace)."""
    with jax.ensure_compile_time_eval():
        return make_rotation(block, seed)


# ---------------------------------------------------------------- quantizing


def _midpoints(lut: jax.Array) -> tuple[np.ndarray, np.ndarray]:
    """(levels, the midpoints between neighbours) of a concrete ascending lut, f32 [L], [L-1]:
    the decision boundaries of round-to-nearest."""
    levels = np.asarray(lut, np.float32)
    return levels, np.float32(0.5) * (levels[1:] + levels[:-1])


def _assign(x: jax.Array, lut: jax.Array) -> jax.Array:
    """Index of the nearest lut value for each element of x (lut ascending, concrete: the
    format's `format_lut`) -> uint8: the count of midpoints below x. Up to 16 levels, compare
    with all; a larger lut (8 bits) looks up a uniform grid of cells a quarter of the closest
    midpoint gap wide, whose table gives the count below the cell before x's, then compares with the
    next two midpoints (x lies under half the closest gap above that cell's start, so at most
    one midpoint sits between): the same codes as a binary search with 3 gathers instead of 8
    (tq8, 2M values: 19 vs 150-180 ms)."""
    levels, mids = _midpoints(lut)
    if lut.shape[0] <= 16:
        return jnp.searchsorted(jnp.asarray(mids), x, method="compare_all").astype(jnp.uint8)
    step = float(np.diff(mids.astype(np.float64)).min()) / 4
    lo = float(mids[0]) - 2 * step
    cells = int(np.ceil((float(mids[-1]) - lo) / step)) + 3
    below = np.searchsorted(mids, lo + (np.arange(cells) - 1) * step, side="left")
    cell = jnp.clip(jnp.floor((x - lo) / step), 0, cells - 1).astype(jnp.int32)
    base = jnp.asarray(below, jnp.int32)[cell]
    m, n = jnp.asarray(mids), mids.shape[0]
    code = (base + ((x > m[jnp.minimum(base, n - 1)]) & (base < n))
            + ((x > m[jnp.minimum(base + 1, n - 1)]) & (base + 1 < n)))
    return code.astype(jnp.uint8)


def _nearest(x: jax.Array, lut: jax.Array) -> jax.Array:
    """lut[_assign(x, lut)]: the nearest lut value to each element of x f32 (lut ascending,
    concrete) -> f32, the same values. Up to 16 levels it is a chain of compares and selects,
    which XLA fuses into one loop; the gather of codes it replaces is ~5x slower on CPU (one
    step of the "tq" scale search on a 576 x 1536 weight: 8.6 -> 1.6 ms)."""
    if lut.shape[0] > 16:
        return lut[_assign(x, lut)]
    levels, mids = _midpoints(lut)
    out = jnp.full(x.shape, levels[0], jnp.float32)
    for mid, level in zip(mids, levels[1:], strict=True):
        out = jnp.where(x > mid, level, out)
    return out


def _safe(x: jax.Array) -> jax.Array:
    return jnp.where(x != 0, x, 1.0)


_SEARCH = np.linspace(0.7, 1.3, 13)  # "tq" scale candidates, relative to the group's rms


def _fit_groups(v: jax.Array, h: jax.Array, lut: jax.Array,
                kind: str) -> tuple[jax.Array, jax.Array | None]:
    """Scales (and offsets) for groups v f32 [..., G, N] with row importances h [..., G, 1].

    Returns f16-representable f32 scale [..., N] and offset [..., N] (affine) or None.
    """
    if kind == "affine":
        lo, hi = jnp.min(v, axis=-2), jnp.max(v, axis=-2)
        scale = _f16((hi - lo) / (lut.shape[0] - 1))
        return scale, _f16(lo)
    if kind == "sym":
        pick = jnp.argmax(jnp.abs(v), axis=-2)[..., None, :]
        return _f16(jnp.take_along_axis(v, pick, axis=-2)[..., 0, :] / lut[0]), None
    rms = jnp.sqrt(jnp.sum(h * v * v, axis=-2) / _safe(jnp.sum(h, axis=-2)))

    def error(scale: jax.Array) -> tuple[jax.Array, jax.Array]:
        s = _safe(scale)[..., None, :]
        c = _nearest(v / s, lut)
        return jnp.sum(h * (v - s * c) ** 2, axis=-2), c

    def search(best: tuple[jax.Array, jax.Array], alpha: jax.Array) -> tuple:
        err, _ = error(alpha * rms)
        take = err < best[0]
        return (jnp.where(take, err, best[0]), jnp.where(take, alpha * rms, best[1])), None

    init = (jnp.full(rms.shape, jnp.inf), rms)
    (_, scale), _ = jax.lax.scan(search, init, jnp.asarray(_SEARCH, jnp.float32))
    _, c = error(scale)  # least-squares refit of the scale for the chosen codes
    refit = jnp.sum(h * v * c, axis=-2) / _safe(jnp.sum(h * c * c, axis=-2))
    return _f16(jnp.where(jnp.sum(h * c * c, axis=-2) > 0, refit, scale)), None


def _f16(x: jax.Array) -> jax.Array:
    """Round to the stored scale precision (so codes are chosen for the scale that is stored)."""
    return x.astype(SCALE_DTYPE).astype(jnp.float32)


def _codes(v: jax.Array, scale: jax.Array, offset: jax.Array | None,
           lut: jax.Array) -> jax.Array:
    """Codes for v [..., N] given scale/offset [..., N] (broadcast) -> uint8."""
    if offset is not None:
        v = v - offset
    return _assign(v / _safe(scale), lut)


def _values(codes: jax.Array, scale: jax.Array, offset: jax.Array | None,
            lut: jax.Array) -> jax.Array:
    out = scale * lut[codes.astype(jnp.int32)]
    return out if offset is None else out + offset


@functools.partial(jax.jit, static_argnames=("fmt", "group"))
def _round_to_nearest(w: jax.Array, h: jax.Array, fmt: WeightFormat,
                      group: int) -> tuple[jax.Array, jax.Array, jax.Array | None]:
    """w f32 [K, N] (stored basis), row importances h [K] -> codes [K, N], scale, offset."""
    lut, kind = format_lut(fmt), fmt.kind  # a constant of the trace
    k, n = w.shape
    v = w.reshape(k // group, group, n)
    scale, offset = _fit_groups(v, h.reshape(k // group, group, 1), lut, kind)
    s = scale[:, None]
    codes = _codes(v, s, None if offset is None else offset[:, None], lut)
    return codes.reshape(k, n), scale, offset


@struct.dataclass
class HessianFactor:
    """A layer-input Hessian prepared for GPTQ in one stored basis (see `hessian_factor`)."""

    # Rows are in quantization order: row i of the three arrays below is stored row order[i].
    order: jax.Array  # [K_pad] int32 permutation of the stored rows, whole groups at a time
    # [K_pad, K_pad] f32 Mᵀ, M = L⁻¹ for L the Cholesky factor of J (H + λI) J (J reverses the
    # row order): GPTQ's upper U with Uᵀ U = (H + λI)⁻¹ is J M J, read a block of rows at a time
    # (`_upper_rows`). Kept in this form, it is computed in the buffer H is gathered into.
    inverse: jax.Array
    importance: jax.Array  # [K_pad] f32 diagonal of H + λI (weights of the scale search)
    dead: jax.Array  # [K_pad] bool: inputs that are always zero (their weights are dropped)
    group: int = struct.field(pytree_node=False, default=64)
    rotation: int = struct.field(pytree_node=False, default=0)  # the basis' Hadamard block


@functools.partial(jax.jit, static_argnames=("group",))
def _act_order(diag: jax.Array, group: int) -> jax.Array:
    """GPTQ's act-order over whole groups: diag f32 [K_pad] -> permutation int32 [K_pad]."""
    d = diag.reshape(-1, group)
    groups = jnp.argsort(-jnp.sum(d, axis=1), stable=True)
    within = jnp.argsort(-d, axis=1, stable=True)[groups]
    return (groups[:, None] * group + within).reshape(-1).astype(jnp.int32)


def _permute_rows(m: np.ndarray, perm: np.ndarray) -> None:
    """m[:] = m[perm] in place (a row at a time along each cycle of the permutation)."""
    done = np.zeros(len(perm), bool)
    for start in range(len(perm)):
        if done[start] or perm[start] == start:
            continue
        first, i = m[start].copy(), start
        while perm[i] != start:
            m[i], done[i], i = m[perm[i]], True, perm[i]
        m[i], done[i] = first, True


def _rotate_both(m: np.ndarray, rot: Rotation) -> None:
    """m [K, K] <- Π m Πᵀ in place, Π the per-block rotation of the stored basis."""
    k, b = m.shape[0], rot.dim
    pi = np.asarray(rotate(jnp.eye(b), rot)).T  # [b, b]: rotate(x) = x Πᵀ on rows
    for a in range(0, k, b):
        m[a:a + b] = pi @ m[a:a + b]
    for a in range(0, k, 512):
        rows = m[a:a + 512]
        m[a:a + 512] = (rows.reshape(len(rows), k // b, b) @ pi.T).reshape(len(rows), k)


def _factor(m: np.ndarray, order: jax.Array | np.ndarray, damp: float
            ) -> tuple[jax.Array, jax.Array, jax.Array]:
    """H f32 [K, K] (stored basis; a writable host array, overwritten) and the quantization
    order int [K] -> `HessianFactor`'s inverse, importance and dead, all in H's buffer: its rows
    and columns permuted into reversed order in place, then factored (LAPACK potrf) and inverted
    (trtri) in place. (XLA held three [K, K] buffers: layout copies around its LAPACK calls.)"""
    from scipy.linalg import lapack

    k = m.shape[0]
    rev = np.asarray(order)[::-1]
    diag = np.diag(m)[rev]
    dead = diag <= 0
    diag = diag + dead.astype(np.float32)
    diag = diag + np.float32(damp) * np.mean(diag, dtype=np.float32)
    _permute_rows(m, rev)
    for a in range(0, k, 512):  # then the columns, a block of rows at a time
        m[a:a + 512] = m[a:a + 512][:, rev]
    m[np.arange(k), np.arange(k)] = diag
    # m is symmetric, so m.T (Fortran order, the same buffer) is the matrix LAPACK factors
    low, info = lapack.spotrf(m.T, lower=1, overwrite_a=1, clean=1)
    if info == 0:
        low, info = lapack.strtri(low, lower=1, overwrite_c=1)
    if info != 0 or not np.shares_memory(low, m):
        raise TqjaxError(f"cannot factor the calibration Hessian ({k} inputs; LAPACK info "
                         f"{info}): raise the dampening")
    del low  # m's bytes, read in C order: Mᵀ
    return jax.device_put(m), jnp.asarray(diag[::-1]), jnp.asarray(dead[::-1])


def _own_buffer(h: Any) -> bool:
    """Whether h is a host f32 array `hessian_factor` can overwrite and hand to jax as it is."""
    return (isinstance(h, np.ndarray) and h.dtype == np.float32 and h.flags.writeable
            and h.flags.c_contiguous and h.ctypes.data % HOST_ALIGN == 0)


def hessian_factor(hessian: jax.Array | np.ndarray, fmt: WeightFormat, seed: int = 0,
                   damp: float = 0.01, consume: bool = False) -> HessianFactor:
    """Prepare H = Σ x xᵀ f32 [K, K] (a layer's calibration inputs) for GPTQ on `fmt`: moved to
    the stored basis (padded, rotated per group for "tq"), put in act-order, dampened by
    `damp`·mean(diag H) and factored. Reusable for every weight with the same input and basis
    (q/k/v, gate/up). `consume` (for a Gram needed in one basis only): H is used up; a host
    `host_buffer` H is factored in its own buffer (the factor then is H's only [K, K] buffer),
    a jax H deleted once copied."""
    k = hessian.shape[0]
    if hessian.shape != (k, k):
        raise TqjaxError(f"a Hessian must be square, got shape {hessian.shape}")
    kp = fmt.padded_in(k)
    if consume and kp == k and _own_buffer(hessian):
        m = hessian
    else:
        m = host_buffer((kp, kp), np.float32)
        m[k:], m[:k, k:] = 0, 0
        m[:k, :k] = np.asarray(hessian)
        if consume and isinstance(hessian, jax.Array):
            hessian.delete()
    if fmt.rotation_block:
        _rotate_both(m, format_rotation(fmt.rotation_block, seed))
    order = _act_order(jnp.asarray(np.diag(m)), fmt.group_size(k))
    inverse, importance, dead = _factor(m, order, damp)
    return HessianFactor(order, inverse, importance, dead, fmt.group_size(k), fmt.rotation_block)


GPTQ_BLOCK = 128  # rows whose errors are pushed on row by row (GPTQ's lazy batch)


def _row_block(group: int) -> int:
    """Rows per GPTQ batch: the largest divisor of `group` up to GPTQ_BLOCK."""
    return max(d for d in range(1, min(group, GPTQ_BLOCK) + 1) if group % d == 0)


def _upper_rows(inverse: jax.Array, first: jax.Array, rows: int) -> jax.Array:
    """Rows [first, first + rows) of GPTQ's upper U = J M J from `HessianFactor.inverse` (Mᵀ)
    -> f32 [rows, K]: columns [K - first - rows, K - first) of Mᵀ, transposed and reversed."""
    k = inverse.shape[0]
    return jax.lax.dynamic_slice(inverse, (0, k - first - rows), (k, rows))[::-1, ::-1].T


@functools.partial(jax.jit, static_argnames=("fmt",))
def _gptq(w: jax.Array, factor: HessianFactor,
          fmt: WeightFormat) -> tuple[jax.Array, jax.Array, jax.Array | None]:
    """GPTQ: w f32 [K, N] in the stored basis -> codes [K, N], scale, offset (per group).

    A group's scale is fitted when the group is reached; its rows are then quantized in
    batches of `_row_block` rows: each row's error goes onto the batch's later rows at once,
    and a batch's errors onto every later row in one product (GPTQ's lazy batch updates; a
    per-channel group, K rows, no longer costs K x K x N in its row loop)."""
    lut, kind = format_lut(fmt), fmt.kind  # a constant of the trace
    k, n = w.shape
    group = factor.group
    block = _row_block(group)
    w = jnp.where(factor.dead[:, None], 0.0, w[factor.order])
    rows = jnp.arange(block)

    def one_group(w: jax.Array, g: jax.Array) -> tuple[jax.Array, tuple]:
        start = g * group
        hg = jax.lax.dynamic_slice(factor.importance, (start,), (group,))
        scale, offset = _fit_groups(jax.lax.dynamic_slice(w, (start, 0), (group, n)),
                                    hg[:, None], lut, kind)

        def batch(w: jax.Array, j: jax.Array) -> tuple[jax.Array, jax.Array]:
            first = start + j * block
            wb = jax.lax.dynamic_slice(w, (first, 0), (block, n))
            ub = _upper_rows(factor.inverse, first, block)
            uu = jax.lax.dynamic_slice(ub, (0, first), (block, block))

            def row(i: jax.Array, state: tuple) -> tuple:
                wb, err, codes = state
                c = _codes(wb[i], scale, offset, lut)
                e = (wb[i] - _values(c, scale, offset, lut)) / uu[i, i]
                wb = wb - jnp.where((rows > i)[:, None], uu[i][:, None] * e[None, :], 0.0)
                return wb, err.at[i].set(e), codes.at[i].set(c)

            init = (wb, jnp.zeros((block, n)), jnp.zeros((block, n), jnp.uint8))
            _, err, codes = jax.lax.fori_loop(0, block, row, init)
            later = jnp.arange(k) >= first + block
            return w - jnp.where(later[None, :], ub, 0.0).T @ err, codes

        w, codes = jax.lax.scan(batch, w, jnp.arange(group // block))
        return w, (codes.reshape(group, n), scale, offset)

    _, (codes, scale, offset) = jax.lax.scan(one_group, w, jnp.arange(k // group))
    back = jnp.argsort(factor.order)  # quantization order -> stored order
    groups = jnp.argsort(factor.order[::group])
    return (codes.reshape(k, n)[back], scale[groups],
            None if offset is None else offset[groups])


def to_stored_basis(x: jax.Array, fmt: WeightFormat, seed: int = 0) -> jax.Array:
    """Rows of x f32 [K, ...] (K = in_features) zero-padded to the format's padded input dim
    and rotated per block of `fmt.rotation_block` rows: the basis the codes live in."""
    k = x.shape[0]
    kp = fmt.padded_in(k)
    x = jnp.pad(x.astype(jnp.float32), [(0, kp - k)] + [(0, 0)] * (x.ndim - 1))
    b = fmt.rotation_block
    if not b:
        return x
    return jnp.moveaxis(_per_block(rotate, jnp.moveaxis(x, 0, -1), format_rotation(b, seed)), -1, 0)


@functools.partial(jax.jit, static_argnames=("fmt", "seed"))
def _quantize_block(w: jax.Array, hessian: HessianFactor | None, fmt: WeightFormat, seed: int
                    ) -> tuple[jax.Array, jax.Array, jax.Array | None]:
    """Columns w [K, n] of a dense weight -> their packed codes uint8 [n, K_pad·bits/8], scales
    and offsets [n, K_pad/group] (`SCALE_DTYPE`; offsets None unless affine): moved to the stored
    basis, rounded to nearest (`hessian` None) or GPTQ'd, and packed, in one program per shape
    (eagerly, each step compiled its own small programs: ~70 for one model's shapes)."""
    wc = to_stored_basis(w, fmt, seed)  # [K_pad, n]
    codes, s, o = (_round_to_nearest(wc, jnp.ones(wc.shape[0]), fmt, fmt.group_size(w.shape[0]))
                   if hessian is None else _gptq(wc, hessian, fmt))
    return (pack_bits(codes.T, fmt.bits), s.T.astype(SCALE_DTYPE),
            None if o is None else o.T.astype(SCALE_DTYPE))


# Output columns per quantization call: the jitted search's time grows far faster than the
# weight past ~16k columns (tq8, 896 inputs: 16384 columns 3.7 s, 49152 columns 124 s), and a
# block's temporaries are the quantizer's transient memory (tq8, 896 inputs, 4096 columns:
# 32 MB with GPTQ, 59 MB rounding to nearest; XLA memory_analysis)
QUANTIZE_COLUMNS = 4096
# ... and rounding to nearest, in blocks this wide, the last one padded to the same width (one
# program per tensor): tq8 with 896 inputs, 7 MB of temporaries and 56 µs a column, against
# 56 MB and 68 µs at 4096 (XLA memory_analysis; this 2-core CPU)
ROUND_COLUMNS = 512


@dataclasses.dataclass(frozen=True)
class Columns:
    """A dense [in, out] weight read a block of output columns at a time, for a tensor that
    should never be whole in f32 beside the params (a checkpoint's embedding or head).

    shape: (in, out). read(a, b): columns [a, b) as f32 [in, b - a].
    """

    shape: tuple[int, int]
    read: Callable[[int, int], np.ndarray]


def quantize_linear(w: jax.Array | Columns, fmt: WeightFormat, seed: int = 0,
                    hessian: HessianFactor | None = None) -> QuantizedLinear:
    """Quantize a dense weight w [K, N] ([in, out]), an array or `Columns`, to `fmt`.

    Without `hessian`: round to nearest with the format's scale rule ("tq": MSE-searched scale).
    With a `hessian_factor` of this layer's inputs (same format basis): GPTQ, "tq" scales
    weighted by the Hessian diagonal. `seed` picks the shared rotation (rotated formats).
    Output columns are quantized independently, `QUANTIZE_COLUMNS` at a time (rounding:
    `ROUND_COLUMNS`), each block's
    packed codes and scales written into the final host buffers: the only full-size arrays
    are the result's.
    """
    if len(w.shape) != 2:
        raise TqjaxError(f"quantize_linear needs a 2-D [in, out] weight, got shape {w.shape}")
    k, n = w.shape
    g = fmt.group_size(k)
    if fmt.padded_in(k) * fmt.bits % 8:
        raise TqjaxError(f"{fmt.name}: {k} input rows of {fmt.bits} bits do not fill bytes")
    kp = fmt.padded_in(k)
    if hessian is not None and (hessian.inverse.shape[0], hessian.group, hessian.rotation) != (
            kp, g, fmt.rotation_block):
        raise TqjaxError(f"the Hessian factor was prepared for another basis than {fmt.name} "
                         f"with {k} inputs")
    lut = format_lut(fmt)
    parts: list[tuple[jax.Array, ...]] = []  # (inside a jit: the blocks are concatenated)
    out: tuple[np.ndarray | None, ...] = ()
    step = QUANTIZE_COLUMNS if hessian is not None else ROUND_COLUMNS
    for a in range(0, n, step):
        b = min(n, a + step)
        block = jnp.asarray(w.read(a, b) if isinstance(w, Columns) else w[:, a:b])
        pad = step - (b - a) if hessian is None and a else 0  # (its last column repeated)
        if pad:
            block = jnp.pad(block, ((0, 0), (0, pad)), mode="edge")
        part = _quantize_block(block, hessian, fmt, seed)
        if pad:
            part = tuple(None if x is None else x[:b - a] for x in part)
        if parts or isinstance(part[0], jax.core.Tracer):
            parts.append(part)
            continue
        if not out:  # the result's host buffers, filled block by block
            out = (host_buffer((n, kp * fmt.bits // 8), np.uint8),
                   host_buffer((n, kp // g), SCALE_DTYPE),
                   host_buffer((n, kp // g), SCALE_DTYPE) if fmt.kind == "affine" else None)
        for buf, x in zip(out, part, strict=True):
            if buf is not None:
                buf[a:b] = np.asarray(x)
        del block, part
    if parts:
        packed, scale, offset = (None if parts[0][i] is None else
                                 jnp.concatenate([p[i] for p in parts]) for i in range(3))
    else:
        packed, scale, offset = (None if x is None else jax.device_put(x) for x in out)
    return QuantizedLinear(
        packed=packed,
        scale=scale,
        lut=lut,
        offset=offset,
        rotation=format_rotation(fmt.rotation_block, seed) if fmt.rotation_block else None,
        bits=fmt.bits,
        group=g,
        in_features=k,
        kind=fmt.kind,
    )
