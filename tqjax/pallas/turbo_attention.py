"""Decode attention (one query token per sequence) straight from the packed TurboQuant KV cache.

Flash-decoding in the Pallas Triton dialect: program (b, kv, split) owns the G query heads of KV
head `kv` (padded to ≥ 16 rows for the dot) and one contiguous range of cache blocks; it walks the
blocks up to the sequence's own position (slot s is visible iff s <= positions[b]) with an online
softmax and writes an unnormalised partial output plus its running max and sum. A combine step in
plain JAX merges the splits. Per block of `block` slots:

- keys: gather each code's byte(s) from the packed rows (code c of a segment starts at stream bit
  c·bits; two bytes when bits does not divide 8), look the code up in the centroid table, and
  score the rotated query: ⟨Πq, scale·c⟩ = (Πq · c) · scale (q∘s for balanced keys, which
  store k/s);
- centred keys (`center` set): add ⟨q, R_s μ⟩. With a = q₁μ₁ + q₂μ₂, b = q₂μ₁ − q₁μ₂ (halves of
  the head dim) this is Σᵢ aᵢ cos(s ωᵢ) + bᵢ sin(s ωᵢ); per block, the coefficients are rotated by
  the block start s₀ (angle addition) and dotted with a fixed [block, hd] table of cos/sin(t ω),
  t < block, so no per-slot trigonometry and no [S, hd] centre array;
- values: Σ p·scale·c accumulated in the rotated space; Πᵀ is applied once per head output after
  the kernel.

Dense (f32/bf16/f16) K or V operands take the same path with plain rows (the baseline).
Split quantizers (fractional rates) are packed segment by segment; each channel knows its
segment's bit offset, width and centroid table, so one gather handles both segments.

Stores with dense sink slots (`sink` [B, KV, n, hd]: the first n slots kept exact) are handled
in plain JAX as one more softmax partial (the kernel skips those slots), and so is an exact
recent window (the cache's last N keys/values: the kernel then stops at `bound`, before them);
a value centre μ_v (`center` on a value store) is added back as (Σ p over the packed slots)·μ_v
in the combine.
"""

from __future__ import annotations

import dataclasses
import functools
from typing import Protocol

import jax
import jax.numpy as jnp
from jax.experimental import pallas as pl
from jax.experimental.pallas import triton as plgpu

from tqjax.errors import TqjaxError
from tqjax.pallas.backend import default_interpret
from tqjax.quant.rotation import rotate, unrotate
from tqjax.quant.turboquant import TurboQuantizer, segments

NEG = -1e30  # masked score; finite so that exp(NEG − m) is 0 without inf − inf
Window = tuple[jax.Array, jax.Array, jax.Array]  # exact recent keys, values, positions
TARGET_PROGRAMS = 256
MIN_SPLIT_SLOTS = 512  # a split below this many slots costs more in the combine than it saves


class TurboLike(Protocol):
    """What the kernel reads from a `tqjax.kv.quantized.TurboStore` (duck-typed: this layer does
    not import tqjax.kv)."""

    packed: jax.Array  # [B, KV, S, bytes] uint8
    scale: jax.Array  # [B, KV, S] f16
    quantizer: TurboQuantizer
    center: jax.Array | None  # [KV, hd]: keys pre-RoPE (inv_freq set), values constant
    inv_freq: jax.Array | None  # [hd/2], keys only
    chan_scale: jax.Array | None  # [KV, hd] key channel scales s: stores k/s, scores q∘s
    sink: jax.Array | None  # [B, KV, n, hd] f16: the first n slots, exact


class DenseLike(Protocol):
    """What the kernel reads from a `tqjax.kv.store.DenseStore`."""

    data: jax.Array  # [B, KV, S, hd]

    def values(self) -> jax.Array: ...  # [B, KV, S, hd] in the values' dtype


