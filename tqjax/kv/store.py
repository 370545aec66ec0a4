"""Per-layer storage of keys or values, one pytree type per cache format.

Every store holds `[B, KV, S, ...]` arrays for a batch `B`, `KV` heads and `S` cache slots and
implements three pure functions, dispatched on the store type:

- `write(store, x, start)`: x [B, KV, T, hd] written at slots start[b] .. start[b] + T - 1.
- `scores(store, q)`: q [B, KV, N, hd] -> q·k for every slot, f32 [B, KV, N, S].
- `mix(store, p)`: p f32 [B, KV, N, S] -> sum_s p[s] v[s], f32 [B, KV, N, hd].

Compressed stores never build a dequantized copy of the whole cache in `scores`/`mix`.
"""

from __future__ import annotations

import functools

import jax
import jax.numpy as jnp
from flax import struct


def write_rows(buf: jax.Array, new: jax.Array, start: jax.Array) -> jax.Array:
    """Write new [B, KV, T, ...] into buf [B, KV, S, ...] at slot start[b] per batch row."""

    def one(b: jax.Array, n: jax.Array, s: jax.Array) -> jax.Array:
        idx = (0, s) + (0,) * (b.ndim - 2)
        return jax.lax.dynamic_update_slice(b, n.astype(b.dtype), idx)

    return jax.vmap(one)(buf, new, start)


@struct.dataclass
class DenseStore:
    """Uncompressed store (f32, bf16 or f16)."""

    data: jax.Array  # [B, KV, S, hd]


@functools.singledispatch
def write(store: object, x: jax.Array, start: jax.Array) -> object:
    raise TypeError(f"no KV store implementation for {type(store).__name__}")


@functools.singledispatch
def scores(store: object, q: jax.Array) -> jax.Array:
    raise TypeError(f"no KV store implementation for {type(store).__name__}")


@functools.singledispatch
def mix(store: object, p: jax.Array) -> jax.Array:
    raise TypeError(f"no KV store implementation for {type(store).__name__}")


@write.register
def _(store: DenseStore, x: jax.Array, start: jax.Array) -> DenseStore:
    return DenseStore(write_rows(store.data, x, start))


@scores.register
def _(store: DenseStore, q: jax.Array) -> jax.Array:
    k = store.data.astype(q.dtype)
    return jnp.einsum("bknd,bksd->bkns", q, k, preferred_element_type=jnp.float32)


@mix.register
def _(store: DenseStore, p: jax.Array) -> jax.Array:
    v = store.data
    return jnp.einsum("bkns,bksd->bknd", p.astype(v.dtype), v,
                      preferred_element_type=jnp.float32)
