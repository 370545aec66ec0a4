"""The decoder-only transformer shared by Llama (2/3/3.1, SmolLM) and Qwen (2/2.5/3).

Differences are config flags: Qwen2 adds biases to the Q/K/V projections, Qwen3 RMS-normalises
each query and key head before RoPE. Linear weights are stored `[in, out]` (x @ w) and may be
dense arrays or quantized weights from `tqjax.quant.weights`.
"""

from __future__ import annotations

import dataclasses
import functools
from collections.abc import Callable, Iterator
from typing import Any

import jax
import jax.numpy as jnp
import numpy as np
from flax import struct

from tqjax.errors import TqjaxError
from tqjax.host import host_buffer, release_adopted, trim_heap
from tqjax.kv import cache as kvc
from tqjax.kv.rope import apply_rope, rope_cos_sin
from tqjax.models.config import ModelConfig
from tqjax.quant import ggml, half
from tqjax.quant import weights as qw

Weight = Any  # jax.Array [in, out], a quantized weight pytree (tqjax.quant.weights) or HalfLinear
LINEARS = ("wq", "wk", "wv", "wo", "w_gate", "w_up", "w_down")  # a layer's linear weights


@struct.dataclass
class LayerParams:
    attn_norm: jax.Array  # [D]
    wq: Weight  # [D, H*hd]
    wk: Weight  # [D, KV*hd]
    wv: Weight  # [D, KV*hd]
    wo: Weight  # [H*hd, D]
    mlp_norm: jax.Array  # [D]
    w_gate: Weight  # [D, F]
    w_up: Weight  # [D, F]
    w_down: Weight  # [F, D]
    bq: jax.Array | None = None  # [H*hd]   (qwen2)
    bk: jax.Array | None = None  # [KV*hd]  (qwen2)
    bv: jax.Array | None = None  # [KV*hd]  (qwen2)
    q_norm: jax.Array | None = None  # [hd]  (qwen3)
    k_norm: jax.Array | None = None  # [hd]  (qwen3)


PARTS = ("norms", *LINEARS)  # a `LayerStack`'s parts: a layer's other arrays, then each linear


def _part(lp: LayerParams, p: int) -> LayerParams:
    """Part p (`PARTS`) of a layer: its norms and biases (linears None), or one linear alone."""
    names = [f.name for f in dataclasses.fields(lp)]
    keep = [n for n in names if n not in LINEARS] if p == 0 else [PARTS[p]]
    return LayerParams(**{n: getattr(lp, n) if n in keep else None for n in names})


def _merge(parts: list[LayerParams]) -> LayerParams:
    """Inverse of `_part`: a layer from its parts, in `PARTS` order."""
    return parts[0].replace(**{name: getattr(parts[1 + k], name)
                               for k, name in enumerate(LINEARS)})


@struct.dataclass
class LayerStack:
    """Decoder layers stacked part by part (`PARTS`: the norms and biases, then each linear)
    and, within a part, by weight format: the layers whose part has the same pytree, shapes
    and dtypes share one `LayerParams` (that part's fields set, the others None) whose leaves
    have a leading axis over them. `forward` compiles each linear once per format it takes,
    not once per layer nor per layer's combination of formats: a mixed-precision model gives
    its q projections three formats and its down projections seven, and 15 of 30 layers a
    combination of their own (SmolLM2 at 4.25 bpw). A leaf that all of a format's layers
    share (one array: a codebook, a rotation; every leaf of a one-layer format) is kept once,
    without that axis; a dense linear is a one-layer format (XLA:CPU would copy its slice out
    of a stack before its library dot). Reads like a list of layers: `len`, iteration and
    `stack[i]` (layer i's arrays indexed out)."""

    stacks: tuple[tuple[LayerParams, ...], ...]  # per part, per format: stacked leaves
    kind: tuple[tuple[int, ...], ...] = struct.field(pytree_node=False)  # per part: layer i's
    # format
    pos: tuple[tuple[int, ...], ...] = struct.field(pytree_node=False)  # per part: layer i's
    # index in its format's stack
    stacked: tuple[tuple[tuple[bool, ...], ...], ...] = struct.field(pytree_node=False)  # per
    # part, per format, per leaf (flattening order): whether it has the layer axis

    def __len__(self) -> int:
        return len(self.kind[0])

    def __getitem__(self, i: int) -> LayerParams:
        return _merge([self.part(p, self.kind[p][i], self.pos[p][i])
                       for p in range(len(PARTS))])

    def __iter__(self) -> Iterator[LayerParams]:
        return (self[i] for i in range(len(self)))

    def part(self, p: int, f: int, j: jax.Array | int) -> LayerParams:
        """Part p's layer j (traced or not) of format f: its stacked leaves indexed at j (a
        slice that XLA reads in place inside a fused dot), its shared ones as they are."""
        leaves, tree = jax.tree_util.tree_flatten(self.stacks[p][f])
        return jax.tree_util.tree_unflatten(tree, [
            jax.lax.dynamic_index_in_dim(a, j, keepdims=False) if s else a
            for a, s in zip(leaves, self.stacked[p][f], strict=True)])


