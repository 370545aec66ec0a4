"""Quantized checkpoint directories (no pickle anywhere).

A directory holds:
- `model.safetensors`: dense tensors under their Params names ("embed", "final_norm",
  "rope_inv_freq", "layers.{i}.attn_norm", "layers.{i}.bq", ...); each quantized linear as
  "{path}.packed" (uint8), "{path}.scale" (f16) and, for affine formats, "{path}.offset" (f16);
  constants shared by many tensors once: "shared.lut.{j}" (f32 code values) and
  "shared.rotation.{j}.signs" (f32 ±1).
- `config.json`: the `ModelConfig` as `dataclasses.asdict` (rope scaling nested).
- the tokenizer: `tokenizer.json` + `tokenizer_config.json` (chat template, bos/eos, add_bos),
  rebuilt from GGUF metadata or copied from an HF source directory.
- `quantization.json`, written last: format name and version, the model architecture (one of
  `config.GGUF_ARCHITECTURES`, equal to config.json's `arch`), the method, per-tensor
  {kind, bits, group, in/out features, lut, rotation}, storage accounting, the source model's
  name/size/sha256, and the size and sha256 of every other file, all verified on load
  ("disk": bytes of those files, the weights file alone, and its bits per parameter).

The directory is written next to its target under a temporary name, fsynced, then renamed into
place (an existing quantized checkpoint there is replaced; anything else is left alone).
"""

from __future__ import annotations

import dataclasses
import hashlib
import json
import math
import shutil
from collections.abc import Callable
from pathlib import Path
from typing import Any

import jax
import jax.numpy as jnp
import numpy as np

from tqjax.atomic import read_json, replace_dir, safetensors_io
from tqjax.dtypes import HALF_DTYPES, resolve_dtype
from tqjax.errors import TqjaxError
from tqjax.fetch import sha256_file
from tqjax.host import host_buffer
from tqjax.models.config import GGUF_ARCHITECTURES, ModelConfig, RopeScaling
from tqjax.models.tokenizer import Tokenizer
from tqjax.models.transformer import LINEARS, LayerParams, Params
from tqjax.quant.accounting import params_bits
from tqjax.quant.half import HalfLinear, dense
from tqjax.quant.rotation import Rotation
from tqjax.quant.weights import KINDS, QuantizedLinear, WeightFormat, format_lut

FORMAT = "tqjax-quantized"
FORMAT_VERSION = 2  # 2: quantized weights stored output-major ([out, in·bits/8])
QUANT_FILE = "quantization.json"
CONFIG_FILE = "config.json"
WEIGHTS_FILE = "model.safetensors"
TOKENIZER_CONFIG = "tokenizer_config.json"
HF_TOKENIZER_FILES = ("tokenizer.json", "tokenizer.model", TOKENIZER_CONFIG,
                      "special_tokens_map.json", "chat_template.jinja")
QUANTIZED_PARTS = (".packed", ".scale", ".offset")  # tensor-name suffixes of a QuantizedLinear


def is_quantized_checkpoint(path: Path) -> bool:
    """True for a directory holding a quantization.json."""
    return path.is_dir() and (path / QUANT_FILE).is_file()


def with_tokenizer_ends(config: ModelConfig, tokenizer: Tokenizer | None) -> ModelConfig:
    """The config with the tokenizer's end tokens after its own: a saved checkpoint's tokenizer
    files are read back with config.json's ids (`tokenizer_from_hf_dir`), so a GGUF model's
    whole end-of-generation set must be written there."""
    if tokenizer is None:
        return config
    eos = tuple(dict.fromkeys((*config.eos_token_ids, *tokenizer.eos_ids)))
    return dataclasses.replace(config, eos_token_ids=eos)


def file_digest(path: Path) -> tuple[int, str]:
    """(size in bytes, sha256 hex) of a file."""
    return path.stat().st_size, sha256_file(path)


