"""KV cache formats: attention on each compressed store equals attention on its own
reconstruction, exact memory accounting, and clear errors for bad specs."""

import dataclasses

import chex
import jax
import jax.numpy as jnp
import numpy as np
import pytest

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
from tqjax.kv.quantized import materialize

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
    the store's own reconstructed K/V (no recent window: every slot comes from the store)."""
    spec = dataclasses.replace(spec, recent_tokens=0)
    rng = np.random.default_rng(0)
    cal = random_calibration(rng)
    inv_freq = 1.0 / 10000 ** (np.arange(0, HD, 2) / HD)
    cache = make_cache(spec, batch=B, slots=S, num_layers=1, kv_heads=KV, head_dim=HD,
                       calibration=cal, inv_freq=inv_freq.astype(np.float32))
    layer = cache.layers[0]
    start = jnp.asarray([0, 0], jnp.int32)
    for t, st in ((13, start), (1, jnp.asarray([13, 9], jnp.int32))):
        q = jnp.asarray(rng.normal(size=(B, t, KV * G, HD)), jnp.float32)
        k = jnp.asarray(rng.normal(size=(B, t, KV, HD)) * 2 + 1, jnp.float32)
        v = jnp.asarray(rng.normal(size=(B, t, KV, HD)), jnp.float32)
        out, layer = attend(layer, q, k, v, st)
        want = dense_attention(q, materialize(layer.k), materialize(layer.v), st)
        tol = 1e-2 if "bf16" in (spec.k, spec.v) else 2e-4  # bf16 stores mix with bf16 weights
        chex.assert_trees_all_close(out, want, atol=tol, rtol=tol)


@pytest.mark.parametrize("name,bits", [("turbo2", 2), ("turbo3", 3), ("turbo4", 4),
                                       ("turbo2.5", 2.5), ("turbo3.5", 3.5), ("q8", 8),
                                       ("q4", 4), ("f16", 16), ("turbo3-prod", 3)])
def test_bytes_per_token_exact(name, bits):
    layers, hd = 3, 64
    cache = make_cache(CacheSpec(name, name, center_keys=False, center_values=False,
                                 balance_keys=False),
                       batch=1, slots=32, num_layers=layers, kv_heads=KV, head_dim=hd)
    # q4: fp16 step+min per 32; prod: fp16 scale and residual norm
    scale_bits = {"q4": 2 * 16 / 32 * hd, "f16": 0, "turbo3-prod": 32}.get(name, 16)
    want = layers * 2 * KV * (hd * bits + scale_bits) / 8
    assert bytes_per_token(cache) == want
    if name == "turbo3":
        assert (hd * 3 + 16) / hd == 3.25 and 16 / 3.25 >= 4.9


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
    for t, start, lo in steps:
        start = jnp.asarray(start, jnp.int32)
        q = jnp.asarray(rng.normal(size=(B, t, KV * G, HD)), jnp.float32)
        k = jnp.asarray(rng.normal(size=(B, t, KV, HD)) * 2 + 1, jnp.float32)
        v = jnp.asarray(rng.normal(size=(B, t, KV, HD)), jnp.float32)
        out, layer = attend(layer, q, k, v, start, backend=backend)
        for row in range(B):
            s0 = int(start[row])
            k_exact = k_exact.at[row, :, s0:s0 + t].set(k[row].transpose(1, 0, 2))
            v_exact = v_exact.at[row, :, s0:s0 + t].set(v[row].transpose(1, 0, 2))
        want = window_attention(q, materialize(layer.k), materialize(layer.v), k_exact, v_exact,
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
    whole, _ = attend(empty, q, k, v, jnp.zeros(B, jnp.int32))
    layer, parts = empty, []
    for c in range(0, 30, 7):
        out, layer = attend(layer, q[:, c:c + 7], k[:, c:c + 7], v[:, c:c + 7],
                            jnp.full(B, c, jnp.int32))
        parts.append(out)
    chex.assert_trees_all_close(jnp.concatenate(parts, axis=1), whole, atol=1e-5, rtol=1e-5)
