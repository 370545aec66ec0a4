"""TurboQuant (arXiv 2504.19874) on vectors along the last axis: TurboQuant_mse, TurboQuant_prod,
and fractional rates by giving some rotated channels one more bit.

TurboQuant_mse of x ∈ R^d: rotate, y = Π·x/‖x‖·√d (each coordinate ~ N(0, 1)-like), code every
coordinate of y to the nearest centroid of the Lloyd–Max codebook for one coordinate of a random
unit vector in R^d, scaled by √d (`codebook.lloyd_max(bits, d).centroids · √d`), and keep one float
scale per vector. Reconstruction in the rotated space is scale·c (c the chosen centroids), in the
original space Πᵀ(scale·c). The codes stay unpacked (uint8, one per coordinate); see `packing`.

Scale: with `norm_correction` (the default) scale = ‖x‖/‖c‖, so ‖x̂‖ == ‖x‖ exactly. Without it
scale = ‖x‖/√d, the paper's plain TurboQuant_mse, whose error matches the codebook's predicted
`d·mse` (D_mse). Norm correction shrinks inner products by ≈ √(1 − D_mse) instead of 1 − D_mse
(0.80 instead of 2/π at 1 bit); it costs MSE at 1 bit (≈ 2 − 2√(1 − D_mse): 0.40 vs 0.36) and
2 bits (0.117 vs 0.115 at d = 64) and saves a little from 3 bits (0.0328 vs 0.0334 at d = 64).

Split (fractional-rate) quantizers: the first `hi_channels` coordinates of the *rotated* vector use
the (bits+1)-bit codebook, the rest the bits-bit one, with one shared scale. After the rotation all
coordinates are exchangeable, so which ones get the extra bit does not matter; taking the first
keeps it static. TurboQuantizer is the hi_channels = 0 case (SplitQuantizer is the same class).

TurboQuant_prod (unbiased inner products): a (bits−1)-bit plain TurboQuant_mse code, then 1-bit
QJL on the residual r = x − x̂_mse: signs of S·r (S a seeded Gaussian d×d) and ‖r‖; the estimate is
x̂_mse + (√(π/2)/d)·‖r‖·Sᵀ(2·signs − 1), unbiased over the draw of Π and S.
"""

import math
from typing import NamedTuple

import flax.struct
import jax
import jax.numpy as jnp
import numpy as np

from tqjax.errors import TqjaxError
from tqjax.quant.codebook import lloyd_max
from tqjax.quant.packing import lookup
from tqjax.quant.rotation import Rotation, make_rotation, rotate, unrotate


@flax.struct.dataclass
class TurboQuantizer:
    """TurboQuant_mse on [..., dim] vectors, `bits` per coordinate, the first `hi_channels` rotated
    coordinates with bits + 1. Codebooks are in the N(0, 1)-like scale (unit-vector one · √dim)."""

    rotation: Rotation
    centroids: jax.Array  # [2^bits] float32 ascending, for rotated channels hi_channels..dim-1
    boundaries: jax.Array  # [2^bits - 1] float32 midpoints
    hi_centroids: jax.Array | None  # [2^(bits+1)] float32 for channels 0..hi_channels-1, or None
    hi_boundaries: jax.Array | None  # [2^(bits+1) - 1] float32, or None
    bits: int = flax.struct.field(pytree_node=False)
    dim: int = flax.struct.field(pytree_node=False)
    hi_channels: int = flax.struct.field(pytree_node=False)
    norm_correction: bool = flax.struct.field(pytree_node=False)


SplitQuantizer = TurboQuantizer  # one implementation: a split quantizer has hi_channels > 0


@flax.struct.dataclass
class ProdQuantizer:
    """TurboQuant_prod, `bits` per coordinate: a (bits − 1)-bit plain TurboQuantizer plus QJL."""

    mse: TurboQuantizer  # bits - 1 bits, norm_correction=False (smallest residual)
    qjl: jax.Array  # [dim, dim] float32 S, i.i.d. N(0, 1)

    @property
    def bits(self) -> int:
        return self.mse.bits + 1

    @property
    def dim(self) -> int:
        return self.mse.dim


