"""KV cache formats: attention on each compressed store equals dense attention on a numpy
float64 decoding of the store's raw fields (np.unpackbits, scipy's Hadamard matrix, the RoPE
formula), memory accounting against the arrays' real sizes, and clear errors for bad specs."""

import dataclasses
import functools

import chex
import jax
import jax.numpy as jnp
import numpy as np
import pytest
import scipy.linalg

import tqjax
from tqjax.errors import TqjaxError
from tqjax.kv import store as kvs
from tqjax.kv.cache import (
    STORE_FACTORIES,
    CacheSpec,
    Calibration,
    LayerCache,
    attend,
    bytes_per_token,
    make_cache,
)
from tqjax.kv.quantized import (
    AidedStore,
    HadamardStore,
    Int4Store,
    Int8Store,
    Q40Store,
    TurboStore,
    materialize,
)

from .conftest import GOLDEN

B, KV, G, HD, S = 2, 2, 3, 64, 40


def random_calibration(rng, layers=1, hd=HD):
    return Calibration(key_mean=rng.normal(size=(layers, KV, hd)).astype(np.float32) * 3,
                       value_mean=rng.normal(size=(layers, KV, hd)).astype(np.float32),
                       key_scale=np.exp(rng.normal(size=(layers, KV, hd)) * 0.3)
                       .astype(np.float32))