def source_info(path: Path) -> dict[str, Any]:
    """Name, size and sha256 of the model a checkpoint came from (a directory hashes the sorted
    list of its files' names and sha256s)."""
    if path.is_file():
        size, digest = file_digest(path)
        return {"name": path.name, "size": size, "sha256": digest}
    files = sorted(p for p in path.rglob("*") if p.is_file())
    h, total = hashlib.sha256(), 0
    for f in files:
        size, digest = file_digest(f)
        total += size
        h.update(f"{f.relative_to(path)}\t{digest}\n".encode())
    return {"name": path.name, "size": total, "sha256": h.hexdigest()}


# ---------------------------------------------------------------- reading one tensor at a time

def read_file_bytes(path: Path, offset: int, size: int) -> np.ndarray:
    """`size` bytes of a file from `offset`, uint8 [size] in a `host_buffer` (read, not mapped:
    a map's touched pages would stay in the process's resident set)."""
    out = host_buffer((size,), np.uint8)
    with open(path, "rb") as f:
        f.seek(offset)
        got = f.readinto(memoryview(out))
    if got != size:
        raise TqjaxError(f"{path} ends before the tensor bytes at {offset}+{size} (truncated?)")
    return out


PLACE_BYTES = 1 << 24  # f32 bytes of rows read at a time while placing one tensor (16 MiB)


