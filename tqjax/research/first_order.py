"""The first-order split of a weight quantization's NLL change (research; see docs/research.md).

ΔNLL = g·Δ + rest: g·Δ is the directional derivative of a text's NLL at the original weights
along the weight errors Δ = ŵ − w (one JVP per window), the rest grows like ‖Δ‖² and tracks KL.
Used by `scripts/weights_table.py --first-order`.
"""

from __future__ import annotations

import functools

import jax
import jax.numpy as jnp
import numpy as np

from tqjax.api import Model
from tqjax.decode.generate import new_cache
from tqjax.eval import _check_windows, window_logprobs
from tqjax.kv.cache import CacheSpec, KVCache
from tqjax.models.config import ModelConfig
from tqjax.models.quantize import get_path, linear_paths, set_paths
from tqjax.models.transformer import Params
from tqjax.quant.weights import QuantizedLinear, effective_weight


def weight_errors(params: Params, quantized: Params) -> dict[str, jax.Array]:
    """Δ = ŵ − w f32 of every weight `quantized` stores as a QuantizedLinear, by `linear_paths`
    name ([in, out]) and "embed" ([V, D], as params.embed); params holds the dense originals."""
    errors = {p: effective_weight(get_path(quantized, p)) - get_path(params, p)
              for p in linear_paths(quantized)
              if isinstance(get_path(quantized, p), QuantizedLinear)}
    if isinstance(quantized.embed, QuantizedLinear):
        errors["embed"] = effective_weight(quantized.embed).T - params.embed
    return errors


def _moved(params: Params, errors: dict[str, jax.Array], t: jax.Array) -> Params:
    """params with every weight w in `errors` replaced by w + t·Δ."""
    params = set_paths(params, {p: get_path(params, p) + t * d
                                for p, d in errors.items() if p != "embed"})
    if "embed" in errors:
        params = params.replace(embed=params.embed + t * errors["embed"])
    return params


@functools.partial(jax.jit, static_argnums=(1,))
def _nll_slope(params: Params, config: ModelConfig, errors: dict[str, jax.Array],
               tokens: jax.Array, cache: KVCache) -> jax.Array:
    """d/dt of the summed NLL of tokens int32 [1, T] under weights w + t·Δ, at t = 0."""
    def nll(t: jax.Array) -> jax.Array:
        return jnp.sum(window_logprobs(_moved(params, errors, t), config, tokens, cache)[1])

    return jax.jvp(nll, (jnp.float32(0.0),), (jnp.float32(1.0),))[1]


def first_order_nll(model: Model, quantized: Params, ids: list[int] | np.ndarray,
                    ctx: int) -> float:
    """g·Δ, nats per token: the first-order part of the mean NLL change on `ids` (the windows
    `sweep` uses) caused by the weight errors Δ of `quantized` against `model.params`.

    g is the gradient of this text's NLL at the original weights, so the sign of g·Δ is how the
    rounding happens to fall against this text: it is as likely to help as to hurt, and its
    size grows like ‖Δ‖ while the rest of the change (≈ the KL) grows like ‖Δ‖². The NLL
    change minus g·Δ is the part a more faithful quantization lowers.
    """
    ids = np.asarray(ids, np.int32)
    windows = _check_windows(model, len(ids), ctx)
    errors = weight_errors(model.params, quantized)
    cache = new_cache(model.params, model.config, CacheSpec(), 1, ctx, None)
    slope = sum(float(_nll_slope(model.params, model.config, errors,
                                 jnp.asarray(ids[None, w * ctx:(w + 1) * ctx]), cache))
                for w in range(windows))
    return slope / (windows * (ctx - 1))


