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

and the one decoder here (`_position_values`) reproduces `gguf.quants.dequantize` bit for bit
(same f32 operations in the same order). The bytes are the file's, held in two arrays: each
block's run of code bytes (`CODE_BYTES`: the nibbles or int8 codes; Q6_K's low nibbles) in
`codes`, the rest of each block (scales, mins, Q5's and Q6_K's high bits) in `head`, both per
output row in block order. A decode step's fused dots then read each row's codes in order;
through whole blocks (scales between the codes) XLA:CPU indexed every byte on its own
(SmolLM2's Q4_1 576 -> 1536: 0.43 ms against 0.07 ms split, issue 22, stop 39).
`file_blocks` puts the bytes back in the file's order. `linear` decodes a cache-sized tile
of output rows at a time and multiplies it in one dot (XLA), or runs the fused
`tqjax.pallas.ggml_matmul` kernel (Pallas backend). An embedding table [V, D] is a
GGMLLinear with out = V: `gather_rows` is the token lookup and `linear` the tied head.
"""

from __future__ import annotations

import math
from typing import Any

import jax
import jax.numpy as jnp
import numpy as np
from flax import struct
from gguf import GGML_QUANT_SIZES, GGMLQuantizationType

from tqjax.errors import TqjaxError
from tqjax.pallas import ggml_matmul as gm
from tqjax.pallas.backend import resolve as resolve_backend
from tqjax.pallas.ggml_matmul import CODE_BYTES
from tqjax.quant import tiling
from tqjax.quant.tiling import column_tiles, run_edges, sum_parts, use_fused

T = GGMLQuantizationType
SUPPORTED_TYPES: tuple[int, ...] = tuple(int(t) for t in (
    T.Q8_0, T.Q4_0, T.Q4_1, T.Q5_0, T.Q5_1, T.Q4_K, T.Q5_K, T.Q6_K))
QK_K = 256
K_SCALE_SIZE = 12  # Q4_K/Q5_K: 8 six-bit scales and 8 six-bit mins in 12 bytes
TILE_WEIGHTS = 1 << 20  # values decoded per step of `_linear_tiled` (4 MiB of f32)
UNTILED_WEIGHTS = 1 << 23  # weights up to this size are decoded whole (one dot, no loop)


@struct.dataclass
class GGMLLinear:
    """One GGUF-quantized weight [out, in] in the file's blocks, used as x @ Wᵀ ([in, out]),
    each block split into its code bytes and the rest (see the module docstring)."""

    head: jax.Array  # uint8 [N_out, in / block · head bytes]: scales (mins, high bits) per block
    codes: jax.Array  # uint8 [N_out, in / block · code bytes]: each block's codes
    ggml_type: int = struct.field(pytree_node=False, default=int(T.Q8_0))
    in_features: int = struct.field(pytree_node=False, default=0)

    @property
    def out_features(self) -> int:
        return self.codes.shape[0]

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


def _split(blocks: np.ndarray, ggml_type: int) -> tuple[np.ndarray, np.ndarray]:
    """Blocks uint8 [N, nb, type_size] -> (head [N, nb · head bytes], codes [N, nb · code
    bytes]); `file_blocks` is the inverse."""
    c0, c1 = CODE_BYTES[int(ggml_type)]
    head = np.concatenate([blocks[..., :c0], blocks[..., c1:]], axis=-1)
    return head.reshape(len(blocks), -1), blocks[..., c0:c1].reshape(len(blocks), -1)


def file_blocks(w: GGMLLinear) -> jax.Array:
    """The weight's bytes as the file stores them, uint8 [N, in / block · type_size]."""
    c0, _ = CODE_BYTES[int(w.ggml_type)]
    n, nb = w.out_features, w.in_features // w.block
    h, c = w.head.reshape(n, nb, -1), w.codes.reshape(n, nb, -1)
    return jnp.concatenate([h[..., :c0], c, h[..., c0:]], axis=-1).reshape(n, -1)


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
    head, codes = _split(raw.reshape(out, inp // block, type_size), ggml_type)
    return GGMLLinear(jnp.asarray(head), jnp.asarray(codes), int(ggml_type), inp)


def permute_rows(w: GGMLLinear, perm: np.ndarray) -> GGMLLinear:
    """w with output rows reordered, row i of the result = row perm[i] of w (a row's blocks move
    together, so this is exact; llama's Q/K un-permutation is such a reordering)."""
    rows = jnp.asarray(perm)
    return w.replace(head=w.head[rows], codes=w.codes[rows])


def weight_bytes(w: GGMLLinear) -> int:
    """Bytes the weight occupies (and a decode step reads): out · in / block · type_size."""
    return math.prod(w.head.shape) + math.prod(w.codes.shape)


def bits_per_weight(w: GGMLLinear) -> float:
    """Stored bits per weight value, scales included (e.g. 4.5 for Q4_0, 8.5 for Q8_0)."""
    return 8 * w.type_size / w.block


# ---------------------------------------------------------------- block decoding


def _f16(b: jax.Array) -> jax.Array:
    """uint8 [..., 2] little-endian half -> f32 [...]."""
    return jax.lax.bitcast_convert_type(b, jnp.float16).astype(jnp.float32)


def _i32(b: jax.Array) -> jax.Array:
    return b.astype(jnp.int32)


def _k_scale_min(sc: jax.Array) -> tuple[jax.Array, jax.Array]:
    """Q4_K/Q5_K packed 6-bit scales uint8 [..., 12] -> (scales, mins) int32 [..., 2, 4]
    (sub-block h·4 + i at [h, i]): for h = 0 the low 6 bits of bytes i and 4 + i; for h = 1
    the nibbles of byte 8 + i with the top 2 bits of bytes i and 4 + i above them."""
    d, m, md = _i32(sc[..., 0:4]), _i32(sc[..., 4:8]), _i32(sc[..., 8:12])
    first = jnp.arange(2)[:, None] == 0  # [2, 1]
    hi_sc, hi_mn = (md & 0xF) | ((d >> 2) & 0x30), (md >> 4) | ((m >> 2) & 0x30)
    scale = jnp.where(first, (d & 0x3F)[..., None, :], hi_sc[..., None, :])
    mins = jnp.where(first, (m & 0x3F)[..., None, :], hi_mn[..., None, :])
    return scale, mins


def _values(q: jax.Array, scale: jax.Array, offset: jax.Array | None) -> jax.Array:
    """Decoded values f32 [..., nb, S, L] (gguf's operation order: scale · q, then + offset)."""
    v = scale[..., None] * q.astype(jnp.float32)
    return v if offset is None else v + offset[..., None]


def _code_values(w: GGMLLinear) -> jax.Array:
    """Every value of w's rows in `code_order`, f32 [N, in] (each code position's
    `_position_values` over all blocks, one after the other)."""
    nb = w.in_features // w.block
    return jnp.concatenate([_position_values(w, 0, nb, j)
                            for j in range(_positions(w.ggml_type))], axis=-1)


def dequantize_rows(w: GGMLLinear) -> jax.Array:
    """The weight as HF stores it, f32 [out, in] (equal to `gguf.quants.dequantize`)."""
    return _code_values(w)[:, np.argsort(code_order(w))]


def dequantize(w: GGMLLinear) -> jax.Array:
    """The weight as a linear uses it, f32 [in, out] (x @ dequantize(w) == linear(x, w))."""
    return dequantize_rows(w).T


def gather_rows(w: GGMLLinear, ids: jax.Array) -> jax.Array:
    """Rows `ids` int [...] of the weight, f32 [..., in]: the token lookup of an embedding table
    [V, D] stored with out = V (decodes only the gathered rows)."""
    flat = ids.reshape(-1)
    rows = dequantize_rows(w.replace(head=w.head[flat], codes=w.codes[flat]))
    return rows.reshape(*ids.shape, w.in_features)


# ---------------------------------------------------------------- matmul


def _linear_tiled(x: jax.Array, w: GGMLLinear, tile_weights: int) -> jax.Array:
    """x [M, in] -> [M, out] (f32 accumulation), decoding `rows` output rows at a time to x's
    dtype and multiplying them in one dot, so the decoded temporary stays cache-sized (about
    tile_weights values) and the blocks are the only full-size copy."""
    n = w.out_features
    rows = min(n, max(8, tile_weights // w.in_features // 8 * 8))
    xs = jnp.take(x, jnp.asarray(code_order(w)), axis=1)  # x in the order of the codes
    nb, pos = w.in_features // w.block, _positions(w.ggml_type)
    span = w.in_features // pos  # inputs per code position

    def tile(start: Any, size: int) -> jax.Array:  # y[:, start:start + size]
        def cut(a: jax.Array) -> jax.Array:
            return jax.lax.dynamic_slice_in_dim(a, start, size, axis=0)

        sub = w.replace(head=cut(w.head), codes=cut(w.codes))
        parts = [jax.lax.dot_general(  # one dot per code position: no concatenated copy
            xs[:, j * span:(j + 1) * span], _position_values(sub, 0, nb, j).astype(x.dtype),
            (((1,), (1,)), ((), ())), preferred_element_type=jnp.float32) for j in range(pos)]
        return sum(parts[1:], parts[0])

    return column_tiles(tile, x.shape[0], n, rows, jnp.float32)


def _decode_then_dot(x: jax.Array, w: GGMLLinear) -> jax.Array:
    """x [M, in] -> [M, out] f32: the weight decoded whole when it has at most UNTILED_WEIGHTS
    values (one dot, no loop), else in `_linear_tiled` tiles of TILE_WEIGHTS."""
    size = w.out_features * w.in_features
    return _linear_tiled(x, w, size if size <= UNTILED_WEIGHTS else TILE_WEIGHTS)


def _positions(ggml_type: int) -> int:
    """Code positions per code byte: 2 nibbles for the 4/5-bit types, 1 for Q8_0."""
    return 1 if T(ggml_type) == T.Q8_0 else 2


def code_order(w: GGMLLinear) -> np.ndarray:
    """int32 [in]: the input index of every code as `_position_values` lays them out, position
    by position (the low nibbles of every code byte of the row, then the high ones): x[:, order]
    is the input in the order the fused dots read the codes."""
    t, nb = T(w.ggml_type), w.in_features // w.block
    if t == T.Q8_0:
        return np.arange(w.in_features, dtype=np.int32)
    b = np.arange(nb)
    if t in (T.Q4_K, T.Q5_K):  # code byte (chunk c, l) holds sub-blocks 2c (low) and 2c + 1
        c, lane = np.arange(4)[None, :, None], np.arange(32)[None, None, :]
        parts = [b[:, None, None] * QK_K + (2 * c + j) * 32 + lane for j in range(2)]
    elif t == T.Q6_K:  # low-nibble byte (half h, m) holds values 128h + m and 128h + 64 + m
        h, m = np.arange(2)[None, :, None], np.arange(64)[None, None, :]
        parts = [b[:, None, None] * QK_K + h * 128 + j * 64 + m for j in range(2)]
    else:  # Q4_x/Q5_x: code byte i holds values i (low nibble) and 16 + i
        parts = [b[:, None] * 32 + j * 16 + np.arange(16)[None, :] for j in range(2)]
    return np.concatenate([p.ravel() for p in parts]).astype(np.int32)


def _position_values(w: GGMLLinear, b0: int, b1: int, j: int) -> jax.Array:
    """Blocks b0..b1-1 decoded at code position j (see `code_order`), f32 [N, (b1 - b0) ·
    code bytes] in the order of the codes: gguf's f32 operations in its order (scale · q,
    then + offset), so every value equals `gguf.quants.dequantize`'s."""
    t, n, r = T(w.ggml_type), w.out_features, b1 - b0
    c0, c1 = CODE_BYTES[int(t)]
    cb = c1 - c0
    codes = w.codes[:, b0 * cb:b1 * cb].reshape(n, r, cb)
    head = w.head.reshape(n, w.in_features // w.block, -1)[:, b0:b1]  # [N, r, head bytes]
    if t == T.Q8_0:
        q = jax.lax.bitcast_convert_type(codes, jnp.int8).astype(jnp.int32)
        return _values(q, _f16(head[..., 0:2]), None).reshape(n, -1)
    if t == T.Q6_K:  # head: qh [64], int8 scales [16], d; value 128h + 64j + 32a + l
        low = (_i32(codes).reshape(n, r, 2, 2, 32) >> 4 * j) & 0xF  # [N, r, h, a, l]
        qh = _i32(head[..., 0:64]).reshape(n, r, 2, 1, 32)
        shifts = (2 * (2 * j + jnp.arange(2, dtype=jnp.int32)))[:, None]  # [a, 1]
        q = (low | (((qh >> shifts) & 3) << 4)) - 32
        sc = jax.lax.bitcast_convert_type(head[..., 64:80], jnp.int8).astype(jnp.float32)
        scale = (_f16(head[..., 80:82])[..., None] * sc).reshape(n, r, 2, 2, 4)[..., j, :]
        return _values(q.reshape(n, r, 2, 4, 16), scale, None).reshape(n, -1)
    if t in (T.Q4_K, T.Q5_K):
        q = (_i32(codes).reshape(n, r, 4, 32) >> 4 * j) & 0xF  # sub-blocks 2c + j
        if t == T.Q5_K:  # bit s of qh[l] is sub-block s's fifth bit
            shifts = (2 * jnp.arange(4, dtype=jnp.int32) + j)[:, None]
            q = q | (((_i32(head[..., 16:48])[..., None, :] >> shifts) & 1) << 4)
        d, dmin = _f16(head[..., 0:2]), _f16(head[..., 2:4])
        sc, mn = _k_scale_min(head[..., 4:4 + K_SCALE_SIZE])
        scale = (d[..., None] * sc.reshape(n, r, 8).astype(jnp.float32))[..., j::2]
        offset = -(dmin[..., None] * mn.reshape(n, r, 8).astype(jnp.float32))[..., j::2]
        return _values(q, scale, offset).reshape(n, -1)
    affine, high = t in (T.Q4_1, T.Q5_1), t in (T.Q5_0, T.Q5_1)
    q = (_i32(codes) >> 4 * j) & 0xF  # [N, r, 16]: values 16j + i
    if high:  # bit 16j + i of the 32-bit qh (after d, m) is value 16j + i's fifth bit
        at = (4 if affine else 2) + 2 * j
        bits = _i32(head[..., at]) | (_i32(head[..., at + 1]) << 8)
        q = q | (((bits[..., None] >> jnp.arange(16, dtype=jnp.int32)) & 1) << 4)
    d = _f16(head[..., 0:2])  # [N, r]
    if affine:
        return _values(q, d, _f16(head[..., 2:4])).reshape(n, -1)
    return _values(q - (16 if high else 8), d, None).reshape(n, -1)


def _linear_fused(x: jax.Array, w: GGMLLinear) -> jax.Array:
    """x [M, in] -> [M, out] f32 for a few rows M (decode): per row, vector · decode(W)ᵀ in
    runs of whole blocks (`tqjax.quant.tiling`), so the only bytes read are the file's blocks
    and nothing is written: one dot per code position and run reads the codes in order
    against x taken once in `code_order` (SmolLM2's Q4_1 576 -> 1536: 0.07 ms against 0.43 ms
    decoding whole blocks, the f32 weight's dot 0.11 ms; issue 22, stop 39).
    """
    nb = w.in_features // w.block
    runs = run_edges(nb, w.type_size, w.block, tiling.GGML_FUSED_VALUES)  # in blocks
    spans = list(zip(runs[:-1], runs[1:], strict=True))
    cb = CODE_BYTES[int(w.ggml_type)][1] - CODE_BYTES[int(w.ggml_type)][0]
    xs = jnp.take(x.astype(jnp.float32), jnp.asarray(code_order(w)), axis=1)  # [M, in]
    # (offset in xs, length, decoded values [N, length]) per run and code position
    parts = [((j * nb + b0) * cb, (b1 - b0) * cb, _position_values(w, b0, b1, j))
             for b0, b1 in spans for j in range(_positions(w.ggml_type))]

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
