"""UQFF reader: a mistral.rs model directory (`<stem>-N.uqff` shards + residual.safetensors + config and
tokenizer files) as tensor records.

Every shard is a safetensors file; all shards of a set share one namespace (a layer's sub-tensors may sit
in different shards). The version tensors `uqff.version.{major,minor,patch}` (U32 scalars, in some shard)
decide whether we can read it: major 1, minor up to READER_MINOR. Layers become records named
`<key>.weight`: GGUF blocks as `Grid`s carrying their bytes (`PackedCodes(layout="ggml:<TYPE>")`, so a GGUF
or UQFF writer of the same type copies blocks), HQQ as axis-0 grids, AFQ as min-form grids (or integer
zero points when the biases provably sit on the integer grid), FP8 / F8Q8 / MXFP4 / Unquant as `Dense`
float tensors decoded as mistral.rs decodes them. `<key>.bias` and the residual tensors are `Dense`.
Shards are opened lazily and one layer is read at a time.

Stacked experts (`<block>.experts.{gate,up,down}_proj`, weight `[E, out, in]`, formats/uqff/moe.py) are read
as E per-expert 2-D layers under the names transformers saves (`<block>.experts.<e>.gate_proj.weight`,
Mixtral's `experts.<e>.w1.weight`): each expert's tensors are views of the stacked ones (its slab of the
stacked weight and metadata, the shared scalars as they are), so every family's decoding runs unchanged on
them; the stacked layer being read is kept in memory until the next one is asked for.
"""

from __future__ import annotations

import re
from pathlib import Path
from typing import Iterator

import torch

from ...converters.errors import BadInput
from ...converters.records import Dense, Grid, GridParams, PackedCodes, TensorRecord
from ...kernels.ggml.kblocks import K_ZERO_POINT, unpack_k_blocks
from ...kernels.floatq import element_table, unpack_fp4
from ...kernels.ggml.layouts import LAYOUTS
from ...kernels.ggml.legacy import unpack_blocks
from ...kernels.hqq import axis0_expand
from ...converters.model_shapes import ModelShapes, layer_index
from ..common.checkpoint import SIDE_FILES, read_json
from ..common.safetensors_header import Descriptors, read_header, read_tensor
from .moe import STACKABLE_FAMILIES, canonical_expert_name, expected_shape, layer_weights, moe_model
from .layout import (AFQ_BITS, AFQ_GROUPS, EXTRA_BLOCKS, FAMILY_OF_TAG, FP8_DTYPE_CODE, GGML_NAME_OF_ID, MAJOR,
                     READER_MINOR, decode_f8q8, decode_q8_1, decode_q8_k, hqq_halves_unpack,
                     unpack_afq)
from ...converters.records import ModelSource

__all__ = ["UqffSource", "open_uqff", "shard_set", "is_uqff_file"]

_SHARD_RE = re.compile(r"^(?P<stem>.+)-(?P<no>\d+)\.uqff$")
_VERSION_KEYS = ("uqff.version.major", "uqff.version.minor", "uqff.version.patch")
_TORCH_NAME = {torch.float32: "float32", torch.float16: "float16", torch.bfloat16: "bfloat16"}


def is_uqff_file(path: Path) -> bool:
    """A safetensors file whose header names the UQFF version tensors or a `.weight.format` layer tag."""
    path = Path(path)
    try:
        with open(path, "rb") as f:
            n = int.from_bytes(f.read(8), "little")
            if not 2 <= n <= 100_000_000:
                return False
            head = f.read(n)
    except OSError:
        return False
    return b'"uqff.version.major"' in head or b'.weight.format"' in head


def shard_set(path: Path) -> list[Path]:
    """The shards to read, as mistral.rs finds them. A `<stem>-<N>.uqff` file expands to its contiguous set
    `<stem>-0.uqff, <stem>-1.uqff, ...`; any other `.uqff` name is one file as it is. A directory must hold
    one such set: the files named `<stem>-<N>.uqff` (hidden files and other names beside a set are not
    part of it and are left alone), or else a single `.uqff` file. A gap in the numbering (a missing
    shard) is refused: the layers it held would be missing."""
    path = Path(path)
    if path.is_dir():
        files = sorted(p for p in path.glob("*.uqff") if p.is_file() and not p.name.startswith("."))
        if not files:
            raise BadInput("no .uqff file in this directory", path=path)
        sets: dict[str, list[Path]] = {}
        for p in files:
            m = _SHARD_RE.match(p.name)
            if m:
                sets.setdefault(m["stem"], []).append(p)
        if len(sets) > 1:
            stems = sorted(sets)
            raise BadInput(f"several UQFF sets here ({', '.join(stems[:6])}); name one, e.g. "
                           f"{path / (stems[0] + '-0.uqff')}", path=path)
        if sets:
            (stem, members), = sets.items()
            return _contiguous(path / f"{stem}-0.uqff", stem, members)
        if len(files) > 1:
            raise BadInput(f"several .uqff files here and none named <stem>-<N>.uqff "
                           f"({', '.join(p.name for p in files[:6])}); name one", path=path)
        return files
    if not path.is_file():
        raise BadInput("no such file", path=path)
    m = _SHARD_RE.match(path.name)
    if not m:
        return [path]
    members = [p for p in path.parent.glob("*.uqff") if p.is_file() and _stem_of(p) == m["stem"]]
    return _contiguous(path, m["stem"], members)


def _stem_of(p: Path) -> str | None:
    m = _SHARD_RE.match(p.name)
    return m["stem"] if m else None


