"""Tensor- and data-parallel sharding of a model and its KV cache (`jax.sharding`, GSPMD).

A 2-D mesh has a data axis "dp" (the batch) and a tensor axis "tp" (attention heads, the MLP
hidden dimension and the vocabulary). Every array gets a `NamedSharding`: the weights when the
model is loaded (`shard_params`, `tqjax.load(..., mesh=...)`), the cache when it is created
(`shard_cache`, called by `tqjax.decode.generate.new_cache` for a sharded model); jit then
propagates the shardings through the forward pass (GSPMD) and inserts the collectives (one
all-reduce after each row-parallel linear). The rules live in one place, as logical axes
mapped to mesh axes (`RULES`) and the logical axes of every weight (`LINEAR_AXES`) and cache
field (`CACHE_AXES`):

- column-parallel (wq, wk, wv, w_gate, w_up, an untied head; the embedding over the
  vocabulary): the output dimension is split. Quantized weights (packed codes, scales,
  offsets) and GGUF blocks are stored output-major and split their rows (one per output).
  Nothing crosses a Hadamard block: rotations act on the input dimension.
- row-parallel (wo, w_down): the input dimension is split, so each device multiplies its own
  heads' (or hidden units') slice and the partial products are summed. A quantized weight is
  split only at group boundaries (a group is a whole number of Hadamard blocks, and is where
  its scales change) and only when it is not padded: each shard then rotates its own input
  slice, no all-to-all. Otherwise it is replicated. GGUF blocks split at block boundaries or
  are replicated.
- key/value heads (wk, wv, their biases and every cache array with a head axis) are split
  when the tensor size divides their count and replicated otherwise (Qwen2.5 has 2 KV heads:
  at TP 7 each device computes both and keeps the whole cache). A tensor size must divide the
  number of attention heads (`check_mesh`: a one-line error otherwise). A weight whose MLP or
  vocabulary dimension it does not divide (Qwen2.5-0.5B at TP 7: 4864 and 151936) is split
  along its model dimension instead (`FALLBACK`; 896 = 7 x 128: the gate/up products and the
  tied head's logits are then all-reduced, the down projection's output all-gathered); what
  splits neither way is replicated, and `device_bytes` reports what each device holds.
- the batch of every cache array is split over "dp" when it divides the batch.

Shared constants (codebooks, rotation signs, RoPE frequencies, norms, cache centres of
replicated heads) are replicated. On CPU the XLA linear of a quantized weight dequantizes a
tile of output columns at a time with a `dynamic_slice` (`tqjax.quant.weights`): over a
column-split weight GSPMD gathers the codes for that loop, so the split saves resident memory
but not that transient; one-tile backends (GPU) multiply each shard in place.

Multi-host (not tested here): call `jax.distributed.initialize()` (coordinator address,
process count and id, or the cluster's environment) in every process before anything else
touches JAX; `jax.devices()` then lists every host's devices and `make_mesh` lays the mesh
over all of them (put "tp" within a host: its collectives are the frequent ones). Every
process runs the same program; `tqjax.models.orbax_checkpoint.restore_sharded` reads only the
shards a process's own devices hold.
"""

from __future__ import annotations

from typing import Any

import jax
import numpy as np
from jax.sharding import Mesh, NamedSharding, PartitionSpec

from tqjax.errors import TqjaxError, is_int
from tqjax.kv.cache import KVCache
from tqjax.models.config import ModelConfig
from tqjax.models.transformer import LayerParams, LayerStack, Params
from tqjax.quant.ggml import GGMLLinear
from tqjax.quant.half import HalfLinear
from tqjax.quant.weights import QuantizedLinear

DP, TP = "dp", "tp"

# logical axis -> mesh axis: the sharding rules, in one place
RULES: dict[str, str | None] = {
    "batch": DP,
    "heads": TP,
    "kv_heads": TP,
    "mlp": TP,
    "vocab": TP,
    "embed": None,
    "head_dim": None,
    "slots": None,
}

