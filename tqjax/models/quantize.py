"""Quantizing a whole model's linears: `WeightSpec`, `quantize_params` (the sequential GPTQ
pipeline and the mixed-precision allocation). Calibration text: `models/calibration.py`; bits
accounting: `quant/accounting.py`.

Every decoder linear (q/k/v/o, gate/up/down) becomes a `QuantizedLinear`; norms and biases stay
dense, and so do the token embedding and output head unless `quantize_embeddings` is set.
Data-free by default; with calibration token windows the codes are chosen by GPTQ, layer by
layer in order, each layer seeing the inputs produced by the already-quantized layers before it
(`run_sequential`), and the "mixed" allocator weighs rounding errors by the Fisher information.
"""

from __future__ import annotations

import dataclasses
import functools
from collections.abc import Callable, Iterable
from typing import Any

import jax
import jax.numpy as jnp
import numpy as np
from tqdm import tqdm

from tqjax.errors import TqjaxError, is_int, is_real
from tqjax.host import drop_programs, host_buffer
from tqjax.kv.cache import CacheSpec, make_cache
from tqjax.kv.rope import rope_cos_sin
from tqjax.models.config import ModelConfig
from tqjax.models.loading import Checkpoint
from tqjax.models.transformer import (
    LINEARS,
    LayerParams,
    Params,
    attention_heads,
    embed_tokens,
    gated_activation,
    layer_output,
    rms_norm,
)
from tqjax.quant import half
from tqjax.quant.mixed import (
    FISHER_ROWS,
    GROUPS,
    allocate,
    candidate_formats,
    check_budget,
    format_losses,
    group_sums,
)
from tqjax.quant.weights import (
    Columns,
    HessianFactor,
    QuantizedLinear,
    WeightFormat,
    gather_columns,
    hessian_factor,
    linear,
    quantize_linear,
)

# the decoder linears quantized together by sequential GPTQ: each stage's linears read the same
# input, so they share one Gram (`run_sequential`)
STAGES = (("wq", "wk", "wv"), ("wo",), ("w_gate", "w_up"), ("w_down",))
METHODS = {  # method -> format (with its default group)
    "tq8": WeightFormat("tq", 8, 64),
    "tq4": WeightFormat("tq", 4, 64),
    "tq3": WeightFormat("tq", 3, 64),
    "tq2": WeightFormat("tq", 2, 64),
    "int8": WeightFormat("sym", 8, 0),  # per-channel absmax (the baseline)
    "int8-rot": WeightFormat("sym", 8, 0, rotation=64),  # the same over 64-row Hadamard blocks
    "int4": WeightFormat("sym", 4, 32),  # Q4_0-like
    "int4-affine": WeightFormat("affine", 4, 32),  # Q4_1-like
}
MIXED = "mixed"
# The token embedding and the output head (tied or not) keep 8 bits, as GGUF files ship them
# (Q8_0 tables, Q6_K/Q8_0 heads): at 4 bits SmolLM2's tied table alone doubles the perplexity
# cost of tq4 (+14.9% vs +7.6% on Macbeth).
EMBEDDING_FORMAT = WeightFormat("tq", 8, 64)
FISHER_TOKENS = 256  # tokens of each calibration window used for the Fisher information
FISHER_WINDOWS = 32  # at most this many calibration windows (spread evenly) for Fisher
# quantizer programs (one per format and weight shape, ~9 MB each, resident while jax caches
# them) compiled before `quantize_params` drops them (`drop_programs`): "mixed" would keep ~60
KEPT_PROGRAMS = 8


