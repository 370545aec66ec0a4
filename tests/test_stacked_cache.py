"""The stacked cache and the layer loop: `KVCache.groups` hold runs of alike layers stacked
[L, ...], and `forward` runs each run as one compiled body (`fori_loop`) that reads and writes
its layer of the stack in place. Checked against the same layers run one by one (a cache with
one group per layer), on caches with one group and with boundary layers (three). Quantized
weights stacked by format (`LayerStack`) against the same layers as a list."""

from __future__ import annotations

import dataclasses
import json

import jax
import jax.numpy as jnp
import numpy as np
import pytest

import tqjax
from tqjax.errors import TqjaxError
from tqjax.kv.cache import CacheSpec, Calibration, KVCache, group_size, make_cache
from tqjax.models.transformer import forward
from tqjax.quant.accounting import params_bits

from .conftest import GOLDEN

LAYERS = 6  # the tiny model's 2 layers, repeated


@pytest.fixture(scope="module")
def deep():
    """The tiny Qwen2 model (qkv biases, GQA) with its layers repeated to LAYERS."""
    m = tqjax.load(GOLDEN / "tiny" / "qwen2")
    reps = LAYERS // m.config.num_layers
    params = m.params.replace(layers=m.params.layers * reps)
    return params, dataclasses.replace(m.config, num_layers=LAYERS)


def calibration(config, seed=0):
    rng = np.random.default_rng(seed)
    shape = (config.num_layers, config.num_kv_heads, config.head_dim)
    scale = np.exp(rng.normal(size=shape) * 0.3).astype(np.float32)
    return Calibration(rng.normal(size=shape).astype(np.float32),
                       rng.normal(size=shape).astype(np.float32), scale)


def new(params, config, spec, batch=2, slots=64):
    return make_cache(spec, batch=batch, slots=slots, num_layers=config.num_layers,
                      kv_heads=config.num_kv_heads, head_dim=config.head_dim,
                      calibration=calibration(config),
                      inv_freq=np.asarray(params.rope_inv_freq))


SPECS = {"f32": CacheSpec(), "turbo4": CacheSpec("turbo4", "turbo4"),
         "turbo4+boundary q8": CacheSpec("turbo4", "turbo3", boundary_layers=1)}


def test_groups_are_runs_of_alike_layers(deep):
    params, config = deep
    assert [group_size(g) for g in new(params, config, SPECS["turbo4"]).groups] == [LAYERS]
    cache = new(params, config, SPECS["turbo4+boundary q8"])
    assert [group_size(g) for g in cache.groups] == [1, LAYERS - 2, 1]
    assert [type(g.k).__name__ for g in cache.groups] == ["Int8Store", "TurboStore",
                                                         "Int8Store"]
    assert cache.num_layers == LAYERS and cache.slots == 64 and cache.batch == 2
    # per-layer views stacked back give the same arrays; every per-layer constant is its own
    again = KVCache.from_layers(cache.layers)
    for a, b in zip(jax.tree.leaves(cache), jax.tree.leaves(again), strict=True):
        np.testing.assert_array_equal(np.asarray(a), np.asarray(b))
    signs = np.asarray(cache.groups[1].k.quantizer.rotation.signs)  # [L-2, hd]: seeded per layer
    assert len({s.tobytes() for s in signs}) == LAYERS - 2


def one_group_per_layer(cache):
    """The same cache with every layer its own group (the model then runs each layer on its
    own, unrolled: the reference for the loop)."""
    return KVCache(tuple(jax.tree.map(lambda a, i=i: a[i:i + 1], g)
                         for g in cache.groups for i in range(group_size(g))))