# (input, output) logical axes of each linear weight [in, out]
LINEAR_AXES: dict[str, tuple[str, str]] = {
    "wq": ("embed", "heads"),
    "wk": ("embed", "kv_heads"),
    "wv": ("embed", "kv_heads"),
    "wo": ("heads", "embed"),
    "w_gate": ("embed", "mlp"),
    "w_up": ("embed", "mlp"),
    "w_down": ("mlp", "embed"),
    "lm_head": ("embed", "vocab"),
}
BIAS_AXES: dict[str, str] = {"bq": "heads", "bk": "kv_heads", "bv": "kv_heads"}
# a weight whose MLP or vocabulary dimension the tensor axis does not divide is split along
# its model dimension instead (Qwen2.5-0.5B at TP 7: MLP 4864 and vocabulary 151936, model 896)
FALLBACK: dict[str, str] = {"mlp": "embed", "vocab": "embed"}

_PER_SLOT = ("batch", "kv_heads", "slots")
# cache field name (a store's, or the recent window's) -> logical axes of that array
CACHE_AXES: dict[str, tuple[str | None, ...]] = {
    "data": (*_PER_SLOT, "head_dim"),  # DenseStore [B, KV, S, hd]
    "q": (*_PER_SLOT, "head_dim"),  # Int8Store [B, KV, S, hd]
    "scale": _PER_SLOT,  # Int8Store / TurboStore [B, KV, S]
    "packed": (*_PER_SLOT, None),  # Int4Store / TurboStore [B, KV, S, bytes]
    "step": (*_PER_SLOT, None),  # Int4Store [B, KV, S, groups]
    "lo": (*_PER_SLOT, None),
    "qjl_signs": (*_PER_SLOT, None),  # TurboStore (prod) [B, KV, S, hd/8]
    "qjl_norm": _PER_SLOT,  # [B, KV, S]
    "sink": ("batch", "kv_heads", None, "head_dim"),  # [B, KV, n_sink, hd]
    "center": ("kv_heads", "head_dim"),  # [KV, hd]
    "chan_scale": ("kv_heads", "head_dim"),  # [KV, hd]
    "k": ("batch", "kv_heads", None, "head_dim"),  # RecentWindow ring [B, KV, N, hd]
    "v": ("batch", "kv_heads", None, "head_dim"),
    "pos": ("batch", None),  # RecentWindow [B, N]
}


def make_mesh(tp: int = 1, dp: int = 1, devices: list[Any] | None = None) -> Mesh:
    """A (dp, tp) mesh over the first dp·tp devices (default `jax.devices()`); the tensor axis
    varies fastest, so a tensor-parallel group is adjacent devices."""
    for name, n in (("tensor", tp), ("data", dp)):
        if not is_int(n) or n < 1:
            raise TqjaxError(f"{name} parallel size must be a positive integer, got {n!r}")
    tp, dp = int(tp), int(dp)
    devices = list(jax.devices() if devices is None else devices)
    if tp * dp > len(devices):
        hint = (f" (on CPU, start with XLA_FLAGS=--xla_force_host_platform_device_count="
                f"{tp * dp})" if devices and devices[0].platform == "cpu" else "")
        raise TqjaxError(f"a mesh of tp {tp} x dp {dp} needs {tp * dp} devices, "
                         f"{len(devices)} available{hint}")
    grid = np.asarray(devices[: tp * dp], dtype=object).reshape(dp, tp)
    return Mesh(grid, (DP, TP))


def axis_size(mesh: Mesh, name: str) -> int:
    """Devices along mesh axis `name` (1 when the mesh has no such axis)."""
    return int(mesh.shape.get(name, 1))


def mesh_axis(mesh: Mesh, logical: str | None, *sizes: int) -> str | None:
    """The mesh axis a dimension along `logical` is split over, or None (replicated: no rule,
    a mesh axis of 1, or one of `sizes` it does not divide: the dimension's length, and the
    pieces it may be cut into, such as heads or quantization groups)."""
    name = RULES.get(logical) if logical else None
    if name is None:
        return None
    n = axis_size(mesh, name)
    return name if n > 1 and all(size and size % n == 0 for size in sizes) else None


def logical_sizes(config: ModelConfig) -> dict[str, int]:
    """How many whole pieces each logical axis of the model has (heads, not head columns)."""
    return {"heads": config.num_heads, "kv_heads": config.num_kv_heads,
            "mlp": config.intermediate_size, "vocab": config.vocab_size,
            "embed": config.hidden_size}