@dataclasses.dataclass(frozen=True)
class WeightSpec:
    """What to quantize and how.

    method: one of METHODS or "mixed" (per-tensor "tq" bits and group meeting `bpw`).
    bpw: target average bits per weight of the quantized tensors, every stored byte counted
      (mixed only). group_size: input rows per scale (None: the method's default, "tq": 64;
      for mixed, the allocator picks one of `mixed.GROUPS` per tensor).
    quantize_embeddings: also quantize the token embedding (`EMBEDDING_FORMAT`, round to
      nearest, stored as embedᵀ so a tied head reads the same codes) and an untied output head
      (`EMBEDDING_FORMAT`, GPTQ when calibrated): fixed formats whose bits count in the mixed
      budget, so `bpw` is then the average over every quantized tensor.
    seed: rotation seed. damp: GPTQ relative dampening.
    """

    method: str = "tq4"
    bpw: float | None = None
    group_size: int | None = None
    quantize_embeddings: bool = False
    seed: int = 0
    damp: float = 0.01

    def __post_init__(self) -> None:
        if self.method not in (*METHODS, MIXED):
            raise TqjaxError(f"unknown weight method {self.method!r} "
                             f"(choose from: {', '.join((*METHODS, MIXED))})")
        if (self.method == MIXED) != (self.bpw is not None):
            raise TqjaxError("a bpw target goes with the mixed method, and mixed needs one")
        if self.bpw is not None and not (is_real(self.bpw) and 2.0 < self.bpw <= 16.0):
            raise TqjaxError(f"bpw must be a number in (2, 16], got {self.bpw!r}")
        if not 0.0 <= self.damp < 1.0:
            raise TqjaxError(f"GPTQ dampening must be in [0, 1), got {self.damp}")
        if not is_int(self.seed) or self.seed < 0:  # (numpy's generators take no negative seed)
            raise TqjaxError(f"the rotation seed must be an integer >= 0, got {self.seed!r}")
        self.base_format  # validates the group size  # noqa: B018
        if (self.seed and self.method != MIXED and not self.quantize_embeddings
                and not self.base_format.rotation_block):
            raise TqjaxError(f"{self.method} weights are not rotated: a rotation seed would "
                             f"change nothing (seed {self.seed})")

    @property
    def base_format(self) -> WeightFormat:
        """The format of a uniform method; for "mixed", its "tq" group at 4 bits."""
        fmt = METHODS.get(self.method, METHODS["tq4"])
        return fmt if self.group_size is None else dataclasses.replace(fmt, group=self.group_size)


# ---------------------------------------------------------------- naming and walking


def linear_paths(params: Params, quantize_head: bool = True) -> list[str]:
    """Names of the quantizable linears: "layers.{i}.{field}" and "lm_head" (if untied)."""
    return _linear_names(len(params.layers), quantize_head and params.lm_head is not None)


def _linear_names(num_layers: int, head: bool) -> list[str]:
    names = [f"layers.{i}.{f}" for i in range(num_layers) for f in LINEARS]
    return names + (["lm_head"] if head else [])


def get_path(params: Params, path: str) -> Any:
    """The leaf at a `linear_paths` name."""
    if path == "lm_head":
        return params.lm_head
    _, i, field = path.split(".")
    return getattr(params.layers[int(i)], field)


def set_paths(params: Params, values: dict[str, Any]) -> Params:
    """A copy of params with the given `linear_paths` leaves replaced."""
    layers = list(params.layers)
    for path, value in values.items():
        if path == "lm_head":
            params = params.replace(lm_head=value)
            continue
        _, i, field = path.split(".")
        layers[int(i)] = layers[int(i)].replace(**{field: value})
    return params.replace(layers=layers)


# ---------------------------------------------------------------- calibration capture


@functools.partial(jax.jit, static_argnums=(2,))
def _norm(x: jax.Array, weight: jax.Array, eps: float) -> jax.Array:
    return rms_norm(x, weight, eps)


@functools.partial(jax.jit, static_argnums=(1,))
def _heads(lp: LayerParams, config: ModelConfig, hn: jax.Array, inv_freq: jax.Array) -> jax.Array:
    """Normed x [B, T, D] -> the o_proj input [B, T, H*hd] (causal attention from position 0,
    dense cache)."""
    b, t, _ = hn.shape
    cos, sin = rope_cos_sin(jnp.arange(t)[None], inv_freq)
    cache = make_cache(CacheSpec(), batch=b, slots=t, num_layers=1,
                       kv_heads=config.num_kv_heads, head_dim=config.head_dim).layers[0]
    return attention_heads(lp, config, hn, cos[:, :, None], sin[:, :, None],
                           jnp.zeros(b, jnp.int32), cache)[0]


@jax.jit
def _add_linear(x: jax.Array, inputs: jax.Array, w: Any) -> jax.Array:
    return x + linear(inputs, w)


_gated = jax.jit(gated_activation)
_embed = jax.jit(embed_tokens)


