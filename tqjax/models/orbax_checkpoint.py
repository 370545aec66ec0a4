"""Sharded checkpoints with orbax-checkpoint: params saved from a mesh and restored straight
onto another (each device reads only its own shards from the tensorstore arrays).

A directory holds:
- `state/`: the orbax checkpoint of every array of the Params pytree (dense and quantized
  weights alike: packed codes, scales, offsets, codebooks, rotation signs, GGUF blocks), one
  entry per leaf named by its path ("layers.3.wq.packed");
- `config.json`: the `ModelConfig`;
- `orbax.json`, written last: format name and version, the Params structure (pytree types,
  their static fields such as bits/group/in_features, and each array's shape and dtype, so
  the abstract tree can be rebuilt and sharded before anything is read), the caller's `meta`
  (e.g. how the weights were quantized), and the size and sha256 of every other file, checked
  before anything is read (one written by an older tqjax has no list and is read unchecked);
- the tokenizer files, when given.

The whole directory is built under a temporary name and swapped into place
(`tqjax.atomic.replace_dir`; orbax's own finalize renames `state/` inside it). The safetensors
quantized checkpoint (`tqjax.models.checkpoint`) stays the interchange format; this one is for
placing a large model on a mesh without a full copy per device. Single-process here; on
several hosts every process calls `save_sharded` / `restore_sharded` with the same arguments
(orbax writes and reads each process's shards), and the directory must be on a shared file
system.
"""

from __future__ import annotations

import dataclasses
import json
from pathlib import Path
from typing import Any

import jax
import jax.numpy as jnp
import numpy as np
from jax.sharding import Mesh

from tqjax.atomic import read_json, replace_dir
from tqjax.dtypes import resolve_dtype
from tqjax.errors import TqjaxError
from tqjax.models.checkpoint import (
    _save_tokenizer,
    config_from_dict,
    config_to_dict,
    list_files,
    verify_files,
    with_tokenizer_ends,
)
from tqjax.models.config import ModelConfig
from tqjax.models.tokenizer import Tokenizer
from tqjax.models.transformer import PARTS, LayerParams, LayerStack, Params
from tqjax.quant.ggml import GGMLLinear
from tqjax.quant.half import HalfLinear
from tqjax.quant.rotation import Rotation
from tqjax.quant.weights import QuantizedLinear
from tqjax.sharding import make_mesh, param_shardings

FORMAT = "tqjax-orbax"
FORMAT_VERSION = 2  # 2: quantized weights stored output-major
META_FILE = "orbax.json"
CONFIG_FILE = "config.json"
STATE_DIR = "state"
TYPES: dict[str, type] = {c.__name__: c for c in (Params, LayerParams, LayerStack,
                                                  QuantizedLinear, GGMLLinear, HalfLinear,
                                                  Rotation)}


def is_orbax_checkpoint(path: Path) -> bool:
    """True for a directory holding an orbax.json."""
    return path.is_dir() and (path / META_FILE).is_file()


def _encode(node: Any) -> Any:
    """The Params structure as JSON: dataclasses by type name with pytree and static fields,
    arrays as shape and dtype, lists and None as themselves."""
    if node is None:
        return None
    if isinstance(node, (list, tuple)):
        return [_encode(x) for x in node]
    if type(node).__name__ in TYPES and dataclasses.is_dataclass(node):
        fields, static = {}, {}
        for f in dataclasses.fields(node):
            value = getattr(node, f.name)
            if f.metadata.get("pytree_node", True):
                fields[f.name] = _encode(value)
            else:
                static[f.name] = value
        return {"type": type(node).__name__, "fields": fields, "static": static}
    if hasattr(node, "shape") and hasattr(node, "dtype"):
        return {"shape": list(node.shape), "dtype": np.dtype(node.dtype).name}
    raise TqjaxError(f"cannot save a {type(node).__name__} in an orbax checkpoint")


