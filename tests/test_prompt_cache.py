"""Prompt caches: rows of a cache (take_row/put_row), saved caches, prefix reuse, context shift."""

import contextlib
import os

import jax
import jax.numpy as jnp
import numpy as np
import pytest

import tqjax
from tqjax.api import Session
from tqjax.decode import generate as gen
from tqjax.decode import prompt_cache as pc
from tqjax.errors import TqjaxError
from tqjax.kv.cache import CacheSpec

from .conftest import GOLDEN
from .test_cli import make_byte_tokenizer

SPECS = {"f32": CacheSpec(), "q8": CacheSpec("q8", "q8"), "turbo4": CacheSpec("turbo4", "turbo4"),
         "turbo4/turbo3": CacheSpec("turbo4", "turbo3", recent_tokens=8)}


@pytest.fixture(scope="module")
def model(tmp_path_factory):
    """The tiny random Llama with a byte tokenizer (turbo caches calibrate on text)."""
    import shutil

    d = tmp_path_factory.mktemp("tiny") / "llama"
    shutil.copytree(GOLDEN / "tiny" / "llama", d)
    make_byte_tokenizer(d)
    return tqjax.load(d)


def filled(model, spec, prompts, slots):
    """A cache of len(prompts) rows holding the prompts (right-padded, one prefill)."""
    width = max(len(p) for p in prompts)
    tokens = np.zeros((len(prompts), gen.padded_length(width)), np.int32)
    for b, p in enumerate(prompts):
        tokens[b, :len(p)] = p
    cache = gen.new_cache(model.params, model.config, spec, len(prompts), slots,
                          model.calibration(spec))
    _, cache = gen.prefill(model.params, model.config, tokens,
                           np.asarray([len(p) for p in prompts]), cache)
    return cache


def row_leaves(cache):
    """(path, array) of every leaf, numpy."""
    return [(jax.tree_util.keystr(k), np.asarray(x))
            for k, x in jax.tree_util.tree_leaves_with_path(cache)]


@pytest.mark.parametrize("name", ["f32", "turbo4/turbo3"])
def test_take_row_and_put_row_copy_exactly_the_row(model, name):
    spec = SPECS[name]
    rng = np.random.default_rng(0)
    prompts = [rng.integers(3, 256, 40).tolist(), rng.integers(3, 256, 23).tolist()]
    cache = filled(model, spec, prompts, 128)
    one = pc.take_row(cache, 1)
    for (path, a), (_, b) in zip(row_leaves(cache), row_leaves(one), strict=True):
        if b.shape != a.shape:  # a per-row array (stacked: [L, B, ...]): exactly row 1
            assert b.shape == (a.shape[0], 1, *a.shape[2:]), path
            np.testing.assert_array_equal(b[:, 0], a[:, 1], err_msg=path)
        else:  # a per-layer constant, shared
            np.testing.assert_array_equal(b, a, err_msg=path)
    # into row 0 of another 2-row cache: row 0 becomes the copy, row 1 and constants unchanged
    other = filled(model, spec, [rng.integers(3, 256, 30).tolist()] * 2, 128)
    before = row_leaves(other)
    merged = pc.put_row(other, 0, one)
    for (path, a), (_, o), (_, m), (_, r) in zip(row_leaves(cache), before, row_leaves(merged),
                                                 row_leaves(one), strict=True):
        if r.shape != a.shape:  # per-row
            np.testing.assert_array_equal(m[:, 0], a[:, 1], err_msg=path)
            np.testing.assert_array_equal(m[:, 1], o[:, 1], err_msg=path)
        else:
            np.testing.assert_array_equal(m, o, err_msg=path)
    # the next decode step of the moved row gives the original row's logits, bit for bit
    step = jax.jit(lambda c, t, s: gen.forward(model.params, model.config, t, s, c,
                                               out_index=jnp.zeros(2, jnp.int32)))
    want, _ = step(cache, jnp.asarray([[5], [7]]), jnp.asarray([40, 23], jnp.int32))
    got, _ = step(merged, jnp.asarray([[7], [9]]), jnp.asarray([23, 30], jnp.int32))
    np.testing.assert_array_equal(np.asarray(got[0]), np.asarray(want[1]))