@dataclasses.dataclass(frozen=True)
class Layout:
    """Static description of one operand: dense rows, or packed segments
    ((first channel, channels, bits), ...) whose centroid tables are concatenated."""

    segments: tuple[tuple[int, int, int], ...] | None  # None: dense
    n_bytes: int = 0


def _table(q: TurboQuantizer) -> jax.Array:
    """All centroid tables, segment by segment, f32 [Σ 2^bits]."""
    return jnp.concatenate([seg.centroids for seg in segments(q)])


def _channel_plan(layout: Layout, hd: int) -> tuple[jax.Array, ...]:
    """Per channel (int32 [hd]): first byte, bit shift, mask and centroid-table offset."""
    c = jnp.arange(hd, dtype=jnp.int32)
    bit = jnp.zeros_like(c)
    width = jnp.zeros_like(c)
    table = jnp.zeros_like(c)
    stream, offset = 0, 0
    for first, count, bits in layout.segments:
        inside = (c >= first) & (c < first + count)
        bit = jnp.where(inside, stream + (c - first) * bits, bit)
        width = jnp.where(inside, bits, width)
        table = jnp.where(inside, offset, table)
        stream, offset = stream + count * bits, offset + (1 << bits)
    return bit >> 3, bit & 7, (1 << width) - 1, table


def _rows(refs: tuple, layout: Layout, slots: jax.Array, hd: int) -> tuple[jax.Array, ...]:
    """Rows of the visible block: f32 [block, hd] values (centroids for packed operands) and
    f32 [block] scales (None for dense)."""
    shape = (slots.shape[0], hd)
    rows = jnp.broadcast_to(slots[:, None], shape)
    cols = jnp.broadcast_to(jnp.arange(hd, dtype=jnp.int32)[None, :], shape)
    if layout.segments is None:  # (uint16: a bf16 store's bits, read as bf16 here, no copy)
        x = refs[0][rows, cols]
        x = jax.lax.bitcast_convert_type(x, jnp.bfloat16) if x.dtype == jnp.uint16 else x
        return x.astype(jnp.float32), None
    packed_ref, scale_ref, table_ref = refs
    byte, shift, mask, table = _channel_plan(layout, hd)
    word = packed_ref[rows, jnp.broadcast_to(byte[None, :], shape)].astype(jnp.int32)
    if any(8 % bits for _, _, bits in layout.segments):
        nxt = jnp.broadcast_to(jnp.minimum(byte + 1, layout.n_bytes - 1)[None, :], shape)
        word = word | (packed_ref[rows, nxt].astype(jnp.int32) << 8)
    code = ((word >> shift[None, :]) & mask[None, :]) + table[None, :]
    return table_ref[code], scale_ref[slots].astype(jnp.float32)


