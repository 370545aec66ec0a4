"""Checkpoint loading: HF safetensors directories (single or sharded) and GGUF files.

Both formats are read into HF tensor names (`model.layers.0.self_attn.q_proj.weight`, ...)
holding float32 numpy arrays `[out, in]`, then turned into `Params` in the requested dtype.
"""

from __future__ import annotations

import json
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import jax.numpy as jnp
import numpy as np
from tqdm import tqdm

from tqjax.errors import TqjaxError
from tqjax.models import checkpoint
from tqjax.models.config import ModelConfig, config_from_gguf, config_from_hf, rope_inv_freq
from tqjax.models.transformer import LayerParams, Params

DTYPES = {"float32": jnp.float32, "bfloat16": jnp.bfloat16, "float16": jnp.float16}

GGUF_LAYER_NAMES = {
    "attn_norm.weight": "input_layernorm.weight",
    "attn_q.weight": "self_attn.q_proj.weight",
    "attn_k.weight": "self_attn.k_proj.weight",
    "attn_v.weight": "self_attn.v_proj.weight",
    "attn_q.bias": "self_attn.q_proj.bias",
    "attn_k.bias": "self_attn.k_proj.bias",
    "attn_v.bias": "self_attn.v_proj.bias",
    "attn_q_norm.weight": "self_attn.q_norm.weight",
    "attn_k_norm.weight": "self_attn.k_norm.weight",
    "attn_output.weight": "self_attn.o_proj.weight",
    "ffn_norm.weight": "post_attention_layernorm.weight",
    "ffn_gate.weight": "mlp.gate_proj.weight",
    "ffn_up.weight": "mlp.up_proj.weight",
    "ffn_down.weight": "mlp.down_proj.weight",
}
GGUF_GLOBAL_NAMES = {
    "token_embd.weight": "model.embed_tokens.weight",
    "output_norm.weight": "model.norm.weight",
    "output.weight": "lm_head.weight",
    "rope_freqs.weight": "rope_freqs",
}


def resolve_dtype(name: str) -> jnp.dtype:
    if name not in DTYPES:
        raise TqjaxError(f"unknown dtype {name!r} (choose from: {', '.join(DTYPES)})")
    return DTYPES[name]


# ---------------------------------------------------------------- safetensors directories


def read_hf_config(path: Path) -> ModelConfig:
    cfg_file = path / "config.json"
    if not cfg_file.is_file():
        raise TqjaxError(f"{path} has no config.json (expected an HF model directory)")
    try:
        return config_from_hf(json.loads(cfg_file.read_text()))
    except json.JSONDecodeError as e:
        raise TqjaxError(f"{cfg_file} is not valid JSON: {e}") from None


def safetensors_files(path: Path) -> list[Path]:
    index = path / "model.safetensors.index.json"
    if index.is_file():
        weight_map = json.loads(index.read_text()).get("weight_map", {})
        files = sorted({path / f for f in weight_map.values()})
    else:
        files = sorted(path.glob("*.safetensors"))
    if not files:
        raise TqjaxError(f"{path} has no *.safetensors weights")
    for f in files:
        if not f.is_file():
            raise TqjaxError(f"missing weight shard {f}")
    return files


def iter_safetensors(files: list[Path]) -> Iterator[tuple[str, np.ndarray]]:
    """Yield (name, float32 array) for every tensor of the given safetensors files."""
    from safetensors import SafetensorError, safe_open

    for f in files:
        try:
            with safe_open(f, framework="flax") as st:
                for name in st.keys():  # noqa: SIM118 (safe_open is not a dict)
                    yield name, np.asarray(st.get_tensor(name).astype(jnp.float32))
        except (SafetensorError, OSError, ValueError) as e:
            raise TqjaxError(f"cannot read {f} (truncated or corrupt?): {e}") from None


# ---------------------------------------------------------------- GGUF files


def open_gguf(path: Path) -> Any:
    import gguf

    try:
        return gguf.GGUFReader(str(path))
    except Exception as e:  # gguf raises bare ValueError/IndexError/struct errors on bad files
        raise TqjaxError(f"cannot read GGUF file {path} (truncated or corrupt?): {e}") from None


def gguf_metadata(reader: Any) -> dict[str, Any]:
    """All GGUF key/values as Python values (token lists included)."""
    meta = {}
    for key, field in reader.fields.items():
        try:
            meta[key] = field.contents()
        except Exception:  # noqa: S112 - a few structural fields have no scalar content
            continue
    return meta