class SafetensorsFile:
    """A safetensors file read one tensor (or row range) at a time: it is opened for each
    read, so the pages its memory map touched leave the resident set when the read is done."""

    def __init__(self, path: Path) -> None:
        self.path = path
        with self._open() as st:
            slices = {name: st.get_slice(name)
                      for name in st.keys()}  # noqa: SIM118 (safe_open is not a dict)
            self.shapes = {name: tuple(s.get_shape()) for name, s in slices.items()}
            self.dtypes = {name: s.get_dtype() for name, s in slices.items()}

    def _open(self) -> Any:
        from safetensors import SafetensorError, safe_open

        try:
            return safe_open(self.path, framework="numpy")
        except (SafetensorError, OSError, ValueError) as e:
            raise TqjaxError(f"cannot read {self.path} (truncated or corrupt?): {e}") from None

    def place(self, name: str, dtype: Any = None, output_major: bool = False) -> Any:
        """Tensor `name` on the device, cast to `dtype` if given: read `PLACE_BYTES` of rows at
        a time into one host buffer that the device adopts (no whole copy on the side).
        `output_major`: a dense [in, out] linear of a half-precision `dtype` comes as the
        `HalfLinear` the model runs, [out, in] bits, transposed chunk by chunk."""
        shape = self.shapes[name]
        if len(shape) == 0 or shape[0] == 0:
            value = self.read(name)
            out = host_buffer(value.shape, value.dtype if dtype is None else dtype)
            out[...] = value
            return jax.device_put(out)
        step = max(1, PLACE_BYTES // (4 * math.prod(shape[1:])))
        out = None
        for a in range(0, shape[0], step):
            rows = self.read(name, slice(a, min(shape[0], a + step)))
            if out is None:
                kind = rows.dtype if dtype is None else dtype
                out = host_buffer(shape[::-1] if output_major else shape, kind)
            if output_major:
                out[:, a:a + len(rows)] = rows.T
            else:
                out[a:a + len(rows)] = rows
        if output_major:
            return HalfLinear(jax.device_put(out.view(np.uint16)), jnp.dtype(out.dtype).name)
        return jax.device_put(out)

    def read(self, name: str, rows: slice | None = None) -> np.ndarray:
        """Tensor `name` (rows `rows` of its first axis, if given) in its stored dtype."""
        from safetensors import SafetensorError

        with self._open() as st:
            try:
                return st.get_tensor(name) if rows is None else st.get_slice(name)[rows]
            except (SafetensorError, OSError, ValueError) as e:
                raise TqjaxError(f"cannot read {name} from {self.path} (truncated or "
                                 f"corrupt?): {e}") from None


# ---------------------------------------------------------------- params <-> flat tensors


def _fields(obj: Any) -> dict[str, Any]:
    return {f.name: getattr(obj, f.name) for f in dataclasses.fields(obj)}


def flatten_params(params: Params) -> dict[str, Any]:
    """{name: dense array or QuantizedLinear} for every non-None leaf field of params."""
    flat = {}
    for name, value in _fields(params).items():
        if name == "layers":
            for i, lp in enumerate(value):
                flat |= {f"layers.{i}.{k}": v for k, v in _fields(lp).items()}
        else:
            flat[name] = value
    return {k: v for k, v in flat.items() if v is not None}


def _unflatten(flat: dict[str, Any], config: ModelConfig) -> Params:
    optional = {"layers", "lm_head"} if config.tie_embeddings else {"layers"}

    def build(cls: type, prefix: str) -> Any:
        values = {}
        for f in dataclasses.fields(cls):
            if prefix + f.name in flat:
                values[f.name] = flat.pop(prefix + f.name)
            elif f.default is dataclasses.MISSING and f.name not in optional:
                raise TqjaxError(f"quantized checkpoint is missing tensor {prefix + f.name}")
        return values

    layers = [LayerParams(**build(LayerParams, f"layers.{i}.")) for i in range(config.num_layers)]
    params = Params(layers=layers, **{"lm_head": None} | build(Params, ""))
    if flat:
        raise TqjaxError(f"quantized checkpoint has unexpected tensors: {', '.join(sorted(flat))}")
    return params


def _to_tensors(params: Params, dense_dtype: jnp.dtype | None
                ) -> tuple[dict[str, jax.Array], dict[str, Any]]:
    """Flat safetensors dict and the per-tensor quantization metadata."""
    tensors: dict[str, jax.Array] = {}
    meta: dict[str, Any] = {}
    shared: dict[int, str] = {}  # id of a shared array -> its tensor name
    counts = {"lut": 0, "rotation": 0}

    def share(kind: str, arrays: dict[str, jax.Array]) -> str:
        key = id(next(iter(arrays.values())))
        if key not in shared:
            shared[key] = name = f"shared.{kind}.{counts[kind]}"
            counts[kind] += 1
            tensors.update({f"{name}.{k}" if k else name: v for k, v in arrays.items()})
        return shared[key]

    for name, value in flatten_params(params).items():
        if not isinstance(value, QuantizedLinear):
            value = dense(value)  # (a half-precision linear kept as the model runs it)
            keep = name == "rope_inv_freq" or dense_dtype is None
            tensors[name] = value if keep else value.astype(dense_dtype)
            continue
        tensors[f"{name}.packed"], tensors[f"{name}.scale"] = value.packed, value.scale
        if value.offset is not None:
            tensors[f"{name}.offset"] = value.offset
        rotation = None
        if value.rotation is not None:
            parts = {"signs": value.rotation.signs}
            if value.rotation.matrix is not None:
                parts["matrix"] = value.rotation.matrix
            rotation = share("rotation", parts)
        meta[name] = {"kind": value.kind, "bits": value.bits, "group": value.group,
                      "in_features": value.in_features, "out_features": value.out_features,
                      "lut": share("lut", {"": value.lut}), "rotation": rotation}
    return tensors, meta


def _quantized(name: str, info: dict[str, Any], tensors: dict[str, jax.Array],
               shared: dict[str, Any]) -> QuantizedLinear:
    """Rebuild one QuantizedLinear, checking every shape against its metadata."""
    try:
        bits, group = int(info["bits"]), int(info["group"])
        k, n = int(info["in_features"]), int(info["out_features"])
        kind, lut_name, rot_name = info["kind"], info["lut"], info.get("rotation")
    except (KeyError, TypeError, ValueError):
        raise TqjaxError(f"{QUANT_FILE}: bad entry for {name}") from None
    if kind not in KINDS:
        raise TqjaxError(f"{QUANT_FILE}: unknown format kind {kind!r} for {name} "
                         f"(this tqjax reads {', '.join(KINDS)})")
    if not (1 <= bits <= 8 and group > 0 and k > 0 and n > 0):
        raise TqjaxError(f"{QUANT_FILE}: bad kind/bits/group/features for {name}")
    k_pad = -(-k // group) * group
    expect = {".packed": (n, k_pad * bits // 8), ".scale": (n, k_pad // group)}
    if kind == "affine":
        expect[".offset"] = (n, k_pad // group)
    for suffix, shape in expect.items():
        t = tensors.pop(name + suffix, None)
        if t is None or t.shape != shape:
            got = "missing" if t is None else f"shape {t.shape}"
            raise TqjaxError(f"quantized checkpoint: {name}{suffix} is {got}, expected {shape}")
        expect[suffix] = t
    if isinstance(shared.get(lut_name), Rotation) or getattr(
            shared.get(lut_name), "shape", None) != (1 << bits,):
        raise TqjaxError(f"quantized checkpoint: {name} needs a {1 << bits}-entry lut {lut_name}")
    if kind != "tq" and not np.array_equal(np.asarray(shared[lut_name]),
                                           np.asarray(format_lut(WeightFormat(kind, bits, 8)))):
        raise TqjaxError(f"quantized checkpoint: {name} is {kind} but its lut {lut_name} is not "
                         f"the {bits}-bit integer levels")
    rotation = None
    if kind == "tq" or rot_name is not None:
        rotation = shared.get(rot_name)
        d = rotation.dim if isinstance(rotation, Rotation) else 0
        if not (d == group if kind == "tq" else d and group % d == 0):
            raise TqjaxError(f"quantized checkpoint: {name} needs a rotation whose dim "
                             f"{'is' if kind == 'tq' else 'divides'} its group {group}")
    return QuantizedLinear(packed=expect[".packed"], scale=expect[".scale"], lut=shared[lut_name],
                           offset=expect.get(".offset"), rotation=rotation, bits=bits,
                           group=group, in_features=k, kind=kind)


def _shared(tensors: dict[str, jax.Array]) -> dict[str, Any]:
    """Pop the shared luts and rotations: {"shared.lut.0": array, "shared.rotation.0": Rotation}."""
    out: dict[str, Any] = {}
    for name in sorted(t for t in tensors if t.startswith("shared.lut.")):
        out[name] = tensors.pop(name)
    for name in sorted(t for t in tensors if t.startswith("shared.rotation.") and
                       t.endswith(".signs")):
        base = name.removesuffix(".signs")
        out[base] = Rotation(signs=tensors.pop(name), matrix=tensors.pop(base + ".matrix", None))
    return out


# ---------------------------------------------------------------- config and tokenizer


def config_to_dict(config: ModelConfig) -> dict[str, Any]:
    return dataclasses.asdict(config)


def config_from_dict(raw: Any) -> ModelConfig:
    """Inverse of `config_to_dict`; bad content is a TqjaxError."""
    try:
        fields = dict(raw)
        scaling = fields.pop("rope_scaling", None)
        fields["eos_token_ids"] = tuple(fields.get("eos_token_ids", ()))
        return ModelConfig(**fields,
                           rope_scaling=None if scaling is None else RopeScaling(**scaling))
    except (TypeError, ValueError) as e:
        raise TqjaxError(f"{CONFIG_FILE} of the quantized checkpoint is invalid: {e}") from None


def _save_tokenizer(out: Path, tokenizer: Tokenizer | None, source: Path | None) -> None:
    """HF sources: copy their tokenizer files; otherwise save the rebuilt `tokenizers` backend
    and a tokenizer_config.json with the chat template, bos/eos and add_bos."""
    if source is not None and source.is_dir():
        for name in HF_TOKENIZER_FILES:
            if (source / name).is_file():
                shutil.copyfile(source / name, out / name)
        return
    if tokenizer is None:
        return
    if tokenizer.is_sentencepiece:
        raise TqjaxError("cannot save a sentencepiece tokenizer without its source directory")
    tokenizer.backend.save(str(out / "tokenizer.json"))
    token = tokenizer.backend.id_to_token
    cfg = {
        "chat_template": tokenizer.chat_template,
        "bos_token": None if tokenizer.bos_id is None else token(tokenizer.bos_id),
        "eos_token": token(tokenizer.eos_ids[0]) if tokenizer.eos_ids else None,
        "add_bos_token": tokenizer.add_bos,
    }
    (out / TOKENIZER_CONFIG).write_text(json.dumps(cfg, indent=1, ensure_ascii=False))


# ---------------------------------------------------------------- atomic directory writes


def write_dir_atomically(target: Path, fill: Callable[[Path], None]) -> None:
    """Create directory `target` by fill(tmp) on a temporary sibling, then swap it into place
    (`tqjax.atomic.replace_dir`). An existing quantized checkpoint (or empty directory) at
    `target` is replaced; any other existing path raises TqjaxError and is left untouched."""
    replace_dir(check_target(target), fill)


def check_target(target: Path) -> Path:
    """`target` (absolute) if a checkpoint may be written there: nothing, an empty directory
    or a quantized checkpoint (then replaced); any other existing path raises TqjaxError."""
    target = target.expanduser().absolute()
    if target.exists() and not (is_quantized_checkpoint(target) or
                                (target.is_dir() and not any(target.iterdir()))):
        raise TqjaxError(f"{target} exists and is not a quantized checkpoint; not overwriting it")
    return target


# ---------------------------------------------------------------- save / load


def save_quantized(out: Path, params: Params, config: ModelConfig, *, method: dict[str, Any],
                   tokenizer: Tokenizer | None = None, source: Path | None = None,
                   dense_dtype: str | None = None) -> dict[str, Any]:
    """Write a quantized checkpoint directory atomically; returns its quantization.json dict.

    method: what produced it (e.g. `dataclasses.asdict(WeightSpec)`), stored verbatim.
    dense_dtype: store dense tensors (embedding, norms, biases, a dense head) as this dtype
    ("float32", "bfloat16", "float16"; None keeps the params' dtype). The rope frequencies
    always stay f32.
    """
    from safetensors.flax import save_file

    cast = None if dense_dtype is None else resolve_dtype(dense_dtype, "dense dtype")
    tensors, tensor_meta = _to_tensors(params, cast)
    config = with_tokenizer_ends(config, tokenizer)
    meta = {
        "format": FORMAT,
        "format_version": FORMAT_VERSION,
        "architecture": config.arch,
        "method": method,
        "source": None if source is None else source_info(source),
        "dense_dtype": dense_dtype,
        "memory": params_bits(params),
        "tensors": tensor_meta,
    }

    def fill(tmp: Path) -> None:
        with safetensors_io(out / WEIGHTS_FILE):
            save_file(tensors, str(tmp / WEIGHTS_FILE), metadata={"format": FORMAT})
        (tmp / CONFIG_FILE).write_text(json.dumps(config_to_dict(config), indent=1))
        _save_tokenizer(tmp, tokenizer, source)
        files = list_files(tmp)
        meta["files"] = files
        n = meta["memory"]["params"]
        meta["disk"] = {"bytes": sum(f["size"] for f in files.values()),
                        "weights_bytes": files[WEIGHTS_FILE]["size"],
                        "weights_bpw": 8 * files[WEIGHTS_FILE]["size"] / n}
        (tmp / QUANT_FILE).write_text(json.dumps(meta, indent=1))

    write_dir_atomically(out, fill)
    return meta


def list_files(root: Path) -> dict[str, dict[str, Any]]:
    """{path relative to `root` ("state/manifest.ocdbt"): {"size": bytes, "sha256": hex}} for
    every file under `root`, sorted; what `verify_files` checks on load."""
    return {f.relative_to(root).as_posix(): dict(zip(("size", "sha256"), file_digest(f),
                                                     strict=True))
            for f in sorted(root.rglob("*")) if f.is_file()}


def verify_files(path: Path, files: Any, listing: str) -> None:  # noqa: ANN401 (JSON)
    """Every file in `files` (`list_files`'s dict, read from `listing`, a file in `path`)
    exists under `path` with its recorded size and sha256: a truncated, changed or missing
    file is one line before any of it is read."""
    if not isinstance(files, dict):
        raise TqjaxError(f"{path / listing}: bad 'files' entry")
    for name, info in files.items():
        rel = Path(name)
        if rel.is_absolute() or ".." in rel.parts or not isinstance(info, dict):
            raise TqjaxError(f"{path / listing}: bad entry for file {name}")
        f = path / rel
        if not f.is_file():
            raise TqjaxError(f"checkpoint {path} is missing {name}")
        size, digest = file_digest(f)
        if size != info.get("size"):
            raise TqjaxError(f"{f} has {size} bytes, expected {info.get('size')} "
                             f"(truncated or changed?)")
        if digest != info.get("sha256"):
            raise TqjaxError(f"{f} does not match its sha256 in {listing} (tampered or corrupt)")


def check_architecture(path: Path, meta: dict[str, Any], config: ModelConfig) -> None:
    """The architecture quantization.json states is one this tqjax runs and the one config.json
    describes (files written before the field existed are judged by config.json alone)."""
    arch = meta.get("architecture", config.arch)
    for value, where in ((arch, QUANT_FILE), (config.arch, CONFIG_FILE)):
        if value not in GGUF_ARCHITECTURES:
            raise TqjaxError(f"{path / where}: unknown architecture {value!r} (this tqjax runs "
                             f"{', '.join(GGUF_ARCHITECTURES)})")
    if arch != config.arch:
        raise TqjaxError(f"{path}: {QUANT_FILE} says architecture {arch!r} but {CONFIG_FILE} "
                         f"says {config.arch!r}")


def _dense_linear(name: str) -> bool:
    """Whether flat tensor `name` is a dense linear ("lm_head", "layers.{i}.w_up", ...; a
    quantized one is stored as "lm_head.packed", ...)."""
    parts = name.split(".")
    return name == "lm_head" or (len(parts) == 3 and parts[0] == "layers"
                                 and parts[2] in LINEARS)


def load_quantized(path: Path, dtype: str = "float32"
                   ) -> tuple[ModelConfig, Params, dict[str, Any]]:
    """Load a quantized checkpoint directory -> (config, params, quantization.json dict).

    Files are verified against their sha256 first. Dense tensors are cast to `dtype`
    ("float32", "bfloat16", "float16"; a dense linear of a half dtype comes as a
    `HalfLinear`); quantized tensors keep their stored types. Tensors
    are read, cast and placed one at a time, largest first.
    """
    jdtype = resolve_dtype(dtype)
    meta = read_json(path / QUANT_FILE)
    if not isinstance(meta, dict) or meta.get("format") != FORMAT:
        raise TqjaxError(f"{path / QUANT_FILE} is not a tqjax quantization file")
    if meta.get("format_version") != FORMAT_VERSION:
        raise TqjaxError(f"{path} has quantized format version {meta.get('format_version')}; "
                         f"this tqjax reads version {FORMAT_VERSION} (quantize it again)")
    if not isinstance(meta.get("tensors"), dict):
        raise TqjaxError(f"{path / QUANT_FILE} has no 'tensors' table")
    files = meta.get("files")
    if not isinstance(files, dict) or WEIGHTS_FILE not in files or CONFIG_FILE not in files:
        raise TqjaxError(f"{path / QUANT_FILE} does not list {WEIGHTS_FILE} and {CONFIG_FILE}")
    verify_files(path, files, QUANT_FILE)
    config = config_from_dict(read_json(path / CONFIG_FILE))
    check_architecture(path, meta, config)
    st = SafetensorsFile(path / WEIGHTS_FILE)
    keep = {"rope_inv_freq"} | {n + s for n in meta["tensors"] for s in QUANTIZED_PARTS}
    tensors = {name: st.place(name, None if name in keep or name.startswith("shared.") else jdtype,
                              output_major=jdtype in HALF_DTYPES and _dense_linear(name))
               for name in sorted(st.shapes, key=lambda n: -math.prod(st.shapes[n]))}
    shared = _shared(tensors)
    flat: dict[str, Any] = {name: _quantized(name, info, tensors, shared)
                            for name, info in meta["tensors"].items()}
    flat |= tensors
    return config, _unflatten(flat, config), meta