def dense_attention(q, k, v, start):
    """Reference: plain causal GQA attention over full K/V [B, KV, S, hd]."""
    b, t, h, hd = q.shape
    qg = q.reshape(b, t, KV, h // KV, hd)
    s = jnp.einsum("btkgd,bksd->bkgts", qg, k) / np.sqrt(hd)
    qpos = start[:, None] + jnp.arange(t)[None]
    mask = jnp.arange(k.shape[2])[None, None, :] <= qpos[:, :, None]  # [B, T, S]
    p = jax.nn.softmax(jnp.where(mask[:, None, None], s, -jnp.inf), axis=-1)
    return jnp.einsum("bkgts,bksd->btkgd", p, v).reshape(b, t, h, hd)


def np_codes(packed, bits, n):
    """Codes int64 [..., n] of a little-endian bit stream packed along the last axis (code i is
    stream bits i·bits .. i·bits + bits - 1), by numpy's own bit unpacking."""
    stream = np.unpackbits(np.asarray(packed), axis=-1, bitorder="little")[..., : n * bits]
    stream = stream.reshape(*stream.shape[:-1], n, bits).astype(np.int64)
    return (stream << np.arange(bits)).sum(-1)


def np_rope(x, positions, inv_freq):
    """RoPE by its formula (halves rotated by position·inv_freq), float64: x [..., S, hd]."""
    angle = np.asarray(positions, np.float64)[:, None] * np.asarray(inv_freq, np.float64)
    half = x.shape[-1] // 2
    x1, x2 = x[..., :half], x[..., half:]
    return np.concatenate([x1 * np.cos(angle) - x2 * np.sin(angle),
                           x2 * np.cos(angle) + x1 * np.sin(angle)], -1)


def np_reconstruct(store):
    """Every slot's vector, float64 [B, KV, S, hd], decoded in numpy from the store's raw fields
    as each format's docstring defines them (independent of the stores' own jnp decoders)."""
    f = lambda a: np.asarray(a, np.float64)  # noqa: E731
    if isinstance(store, kvs.DenseStore):  # (a bf16 store holds the bits, uint16)
        return f(np.asarray(store.data).view(jnp.bfloat16) if store.bf16 else store.data)
    if isinstance(store, HadamardStore):  # holds H x, H = hadamard / sqrt(hd), symmetric
        inner = np_reconstruct(store.inner)
        hd = inner.shape[-1]
        return inner @ (scipy.linalg.hadamard(hd) / np.sqrt(hd))
    if isinstance(store, Int8Store):
        q = f(store.q)
        return (q.reshape(*q.shape[:-1], -1, store.group) * f(store.scale)[..., None]).reshape(
            q.shape)
    if isinstance(store, Int4Store | Q40Store):
        hd = store.packed.shape[-1] * 2
        codes = np_codes(store.packed, 4, hd).reshape(*store.packed.shape[:-1], -1, store.group)
        if isinstance(store, Q40Store):
            x = (codes - 8.0) * f(store.scale)[..., None]
        else:
            x = f(store.lo)[..., None] + f(store.step)[..., None] * codes
        return x.reshape(*store.packed.shape[:-1], hd)
    if isinstance(store, AidedStore):
        return np_aids(store, np_reconstruct(store.inner))
    assert isinstance(store, TurboStore)
    q = store.quantizer
    hd, hi = q.dim, q.hi_channels
    parts, offset = [], 0  # packed segments: the first hi channels at bits + 1, then the rest
    for n, bits, table in ((hi, q.bits + 1, q.hi_centroids), (hd - hi, q.bits, q.centroids)):
        if n:
            size = n * bits // 8
            parts.append(f(table)[np_codes(store.packed[..., offset:offset + size], bits, n)])
            offset += size
    assert offset == store.packed.shape[-1]
    y = np.concatenate(parts, -1) * f(store.scale)[..., None]  # rotated space
    rot = q.rotation  # Π x = T (signs ∘ x): Πᵀ y = signs ∘ (Tᵀ y)
    t = (scipy.linalg.hadamard(hd) / np.sqrt(hd)) if rot.matrix is None else f(rot.matrix)
    x = (y @ t) * f(rot.signs)
    if store.qjl is not None:  # + Sᵀ (√(π/2)/d · ‖r‖ · (2·signs − 1))
        pm = 2.0 * np_codes(store.qjl_signs, 1, hd) - 1.0
        x = x + (np.sqrt(np.pi / 2) / hd * f(store.qjl_norm)[..., None] * pm) @ f(store.qjl)
    return np_aids(store, x)


def np_aids(store, x):
    """Undo the aids on quantizer-space vectors x [B, KV, S, hd]: times the key channel scales,
    plus the centre (keys: RoPE-rotated to each slot's position), sink slots exact."""
    if store.chan_scale is not None:
        x = x * np.asarray(store.chan_scale, np.float64)[None, :, None, :]
    if store.center is not None:
        centre = np.broadcast_to(np.asarray(store.center, np.float64)[:, None, :],
                                 (x.shape[1], x.shape[2], x.shape[3]))
        if store.inv_freq is not None:
            centre = np_rope(centre, np.arange(x.shape[2]), store.inv_freq)
        x = x + centre[None]
    if store.sink is not None:
        x = x.copy()
        x[:, :, : store.sink.shape[2]] = np.asarray(store.sink, np.float64)
    return x


def np_dense(store):
    return jnp.asarray(np_reconstruct(store), jnp.float32)


SPECS = [
    CacheSpec("f32", "f32"), CacheSpec("q8", "q8"), CacheSpec("q4", "q4"),
    CacheSpec("turbo2", "turbo2"), CacheSpec("turbo3", "turbo3"), CacheSpec("turbo4", "turbo4"),
    CacheSpec("turbo2.5", "turbo3.5"), CacheSpec("turbo3", "turbo3", sink_tokens=3),
    CacheSpec("turbo4", "bf16", center_keys=False, balance_keys=False),
    CacheSpec("turbo3-prod", "turbo4-prod"),
    CacheSpec("turbo3", "turbo3", sink_tokens=0),
]


@pytest.mark.parametrize("spec", SPECS, ids=lambda s: f"{s.k}-{s.v}-sink{s.sink_tokens}")
def test_attention_equals_attention_on_reconstruction(spec):
    """Prefill a chunk then decode a step on a ragged batch; compare with dense attention on
    the K/V decoded in numpy from the store's fields (no recent window: every slot comes from
    the store). The decoded K/V are also checked to be the inputs up to quantization error."""
    spec = dataclasses.replace(spec, recent_tokens=0)
    rng = np.random.default_rng(0)
    cal = random_calibration(rng)
    inv_freq = 1.0 / 10000 ** (np.arange(0, HD, 2) / HD)
    cache = make_cache(spec, batch=B, slots=S, num_layers=1, kv_heads=KV, head_dim=HD,
                       calibration=cal, inv_freq=inv_freq.astype(np.float32))
    layer = cache.layers[0]
    start = jnp.asarray([0, 0], jnp.int32)
    att = jax.jit(attend)
    for t, st in ((13, start), (1, jnp.asarray([13, 9], jnp.int32))):
        q = jnp.asarray(rng.normal(size=(B, t, KV * G, HD)), jnp.float32)
        k = jnp.asarray(rng.normal(size=(B, t, KV, HD)) * 2 + 1, jnp.float32)
        v = jnp.asarray(rng.normal(size=(B, t, KV, HD)), jnp.float32)
        out, layer = att(layer, q, k, v, st)
        keys, values = np_dense(layer.k), np_dense(layer.v)
        want = dense_attention(q, keys, values, st)
        tol = 2e-4
        chex.assert_trees_all_close(out, want, atol=tol, rtol=tol)
        for x, ref in ((k, keys), (v, values)):  # the slots this chunk wrote hold its rows
            sent = jnp.swapaxes(x, 1, 2)  # [B, KV, t, hd]
            got = jnp.stack([ref[b, :, int(st[b]):int(st[b]) + t] for b in range(B)])
            err = float(jnp.linalg.norm(got - sent) / jnp.linalg.norm(sent))
            # measured: f32 0, q8 0.006, q4 0.08; turbo 0.12-0.76 (random centres and channel
            # scales that do not fit the data inflate the 2-3 bit keys' error)
            assert err < (0.01 if spec.k in ("f32", "q8") else 1.0), err


@pytest.mark.parametrize("name,bits", [("turbo2", 2), ("turbo3", 3), ("turbo4", 4),
                                       ("turbo2.5", 2.5), ("turbo3.5", 3.5), ("q8", 8),
                                       ("q4", 4), ("f16", 16), ("turbo3-prod", 3)])
def test_bytes_per_token_exact(name, bits):
    layers, hd, slots = 3, 64, 40
    cache = make_cache(CacheSpec(name, name, center_keys=False, center_values=False,
                                 balance_keys=False),
                       batch=1, slots=slots, num_layers=layers, kv_heads=KV, head_dim=hd)
    # q4: fp16 step+min per 32; prod: fp16 scale and residual norm
    scale_bits = {"q4": 2 * 16 / 32 * hd, "f16": 0, "turbo3-prod": 32}.get(name, 16)
    want = layers * 2 * KV * (hd * bits + scale_bits) / 8
    assert bytes_per_token(cache) == want
    # the bytes the cache really allocates per slot: every array with a slot axis, stacked
    # over layers [L, 1, KV, S, ...] (per-layer constants such as sink slots, the recent ring
    # or codebooks are not per token)
    per_slot = sum(leaf.nbytes for leaf in jax.tree.leaves(cache)
                   if leaf.ndim >= 4 and leaf.shape[1:4] == (1, KV, slots))
    assert per_slot == want * slots


def test_reconstruction_error_shrinks_with_bits():
    rng = np.random.default_rng(1)
    x = jnp.asarray(rng.normal(size=(1, KV, S, HD)), jnp.float32)
    errs = []
    for name in ("turbo2", "turbo2.5", "turbo3", "turbo3.5", "turbo4", "q8"):
        spec = CacheSpec(name, name, center_keys=False, center_values=False, balance_keys=False)
        st = make_cache(spec, batch=1, slots=S, num_layers=1, kv_heads=KV, head_dim=HD).layers[0].v
        st = kvs.write(st, x, jnp.zeros(1, jnp.int32))
        errs.append(float(jnp.mean((materialize(st) - x) ** 2) / jnp.mean(x**2)))
    assert errs == sorted(errs, reverse=True), errs
    assert 0.10 < errs[0] < 0.13 and errs[4] < 0.011  # Lloyd–Max: 0.117, 0.009


def test_centred_keys_remove_a_large_offset():
    """A huge constant pre-RoPE key offset (Qwen's k_proj bias) costs nothing when centred."""
    rng = np.random.default_rng(2)
    inv_freq = (1.0 / 10000 ** (np.arange(0, HD, 2) / HD)).astype(np.float32)
    offset = rng.normal(size=(KV, HD)).astype(np.float32) * 50
    pre = rng.normal(size=(1, KV, S, HD)).astype(np.float32) + offset[None, :, None]
    from tqjax.kv.rope import apply_rope, rope_cos_sin

    cos, sin = rope_cos_sin(jnp.arange(S), inv_freq)
    k = apply_rope(jnp.asarray(pre), cos, sin)
    cal = Calibration(offset[None], np.zeros((1, KV, HD), np.float32),
                      np.ones((1, KV, HD), np.float32))
    errs = {}
    for centred in (False, True):
        spec = CacheSpec("turbo3", "f32", center_keys=centred, balance_keys=False)
        st = make_cache(spec, batch=1, slots=S, num_layers=1, kv_heads=KV, head_dim=HD,
                        calibration=cal, inv_freq=inv_freq).layers[0].k
        st = kvs.write(st, k, jnp.zeros(1, jnp.int32))
        errs[centred] = float(jnp.mean((materialize(st) - k) ** 2))
    assert errs[True] < errs[False] / 100, errs


@pytest.mark.parametrize("bad", ["turbo5", "turbo1.5x", "int3", ""])
def test_unknown_cache_type(bad):
    with pytest.raises(TqjaxError, match="unknown cache type"):
        make_cache(CacheSpec(bad, "f32"), batch=1, slots=4, num_layers=1, kv_heads=1, head_dim=64)


def test_head_dim_the_packing_cannot_serve():
    with pytest.raises(TqjaxError):
        make_cache(CacheSpec("turbo3", "f32", center_keys=False, balance_keys=False), batch=1,
                   slots=4, num_layers=1, kv_heads=1, head_dim=12)


def test_non_power_of_two_head_dim_uses_dense_rotation():
    spec = CacheSpec("turbo4", "turbo4", center_keys=False, center_values=False,
                     balance_keys=False)
    st = make_cache(spec, batch=1, slots=8, num_layers=1, kv_heads=1, head_dim=48).layers[0].v
    x = jnp.asarray(np.random.default_rng(3).normal(size=(1, 1, 8, 48)), jnp.float32)
    st = kvs.write(st, x, jnp.zeros(1, jnp.int32))
    assert float(jnp.mean((materialize(st) - x) ** 2)) < 0.02


def test_all_advertised_types_are_constructible():
    for name in STORE_FACTORIES:
        spec = CacheSpec(name, name, center_keys=False, center_values=False, balance_keys=False)
        make_cache(spec, batch=1, slots=4, num_layers=1, kv_heads=1, head_dim=64)


def test_generate_with_compressed_cache_on_tiny_model():
    """End to end on a tiny golden model: turbo4 logits stay close to f32."""
    model = tqjax.load(GOLDEN / "tiny" / "qwen2")
    ids = list(range(3, 40))
    spec = CacheSpec("turbo4", "turbo4", center_keys=False, center_values=False,
                     balance_keys=False)
    dense = tqjax.logits(model, ids)
    turbo = tqjax.logits(model, ids, cache=spec)
    assert np.abs(turbo - dense).max() < 0.1 * np.abs(dense).max()
    assert (turbo.argmax(-1) == dense.argmax(-1)).mean() > 0.9
    q8 = tqjax.logits(model, ids, cache=dataclasses.replace(spec, k="q8", v="q8"))
    assert np.abs(q8 - dense).max() < np.abs(turbo - dense).max()


@pytest.mark.parametrize("name", sorted(STORE_FACTORIES))
def test_cache_buffers_are_distinct(name):
    """The decode step donates the cache: no two leaves may share a buffer."""
    rng = np.random.default_rng(0)
    inv_freq = (1.0 / 10000 ** (np.arange(0, HD, 2) / HD)).astype(np.float32)
    cache = make_cache(CacheSpec(name, name), batch=1, slots=8, num_layers=2, kv_heads=KV,
                       head_dim=HD, calibration=random_calibration(rng, layers=2),
                       inv_freq=inv_freq)
    owners: dict[int, list[str]] = {}
    for path, leaf in jax.tree_util.tree_flatten_with_path(cache)[0]:
        owners.setdefault(leaf.unsafe_buffer_pointer(), []).append(jax.tree_util.keystr(path))
    assert [names for names in owners.values() if len(names) > 1] == []


def test_layer_cache_is_a_pytree():
    cache = make_cache(CacheSpec("turbo3", "q8", center_keys=False, balance_keys=False),
                       batch=1, slots=4, num_layers=2, kv_heads=1, head_dim=64)
    leaves, treedef = jax.tree_util.tree_flatten(cache)
    assert isinstance(jax.tree_util.tree_unflatten(treedef, leaves).layers[0], LayerCache)


def window_attention(q, k_store, v_store, k_exact, v_exact, start, lo, window):
    """Reference for the recent window: dense attention where key/value j is the exact
    (fp16-rounded) one when max(qpos - window, lo - 1) < j <= qpos, else the store's
    reconstruction. k/v_* [B, KV, S, hd]; lo [B]: first position the ring holds exactly."""
    b, t, h, hd = q.shape
    qpos = start[:, None] + jnp.arange(t)[None]  # [B, T]
    bound = jnp.maximum(qpos - window, lo[:, None] - 1)
    slot = jnp.arange(k_store.shape[2])
    exact = (slot[None, None] > bound[..., None]) & (slot[None, None] <= qpos[..., None])
    rnd = lambda x: x.astype(jnp.float16).astype(jnp.float32)  # noqa: E731
    keys = jnp.where(exact[:, None, :, :, None], rnd(k_exact)[:, :, None], k_store[:, :, None])
    vals = jnp.where(exact[:, None, :, :, None], rnd(v_exact)[:, :, None], v_store[:, :, None])
    qg = q.reshape(b, t, KV, h // KV, hd)
    s = jnp.einsum("btkgd,bktsd->bkgts", qg, keys) / np.sqrt(hd)
    mask = slot[None, None, :] <= qpos[:, :, None]
    p = jax.nn.softmax(jnp.where(mask[:, None, None], s, -jnp.inf), axis=-1)
    return jnp.einsum("bkgts,bktsd->btkgd", p, vals).reshape(b, t, h, hd)


@pytest.mark.parametrize("backend", ["xla", "pallas"])
def test_recent_window_reads_exact_copies(backend):
    """turbo3 K/V with an 8-token window: a 13-token prefill, then decode steps on a ragged
    batch (row 1 rewinds to position 9, as a shorter prompt does): the last 8 positions of each
    query come from exact copies, older ones from the store, and a rewound row only trusts the
    ring entries it has re-written (positions 5..8 here: 9..12 were its padded tail)."""
    rng = np.random.default_rng(1)
    spec = CacheSpec("turbo3", "turbo3", recent_tokens=8, sink_tokens=2)
    inv_freq = (1.0 / 10000 ** (np.arange(0, HD, 2) / HD)).astype(np.float32)
    layer = make_cache(spec, batch=B, slots=S, num_layers=1, kv_heads=KV, head_dim=HD,
                       calibration=random_calibration(rng), inv_freq=inv_freq).layers[0]
    k_exact = jnp.zeros((B, KV, S, HD))
    v_exact = jnp.zeros((B, KV, S, HD))
    steps = [(13, [0, 0], [0, 0]), (1, [13, 9], [5, 5]), (1, [14, 10], [6, 5])]
    att = jax.jit(functools.partial(attend, backend=backend))
    for t, start, lo in steps:
        start = jnp.asarray(start, jnp.int32)
        q = jnp.asarray(rng.normal(size=(B, t, KV * G, HD)), jnp.float32)
        k = jnp.asarray(rng.normal(size=(B, t, KV, HD)) * 2 + 1, jnp.float32)
        v = jnp.asarray(rng.normal(size=(B, t, KV, HD)), jnp.float32)
        out, layer = att(layer, q, k, v, start)
        for row in range(B):
            s0 = int(start[row])
            k_exact = k_exact.at[row, :, s0:s0 + t].set(k[row].transpose(1, 0, 2))
            v_exact = v_exact.at[row, :, s0:s0 + t].set(v[row].transpose(1, 0, 2))
        want = window_attention(q, np_dense(layer.k), np_dense(layer.v), k_exact, v_exact,
                                start, jnp.asarray(lo), 8)
        chex.assert_trees_all_close(out, want, atol=2e-4, rtol=2e-4)


def test_recent_window_same_in_one_chunk_or_many():
    """A windowed turbo cache gives the same attention whether 30 tokens arrive at once or in
    chunks of 7 (the chunk's own exact rows are rounded like the ring's)."""
    rng = np.random.default_rng(2)
    spec = CacheSpec("turbo4", "turbo3", recent_tokens=8)
    inv_freq = (1.0 / 10000 ** (np.arange(0, HD, 2) / HD)).astype(np.float32)
    empty = make_cache(spec, batch=B, slots=S, num_layers=1, kv_heads=KV, head_dim=HD,
                       calibration=random_calibration(rng), inv_freq=inv_freq).layers[0]
    q = jnp.asarray(rng.normal(size=(B, 30, KV * G, HD)), jnp.float32)
    k = jnp.asarray(rng.normal(size=(B, 30, KV, HD)), jnp.float32)
    v = jnp.asarray(rng.normal(size=(B, 30, KV, HD)), jnp.float32)
    att = jax.jit(attend)  # as the model runs it (eager, each loop compiles on its own)
    whole, _ = att(empty, q, k, v, jnp.zeros(B, jnp.int32))
    layer, parts = empty, []
    for c in range(0, 30, 7):
        out, layer = att(layer, q[:, c:c + 7], k[:, c:c + 7], v[:, c:c + 7],
                         jnp.full(B, c, jnp.int32))
        parts.append(out)
    chex.assert_trees_all_close(jnp.concatenate(parts, axis=1), whole, atol=1e-5, rtol=1e-5)


def test_ragged_turbo4_batch_rows_match_running_alone():
    """Prompts of 45, 17 and 30 tokens in one batch with a turbo4 cache (sinks, centred keys
    and values, balanced keys, an exact recent window of 8, shorter than the length gaps):
    every row's prefill logits and greedy continuation are the ones it gets alone, so a
    shorter row's padded tail never reaches its attention."""
    from tqjax.decode.calibrate import calibrate
    from tqjax.decode.generate import generate_tokens, new_cache, padded_length, prefill
    from tqjax.decode.sampling import SamplingParams

    model = tqjax.load(GOLDEN / "tiny" / "qwen3")  # head_dim 32
    p, c = model.params, model.config
    rng = np.random.default_rng(5)
    prompts = [rng.integers(0, c.vocab_size, n).tolist() for n in (45, 17, 30)]
    spec = CacheSpec("turbo4", "turbo4", recent_tokens=8)
    calib = calibrate(p, c, rng.integers(0, c.vocab_size, 64).tolist())

    def last_logits(batch, cache_spec=spec):
        # padded as generate pads: one prefill shape per batch size, shared with `greedy`
        tokens = np.zeros((len(batch), padded_length(max(map(len, batch)))), np.int32)
        for b, ids in enumerate(batch):
            tokens[b, :len(ids)] = ids
        cache = new_cache(p, c, cache_spec, len(batch), 64, calib)
        return np.asarray(prefill(p, c, tokens, np.asarray(list(map(len, batch))), cache)[0])

    def greedy(batch):
        steps = list(generate_tokens(p, c, batch, max_new_tokens=10, sampling=SamplingParams(),
                                     eos_ids=(), ctx_size=64, cache_spec=spec,
                                     calibration=calib))
        return [s.ids for s in steps[-1][0]]

    together = last_logits(prompts)
    alone = np.concatenate([last_logits([ids]) for ids in prompts])
    # float noise only (XLA sums the factored centre scores in a batch-size-dependent order:
    # 3.1e-5 of the largest logit measured); a padded tail leaking in moves them by > 1e-3
    np.testing.assert_allclose(together, alone, atol=5e-5 * np.abs(alone).max())
    dense = np.concatenate([last_logits([ids], CacheSpec()) for ids in prompts])
    assert np.abs(alone - dense).max() > 1e-3 * np.abs(dense).max()  # the cache is compressed
    assert greedy(prompts) == [greedy([ids])[0] for ids in prompts]


def test_centre_scores_match_float64_rope():
    """The factored ⟨q, R_p μ⟩ table (angle sums over u + v) against the rotated centres built
    in float64 from the same f32 inverse frequencies, at positions up to 16k."""
    import types

    from tqjax.kv.quantized import _centre_scores

    rng = np.random.default_rng(0)
    for hd, kv, n, size, first in [(64, 3, 3, 96, 0), (64, 1, 2, 40, 123), (128, 2, 7, 8192, 8000)]:
        inv = (1.0 / 10000.0 ** (np.arange(0, hd, 2) / hd)).astype(np.float32)
        centre = rng.normal(size=(kv, hd)).astype(np.float32)
        store = types.SimpleNamespace(center=jnp.asarray(centre), inv_freq=jnp.asarray(inv))
        q = rng.normal(size=(2, kv, n, hd)).astype(np.float32)
        got = np.asarray(_centre_scores(store, jnp.asarray(q), jnp.asarray(first), size))
        ang = (first + np.arange(size))[:, None] * inv.astype(np.float64)  # [S, hd/2]
        c, s, h = np.cos(ang)[:, None], np.sin(ang)[:, None], hd // 2
        mu = centre.astype(np.float64)[None]
        m1, m2 = mu[..., :h], mu[..., h:]
        rot = np.concatenate([m1 * c - m2 * s, m2 * c + m1 * s], -1)
        want = np.einsum("bknd,skd->bkns", q.astype(np.float64), rot)
        assert np.abs(got - want).max() <= 1e-4 * np.abs(want).max(), (hd, size, first)


def test_padded_prefill_keeps_each_rows_last_tokens_in_the_ring():
    """A right-padded batch prefill writes only each row's real tokens into its recent-token
    ring (`valid`): with a ring of 32, prompts of 45, 17 and 30 tokens padded to 64 give the
    prefill and decode logits each prompt gets alone, unpadded. (Before, the ring held the
    padding's positions and the rows' last real tokens were read from the compressed store:
    0.12-0.19 of the largest logit off.)"""
    from tqjax.decode.calibrate import calibrate
    from tqjax.decode.generate import new_cache, prefill
    from tqjax.models.transformer import forward

    model = tqjax.load(GOLDEN / "tiny" / "qwen3")
    p, c = model.params, model.config
    rng = np.random.default_rng(5)
    lens = (45, 17, 30)
    prompts = [rng.integers(0, c.vocab_size, n).tolist() for n in lens]
    spec = CacheSpec("turbo4", "turbo4", recent_tokens=32)
    calib = calibrate(p, c, rng.integers(0, c.vocab_size, 64).tolist())
    forced = rng.integers(0, c.vocab_size, 4).tolist()
    step = jax.jit(lambda cache, tok, pos: forward(p, c, tok, pos, cache,
                                                   out_index=jnp.zeros_like(pos)))

    def run(batch, width):
        """Prefill right-padded to `width`, then forced decode steps: logits [B, 1 + steps, V]
        and the first layer's ring positions after the prefill."""
        tokens = np.zeros((len(batch), width), np.int32)
        for b, ids in enumerate(batch):
            tokens[b, :len(ids)] = ids
        lengths = np.asarray(list(map(len, batch)), np.int32)
        cache = new_cache(p, c, spec, len(batch), 128, calib)
        logits, cache = prefill(p, c, tokens, lengths, cache)
        ring = np.asarray(cache.layers[0].recent.pos)
        out, pos = [np.asarray(logits)], lengths.copy()
        for tok in forced:
            logits, cache = step(cache, jnp.full((len(batch), 1), tok, jnp.int32),
                                 jnp.asarray(pos))
            out.append(np.asarray(logits))
            pos = pos + 1
        return np.stack(out, 1), ring

    padded, ring = run(prompts, 64)
    for b, n in enumerate(lens):  # the ring holds the row's last min(n, 32) positions
        assert sorted(x for x in ring[b].tolist() if x >= 0) == list(range(max(0, n - 32), n))
        alone, _ = run([prompts[b]], n)
        # float noise only (measured ~1e-5 of the largest logit; the padding in the ring: > 0.1)
        np.testing.assert_allclose(padded[b], alone[0], atol=1e-4 * np.abs(alone).max())


def test_calibration_is_the_value_means_and_leaves_no_program_behind():
    """`calibrate`: the value means are those of a dense cache filled by a forward pass over the
    same ids (first SKIP_TOKENS skipped), and its one-off program is not kept compiled (an
    XLA:CPU program stays resident while cached: ~60 MB for SmolLM2's)."""
    from tqjax.decode import calibrate as cal_mod
    from tqjax.models.transformer import forward

    model = tqjax.load(GOLDEN / "tiny" / "qwen3")
    p, c = model.params, model.config
    ids = np.random.default_rng(3).integers(0, c.vocab_size, 40).tolist()
    calib = cal_mod.calibrate(p, c, ids)
    assert cal_mod._layer_statistics._cache_size() == 0
    cache = make_cache(CacheSpec(), batch=1, slots=len(ids), num_layers=c.num_layers,
                       kv_heads=c.num_kv_heads, head_dim=c.head_dim)
    _, cache = forward(p, c, jnp.asarray([ids], jnp.int32), jnp.zeros(1, jnp.int32), cache)
    want = np.stack([np.asarray(layer.v.data[0, :, cal_mod.SKIP_TOKENS:], np.float64).mean(1)
                     for layer in cache.layers])
    np.testing.assert_allclose(calib.value_mean, want, rtol=1e-5, atol=1e-6)