def check_mesh(config: ModelConfig, mesh: Mesh) -> None:
    """A tensor size must divide the attention heads (a one-line TqjaxError otherwise)."""
    check_tp(config, axis_size(mesh, TP))


def check_tp(config: ModelConfig, tp: int) -> None:
    """`tp` devices must divide the attention heads (a one-line TqjaxError otherwise)."""
    if config.num_heads % tp:
        ok = [d for d in range(1, config.num_heads + 1) if config.num_heads % d == 0]
        raise TqjaxError(f"tensor parallel size {tp} does not divide the model's "
                         f"{config.num_heads} attention heads (choose from "
                         f"{', '.join(map(str, ok))})")


def _spec(mesh: Mesh, *axes: str | None) -> NamedSharding:
    return NamedSharding(mesh, PartitionSpec(*axes))


def split_axes(mesh: Mesh, first: str, second: str, first_sizes: tuple[int, ...],
               second_sizes: tuple[int, ...]) -> tuple[str | None, str | None]:
    """Mesh axes of a 2-D weight's dimensions along logical axes first / second; a dimension
    splits when the mesh axis divides every one of its sizes (() = it may not be cut). When
    neither splits by its own rule, a `FALLBACK` splits the other one over the same mesh
    axis."""
    a = mesh_axis(mesh, first, *first_sizes) if first_sizes else None
    b = mesh_axis(mesh, second, *second_sizes) if second_sizes else None
    if a is None and b is None:
        if FALLBACK.get(second) == first and first_sizes:
            a = _fallback(mesh, second, first_sizes)
        elif FALLBACK.get(first) == second and second_sizes:
            b = _fallback(mesh, first, second_sizes)
    return a, b


def _fallback(mesh: Mesh, logical: str, sizes: tuple[int, ...]) -> str | None:
    name = RULES[logical]
    n = axis_size(mesh, name) if name else 1
    return name if n > 1 and all(size and size % n == 0 for size in sizes) else None


