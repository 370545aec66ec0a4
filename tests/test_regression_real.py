"""Regression bounds on the real models' numbers: the KV cache's and the quantized weights'
ΔPPL and KL on a short Hamlet text, each held at its measured value plus a stated margin, so a
change that costs quality fails here instead of showing up later in a results table.

Measured 2026-12-02 at commit c2e39e1 with `python -m pytest -s -q -m slow
tests/test_regression_real.py` (each test prints its figures; the whole file took 636 s of CPU
time under heavy shared load: KV SmolLM2 ~100 s, KV Qwen2.5-Coder ~135 s plus its load,
tq4 ~135 s, mixed ~180 s; peak RSS 6.4 GB; a ragged-batch SmolLM2 case cost ~80 s more and
was left to the tiny model in tests/test_kv.py). The numbers are deterministic on
one machine (same code, same XLA CPU program); the margins allow for other CPUs' float
summation order and for small changes in code that should not move quality:
- KL: within ±25% of the measured value (the lower bound catches a cache or a quantizer that
  silently stopped compressing, which would read as KL ≈ 0);
- ΔPPL: at most the measured value + 25% of its size + 0.1 percentage points (ΔPPL on 511
  tokens moves more than KL with the luck of the rounding, see README).
"""

import dataclasses

import numpy as np
import pytest

import tqjax
from tqjax.eval import sweep
from tqjax.fetch import corpus_text
from tqjax.models.calibration import calibration_corpus, calibration_windows
from tqjax.models.quantize import WeightSpec, quantize_params

pytestmark = pytest.mark.slow

SMOL, QWEN = "smollm2-135m-instruct", "qwen2.5-coder-0.5b-instruct"
TEXT, TOKENS, CTX = "shakespeare:hamlet", 512, 512  # one window of 512 tokens (511 predicted)
# Weights: GPTQ on 2 windows of 256 tokens of the default calibration corpus (the on-the-fly
# default is 4 of 512; halved so the file stays within its time budget), rotation seed 0.
CAL_WINDOWS, CAL_LENGTH, SEED = 2, 256, 0

# (model, run) -> (ΔPPL %, KL nats/token) measured against the f32 cache / unquantized model
MEASURED = {
    (SMOL, "turbo4"): (-0.2750, 0.003304),  # ± 0.38 s.e.
    (SMOL, "turbo4/turbo3"): (+0.8161, 0.007685),  # ± 0.62
    (QWEN, "turbo4"): (+0.2329, 0.002719),  # ± 0.40
    (QWEN, "turbo4/turbo3"): (+0.4397, 0.004460),  # ± 0.60
    (SMOL, "tq4"): (+30.5407, 0.213679),  # ± 4.8
    (SMOL, "mixed-4.25"): (+40.8678, 0.267388),  # ± 6.6 (worse than tq4 on 2x256 tokens of
    # calibration: the Fisher-weighted allocation needs more; README's 32 windows: KL 0.091)
}
KL_MARGIN, DPPL_MARGIN, DPPL_FLOOR = 0.25, 0.25, 0.1


def check(model_name: str, run: str, res) -> None:
    dppl, kl = 100 * float(np.expm1(res.nll_delta)), res.kl
    print(f"\n{model_name} {run}: ΔPPL {dppl:+.4f}% ± {res.dppl_se_pct:.4f}, KL {kl:.6f}, "
          f"top-1 {res.top1:.4f}")
    want_dppl, want_kl = MEASURED[model_name, run]
    assert (1 - KL_MARGIN) * want_kl <= kl <= (1 + KL_MARGIN) * want_kl, (kl, want_kl)
    assert dppl <= want_dppl + DPPL_MARGIN * abs(want_dppl) + DPPL_FLOOR, (dppl, want_dppl)


@pytest.fixture(scope="module", params=[SMOL, QWEN])
def model(request, real_model):
    return real_model(request.param)


@pytest.fixture(scope="module")
def smol(real_model):
    return real_model(SMOL)


def hamlet(model) -> list[int]:
    return model.tokenizer.encode(corpus_text(TEXT), add_bos=False)[:TOKENS]


def test_kv_cache_quality(model):
    """turbo4 and turbo4/turbo3 (the default robust caches) against an f32 cache."""
    name = next(n for n in (SMOL, QWEN) if n in model.source)
    caches = {"turbo4": tqjax.CacheSpec("turbo4", "turbo4"),
              "turbo4/turbo3": tqjax.CacheSpec("turbo4", "turbo3")}
    runs = {"f32": (model, tqjax.CacheSpec())} | {r: (model, c) for r, c in caches.items()}
    res = sweep(hamlet(model), CTX, runs, reference="f32")
    for run in caches:
        check(name, run, res[run])


@pytest.mark.parametrize("run,spec", [("tq4", WeightSpec("tq4", seed=SEED)),
                                      ("mixed-4.25", WeightSpec("mixed", bpw=4.25, seed=SEED))])
@pytest.mark.usefixtures("keep_quantizer_programs")
def test_weight_quantization_quality(smol, run, spec):
    """tq4 and mixed 4.25 bpw weights (GPTQ) against the unquantized model (the GGUF file's
    weights dequantized to f32), both with an f32 cache. SmolLM2 only: tq4 here costs ~135 s
    of CPU on its 135M parameters; Qwen2.5-Coder-0.5B has 3.7x as many (~8 min, estimated,
    not measured), beyond this file's budget."""
    windows = calibration_windows(smol.tokenizer, calibration_corpus(), CAL_WINDOWS, CAL_LENGTH)
    quantized = dataclasses.replace(smol, params=quantize_params(smol.params, smol.config, spec,
                                                                 windows))
    res = sweep(hamlet(smol), CTX, {"f32": (smol, tqjax.CacheSpec()),
                                    run: (quantized, tqjax.CacheSpec())}, reference="f32")
    check(SMOL, run, res[run])
