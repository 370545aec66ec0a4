"""Lloyd–Max scalar quantizers for one coordinate of a random unit vector, computed numerically.

After a random rotation, each coordinate t of a unit vector in R^dim has the density
∝ (1 − t²)^((dim−3)/2) on [−1, 1]; as dim → ∞, t·√dim tends to N(0, 1). A Lloyd–Max codebook is the
1-D k-means of that density: centroids are the conditional means of their cells, boundaries the
midpoints between neighbouring centroids.

Scale convention: `lloyd_max(bits, dim)` returns centroids, boundaries and mse in the scale of
the unit-vector coordinate t (so `dim * mse` is the expected ‖u − Q(u)‖² of a unit vector u, the
paper's D_mse); `lloyd_max(bits, None)` is the N(0, 1) codebook. The quantizer (`turboquant.py`)
multiplies a finite-dim codebook by √dim to work in the N(0, 1)-like scale.

Everything here is numpy float64 and runs once per (bits, dim): results are cached.
"""

import functools
import math
from dataclasses import dataclass

import numpy as np

from tqjax.errors import TqjaxError

_GRID_POINTS = 1 << 17  # nodes of the integration grid
_HALF_WIDTH = 14.0  # grid half-width in the N(0, 1)-like scale; the mass beyond is < 1e-40
_TOL = 1e-10  # converged when every centroid is this close to its cell's mean (t-scale)
_MAX_ITER = 100


@dataclass(frozen=True)
class Codebook:
    """A scalar quantizer: `centroids` float64 [2^bits] ascending, `boundaries` float64 [2^bits − 1]
    (midpoints; a value in (boundaries[i−1], boundaries[i]] maps to centroids[i]), and `mse`, the
    expected squared error per coordinate under the density, in the same scale as the centroids."""

    centroids: np.ndarray
    boundaries: np.ndarray
    mse: float


def _check_dim(dim: int | None) -> None:
    if dim is not None and (not isinstance(dim, int) or dim < 2):
        raise TqjaxError(f"codebook dimension must be an integer >= 2 or None, got {dim!r}")


def coordinate_density(t: np.ndarray, dim: int | None) -> np.ndarray:
    """Density of one coordinate of a uniformly random unit vector in R^dim, evaluated at t.

    t: float array, any shape. dim=None gives the N(0, 1) density (the limit of t·√dim).
    Returns float64 of t's shape; 0 outside [−1, 1] for finite dim (and +inf at ±1 when dim == 2).
    """
    _check_dim(dim)
    t = np.asarray(t, dtype=np.float64)
    if dim is None:
        return np.exp(-0.5 * t * t) / math.sqrt(2.0 * math.pi)
    log_norm = math.lgamma(dim / 2) - math.lgamma((dim - 1) / 2) - 0.5 * math.log(math.pi)
    with np.errstate(divide="ignore"):
        dens = math.exp(log_norm) * np.clip(1.0 - t * t, 0.0, None) ** (0.5 * (dim - 3))
    return np.where(np.abs(t) <= 1.0, dens, 0.0)


def _tail(values: np.ndarray, nodes: np.ndarray) -> np.ndarray:
    """Trapezoid integral of `values` from each node to the last one (exact-ish for small tails)."""
    steps = 0.5 * (values[1:] + values[:-1]) * np.diff(nodes)
    return np.concatenate([np.cumsum(steps[::-1])[::-1], [0.0]])


@functools.lru_cache(maxsize=8)
def _grid(dim: int | None) -> tuple[np.ndarray, ...]:
    """Integration grid on the positive half s >= 0 of the N(0, 1)-like scale s = t·√dim (the
    density is even): nodes s, the density p(s) there, and the tail integrals ∫_s^end of p, s·p,
    s²·p and p^(1/3), each normalised to 1 at s = 0 (tails keep the small outer cells precise). For
    finite dim the nodes are uniform in θ, s = √dim·sin θ, where the density is ∝ cos^(dim−2) θ:
    smooth even for dim = 2, whose density in t is infinite at ±1. The grid ends where the density
    is negligible or at s = √dim."""
    if dim is None:
        s = node = np.linspace(0.0, _HALF_WIDTH, _GRID_POINTS)
        dens_dnode = np.exp(-0.5 * s * s)  # unnormalised density per unit node
        ds_dnode = np.ones_like(s)
    else:
        root = math.sqrt(dim)
        node = np.linspace(0.0, math.asin(min(1.0, _HALF_WIDTH / root)), _GRID_POINTS)  # θ
        s = root * np.sin(node)
        dens_dnode = np.cos(node) ** (dim - 2)
        ds_dnode = root * np.cos(node)
    total = _tail(dens_dnode, node)[0]
    with np.errstate(divide="ignore", invalid="ignore"):
        density = np.where(ds_dnode > 0, dens_dnode / ds_dnode, 0.0) / total
    compand = _tail(np.cbrt(dens_dnode) * np.cbrt(ds_dnode) ** 2, node)
    return (
        s,
        density,
        _tail(dens_dnode, node) / total,
        _tail(s * dens_dnode, node) / total,
        _tail(s * s * dens_dnode, node) / total,
        compand / compand[0],
    )