def _tuples(raw: Any) -> Any:
    """Nested JSON lists back to the nested tuples a pytree's static data is."""
    return tuple(_tuples(x) for x in raw) if isinstance(raw, list) else raw


def _decode(raw: Any) -> Any:
    """Inverse of `_encode` with `jax.ShapeDtypeStruct` leaves (an abstract Params)."""
    try:
        if raw is None:
            return None
        if isinstance(raw, list):
            return [_decode(x) for x in raw]
        if "type" in raw:
            cls = TYPES[raw["type"]]
            if cls is GGMLLinear and "fields" not in raw["fields"]:  # whole blocks (before
                # 4ddeb95) or codes and the rest of each block (before stop 44)
                raise TqjaxError(f"{META_FILE}: GGUF blocks saved in an older layout than "
                                 "this tqjax reads; save the checkpoint again")
            fields = {k: _decode(v) for k, v in raw["fields"].items()}
            static = raw["static"]
            if cls is GGMLLinear:
                fields["fields"] = tuple(fields["fields"])
            if cls is LayerStack:  # (JSON lists back to the tuples a pytree's static data is)
                if len(static["kind"]) != len(PARTS) or not isinstance(static["kind"][0], list):
                    raise TqjaxError(f"{META_FILE}: layers stacked in an older layout than "
                                     "this tqjax reads; save the checkpoint again")
                fields["stacks"] = tuple(tuple(part) for part in fields["stacks"])
                static = {"kind": _tuples(static["kind"]), "pos": _tuples(static["pos"]),
                          "stacked": _tuples(static["stacked"])}
            return cls(**fields, **static)
        return jax.ShapeDtypeStruct(tuple(int(n) for n in raw["shape"]), np.dtype(raw["dtype"]))
    except (KeyError, TypeError, ValueError, AttributeError) as e:
        raise TqjaxError(f"{META_FILE}: bad params structure ({e})") from None


def leaf_names(tree: Any) -> list[str]:
    """Dotted names of a pytree's leaves in flattening order ("layers.0.wq.packed")."""
    names = []
    for path, _ in jax.tree_util.tree_flatten_with_path(tree)[0]:
        parts = [str(getattr(k, "name", getattr(k, "idx", getattr(k, "key", k)))) for k in path]
        names.append(".".join(parts))
    return names


def _checkpointer() -> Any:
    import orbax.checkpoint as ocp

    return ocp.StandardCheckpointer()


def save_sharded(path: str | Path, params: Params, config: ModelConfig,
                 meta: dict[str, Any] | None = None, tokenizer: Tokenizer | None = None,
                 source: Path | None = None) -> dict[str, Any]:
    """Write params (on any mesh, or one device) as an orbax checkpoint directory, atomically;
    `meta` (JSON-serialisable, e.g. the weight method) is stored in orbax.json, which is
    returned. `tokenizer` / `source` (an HF directory to copy tokenizer files from) make the
    directory loadable by name with `tqjax.load`."""
    path = Path(path).expanduser().absolute()
    if path.exists() and not (is_orbax_checkpoint(path) or
                              (path.is_dir() and not any(path.iterdir()))):
        raise TqjaxError(f"{path} exists and is not an orbax checkpoint; not overwriting it")
    config = with_tokenizer_ends(config, tokenizer)
    flat = dict(zip(leaf_names(params), jax.tree.leaves(params), strict=True))
    info = {"format": FORMAT, "format_version": FORMAT_VERSION, "params": _encode(params),
            "meta": meta or {}}
    try:
        json.dumps(info)
    except TypeError as e:
        raise TqjaxError(f"orbax checkpoint metadata is not JSON-serialisable: {e}") from None

    def fill(tmp: Path) -> None:
        ckptr = _checkpointer()
        ckptr.save(tmp / STATE_DIR, flat)
        ckptr.wait_until_finished()
        (tmp / CONFIG_FILE).write_text(json.dumps(config_to_dict(config), indent=1))
        _save_tokenizer(tmp, tokenizer, source)
        info["files"] = list_files(tmp)
        (tmp / META_FILE).write_text(json.dumps(info, indent=1))

    replace_dir(path, fill)
    return info


