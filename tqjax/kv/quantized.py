"""Compressed KV stores: the llama.cpp-style baselines (int8 per vector or per block of 32,
affine int4, Q4_0, optionally in a Walsh–Hadamard basis), and TurboQuant; and `AidedStore`,
which gives any baseline TurboQuant's aids (centring, key balancing, dense sink slots).

TurboQuant stores keep packed Lloyd–Max codes of the *rotated* vectors plus one fp16 scale per
vector. Attention never leaves the rotated space per slot: a key score is
⟨Πq, scale·c⟩ = ⟨q, Πᵀ(scale·c)⟩, and values are accumulated as Σ p·scale·c and rotated back once
per block of slots (attention walks the cache in blocks) and head output.

Keys may be *centred* first: a per-head vector μ (the pre-RoPE key mean, from calibration) is
rotated to each slot's position and subtracted before quantizing, and its exact score
contribution ⟨q, R_s μ⟩ is added back. Softmax does not change, but the large constant offset
that Qwen's k_proj bias puts on every key no longer eats the quantizer's range. Values may be
centred the same way (no RoPE); μ_v is added back exactly since softmax weights sum to one.

With `qjl` set the store is TurboQuant_prod: the (b−1)-bit MSE code plus one sign bit per
channel of S·r (S Gaussian, r the residual) and ‖r‖, an unbiased inner-product estimator.

The first `n_sink` slots can be kept dense: attention sinks (the first tokens, which most heads
attend to heavily) then carry no quantization error, for a fixed cost per layer.
"""

from __future__ import annotations

import math

import jax
import jax.numpy as jnp
import numpy as np
from flax import struct

from tqjax.kv import store as kvs
from tqjax.kv.rope import apply_rope, rope_cos_sin
from tqjax.quant.packing import (
    lookup,
    pack_bits,
    packed_size,
    planar_order,
    unpack_bits,
    unpack_planes,
)
from tqjax.quant.rotation import hadamard_transform, rotate, unrotate
from tqjax.quant.turboquant import (
    ProdQuantizer,
    Segment,
    TurboQuantizer,
    dequantize_rotated,
    quantize,
    quantize_prod,
    segments,
)

SCALE_DTYPE = jnp.float16
CENTRE_INNER = 64  # slots per inner factor of the centred keys' score table (`_centre_scores`)


# ---------------------------------------------------------------- symmetric int8 in groups