@struct.dataclass
class Params:
    embed: Weight  # [V, D] dense or GGMLLinear (out = V), or the QuantizedLinear of embedᵀ [D, V]
    layers: list[LayerParams] | LayerStack
    final_norm: jax.Array  # [D]
    lm_head: Weight | None  # [D, V]; None when tied to `embed`
    rope_inv_freq: jax.Array  # [hd/2] f32


def rms_norm(x: jax.Array, weight: jax.Array, eps: float) -> jax.Array:
    """x [..., D] normalised in f32, returned in x's dtype (HF convention)."""
    xf = x.astype(jnp.float32)
    xf = xf * jax.lax.rsqrt(jnp.mean(xf * xf, axis=-1, keepdims=True) + eps)
    return weight.astype(x.dtype) * xf.astype(x.dtype)


def qkv(lp: LayerParams, config: ModelConfig, x: jax.Array, cos: jax.Array, sin: jax.Array
        ) -> tuple[jax.Array, jax.Array, jax.Array]:
    """x [B, T, D] (already normed) -> post-RoPE queries [B, T, H, hd], keys and values
    [B, T, KV, hd]."""
    b, t, _ = x.shape
    hd = config.head_dim
    q, k, v = _linear(x, lp.wq), _linear(x, lp.wk), _linear(x, lp.wv)
    if config.qkv_bias:
        q, k, v = q + lp.bq.astype(q.dtype), k + lp.bk.astype(k.dtype), v + lp.bv.astype(v.dtype)
    q = q.reshape(b, t, config.num_heads, hd)
    k = k.reshape(b, t, config.num_kv_heads, hd)
    v = v.reshape(b, t, config.num_kv_heads, hd)
    if config.qk_norm:
        q, k = rms_norm(q, lp.q_norm, config.rms_eps), rms_norm(k, lp.k_norm, config.rms_eps)
    return apply_rope(q, cos, sin), apply_rope(k, cos, sin), v


def attention_heads(lp: LayerParams, config: ModelConfig, x: jax.Array, cos: jax.Array,
                    sin: jax.Array, start: jax.Array, layer_cache: kvc.LayerCache,
                    valid: jax.Array | None = None
                    ) -> tuple[jax.Array, kvc.LayerCache, jax.Array]:
    """x [B, T, D] (already normed) -> the concatenated head outputs [B, T, H*hd] (the o_proj
    input), the updated cache and the post-RoPE queries [B, T, H, hd] (used by calibration).
    valid int32 [B]: real tokens per row (`kvc.attend`)."""
    q, k, v = qkv(lp, config, x, cos, sin)
    out, layer_cache = kvc.attend(layer_cache, q, k, v, start, valid=valid)
    return out.reshape(*x.shape[:2], -1), layer_cache, q


def layer_output(lp: LayerParams, config: ModelConfig, x: jax.Array, heads: jax.Array
                 ) -> jax.Array:
    """The residual stream x [B, T, D] after the layer's o_proj (of heads [B, T, H*hd]) and MLP."""
    x = x + _linear(heads, lp.wo)
    return x + _linear(gated_activation(lp, rms_norm(x, lp.mlp_norm, config.rms_eps)), lp.w_down)


