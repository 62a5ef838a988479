"""A Hugging Face style checkpoint directory: config.json, safetensors shards (with or without an index),
tokenizer and other side files. Shared by every safetensors-based format.

Shards are opened lazily and one tensor is read at a time, so a model is never held whole. Every
failure names the file (and tensor) in a `BadInput`.
"""

from __future__ import annotations

import json
import os
import re
import warnings
from functools import cached_property
from pathlib import Path
from typing import Callable, Iterator

import torch

from ...converters.errors import BadInput
from ...converters.validate import json_kind, read_json as _read_json
from .safetensors_header import Descriptors, SafetensorsHeader, read_header, read_tensor
from ...converters.records import Dense, ModelSource, TensorRecord, renamed

__all__ = ["CheckpointDir", "CheckpointSource", "read_json", "SIDE_FILES", "dtype_name", "weight_files_ignored",
           "WEIGHT_SUFFIXES"]

# Files a converted model carries along when the target format keeps them next to its weights.
SIDE_FILES = (
    "tokenizer.json", "tokenizer_config.json", "tokenizer.model", "special_tokens_map.json",
    "vocab.json", "merges.txt", "added_tokens.json", "generation_config.json", "chat_template.jinja",
    "chat_template.json",
)


def read_json(path: Path) -> dict:
    """A JSON object from a checkpoint's file, bounded and checked (converters.validate)."""
    return _read_json(path)


# Files that hold weights of some kind. Those in a folder that are not part of the model are named
# (CheckpointDir.ignored), never read and never silently skipped.
WEIGHT_SUFFIXES = (".safetensors", ".bin", ".pt", ".pth", ".ckpt", ".pkl", ".gguf", ".uqff", ".h5", ".msgpack",
                   ".onnx", ".npz")
INDEX_SUFFIX = ".safetensors.index.json"

# Weight files Hub repositories carry beside the model, with what they are.
_KNOWN_EXTRAS = (
    (re.compile(r"adapter_model\.(safetensors|bin)"), "PEFT adapter weights, not the model's"),
    (re.compile(r"consolidated(\.\d+)?\.(safetensors|pth|pt)"),
     "Mistral's native-format copy of the weights (transformers does not read it)"),
    (re.compile(r"(pytorch|tf|flax)_model(-\d+-of-\d+)?\.(bin|h5|msgpack)"),
     "the pickle/TF/Flax copy of the weights (the safetensors are read)"),
    (re.compile(r"(training_args|optimizer|scheduler|scaler|rng_state.*)\.(bin|pt|pth)"), "training state"),
)
_BY_SUFFIX = {".gguf": "a GGUF model (read it as gguf)", ".uqff": "a UQFF shard (read the folder as uqff)",
              ".bin": "a pickle file, not read", ".pt": "a pickle file, not read", ".pth": "a pickle file, not read",
              ".ckpt": "a pickle file, not read", ".pkl": "a pickle file, not read"}
_MAX_NAMED = 6  # candidates a one-line message names before "and N more"


def _listing(names) -> str:
    names = list(names)
    shown = ", ".join(names[:_MAX_NAMED])
    return shown + (f" and {len(names) - _MAX_NAMED} more" if len(names) > _MAX_NAMED else "")


def _known_extra(name: str) -> str | None:
    for pattern, reason in _KNOWN_EXTRAS:
        if pattern.fullmatch(name):
            return reason
    return None


def _plain_file_name(name: object) -> bool:
    """A file name directly inside the folder: no directory part, no `..`, not absolute."""
    return (isinstance(name, str) and name not in ("", ".", "..") and "/" not in name and "\\" not in name
            and "\0" not in name and os.path.basename(name) == name)


def weight_files_ignored(folder: Path, used, reason_for_safetensors: str = "not part of the model") -> dict[str, str]:
    """{file name: why} for every weight-like file directly in `folder` that is not in `used`."""
    folder, used = Path(folder), set(used)
    ignored = {}
    for entry in sorted(folder.iterdir(), key=lambda p: p.name):
        name = entry.name
        if name in used or not name.lower().endswith(WEIGHT_SUFFIXES) or not entry.is_file():
            continue
        reason = _known_extra(name) or _BY_SUFFIX.get(Path(name).suffix.lower())
        ignored[name] = reason or reason_for_safetensors
    return ignored


