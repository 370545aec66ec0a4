"""Seeded random rotations Π of R^d, applied along the last axis.

Π = T·D: D = diag(signs), random ±1 signs from `np.random.default_rng(seed)`, then T = H/√d, the
normalised Walsh–Hadamard matrix, when d is a power of two (applied by a fast transform, O(d log d),
no d×d matrix). Other d fall back to T = a dense Haar-random orthogonal matrix (QR of a seeded
Gaussian with the signs of R's diagonal folded into Q), drawn from the same generator after the
signs. Either way Π is exactly orthogonal: unrotate(rotate(x)) == x up to float rounding.
"""

import math

import flax.struct
import jax
import jax.numpy as jnp
import numpy as np

from tqjax.errors import TqjaxError

MAX_DIM = 65536


@flax.struct.dataclass
class Rotation:
    """A rotation Π = T·diag(signs) of R^dim; T = H/√dim when `matrix` is None."""

    signs: jax.Array  # [d] float32 ±1
    matrix: jax.Array | None  # [d, d] float32 orthogonal T, only for non-power-of-two d

    @property
    def dim(self) -> int:
        return self.signs.shape[-1]


def make_rotation(dim: int, seed: int) -> Rotation:
    """The rotation of R^dim for `seed` (deterministic). dim: 2..65536; a power of two gets the
    randomized Hadamard transform, anything else a dense random orthogonal matrix."""
    if not isinstance(dim, int) or not 2 <= dim <= MAX_DIM:
        raise TqjaxError(f"rotation dimension must be an integer in 2..{MAX_DIM}, got {dim!r}")
    rng = np.random.default_rng(seed)
    signs = rng.integers(0, 2, size=dim) * 2.0 - 1.0
    matrix = None
    if dim & (dim - 1):
        q, r = np.linalg.qr(rng.standard_normal((dim, dim)))
        matrix = jnp.asarray(q * np.sign(np.diag(r)), dtype=jnp.float32)
    return Rotation(signs=jnp.asarray(signs, dtype=jnp.float32), matrix=matrix)


# f32 transforms of up to this many channels are one matmul by H/√d: one XLA operation,
# where the butterfly's log2(d) stages compile as as many fusions (a SmolLM2 turbo4 decode
# step had 36 per layer); wider ones, and other dtypes, take the butterfly
MATMUL_MAX_DIM = 256


def hadamard_matrix(d: int) -> np.ndarray:
    """H/√d, the normalised Sylvester–Hadamard matrix of size d (a power of two), f32 [d, d]."""
    h = np.ones((1, 1))
    while h.shape[0] < d:
        h = np.block([[h, h], [h, -h]])
    return (h / math.sqrt(d)).astype(np.float32)


@jax.jit
def hadamard_transform(x: jax.Array) -> jax.Array:
    """Normalised fast Walsh–Hadamard transform H·x/√d along the last axis.

    x: [..., d] float, d a power of two. Returns the same shape and dtype. H is symmetric and
    (H/√d)² = I, so this is its own inverse. f32 with d <= `MATMUL_MAX_DIM`: a matmul by
    `hadamard_matrix(d)`; otherwise log2(d) butterfly stages, each a reshape to
    [..., blocks, 2, half] and a sum/difference of the two halves.
    """
    d = x.shape[-1]
    if d < 1 or d & (d - 1):
        raise TqjaxError(f"the Walsh–Hadamard transform needs a power-of-two last axis, got {d}")
    if x.dtype == jnp.float32 and d <= MATMUL_MAX_DIM:
        return jnp.matmul(x, jnp.asarray(hadamard_matrix(d)), precision=jax.lax.Precision.HIGHEST)
    lead = x.shape[:-1]
    half = 1
    while half < d:
        pairs = x.reshape(*lead, d // (2 * half), 2, half)
        a, b = pairs[..., 0, :], pairs[..., 1, :]
        x = jnp.stack([a + b, a - b], axis=-2).reshape(*lead, d)
        half *= 2
    return x * jnp.asarray(1.0 / math.sqrt(d), dtype=x.dtype)


def _check(x: jax.Array, rot: Rotation) -> None:
    if x.shape[-1:] != (rot.dim,):
        raise TqjaxError(f"rotation of dimension {rot.dim} applied to an array of shape {x.shape}")


@jax.jit
def rotate(x: jax.Array, rot: Rotation) -> jax.Array:
    """Π·x along the last axis. x: [..., d] any float dtype → [..., d] same dtype."""
    _check(x, rot)
    x = x * rot.signs.astype(x.dtype)
    if rot.matrix is None:
        return hadamard_transform(x)
    return jnp.matmul(x, rot.matrix.astype(x.dtype).T, precision=jax.lax.Precision.HIGHEST)


def rotate_blocks_flat(x: jax.Array, rot: Rotation) -> jax.Array:
    """Π·x on each block of rot.dim along x's last axis [..., K] (K a multiple of rot.dim), the
    same values as `rotate` per block, computed so that XLA stores the result flat.

    One matrix-vector product: the elementwise expansion x[b, i]·T[o, i] [blocks·dim, dim] times
    the signs [dim], whose output is a flat [blocks·dim] array. `rotate` on [blocks, dim] returns
    a [blocks, dim] array, and XLA:CPU's fused vector-matrix dots (the decode path of quantized
    weights, `tqjax.quant.weights`) read a vector through that reshape element by element: a
    SmolLM2-shaped tq4 projection (576 -> 1536) took 0.51 ms a call against 0.19 ms with this
    form (issue 22, stop 39). Costs rot.dim multiply-adds per element (use for dim <= 256).
    """
    d = rot.dim
    if x.shape[-1] % d:
        raise TqjaxError(f"blocks of {d} do not divide the last axis of {x.shape}")
    t = jnp.asarray(hadamard_matrix(d)) if rot.matrix is None else rot.matrix  # T [o, i]
    expanded = (x.reshape(-1, 1, d) * t.astype(x.dtype)).reshape(-1, d)  # [blocks·d (o), d (i)]
    y = jnp.dot(expanded, rot.signs.astype(x.dtype), precision=jax.lax.Precision.HIGHEST)
    return y.reshape(x.shape)


@jax.jit
def unrotate(y: jax.Array, rot: Rotation) -> jax.Array:
    """Πᵀ·y along the last axis (the inverse of `rotate`). y: [..., d] float → same shape, dtype."""
    _check(y, rot)
    if rot.matrix is None:
        y = hadamard_transform(y)
    else:
        y = jnp.matmul(y, rot.matrix.astype(y.dtype), precision=jax.lax.Precision.HIGHEST)
    return y * rot.signs.astype(y.dtype)
