"""Mixed precision: per-tensor TurboQuant formats (bits and group size) meeting an average
bits-per-weight budget.

Every tensor l may take any "tq" format f of `CANDIDATE_BITS` × groups. Stored in f it costs
c_l(f) bits (codes and scales, `WeightFormat.tensor_bits`) and adds a predicted loss L_l(f),
measured by rounding the tensor to nearest in f (`format_loss`; at 4 bits for each group size,
scaled to the other widths by the Lloyd–Max distortion, `format_losses`):

- data-free: the relative squared error ‖w − ŵ‖²/‖w‖², so every tensor's relative error counts
  the same;
- with calibration text: ½ Σ_{b,n} F_b,n · mse_b,n(f), the diagonal Fisher information of the
  next-token distribution summed over each block of `FISHER_ROWS` input rows times the block's
  mean squared rounding error: the second-order KL increase of that error.

After the per-group rotation a group is close to Gaussian, so a larger group costs little
accuracy (2% more error at 128 rows than at 64 for Gaussian weights) and saves scale bits
(0.25 bits/weight at group 64, 0.125 at 128): usually a better buy than code bits. Measuring
the error shows where a tensor's weights make that trade worse; the cost side counts the
padding a group size may force.

`allocate` minimises Σ L_l(f_l) subject to Σ c_l(f_l) <= bpw · Σ params (shared codebooks and
rotations included): on each tensor's lower convex hull of (cost, loss) points it takes
upgrades in order of loss reduction per stored bit (the Lagrangian solution, exact up to the
last upgrade that fits). Every tensor gets at least 3 bits when the budget allows it: 2-bit
codes are far outside the second-order regime the Fisher weights describe.
"""

from __future__ import annotations

import functools

import jax
import jax.numpy as jnp

from tqjax.errors import TqjaxError
from tqjax.quant.accounting import shared_bits
from tqjax.quant.codebook import lloyd_max
from tqjax.quant.weights import WeightFormat, effective_weight, quantize_linear

CANDIDATE_BITS = (2, 3, 4, 5, 6, 8)
GROUPS = (64, 128)  # "tq" group sizes to choose from when none is fixed
PREFERRED_MIN_BITS = 3  # below it the error is outside the second-order (Fisher) regime
MEASURED_BITS = 4  # the width each tensor's error is measured at (`format_losses`)
FISHER_ROWS = 64  # input rows per block the Fisher weights are summed over, whatever the group


def candidate_formats(groups: tuple[int, ...] = GROUPS) -> list[WeightFormat]:
    """The "tq" formats the allocator chooses from, fewest bits first."""
    return [WeightFormat("tq", b, g) for b in CANDIDATE_BITS for g in groups]


def group_sums(x: jax.Array, group: int) -> jax.Array:
    """x [K, N] summed over groups of `group` input rows (zero-padded) -> [ceil(K/group), N]."""
    k, n = x.shape
    return jnp.sum(jnp.pad(x, [(0, -k % group), (0, 0)]).reshape(-1, group, n), axis=1)


@functools.partial(jax.jit, static_argnames=("fmt", "seed"))
def _squared_error(w: jax.Array, fmt: WeightFormat, seed: int) -> jax.Array:
    """(ŵ − w)² f32 [K, N] of rounding w [K, N] to nearest in `fmt`, in the original basis."""
    return (effective_weight(quantize_linear(w, fmt, seed)) - w) ** 2


def format_loss(w: jax.Array, fmt: WeightFormat, fisher: jax.Array | None = None,
                seed: int = 0) -> float:
    """Predicted loss of rounding w f32 [K, N] to nearest in `fmt` (see the module doc).

    fisher: the diagonal Fisher summed over blocks of `FISHER_ROWS` input rows (the last one
    zero-padded), f32 [ceil(K/FISHER_ROWS), N], for the KL estimate; None for the relative
    squared error.
    """
    w = jnp.asarray(w, jnp.float32)
    err = _squared_error(w, fmt, seed)
    if fisher is None:
        return float(jnp.sum(err) / jnp.maximum(jnp.sum(w * w), 1e-30))
    rows = group_sums(jnp.ones((w.shape[0], 1), jnp.float32), FISHER_ROWS)  # real rows per block
    return float(0.5 * jnp.sum(fisher * group_sums(err, FISHER_ROWS) / rows))


def distortion(fmt: WeightFormat) -> float:
    """Lloyd–Max ‖w − ŵ‖²/‖w‖² of a Gaussian-like group under a "tq" format."""
    return lloyd_max(fmt.bits, fmt.group).mse * fmt.group


def format_losses(w: jax.Array, groups: tuple[int, ...] = GROUPS,
                  fisher: jax.Array | None = None, seed: int = 0) -> dict[WeightFormat, float]:
    """`format_loss` of w [K, N] (fisher: None or f32 [ceil(K/FISHER_ROWS), N]) for every
    `candidate_formats(groups)`: measured at `MEASURED_BITS` for each group size and scaled to
    the other widths by the ratio of their Lloyd–Max distortions (how the error of a rotated
    group falls with bits)."""
    out = {}
    for g in groups:
        measured = WeightFormat("tq", MEASURED_BITS, g)
        loss = format_loss(w, measured, fisher, seed) / distortion(measured)
        out |= {f: loss * distortion(f) for f in candidate_formats((g,))}
    return out


