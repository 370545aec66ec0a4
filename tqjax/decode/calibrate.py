"""Calibration for centred TurboQuant caches: per-layer, per-head key (pre-RoPE) and value means.

One forward pass over a short built-in text (prose and code written for this purpose, never an
evaluation text) with a dense cache; the cached keys are un-rotated to their pre-RoPE form and
averaged. The first tokens are skipped: attention-sink keys are atypical.
"""

from __future__ import annotations

import functools

import jax
import jax.numpy as jnp
import numpy as np

from tqjax.kv.cache import CacheSpec, Calibration, make_cache
from tqjax.kv.rope import apply_rope, rope_cos_sin
from tqjax.models.config import ModelConfig
from tqjax.models.transformer import Params, forward

SKIP_TOKENS = 4


def _pair_energy(x: jax.Array) -> jax.Array:
    """Mean energy of each RoPE pair (i, i + hd/2), x [..., N, hd] -> [..., hd/2]."""
    e = jnp.mean(x * x, axis=-2)
    half = e.shape[-1] // 2
    return e[..., :half] + e[..., half:]


@functools.partial(jax.jit, static_argnums=(1,))
def _statistics(params: Params, config: ModelConfig,
                tokens: jax.Array) -> tuple[jax.Array, jax.Array, jax.Array]:
    t, kvh = tokens.shape[1], config.num_kv_heads
    cache = make_cache(CacheSpec(), batch=1, slots=t, num_layers=config.num_layers,
                       kv_heads=kvh, head_dim=config.head_dim)
    queries: list[jax.Array] = []
    _, cache = forward(params, config, tokens, jnp.zeros(1, jnp.int32), cache, queries=queries)
    cos, sin = rope_cos_sin(jnp.arange(t), params.rope_inv_freq)  # [T, hd/2]
    kmeans, vmeans, kscales = [], [], []
    for layer, q in zip(cache.layers, queries, strict=True):
        k = apply_rope(layer.k.data[0], cos, sin, inverse=True)[:, SKIP_TOKENS:]  # [KV, T', hd]
        k = k.astype(jnp.float32)
        kmean = jnp.mean(k, axis=1)
        qg = q[0, SKIP_TOKENS:].astype(jnp.float32).reshape(t - SKIP_TOKENS, kvh, -1,
                                                             config.head_dim)
        qg = qg.transpose(1, 0, 2, 3).reshape(kvh, -1, config.head_dim)  # [KV, T'*G, hd]
        # s^2 = sqrt(E_k / E_q) per RoPE pair minimises E[((q*s) . (k/s) error)^2]
        ratio = _pair_energy(k - kmean[:, None]) / jnp.maximum(_pair_energy(qg), 1e-12)
        s = jnp.clip(ratio, 1e-12) ** 0.25
        s = jnp.clip(s / jnp.exp(jnp.mean(jnp.log(s), axis=-1, keepdims=True)), 1 / 16, 16)
        kmeans.append(kmean)
        kscales.append(jnp.concatenate([s, s], axis=-1))
        vmeans.append(jnp.mean(layer.v.data[0, :, SKIP_TOKENS:].astype(jnp.float32), axis=1))
    return jnp.stack(kmeans), jnp.stack(vmeans), jnp.stack(kscales)


def calibrate(params: Params, config: ModelConfig, ids: list[int]) -> Calibration:
    """Key (pre-RoPE) and value means and key channel scales, f32 [L, KV, hd]."""
    k, v, s = _statistics(params, config, jnp.asarray([ids], jnp.int32))
    out = Calibration(np.asarray(k), np.asarray(v), np.asarray(s))
    # a one-off program: dropped once it has run, since a compiled XLA:CPU program stays
    # resident (~4-5 KB per HLO instruction: 40-60 MB here) for as long as it is cached
    _statistics.clear_cache()
    return out
