"""Bits accounting of weights: exact stored bytes of a parameter pytree, and the bits a
format will store before anything is quantized.

One place for it: quantized checkpoints (quantization.json "memory"), scripts/quantize.py,
the weights tables and the benchmarks report `params_bits`; the mixed-precision allocator
budgets with `WeightFormat.tensor_bits` (a tensor's codes, scales and offsets) plus
`shared_bits` (the constants stored once), which add up to what `params_bits` measures.
"""

from __future__ import annotations

import math
from collections.abc import Iterable
from typing import Any

import jax

from tqjax.quant.ggml import GGMLLinear
from tqjax.quant.weights import QuantizedLinear, WeightFormat


def unique_bytes(tree: Any, seen: set[int] | None = None) -> int:
    """Bytes of every array leaf of `tree`, each array counted once (by identity: luts and
    rotations shared between quantized linears count once); `seen` carries the ids across
    calls."""
    seen = set() if seen is None else seen
    total = 0
    for leaf in jax.tree_util.tree_leaves(tree):
        if id(leaf) not in seen:
            seen.add(id(leaf))
            total += leaf.nbytes
    return total


def shared_bits(formats: Iterable[WeightFormat]) -> int:
    """Bits of the constants stored once for every tensor of these formats (one seed): each
    format's f32 lut (`format_lut`) and one set of f32 rotation signs per rotation block size
    (`format_rotation`, shared across formats)."""
    fmts = set(formats)
    return (sum(32 << f.bits for f in fmts)
            + sum(32 * b for b in {f.rotation_block for f in fmts} if b))


def params_bits(params: Any) -> dict[str, float]:
    """Exact storage of a model's params (`tqjax.models.transformer.Params`).

    Returns bytes, params (weights; quantized linears, ours or GGUF blocks, count in·out,
    rope frequencies are not parameters but their bytes count) and bpw = 8·bytes/params,
    overall and for the quantized linears alone (`quantized_*`, shared constants included).
    """
    seen: set[int] = set()
    is_q = lambda x: isinstance(x, (QuantizedLinear, GGMLLinear))  # noqa: E731
    leaves = jax.tree_util.tree_leaves(params.replace(rope_inv_freq=None), is_leaf=is_q)
    quantized = [leaf for leaf in leaves if is_q(leaf)]
    q_bytes = sum(unique_bytes(w, seen) for w in quantized)
    # a linear stacked over layers (`transformer.LayerStack`) is one matrix per leading index
    q_params = sum(w.in_features * w.out_features * math.prod(
        w.packed.shape[:-2] if isinstance(w, QuantizedLinear) else w.fields[0].shape[:-3])
        for w in quantized)
    total_bytes = q_bytes + unique_bytes(params, seen)
    dense_params = sum(leaf.size for leaf in leaves if not is_q(leaf))
    n = q_params + dense_params
    return {
        "bytes": total_bytes,
        "params": n,
        "bpw": 8 * total_bytes / n,
        "quantized_bytes": q_bytes,
        "quantized_params": q_params,
        "quantized_bpw": 8 * q_bytes / q_params if q_params else 0.0,
    }