def _gram(acts: Iterable[jax.Array]) -> np.ndarray:
    """Σ xᵀx over every row of every [..., K] activation -> f32 [K, K], a `host_buffer` summed
    in place by BLAS (syrk, one window at a time: `acts` may make each as it is asked for),
    which `hessian_factor(consume=True)` then factors in place: the Gram and its factor are
    one [K, K] buffer."""
    from scipy.linalg import blas

    c = None
    for a in acts:
        k = a.shape[-1]
        rows = np.asarray(a, np.float32).reshape(-1, k)  # [T, K]
        if c is None:
            c = host_buffer((k, k), np.float32)
            c[:] = 0
        # c.T (Fortran order) += rowsᵀ rows: the lower triangle in BLAS's terms, c's upper
        out = blas.ssyrk(1.0, rows.T, beta=1.0, c=c.T, trans=0, lower=1, overwrite_c=1)
        if not np.shares_memory(out, c):  # (BLAS worked on a copy)
            c.T[...] = out
    if c is None:
        raise TqjaxError("a Gram needs at least one activation")
    for a in range(0, k, 512):  # c's lower triangle from its upper, a block of rows at a time
        b = min(k, a + 512)
        c[a:b, :a] = c[:a, a:b].T
        c[a:b, a:b] = np.triu(c[a:b, a:b]) + np.triu(c[a:b, a:b], 1).T
    return c


Quantizer = Callable[[str, Any, jax.Array], Any]


def run_sequential(params: Params, config: ModelConfig, windows: np.ndarray, quantize: Quantizer,
                   head: bool, dense_layer: Callable[[int], LayerParams] | None = None
                   ) -> tuple[Params, list[jax.Array]]:
    """Replace linears in model order, each seeing inputs from the already-replaced ones.

    windows int32 [W, T] (calibration tokens, each window from position 0). For every linear,
    quantize(path, weight, H) returns its replacement, H = Σ x xᵀ f32 [in, in] over the inputs
    the layer gets in the partly quantized model (the blocks of
    `transformer.forward`, run in stages). `head` also replaces the untied output head.
    `dense_layer(i)`: layer i's dense params, read when reached (a checkpoint quantized as it
    is read; `params.layers` is then ignored), instead of `params.layers[i]`.
    Returns the new params and the final-normed hidden states (one [1, T, D] per window).
    """
    x = [_embed(params.embed, jnp.asarray(w, jnp.int32)[None]) for w in windows]
    inv_freq, eps = params.rope_inv_freq, config.rms_eps

    def stage(lp: LayerParams, i: int, fields: tuple[str, ...],
              acts: Iterable[jax.Array]) -> LayerParams:
        """Quantize `fields` from their inputs `acts` (one [1, T, in] per window)."""
        h = _gram(acts)
        return lp.replace(**{f: quantize(f"layers.{i}.{f}", getattr(lp, f), h) for f in fields})

    def add(xs: list[jax.Array], acts: list[jax.Array], w: Any) -> list[jax.Array]:
        return [_add_linear(xi, a, w) for xi, a in zip(xs, acts, strict=True)]

    layers = []
    for i in range(config.num_layers):
        # lp: layer i, each dense linear replaced (and its dense array dropped) in turn
        lp = params.layers[i] if dense_layer is None else dense_layer(i)
        hn = [_norm(xi, lp.attn_norm, eps) for xi in x]
        lp = stage(lp, i, STAGES[0], hn)
        heads = [_heads(lp, config, h, inv_freq) for h in hn]
        lp = stage(lp, i, STAGES[1], heads)
        x = add(x, heads, lp.wo)
        del heads
        hn = [_norm(xi, lp.mlp_norm, eps) for xi in x]
        lp = stage(lp, i, STAGES[2], hn)
        # only the quantized gate/up: the compilation is keyed on those two formats, not on
        # every other field's (mixed: one per layer otherwise)
        mlp_in = lp.replace(**dict.fromkeys(("wq", "wk", "wv", "wo", "w_down")))
        # the down projection's inputs ([T, intermediate] a window) made again for the
        # residual rather than all held beside its Gram, where the quantizing peaks
        lp = stage(lp, i, STAGES[3], (_gated(mlp_in, h) for h in hn))
        x = jax.block_until_ready([_add_linear(xi, _gated(mlp_in, h), lp.w_down)
                                   for xi, h in zip(x, hn, strict=True)])  # (temporaries gone)
        layers.append(lp)
        del lp, mlp_in, hn  # before the next layer is read
    params = params.replace(layers=layers)
    hidden = [_norm(xi, params.final_norm, eps) for xi in x]
    if head and params.lm_head is not None:
        params = params.replace(lm_head=quantize("lm_head", params.lm_head, _gram(hidden)))
    return params, hidden