def _contiguous(named: Path, stem: str, members: list[Path]) -> list[Path]:
    """`<stem>-0.uqff` .. `<stem>-<k>.uqff` with no gap; every other member of the stem is an error."""
    folder = named.parent
    shards, i = [], 0
    while (folder / f"{stem}-{i}.uqff").is_file():
        shards.append(folder / f"{stem}-{i}.uqff")
        i += 1
        if i > len(members):
            break
    if not shards:
        raise BadInput(f"{stem}-0.uqff is missing: a UQFF set starts at shard 0", path=named)
    stray = sorted(p.name for p in members if p not in shards)
    if stray:
        raise BadInput(f"not part of the contiguous set {stem}-0.uqff .. {shards[-1].name} (mistral.rs reads "
                       f"{stem}-0, -1, ... up to the first missing number, {stem}-{i}.uqff); a shard is "
                       "missing or misnamed", path=folder / stray[0])
    if named not in shards:
        raise BadInput(f"shard set {stem}-0.uqff .. is not contiguous up to this file", path=named)
    _check_report(shards)
    return shards


def _check_report(shards: list[Path]) -> None:
    """mistral.rs' uqff_report.json, when present, lists each output's shards and mistral.rs holds the folder
    to it: a shard it lists for this set that is not there is refused (its layers would be missing)."""
    report = shards[0].parent / "uqff_report.json"
    if not report.is_file():
        return
    outputs = read_json(report).get("outputs")
    names = [p.name for p in shards]
    for output in outputs if isinstance(outputs, list) else []:
        listed = output.get("shards") if isinstance(output, dict) else None
        if not isinstance(listed, list) or not all(isinstance(x, str) for x in listed):
            continue
        if set(listed) & set(names) and listed != names:
            missing = [x for x in listed if x not in names]
            if missing:
                raise BadInput(f"missing: {report.name} lists it among this set's shards ({', '.join(listed[:6])})",
                               path=shards[0].parent / Path(missing[0]).name)


class _Shards:
    """The merged namespace of a shard set: tensor name -> shard, with lazy single-tensor reads."""

    def __init__(self, shards: list[Path]):
        self.shards = shards
        self._fds = Descriptors()
        self.location: dict[str, Path] = {}
        self.order: list[str] = []
        # each header checked in our own words first (formats/common/safetensors_header.py); names sorted, as
        # safe_open lists them
        self.headers = {shard: read_header(shard) for shard in shards}
        self.views: dict[str, tuple[str, str, int, int]] = {}  # view -> (stacked tensor, how, expert, experts)
        self._stack_layer, self._stack_tensors = None, {}  # the stacked layer being read, its tensors
        for shard in shards:
            for name in sorted(self.headers[shard].tensors):
                if name in self.location and not name.startswith("uqff.version."):
                    raise BadInput(f"duplicate tensor key (also in {self.location[name].name})", path=shard,
                                   tensor=name)
                if name not in self.location:
                    self.order.append(name)
                self.location.setdefault(name, shard)

    def __contains__(self, name: str) -> bool:
        return name in self.location

    def get(self, name: str) -> torch.Tensor:
        if name in self.views:
            return self._view(name)
        shard = self.location.get(name)
        if shard is None:
            raise BadInput("tensor not found in any shard", path=self.shards[0], tensor=name)
        return read_tensor(self.headers[shard], name, self._fds.fd(shard))

    def meta(self, name: str) -> tuple[str, list[int]]:
        if name in self.views:
            real, how, _, experts = self.views[name]
            dtype, shape = self.meta(real)
            return dtype, _view_shape(how, shape, experts)
        entry = self.headers[self.location[name]].tensors[name]
        return entry.dtype, list(entry.shape)

    # -- one expert's view of a stacked layer's tensor ---------------------------------------------------
    def add_view(self, name: str, real: str, how: str, expert: int, experts: int) -> None:
        """`name` reads as expert `expert`'s part of `real`: "stack" its slab [expert] of a [E, ...] tensor,
        "bytes" its 1/E run of a 1-D byte tensor (GGUF blocks, expert-major), "shape" the stacked
        weight.shape [E, out, in] without E."""
        self.views[name] = (real, how, expert, experts)
        self.location[name] = self.location[real]

    def _view(self, name: str) -> torch.Tensor:
        real, how, e, experts = self.views[name]
        layer = real.partition(".weight")[0]
        if self._stack_layer != layer:  # one stacked layer's tensors are held, read once for all its experts
            self._stack_layer, self._stack_tensors = layer, {}
        if real not in self._stack_tensors:
            self._stack_tensors[real] = self.get(real)
        t = self._stack_tensors[real]
        if how == "stack":
            return t[e]
        if how == "bytes":
            k = t.numel() // experts
            return t[e * k:(e + 1) * k]
        return t[1:]

    def version_values(self) -> tuple[int, int, int] | None:
        """The version tensors; every shard that carries them must agree (mistral.rs' rule)."""
        found = None
        for shard in self.shards:
            entries = self.headers[shard].tensors
            vals = None
            if any(k in entries for k in _VERSION_KEYS):
                vals = []
                for k in _VERSION_KEYS:
                    if k not in entries:
                        raise BadInput("incomplete UQFF version tensors", path=shard, tensor=k)
                    if entries[k].dtype != "U32" or entries[k].shape != ():
                        raise BadInput("UQFF version tensor must be a scalar U32", path=shard, tensor=k)
                    vals.append(int(read_tensor(self.headers[shard], k, self._fds.fd(shard)).to(torch.int64)))
                vals = tuple(vals)
            if vals is not None:
                if found is not None and vals != found:
                    raise BadInput(f"conflicting UQFF version tensors ({'.'.join(map(str, vals))} vs "
                                   f"{'.'.join(map(str, found))})", path=shard)
                found = vals
        return found


