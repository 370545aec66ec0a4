"""Memory planner: the longest context (or the largest batch) that fits a memory budget, for
every weights × KV-cache preset, from exact byte counts.

A run's peak resident memory is modelled as

    peak = params + kv(batch, slots) + runtime(batch)

- params: the bytes of the parameter pytree exactly as the loaders store it, from the
  checkpoint's tensor table (nothing is read): dense arrays in f32/bf16, GGUF blocks as the file
  has them (`weights="gguf"`, norms in f32), and the quantizers' packed shapes for int8 / tq4
  (`jax.eval_shape` of `quantize_linear`). `mixed-4.25` counts its budget: the allocator keeps the
  quantized linears' stored bits (codes, scales, offsets) at or under 4.25 per weight.
- kv: `batch · slots · bytes_per_token + constants` of a real (tiny) cache of that format
  (`tqjax.kv.cache.bytes_per_token` / `constant_bytes`), slots rounded up the way the runtime
  allocates them (whole 512-token prefill chunks).
- runtime: the working set of the runtime, MEASURED (`RUNTIME`, or `RUNTIME_MLIR_EMITTERS` where
  XLA runs its MLIR fusion emitters, see `tqjax.xla`): the JAX/Python base with
  compiled executables, plus terms for the logits and the prefill activations, and for the
  turbo caches their calibration pass (by weights preset).
A preset fits when peak · (1 + `MARGIN`) is within the budget. The constants
  were fitted by `python scripts/plan_check.py --fit` (peak RSS of `scripts/bench.py`
  subprocesses minus their exact params and cache bytes); see `results/current/plan/`.

With `devices > 1` (tensor parallel, `tqjax.sharding`'s rules) the KV heads are split when
the device count divides them and replicated otherwise, the params are taken as split evenly
(an estimate: `tqjax.sharding.device_bytes` counts a loaded sharded model exactly, replicated
norms and undivided weights included) and every device pays the runtime.

Public API: `parse_bytes`, `plan(...) -> Plan`, `param_bytes`, `kv_bytes`, `cache_terms`,
`predict_peak`.
"""

from __future__ import annotations

import dataclasses
import math
import re
from collections.abc import Callable
from pathlib import Path

import jax
import jax.numpy as jnp
import numpy as np

from tqjax import fetch, xla
from tqjax.decode.generate import PAD_MULTIPLE, PREFILL_CHUNK, padded_length
from tqjax.errors import TqjaxError
from tqjax.kv.cache import (
    CacheSpec,
    Calibration,
    bytes_per_token,
    constant_bytes,
    make_cache,
    parse_kv,
)
from tqjax.models import checkpoint, loading, orbax_checkpoint
from tqjax.models.config import ModelConfig, rope_inv_freq
from tqjax.models.quantize import LINEARS, METHODS
from tqjax.quant import ggml
from tqjax.quant.weights import format_lut, quantize_linear
from tqjax.sharding import check_tp

WEIGHT_PRESETS = ("f32", "bf16", "int8", "tq4", "mixed-4.25", "gguf")
KV_PRESETS = ("f32", "bf16", "q8", "turbo4", "turbo4/turbo3", "turbo3")
MIXED_BPW = 4.25


@dataclasses.dataclass(frozen=True)
class Runtime:
    """Measured working set of the runtime beyond params and cache, in bytes:
    base + per_logit · batch · vocab + per_activation · chunk · hidden
    + max(row_activation[kind], per_activation) · (batch - 1) · chunk · hidden, where chunk
    is the prefill chunk (min(prompt, 512) tokens) and kind "turbo" or "dense" (the keys'
    store), + calibrated[weights] · vocab with a turbo cache."""

    base: float
    per_logit: float
    per_activation: float
    command: str
    # each row past the first (the fits run one): the prefill chunk's temporaries per row in
    # XLA's buffer plan, bytes per (chunk token · hidden unit), by the keys' store; measured by
    # `python scripts/research/prefill_temps.py` (SmolLM2 and Qwen2.5-Coder-0.5B alike: dense
    # 45.0-46.0, turbo 141.0-142.1)
    row_activation: dict[str, float] = dataclasses.field(
        default_factory=lambda: {"dense": 46.0, "turbo": 142.1})
    # turbo caches: their calibration pass and larger decode step, bytes per vocabulary entry
    # by weights preset (a preset not measured takes the largest)
    calibrated: dict[str, float] = dataclasses.field(default_factory=dict)

    def turbo(self, weights: str, vocab: int) -> float:
        """The turbo caches' term for a weights preset and a vocabulary size, bytes."""
        return vocab * self.calibrated.get(weights, max(self.calibrated.values(), default=0.0))