class CheckpointDir:
    """The safetensors files that make the model in a directory, and the map from tensor name to file.

    Which files make the model is decided as the loaders of the ecosystem decide it, so that a Hub folder
    with other weights beside the model (a PEFT adapter, Mistral's consolidated.safetensors, pickles, GGUF
    copies) converts exactly like the clean folder:

    - transformers (modeling_utils._get_resolved_checkpoint_files, 5.x): config.json's `transformers_weights`
      when given; else model.safetensors; else model.safetensors.index.json, and then only the files its
      weight_map names. Every tensor those files hold is loaded (the index selects files, not tensors).
    - gptqmodel 7.6 (utils.model.get_checkpoints), for a GPTQ/QQQ config with bits and group_size: the first
      of gptq_model-{bits}bit-{group_size}g and model, each as `<base>.safetensors.index.json` before
      `<base>.safetensors`. AutoGPTQ named its file by quantize_config.json's `model_file_base_name`.
    - When these pick different files the folder is refused, naming them; when none applies, a single
      .safetensors file (other than the known extras) is the model, and several are refused as ambiguous.

    Weight-like files that are not part of the model are listed in `ignored` ({file name: reason}).
    """

    def __init__(self, path: Path):
        self._fds = Descriptors()  # of the shards, for reading tensors
        self.path = Path(path)
        if not self.path.is_dir():
            raise BadInput("not a directory (expected a checkpoint folder)", path=self.path)
        self.index: Path | None = None
        self.weight_map: dict[str, str] | None = None
        self.shards, self.chosen_by = self._choose()
        self._keys: dict[str, list[str]] = {}
        self._headers: dict[str, SafetensorsHeader] = {}
        self.location: dict[str, str] = {}
        for shard in self.shards:
            # our own check of the header first (sizes against the file, in our words); the names in
            # sorted order, as safe_open lists them
            self._headers[shard] = read_header(self.path / shard)
            keys = sorted(self._headers[shard].tensors)
            self._keys[shard] = keys
            for k in keys:
                if k in self.location:
                    raise BadInput(f"tensor also stored in {self.location[k]}", path=self.path / shard, tensor=k)
                self.location[k] = shard
        if self.weight_map is not None:
            self._check_index_against_shards()
        if self.index is not None:
            other = f"not named in {self.index.name}"
        else:
            other = f"not part of the model ({self.chosen_by})"
        used = set(self.shards) | ({self.index.name} if self.index is not None else set())
        self.ignored: dict[str, str] = weight_files_ignored(self.path, used, other)
        for extra in sorted(self.path.glob("*" + INDEX_SUFFIX)):
            if extra.name not in used and extra.is_file():
                self.ignored[extra.name] = f"index not used ({self.chosen_by})"
        self._handles: dict[str, object] = {}

    # -- which files make the model -----------------------------------------------------------------
    def _choose(self) -> tuple[list[str], str]:
        """(shard names, the rule that chose them); sets self.index / self.weight_map for an index."""
        picks: dict[tuple[str, ...], list[str]] = {}  # the files -> the loaders that pick them
        sets: dict[tuple[str, ...], tuple[str, Path | None]] = {}
        for loader, found in self._loader_picks():
            if found is None:
                continue
            label, index, shards = found
            key = tuple(sorted(shards))
            picks.setdefault(key, []).append(f"{loader} reads {label}")
            sets.setdefault(key, (shards, index, label))
        if len(picks) > 1:
            raise BadInput("which files hold the model is ambiguous: " + "; ".join(
                ", ".join(v) for v in picks.values()) + "; remove the copy that is not the model", path=self.path)
        if picks:
            (key, who), = picks.items()
            shards, index, label = sets[key]
            if index is not None:
                self.index = index
                self.weight_map = self._index_maps[index]
            return shards, " and ".join(w.split(" reads ")[0] for w in who) + f" read {label}"
        candidates = sorted(p.name for p in self.path.glob("*.safetensors")
                            if p.is_file() and _known_extra(p.name) is None)
        if len(candidates) == 1:
            return candidates, f"{candidates[0]} is the only .safetensors file"
        if candidates:
            raise BadInput(f"no model.safetensors and no model.safetensors.index.json, and several files could "
                           f"hold the model: {_listing(candidates)}; write an index naming the shards, or keep "
                           "only the model's files", path=self.path)
        extras = sorted(p.name for p in self.path.glob("*.safetensors") if p.is_file())
        if extras:
            raise BadInput(f"no model weights: {_listing(extras)} is not the model "
                           f"({_known_extra(extras[0])}) and there is no model.safetensors", path=self.path)
        raise BadInput("no .safetensors files found", path=self.path)

    def _loader_picks(self):
        """(loader, (label, index path or None, shard names) or None) for each loader that reads this folder."""
        self._index_maps: dict[Path, dict[str, str]] = {}
        cfg_path = self.path / "config.json"
        cfg = _json_or_none(cfg_path)
        explicit = cfg.get("transformers_weights") if cfg else None
        if explicit is not None:
            ok = _plain_file_name(explicit) and (explicit.endswith(".safetensors") or explicit.endswith(INDEX_SUFFIX))
            if not ok:
                raise BadInput(f"transformers_weights is {explicit!r}: expected a .safetensors or "
                               f"{INDEX_SUFFIX} file name inside the folder", path=cfg_path)
            if explicit.endswith(INDEX_SUFFIX):
                yield "transformers", self._from_index(self.path / explicit, required=True)
            else:
                yield "transformers", self._from_file(self.path / explicit, required=True)
        else:
            yield "transformers", self._from_file(self.path / "model.safetensors") or self._from_index(
                self.path / ("model" + INDEX_SUFFIX))
        qc, qc_path = _quant_config_and_file(self.path, cfg)
        if not qc:
            return
        base = qc.get("model_file_base_name")
        if base is not None:
            if not _plain_file_name(base):
                raise BadInput(f"model_file_base_name is {base!r}: expected a file name inside the folder "
                               "(without .safetensors)", path=qc_path)
            yield "AutoGPTQ", self._from_base(base)
        bits, group = qc.get("bits"), qc.get("group_size")
        method = str(qc.get("quant_method", qc.get("method", "gptq"))).lower()
        if method in ("gptq", "qqq") and type(bits) is int and type(group) is int:
            yield "gptqmodel", (self._from_base(f"gptq_model-{bits}bit-{group}g") or self._from_base("model"))

    def _from_base(self, base: str):
        return self._from_index(self.path / (base + INDEX_SUFFIX)) or self._from_file(self.path / (base + ".safetensors"))

    def _from_file(self, path: Path, required: bool = False):
        if path.is_file():
            return path.name, None, [path.name]
        if required:
            raise BadInput("file named by config.json transformers_weights is missing", path=path)
        return None

    def _from_index(self, index: Path, required: bool = False):
        if not index.is_file():
            if required:
                raise BadInput("file named by config.json transformers_weights is missing", path=index)
            return None
        if index not in self._index_maps:
            self._index_maps[index] = self._read_index(index)
        weight_map = self._index_maps[index]
        shards = list(dict.fromkeys(weight_map.values()))
        return f"{index.name} ({_listing(shards)})", index, shards

    def _read_index(self, index: Path) -> dict[str, str]:
        """The index's weight_map, checked: {tensor name: plain .safetensors file name in this folder}."""
        data = read_json(index)
        weight_map = data.get("weight_map")
        if not isinstance(weight_map, dict) or not weight_map:
            found = "missing" if weight_map is None else f"{json_kind(weight_map)}"
            raise BadInput(f"weight_map is {found}: expected an object mapping tensor names to shard files",
                           path=index)
        if data.get("metadata") is not None and not isinstance(data["metadata"], dict):
            raise BadInput(f"metadata is {json_kind(data['metadata'])}: expected a JSON object", path=index)
        duplicate = _duplicate_weight_map_key(index)
        if duplicate is not None:
            raise BadInput("listed twice in weight_map", path=index, tensor=duplicate)
        checked: set[str] = set()
        for tensor, shard in weight_map.items():
            if not tensor:
                raise BadInput("weight_map has an empty tensor name", path=index)
            if not isinstance(shard, str):  # first: a list is not hashable for the set below
                raise BadInput(f"weight_map value is {json_kind(shard)}: expected a shard file name", path=index,
                               tensor=tensor)
            if shard in checked:
                continue
            if not _plain_file_name(shard) or not shard.endswith(".safetensors"):
                raise BadInput(f"weight_map names shard {shard[:80]!r}: expected a .safetensors file name inside "
                               "the folder (no directories, no ..)", path=index, tensor=tensor)
            where = self.path / shard
            if where.is_dir():
                raise BadInput(f"shard named in {index.name} is a directory", path=where)
            if not where.is_file():
                raise BadInput(f"shard named in {index.name} is missing", path=where)
            checked.add(shard)
        return weight_map

    def _check_index_against_shards(self) -> None:
        """transformers loads every tensor of the files the index names, wherever the index places it: so a
        tensor the index lists but no file holds is missing (refused: transformers would leave that weight
        randomly initialised), and tensors placed elsewhere or not listed are read, with one warning."""
        weight_map, index = self.weight_map, self.index
        moved = []
        for tensor, shard in weight_map.items():
            if self.location.get(tensor) != shard:
                if tensor not in self.location:
                    raise BadInput(f"listed in {index.name} (in {shard}) but no shard holds it", path=index,
                                   tensor=tensor)
                moved.append(tensor)
        unlisted = [k for k in self.location if k not in weight_map]
        if moved or unlisted:
            parts = []
            if unlisted:
                parts.append(f"{len(unlisted)} tensor(s) the index does not list (e.g. {unlisted[0]})")
            if moved:
                parts.append(f"{len(moved)} tensor(s) in another shard than it says (e.g. {moved[0]} is in "
                             f"{self.location[moved[0]]})")
            warnings.warn(f"{index}: the shards hold {' and '.join(parts)}; read as the shards hold them, "
                          "as transformers does", stacklevel=3)

    def keys(self, shard: str) -> list[str]:
        return self._keys[shard]

    def __contains__(self, name: str) -> bool:
        return name in self.location

    def shape(self, name: str) -> tuple[int, ...]:
        return self._headers[self.location[name]].tensors[name].shape

    def dtype(self, name: str) -> str:
        return self._headers[self.location[name]].tensors[name].dtype

    def get(self, name: str, outer: int | None = None) -> torch.Tensor:
        """A tensor, or with `outer` only that index of its first dimension (read_tensor)."""
        if name not in self.location:
            raise BadInput("tensor not found in any shard", path=self.path, tensor=name)
        shard = self.location[name]
        return read_tensor(self._headers[shard], name, self._fds.fd(self.path / shard), outer)

    def close(self) -> None:
        self._fds.close()

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
                first = found[min(found)]  # the file holding the partners (the first of them, by part name)
                raise BadInput(f"{', '.join(sorted(found))} without {primary}", path=self.file_of(first), tensor=prefix)
        return modules

    def require_parts(self, prefix: str, found: dict[str, str], primary: str, needed: tuple[str, ...]) -> None:
        """A module's `primary` tensor needs each of `needed` beside it (a qweight its qzeros and scales): the
        first one missing is a BadInput naming it, in the file of the primary."""
        for part in needed:
            if part not in found:
                raise BadInput(f"{primary} without {part}", path=self.file_of(found[primary]), tensor=f"{prefix}.{part}")

    def side_files(self) -> dict[str, Path]:
        return {n: self.path / n for n in SIDE_FILES if (self.path / n).exists()}


