"""GGUF (ggml) quantized weights kept in the file's own blocks: no re-quantization, no f32 copy.

A `GGMLLinear` holds one [out, in] weight exactly as a GGUF file stores it: per output row, the
input dim cut into blocks of `block` values, each block `type_size` bytes (scales then codes;
layouts in gguf/quants.py and llama.cpp's ggml-quants.c). Every supported type decodes to

    W[n, b·block + s·L + l] = scale[n, b, s] · q[n, b, s, l] + offset[n, b, s]

with integer codes q, one scale (and, for the affine types, one offset) per sub-block s of L
values:

    type  block bytes  sub-blocks   code           scale        offset
    Q8_0     32    34   1 × 32      int8           d            -
    Q4_0     32    18   1 × 32      nibble − 8     d            -
    Q4_1     32    20   1 × 32      nibble         d            m
    Q5_0     32    22   1 × 32      5 bits − 16    d            -
    Q5_1     32    24   1 × 32      5 bits         d            m
    Q4_K    256   144   8 × 32      nibble         d·sc (6 b)   −dmin·m (6 b)
    Q5_K    256   176   8 × 32      5 bits         d·sc (6 b)   −dmin·m (6 b)
    Q6_K    256   210  16 × 16      6 bits − 32    d·sc (i8)    -

and the decoders here reproduce `gguf.quants.dequantize` bit for bit (same f32 operations in
the same order): `_plane_values` for the fused dots of a decode step, `_position_values` (one
nibble position of every plane) and `_q6k_rows` (whole Q6_K rows in HF order) for
decode-then-dot and lookups. The bytes are the file's, each block cut into its
fields (`tqjax.pallas.ggml_matmul.FIELDS`: d, the scales, the codes, ...), each field held as
its own array [N, planes, blocks · plane bytes]: the codes cut into planes (runs of 32 bytes
dealt round-robin), each plane block after block. A decode step's fused dots then read, per
plane and nibble position, each row's codes in order with one constant shift per block and a
scale per run of 16 or 32 values. Dots that read their bytes from whole blocks, or from fields
interleaved per block, made XLA:CPU index every byte on its own and ran 2-6x slower (SmolLM2's
Q4_1 576 -> 1536: 0.43 against 0.07 ms; Qwen2.5-Coder-1.5B's Q6_K 8960 -> 1536: 11.5 against
1.9 ms; issue 22, stops 39 and 44, docs/research.md). `file_blocks` puts the bytes back in
the file's order. `linear` decodes a cache-sized tile of output rows at a time and multiplies
it in one dot (XLA), or runs the fused `tqjax.pallas.ggml_matmul` kernel (Pallas backend). An
embedding table [V, D] is a GGMLLinear with out = V: `gather_rows` is the token lookup and
`linear` the tied head.
"""

from __future__ import annotations

import math
from collections.abc import Iterator
from typing import Any

import jax
import jax.numpy as jnp
import numpy as np
from flax import struct
from gguf import GGML_QUANT_SIZES, GGMLQuantizationType

from tqjax.errors import TqjaxError
from tqjax.pallas import ggml_matmul as gm
from tqjax.pallas.backend import resolve as resolve_backend
from tqjax.pallas.ggml_matmul import FIELDS
from tqjax.quant import tiling
from tqjax.quant.tiling import column_tiles, run_edges, sum_parts, use_fused

T = GGMLQuantizationType
SUPPORTED_TYPES: tuple[int, ...] = tuple(int(t) for t in (
    T.Q8_0, T.Q4_0, T.Q4_1, T.Q5_0, T.Q5_1, T.Q4_K, T.Q5_K, T.Q6_K))
KQUANTS: tuple[int, ...] = tuple(int(t) for t in (T.Q4_K, T.Q5_K, T.Q6_K))  # 256-value blocks
QK_K = 256
TILE_WEIGHTS = 1 << 20  # values decoded per step of `_linear_tiled` (4 MiB of f32)
UNTILED_WEIGHTS = 1 << 23  # weights up to this size are decoded whole (one dot, no loop)


