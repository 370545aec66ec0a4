"""The KV cache: one key store and one value store per layer, and attention over them."""

from __future__ import annotations

import dataclasses
from collections.abc import Callable

import jax
import jax.numpy as jnp
from flax import struct

from tqjax.errors import TqjaxError
from tqjax.kv import store as kvs

DENSE_DTYPES = {"f32": jnp.float32, "bf16": jnp.bfloat16, "f16": jnp.float16}


@dataclasses.dataclass(frozen=True)
class CacheSpec:
    """Cache formats for keys and values (e.g. "f32", "bf16", "turbo3")."""

    k: str = "f32"
    v: str = "f32"


@dataclasses.dataclass(frozen=True)
class StoreShape:
    """What a store constructor needs to know: sizes, layer index and rope frequencies."""

    batch: int
    kv_heads: int
    slots: int
    head_dim: int
    layer: int
    num_layers: int


StoreFactory = Callable[[StoreShape, bool], object]  # (shape, is_key) -> store


def _dense_factory(dtype: jnp.dtype) -> StoreFactory:
    def make(s: StoreShape, is_key: bool) -> kvs.DenseStore:
        return kvs.DenseStore(jnp.zeros((s.batch, s.kv_heads, s.slots, s.head_dim), dtype))

    return make


STORE_FACTORIES: dict[str, StoreFactory] = {
    name: _dense_factory(dtype) for name, dtype in DENSE_DTYPES.items()
}


@struct.dataclass
class LayerCache:
    k: object  # a key store from tqjax.kv.store
    v: object  # a value store


@struct.dataclass
class KVCache:
    layers: list[LayerCache]

    @property
    def slots(self) -> int:
        return jax.tree_util.tree_leaves(self.layers[0])[0].shape[2]


def check_spec(spec: CacheSpec) -> None:
    for name in (spec.k, spec.v):
        if name not in STORE_FACTORIES:
            raise TqjaxError(f"unknown cache type {name!r} "
                             f"(choose from: {', '.join(STORE_FACTORIES)})")


def make_cache(spec: CacheSpec, *, batch: int, slots: int, num_layers: int, kv_heads: int,
               head_dim: int) -> KVCache:
    """An empty cache of `slots` positions for `batch` sequences."""
    check_spec(spec)
    layers = []
    for i in range(num_layers):
        shape = StoreShape(batch, kv_heads, slots, head_dim, i, num_layers)
        layers.append(LayerCache(STORE_FACTORIES[spec.k](shape, True),
                                 STORE_FACTORIES[spec.v](shape, False)))
    return KVCache(layers)


def attend(layer: LayerCache, q: jax.Array, k: jax.Array, v: jax.Array,
           start: jax.Array) -> tuple[jax.Array, LayerCache]:
    """Write this chunk's keys/values, then causal attention over the whole cache.

    q [B, T, H, hd], k/v [B, T, KV, hd] (post-RoPE), start int32 [B]: slot of the chunk's
    first token per sequence. Slot s is visible to query t iff s <= start + t.
    Returns (out [B, T, H, hd] in q's dtype, updated layer).
    """
    b, t, h, hd = q.shape
    kvh = k.shape[2]
    g = h // kvh
    layer = LayerCache(kvs.write(layer.k, k.transpose(0, 2, 1, 3), start),
                       kvs.write(layer.v, v.transpose(0, 2, 1, 3), start))
    qg = q.reshape(b, t, kvh, g, hd).transpose(0, 2, 3, 1, 4).reshape(b, kvh, g * t, hd)
    s = kvs.scores(layer.k, qg) * (1.0 / hd**0.5)  # [B, KV, G*T, S]
    qpos = start[:, None] + jnp.tile(jnp.arange(t), g)[None, :]  # [B, G*T]
    visible = jnp.arange(s.shape[-1])[None, None, :] <= qpos[:, :, None]  # [B, G*T, S]
    s = jnp.where(visible[:, None], s, -jnp.inf)
    p = jax.nn.softmax(s, axis=-1)
    out = kvs.mix(layer.v, p)  # [B, KV, G*T, hd]
    out = out.reshape(b, kvh, g, t, hd).transpose(0, 3, 1, 2, 4).reshape(b, t, h, hd)
    return out.astype(q.dtype), layer
