"""Mixed precision: per-tensor TurboQuant bit widths meeting an average bits-per-weight budget.

After the per-group rotation every weight group looks Gaussian, so a b-bit "tq" code leaves a
relative squared error close to the Lloyd–Max distortion D(b) = `lloyd_max(b, group).mse · group`
(0.115, 0.033, 0.0091, 0.0024 for b = 2..5 at group 64) whatever the tensor, and that error is
white within each group. The predicted loss increase of giving tensor l b bits is a_l·D(b):

- data-free, a_l = 1: every tensor's relative error counts the same;
- with calibration text, a_l = ½ Σ_{g,n} F_g,n·σ²_g,n (`params.fisher_sensitivity`): the
  diagonal Fisher information of the next-token distribution summed over each group times the
  group's mean squared weight, i.e. the second-order KL increase of white noise with variance
  D(b)·σ² per weight.

`allocate` solves min Σ a_l·D(b_l) subject to Σ stored bits <= bpw · Σ params (shared codebooks
and rotation included) greedily: it takes single-step upgrades in order of loss reduction per
stored bit (D is convex in b, so each tensor's steps come in order). Every tensor gets at least
3 bits when the budget allows it: 2-bit codes (D = 0.115) are far outside the second-order
regime the sensitivities describe.
"""

from __future__ import annotations

from tqjax.errors import TqjaxError
from tqjax.quant.codebook import lloyd_max
from tqjax.quant.weights import WeightFormat

CANDIDATE_BITS = (2, 3, 4, 5, 6, 8)
PREFERRED_MIN_BITS = 3  # below it the error is outside the second-order (Fisher) regime


def candidate_formats(group: int) -> list[WeightFormat]:
    """The "tq" formats the allocator chooses from, fewest bits first."""
    return [WeightFormat("tq", b, group) for b in CANDIDATE_BITS]


def relative_distortion(fmt: WeightFormat) -> float:
    """Expected ‖w − ŵ‖²/‖w‖² of a Gaussian-like group under a "tq" format."""
    return lloyd_max(fmt.bits, fmt.group).mse * fmt.group


def shared_bits(formats: list[WeightFormat]) -> int:
    """Bits of the constants shared by all tensors of these formats: f32 luts and the rotation
    signs (one per group size)."""
    luts = sum(32 << f.bits for f in set(formats))
    return luts + sum(32 * g for g in {f.group for f in formats if f.kind == "tq"})


def allocate(shapes: dict[str, tuple[int, int]], sensitivity: dict[str, float], bpw: float,
             group: int) -> dict[str, WeightFormat]:
    """Per-tensor formats for shapes {path: (in, out)} meeting `bpw` (see the module doc).

    Raises TqjaxError when even the smallest format exceeds the budget.
    """
    formats = candidate_formats(group)
    n_params = sum(k * n for k, n in shapes.values())
    budget = bpw * n_params - shared_bits(formats)

    def floor_bits(fmt: WeightFormat) -> int:
        return sum(fmt.tensor_bits(k, n) for k, n in shapes.values())

    if floor_bits(formats[0]) > budget:
        least = (floor_bits(formats[0]) + shared_bits(formats)) / n_params
        raise TqjaxError(f"bpw {bpw} is below the smallest mixed format ({least:.3f} bits/weight "
                         f"with group {group})")
    while len(formats) > 1 and formats[0].bits < PREFERRED_MIN_BITS and floor_bits(
            formats[1]) <= budget:
        formats = formats[1:]  # 2-bit codes only when the budget needs them
    dist = [relative_distortion(f) for f in formats]
    cost = {p: [f.tensor_bits(k, n) for f in formats] for p, (k, n) in shapes.items()}
    used = sum(c[0] for c in cost.values())
    steps = sorted(((sensitivity[p] * (dist[j] - dist[j + 1]) / (c[j + 1] - c[j]), i, j, p)
                    for i, (p, c) in enumerate(cost.items()) for j in range(len(formats) - 1)),
                   key=lambda s: (-s[0], s[1], s[2]))
    choice = dict.fromkeys(shapes, 0)
    for _, _, j, p in steps:
        extra = cost[p][j + 1] - cost[p][j]
        if choice[p] == j and used + extra <= budget:
            choice[p], used = j + 1, used + extra
    return {p: formats[j] for p, j in choice.items()}
