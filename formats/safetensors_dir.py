"""A Hugging Face style checkpoint directory: config.json, safetensors shards (with or without an index),
tokenizer and other side files. Shared by every safetensors-based format.

Shards are opened lazily and one tensor is read at a time, so a model is never held whole. Every
failure names the file (and tensor) in a `BadInput`.
"""

from __future__ import annotations

import json
from pathlib import Path

import torch
from safetensors import safe_open

from ..converters.errors import BadInput
from ..converters.validate import read_json as _read_json
from ..converters.records import Dense, TensorRecord

__all__ = ["CheckpointDir", "read_json", "SIDE_FILES", "dtype_name"]

# Files a converted model carries along when the target format keeps them next to its weights.
SIDE_FILES = (
    "tokenizer.json", "tokenizer_config.json", "tokenizer.model", "special_tokens_map.json",
    "vocab.json", "merges.txt", "added_tokens.json", "generation_config.json", "chat_template.jinja",
    "chat_template.json",
)


def read_json(path: Path) -> dict:
    """A JSON object from a checkpoint's file, bounded and checked (converters.validate)."""
    return _read_json(path)


class CheckpointDir:
    """The safetensors shards of a directory and the map from tensor name to shard."""

    def __init__(self, path: Path):
        self.path = Path(path)
        if not self.path.is_dir():
            raise BadInput("not a directory (expected a checkpoint folder)", path=self.path)
        index = self.path / "model.safetensors.index.json"
        if index.exists():
            weight_map = read_json(index).get("weight_map")
            if not isinstance(weight_map, dict) or not weight_map:
                raise BadInput("index has no weight_map", path=index)
            self.shards = list(dict.fromkeys(weight_map.values()))
            for shard in self.shards:
                if not (self.path / shard).exists():
                    raise BadInput("shard named in the index is missing", path=self.path / shard)
        else:
            self.shards = sorted(p.name for p in self.path.glob("*.safetensors"))
            if not self.shards:
                raise BadInput("no .safetensors files found", path=self.path)
        self._keys: dict[str, list[str]] = {}
        self.location: dict[str, str] = {}
        for shard in self.shards:
            keys = self._open(shard, lambda f: list(f.keys()))
            self._keys[shard] = keys
            for k in keys:
                if k in self.location:
                    raise BadInput(f"tensor also stored in {self.location[k]}", path=self.path / shard, tensor=k)
                self.location[k] = shard
        self._handles: dict[str, object] = {}

    def _open(self, shard: str, fn):
        path = self.path / shard
        try:
            with safe_open(str(path), framework="pt") as f:
                return fn(f)
        except BadInput:
            raise
        except Exception as e:  # SafetensorError: truncated, corrupt header, bad offsets
            raise BadInput(f"cannot read safetensors file ({_one_line(e)})", path=path) from None

    def keys(self, shard: str) -> list[str]:
        return self._keys[shard]

    def __contains__(self, name: str) -> bool:
        return name in self.location

    def shape(self, name: str) -> tuple[int, ...]:
        return tuple(self._open(self.location[name], lambda f: f.get_slice(name).get_shape()))

    def dtype(self, name: str) -> str:
        return self._open(self.location[name], lambda f: f.get_slice(name).get_dtype())

    def get(self, name: str) -> torch.Tensor:
        if name not in self.location:
            raise BadInput("tensor not found in any shard", path=self.path, tensor=name)
        shard = self.location[name]
        try:
            with safe_open(str(self.path / shard), framework="pt") as f:
                return f.get_tensor(name)
        except Exception as e:
            raise BadInput(f"cannot read tensor ({_one_line(e)})", path=self.path / shard, tensor=name) from None

    def file_of(self, name: str) -> Path:
        return self.path / self.location[name]

    def dense_record(self, name: str, shard: str) -> TensorRecord:
        """A tensor that passes through as it is, read when the record is loaded."""
        return TensorRecord(name, self.shape(name), dtype_name(self.dtype(name)),
                            lambda: Dense(self.get(name)), source_file=shard)

    def group_modules(self, parts: tuple[str, ...], primary: str) -> dict[str, dict[str, str]]:
        """{module prefix: {part: tensor name}} for tensors named `<prefix>.<part>`; a module with
        partner tensors but no `primary` one (a qzeros without its qweight) is a BadInput."""
        modules: dict[str, dict[str, str]] = {}
        for name in self.location:
            prefix, _, part = name.rpartition(".")
            if part in parts:
                modules.setdefault(prefix, {})[part] = name
        for prefix, found in modules.items():
            if primary not in found:
                raise BadInput(f"{', '.join(sorted(found))} without {primary}", path=self.path, tensor=prefix)
        return modules

    def side_files(self) -> dict[str, Path]:
        return {n: self.path / n for n in SIDE_FILES if (self.path / n).exists()}


