"""Per-layer storage of keys or values, one pytree type per cache format.

Every store holds `[B, KV, S, ...]` arrays for a batch `B`, `KV` heads and `S` cache slots and
implements four pure functions, dispatched on the store type:

- `write(store, x, start)`: x [B, KV, T, hd] written at slots start[b] .. start[b] + T - 1.
- `block(store, lo, size)`: the slots lo .. lo + size - 1 as a store of `size` slots (every
  per-slot array sliced along axis 2; per-layer constants such as sink slots kept whole).
- `scores(store, q, first)`: q [B, KV, N, hd] -> q·k for every slot, f32 [B, KV, N, S], where
  the store's slot i is cache slot first + i (a `block`; 0 for a whole store).
- `mix(store, p, first)`: p f32 [B, KV, N, S] -> sum_s p[s] v[s], f32 [B, KV, N, hd].
- `split_sink(store)` (optional): (the exact rows of its first slots, the store without
  them), so that attention folds those rows in once and scores the blocks without a select.

Attention (`tqjax.kv.cache.attend`) walks the live slots one `block` at a time, so `scores` and
`mix` only ever see one block: no store builds a dequantized copy of the whole cache.

A cache keeps its layers stacked (`tqjax.kv.cache.KVCache`), and the model reads one layer of
such a stack in place: each per-slot array of that layer's store is a `LayerSlab`, the whole
stack [L, B, KV, S, ...] with the layer's index, which `write_rows` updates and `slot_block`
reads at that layer (no copy of the layer's slots).
"""

from __future__ import annotations

import functools

import jax
import jax.numpy as jnp
from flax import struct


@struct.dataclass
class LayerSlab:
    """One layer of a per-slot array stacked over layers: data [L, B, KV, S, ...] at layer
    `layer` (int32 scalar); it reads as an array of shape [B, KV, S, ...]."""

    data: jax.Array  # [L, B, KV, S, ...]
    layer: jax.Array  # int32 []

    @property
    def shape(self) -> tuple[int, ...]:
        return self.data.shape[1:]

    @property
    def ndim(self) -> int:
        return self.data.ndim - 1

    @property
    def dtype(self) -> jnp.dtype:
        return self.data.dtype

    def value(self) -> jax.Array:
        """The layer's array [B, KV, S, ...] (a copy)."""
        return jax.lax.dynamic_index_in_dim(self.data, self.layer, keepdims=False)


def _slab_parts(x: jax.Array | LayerSlab) -> tuple[jax.Array, tuple]:
    """(the array to index, the leading index): a LayerSlab's stack and (layer,), else x and ()."""
    return (x.data, (x.layer,)) if isinstance(x, LayerSlab) else (x, ())


def write_rows(buf: jax.Array | LayerSlab, new: jax.Array, start: jax.Array
               ) -> jax.Array | LayerSlab:
    """Write new [B, KV, T, ...] into buf [B, KV, S, ...] at slot start[b] per batch row.

    One `dynamic_update_slice` per row (B is static and small): each updates the donated
    buffer in place, where a vmapped update would become a scatter. A `LayerSlab` is written
    at its layer, in place in the whole stack."""
    data, lead = _slab_parts(buf)
    tail = (0,) * (new.ndim - 3)
    for b in range(new.shape[0]):
        row = new[b:b + 1].astype(data.dtype).reshape((1,) * len(lead) + new[b:b + 1].shape)
        data = jax.lax.dynamic_update_slice(data, row, (*lead, b, 0, start[b], *tail))
    return LayerSlab(data, buf.layer) if lead else data


def slot_block(x: jax.Array | LayerSlab, lo: jax.Array, size: int) -> jax.Array:
    """Slots lo .. lo + size - 1 of a per-slot array x [B, KV, S, ...] (lo + size <= S)."""
    data, lead = _slab_parts(x)
    shape = x.shape  # [B, KV, S, ...] (a LayerSlab's per-layer shape)
    block = jax.lax.dynamic_slice(data, (*lead, 0, 0, lo, *(0,) * (len(shape) - 3)),
                                  (*(1,) * len(lead), *shape[:2], size, *shape[3:]))
    return block.reshape(*shape[:2], size, *shape[3:])


