"""Static model configuration, built from an HF `config.json` or from GGUF metadata.

One frozen (hashable) dataclass covers Llama and Qwen through flags, so it can be a static
argument of jitted functions.
"""

from __future__ import annotations

import dataclasses
import math
from typing import Any

import numpy as np

from tqjax.errors import TqjaxError

HF_ARCHITECTURES = {
    "LlamaForCausalLM": "llama",
    "Qwen2ForCausalLM": "qwen2",
    "Qwen3ForCausalLM": "qwen3",
}
GGUF_ARCHITECTURES = ("llama", "qwen2", "qwen3")
ROPE_TYPES = ("default", "linear", "llama3")


@dataclasses.dataclass(frozen=True)
class RopeScaling:
    """Rope frequency scaling. `kind` is "linear" (positions / factor) or "llama3"."""

    kind: str
    factor: float
    low_freq_factor: float = 1.0
    high_freq_factor: float = 4.0
    original_max_position: int = 8192


@dataclasses.dataclass(frozen=True)
class ModelConfig:
    """Architecture hyper-parameters; `arch` is "llama", "qwen2" or "qwen3"."""

    arch: str
    vocab_size: int
    hidden_size: int
    intermediate_size: int
    num_layers: int
    num_heads: int
    num_kv_heads: int
    head_dim: int
    rms_eps: float
    rope_theta: float
    max_position: int
    tie_embeddings: bool
    rope_scaling: RopeScaling | None = None
    bos_token_id: int | None = None
    eos_token_ids: tuple[int, ...] = ()

    @property
    def qkv_bias(self) -> bool:
        return self.arch == "qwen2"

    @property
    def qk_norm(self) -> bool:
        return self.arch == "qwen3"

    @property
    def num_params(self) -> int:
        """Parameter count (embedding counted once when tied)."""
        d, h, kv, hd = self.hidden_size, self.num_heads, self.num_kv_heads, self.head_dim
        attn = d * h * hd * 2 + d * kv * hd * 2
        if self.qkv_bias:
            attn += (h + 2 * kv) * hd
        if self.qk_norm:
            attn += 2 * hd
        layer = attn + 3 * d * self.intermediate_size + 2 * d
        head = 0 if self.tie_embeddings else self.vocab_size * d
        return self.num_layers * layer + self.vocab_size * d + head + d


def _rope_from_hf(raw: dict[str, Any] | None) -> RopeScaling | None:
    if not raw:
        return None
    kind = raw.get("rope_type", raw.get("type", "default"))
    if kind not in ROPE_TYPES:
        raise TqjaxError(f"unsupported rope type {kind!r} (supported: {', '.join(ROPE_TYPES)})")
    if kind == "default":
        return None
    if kind == "linear":
        return RopeScaling("linear", float(raw["factor"]))
    return RopeScaling(
        "llama3",
        float(raw["factor"]),
        float(raw.get("low_freq_factor", 1.0)),
        float(raw.get("high_freq_factor", 4.0)),
        int(raw.get("original_max_position_embeddings", 8192)),
    )


def config_from_hf(cfg: dict[str, Any]) -> ModelConfig:
    """Build a config from a parsed HF `config.json` (old `rope_theta` or new `rope_parameters`);
    a missing or bad field is a TqjaxError naming it."""
    try:
        return check_config(_config_from_hf(cfg))
    except KeyError as e:
        raise TqjaxError(f"config.json has no {e.args[0]!r}") from None
    except (TypeError, ValueError, AttributeError) as e:
        raise TqjaxError(f"config.json has a bad value: {e}") from None


