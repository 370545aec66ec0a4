"""Calibration for centred TurboQuant caches: per-layer, per-head key (pre-RoPE) and value means.

One forward pass over a short built-in text (prose and code written for this purpose, never an
evaluation text) with a dense cache, one layer at a time (one small compiled layer, run for
each layer in turn: no logits, no whole-model program); the cached keys are un-rotated to their
pre-RoPE form and averaged. The first tokens are skipped: attention-sink keys are atypical.
"""

from __future__ import annotations

import functools

import jax
import jax.numpy as jnp
import numpy as np

from tqjax.host import trim_heap
from tqjax.kv.cache import CacheSpec, Calibration, make_cache
from tqjax.kv.rope import apply_rope, rope_cos_sin
from tqjax.models.config import ModelConfig
from tqjax.models.transformer import (
    LayerStack,
    Params,
    as_stack,
    attention_heads,
    embed_tokens,
    layer_output,
    pick_layer,
    rms_norm,
)

SKIP_TOKENS = 4


def _pair_energy(x: jax.Array) -> jax.Array:
    """Mean energy of each RoPE pair (i, i + hd/2), x [..., N, hd] -> [..., hd/2]."""
    e = jnp.mean(x * x, axis=-2)
    half = e.shape[-1] // 2
    return e[..., :half] + e[..., half:]


@functools.partial(jax.jit, static_argnums=(2,))
def _layer_statistics(layers: LayerStack, i: jax.Array, config: ModelConfig, x: jax.Array,
                      inv_freq: jax.Array) -> tuple[jax.Array, jax.Array, jax.Array, jax.Array]:
    """Layer i (int32 scalar) over the calibration tokens: x [1, T, D] -> (its output
    [1, T, D], the key (pre-RoPE) and value means and the key channel scales, f32 [KV, hd]).
    One program for every layer of a stack, each linear compiled once per format it takes
    (`pick_layer`)."""
    lp = pick_layer(layers, i, range(len(layers)))
    t, kvh, hd = x.shape[1], config.num_kv_heads, config.head_dim
    cos, sin = rope_cos_sin(jnp.arange(t)[None], inv_freq)  # [1, T, hd/2]
    cache = make_cache(CacheSpec(), batch=1, slots=t, num_layers=1, kv_heads=kvh,
                       head_dim=hd).layer(0)
    heads, cache, q = attention_heads(lp, config, rms_norm(x, lp.attn_norm, config.rms_eps),
                                      cos[:, :, None], sin[:, :, None], jnp.zeros(1, jnp.int32),
                                      cache)
    x = layer_output(lp, config, x, heads)
    k = apply_rope(cache.k.data[0], cos[0], sin[0], inverse=True)[:, SKIP_TOKENS:]  # [KV, T', hd]
    k = k.astype(jnp.float32)
    kmean = jnp.mean(k, axis=1)
    qg = q[0, SKIP_TOKENS:].astype(jnp.float32).reshape(t - SKIP_TOKENS, kvh, -1, hd)
    qg = qg.transpose(1, 0, 2, 3).reshape(kvh, -1, hd)  # [KV, T'*G, hd]
    # s^2 = sqrt(E_k / E_q) per RoPE pair minimises E[((q*s) . (k/s) error)^2]
    ratio = _pair_energy(k - kmean[:, None]) / jnp.maximum(_pair_energy(qg), 1e-12)
    s = jnp.clip(ratio, 1e-12) ** 0.25
    s = jnp.clip(s / jnp.exp(jnp.mean(jnp.log(s), axis=-1, keepdims=True)), 1 / 16, 16)
    vmean = jnp.mean(cache.v.data[0, :, SKIP_TOKENS:].astype(jnp.float32), axis=1)
    return x, kmean, vmean, jnp.concatenate([s, s], axis=-1)


def calibrate(params: Params, config: ModelConfig, ids: list[int]) -> Calibration:
    """Key (pre-RoPE) and value means and key channel scales, f32 [L, KV, hd]."""
    x = embed_tokens(params.embed, jnp.asarray([ids], jnp.int32)).astype(params.final_norm.dtype)
    stats, layers = [], params.layers
    for i in range(len(layers)):  # one compiled layer, run layer by layer (no logits, no cache)
        # a stack's layer by its index; a list's layers alike, each as a stack of one
        stack, j = (layers, i) if isinstance(layers, LayerStack) else (as_stack([layers[i]]), 0)
        x, *layer = _layer_statistics(stack, jnp.int32(j), config, x, params.rope_inv_freq)
        stats.append([np.asarray(a) for a in layer])
    # a one-off program: dropped once it has run, since a compiled XLA:CPU program stays
    # resident (~4-5 KB per HLO instruction) for as long as it is cached
    _layer_statistics.clear_cache()
    # ... and its freed heap given back: the cache and decode buffers that follow are large
    # enough to be mmapped, so they would not reuse it (SmolLM2 turbo4, a 1000-token prompt:
    # the run's peak 1013-1047 MiB against 1060-1141 without)
    trim_heap()
    k, v, s = (np.stack(a) for a in zip(*stats, strict=True))
    return Calibration(k, v, s)