@pytest.mark.parametrize("name", list(SPECS))
def test_layer_loop_equals_layers_one_by_one(deep, name):
    """Prefill of a ragged batch then two decode steps: the loop over a stacked group and the
    layers run one by one give the same logits and the same cache."""
    params, config = deep
    spec = SPECS[name]
    rng = np.random.default_rng(1)
    tokens = jnp.asarray(rng.integers(3, config.vocab_size, (2, 24)), jnp.int32)
    valid = jnp.asarray([24, 17], jnp.int32)
    run = jax.jit(lambda c, t, s, v: forward(params, config, t, s, c, valid=v))
    stacked = new(params, config, spec)
    caches = {"loop": stacked, "one by one": one_group_per_layer(stacked)}
    assert len(caches["one by one"].groups) == LAYERS
    outs = {}
    for form, cache in caches.items():
        out, cache = run(cache, tokens, jnp.zeros(2, jnp.int32), valid)
        logits, start = [out[jnp.arange(2), valid - 1]], valid
        for step in range(2):
            nxt = jnp.asarray([[5 + step], [9 + step]], jnp.int32)
            out, cache = run(cache, nxt, start, jnp.ones(2, jnp.int32))
            logits.append(out[:, 0])
            start = start + 1
        outs[form] = (logits, KVCache.from_layers(cache.layers))
    (loop_logits, loop_cache), (ref_logits, ref_cache) = outs["loop"], outs["one by one"]
    for a, b in zip(loop_logits, ref_logits, strict=True):
        np.testing.assert_allclose(np.asarray(a), np.asarray(b), rtol=0, atol=2e-5)
    for (p, a), b in zip(jax.tree_util.tree_leaves_with_path(loop_cache),
                         jax.tree.leaves(ref_cache), strict=True):
        a, b = np.asarray(a), np.asarray(b)
        if np.issubdtype(a.dtype, np.integer):  # codes: a rounding flip at most, rarely
            assert np.mean(a != b) < 1e-3, jax.tree_util.keystr(p)
        else:
            np.testing.assert_allclose(a.astype(np.float32), b.astype(np.float32), rtol=0,
                                       atol=2e-3, err_msg=jax.tree_util.keystr(p))


def hlo_instructions(params, config, spec, split=False):
    """Instructions in the optimized HLO of a jitted batch-1 decode step (split: one cache
    group per layer, so the layers run unrolled)."""
    cache = new(params, config, spec, batch=1)
    cache = one_group_per_layer(cache) if split else cache
    step = jax.jit(lambda p, c, t, s: forward(p, config, t, s, c), donate_argnums=1)
    text = step.lower(params, cache, jnp.ones((1, 1), jnp.int32),
                      jnp.zeros(1, jnp.int32)).compile().as_text()
    return sum(1 for line in text.splitlines() if " = " in line)


@pytest.mark.parametrize("name", ["f32", "turbo4"])
def test_decode_program_grows_by_the_projections_only(deep, name):
    """One attention for all layers: each further layer adds only its projections' branch
    to the program, a fraction of what an unrolled layer adds (XLA:CPU keeps each program
    resident at ~4-5 KB per instruction)."""
    params, config = deep
    two = dataclasses.replace(config, num_layers=2)
    small = params.replace(layers=params.layers[:2])
    spec = SPECS[name]
    loop = hlo_instructions(params, config, spec) - hlo_instructions(small, two, spec)
    unrolled = (hlo_instructions(params, config, spec, split=True)
                - hlo_instructions(small, two, spec, split=True))
    # measured (4 more layers): 813 vs 1600 instructions (f32), 813 vs 6864 (turbo4)
    assert 0 < loop < {"f32": 0.6, "turbo4": 0.15}[name] * unrolled, (loop, unrolled)


