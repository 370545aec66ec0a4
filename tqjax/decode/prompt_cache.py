"""Prompt caches: one sequence's KV cache copied out of a batch and back (`take_row`/`put_row`),
and saved to / restored from a file (`save_prompt_cache`/`load_prompt_cache`).

Every array of a cache is one of three kinds (the rule `tqjax.kv.cache.bytes_per_token` uses):

- per-slot: a store field with ndim >= 3 other than `sink`, [B, KV, S, ...] (slot axis 2);
- per-row constants: a turbo store's dense `sink` slots [B, KV, n_sink, hd] and the
  recent-token ring (`RecentWindow`: k/v [B, KV, N, hd], pos [B, N]);
- per-layer constants (no batch axis): centres, rope frequencies, channel scales, rotations,
  codebooks, QJL matrices. They come from the spec, the calibration and the seed, never from a
  row: `put_row` keeps the target cache's, and a saved file holds only their sha256 (checked
  against the target cache's on load) and none of their values. The calibration means they
  come from are saved too (small: [L, KV, hd] each): on another mesh or CPU the calibration
  pass sums in another order and its means differ in their last bits, so a file whose
  calibration is within `CALIBRATION_RTOL` of the target's is accepted when its constants'
  sha256 is the one its own calibration gives. (A bf16 or f16 model's means differ by
  ~1e-3 between meshes, as much as calibrating on 99% of the text moves them: its turbo
  caches load only where their calibration is the same.)

File format: one safetensors file (a single-host blob of a batch-1 row, written atomically).
safetensors rather than orbax-checkpoint: a prompt cache is one small flat dict of host arrays
plus string metadata read back whole on one host; orbax is built for sharded, asynchronous
pytree checkpoints (a directory per checkpoint, restore by sharding), which here would only add
a directory, a dependency on the pytree's exact structure and no checksums. safetensors is
already the project's tensor format, is zero-copy and executes nothing on load (no pickle).
The file holds only the n live positions: per-slot arrays cut to [1, KV, n, ...], sink slots
to the first min(n_sink, n), the ring to its entries at positions < n (in position order), and
the token ids. Its metadata: format name and version, the `CacheMeta` (model, tokenizer,
calibration and per-layer-constant sha256s, cache spec and per-layer types, shapes), the token
count, and a sha256 over that metadata and every tensor (name, dtype, shape, bytes)."""

from __future__ import annotations

import dataclasses
import hashlib
import json
import weakref
from collections.abc import Sequence
from pathlib import Path

import jax
import jax.numpy as jnp
import numpy as np

from tqjax.atomic import write_safetensors
from tqjax.errors import TqjaxError
from tqjax.kv.cache import (
    CacheSpec,
    Calibration,
    KVCache,
    LayerCache,
    RecentWindow,
    check_spec,
    group_size,
    layer_types,
    make_cache,
    slot_field,
)
from tqjax.models.config import ModelConfig
from tqjax.models.tokenizer import Tokenizer
from tqjax.models.transformer import Params


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
    return "slot" if slot_field(_name(path), leaf.ndim) else "const"


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
    def take(layer: LayerCache) -> LayerCache:  # one layer; vmapped over each stacked group
        recent = layer.recent
        if recent is not None:
            recent = jax.tree_util.tree_map(
                lambda x: jax.lax.dynamic_slice_in_dim(x, row, 1, axis=0), recent)
        return LayerCache(_take_store(layer.k, row), _take_store(layer.v, row), recent)

    return KVCache(tuple(jax.vmap(take)(group) for group in cache.groups))


def _layer_shapes(cache: KVCache) -> list[LayerCache]:
    """Every layer's cache as shapes and dtypes (`jax.ShapeDtypeStruct`; no copy)."""
    return jax.eval_shape(lambda c: c.layers, cache)


def _check_row(cache: KVCache, row: int) -> None:
    batch = cache.batch
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
    def put(layer: LayerCache, src: LayerCache) -> LayerCache:  # vmapped over each group
        recent = None if layer.recent is None else _put_ring(layer.recent, row, src.recent)
        return LayerCache(_put_store(layer.k, row, src.k), _put_store(layer.v, row, src.v),
                          recent)

    return KVCache(tuple(jax.vmap(put)(group, src)
                         for group, src in zip(cache.groups, one.groups, strict=True)))