def unpermute_rope_rows(w: np.ndarray, n_heads: int) -> np.ndarray:
    """Undo llama.cpp's Q/K row permutation (interleaved -> half-split RoPE), w [out, in]."""
    out = w.shape[0]
    return w.reshape(n_heads, out // n_heads // 2, 2, *w.shape[1:]).swapaxes(1, 2).reshape(w.shape)


def iter_gguf(reader: Any, config: ModelConfig) -> Iterator[tuple[str, np.ndarray]]:
    """Yield (HF name, float32 array) for every GGUF tensor, dequantized and un-permuted."""
    from gguf.quants import dequantize

    for t in reader.tensors:
        if t.name in GGUF_GLOBAL_NAMES:
            name = GGUF_GLOBAL_NAMES[t.name]
        else:
            parts = t.name.split(".", 2)
            if parts[0] != "blk" or parts[2] not in GGUF_LAYER_NAMES:
                raise TqjaxError(f"unexpected tensor {t.name!r} in GGUF file")
            name = f"model.layers.{parts[1]}.{GGUF_LAYER_NAMES[parts[2]]}"
        try:
            arr = dequantize(t.data, t.tensor_type)
        except Exception as e:
            raise TqjaxError(f"cannot decode GGUF tensor {t.name} ({t.tensor_type.name}): {e}"
                             ) from None
        arr = np.asarray(arr, np.float32).reshape(tuple(reversed([int(d) for d in t.shape])))
        if config.arch == "llama" and name.endswith(("q_proj.weight", "k_proj.weight")):
            heads = config.num_heads if "q_proj" in name else config.num_kv_heads
            arr = unpermute_rope_rows(arr, heads)
        yield name, arr


# ---------------------------------------------------------------- assembling Params


def build_params(tensors: dict[str, np.ndarray], config: ModelConfig, dtype: jnp.dtype,
                 rope_freqs: np.ndarray | None = None) -> Params:
    """Turn HF-named float32 tensors into `Params` (linears transposed to [in, out])."""

    def take(name: str) -> np.ndarray:
        if name not in tensors:
            raise TqjaxError(f"checkpoint is missing tensor {name}")
        return tensors.pop(name)

    def dense(name: str) -> jnp.ndarray:
        return jnp.asarray(take(name), dtype)

    def linear(name: str) -> jnp.ndarray:
        return jnp.asarray(take(name).T, dtype)

    layers = []
    for i in range(config.num_layers):
        p = f"model.layers.{i}."
        extra: dict[str, jnp.ndarray] = {}
        if config.qkv_bias:
            extra |= {f"b{c}": dense(p + f"self_attn.{c}_proj.bias") for c in "qkv"}
        if config.qk_norm:
            extra |= {f"{c}_norm": dense(p + f"self_attn.{c}_norm.weight") for c in "qk"}
        layers.append(LayerParams(
            attn_norm=dense(p + "input_layernorm.weight"),
            wq=linear(p + "self_attn.q_proj.weight"),
            wk=linear(p + "self_attn.k_proj.weight"),
            wv=linear(p + "self_attn.v_proj.weight"),
            wo=linear(p + "self_attn.o_proj.weight"),
            mlp_norm=dense(p + "post_attention_layernorm.weight"),
            w_gate=linear(p + "mlp.gate_proj.weight"),
            w_up=linear(p + "mlp.up_proj.weight"),
            w_down=linear(p + "mlp.down_proj.weight"),
            **extra,
        ))
    inv_freq = rope_inv_freq(config)
    if rope_freqs is not None:  # GGUF llama3 scaling: per-frequency divisors stored as a tensor
        inv_freq = (inv_freq / rope_freqs.reshape(-1)).astype(np.float32)
    embed = dense("model.embed_tokens.weight")
    head = tensors.pop("lm_head.weight", None)
    params = Params(
        embed=embed,
        layers=layers,
        final_norm=dense("model.norm.weight"),
        lm_head=None if config.tie_embeddings or head is None else jnp.asarray(head.T, dtype),
        rope_inv_freq=jnp.asarray(inv_freq),
    )
    if config.tie_embeddings is False and head is None:
        raise TqjaxError("checkpoint is missing tensor lm_head.weight")
    return params


def load_checkpoint(path: Path, dtype: str = "float32",
                    progress: bool = False) -> tuple[ModelConfig, Params, dict[str, Any]]:
    """Load an HF directory, a .gguf file or a quantized checkpoint directory -> (config,
    params, GGUF metadata, quantization.json contents or {})."""
    jdtype = resolve_dtype(dtype)
    if not path.exists():
        raise TqjaxError(f"no such file or directory: {path}")
    if checkpoint.is_quantized_checkpoint(path):
        return checkpoint.load_quantized(path, dtype)
    if path.is_dir():
        config, meta = read_hf_config(path), {}
        files = safetensors_files(path)
        stream = iter_safetensors(files)
        total = None
    elif path.suffix == ".gguf":
        reader = open_gguf(path)
        meta = gguf_metadata(reader)
        names = {t.name for t in reader.tensors}
        config = config_from_gguf(meta, has_output_weight="output.weight" in names)
        stream, total = iter_gguf(reader, config), len(reader.tensors)
    else:
        raise TqjaxError(f"{path} is neither an HF model directory nor a .gguf file")
    tensors = dict(tqdm(stream, total=total, desc=f"loading {path.name}", unit="tensor",
                        disable=None if progress else True, leave=False))
    rope_freqs = tensors.pop("rope_freqs", None)
    return config, build_params(tensors, config, jdtype, rope_freqs), meta