def test_rows_and_saved_caches_across_three_groups(deep, tmp_path):
    """take_row / put_row / save and load a prompt cache on a cache of three groups (boundary
    layers): the row comes back exactly, and its next decode step gives the same logits."""
    from tqjax.decode import prompt_cache as pc

    params, config = deep
    spec = SPECS["turbo4+boundary q8"]
    rng = np.random.default_rng(2)
    tokens = jnp.asarray(rng.integers(3, config.vocab_size, (2, 20)), jnp.int32)
    valid = jnp.asarray([20, 13], jnp.int32)
    run = jax.jit(lambda c, t, s, v: forward(params, config, t, s, c, valid=v))
    _, cache = run(new(params, config, spec), tokens, jnp.zeros(2, jnp.int32), valid)
    one = pc.take_row(cache, 1)
    assert [group_size(g) for g in one.groups] == [1, LAYERS - 2, 1] and one.batch == 1
    meta = pc.cache_meta(config, params, None, spec, calibration(config))
    pc.save_prompt_cache(tmp_path / "row.safetensors", one, tokens[1, :13].tolist(), meta)
    back, ids = pc.load_prompt_cache(tmp_path / "row.safetensors", meta, 64)
    assert ids == tokens[1, :13].tolist()
    merged = pc.put_row(new(params, config, spec), 0, back)
    nxt = jnp.asarray([[7], [7]], jnp.int32)
    want, _ = run(cache, nxt, jnp.asarray([20, 13], jnp.int32), jnp.ones(2, jnp.int32))
    got, _ = run(merged, nxt, jnp.asarray([13, 0], jnp.int32), jnp.ones(2, jnp.int32))
    np.testing.assert_array_equal(np.asarray(got[0, 0]), np.asarray(want[1, 0]))
    with pytest.raises(TqjaxError, match="grouped by format"):  # one group vs three
        pc.put_row(new(params, config, SPECS["turbo4"]), 0, back)


@pytest.fixture(scope="module")
def deep_quantized(deep):
    """The deep model with two weight formats interleaved (tq4 and int8, as a Q4_K_M file
    alternates Q4_K and Q6_K layers) and one layer left dense."""
    from tqjax.models.quantize import WeightSpec, quantize_params

    params, config = deep
    tq4 = quantize_params(params, config, WeightSpec("tq4"))
    int8 = quantize_params(params, config, WeightSpec("int8"))
    layers = [int8.layers[i] if i in (1, 2, 4) else tq4.layers[i] for i in range(LAYERS)]
    layers[5] = params.layers[5]
    return params.replace(layers=layers), config


@pytest.mark.parametrize("name", ["f32", "turbo4+boundary q8"])
def test_layer_stack_runs_as_the_layer_list(deep_quantized, name):
    """Stacked by format (tq4, int8, the dense layer on its own), the layers give the same
    logits and cache as the list, for a prefill and a decode step, on one cache group and on
    three; `stack[i]` is layer i."""
    from tqjax.models.transformer import PARTS, LayerStack, stack_layers

    params, config = deep_quantized
    stack = stack_layers(list(params.layers))
    linears = len(PARTS) - 1
    assert isinstance(stack, LayerStack) and PARTS[1] == "wq"
    assert stack.kind == ((0,) * LAYERS, *[(0, 1, 1, 0, 1, 2)] * linears)  # norms: one format
    assert stack.pos == (tuple(range(LAYERS)), *[(0, 0, 1, 1, 2, 0)] * linears)
    assert len(stack) == LAYERS and all(stack.stacked[0][0])
    names = [jax.tree_util.keystr(p)
             for p, _ in jax.tree_util.tree_leaves_with_path(stack.stacks[1][0])]
    shared = {n for n, s in zip(names, stack.stacked[1][0], strict=True) if not s}
    assert ".wq.lut" in shared and ".wq.packed" not in shared  # one codebook, not one a layer
    assert not any(stack.stacked[1][2])  # the dense layer's wq: its own array, as it was
    for lp, got in zip(params.layers, stack, strict=True):
        for a, b in zip(jax.tree.leaves(lp), jax.tree.leaves(got), strict=True):
            np.testing.assert_array_equal(np.asarray(a), np.asarray(b))
    stacked = params.replace(layers=stack)
    counts = ("params", "quantized_params", "quantized_bytes")  # (the list's repeated layers
    # share their norms, which the stack copies: its "bytes" are larger)
    assert [params_bits(stacked)[k] for k in counts] == [params_bits(params)[k] for k in counts]
    step = jax.jit(lambda p, c, t, s: forward(p, config, t, s, c))
    tokens = jnp.asarray([[3, 17, 5, 9, 2], [8, 1, 4, 4, 11]], jnp.int32)
    runs = []
    for p in (params, stacked):
        cache = new(p, config, SPECS[name])
        logits, cache = step(p, cache, tokens, jnp.zeros(2, jnp.int32))
        more, cache = step(p, cache, tokens[:, :1], jnp.full(2, 5, jnp.int32))
        runs.append((logits, more, cache))
    for a, b in zip(jax.tree.leaves(runs[0]), jax.tree.leaves(runs[1]), strict=True):
        np.testing.assert_array_equal(np.asarray(a), np.asarray(b))