def _config_from_hf(cfg: dict[str, Any]) -> ModelConfig:
    if not isinstance(cfg, dict):
        raise TqjaxError("config.json is not a JSON object")
    archs = cfg.get("architectures") or []
    if not archs and cfg.get("model_type") in GGUF_ARCHITECTURES:  # (as AutoModel reads it)
        archs = [a for a, name in HF_ARCHITECTURES.items() if name == cfg["model_type"]]
    arch = next((HF_ARCHITECTURES[a] for a in archs if a in HF_ARCHITECTURES), None)
    if arch is None:
        names = ", ".join(HF_ARCHITECTURES)
        raise TqjaxError(f"unsupported architecture {archs or cfg.get('model_type')!r} "
                         f"(supported: {names})")
    if cfg.get("hidden_act", "silu") != "silu":
        raise TqjaxError(f"unsupported activation {cfg['hidden_act']!r} (only silu)")
    if (cfg.get("attention_bias") and arch != "qwen2") or cfg.get("mlp_bias"):
        raise TqjaxError(f"unsupported {arch} variant: attention_bias/mlp_bias are not "
                         f"implemented")
    quant = cfg.get("quantization_config")
    if quant:
        method = quant.get("quant_method", "?") if isinstance(quant, dict) else quant
        raise TqjaxError(f"unsupported: a quantized HF checkpoint (quantization_config "
                         f"{method!r}); use the unquantized model or a GGUF file")
    if cfg.get("use_sliding_window"):
        raise TqjaxError("unsupported: sliding-window attention (use_sliding_window=true)")
    rope = cfg.get("rope_parameters") or {}
    if rope:  # transformers >= 5 layout: theta and scaling in one dict
        theta, scaling = rope.get("rope_theta", cfg.get("rope_theta", 10000.0)), rope
    else:
        theta, scaling = cfg.get("rope_theta", 10000.0), cfg.get("rope_scaling")
    eos = cfg.get("eos_token_id")
    eos_ids = tuple(eos) if isinstance(eos, list) else (() if eos is None else (int(eos),))
    heads = int(cfg["num_attention_heads"])
    return ModelConfig(
        arch=arch,
        vocab_size=int(cfg["vocab_size"]),
        hidden_size=int(cfg["hidden_size"]),
        intermediate_size=int(cfg["intermediate_size"]),
        num_layers=int(cfg["num_hidden_layers"]),
        num_heads=heads,
        num_kv_heads=int(cfg.get("num_key_value_heads") or heads),
        head_dim=int(cfg.get("head_dim") or cfg["hidden_size"] // heads),
        rms_eps=float(cfg.get("rms_norm_eps", 1e-6)),
        rope_theta=float(theta),
        max_position=int(cfg.get("max_position_embeddings", 4096)),
        tie_embeddings=bool(cfg.get("tie_word_embeddings", False)),
        rope_scaling=_rope_from_hf(scaling),
        bos_token_id=cfg.get("bos_token_id"),
        eos_token_ids=eos_ids,
    )


def config_from_gguf(meta: dict[str, Any], has_output_weight: bool) -> ModelConfig:
    """Build a config from GGUF metadata (`{arch}.block_count`, ...) as a plain dict; a
    missing or bad key is a TqjaxError naming it."""
    try:
        return check_config(_config_from_gguf(meta, has_output_weight))
    except KeyError as e:
        raise TqjaxError(f"GGUF metadata has no {e.args[0]!r}") from None
    except (TypeError, ValueError, AttributeError) as e:
        raise TqjaxError(f"GGUF metadata has a bad value: {e}") from None


def check_config(config: ModelConfig) -> ModelConfig:
    """The config itself, if its sizes can make a model; else a TqjaxError."""
    c = config
    sizes = {"vocab size": c.vocab_size, "hidden size": c.hidden_size,
             "intermediate size": c.intermediate_size, "layers": c.num_layers,
             "attention heads": c.num_heads, "key/value heads": c.num_kv_heads,
             "head dim": c.head_dim, "context length": c.max_position}
    for name, value in sizes.items():
        if value < 1:
            raise TqjaxError(f"the model's {name} must be >= 1, got {value}")
    if c.num_heads % c.num_kv_heads:
        raise TqjaxError(f"the model's {c.num_heads} attention heads are not a multiple of its "
                         f"{c.num_kv_heads} key/value heads")
    if c.head_dim % 2:
        raise TqjaxError(f"the model's head dim must be even (rotary pairs), got {c.head_dim}")
    if not (c.rms_eps > 0 and c.rope_theta > 0):
        raise TqjaxError(f"the model's rms eps and rope theta must be > 0, got {c.rms_eps} "
                         f"and {c.rope_theta}")
    if c.rope_scaling is not None and not c.rope_scaling.factor > 0:
        raise TqjaxError(f"the model's rope scaling factor must be > 0, got "
                         f"{c.rope_scaling.factor}")
    return config


def _config_from_gguf(meta: dict[str, Any], has_output_weight: bool) -> ModelConfig:
    arch = meta.get("general.architecture")
    if arch not in GGUF_ARCHITECTURES:
        raise TqjaxError(f"unsupported GGUF architecture {arch!r} "
                         f"(supported: {', '.join(GGUF_ARCHITECTURES)})")

    def key(name: str, default: Any = None) -> Any:
        value = meta.get(f"{arch}.{name}", default)
        if value is None:
            raise TqjaxError(f"GGUF metadata is missing {arch}.{name}")
        return value

    hidden, heads = int(key("embedding_length")), int(key("attention.head_count"))
    scaling_type = meta.get(f"{arch}.rope.scaling.type", "none")
    scaling = None
    if scaling_type == "linear":
        scaling = RopeScaling("linear", float(key("rope.scaling.factor")))
    elif scaling_type not in ("none", None):
        raise TqjaxError(f"unsupported rope scaling {scaling_type!r} in GGUF")
    vocab = meta.get(f"{arch}.vocab_size") or len(meta["tokenizer.ggml.tokens"])
    eos = meta.get("tokenizer.ggml.eos_token_id")
    return ModelConfig(
        arch=arch,
        vocab_size=int(vocab),
        hidden_size=hidden,
        intermediate_size=int(key("feed_forward_length")),
        num_layers=int(key("block_count")),
        num_heads=heads,
        num_kv_heads=int(key("attention.head_count_kv", heads)),
        head_dim=int(key("attention.key_length", hidden // heads)),
        rms_eps=float(key("attention.layer_norm_rms_epsilon")),
        rope_theta=float(key("rope.freq_base", 10000.0)),
        max_position=int(key("context_length")),
        tie_embeddings=not has_output_weight,
        rope_scaling=scaling,
        bos_token_id=meta.get("tokenizer.ggml.bos_token_id"),
        eos_token_ids=() if eos is None else (int(eos),),
    )


def rope_inv_freq(config: ModelConfig) -> np.ndarray:
    """Inverse rotary frequencies, float32 [head_dim // 2], with any scaling applied."""
    hd = config.head_dim
    inv = 1.0 / config.rope_theta ** (np.arange(0, hd, 2, dtype=np.float64) / hd)
    sc = config.rope_scaling
    if sc is None:
        return inv.astype(np.float32)
    if sc.kind == "linear":
        return (inv / sc.factor).astype(np.float32)
    # Llama 3.1: long wavelengths slowed by `factor`, short ones kept, smooth blend in between.
    low_wavelen = sc.original_max_position / sc.low_freq_factor
    high_wavelen = sc.original_max_position / sc.high_freq_factor
    wavelen = 2 * math.pi / inv
    smooth = (sc.original_max_position / wavelen - sc.low_freq_factor) / (
        sc.high_freq_factor - sc.low_freq_factor)
    blended = (1 - smooth) * inv / sc.factor + smooth * inv
    out = np.where(wavelen > low_wavelen, inv / sc.factor, inv)
    out = np.where((wavelen <= low_wavelen) & (wavelen >= high_wavelen), blended, out)
    return out.astype(np.float32)