def _dense_as(abstract: Params, dtype: Any) -> Params:
    """The abstract params with every dense floating array (embedding, norms, biases, dense
    weights) as `dtype`; quantized weights' parts and the RoPE frequencies keep theirs."""

    def cast(x: Any) -> Any:
        if isinstance(x, jax.ShapeDtypeStruct) and jnp.issubdtype(x.dtype, jnp.floating):
            return jax.ShapeDtypeStruct(x.shape, dtype)
        return x

    def fields(obj: Any) -> dict[str, Any]:
        return {f.name: cast(getattr(obj, f.name)) for f in dataclasses.fields(obj)}

    layers = abstract.layers
    if isinstance(layers, LayerStack):
        layers = layers.replace(stacks=tuple(tuple(lp.replace(**fields(lp)) for lp in part)
                                             for part in layers.stacks))
    else:
        layers = [lp.replace(**fields(lp)) for lp in layers]
    return abstract.replace(embed=cast(abstract.embed), final_norm=cast(abstract.final_norm),
                            lm_head=cast(abstract.lm_head), layers=layers)


def restore_sharded(path: str | Path, mesh: Mesh | None = None, dtype: str | None = None
                    ) -> tuple[ModelConfig, Params, dict[str, Any]]:
    """Read an orbax checkpoint directory onto `mesh` (None: a 1-device mesh) -> (config,
    params placed by `tqjax.sharding.param_shardings`, orbax.json contents). The abstract
    tree and its shardings are built first, so each device reads only its shards. `dtype`
    ("float32", "bfloat16", "float16"; None keeps the saved ones) casts the dense arrays as
    they are read."""
    path = Path(path).expanduser()
    if not is_orbax_checkpoint(path):
        raise TqjaxError(f"{path} is not an orbax checkpoint directory (no {META_FILE})")
    info = read_json(path / META_FILE)
    if not isinstance(info, dict) or info.get("format") != FORMAT:
        raise TqjaxError(f"{path / META_FILE} is not a tqjax orbax checkpoint")
    if info.get("format_version") != FORMAT_VERSION:
        raise TqjaxError(f"{path} has orbax format version {info.get('format_version')}; "
                         f"this tqjax reads version {FORMAT_VERSION} (quantize it again)")
    if not (path / STATE_DIR).is_dir():
        raise TqjaxError(f"orbax checkpoint {path} has no {STATE_DIR}/ directory")
    if "files" in info:  # (one written by an older tqjax has no list)
        verify_files(path, info["files"], META_FILE)
    config = config_from_dict(read_json(path / CONFIG_FILE))
    abstract = _decode(info.get("params"))
    if not isinstance(abstract, Params) or len(abstract.layers) != config.num_layers:
        raise TqjaxError(f"{path / META_FILE} does not describe a {config.num_layers}-layer model")
    if dtype is not None:
        abstract = _dense_as(abstract, resolve_dtype(dtype))
    mesh = make_mesh(1, 1) if mesh is None else mesh
    shardings = param_shardings(abstract, config, mesh)
    leaves, treedef = jax.tree.flatten(abstract)
    target = {name: jax.ShapeDtypeStruct(a.shape, a.dtype, sharding=s)
              for name, a, s in zip(leaf_names(abstract), leaves, jax.tree.leaves(shardings),
                                    strict=True)}
    try:
        restored = _checkpointer().restore(path.absolute() / STATE_DIR, target)
    except Exception as e:  # noqa: BLE001 (TensorStore's read errors are plain Exceptions)
        why = (str(e).splitlines() or [type(e).__name__])[0].split(". See full TensorStore")[0]
        raise TqjaxError(f"cannot restore {path} (truncated or corrupt?): {why}") from None
    params = jax.tree.unflatten(treedef, [restored[name] for name in target])
    return config, params, info