# Measured: `python scripts/plan_check.py --fit` (results/current/plan/fit.json, 6fb3d2f):
# least squares over bench.py peak RSS (VmHWM) minus exact params and cache, SmolLM2 and
# Qwen2.5-Coder-0.5B, f32 weights and cache, prompts of 58 and 1018 tokens, batch 1; largest
# misfit 13 MB (refitted at stop 46: base 423 -> 425 MB, per_activation 27.9 -> 20.8). The
# vocabulary term is not measurable at batch 1 (its fitted coefficient was negative): 0.
# bf16 and GGUF-block weights need nothing beyond this fit since stop 46 (their dots read the
# stored bytes, their layers are stacked): the same runs with them fall -102 to +28 MB from it.
# Before, XLA:CPU converted bf16 weights to f32 before each dot (a tied 151936 x 896 head: a
# 545 MB temporary) and the planner added 1.14 x the f32 weights' bytes to both.
# Turbo caches: their calibration pass (`tqjax.decode.calibrate`) and their larger compiled
# decode step add, beyond this fit (1018-token prompt, 1024 slots): SmolLM2 (vocabulary 49152)
# f32 74 and 89 MB (turbo4, turbo4/turbo3), bf16 23, GGUF blocks 113; Qwen2.5-Coder-0.5B
# (151936) with turbo3 f32 182, bf16 213, GGUF blocks 295. Not per layer (SmolLM2 has more);
# taken per vocabulary entry, the larger of the two models' per preset, so that it bounds both
# (a constant, Qwen's, over-predicted SmolLM2's runs by up to 190 MB).
RUNTIME = Runtime(base=424_957_340.0, per_logit=0.0, per_activation=20.77,
                  command="python scripts/plan_check.py --fit",
                  calibrated={"f32": 1818.8, "bf16": 1404.0, "gguf": 2288.2})
# The same fit with XLA:CPU's MLIR fusion emitters (XLA's own default: a jaxlib tqjax.xla has
# not been measured on, or --xla_cpu_use_fusion_emitters=true), before the refits of stops 40
# and 41; its turbo term the largest measured with them (stop 38: SmolLM2 turbo4/turbo3,
# 718 MB over its 49152 vocabulary entries).
RUNTIME_MLIR_EMITTERS = dataclasses.replace(RUNTIME, base=493_281_922.0, per_activation=132.85,
                                            calibrated={"f32": 718e6 / 49152})


def runtime() -> Runtime:
    """The runtime constants for the XLA emitters this process runs with (`tqjax.xla`)."""
    return RUNTIME if xla.llvm_emitters() else RUNTIME_MLIR_EMITTERS
# A preset fits when its predicted peak plus this fraction is within the budget: the fits'
# largest misfits were 34 MB (5.6% of SmolLM2's smallest run) and, refitted, 13 MB.
MARGIN = 0.06


@dataclasses.dataclass(frozen=True)
class PresetPlan:
    """One weights × KV preset. Bytes are per device; contexts in tokens (cache slots)."""

    weights: str
    kv: str
    param_bytes: int
    kv_bytes_per_token: float  # one sequence, all layers, K+V
    kv_constant_bytes: int  # one sequence: sink slots, recent rings, centres, rotations
    runtime_bytes: int  # at the plan's batch
    max_context: int  # longest context that fits at the plan's batch (0: none)
    max_batch: int | None  # with a context: the largest batch that fits (None: not asked)
    peak_bytes: int  # predicted peak at max_context (or at the asked context and max_batch)


