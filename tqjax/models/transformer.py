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


def _normed_qkv(lp: LayerParams, config: ModelConfig, x: jax.Array, cos: jax.Array,
                sin: jax.Array) -> tuple[jax.Array, jax.Array, jax.Array]:
    return qkv(lp, config, rms_norm(x, lp.attn_norm, config.rms_eps), cos, sin)


def layer_loop(params: Params, config: ModelConfig, x: jax.Array, cos: jax.Array,
               sin: jax.Array, start: jax.Array, cache: kvc.KVCache,
               valid: jax.Array | None = None) -> tuple[jax.Array, list[kvc.LayerCache]]:
    """The layers as one compiled body in a `fori_loop` (for `kvc.stackable` caches): x
    [B, T, D] -> (x after the last layer, the updated per-layer caches).

    Each layer's weights are picked by `lax.switch` (every branch reads its own arrays in
    place, any weight format); the caches are stacked over layers for the loop and split after
    it. Why: XLA:CPU keeps a compiled program resident at ~3-4 KB per optimized HLO
    instruction, and a turbo cache's attention is ~3x a dense one's in HLO; unrolled over
    SmolLM2's 30 layers its prefill and decode programs held 486 MB (f32 cache: 181 MB),
    about what the compressed cache saves (`scripts/research/program_memory.py`)."""
    t = x.shape[1]
    norms_qkv = [functools.partial(_normed_qkv, lp, config) for lp in params.layers]
    outputs = [functools.partial(layer_output, lp, config) for lp in params.layers]
    stacked = jax.tree.map(lambda *xs: jnp.stack(xs), *cache.layers)

    def layer(i: jax.Array, carry: tuple[jax.Array, kvc.LayerCache]
              ) -> tuple[jax.Array, kvc.LayerCache]:
        x, stacked = carry
        q, k, v = jax.lax.switch(i, norms_qkv, x, cos, sin)
        one = jax.tree.map(lambda a: jax.lax.dynamic_index_in_dim(a, i, keepdims=False), stacked)
        out, one = kvc.attend(one, q, k, v, start, valid=valid)
        stacked = jax.tree.map(lambda a, b: jax.lax.dynamic_update_index_in_dim(a, b, i, 0),
                               stacked, one)
        return jax.lax.switch(i, outputs, x, out.reshape(*x.shape[:1], t, -1)), stacked

    x, stacked = jax.lax.fori_loop(0, len(params.layers), layer, (x, stacked))
    return x, [jax.tree.map(lambda a, i=i: a[i], stacked) for i in range(len(params.layers))]


def forward(params: Params, config: ModelConfig, tokens: jax.Array, start: jax.Array,
            cache: kvc.KVCache, out_index: jax.Array | None = None,
            queries: list[jax.Array] | None = None, valid: jax.Array | None = None
            ) -> tuple[jax.Array, kvc.KVCache]:
    """Run a chunk of tokens through the model, reading and extending the KV cache.

    tokens int32 [B, T]; start int32 [B]: position of tokens[:, 0] per sequence (prefill: 0,
    decode: the current length). Returns f32 logits [B, T, V], or [B, V] taken at
    `out_index` int32 [B] when given, and the updated cache. A `queries` list, if given, is
    filled with every layer's post-RoPE queries [B, T, H, hd]. `valid` int32 [B]: the real
    tokens of each row's chunk (right-padded prefill; default T): only those enter the caches'
    recent-token rings, so each row's ring ends at its last real token, not in its padding.
    """
    dtype = params.final_norm.dtype
    x = embed_tokens(params.embed, tokens).astype(dtype)
    positions = start[:, None] + jnp.arange(tokens.shape[1])[None, :]
    cos, sin = rope_cos_sin(positions, params.rope_inv_freq)
    cos, sin = cos[:, :, None, :], sin[:, :, None, :]  # broadcast over heads
    if queries is None and kvc.stackable(cache):
        x, new_layers = layer_loop(params, config, x, cos, sin, start, cache, valid)
    else:
        new_layers = []
        for lp, layer_cache in zip(params.layers, cache.layers, strict=True):
            heads, layer_cache, q = attention_heads(
                lp, config, rms_norm(x, lp.attn_norm, config.rms_eps), cos, sin, start,
                layer_cache, valid)
            if queries is not None:
                queries.append(q)
            x = layer_output(lp, config, x, heads)
            new_layers.append(layer_cache)
    if out_index is not None:
        x = jnp.take_along_axis(x, out_index[:, None, None], axis=1)[:, 0]
    x = rms_norm(x, params.final_norm, config.rms_eps)
    head = params.embed if params.lm_head is None else params.lm_head
    if head is params.embed and not isinstance(head, (qw.QuantizedLinear, ggml.GGMLLinear)):
        logits = jnp.einsum("...d,vd->...v", x, head.astype(x.dtype),  # dense tied [V, D]
                            preferred_element_type=jnp.float32)
    else:  # [D, V]: an untied head, a quantized embedding (embedᵀ) or a GGUF [V, D] table
        logits = qw.linear(x, head).astype(jnp.float32)
    return logits, kvc.KVCache(new_layers)