def _view_shape(how: str, shape: list[int], experts: int) -> list[int]:
    if how == "stack":
        return list(shape[1:])
    if how == "bytes":
        return [shape[0] // experts]
    return [shape[0] - 1]


_INT_TAGS = ("U8", "U16", "U32", "I8", "I16", "I32", "I64")
_FLOAT_TAGS = ("F32", "F16", "BF16", "F64")
_MAX_DIM = 1 << 24
_MAX_EXPERTS = 1 << 14  # released MoE models have up to a few hundred experts per layer
_FP8_MAX_SCALE = 65504.0 / 448.0
_NUMBERED = re.compile(r"^model-\d+-of-\d+\.safetensors$")
_PICKLED = re.compile(r"^pytorch_model.*\.(bin|pt|pth)$")
# model types whose every layer has these tensors (transformers' Llama, Mistral, Qwen2, Qwen3): for them a
# missing one is refused by name
_COMPLETE_CHECKED = frozenset({"llama", "mistral", "qwen2", "qwen3"})
_EXPERT_INDEX = re.compile(r"\.experts\.(\d+)\.")
_STACK_KEY = re.compile(r"^(?P<block>.+)\.experts\.(?P<proj>gate_proj|up_proj|down_proj)$")
_PER_LAYER = ("input_layernorm", "post_attention_layernorm", "self_attn.q_proj", "self_attn.k_proj",
              "self_attn.v_proj", "self_attn.o_proj", "mlp.gate_proj", "mlp.up_proj", "mlp.down_proj")


def _numel(shape) -> int:
    total = 1
    for d in shape:
        total *= int(d)
    return total


def _show_allowed(allowed) -> str:
    if isinstance(allowed, range):
        return f"{allowed.start}..{allowed.stop - 1}"
    values = sorted(allowed)
    return "one of " + ", ".join(map(str, values[:16])) + (" ..." if len(values) > 16 else "")


def _torch_dtype_name(dtype: torch.dtype) -> str:
    return _TORCH_NAME.get(dtype, str(dtype).replace("torch.", ""))


class UqffSource(ModelSource):
    """A UQFF model directory (or one `.uqff` file of it), read lazily layer by layer."""

    format_name = "uqff"

    def __init__(self, path: Path):
        path = Path(path)
        self.shard_paths = shard_set(path)
        self.path = self.shard_paths[0].parent
        self.shards = _Shards(self.shard_paths)
        self._check_version()
        cfg_path = self.path / "config.json"
        if not cfg_path.is_file():
            raise BadInput("missing: mistral.rs builds the model from the config.json beside the UQFF shards",
                           path=cfg_path)
        self.config = _without_quantization_config(read_json(cfg_path))
        self.shapes = ModelShapes(self.config, cfg_path)
        self.quant_config = {"quant_method": "uqff", "version": ".".join(map(str, self.version)),
                             "shards": [p.name for p in self.shard_paths]}
        self.layers: dict[str, dict[str, str]] = {}  # key -> {suffix: tensor name}
        self.biases: dict[str, str] = {}
        for name in self.shards.order:
            if name.startswith("uqff.version."):
                continue
            if ".weight" in name:
                key, _, rest = name.partition(".weight")
                self.layers.setdefault(key, {})["weight" + rest] = name
            elif name.endswith(".bias"):
                self.biases[name[: -len(".bias")]] = name
            else:
                raise BadInput("not a UQFF layer tensor (expected <key>.weight*, <key>.bias)",
                               path=self.shards.location[name], tensor=name)
        for key, parts in self.layers.items():
            if "weight.format" not in parts:
                where = self.shards.location[next(iter(parts.values()))]
                raise BadInput("layer has no .weight.format tag", path=where, tensor=f"{key}.weight.format")
            if "weight" not in parts:
                raise BadInput("layer has metadata but no weight", path=self.shards.location[parts["weight.format"]],
                               tensor=f"{key}.weight")
        if not self.layers:
            raise BadInput("no UQFF layers in this set (no <key>.weight.format tensors): nothing to read",
                           path=self.shard_paths[0])
        self._expand_stacks()
        self.residual = self._residual()
        self._check_complete()

    # -- stacked experts ----------------------------------------------------------------------------------
    def _stack_size(self, key: str) -> int | None:
        """E for a stacked `[E, out, in]` layer (GGUF: a 3-long weight.shape; other families: a 3-D weight),
        None for a 2-D one."""
        parts = self.layers[key]
        if "weight.shape" in parts and self.shards.meta(parts["weight.shape"])[1] == [3]:
            return int(self._part(key, "weight.shape")[0])
        dims = self.shards.meta(parts["weight"])[1]
        return int(dims[0]) if len(dims) == 3 else None

    def _expand_stacks(self) -> None:
        """Each stacked experts layer becomes E per-expert layers of views (see the module docstring)."""
        moe = moe_model(self.config)
        expanded: dict[str, dict[str, str]] = {}
        for key, parts in self.layers.items():
            experts = self._stack_size(key)
            if experts is None:
                expanded[key] = parts
                continue
            fam = self.family(key)
            m = _STACK_KEY.match(key)
            if not m:
                raise self._bad(key, "a 3-D layer that is not a stacked experts projection "
                                     "(<block>.experts.gate_proj / up_proj / down_proj)")
            if fam not in STACKABLE_FAMILIES:
                raise self._bad(key, f"stacked experts stored as {fam}: mistral.rs loads stacked layers only as GGUF "
                                     "blocks, AFQ or unquantized")
            if not 1 <= experts <= _MAX_EXPERTS:
                raise self._bad(key, f"{experts} stacked experts; expected 1..{_MAX_EXPERTS}", "weight.shape")
            hf_proj = (moe.hf_names if moe is not None else {})
            views = {suffix: self._view_kind(key, fam, suffix, real, experts) for suffix, real in parts.items()}
            bias = self.biases.pop(key, None)
            for e in range(experts):
                vkey = f"{m['block']}.experts.{e}.{hf_proj.get(m['proj'], m['proj'])}"
                expanded[vkey] = {}
                for suffix, real in parts.items():
                    if views[suffix] is None:
                        expanded[vkey][suffix] = real  # a scalar all experts share
                    else:
                        self.shards.add_view(f"{vkey}.{suffix}", real, views[suffix], e, experts)
                        expanded[vkey][suffix] = f"{vkey}.{suffix}"
                if bias is not None:
                    if self.shards.meta(bias)[1][:1] != [experts]:
                        raise BadInput(f"bias of a stacked layer must be [{experts}, out]", path=self.shards.location[bias],
                                       tensor=bias)
                    self.shards.add_view(f"{vkey}.bias", bias, "stack", e, experts)
                    self.biases[vkey] = f"{vkey}.bias"
        self.layers = expanded

    def _view_kind(self, key: str, fam: str, suffix: str, real: str, experts: int) -> str | None:
        dtype, shape = self.shards.meta(real)
        if suffix == "weight.shape":
            return "shape"
        if len(shape) == 0 or shape == [1]:
            return None
        if fam == "gguf" and suffix == "weight":
            if len(shape) != 1 or shape[0] % experts:
                raise self._bad(key, f"stacked GGUF weight of shape {shape[:4]} is not {experts} experts' blocks")
            return "bytes"
        if shape[0] != experts:
            raise self._bad(key, f"{suffix} of shape {shape[:4]} does not stack {experts} experts", suffix)
        return "stack"

    # -- container checks -------------------------------------------------------------------------------
    def _check_version(self) -> None:
        first = self.shard_paths[0]
        names = [n for n in self.shards.order]
        if names and all(n.isdigit() for n in names):
            raise BadInput("pre-1.0 UQFF (numeric tensor names) is no longer supported by mistral.rs; regenerate "
                           "it with mistral.rs >= 0.8.4", path=first)
        version = self.shards.version_values()
        if version is None:
            raise BadInput("UQFF artifact has no version tensors uqff.version.major/minor/patch (a pre-1.0 or "
                           "non-UQFF file)", path=first)
        major, minor, _ = version
        if major != MAJOR:
            raise BadInput(f"UQFF major version {major} is not supported (this reader reads {MAJOR}.x)", path=first)
        if minor > READER_MINOR:
            raise BadInput(f"written by a newer mistral.rs: UQFF {major}.{minor}; this reader knows UQFF up to "
                           f"{MAJOR}.{READER_MINOR}", path=first)
        self.version = version

    def _residual(self):
        """Where mistral.rs takes every tensor that is not a UQFF layer from: the model's own weights when
        the folder has them (model.safetensors.index.json, model.safetensors, model-N-of-M.safetensors,
        consolidated.safetensors; pytorch_model*.bin/.pt/.pth), else residual.safetensors, else nothing.
        Other .safetensors files beside them are not read (mistral.rs does not read them either)."""
        from ..common.checkpoint import CheckpointDir

        d = self.path
        if (d / "model.safetensors.index.json").is_file() or (d / "model.safetensors").is_file():
            return CheckpointDir(d)
        numbered = sorted(p for p in d.glob("model-*-of-*.safetensors") if _NUMBERED.match(p.name) and p.is_file())
        if numbered:
            return _Shards(numbered)
        if (d / "consolidated.safetensors").is_file():
            return _Shards([d / "consolidated.safetensors"])
        pickles = sorted(p.name for p in d.iterdir() if _PICKLED.match(p.name) and p.is_file())
        if pickles:
            raise BadInput("mistral.rs would take the tensors that are not UQFF layers from this pickle, which "
                           "this reader does not read; convert it to safetensors (residual.safetensors)",
                           path=d / pickles[0])
        if (d / "residual.safetensors").is_file():
            return _Shards([d / "residual.safetensors"])
        return None

    def _residual_names(self) -> list[str]:
        if self.residual is None:
            return []
        return self.residual.order if isinstance(self.residual, _Shards) else list(self.residual.location)

    def _check_complete(self) -> None:
        """The model's other tensors (norms, and the embedding when it is not a layer) must be there: a UQFF
        set without residual.safetensors, or with a wrong one, would convert into a model without them."""
        have = set(self.layers) | {f"{k}.weight" for k in self.layers}
        have |= set(self._residual_names())
        where = self.path / "residual.safetensors"
        if self.residual is None:
            raise BadInput("missing: the tensors that are not UQFF layers (the model's norms, dense leftovers) "
                           "are stored there by mistral.rs, and no model safetensors stand in for it", path=where)
        if not any(n for n in self._residual_names() if not n.startswith("uqff.version.")):
            raise BadInput("holds no tensors: the model's norms are missing", path=self._residual_file(None))
        sh = self.shapes
        model_type = self.config.get("model_type")
        moe = moe_model(self.config)
        if moe is not None and sh.layers and layer_weights(self.config, moe, 0) is not None:
            per_layer = lambda i: layer_weights(self.config, moe, i)  # noqa: E731  (Mixtral, Qwen3-MoE)
        elif isinstance(model_type, str) and model_type in _COMPLETE_CHECKED and sh.layers:
            per_layer = lambda i: _PER_LAYER  # noqa: E731
        else:
            return
        want = ["model.norm.weight"]
        if "model.embed_tokens.weight" not in have and not (sh.tie and "lm_head.weight" in have):
            want.append("model.embed_tokens.weight")
        if not sh.tie:
            want.append("lm_head.weight")
        for i in range(sh.layers):
            want += [f"model.layers.{i}.{n}.weight" for n in per_layer(i)]
        if moe is not None:  # Mixtral's experts may be spelled w1/w3/w2 or gate/up/down_proj
            have = {canonical_expert_name(n) for n in have}
        missing = [n for n in want if (canonical_expert_name(n) if moe is not None else n) not in have]
        if missing:
            more = f" and {len(missing) - 3} more" if len(missing) > 3 else ""
            raise BadInput(f"{len(missing)} tensor(s) the model needs (config.json: {sh.layers} layers) are in "
                           f"neither the UQFF shards nor the residual tensors: {', '.join(missing[:3])}{more}",
                           path=self._residual_file(None), tensor=missing[0])

    def _residual_file(self, name: str | None) -> Path:
        if self.residual is None:
            return self.path / "residual.safetensors"
        if isinstance(self.residual, _Shards):
            return self.residual.location[name] if name in self.residual.location else self.residual.shards[0]
        return self.residual.file_of(name) if name in self.residual.location else self.path

    # -- per-layer metadata scalars -----------------------------------------------------------------------
    def _meta_scalar(self, key: str, suffix: str, tags, kind: str, what: str) -> tuple[str, torch.Tensor]:
        """A layer's scalar (`[]` or `[1]`) metadata tensor of one of `tags`, checked from the header before
        it is read: (its name, its value as a 0-d tensor)."""
        parts = self.layers[key]
        if suffix not in parts:
            raise BadInput(f"missing {suffix} for this layer", path=self.shards.location[parts["weight"]],
                           tensor=f"{key}.{suffix}")
        name = parts[suffix]
        dtype, shape = self.shards.meta(name)
        if dtype not in tags or len(shape) > 1 or (shape and shape[0] != 1):
            raise BadInput(f"{what}: expected {kind} scalar, found {dtype} {shape[:4]}",
                           path=self.shards.location[name], tensor=name)
        return name, self.shards.get(name).reshape(())

    def _meta_int(self, key: str, suffix: str, allowed, what: str) -> int:
        """An integer scalar metadata tensor, checked against `allowed` before any use."""
        name, value = self._meta_scalar(key, suffix, _INT_TAGS, "an integer", what)
        v = int(value.to(torch.int64))
        if v not in allowed:
            raise BadInput(f"{what} is {v}; expected {_show_allowed(allowed)}", path=self.shards.location[name],
                           tensor=name)
        return v

    def _meta_float(self, key: str, suffix: str, what: str) -> torch.Tensor:
        name, v = self._meta_scalar(key, suffix, _FLOAT_TAGS, "a float", what)
        if not bool(torch.isfinite(v)):
            raise BadInput(f"{what} is not a finite number", path=self.shards.location[name], tensor=name)
        return v

    def _header(self, key: str, suffix: str) -> tuple[str, list[int]]:
        """(dtype tag, shape) of a layer's tensor from the safetensors header, without reading it."""
        parts = self.layers[key]
        if suffix not in parts:
            raise BadInput(f"missing {suffix} for this layer", path=self.shards.location[parts["weight"]],
                           tensor=f"{key}.{suffix}")
        return self.shards.meta(parts[suffix])

    # -- one layer --------------------------------------------------------------------------------------
    def _part(self, key: str, suffix: str) -> torch.Tensor:
        parts = self.layers[key]
        if suffix not in parts:
            raise BadInput(f"missing {suffix} for this layer", path=self.shards.location[parts["weight"]],
                           tensor=f"{key}.{suffix}")
        return self.shards.get(parts[suffix])

    def family(self, key: str) -> str:
        return FAMILY_OF_TAG[self._meta_int(key, "weight.format", FAMILY_OF_TAG, "UQFF format tag")]

    def _bad(self, key: str, msg: str, suffix: str = "weight") -> BadInput:
        return BadInput(msg, path=self.shards.location[self.layers[key]["weight"]], tensor=f"{key}.{suffix}")

    def _shape(self, key: str) -> tuple[int, ...]:
        dtype, dims = self._header(key, "weight.shape")
        if dtype not in _INT_TAGS or len(dims) != 1 or not 1 <= dims[0] <= 8:
            raise self._bad(key, f"weight.shape must be a short integer vector, found {dtype} {dims[:4]}",
                            "weight.shape")
        shape = tuple(int(x) for x in self._part(key, "weight.shape").to(torch.int64).tolist())
        if any(not 1 <= x <= _MAX_DIM for x in shape):
            raise self._bad(key, f"weight shape {list(shape)}: every size must be 1..{_MAX_DIM}", "weight.shape")
        if len(shape) != 2:
            raise self._bad(key, f"weight shape {list(shape)}: only 2-D layers and [E, out, in] stacked experts "
                                 "are supported", "weight.shape")
        return shape

    def describe_layer(self, key: str) -> tuple[tuple[int, ...], GridParams | None, str, dict]:
        """(shape, grid params or None, dtype label, typed TensorRecord fields) from the small tensors only."""
        fam = self.family(key)
        if fam == "gguf":
            shape = self._shape(key)
            name = GGML_NAME_OF_ID[self._meta_int(key, "weight.dtype", GGML_NAME_OF_ID, "ggml type id")]
            notes = {"native_type": name}
            if name in LAYOUTS and LAYOUTS[name].kind != "float":
                return shape, self._load_gguf(key, shape, name).params, "grid", notes
            return shape, None, "float32" if name not in LAYOUTS else {"F32": "float32", "F16": "float16",
                                                                       "BF16": "bfloat16"}[name], notes
        notes = {}
        if fam in ("hqq", "afq"):
            params, shape = self._load_hqq(key, False) if fam == "hqq" else self._load_afq(key, False)
            if fam == "hqq":  # the stored group size and flags, so that a HQQ / UQFF writer stores the same layout
                notes["source_groups"] = (self._meta_int(key, "weight.group_size", range(1, 1 << 32), "group size"),)
                notes["layer_flags"] = {"uqff": {k: self._meta_int(key, f"weight.{k}", range(0, 1 << 32), k)
                                               for k in ("optimization_steps", "round_zeros", "channel_wise")
                                               if f"weight.{k}" in self.layers[key]}}
            return shape, params, "grid", notes
        dtype, wshape = self.shards.meta(self.layers[key]["weight"])
        if fam != "f8q8" and (len(wshape) != 2 or min(wshape) < 1):
            raise self._bad(key, f"{fam} weight of shape {wshape[:4]}: only 2-D layers are supported")
        if fam == "unquant":
            if dtype not in ("F32", "F16", "BF16"):
                raise self._bad(key, f"Unquant weight dtype {dtype} is not F32, F16 or BF16")
            return tuple(wshape), None, {"F32": "float32", "F16": "float16", "BF16": "bfloat16"}[dtype], notes
        if fam == "f8q8":
            return self._shape(key), None, "float32", notes
        shape, params, _ = self._float_grid(key, fam, with_codes=False)  # fp8, mxfp4: float grids
        return shape, params, "grid", notes

    def load_layer(self, key: str) -> Dense | Grid:
        fam = self.family(key)
        if fam == "gguf":
            shape = self._shape(key)
            name = GGML_NAME_OF_ID[self._meta_int(key, "weight.dtype", GGML_NAME_OF_ID, "ggml type id")]
            if name in LAYOUTS and LAYOUTS[name].kind != "float":
                return self._load_gguf(key, shape, name)
            return Dense(self._gguf_plain(key, shape, name))
        if fam in ("hqq", "afq"):
            return self._load_grid(key, fam)
        w = self._part(key, "weight")
        if fam == "unquant":
            return Dense(w)
        if fam == "f8q8":
            shape = self._shape(key)
            nblocks = self._meta_int(key, "weight.num_blocks", range(1, 1 << 32), "F8Q8 block count")
            if w.dtype != torch.uint8 or w.numel() != nblocks * 33 or nblocks * 32 < shape[0] * shape[1]:
                raise self._bad(key, f"F8Q8 weight of {w.numel()} bytes does not hold {nblocks} blocks of 33 "
                                     f"for shape {list(shape)}")
            return Dense(decode_f8q8(w, shape[0] * shape[1]).view(shape))
        if fam in ("fp8", "mxfp4"):
            shape, params, codes = self._float_grid(key, fam, with_codes=True)
            return Grid(params, codes=codes)
        raise self._bad(key, f"family {fam} not readable")

    def _float_grid(self, key: str, fam: str, with_codes: bool):
        """FP8 (E4M3 codes times one float32 scale, `dequant_w_scale`) and MXFP4 (E2M1 nibbles, low first, times
        an E8M0 exponent per 32) as float grids: (shape, GridParams, codes or None). Planning (no codes) reads
        the weight's header only."""
        dtype, wshape = self.shards.meta(self.layers[key]["weight"])
        if fam == "fp8":
            if dtype != "F8_E4M3":
                raise self._bad(key, f"FP8 weight dtype {dtype} is not F8_E4M3")
            if "weight.dtype" in self.layers[key]:
                self._meta_int(key, "weight.dtype", (FP8_DTYPE_CODE,), "FP8 dtype code (9 = F8E4M3)")
            scale = self._meta_float(key, "weight.dequant_w_scale", "FP8 dequant scale").to(torch.float32)
            # mistral.rs' ISQ stores absmax / 448 (> 0); a scale past 65504 / 448 would put weights beyond
            # float16's range, which no model's weights reach: a corrupt value, not a model
            if not 0.0 < float(scale) <= _FP8_MAX_SCALE:
                raise self._bad(key, f"FP8 dequant scale {float(scale):.6g} is outside (0, {_FP8_MAX_SCALE:.6g}]: the "
                                     "weights would be beyond float16's range", "weight.dequant_w_scale")
            shape = tuple(wshape)
            scales = scale.reshape(1, 1).expand(shape[0], 1).contiguous()
            params = GridParams(bits=8, group_size=shape[1], scales=scales,
                                zeros=torch.zeros(scales.shape, dtype=torch.int8), codebook=element_table("e4m3"))
            codes = self._part(key, "weight").view(torch.uint8) if with_codes else None
            return shape, params, codes
        scales = self._part(key, "weight.scales")
        if dtype != "U8" or scales.dtype != torch.uint8 or len(wshape) != 2 or (wshape[1] * 2) % 32 or \
                tuple(scales.shape) != (wshape[0], wshape[1] * 2 // 32):
            raise self._bad(key, f"MXFP4 weight {list(wshape)} / scales {list(scales.shape)} do not match")
        scales = scales.view(torch.float8_e8m0fnu)
        params = GridParams(bits=4, group_size=32, scales=scales, zeros=torch.zeros(scales.shape, dtype=torch.int8),
                            codebook=element_table("e2m1"))
        codes = unpack_fp4(self._part(key, "weight")) if with_codes else None
        return (wshape[0], wshape[1] * 2), params, codes

    def _gguf_bytes(self, key: str, shape, block: int, nbytes: int) -> torch.Tensor:
        rows, n = shape
        if n % block:
            raise self._bad(key, f"rows of {n} are not whole blocks of {block}")
        w = self._part(key, "weight")
        want = rows * (n // block) * nbytes
        if w.dtype != torch.uint8 or w.numel() != want:
            raise self._bad(key, f"{w.numel()} bytes of {w.dtype}, expected {want} uint8 for shape {list(shape)}")
        return w.reshape(rows, -1).contiguous()

    def _gguf_plain(self, key: str, shape, name: str) -> torch.Tensor:
        if name in EXTRA_BLOCKS:
            block, nbytes = EXTRA_BLOCKS[name]
            data = self._gguf_bytes(key, shape, block, nbytes)
            return decode_q8_1(data, shape[0]) if name == "Q8_1" else decode_q8_k(data, shape[0])
        dtype = {"F32": torch.float32, "F16": torch.float16, "BF16": torch.bfloat16}[name]
        data = self._gguf_bytes(key, shape, 1, torch.tensor([], dtype=dtype).element_size())
        return data.view(dtype).view(shape)

    def _load_gguf(self, key: str, shape, name: str) -> Grid:
        lay = LAYOUTS[name]
        words = self._gguf_bytes(key, shape, lay.block, lay.nbytes)
        if lay.kind == "k":
            codes, scales, mins = unpack_k_blocks(name, words.numpy())
            codes, scales = torch.from_numpy(codes), torch.from_numpy(scales)
            if mins is None:
                zeros = torch.full_like(scales, K_ZERO_POINT[name], dtype=torch.int16)
            else:
                mins, zeros = torch.from_numpy(mins), torch.zeros_like(scales)
            group = lay.sub_block
        else:
            q, d, m = unpack_blocks(lay, words)
            scales, mins = d.to(torch.float16), None  # the stored fp16 block scale, exactly
            if lay.name == "Q8_0":
                codes, zeros = (q + 128).to(torch.uint8), torch.full_like(scales, 128, dtype=torch.int16)
            elif lay.has_min:
                codes, mins, zeros = q.to(torch.uint8), m, torch.zeros_like(m)
            else:
                codes, zeros = q.to(torch.uint8), torch.full_like(scales, lay.offset, dtype=torch.int16)
            group = lay.block
        params = GridParams(bits=lay.bits, group_size=group, scales=scales, zeros=zeros, mins=mins)
        return Grid(params, codes, PackedCodes(words, lay.bits, f"ggml:{name}"))

    def _load_grid(self, key: str, fam: str) -> Grid:
        return self._load_hqq(key) if fam == "hqq" else self._load_afq(key)

    def _load_hqq(self, key: str, with_codes: bool = True):
        out, n = self._shape(key)
        numel = out * n
        bits = self._meta_int(key, "weight.bits", (4, 8), "HQQ bits (mistral.rs writes 4 and 8)")
        self._meta_int(key, "weight.axis", (0,), "HQQ axis (mistral.rs dequantizes axis 0 only)")
        gs = self._meta_int(key, "weight.group_size", range(1, numel + 1), f"HQQ group size (1..{numel})")
        for suffix in ("weight.round_zeros", "weight.channel_wise"):
            if suffix in self.layers[key]:
                self._meta_int(key, suffix, (0, 1), suffix[len("weight."):] + " flag")
        if "weight.optimization_steps" in self.layers[key]:
            self._meta_int(key, "weight.optimization_steps", range(0, 1 << 32), "optimization steps")
        # hqq and mistral.rs view the flattened weight as [gs, numel/gs]: gs must divide the element count
        # (not the rows: k/v projections of 32 rows with gs 64 are what mistral.rs writes), and the 4-bit
        # packing stores the two halves of the gs rows in one byte
        if numel % gs or gs * bits % 8:
            raise self._bad(key, f"HQQ group size {gs} does not divide the {out}x{n} weight's {numel} elements "
                                 f"into whole {bits}-bit packed groups", "weight.group_size")
        m = numel // gs
        for suffix in ("weight.scales", "weight.zeros"):
            dtype, shape = self._header(key, suffix)
            if dtype not in ("F32", "F16", "BF16") or _numel(shape) != m or len(shape) > 2:
                raise self._bad(key, f"HQQ {suffix[7:]} {shape[:4]} {dtype} do not hold {m} float groups "
                                     f"([1, {m}])", suffix)
        if self._header(key, "weight.scales")[0] != self._header(key, "weight.zeros")[0]:
            raise self._bad(key, "HQQ scales and zeros have different dtypes", "weight.zeros")
        wdtype, wshape = self._header(key, "weight")
        if wdtype != "U8" or list(wshape) != [gs * bits // 8, m]:
            raise self._bad(key, f"HQQ weight {wshape[:4]} {wdtype}, expected U8 {[gs * bits // 8, m]} for shape "
                                 f"{[out, n]}, group size {gs}, {bits} bits")
        scales, zeros = self._part(key, "weight.scales"), self._part(key, "weight.zeros")
        # the [1, M] meta as records.py's axis-0 [p, in] matrix (kernels/hqq.py axis0_expand)
        e_s, e_z = axis0_expand(scales, (out, n), gs), axis0_expand(zeros, (out, n), gs)
        params = GridParams(bits=bits, group_size=out // e_s.shape[0], scales=e_s, zeros=e_z, axis=0,
                            compute_dtype=scales.dtype)
        if not with_codes:
            return params, (out, n)
        grouped = hqq_halves_unpack(self._part(key, "weight"), bits)  # [gs, numel/gs]
        return Grid(params, grouped.reshape(out, n))

    def _load_afq(self, key: str, with_codes: bool = True):
        bits = self._meta_int(key, "weight.bits", AFQ_BITS, "AFQ bits")
        gs = self._meta_int(key, "weight.group_size", AFQ_GROUPS, "AFQ group size")
        wdtype, wshape = self._header(key, "weight")
        if len(wshape) != 2 or wdtype not in ("U32", "I32") or min(wshape) < 1:
            raise self._bad(key, f"AFQ weight must be a 2-D U32 tensor, got {wshape[:4]} {wdtype}")
        out, words = wshape
        n, rest = divmod(words * 32, bits)
        dtypes = {self._header(key, s)[0] for s in ("weight.scales", "weight.biases")}
        sshape, bshape = self._header(key, "weight.scales")[1], self._header(key, "weight.biases")[1]
        if len(dtypes) != 1 or not dtypes <= {"F32", "F16", "BF16"} or list(sshape) != list(bshape) \
                or len(sshape) != 2 or sshape[0] != out:
            raise self._bad(key, f"AFQ scales {sshape[:4]} / biases {bshape[:4]} ({', '.join(sorted(dtypes))}) "
                                 f"are not one float [{out}, groups] pair", "weight.scales")
        if rest or n != sshape[1] * gs:
            raise self._bad(key, f"AFQ weight rows of {words} u32 words hold {words * 32 / bits:g} {bits}-bit codes, "
                                 f"but the scales describe {sshape[1]} groups of {gs} = {sshape[1] * gs} inputs",
                            "weight.bits")
        scales, biases = self._part(key, "weight.scales"), self._part(key, "weight.biases")
        compute = scales.dtype
        zeros = _integer_zeros(scales, biases, bits)
        if zeros is not None:
            params = GridParams(bits=bits, group_size=gs, scales=scales, zeros=zeros, compute_dtype=compute)
        else:
            params = GridParams(bits=bits, group_size=gs, scales=scales, zeros=torch.zeros_like(scales), mins=biases,
                                compute_dtype=compute)
        if not with_codes:
            return params, (out, n)
        w = self._part(key, "weight")
        codes = unpack_afq(w, bits, n)
        packed = PackedCodes(w.view(torch.int32).T.contiguous(), bits, "gptq-rows") if bits in (2, 3, 4, 8) else None
        return Grid(params, codes, packed)

    # -- the ModelSource interface ------------------------------------------------------------------------
    def _check_shape(self, name: str, shape: tuple, where: Path) -> None:
        """A tensor's shape against config.json (converters/model_shapes.py), and its layer index."""
        i = layer_index(name)
        if i is not None and self.shapes.layers is not None and i >= self.shapes.layers:
            raise BadInput(f"layer {i} is beyond config.json's num_hidden_layers {self.shapes.layers}", path=where,
                           tensor=name)
        self.shapes.check_dense(name, tuple(shape), where)
        moe = moe_model(self.config)
        want = expected_shape(self.config, moe, name) if moe is not None else None
        if want is not None and tuple(shape) != want[0]:
            raise BadInput(f"shape {tuple(shape)} does not match config.json: expected {want[0]} from {want[1]}",
                           path=where, tensor=name)
        slot = _EXPERT_INDEX.search(name)
        if moe is not None and moe.num_experts and slot and int(slot[1]) >= moe.num_experts:
            raise BadInput(f"expert {slot[1]} is beyond config.json's {moe.num_experts} experts", path=where, tensor=name)

    def records(self) -> Iterator[TensorRecord]:
        for key in self.layers:
            shape, params, dtype, notes = self.describe_layer(key)
            path = self.shards.location[self.layers[key]["weight"]]
            self._check_shape(f"{key}.weight", shape, path)
            yield TensorRecord(f"{key}.weight", shape, dtype, lambda k=key: self.load_layer(k), params=params,
                               source_file=path.name, **notes)
            if key in self.biases:
                rec = self._dense_record(self.shards, self.biases[key])
                if rec.shape != (shape[0],):
                    raise BadInput(f"bias of shape {rec.shape} does not match the layer's {shape[0]} outputs",
                                   path=self.shards.location[self.biases[key]], tensor=rec.name)
                yield rec
        for key, name in self.biases.items():
            if key not in self.layers:
                yield self._dense_record(self.shards, name)
        biases = set(self.biases.values())
        for name in self._residual_names():
            if name.startswith("uqff.version.") or name in biases or \
                    (name.endswith(".weight") and name[: -len(".weight")] in self.layers):
                continue  # UQFF layers (and their biases) override the dense copy (mistral.rs asks the UQFF first)
            yield self._dense_record(self.residual, name)

    def _dense_record(self, store, name: str) -> TensorRecord:
        if isinstance(store, _Shards):
            dtype, shape = store.meta(name)
            where = store.location[name].name
        else:
            dtype, shape, where = store.dtype(name), store.shape(name), store.location[name]
        from ..common.checkpoint import dtype_name as _dtype_name

        path = store.location[name] if isinstance(store, _Shards) else store.file_of(name)
        if dtype not in ("F32", "F16", "BF16"):  # norms, embeddings, biases, dense leftovers: mistral.rs loads floats
            raise BadInput(f"{dtype} tensor: the tensors beside UQFF layers are F32, F16 or BF16", path=path, tensor=name)
        self._check_shape(name, tuple(shape), path)
        return TensorRecord(name, tuple(shape), _dtype_name(dtype), lambda: Dense(store.get(name)), source_file=where)

    def side_files(self) -> dict[str, Path]:
        return {n: self.path / n for n in SIDE_FILES if (self.path / n).exists()}

    @property
    def ignored_files(self) -> dict[str, str]:
        """Weight files in the folder that are neither its .uqff shards nor the residual tensors read."""
        from ..common.checkpoint import weight_files_ignored

        used = {p.name for p in self.shard_paths}
        used |= {Path(p).name for p in getattr(self.residual, "shards", None) or ["residual.safetensors"]}
        return weight_files_ignored(self.path, used, "not read (the residual tensors are elsewhere)")

    def describe(self) -> dict:
        families: dict[str, int] = {}
        for key in self.layers:
            fam = self.family(key)
            if fam == "gguf":
                fam = "gguf:" + GGML_NAME_OF_ID[self._meta_int(key, "weight.dtype", GGML_NAME_OF_ID, "ggml type id")]
            families[fam] = families.get(fam, 0) + 1
        return {"format": "uqff", "version": ".".join(map(str, self.version)),
                "shards": [p.name for p in self.shard_paths], "layers": len(self.layers), "families": families,
                "residual": None if self.residual is None else "residual.safetensors"
                if (self.path / "residual.safetensors").exists() else "model safetensors",
                "architectures": self.config.get("architectures"), "ignored_files": self.ignored_files}


def _integer_zeros(scales: torch.Tensor, biases: torch.Tensor, bits: int) -> torch.Tensor | None:
    """Integer zero points z with bias = -scale*z, when the zero-point form (q - z) * s gives mistral.rs'
    s*q + b bit for bit: float32 arithmetic, fp16-representable scales (so every s*q and s*z is exact)
    and z an integer code. None otherwise: the grid then stays in the min form."""
    if scales.dtype != torch.float32:
        return None
    s = scales
    if not torch.equal(s.to(torch.float16).to(torch.float32), s) or bool((s == 0).any()):
        return None
    z = torch.round(-biases / s)
    if bool(((z < 0) | (z > (1 << bits) - 1)).any()):
        return None
    if not torch.equal(-(s * z), biases) and not torch.equal((-s) * z, biases):
        return None
    return z.to(torch.int16)


def _without_quantization_config(obj):
    """mistral.rs drops every `quantization_config` key, recursively; so do we."""
    if isinstance(obj, dict):
        return {k: _without_quantization_config(v) for k, v in obj.items() if k != "quantization_config"}
    if isinstance(obj, list):
        return [_without_quantization_config(v) for v in obj]
    return obj


def open_uqff(path: Path, **_: object) -> UqffSource:
    return UqffSource(path)