def check_compatible(cache: KVCache, one: KVCache) -> None:
    """Raise TqjaxError unless the batch-1 `one` fits a row of `cache`: same layers and store
    formats, at most as many slots (and ring/sink sizes within the target's)."""
    if one.num_layers != cache.num_layers:
        raise TqjaxError(f"cache with {one.num_layers} layers, the target has "
                         f"{cache.num_layers}")
    if one.batch != 1:
        raise TqjaxError("put_row takes a batch-1 cache")
    if one.slots > cache.slots:
        raise TqjaxError(f"cache of {one.slots} slots does not fit a row of {cache.slots} slots")
    if [group_size(g) for g in one.groups] != [group_size(g) for g in cache.groups]:
        raise TqjaxError("the cache's layers are grouped by format unlike the target's "
                         "(another cache type or layout)")
    for i, (a, b) in enumerate(zip(_layer_shapes(cache), _layer_shapes(one), strict=True)):
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


# ---------------------------------------------------------------- saved prompt caches

FORMAT = "tqjax-prompt-cache"
VERSION = 3  # 2: a bf16 dense store holds its bits (uint16); 3: the calibration means are
# saved, and a GGUF tokenizer's hash covers llama.cpp's whole end-of-generation set
_MODEL_HASHES: dict[int, tuple[weakref.ref, str]] = {}  # id(params) -> (params, sha256)


def common_prefix(a: Sequence[int], b: Sequence[int]) -> int:
    """Length of the longest common prefix of two token sequences."""
    n = 0
    for x, y in zip(a, b, strict=False):
        if x != y:
            break
        n += 1
    return n


def ring_size(cache: KVCache) -> int:
    """Positions each row's recent-token ring holds (`RecentWindow`; 0: no layer has one)."""
    return max((g.recent.pos.shape[-1] for g in cache.groups if g.recent is not None),
               default=0)


def reusable_prefix(held: Sequence[int], prompt: Sequence[int], ring: int) -> int:
    """Prompt tokens a cache holding `held` (slot i holds held[i]) can give a new `prompt`, so
    that what follows reads what a fresh prefill of the prompt would.

    The common prefix, less the prompt's last token (always run, for its logits). A cache with
    an exact recent-token ring of `ring` positions (the turbo stores') holds the last `ring` of
    `held`, and a query reads its last `ring` positions (itself included) from it. Where `held`
    goes on more than one token past the reuse point n, the ring no longer holds the positions
    before n that a fresh prefill reads exactly, and the compressed store would serve them
    instead. Then `ring` fewer tokens are reused: they are prefilled again and enter the ring.
    Their keys and values are recomputed reading the older positions from the store, so the
    continuation matches a fresh one to within noise, not bit for bit (turbo4 on SmolLM2 and
    Qwen2.5-Coder-0.5B: KL to the fresh logits 3e-5-1e-4 against 2e-4-1.3e-3 without the
    back-off, and to an f32 cache's within 5% of the fresh run's; docs/research.md, stop 56).
    Reuse up to the end of `held` (a chat's next turn, the same prompt again) reads what a
    fresh run reads."""
    n = min(common_prefix(held, prompt), len(prompt) - 1)
    if ring and n < len(held) - 1 and len(held) > ring:
        n -= ring
    return max(n, 0)


def _sha256_arrays(h: hashlib._Hash, named: list[tuple[str, np.ndarray]]) -> None:
    for name, x in named:
        x = np.ascontiguousarray(x)
        h.update(f"{name}|{x.dtype.str}|{x.shape}|".encode())
        h.update(x.reshape(-1).view(np.uint8))


def model_sha256(config: ModelConfig, params: Params) -> str:
    """sha256 of the config and every parameter (structure, dtypes, shapes, bytes); memoized
    per params object (hashing runs at a few hundred MB/s)."""
    key = id(params)
    hit = _MODEL_HASHES.get(key)
    if hit is not None and hit[0]() is params:
        return hit[1]
    h = hashlib.sha256(json.dumps(dataclasses.asdict(config), sort_keys=True,
                                  default=str).encode())
    leaves = jax.tree_util.tree_leaves_with_path(params)
    h.update(str(jax.tree_util.tree_structure(params)).encode())
    _sha256_arrays(h, [(jax.tree_util.keystr(p), np.asarray(x)) for p, x in leaves])
    digest = h.hexdigest()
    try:
        _MODEL_HASHES[key] = (weakref.ref(params), digest)
    except TypeError:  # not weak-referenceable: no memo
        pass
    return digest