# ---------------------------------------------------------------- Fisher information


HEAD_COLUMNS = 8192  # output-head columns (vocabulary entries) per block of the Fisher pass
# Read-ahead: jax dispatches work asynchronously, so a loop that reads a layer (or a block of
# the head) and hands it to a jitted function goes on reading while the work is queued, and
# the read weights stay resident until their work is done. Each loop below therefore waits for
# a layer's (a block's) results before it reads the next: Qwen2.5-Coder-0.5B's Fisher pass
# held up to 8 f32 layers at once (+440 MB; 2-core AMD EPYC) without the wait.
FISHER_SAVED_BYTES = 256 << 20  # layer inputs kept between the two sweeps, at most (about)


def table_columns(embed: jax.Array) -> Columns:
    """A dense embedding table [V, D] as the [D, V] `Columns` of embedᵀ, each block transposed
    as it is read (never a whole transposed copy)."""
    return Columns(tuple(embed.shape[::-1]), lambda a, b: embed[a:b].T.astype(jnp.float32))


def head_columns(params: Params) -> Columns:
    """The output head as [D, V] `Columns` (f32 blocks): an untied head (dense, or `Columns`
    of a checkpoint), or the tied embedding (dense [V, D] or quantized embedᵀ)."""
    head = params.lm_head
    if isinstance(head, Columns):
        return head
    if head is not None and not isinstance(head, QuantizedLinear):
        return Columns(tuple(head.shape), lambda a, b: head[:, a:b].astype(jnp.float32))
    if head is None and isinstance(params.embed, QuantizedLinear):
        embed = params.embed
        return Columns((embed.in_features, embed.out_features), lambda a, b: gather_columns(
            embed, jnp.arange(a, b)).T.astype(jnp.float32))
    if head is None and not isinstance(params.embed, (QuantizedLinear, Columns)):
        return table_columns(params.embed)
    raise TqjaxError("the Fisher pass needs a dense or 8-bit head")


def _layer(lp: LayerParams, config: ModelConfig, x: jax.Array, inv_freq: jax.Array) -> jax.Array:
    """One decoder layer on x [B, T, D] from position 0 (`transformer.forward`'s math)."""
    heads = _heads(lp, config, rms_norm(x, lp.attn_norm, config.rms_eps), inv_freq)
    return layer_output(lp, config, x, heads)


_layer_forward = jax.jit(_layer, static_argnums=(1,))


@functools.partial(jax.jit, static_argnums=(1, 5))
def _layer_fisher(lp: LayerParams, config: ModelConfig, x: jax.Array, g: jax.Array,
                  inv_freq: jax.Array, group: int) -> tuple[dict[str, jax.Array], jax.Array]:
    """Layer input x [1, T, D], cotangent g of its output -> ({field: (∂/∂w)² summed over
    groups of `group` input rows, f32 [ceil(K/group), N]}, the cotangent of x)."""
    def run(lin: dict[str, Any], x: jax.Array) -> jax.Array:
        return _layer(lp.replace(**lin), config, x, inv_freq)

    _, vjp = jax.vjp(run, {f: getattr(lp, f) for f in LINEARS}, x)
    grads, gx = vjp(g)
    return {f: group_sums(v.astype(jnp.float32) ** 2, group) for f, v in grads.items()}, gx


@jax.jit
def _head_block(hn: jax.Array, block: jax.Array, key: jax.Array, first: jax.Array,
                state: tuple[jax.Array, ...]) -> tuple[jax.Array, ...]:
    """One block of head columns [D, n] (vocabulary ids first..first + n) into the running
    (max, Σ exp, best Gumbel score, label) per token: a log-sum-exp and a Gumbel-max sample
    of the next-token distribution, one block at a time."""
    m, s, best, label = state
    logits = jnp.dot(hn, block.astype(hn.dtype), preferred_element_type=jnp.float32)  # [T, n]
    top = jnp.maximum(m, jnp.max(logits, axis=-1))
    s = s * jnp.exp(m - top) + jnp.sum(jnp.exp(logits - top[:, None]), axis=-1)
    z = logits + jax.random.gumbel(jax.random.fold_in(key, first), logits.shape)
    better = jnp.max(z, axis=-1) > best
    label = jnp.where(better, first + jnp.argmax(z, axis=-1), label)
    return top, s, jnp.where(better, jnp.max(z, axis=-1), best), label