def _codebook(bits: int, dim: int) -> tuple[jax.Array, jax.Array]:
    book = lloyd_max(bits, dim)
    root = math.sqrt(dim)
    return (
        jnp.asarray(book.centroids * root, dtype=jnp.float32),
        jnp.asarray(book.boundaries * root, dtype=jnp.float32),
    )


def make_split_quantizer(
    dim: int, bits: int, hi_channels: int, seed: int = 0, norm_correction: bool = True
) -> TurboQuantizer:
    """A quantizer for [..., dim] vectors at bits + hi_channels/dim bits per coordinate (plus the
    scale). dim: 2..65536; bits: 1..8 (1..7 when hi_channels > 0); 0 <= hi_channels < dim. The
    rotation is `make_rotation(dim, seed)`; the codebooks are `lloyd_max(·, dim)` scaled by √dim."""
    if not isinstance(bits, int) or not 1 <= bits <= (7 if hi_channels else 8):
        raise TqjaxError(f"quantizer bits must be in 1..8 (1..7 with hi channels), got {bits!r}")
    rotation = make_rotation(dim, seed)
    if not isinstance(hi_channels, int) or not 0 <= hi_channels < dim:
        raise TqjaxError(f"hi_channels must be an integer in 0..{dim - 1}, got {hi_channels!r}")
    centroids, boundaries = _codebook(bits, dim)
    hi_centroids, hi_boundaries = _codebook(bits + 1, dim) if hi_channels else (None, None)
    return TurboQuantizer(
        rotation=rotation,
        centroids=centroids,
        boundaries=boundaries,
        hi_centroids=hi_centroids,
        hi_boundaries=hi_boundaries,
        bits=bits,
        dim=dim,
        hi_channels=hi_channels,
        norm_correction=norm_correction,
    )


def make_quantizer(
    dim: int, bits: int, seed: int = 0, norm_correction: bool = True
) -> TurboQuantizer:
    """TurboQuant_mse for [..., dim] vectors, `bits` (1..8) per coordinate; see the module doc."""
    return make_split_quantizer(dim, bits, 0, seed, norm_correction)


def make_prod_quantizer(dim: int, bits: int, seed: int = 0) -> ProdQuantizer:
    """TurboQuant_prod for [..., dim] vectors at `bits` (2..9) per coordinate: the MSE part is
    `make_quantizer(dim, bits − 1, seed, norm_correction=False)`, S is drawn from
    `np.random.default_rng([seed, 1])`."""
    if not isinstance(bits, int) or not 2 <= bits <= 9:
        raise TqjaxError(f"TurboQuant_prod bits must be an integer in 2..9, got {bits!r}")
    mse = make_quantizer(dim, bits - 1, seed, norm_correction=False)
    qjl = np.random.default_rng([seed, 1]).standard_normal((dim, dim))
    return ProdQuantizer(mse=mse, qjl=jnp.asarray(qjl, dtype=jnp.float32))


class Segment(NamedTuple):
    """Rotated channels first .. first + count - 1 sharing one codebook of 2^bits centroids."""

    first: int
    count: int
    bits: int
    centroids: jax.Array  # [2^bits] f32 ascending
    boundaries: jax.Array  # [2^bits - 1] f32 decision thresholds

    @property
    def channels(self) -> slice:
        return slice(self.first, self.first + self.count)


def segments(q: TurboQuantizer) -> list[Segment]:
    """The channel groups of a (split) quantizer, in channel and packing order: the first
    `hi_channels` rotated channels at bits + 1, the rest at bits (one group when
    hi_channels = 0). The one description of the layout that packing, the cache stores and
    the Pallas kernel read."""
    rest = Segment(q.hi_channels, q.dim - q.hi_channels, q.bits, q.centroids, q.boundaries)
    if q.hi_channels:
        return [Segment(0, q.hi_channels, q.bits + 1, q.hi_centroids, q.hi_boundaries), rest]
    return [rest]