def tokenizer_sha256(tokenizer: Tokenizer | None) -> str:
    """sha256 of a tokenizer's serialized model, special ids and chat template ('' for none)."""
    if tokenizer is None:
        return ""
    backend = tokenizer.backend
    blob = (backend.serialized_model_proto() if tokenizer.is_sentencepiece
            else backend.to_str().encode())
    extra = json.dumps([tokenizer.bos_id, list(tokenizer.eos_ids), tokenizer.add_bos,
                        tokenizer.chat_template], default=str).encode()
    return hashlib.sha256(blob + b"\0" + extra).hexdigest()


def _calibration_sha256(calibration: Calibration | None) -> str:
    if calibration is None:
        return ""
    h = hashlib.sha256()
    _sha256_arrays(h, [(f.name, np.asarray(getattr(calibration, f.name), np.float32))
                       for f in dataclasses.fields(calibration)])
    return h.hexdigest()


CALIBRATION_RTOL = 1e-4  # of each field's largest magnitude: a mesh's or CPU's rounding
# moves the means by ~1e-6 of it; another model's or calibration text's by far more
_CALIBRATION_PREFIX = "calibration."


def _calibration_names(calibration: Calibration | None) -> dict[str, str]:
    """{name in a saved file: Calibration field} (none without a calibration)."""
    return {} if calibration is None else {_CALIBRATION_PREFIX + f.name: f.name
                                           for f in dataclasses.fields(calibration)}


def _calibration_tensors(calibration: Calibration | None) -> dict[str, np.ndarray]:
    """The calibration means a saved file carries, by `_calibration_names`."""
    return {name: np.asarray(getattr(calibration, field), np.float32)
            for name, field in _calibration_names(calibration).items()}


def _near_calibration(saved: dict[str, np.ndarray], calibration: Calibration | None
                      ) -> Calibration | None:
    """The file's calibration where every field is within `CALIBRATION_RTOL` of the target's
    (the same model calibrated on another mesh or CPU), else None."""
    if calibration is None or not saved:
        return None
    fields, names = {}, _calibration_names(calibration)
    for name, want in _calibration_tensors(calibration).items():
        got = saved.get(name)
        if got is None or got.shape != want.shape or not np.all(np.isfinite(got)) or \
                np.abs(got - want).max(initial=0.0) > CALIBRATION_RTOL * np.abs(want).max(
                    initial=0.0):
            return None
        fields[names[name]] = got
    return type(calibration)(**fields)


def _constants_sha256(cache: KVCache) -> str:
    """sha256 of every per-layer constant of a cache (rotations, codebooks, centres, channel
    scales, QJL matrices, rope frequencies) and of its layout (store types, static fields)."""
    h = hashlib.sha256()
    for i, layer in enumerate(cache.layers):
        for part in ("k", "v"):
            store = getattr(layer, part)
            layout = _static(store)
            h.update(f"{i}.{part}|{layout[0]}|{layout[1]}".encode())
            _sha256_arrays(h, [(jax.tree_util.keystr(p), np.asarray(x))
                               for p, x in jax.tree_util.tree_leaves_with_path(store)
                               if _kind(p, x) == "const"])
        h.update(b"ring" if layer.recent is not None else b"-")
    return h.hexdigest()