def _groups(x: jax.Array, group: int) -> jax.Array:
    """[..., hd] -> [..., hd/group, group]."""
    return x.reshape(*x.shape[:-1], x.shape[-1] // group, group)


def _divide(xg: jax.Array, scale: jax.Array) -> jax.Array:
    """xg [..., G, group] / the stored f16 scale [..., G] (1 where it is 0: an all-zero group)."""
    sf = scale.astype(jnp.float32)[..., None]
    return xg / jnp.where(sf != 0, sf, 1.0)


@struct.dataclass
class Int8Store:
    """Symmetric int8, one fp16 absmax scale per group of `group` channels: x ≈ scale · q,
    q = round(x / scale) in [-127, 127], scale = max|x| / 127 (rounded to fp16 first, and the
    division uses the stored scale). q8: the whole head vector is one group (8 + 16/hd bits a
    value); q8_0: groups of 32 like llama.cpp's Q8_0 block (8.5 bits)."""

    q: jax.Array  # [B, KV, S, hd] int8
    scale: jax.Array  # [B, KV, S, hd/group] f16
    group: int = struct.field(pytree_node=False, default=32)


def _int8_values(store: Int8Store) -> jax.Array:
    q = _groups(store.q.astype(jnp.float32), store.group)
    return (q * store.scale.astype(jnp.float32)[..., None]).reshape(store.q.shape)


@kvs.write.register
def _(store: Int8Store, x: jax.Array, start: jax.Array) -> Int8Store:
    xg = _groups(x.astype(jnp.float32), store.group)  # [B, KV, T, hd/group, group]
    scale = (jnp.max(jnp.abs(xg), axis=-1) / 127.0).astype(SCALE_DTYPE)
    q = jnp.round(_divide(xg, scale)).clip(-127, 127).astype(jnp.int8).reshape(x.shape)
    return Int8Store(kvs.write_rows(store.q, q, start), kvs.write_rows(store.scale, scale, start),
                     store.group)


@kvs.block.register
def _(store: Int8Store, lo: jax.Array, size: int) -> Int8Store:
    return Int8Store(kvs.slot_block(store.q, lo, size), kvs.slot_block(store.scale, lo, size),
                     store.group)


# ---------------------------------------------------------------- affine int4, groups of 32


@struct.dataclass
class Int4Store:
    """Affine 4-bit in groups of `group` channels: x ≈ lo + step · q, q in [0, 15]."""

    packed: jax.Array  # [B, KV, S, hd/2] uint8
    step: jax.Array  # [B, KV, S, hd/group] f16
    lo: jax.Array  # [B, KV, S, hd/group] f16
    group: int = struct.field(pytree_node=False, default=32)


def _int4_values(store: Int4Store) -> jax.Array:
    hd = store.packed.shape[-1] * 2
    q = _groups(unpack_bits(store.packed, 4, hd).astype(jnp.float32), store.group)
    x = store.lo.astype(jnp.float32)[..., None] + store.step.astype(jnp.float32)[..., None] * q
    return x.reshape(*x.shape[:-2], hd)


@kvs.write.register
def _(store: Int4Store, x: jax.Array, start: jax.Array) -> Int4Store:
    xg = _groups(x.astype(jnp.float32), store.group)
    lo, hi = jnp.min(xg, axis=-1), jnp.max(xg, axis=-1)
    step = ((hi - lo) / 15.0).astype(SCALE_DTYPE)
    lo = lo.astype(SCALE_DTYPE)
    q = jnp.round(_divide(xg - lo.astype(jnp.float32)[..., None], step))
    q = q.clip(0, 15).astype(jnp.uint8).reshape(x.shape)
    return Int4Store(kvs.write_rows(store.packed, pack_bits(q, 4), start),
                     kvs.write_rows(store.step, step, start), kvs.write_rows(store.lo, lo, start),
                     store.group)


@kvs.block.register
def _(store: Int4Store, lo: jax.Array, size: int) -> Int4Store:
    return Int4Store(kvs.slot_block(store.packed, lo, size), kvs.slot_block(store.step, lo, size),
                     kvs.slot_block(store.lo, lo, size), store.group)


# ---------------------------------------------------------------- llama.cpp Q4_0


@struct.dataclass
class Q40Store:
    """llama.cpp's Q4_0: blocks of 32 channels, one fp16 scale d = m / −8 per block (m the
    block's value of largest magnitude, sign kept), q = min(15, ⌊x / d + 8.5⌋), x ≈ d · (q − 8):
    4.5 bits a value. (llama.cpp divides by d before rounding it to fp16; here by the stored
    fp16 d, which dequantization uses.)"""

    packed: jax.Array  # [B, KV, S, hd/2] uint8, codes 0..15
    scale: jax.Array  # [B, KV, S, hd/32] f16
    group: int = struct.field(pytree_node=False, default=32)


def _q40_values(store: Q40Store) -> jax.Array:
    hd = store.packed.shape[-1] * 2
    q = _groups(unpack_bits(store.packed, 4, hd).astype(jnp.float32) - 8.0, store.group)
    return (q * store.scale.astype(jnp.float32)[..., None]).reshape(*q.shape[:-2], hd)


@kvs.write.register
def _(store: Q40Store, x: jax.Array, start: jax.Array) -> Q40Store:
    xg = _groups(x.astype(jnp.float32), store.group)  # [B, KV, T, hd/32, 32]
    at = jnp.argmax(jnp.abs(xg), axis=-1)[..., None]
    scale = (jnp.take_along_axis(xg, at, axis=-1)[..., 0] / -8.0).astype(SCALE_DTYPE)
    q = jnp.floor(_divide(xg, scale) + 8.5).clip(0, 15).astype(jnp.uint8).reshape(x.shape)
    return Q40Store(kvs.write_rows(store.packed, pack_bits(q, 4), start),
                    kvs.write_rows(store.scale, scale, start), store.group)


@kvs.block.register
def _(store: Q40Store, lo: jax.Array, size: int) -> Q40Store:
    return Q40Store(kvs.slot_block(store.packed, lo, size), kvs.slot_block(store.scale, lo, size),
                    store.group)


# ---------------------------------------------------------------- TurboQuant


@struct.dataclass
class TurboStore:
    """TurboQuant codes (packed) and per-vector scales; optional centring, key balancing,
    dense sink slots and QJL residual signs (TurboQuant_prod)."""

    packed: jax.Array  # [B, KV, S, packed bytes] uint8
    scale: jax.Array  # [B, KV, S] f16
    quantizer: TurboQuantizer
    center: jax.Array | None = None  # [KV, hd] f32 mean removed before quantizing
    inv_freq: jax.Array | None = None  # [hd/2] f32 (keys): rotate `center` to each slot
    chan_scale: jax.Array | None = None  # [KV, hd] f32 key scales s: stores k/s, scores q∘s
    sink: jax.Array | None = None  # [B, KV, n_sink, hd] f16: the first slots kept dense
    qjl: jax.Array | None = None  # [hd, hd] f32 Gaussian S (TurboQuant_prod)
    qjl_signs: jax.Array | None = None  # [B, KV, S, hd/8] uint8 packed sign bits of S·r
    qjl_norm: jax.Array | None = None  # [B, KV, S] f16 residual norms ‖r‖


def pack_codes(q: TurboQuantizer, codes: jax.Array) -> jax.Array:
    """codes uint8 [..., dim] -> packed uint8 [..., bytes], segment by segment."""
    return jnp.concatenate([pack_bits(codes[..., seg.channels], seg.bits)
                            for seg in segments(q)], -1)


def _segment_bytes(q: TurboQuantizer, packed: jax.Array) -> list[tuple[Segment, jax.Array]]:
    """Each segment of q with its packed bytes [..., segment bytes] (`pack_codes`' layout)."""
    out, offset = [], 0
    for seg in segments(q):
        size = packed_size(seg.count, seg.bits)
        out.append((seg, packed[..., offset:offset + size]))
        offset += size
    return out


def unpack_codes(q: TurboQuantizer, packed: jax.Array) -> jax.Array:
    """Inverse of `pack_codes`: packed uint8 [..., bytes] -> codes uint8 [..., dim]."""
    return jnp.concatenate([unpack_bits(b, seg.bits, seg.count)
                            for seg, b in _segment_bytes(q, packed)], -1)


def _centre_at(store: Aided, positions: jax.Array) -> jax.Array:
    """The centre at each position (keys: rotated by RoPE): positions [...] -> [..., KV, hd]."""
    if store.inv_freq is None:
        return jnp.broadcast_to(store.center, (*positions.shape, *store.center.shape))
    cos, sin = rope_cos_sin(positions, store.inv_freq)
    return apply_rope(store.center, cos[..., None, :], sin[..., None, :])


def _centre_scores(store: Aided, q: jax.Array, first: jax.Array | int, size: int) -> jax.Array:
    """⟨q, R_(first+i) μ⟩ for the store slots i < size: q f32 [B, KV, N, hd] -> [B, KV, N, size].

    With RoPE, ⟨q, R_p μ⟩ = a·cos(pθ) + b·sin(pθ) summed over the frequencies, a and b per
    frequency from q and μ; the angle sum p = first + u + v (u a multiple of `inner`, v < inner)
    splits the [N, size, hd/2] table into [N, size/inner, hd/2] and [inner, hd/2] factors and a
    matmul, so no [size, KV, hd] array of rotated centres is built."""
    if store.inv_freq is None:
        dots = jnp.einsum("bknd,kd->bkn", q, store.center)
        return jnp.broadcast_to(dots[..., None], (*dots.shape, size))
    half = q.shape[-1] // 2
    mu1, mu2 = store.center[None, :, None, :half], store.center[None, :, None, half:]
    q1, q2 = q[..., :half], q[..., half:]
    a, b = q1 * mu1 + q2 * mu2, q2 * mu1 - q1 * mu2  # [B, KV, N, hd/2]
    c0, s0 = rope_cos_sin(jnp.asarray(first), store.inv_freq)  # [hd/2]
    a, b = a * c0 + b * s0, b * c0 - a * s0
    inner = math.gcd(size, CENTRE_INNER)
    cu, su = rope_cos_sin(jnp.arange(0, size, inner), store.inv_freq)  # [U, hd/2]
    cv, sv = rope_cos_sin(jnp.arange(inner), store.inv_freq)  # [V, hd/2]
    # (a, b) rotated by uθ as dots over a pair axis, not broadcast products: XLA would fuse
    # cos/sin into a product and evaluate them once per [B, KV, N, U, hd/2] element
    cs = jnp.stack([cu, su]).transpose(2, 0, 1)  # [hd/2, 2, U]
    au = jnp.einsum("bknic,icu->bknui", jnp.stack([a, b], -1), cs)  # [B, KV, N, U, hd/2]
    bu = jnp.einsum("bknic,icu->bknui", jnp.stack([b, -a], -1), cs)
    s = jnp.einsum("bknui,vi->bknuv", au, cv) + jnp.einsum("bknui,vi->bknuv", bu, sv)
    return s.reshape(*s.shape[:3], size)


def _turbo_rotated(store: TurboStore) -> jax.Array:
    """Stored vectors in the rotated space, f32 [B, KV, S, hd] (scale · centroids)."""
    codes = unpack_codes(store.quantizer, store.packed)
    return dequantize_rotated(store.quantizer, codes, store.scale.astype(jnp.float32))


# query rows per KV head (G·T) up to which a turbo store scores plane by plane (decode); more
# rows (prefill) score all planes in one dot
PLANE_ROWS = 16


def _turbo_planes(store: TurboStore) -> list[tuple[np.ndarray, jax.Array]]:
    """The stored vectors in the rotated space (`_turbo_rotated`), as planes: per segment and
    code position j of its whole-byte units (`packing.unpack_planes`), (the rotated channels
    it holds [n], their values scale·c f32 [B, KV, S, n]). Each plane reads its bytes in order,
    which XLA:CPU vectorises; the interleaved channels did not (issue 22, stop 39)."""
    out = []
    scale = store.scale.astype(jnp.float32)[..., None]
    for seg, packed in _segment_bytes(store.quantizer, store.packed):
        planes = unpack_planes(packed, seg.bits, seg.count)
        order = seg.first + planar_order(seg.count, seg.bits).reshape(len(planes), -1)
        out += [(ch, scale * lookup(seg.centroids, codes)) for ch, codes in zip(
            order, planes, strict=True)]
    return out


def _qjl_terms(store: TurboStore) -> jax.Array:
    """The QJL residual estimates (√(π/2)/d)·‖r‖·(2·signs − 1), f32 [B, KV, S, hd], in S-space
    (apply Sᵀ to get back to the original space)."""
    hd = store.quantizer.dim
    pm = 2.0 * unpack_bits(store.qjl_signs, 1, hd).astype(jnp.float32) - 1.0
    gain = (jnp.pi / 2) ** 0.5 / hd * store.qjl_norm.astype(jnp.float32)
    return gain[..., None] * pm


def write_sink(sink: jax.Array, x: jax.Array, start: jax.Array) -> jax.Array:
    """Copy the chunk x [B, KV, T, hd] (slots start..start+T-1) into the dense sink slots."""
    slot = jnp.arange(sink.shape[2])
    idx = slot[None, :] - start[:, None]  # [B, n_sink]: chunk index of each sink slot
    inside = (idx >= 0) & (idx < x.shape[2])
    picked = jnp.take_along_axis(x, jnp.clip(idx, 0, x.shape[2] - 1)[:, None, :, None], axis=2)
    return jnp.where(inside[:, None, :, None], picked.astype(sink.dtype), sink)


# ---------------------------------------------------------------- the aids (centring, key
# balancing, dense sink slots), shared by TurboStore and AidedStore: both carry the fields
# center, inv_freq, chan_scale and sink with the same meaning.


def _aid_input(store: Aided, x: jax.Array, start: jax.Array) -> jax.Array:
    """What the quantizer sees of x [B, KV, T, hd] at slots start..: f32, the centre at each
    position removed, divided by the channel scales."""
    x = x.astype(jnp.float32)
    if store.center is not None:
        positions = start[:, None] + jnp.arange(x.shape[2])[None, :]  # [B, T]
        x = x - _centre_at(store, positions).transpose(0, 2, 1, 3)
    if store.chan_scale is not None:
        x = x / store.chan_scale[None, :, None, :]
    return x


def _aid_sink(store: Aided, x: jax.Array, start: jax.Array) -> Aided:
    """The store with the chunk x [B, KV, T, hd]'s exact rows in its sink slots (if any)."""
    return store if store.sink is None else store.replace(sink=write_sink(store.sink, x, start))


def _aid_query(store: Aided, q: jax.Array) -> jax.Array:
    """q [B, KV, N, hd] -> f32 q∘s, the query that scores the balanced keys k/s."""
    qs = q.astype(jnp.float32)
    return qs if store.chan_scale is None else qs * store.chan_scale[None, :, None, :]


def _aid_scores(store: Aided, s: jax.Array, q: jax.Array, first: jax.Array | int) -> jax.Array:
    """The quantized part's scores s f32 [B, KV, N, S] (store slot i = cache slot first + i)
    plus the centre's exact ⟨q, R_slot μ⟩; sink slots score q·sink exactly. q [B, KV, N, hd]."""
    qs = q.astype(jnp.float32)
    slots = first + jnp.arange(s.shape[-1])  # [S] cache slot of each store slot
    if store.center is not None:
        s = s + _centre_scores(store, qs, first, s.shape[-1])
    if store.sink is not None:
        onehot = _sink_onehot(store, slots)
        exact = jnp.einsum("bknd,bkid->bkni", qs, store.sink.astype(jnp.float32))
        s = jnp.where(jnp.sum(onehot, -1) > 0, jnp.einsum("bkni,si->bkns", exact, onehot), s)
    return s


def _aid_split(store: Aided, p: jax.Array, first: jax.Array | int
               ) -> tuple[jax.Array, jax.Array | None]:
    """Softmax weights p f32 [B, KV, N, S] -> (p with the sink slots zeroed, the sink slots'
    exact Σ p·sink f32 [B, KV, N, hd], or None without sinks)."""
    if store.sink is None:
        return p, None
    onehot = _sink_onehot(store, first + jnp.arange(p.shape[-1]))
    exact = jnp.einsum("bkns,si,bkid->bknd", p, onehot, store.sink.astype(jnp.float32))
    return jnp.where(jnp.sum(onehot, -1) > 0, 0.0, p), exact


def _aid_output(store: Aided, out: jax.Array, p: jax.Array, first: jax.Array | int,
                exact: jax.Array | None) -> jax.Array:
    """The quantized part's Σ p·x̃ f32 [B, KV, N, hd] (p as `_aid_split` left it) -> times the
    channel scales, plus the centre Σ p·μ, plus the exact sink rows."""
    if store.chan_scale is not None:  # (keys only in practice) undo the basis scaling
        out = out * store.chan_scale[None, :, None, :]
    if store.center is not None:
        if store.inv_freq is None:  # a constant centre: (Σ p) μ
            out = out + jnp.sum(p, -1)[..., None] * store.center[None, :, None, :]
        else:
            slots = first + jnp.arange(p.shape[-1])  # [S]
            out = out + jnp.einsum("bkns,skd->bknd", p, _centre_at(store, slots))
    return out if exact is None else out + exact


def _aid_values(store: Aided, x: jax.Array) -> jax.Array:
    """Reconstructed quantizer-space vectors x f32 [B, KV, S, hd] -> the original space."""
    if store.chan_scale is not None:
        x = x * store.chan_scale[None, :, None, :]
    if store.center is not None:
        x = x + _centre_at(store, jnp.arange(x.shape[2])).transpose(1, 0, 2)[None]
    if store.sink is not None:
        x = x.at[:, :, : store.sink.shape[2]].set(store.sink.astype(jnp.float32))
    return x


@kvs.write.register
def _(store: TurboStore, x: jax.Array, start: jax.Array) -> TurboStore:
    raw = x
    x = _aid_input(store, x, start)  # f32 [B, KV, T, hd], centred and balanced
    if store.qjl is not None:
        codes, scale, signs, rnorm = quantize_prod(ProdQuantizer(store.quantizer, store.qjl), x)
        store = store.replace(
            qjl_signs=kvs.write_rows(store.qjl_signs, pack_bits(signs, 1), start),
            qjl_norm=kvs.write_rows(store.qjl_norm, rnorm.astype(SCALE_DTYPE), start))
    else:
        codes, scale = quantize(store.quantizer, x)
    store = _aid_sink(store, raw, start)
    return store.replace(
        packed=kvs.write_rows(store.packed, pack_codes(store.quantizer, codes), start),
        scale=kvs.write_rows(store.scale, scale.astype(SCALE_DTYPE), start))


@kvs.block.register
def _(store: TurboStore, lo: jax.Array, size: int) -> TurboStore:
    cut = lambda x: None if x is None else kvs.slot_block(x, lo, size)  # noqa: E731
    return store.replace(packed=cut(store.packed), scale=cut(store.scale),
                         qjl_signs=cut(store.qjl_signs), qjl_norm=cut(store.qjl_norm))


def _sink_onehot(store: Aided, slots: jax.Array) -> jax.Array:
    """f32 [S, n_sink]: 1 where the store's slot (cache slot `slots` [S]) is sink slot i."""
    return (slots[:, None] == jnp.arange(store.sink.shape[2])[None, :]).astype(jnp.float32)


@kvs.scores.register
def _(store: TurboStore, q: jax.Array, first: jax.Array | int = 0) -> jax.Array:
    """⟨Π(q∘s), scale·c⟩ (+ the QJL estimate ⟨S(q∘s), r̃⟩) + ⟨q, R_slot μ⟩ for centred keys;
    sink slots score q·sink exactly."""
    qb = _aid_query(store, q)
    qr = rotate(qb, store.quantizer.rotation)
    planes = _turbo_planes(store)
    if q.shape[2] <= PLANE_ROWS:  # decode: each plane's dot reads its codes in order
        s = sum(jnp.einsum("bknd,bksd->bkns", qr[..., ch], v) for ch, v in planes)
    else:  # prefill: one dot over the planes' channels, so one [N, S] score matrix is live
        # (a plane's each was: 8 for 3-bit codes, ~100 MiB per row of a 512-token chunk)
        ch = np.concatenate([c for c, _ in planes])
        s = jnp.einsum("bknd,bksd->bkns", qr[..., ch], jnp.concatenate([v for _, v in planes],
                                                                         -1))
    if store.qjl is not None:
        s = s + jnp.einsum("bknd,bksd->bkns", qb @ store.qjl.T, _qjl_terms(store))
    return _aid_scores(store, s, q, first)


@kvs.mix.register
def _(store: TurboStore, p: jax.Array, first: jax.Array | int = 0) -> jax.Array:
    """Σ p·scale·c accumulated in the rotated space and rotated back (+ QJL), the centre added
    back as Σ p·μ; sink slots mix their exact rows."""
    p, exact = _aid_split(store, p, first)
    planes = _turbo_planes(store)
    mixed = jnp.concatenate([jnp.einsum("bkns,bksd->bknd", p, v) for _, v in planes], -1)
    order = np.argsort(np.concatenate([ch for ch, _ in planes]))  # back to channel order
    out = unrotate(mixed[..., order], store.quantizer.rotation)
    if store.qjl is not None:
        out = out + jnp.einsum("bkns,bksd->bknd", p, _qjl_terms(store)) @ store.qjl
    return _aid_output(store, out, p, first, exact)


# ---------------------------------------------------------------- shared score/mix for
# stores that reconstruct values per slot (int8, int4)


def _register_reconstructing(cls: type, values: object) -> None:
    @kvs.scores.register(cls)
    def _(store: object, q: jax.Array, first: jax.Array | int = 0) -> jax.Array:
        return jnp.einsum("bknd,bksd->bkns", q.astype(jnp.float32), values(store))

    @kvs.mix.register(cls)
    def _(store: object, p: jax.Array, first: jax.Array | int = 0) -> jax.Array:
        return jnp.einsum("bkns,bksd->bknd", p, values(store))


_register_reconstructing(Int8Store, _int8_values)
_register_reconstructing(Int4Store, _int4_values)
_register_reconstructing(Q40Store, _q40_values)


# ---------------------------------------------------------------- wrappers: a Hadamard basis,
# and TurboStore's aids for any store


@struct.dataclass
class HadamardStore:
    """Any store holding Hx, H the normalised Walsh–Hadamard matrix (symmetric, H·H = I; hd a
    power of two), the rotation llama.cpp applies before quantizing its cache: it spreads an
    outlier channel over every channel of the vector. Scores use the rotated query,
    q·k = (Hq)·(Hk); values mix in the rotated space and the output is rotated back."""

    inner: object  # a store of rotated vectors


@kvs.write.register
def _(store: HadamardStore, x: jax.Array, start: jax.Array) -> HadamardStore:
    return HadamardStore(kvs.write(store.inner, hadamard_transform(x.astype(jnp.float32)), start))


@kvs.block.register
def _(store: HadamardStore, lo: jax.Array, size: int) -> HadamardStore:
    return HadamardStore(kvs.block(store.inner, lo, size))


@kvs.scores.register
def _(store: HadamardStore, q: jax.Array, first: jax.Array | int = 0) -> jax.Array:
    return kvs.scores(store.inner, hadamard_transform(q.astype(jnp.float32)), first)


@kvs.mix.register
def _(store: HadamardStore, p: jax.Array, first: jax.Array | int = 0) -> jax.Array:
    return hadamard_transform(kvs.mix(store.inner, p, first))  # [B, KV, N, hd]


@struct.dataclass
class AidedStore:
    """Any store with TurboStore's aids (the same fields, the same code): keys centred on the
    calibrated pre-RoPE mean rotated to each slot, key channels balanced (k/s stored, q∘s
    scored), values centred, the first slots kept dense. What the inner store quantizes is
    x − μ (keys: (k − R μ)/s); the exact parts are added back in `scores` and `mix`."""

    inner: object  # the quantizing store (q8, q4, ...)
    center: jax.Array | None = None  # [KV, hd] f32
    inv_freq: jax.Array | None = None  # [hd/2] f32 (keys)
    chan_scale: jax.Array | None = None  # [KV, hd] f32 (keys)
    sink: jax.Array | None = None  # [B, KV, n_sink, hd] f16


@kvs.write.register
def _(store: AidedStore, x: jax.Array, start: jax.Array) -> AidedStore:
    store = store.replace(inner=kvs.write(store.inner, _aid_input(store, x, start), start))
    return _aid_sink(store, x, start)


@kvs.block.register
def _(store: AidedStore, lo: jax.Array, size: int) -> AidedStore:
    return store.replace(inner=kvs.block(store.inner, lo, size))


@kvs.scores.register
def _(store: AidedStore, q: jax.Array, first: jax.Array | int = 0) -> jax.Array:
    return _aid_scores(store, kvs.scores(store.inner, _aid_query(store, q), first), q, first)


@kvs.mix.register
def _(store: AidedStore, p: jax.Array, first: jax.Array | int = 0) -> jax.Array:
    p, exact = _aid_split(store, p, first)
    return _aid_output(store, kvs.mix(store.inner, p, first), p, first, exact)


Aided = TurboStore | AidedStore  # the stores that carry the aids' fields


def _split_sink(store: Aided) -> tuple[jax.Array | None, Aided]:
    return (None, store) if store.sink is None else (store.sink, store.replace(sink=None))


kvs.split_sink.register(TurboStore, _split_sink)
kvs.split_sink.register(AidedStore, _split_sink)


def materialize(store: object) -> jax.Array:
    """Every slot's reconstructed vector, f32 [B, KV, S, hd] (tests and debugging; attention
    never calls this)."""
    if isinstance(store, kvs.DenseStore):
        return store.values().astype(jnp.float32)
    if isinstance(store, Int8Store):
        return _int8_values(store)
    if isinstance(store, Int4Store):
        return _int4_values(store)
    if isinstance(store, Q40Store):
        return _q40_values(store)
    if isinstance(store, HadamardStore):
        return hadamard_transform(materialize(store.inner))
    if isinstance(store, AidedStore):
        return _aid_values(store, materialize(store.inner))
    x = unrotate(_turbo_rotated(store), store.quantizer.rotation)
    if store.qjl is not None:
        x = x + _qjl_terms(store) @ store.qjl
    return _aid_values(store, x)