def _kernel(pos_ref: object, q_ref: object, centre_refs: tuple | None, k_refs: tuple,
            v_refs: tuple, o_ref: object, m_ref: object, l_ref: object, *, k_layout: Layout,
            v_layout: Layout, block: int, blocks_per_split: int, slots: int, skip: int) -> None:
    split = pl.program_id(2)
    pos = jnp.minimum(pos_ref[0], slots - 1)
    q = q_ref[...]  # [Gp, hd] f32, rotated (packed keys) and pre-scaled by 1/√hd
    gp, hd = q.shape

    def body(blk: jax.Array, carry: tuple[jax.Array, ...]) -> tuple[jax.Array, ...]:
        o, m, lsum = carry
        idx = blk * block + jnp.arange(block, dtype=jnp.int32)
        safe = jnp.minimum(idx, slots - 1)
        k, k_scale = _rows(k_refs, k_layout, safe, hd)
        s = plgpu.dot(q, k, trans_b=True)  # [Gp, block]
        if k_scale is not None:
            s = s * k_scale[None, :]
        if centre_refs is not None:
            c_ref, d_ref, freq_ref, trig_ref = centre_refs
            phase = (blk * block).astype(jnp.float32) * freq_ref[...]  # [hd]
            coef = c_ref[...] * jnp.cos(phase)[None, :] + d_ref[...] * jnp.sin(phase)[None, :]
            s = s + plgpu.dot(coef, trig_ref[...], trans_b=True)
        s = jnp.where(((idx >= skip) & (idx <= pos))[None, :], s, NEG)
        m_new = jnp.maximum(m, jnp.max(s, axis=1))
        correction = jnp.exp(m - m_new)
        p = jnp.exp(s - m_new[:, None])
        lsum = lsum * correction + jnp.sum(p, axis=1)
        v, v_scale = _rows(v_refs, v_layout, safe, hd)
        if v_scale is not None:
            p = p * v_scale[None, :]
        o = o * correction[:, None] + plgpu.dot(p, v)
        return o, m_new, lsum

    first = split * blocks_per_split
    last = jnp.minimum(first + blocks_per_split, pos // block + 1)
    first = jnp.maximum(first, skip // block)  # blocks of sink slots only
    init = (jnp.zeros((gp, hd), jnp.float32), jnp.full((gp,), NEG, jnp.float32),
            jnp.zeros((gp,), jnp.float32))
    o, m, lsum = jax.lax.fori_loop(first, last, body, init)
    o_ref[...] = o
    m_ref[...] = m
    l_ref[...] = lsum


def _sink_slots(store: TurboLike | DenseLike) -> int:
    sink = getattr(store, "sink", None)
    return 0 if sink is None else sink.shape[2]


def _prefix(store: TurboLike | DenseLike, n: int) -> jax.Array:
    """The first n slots, exact: f32 [B, KV, n, hd] (a packed store's sink, or dense rows)."""
    rows = store.sink if hasattr(store, "quantizer") else store.values()[:, :, :n]
    return rows.astype(jnp.float32)


def _operand(store: TurboLike | DenseLike) -> tuple[Layout, tuple[jax.Array, ...]]:
    if hasattr(store, "quantizer"):
        parts = tuple((seg.first, seg.count, seg.bits) for seg in segments(store.quantizer))
        layout = Layout(parts, store.packed.shape[-1])
        return layout, (store.packed, store.scale, _table(store.quantizer))
    return Layout(None), (store.data,)


def _centre_terms(q: jax.Array, center: jax.Array, inv_freq: jax.Array,
                  block: int) -> tuple[jax.Array, ...]:
    """q [B, KV, Gp, hd] f32, center [KV, hd] → (C, D [B, KV, Gp, hd], ω [hd], table
    [block, hd]): the bias at slot s0 + t is ((C cos(s0 ω) + D sin(s0 ω)) · table[t])."""
    half = q.shape[-1] // 2
    q1, q2 = q[..., :half], q[..., half:]
    mu1, mu2 = center[None, :, None, :half], center[None, :, None, half:]
    a, b = q1 * mu1 + q2 * mu2, q2 * mu1 - q1 * mu2
    c = jnp.concatenate([a, b], axis=-1)
    d = jnp.concatenate([b, -a], axis=-1)
    freq = jnp.concatenate([inv_freq, inv_freq]).astype(jnp.float32)
    angle = jnp.arange(block, dtype=jnp.float32)[:, None] * inv_freq[None, :]
    return c, d, freq, jnp.concatenate([jnp.cos(angle), jnp.sin(angle)], axis=-1)


def supported(q_shape: tuple[int, ...], k_store: object, v_store: object) -> bool:
    """Whether `turbo_decode_attention` handles these operands: TurboQuant or dense K and V and
    a power-of-two head dim >= 16 (the kernel's dot tiles)."""
    hd = q_shape[-1]
    ok = hd >= 16 and hd & (hd - 1) == 0
    for store in (k_store, v_store):
        if hasattr(store, "quantizer"):  # TurboQuant_prod (qjl) stays on the XLA path
            ok = ok and store.quantizer.dim == hd and getattr(store, "qjl", None) is None
        else:
            ok = ok and hasattr(store, "data") and store.data.shape[-1] == hd
    sinks = {_sink_slots(st) for st in (k_store, v_store) if hasattr(st, "quantizer")}
    return ok and len(sinks) <= 1  # packed stores agree on their sink slots


def choose_splits(batch: int, kv_heads: int, slots: int, block: int) -> int:
    """Splits of the cache per (sequence, KV head): enough programs to fill a large GPU, each
    split at least MIN_SPLIT_SLOTS long."""
    blocks = -(-slots // block)
    want = -(-TARGET_PROGRAMS // (batch * kv_heads))
    return max(1, min(want, -(-slots // MIN_SPLIT_SLOTS), blocks))


@functools.partial(jax.jit, static_argnames=("block", "splits", "interpret"))
def _decode_attention(q: jax.Array, k_store: TurboLike | DenseLike,
                      v_store: TurboLike | DenseLike, positions: jax.Array, bound: jax.Array,
                      window: Window | None, block: int, splits: int,
                      interpret: bool) -> jax.Array:
    b, h, hd = q.shape
    k_layout, k_args = _operand(k_store)
    v_layout, v_args = _operand(v_store)
    kv, slots = k_args[0].shape[1], k_args[0].shape[2]
    g = h // kv
    gp = max(16, 1 << (g - 1).bit_length())
    qf = q.astype(jnp.float32).reshape(b, kv, g, hd)
    qk = qf
    if k_layout.segments:
        if getattr(k_store, "chan_scale", None) is not None:
            qk = qk * k_store.chan_scale[None, :, None, :]
        qk = rotate(qk, k_store.quantizer.rotation)
    qk = jnp.pad(qk * hd**-0.5, ((0, 0), (0, 0), (0, gp - g), (0, 0)))
    centre = None
    if getattr(k_store, "inv_freq", None) is not None:
        qc = jnp.pad(qf * hd**-0.5, ((0, 0), (0, 0), (0, gp - g), (0, 0)))
        centre = _centre_terms(qc, k_store.center, k_store.inv_freq, block)
    blocks = -(-slots // block)
    per_split = -(-blocks // splits)

    head = lambda *tail: pl.BlockSpec(  # noqa: E731
        (None, None, *tail), lambda i, j, s: (i, j) + (0,) * len(tail))
    whole = lambda a: pl.BlockSpec(a.shape, lambda i, j, s: (0,) * a.ndim)  # noqa: E731

    def specs(layout: Layout, args: tuple[jax.Array, ...]) -> tuple[pl.BlockSpec, ...]:
        if layout.segments is None:
            return (head(slots, hd),)
        return head(slots, layout.n_bytes), head(slots), whole(args[2])

    centre_specs = None if centre is None else (head(gp, hd), head(gp, hd), whole(centre[2]),
                                                whole(centre[3]))
    split_out = lambda *tail: pl.BlockSpec(  # noqa: E731
        (None, None, None, *tail), lambda i, j, s: (s, i, j) + (0,) * len(tail))
    skip = max(_sink_slots(k_store), _sink_slots(v_store))
    kernel = functools.partial(_kernel, k_layout=k_layout, v_layout=v_layout, block=block,
                               blocks_per_split=per_split, slots=slots, skip=skip)
    o, m, lsum = pl.pallas_call(
        kernel,
        grid=(b, kv, splits),
        in_specs=[pl.BlockSpec((1,), lambda i, j, s: (i,)), head(gp, hd), centre_specs,
                  specs(k_layout, k_args), specs(v_layout, v_args)],
        out_specs=[split_out(gp, hd), split_out(gp), split_out(gp)],
        out_shape=[jax.ShapeDtypeStruct((splits, b, kv, gp, hd), jnp.float32),
                   jax.ShapeDtypeStruct((splits, b, kv, gp), jnp.float32),
                   jax.ShapeDtypeStruct((splits, b, kv, gp), jnp.float32)],
        compiler_params=plgpu.CompilerParams(num_warps=4, num_stages=2),
        interpret=interpret,
        name="turbo_decode_attention",
    )(bound.astype(jnp.int32), qk, centre, k_args, v_args)
    o, m, lsum = o[:, :, :, :g], m[:, :, :, :g], lsum[:, :, :, :g]
    top = jnp.max(m, axis=0)  # [B, KV, G]
    # exact rows outside the kernel, one more softmax partial each, in the original basis:
    # the sink slots (visible up to `bound`) and the recent window
    exact = []
    if skip:
        visible = jnp.arange(skip)[None, :] <= bound[:, None]  # [B, n]
        exact.append((_prefix(k_store, skip), _prefix(v_store, skip), visible))
    if window is not None:
        wk, wv, wpos = window
        near = (wpos > bound[:, None]) & (wpos <= positions[:, None]) & (wpos >= 0)
        exact.append((wk.astype(jnp.float32), wv.astype(jnp.float32), near))
    partials = []
    for keys, values, visible in exact:
        s = jnp.einsum("bkgd,bksd->bkgs", qf * hd**-0.5, keys)
        s = jnp.where(visible[:, None, None, :], s, NEG)
        top = jnp.maximum(top, jnp.max(s, axis=-1))
        partials.append((s, values))
    weight = jnp.exp(m - top[None])  # [splits, B, KV, G]
    num = jnp.sum(o * weight[..., None], axis=0)
    den = jnp.sum(lsum * weight, axis=0)
    if v_layout.segments:
        num = unrotate(num, v_store.quantizer.rotation)
        if v_store.center is not None:  # centred values: Σ p (v̂ + μ_v) over the packed slots
            num = num + den[..., None] * v_store.center[None, :, None, :]
    for s, values in partials:
        p = jnp.where(s > NEG, jnp.exp(s - top[..., None]), 0.0)
        num = num + jnp.einsum("bkgs,bksd->bkgd", p, values)
        den = den + jnp.sum(p, axis=-1)
    return (num / den[..., None]).reshape(b, h, hd)


def turbo_decode_attention(q: jax.Array, k_store: TurboLike | DenseLike,
                           v_store: TurboLike | DenseLike, positions: jax.Array, *,
                           bound: jax.Array | None = None, window: Window | None = None,
                           block: int = 64, splits: int | None = None,
                           interpret: bool | None = None) -> jax.Array:
    """Attention of one new token per sequence over the cache, softmax(q·k/√hd) v.

    q [B, H, hd] (post-RoPE; H = KV·G, head h reads KV head h // G); k_store/v_store: TurboStore
    or DenseStore with [B, KV, S, ...] arrays, already holding this token; positions int32 [B]:
    the token's position. Store slot s is visible iff s <= bound[b] (None: positions); window:
    exact recent rows (keys, values f32 [B, KV, W, hd], their positions int32 [B, W], -1 =
    none), those at positions in (bound, positions] visible. block: slots per kernel step (a
    power of two >= 16); splits: programs per (sequence, KV head) along the cache (None:
    automatic); interpret: None = automatic (CPU → interpret mode). Returns f32 [B, H, hd].
    """
    if not supported(q.shape, k_store, v_store):
        raise TqjaxError(f"turbo_decode_attention needs TurboQuant or dense K/V stores and a "
                         f"power-of-two head dim >= 16, got q {q.shape}")
    if block < 16 or block & (block - 1):
        raise TqjaxError(f"attention block must be a power of two >= 16, got {block}")
    b, kv, slots = (k_store.packed if hasattr(k_store, "quantizer") else k_store.data).shape[:3]
    if splits is None:
        splits = choose_splits(b, kv, slots, block)
    interpret = default_interpret() if interpret is None else interpret
    bound = positions if bound is None else bound
    return _decode_attention(q, k_store, v_store, positions, bound, window, block, splits,
                             interpret)
