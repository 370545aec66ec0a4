"""The KV cache: one key store and one value store per layer, and attention over them.

Cache formats (`--cache-type-k/-v`): dense `f32`/`bf16`/`f16`; baselines `q8` (int8 absmax per
token and head), `q8_0` (int8, one fp16 scale per 32 values, llama.cpp's Q8_0), `q4` (affine
4-bit, groups of 32), `q4_0` (llama.cpp's symmetric Q4_0, blocks of 32) and `q4_0h` (Q4_0 of the
Walsh–Hadamard-rotated head vector, as llama.cpp rotates quantized caches); TurboQuant
`turbo2`/`turbo3`/`turbo4`, the fractional `turbo2.5`/`turbo3.5` (half the rotated channels one
bit higher) and `turbo2-prod`..`turbo4-prod` (TurboQuant_prod: one of the bits is a QJL residual
sign). Every turbo format stores one fp16 scale per vector (prod: two). Turbo stores are
robust by default: keys centred and channel-balanced, values centred (per-layer statistics from a
calibration pass), the first 4 positions kept dense (`tqjax.kv.quantized`), and every query
sees its 32 most recent keys and values exactly (`RecentWindow`). With `baseline_aids` the q8/q4
baselines get the same aids under the same switches (`tqjax.kv.quantized.AidedStore`), for
comparisons at equal help.

Attention on the XLA path (`blockwise_attention`) walks the live slots in blocks of `BLOCK`
(decode: `DECODE_BLOCK` over the live length rounded to them) with an online softmax, so
its cost and memory follow the longest live sequence, not the allocated slots, and no store is
ever dequantized whole.
"""

from __future__ import annotations

import dataclasses
from collections.abc import Callable

import jax
import jax.numpy as jnp
import numpy as np
from flax import struct

from tqjax.dtypes import DTYPES, SHORT_NAMES
from tqjax.errors import TqjaxError, is_int
from tqjax.kv import store as kvs
from tqjax.kv.quantized import (
    SCALE_DTYPE,
    AidedStore,
    HadamardStore,
    Int4Store,
    Int8Store,
    Q40Store,
    TurboStore,
    pack_codes,
)
from tqjax.pallas import turbo_attention
from tqjax.pallas.backend import resolve as resolve_backend
from tqjax.quant.turboquant import make_prod_quantizer, make_split_quantizer

DENSE_DTYPES = {short: DTYPES[full] for short, full in SHORT_NAMES.items()}
BLOCK = 512  # cache slots per step of the XLA attention loop
# a few query rows (decode) first take steps of DECODE_BLOCK slots over the live length
# rounded to them, then BLOCK-sized steps for the rest: on this 2-core CPU an 8k-slot decode
# attention costs 1.40 ms in 2048-slot steps vs 1.97 ms in 512-slot steps (f32; turbo4 1.82
# vs 2.41 ms), while a short live length in a large cache still reads only BLOCK-sized steps
DECODE_BLOCK = 2048
DECODE_ROWS = 16  # at most this many query rows per KV head take the large steps
NEG = -1e30  # masked score; finite so that exp(NEG − m) is 0 without inf − inf
Window = tuple[jax.Array, jax.Array, jax.Array]  # exact recent keys, values f32, positions


@dataclasses.dataclass(frozen=True)
class CacheSpec:
    """Cache formats for keys and values (e.g. "f32", "q8", "turbo3"); `v` defaults to `k`, so
    CacheSpec("turbo4") is turbo4 keys and values, as the string "turbo4" is (`parse_kv`).

    center_keys: centre turbo keys on calibrated pre-RoPE means (the robust default).
    center_values: centre turbo values on calibrated means (exact: softmax weights sum to 1).
    balance_keys: per-channel key scales absorbed into the query, q·k = (q∘s)·(k/s), s from
        calibration, to even out key/query channel energies before rotation.
    sink_tokens: the first N positions of turbo stores are kept dense (attention sinks); a
        fixed cost of N·KV·hd fp16 values per layer, independent of the context length.
    recent_tokens: layers with a turbo store also keep dense fp16 copies of the last N
        positions (a ring buffer), and each query attends to its N most recent tokens
        exactly; a fixed cost of 2·N·KV·hd fp16 values per layer.
    boundary_layers: the first and last N layers keep `boundary_type` instead.
    baseline_aids: the q8/q4 baseline stores get the aids above too (each under its switch);
        off by default, so that `q8_0`/`q4_0` are the formats llama.cpp users know.
    """

    k: str = "f32"
    v: str = None  # type: ignore[assignment]  # None -> k (__post_init__)
    center_keys: bool = True
    center_values: bool = True
    balance_keys: bool = True
    boundary_layers: int = 0
    boundary_type: str = "q8"
    sink_tokens: int = 4
    recent_tokens: int = 32
    seed: int = 0
    baseline_aids: bool = False

    def __post_init__(self) -> None:
        if self.v is None:
            object.__setattr__(self, "v", self.k)

    def aided(self, name: str) -> bool:
        """Whether a store of type `name` gets the aids (centring, balancing, sinks, window)."""
        return name.startswith("turbo") or (self.baseline_aids and name in BASELINES)

    @property
    def needs_calibration(self) -> bool:
        types = {(self.k, self.v)}
        if self.boundary_layers:
            types.add((self.boundary_type, self.boundary_type))
        return any(((self.center_keys or self.balance_keys) and self.aided(k))
                   or (self.center_values and self.aided(v)) for k, v in types)