@dataclasses.dataclass(frozen=True)
class CacheMeta:
    """What a saved prompt cache must match to be restored into a model's cache: model,
    tokenizer, cache spec (per-layer K/V types, rotation seed, sink/recent sizes, centring),
    calibration constants and the per-layer constants they produce. `calibration` and
    `inv_freq` [hd/2] are carried to build the target cache and not compared themselves."""

    model_sha256: str
    tokenizer_sha256: str
    spec: CacheSpec
    layer_types: tuple[tuple[str, str], ...]
    num_layers: int
    kv_heads: int
    head_dim: int
    vocab_size: int
    calibration_sha256: str
    constants_sha256: str
    calibration: Calibration | None = dataclasses.field(default=None, compare=False, repr=False)
    inv_freq: np.ndarray | None = dataclasses.field(default=None, compare=False, repr=False)

    def record(self) -> dict:
        """The compared fields as JSON-ready values (what a file stores)."""
        out = {f.name: getattr(self, f.name) for f in dataclasses.fields(self) if f.compare}
        out["spec"] = dataclasses.asdict(self.spec)
        out["layer_types"] = [list(t) for t in self.layer_types]
        return out

    def empty_cache(self, slots: int, batch: int = 1) -> KVCache:
        """An empty cache of this format: `batch` rows of `slots` slots."""
        return make_cache(self.spec, batch=batch, slots=slots, num_layers=self.num_layers,
                          kv_heads=self.kv_heads, head_dim=self.head_dim,
                          calibration=self.calibration, inv_freq=self.inv_freq)


def cache_meta(config: ModelConfig, params: Params, tokenizer: Tokenizer | None,
               spec: CacheSpec, calibration: Calibration | None) -> CacheMeta:
    """The `CacheMeta` of a model's caches in format `spec` (hashes every parameter once per
    params object)."""
    check_spec(spec)
    inv_freq = np.asarray(params.rope_inv_freq, np.float32)
    probe = make_cache(spec, batch=1, slots=1, num_layers=config.num_layers,
                       kv_heads=config.num_kv_heads, head_dim=config.head_dim,
                       calibration=calibration, inv_freq=inv_freq)
    return CacheMeta(
        model_sha256=model_sha256(config, params), tokenizer_sha256=tokenizer_sha256(tokenizer),
        spec=spec, layer_types=tuple(layer_types(spec, config.num_layers)),
        num_layers=config.num_layers, kv_heads=config.num_kv_heads, head_dim=config.head_dim,
        vocab_size=config.vocab_size, calibration_sha256=_calibration_sha256(calibration),
        constants_sha256=_constants_sha256(probe), calibration=calibration, inv_freq=inv_freq)


def _live_ring(ring: RecentWindow, n: int) -> tuple[np.ndarray, np.ndarray, np.ndarray]:
    """A batch-1 ring's entries at positions 0..n-1, in position order: k/v [1, KV, m, hd],
    pos [m] int32 (later positions are stale: never read again)."""
    pos = np.asarray(ring.pos[0])
    slots = np.nonzero((pos >= 0) & (pos < n))[0]
    slots = slots[np.argsort(pos[slots], kind="stable")]
    return (np.asarray(ring.k)[:, :, slots], np.asarray(ring.v)[:, :, slots],
            pos[slots].astype(np.int32))


def _cache_tensors(cache: KVCache, n: int) -> dict[str, np.ndarray]:
    """The live part of a batch-1 cache as named host arrays (see the module docstring)."""
    out = {}
    for i, layer in enumerate(cache.layers):
        for part in ("k", "v"):
            for p, x in jax.tree_util.tree_leaves_with_path(getattr(layer, part)):
                kind = _kind(p, x)
                if kind != "const":
                    out[f"layers.{i}.{part}{jax.tree_util.keystr(p)}"] = np.asarray(x[:, :, :n])
        if layer.recent is not None:
            k, v, pos = _live_ring(layer.recent, n)
            out |= {f"layers.{i}.recent.k": k, f"layers.{i}.recent.v": v,
                    f"layers.{i}.recent.pos": pos}
    return out


def _checksum(header: dict[str, str], tensors: dict[str, np.ndarray]) -> str:
    h = hashlib.sha256(json.dumps(header, sort_keys=True).encode())
    _sha256_arrays(h, sorted(tensors.items()))
    return h.hexdigest()