def _normed_qkv(lp: LayerParams, config: ModelConfig, x: jax.Array, cos: jax.Array,
                sin: jax.Array) -> tuple[jax.Array, jax.Array, jax.Array]:
    return qkv(lp, config, rms_norm(x, lp.attn_norm, config.rms_eps), cos, sin)


def gated_activation(lp: LayerParams, x: jax.Array) -> jax.Array:
    """x [B, T, D] (already normed) -> silu(x·W_gate) ∘ (x·W_up) [B, T, F] (the down_proj input)."""
    return jax.nn.silu(_linear(x, lp.w_gate)) * _linear(x, lp.w_up)


def embed_tokens(embed: Weight, tokens: jax.Array) -> jax.Array:
    """Token ids int [...] -> embeddings [..., D] from a dense [V, D], quantized embedᵀ or GGUF
    [V, D] table."""
    if isinstance(embed, qw.QuantizedLinear):
        return qw.gather_columns(embed, tokens)
    if isinstance(embed, ggml.GGMLLinear):
        return ggml.gather_rows(embed, tokens)
    return embed[tokens]


FUSED = (qw.QuantizedLinear, ggml.GGMLLinear, half.HalfLinear)  # linears run as fused dots,
# which read a stacked weight in place


def _signature(part: LayerParams, p: int, i: int) -> Any:
    """What layers must share for part p (`PARTS`) to stack: its pytree, shapes and dtypes;
    layer i's dense linear only matches itself (`LayerStack`)."""
    if p and not isinstance(getattr(part, PARTS[p]), FUSED):
        return i
    leaves, tree = jax.tree_util.tree_flatten(part)
    return tree, tuple((x.shape, str(x.dtype)) for x in leaves)


def _stack_format(flat: list[Any], members: list[int], consume: bool) -> tuple[Any, tuple]:
    """One format's stack: the members' (leaves, pytree) from `flat` -> (a pytree whose leaves
    have a leading axis over the members, or are the one array they share; per leaf, whether
    it has that axis). Each stacked leaf is filled in one host buffer the device adopts;
    `consume` drops each source leaf from `flat` once copied."""
    out, mask = [], []
    for j in range(len(flat[members[0]][0])):
        first = flat[members[0]][0][j]
        mask.append(any(flat[i][0][j] is not first for i in members))
        if not mask[-1]:
            out.append(first)
            continue
        buf = host_buffer((len(members), *first.shape), first.dtype)
        del first
        for r, i in enumerate(members):
            buf[r] = np.asarray(flat[i][0][j])
            if consume:
                flat[i][0][j] = None
                release_adopted()
        out.append(jax.device_put(buf))
        if consume:
            trim_heap()  # the sources' freed heap (small arrays are not served by mmap)
    return jax.tree_util.tree_unflatten(flat[members[0]][1], out), tuple(mask)


def stack_layers(layers: list[LayerParams], consume: bool = False) -> LayerStack:
    """Layers as a `LayerStack`: each part (`PARTS`) grouped by format, a dense linear a format
    of its own, since XLA:CPU copies a dense weight's slice out of a stack before its library
    dot (SmolLM2 f32 decode: 49 -> 84 ms a step); a leaf all of a format's layers share is
    kept as it is. `consume`: `layers` is emptied and each source array dropped as soon as it
    is copied, so stacking holds one layer's array beyond the params."""
    n = len(layers)
    parts = [[_part(lp, p) for p in range(len(PARTS))] for lp in layers]
    if consume:  # `parts`, then `flat`, hold the only references to the sources
        layers.clear()
    stacks, kinds, places, masks = [], [], [], []
    for p in range(len(PARTS)):
        flat = [jax.tree_util.tree_flatten(parts[i][p]) for i in range(n)]  # (leaves, pytree)
        sigs = [_signature(parts[i][p], p, i) for i in range(n)]
        for i in range(n):
            parts[i][p] = None
        signatures: list[Any] = []  # (equality, not hashing: static pytree data need not hash)
        for sig in sigs:
            if sig not in signatures:
                signatures.append(sig)
        kind = [signatures.index(sig) for sig in sigs]
        formats = [_stack_format(flat, [i for i, k in enumerate(kind) if k == f], consume)
                   for f in range(len(signatures))]
        if p == 0 and len(formats) > 1:  # `forward` reads every layer's norms alike
            raise ValueError("decoder layers whose norms or biases differ in shape or dtype")
        stacks.append(tuple(tree for tree, _ in formats))
        kinds.append(tuple(kind))
        places.append(tuple(kind[:i].count(k) for i, k in enumerate(kind)))
        masks.append(tuple(mask for _, mask in formats))
    return LayerStack(tuple(stacks), tuple(kinds), tuple(places), tuple(masks))


