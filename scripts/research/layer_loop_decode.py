"""Prototype: the real model's forward as one compiled layer body (a loop over layers), against
the product's unrolled forward: decode speed, resident program memory and peak RSS.

    python scripts/research/layer_loop_decode.py MODEL KV CONTEXT --form product|loop
        [--prompt-tokens 512] [--decode-tokens 32]

`loop`: `fori_loop` over layers; each layer's weights are picked by `lax.switch` (every branch
reads its own arrays, any weight format), the cache is the product's `LayerCache` with every
leaf stacked over layers; the body takes its layer's cache out (a dynamic slice: one copy of
that layer per step), runs the product's `attend`, and writes it back. Prefill and decode
both use the form. `product`: `tqjax.models.transformer.forward`. Until 8ad82df the product
ran its layers unrolled on a per-layer cache list (the archived runs' `unrolled`, and
`loop-list`: this loop on that list, stacked and split inside each step); since then it runs
this loop itself on a stacked cache, reading each layer's slots in place (no copy).
Prints one JSON line: decode tok/s (median of the steps after the first), the RSS the
compiled programs keep, peak RSS (VmHWM) and the greedy tokens (to check the forms agree).
Research only: the product path is `tqjax.models.transformer`.
"""

from __future__ import annotations

import argparse
import functools
import json
import time

import jax
import jax.numpy as jnp
import numpy as np

# a sibling script: run as `python scripts/research/...`, its folder is on sys.path
from program_memory import trimmed_rss

import tqjax
from tqjax.commands.bench import proc_status_bytes
from tqjax.decode.generate import new_cache
from tqjax.kv import cache as kvc
from tqjax.kv.cache import parse_kv
from tqjax.kv.rope import apply_rope, rope_cos_sin
from tqjax.models.config import ModelConfig
from tqjax.models.transformer import Params, embed_tokens, forward, gated_activation, rms_norm
from tqjax.quant import weights as qw


def forward_loop(params: Params, config: ModelConfig, tokens: jax.Array, start: jax.Array,
                 stacked: kvc.LayerCache, out_index: jax.Array
                 ) -> tuple[jax.Array, kvc.LayerCache]:
    """`transformer.forward` (no qkv bias / qk norm) with one layer body: tokens int32 [B, T],
    start int32 [B], stacked = every layer's LayerCache leaves stacked on a leading axis ->
    (logits f32 [B, V] at out_index, the updated stack)."""
    assert not config.qkv_bias and not config.qk_norm, "prototype: Llama-style layers only"
    b, t = tokens.shape
    hd = config.head_dim
    x = embed_tokens(params.embed, tokens).astype(params.final_norm.dtype)
    positions = start[:, None] + jnp.arange(t)[None, :]
    cos, sin = rope_cos_sin(positions, params.rope_inv_freq)
    cos, sin = cos[:, :, None, :], sin[:, :, None, :]

    def projections(lp):  # noqa: ANN001, ANN202
        def run(x: jax.Array) -> tuple[jax.Array, ...]:
            h = rms_norm(x, lp.attn_norm, config.rms_eps)
            return qw.linear(h, lp.wq), qw.linear(h, lp.wk), qw.linear(h, lp.wv)
        return run

    def output(lp):  # noqa: ANN001, ANN202
        def run(x: jax.Array, heads: jax.Array) -> jax.Array:
            x = x + qw.linear(heads, lp.wo)
            return x + qw.linear(gated_activation(lp, rms_norm(x, lp.mlp_norm, config.rms_eps)),
                                 lp.w_down)
        return run

    projs = [projections(lp) for lp in params.layers]
    outs = [output(lp) for lp in params.layers]

    def layer(i: jax.Array, carry: tuple[jax.Array, kvc.LayerCache]
              ) -> tuple[jax.Array, kvc.LayerCache]:
        x, stack = carry
        q, k, v = jax.lax.switch(i, projs, x)
        q = apply_rope(q.reshape(b, t, config.num_heads, hd), cos, sin)
        k = apply_rope(k.reshape(b, t, config.num_kv_heads, hd), cos, sin)
        v = v.reshape(b, t, config.num_kv_heads, hd)
        lc = jax.tree.map(lambda a: jax.lax.dynamic_index_in_dim(a, i, keepdims=False), stack)
        heads, lc = kvc.attend(lc, q, k, v, start)
        stack = jax.tree.map(lambda s, a: jax.lax.dynamic_update_index_in_dim(s, a, i, 0),
                             stack, lc)
        return jax.lax.switch(i, outs, x, heads.reshape(b, t, -1)), stack

    x, stacked = jax.lax.fori_loop(0, len(params.layers), layer, (x, stacked))
    x = jnp.take_along_axis(x, out_index[:, None, None], axis=1)[:, 0]
    x = rms_norm(x, params.final_norm, config.rms_eps)
    head = params.embed if params.lm_head is None else params.lm_head
    if head is params.embed and not isinstance(head, qw.QuantizedLinear):
        logits = jnp.einsum("...d,vd->...v", x, head.astype(x.dtype),
                            preferred_element_type=jnp.float32)
    else:
        logits = qw.linear(x, head).astype(jnp.float32)
    return logits, stacked


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("model")
    p.add_argument("kv")
    p.add_argument("context", type=int)
    p.add_argument("--form", choices=("product", "loop"), required=True)
    p.add_argument("--prompt-tokens", type=int, default=512)
    p.add_argument("--decode-tokens", type=int, default=32)
    a = p.parse_args()
    m = tqjax.load(a.model)
    cfg = m.config
    spec = tqjax.CacheSpec(*parse_kv(a.kv))
    cache = new_cache(m.params, cfg, spec, 1, a.context + a.decode_tokens + 8,
                      m.calibration(spec))
    if a.form == "loop":
        (cache,) = cache.groups  # one group: every layer alike, leaves stacked [L, ...]

    run = forward_loop if a.form == "loop" else (
        lambda params, config, tokens, start, cache, out_index: forward(
            params, config, tokens, start, cache, out_index=out_index))

    @functools.partial(jax.jit, donate_argnums=4)
    def step(params, tokens, start, out_index, cache):  # noqa: ANN001, ANN202
        return run(params, cfg, tokens, start, cache, out_index)

    rng = np.random.default_rng(0)
    prompt = jnp.asarray(rng.integers(0, cfg.vocab_size, (1, a.prompt_tokens), np.int32))
    base = trimmed_rss()
    logits, cache = step(m.params, prompt, jnp.zeros(1, jnp.int32),
                         jnp.asarray([a.prompt_tokens - 1], jnp.int32), cache)
    tok = jnp.argmax(logits, -1).astype(jnp.int32)
    tokens, times = [int(tok[0])], []
    for i in range(a.decode_tokens):
        t0 = time.perf_counter()
        logits, cache = step(m.params, tok[:, None], jnp.asarray([a.context + i], jnp.int32),
                             jnp.zeros(1, jnp.int32), cache)
        tok = jnp.argmax(logits, -1).astype(jnp.int32)
        tokens.append(int(tok[0]))
        times.append(time.perf_counter() - t0)
    programs = trimmed_rss() - base
    print(json.dumps({"model": a.model, "kv": a.kv, "context": a.context, "form": a.form,
                      "decode_tok_s": round(1 / float(np.median(times[1:])), 2),
                      "first_step_s": round(times[0], 2),
                      "programs_and_temps_mb": round(programs, 1),
                      "peak_rss_mb": round(proc_status_bytes("VmHWM") / 1e6, 1),
                      "tokens": tokens}))


if __name__ == "__main__":
    main()
