"""UQFF reader, the container: a mistral.rs model directory (`<stem>-N.uqff` shards + residual.safetensors +
config and tokenizer files) as tensor records.

Every shard is a safetensors file; all shards of a set share one namespace (a layer's sub-tensors may sit
in different shards). The version tensors `uqff.version.{major,minor,patch}` (U32 scalars, in some shard)
decide whether we can read it: major 1, minor up to READER_MINOR. Layers become records named
`<key>.weight`, each described and loaded by the codec of its `weight.format` tag (codecs/: GGUF blocks as
grids carrying their bytes, HQQ as axis-0 grids, AFQ as min-form grids, FP8 / MXFP4 as float grids, F8Q8 /
Unquant as dense floats), which reads the layer through a `LayerView`; the container knows no tag's layout.
`<key>.bias` and the residual tensors are `Dense`. Shards are opened lazily and one layer is read at a time.

Stacked experts (`<block>.experts.{gate,up,down}_proj`, weight `[E, out, in]`, formats/uqff/moe.py) are read
as E per-expert 2-D layers under the names transformers saves (`<block>.experts.<e>.gate_proj.weight`,
Mixtral's `experts.<e>.w1.weight`): each expert's tensors are views of the stacked ones (its slab of the
stacked weight and metadata, the shared scalars as they are), so every codec runs unchanged on them; the
stacked layer being read is kept in memory until the next one is asked for.
"""

from __future__ import annotations

import re
from pathlib import Path
from typing import Iterator

import torch

from ...converters.errors import BadInput
from ...converters.model_shapes import ModelShapes, layer_index
from ...converters.records import Dense, Grid, ModelSource, TensorRecord
from ..common.checkpoint import SIDE_FILES, read_json
from ..common.quant_config import without_quantization_config
from ..common.safetensors_header import Descriptors, read_header, read_tensor
from .codecs import LayerDescription, codec
from .layer_view import LayerView
from .layout import MAJOR, READER_MINOR
from .moe import STACKABLE_FAMILIES, canonical_expert_name, expected_shape, layer_weights, moe_model

__all__ = ["UqffSource", "open_uqff", "shard_set", "is_uqff_file"]

_SHARD_RE = re.compile(r"^(?P<stem>.+)-(?P<no>\d+)\.uqff$")
_VERSION_KEYS = ("uqff.version.major", "uqff.version.minor", "uqff.version.patch")


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


_MAX_EXPERTS = 1 << 14  # released MoE models have up to a few hundred experts per layer
_NUMBERED = re.compile(r"^model-\d+-of-\d+\.safetensors$")
_PICKLED = re.compile(r"^pytorch_model.*\.(bin|pt|pth)$")
# model types whose every layer has these tensors (transformers' Llama, Mistral, Qwen2, Qwen3): for them a
# missing one is refused by name
_COMPLETE_CHECKED = frozenset({"llama", "mistral", "qwen2", "qwen3"})
_EXPERT_INDEX = re.compile(r"\.experts\.(\d+)\.")
_STACK_KEY = re.compile(r"^(?P<block>.+)\.experts\.(?P<proj>gate_proj|up_proj|down_proj)$")
_PER_LAYER = ("input_layernorm", "post_attention_layernorm", "self_attn.q_proj", "self_attn.k_proj",
              "self_attn.v_proj", "self_attn.o_proj", "mlp.gate_proj", "mlp.up_proj", "mlp.down_proj")


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
        self.config = without_quantization_config(read_json(cfg_path))
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
            return int(self.layer(key).part("weight.shape")[0])
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
            layer = self.layer(key)
            fam = layer.family()
            m = _STACK_KEY.match(key)
            if not m:
                raise layer.bad("a 3-D layer that is not a stacked experts projection "
                                "(<block>.experts.gate_proj / up_proj / down_proj)")
            if fam not in STACKABLE_FAMILIES:
                raise layer.bad(f"stacked experts stored as {fam}: mistral.rs loads stacked layers only as GGUF "
                                "blocks, AFQ or unquantized")
            if not 1 <= experts <= _MAX_EXPERTS:
                raise layer.bad(f"{experts} stacked experts; expected 1..{_MAX_EXPERTS}", "weight.shape")
            hf_proj = (moe.hf_names if moe is not None else {})
            views = {suffix: self._view_kind(layer, fam, suffix, real, experts) for suffix, real in parts.items()}
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

    def _view_kind(self, layer: LayerView, fam: str, suffix: str, real: str, experts: int) -> str | None:
        dtype, shape = self.shards.meta(real)
        if suffix == "weight.shape":
            return "shape"
        if len(shape) == 0 or shape == [1]:
            return None
        if fam == "gguf" and suffix == "weight":
            if len(shape) != 1 or shape[0] % experts:
                raise layer.bad(f"stacked GGUF weight of shape {shape[:4]} is not {experts} experts' blocks")
            return "bytes"
        if shape[0] != experts:
            raise layer.bad(f"{suffix} of shape {shape[:4]} does not stack {experts} experts", suffix)
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

    # -- one layer, read by the codec of its tag ------------------------------------------------------
    def layer(self, key: str) -> LayerView:
        return LayerView(self.shards, key, self.layers[key])

    def describe_layer(self, key: str) -> LayerDescription:
        """What planning knows of a layer, from its small tensors (its codec's `describe`)."""
        layer = self.layer(key)
        return codec(layer.family()).describe(layer)

    def load_layer(self, key: str) -> Dense | Grid:
        layer = self.layer(key)
        return codec(layer.family()).load(layer)

    # -- the ModelSource interface ------------------------------------------------------------------------
    def _check_shape(self, name: str, shape: tuple, where: Path) -> None:
        """A tensor's shape against config.json (converters/model_shapes.py), and its layer index."""
        i = layer_index(name)
        # the multi-token-prediction layers some models keep after the trunk (GLM-4.5 / GLM-5, DeepSeek-V3:
        # model.layers.<num_hidden_layers + k>, counted by num_nextn_predict_layers) are the model's too
        nextn = self.config.get("num_nextn_predict_layers") if isinstance(self.config, dict) else None
        nextn = nextn if isinstance(nextn, int) and not isinstance(nextn, bool) and 0 <= nextn <= 16 else 0
        if i is not None and self.shapes.layers is not None and i >= self.shapes.layers + nextn:
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
            described = self.describe_layer(key)
            shape = described.shape
            path = self.shards.location[self.layers[key]["weight"]]
            self._check_shape(f"{key}.weight", shape, path)
            yield TensorRecord(f"{key}.weight", shape, described.dtype, lambda k=key: self.load_layer(k),
                               params=described.params, source_file=path.name, **described.record_fields)
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
            layer = self.layer(key)
            fam = codec(layer.family()).label(layer)
            families[fam] = families.get(fam, 0) + 1
        return {"format": "uqff", "version": ".".join(map(str, self.version)),
                "shards": [p.name for p in self.shard_paths], "layers": len(self.layers), "families": families,
                "residual": None if self.residual is None else "residual.safetensors"
                if (self.path / "residual.safetensors").exists() else "model safetensors",
                "architectures": self.config.get("architectures"), "ignored_files": self.ignored_files}


def open_uqff(path: Path, **_: object) -> UqffSource:
    return UqffSource(path)
