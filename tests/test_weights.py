"""Weight quantization: formats, quantizers, GPTQ, mixed allocation, params, checkpoints."""

import dataclasses
import json
import math
import time
from pathlib import Path

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from safetensors.numpy import load_file

import tqjax
from tqjax.decode.generate import new_cache
from tqjax.errors import TqjaxError
from tqjax.fetch import PYTHON_STDLIB_MODULES
from tqjax.kv.cache import make_cache
from tqjax.models import checkpoint as ckpt
from tqjax.models.calibration import (
    CALIBRATION_CHARS,
    CALIBRATION_MODULES,
    CALIBRATION_WINDOWS,
    MAX_CALIBRATION_CHARS,
    calibration_corpus,
    calibration_source,
    calibration_windows,
)
from tqjax.models.quantize import (
    EMBEDDING_FORMAT,
    WeightSpec,
    fisher_diagonal,
    get_path,
    linear_paths,
    quantize_params,
    run_sequential,
    weight_formats,
)
from tqjax.models.tokenizer import tokenizer_from_gguf
from tqjax.models.transformer import forward
from tqjax.quant import weights as qw
from tqjax.quant.accounting import params_bits, shared_bits, unique_bytes
from tqjax.quant.codebook import lloyd_max
from tqjax.quant.mixed import (
    _lower_hull,
    allocate,
    candidate_formats,
    format_loss,
    format_losses,
)
from tqjax.quant.weights import (
    HessianFactor,
    QuantizedLinear,
    WeightFormat,
    _factor,
    _tiled_matmul,
    dequantize_weight,
    effective_weight,
    format_lut,
    gather_columns,
    hessian_factor,
    linear,
    quantize_linear,
    to_stored_basis,
)

from .conftest import GOLDEN

FORMATS = [WeightFormat("sym", 8, 0), WeightFormat("sym", 4, 32), WeightFormat("affine", 4, 32),
           WeightFormat("tq", 8, 64), WeightFormat("tq", 4, 64), WeightFormat("tq", 3, 64),
           WeightFormat("tq", 2, 32), WeightFormat("sym", 8, 0, rotation=64),
           WeightFormat("affine", 4, 32, rotation=16)]
TOKENS = list(range(3, 35))


def rel_err(a, b):
    return float(np.linalg.norm(np.asarray(a) - np.asarray(b)) / np.linalg.norm(np.asarray(b)))


@pytest.fixture(scope="module")
def tiny():
    return tqjax.load(GOLDEN / "tiny" / "qwen2_gqa7")  # hidden 112: padded to the group


@pytest.fixture(scope="module")
def tiny_ref(tiny):
    return tqjax.logits(tiny, TOKENS)


# ---------------------------------------------------------------- formats and quantizers


@pytest.mark.parametrize("fmt,k", list(zip(FORMATS, [40, 112, 112, 100, 112, 64, 40, 100, 40],
                                           strict=True)),
                         ids=lambda x: getattr(x, "name", str(x)))