def save_prompt_cache(path: str | Path, cache: KVCache, tokens: Sequence[int],
                      meta: CacheMeta) -> None:
    """Save a batch-1 cache holding len(tokens) live positions (tokens[i] at slot i), written
    atomically. The cache must be in `meta`'s format (its per-layer constants are checked)."""
    ids = np.asarray(list(tokens), np.int64)
    n = len(ids)
    if n == 0:
        raise TqjaxError("a prompt cache needs at least one token")
    if ids.min() < 0 or ids.max() >= meta.vocab_size:
        raise TqjaxError(f"prompt cache token id out of range [0, {meta.vocab_size})")
    if cache.batch != 1:
        raise TqjaxError("save_prompt_cache takes a batch-1 cache (see take_row)")
    if n > cache.slots:
        raise TqjaxError(f"{n} tokens but the cache has only {cache.slots} slots")
    if cache.num_layers != meta.num_layers or _constants_sha256(cache) != meta.constants_sha256:
        raise TqjaxError("the cache is not in the format its CacheMeta describes")
    tensors = _cache_tensors(cache, n) | _calibration_tensors(meta.calibration)
    tensors["tokens"] = ids.astype(np.int32)
    header = {"format": FORMAT, "version": str(VERSION), "n_tokens": str(n),
              "meta": json.dumps(meta.record(), sort_keys=True)}
    try:
        write_safetensors(path, tensors, {**header, "sha256": _checksum(header, tensors)})
    except OSError as e:  # (the atomic write names `path`, not its temporary sibling)
        raise TqjaxError(f"cannot write prompt cache {path}: {e.strerror or e}") from None


_FIELD_NAMES = {"model_sha256": "another model", "tokenizer_sha256": "another tokenizer",
                "spec": "another cache type or cache options",
                "layer_types": "other per-layer cache types",
                "calibration_sha256": "other calibration constants",
                "constants_sha256": "other per-layer cache constants (rotations, codebooks, "
                                    "centres)"}


def _check_file(path: Path) -> None:
    """A prompt-cache path must be a regular file (a folder, a FIFO or a device is not)."""
    if not path.exists():
        raise TqjaxError(f"no such prompt cache file: {path}")
    if path.is_dir():
        raise TqjaxError(f"prompt cache {path} is a directory; give a file")
    if not path.is_file():
        raise TqjaxError(f"prompt cache {path} is not a regular file")


def _read(path: Path) -> tuple[dict[str, str], dict[str, np.ndarray]]:
    """Header and tensors of a prompt-cache file; any unreadable file -> TqjaxError."""
    from safetensors import safe_open

    _check_file(path)
    try:
        with safe_open(str(path), framework="numpy") as f:
            header = dict(f.metadata() or {})
            tensors = {name: f.get_tensor(name) for name in f.keys()}  # noqa: SIM118
    except Exception as e:  # safetensors raises several types for truncated / garbled files
        reason = str(e).splitlines()[0] if str(e) else type(e).__name__
        raise TqjaxError(f"prompt cache {path} is truncated or corrupt ({reason})") from None
    return header, tensors


def saved_length(path: str | Path) -> int:
    """The token count of a prompt-cache file, from its header (for sizing the target row);
    the file is checked in full by `load_prompt_cache`."""
    from safetensors import safe_open

    path = Path(path)
    _check_file(path)
    try:
        with safe_open(str(path), framework="numpy") as f:
            header = f.metadata() or {}
            if header.get("format") != FORMAT:
                raise TqjaxError(f"{path} is not a tqjax prompt cache")
            n = int(header.get("n_tokens", ""))
    except TqjaxError:
        raise
    except Exception as e:  # unreadable header or count
        reason = str(e).splitlines()[0] if str(e) else type(e).__name__
        raise TqjaxError(f"prompt cache {path} is truncated or corrupt ({reason})") from None
    if n < 1:
        raise TqjaxError(f"prompt cache {path} is corrupt (token count {n})")
    return n