# CacheSpec options that switch every robustness step off: an ablation for study
# (`scripts/kv_table.py`'s `:naive` flag; from Python, `CacheSpec(k, v, **NAIVE)`)
NAIVE = {"center_keys": False, "center_values": False, "balance_keys": False, "sink_tokens": 0,
         "recent_tokens": 0}


@dataclasses.dataclass(frozen=True, eq=False)
class Calibration:
    """Per-layer means from a calibration pass, f32 [L, KV, hd]; keys before RoPE."""

    key_mean: np.ndarray
    value_mean: np.ndarray
    key_scale: np.ndarray  # per RoPE pair (both halves equal), geometric mean 1 per head


@dataclasses.dataclass(frozen=True)
class StoreShape:
    """What a store constructor needs: sizes, layer, and key centring data."""

    batch: int
    kv_heads: int
    slots: int
    head_dim: int
    layer: int
    seed: int = 0
    sink_tokens: int = 0
    center: np.ndarray | None = None  # [KV, hd] centre (keys: pre-RoPE), when centring
    inv_freq: np.ndarray | None = None  # [hd/2]: set for keys, whose centre follows RoPE
    chan_scale: np.ndarray | None = None  # [KV, hd] key channel scales (balanced keys)


StoreFactory = Callable[[StoreShape], object]


def _dense_factory(dtype: jnp.dtype) -> StoreFactory:
    def make(s: StoreShape) -> kvs.DenseStore:
        return kvs.DenseStore.empty((s.batch, s.kv_heads, s.slots, s.head_dim), dtype)

    return make


def _blocks(s: StoreShape, name: str, group: int = 32) -> int:
    """Blocks of `group` channels per head vector (a one-line error if they do not tile it)."""
    if s.head_dim % group:
        raise TqjaxError(f"{name} cache needs a head dim divisible by {group}, got {s.head_dim}")
    return s.head_dim // group


def _int8_factory(group: int | None) -> StoreFactory:
    """Symmetric int8, one scale per `group` channels (None: per head vector, q8)."""
    def make(s: StoreShape) -> Int8Store:
        g = group or s.head_dim
        lead = (s.batch, s.kv_heads, s.slots)
        return Int8Store(jnp.zeros((*lead, s.head_dim), jnp.int8),
                         jnp.zeros((*lead, _blocks(s, "q8_0", g)), SCALE_DTYPE), g)

    return make