def dtype_name(safetensors_dtype: str) -> str:
    """safetensors' dtype tag ("F16") -> torch's name ("float16"), as records carry it."""
    return {"F16": "float16", "BF16": "bfloat16", "F32": "float32", "F64": "float64", "I32": "int32",
            "I64": "int64", "I8": "int8", "U8": "uint8", "BOOL": "bool"}.get(safetensors_dtype, safetensors_dtype.lower())



def _json_or_none(path: Path) -> dict | None:
    """A folder's JSON file for choosing the model files: absent -> None (the reader that needs it says so)."""
    return read_json(path) if path.is_file() else None


def _quant_config_and_file(folder: Path, cfg: dict | None) -> tuple[dict | None, Path]:
    """config.json's quantization_config, else quantize_config.json (as the GPTQ readers take it)."""
    qc = (cfg or {}).get("quantization_config")
    if isinstance(qc, dict) and qc:
        return qc, folder / "config.json"
    qfile = folder / "quantize_config.json"
    if qfile.is_file():
        return read_json(qfile), qfile
    return None, qfile


def _duplicate_weight_map_key(index: Path) -> str | None:
    """A tensor name written twice in the index's weight_map (json keeps the last one silently). The text was
    bounded and checked by read_json already."""
    seen_twice: dict[int, str] = {}

    def pairs_hook(pairs):
        obj = dict(pairs)
        if len(obj) != len(pairs):
            counts: dict[str, int] = {}
            for k, _ in pairs:
                counts[k] = counts.get(k, 0) + 1
            seen_twice[id(obj)] = next(k for k, n in counts.items() if n > 1)
        return obj

    data = json.loads(index.read_bytes().decode("utf-8"), object_pairs_hook=pairs_hook)
    return seen_twice.get(id(data.get("weight_map")))


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