def test_put_row_with_fewer_slots_fills_the_first(model):
    spec = SPECS["turbo4/turbo3"]
    rng = np.random.default_rng(1)
    prompt = rng.integers(3, 256, 50).tolist()
    small = filled(model, spec, [prompt], 64)
    big = gen.new_cache(model.params, model.config, spec, 3, 256, model.calibration(spec))
    merged = pc.put_row(big, 2, small)
    assert merged.slots == 256
    lk = merged.layers[1].k
    np.testing.assert_array_equal(np.asarray(lk.packed[2, :, :64]),
                                  np.asarray(small.layers[1].k.packed[0]))
    assert not np.asarray(lk.packed[2, :, 64:]).any() and not np.asarray(lk.packed[:2]).any()
    np.testing.assert_array_equal(np.asarray(merged.layers[0].recent.pos[2]),
                                  np.asarray(small.layers[0].recent.pos[0]))
    with pytest.raises(TqjaxError, match="does not fit"):
        pc.put_row(small, 0, pc.take_row(merged, 2))
    with pytest.raises(TqjaxError, match="out of range"):
        pc.take_row(merged, 3)
    with pytest.raises(TqjaxError, match="does not match"):
        pc.put_row(gen.new_cache(model.params, model.config, CacheSpec(), 1, 64), 0, small)


def meta_for(model, spec, params=None):
    return pc.cache_meta(model.config, params or model.params, model.tokenizer, spec,
                         model.calibration(spec))


@pytest.mark.parametrize("name", list(SPECS))
def test_saved_cache_restores_bit_for_bit(model, name, tmp_path):
    """Save after a prefill of n tokens, restore into a cache of the same slots: the next two
    decode steps give the same logits bit for bit; only the live positions are stored."""
    spec = SPECS[name]
    prompt = np.random.default_rng(2).integers(3, 256, 45).tolist()
    cache = filled(model, spec, [prompt], 128)
    meta = meta_for(model, spec)
    path = tmp_path / "p.tqkv"
    pc.save_prompt_cache(path, cache, prompt, meta)
    restored, ids = pc.load_prompt_cache(path, meta, 128)
    assert ids == prompt and restored.slots == 128

    step = jax.jit(lambda c, t, s: gen.forward(model.params, model.config, t, s, c,
                                               out_index=jnp.zeros(1, jnp.int32)))
    for pos, tok in ((45, 9), (46, 77)):
        want, cache = step(cache, jnp.asarray([[tok]]), jnp.asarray([pos], jnp.int32))
        got, restored = step(restored, jnp.asarray([[tok]]), jnp.asarray([pos], jnp.int32))
        np.testing.assert_array_equal(np.asarray(got), np.asarray(want))
    # a bigger row works too (other attention blocks: equal to rounding)
    bigger, _ = pc.load_prompt_cache(path, meta, 1024)
    got, _ = step(bigger, jnp.asarray([[9]]), jnp.asarray([45], jnp.int32))
    first, _ = step(filled(model, spec, [prompt], 128), jnp.asarray([[9]]),
                    jnp.asarray([45], jnp.int32))
    np.testing.assert_allclose(np.asarray(got), np.asarray(first), atol=1e-5, rtol=1e-5)
    from safetensors import safe_open

    with safe_open(str(path), "numpy") as f:  # stored: 45 positions, not the 128 slots
        shapes = {k: f.get_slice(k).get_shape() for k in f.keys()}  # noqa: SIM118
    slot_axes = [s[2] for k, s in shapes.items() if k.endswith((".data", ".packed", ".q"))]
    assert slot_axes and set(slot_axes) == {45}