def load_prompt_cache(path: str | Path, meta: CacheMeta, slots: int
                      ) -> tuple[KVCache, list[int]]:
    """Restore a saved prompt cache into a new batch-1 cache of `slots` slots (>= its token
    count), the per-layer constants built from `meta` (the target model's). Returns the cache
    and its token ids. Raises TqjaxError on another format version, a truncated or corrupt
    file, a file from another model/tokenizer/cache type/calibration, or too few slots."""
    path = Path(path)
    header, tensors = _read(path)
    if header.get("format") != FORMAT:
        raise TqjaxError(f"{path} is not a tqjax prompt cache")
    if header.get("version") != str(VERSION):
        raise TqjaxError(f"prompt cache {path} has format version {header.get('version')}, "
                         f"this tqjax reads version {VERSION}")
    body = {k: v for k, v in header.items() if k != "sha256"}
    if header.get("sha256") != _checksum(body, tensors):
        raise TqjaxError(f"prompt cache {path} is corrupt (checksum mismatch)")
    try:
        record, n = json.loads(header["meta"]), int(header["n_tokens"])
    except (KeyError, ValueError) as e:
        raise TqjaxError(f"prompt cache {path} has unreadable metadata ({e})") from None
    want = meta.record()
    saved_calibration = {k: tensors.pop(k) for k in _calibration_names(meta.calibration)
                         if k in tensors}
    if record.get("calibration_sha256") != want["calibration_sha256"]:
        near = _near_calibration(saved_calibration, meta.calibration)
        if near is not None and record.get("constants_sha256") == _constants_sha256(
                dataclasses.replace(meta, calibration=near).empty_cache(1)):
            # (the target's own constants are used: they differ from the file's in last bits)
            record = {**record, "calibration_sha256": want["calibration_sha256"],
                      "constants_sha256": want["constants_sha256"]}
    for name, what in _FIELD_NAMES.items():
        if record.get(name) != want[name]:
            raise TqjaxError(f"prompt cache {path} was made for {what}; it does not match "
                             f"this model and cache")
    if record != want:
        raise TqjaxError(f"prompt cache {path} was made for another model shape")
    if n > slots:
        raise TqjaxError(f"prompt cache {path} holds {n} tokens, more than the {slots} slots")
    cache = meta.empty_cache(slots)
    try:
        cache = _fill(cache, tensors, n)
    except (KeyError, ValueError) as e:
        raise TqjaxError(f"prompt cache {path} does not hold this cache's arrays ({e})"
                         ) from None
    ids = tensors["tokens"]
    if ids.shape != (n,):
        raise TqjaxError(f"prompt cache {path} is corrupt (token count)")
    return cache, [int(t) for t in ids]


def _fill(cache: KVCache, tensors: dict[str, np.ndarray], n: int) -> KVCache:
    """An empty batch-1 cache with the saved live arrays written into its first slots."""
    used = {"tokens"}

    def put(prefix: str, store: object) -> object:
        def one(path: tuple, x: jax.Array) -> jax.Array:
            kind = _kind(path, x)
            if kind == "const":
                return x
            name = prefix + jax.tree_util.keystr(path)
            saved = tensors[name]
            used.add(name)
            if saved.shape[:2] != x.shape[:2] or saved.shape[3:] != x.shape[3:] or \
                    saved.shape[2] > x.shape[2] or (kind == "slot" and saved.shape[2] != n) or \
                    saved.dtype != np.dtype(x.dtype):
                raise ValueError(f"{name}: {saved.dtype}{list(saved.shape)} for "
                                 f"{x.dtype}{list(x.shape)}")
            return x.at[:, :, :saved.shape[2]].set(saved)

        return jax.tree_util.tree_map_with_path(one, store)

    layers = []
    for i, layer in enumerate(cache.layers):
        recent = layer.recent
        if recent is not None:
            k, v, pos = (tensors[f"layers.{i}.recent.{f}"] for f in ("k", "v", "pos"))
            used |= {f"layers.{i}.recent.{f}" for f in ("k", "v", "pos")}
            m, ring = pos.shape[0], recent.pos.shape[1]
            if k.shape != (1, *recent.k.shape[1:2], m, recent.k.shape[3]) or v.shape != k.shape \
                    or m > ring or (m and (pos.min() < 0 or pos.max() >= n)):
                raise ValueError(f"layer {i} ring")
            dest = pos % ring
            recent = RecentWindow(recent.k.at[:, :, dest].set(k), recent.v.at[:, :, dest].set(v),
                                  recent.pos.at[0, dest].set(pos))
        layers.append(LayerCache(put(f"layers.{i}.k", layer.k), put(f"layers.{i}.v", layer.v),
                                 recent))
    if used != set(tensors):
        raise ValueError(f"unexpected arrays {sorted(set(tensors) - used)[:3]}")
    return KVCache.from_layers(layers)
