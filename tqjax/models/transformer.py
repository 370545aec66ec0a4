"""The decoder-only transformer shared by Llama (2/3/3.1, SmolLM) and Qwen (2/2.5/3).

Differences are config flags: Qwen2 adds biases to the Q/K/V projections, Qwen3 RMS-normalises
each query and key head before RoPE. Linear weights are stored `[in, out]` (x @ w) and may be
dense arrays or quantized weights from `tqjax.quant.weights`.
"""

from __future__ import annotations

import functools
from typing import Any

import jax
import jax.numpy as jnp
from flax import struct

from tqjax.kv import cache as kvc
from tqjax.kv.rope import apply_rope, rope_cos_sin
from tqjax.models.config import ModelConfig
from tqjax.quant import ggml
from tqjax.quant import weights as qw

Weight = Any  # jax.Array [in, out] or a quantized weight pytree (tqjax.quant.weights)


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


@struct.dataclass
class Params:
    embed: Weight  # [V, D] dense or GGMLLinear (out = V), or the QuantizedLinear of embedᵀ [D, V]
    layers: list[LayerParams]
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
    q, k, v = qw.linear(x, lp.wq), qw.linear(x, lp.wk), qw.linear(x, lp.wv)
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
    x = x + qw.linear(heads, lp.wo)
    return x + qw.linear(gated_activation(lp, rms_norm(x, lp.mlp_norm, config.rms_eps)), lp.w_down)


def _normed_qkv(lp: LayerParams, config: ModelConfig, x: jax.Array, cos: jax.Array,
                sin: jax.Array) -> tuple[jax.Array, jax.Array, jax.Array]:
    return qkv(lp, config, rms_norm(x, lp.attn_norm, config.rms_eps), cos, sin)


def gated_activation(lp: LayerParams, x: jax.Array) -> jax.Array:
    """x [B, T, D] (already normed) -> silu(x·W_gate) ∘ (x·W_up) [B, T, F] (the down_proj input)."""
    return jax.nn.silu(qw.linear(x, lp.w_gate)) * qw.linear(x, lp.w_up)


def embed_tokens(embed: Weight, tokens: jax.Array) -> jax.Array:
    """Token ids int [...] -> embeddings [..., D] from a dense [V, D], quantized embedᵀ or GGUF
    [V, D] table."""
    if isinstance(embed, qw.QuantizedLinear):
        return qw.gather_columns(embed, tokens)
    if isinstance(embed, ggml.GGMLLinear):
        return ggml.gather_rows(embed, tokens)
    return embed[tokens]


def forward(params: Params, config: ModelConfig, tokens: jax.Array, start: jax.Array,
            cache: kvc.KVCache, out_index: jax.Array | None = None,
            valid: jax.Array | None = None) -> tuple[jax.Array, kvc.KVCache]:
    """Run a chunk of tokens through the model, reading and extending the KV cache.

    tokens int32 [B, T]; start int32 [B]: position of tokens[:, 0] per sequence (prefill: 0,
    decode: the current length). Returns f32 logits [B, T, V], or [B, V] taken at
    `out_index` int32 [B] when given, and the updated cache. `valid` int32 [B]: the real
    tokens of each row's chunk (right-padded prefill; default T): only those enter the caches'
    recent-token rings, so each row's ring ends at its last real token, not in its padding.

    Each group of alike cache layers (`kvc.KVCache`) runs as one compiled layer body in a
    `fori_loop`: each layer's projections are picked by `lax.switch` (every branch reads its
    own weights in place, any weight format) around one attention, which reads and writes its
    layer of the stacked cache in place. Why: XLA:CPU keeps a compiled program resident at
    ~4-5 KB per HLO instruction, and unrolled over 30 layers a turbo cache's attention held
    more memory in programs than the compression saved (docs/research.md, stop 37).
    """
    dtype = params.final_norm.dtype
    x = embed_tokens(params.embed, tokens).astype(dtype)
    positions = start[:, None] + jnp.arange(tokens.shape[1])[None, :]
    cos, sin = rope_cos_sin(positions, params.rope_inv_freq)
    cos, sin = cos[:, :, None, :], sin[:, :, None, :]  # broadcast over heads
    if cache.num_layers != len(params.layers):
        raise ValueError(f"a cache of {cache.num_layers} layers for a model of "
                         f"{len(params.layers)}")

    def attention(group: kvc.LayerCache, i: jax.Array | int, q: jax.Array, k: jax.Array,
                  v: jax.Array) -> tuple[jax.Array, kvc.LayerCache]:
        """Layer i of the stacked group: attention, its cache read and written in place."""
        view = kvc.layer_view(group, i)
        out, after = kvc.attend(view, q, k, v, start, valid=valid)
        return out.reshape(*x.shape[:2], -1), kvc.layer_update(group, after, i, view)

    groups, first = [], 0
    for group in cache.groups:
        n = kvc.group_size(group)
        layers = params.layers[first:first + n]
        first += n
        if n == 1:
            heads, group = attention(group, 0, *_normed_qkv(layers[0], config, x, cos, sin))
            x = layer_output(layers[0], config, x, heads)
        else:
            projections = [functools.partial(_normed_qkv, lp, config) for lp in layers]
            outputs = [functools.partial(layer_output, lp, config) for lp in layers]

            def body(i: jax.Array, carry: tuple[jax.Array, kvc.LayerCache],
                     projections: list = projections, outputs: list = outputs
                     ) -> tuple[jax.Array, kvc.LayerCache]:
                x, group = carry
                heads, group = attention(group, i, *jax.lax.switch(i, projections, x, cos, sin))
                return jax.lax.switch(i, outputs, x, heads), group

            x, group = jax.lax.fori_loop(0, n, body, (x, group))
        groups.append(group)
    if out_index is not None:
        x = jnp.take_along_axis(x, out_index[:, None, None], axis=1)[:, 0]
    x = rms_norm(x, params.final_norm, config.rms_eps)
    head = params.embed if params.lm_head is None else params.lm_head
    if head is params.embed and not isinstance(head, (qw.QuantizedLinear, ggml.GGMLLinear)):
        logits = jnp.einsum("...d,vd->...v", x, head.astype(x.dtype),  # dense tied [V, D]
                            preferred_element_type=jnp.float32)
    else:  # [D, V]: an untied head, a quantized embedding (embedᵀ) or a GGUF [V, D] table
        logits = qw.linear(x, head).astype(jnp.float32)
    return logits, kvc.KVCache(tuple(groups))
