"""Rows of a KV cache: copy one sequence's cache out of a batch and back in.

Every array of a cache is one of three kinds (the rule `tqjax.kv.cache.bytes_per_token` uses):

- per-slot: a store field with ndim >= 3 other than `sink`, [B, KV, S, ...] (slot axis 2);
- per-row constants: a turbo store's dense `sink` slots [B, KV, n_sink, hd] and the
  recent-token ring (`RecentWindow`: k/v [B, KV, N, hd], pos [B, N]);
- per-layer constants (no batch axis): centres, rope frequencies, channel scales, rotations,
  codebooks, QJL matrices. They come from the spec, the calibration and the seed, never from a
  row: `put_row` keeps the target cache's.
"""

from __future__ import annotations

import jax
import jax.numpy as jnp

from tqjax.errors import TqjaxError
from tqjax.kv.cache import KVCache, LayerCache, RecentWindow


def _name(path: tuple) -> str:
    """The field name of a leaf's path inside a store ('' for a bare array)."""
    for key in reversed(path):
        if isinstance(key, jax.tree_util.GetAttrKey):
            return key.name
    return ""


def _kind(path: tuple, leaf: jax.Array) -> str:
    """'slot' (per-slot array, slot axis 2), 'row' (sink slots: batch axis 0, no slot axis) or
    'const' (per-layer constant) for a store leaf; nested stores are walked through."""
    if _name(path) == "sink":
        return "row"
    return "slot" if leaf.ndim >= 3 else "const"


def _map_store(fn: object, store: object, *rest: object) -> object:
    """tree_map over a store with fn(kind, leaf, *rest_leaves) (same structures)."""
    return jax.tree_util.tree_map_with_path(
        lambda path, x, *r: fn(_kind(path, x), x, *r), store, *rest)


def _static(store: object) -> tuple:
    """A store's layout (tree structure with static fields, and each leaf's kind, dtype,
    rank and non-slot shape), for compatibility checks."""
    leaves = jax.tree_util.tree_leaves_with_path(store)
    return (jax.tree_util.tree_structure(store),
            tuple((jax.tree_util.keystr(p), _kind(p, x), x.dtype.name, x.ndim,
                   x.shape if _kind(p, x) == "const" else (x.shape[1], *x.shape[3:]))
                  for p, x in leaves))


def _take_store(store: object, row: jax.Array) -> object:
    return _map_store(lambda kind, x: x if kind == "const" else
                      jax.lax.dynamic_slice_in_dim(x, row, 1, axis=0), store)


@jax.jit
def _take_row(cache: KVCache, row: jax.Array) -> KVCache:
    layers = []
    for layer in cache.layers:
        recent = layer.recent
        if recent is not None:
            recent = jax.tree_util.tree_map(
                lambda x: jax.lax.dynamic_slice_in_dim(x, row, 1, axis=0), recent)
        layers.append(LayerCache(_take_store(layer.k, row), _take_store(layer.v, row), recent))
    return KVCache(layers)


def _check_row(cache: KVCache, row: int) -> None:
    batch = jax.tree_util.tree_leaves(cache.layers[0].k)[0].shape[0]
    if not 0 <= row < batch:
        raise TqjaxError(f"cache row {row} out of range: the cache holds {batch} rows")


def take_row(cache: KVCache, row: int) -> KVCache:
    """A batch-1 copy of row `row` of `cache` (same slots; per-layer constants shared)."""
    _check_row(cache, row)
    return _take_row(cache, jnp.int32(row))


def _put_slots(buf: jax.Array, one: jax.Array, row: jax.Array) -> jax.Array:
    """one [1, ...] written into buf [B, ...] at (row, 0, 0, ...): fewer slots fill the first."""
    return jax.lax.dynamic_update_slice(buf, one.astype(buf.dtype),
                                        (row, *(0,) * (buf.ndim - 1)))


def _put_store(store: object, row: jax.Array, one: object) -> object:
    return _map_store(lambda kind, x, o: x if kind == "const" else _put_slots(x, o, row),
                      store, one)


def _put_ring(ring: RecentWindow, row: jax.Array, one: RecentWindow) -> RecentWindow:
    """Position p lives in ring slot p % N: a ring of another size is re-placed by position."""
    n, n1 = ring.pos.shape[1], one.pos.shape[1]
    if n1 == n:
        return jax.tree_util.tree_map(lambda b, o: _put_slots(b, o, row), ring, one)
    pos = one.pos[0]  # [N1]
    dest = jnp.where(pos >= 0, pos % n, n)  # n: out of range, dropped
    k = jnp.zeros(ring.k.shape[1:], ring.k.dtype).at[:, dest].set(one.k[0], mode="drop")
    v = jnp.zeros(ring.v.shape[1:], ring.v.dtype).at[:, dest].set(one.v[0], mode="drop")
    p = jnp.full((n,), -1, ring.pos.dtype).at[dest].set(pos, mode="drop")
    return RecentWindow(_put_slots(ring.k, k[None], row), _put_slots(ring.v, v[None], row),
                        _put_slots(ring.pos, p[None], row))


@jax.jit
def _put_row(cache: KVCache, row: jax.Array, one: KVCache) -> KVCache:
    layers = []
    for layer, src in zip(cache.layers, one.layers, strict=True):
        recent = None if layer.recent is None else _put_ring(layer.recent, row, src.recent)
        layers.append(LayerCache(_put_store(layer.k, row, src.k), _put_store(layer.v, row, src.v),
                                 recent))
    return KVCache(layers)


def check_compatible(cache: KVCache, one: KVCache) -> None:
    """Raise TqjaxError unless the batch-1 `one` fits a row of `cache`: same layers and store
    formats, at most as many slots (and ring/sink sizes within the target's)."""
    if len(one.layers) != len(cache.layers):
        raise TqjaxError(f"cache with {len(one.layers)} layers, the target has "
                         f"{len(cache.layers)}")
    if jax.tree_util.tree_leaves(one.layers[0].k)[0].shape[0] != 1:
        raise TqjaxError("put_row takes a batch-1 cache")
    if one.slots > cache.slots:
        raise TqjaxError(f"cache of {one.slots} slots does not fit a row of {cache.slots} slots")
    for i, (a, b) in enumerate(zip(cache.layers, one.layers, strict=True)):
        for part in ("k", "v"):
            sa, sb = getattr(a, part), getattr(b, part)
            if _static(sa) != _static(sb):
                raise TqjaxError(f"layer {i} {part}: cache store {type(sb).__name__} does not "
                                 f"match the target's {type(sa).__name__} (another cache type "
                                 f"or layout)")
        if (a.recent is None) != (b.recent is None):
            raise TqjaxError(f"layer {i}: recent-token window present in one cache only")


def put_row(cache: KVCache, row: int, one: KVCache) -> KVCache:
    """`cache` with row `row` replaced by the batch-1 cache `one` (same slots, or fewer slots
    written into the first ones; slots past them keep their old, invisible contents). Per-layer
    constants are the target's. A new cache is returned; `cache` is not donated."""
    _check_row(cache, row)
    check_compatible(cache, one)
    return _put_row(cache, jnp.int32(row), one)