def as_stack(layers: list[LayerParams] | LayerStack) -> LayerStack:
    """A list of layers as a `LayerStack` of one-layer formats (no array copied), or the
    stack."""
    if isinstance(layers, LayerStack):
        return layers
    n = len(layers)
    parts = [tuple(_part(lp, p) for lp in layers) for p in range(len(PARTS))]
    return LayerStack(tuple(parts), (tuple(range(n)),) * len(PARTS), ((0,) * n,) * len(PARTS),
                      tuple(tuple((False,) * len(jax.tree_util.tree_leaves(lp)) for lp in part)
                            for part in parts))


@dataclasses.dataclass(frozen=True)
class _Picked:
    """A linear chosen at run time among formats, inside `forward`'s layer body: `which`
    (int32 scalar) indexes `formats`, each giving the layer's weight in that format."""

    which: jax.Array
    formats: tuple[Callable[[], Weight], ...]


def _linear(x: jax.Array, w: Weight | _Picked) -> jax.Array:
    """`qw.linear`, or for a `_Picked` weight a `lax.switch` over its formats' fused dots."""
    if not isinstance(w, _Picked):
        return qw.linear(x, w)
    if len(w.formats) == 1:
        return qw.linear(x, w.formats[0]())
    return jax.lax.switch(w.which, [lambda x, get=get: qw.linear(x, get()) for get in w.formats],
                          x)


def pick_layer(layers: LayerStack, i: jax.Array | int, among: range) -> LayerParams:
    """Layer i (traced or not) of `layers` for the layer functions (`qkv`, `layer_output`),
    each part picked among the formats it takes in the layers `among` (i one of them): the
    norms by a `lax.switch` returning them (one format in a stack; one per layer in a list's
    `as_stack`), each linear by a `lax.switch` around its fused dot (`_Picked`), none where
    a part takes one format. So a program compiles each linear once per format it takes."""
    formats = []  # per part: (its index among the formats of `among`, the formats' getters)
    for p in range(len(PARTS)):
        kinds = sorted({layers.kind[p][j] for j in among})
        pick = jnp.asarray(layers.pos[p])[i]
        which = jnp.asarray([kinds.index(k) if k in kinds else 0 for k in layers.kind[p]])[i]
        formats.append((which, tuple(functools.partial(layers.part, p, f, pick)
                                     for f in kinds)))
    which, get = formats[0]
    norms = get[0]() if len(get) == 1 else jax.lax.switch(which, get)
    return norms.replace(**{name: _Picked(which, tuple(
        lambda get=g, name=name: getattr(get(), name) for g in get))
        for name, (which, get) in zip(PARTS[1:], formats[1:], strict=True)})


def _check_chunk(config: ModelConfig, tokens: jax.Array, start: jax.Array,
                 cache: kvc.KVCache) -> None:
    """`forward`'s shapes (static, so checked as it is traced): a mismatch XLA would run
    anyway, clamping a cache row or slot index, is a TqjaxError here. (Positions are traced:
    start + T <= the cache's slots is the caller's to keep; `prefill` checks it.)"""
    if np.ndim(tokens) != 2 or np.shape(start) != np.shape(tokens)[:1]:
        raise TqjaxError(f"forward takes tokens [B, T] and start [B], got shapes "
                         f"{np.shape(tokens)} and {np.shape(start)}")
    b, t = np.shape(tokens)
    if (cache.batch, cache.kv_heads) != (b, config.num_kv_heads) or cache.slots < t:
        raise TqjaxError(f"a cache of batch {cache.batch}, {cache.kv_heads} KV heads and "
                         f"{cache.slots} slots for a chunk of batch {b} and {t} tokens of a "
                         f"model with {config.num_kv_heads} KV heads")


