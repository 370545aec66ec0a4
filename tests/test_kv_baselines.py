"""The llama.cpp-style KV baselines (q8, q8_0, q4, q4_0, Hadamard q4_0h) and the aids they can
share with TurboQuant: attention through the blockwise path against a float64 numpy reference
that quantizes with hand-written numpy roundings (and scipy's Hadamard matrix), the Q4_0/Q8_0
blocks against the gguf package's llama.cpp codec, and bits per value by formula."""

import dataclasses
import functools

import jax
import jax.numpy as jnp
import numpy as np
import pytest
import scipy.linalg
from gguf import GGMLQuantizationType, quants

from tqjax.errors import TqjaxError
from tqjax.kv import cache as kvc
from tqjax.kv import store as kvs
from tqjax.kv.cache import CacheSpec, Calibration, attend, bytes_per_token, constant_bytes
from tqjax.kv.quantized import materialize

B, KV, G, HD, S, BLOCK = 2, 2, 3, 64, 40, 16  # 40 slots: blocks of 16 and an overlapping last
INV_FREQ = (1.0 / 10000 ** (np.arange(0, HD, 2) / HD)).astype(np.float32)
F16 = lambda x: np.asarray(x, np.float32).astype(np.float16).astype(np.float64)  # noqa: E731


# ---------------------------------------------------------------- numpy roundings: the codes and
# fp16 scales from float32 arithmetic (as the formats define them), reconstruction in float64