def dtype_name(safetensors_dtype: str) -> str:
    """safetensors' dtype tag ("F16") -> torch's name ("float16"), as records carry it."""
    return {"F16": "float16", "BF16": "bfloat16", "F32": "float32", "F64": "float64", "I32": "int32",
            "I64": "int64", "I8": "int8", "U8": "uint8", "BOOL": "bool"}.get(safetensors_dtype, safetensors_dtype.lower())


def _one_line(e: Exception) -> str:
    return " ".join(str(e).split()) or type(e).__name__


class ShardWriter:
    """Writes tensors into numbered safetensors shards as they come, holding at most one shard in memory.

    Shards are named `model.safetensors` (one) or `model-0000i-of-0000n.safetensors` plus an index,
    like `save_pretrained`; the final names are given in `close()`, once the count is known.
    """

    def __init__(self, path: Path, max_shard_bytes: int = 2 * 1024**3):
        self.path = Path(path)
        self.max_shard_bytes = max_shard_bytes
        self.buffer: dict[str, torch.Tensor] = {}
        self.buffer_bytes = 0
        self.shards: list[list[str]] = []

    def put(self, name: str, tensor: torch.Tensor) -> None:
        if name in self.buffer or any(name in s for s in self.shards):
            raise ValueError(f"duplicate tensor name {name}")
        nbytes = tensor.numel() * tensor.element_size()
        if self.buffer and self.buffer_bytes + nbytes > self.max_shard_bytes:
            self._flush()
        self.buffer[name] = tensor.contiguous()
        self.buffer_bytes += nbytes

    def _flush(self) -> None:
        if not self.buffer:
            return
        from safetensors.torch import save_file

        save_file(self.buffer, str(self.path / f".shard-{len(self.shards) + 1:05d}"), metadata={"format": "pt"})
        self.shards.append(list(self.buffer))
        self.buffer, self.buffer_bytes = {}, 0

    def close(self) -> dict[str, str]:
        self._flush()
        total = len(self.shards)
        weight_map = {}
        for i, names in enumerate(self.shards, start=1):
            final = "model.safetensors" if total == 1 else f"model-{i:05d}-of-{total:05d}.safetensors"
            (self.path / f".shard-{i:05d}").rename(self.path / final)
            weight_map.update({n: final for n in names})
        if total > 1:
            index = {"metadata": {}, "weight_map": weight_map}
            (self.path / "model.safetensors.index.json").write_text(json.dumps(index, indent=2) + "\n")
        return weight_map


def copy_side_files(source, out_dir: Path) -> None:
    for name, src in source.side_files().items():
        (Path(out_dir) / name).write_bytes(Path(src).read_bytes())


def write_json(path: Path, data: dict) -> None:
    Path(path).write_text(json.dumps(data, indent=2) + "\n")


def quantization_config_of(path: Path) -> dict | None:
    """The quantization config of a checkpoint folder ({} for a dense one), None if it is not one."""
    path = Path(path)
    if not (path.is_dir() and (path / "config.json").exists()):
        return None
    try:
        cfg = read_json(path / "config.json")
    except BadInput:
        return None
    qc = cfg.get("quantization_config") or {}
    if not qc and (path / "quantize_config.json").exists():
        try:
            qc = read_json(path / "quantize_config.json")
        except BadInput:
            return None
    return qc