@struct.dataclass
class GGMLLinear:
    """One GGUF-quantized weight [out, in] in the file's blocks, used as x @ Wᵀ ([in, out]),
    each block's fields in their own arrays (see the module docstring)."""

    fields: tuple[jax.Array, ...]  # uint8 [N_out, planes, in / block · plane bytes] per field
    ggml_type: int = struct.field(pytree_node=False, default=int(T.Q8_0))
    in_features: int = struct.field(pytree_node=False, default=0)

    @property
    def out_features(self) -> int:
        return self.fields[0].shape[-3]  # (a `LayerStack`'s leading axis over layers before it)

    @property
    def block(self) -> int:  # values per block
        return GGML_QUANT_SIZES[T(self.ggml_type)][0]

    @property
    def type_size(self) -> int:  # bytes per block
        return GGML_QUANT_SIZES[T(self.ggml_type)][1]

    @property
    def type_name(self) -> str:
        return T(self.ggml_type).name


def _check_type(ggml_type: int) -> None:
    if int(ggml_type) not in SUPPORTED_TYPES:
        names = ", ".join(T(t).name for t in SUPPORTED_TYPES)
        raise TqjaxError(f"GGML type {T(ggml_type).name} is not supported as kept blocks "
                         f"(supported: {names})")


def _split(blocks: np.ndarray, ggml_type: int) -> Iterator[np.ndarray]:
    """Blocks uint8 [N, nb, type_size] -> one array [N, planes, nb · size / planes] per field of
    FIELDS[ggml_type], one at a time (so a caller holds one field's copy at once);
    `file_blocks` is the inverse."""
    n, nb, _ = blocks.shape
    for start, size, planes, chunk in FIELDS[int(ggml_type)]:
        f = blocks[..., start:start + size].reshape(n, nb, size // (planes * chunk), planes, chunk)
        yield np.ascontiguousarray(f.transpose(0, 3, 1, 2, 4)).reshape(n, planes, -1)


def file_blocks(w: GGMLLinear) -> jax.Array:
    """The weight's bytes as the file stores them, uint8 [N, in / block · type_size]."""
    n, nb = w.out_features, w.in_features // w.block
    parts = []
    for a, (_, size, planes, chunk) in zip(w.fields, FIELDS[int(w.ggml_type)], strict=True):
        f = a.reshape(n, planes, nb, size // (planes * chunk), chunk).transpose(0, 2, 3, 1, 4)
        parts.append(f.reshape(n, nb, size))
    return jnp.concatenate(parts, axis=-1).reshape(n, -1)


def from_gguf(data: np.ndarray, ggml_type: int, shape: tuple[int, int]) -> GGMLLinear:
    """A GGMLLinear from a GGUF tensor's raw bytes (`ReaderTensor.data`, uint8 [out, row bytes]
    or any array viewing the same bytes), its `tensor_type` and HF shape (out, in)."""
    _check_type(ggml_type)
    out, inp = (int(d) for d in shape)
    block, type_size = GGML_QUANT_SIZES[T(ggml_type)]
    if inp % block:
        raise TqjaxError(f"{T(ggml_type).name} weight [{out}, {inp}]: input dim is not a "
                         f"multiple of the {block}-value block")
    raw = np.ascontiguousarray(data).view(np.uint8)
    row_bytes = inp // block * type_size
    if raw.size != out * row_bytes:
        raise TqjaxError(f"{T(ggml_type).name} weight [{out}, {inp}] needs {out * row_bytes} "
                         f"bytes, got {raw.size}")
    fields = tuple(jnp.asarray(f) for f in _split(raw.reshape(out, inp // block, type_size),
                                                  ggml_type))
    return GGMLLinear(fields, int(ggml_type), inp)


def _rows(w: GGMLLinear, rows: Any) -> GGMLLinear:
    """w with only output rows `rows` (an index array or slice)."""
    return w.replace(fields=tuple(a[rows] for a in w.fields))


def permute_rows(w: GGMLLinear, perm: np.ndarray) -> GGMLLinear:
    """w with output rows reordered, row i of the result = row perm[i] of w (a row's blocks move
    together, so this is exact; llama's Q/K un-permutation is such a reordering)."""
    return _rows(w, jnp.asarray(perm))


def weight_bytes(w: GGMLLinear) -> int:
    """Bytes the weight occupies (and a decode step reads): out · in / block · type_size."""
    return sum(math.prod(a.shape) for a in w.fields)


def bits_per_weight(w: GGMLLinear) -> float:
    """Stored bits per weight value, scales included (e.g. 4.5 for Q4_0, 8.5 for Q8_0)."""
    return 8 * w.type_size / w.block


# ---------------------------------------------------------------- block decoding


def _f16(b: jax.Array) -> jax.Array:
    """uint8 [..., 2] little-endian half -> f32 [...]."""
    return jax.lax.bitcast_convert_type(b, jnp.float16).astype(jnp.float32)


def _i32(b: jax.Array) -> jax.Array:
    return b.astype(jnp.int32)


def _code_field(ggml_type: int) -> int:
    """Index in FIELDS[ggml_type] of the field that holds the (low) code nibbles or bytes."""
    return 0 if T(ggml_type) == T.Q6_K else len(FIELDS[int(ggml_type)]) - 1


def _planes(ggml_type: int) -> tuple[int, int, int]:
    """(code planes, nibble positions per code byte, code bytes per plane and block): the
    fused dots of a run of blocks are one per plane and position."""
    _, size, planes, _ = FIELDS[int(ggml_type)][_code_field(ggml_type)]
    return planes, 1 if T(ggml_type) == T.Q8_0 else 2, size // planes


def _chunks32(ggml_type: int, k: int) -> list[int]:
    """The 32-byte runs of a K-quant's code field (their index in the block's field) that
    plane k holds, in the plane's order."""
    _, size, planes, chunk = FIELDS[int(ggml_type)][_code_field(ggml_type)]
    return [(k + planes * g) * (chunk // 32) + u
            for g in range(size // (planes * chunk)) for u in range(chunk // 32)]


def code_order(w: GGMLLinear) -> np.ndarray:
    """int32 [in]: the input index of every value as `_plane_values` lays them out, plane by
    plane and position by position (for each, block after block, the plane's code bytes in
    order): x[:, order] is the input in the order the fused dots read the codes."""
    t, nb = T(w.ggml_type), w.in_features // w.block
    planes, positions, pb = _planes(t)
    parts = []
    for k in range(planes):
        for j in range(positions):
            b, i = np.arange(nb)[:, None], np.arange(pb)[None, :]
            if t == T.Q8_0:
                value = 32 * b + i
            elif int(t) not in KQUANTS:  # Q4_x/Q5_x: byte i holds values i and 16 + i
                value = 32 * b + 16 * j + i
            else:
                c = np.asarray(_chunks32(t, k))[i // 32]  # the byte's 32-byte run, lane i % 32
                if t == T.Q6_K:  # run c = 2h + a of ql: values 128h + 64j + 32a + lane
                    value = QK_K * b + 128 * (c // 2) + 64 * j + 32 * (c % 2) + i % 32
                else:  # Q4_K/Q5_K: run c holds sub-blocks 2c (low nibbles) and 2c + 1
                    value = QK_K * b + 32 * (2 * c + j) + i % 32
            parts.append(value.ravel())
    return np.concatenate(parts).astype(np.int32)


def _k_scale_min(by: jax.Array, s: int) -> tuple[jax.Array, jax.Array]:
    """Q4_K/Q5_K sub-block s's 6-bit scale and min, int32 [...], from the 12 packed scale
    bytes int32 [..., 12]: for s < 4 the low 6 bits of bytes s and 4 + s; else the nibbles of
    byte s + 4 with the top 2 bits of bytes s - 4 and s above them."""
    if s < 4:
        return by[..., s] & 0x3F, by[..., 4 + s] & 0x3F
    return ((by[..., s + 4] & 0xF) | ((by[..., s - 4] >> 6) << 4),
            (by[..., s + 4] >> 4) | ((by[..., s] >> 6) << 4))


def _k_scales8(by: jax.Array) -> tuple[jax.Array, jax.Array]:
    """All 8 sub-blocks' scales and mins (`_k_scale_min`), int32 [..., 8], from the packed
    bytes int32 [..., 12], as one array each."""
    low = jnp.arange(8) < 4  # sub-blocks 0-3: low 6 bits of bytes s and 4 + s, else packed
    sc = jnp.where(low, jnp.tile(by[..., 0:4] & 0x3F, 2),
                   jnp.tile(by[..., 8:12] & 0xF, 2) | ((jnp.tile(by[..., 0:4], 2) >> 6) << 4))
    mn = jnp.where(low, jnp.tile(by[..., 4:8] & 0x3F, 2),
                   jnp.tile(by[..., 8:12] >> 4, 2) | ((jnp.tile(by[..., 4:8], 2) >> 6) << 4))
    return sc, mn


def _values(q: jax.Array, scale: jax.Array, offset: jax.Array | None) -> jax.Array:
    """Decoded values f32 [..., L] from codes [..., L] and a scale (offset) [...] per run of L
    (gguf's operation order: scale · q, then + offset)."""
    v = scale[..., None] * q.astype(jnp.float32)
    return v if offset is None else v + offset[..., None]


def _plane_values(w: GGMLLinear, b0: int, b1: int, k: int, j: int) -> jax.Array:
    """Blocks b0..b1-1 decoded at code plane k, nibble position j (see `code_order`), f32
    [N, (b1 - b0) · plane bytes] in the order of the codes: gguf's f32 operations in its order
    (scale · q, then + offset), so every value equals `gguf.quants.dequantize`'s."""
    t, n, r = T(w.ggml_type), w.out_features, b1 - b0
    layout = FIELDS[int(t)]

    def plane(f: int, kk: int) -> jax.Array:  # field f's plane kk over the run, int32 [N, r · pb]
        pb = layout[f][1] // layout[f][2]
        return _i32(w.fields[f][:, kk, b0 * pb:b1 * pb])

    def per_block(f: int) -> jax.Array:  # a one-plane field over the run, uint8 [N, r, size]
        size = layout[f][1]
        return w.fields[f][:, 0, b0 * size:b1 * size].reshape(n, r, size)

    if t == T.Q8_0:
        q = jax.lax.bitcast_convert_type(w.fields[1][:, 0, b0 * 32:b1 * 32], jnp.int8)
        return _values(q.reshape(n, r, 32), _f16(per_block(0)), None).reshape(n, -1)
    if int(t) in KQUANTS:
        runs = _chunks32(t, k)  # the plane's 32-byte runs of codes, each its own sub-block
        q = (plane(_code_field(t), k) >> 4 * j) & 0xF  # [N, r · 32 · len(runs)]
    if t == T.Q6_K:  # runs a and 2 + a (FIELDS): values 128h + 64j + 32a + l, high bits qh[32h + l]
        a = runs[0]
        q = (q | (((plane(1, 0) >> (4 * j + 2 * a)) & 3) << 4)) - 32
        sc = jax.lax.bitcast_convert_type(per_block(2), jnp.int8).astype(jnp.float32)
        scale = _f16(per_block(3))[..., None] * sc  # [N, r, 16]: sub-blocks of 16 values
        first = 4 * j + 2 * a  # run 2h + a holds sub-blocks 8h + first and 8h + first + 1
        scale = scale.reshape(n, r, 2, 8)[..., first:first + 2]  # [N, r, h, 2] (one slice:
        # picking them one by one made XLA select per value, 6x slower)
        return _values(q.reshape(n, r, 2, 2, 16), scale, None).reshape(n, -1)
    if t in (T.Q4_K, T.Q5_K):  # plane k is run k (FIELDS): sub-block s = 2k + j
        s = 2 * runs[0] + j
        if t == T.Q5_K:  # bit s of qh[l] is sub-block s's fifth bit
            q = q | (((plane(3, 0) >> s) & 1) << 4)
        sc, mn = (v.astype(jnp.float32) for v in _k_scale_min(_i32(per_block(2)), s))
        scale = _f16(per_block(0)) * sc  # [N, r]
        offset = -(_f16(per_block(1)) * mn)
        return _values(q.reshape(n, r, 32), scale, offset).reshape(n, -1)
    affine, high = t in (T.Q4_1, T.Q5_1), t in (T.Q5_0, T.Q5_1)
    q = ((plane(len(layout) - 1, 0) >> 4 * j) & 0xF).reshape(n, r, 16)  # values 16j + i
    if high:  # bit 16j + i of the 32-bit qh is value 16j + i's fifth bit
        qh = _i32(per_block(len(layout) - 2))
        bits = qh[..., 2 * j] | (qh[..., 2 * j + 1] << 8)
        q = q | (((bits[..., None] >> jnp.arange(16, dtype=jnp.int32)) & 1) << 4)
    d = _f16(per_block(0))  # [N, r]
    if affine:
        return _values(q, d, _f16(per_block(1))).reshape(n, -1)
    return _values(q - (16 if high else 8), d, None).reshape(n, -1)


def _plane_parts(w: GGMLLinear) -> list[tuple[int, int]]:
    """(plane, position) of each dot over a run of blocks, in `code_order`."""
    planes, positions, _ = _planes(w.ggml_type)
    return [(k, j) for k in range(planes) for j in range(positions)]


def _q6k_rows(w: GGMLLinear) -> jax.Array:
    """A Q6_K weight decoded whole in HF order, f32 [out, in]: every value in one elementwise
    pass over both planes (the same f32 operations as `_plane_values`, with the plane,
    position and sub-block as array axes)."""
    n, nb = w.out_features, w.in_features // w.block
    jj = jnp.arange(2, dtype=jnp.int32)[:, None]  # nibble position
    aa = jnp.arange(2, dtype=jnp.int32)[:, None, None, None, None]  # plane
    ql = _i32(w.fields[0].reshape(n, 2, nb, 2, 1, 32))  # [N, a, nb, h, j, l]
    qh = _i32(w.fields[1].reshape(n, 1, nb, 2, 1, 32))
    q = ((ql >> 4 * jj) & 0xF) | (((qh >> (4 * jj + 2 * aa)) & 3) << 4)
    q = (q - 32).transpose(0, 2, 3, 4, 1, 5).reshape(n, nb, 2, 2, 2, 2, 16)  # values (h, j, a, l)
    sc = jax.lax.bitcast_convert_type(w.fields[2].reshape(n, nb, 16), jnp.int8)
    scale = _f16(w.fields[3].reshape(n, nb, 2))[..., None] * sc.astype(jnp.float32)
    return _values(q, scale.reshape(n, nb, 2, 2, 2, 2), None).reshape(n, -1)  # 8h + 4j + 2a + t


def _position_order(w: GGMLLinear) -> np.ndarray:
    """int32 [in]: `code_order` position by position (each position's planes one after the
    other): x[:, order] is the input in the order of `_position_values` for j = 0, 1, ..."""
    planes, positions, _ = _planes(w.ggml_type)
    return code_order(w).reshape(planes, positions, -1).transpose(1, 0, 2).ravel()


def _position_values(w: GGMLLinear, j: int) -> jax.Array:
    """Every value at nibble position j of every plane, f32 [N, in / positions] (planes one
    after the other, each block after block in the plane's order; Q6_K is not decoded so)."""
    t, n, nb = T(w.ggml_type), w.out_features, w.in_features // w.block
    if t not in (T.Q4_K, T.Q5_K):
        return _plane_values(w, 0, nb, 0, j)  # one plane
    q = (_i32(w.fields[-1].reshape(n, 4, nb, 32)) >> 4 * j) & 0xF  # [N, c, nb, l]
    if t == T.Q5_K:  # bit 2c + j of qh[l] is sub-block 2c + j's fifth bit
        qh = _i32(w.fields[3].reshape(n, 1, nb, 32))
        q = q | (((qh >> (2 * jnp.arange(4, dtype=jnp.int32) + j)[:, None, None]) & 1) << 4)
    sc, mn = (jnp.swapaxes(v[..., j::2], 1, 2).astype(jnp.float32)  # [N, c, nb]: 2c + j
              for v in _k_scales8(_i32(w.fields[2].reshape(n, nb, 12))))
    scale = _f16(w.fields[0].reshape(n, 1, nb, 2)) * sc
    offset = -(_f16(w.fields[1].reshape(n, 1, nb, 2)) * mn)
    return _values(q, scale, offset).reshape(n, -1)


def dequantize_rows(w: GGMLLinear) -> jax.Array:
    """The weight as HF stores it, f32 [out, in] (equal to `gguf.quants.dequantize`): Q6_K by
    `_q6k_rows`, the rest as their `_position_values` put in HF order (each block's values
    run plane by plane, each plane's position by position)."""
    if T(w.ggml_type) == T.Q6_K:
        return _q6k_rows(w)
    n, nb = w.out_features, w.in_features // w.block
    planes, positions, pb = _planes(w.ggml_type)
    v = jnp.stack([_position_values(w, j) for j in range(positions)], axis=1)
    v = v.reshape(n, positions, planes, nb, pb).transpose(0, 3, 2, 1, 4)
    return v.reshape(n, w.in_features)


def dequantize(w: GGMLLinear) -> jax.Array:
    """The weight as a linear uses it, f32 [in, out] (x @ dequantize(w) == linear(x, w))."""
    return dequantize_rows(w).T


def gather_rows(w: GGMLLinear, ids: jax.Array) -> jax.Array:
    """Rows `ids` int [...] of the weight, f32 [..., in]: the token lookup of an embedding table
    [V, D] stored with out = V (decodes only the gathered rows)."""
    rows = dequantize_rows(_rows(w, ids.reshape(-1)))
    return rows.reshape(*ids.shape, w.in_features)


# ---------------------------------------------------------------- matmul


def _linear_tiled(x: jax.Array, w: GGMLLinear, tile_weights: int) -> jax.Array:
    """x [M, in] -> [M, out] (f32 accumulation), decoding `rows` output rows at a time to x's
    dtype and multiplying them, so the decoded temporary stays cache-sized (about
    tile_weights values) and the blocks are the only full-size copy. Each nibble position's
    values (`_position_values`) get a dot with x taken once in their order; Q6_K's tile is
    decoded whole in HF order (`_q6k_rows`) for one dot. Measured at M = 128 against one
    dot per plane and position, or one dot of their concatenation (docs/research.md, stop
    44): as fast or faster, in programs up to 2.5x smaller."""
    n = w.out_features
    rows = tiling.tile_rows(w.in_features, n, tile_weights, 8)
    whole = T(w.ggml_type) == T.Q6_K
    xs = x if whole else jnp.take(x, jnp.asarray(_position_order(w)), axis=1)
    positions = _planes(w.ggml_type)[1]
    span = w.in_features // positions
    dims = (((1,), (1,)), ((), ()))

    def tile(start: Any, size: int) -> jax.Array:  # y[:, start:start + size]
        sub = w.replace(fields=tuple(jax.lax.dynamic_slice_in_dim(a, start, size, axis=0)
                                     for a in w.fields))
        if whole:
            return jax.lax.dot_general(x, _q6k_rows(sub).astype(x.dtype), dims,
                                       preferred_element_type=jnp.float32)
        ys = [jax.lax.dot_general(xs[:, j * span:(j + 1) * span],
                                  _position_values(sub, j).astype(x.dtype), dims,
                                  preferred_element_type=jnp.float32)
              for j in range(positions)]
        return sum(ys[1:], ys[0])

    return column_tiles(tile, x.shape[0], n, rows, jnp.float32)


def _decode_then_dot(x: jax.Array, w: GGMLLinear) -> jax.Array:
    """x [M, in] -> [M, out] f32: the weight decoded whole when it has at most UNTILED_WEIGHTS
    values (one dot, no loop), else in `_linear_tiled` tiles of TILE_WEIGHTS."""
    size = w.out_features * w.in_features
    return _linear_tiled(x, w, size if size <= UNTILED_WEIGHTS else TILE_WEIGHTS)


def _linear_fused(x: jax.Array, w: GGMLLinear) -> jax.Array:
    """x [M, in] -> [M, out] f32 for a few rows M (decode): per row, vector · decode(W)ᵀ in
    runs of whole blocks (`tqjax.quant.tiling`), so the only bytes read are the file's blocks
    and nothing is written: one dot per run, code plane and position reads that plane's codes
    in order against x taken once in `code_order` (see the module docstring for the times).
    """
    nb = w.in_features // w.block
    _, _, pb = _planes(w.ggml_type)
    runs = run_edges(nb, pb, pb, tiling.GGML_FUSED_VALUES)  # in blocks
    spans = list(zip(runs[:-1], runs[1:], strict=True))
    xs = jnp.take(x.astype(jnp.float32), jnp.asarray(code_order(w)), axis=1)  # [M, in]
    # (offset in xs, length, decoded values [N, length]) per run, plane and position
    parts = [((i * nb + b0) * pb, (b1 - b0) * pb, _plane_values(w, b0, b1, k, j))
             for b0, b1 in spans for i, (k, j) in enumerate(_plane_parts(w))]

    def row(xv: jax.Array) -> jax.Array:  # [in] -> [N]
        return sum_parts([jnp.dot(xv[a:a + size], v.T) for a, size, v in parts])

    return jnp.stack([row(xs[i]) for i in range(x.shape[0])])


def linear(x: jax.Array, w: GGMLLinear, backend: str | None = None) -> jax.Array:
    """x [..., in] @ W -> [..., out] in x's dtype, W the GGUF weight used as [in, out].

    backend "pallas": the fused `tqjax.pallas.ggml_matmul` kernel where it applies; "xla": on
    CPU with at most `tiling.FUSED_ROWS` rows (decode), the decoding fused into vector-matrix dots
    (`_linear_fused`); otherwise decode, then one dot (a one-pass multiply-reduce measured
    slower), weights over UNTILED_WEIGHTS values (embedding heads) in tiles of TILE_WEIGHTS
    (a whole-head f32 temporary measured ~10x slower). None = the current backend
    (`tqjax.pallas.backend`).
    """
    if x.shape[-1] != w.in_features:
        raise TqjaxError(f"linear: x has {x.shape[-1]} features, the {w.type_name} weight "
                         f"expects {w.in_features}")
    x2 = x.reshape(-1, x.shape[-1])
    if resolve_backend(backend) == "pallas":
        if gm.supported(x2.shape, w):
            return gm.ggml_matmul(x2, w).reshape(*x.shape[:-1], w.out_features)
    if use_fused(x2.shape[0]):
        return _linear_fused(x2, w).astype(x.dtype).reshape(*x.shape[:-1], w.out_features)
    return _decode_then_dot(x2, w).astype(x.dtype).reshape(*x.shape[:-1], w.out_features)


def describe(w: Any) -> str:
    """A short label for a weight, e.g. 'Q4_K [896 -> 4864]' (for reports)."""
    return f"{w.type_name} [{w.in_features} -> {w.out_features}]"