def test_stacked_weights_compile_once_per_format(deep_quantized):
    """Two quantized formats interleaved: the stacked decode program does not grow with the
    layers (12 against 6), where the list's grows by each layer's projections."""
    from tqjax.models.transformer import stack_layers

    params, config = deep_quantized
    six = params.replace(layers=[*params.layers[:5], params.layers[0]])  # no dense layer
    twelve = six.replace(layers=six.layers * 2)
    deeper = dataclasses.replace(config, num_layers=2 * LAYERS)
    spec = SPECS["f32"]
    listed = hlo_instructions(twelve, deeper, spec) - hlo_instructions(six, config, spec)
    stacked = (hlo_instructions(twelve.replace(layers=stack_layers(twelve.layers)), deeper, spec)
               - hlo_instructions(six.replace(layers=stack_layers(six.layers)), config, spec))
    # measured: 0 against 3,663 instructions (a 6-layer program: 1,906 against 4,074)
    assert abs(stacked) < 0.02 * listed, (stacked, listed)


def test_each_linear_compiles_once_per_format_it_takes(deep_quantized):
    """Formats mixed per linear, as a mixed-precision model has them: q projections in tq4 and
    int8 on layers 0-2 and 3-5, down projections alternating. The layers then have four
    combinations of formats, the linears two formats each; the decode program is as large as
    when both linears follow one pattern (two combinations), where one layer body per
    combination adds two more bodies."""
    from tqjax.models.transformer import stack_layers

    params, config = deep_quantized
    tq4, int8 = params.layers[0], params.layers[1]

    def layers(q: str, down: str) -> list:
        return [tq4.replace(wq=(tq4 if q[i] == "t" else int8).wq,
                            w_down=(tq4 if down[i] == "t" else int8).w_down)
                for i in range(LAYERS)]

    def model(q: str, down: str):
        return params.replace(layers=stack_layers(layers(q, down)))

    spec = SPECS["f32"]
    uniform = hlo_instructions(model("tttttt", "tttttt"), config, spec)
    aligned = hlo_instructions(model("tttiii", "tttiii"), config, spec)
    crossed = hlo_instructions(model("tttiii", "titiit"), config, spec)
    # measured: uniform 1,021, aligned 1,128, crossed 1,142 (one layer body per combination:
    # 1,021, 1,744, 3,080)
    assert aligned > uniform and abs(crossed - aligned) < 0.3 * (aligned - uniform), (
        uniform, aligned, crossed)
    # and each linear is read in its own format at its own place in its stack
    step = jax.jit(lambda p, c, t, s: forward(p, config, t, s, c))
    tokens = jnp.asarray([[3, 17, 5, 9, 2], [8, 1, 4, 4, 11]], jnp.int32)
    runs = []
    for p in (params.replace(layers=layers("tttiii", "titiit")), model("tttiii", "titiit")):
        logits, cache = step(p, new(p, config, spec), tokens, jnp.zeros(2, jnp.int32))
        runs.append((logits, *step(p, cache, tokens[:, :1], jnp.full(2, 5, jnp.int32))))
    for a, b in zip(jax.tree.leaves(runs[0]), jax.tree.leaves(runs[1]), strict=True):
        np.testing.assert_array_equal(np.asarray(a), np.asarray(b))


