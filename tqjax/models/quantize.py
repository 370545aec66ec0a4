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
from collections.abc import Callable
from typing import Any

import jax
import jax.numpy as jnp
import numpy as np
from tqdm import tqdm

from tqjax.errors import TqjaxError
from tqjax.kv.cache import CacheSpec, make_cache
from tqjax.kv.rope import rope_cos_sin
from tqjax.models.config import ModelConfig
from tqjax.models.loading import Checkpoint
from tqjax.models.transformer import (
    LayerParams,
    Params,
    attention_heads,
    embed_tokens,
    forward,
    gated_activation,
    rms_norm,
)
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
    hessian_factor,
    linear,
    quantize_linear,
)

LINEARS = ("wq", "wk", "wv", "wo", "w_gate", "w_up", "w_down")
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
        if self.bpw is not None and not 2.0 < self.bpw <= 16.0:
            raise TqjaxError(f"bpw must be in (2, 16], got {self.bpw}")
        if not 0.0 <= self.damp < 1.0:
            raise TqjaxError(f"GPTQ dampening must be in [0, 1), got {self.damp}")
        self.base_format  # validates the group size  # noqa: B018

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


@functools.partial(jax.jit, donate_argnums=(0,))
def _add_gram(c: jax.Array, a: jax.Array) -> jax.Array:
    rows = a.reshape(-1, a.shape[-1]).astype(jnp.float32)
    return c + rows.T @ rows


def _gram(acts: list[jax.Array]) -> jax.Array:
    """Σ xᵀx over every row of every [..., K] activation -> f32 [K, K], one window at a time
    (one jitted sum over all of them would hold a product per window)."""
    c = jnp.zeros((acts[0].shape[-1],) * 2, jnp.float32)
    for a in acts:
        c = _add_gram(c, a)
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
              acts: list[jax.Array]) -> LayerParams:
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
        lp = stage(lp, i, ("wq", "wk", "wv"), hn)
        heads = [_heads(lp, config, h, inv_freq) for h in hn]
        lp = stage(lp, i, ("wo",), heads)
        x = add(x, heads, lp.wo)
        hn = [_norm(xi, lp.mlp_norm, eps) for xi in x]
        lp = stage(lp, i, ("w_gate", "w_up"), hn)
        # only the quantized gate/up: the compilation is keyed on those two formats, not on
        # every other field's (mixed: one per layer otherwise)
        mlp_in = lp.replace(**dict.fromkeys(("wq", "wk", "wv", "wo", "w_down")))
        gated = [_gated(mlp_in, h) for h in hn]
        lp = stage(lp, i, ("w_down",), gated)
        x = add(x, gated, lp.w_down)
        layers.append(lp)
        del lp, mlp_in, hn, heads, gated  # before the next layer is read
    params = params.replace(layers=layers)
    hidden = [_norm(xi, params.final_norm, eps) for xi in x]
    if head and params.lm_head is not None:
        params = params.replace(lm_head=quantize("lm_head", params.lm_head, _gram(hidden)))
    return params, hidden


# ---------------------------------------------------------------- Fisher information


@functools.partial(jax.jit, static_argnums=(2, 5))
def _fisher_window(linears: dict[str, jax.Array], params: Params, config: ModelConfig,
                   tokens: jax.Array, key: jax.Array, group: int) -> dict[str, jax.Array]:
    """Σ (∂ log p(y)/∂w)² over groups of `group` input rows for one window, labels y sampled
    from the model -> {path: f32 [ceil(K/group), N]}."""
    cache = make_cache(CacheSpec(), batch=1, slots=tokens.shape[1], num_layers=config.num_layers,
                       kv_heads=config.num_kv_heads, head_dim=config.head_dim)

    def log_likelihood(lin: dict[str, jax.Array]) -> jax.Array:
        logits, _ = forward(set_paths(params, lin), config, tokens, jnp.zeros(1, jnp.int32), cache)
        logp = jax.nn.log_softmax(logits[0], axis=-1)
        y = jax.random.categorical(key, jax.lax.stop_gradient(logp))
        return jnp.sum(jnp.take_along_axis(logp, y[:, None], axis=-1))

    grads = jax.grad(log_likelihood)(linears)
    return {p: group_sums(g.astype(jnp.float32) ** 2, group) for p, g in grads.items()}


def fisher_diagonal(params: Params, config: ModelConfig, paths: list[str], windows: np.ndarray,
                    group: int, seed: int = 0) -> dict[str, jax.Array]:
    """The diagonal Fisher of each linear's weights summed over groups of `group` input rows,
    f32 [ceil(K/group), N], averaged over calibration windows int32 [W, T]: one sampled label
    per position (labels drawn independently, so cross-position terms vanish in expectation)."""
    linears = {p: get_path(params, p) for p in paths}
    total = {p: jnp.zeros(group_sums(w, group).shape, jnp.float32) for p, w in linears.items()}
    for i, w in enumerate(windows):
        key = jax.random.PRNGKey(seed * 7919 + i)
        out = _fisher_window(linears, params, config, jnp.asarray(w, jnp.int32)[None], key, group)
        total = {p: total[p] + out[p] / len(windows) for p in paths}
    return total