# config.json classes saved in DeepSeek's own release layout (its names, `.scale` E8M0 exponents beside FP4 and FP8
# weights, quantization_config fp8): the hf reader reads them (formats/hf/deepseek_v4.py), whatever their
# quantization_config says, and the fp8 reader, which knows DeepSeek-V3's `weight_scale_inv`, leaves them to it
RELEASE_LAYOUT_CLASSES = ("DeepseekV4ForCausalLM",)


def release_layout_of(path: Path) -> bool:
    """Whether a checkpoint folder's config.json names a class saved in its release layout (RELEASE_LAYOUT_CLASSES)."""
    path = Path(path)
    if not (path.is_dir() and (path / "config.json").exists()):
        return False
    try:
        archs = read_json(path / "config.json").get("architectures") or []
    except (BadInput, AttributeError):
        return False
    return isinstance(archs, list) and any(a in RELEASE_LAYOUT_CLASSES for a in archs if isinstance(a, str))


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
    return qc if isinstance(qc, dict) else None  # not an object: for the reader to refuse, naming the key


class CheckpointSource(ModelSource):
    """What every reader of a safetensors checkpoint folder shares: its `ckpt` (a CheckpointDir) gives the
    side files to carry, the files the tensors come from and the weight files it ignores."""

    ckpt: CheckpointDir

    def side_files(self) -> dict[str, Path]:
        return self.ckpt.side_files()

    def weight_files(self) -> list[str]:
        return list(self.ckpt.shards)

    @property
    def ignored_files(self) -> dict[str, str]:
        """Weight files in the folder that are not part of the model, with why (CheckpointDir.ignored)."""
        return self.ckpt.ignored

    # -- names ----------------------------------------------------------------------------------------------
    # A quantized checkpoint may be saved under other names than its model's transformers class loads: DeepSeek-V4
    # quantized from its release-named float folder (auto-round's model-free mode, llm-compressor) keeps the
    # release's `head.weight`, `layers.N.attn.wq_a.qweight` (formats/common/release_names.py quantized_release_names).
    # Read as they are, the head is not found ("the checkpoint has no output head") and no writer knows the names.
    # The readers that group a grid's parts by module (gptq, auto-round, compressed-tensors) keep grouping them under
    # the stored module name, so the parts stay together whatever the naming; the one record of a module
    # (`<module>.weight`) and every dense tensor are renamed here, where each of those readers yields its records,
    # to the class's names (the hf reader's for the float release), the stored name kept as the record's
    # source_name for messages. The config's module names (ignore lists, per-layer overrides) are matched under
    # either naming (`module_names`): a producer writes them as it saw the modules.
    @cached_property
    def _rename(self) -> Callable[[str], str] | None:
        from .release_names import quantized_release_names

        return quantized_release_names(getattr(self, "config", None), self.ckpt.location)

    def model_name(self, name: str) -> str:
        """A stored tensor's name as the model's class names it (itself unless the checkpoint is renamed)."""
        return self._rename(name) if self._rename else name

    def model_module(self, prefix: str) -> str:
        """A stored module's name as the model's class names it (`head` -> `lm_head`)."""
        return self._rename(prefix + ".weight")[: -len(".weight")] if self._rename else prefix

    def module_names(self, prefix: str) -> tuple[str, ...]:
        """The names a quantization config may give a stored module: the stored one, and the class's if it differs."""
        model = self.model_module(prefix)
        return (prefix,) if model == prefix else (prefix, model)

    def model_record(self, rec: TensorRecord) -> TensorRecord:
        """A record under the class's name, the stored one kept as its source_name."""
        if not self._rename:
            return rec
        name = self._rename(rec.name)
        return rec if name == rec.name else renamed(rec, name=name, source_name=rec.source_name or rec.name)

    def module_records(self, modules: dict[str, dict[str, str]], primary: str,
                       grid_record: Callable[[str, str], TensorRecord]) -> Iterator[TensorRecord]:
        """Every tensor of the folder in file order, shard by shard: a quantized module (`modules`: prefix ->
        part -> tensor name, CheckpointDir.group_modules) as the one record `grid_record(prefix, shard)` makes
        where its `primary` part stands, its other parts consumed by it; every other tensor dense, its shape
        checked against the config (`self.shapes`, a ModelShapes); each under the class's name (model_record)."""
        consumed = {n for parts in modules.values() for p, n in parts.items() if p != primary}
        for shard in self.ckpt.shards:
            for name in self.ckpt.keys(shard):
                if name in consumed:
                    continue
                prefix, _, part = name.rpartition(".")
                if part == primary and prefix in modules:
                    yield self.model_record(grid_record(prefix, shard))
                else:
                    yield self.checked_dense_record(name, shard)

    def checked_dense_record(self, name: str, shard: str) -> TensorRecord:
        """A tensor stored as it is: its dtype and shape checked against the config (`self.shapes`, under the
        class's name, an error naming the stored one too), its record under the class's name (model_record)."""
        self.shapes.check_dense(self.model_name(name), self.ckpt.shape(name), self.ckpt.path / shard,
                                self.ckpt.dtype(name), stored=name)
        return self.model_record(self.ckpt.dense_record(name, shard))