Fixed = dict[str, tuple[tuple[int, int], WeightFormat]]


def _tally(shapes: dict[str, tuple[int, int]], formats: list[WeightFormat], fixed: Fixed
           ) -> tuple[int, int, list[WeightFormat], dict[str, dict[WeightFormat, int]]]:
    """(parameters, bits of the fixed tensors, their formats, {path: {format: bits}})."""
    n_params = sum(k * n for k, n in shapes.values()) + sum(k * n for (k, n), _ in fixed.values())
    fixed_bits = sum(f.tensor_bits(k, n) for (k, n), f in fixed.values())
    cost = {p: {f: f.tensor_bits(k, n) for f in formats} for p, (k, n) in shapes.items()}
    return n_params, fixed_bits, [f for _, f in fixed.values()], cost


def _cheapest(cost: dict[str, dict[WeightFormat, int]]) -> dict[str, WeightFormat]:
    return {p: min(c, key=lambda f: (c[f], f.bits)) for p, c in cost.items()}


def check_budget(shapes: dict[str, tuple[int, int]], formats: list[WeightFormat], bpw: float,
                 fixed: Fixed | None = None) -> None:
    """Raise TqjaxError unless some choice of `formats` for shapes {path: (in, out)} (plus the
    `fixed` tensors) meets `bpw`, or when even the most expensive choice stays below it."""
    n_params, fixed_bits, kept, cost = _tally(shapes, formats, fixed or {})
    least = (sum(min(c.values()) for c in cost.values()) + fixed_bits
             + shared_bits([*_cheapest(cost).values(), *kept]))
    most = sum(max(c.values()) for c in cost.values()) + fixed_bits + shared_bits(formats + kept)
    if bpw * n_params < least:
        raise TqjaxError(f"bpw {bpw} is below the smallest mixed format "
                         f"({least / n_params:.3f} bits/weight)")
    if bpw * n_params > most:
        raise TqjaxError(f"bpw {bpw} is above the largest mixed format "
                         f"({most / n_params:.3f} bits/weight)")


def allocate(shapes: dict[str, tuple[int, int]], losses: dict[str, dict[WeightFormat, float]],
             bpw: float, fixed: Fixed | None = None) -> dict[str, WeightFormat]:
    """Per-tensor formats for shapes {path: (in, out)} meeting `bpw`, minimising the summed
    predicted loss; losses[path][fmt] for every candidate format (see the module doc).

    fixed: {path: ((in, out), format)} of tensors stored outside the allocation (an 8-bit
    embedding or head) whose bits and parameters count in the budget all the same.
    Raises TqjaxError as `check_budget` does.
    """
    formats = sorted({f for per in losses.values() for f in per}, key=lambda f: (f.bits, f.group))
    check_budget(shapes, formats, bpw, fixed)
    n_params, fixed_bits, kept, cost = _tally(shapes, formats, fixed or {})
    # Every candidate's shared constants are reserved, used or not: a few kilobytes, and the
    # budget then holds whatever the allocation picks.
    budget = bpw * n_params - fixed_bits - shared_bits(formats + kept)

    def floor(allowed: list[WeightFormat]) -> int:
        return sum(min(c[f] for f in allowed) for c in cost.values())

    if floor(formats) > budget:  # fits only without the unused formats' constants
        return _cheapest(cost)
    preferred = [f for f in formats if f.bits >= PREFERRED_MIN_BITS]
    if preferred and floor(preferred) <= budget:
        formats = preferred  # 2-bit codes only when the budget needs them
    hulls = {p: _lower_hull([(cost[p][f], losses[p][f], f) for f in formats]) for p in shapes}
    used = sum(h[0][0] for h in hulls.values())
    steps = sorted((((h[j][1] - h[j + 1][1]) / (h[j + 1][0] - h[j][0]), i, j, p)
                    for i, (p, h) in enumerate(hulls.items()) for j in range(len(h) - 1)),
                   key=lambda s: (-s[0], s[1], s[2]))  # best first; ties in tensor order
    choice = dict.fromkeys(shapes, 0)
    for _, _, j, p in steps:
        extra = hulls[p][j + 1][0] - hulls[p][j][0]
        if choice[p] == j and used + extra <= budget:
            choice[p], used = j + 1, used + extra
    return {p: hulls[p][j][2] for p, j in choice.items()}


def _lower_hull(points: list[tuple[int, float, WeightFormat]]
                ) -> list[tuple[int, float, WeightFormat]]:
    """The (cost, loss, format) points on the lower convex hull, cheapest first: each step
    costs more, lowers the loss, and buys less loss per bit than the step before."""
    hull: list[tuple[int, float, WeightFormat]] = []
    for p in sorted(points, key=lambda q: (q[0], q[1])):
        if hull and p[1] >= hull[-1][1]:
            continue  # costs at least as much for no less loss
        while len(hull) >= 2 and ((hull[-2][1] - hull[-1][1]) * (p[0] - hull[-2][0])
                                  <= (hull[-2][1] - p[1]) * (hull[-1][0] - hull[-2][0])):
            hull.pop()  # the middle point lies on or above the chord
        hull.append(p)
    return hull