def _centroids(q: TurboQuantizer, codes: jax.Array) -> jax.Array:
    """Codes uint8 [..., dim] → the chosen centroids float32 [..., dim] (N(0, 1)-like scale)."""
    if codes.shape[-1:] != (q.dim,):
        raise TqjaxError(f"codes of shape {codes.shape} do not match a quantizer of dim {q.dim}")
    parts = [lookup(seg.centroids, codes[..., seg.channels]) for seg in segments(q)]
    return jnp.concatenate(parts, axis=-1)


@jax.jit
def quantize(q: TurboQuantizer, x: jax.Array) -> tuple[jax.Array, jax.Array]:
    """Quantize x [..., dim] (any float dtype) → (codes uint8 [..., dim], scale float32 [...]).

    Codes index the rotated coordinates' codebooks (unpacked); x = 0 gives scale 0 (no NaN).
    """
    if x.shape[-1:] != (q.dim,) or not jnp.issubdtype(x.dtype, jnp.floating):
        raise TqjaxError(f"quantizer needs float [..., {q.dim}], got {x.dtype} {x.shape}")
    x = x.astype(jnp.float32)
    norm = jnp.linalg.norm(x, axis=-1)
    inv = jnp.where(norm > 0, math.sqrt(q.dim) / jnp.where(norm > 0, norm, 1.0), 0.0)
    y = rotate(x, q.rotation) * inv[..., None]
    codes = jnp.concatenate(
        [
            jnp.sum(y[..., seg.channels, None] > seg.boundaries, axis=-1, dtype=jnp.uint8)
            for seg in segments(q)
        ],
        axis=-1,
    )
    if q.norm_correction:
        return codes, norm / jnp.linalg.norm(_centroids(q, codes), axis=-1)
    return codes, norm / math.sqrt(q.dim)


@jax.jit
def dequantize_rotated(q: TurboQuantizer, codes: jax.Array, scale: jax.Array) -> jax.Array:
    """Reconstruction in the rotated space, scale·c: codes uint8 [..., dim], scale [...] →
    float32 [..., dim]. Score a rotated query (rotate(q_vec, q.rotation)) against this directly."""
    return scale[..., None].astype(jnp.float32) * _centroids(q, codes)


@jax.jit
def dequantize(q: TurboQuantizer, codes: jax.Array, scale: jax.Array) -> jax.Array:
    """Reconstruction in the original space, Πᵀ(scale·c): float32 [..., dim]."""
    return unrotate(dequantize_rotated(q, codes, scale), q.rotation)


@jax.jit
def quantize_prod(
    pq: ProdQuantizer, x: jax.Array
) -> tuple[jax.Array, jax.Array, jax.Array, jax.Array]:
    """TurboQuant_prod of x [..., dim] → (codes uint8 [..., dim], scale float32 [...],
    qjl_signs uint8 [..., dim] in {0, 1} (1 where S·r >= 0), residual_norm float32 [...])."""
    codes, scale = quantize(pq.mse, x)
    residual = x.astype(jnp.float32) - dequantize(pq.mse, codes, scale)
    projected = jnp.matmul(residual, pq.qjl.T, precision=jax.lax.Precision.HIGHEST)
    return codes, scale, (projected >= 0).astype(jnp.uint8), jnp.linalg.norm(residual, axis=-1)


@jax.jit
def dequantize_prod(
    pq: ProdQuantizer, codes: jax.Array, scale: jax.Array, signs: jax.Array, rnorm: jax.Array
) -> jax.Array:
    """x̂ = x̂_mse + (√(π/2)/dim)·‖r‖·Sᵀ(2·signs − 1): float32 [..., dim]."""
    pm = 2.0 * signs.astype(jnp.float32) - 1.0
    qjl = jnp.matmul(pm, pq.qjl, precision=jax.lax.Precision.HIGHEST)
    gain = math.sqrt(math.pi / 2) / pq.dim * rnorm.astype(jnp.float32)
    return dequantize(pq.mse, codes, scale) + gain[..., None] * qjl


