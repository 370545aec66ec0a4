"""Fused dequantize-and-multiply for GGUF weights kept in their own blocks (Pallas, Triton dialect).

y = x @ Wᵀ for W [N, K] stored as llama.cpp blocks (`tqjax.quant.ggml.GGMLLinear`: per output
row, K / block blocks of `type_size` bytes, kept field by field as FIELDS lays them out), never
writing W to memory. The launch follows
`tqjax.pallas.dequant_matmul`: each program owns `block_n` output rows and a contiguous range of
blocks (split-K); `decode` tiling (M <= 8) does a row-wise multiply-and-reduce per activation
row, `prefill` tiling a [block_m, L] × [L, block_n] dot per sub-block. Per block, each sub-block
of L values (16 or 32: a power of two, as Triton needs)

1. gathers its code bytes straight from the block's fields (byte and shift computed from the
   value index, e.g. Q6_K's low nibbles at byte 64·h + r mod 64 and high bits at
   128 + 32·h + r mod 32, each byte found in its field's planes), and
   its scale (and min) bytes, assembling f16 from two bytes and sign-extending int8 with integer
   ops,
2. multiplies the integer codes (as f32, exact) with the activation slice,
3. applies the sub-block's scale to the partial product (and offset · Σx).

Split-K partials come back as f32 [splits, M, N] and are summed in plain JAX.
"""

from __future__ import annotations

import functools
from typing import Protocol

import jax
import jax.numpy as jnp
from gguf import GGML_QUANT_SIZES, GGMLQuantizationType
from jax.experimental import pallas as pl
from jax.experimental.pallas import triton as plgpu

from tqjax.errors import TqjaxError
from tqjax.pallas.backend import default_interpret
from tqjax.pallas.dequant_matmul import (
    DECODE_ROWS,
    TARGET_PROGRAMS,
    Tiling,
    accumulate,
    fold,
)

T = GGMLQuantizationType
KERNEL_TYPES: tuple[int, ...] = tuple(int(t) for t in (
    T.Q8_0, T.Q4_0, T.Q4_1, T.Q5_0, T.Q5_1, T.Q4_K, T.Q5_K, T.Q6_K))
# Each block's bytes split into its fields (gguf/quants.py's names), as (start, size, planes,
# chunk): a weight keeps field f as uint8 [N, planes, blocks · size / planes], the field's
# chunks of `chunk` bytes dealt round-robin to its planes (chunk c to plane c mod planes), each
# plane block after block (`tqjax.quant.ggml`). Per-block fields are one plane; the codes are
# cut into planes so that every dot of the XLA path reads one plane's codes in order with one
# constant shift per block (Q6_K: plane a holds the low nibbles of values 128h + 64j + 32a + l
# for both halves h, and its qh bytes (h, l) are the plane's own order).
FIELDS: dict[int, tuple[tuple[int, int, int, int], ...]] = {
    int(T.Q8_0): ((0, 2, 1, 2), (2, 32, 1, 32)),  # d, qs
    int(T.Q4_0): ((0, 2, 1, 2), (2, 16, 1, 16)),  # d, qs
    int(T.Q4_1): ((0, 2, 1, 2), (2, 2, 1, 2), (4, 16, 1, 16)),  # d, m, qs
    int(T.Q5_0): ((0, 2, 1, 2), (2, 4, 1, 4), (6, 16, 1, 16)),  # d, qh, qs
    int(T.Q5_1): ((0, 2, 1, 2), (2, 2, 1, 2), (4, 4, 1, 4), (8, 16, 1, 16)),  # d, m, qh, qs
    int(T.Q4_K): ((0, 2, 1, 2), (2, 2, 1, 2), (4, 12, 1, 12), (16, 128, 4, 32)),  # d dmin sc qs
    int(T.Q5_K): ((0, 2, 1, 2), (2, 2, 1, 2), (4, 12, 1, 12), (16, 32, 1, 32),  # ... qh
                  (48, 128, 4, 32)),  # qs
    int(T.Q6_K): ((0, 128, 2, 32), (128, 64, 1, 64), (192, 16, 1, 16), (208, 2, 1, 2)),
}  # Q6_K: ql, qh, scales, d


def field_of(ggml_type: int, at: int) -> int:
    """Index of the field (in FIELDS[ggml_type]) that holds byte `at` of a block."""
    for f, (start, size, _, _) in enumerate(FIELDS[int(ggml_type)]):
        if start <= at < start + size:
            return f
    raise TqjaxError(f"byte {at} is outside a {T(ggml_type).name} block")