def test_a_saved_cache_loads_where_the_calibration_differs_in_its_last_bits(model, tmp_path):
    """The same model on another mesh or CPU calibrates to means that differ in their last
    bits (TP 3 against one device, found by QA): a file made there is accepted (its constants
    checked against its own saved means), the next steps' logits equal to rounding; another
    calibration (1% off) is still refused."""
    import dataclasses

    spec = SPECS["turbo4/turbo3"]
    prompt = np.random.default_rng(5).integers(3, 256, 45).tolist()
    cal = model.calibration(spec)

    def scaled(f):
        return dataclasses.replace(cal, **{n.name: np.asarray(getattr(cal, n.name)) * f
                                           for n in dataclasses.fields(cal)})

    near = scaled(np.float32(1 + 2e-6))
    meta = pc.cache_meta(model.config, model.params, model.tokenizer, spec, cal)
    other = pc.cache_meta(model.config, model.params, model.tokenizer, spec, near)
    assert other.calibration_sha256 != meta.calibration_sha256
    assert other.constants_sha256 != meta.constants_sha256
    cache = gen.new_cache(model.params, model.config, spec, 1, 128, near)
    tokens = np.zeros((1, gen.padded_length(45)), np.int32)
    tokens[0, :45] = prompt
    _, cache = gen.prefill(model.params, model.config, tokens, np.asarray([45]), cache)
    path = tmp_path / "p.tqkv"
    pc.save_prompt_cache(path, cache, prompt, other)  # made "elsewhere"
    restored, ids = pc.load_prompt_cache(path, meta, 128)
    assert ids == prompt
    step = jax.jit(lambda c, t, s: gen.forward(model.params, model.config, t, s, c,
                                               out_index=jnp.zeros(1, jnp.int32)))
    want, _ = step(filled(model, spec, [prompt], 128), jnp.asarray([[9]]),
                   jnp.asarray([45], jnp.int32))
    got, _ = step(restored, jnp.asarray([[9]]), jnp.asarray([45], jnp.int32))
    np.testing.assert_allclose(np.asarray(got), np.asarray(want), rtol=1e-4, atol=1e-4)
    far = pc.cache_meta(model.config, model.params, model.tokenizer, spec, scaled(1.01))
    with pytest.raises(TqjaxError, match="other calibration constants"):
        pc.load_prompt_cache(path, far, 128)
    # an array that is no calibration field is not taken as one (it is an unexpected array)
    from safetensors import safe_open

    with safe_open(str(path), "numpy") as f:
        header = dict(f.metadata())
        tensors = {k: f.get_tensor(k) for k in f.keys()}  # noqa: SIM118
    tensors["calibration.bogus"] = np.zeros(3, np.float32)
    body = {k: v for k, v in header.items() if k != "sha256"}
    pc.write_safetensors(tmp_path / "x.tqkv", tensors, {**body,
                                                         "sha256": pc._checksum(body, tensors)})
    with pytest.raises(TqjaxError, match=r"unexpected arrays \['calibration.bogus'\]"):
        pc.load_prompt_cache(tmp_path / "x.tqkv", meta, 128)


