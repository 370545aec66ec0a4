"""Key calibration for centred TurboQuant keys: per-layer, per-head pre-RoPE key means.

One forward pass over a short built-in text (prose and code written for this purpose, never an
evaluation text) with a dense cache; the cached keys are un-rotated to their pre-RoPE form and
averaged. The first tokens are skipped: attention-sink keys are atypical.
"""

from __future__ import annotations

import functools
from importlib import resources

import jax
import jax.numpy as jnp
import numpy as np

from tqjax.kv.cache import CacheSpec, make_cache
from tqjax.kv.rope import apply_rope, rope_cos_sin
from tqjax.models.config import ModelConfig
from tqjax.models.transformer import Params, forward

SKIP_TOKENS = 4


def calibration_text() -> str:
    return resources.files("tqjax.data").joinpath("calibration.txt").read_text(encoding="utf-8")


@functools.partial(jax.jit, static_argnums=(1,))
def _key_means(params: Params, config: ModelConfig, tokens: jax.Array) -> jax.Array:
    t = tokens.shape[1]
    cache = make_cache(CacheSpec(), batch=1, slots=t, num_layers=config.num_layers,
                       kv_heads=config.num_kv_heads, head_dim=config.head_dim)
    _, cache = forward(params, config, tokens, jnp.zeros(1, jnp.int32), cache)
    cos, sin = rope_cos_sin(jnp.arange(t), params.rope_inv_freq)  # [T, hd/2]
    means = []
    for layer in cache.layers:
        k = apply_rope(layer.k.data[0], cos, sin, inverse=True)  # [KV, T, hd] pre-RoPE
        means.append(jnp.mean(k[:, SKIP_TOKENS:].astype(jnp.float32), axis=1))
    return jnp.stack(means)


def key_centers(params: Params, config: ModelConfig, ids: list[int]) -> np.ndarray:
    """Pre-RoPE key means f32 [L, KV, hd] over calibration token ids."""
    return np.asarray(_key_means(params, config, jnp.asarray([ids], jnp.int32)))