@jax.jit
def _head_grad(hn: jax.Array, block: jax.Array, lse: jax.Array, label: jax.Array,
               first: jax.Array, g: jax.Array) -> jax.Array:
    """g [T, D] plus this block's part of ∂ log p(label)/∂hn = head[:, label] − E_p[head]."""
    logits = jnp.dot(hn, block.astype(hn.dtype), preferred_element_type=jnp.float32)
    ids = first + jnp.arange(block.shape[1])
    d = (ids[None, :] == label[:, None]).astype(jnp.float32) - jnp.exp(logits - lse[:, None])
    return g + d @ block.astype(jnp.float32).T


@functools.partial(jax.jit, static_argnums=(2,))
def _final_norm_vjp(x: jax.Array, weight: jax.Array, eps: float, g: jax.Array) -> jax.Array:
    return jax.vjp(lambda x: rms_norm(x, weight, eps), x)[1](g.astype(x.dtype))[0]


def _head_cotangents(params: Params, config: ModelConfig, head: Columns, xs: list[jax.Array],
                     keys: list[jax.Array]) -> list[jax.Array]:
    """Each window's last-layer output x [1, T, D] -> ∂ Σ_t log p(y_t)/∂x, labels y sampled from
    the model's own next-token distribution (Gumbel-max over `HEAD_COLUMNS` blocks, drawn with
    the window's key). The head is read a block at a time, twice for all the windows (a
    log-sum-exp and the labels, then the gradient); no [T, V] array is made."""
    hns = [_norm(x, params.final_norm, config.rms_eps)[0] for x in xs]  # [T, D] each
    t, (_, v) = hns[0].shape[0], head.shape
    states = [(jnp.full(t, -jnp.inf), jnp.zeros(t), jnp.full(t, -jnp.inf),
               jnp.zeros(t, jnp.int32))] * len(xs)
    for a in range(0, v, HEAD_COLUMNS):  # (each block waited for: see read-ahead)
        block = jnp.asarray(head.read(a, min(v, a + HEAD_COLUMNS)))
        states = jax.block_until_ready([_head_block(hn, block, key, jnp.int32(a), state)
                                        for hn, key, state in zip(hns, keys, states, strict=True)])
    lses = [state[0] + jnp.log(state[1]) for state in states]
    gs = [jnp.zeros(hn.shape, jnp.float32) for hn in hns]
    for a in range(0, v, HEAD_COLUMNS):
        block = jnp.asarray(head.read(a, min(v, a + HEAD_COLUMNS)))
        gs = jax.block_until_ready([_head_grad(hn, block, lse, state[3], jnp.int32(a), g)
                                    for hn, lse, state, g in zip(hns, lses, states, gs,
                                                                 strict=True)])
    return [_final_norm_vjp(x, params.final_norm, config.rms_eps, g[None])
            for x, g in zip(xs, gs, strict=True)]