@struct.dataclass
class DenseStore:
    """Uncompressed store (f32, bf16 or f16). A bf16 store holds its values' bits (uint16):
    XLA:CPU computes bf16 slices and updates in f32, converting the layer's whole stack there
    and back at every layer and step (a bf16 cache decoded ~15x slower than f32 at 4k slots);
    on the bits they stay in place, and each block is read as bf16 (`values`)."""

    data: jax.Array  # [B, KV, S, hd] f32 / f16, or uint16: bf16 bits

    @staticmethod
    def empty(shape: tuple[int, ...], dtype: jnp.dtype) -> DenseStore:
        """Zeros [B, KV, S, hd] of `dtype`."""
        bf16 = jnp.dtype(dtype) == jnp.bfloat16
        return DenseStore(jnp.zeros(shape, jnp.uint16 if bf16 else dtype))

    @property
    def bf16(self) -> bool:
        """Whether the store holds bf16 values as their bits (its data is uint16)."""
        return self.data.dtype == jnp.uint16

    def values(self) -> jax.Array:
        """The stored values in their own dtype [B, KV, S, hd] (bf16 from its bits)."""
        data = self.data.value() if isinstance(self.data, LayerSlab) else self.data
        return jax.lax.bitcast_convert_type(data, jnp.bfloat16) if self.bf16 else data

    def encode(self, x: jax.Array) -> jax.Array:
        """x [..., hd] as this store holds values (its dtype; bf16 as bits)."""
        if self.bf16:
            return jax.lax.bitcast_convert_type(x.astype(jnp.bfloat16), jnp.uint16)
        return x.astype(self.data.dtype)


@functools.singledispatch
def write(store: object, x: jax.Array, start: jax.Array) -> object:
    raise TypeError(f"no KV store implementation for {type(store).__name__}")


@functools.singledispatch
def block(store: object, lo: jax.Array, size: int) -> object:
    raise TypeError(f"no KV store implementation for {type(store).__name__}")


@functools.singledispatch
def scores(store: object, q: jax.Array, first: jax.Array | int = 0) -> jax.Array:
    raise TypeError(f"no KV store implementation for {type(store).__name__}")


@functools.singledispatch
def mix(store: object, p: jax.Array, first: jax.Array | int = 0) -> jax.Array:
    raise TypeError(f"no KV store implementation for {type(store).__name__}")


@functools.singledispatch
def split_sink(store: object) -> tuple[jax.Array | None, object]:
    """(rows, store'): the exact rows [B, KV, n, hd] the store keeps for its first n slots
    (which its `scores`/`mix` use there), and the same store without them, for blocks that
    attention masks below slot n. Stores without exact slots: (None, store)."""
    return None, store


@write.register
def _(store: DenseStore, x: jax.Array, start: jax.Array) -> DenseStore:
    return store.replace(data=write_rows(store.data, store.encode(x), start))


@block.register
def _(store: DenseStore, lo: jax.Array, size: int) -> DenseStore:
    return store.replace(data=slot_block(store.data, lo, size))


@scores.register
def _(store: DenseStore, q: jax.Array, first: jax.Array | int = 0) -> jax.Array:
    k = store.values().astype(q.dtype)
    return jnp.einsum("bknd,bksd->bkns", q, k, preferred_element_type=jnp.float32)


@mix.register
def _(store: DenseStore, p: jax.Array, first: jax.Array | int = 0) -> jax.Array:
    # v read in p's dtype (f32), as `scores` reads k in q's: p keeps its f32 precision
    return jnp.einsum("bkns,bksd->bknd", p, store.values().astype(p.dtype),
                      preferred_element_type=jnp.float32)
