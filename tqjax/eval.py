"""Perplexity over non-overlapping windows, and agreement with a reference configuration."""

from __future__ import annotations

import dataclasses
import functools

import jax
import jax.numpy as jnp
import numpy as np

from tqjax.api import Model
from tqjax.decode.generate import new_cache, token_ids
from tqjax.errors import TqjaxError
from tqjax.kv.cache import CacheSpec, KVCache, as_cache_spec
from tqjax.models.config import ModelConfig
from tqjax.models.transformer import Params, forward


@dataclasses.dataclass
class PerplexityResult:
    """ppl = exp(mean NLL) over every predicted token; kl/top1 only against a reference."""

    ppl: float
    nll: float
    tokens: int  # predicted tokens: windows * (ctx - 1)
    windows: int
    kl: float | None = None  # mean KL(reference || model), nats per token
    top1: float | None = None  # fraction of positions whose argmax agrees with the reference
    nll_delta: float | None = None  # mean per-token NLL minus the reference's, nats
    dnll_se: float | None = None  # its standard error (paired, tokens taken as independent)

    @property
    def dppl_se_pct(self) -> float | None:
        """One standard error of ΔPPL against the reference, in percent of the reference PPL."""
        if self.nll_delta is None or self.dnll_se is None:
            return None
        return 100 * float(np.exp(self.nll_delta)) * self.dnll_se


@functools.partial(jax.jit, static_argnums=(1,))
def window_logprobs(params: Params, config: ModelConfig, tokens: jax.Array,
                    cache: KVCache) -> tuple[jax.Array, jax.Array]:
    """tokens int32 [1, T] -> (log-probs f32 [T-1, V] predicting tokens 1..T-1, NLL [T-1])."""
    logits, _ = forward(params, config, tokens, jnp.zeros(1, jnp.int32), cache)
    logp = jax.nn.log_softmax(logits[0, :-1], axis=-1)
    nll = -jnp.take_along_axis(logp, tokens[0, 1:, None], axis=-1)[:, 0]
    return logp, nll


@jax.jit
def _compare(ref_logp: jax.Array, logp: jax.Array) -> tuple[jax.Array, jax.Array]:
    kl = jnp.sum(jnp.exp(ref_logp) * (ref_logp - logp), axis=-1)
    agree = jnp.argmax(ref_logp, axis=-1) == jnp.argmax(logp, axis=-1)
    return jnp.sum(kl), jnp.sum(agree)


Run = tuple[Model, CacheSpec]


def _check_windows(model: Model, n_ids: int, ctx: int) -> int:
    if ctx < 2:
        raise TqjaxError(f"ctx must be >= 2, got {ctx}")
    if ctx > model.config.max_position:
        raise TqjaxError(f"ctx {ctx} exceeds the model's context {model.config.max_position}")
    if n_ids < ctx:
        raise TqjaxError(f"need at least {ctx} tokens for one window, got {n_ids}")
    return n_ids // ctx


def sweep(ids: list[int] | np.ndarray, ctx: int, runs: dict[str, Run],
          reference: str | None = None) -> dict[str, PerplexityResult]:
    """Perplexity of several (model, cache) runs on the same windows of `ids`.

    With `reference` (a key of `runs`), every run also gets KL(reference || run), top-1
    agreement and the paired NLL difference with its standard error; the reference's log-probs
    are computed once per window.
    """
    ids = token_ids(ids, min(m.config.vocab_size for m, _ in runs.values())).astype(np.int32)
    windows = min(_check_windows(m, len(ids), ctx) for m, _ in runs.values())
    order = sorted(runs, key=lambda name: name != reference)  # reference first
    nll = dict.fromkeys(runs, 0.0)
    kl, agree = dict.fromkeys(runs, 0.0), dict.fromkeys(runs, 0)
    diffs: dict[str, list[np.ndarray]] = {name: [] for name in runs}
    for w in range(windows):
        tokens = jnp.asarray(ids[None, w * ctx:(w + 1) * ctx])
        ref_logp = None
        for name in order:
            model, spec = runs[name]
            cache = new_cache(model.params, model.config, spec, 1, ctx, model.calibration(spec))
            logp, window_nll = window_logprobs(model.params, model.config, tokens, cache)
            nll[name] += float(jnp.sum(window_nll))
            if name == reference:
                ref_logp, ref_nll = logp, np.asarray(window_nll)
            elif ref_logp is not None:
                k, a = _compare(ref_logp, logp)
                kl[name], agree[name] = kl[name] + float(k), agree[name] + int(a)
                diffs[name].append(np.asarray(window_nll) - ref_nll)
    n = windows * (ctx - 1)
    if reference is not None:  # the reference agrees with itself
        agree[reference] = n
        diffs[reference] = [np.zeros(n)]

    def paired(name: str) -> dict:
        if reference is None:
            return {}
        d = np.concatenate(diffs[name]).astype(np.float64)
        return {"kl": kl[name] / n, "top1": agree[name] / n, "nll_delta": float(d.mean()),
                "dnll_se": float(d.std(ddof=1) / np.sqrt(d.size)) if d.size > 1 else 0.0}

    return {name: PerplexityResult(ppl=float(np.exp(nll[name] / n)), nll=nll[name] / n, tokens=n,
                                   windows=windows, **paired(name)) for name in runs}


def dppl_text(row: dict) -> str:
    """A result row's ΔPPL as "+0.36% ± 0.12" (the ± only where the row has `dppl_se_pct`)."""
    se = row.get("dppl_se_pct")
    return f"{row['dppl_pct']:+.2f}%" + ("" if se is None else f" ± {se:.2f}")


def perplexity(model: Model, ids: list[int] | np.ndarray, ctx: int,
               cache: CacheSpec | str = CacheSpec(), reference: CacheSpec | str | None = None,
               reference_model: Model | None = None) -> PerplexityResult:
    """Perplexity of `ids` in independent windows of `ctx` tokens (a partial tail is dropped).

    With `reference` (a cache spec) and/or `reference_model` (e.g. unquantized weights), also
    report KL divergence and top-1 agreement of next-token distributions against it.
    """
    runs: dict[str, Run] = {"run": (model, as_cache_spec(cache))}
    if reference is not None or reference_model is not None:
        runs["reference"] = (reference_model or model, as_cache_spec(reference or CacheSpec()))
        return sweep(ids, ctx, runs, reference="reference")["run"]
    return sweep(ids, ctx, runs)["run"]