def blocks(x, g):
    return np.asarray(x, np.float32).reshape(*np.shape(x)[:-1], np.shape(x)[-1] // g, g)


def np_q8(x, g):
    """Symmetric int8, fp16 scale absmax/127 per g values; x ≈ d·round(x/d)."""
    xb = blocks(x, g)
    d = F16(np.abs(xb).max(-1) / np.float32(127))[..., None]
    q = np.clip(np.round(xb / np.where(d == 0, 1, d).astype(np.float32)), -127, 127)
    return (q * d).reshape(np.shape(x))


def np_q4_affine(x, g=32):
    """Affine 4-bit per g values: fp16 min and step (max − min)/15, q = round((x − min)/step)."""
    xb = blocks(x, g)
    lo = F16(xb.min(-1))[..., None]
    step = F16((xb.max(-1) - xb.min(-1)) / np.float32(15))[..., None]
    q = np.round((xb - lo.astype(np.float32)) / np.where(step == 0, 1, step).astype(np.float32))
    return (lo + step * np.clip(q, 0, 15)).reshape(np.shape(x))


def np_q4_0(x, g=32):
    """llama.cpp Q4_0: d = (value of largest magnitude)/−8 in fp16, q = min(15, ⌊x/d + 8.5⌋)."""
    xb = blocks(x, g)
    m = np.take_along_axis(xb, np.abs(xb).argmax(-1)[..., None], -1)
    d = F16(m / np.float32(-8))
    q = np.clip(np.floor(xb / np.where(d == 0, 1, d).astype(np.float32) + np.float32(8.5)), 0, 15)
    return ((q - 8) * d).reshape(np.shape(x))


HADAMARD = scipy.linalg.hadamard(HD) / np.sqrt(HD)  # symmetric, orthogonal


def np_q4_0h(x):
    return np_q4_0(np.asarray(x, np.float64) @ HADAMARD) @ HADAMARD


ROUNDINGS = {"q8": lambda x: np_q8(x, x.shape[-1]), "q8_0": lambda x: np_q8(x, 32),
             "q4": np_q4_affine, "q4_0": np_q4_0, "q4_0h": np_q4_0h}


def np_rope(x, pos):
    """Half-split RoPE of x [..., hd] at positions pos (broadcast over x's leading axes)."""
    ang = np.asarray(pos, np.float64)[..., None] * INV_FREQ.astype(np.float64)
    c, s, h = np.cos(ang), np.sin(ang), x.shape[-1] // 2
    return np.concatenate([x[..., :h] * c - x[..., h:] * s, x[..., h:] * c + x[..., :h] * s], -1)


def np_attention(q, keys, values, start):
    """Causal GQA softmax attention in float64. q [B, T, H, hd]; keys/values per query position:
    [B, T, KV, S, hd] (row t sees slots 0..start+t). Returns [B, T, H, hd]."""
    b, t, h, hd = q.shape
    out = np.zeros((b, t, h, hd))
    for row in range(b):
        for j in range(t):
            pos = int(start[row]) + j
            for head in range(h):
                kv = head // (h // KV)
                s = keys[row, j, kv, : pos + 1] @ q[row, j, head] / np.sqrt(hd)
                p = np.exp(s - s.max())
                out[row, j, head] = p @ values[row, j, kv, : pos + 1] / p.sum()
    return out


# ---------------------------------------------------------------- attention vs reference

STEPS = [(13, [0, 0]), (19, [13, 9]), (1, [32, 28]), (1, [33, 29])]  # ragged: row 1 rewinds


def run_steps(spec, rng, calibration=None):
    """Write random chunks through `attend` (XLA, blocks of 16); yield what each step saw."""
    layer = kvc.make_cache(spec, batch=B, slots=S, num_layers=1, kv_heads=KV, head_dim=HD,
                           calibration=calibration, inv_freq=INV_FREQ).layers[0]
    att = jax.jit(functools.partial(attend, backend="xla"))  # fresh: patched blocks retrace
    for t, start in STEPS:
        start = np.asarray(start, np.int32)
        q = rng.normal(size=(B, t, KV * G, HD)).astype(np.float32)
        k = (rng.normal(size=(B, t, KV, HD)) * 2 + 1).astype(np.float32)
        v = rng.normal(size=(B, t, KV, HD)).astype(np.float32)
        v[..., 5] *= 8  # an outlier channel: what a Hadamard rotation spreads out
        out, layer = att(layer, jnp.asarray(q), jnp.asarray(k), jnp.asarray(v),
                         jnp.asarray(start))
        yield q, k, v, start, np.asarray(out, np.float64)


def per_query(x, t):
    """[B, KV, S, hd] -> the same keys/values for each of t query rows, [B, t, KV, S, hd]."""
    return np.repeat(x[:, None], t, axis=1)


def written(buf, x, start):
    """buf [B, KV, S, hd] with the chunk x [B, T, KV, hd] written at slots start[b].."""
    buf = buf.copy()
    for row in range(B):
        buf[row, :, start[row]:start[row] + x.shape[1]] = x[row].transpose(1, 0, 2)
    return buf


@pytest.mark.parametrize("name", sorted(ROUNDINGS))
def test_attention_matches_numpy_quantized_reference(name, monkeypatch):
    """Every written key/value rounded by the numpy codec, then float64 softmax attention: the
    store's blockwise attention (scores and mix in its own basis) agrees to f32 precision, and
    is measurably far from attention on the unrounded keys/values (the check can fail)."""
    monkeypatch.setattr(kvc, "BLOCK", BLOCK)
    spec = CacheSpec(name, name, recent_tokens=0, sink_tokens=0)
    rng = np.random.default_rng(7)
    kbuf, vbuf = np.zeros((B, KV, S, HD)), np.zeros((B, KV, S, HD))
    gap = 0.0
    for q, k, v, start, out in run_steps(spec, rng):
        kbuf, vbuf = written(kbuf, k, start), written(vbuf, v, start)
        t, rnd = q.shape[1], ROUNDINGS[name]
        want = np_attention(q, per_query(rnd(kbuf), t), per_query(rnd(vbuf), t), start)
        exact = np_attention(q, per_query(kbuf, t), per_query(vbuf, t), start)
        np.testing.assert_allclose(out, want, atol=2e-4, rtol=2e-4)
        gap = max(gap, np.abs(out - exact).max())
    assert gap > 5e-3, gap  # the rounding shows: 5e-3 is 25x the tolerance


# ---------------------------------------------------------------- the aids on a baseline


def calibration(rng):
    return Calibration(key_mean=rng.normal(size=(1, KV, HD)).astype(np.float32) * 3,
                       value_mean=rng.normal(size=(1, KV, HD)).astype(np.float32),
                       key_scale=np.exp(rng.normal(size=(1, KV, HD)) * 0.3).astype(np.float32))


@pytest.mark.parametrize("name", ["q4", "q4_0h"])
def test_aided_baseline_matches_numpy_reference(name, monkeypatch):
    """baseline_aids: keys stored as round((k − R_p μ_k)/s)·s + R_p μ_k, values as
    round(v − μ_v) + μ_v, the first 3 positions exact (fp16), and each query's 8 most recent
    positions exact (fp16 ring; row 1's rewind re-trusts only what it re-wrote)."""
    monkeypatch.setattr(kvc, "BLOCK", BLOCK)
    sinks, window = 3, 8
    spec = CacheSpec(name, name, baseline_aids=True, sink_tokens=sinks, recent_tokens=window)
    rng = np.random.default_rng(8)
    cal = calibration(rng)
    mu_k, mu_v = cal.key_mean[0].astype(np.float64), cal.value_mean[0].astype(np.float64)
    scale = cal.key_scale[0].astype(np.float64)  # [KV, hd]
    slot_pos = np.arange(S)
    centre_k = np_rope(mu_k[:, None, :], slot_pos[None, :])  # [KV, S, hd]
    kbuf, vbuf = np.zeros((B, KV, S, HD)), np.zeros((B, KV, S, HD))
    rnd = ROUNDINGS[name]
    ring = np.full((B, window), -1)  # the position each ring slot holds (p lives at p % window)
    gap = 0.0
    for q, k, v, start, out in run_steps(spec, rng, cal):
        lo = start.copy()  # the run of positions start-1, start-2, ... the ring still holds
        for row in range(B):
            while lo[row] > 0 and start[row] - lo[row] < window \
                    and ring[row, (lo[row] - 1) % window] == lo[row] - 1:
                lo[row] -= 1
            for pos in range(start[row], start[row] + q.shape[1]):
                ring[row, pos % window] = pos
        kbuf, vbuf = written(kbuf, k, start), written(vbuf, v, start)
        k_rec = rnd((kbuf - centre_k) / scale[:, None]) * scale[:, None] + centre_k
        v_rec = rnd(vbuf - mu_v[:, None]) + mu_v[:, None]
        k_rec[:, :, :sinks], v_rec[:, :, :sinks] = F16(kbuf[:, :, :sinks]), F16(vbuf[:, :, :sinks])
        t = q.shape[1]
        keys, vals = per_query(k_rec, t), per_query(v_rec, t)  # [B, T, KV, S, hd]
        for row in range(B):
            for j in range(t):
                pos = int(start[row]) + j
                near = slice(max(pos - window, int(lo[row]) - 1) + 1, pos + 1)
                keys[row, j, :, near] = F16(kbuf[row, :, near])
                vals[row, j, :, near] = F16(vbuf[row, :, near])
        want = np_attention(q, keys, vals, start)
        np.testing.assert_allclose(out, want, atol=2e-4, rtol=2e-4)
        plain = np_attention(q, per_query(rnd(kbuf), t), per_query(rnd(vbuf), t), start)
        gap = max(gap, np.abs(out - plain).max())
    assert gap > 5e-3, gap  # the aids change the answer: not the plain baseline


# ---------------------------------------------------------------- llama.cpp block codec


def gguf_blocks(name, store, x):
    """Our codes and scales [1, KV, S, ...] as llama.cpp's block bytes, and gguf's own
    quantization of x, both [KV*S*hd/32, bytes]."""
    scale = np.asarray(store.scale).reshape(-1, 1).view(np.uint8)  # fp16 d, little-endian
    if name == "q8_0":
        qs = np.asarray(store.q).reshape(-1, 32).view(np.uint8)
        ours, kind = np.concatenate([scale, qs], -1), GGMLQuantizationType.Q8_0
    else:  # Q4_0: byte j holds element j (low nibble) and element j + 16 (high nibble)
        codes = materialize(store) / np.repeat(np.asarray(store.scale, np.float32), 32, -1) + 8
        codes = np.rint(np.asarray(codes)).astype(np.uint8).reshape(-1, 32)
        ours = np.concatenate([scale, codes[:, :16] | (codes[:, 16:] << 4)], -1)
        kind = GGMLQuantizationType.Q4_0
    return ours, quants.quantize(x.reshape(-1, 32), kind).reshape(-1, ours.shape[-1]), kind


@pytest.mark.parametrize("name", ["q8_0", "q4_0"])
def test_blocks_are_llama_cpp_blocks(name):
    """Our q8_0/q4_0 state written as GGUF blocks decodes with gguf's llama.cpp codec to exactly
    our reconstruction; gguf's own quantization picks the same scales and codes for ≥ 97% of
    values, ±1 elsewhere (llama.cpp divides by the unrounded scale, we by the stored one)."""
    x = np.random.default_rng(9).normal(size=(1, KV, S, HD)).astype(np.float32) * 3
    st = kvc.STORE_FACTORIES[name](kvc.StoreShape(1, KV, S, HD, 0))
    st = kvs.write(st, jnp.asarray(x), jnp.zeros(1, jnp.int32))
    ours, theirs, kind = gguf_blocks(name, st, x)
    np.testing.assert_array_equal(quants.dequantize(ours, kind).reshape(x.shape),
                                  np.asarray(materialize(st)))
    np.testing.assert_array_equal(ours[:, :2], theirs[:, :2])  # the fp16 scales
    a, b = (quants.dequantize(z, kind).astype(np.float64) for z in (ours, theirs))
    d = np.repeat(ours[:, :2].copy().view(np.float16).astype(np.float64), 32, -1)
    steps = np.abs(a - b) / np.abs(d)  # code differences, in units of the block's scale
    assert np.all(np.isclose(steps, np.round(steps))) and steps.max() <= 1
    assert (steps == 0).mean() >= 0.97, (steps == 0).mean()


# ---------------------------------------------------------------- accounting and errors


@pytest.mark.parametrize("name,hd,bits", [
    ("q8", 64, 8 + 16 / 64), ("q8", 128, 8 + 16 / 128), ("q8_0", 64, 8 + 16 / 32),
    ("q4", 64, 4 + 2 * 16 / 32), ("q4_0", 64, 4 + 16 / 32), ("q4_0h", 128, 4 + 16 / 32)])
def test_bits_per_value_by_formula(name, hd, bits):
    """Per stored value: the code bits plus each block's fp16 scale(s) over its values; the aids
    add no per-token bytes, only per-layer constants."""
    layers, slots = 3, 32
    plain = kvc.make_cache(CacheSpec(name, name), batch=1, slots=slots, num_layers=layers,
                           kv_heads=KV, head_dim=hd)
    assert 8 * bytes_per_token(plain) / (layers * 2 * KV * hd) == bits
    assert constant_bytes(plain) == 0
    rng = np.random.default_rng(0)
    cal = Calibration(*(rng.normal(size=(layers, KV, hd)).astype(np.float32) for _ in range(3)))
    n_sink, n_ring = 4, 8
    spec = CacheSpec(name, name, baseline_aids=True, sink_tokens=n_sink, recent_tokens=n_ring)
    aided = kvc.make_cache(spec, batch=1, slots=slots, num_layers=layers, kv_heads=KV,
                           head_dim=hd, calibration=cal, inv_freq=np.ones(hd // 2, np.float32))
    assert bytes_per_token(aided) == bytes_per_token(plain)
    # f32 key centre, key channel scales, rope frequencies and value centre; fp16 sink slots
    # for K and V; the fp16 K/V ring and its int32 positions
    per_layer = 4 * (3 * KV * hd + hd // 2) + 2 * 2 * n_sink * KV * hd + 2 * 2 * n_ring * KV * hd \
        + 4 * n_ring
    assert constant_bytes(aided) == layers * per_layer


def test_aids_follow_the_switches():
    """baseline_aids only adds what the usual switches allow: naive switches leave a plain store
    and need no calibration; turbo keeps its aids without the flag."""
    assert not CacheSpec("q4_0", "q4_0").needs_calibration
    assert CacheSpec("q4_0", "q4_0", baseline_aids=True).needs_calibration
    assert not CacheSpec("q4_0", "q4_0", baseline_aids=True, center_keys=False,
                         center_values=False, balance_keys=False).needs_calibration
    assert CacheSpec("f32", "f32", boundary_layers=1, boundary_type="q8",
                     baseline_aids=True).needs_calibration
    spec = dataclasses.replace(CacheSpec("q4_0", "q8_0", baseline_aids=True), **kvc.NAIVE)
    layer = kvc.make_cache(spec, batch=1, slots=8, num_layers=1, kv_heads=KV,
                           head_dim=HD).layers[0]
    assert type(layer.k).__name__ == "Q40Store" and type(layer.v).__name__ == "Int8Store"
    assert layer.recent is None


@pytest.mark.parametrize("name,hd,match", [("q4_0h", 96, "power-of-two"),
                                           ("q8_0", 48, "divisible by 32"),
                                           ("q4_0", 16, "divisible by 32")])
def test_head_dims_a_format_cannot_serve(name, hd, match):
    with pytest.raises(TqjaxError, match=match):
        kvc.make_cache(CacheSpec(name, name), batch=1, slots=4, num_layers=1, kv_heads=1,
                       head_dim=hd)