def weight_shardings(w: Any, in_axis: str, out_axis: str, mesh: Mesh,
                     sizes: dict[str, int]) -> Any:
    """Shardings (a pytree like w) of a linear weight used as [in, out] along the logical
    axes in_axis / out_axis: dense [in, out], QuantizedLinear, GGMLLinear or HalfLinear (see
    the module docstring for where each may split); `sizes` = `logical_sizes(config)`."""
    rep = _spec(mesh)

    def dims(in_pieces: int, out_len: int) -> tuple[str | None, str | None]:
        ins = (in_pieces, sizes[in_axis]) if in_pieces else ()
        return split_axes(mesh, in_axis, out_axis, ins, (out_len, sizes[out_axis]))

    if isinstance(w, QuantizedLinear):  # [out, in]; inputs cut only at groups, never padded
        groups = w.scale.shape[1] if w.padded_in == w.in_features else 0
        rows, cols = dims(groups, w.out_features)
        split = _spec(mesh, cols, rows)
        return jax.tree.map(lambda _: rep, w).replace(
            packed=split, scale=split, offset=None if w.offset is None else split)
    if isinstance(w, GGMLLinear):  # fields [out, planes, in-blocks · bytes]: cut at blocks
        rows, cols = dims(w.in_features // w.block, w.out_features)
        split = _spec(mesh, cols, None, rows)
        return w.replace(fields=tuple(split for _ in w.fields))
    if isinstance(w, HalfLinear):  # bits [out, in]
        rows, cols = dims(w.in_features, w.out_features)
        return w.replace(bits=_spec(mesh, cols, rows))
    k, n = w.shape
    return _spec(mesh, *dims(k, n))


def param_shardings(params: Params, config: ModelConfig, mesh: Mesh) -> Params:
    """A Params-shaped pytree of NamedSharding for `params` on `mesh` (shapes and static fields
    only are read, so abstract params of ShapeDtypeStruct leaves work too)."""
    check_mesh(config, mesh)
    rep, sizes = _spec(mesh), logical_sizes(config)

    def layer(lp: LayerParams) -> LayerParams:
        out = jax.tree.map(lambda _: rep, lp)
        fields = {name: weight_shardings(getattr(lp, name), *axes, mesh, sizes)
                  for name, axes in LINEAR_AXES.items()
                  if name != "lm_head" and getattr(lp, name) is not None}  # (a stack's part)
        fields |= {name: _spec(mesh, mesh_axis(mesh, axis, sizes[axis]))
                   for name, axis in BIAS_AXES.items() if getattr(lp, name) is not None}
        return out.replace(**fields)

    def stacked(stack: LayerParams, mask: tuple[bool, ...]) -> LayerParams:
        """A format's stack: one layer's shardings, the layer axis (where a leaf has it)
        unsplit."""
        leaves, tree = jax.tree.flatten(stack)
        one = jax.tree.leaves(layer(jax.tree.unflatten(tree, [
            jax.ShapeDtypeStruct(a.shape[s:], a.dtype) for a, s in zip(leaves, mask,
                                                                        strict=True)])))
        return jax.tree.unflatten(tree, [NamedSharding(mesh, PartitionSpec(None, *sh.spec))
                                         if s else sh for sh, s in zip(one, mask, strict=True)])

    if isinstance(params.layers, LayerStack):
        layers = params.layers.replace(stacks=tuple(
            tuple(stacked(st, mask) for st, mask in zip(part, masks, strict=True))
            for part, masks in zip(params.layers.stacks, params.layers.stacked, strict=True)))
    else:
        layers = [layer(lp) for lp in params.layers]
    embed = params.embed
    if isinstance(embed, (QuantizedLinear, GGMLLinear)):  # embedᵀ [D, V] / blocks with out = V
        embed_sh = weight_shardings(embed, "embed", "vocab", mesh, sizes)
    else:  # dense [V, D]
        v, d = embed.shape
        embed_sh = _spec(mesh, *split_axes(mesh, "vocab", "embed", (v,), (d,)))
    head = None if params.lm_head is None else weight_shardings(
        params.lm_head, *LINEAR_AXES["lm_head"], mesh, sizes)
    return Params(embed=embed_sh, layers=layers, final_norm=rep, lm_head=head,
                  rope_inv_freq=rep)


def shard_params(params: Params, config: ModelConfig, mesh: Mesh) -> Params:
    """params placed on `mesh` by `param_shardings` (each device keeps its shards)."""
    return jax.device_put(params, param_shardings(params, config, mesh))


def _field_name(path: tuple[Any, ...]) -> str | None:
    names = [k.name for k in path if isinstance(k, jax.tree_util.GetAttrKey)]
    return names[-1] if names else None


def cache_shardings(cache: KVCache, mesh: Mesh) -> KVCache:
    """A KVCache-shaped pytree of NamedSharding: batch over "dp", KV heads over "tp" where
    they divide (`CACHE_AXES`); quantizer constants, codebooks and QJL matrices replicated."""

    def one(path: tuple[Any, ...], leaf: jax.Array) -> NamedSharding:
        axes = CACHE_AXES.get(_field_name(path) or "")
        if axes is not None:
            axes = (None, *axes)  # every cache array is stacked over its group's layers
        if axes is None or len(axes) != leaf.ndim:
            return _spec(mesh)
        return _spec(mesh, *(mesh_axis(mesh, a, n) for a, n in zip(axes, leaf.shape,
                                                                     strict=True)))

    return jax.tree_util.tree_map_with_path(one, cache)


def shard_cache(cache: KVCache, mesh: Mesh) -> KVCache:
    """cache placed on `mesh` by `cache_shardings`."""
    return jax.device_put(cache, cache_shardings(cache, mesh))


def mesh_of(tree: Any) -> Mesh | None:
    """The mesh a pytree's arrays are placed on (by `shard_params`), or None."""
    for leaf in jax.tree.leaves(tree):
        sharding = getattr(leaf, "sharding", None)
        if isinstance(sharding, NamedSharding):
            return sharding.mesh
    return None


def device_bytes(tree: Any) -> dict[int, int]:
    """Resident bytes per device id: Σ over leaves of `shard.data.nbytes` of its shards."""
    out: dict[int, int] = {}
    for leaf in jax.tree.leaves(tree):
        for shard in leaf.addressable_shards:
            out[shard.device.id] = out.get(shard.device.id, 0) + shard.data.nbytes
    return out