def test_calibration_compiles_one_layer_program_for_a_stack(deep_quantized, monkeypatch):
    """The turbo caches' calibration (`decode.calibrate`) over the crossed formats of the test
    above: the same statistics as over the list of layers, from one compiled program for
    the stack, where the list compiles one per combination of formats (4; so did a stack)."""
    from tqjax.decode import calibrate as cal
    from tqjax.models.transformer import stack_layers

    params, config = deep_quantized
    tq4, int8 = params.layers[0], params.layers[1]
    listed = params.replace(layers=[
        tq4.replace(wq=(tq4 if q == "t" else int8).wq, w_down=(tq4 if d == "t" else int8).w_down)
        for q, d in zip("tttiii", "titiit", strict=True)])
    stacked = listed.replace(layers=stack_layers(list(listed.layers)))
    real, programs = cal._layer_statistics, []

    class Counted:  # the jitted function, its programs counted before calibrate drops them
        def __call__(self, *args):
            return real(*args)

        def clear_cache(self):
            programs.append(real._cache_size())
            real.clear_cache()

    monkeypatch.setattr(cal, "_layer_statistics", Counted())
    ids = list(range(3, 40))
    want, got = (cal.calibrate(p, config, ids) for p in (listed, stacked))
    assert programs == [4, 1]
    for f in dataclasses.fields(want):
        np.testing.assert_allclose(np.asarray(getattr(got, f.name)),
                                   np.asarray(getattr(want, f.name)), rtol=1e-6, atol=1e-6)


def test_stack_layers_consumes_the_list(deep_quantized):
    """consume=True empties the caller's list (each source array dropped once copied)."""
    from tqjax.models.transformer import stack_layers

    params, _ = deep_quantized
    want = [jax.tree.map(np.asarray, lp) for lp in params.layers]
    layers = [jax.tree.map(jnp.copy, lp) for lp in params.layers]
    stack = stack_layers(layers, consume=True)
    assert layers == []
    for lp, got in zip(want, stack, strict=True):
        for a, b in zip(jax.tree.leaves(lp), jax.tree.leaves(got), strict=True):
            np.testing.assert_array_equal(a, np.asarray(b))


def test_layer_stack_shards_and_round_trips_through_orbax(deep_quantized, tmp_path):
    """A `LayerStack` placed by the sharding rules (one device here; tests/test_sharding.py
    runs stacked tq4/int8 models on TP meshes) and saved and restored as an orbax checkpoint
    is the same stack, giving the same logits."""
    from tqjax.models.orbax_checkpoint import restore_sharded, save_sharded
    from tqjax.models.transformer import PARTS, LayerStack, stack_layers
    from tqjax.sharding import make_mesh, shard_params

    params, config = deep_quantized
    stacked = params.replace(layers=stack_layers(list(params.layers)))
    placed = shard_params(stacked, config, make_mesh(1))
    save_sharded(tmp_path / "orbax", placed, config)
    _, restored, _ = restore_sharded(tmp_path / "orbax")
    assert isinstance(restored.layers, LayerStack)
    assert (restored.layers.kind, restored.layers.pos, restored.layers.stacked) == (
        stacked.layers.kind, stacked.layers.pos, stacked.layers.stacked)
    for a, b in zip(jax.tree.leaves(restored), jax.tree.leaves(stacked), strict=True):
        np.testing.assert_array_equal(np.asarray(a), np.asarray(b))
    step = jax.jit(lambda p, c, t, s: forward(p, config, t, s, c)[0])
    tokens = jnp.asarray([[3, 17, 5, 9, 2], [8, 1, 4, 4, 11]], jnp.int32)
    logits = [step(p, new(p, config, SPECS["f32"]), tokens, jnp.zeros(2, jnp.int32))
              for p in (stacked, placed, restored)]
    for got in logits[1:]:
        np.testing.assert_array_equal(np.asarray(got), np.asarray(logits[0]))
    # a checkpoint saved before the layers were stacked part by part (one format per layer's
    # combination of formats: flat `kind`) is refused in one line, not misread
    meta = tmp_path / "orbax" / "orbax.json"
    info = json.loads(meta.read_text())

    def stack_node(node):
        if isinstance(node, dict) and node.get("type") == "LayerStack":
            return node
        children = node.values() if isinstance(node, dict) else (
            node if isinstance(node, list) else ())
        return next(filter(None, map(stack_node, children)), None)

    static = stack_node(info)["static"]
    static.update({k: v[1] for k, v in static.items()})  # the wq part's, as the old layout
    meta.write_text(json.dumps(info))
    with pytest.raises(TqjaxError, match="layers stacked in an older layout"):
        restore_sharded(tmp_path / "orbax")
    static["kind"] = [0] * len(PARTS)  # (an old model of as many layers as PARTS has parts)
    meta.write_text(json.dumps(info))
    with pytest.raises(TqjaxError, match="layers stacked in an older layout"):
        restore_sharded(tmp_path / "orbax")