def _cells(centroids: np.ndarray, s: np.ndarray, tail: np.ndarray) -> np.ndarray:
    """Integral of a tail table over each positive centroid's cell: 0 to the first midpoint, ...,
    the last midpoint to the grid end."""
    edges = np.concatenate([[0.0], 0.5 * (centroids[1:] + centroids[:-1]), [s[-1]]])
    return -np.diff(np.interp(edges, s, tail))


def _lloyd_map(
    centroids: np.ndarray, s: np.ndarray, density: np.ndarray, mass: np.ndarray, first: np.ndarray
) -> tuple[np.ndarray, np.ndarray]:
    """The Lloyd map T (each positive centroid → its cell's conditional mean) at `centroids`, and
    a Newton step on c = T(c) (or T(c) itself where Newton would break the ordering)."""
    cell_mass = _cells(centroids, s, mass)
    lloyd = _cells(centroids, s, first) / cell_mass
    mids = 0.5 * (centroids[1:] + centroids[:-1])
    p_mid = np.interp(mids, s, density)
    # ∂T_i/∂(lower edge) = p(a)(T_i − a)/m_i, ∂T_i/∂(upper edge) = p(b)(b − T_i)/m_i; edge = mean.
    d_upper = 0.5 * p_mid * (mids - lloyd[:-1]) / cell_mass[:-1]  # ∂T_i/∂c_{i+1}
    d_lower = 0.5 * p_mid * (lloyd[1:] - mids) / cell_mass[1:]  # ∂T_{i+1}/∂c_i
    jac = np.diag(np.concatenate([d_upper, [0.0]]) + np.concatenate([[0.0], d_lower]))
    jac += np.diag(d_upper, 1) + np.diag(d_lower, -1)
    newton = centroids - np.linalg.solve(np.eye(len(centroids)) - jac, centroids - lloyd)
    ordered = newton[0] > 0 and np.all(np.diff(newton) > 0)
    return lloyd, newton if ordered else lloyd


def lloyd_max(bits: int, dim: int | None = None) -> Codebook:
    """The Lloyd–Max codebook with 2^bits levels for `coordinate_density(·, dim)`.

    bits: 1..8. dim: the vector dimension (>= 2), or None for the N(0, 1) limit.
    Returns a Codebook in the t-scale of the density (unit-vector coordinates; N(0, 1) when None).
    Solves the Lloyd fixed point (centroid = conditional mean of its cell, boundaries = midpoints)
    with integrals over a fine grid, from the high-resolution (companded p^(1/3)) initial guess, by
    Newton steps on the Lloyd map, until every centroid is within 1e-10 (t-scale) of its cell mean.
    The density is even, so the codebook is symmetric: only the positive half is solved for.
    """
    if not isinstance(bits, int) or not 1 <= bits <= 8:
        raise TqjaxError(f"codebook bits must be an integer in 1..8, got {bits!r}")
    _check_dim(dim)
    return _lloyd_max(bits, dim)


@functools.lru_cache(maxsize=64)
def _lloyd_max(bits: int, dim: int | None) -> Codebook:
    s, density, mass, first, second, compand = _grid(dim)
    half = 1 << (bits - 1)
    to_t = 1.0 if dim is None else 1.0 / math.sqrt(dim)
    centroids = np.interp(1.0 - (np.arange(half) + 0.5) / half, compand[::-1], s[::-1])
    for _ in range(_MAX_ITER):
        lloyd, step = _lloyd_map(centroids, s, density, mass, first)
        if np.max(np.abs(lloyd - centroids)) * to_t < _TOL:
            break
        centroids = step
    else:
        raise TqjaxError(f"Lloyd–Max iteration did not converge for bits={bits}, dim={dim}")
    cells = [_cells(centroids, s, table) for table in (mass, first, second)]
    mse = float(np.sum(cells[2] - 2.0 * centroids * cells[1] + centroids**2 * cells[0]))
    centroids = np.concatenate([-centroids[::-1], centroids]) * to_t
    return Codebook(
        centroids=centroids,
        boundaries=0.5 * (centroids[1:] + centroids[:-1]),
        mse=mse * to_t * to_t,
    )