@dataclasses.dataclass(frozen=True)
class Plan:
    """The planner's answer for one model and budget."""

    model: str
    memory_bytes: int
    devices: int
    batch: int
    context: int | None
    max_position: int
    rows: tuple[PresetPlan, ...]


_UNITS = {"": 1, "b": 1, "k": 10**3, "kb": 10**3, "m": 10**6, "mb": 10**6, "g": 10**9,
          "gb": 10**9, "t": 10**12, "tb": 10**12, "kib": 2**10, "mib": 2**20, "gib": 2**30,
          "tib": 2**40}


def parse_bytes(text: str | int) -> int:
    """'8GiB', '7.5 GB', '512MiB', '12345678' -> bytes (decimal GB, binary GiB). A number
    with no unit is bytes, but under 1 MiB it is refused as a missing unit ('8' is 8 bytes,
    not 8 GB)."""
    if isinstance(text, int) and not isinstance(text, bool):
        value = text
    else:
        m = re.fullmatch(r"\s*([0-9]*\.?[0-9]+)\s*([a-zA-Z]*)\s*", str(text))
        if not m or m.group(2).lower() not in _UNITS:
            raise TqjaxError(f"cannot read memory size {text!r} (e.g. 8GiB, 7.5GB, 512MiB)")
        if not m.group(2) and 0 < float(m.group(1)) < 2**20:
            raise TqjaxError(f"memory size {text!r} has no unit and would be {m.group(1)} "
                             f"bytes; give one (e.g. {m.group(1)}GiB or {m.group(1)}GB)")
        value = int(float(m.group(1)) * _UNITS[m.group(2).lower()])
    if value <= 0:
        raise TqjaxError(f"memory size must be positive, got {text!r}")
    return value


def _tensor_table(path: Path) -> tuple[ModelConfig, dict[str, loading.StoredTensor]]:
    """Config and tensor index of a .gguf file or HF directory (no tensor data read)."""
    if path.is_file() and path.suffix == ".gguf":
        meta, tensors = loading.read_gguf(path)
        config = loading.config_from_gguf(meta, has_output_weight="lm_head.weight" in tensors)
        return config, tensors
    if checkpoint.is_quantized_checkpoint(path) or orbax_checkpoint.is_orbax_checkpoint(path):
        raise TqjaxError(f"{path} is a tqjax checkpoint of finished weights; the planner reads "
                         f"the model it was made from (a name, a .gguf or an HF directory) and "
                         f"plans every weights preset for it")
    if path.is_dir() and (path / "config.json").is_file():
        return (loading.read_hf_config(path),
                loading.safetensors_tensors(loading.safetensors_files(path)))
    raise TqjaxError(f"{path}: the planner reads a model name, a .gguf file or an HF directory")


def _nbytes(tree: object) -> int:
    return sum(math.prod(x.shape) * np.dtype(x.dtype).itemsize
               for x in jax.tree_util.tree_leaves(tree))


def _quantized_bytes(shape: tuple[int, int], method: str) -> int:
    """Packed codes + scales (+ offsets) of one [out, in] linear stored as `method`, from the
    quantizer's output shapes (the lut and rotation are shared and counted once per model)."""
    out, inp = shape
    q = jax.eval_shape(lambda w: quantize_linear(w, METHODS[method]),
                       jax.ShapeDtypeStruct((inp, out), jnp.float32))
    return _nbytes((q.packed, q.scale, q.offset))