def test_bad_prompt_cache_files_are_refused(model, tmp_path):
    spec = SPECS["turbo4"]
    prompt = np.random.default_rng(3).integers(3, 256, 20).tolist()
    meta = meta_for(model, spec)
    good = tmp_path / "good.tqkv"
    pc.save_prompt_cache(good, filled(model, spec, [prompt], 64), prompt, meta)
    data = good.read_bytes()

    def refused(blob, match, m=meta, slots=64):
        bad = tmp_path / "bad.tqkv"
        bad.write_bytes(blob)
        with pytest.raises(TqjaxError, match=match) as e:
            pc.load_prompt_cache(bad, m, slots)
        assert "\n" not in str(e.value)

    other = model.params.replace(final_norm=model.params.final_norm * 1.5)
    refused(data, "another model", meta_for(model, spec, other))
    import dataclasses  # a replaced Model shares the memo dict but not the memo

    changed = dataclasses.replace(model, params=other)
    assert changed.cache_meta(spec).model_sha256 != model.cache_meta(spec).model_sha256
    refused(data, "another cache type", meta_for(model, SPECS["turbo4/turbo3"]))
    refused(data, "another cache type", meta_for(model, CacheSpec("turbo4", "turbo4", seed=1)))
    refused(data[: len(data) - 100], "truncated or corrupt")
    refused(data[:40], "truncated or corrupt")
    for at in (len(data) - 50, len(data) // 2):  # a flipped byte in the arrays
        flipped = bytearray(data)
        flipped[at] ^= 0x10
        refused(bytes(flipped), "corrupt")
    header_len = int.from_bytes(data[:8], "little")
    text = data[8:8 + header_len].replace(b'"version":"3"', b'"version":"2"')
    assert len(text) == header_len and text != data[8:8 + header_len]
    refused(data[:8] + text + data[8 + header_len:], "format version 2, this tqjax reads version 3")
    refused(data, "holds 20 tokens, more than the 16 slots", slots=16)
    with pytest.raises(TqjaxError, match="no such"):
        pc.load_prompt_cache(tmp_path / "missing.tqkv", meta, 64)
    # a safetensors file that is no prompt cache (weights given by mistake), a folder, a FIFO:
    # each said as it is, by saved_length (which runs first) and by the load
    from safetensors.numpy import save_file

    weights, fifo = tmp_path / "weights.safetensors", tmp_path / "fifo"
    save_file({"w": np.ones(3, np.float32)}, str(weights), metadata={"n_tokens": "x"})
    os.mkfifo(fifo)
    for path, match in ((weights, "is not a tqjax prompt cache"), (tmp_path, "is a directory"),
                        (fifo, "is not a regular file")):
        for read in (pc.saved_length, lambda p: pc.load_prompt_cache(p, meta, 64)):
            with pytest.raises(TqjaxError, match=match):
                read(path)
    # writing where no file can go: a TqjaxError naming the path (not the temporary sibling,
    # not an OSError), and from generate() before any prefill
    session = Session(model, cache=spec, ctx_size=64)
    session.generate(prompt, max_new_tokens=2)
    for dest, match in ((tmp_path, "cannot write prompt cache .*: Is a directory"),
                        (good / "x.tqkv", "cannot write prompt cache .*: Not a directory")):
        with pytest.raises(TqjaxError, match=match):
            session.save(dest)
    with pytest.raises(TqjaxError, match="cannot write prompt cache .*: Not a directory"):
        tqjax.generate(model, prompt, max_new_tokens=2, cache=spec, prompt_cache=good / "x")


def test_session_reuses_the_common_prefix(model):
    """The second prompt shares a long prefix with the first prompt + output: only the rest is
    prefilled, and the greedy tokens equal a fresh generation's."""
    rng = np.random.default_rng(4)
    system = rng.integers(3, 256, 150).tolist()
    q1, q2 = rng.integers(3, 256, 7).tolist(), rng.integers(3, 256, 9).tolist()
    session = Session(model, ctx_size=256)
    first = session.generate(system + q1, max_new_tokens=5)
    assert first.cached_tokens == 0 and session.tokens == system + q1 + first.token_ids[:-1]
    second = session.generate(system + q2, max_new_tokens=5)
    assert second.cached_tokens == common(system + q1, system + q2)
    assert second.token_ids == tqjax.generate(model, system + q2, max_new_tokens=5).token_ids
    # the same prompt again: everything but its last token is reused
    again = session.generate(system + q2, max_new_tokens=5)
    assert again.cached_tokens == len(system + q2) - 1 and again.token_ids == second.token_ids
    # a refused call leaves the session's cache usable
    with pytest.raises(TqjaxError, match="out of range"):
        session.generate(system + [model.config.vocab_size], max_new_tokens=2)
    assert session.generate(system + q2, max_new_tokens=5).token_ids == second.token_ids
    # a saved file longer than another session's context is refused (it was loaded whole:
    # the session then held more tokens than its context; found by QA)
    import tempfile

    with tempfile.TemporaryDirectory() as d:
        session.save(f"{d}/s.tqkv")
        n = len(session.tokens)
        small = Session(model, ctx_size=64)
        with pytest.raises(TqjaxError, match=f"holds {n} tokens, more than the session's "
                                             f"context of 64"):
            small.load(f"{d}/s.tqkv")
        assert small.tokens == [] and small.generate(q1, max_new_tokens=2).cached_tokens == 0


@contextlib.contextmanager
def compilations():
    """Count XLA backend compilations inside the block: yields a list that grows by one name
    (the event's) per compilation."""
    from jax import monitoring

    seen = []

    def listen(event, secs, **kwargs):
        if event == "/jax/core/compile/backend_compile_duration":
            seen.append(kwargs.get("fun_name", event))

    monitoring.register_event_duration_secs_listener(listen)
    try:
        yield seen
    finally:
        monitoring.unregister_event_duration_listener(listen)


def test_new_sampling_settings_compile_nothing(model, tmp_path):
    """Generation (plain, a Session's reuse, a prompt-cache file) compiles once per shape: a
    second round of the same shapes with another seed, temperature, top-k/p, min-p and repeat
    penalty compiles nothing (the first-token sampling after the prefill is jitted with traced
    settings; run eagerly, its lax.cond compiled afresh on every call, ~0.7 s each on CPU, most
    of a reused prefix's time to first token)."""
    rng = np.random.default_rng(8)
    system = rng.integers(3, 256, 100).tolist()
    q1, q2 = rng.integers(3, 256, 5).tolist(), rng.integers(3, 256, 6).tolist()
    path = tmp_path / "p.tqkv"

    def run(**kw):
        session = Session(model, ctx_size=256)
        out = [session.generate(system + q1, max_new_tokens=4, **kw),
               session.generate(system + q2, max_new_tokens=4, **kw)]
        out += [tqjax.generate(model, system + q1, max_new_tokens=4, prompt_cache=path, **kw)
                for _ in range(2)]  # the first run writes the file, the later ones reuse it
        assert [r.cached_tokens for r in out[1:]] == [len(system), out[2].cached_tokens,
                                                      len(system + q1) - 1]
        return out

    warm = run(temperature=0.5, seed=2)  # compiles every shape
    assert warm[2].cached_tokens == 0
    assert all(r.generated_tokens == 4 for r in warm), [r.token_ids for r in warm]  # no EOS
    with compilations() as compiled:
        run()
        run(temperature=0.8, top_k=7, top_p=0.9, min_p=0.05, repeat_penalty=1.2, seed=11)
    assert compiled == []


def common(a, b):
    return next(i for i, (x, y) in enumerate(zip(a + [-1], b + [-2], strict=False)) if x != y)


def test_generate_with_a_prompt_cache_file(model, tmp_path):
    spec = SPECS["turbo4/turbo3"]
    rng = np.random.default_rng(5)
    doc, q1, q2 = (rng.integers(3, 256, n).tolist() for n in (120, 6, 8))
    path = tmp_path / "doc.tqkv"
    plain = tqjax.generate(model, doc + q1, max_new_tokens=6, cache=spec)
    made = tqjax.generate(model, doc + q1, max_new_tokens=6, cache=spec, prompt_cache=path)
    assert path.is_file() and made.cached_tokens == 0 and made.token_ids == plain.token_ids
    reused = tqjax.generate(model, doc + q1, max_new_tokens=6, cache=spec, prompt_cache=path)
    assert reused.cached_tokens == len(doc + q1) - 1 and reused.token_ids == plain.token_ids
    other = tqjax.generate(model, doc + q2, max_new_tokens=6, cache=spec, prompt_cache=path,
                           prompt_cache_ro=True)
    # (the file holds doc + q1 past the reuse point: the ring's 8 positions are prefilled again)
    assert other.cached_tokens == common(doc + q1, doc + q2) - spec.recent_tokens
    assert other.token_ids == tqjax.generate(model, doc + q2, max_new_tokens=6,
                                             cache=spec).token_ids
    assert pc.load_prompt_cache(path, meta_for(model, spec), 256)[1] == doc + q1  # read-only
    with pytest.raises(TqjaxError, match="another cache type"):
        tqjax.generate(model, doc, max_new_tokens=2, prompt_cache=path)
    missing = tmp_path / "typo.tqkv"  # read-only and missing: an error, not a silent miss
    with pytest.raises(TqjaxError, match="does not exist"):
        tqjax.generate(model, doc, max_new_tokens=2, prompt_cache=missing, prompt_cache_ro=True)
    assert not missing.exists()


def test_reuse_short_of_the_held_tokens_gives_back_the_recent_ring(model):
    """A turbo cache keeps its last N positions exactly (the recent ring). A cache that holds
    A = P + a, reused for B = P + b, no longer has P's last N positions in its ring, which a
    fresh prefill of B reads exactly: `reusable_prefix` reuses N fewer tokens, prefilled again
    into the ring. Teacher-forced logits over b then stay within 0.04 of a fresh prefill's
    (measured 0.012-0.027 on three draws); reusing all of P was 0.096-0.124 away. Reuse at the
    end of the held tokens (B extends A) reads what a fresh prefill reads: its logits differ
    only by float rounding (another chunking: 1e-6)."""
    spec = SPECS["turbo4/turbo3"]  # a ring of 8

    def logits(ids, start=0, kv=None):
        kv = kv if kv is not None else gen.new_cache(model.params, model.config, spec, 1, 256,
                                                     model.calibration(spec))
        out, kv = gen.full_logits(model.params, model.config,
                                  jnp.asarray(np.asarray(ids, np.int32)[None]),
                                  jnp.asarray([start], jnp.int32), kv)
        return np.asarray(out[0]), kv

    rng = np.random.default_rng(0)
    for _ in range(3):
        prefix = rng.integers(3, 256, 100).tolist()
        held, new = (prefix + rng.integers(3, 256, 40).tolist() for _ in range(2))
        fresh = logits(new)[0][100:]
        _, kv = logits(held)
        n = pc.reusable_prefix(held, new, pc.ring_size(kv))
        assert (pc.ring_size(kv), n) == (8, 100 - 8)
        reused = logits(new[n:], n, kv)[0][100 - n:]
        assert np.abs(reused - fresh).max() < 0.04
        _, kv = logits(held)
        assert np.abs(logits(new[100:], 100, kv)[0] - fresh).max() > 0.04  # all of P reused
    more = held + rng.integers(3, 256, 20).tolist()  # the next turn of a chat: exact
    _, kv = logits(held)
    n = pc.reusable_prefix(held, more, pc.ring_size(kv))
    assert n == len(held)
    np.testing.assert_allclose(logits(more[n:], n, kv)[0], logits(more)[0][n:], atol=2e-5)
    # no ring (dense and q8 caches): the whole common prefix, less the prompt's last token
    assert pc.reusable_prefix(held, new, 0) == 100
    assert pc.reusable_prefix(held, held, 0) == pc.reusable_prefix(held, held, 8) == 139
    assert pc.reusable_prefix(held, held[:-1] + [0], 8) == 139  # the ring holds 132..138
    assert pc.reusable_prefix(held, held[:-2] + [0], 8) == 138 - 8  # it lacks 131
    assert pc.reusable_prefix(held[:6], held[:3] + [0], 8) == 3  # all held in the ring
    assert pc.reusable_prefix(held, held[:5] + [0], 8) == 0


def rope_np(x, pos, inv_freq):
    """Half-split RoPE of x [..., n, hd] at positions pos [n] (numpy, float64)."""
    ang = np.asarray(pos, np.float64)[:, None] * np.asarray(inv_freq, np.float64)[None, :]
    cos, sin = np.cos(ang), np.sin(ang)
    h = x.shape[-1] // 2
    x1, x2 = x[..., :h].astype(np.float64), x[..., h:].astype(np.float64)
    return np.concatenate([x1 * cos - x2 * sin, x2 * cos + x1 * sin], -1)


def test_context_shift_moves_and_rerotates_the_kept_keys(model):
    """keep 5, drop 10 of 30: slots 5..19 hold the old 15..29 with keys rotated back by 10
    positions (against numpy: undo RoPE at the old position, apply it at the new one); layer 0
    equals a fresh prefill of the kept tokens at their new positions."""
    tokens = np.random.default_rng(6).integers(3, 256, 30).tolist()
    cache = filled(model, CacheSpec(), [tokens], 64)
    old = [(np.asarray(la.k.data[0]), np.asarray(la.v.data[0])) for la in cache.layers]
    inv = np.asarray(model.params.rope_inv_freq)
    shifted = gen.context_shift(cache, 0, 5, 10, model.params.rope_inv_freq)
    kept = tokens[:5] + tokens[15:]
    fresh = filled(model, CacheSpec(), [kept], 64)
    for i, (layer, (k, v)) in enumerate(zip(shifted.layers, old, strict=True)):
        got_k, got_v = np.asarray(layer.k.data[0]), np.asarray(layer.v.data[0])
        np.testing.assert_array_equal(got_k[:, :5], k[:, :5])
        np.testing.assert_array_equal(got_v[:, :20], np.concatenate([v[:, :5], v[:, 15:30]], 1))
        pre = rope_np(k[:, 15:30], -np.arange(15, 30), inv)  # undo RoPE at the old positions
        np.testing.assert_allclose(got_k[:, 5:20], rope_np(pre, np.arange(5, 20), inv),
                                   atol=1e-5, rtol=1e-5)
        if i == 0:  # keys of layer 0 depend only on token and position
            np.testing.assert_allclose(got_k[:, :20], np.asarray(fresh.layers[0].k.data[0, :, :20]),
                                       atol=1e-5, rtol=1e-5)
            np.testing.assert_allclose(got_v[:, :20], np.asarray(fresh.layers[0].v.data[0, :, :20]),
                                       atol=1e-6)
    with pytest.raises(TqjaxError, match="dense keys"):
        gen.context_shift(filled(model, SPECS["q8"], [tokens], 64), 0, 5, 10,
                          model.params.rope_inv_freq)


def test_context_shift_of_a_bf16_cache(model):
    """A bf16 cache (its values held as bits) shifts as an f32 one does: values moved bit for
    bit, kept keys re-rotated by 10 positions and rounded to bf16 again."""
    tokens = np.random.default_rng(6).integers(3, 256, 30).tolist()
    cache = filled(model, CacheSpec("bf16", "bf16"), [tokens], 64)
    inv = np.asarray(model.params.rope_inv_freq)
    old = [(np.asarray(la.k.values()[0], np.float64), np.asarray(la.v.data[0]))
           for la in cache.layers]
    shifted = gen.context_shift(cache, 0, 5, 10, model.params.rope_inv_freq)
    worst = 0.0
    for layer, (k, v) in zip(shifted.layers, old, strict=True):
        assert layer.k.data.dtype == jnp.uint16 and layer.k.bf16
        got_k = np.asarray(layer.k.values()[0], np.float64)
        np.testing.assert_array_equal(got_k[:, :5], k[:, :5])
        np.testing.assert_array_equal(np.asarray(layer.v.data[0])[:, :20],
                                      np.concatenate([v[:, :5], v[:, 15:30]], 1))
        want = rope_np(rope_np(k[:, 15:30], -np.arange(15, 30), inv), np.arange(5, 20), inv)
        worst = max(worst, float(np.abs(got_k[:, 5:20] - want).max() / np.abs(want).max()))
    assert worst < 6e-3  # measured 3.1e-3 of the largest key (bf16: 2^-8 relative)


def test_generation_past_the_context(model):
    """Without context shift a full context stops with 'length'; with it generation goes on
    (keep 4, drop half the rest, twice here) and the cache holds exactly the kept tokens."""
    prompt = np.random.default_rng(7).integers(3, 256, 20).tolist()
    with pytest.raises(TqjaxError, match="context shift needs dense keys"):  # before any work
        tqjax.generate(model, prompt, max_new_tokens=40, ctx_size=32, cache=SPECS["q8"],
                       context_shift=True)
    stopped = tqjax.generate(model, prompt, max_new_tokens=40, ctx_size=32)
    assert stopped.finish_reason == "length"
    assert stopped.prompt_tokens + len(stopped.token_ids) == 32
    steps = gen.generate_tokens(model.params, model.config, [prompt], max_new_tokens=40,
                                sampling=gen.SamplingParams(), eos_ids=(), ctx_size=32,
                                context_shift_keep=4)
    seen = []
    while True:
        try:
            seqs, _, _ = next(steps)
            seen.append((seqs[0].shifts, list(seqs[0].ids)))
        except StopIteration as end:
            state = end.value
            break
    ids = seen[-1][1]
    assert len(ids) == 40 and seen[-1][0] >= 2 and len(state.tokens[0]) < 32
    assert ids[:len(stopped.token_ids)] == stopped.token_ids
    live, shifts = list(prompt), 0  # the bookkeeping, replayed: what the cache holds
    for t in ids[:-1]:
        if len(live) + 1 >= 32:
            del live[4:4 + (len(live) - 4) // 2]
            shifts += 1
        live.append(t)
    assert state.tokens[0] == live and seen[-1][0] == shifts
    # the shifted cache's slots are the kept tokens: its keys at layer 0 match a fresh prefill
    k0 = np.asarray(state.cache.layers[0].k.data[0, :, :len(live)])
    fresh = filled(model, CacheSpec(), [live], 64)
    np.testing.assert_allclose(k0, np.asarray(fresh.layers[0].k.data[0, :, :len(live)]),
                               atol=1e-5, rtol=1e-5)


def test_cli_prompt_cache(tmp_path):
    """scripts/generate.py --prompt-cache: written on the first run, reused on the second (same
    tokens); a file for another cache type or a truncated file is one line and exit 2."""
    import json
    import shutil

    from .test_cli import assert_user_error, run

    d = tmp_path / "llama"
    shutil.copytree(GOLDEN / "tiny" / "llama", d)
    make_byte_tokenizer(d)
    f = tmp_path / "p.tqkv"
    args = ("--model", d, "--prompt", "a long shared prefix, then a question", "-n", "4",
            "--json", "--prompt-cache", f)
    first, second = (run("generate.py", *args) for _ in range(2))
    assert first.returncode == 0 and second.returncode == 0, first.stderr + second.stderr
    a, b = (json.loads(p.stdout.strip().splitlines()[-1]) for p in (first, second))
    assert a["cached_tokens"] == 0 and b["cached_tokens"] == a["prompt_tokens"] - 1
    assert a["token_ids"] == b["token_ids"]
    assert_user_error(run("generate.py", *args, "--kv", "q8"), "another cache type")
    f.write_bytes(f.read_bytes()[:-7])
    assert_user_error(run("generate.py", *args), "truncated or corrupt")


@pytest.mark.slow
def test_smollm2_turbo4_prompt_cache(tmp_path, real_model):
    """SmolLM2, turbo4 cache: a restored prompt cache gives the original's next logits bit for
    bit, and generation through a prompt-cache file equals generation without it (the shapes
    are generate's own, so the compilations are shared)."""
    smol = real_model("smollm2-135m-instruct")
    spec = CacheSpec("turbo4", "turbo4")
    prompt = tqjax.api.encode_prompt(smol, "Name three colours of the rainbow.", chat=True,
                                     system="You are a terse assistant. " * 8)
    # the restored run prefills its last prompt token as one padded chunk from slot n - 1;
    # enough new tokens that the plain run's cache has those slots too, so both runs (and
    # the checks below) share one cache shape and its compilations
    n = len(prompt)
    slots = gen.padded_length(n - 1 + gen.PAD_MULTIPLE)
    new = slots - gen.PAD_MULTIPLE + 1 - n
    assert gen.padded_length(n + new) == slots
    plain = tqjax.generate(smol, prompt, max_new_tokens=new, cache=spec)
    path = tmp_path / "smol.tqkv"
    meta = smol.cache_meta(spec)
    pc.save_prompt_cache(path, filled(smol, spec, [prompt], slots), prompt, meta)
    restored, ids = pc.load_prompt_cache(path, meta, slots)
    assert ids == prompt

    def next_logits(cache):  # one more token at position n, prefilled as generate would
        tokens = np.zeros((1, gen.PAD_MULTIPLE), np.int32)
        tokens[0, 0] = 42
        logits, _ = gen.prefill(smol.params, smol.config, tokens, np.asarray([1]), cache,
                                np.asarray([n]))
        return np.asarray(logits)

    want = next_logits(filled(smol, spec, [prompt], slots))
    np.testing.assert_array_equal(next_logits(restored), want)
    reused = tqjax.generate(smol, prompt, max_new_tokens=new, cache=spec, prompt_cache=path)
    assert reused.cached_tokens == n - 1 and reused.token_ids == plain.token_ids


def test_context_shift_keeps_at_most_the_prompt(model):
    """n_keep past the prompt keeps the prompt (llama.cpp's clamp): it shifts as n_keep = -1
    does (it never shifted: half of nothing); a prompt that leaves nothing to drop when the
    context fills is refused before any work."""
    prompt = np.random.default_rng(3).integers(3, 256, 10).tolist()

    def run(keep, ctx=32):  # -> (ids, shifts) of the last step
        steps = gen.generate_tokens(model.params, model.config, [prompt], max_new_tokens=40,
                                    sampling=gen.SamplingParams(), eos_ids=(), ctx_size=ctx,
                                    context_shift_keep=keep)
        seqs = [s for s, _, _ in steps][-1]
        return seqs[0].ids, seqs[0].shifts

    whole, past = run(-1), run(1000)
    assert whole[1] >= 2 and len(whole[0]) == 40
    assert past == whole
    with pytest.raises(TqjaxError, match="keeping 10 of a 10-token prompt leaves nothing to "
                                         "drop in a context of 12"):
        run(-1, 12)
    ids, shifts = run(-1, 13)  # 13 - 1 - 10 = 2 tokens past the prompt: one dropped a shift
    assert len(ids) == 40 and shifts >= 10