def test_a_stacked_weight_dequantizes_layer_by_layer(deep_quantized):
    """The reference dequantization reads a stacked `QuantizedLinear` (its layer axis first)
    as the stack of its layers' weights; the Pallas kernel takes one layer's weight only
    (`supported` says no to a stack, which the layer loop slices first)."""
    from tqjax.models.transformer import PARTS, stack_layers
    from tqjax.pallas import dequant_matmul
    from tqjax.quant.weights import QuantizedLinear, dequantize_weight

    params, config = deep_quantized
    stack = stack_layers(list(params.layers))
    seen = 0
    for p, part in enumerate(PARTS[1:], start=1):
        for f, fmt in enumerate(stack.stacks[p]):
            w = getattr(fmt, part)
            if not isinstance(w, QuantizedLinear) or w.packed.ndim != 3:
                continue
            got = np.asarray(dequantize_weight(w))  # [layers, K_pad, N]
            layers = [i for i in range(len(stack)) if stack.kind[p][i] == f]
            assert got.shape[0] == len(layers) > 1
            for i in layers:
                one = getattr(params.layers[i], part)
                want = np.asarray(dequantize_weight(one))
                np.testing.assert_array_equal(got[stack.pos[p][i]], want)
            assert not dequant_matmul.supported((1, one.padded_in), w)
            assert dequant_matmul.supported((1, one.padded_in), one)
            seen += 1
    assert seen >= 7  # every linear's tq4 stack (4 layers) and int8 stack (3)


@pytest.mark.parametrize("dtype", ["bf16", "f16"])
def test_a_half_cache_is_updated_and_read_in_place(deep, dtype):
    """A bf16 (or f16) cache's decode step never converts its stacked layers to f32:
    XLA:CPU computes bf16 slices and updates in f32, and so converted a bf16 cache's whole
    stack there and back at every layer (15x slower than f32 at 4k slots). Its logits stay
    those of an f32 cache to half precision, and it stores the rows rounded."""
    params, config = deep
    spec = CacheSpec(dtype, dtype)
    slots = 256
    cache = new(params, config, spec, batch=1, slots=slots)
    step = jax.jit(lambda p, c, t, s: forward(p, config, t, s, c), donate_argnums=1)
    tok, pos = jnp.ones((1, 1), jnp.int32), jnp.asarray([5], jnp.int32)
    text = step.lower(params, cache, tok, pos).compile().as_text()
    stack = f"{LAYERS},1,{config.num_kv_heads},{slots},{config.head_dim}]"
    assert f"[{stack}" in text  # (the stack is in the program, in its own type)
    assert f"f32[{stack}" not in text
    ref = new(params, config, CacheSpec(), batch=1, slots=slots)
    prompt = jnp.asarray([[3, 17, 5, 9, 40, 2]], jnp.int32)
    got, cache = forward(params, config, prompt, jnp.zeros(1, jnp.int32), cache)
    want, ref = forward(params, config, prompt, jnp.zeros(1, jnp.int32), ref)
    tol = {"bf16": 1e-2, "f16": 1e-3}[dtype]  # measured 4.7e-3 and 5.4e-4 (logits up to 2.8)
    np.testing.assert_allclose(np.asarray(got), np.asarray(want), atol=tol, rtol=0)
    k = np.asarray(ref.layer(0).k.data[0, :, :6])  # (the first layer: the same inputs)
    got_k = cache.layer(0).k.values()[0, :, :6]
    np.testing.assert_array_equal(np.asarray(got_k), k.astype(got_k.dtype))