def param_bytes(config: ModelConfig, tensors: dict[str, loading.StoredTensor],
                weights: str) -> int:
    """Resident parameter bytes for a weights preset (see the module docstring)."""
    if weights not in WEIGHT_PRESETS:
        raise TqjaxError(f"unknown weights preset {weights!r} (choose from: "
                         f"{', '.join(WEIGHT_PRESETS)})")
    names = loading.param_names(config)
    linears = {n for n in names if n.startswith("model.layers.")
               and n.rsplit(".", 2)[-2].removesuffix("_proj") in
               {"q", "k", "v", "o", "gate", "up", "down"} and n.endswith(".weight")}
    assert len(linears) == len(LINEARS) * config.num_layers
    total = 4 * (config.head_dim // 2)  # rope_inv_freq f32
    cache: dict[tuple[tuple[int, ...], str], int] = {}
    for name in names:
        t = tensors.get(name)
        if t is None:
            raise TqjaxError(f"checkpoint is missing tensor {name}")
        n = math.prod(t.shape)
        if weights == "gguf" and t.ggml_type is None:
            raise TqjaxError("weights 'gguf' needs a .gguf file")
        if weights == "gguf" and t.ggml_type in ggml.SUPPORTED_TYPES and len(t.shape) == 2:
            block, size = ggml.GGML_QUANT_SIZES[ggml.T(t.ggml_type)]
            total += t.shape[0] * (t.shape[1] // block) * size
        elif weights in METHODS and name in linears:
            key = (t.shape, weights)
            if key not in cache:
                cache[key] = _quantized_bytes(t.shape, weights)
            total += cache[key]
        elif weights == "mixed-4.25" and name in linears:
            total += math.floor(n * MIXED_BPW / 8)
        else:
            total += n * (2 if weights == "bf16" else 4)
    if weights in METHODS:
        fmt = METHODS[weights]
        total += _nbytes(format_lut(fmt)) + 4 * fmt.rotation_block  # shared lut, rotation signs
    return total


def kv_bytes(config: ModelConfig, kv: str, devices: int = 1) -> tuple[float, int, int]:
    """(bytes per token per sequence, constant bytes per sequence, constant bytes shared by
    the batch) of a KV preset "K" or "K/V", per device, from real caches of 64 and 128 slots
    at batch 1 and 2."""
    spec = CacheSpec(*parse_kv(kv))
    # tqjax.sharding splits the KV heads when the tensor size divides them, else replicates
    kvh = config.num_kv_heads // devices if config.num_kv_heads % devices == 0 else \
        config.num_kv_heads
    hd, layers = config.head_dim, config.num_layers
    zeros = np.zeros((layers, kvh, hd), np.float32)
    cal = Calibration(zeros, zeros, np.ones_like(zeros))

    def total(batch: int, slots: int) -> tuple[float, int]:
        c = make_cache(spec, batch=batch, slots=slots, num_layers=layers, kv_heads=kvh,
                       head_dim=hd, calibration=cal, inv_freq=rope_inv_freq(config))
        return bytes_per_token(c), constant_bytes(c)

    per1, const1 = total(1, 64)
    _, const2 = total(2, 64)
    per_seq = const2 - const1
    return per1, per_seq, const1 - per_seq


def slots_for(context: int) -> int:
    """Cache slots the runtime allocates for a context: whole prefill chunks past one chunk."""
    return padded_length(context, PREFILL_CHUNK if context > PREFILL_CHUNK else PAD_MULTIPLE)


def cache_terms(kv: str) -> tuple[bool, bool]:
    """(calibrated, turbo) of a KV preset "K" or "K/V": whether a calibration pass runs, and
    whether the keys' store is a turbo one (the runtime terms `runtime_bytes` takes)."""
    spec = CacheSpec(*parse_kv(kv))
    return spec.needs_calibration, spec.k.startswith("turbo")


def runtime_bytes(config: ModelConfig, batch: int, context: int, weights: str = "f32",
                  calibrated: bool = False, turbo: bool = False) -> int:
    """The measured working set beyond params and cache (`runtime()`), bytes; `calibrated`: a
    turbo cache's calibration pass runs (its term depends on `weights`); `turbo`: the keys'
    store is a turbo one (`cache_terms` gives both)."""
    chunk = min(PREFILL_CHUNK, slots_for(context))
    rt = runtime()
    calib = rt.turbo(weights, config.vocab_size) if calibrated else 0.0
    row = rt.row_activation["turbo" if turbo else "dense"]
    return round(rt.base + rt.per_logit * batch * config.vocab_size
                 + (rt.per_activation + max(row, rt.per_activation) * (batch - 1))
                 * chunk * config.hidden_size + calib)


def predict_peak(params: int, kv: tuple[float, int, int], config: ModelConfig, batch: int,
                 context: int, weights: str = "f32", calibrated: bool = False,
                 turbo: bool = False) -> int:
    """Predicted peak bytes per device for `batch` sequences in a cache of `context` tokens."""
    per_token, per_seq, shared = kv
    slots = slots_for(context)
    return round(params + batch * (slots * per_token + per_seq) + shared
                 + runtime_bytes(config, batch, context, weights, calibrated, turbo))


def _largest(fits: Callable[[int], bool], lo: int, hi: int) -> int:
    """Largest x in [lo, hi] with fits(x) (fits monotone), or lo - 1 if none."""
    if hi < lo or not fits(lo):
        return lo - 1
    while lo < hi:
        mid = (lo + hi + 1) // 2
        lo, hi = (mid, hi) if fits(mid) else (lo, mid - 1)
    return lo


def _row(config: ModelConfig, weights: str, kv: str, params: int,
         kvb: tuple[float, int, int], budget: int, batch: int,
         context: int | None) -> PresetPlan:
    """One preset's longest context (and largest batch at `context`) whose predicted peak plus
    `MARGIN` is within `budget`."""
    calib, turbo = cache_terms(kv)

    def peak(b: int, c: int) -> int:
        return predict_peak(params, kvb, config, b, c, weights, calib, turbo)

    def fits(b: int, c: int) -> bool:
        return peak(b, c) * (1 + MARGIN) <= budget

    ctx = max(0, _largest(lambda c: fits(batch, c), 1, config.max_position))
    if ctx > PREFILL_CHUNK:  # a context the runtime fills exactly: whole prefill chunks
        ctx = ctx // PREFILL_CHUNK * PREFILL_CHUNK
    max_batch, top = None, peak(batch, max(ctx, 1))
    if context is not None:
        hi = 1  # (doubled while it fits, up to 2**41: 2**16 was a cap that a budget reached)
        while hi < 1 << 40 and fits(hi * 2, context):
            hi *= 2
        max_batch = max(0, _largest(lambda b: fits(b, context), 1, hi * 2))
        top = peak(max(max_batch, 1), context)
    return PresetPlan(weights, kv, params, kvb[0], kvb[1] + kvb[2],
                      runtime_bytes(config, batch, max(ctx, 1), weights, calib, turbo),
                      ctx,
                      max_batch, top)


def plan(model: str | Path, memory: int | str, *, devices: int = 1, batch: int = 1,
         context: int | None = None, weights: tuple[str, ...] = WEIGHT_PRESETS,
         kv: tuple[str, ...] = KV_PRESETS) -> Plan:
    """For every weights × KV preset: the longest context that fits `memory` bytes per device
    at `batch`; with `context`, also the largest batch that fits at that context. `model`: a
    model name, .gguf file or HF directory."""
    budget = parse_bytes(memory)
    for what, x in (("devices", devices), ("batch", batch)):
        if not isinstance(x, int) or isinstance(x, bool) or x < 1:
            raise TqjaxError(f"{what} must be a positive integer, got {x!r}")
    if context is not None and (not isinstance(context, int) or isinstance(context, bool)
                                or context < 1):
        raise TqjaxError(f"context must be a positive integer, got {context!r}")
    path = fetch.resolve_path(model)
    config, tensors = _tensor_table(path)
    check_tp(config, devices)  # what `--tp` would refuse, the plan refuses too
    if context is not None and context > config.max_position:
        raise TqjaxError(f"context {context} exceeds the model's {config.max_position} positions")
    kv_cache = {name: kv_bytes(config, name, devices) for name in kv}
    params = {w: -(-param_bytes(config, tensors, w) // devices) for w in weights
              if w != "gguf" or (path.is_file() and path.suffix == ".gguf")}
    rows = [_row(config, w, name, p, kv_cache[name], budget, batch, context)
            for w, p in params.items() for name in kv]
    return Plan(str(model), budget, devices, batch, context, config.max_position, tuple(rows))
