"""Checkpoint loading: HF safetensors directories (single or sharded) and GGUF files.

Both formats are indexed as HF tensor names (`model.layers.0.self_attn.q_proj.weight`, ...)
with HF shapes (`[out, in]` for linears), and each tensor is then read, converted and placed
on the device on its own (`place`), largest first: a few rows at a time are read from the file
(no memory map stays resident), decoded to float32, transposed/un-permuted and cast into a
host buffer of the final dtype that the device adopts without a copy. A load's peak memory is
the final params plus one tensor's chunk (and, for a GGUF file kept in its blocks, one
tensor's bytes), not a dict of every tensor in f32. With `blocks=True` (`weights="gguf"`) a
GGUF file's quantized matrices stay in the file's blocks (`tqjax.quant.ggml.GGMLLinear`).
"""

from __future__ import annotations

import dataclasses
import functools
import math
from collections.abc import Callable
from pathlib import Path
from typing import Any

import jax
import jax.numpy as jnp
import numpy as np
from tqdm import tqdm

from tqjax.atomic import read_json
from tqjax.dtypes import HALF_DTYPES, resolve_dtype
from tqjax.errors import TqjaxError
from tqjax.host import host_buffer, release_adopted
from tqjax.models import checkpoint
from tqjax.models.checkpoint import SafetensorsFile, read_file_bytes
from tqjax.models.config import ModelConfig, config_from_gguf, config_from_hf, rope_inv_freq
from tqjax.models.gguf_file import read_header
from tqjax.models.transformer import LayerParams, Params
from tqjax.quant.half import HalfLinear
from tqjax.quant.weights import Columns

GGUF_WEIGHTS = "gguf"  # the weights mode that keeps a GGUF file's quantized blocks

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


# ---------------------------------------------------------------- one tensor at a time

CHUNK_BYTES = 1 << 24  # float32 bytes decoded at a time while converting one tensor (16 MiB)


@dataclasses.dataclass(frozen=True)
class StoredTensor:
    """One tensor of a checkpoint file, read on demand.

    shape: the HF shape ([out, in] for a linear, [V, D] for the embedding).
    read(rows): rows (a slice or an int array of indices along shape[0]) as float32
      [len(rows), *shape[1:]].
    ggml_type, raw (GGUF files only): the tensor's ggml type and raw() its bytes as the file
      has them, uint8 [shape[0], bytes per row]. dtype (safetensors only): the stored dtype.
    """

    shape: tuple[int, ...]
    read: Callable[[slice | np.ndarray], np.ndarray]
    ggml_type: int | None = None
    raw: Callable[[], np.ndarray] | None = None
    dtype: str | None = None  # a safetensors file's dtype name ("BF16")