def field_column(ggml_type: int, f: int, e: jax.Array, block: jax.Array) -> tuple[jax.Array,
                                                                                   jax.Array]:
    """(plane, column) in field f's array of byte e (int32 [...], within the field) of `block`."""
    _, size, planes, chunk = FIELDS[int(ggml_type)][f]
    c = e // chunk
    return c % planes, block * (size // planes) + (c // planes) * chunk + e % chunk


class BlockWeight(Protocol):
    """What the kernel reads of a `tqjax.quant.ggml.GGMLLinear` (structural type, so this
    ground-layer module imports nothing above it)."""

    fields: tuple[jax.Array, ...]  # uint8 [N, planes, K / block · plane bytes] per FIELDS entry
    ggml_type: int
    in_features: int  # K

    @property
    def out_features(self) -> int: ...  # N


def sub_blocks(ggml_type: int) -> tuple[int, int]:
    """(sub-blocks per block, values per sub-block L) the kernel loops over."""
    t = T(ggml_type)
    if t == T.Q8_0:
        return 1, 32
    if t in (T.Q4_K, T.Q5_K):
        return 8, 32
    return (16, 16) if t == T.Q6_K else (2, 16)  # Q6_K; Q4_0/Q4_1/Q5_0/Q5_1: one per nibble


def supported(x_shape: tuple[int, ...], w: BlockWeight) -> bool:
    """Whether `ggml_matmul` handles x [M, K] with w (else use the XLA path)."""
    return (len(x_shape) == 2 and x_shape[1] == w.in_features and w.out_features % 16 == 0
            and int(w.ggml_type) in KERNEL_TYPES)


def choose_tiling(m: int, blocks: int, n: int) -> Tiling:
    """Default tiling for x [m, K] @ W [K, n] with K in `blocks` blocks: decode (m <= 8) or
    prefill, as `tqjax.pallas.dequant_matmul.choose_tiling`."""
    if m <= DECODE_ROWS:
        block_m, block_n, row_blocks = None, 64, 1
    else:
        block_m = min(64, max(16, 1 << (m - 1).bit_length()))
        block_n, row_blocks = 64, -(-m // block_m)
    while n % block_n:
        block_n //= 2
    want = max(1, TARGET_PROGRAMS // (row_blocks * (n // block_n)))
    splits = max(d for d in range(1, blocks + 1) if blocks % d == 0 and d <= want)
    return Tiling(block_m, block_n, splits)


def _half(lo: jax.Array, hi: jax.Array) -> jax.Array:
    """Little-endian f16 from its two bytes (int32 [...]) -> f32 [...]."""
    bits = (lo | (hi << 8)).astype(jnp.uint16)
    return jax.lax.bitcast_convert_type(bits, jnp.float16).astype(jnp.float32)


def _signed(b: jax.Array) -> jax.Array:
    """Bytes int32 0..255 read as int8."""
    return (b ^ 0x80) - 0x80


def _decode_part(t: T, load: object, load1: object, p: int, length: int
                 ) -> tuple[jax.Array, jax.Array, jax.Array | None]:
    """Sub-block p of the current block: (codes int32 [block_n, L], scale f32 [block_n],
    offset f32 [block_n] or None). load(at, offsets int32 [L]) gathers bytes int32
    [block_n, L] at at + offsets within the block (at: where the field read starts, static);
    load1(at) one byte per row, int32 [block_n]."""
    e = p * length + jnp.arange(length, dtype=jnp.int32)  # value index within the block
    if t == T.Q8_0:
        return _signed(load(2, e)), _half(load1(0), load1(1)), None
    if t in (T.Q4_0, T.Q4_1, T.Q5_0, T.Q5_1):
        affine, high = t in (T.Q4_1, T.Q5_1), t in (T.Q5_0, T.Q5_1)
        qh_at = 4 if affine else 2
        qs_at = qh_at + 4 * high
        q = (load(qs_at, e & 15) >> (4 * p)) & 0xF
        if high:
            q = q | (((load(qh_at, e >> 3) >> (e & 7)) & 1) << 4)
        d = _half(load1(0), load1(1))
        if affine:
            return q, d, _half(load1(2), load1(3))
        return q - (16 if high else 8), d, None
    if t in (T.Q4_K, T.Q5_K):
        qs_at = 16 + 32 * (t == T.Q5_K)
        q = (load(qs_at + 32 * (p // 2), e & 31) >> (4 * (p % 2))) & 0xF
        if t == T.Q5_K:
            q = q | (((load(16, e & 31) >> p) & 1) << 4)
        if p < 4:
            sc, mn = load1(4 + p) & 0x3F, load1(8 + p) & 0x3F
        else:
            md = load1(12 + p - 4)
            sc = (md & 0xF) | ((load1(4 + p - 4) >> 6) << 4)
            mn = (md >> 4) | ((load1(8 + p - 4) >> 6) << 4)
        d, dmin = _half(load1(0), load1(1)), _half(load1(2), load1(3))
        return q, d * sc.astype(jnp.float32), -(dmin * mn.astype(jnp.float32))
    if t == T.Q6_K:
        h, r = p // 8, e & 127  # half of the block, index within it
        ql = (load(64 * h, r & 63) >> (4 * ((p % 8) // 4))) & 0xF
        qh = (load(128 + 32 * h, r & 31) >> (2 * ((p % 8) // 2))) & 3
        scale = _half(load1(208), load1(209)) * _signed(load1(192 + p)).astype(jnp.float32)
        return (ql | (qh << 4)) - 32, scale, None
    raise TqjaxError(f"ggml_matmul has no decoder for {t.name}")


def _kernel(x_ref: object, *refs: object, ggml_type: int, block: int, blocks_per_split: int,
            rows: int | None, block_n: int) -> None:
    *field_refs, o_ref = refs  # one ref per FIELDS entry, [block_n, planes, blocks · plane]
    split = pl.program_id(2)
    t = T(ggml_type)
    parts, length = sub_blocks(ggml_type)
    row_ids = jnp.arange(block_n, dtype=jnp.int32)
    layout = FIELDS[int(ggml_type)]

    def body(i: jax.Array, acc: tuple[jax.Array, ...]) -> tuple[jax.Array, ...]:
        b = split * blocks_per_split + i

        def load(at: int, offsets: jax.Array) -> jax.Array:  # bytes at + offsets: [block_n, L]
            f = field_of(ggml_type, at)  # every offset stays in the field that holds `at`
            plane, col = field_column(ggml_type, f, at - layout[f][0] + offsets, b)
            shape = (block_n, offsets.shape[0])
            r = jnp.broadcast_to(row_ids[:, None], shape)
            k = jnp.broadcast_to(plane[None, :], shape)
            c = jnp.broadcast_to(col[None, :], shape)
            return field_refs[f][r, k, c].astype(jnp.int32)

        def load1(at: int) -> jax.Array:  # byte `at`, [block_n]
            return load(at, jnp.zeros((1,), jnp.int32))[:, 0]

        for p in range(parts):
            q, scale, offset = _decode_part(t, load, load1, p, length)
            acc = fold(acc, x_ref, pl.ds(b * block + p * length, length), q, scale, offset,
                       rows, trans_b=True)  # q [block_n, L]
        return acc

    accumulate(o_ref, rows, block_n, blocks_per_split, body)


@functools.partial(jax.jit, static_argnames=("interpret", "tiling"))
def _ggml_matmul(x: jax.Array, w: BlockWeight, interpret: bool, tiling: Tiling) -> jax.Array:
    m, k = x.shape
    block = GGML_QUANT_SIZES[T(w.ggml_type)][0]
    n, blocks = w.out_features, k // block
    block_m, block_n, splits = tiling.block_m, tiling.block_n, tiling.splits
    if n % block_n or blocks % splits or block_n & (block_n - 1):
        raise TqjaxError(f"bad tiling {tiling} for [{m}, {k}] @ [{k}, {n}] in {blocks} blocks")
    if block_m is None:
        xp, rows, row_blocks = x, m, 1
        x_spec = pl.BlockSpec((m, k), lambda i, j, s: (0, 0))
    else:
        row_blocks = -(-m // block_m)
        xp, rows = jnp.pad(x, ((0, row_blocks * block_m - m), (0, 0))), None
        x_spec = pl.BlockSpec((block_m, k), lambda i, j, s: (i, 0))
    mp = xp.shape[0]
    kernel = functools.partial(
        _kernel, ggml_type=int(w.ggml_type), block=block, blocks_per_split=blocks // splits,
        rows=rows, block_n=block_n)
    field_specs = [pl.BlockSpec((block_n, *a.shape[1:]), lambda i, j, s: (j, 0, 0))
                   for a in w.fields]
    out = pl.pallas_call(
        kernel,
        grid=(row_blocks, n // block_n, splits),
        in_specs=[x_spec, *field_specs],
        out_specs=pl.BlockSpec((None, mp if block_m is None else block_m, block_n),
                               lambda i, j, s: (s, i, j)),
        out_shape=jax.ShapeDtypeStruct((splits, mp, n), jnp.float32),
        compiler_params=plgpu.CompilerParams(num_warps=4, num_stages=2),
        interpret=interpret,
        name=f"ggml_matmul_{T(w.ggml_type).name.lower()}",
    )(xp, *w.fields)
    return jnp.sum(out, axis=0)[:m].astype(x.dtype)


def ggml_matmul(x: jax.Array, w: BlockWeight, *, interpret: bool | None = None,
                tiling: Tiling | None = None) -> jax.Array:
    """x [M, K] @ Wᵀ -> [M, N] in x's dtype for a GGUF block weight W [N, K], without
    materialising W. interpret: None = automatic (CPU -> interpret mode); tiling: None =
    `choose_tiling`. Raises TqjaxError for shapes `supported` rejects."""
    if not supported(x.shape, w):
        raise TqjaxError(f"ggml_matmul does not handle x {x.shape} with a "
                         f"{T(w.ggml_type).name} [{w.out_features}, {w.in_features}] weight "
                         "(needs 2-D x with K = in_features and N % 16 == 0)")
    block = GGML_QUANT_SIZES[T(w.ggml_type)][0]
    if tiling is None:
        tiling = choose_tiling(x.shape[0], w.in_features // block, w.out_features)
    interpret = default_interpret() if interpret is None else interpret
    return _ggml_matmul(x, w, interpret, tiling)