@jax.jit
def reconstruct(q: TurboQuantizer | ProdQuantizer, x: jax.Array) -> jax.Array:
    """Quantize then dequantize x [..., dim] (original space) → float32 [..., dim]."""
    if isinstance(q, ProdQuantizer):
        return dequantize_prod(q, *quantize_prod(q, x))
    return dequantize(q, *quantize(q, x))


def bits_per_value(
    bits: int, dim: int, hi_channels: int = 0, scale_bits: int = 16, prod: bool = False
) -> float:
    """Stored bits per coordinate, scales included: (bits·dim + hi_channels + scale_bits·n)/dim,
    with n = 1 scale per vector (two for TurboQuant_prod: scale and ‖r‖; its `bits` counts the QJL
    bit). E.g. 3 bits, dim 64, fp16 scale → 3.25; 2 bits, dim 128, 64 hi channels → 2.625."""
    return (bits * dim + hi_channels + scale_bits * (2 if prod else 1)) / dim


@jax.jit
def _errors(
    q: TurboQuantizer | ProdQuantizer, x: jax.Array, queries: jax.Array
) -> dict[str, jax.Array]:
    x = x.astype(jnp.float32)
    x_hat = reconstruct(q, x)
    sq_norm = jnp.sum(x * x, axis=-1)
    safe = jnp.where(sq_norm > 0, sq_norm, 1.0)
    true_ip = jnp.sum(queries * x, axis=-1)
    est_ip = jnp.sum(queries * x_hat, axis=-1)
    ip_err = (est_ip - true_ip) / jnp.sqrt(safe * jnp.sum(queries * queries, axis=-1))
    return {
        "mse": jnp.mean(jnp.sum((x - x_hat) ** 2, axis=-1) / safe),
        "norm_ratio": jnp.mean(jnp.sqrt(jnp.sum(x_hat * x_hat, axis=-1) / safe)),
        "ip_bias": jnp.mean(ip_err),
        "ip_rmse": jnp.sqrt(jnp.mean(ip_err**2)),
        "ip_slope": jnp.sum(est_ip * true_ip) / jnp.sum(true_ip * true_ip),
    }


def distortion(
    q: TurboQuantizer | ProdQuantizer,
    x: jax.Array,
    queries: jax.Array | None = None,
    seed: int = 0,
) -> dict[str, float]:
    """Empirical distortion of q on vectors x [n, dim] (nonzero), against queries [n, dim] (default:
    independent uniformly random unit vectors drawn with `seed`). Returns floats:
    mse = mean ‖x − x̂‖²/‖x‖² (D_mse for unit x); norm_ratio = mean ‖x̂‖/‖x‖;
    ip_bias, ip_rmse = mean and RMS of (⟨y, x̂⟩ − ⟨y, x⟩)/(‖y‖‖x‖); ip_slope = least-squares slope
    of ⟨y, x̂⟩ on ⟨y, x⟩ (1 when unbiased, ≈ 2/π for the plain 1-bit MSE quantizer)."""
    if x.ndim != 2 or x.shape[-1] != q.dim:
        raise TqjaxError(f"distortion needs vectors [n, {q.dim}], got shape {x.shape}")
    if queries is None:
        queries = np.random.default_rng(seed).standard_normal(x.shape)
        queries /= np.linalg.norm(queries, axis=-1, keepdims=True)
    if queries.shape != x.shape:
        raise TqjaxError(f"queries of shape {queries.shape} do not match vectors {x.shape}")
    errors = _errors(q, jnp.asarray(x), jnp.asarray(queries, dtype=jnp.float32))
    return {name: float(value) for name, value in errors.items()}