def place(t: StoredTensor, dtype: jnp.dtype, transpose: bool = False,
          perm: np.ndarray | None = None, bits: bool = False) -> jax.Array:
    """t as a device array of `dtype`: rows reordered by `perm` (row i = stored row perm[i]),
    then transposed ([out, in] -> [in, out]) if asked. Rows are read and cast `CHUNK_BYTES` of
    float32 at a time into one host buffer of the final dtype, which the device adopts.
    `bits`: a 16-bit dtype's values placed as their uint16 bit patterns (a view)."""
    release_adopted()  # host buffers jax adopted and the caller dropped go before this read
    rows = t.shape[0]
    out = host_buffer(t.shape[::-1] if transpose else t.shape, dtype)
    step = max(1, CHUNK_BYTES // (4 * math.prod(t.shape[1:])))
    for a in range(0, rows, step):
        b = min(rows, a + step)
        chunk = t.read(slice(a, b) if perm is None else perm[a:b])  # [b - a, *shape[1:]]
        if transpose:
            out[:, a:b] = chunk.T
        else:
            out[a:b] = chunk
    return jax.device_put(out.view(np.uint16) if bits else out)


# ---------------------------------------------------------------- safetensors directories


def read_hf_config(path: Path) -> ModelConfig:
    cfg_file = path / "config.json"
    if not cfg_file.is_file():
        raise TqjaxError(f"{path} has no config.json (expected an HF model directory)")
    raw = read_json(cfg_file, dict)
    if "architectures" not in raw and "arch" in raw and "num_layers" in raw:  # tqjax's own
        raise TqjaxError(f"{path} holds a tqjax checkpoint's config.json but not its "
                         f"quantization.json or orbax.json (an incomplete checkpoint?)")
    config = config_from_hf(raw)
    gen_file = path / "generation_config.json"
    if gen_file.is_file():  # HF's generate ends on these (Qwen2.5: <|im_end|> and <|endoftext|>)
        eos = read_json(gen_file, dict).get("eos_token_id")
        ids = eos if isinstance(eos, list) else ([] if eos is None else [eos])
        if not all(isinstance(i, int) and not isinstance(i, bool) for i in ids):
            raise TqjaxError(f"{gen_file}: eos_token_id must be an integer or a list of them, "
                             f"got {eos!r}")
        config = dataclasses.replace(config, eos_token_ids=tuple(
            i for i in dict.fromkeys((*config.eos_token_ids, *ids)) if 0 <= i < config.vocab_size))
    return config


SAFETENSORS_DTYPES = ("F32", "F16", "BF16")  # tensor dtypes read (as float32)


def safetensors_files(path: Path) -> list[Path]:
    index = path / "model.safetensors.index.json"
    if index.is_file():
        weight_map = read_json(index, dict).get("weight_map", {})
        if not isinstance(weight_map, dict) or not all(
                isinstance(f, str) and Path(f).name == f for f in weight_map.values()):
            raise TqjaxError(f"{index}: weight_map must map tensor names to file names in "
                             f"its folder")
        files = sorted({path / f for f in weight_map.values()})
    else:
        files = sorted(path.glob("*.safetensors"))
    if not files:
        raise TqjaxError(f"{path} has no *.safetensors weights")
    for f in files:
        if not f.is_file():
            raise TqjaxError(f"missing weight shard {f}")
    return files


def safetensors_tensors(files: list[Path]) -> dict[str, StoredTensor]:
    """Index the tensors of safetensors files by name (nothing is read yet)."""
    out, where = {}, {}
    for f in files:
        st = SafetensorsFile(f)
        for name, shape in st.shapes.items():
            if name in out:  # (which one would be read depended on the files' order)
                raise TqjaxError(f"tensor {name} is in both {where[name].name} and {f.name}")
            out[name] = StoredTensor(shape, functools.partial(_read_safetensor, st, name),
                                     dtype=st.dtypes[name])
            where[name] = f
    return out


def _read_safetensor(st: SafetensorsFile, name: str, rows: slice | np.ndarray) -> np.ndarray:
    if isinstance(rows, slice):
        return np.asarray(st.read(name, rows), np.float32)
    lo = int(rows.min())
    return np.asarray(st.read(name, slice(lo, int(rows.max()) + 1))[rows - lo], np.float32)


# ---------------------------------------------------------------- GGUF files


def unpermute_rope_rows(w: np.ndarray, n_heads: int) -> np.ndarray:
    """Undo llama.cpp's Q/K row permutation (interleaved -> half-split RoPE), w [out, ...]."""
    out = w.shape[0]
    return w.reshape(n_heads, out // n_heads // 2, 2, *w.shape[1:]).swapaxes(1, 2).reshape(w.shape)


def gguf_hf_name(name: str) -> str:
    """The HF name of a GGUF tensor ("blk.0.attn_q.weight" -> "model.layers.0.self_attn...")."""
    if name in GGUF_GLOBAL_NAMES:
        return GGUF_GLOBAL_NAMES[name]
    parts = name.split(".", 2)
    if len(parts) != 3 or parts[0] != "blk" or parts[2] not in GGUF_LAYER_NAMES:
        raise TqjaxError(f"unexpected tensor {name!r} in GGUF file")
    return f"model.layers.{parts[1]}.{GGUF_LAYER_NAMES[parts[2]]}"


def read_gguf(path: Path) -> tuple[dict[str, Any], dict[str, StoredTensor]]:
    """A GGUF file's key/values (token lists included: `gguf_file.read_header`) and its tensor
    index by HF name (nothing is read yet)."""
    meta, index = read_header(path)
    tensors = {}
    for t in index:
        shape = tuple(reversed(t.shape))  # HF order: [out, in]
        raw = functools.partial(_gguf_bytes, path, t.offset, t.nbytes, shape[0])
        read = functools.partial(_gguf_rows, raw, t.name, t.ggml_type, shape)
        tensors[gguf_hf_name(t.name)] = StoredTensor(shape, read, int(t.ggml_type), raw)
    return meta, tensors


def _gguf_bytes(path: Path, offset: int, nbytes: int, rows: int, lo: int = 0,
                hi: int | None = None) -> np.ndarray:
    """Rows [lo, hi) of a GGUF tensor's bytes, uint8 [hi - lo, bytes per row]."""
    row = nbytes // rows
    hi = rows if hi is None else hi
    return read_file_bytes(path, offset + lo * row, (hi - lo) * row).reshape(hi - lo, row)


def _gguf_rows(raw: Callable[..., np.ndarray], name: str, ggml_type: Any, shape: tuple[int, ...],
               rows: slice | np.ndarray) -> np.ndarray:
    from gguf.quants import dequantize

    if isinstance(rows, slice):
        data = raw(rows.start, rows.stop)
    else:
        lo = int(rows.min())
        data = raw(lo, int(rows.max()) + 1)[rows - lo]
    try:
        values = dequantize(data, ggml_type)
    except Exception as e:
        raise TqjaxError(f"cannot decode GGUF tensor {name} ({ggml_type.name}): {e}") from None
    return np.asarray(values, np.float32).reshape(len(data), *shape[1:])


# ---------------------------------------------------------------- assembling Params


def rope_permutations(config: ModelConfig) -> dict[str, np.ndarray]:
    """GGUF llama files: the row order int [out] that un-permutes each Q/K projection
    (`unpermute_rope_rows` applied to the row indices), by HF name."""
    if config.arch != "llama":
        return {}
    hd = config.head_dim
    q = unpermute_rope_rows(np.arange(config.num_heads * hd), config.num_heads)
    k = unpermute_rope_rows(np.arange(config.num_kv_heads * hd), config.num_kv_heads)
    return {f"model.layers.{i}.self_attn.{c}_proj.weight": perm
            for i in range(config.num_layers) for c, perm in (("q", q), ("k", k))}


def param_names(config: ModelConfig) -> dict[str, str]:
    """HF names of the tensors `Params` is built from -> "dense" (kept as stored) or "linear"
    (stored [out, in], used [in, out]). An untied model's "lm_head.weight" is included."""
    names = {"model.embed_tokens.weight": "dense", "model.norm.weight": "dense"}
    if not config.tie_embeddings:
        names["lm_head.weight"] = "linear"
    for i in range(config.num_layers):
        p = f"model.layers.{i}."
        names |= {p + "input_layernorm.weight": "dense",
                  p + "post_attention_layernorm.weight": "dense"}
        names |= {p + f"self_attn.{c}_proj.weight": "linear" for c in "qkvo"}
        names |= {p + f"mlp.{c}_proj.weight": "linear" for c in ("gate", "up", "down")}
        if config.qkv_bias:
            names |= {p + f"self_attn.{c}_proj.bias": "dense" for c in "qkv"}
        if config.qk_norm:
            names |= {p + f"self_attn.{c}_norm.weight": "dense" for c in "qk"}
    return names


def param_shapes(config: ModelConfig) -> dict[str, tuple[int, ...]]:
    """The shape the config gives each of `param_names`' tensors, as stored by HF ([out, in]
    for a linear)."""
    d, v, hd = config.hidden_size, config.vocab_size, config.head_dim
    q, kv, ff = config.num_heads * hd, config.num_kv_heads * hd, config.intermediate_size
    by_suffix = {"input_layernorm.weight": (d,), "post_attention_layernorm.weight": (d,),
                 "self_attn.q_proj.weight": (q, d), "self_attn.k_proj.weight": (kv, d),
                 "self_attn.v_proj.weight": (kv, d), "self_attn.o_proj.weight": (d, q),
                 "mlp.gate_proj.weight": (ff, d), "mlp.up_proj.weight": (ff, d),
                 "mlp.down_proj.weight": (d, ff), "self_attn.q_proj.bias": (q,),
                 "self_attn.k_proj.bias": (kv,), "self_attn.v_proj.bias": (kv,),
                 "self_attn.q_norm.weight": (hd,), "self_attn.k_norm.weight": (hd,)}
    top = {"model.embed_tokens.weight": (v, d), "model.norm.weight": (d,),
           "lm_head.weight": (v, d)}
    return {n: top[n] if n in top else by_suffix[n.split(".", 3)[3]]
            for n in param_names(config)}


@dataclasses.dataclass
class Checkpoint:
    """An opened HF directory or GGUF file: config, metadata and tensor index. Nothing is read
    until asked: `params` reads everything, `leaf` and `layer` one tensor or one decoder
    layer, `columns` a matrix as [in, out] column blocks (a streaming quantizer's input).

    Linears are transposed to [in, out] and cast to `dtype` with the norms, biases and
    embedding; `perms` reorders rows first (GGUF llama Q/K). With `blocks`, every 2-D tensor
    whose ggml type `tqjax.quant.ggml` supports (linears, embedding, head) is kept as a
    `GGMLLinear` of its file bytes instead.
    """

    config: ModelConfig
    tensors: dict[str, StoredTensor]
    dtype: jnp.dtype
    meta: dict[str, Any] = dataclasses.field(default_factory=dict)
    blocks: bool = False
    perms: dict[str, np.ndarray] = dataclasses.field(default_factory=dict)
    path: Path | None = None  # the file or directory it was opened from
    names: dict[str, str] = dataclasses.field(init=False)  # `param_names(config)`

    def __post_init__(self) -> None:
        self.names = param_names(self.config)
        missing = [n for n in self.names if n not in self.tensors]
        if missing:
            raise TqjaxError(f"checkpoint is missing tensor {missing[0]}")
        for name in self.names:
            if self.tensors[name].dtype not in (None, *SAFETENSORS_DTYPES):
                raise TqjaxError(f"tensor {name} is {self.tensors[name].dtype}, which tqjax "
                                 f"does not read ({', '.join(SAFETENSORS_DTYPES)})")
        for name, shape in param_shapes(self.config).items():  # (else wrong answers or a
            # traceback deep in the model: a short table's ids clamp, a [1] norm broadcasts)
            if tuple(self.tensors[name].shape) != shape:
                raise TqjaxError(f"{name} has shape {tuple(self.tensors[name].shape)}, but the "
                                 f"model's configuration gives {shape}")

    def leaf(self, name: str, runtime: bool = False) -> Any:
        """The tensor `name` (an HF name among `param_names`) read, converted and placed.
        `runtime`: a linear of a half-precision dtype comes as the `HalfLinear` the model
        runs (kept [out, in], as stored) instead of a dense [in, out] array."""
        t = self.tensors[name]
        if self.blocks:
            from tqjax.quant import ggml

            if t.ggml_type in ggml.SUPPORTED_TYPES and len(t.shape) == 2:
                w = ggml.from_gguf(t.raw(), t.ggml_type, t.shape)
                return w if name not in self.perms else ggml.permute_rows(w, self.perms[name])
        linear = self.names[name] == "linear"
        if linear and runtime and self.dtype in HALF_DTYPES:
            return HalfLinear(place(t, self.dtype, False, self.perms.get(name), bits=True),
                              jnp.dtype(self.dtype).name)
        return place(t, self.dtype, linear, self.perms.get(name))

    def columns(self, name: str) -> Columns:
        """A 2-D tensor stored [rows, D] (the embedding [V, D], a head [V, D]) as the
        [D, rows] matrix whose columns are its rows, read a block of columns at a time, with
        the values of `dtype` (as `leaf` would place them) in f32."""
        t = self.tensors[name]
        if len(t.shape) != 2 or name in self.perms:
            raise TqjaxError(f"{name} cannot be read by columns")

        d = t.shape[1]
        step = max(1, CHUNK_BYTES // (4 * d))

        def read(a: int, b: int) -> np.ndarray:  # [D, b - a], decoded CHUNK_BYTES at a time
            out = host_buffer((d, b - a), np.float32)
            for c in range(a, b, step):
                rows = t.read(slice(c, min(b, c + step)))
                if self.dtype != jnp.float32:
                    rows = rows.astype(self.dtype).astype(np.float32)
                out[:, c - a:c - a + len(rows)] = rows.T
            return out

        return Columns((t.shape[1], t.shape[0]), read)

    def layer(self, i: int, placed: dict[str, Any] | None = None) -> LayerParams:
        """Decoder layer i, its tensors taken from `placed` (HF name -> leaf) or read now."""
        p = f"model.layers.{i}."

        def get(name: str) -> Any:
            return placed[p + name] if placed is not None else self.leaf(p + name)

        cfg, extra = self.config, {}
        if cfg.qkv_bias:
            extra |= {f"b{c}": get(f"self_attn.{c}_proj.bias") for c in "qkv"}
        if cfg.qk_norm:
            extra |= {f"{c}_norm": get(f"self_attn.{c}_norm.weight") for c in "qk"}
        return LayerParams(
            attn_norm=get("input_layernorm.weight"),
            wq=get("self_attn.q_proj.weight"),
            wk=get("self_attn.k_proj.weight"),
            wv=get("self_attn.v_proj.weight"),
            wo=get("self_attn.o_proj.weight"),
            mlp_norm=get("post_attention_layernorm.weight"),
            w_gate=get("mlp.gate_proj.weight"),
            w_up=get("mlp.up_proj.weight"),
            w_down=get("mlp.down_proj.weight"),
            **extra,
        )

    def rope_inv_freq(self) -> jax.Array:
        """RoPE inverse frequencies f32 [hd/2] (GGUF llama3 scaling: divided by the per-frequency
        factors stored as a tensor)."""
        inv_freq = rope_inv_freq(self.config)
        if "rope_freqs" in self.tensors:
            freqs = self.tensors["rope_freqs"]
            inv_freq = (inv_freq / freqs.read(slice(0, freqs.shape[0])).reshape(-1)
                        ).astype(np.float32)
        return jnp.asarray(inv_freq)

    def params(self, progress: str | None = None) -> Params:
        """Every tensor `Params` needs, read one at a time and largest first (a large tensor's
        transient copies then come while little else is resident), in the form the model
        runs (half-precision linears as `HalfLinear`). `progress`: a progress-bar label, or
        None."""
        placed: dict[str, Any] = {}
        order = sorted(self.names, key=lambda n: -math.prod(self.tensors[n].shape))
        for name in tqdm(order, desc=progress, unit="tensor",
                         disable=True if progress is None else None, leave=False):
            placed[name] = self.leaf(name, runtime=True)
        return Params(
            embed=placed["model.embed_tokens.weight"],
            layers=[self.layer(i, placed) for i in range(self.config.num_layers)],
            final_norm=placed["model.norm.weight"],
            lm_head=placed.get("lm_head.weight"),
            rope_inv_freq=self.rope_inv_freq(),
        )


def open_checkpoint(path: Path, dtype: str = "float32", blocks: bool = False,
                    on_metadata: Callable[[dict[str, Any]], None] | None = None) -> Checkpoint:
    """Open an HF directory or a .gguf file (see `Checkpoint`; a quantized checkpoint
    directory is `load_checkpoint`'s). `blocks` keeps a GGUF file's quantized matrices in
    their blocks (`weights="gguf"`); other inputs are then an error. `on_metadata` is called
    with a GGUF file's metadata before any tensor is read: work done there (building the
    tokenizer: +46 MB transient for Qwen2.5's vocabulary) then peaks while the params are not
    yet resident."""
    jdtype = resolve_dtype(dtype)
    if not path.exists():
        raise TqjaxError(f"no such file or directory: {path}")
    is_gguf = path.is_file() and path.suffix == ".gguf"
    if blocks and not is_gguf:
        raise TqjaxError(f"weights 'gguf' keeps the quantized blocks of a .gguf file; "
                         f"{path} is not one")
    if checkpoint.is_quantized_checkpoint(path):
        raise TqjaxError(f"{path} holds quantized weights already")
    if path.is_dir():
        config = read_hf_config(path)
        return Checkpoint(config, safetensors_tensors(safetensors_files(path)), jdtype,
                          path=path)
    if not is_gguf:
        raise TqjaxError(f"{path} is neither an HF model directory nor a .gguf file")
    meta, tensors = read_gguf(path)
    config = config_from_gguf(meta, has_output_weight="lm_head.weight" in tensors)
    if on_metadata is not None:  # after the config: an unsupported model says so first
        on_metadata(meta)
    return Checkpoint(config, tensors, jdtype, meta, blocks, rope_permutations(config), path)


def load_checkpoint(path: Path, dtype: str = "float32", progress: bool = False,
                    blocks: bool = False,
                    on_metadata: Callable[[dict[str, Any]], None] | None = None,
                    ) -> tuple[ModelConfig, Params, dict[str, Any]]:
    """Load an HF directory, a .gguf file or a quantized checkpoint directory -> (config,
    params, GGUF metadata or quantization.json contents or {}); see `open_checkpoint`."""
    if checkpoint.is_quantized_checkpoint(path) and not blocks:
        resolve_dtype(dtype)
        return checkpoint.load_quantized(path, dtype)
    ckpt = open_checkpoint(path, dtype, blocks, on_metadata)
    label = f"loading {path.name}" if progress else None
    return ckpt.config, ckpt.params(label), ckpt.meta