def test_quantize_linear_round_trip_and_padding(fmt, k):
    w = np.random.default_rng(k).standard_normal((k, 24)).astype(np.float32)
    q = quantize_linear(jnp.asarray(w), fmt)
    g, k_pad = fmt.group_size(k), fmt.padded_in(k)  # rotated per channel: 100 -> 128 rows
    assert g == (fmt.group or -(-k // max(fmt.rotation_block, 1)) * max(fmt.rotation_block, 1))
    assert (q.in_features, q.padded_in, q.out_features, q.group) == (k, k_pad, 24, g)
    assert q.packed.shape == (24, k_pad * fmt.bits // 8) and q.packed.dtype == jnp.uint8
    assert q.scale.shape == (24, k_pad // g) and q.scale.dtype == jnp.float16
    assert (q.offset is not None) == (fmt.kind == "affine")
    assert (q.rotation.dim if q.rotation else 0) == fmt.rotation_block
    codes = np_codes(q.packed, fmt.bits)  # numpy's unpacking of the stream along K
    # the reference dequantization is scale * lut[code] (+ offset) in the stored basis
    want = np.asarray(q.lut)[codes].reshape(k_pad // g, g, 24) * np.asarray(
        q.scale, np.float32).T[:, None]
    if q.offset is not None:
        want = want + np.asarray(q.offset, np.float32).T[:, None]
    np.testing.assert_allclose(dequantize_weight(q), want.reshape(k_pad, 24), rtol=1e-6)
    budget = {8: 0.01, 4: 0.12, 3: 0.2, 2: 0.4}[fmt.bits]  # ‖Δw‖/‖w‖
    assert rel_err(effective_weight(q), w) < budget
    x = np.random.default_rng(1).standard_normal((3, 5, k)).astype(np.float32)
    np.testing.assert_allclose(linear(jnp.asarray(x), q), x @ np.asarray(effective_weight(q)),
                               rtol=1e-4, atol=1e-4)


def np_codes(packed, bits):
    """Codes [K, N] from bytes uint8 [N, K·bits/8], each output's codes packed along K: numpy's
    own bit unpacking of the little-endian stream (bit j of code i is stream bit i·bits + j)."""
    stream = np.unpackbits(np.asarray(packed), axis=1, bitorder="little")  # [N, K·bits]
    stream = stream.reshape(stream.shape[0], -1, bits).astype(np.int64)
    return (stream << np.arange(bits)).sum(-1).T


def np_dequantize(q):
    """The stored weight f32 [K_pad, N] by a numpy LUT lookup of the unpacked codes."""
    v = np.asarray(q.lut)[np_codes(q.packed, q.bits)]
    v = v.reshape(-1, q.group, v.shape[1]) * np.asarray(q.scale, np.float32).T[:, None]
    if q.offset is not None:
        v = v + np.asarray(q.offset, np.float32).T[:, None]
    return v.reshape(-1, v.shape[2])


LINEAR_FORMATS = [WeightFormat("tq", 2, 32), WeightFormat("tq", 3, 64), WeightFormat("tq", 4, 64),
                  WeightFormat("tq", 8, 64), WeightFormat("sym", 8, 0), WeightFormat("sym", 4, 32),
                  WeightFormat("affine", 4, 32), WeightFormat("sym", 6, 32)]


@pytest.mark.parametrize("fmt", LINEAR_FORMATS, ids=lambda f: f.name)
@pytest.mark.parametrize("m", [1, 7])
def test_linear_matches_numpy_dequantization(fmt, m, monkeypatch):
    """The XLA paths against x @ a numpy dequantization, in the stored basis and through
    `linear`: tiles of outputs (forced small here: 3 whole tiles and a remainder) and, for one
    row, the fused dots (runs forced short: several groups per run, or a group cut in runs)."""
    k, n = 100, 3 * 128 + 44  # 100 inputs: padded to the group
    w = np.random.default_rng(k + fmt.bits).standard_normal((k, n)).astype(np.float32)
    q = quantize_linear(jnp.asarray(w), fmt)
    monkeypatch.setattr(qw, "TILE_WEIGHTS", 128 * q.padded_in)
    monkeypatch.setattr("tqjax.quant.tiling.FUSED_BYTES", 8 * fmt.bits + 1)  # runs of 64 codes
    want_w = np_dequantize(q)  # [K_pad, N]
    np.testing.assert_allclose(dequantize_weight(q), want_w, rtol=1e-6)
    xs = np.random.default_rng(m).standard_normal((m, q.padded_in)).astype(np.float32)
    got = _tiled_matmul(jnp.asarray(xs), q)
    assert got.shape == (m, n)
    np.testing.assert_allclose(got, xs @ want_w, rtol=1e-4, atol=1e-4 * np.abs(xs @ want_w).max())
    x = np.random.default_rng(m + 1).standard_normal((2, m, k)).astype(np.float32)
    want = x @ np.asarray(effective_weight(q))
    np.testing.assert_allclose(linear(jnp.asarray(x), q), want, rtol=1e-4,
                               atol=1e-4 * np.abs(want).max())


def test_linear_keeps_no_dequantized_weight():
    """Compiled for a wide weight, the XLA paths' temporaries (tiles at prefill, the fused dots
    of a decode step) stay far below the f32 [K, N] weight that dequantize-then-dot writes."""
    k, n = 256, 16384
    rng = np.random.default_rng(0)
    q = QuantizedLinear(packed=jnp.asarray(rng.integers(0, 256, (n, k // 2), dtype=np.uint8)),
                        scale=jnp.ones((n, k // 64), jnp.float16),
                        lut=format_lut(WeightFormat("tq", 4, 64)), bits=4, group=64, in_features=k)
    x = jnp.asarray(rng.standard_normal((8, k)), jnp.float32)
    dense = jax.jit(lambda x, q: x @ dequantize_weight(q)).lower(x, q).compile()
    assert dense.memory_analysis().temp_size_in_bytes >= k * n * 4
    for rows in (8, 1):  # prefill (tiles), decode (fused dots)
        xs = x[:rows]
        path = jax.jit(lambda x, q: linear(x, q, backend="xla")).lower(xs, q).compile()
        assert path.memory_analysis().temp_size_in_bytes < k * n * 4 // 4
        np.testing.assert_allclose(path(xs, q), xs @ np_dequantize(q), rtol=1e-4, atol=1e-3)


def test_grid_weights_are_reproduced_exactly():
    rng = np.random.default_rng(0)
    levels = rng.integers(-8, 8, (64, 16))
    levels[0] = -8  # every group of 32 holds its absmax at -8 (Q4_0's rule)
    levels[32] = -8
    w = levels * np.float32(0.125)
    q = quantize_linear(jnp.asarray(w, jnp.float32), WeightFormat("sym", 4, 32))
    np.testing.assert_array_equal(effective_weight(q), w)
    a = rng.integers(0, 16, (64, 16))
    a[0], a[1], a[32], a[33] = 0, 15, 0, 15
    w = a * np.float32(0.25) - np.float32(1.5)
    q = quantize_linear(jnp.asarray(w), WeightFormat("affine", 4, 32))
    np.testing.assert_array_equal(effective_weight(q), w)


def test_tq_lut_is_the_shared_lloyd_max_codebook():
    from .test_quant_core import np_lloyd_max

    lut = format_lut(WeightFormat("tq", 3, 64))
    # Lloyd–Max for a unit vector's coordinate in R^64 (scipy, float64), in the N(0, 1) scale
    np.testing.assert_allclose(lut, np_lloyd_max(3, 64) * 8, rtol=1e-6)
    assert format_lut(WeightFormat("tq", 3, 64)) is lut  # one shared array per format


@pytest.mark.parametrize("kind,bits,group,rotation", [
    ("tq", 4, 48, 0), ("tq", 4, 0, 0), ("sym", 4, 12, 0), ("int", 4, 32, 0), ("sym", 9, 32, 0),
    ("tq", 4, 64, 64), ("sym", 8, 0, 48), ("sym", 4, 32, 64), ("affine", 4, 32, 4)])
def test_bad_formats(kind, bits, group, rotation):
    with pytest.raises(TqjaxError):
        WeightFormat(kind, bits, group, rotation)


@pytest.mark.parametrize("fmt", [WeightFormat("tq", 3, 64), WeightFormat("sym", 8, 0, 64)],
                         ids=lambda f: f.name)
def test_gptq_beats_round_to_nearest_on_correlated_inputs(fmt):
    rng = np.random.default_rng(0)
    k, n = 128, 32
    mix = rng.standard_normal((k, k)) / np.sqrt(k) + np.eye(k)
    x = (rng.standard_normal((2048, k)) * np.linspace(0.2, 3, k)) @ mix
    w = rng.standard_normal((k, n)).astype(np.float32)
    h = jnp.asarray(x.T @ x, jnp.float32)
    err = [float(np.sum((x @ (np.asarray(effective_weight(q)) - w)) ** 2))
           for q in (quantize_linear(jnp.asarray(w), fmt),
                     quantize_linear(jnp.asarray(w), fmt, hessian=hessian_factor(h, fmt)))]
    assert err[1] < 0.8 * err[0], err
    with pytest.raises(TqjaxError):  # a factor for another basis
        quantize_linear(jnp.asarray(w), WeightFormat("tq", 4, 32),
                        hessian=hessian_factor(h, WeightFormat("tq", 4, 64)))


@pytest.mark.parametrize("fmt", [WeightFormat("sym", 8, 0), WeightFormat("tq", 4, 32)],
                         ids=lambda f: f.name)
@pytest.mark.parametrize("consume", [False, True])
@pytest.mark.parametrize("host", [False, True])
def test_hessian_factor_is_gptq_upper_cholesky_of_the_inverse(fmt, consume, host):
    """The rows `_upper_rows` reads make an upper-triangular U with Uᵀ U = (H + λI)⁻¹ in
    quantization order (float64 reference), H in the stored basis (rotated for "tq"); dead
    inputs get a unit diagonal. `consume` deletes a jax H and factors a host_buffer H in its
    own buffer (the factor is then H's buffer); otherwise H is left as it was."""
    from tqjax.host import host_buffer
    from tqjax.quant.weights import _upper_rows

    rng = np.random.default_rng(3)
    k = 96
    x = rng.standard_normal((512, k)) * np.linspace(0.2, 2, k)
    x[:, 5] = 0  # a dead input
    kept = (x.T @ x).astype(np.float32)
    if host:
        h = host_buffer((k, k), np.float32)
        h[:] = kept
    else:
        h = jnp.asarray(kept)
    factor = hessian_factor(h, fmt, damp=0.01, consume=consume)
    if host and consume:
        assert factor.inverse.unsafe_buffer_pointer() == h.ctypes.data
    elif not host:
        assert h.is_deleted() == consume
    if not consume:
        np.testing.assert_array_equal(np.asarray(h), kept)
    hr = np.asarray(to_stored_basis(to_stored_basis(jnp.asarray(kept), fmt).T, fmt), np.float64)
    order = np.asarray(factor.order)
    hp = hr[order][:, order]
    dead = np.diag(hp) <= 1e-6
    np.testing.assert_array_equal(np.asarray(factor.dead), dead)
    assert dead.sum() == (0 if fmt.rotation_block else 1)
    hp += np.diag(dead.astype(np.float64))
    hp += 0.01 * np.mean(np.diag(hp)) * np.eye(k)
    np.testing.assert_allclose(np.asarray(factor.importance), np.diag(hp), rtol=1e-5)
    u = np.concatenate([np.asarray(_upper_rows(factor.inverse, jnp.int32(a), 32), np.float64)
                        for a in range(0, k, 32)])
    assert np.all(np.tril(u, -1) == 0)
    np.testing.assert_allclose(u.T @ u, np.linalg.inv(hp), rtol=1e-3,
                               atol=1e-4 * np.abs(np.linalg.inv(hp)).max())


def test_gram_is_summed_in_place_and_symmetric():
    """`_gram` (BLAS syrk into a host buffer, one window at a time) is Σ xᵀx over every row of
    every window, both triangles filled (float64 reference), in an aligned writable buffer."""
    from tqjax.host import HOST_ALIGN
    from tqjax.models.quantize import _gram

    rng = np.random.default_rng(6)
    acts = [rng.standard_normal((1, t, 1100)).astype(np.float32) for t in (7, 30)]
    got = _gram([jnp.asarray(a) for a in acts])
    want = sum(a[0].astype(np.float64).T @ a[0].astype(np.float64) for a in acts)
    np.testing.assert_allclose(got, want, rtol=1e-4, atol=1e-4)
    np.testing.assert_array_equal(got, got.T)
    assert got.flags.writeable and got.ctypes.data % HOST_ALIGN == 0
    # windows made one at a time as they are asked for give the same sums
    np.testing.assert_array_equal(_gram(jnp.asarray(a) for a in acts), got)
    with pytest.raises(TqjaxError, match="at least one"):
        _gram([])


@pytest.mark.parametrize("fmt", [WeightFormat("sym", 4, 32), WeightFormat("affine", 4, 32)],
                         ids=lambda f: f.name)
def test_gptq_act_order_maps_codes_back_to_their_rows(fmt):
    """With uncorrelated inputs GPTQ has no error to push on, so in any order it must give
    round to nearest's codes and scales, in the stored row and group order."""
    rng = np.random.default_rng(1)
    k, n = 96, 16
    w = jnp.asarray(rng.standard_normal((k, n)), jnp.float32)
    diag = rng.uniform(0.1, 10.0, k)  # a scrambled order: groups and rows permuted
    factor = hessian_factor(jnp.diag(jnp.asarray(diag, jnp.float32)), fmt)
    order = np.asarray(factor.order)
    assert sorted(order.tolist()) == list(range(k))
    by_group = diag[order].reshape(-1, 32)  # whole groups, the heaviest first, rows descending
    assert np.all(np.diff(by_group.sum(axis=1)) <= 0) and np.all(np.diff(by_group, axis=1) <= 0)
    assert np.all(order.reshape(-1, 32) // 32 == order[::32, None] // 32)
    got, ref = quantize_linear(w, fmt, hessian=factor), quantize_linear(w, fmt)
    np.testing.assert_array_equal(got.packed, ref.packed)
    np.testing.assert_array_equal(got.scale, ref.scale)
    if fmt.kind == "affine":
        np.testing.assert_array_equal(got.offset, ref.offset)


def test_gptq_act_order_beats_the_natural_order():
    """Inputs growing in scale along the rows: the natural order would quantize the important
    rows last, with the least left to compensate them (GPTQ's act-order, Frantar et al.)."""
    rng = np.random.default_rng(0)
    k, n = 256, 64
    fmt = WeightFormat("tq", 3, 32)
    mix = rng.standard_normal((k, k)) / np.sqrt(k) + np.eye(k)
    x = (rng.standard_normal((4096, k)) * np.linspace(0.1, 4, k) ** 2) @ mix
    w = jnp.asarray(rng.standard_normal((k, n)), jnp.float32)
    h = jnp.asarray(x.T @ x, jnp.float32)
    act = hessian_factor(h, fmt)
    hr = to_stored_basis(to_stored_basis(h, fmt).T, fmt)
    natural = HessianFactor(jnp.arange(k, dtype=jnp.int32),
                            *_factor(np.array(hr), np.arange(k), 0.01), 32, 32)
    err = [float(np.sum((x @ (np.asarray(effective_weight(quantize_linear(w, fmt, hessian=f)))
                              - np.asarray(w))) ** 2)) for f in (natural, act)]
    assert err[1] < 0.8 * err[0], err


# ---------------------------------------------------------------- mixed allocation


def theory_losses(sens, formats):
    """a·D(b): the Lloyd–Max distortion of a Gaussian group, the same for every group size."""
    return {p: {f: a * lloyd_max(f.bits, f.group).mse * f.group for f in formats}
            for p, a in sens.items()}


def test_allocate_meets_budget_and_follows_sensitivity():
    shapes = {f"t{i}": (256, 64 * (i + 1)) for i in range(6)}
    sens = {f"t{i}": 10.0 ** (i % 3) for i in range(6)}
    formats = candidate_formats()
    n = sum(k * m for k, m in shapes.values())
    for bpw in (2.5, 3.5, 4.25, 6.0):
        fmts = allocate(shapes, theory_losses(sens, formats), bpw)
        bits = sum(f.tensor_bits(*shapes[p]) for p, f in fmts.items())
        assert bits + shared_bits(formats) <= bpw * n
        assert bits + shared_bits(formats) > (bpw - 0.5) * n  # the budget is spent
        # same size, 100x more sensitive -> at least as many bits
        assert fmts["t2"].bits >= fmts["t0"].bits
        assert (min(f.bits for f in fmts.values()) == 2) == (bpw < 3.25)
        # 2% more error at group 128 saves 1/8 bit per weight: a better buy than code bits,
        # so below the top format (8 bits) only group 128 sits on the loss-per-bit hull
        assert {f.group for f in fmts.values() if f.bits < 8} == {128}
    # when the larger group loses much more, the allocator pays for the smaller one
    losses = theory_losses(sens, formats)
    for per in losses.values():
        for f in per:
            per[f] *= 10.0 if f.group == 128 else 1.0
    assert {f.group for f in allocate(shapes, losses, 4.25).values()} == {64}
    with pytest.raises(TqjaxError, match="below the smallest"):
        allocate(shapes, theory_losses(sens, formats), 2.1)
    with pytest.raises(TqjaxError, match="above the largest"):  # not silently 8.25
        allocate(shapes, theory_losses(sens, formats), 9.0)


def test_allocate_counts_fixed_tensors_and_only_the_constants_used():
    formats = candidate_formats()
    shapes = {"t": (64, 64)}
    # 3 bits + its scales, lut and rotation signs fit 4 bits per weight, though every
    # candidate's constants together would not
    fmts = allocate(shapes, theory_losses({"t": 1.0}, formats), 4.0)
    used = fmts["t"].tensor_bits(64, 64) + shared_bits([fmts["t"]])
    assert used <= 4.0 * 64 * 64 < fmts["t"].tensor_bits(64, 64) + shared_bits(formats)
    # a fixed 8-bit table counts in the budget: the allocated tensors get fewer bits
    shapes = {f"t{i}": (256, 256) for i in range(4)}
    losses = theory_losses(dict.fromkeys(shapes, 1.0), formats)
    table = ((256, 512), WeightFormat("tq", 8, 64))
    free, held = allocate(shapes, losses, 4.25), allocate(shapes, losses, 4.25, {"e": table})
    bits = sum(f.tensor_bits(256, 256) for f in held.values()) + table[1].tensor_bits(256, 512)
    assert bits + shared_bits(formats) <= 4.25 * (4 * 256 * 256 + 256 * 512)
    assert sum(f.bits for f in held.values()) < sum(f.bits for f in free.values())


def test_lower_hull_drops_dominated_and_concave_points():
    f = [WeightFormat("tq", b, 64) for b in (2, 3, 4, 5, 6)]
    points = [(1, 10.0, f[0]), (2, 4.0, f[1]), (3, 3.5, f[2]), (3, 5.0, f[3]), (4, 1.0, f[4])]
    # (3, 3.5) lies above the chord from (2, 4) to (4, 1); (3, 5) is dominated by (2, 4)
    assert [p[2] for p in _lower_hull(points)] == [f[0], f[1], f[4]]


@pytest.mark.parametrize("group", [64, 128])
def test_format_loss_matches_lloyd_max_and_fisher_weighting(group):
    w = jnp.asarray(np.random.default_rng(0).standard_normal((512, 48)), jnp.float32)
    fmt = WeightFormat("tq", 4, group)
    rel = format_loss(w, fmt)
    theory = lloyd_max(4, group).mse * group
    # rotated Gaussian groups: at most the Lloyd–Max error of the norm-matched scale (which
    # the per-group scale search starts from), typically a quarter less
    assert 0.6 * theory < rel < theory
    # unit Fisher per weight (64 per group of 64 rows): half the absolute squared error
    ones = jnp.full((512 // 64, 48), 64.0)
    assert format_loss(w, fmt, ones) == pytest.approx(0.5 * rel * float(jnp.sum(w * w)), rel=1e-4)
    # Fisher on the first 64 rows only: only their error counts
    first = ones.at[1:].set(0.0)
    err = np.asarray(effective_weight(quantize_linear(w, fmt)) - w)
    assert format_loss(w, fmt, first) == pytest.approx(0.5 * float(np.sum(err[:64] ** 2)),
                                                       rel=1e-4)
    # 112 rows: two Fisher blocks of 64 rows, the second zero-padded (not two of 56)
    w = w[:112]
    err = np.asarray(effective_weight(quantize_linear(w, fmt)) - w)
    assert format_loss(w, fmt, first[:2]) == pytest.approx(
        0.5 * float(np.sum(err[:64] ** 2)), rel=1e-4)
    # unit Fisher per weight with a partial last block (48 real rows): still ½ Σ err²
    unit = jnp.asarray([[64.0], [48.0]]) * jnp.ones((1, 48))
    assert format_loss(w, fmt, unit) == pytest.approx(0.5 * float(np.sum(err ** 2)), rel=1e-4)


def test_format_losses_scale_the_measured_error_by_lloyd_max():
    w = jnp.asarray(np.random.default_rng(1).standard_normal((256, 32)), jnp.float32)
    losses = format_losses(w, (64, 128))
    assert set(losses) == set(candidate_formats((64, 128)))
    for g in (64, 128):
        at4 = format_loss(w, WeightFormat("tq", 4, g))
        assert losses[WeightFormat("tq", 4, g)] == pytest.approx(at4)
        ratio = lloyd_max(3, g).mse / lloyd_max(4, g).mse
        assert losses[WeightFormat("tq", 3, g)] == pytest.approx(at4 * ratio)
    # the scaled 3-bit figure stays close to a direct measurement on Gaussian weights
    assert losses[WeightFormat("tq", 3, 64)] == pytest.approx(
        format_loss(w, WeightFormat("tq", 3, 64)), rel=0.15)


# ---------------------------------------------------------------- whole models


def test_weight_spec_validation():
    assert WeightSpec("int4").base_format == WeightFormat("sym", 4, 32)
    assert WeightSpec("int8").base_format == WeightFormat("sym", 8, 0)
    assert WeightSpec("mixed", bpw=3.5).base_format == WeightFormat("tq", 4, 64)
    for bad in (dict(method="tq5"), dict(method="mixed"), dict(method="tq4", bpw=4.0),
                dict(method="mixed", bpw=1.0), dict(method="tq4", group_size=48),
                dict(method="int4", group_size=12),
                dict(method="tq4", seed=-1), dict(method="tq4", seed=1.5)):  # (-1 failed late)
        with pytest.raises(TqjaxError):
            WeightSpec(**bad)
    for bpw in ("4", True, float("nan")):  # (a str was a TypeError from the comparison)
        with pytest.raises(TqjaxError, match="bpw must be a number in"):
            WeightSpec("mixed", bpw=bpw)
    assert WeightSpec("mixed", bpw=np.float32(4.25)).bpw == np.float32(4.25)


def test_sequential_stages_reproduce_forward(tiny):
    windows = np.asarray([TOKENS, TOKENS[::-1]], np.int32)
    seen = []

    def keep(path, w, h):
        seen.append((path, h.shape))
        return w

    params, hidden = run_sequential(tiny.params, tiny.config, windows, keep, head=True)
    assert [p for p, _ in seen] == linear_paths(tiny.params)
    assert dict(seen)["layers.0.w_down"] == (128, 128)
    cache = new_cache(tiny.params, tiny.config, tqjax.CacheSpec(), 1, 32)
    want, _ = forward(tiny.params, tiny.config, jnp.asarray(windows[1:]), jnp.zeros(1, jnp.int32),
                      cache)
    got = hidden[1] @ tiny.params.lm_head
    np.testing.assert_allclose(got, want, atol=1e-4)


@pytest.mark.parametrize("method,budget", [("int8", 0.03), ("int8-rot", 0.03), ("int4", 0.35),
                                           ("tq4", 0.35)])
@pytest.mark.usefixtures("keep_quantizer_programs")
def test_quantized_forward_close_to_dense(tiny, tiny_ref, method, budget):
    q = quantize_params(tiny.params, tiny.config, WeightSpec(method))
    got = tqjax.logits(dataclasses.replace(tiny, params=q), TOKENS)
    assert rel_err(got, tiny_ref) < budget
    assert isinstance(q.layers[1].w_down, type(q.layers[0].wq)) and q.lm_head is tiny.params.lm_head


@pytest.mark.usefixtures("keep_quantizer_programs")
def test_calibrated_gptq_with_head(tiny, tiny_ref):
    cal = np.random.default_rng(0).integers(0, 256, (2, 48))
    q = quantize_params(tiny.params, tiny.config, WeightSpec("tq3", quantize_embeddings=True), cal)
    assert all(get_path(q, p).bits == 3 for p in linear_paths(q, quantize_head=False))
    assert q.lm_head.bits == EMBEDDING_FORMAT.bits == q.embed.bits  # the head keeps 8 bits
    got = tqjax.logits(dataclasses.replace(tiny, params=q), TOKENS)
    assert rel_err(got, tiny_ref) < 0.5
    with pytest.raises(TqjaxError, match="already quantized"):
        quantize_params(q, tiny.config, WeightSpec("int8"))
    with pytest.raises(TqjaxError, match="out of range"):
        quantize_params(tiny.params, tiny.config, WeightSpec("int8"), cal + 1000)


@pytest.mark.parametrize("tied", [False, True])
def test_fisher_streamed_equals_the_whole_model_gradient(tiny, tied, monkeypatch):
    """`fisher_diagonal` backpropagates a layer at a time (two sweeps, windows in chunks, the
    head by blocks of columns): the same Fisher as jax.grad of the whole forward pass with the
    same sampled labels (Gumbel-max, the noise drawn per head block)."""
    from tqjax.models import quantize as mq
    from tqjax.models.transformer import forward
    from tqjax.quant.mixed import group_sums

    monkeypatch.setattr(mq, "HEAD_COLUMNS", 100)  # vocabulary 256: blocks 100, 100, 56
    params, config = tiny.params, tiny.config
    if tied:
        params = params.replace(lm_head=None)
        config = dataclasses.replace(config, tie_embeddings=True)
    cal = np.random.default_rng(4).integers(0, 256, (3, 20)).astype(np.int32)
    per_window = config.num_layers * 20 * config.hidden_size * 4
    monkeypatch.setattr(mq, "FISHER_SAVED_BYTES", 2 * per_window)  # chunks of 2 windows and 1
    paths = linear_paths(params, quantize_head=False)
    got = fisher_diagonal(params, config, paths, cal, 8, seed=3)
    cache = make_cache(tqjax.CacheSpec(), batch=1, slots=20, num_layers=config.num_layers,
                       kv_heads=config.num_kv_heads, head_dim=config.head_dim)

    def logits(lin, w):
        return forward(mq.set_paths(params, lin), config, w[None], jnp.zeros(1, jnp.int32),
                       cache)[0][0]

    @jax.jit
    def grad(lin, w, labels):
        return jax.grad(lambda lin: jnp.sum(jnp.take_along_axis(
            jax.nn.log_softmax(logits(lin, w)), labels[:, None], 1)))(lin)

    lin = {p: get_path(params, p) for p in paths}
    want = {p: 0.0 for p in paths}
    for i, w in enumerate(jnp.asarray(cal)):
        key = jax.random.PRNGKey(3 * 7919 + i)
        noise = jnp.concatenate([jax.random.gumbel(jax.random.fold_in(key, a),
                                                   (20, min(256, a + 100) - a))
                                 for a in range(0, 256, 100)], axis=1)
        grads = grad(lin, w, jnp.argmax(logits(lin, w) + noise, axis=-1))
        want = {p: want[p] + group_sums(grads[p] ** 2, 8) / len(cal) for p in paths}
    for p in paths:
        np.testing.assert_allclose(got[p], want[p], rtol=2e-3, atol=1e-6 * float(want[p].max()),
                                   err_msg=p)


def test_fisher_waits_for_each_layer_and_head_block_before_reading_the_next(tiny, monkeypatch):
    """jax dispatches asynchronously: a sweep that read on while a layer's work was queued
    kept every queued layer's weights resident (Qwen2.5-Coder-0.5B's Fisher pass: up to 8
    f32 layers, +440 MB). Each layer's (each head block's) calls are slowed by a host
    callback; the next read must come after all of them have run."""
    from tqjax.models import quantize as mq

    calls, done, seen = [0], [0], []

    def slowed(fn):
        def cb(x):
            time.sleep(0.02)
            done[0] += 1
            return x

        def run(*args):
            out = fn(*args)
            calls[0] += 1
            flag = jax.pure_callback(cb, jax.ShapeDtypeStruct((), jnp.float32),
                                     jnp.sum(jax.tree_util.tree_leaves(out)[0]))
            return jax.tree_util.tree_map(
                lambda a: a + 0 * flag.astype(a.dtype) if a.dtype != jnp.int32 else a, out)
        return run

    for name in ("_layer_forward", "_layer_fisher", "_head_block", "_head_grad"):
        monkeypatch.setattr(mq, name, slowed(getattr(mq, name)))
    monkeypatch.setattr(mq, "HEAD_COLUMNS", 100)  # vocabulary 256: three blocks a pass
    table = mq.table_columns(tiny.params.lm_head.T)

    def read(a, b):
        seen.append((calls[0], done[0]))
        return table.read(a, b)

    monkeypatch.setattr(mq, "head_columns", lambda params: mq.Columns(table.shape, read))

    def layer(i):
        seen.append((calls[0], done[0]))
        return tiny.params.layers[i]

    cal = np.random.default_rng(4).integers(0, 256, (3, 20)).astype(np.int32)
    paths = linear_paths(tiny.params, quantize_head=False)
    fisher_diagonal(tiny.params, tiny.config, paths, cal, 8, 0, layer)
    # 2 layers x 2 sweeps + 3 head blocks x 2 passes reads; 3 windows' calls each
    assert len(seen) == 10 and seen[-1][0] == 3 * (2 + 6 + 2 - 1)
    assert all(n == d for n, d in seen), seen


def test_fisher_mixed_allocation(tiny):
    cal = np.random.default_rng(0).integers(0, 256, (2, 48))
    paths = linear_paths(tiny.params, quantize_head=False)
    spec = WeightSpec("mixed", bpw=4.25)
    fine = fisher_diagonal(tiny.params, tiny.config, paths, cal, 8)
    coarse = fisher_diagonal(tiny.params, tiny.config, paths, cal, 64)
    for p in paths:
        k, n = get_path(tiny.params, p).shape
        assert coarse[p].shape == (-(-k // 64), n) and float(jnp.min(coarse[p])) >= 0
        assert float(jnp.sum(coarse[p])) > 0
        # the 64-row sums are the sums of the 8-row ones (the last group zero-padded)
        summed = jnp.pad(fine[p], [(0, -fine[p].shape[0] % 8), (0, 0)]).reshape(-1, 8, n).sum(1)
        np.testing.assert_allclose(coarse[p], summed, rtol=1e-5, atol=1e-12)
    fmts = weight_formats(tiny.params, tiny.config, spec, paths, cal)
    n = sum(math.prod(get_path(tiny.params, p).shape) for p in paths)
    bits = sum(f.tensor_bits(*get_path(tiny.params, p).shape) for p, f in fmts.items())
    assert 3.5 * n < bits <= 4.25 * n
    # an untied head keeps the embedding format and counts in the budget
    head = get_path(tiny.params, "lm_head").shape
    with_head = weight_formats(tiny.params, tiny.config, spec, [*paths, "lm_head"], cal)
    assert with_head["lm_head"] == EMBEDDING_FORMAT
    assert sum(f.tensor_bits(*get_path(tiny.params, p).shape) for p, f in with_head.items()) <= (
        4.25 * (n + math.prod(head)))
    assert fmts != weight_formats(tiny.params, tiny.config, spec, paths)  # data-free differs
    with pytest.raises(TqjaxError, match="above the largest"):  # before any measuring
        weight_formats(tiny.params, tiny.config, WeightSpec("mixed", bpw=12.0), paths, cal)
    fixed = weight_formats(tiny.params, tiny.config, dataclasses.replace(spec, group_size=32),
                           paths, cal)
    assert {f.group for f in fixed.values()} == {32}


def test_predicted_bits_equal_the_stored_bytes():
    """What the allocator budgets (`tensor_bits` per tensor + `shared_bits` once) is what the
    quantized tensors store, byte for byte: padding, scales, offsets, luts and the rotation
    signs shared by formats with the same block size."""
    rng = np.random.default_rng(0)
    cases = [(WeightFormat("tq", 4, 64), (200, 48)), (WeightFormat("tq", 3, 128), (96, 40)),
             (WeightFormat("tq", 4, 64), (64, 8)), (WeightFormat("sym", 8, 0), (130, 24)),
             (WeightFormat("affine", 4, 32), (72, 16)),
             (WeightFormat("sym", 4, 64, rotation=64), (256, 8)),
             (WeightFormat("sym", 8, 64, rotation=32), (100, 8))]
    ws = [quantize_linear(jnp.asarray(rng.normal(size=s), jnp.float32), f) for f, s in cases]
    predicted = sum(f.tensor_bits(*s) for f, s in cases) + shared_bits(f for f, _ in cases)
    assert 8 * unique_bytes(ws) == predicted


@pytest.mark.usefixtures("keep_quantizer_programs")
def test_params_bits_exact(tiny):
    q = quantize_params(tiny.params, tiny.config, WeightSpec("tq4"))
    bits = params_bits(q)
    c = tiny.config
    d, kv = c.hidden_size, c.num_kv_heads * c.head_dim
    shapes = [(d, d), (d, kv), (d, kv), (d, d), (d, 128), (d, 128), (128, d)] * c.num_layers
    # codes: 4 bits per (padded) input row; one f16 scale per 64 rows and output column
    per = sum(n * (-(-k // 64) * 64 * 4 + -(-k // 64) * 16) for k, n in shapes) // 8
    shared = 16 * 4 + 64 * 4  # one f32 lut and one set of f32 rotation signs
    assert bits["quantized_bytes"] == per + shared
    assert bits["quantized_params"] == sum(k * n for k, n in shapes)
    hf = load_file(GOLDEN / "tiny" / "qwen2_gqa7" / "model.safetensors")  # HF's own tensors
    assert bits["params"] == sum(t.size for t in hf.values())
    assert math.isclose(bits["bpw"], 8 * bits["bytes"] / bits["params"])


def test_tied_model_round_trip(tmp_path):
    m = tqjax.load(GOLDEN / "tiny" / "llama_tied")
    q = quantize_params(m.params, m.config, WeightSpec("int8"))
    ckpt.save_quantized(tmp_path / "tied", q, m.config, method={}, dense_dtype="bfloat16")
    loaded = tqjax.load(tmp_path / "tied")
    assert loaded.params.lm_head is None and loaded.params.embed.dtype == jnp.float32
    want = tqjax.logits(dataclasses.replace(m, params=q), TOKENS)
    assert rel_err(tqjax.logits(loaded, TOKENS), want) < 0.01  # bf16-stored dense tensors


def test_calibration_text_is_not_evaluation_text():
    from tqjax.data import calibration_text

    assert not set(CALIBRATION_MODULES) & set(PYTHON_STDLIB_MODULES)
    assert calibration_source("none") is None
    assert calibration_source("builtin") == calibration_text()
    with pytest.raises(TqjaxError, match="corpus"):
        calibration_source("wikipedia")


def test_default_calibration_ships_offline(monkeypatch):
    """The default corpus needs neither pip nor the network: it is read from tqjax/data, cut per
    part, and bounded by what ships."""
    import tqjax.fetch

    def no_download(*args, **kwargs):
        raise AssertionError("calibration must not download")

    monkeypatch.setattr(tqjax.fetch, "_pip_download", no_download)
    monkeypatch.setattr(tqjax.fetch, "_corpus_root", no_download)
    short = calibration_corpus(3000)  # the built-in text (2143 characters), then Milton
    assert len(short) == 6001 and short[3000] == "\n"
    assert calibration_corpus().startswith(short[:3000])
    assert "PARADISE LOST" in short[:3000] and "import" in short[3001:]
    with pytest.raises(TqjaxError, match="calibration chars"):
        calibration_corpus(MAX_CALIBRATION_CHARS + 1)


@pytest.mark.slow
def test_shipped_calibration_is_its_sources():
    """tqjax/data's prose is the miltondata Paradise Lost, its code this interpreter's stdlib
    modules (checked where the interpreter is the 3.11 the file was cut from)."""
    import sys
    import sysconfig

    from tqjax.data import calibration_part
    from tqjax.fetch import corpus_text

    prose = calibration_part("prose")
    assert len(prose) == MAX_CALIBRATION_CHARS
    assert prose == corpus_text("milton:paradiselost")[:MAX_CALIBRATION_CHARS]
    if sys.version_info[:2] == (3, 11):
        stdlib = Path(sysconfig.get_paths()["stdlib"])
        code = "\n".join((stdlib / m).read_text(encoding="utf-8") for m in CALIBRATION_MODULES)
        assert calibration_part("code") == code[:MAX_CALIBRATION_CHARS]


def test_default_calibration_fills_its_windows():
    """Both parts of the default corpus are long enough, and it holds CALIBRATION_WINDOWS
    distinct windows of 1024 tokens (SmolLM2's tokenizer)."""
    corpus = calibration_corpus()
    assert len(corpus) == 2 * CALIBRATION_CHARS + 1
    tok = tqjax.load("smollm2-135m-instruct").tokenizer
    windows = calibration_windows(tok, corpus, CALIBRATION_WINDOWS, 1024)
    assert windows.shape == (CALIBRATION_WINDOWS, 1024)
    assert len({w.tobytes() for w in windows}) == CALIBRATION_WINDOWS


# ---------------------------------------------------------------- checkpoints


@pytest.fixture(scope="module")
def saved(tiny, tmp_path_factory):
    q = quantize_params(tiny.params, tiny.config, WeightSpec("mixed", bpw=4.5))
    path = tmp_path_factory.mktemp("ckpt") / "tiny-mixed"
    meta = ckpt.save_quantized(path, q, tiny.config, method={"method": "mixed"},
                               source=GOLDEN / "tiny" / "qwen2_gqa7")
    return path, q, meta


def test_checkpoint_round_trip(tiny, saved):
    path, q, meta = saved
    loaded = tqjax.load(path)
    assert loaded.config == tiny.config
    hf = json.loads((GOLDEN / "tiny" / "qwen2_gqa7" / "config.json").read_text())
    assert hf["architectures"] == ["Qwen2ForCausalLM"] and meta["architecture"] == "qwen2"
    np.testing.assert_array_equal(tqjax.logits(loaded, TOKENS),
                                  tqjax.logits(dataclasses.replace(tiny, params=q), TOKENS))
    assert params_bits(loaded.params) == params_bits(q) == meta["memory"]
    assert meta["source"]["name"] == "qwen2_gqa7" and len(meta["source"]["sha256"]) == 64
    assert sorted(meta["files"]) == ["config.json", "model.safetensors"]
    assert not list(path.parent.glob(".*"))  # no temporary directories left


def _copy(saved, tmp_path):
    import shutil

    dst = tmp_path / "ck"
    shutil.copytree(saved[0], dst)
    return dst


def _edit_json(path, fn):
    data = json.loads(path.read_text())
    fn(data)
    path.write_text(json.dumps(data))


def _edit_config(d, **changes):
    """Change config.json and re-sign it in quantization.json (so only the content is wrong)."""
    _edit_json(d / "config.json", lambda c: c.update(changes))
    _edit_json(d / "quantization.json", lambda m: m["files"]["config.json"].update(
        size=(d / "config.json").stat().st_size, sha256=ckpt.file_digest(d / "config.json")[1]))


def _lut_is_a_rotation(m):
    rotation = next(e["rotation"] for e in m["tensors"].values() if e.get("rotation"))
    m["tensors"]["layers.0.wq"]["lut"] = rotation


@pytest.mark.parametrize("damage,message", [
    (lambda d: _edit_json(d / "quantization.json", _lut_is_a_rotation), "entry lut"),
    (lambda d: _edit_json(d / "quantization.json", lambda m: m["files"].update(
        {"model.safetensors": [1, 2]})), "bad entry for file model.safetensors"),
    (lambda d: (d / "quantization.json").unlink(), "not its quantization.json"),
])
def test_more_damaged_checkpoints_are_clear_errors(saved, tmp_path, damage, message):
    """Edits that were AttributeErrors, and a missing quantization.json that was read as an HF
    folder ("unsupported architecture None"); the planner names a checkpoint as one."""
    d = _copy(saved, tmp_path)
    damage(d)
    with pytest.raises(TqjaxError, match=message) as e:
        tqjax.load(d)
    assert "\n" not in str(e.value)
    with pytest.raises(TqjaxError, match="tqjax checkpoint"):
        tqjax.plan(_copy(saved, tmp_path / "intact"), "1GiB")


@pytest.mark.parametrize("damage,message", [
    (lambda d: (d / "model.safetensors").write_bytes(
        (d / "model.safetensors").read_bytes()[:-100]), "truncated"),
    (lambda d: (d / "model.safetensors").write_bytes(
        (d / "model.safetensors").read_bytes()[:-1] + b"\x01"), "sha256"),
    (lambda d: (d / "config.json").unlink(), "missing config.json"),
    (lambda d: (d / "quantization.json").write_text("{not json"), "corrupt"),
    (lambda d: _edit_json(d / "quantization.json", lambda m: m.pop("tensors")), "tensors"),
    (lambda d: _edit_json(d / "quantization.json", lambda m: m.pop("files")), "does not list"),
    (lambda d: _edit_json(d / "quantization.json",
                          lambda m: m.update(format_version=99)), "version 99"),
    (lambda d: _edit_json(d / "quantization.json",
                          lambda m: m["tensors"]["layers.0.wq"].update(bits=3)), "expected"),
    (lambda d: _edit_json(d / "quantization.json",
                          lambda m: m["tensors"]["layers.1.wo"].pop("lut")), "bad entry"),
    (lambda d: _edit_json(d / "quantization.json",
                          lambda m: m["tensors"].pop("layers.1.wo")), "missing tensor layers.1.wo"),
    (lambda d: _edit_json(d / "quantization.json", lambda m: m["files"].update(
        {"../x": {"size": 1, "sha256": "0"}})), r"bad entry for file \.\./x$"),
    (lambda d: _edit_json(d / "quantization.json",
                          lambda m: m.update(architecture="mistral")), "unknown architecture"),
    (lambda d: _edit_json(d / "quantization.json",
                          lambda m: m.update(architecture="llama")), "says architecture"),
    (lambda d: _edit_config(d, arch="mistral"), "unknown architecture 'mistral'"),
    (lambda d: _edit_json(d / "quantization.json",
                          lambda m: m["tensors"]["layers.0.wq"].update(kind="nf4")),
     "unknown format kind 'nf4'"),
])
def test_damaged_checkpoints_are_clear_errors(saved, tmp_path, damage, message):
    d = _copy(saved, tmp_path)
    damage(d)
    with pytest.raises(TqjaxError, match=message) as e:
        tqjax.load(d)
    assert "\n" not in str(e.value)


def test_config_changes_and_overwrites(saved, tmp_path, tiny):
    d = _copy(saved, tmp_path)
    raw = json.loads((d / "config.json").read_text())
    raw["num_layerz"] = raw.pop("num_layers")
    (d / "config.json").write_text(json.dumps(raw))
    _edit_json(d / "quantization.json", lambda m: m["files"]["config.json"].update(
        size=(d / "config.json").stat().st_size,
        sha256=ckpt.file_digest(d / "config.json")[1]))
    with pytest.raises(TqjaxError, match="config.json"):
        tqjax.load(d)
    # an existing checkpoint is replaced; anything else is left alone
    other = tmp_path / "notes"
    other.mkdir()
    (other / "keep.txt").write_text("x")
    with pytest.raises(TqjaxError, match="not overwriting"):
        ckpt.save_quantized(other, tiny.params, tiny.config, method={})
    assert (other / "keep.txt").read_text() == "x"
    ckpt.save_quantized(d, tiny.params, tiny.config, method={"method": "none"})
    assert json.loads((d / "quantization.json").read_text())["method"] == {"method": "none"}


def test_gguf_tokenizer_is_saved_and_reloaded(saved, tmp_path, tiny):
    alphabet = [chr(c) for c in range(33, 127)] + ["Ġ"]
    meta = {"tokenizer.ggml.model": "gpt2", "tokenizer.ggml.pre": "qwen2",
            "tokenizer.ggml.tokens": alphabet + ["<|im_start|>", "<|im_end|>"],
            "tokenizer.ggml.token_type": [1] * len(alphabet) + [3, 3],
            "tokenizer.ggml.merges": [], "tokenizer.ggml.bos_token_id": len(alphabet),
            "tokenizer.ggml.eos_token_id": len(alphabet) + 1,
            "tokenizer.ggml.add_bos_token": True,
            "tokenizer.chat_template": "{% for m in messages %}<|im_start|>{{ m.content }}"
                                       "<|im_end|>{% endfor %}"}
    tok = tokenizer_from_gguf(meta)
    _, q, _ = saved
    out = tmp_path / "with-tok"
    ckpt.save_quantized(out, q, tiny.config, method={}, tokenizer=tok)
    m = tqjax.load(out)
    text = "Hi <|im_end|> there!"
    assert m.tokenizer.encode(text) == tok.encode(text)
    assert (m.tokenizer.bos_id, m.tokenizer.add_bos) == (tok.bos_id, True)
    assert set(tok.eos_ids) <= set(m.tokenizer.eos_ids)
    chat = [{"role": "user", "content": "a"}]
    assert m.tokenizer.apply_chat_template(chat) == tok.apply_chat_template(chat)



def test_quantize_script_json(tmp_path, capsys):
    from tqjax.commands.quantize import run

    out = tmp_path / "q"
    assert run(["--model", str(GOLDEN / "tiny" / "llama"), "--out", str(out), "--weights",
                "int4-affine", "--calibration", "none", "--json"]) == 0
    result = json.loads(capsys.readouterr().out.strip().splitlines()[-1])
    assert {"bpw", "bytes", "seconds"} <= set(result)
    assert result["bytes"] == sum(f.stat().st_size for f in out.iterdir())
    assert abs(result["bpw"] - 5.0) < 0.01  # 4-bit codes + f16 scale and offset per 32
    assert ckpt.is_quantized_checkpoint(out)
    assert json.loads((out / "quantization.json").read_text())["method"]["calibration_sha256"] \
        is None


def test_quantize_script_reads_an_orbax_checkpoint_whole(tmp_path):
    """An orbax checkpoint (sharded pytrees) is restored, then quantized: the same tensors as
    the HF directory it was saved from, which is read a layer at a time."""
    from tqjax.commands.quantize import run
    from tqjax.models.orbax_checkpoint import save_sharded

    src = GOLDEN / "tiny" / "llama"
    m = tqjax.load(src)
    save_sharded(tmp_path / "orbax", m.params, m.config)
    for name, model in (("a", src), ("b", tmp_path / "orbax")):
        assert run(["--model", str(model), "--out", str(tmp_path / name), "--weights", "tq4",
                    "--calibration", "none", "--json"]) == 0
    a, b = (load_file(tmp_path / n / "model.safetensors") for n in "ab")
    assert a.keys() == b.keys()
    for key in a:
        np.testing.assert_array_equal(a[key], b[key], err_msg=key)


@pytest.mark.filterwarnings("ignore::pytest.PytestUnraisableExceptionWarning")
def test_a_half_precision_orbax_checkpoint_with_its_own_head_quantizes_and_saves(tmp_path):
    """A bf16 model's untied head stays a half-precision linear through the quantizer; saving
    it failed after all the quantizing ('HalfLinear' object has no attribute 'astype'). A
    truncated orbax data file is a one-line error (TensorStore raised a bare Exception)."""
    from tqjax.commands.quantize import run
    from tqjax.models.orbax_checkpoint import save_sharded
    from tqjax.quant import half

    m = tqjax.load(GOLDEN / "tiny" / "llama", dtype="bfloat16")
    assert not m.config.tie_embeddings
    save_sharded(tmp_path / "orbax", m.params, m.config)
    assert run(["--model", str(tmp_path / "orbax"), "--out", str(tmp_path / "q"), "--weights",
                "int8", "--calibration", "none", "--json"]) == 0
    q = tqjax.load(tmp_path / "q")
    head = np.asarray(half.dense(m.params.lm_head), np.float32)
    np.testing.assert_allclose(np.asarray(half.dense(q.params.lm_head), np.float32), head,
                               rtol=2**-11, atol=2**-24)  # (stored float16, the default)
    biggest = max((f for f in (tmp_path / "orbax").rglob("*") if f.is_file()),
                  key=lambda f: f.stat().st_size)
    biggest.write_bytes(biggest.read_bytes()[: biggest.stat().st_size // 2])
    # the file list in orbax.json finds it before orbax reads anything (orbax's own failure
    # left its other reads running, which printed tracebacks later, at exit or in a GC)
    with pytest.raises(TqjaxError, match=r"has \d+ bytes, expected \d+ \(truncated") as e:
        tqjax.load(tmp_path / "orbax")
    assert biggest.name in str(e.value)
    # a checkpoint without the list (an older tqjax's) meets orbax's error, made one line
    meta = json.loads((tmp_path / "orbax" / "orbax.json").read_text())
    del meta["files"]
    (tmp_path / "orbax" / "orbax.json").write_text(json.dumps(meta))
    with pytest.raises(TqjaxError, match="truncated or corrupt") as e:
        tqjax.load(tmp_path / "orbax")
    assert "TensorStore details" not in str(e.value)
    import gc

    gc.collect()  # (orbax's other shard reads, never awaited, are reported here, not later)


def test_an_orbax_checkpoint_is_checked_against_its_file_list_before_reading(tmp_path):
    """orbax.json lists every other file's size and sha256 (as quantization.json does); a
    changed byte, a missing file or an entry outside the directory is one line naming it."""
    from tqjax.models.checkpoint import file_digest
    from tqjax.models.orbax_checkpoint import save_sharded

    m = tqjax.load(GOLDEN / "tiny" / "llama")
    info = save_sharded(tmp_path / "orbax", m.params, m.config)
    root = tmp_path / "orbax"
    on_disk = sorted(f.relative_to(root).as_posix() for f in root.rglob("*") if f.is_file())
    assert sorted(info["files"]) == [n for n in on_disk if n != "orbax.json"]
    assert "config.json" in info["files"] and any(n.startswith("state/") for n in info["files"])
    for name, entry in info["files"].items():
        assert (entry["size"], entry["sha256"]) == file_digest(root / name), name
    np.testing.assert_array_equal(tqjax.logits(tqjax.load(root), TOKENS),
                                  tqjax.logits(m, TOKENS))
    biggest = max(info["files"], key=lambda n: info["files"][n]["size"])
    data = bytearray((root / biggest).read_bytes())
    data[len(data) // 2] ^= 1
    (root / biggest).write_bytes(bytes(data))
    with pytest.raises(TqjaxError, match=r"does not match its sha256 in orbax\.json") as e:
        tqjax.load(root)
    assert Path(biggest).name in str(e.value) and "\n" not in str(e.value)
    (root / biggest).unlink()
    with pytest.raises(TqjaxError, match=f"is missing {biggest}$"):
        tqjax.load(root)
    meta = json.loads((root / "orbax.json").read_text())
    meta["files"] = {"../config.json": meta["files"]["config.json"]}
    (root / "orbax.json").write_text(json.dumps(meta))
    with pytest.raises(TqjaxError, match=r"bad entry for file \.\./config\.json"):
        tqjax.load(root)


def test_both_checkpoint_kinds_keep_the_tokenizers_end_tokens(tmp_path):
    """A GGUF model ends on llama.cpp's whole end-of-generation set; its tokenizer files are
    read back with config.json's ids, so both savers write the set there (the orbax saver
    did not: a saved Qwen2.5 ran on past <|endoftext|> again; found by review)."""
    import shutil

    from tqjax.models.checkpoint import save_quantized
    from tqjax.models.orbax_checkpoint import save_sharded

    from .test_cli import make_byte_tokenizer

    d = tmp_path / "llama"
    shutil.copytree(GOLDEN / "tiny" / "llama", d)
    make_byte_tokenizer(d)
    m = tqjax.load(d)
    tok = dataclasses.replace(m.tokenizer, eos_ids=(*m.tokenizer.eos_ids, 7, 9))
    save_sharded(tmp_path / "orbax", m.params, m.config, tokenizer=tok)
    save_quantized(tmp_path / "q", m.params, m.config, method={"weights": "none"}, tokenizer=tok)
    for out in ("orbax", "q"):
        back = tqjax.load(tmp_path / out)
        assert back.tokenizer.eos_ids == tok.eos_ids, out
        assert back.config.eos_token_ids == tok.eos_ids, out


def test_quantize_records_the_calibration_sha256(tmp_path):
    """A calibrated checkpoint names its calibration text by the sha256 of the shipped file."""
    import hashlib
    import shutil
    from importlib import resources

    from tqjax.commands.quantize import run

    from .test_cli import make_byte_tokenizer

    model = tmp_path / "llama"
    shutil.copytree(GOLDEN / "tiny" / "llama", model)
    make_byte_tokenizer(model)
    out = tmp_path / "q"
    assert run(["--model", str(model), "--out", str(out), "--weights", "int8", "--calibration",
                "builtin", "--calibration-windows", "2", "--calibration-length", "64",
                "--json"]) == 0
    method = json.loads((out / "quantization.json").read_text())["method"]
    shipped = resources.files("tqjax.data").joinpath("calibration.txt").read_bytes()
    assert method["calibration_sha256"] == hashlib.sha256(shipped).hexdigest()
    assert (method["calibration"], method["calibration_tokens"]) == ("builtin", 128)
    # the defaults ask for more than the ~530-token built-in text: the error says what to ask
    with pytest.raises(TqjaxError, match=r"need \d+: ask for fewer or shorter windows "
                                         r"\(--calibration-windows, --calibration-length\)"):
        run(["--model", str(model), "--out", str(tmp_path / "q2"), "--weights", "int8",
             "--calibration", "builtin", "--calibration-windows", "32"])


@pytest.fixture(scope="module")
def tiny_qwen3_tq4():
    m = tqjax.load(GOLDEN / "tiny" / "qwen3")  # head_dim 32: every cache format applies
    return m, quantize_params(m.params, m.config, WeightSpec("tq4"))


@pytest.mark.parametrize("kv", ["f32", "turbo3"])
def test_quantized_weights_prefill_then_decode(tiny_qwen3_tq4, kv):
    """tq4 weights: prefill + token-by-token decode through a dense or TurboQuant cache gives
    the full-sequence logits (f32 cache: exactly), close to the dense model's."""
    from tqjax.decode.calibrate import calibrate

    m, q = tiny_qwen3_tq4
    spec = tqjax.CacheSpec(kv, kv)
    calib = calibrate(q, m.config, TOKENS) if spec.needs_calibration else None
    ids = jnp.asarray([TOKENS[:12]], jnp.int32)
    step = jax.jit(forward, static_argnums=1)

    def run(chunks):
        cache, out, pos = new_cache(q, m.config, spec, 1, 16, calib), [], 0
        for n in chunks:
            logits, cache = step(q, m.config, ids[:, pos:pos + n], jnp.full(1, pos, jnp.int32),
                                 cache)
            out.append(np.asarray(logits))
            pos += n
        return np.concatenate(out, axis=1)[0]

    decoded = run([8, 1, 1, 1, 1])
    if kv == "f32":
        np.testing.assert_allclose(decoded, run([12]), atol=2e-4)
    assert rel_err(decoded, tqjax.logits(m, TOKENS[:12])) < 0.4


@pytest.mark.parametrize("fmt", [WeightFormat("tq", 4, 16), WeightFormat("sym", 8, 0),
                                 WeightFormat("sym", 8, 0, 16), WeightFormat("affine", 4, 32)])
def test_gather_columns_is_the_effective_weight(fmt):
    w = jax.random.normal(jax.random.PRNGKey(3), (40, 24))  # 40 rows: not a multiple of 16/32
    q = quantize_linear(w, fmt)
    ids = jnp.asarray([[3, 0, 23], [7, 7, 1]])
    got = gather_columns(q, ids)
    assert got.shape == (2, 3, 40)
    np.testing.assert_allclose(got, effective_weight(q).T[ids], atol=1e-5)
    assert rel_err(got, w.T[ids]) < (0.02 if fmt.bits == 8 else 0.2)


@pytest.mark.usefixtures("keep_quantizer_programs")
def test_rotated_int8_gptq_checkpoint(tiny, tiny_ref, tmp_path):
    """Per-channel int8 in the 64-row Hadamard basis, GPTQ-calibrated, saved and reloaded."""
    cal = np.random.default_rng(0).integers(0, 256, (2, 48))
    q = quantize_params(tiny.params, tiny.config, WeightSpec("int8-rot"), cal)
    w = q.layers[0].wq  # 112 inputs padded to 128, one scale per output channel
    assert (w.rotation.dim, w.group, w.padded_in, w.bits) == (64, 128, 128, 8)
    tq = quantize_linear(jax.random.normal(jax.random.PRNGKey(0), (16, 8)),
                         WeightFormat("tq", 4, 8))
    assert (w.kind, tq.kind) == ("sym", "tq")
    got = tqjax.logits(dataclasses.replace(tiny, params=q), TOKENS)
    assert 0 < rel_err(got, tiny_ref) < 0.03
    ckpt.save_quantized(tmp_path / "q", q, tiny.config, method={"method": "int8-rot"})
    loaded = tqjax.load(tmp_path / "q")
    assert (loaded.params.layers[0].wq.rotation.dim, loaded.params.layers[0].wq.kind) == (64, "sym")
    np.testing.assert_array_equal(tqjax.logits(loaded, TOKENS), got)


@pytest.mark.parametrize("name", ["llama_tied", "qwen2"])
@pytest.mark.usefixtures("keep_quantizer_programs")
def test_quantized_embeddings(name, tmp_path):
    """The embedding (and a tied head reading the same codes) quantized; checkpoint round trip."""
    m = tqjax.load(GOLDEN / "tiny" / name)
    dense = quantize_params(m.params, m.config, WeightSpec("int8"))
    q = quantize_params(m.params, m.config, WeightSpec("int8", quantize_embeddings=True))
    assert isinstance(q.embed, QuantizedLinear) and q.embed.out_features == m.config.vocab_size
    assert (q.lm_head is None) == m.config.tie_embeddings
    assert all(w.bits == EMBEDDING_FORMAT.bits for w in (q.embed, q.lm_head) if w is not None)
    want = tqjax.logits(dataclasses.replace(m, params=dense), TOKENS)
    got = tqjax.logits(dataclasses.replace(m, params=q), TOKENS)
    assert 0 < rel_err(got, want) < 0.03
    bits = params_bits(q)
    extra = [w for w in (q.embed, q.lm_head) if w is not None]
    assert bits["quantized_params"] == params_bits(dense)["quantized_params"] + sum(
        w.in_features * w.out_features for w in extra)
    assert bits["bytes"] < params_bits(dense)["bytes"]
    ckpt.save_quantized(tmp_path / "q", q, m.config, method={})
    loaded = tqjax.load(tmp_path / "q")
    assert isinstance(loaded.params.embed, QuantizedLinear)
    np.testing.assert_allclose(tqjax.logits(loaded, TOKENS), got, atol=1e-4)


def test_window_rows_embed_as_the_whole_quantized_table(tiny):
    """`_window_rows`: the calibration windows, renumbered into the table's rows for their own
    tokens (quantized on their own), embed as through the whole quantized table, and the
    table's rows are only read for those tokens."""
    from tqjax.models.quantize import _window_rows
    from tqjax.quant.weights import Columns

    table = jnp.asarray(tiny.params.embed).T  # embedᵀ [D, V]
    windows = np.random.default_rng(2).integers(0, 200, (3, 40)).astype(np.int32)
    read: list[tuple[int, int]] = []
    source = Columns(tuple(table.shape), lambda a, b: read.append((a, b)) or np.asarray(
        table[:, a:b]))
    rows, renumbered = _window_rows(source, windows, seed=4)
    ids = np.unique(windows)
    assert rows.out_features == len(ids) and renumbered.dtype == np.int32
    np.testing.assert_array_equal(ids[renumbered], windows)
    assert sorted(read) == [(int(i), int(i) + 1) for i in ids]
    whole = quantize_linear(table, EMBEDDING_FORMAT, 4)
    got = gather_columns(rows, jnp.asarray(renumbered))
    want = gather_columns(whole, jnp.asarray(windows))
    np.testing.assert_allclose(got, want, rtol=0, atol=1e-6 * float(jnp.abs(table).max()))


@pytest.mark.parametrize("fmt", [WeightFormat("tq", 8, 64), WeightFormat("sym", 8, 0),
                                 WeightFormat("tq", 4, 64)], ids=lambda f: f.name)
def test_nearest_level_matches_a_binary_search(fmt):
    """`_assign` (the grid-table search for 8-bit codebooks) gives numpy's searchsorted over
    the midpoints, also at each midpoint, one ulp either side of it and far outside (not at
    subnormals next to a midpoint at 0, which XLA on CPU reads as 0)."""
    from tqjax.quant.weights import _assign

    lut = np.asarray(format_lut(fmt), np.float32)
    mids = np.float32(0.5) * (lut[1:] + lut[:-1])
    x = np.concatenate([np.random.default_rng(0).standard_normal(200_000) * lut[-1] / 2,
                        mids, np.nextafter(mids, np.inf), np.nextafter(mids, -np.inf),
                        [lut[0] * 1e6, lut[-1] * 1e6, 0.0]]).astype(np.float32)
    x = x[(x == 0) | (np.abs(x) >= np.finfo(np.float32).tiny)]  # XLA flushes subnormals
    want = np.searchsorted(mids, x, side="left")
    got = np.asarray(jax.jit(lambda v: _assign(v, format_lut(fmt)))(jnp.asarray(x)))
    np.testing.assert_array_equal(got, want)


@pytest.mark.parametrize("fmt", [WeightFormat("tq", 4, 64), WeightFormat("affine", 4, 32)],
                         ids=lambda f: f.name)
@pytest.mark.parametrize("gptq", [False, True])
def test_quantizing_in_column_chunks_changes_nothing(fmt, gptq, monkeypatch):
    """Output columns are quantized QUANTIZE_COLUMNS (GPTQ) or ROUND_COLUMNS at a time: 3
    chunks and a remainder give the codes, scales and offsets of one call over all columns;
    rounding pads the remainder to the chunks' width, so all four run one program."""
    k, n = 128, 350
    rng = np.random.default_rng(5)
    w = jnp.asarray(rng.standard_normal((k, n)), jnp.float32)
    x = rng.standard_normal((256, k)).astype(np.float32)
    factor = hessian_factor(jnp.asarray(x.T @ x), fmt) if gptq else None
    whole = quantize_linear(w, fmt, hessian=factor)
    monkeypatch.setattr(qw, "QUANTIZE_COLUMNS", 100)
    monkeypatch.setattr(qw, "ROUND_COLUMNS", 100)
    programs = qw._quantize_block._cache_size()
    chunked = quantize_linear(w, fmt, hessian=factor)
    assert qw._quantize_block._cache_size() - programs == (2 if gptq else 1)
    for name in ("packed", "scale", "offset"):
        a, b = getattr(whole, name), getattr(chunked, name)
        assert (a is None) == (b is None)
        if a is not None:
            np.testing.assert_array_equal(np.asarray(a), np.asarray(b))


@pytest.mark.parametrize("fmt", [WeightFormat("sym", 8, 0, 64), WeightFormat("sym", 8, 0)],
                         ids=lambda f: f.name)
def test_gptq_batches_rows_as_one_row_loop_would(fmt, monkeypatch):
    """GPTQ's lazy batches (`weights.GPTQ_BLOCK` rows) inside a per-channel group of 384 rows
    give the codes of pushing each row's error on every later row at once (one batch = the
    group): the same algorithm, only the order of the float sums differs."""
    from tqjax.quant import weights
    from tqjax.quant.packing import unpack_bits

    rng = np.random.default_rng(2)
    k, n = 384, 24
    mix = rng.standard_normal((k, k)) / np.sqrt(k) + np.eye(k)
    x = (rng.standard_normal((2048, k)) * np.linspace(0.2, 3, k)) @ mix
    w = jnp.asarray(rng.standard_normal((k, n)), jnp.float32)
    factor = hessian_factor(jnp.asarray(x.T @ x, jnp.float32), fmt)
    assert weights._row_block(factor.group) == 128 and factor.group == k
    batched = quantize_linear(w, fmt, hessian=factor)
    monkeypatch.setattr(weights, "GPTQ_BLOCK", k)
    jax.clear_caches()
    whole = quantize_linear(w, fmt, hessian=factor)
    np.testing.assert_array_equal(batched.scale, whole.scale)  # fitted before any row
    codes = [np.asarray(unpack_bits(q.packed, 8, k)) for q in (batched, whole)]
    assert np.mean(codes[0] == codes[1]) > 0.995
    err = [float(np.sum((x @ (np.asarray(effective_weight(q)) - np.asarray(w))) ** 2))
           for q in (batched, whole)]
    np.testing.assert_allclose(err[0], err[1], rtol=2e-3)


@pytest.mark.parametrize("emb", [False, True])
@pytest.mark.parametrize("calibrated", [False, True])
def test_quantizer_drops_its_programs_before_the_head_and_after_the_embedding(
        tiny, monkeypatch, calibrated, emb):
    """The quantizer's programs are not run again: jax's caches are cleared once the layers are
    done (with quantized embeddings: before the head and around the embedding table, which is
    quantized last; calibrated: its rows for the windows' tokens first, to embed them), so
    none stays resident beside the loaded model, and the result is the same as without
    clearing."""
    from tqjax.models import quantize as mq

    cal = np.random.default_rng(5).integers(0, 256, (2, 24)).astype(np.int32) if calibrated \
        else None
    spec = WeightSpec("tq4", quantize_embeddings=emb)
    want = quantize_params(tiny.params, tiny.config, spec, cal)
    events: list = []
    quantize_linear = mq.quantize_linear
    monkeypatch.setattr(mq, "quantize_linear", lambda w, fmt, *a: (
        events.append(tuple(w.shape)) or quantize_linear(w, fmt, *a)))
    monkeypatch.setattr(mq, "drop_programs", lambda: events.append("clear"))
    got = quantize_params(tiny.params, tiny.config, spec, cal)
    embed_t, head = tiny.params.embed.shape[::-1], tiny.params.lm_head.shape
    if emb:
        assert events[-5:] == ["clear", head, "clear", embed_t, "clear"]
        assert events.count("clear") == 3
        assert events[0] == ((embed_t[0], len(np.unique(cal))) if calibrated else
                             tiny.params.layers[0].wq.shape)
    else:
        assert events[-2:] == [tiny.params.layers[-1].w_down.shape, "clear"]
        assert events.count("clear") == 1
    for a, b in zip(jax.tree_util.tree_leaves(got), jax.tree_util.tree_leaves(want), strict=True):
        np.testing.assert_array_equal(np.asarray(a), np.asarray(b))


def test_mixed_factors_a_shared_gram_in_place_last_and_bounds_its_programs(tiny, monkeypatch):
    """Linears that share a Gram but differ in basis (group size) get one factor per basis; the
    Gram is factored in place (consumed) only by the last basis any of them needs. With at
    most 2 (format, shape) programs kept, jax's caches are cleared before a third is
    compiled. Neither changes a byte of the result."""
    from tqjax.models import quantize as mq

    cal = np.random.default_rng(5).integers(0, 256, (2, 24)).astype(np.int32)
    paths = linear_paths(tiny.params, quantize_head=False)
    pick = {"wq": (4, 64), "wk": (4, 128), "wv": (4, 64), "wo": (3, 64), "w_gate": (3, 128),
            "w_up": (3, 128), "w_down": (8, 64)}
    fmts = {p: WeightFormat("tq", *pick[p.rsplit(".", 1)[1]]) for p in paths}
    monkeypatch.setattr(mq, "weight_formats", lambda *a, **k: fmts)
    spec = WeightSpec("mixed", bpw=4.25)
    factor = mq.hessian_factor
    calls: list[tuple] = []

    def record(h, fmt, seed, damp, consume=False):
        calls.append((fmt.group, consume))
        return factor(h, fmt, seed, damp, consume=consume)

    events: list = []
    quantize_linear = mq.quantize_linear
    monkeypatch.setattr(mq, "hessian_factor", record)
    monkeypatch.setattr(mq, "quantize_linear", lambda w, fmt, *a: (
        events.append((fmt, w.shape)) or quantize_linear(w, fmt, *a)))
    monkeypatch.setattr(mq, "drop_programs", lambda: events.append("clear"))
    monkeypatch.setattr(mq, "KEPT_PROGRAMS", 2)
    got = quantize_params(tiny.params, tiny.config, spec, cal)
    per_layer = [(64, False), (128, True), (64, True), (128, True), (64, True)]
    assert calls == per_layer * tiny.config.num_layers
    kept: set = set()
    for e in events[1:]:  # after the measuring's clear
        if e == "clear":
            assert len(kept) == 2
            kept = set()
        else:
            kept.add(e)
            assert len(kept) <= 2
    assert events[0] == "clear" and events.count("clear") > 2

    monkeypatch.setattr(mq, "hessian_factor", lambda h, fmt, seed, damp, consume=False: factor(
        h, fmt, seed, damp, consume=False))
    monkeypatch.setattr(mq, "KEPT_PROGRAMS", 100)
    want = quantize_params(tiny.params, tiny.config, spec, cal)
    for a, b in zip(jax.tree_util.tree_leaves(got), jax.tree_util.tree_leaves(want), strict=True):
        np.testing.assert_array_equal(np.asarray(a), np.asarray(b))