def _q40_factory(s: StoreShape) -> Q40Store:
    lead = (s.batch, s.kv_heads, s.slots)
    return Q40Store(jnp.zeros((*lead, s.head_dim // 2), jnp.uint8),
                    jnp.zeros((*lead, _blocks(s, "q4_0")), SCALE_DTYPE))


def _hadamard_factory(inner: StoreFactory) -> StoreFactory:
    def make(s: StoreShape) -> HadamardStore:
        if s.head_dim & (s.head_dim - 1):
            raise TqjaxError(f"a Hadamard-rotated cache needs a power-of-two head dim, got "
                             f"{s.head_dim}")
        return HadamardStore(inner(s))

    return make


def _int4_factory(s: StoreShape) -> Int4Store:
    lead, groups = (s.batch, s.kv_heads, s.slots), _blocks(s, "q4")
    scales = (*lead, groups)  # step and lo: two buffers, the decode step donates each
    return Int4Store(jnp.zeros((*lead, s.head_dim // 2), jnp.uint8),
                     jnp.zeros(scales, SCALE_DTYPE), jnp.zeros(scales, SCALE_DTYPE))


def _own_copy(x: np.ndarray | None) -> jax.Array | None:
    """f32 device copy of a host constant. Always a copy: jnp.asarray may alias numpy memory,
    and the decode step donates every cache buffer, so none may be shared (across layers)."""
    return None if x is None else jnp.array(x, jnp.float32, copy=True)


def _aid_fields(s: StoreShape) -> dict[str, jax.Array | None]:
    """The aids' per-layer arrays (turbo and aided baselines alike): centre, rope frequencies,
    channel scales, and fp16 sink slots [B, KV, n_sink, hd] (None where off)."""
    return dict(center=_own_copy(s.center), inv_freq=_own_copy(s.inv_freq),
                chan_scale=_own_copy(s.chan_scale),
                sink=jnp.zeros((s.batch, s.kv_heads, s.sink_tokens, s.head_dim), SCALE_DTYPE)
                if s.sink_tokens else None)


def _turbo_factory(bits: int, half: bool, prod: bool = False) -> StoreFactory:
    name = f"turbo{bits}{'.5' if half else ''}{'-prod' if prod else ''}"

    def make(s: StoreShape) -> TurboStore:
        seed = s.seed * 7919 + s.layer
        lead = (s.batch, s.kv_heads, s.slots)
        if prod:  # (bits-1)-bit MSE code + 1 QJL sign bit per channel
            pq = make_prod_quantizer(s.head_dim, bits, seed=seed)
            q, extra = pq.mse, dict(qjl=pq.qjl,
                                    qjl_signs=jnp.zeros((*lead, s.head_dim // 8), jnp.uint8),
                                    qjl_norm=jnp.zeros(lead, SCALE_DTYPE))
        else:
            q = make_split_quantizer(s.head_dim, bits, s.head_dim // 2 if half else 0, seed=seed)
            extra = {}
        try:
            nbytes = pack_codes(q, jnp.zeros((1, s.head_dim), jnp.uint8)).shape[-1]
        except TqjaxError as e:  # (the packing's own words name neither the type nor the dim)
            raise TqjaxError(f"{name} cache cannot pack a head dim of {s.head_dim} into whole "
                             f"bytes ({e})") from None
        return TurboStore(jnp.zeros((*lead, nbytes), jnp.uint8), jnp.zeros(lead, SCALE_DTYPE),
                          q, **_aid_fields(s), **extra)

    return make


STORE_FACTORIES: dict[str, StoreFactory] = {
    **{name: _dense_factory(dtype) for name, dtype in DENSE_DTYPES.items()},
    "q8": _int8_factory(None),
    "q8_0": _int8_factory(32),
    "q4": _int4_factory,
    "q4_0": _q40_factory,
    "q4_0h": _hadamard_factory(_q40_factory),
    **{f"turbo{b}{h}": _turbo_factory(b, bool(h)) for b in (2, 3, 4) for h in ("", ".5")},
    **{f"turbo{b}-prod": _turbo_factory(b, False, prod=True) for b in (2, 3, 4)},
}


BASELINES = ("q8", "q8_0", "q4", "q4_0", "q4_0h")  # the stores `baseline_aids` applies to


def _with_aids(store: object, s: StoreShape) -> object:
    """A baseline store wrapped with the aids `s` asks for (itself when none)."""
    fields = _aid_fields(s)
    return store if all(v is None for v in fields.values()) else AidedStore(store, **fields)


@struct.dataclass
class RecentWindow:
    """Dense copies of each sequence's most recent keys and values; position p lives in ring
    slot p % N, so a chunk overwrites the oldest entries."""

    k: jax.Array  # [B, KV, N, hd] f16
    v: jax.Array  # [B, KV, N, hd] f16
    pos: jax.Array  # [B, N] int32 position held by each ring slot, -1 = empty


@struct.dataclass
class LayerCache:
    k: object  # a key store from tqjax.kv.store
    v: object  # a value store
    recent: RecentWindow | None = None


def slot_field(name: str, ndim: int) -> bool:
    """Whether a store's field `name` of per-layer rank `ndim` is a per-slot array
    [B, KV, S, ...]: any of rank >= 3 but the sink slots [B, KV, n_sink, hd]."""
    return name != "sink" and ndim >= 3


def slot_leaf(path: tuple, ndim: int) -> bool:
    """Whether a LayerCache leaf at `path` (of per-layer rank `ndim`) is a per-slot array: a
    `slot_field` of its key or value store (the recent-token ring is not)."""
    names = [k.name for k in path if isinstance(k, jax.tree_util.GetAttrKey)]
    return bool(names) and names[0] in ("k", "v") and slot_field(names[-1], ndim)


def _signature(layer: LayerCache) -> tuple:
    leaves, tree = jax.tree_util.tree_flatten(layer)
    return tree, tuple((x.shape, x.dtype) for x in leaves)


def group_size(group: LayerCache) -> int:
    """Layers in a stacked group (the leading axis of its arrays)."""
    return jax.tree_util.tree_leaves(group)[0].shape[0]


@struct.dataclass
class KVCache:
    """Every layer's cache, stored stacked: `groups` are the runs of consecutive layers whose
    caches have the same formats and shapes (all layers, unless boundary layers take another
    format), each one `LayerCache` whose arrays have a leading layer axis [n, ...]. The model
    runs each run of layers as one compiled layer body that reads and writes its layer of the
    stack in place (`tqjax.models.transformer.forward`)."""

    groups: tuple[LayerCache, ...]

    @classmethod
    def from_layers(cls, layers: list[LayerCache]) -> KVCache:
        """The stacked cache of per-layer caches (a copy: each run of alike layers stacked)."""
        return cls(tuple(jax.tree.map(lambda *xs: jnp.stack(xs), *run)
                         for run in _runs(layers)))

    @property
    def num_layers(self) -> int:
        return sum(group_size(g) for g in self.groups)

    @property
    def slots(self) -> int:
        return jax.tree_util.tree_leaves(self.groups[0].k)[0].shape[3]

    @property
    def kv_heads(self) -> int:
        return jax.tree_util.tree_leaves(self.groups[0].k)[0].shape[2]

    @property
    def batch(self) -> int:
        return jax.tree_util.tree_leaves(self.groups[0].k)[0].shape[1]

    def layer(self, i: int) -> LayerCache:
        """Layer i's cache (per-layer arrays; outside jit each is a copy); i < 0 counts from
        the end."""
        if not -self.num_layers <= i < self.num_layers:
            raise IndexError(i)
        i %= self.num_layers
        for g in self.groups:
            n = group_size(g)
            if i < n:
                return jax.tree.map(lambda a, i=i: a[i], g)
            i -= n
        raise IndexError(i)

    @property
    def layers(self) -> list[LayerCache]:
        """Every layer's cache (`layer`); for inspection and tests: outside jit, a copy."""
        return [self.layer(i) for i in range(self.num_layers)]


def _runs(layers: list[LayerCache]) -> list[list[LayerCache]]:
    """Consecutive layers with equal structure, shapes and dtypes, grouped."""
    runs: list[list[LayerCache]] = []
    for layer in layers:
        if runs and _signature(runs[-1][0]) == _signature(layer):
            runs[-1].append(layer)
        else:
            runs.append([layer])
    return runs


def layer_view(group: LayerCache, i: jax.Array | int) -> LayerCache:
    """Layer i of a stacked group, for `attend`: its per-slot arrays are `LayerSlab`s of the
    whole stack (read and written in place at layer i), the rest (sink slots, ring, constants:
    small) indexed out."""
    i = jnp.asarray(i, jnp.int32)
    return jax.tree_util.tree_map_with_path(
        lambda path, x: kvs.LayerSlab(x, i) if slot_leaf(path, x.ndim - 1)
        else jax.lax.dynamic_index_in_dim(x, i, keepdims=False), group)


def layer_update(group: LayerCache, view: LayerCache, i: jax.Array | int,
                 before: LayerCache) -> LayerCache:
    """The group with layer i replaced by `view`, what `attend` returned for the `layer_view`
    `before`: leaves it returned unchanged (the very same arrays: centres, codebooks,
    rotations) are not written back."""
    return jax.tree.map(
        lambda g, v, b: v.data if isinstance(v, kvs.LayerSlab) else g if v is b
        else jax.lax.dynamic_update_index_in_dim(g, v, i, 0), group, view, before)


def concrete(store: object) -> object:
    """A store with every `LayerSlab` replaced by its layer's array (a copy)."""
    return jax.tree.map(lambda x: x.value() if isinstance(x, kvs.LayerSlab) else x, store,
                        is_leaf=lambda x: isinstance(x, kvs.LayerSlab))


def check_spec(spec: CacheSpec) -> None:
    for name in (spec.k, spec.v, spec.boundary_type):
        if name not in STORE_FACTORIES:
            hint = " (turbo bits: 2, 3 or 4, optionally .5)" if name.startswith("turbo") else ""
            raise TqjaxError(f"unknown cache type {name!r}{hint} "
                             f"(choose from: {', '.join(STORE_FACTORIES)})")
    for name in ("boundary_layers", "sink_tokens", "recent_tokens", "seed"):
        if not is_int(getattr(spec, name)):
            raise TqjaxError(f"cache {name.replace('_', ' ')} must be an integer, got "
                             f"{getattr(spec, name)!r}")
    if spec.seed < 0:  # (numpy's generators take no negative seed)
        raise TqjaxError(f"the cache's rotation seed must be >= 0, got {spec.seed}")
    if spec.boundary_layers < 0:
        raise TqjaxError(f"boundary layers must be >= 0, got {spec.boundary_layers}")
    if spec.sink_tokens < 0 or spec.recent_tokens < 0:
        raise TqjaxError(f"sink and recent tokens must be >= 0, got {spec.sink_tokens} and "
                         f"{spec.recent_tokens}")


def layer_types(spec: CacheSpec, num_layers: int) -> list[tuple[str, str]]:
    """(key type, value type) per layer, boundary layers applied; a TqjaxError where the
    boundary layers would be every layer (the asked types then in none)."""
    n = spec.boundary_layers
    if n and 2 * n >= num_layers:
        raise TqjaxError(f"{n} boundary layers at each end would be all {num_layers} layers, "
                         f"none of them {spec.k}/{spec.v} (at most {(num_layers - 1) // 2})")
    return [(spec.boundary_type, spec.boundary_type) if i < n or i >= num_layers - n
            else (spec.k, spec.v) for i in range(num_layers)]


def make_cache(spec: CacheSpec, *, batch: int, slots: int, num_layers: int, kv_heads: int,
               head_dim: int, calibration: Calibration | None = None,
               inv_freq: np.ndarray | None = None) -> KVCache:
    """An empty cache of `slots` positions for `batch` sequences.

    `calibration` and the rope frequencies inv_freq [hd/2] are needed when
    `spec.needs_calibration`.
    """
    check_spec(spec)
    if spec.needs_calibration and calibration is None:
        raise TqjaxError("centred keys/values (turbo, or baselines with aids) need a "
                         "calibration pass")
    layers = []
    for i, (kt, vt) in enumerate(layer_types(spec, num_layers)):
        # per-slot arrays are built with one slot and allocated stacked below, once
        plain = StoreShape(batch, kv_heads, 1, head_dim, i, spec.seed)
        stores = []
        for name, keys in ((kt, True), (vt, False)):
            if not spec.aided(name):
                stores.append(STORE_FACTORIES[name](plain))
                continue
            shape = dataclasses.replace(plain, sink_tokens=min(spec.sink_tokens, slots))
            if keys:
                shape = dataclasses.replace(
                    shape, center=calibration.key_mean[i] if spec.center_keys else None,
                    inv_freq=inv_freq if spec.center_keys else None,
                    chan_scale=calibration.key_scale[i] if spec.balance_keys else None)
            elif spec.center_values:
                shape = dataclasses.replace(shape, center=calibration.value_mean[i])
            stores.append(STORE_FACTORIES[name](shape) if name.startswith("turbo")
                          else _with_aids(STORE_FACTORIES[name](plain), shape))
        recent = None
        n = min(spec.recent_tokens, slots)
        if n and (spec.aided(kt) or spec.aided(vt)):
            ring = (batch, kv_heads, n, head_dim)  # two buffers: the decode step donates each
            recent = RecentWindow(jnp.zeros(ring, SCALE_DTYPE), jnp.zeros(ring, SCALE_DTYPE),
                                  jnp.full((batch, n), -1, jnp.int32))
        layers.append(LayerCache(*stores, recent))

    def stack(path: tuple, *xs: jax.Array) -> jax.Array:
        if slot_leaf(path, xs[0].ndim):  # every store starts with zeros in its slots
            return jnp.zeros((len(xs), *xs[0].shape[:2], slots, *xs[0].shape[3:]), xs[0].dtype)
        return jnp.stack(xs)

    return KVCache(tuple(jax.tree_util.tree_map_with_path(stack, *run) for run in _runs(layers)))


def bytes_per_token(cache: KVCache) -> float:
    """Stored bytes per token slot, all layers, K+V: every per-slot array ([B, KV, S, ...],
    `slot_leaf`); per-layer constants (sink slots, centres, rotations, codebooks) are not
    included."""
    return sum(x.nbytes for g in cache.groups
               for p, x in jax.tree_util.tree_leaves_with_path(g) if slot_leaf(p, x.ndim - 1)
               ) / cache.slots


def constant_bytes(cache: KVCache) -> int:
    """Bytes that do not grow with the context: sink slots, recent-token rings, centres,
    rotations, codebooks."""
    return sum(x.nbytes for x in jax.tree_util.tree_leaves(cache)) - int(
        bytes_per_token(cache) * cache.slots)


def _window_candidates(recent: RecentWindow, k: jax.Array, v: jax.Array, start: jax.Array
                       ) -> tuple[jax.Array, jax.Array, jax.Array, jax.Array]:
    """The exact keys/values a chunk k/v [B, KV, T, hd] at slots start.. can see besides the
    cache: the ring's run of consecutive positions ending at start − 1, then the chunk.

    Returns keys and values f32 [B, KV, N+T, hd], their positions int32 [B, N+T] (-1: none)
    and lo int32 [B], the first position of that exact run (ring entries at or beyond start are
    stale: a shorter sequence of a ragged batch re-writing its padded tail).
    """
    n, t = recent.pos.shape[1], k.shape[2]
    back = start[:, None] - 1 - jnp.arange(n)[None, :]  # [B, N]: start-1, start-2, ...
    held = jnp.take_along_axis(recent.pos, jnp.mod(back, n), axis=1) == back
    run = jnp.sum(jnp.cumprod(held & (back >= 0), axis=1), axis=1)  # [B]
    lo = start - run
    ring_pos = jnp.where((recent.pos >= lo[:, None]) & (recent.pos < start[:, None]),
                         recent.pos, -1)
    pos = jnp.concatenate([ring_pos, start[:, None] + jnp.arange(t)[None, :]], axis=1)
    # the chunk rounded like the ring, so a prompt gives the same result in one chunk or many
    keys = jnp.concatenate([recent.k, k.astype(recent.k.dtype)], axis=2).astype(jnp.float32)
    values = jnp.concatenate([recent.v, v.astype(recent.v.dtype)], axis=2).astype(jnp.float32)
    return keys, values, pos, lo


def _write_window(recent: RecentWindow, k: jax.Array, v: jax.Array, start: jax.Array,
                  valid: jax.Array | None = None) -> RecentWindow:
    """Ring after writing the chunk k/v [B, KV, T, hd] at positions start..start+T-1.

    valid int32 [B]: the real tokens of each row's chunk (default T); only the first valid[b]
    are written, so a right-padded prefill leaves each row's last real tokens in its ring, not
    its padding (a row with valid 0 keeps its ring as it was)."""
    n, t = recent.pos.shape[1], k.shape[2]
    last = t if valid is None else valid[:, None]
    # ring slot r takes the chunk's last real token whose position is r modulo n
    src = last - 1 - jnp.mod(start[:, None] + last - 1 - jnp.arange(n)[None, :], n)  # [B, N]
    take, idx = src >= 0, jnp.clip(src, 0)[:, None, :, None]

    def put(ring: jax.Array, x: jax.Array) -> jax.Array:
        new = jnp.take_along_axis(x, idx, axis=2).astype(ring.dtype)
        return jnp.where(take[:, None, :, None], new, ring)

    return RecentWindow(put(recent.k, k), put(recent.v, v),
                        jnp.where(take, start[:, None] + src, recent.pos))


def attend(layer: LayerCache, q: jax.Array, k: jax.Array, v: jax.Array,
           start: jax.Array, backend: str | None = None, valid: jax.Array | None = None
           ) -> tuple[jax.Array, LayerCache]:
    """Write this chunk's keys/values, then causal attention over the cache (its live slots).

    q [B, T, H, hd], k/v [B, T, KV, hd] (post-RoPE), start int32 [B]: slot of the chunk's
    first token per sequence. Slot s is visible to query t iff s <= start + t.
    backend: "xla" or "pallas" (decode steps, T == 1, over TurboQuant/dense stores run the
    `tqjax.pallas.turbo_attention` kernel); None = `tqjax.pallas.backend.current()`.
    valid int32 [B]: real (not padding) tokens of each row's chunk, default T; only those
    enter the recent-token ring.
    Returns (out [B, T, H, hd] in q's dtype, updated layer).
    """
    b, t, h, hd = q.shape
    kvh = k.shape[2]
    g = h // kvh
    k, v = k.transpose(0, 2, 1, 3), v.transpose(0, 2, 1, 3)  # [B, KV, T, hd]
    qpos = start[:, None] + jnp.tile(jnp.arange(t), g)[None, :]  # [B, G*T]
    bound, window, recent = qpos, None, layer.recent
    if recent is not None:  # the last N positions come from the exact copies, not the stores
        wk, wv, wpos, lo = _window_candidates(recent, k, v, start)
        bound = jnp.maximum(qpos - recent.pos.shape[1], lo[:, None] - 1)
        window = (wk, wv, wpos)
        recent = _write_window(recent, k, v, start, valid)
    layer = LayerCache(kvs.write(layer.k, k, start), kvs.write(layer.v, v, start), recent)
    if (t == 1 and resolve_backend(backend) == "pallas"
            and turbo_attention.supported(q.shape, layer.k, layer.v)):
        out = turbo_attention.turbo_decode_attention(q[:, 0], concrete(layer.k),
                                                     concrete(layer.v), start,
                                                     bound=bound[:, 0], window=window)
        return out[:, None].astype(q.dtype), layer
    qg = q.reshape(b, t, kvh, g, hd).transpose(0, 2, 3, 1, 4).reshape(b, kvh, g * t, hd)
    out = blockwise_attention(layer.k, layer.v, qg, bound, qpos, window)  # [B, KV, G*T, hd]
    out = out.reshape(b, kvh, g, t, hd).transpose(0, 3, 1, 2, 4).reshape(b, t, h, hd)
    return out.astype(q.dtype), layer


def attention_block(slots: int) -> int:
    """Slots per step of `blockwise_attention` for a cache of `slots` slots."""
    return min(BLOCK, slots)


def blockwise_attention(k_store: object, v_store: object, q: jax.Array, bound: jax.Array,
                        qpos: jax.Array, window: Window | None = None) -> jax.Array:
    """Softmax attention of q [B, KV, N, hd] (N = G·T query rows) over the stores, one block of
    slots at a time with an online softmax (flash-decoding in XLA).

    Store slot s is visible to row n iff s <= bound[b, n] (int32 [B, N]); `window` = exact keys,
    values f32 [B, KV, W, hd] and positions int32 [B, W] (-1: none), those at positions in
    (bound, qpos] visible (qpos int32 [B, N]: each row's position). Only blocks up to the largest
    bound are read, and each block is dequantized (or scored in the store's basis) on its own:
    no [S, hd] f32 copy of a store and no [N, S] score matrix. Returns f32 [B, KV, N, hd].
    """
    b, kvh, n, hd = q.shape
    scale = 1.0 / hd**0.5
    slots = jax.tree_util.tree_leaves(
        k_store, is_leaf=lambda x: isinstance(x, kvs.LayerSlab))[0].shape[2]
    qf = q.astype(jnp.float32)

    def update(carry: tuple[jax.Array, ...], s: jax.Array, visible: jax.Array,
               mix: Callable[[jax.Array], jax.Array]) -> tuple[jax.Array, ...]:
        """Fold scores s f32 [B, KV, N, W] (visible bool [B, 1, N, W]) and their values'
        Σ p·v (`mix` of p) into the partial softmax `carry` (m, lsum, acc)."""
        m, lsum, acc = carry
        s = jnp.where(visible, s * scale, NEG)
        m_new = jnp.maximum(m, jnp.max(s, axis=-1))
        correction = jnp.exp(m - m_new)
        p = jnp.where(visible, jnp.exp(s - m_new[..., None]), 0.0)
        return (m_new, lsum * correction + jnp.sum(p, axis=-1),
                acc * correction[..., None] + mix(p))

    def fold_rows(carry: tuple[jax.Array, ...], keys: jax.Array, values: jax.Array,
                  visible: jax.Array) -> tuple[jax.Array, ...]:
        """Fold exact rows keys/values [B, KV, W, hd] (visible [B, 1, N, W]) into `carry`."""
        s = jnp.einsum("bknd,bkwd->bknw", qf, keys.astype(jnp.float32))
        return update(carry, s, visible,
                      lambda p: jnp.einsum("bknw,bkwd->bknd", p, values.astype(jnp.float32)))

    def fold(carry: tuple[jax.Array, ...], lo: jax.Array, size: int,
             visible: jax.Array) -> tuple[jax.Array, ...]:
        """Fold the stores' slots lo .. lo + size - 1 (visible [B, 1, N, size]) into `carry`."""
        s = kvs.scores(kvs.block(k_rest, lo, size), q, lo)  # [B, KV, N, size]
        return update(carry, s, visible, lambda p: kvs.mix(kvs.block(v_rest, lo, size), p, lo))

    carry = (jnp.full((b, kvh, n), NEG, jnp.float32), jnp.zeros((b, kvh, n), jnp.float32),
             jnp.zeros((b, kvh, n, hd), jnp.float32))  # an empty softmax partial
    if window is not None:  # the exact recent rows at positions in (bound, qpos]
        wk, wv, wpos = window
        near = ((wpos[:, None, :] > bound[:, :, None]) & (wpos[:, None, :] <= qpos[:, :, None])
                & (wpos[:, None, :] >= 0))[:, None]  # [B, 1, N, W]
        carry = fold_rows(carry, wk, wv, near)
    # stores that keep their first slots exact (sinks, both keys and values): those rows are
    # folded in once, and the blocks run on the stores without them (no per-block select)
    (k_rows, k_rest), (v_rows, v_rest) = kvs.split_sink(k_store), kvs.split_sink(v_store)
    head = 0
    if k_rows is not None and v_rows is not None and k_rows.shape == v_rows.shape:
        head = k_rows.shape[2]
        idx = jnp.arange(head)
        carry = fold_rows(carry, k_rows, v_rows, (idx[None, None, :] <= bound[:, :, None])[:, None])
    else:
        k_rest, v_rest = k_store, v_store

    def blocks(carry: tuple[jax.Array, ...], first: jax.Array, count: jax.Array, size: int,
               most: int) -> tuple[jax.Array, ...]:
        """Fold `count` (<= most, static) blocks of `size` slots from slot `first` (the exact
        head slots excluded) into the partial softmax `carry`."""

        def step(i: jax.Array, carry: tuple[jax.Array, ...]) -> tuple[jax.Array, ...]:
            nominal = jnp.maximum(first + i * size, head)
            lo = jnp.minimum(first + i * size, slots - size)  # the last may overlap the one before
            idx = lo + jnp.arange(size)  # [size] cache slots of this block
            visible = ((idx[None, None, :] >= nominal) & (idx[None, None, :] <= bound[:, :, None])
                       )[:, None]  # [B, 1, N, size]
            return fold(carry, lo, size, visible)

        def maybe_step(i: jax.Array, carry: tuple[jax.Array, ...]) -> tuple[jax.Array, ...]:
            # blocks past the live length are skipped; a static trip count keeps the loop a
            # scan, which reverse-mode differentiation needs (Fisher diagonals, calibration)
            return jax.lax.cond(i < count, step, lambda _, c: c, i, carry)

        return jax.lax.fori_loop(0, most, maybe_step, carry)

    first = jnp.int32(0)
    live = jnp.max(bound) + 1  # slots any row can see
    size = attention_block(slots)
    most = -(-slots // size)
    if n <= DECODE_ROWS and slots >= 2 * DECODE_BLOCK > 2 * size:  # large steps first
        # as many large blocks as the live length rounds to: a tail of half a large block or
        # more takes one more large block (reading past the live length) instead of 2-4 small
        big = (live + DECODE_BLOCK // 2) // DECODE_BLOCK
        carry = blocks(carry, first, big, DECODE_BLOCK, -(-slots // DECODE_BLOCK))
        first, most = big * DECODE_BLOCK, -(-DECODE_BLOCK // 2 // size)
    _, lsum, acc = blocks(carry, first, (live - first + size - 1) // size, size, most)
    return acc / lsum[..., None]


def parse_kv(text: str) -> tuple[str, str]:
    """A "K" or "K/V" cache-type string (e.g. "turbo4", "turbo4/turbo3") -> (key type, value
    type); "K" alone is both. Raises TqjaxError with one line on an empty, malformed or unknown
    type (the names are `STORE_FACTORIES`' keys)."""
    k, _, v = text.strip().partition("/")
    k, v = k.strip(), v.strip() or k.strip()
    if not k or "/" in v:
        raise TqjaxError(f"bad cache types {text!r}: expected K or K/V, e.g. turbo4/turbo3")
    check_spec(CacheSpec(k, v))
    return k, v


def as_cache_spec(cache: CacheSpec | str) -> CacheSpec:
    """A CacheSpec as it is, or a "K[/V]" string (e.g. "turbo4/turbo3") read by `parse_kv`;
    anything else a TqjaxError."""
    if isinstance(cache, str):
        return CacheSpec(*parse_kv(cache))
    if not isinstance(cache, CacheSpec):
        raise TqjaxError(f"cache must be a CacheSpec or a 'K[/V]' string, got "
                         f"{type(cache).__name__}")
    return cache