def forward(params: Params, config: ModelConfig, tokens: jax.Array, start: jax.Array,
            cache: kvc.KVCache, out_index: jax.Array | None = None,
            valid: jax.Array | None = None) -> tuple[jax.Array, kvc.KVCache]:
    """Run a chunk of tokens through the model, reading and extending the KV cache.

    tokens int32 [B, T]; start int32 [B]: position of tokens[:, 0] per sequence (prefill: 0,
    decode: the current length). Returns f32 logits [B, T, V], or [B, V] taken at
    `out_index` int32 [B] when given, and the updated cache. `valid` int32 [B]: the real
    tokens of each row's chunk (right-padded prefill; default T): only those enter the caches'
    recent-token rings, so each row's ring ends at its last real token, not in its padding.
    Shapes are checked as they are traced (`_check_chunk`); the traced values are not: start +
    T must stay within the cache's slots (XLA clamps an out-of-range write; `prefill` and
    `generate_tokens` check it) and token ids within the vocabulary (`tqjax.logits` checks them).

    Each group of alike cache layers (`kvc.KVCache`) runs as one compiled layer body in a
    `fori_loop`: each of a layer's linears is picked by a `lax.switch` over the formats that
    linear takes (`LayerStack`; a list of layers: one branch per layer), each branch reading
    its stack at the layer's index in place, around one attention, which reads and writes its
    layer of the stacked cache in place. Why: XLA:CPU keeps a compiled program resident at
    ~4-5 KB per HLO instruction, and unrolled over 30 layers a turbo cache's attention held
    more memory in programs than the compression saved (docs/research.md, stop 37); compiled
    once per layer, a Qwen2.5-Coder-1.5B GGUF's decode program held 607 MB (stop 45).
    """
    _check_chunk(config, tokens, start, cache)
    dtype = params.final_norm.dtype
    x = embed_tokens(params.embed, tokens).astype(dtype)
    positions = start[:, None] + jnp.arange(tokens.shape[1])[None, :]
    cos, sin = rope_cos_sin(positions, params.rope_inv_freq)
    cos, sin = cos[:, :, None, :], sin[:, :, None, :]  # broadcast over heads
    layers = as_stack(params.layers)
    if cache.num_layers != len(layers):
        raise TqjaxError(f"a cache of {cache.num_layers} layers for a model of {len(layers)}")

    def run(i: jax.Array | int, x: jax.Array, group: kvc.LayerCache, first: int
            ) -> tuple[jax.Array, kvc.LayerCache]:
        """Layer first + i, its cache layer i of the stacked group, read and written in place;
        its weights picked among the formats the group's layers take (`pick_layer`)."""
        lp = pick_layer(layers, first + i, range(first, first + kvc.group_size(group)))
        view = kvc.layer_view(group, i)
        out, after = kvc.attend(view, *_normed_qkv(lp, config, x, cos, sin), start, valid=valid)
        group = kvc.layer_update(group, after, i, view)
        return layer_output(lp, config, x, out.reshape(*x.shape[:2], -1)), group

    groups, first = [], 0
    for group in cache.groups:
        n = kvc.group_size(group)
        if n == 1:
            x, group = run(0, x, group, first)
        else:
            x, group = jax.lax.fori_loop(
                0, n, lambda i, c, first=first: run(i, *c, first), (x, group))
        groups.append(group)
        first += n
    if out_index is not None:
        x = jnp.take_along_axis(x, out_index[:, None, None], axis=1)[:, 0]
    x = rms_norm(x, params.final_norm, config.rms_eps)
    head = params.embed if params.lm_head is None else params.lm_head
    if head is params.embed and half.is_half(head):  # a tied [V, D] bf16 / f16 table
        logits = half.linear(x.astype(jnp.float32), half.output_major(head))
    elif head is params.embed and not isinstance(head, (qw.QuantizedLinear, ggml.GGMLLinear)):
        logits = jnp.einsum("...d,vd->...v", x, head.astype(x.dtype),  # dense tied [V, D]
                            preferred_element_type=jnp.float32)
    else:  # [D, V]: an untied head, a quantized embedding (embedᵀ) or a GGUF [V, D] table
        logits = qw.linear(x, head).astype(jnp.float32)
    return logits, kvc.KVCache(tuple(groups))