# ---------------------------------------------------------------- quantizing a model


def weight_formats(params: Params, config: ModelConfig, spec: WeightSpec, paths: list[str],
                   windows: np.ndarray | None = None, progress: bool = False
                   ) -> dict[str, WeightFormat]:
    """The format of every quantized linear: the method's, or the "mixed" allocation over
    `candidate_formats` (the spec's group size, or all of `mixed.GROUPS`), each tensor's loss
    in each format measured by `format_losses`: Fisher-weighted with calibration windows
    int32 [W, T], relative without. An untied "lm_head" among `paths` gets `EMBEDDING_FORMAT`,
    and so does the embedding with `spec.quantize_embeddings`; both count in the mixed budget."""
    head = {"lm_head": EMBEDDING_FORMAT} if "lm_head" in paths else {}
    paths = [p for p in paths if p not in head]
    if spec.method != MIXED:
        return dict.fromkeys(paths, spec.base_format) | head
    groups = (spec.group_size,) if spec.group_size else GROUPS
    shapes = {p: tuple(get_path(params, p).shape) for p in paths}
    fixed = {p: (tuple(get_path(params, p).shape), f) for p, f in head.items()}
    if spec.quantize_embeddings:  # stored as embedᵀ [D, V]
        fixed["embed"] = (tuple(params.embed.shape[::-1]), EMBEDDING_FORMAT)
    check_budget(shapes, candidate_formats(groups), spec.bpw, fixed)  # before the measuring
    fisher: dict[str, jax.Array | None] = dict.fromkeys(paths)
    if windows is not None:  # shorter windows bound the memory of the backward pass (big vocab)
        pick = np.linspace(0, len(windows) - 1, min(len(windows), FISHER_WINDOWS)).astype(int)
        fisher |= fisher_diagonal(params, config, paths, windows[pick, :FISHER_TOKENS],
                                  FISHER_ROWS, spec.seed)
    losses = {p: format_losses(get_path(params, p), groups, fisher[p], spec.seed)
              for p in tqdm(paths, desc="measuring formats", unit="tensor", leave=False,
                            disable=None if progress else True)}
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


def quantize_params(params: Params | Checkpoint, config: ModelConfig, spec: WeightSpec,
                    calibration: np.ndarray | None = None, progress: bool = False) -> Params:
    """Params whose decoder linears (and, with `spec.quantize_embeddings`, the embedding and an
    untied head) are `QuantizedLinear`s per `spec`.

    params: dense params, or an opened `loading.Checkpoint`, which is then read as it is
    quantized (one decoder layer at a time; the embedding and head a block of columns at a
    time), so the load never holds the dense model (except for "mixed", whose Fisher
    information needs the whole model: it is read first).
    calibration: token windows int32 [W, T] (never the evaluation text; see
    `calibration_windows`). Without it every tensor is rounded to nearest on its own
    (data-free); with it, codes come from sequential GPTQ and "mixed" weighs errors by Fisher.
    """
    if isinstance(params, Checkpoint) and params.blocks:
        raise TqjaxError("a checkpoint opened with its GGUF blocks kept is not quantized again")
    if isinstance(params, Checkpoint) and spec.method == MIXED:
        params = params.params()
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
        formats = weight_formats(params, config, spec, paths)  # uniform: no weights read
    else:
        paths = linear_paths(params, spec.quantize_embeddings)
        formats = weight_formats(params, config, spec, paths, windows, progress)
    bar = tqdm(total=len(paths), desc=f"quantizing ({spec.method})", unit="tensor",
               disable=None if progress else True, leave=False)
    gram: list[Any] = [None]  # the Gram the cached factors belong to
    factors: dict[tuple[int, int], HessianFactor] = {}  # GPTQ factor of that Gram, per basis

    def quantize(path: str, w: jax.Array | Columns, hessian: jax.Array | None
                 ) -> QuantizedLinear:
        fmt = formats[path]
        factor = None
        if hessian is not None:
            if gram[0] is not hessian:
                gram[0] = hessian
                factors.clear()
            basis = (fmt.rotation_block, fmt.group_size(w.shape[0]))
            if basis not in factors:  # a uniform method needs one basis per Gram: reuse it
                factors[basis] = hessian_factor(hessian, fmt, spec.seed, spec.damp,
                                                consume=spec.method != MIXED)
            factor = factors[basis]
        bar.update()
        return quantize_linear(w, fmt, spec.seed, factor)

    if spec.quantize_embeddings:  # stored as embedᵀ [D, V]
        embed = params.embed if source else params.embed.T
        params = params.replace(embed=quantize_linear(embed, EMBEDDING_FORMAT, spec.seed))
    layer = params.layers.__getitem__ if source is None else source.layer  # dense layer i
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
    gram[0] = None  # the last Gram and its factors ([K, K] each) go before the head comes
    factors.clear()
    if isinstance(params.lm_head, Columns):  # an untied head left dense
        params = params.replace(lm_head=source.leaf("lm_head.weight"))
    return params