def fisher_diagonal(params: Params, config: ModelConfig, paths: list[str], windows: np.ndarray,
                    group: int, seed: int = 0,
                    layer: Callable[[int], LayerParams] | None = None) -> dict[str, jax.Array]:
    """The diagonal Fisher of each decoder linear's weights summed over groups of `group` input
    rows, f32 [ceil(K/group), N], averaged over calibration windows int32 [W, T]: one label per
    position sampled from the model (independent draws, so cross-position terms vanish in
    expectation), the gradient of Σ log p(labels) per window.

    Backpropagation a layer at a time: a forward sweep keeps each layer's input, the head
    gives the cotangent, and a backward sweep reads each layer again (`layer(i)`, default
    `params.layers[i]`: a checkpoint is read, never held whole), in chunks of windows whose
    kept inputs fit `FISHER_SAVED_BYTES`."""
    layer = params.layers.__getitem__ if layer is None else layer
    head, inv_freq = head_columns(params), params.rope_inv_freq
    dtype = params.final_norm.dtype
    n, t = windows.shape
    per_window = config.num_layers * t * config.hidden_size * 4
    chunk = max(1, FISHER_SAVED_BYTES // per_window)
    total: dict[str, jax.Array] = {}
    for c in range(0, n, chunk):
        xs = [_embed(params.embed, jnp.asarray(w, jnp.int32)[None]).astype(dtype)
              for w in windows[c:c + chunk]]
        inputs = []  # [layer][window] inputs [1, T, D]
        for i in range(config.num_layers):
            lp = layer(i)
            inputs.append(xs)
            xs = jax.block_until_ready([_layer_forward(lp, config, x, inv_freq) for x in xs])
            del lp  # (its work done: see read-ahead)
        gs = _head_cotangents(params, config, head, xs,
                              [jax.random.PRNGKey(seed * 7919 + c + j) for j in range(len(xs))])
        del xs
        for i in reversed(range(config.num_layers)):
            lp = layer(i)
            for j, x in enumerate(inputs[i]):
                parts, gs[j] = _layer_fisher(lp, config, x, gs[j], inv_freq, group)
                for f, v in parts.items():
                    key = f"layers.{i}.{f}"
                    total[key] = total[key] + v / n if key in total else v / n
            jax.block_until_ready((gs, total))
            inputs[i] = None
            del lp  # (its work done: see read-ahead)
    return {p: total[p] for p in paths}


# ---------------------------------------------------------------- quantizing a model


def linear_shape(config: ModelConfig, field: str) -> tuple[int, int]:
    """The [in, out] shape of a decoder linear (a `LINEARS` field) of `config`."""
    d, f = config.hidden_size, config.intermediate_size
    q, kv = config.num_heads * config.head_dim, config.num_kv_heads * config.head_dim
    return {"wq": (d, q), "wk": (d, kv), "wv": (d, kv), "wo": (q, d), "w_gate": (d, f),
            "w_up": (d, f), "w_down": (f, d)}[field]


def weight_formats(params: Params, config: ModelConfig, spec: WeightSpec, paths: list[str],
                   windows: np.ndarray | None = None, progress: bool = False,
                   layer: Callable[[int], LayerParams] | None = None
                   ) -> dict[str, WeightFormat]:
    """The format of every quantized linear: the method's, or the "mixed" allocation over
    `candidate_formats` (the spec's group size, or all of `mixed.GROUPS`), each tensor's loss
    in each format measured by `format_losses`: Fisher-weighted with calibration windows
    int32 [W, T], relative without. An untied "lm_head" among `paths` gets `EMBEDDING_FORMAT`,
    and so does the embedding with `spec.quantize_embeddings`; both count in the mixed budget.
    `layer(i)`: the dense decoder layer i (default `params.layers[i]`; a checkpoint's reader),
    read a layer at a time by the Fisher pass and again by the measuring."""
    head = {"lm_head": EMBEDDING_FORMAT} if "lm_head" in paths else {}
    paths = [p for p in paths if p not in head]
    if spec.method != MIXED:
        return dict.fromkeys(paths, spec.base_format) | head
    layer = params.layers.__getitem__ if layer is None else layer
    groups = (spec.group_size,) if spec.group_size else GROUPS
    shapes = {p: linear_shape(config, p.rsplit(".", 1)[1]) for p in paths}
    table = (config.hidden_size, config.vocab_size)  # embedᵀ and the head, [D, V]
    fixed = dict.fromkeys(head, (table, EMBEDDING_FORMAT))
    if spec.quantize_embeddings:
        fixed["embed"] = (table, EMBEDDING_FORMAT)
    check_budget(shapes, candidate_formats(groups), spec.bpw, fixed)  # before the measuring
    fisher: dict[str, jax.Array | None] = dict.fromkeys(paths)
    if windows is not None:  # shorter windows bound the memory of the backward pass (big vocab)
        pick = np.linspace(0, len(windows) - 1, min(len(windows), FISHER_WINDOWS)).astype(int)
        fisher |= fisher_diagonal(params, config, paths, windows[pick, :FISHER_TOKENS],
                                  FISHER_ROWS, spec.seed, layer)
    losses = {}
    with tqdm(total=len(paths), desc="measuring formats", unit="tensor", leave=False,
              disable=None if progress else True) as bar:
        for i in range(config.num_layers):
            lp = layer(i)
            for f in LINEARS:
                if (p := f"layers.{i}.{f}") in shapes:
                    losses[p] = format_losses(getattr(lp, f), groups, fisher.pop(p), spec.seed)
                    bar.update()
            del lp
    return allocate(shapes, losses, spec.bpw, fixed) | head


def _check_windows(calibration: np.ndarray | None, config: ModelConfig) -> np.ndarray | None:
    if calibration is None:
        return None
    windows = np.asarray(calibration)
    if windows.ndim != 2 or windows.size == 0 or not np.issubdtype(windows.dtype, np.integer):
        raise TqjaxError(f"calibration must be integer token windows [W, T], got {windows.shape}")
    if windows.shape[1] > config.max_position:
        raise TqjaxError(f"calibration windows of {windows.shape[1]} tokens exceed the model's "
                         f"context {config.max_position}")
    if windows.min() < 0 or windows.max() >= config.vocab_size:
        raise TqjaxError(f"calibration token id out of range [0, {config.vocab_size})")
    return windows.astype(np.int32)


def _window_rows(table: Columns, windows: np.ndarray, seed: int
                 ) -> tuple[QuantizedLinear, np.ndarray]:
    """The embedding's rows for the tokens in calibration windows int32 [W, T], quantized to
    `EMBEDDING_FORMAT` (each row on its own, as in the whole table; the rotation's float order
    may differ in a few codes), and the windows renumbered into them.

    table: the embedding as embedᵀ [D, V], read a column (token) at a time.
    Returns (a QuantizedLinear [D, U] over the U distinct tokens, windows int32 [W, T] in [0, U)).
    """
    ids = np.unique(windows)
    rows = np.concatenate([table.read(int(i), int(i) + 1) for i in ids], axis=1)  # [D, U]
    return (quantize_linear(jnp.asarray(rows, jnp.float32), EMBEDDING_FORMAT, seed),
            np.searchsorted(ids, windows).astype(np.int32))


def quantize_params(params: Params | Checkpoint, config: ModelConfig, spec: WeightSpec,
                    calibration: np.ndarray | None = None, progress: bool = False) -> Params:
    """Params whose decoder linears (and, with `spec.quantize_embeddings`, the embedding and an
    untied head) are `QuantizedLinear`s per `spec`.

    params: dense params, or an opened `loading.Checkpoint`, which is then read as it is
    quantized (one decoder layer at a time; the embedding and head a block of columns at a
    time), so the load never holds the dense model ("mixed" reads each layer three times more
    first: `fisher_diagonal`'s two sweeps and the measuring). A quantized embedding table is
    quantized last (its calibration rows first: `_window_rows`), when nothing else is held.
    calibration: token windows int32 [W, T] (never the evaluation text; see
    `calibration_windows`). Without it every tensor is rounded to nearest on its own
    (data-free); with it, codes come from sequential GPTQ and "mixed" weighs errors by Fisher.
    Compiled programs are resident while jax caches them, so this drops its own
    (`host.drop_programs`: a caller's jitted functions stay compiled) after "mixed" has
    measured its formats, before the head, once the layers and head are done (so none stays
    resident beside the quantized model), after a quantized embedding table, and whenever more
    than `KEPT_PROGRAMS` formats and shapes have been quantized since.
    """
    if isinstance(params, Checkpoint) and params.blocks:
        raise TqjaxError("a checkpoint opened with its GGUF blocks kept is not quantized again")
    source = params if isinstance(params, Checkpoint) else None
    if source is None and any(isinstance(get_path(params, p), QuantizedLinear)
                              for p in linear_paths(params)):
        raise TqjaxError("these params are already quantized")
    windows = _check_windows(calibration, config)
    if source is not None:  # all but the decoder layers: placed, or read later by columns
        untied, embed = "lm_head.weight" in source.names, "model.embed_tokens.weight"
        params = Params(embed=source.columns(embed) if spec.quantize_embeddings
                        else source.leaf(embed), layers=[],
                        final_norm=source.leaf("model.norm.weight"),
                        lm_head=source.columns("lm_head.weight") if untied else None,
                        rope_inv_freq=source.rope_inv_freq())
        paths = _linear_names(config.num_layers, untied and spec.quantize_embeddings)
    else:
        paths = linear_paths(params, spec.quantize_embeddings)
    def with_table(params: Params, table: Columns) -> Params:
        """`params` with the embedding table quantized (its programs then dropped: they are
        not run again)."""
        params = params.replace(embed=quantize_linear(table, EMBEDDING_FORMAT, spec.seed))
        drop_programs()
        return params

    table = None  # with `spec.quantize_embeddings`: the embedding as embedᵀ [D, V] columns
    if spec.quantize_embeddings:
        table = params.embed if source else table_columns(params.embed)
        # The table is quantized last, when no Gram or layer input is held beside it; until
        # then the calibration windows embed through its rows for their own tokens, quantized
        # alike. First only where "mixed" measures a tied model: its Fisher pass reads the
        # whole quantized table as the head.
        if windows is not None and spec.method == MIXED and params.lm_head is None:
            params, table = with_table(params, table), None
        elif windows is not None:
            window_table, windows = _window_rows(table, windows, spec.seed)
            params = params.replace(embed=window_table)
    head = params.lm_head  # (a loaded model's, kept as it runs if it is not quantized)
    if source is None:  # a loaded model: half-precision linears read as dense [in, out]
        params = params.replace(lm_head=half.dense(params.lm_head))
        loaded = params.layers

        def layer(i: int) -> LayerParams:  # dense layer i
            return loaded[i].replace(**{f: half.dense(getattr(loaded[i], f)) for f in LINEARS})
    else:
        layer = source.layer
    formats = weight_formats(params, config, spec, paths, windows, progress, layer)
    if spec.method == MIXED:
        drop_programs()  # the measuring's programs (Fisher pass, one per format and shape)
    bar = tqdm(total=len(paths), desc=f"quantizing ({spec.method})", unit="tensor",
               disable=None if progress else True, leave=False)
    gram: list[Any] = [None]  # the Gram the cached factors belong to
    factors: dict[tuple[int, int], HessianFactor] = {}  # GPTQ factor of that Gram, per basis
    programs: set[tuple] = set()  # (format, shape) quantized since jax's caches were cleared

    def basis(fmt: WeightFormat, k: int) -> tuple[int, int]:
        return fmt.rotation_block, fmt.group_size(k)

    def sharing(path: str) -> list[WeightFormat]:
        """Formats of the linears quantized after `path` from the same Gram (its stage's)."""
        prefix, _, field = path.rpartition(".")
        stage = next((s for s in STAGES if field in s), (field,))
        return [formats[f"{prefix}.{f}"] for f in stage[stage.index(field) + 1:]]

    def quantize(path: str, w: jax.Array | Columns, hessian: jax.Array | None
                 ) -> QuantizedLinear:
        fmt, k = formats[path], w.shape[0]
        new = (fmt, w.shape) not in programs
        if path == "lm_head" or (new and len(programs) >= KEPT_PROGRAMS):  # (the head comes
            drop_programs()  # last: no layer's program runs again)
            programs.clear()
        programs.add((fmt, w.shape))
        factor = None
        if hessian is not None:
            if gram[0] is not hessian:
                gram[0] = hessian
                factors.clear()
            b = basis(fmt, k)
            if b not in factors:  # the Gram is factored in place by the last basis it needs
                later = {basis(f, k) for f in sharing(path)} - factors.keys() - {b}
                factors[b] = hessian_factor(hessian, fmt, spec.seed, spec.damp,
                                            consume=not later)
            factor = factors[b]
        bar.update()
        q = quantize_linear(w, fmt, spec.seed, factor)
        if not sharing(path):  # its stage's last linear: the Gram and its factors go now, not
            gram[0] = None  # while the next layer is read ([K, K] f32 each: 90 MB for Qwen
            factors.clear()  # 0.5B's down projection)
        return q

    with bar:
        if windows is None:  # data-free: each tensor on its own, one layer at a time
            layers = []
            for i in range(config.num_layers):
                lp = layer(i)
                layers.append(lp.replace(**{f: quantize(f"layers.{i}.{f}", getattr(lp, f), None)
                                            for f in LINEARS}))
                del lp  # before the next layer is read
            params = params.replace(layers=layers)
            if "lm_head" in formats:
                params = params.replace(lm_head=quantize("lm_head", params.lm_head, None))
        else:
            params, _ = run_sequential(params, config, windows, quantize, "lm_head" in formats,
                                       layer)
    drop_programs()  # no program the quantizing compiled runs again (the head's included)
    if table is not None:
        params = with_table(params, table)
    if isinstance(params.lm_head, Columns):  # an untied head left dense
        params = params.replace(lm_head=source.leaf("lm_head.weight", runtime=True))
    elif "lm_head" not in formats:
        params = params.replace(lm_head=head)
    return params
