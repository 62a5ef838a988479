"""HQQ checkpoints (hqq 0.2.x, and the transformers integration that wraps it), read and written.

An HQQ linear is self-describing: packed codes `W_q`, a float `scale` (already inverted) and a float
`zero` per group, and its own nbits / group_size / axis / packing / compute dtype, so a model may mix
settings layer by layer. W = (q - zero) * scale, computed by hqq in the layer's compute dtype. Three
containers hold the same per-layer state (hqq 0.2.8's `HQQLinear.state_dict`, hqq/core/quantize.py):

* transformers `save_pretrained` (also hqq's `save_to_safetensors`): safetensors, 19 flat tensors per layer
  `<module>.W_q`, `.scale`, `.zero`, ... (20 with `.bias`); ints, bools, strings and dtypes encoded as
  small tensors. config.json carries `quantization_config` {quant_method "hqq", quant_config, skip_modules}.
* hqq's `save_quantized`: one `qmodel.pt` torch pickle {module: {key: python value}} + config.json without
  quantization_config. Read with `torch.load(weights_only=True)` only: a file that needs any other object
  is refused, never unpickled.
* hqq <= 0.1.8 qmodel.pt: {module: {"W_q", "meta": {...}, "bias"}}.

Dtype strings ("torch.float16") map through a whitelist, never `eval`. Grids keep hqq's axis: axis 1 is
the usual per-row group of `group_size` inputs; axis 0 is hqq's strided-row group (records.py).

Writing emits either container (`--type safetensors` (default for non-HQQ sources) or `--type qmodel`;
default for an HQQ source: its own container), with every key hqq 0.2.8 and transformers 4.57.6 need.
HQQ grids and integer-zero grids (GPTQ) are written exactly; anything else, and any `--type` scheme such as
`4g64a0` (bits, group size, axis) that differs from the source, is quantized with hqq's own rule
(kernels/hqq.py) and needs --allow-requant.
"""

from __future__ import annotations

import math
import os
import pickle
import re
import warnings
import zipfile
from collections import Counter
from dataclasses import dataclass, field
from pathlib import Path
from typing import Iterator

import torch

from ...converters.checker import (EXACT, REFUSED, REQUANTIZE, Decision, TargetScheme, check, describe_grid,
                                register_family)
from ...converters.errors import BadInput, QConvertError
from ...converters.plan import Options, TensorPlan
from ...converters.records import Dense, Grid, GridParams, TensorRecord
from ...converters.registry import FormatEntry, register_format
from ...kernels.hqq import (PACKINGS, axis0_compact, axis0_expand, codes_to_grouped, grouped_shape, pack_hqq,
                           packing_for_bits, quantize_hqq, unpack_hqq)
from ...converters.model_shapes import ModelShapes
from ..common.safetensors_header import safetensors_tag
from ..common.checkpoint import (CheckpointDir, CheckpointSource, SIDE_FILES, ShardWriter, copy_side_files, read_json,
                              write_json)

__all__ = ["HqqLayer", "HqqSafetensorsSource", "HqqPickleSource", "HqqWriter", "open_hqq", "DTYPE_NAMES"]

QMODEL = "qmodel.pt"
# dtype strings hqq writes (str(torch.dtype)) -> dtype; nothing else is accepted
DTYPE_NAMES = {"torch.float16": torch.float16, "torch.bfloat16": torch.bfloat16, "torch.float32": torch.float32,
               "torch.uint8": torch.uint8, "torch.int32": torch.int32}
_COMPUTE_DTYPES = (torch.float16, torch.bfloat16, torch.float32)
_SUPPORTED_BITS = (1, 2, 3, 4, 5, 6, 8)
# the per-layer keys of HQQLinear.state_dict() (hqq 0.2.8); bias is optional
LAYER_KEYS = ("W_q", "nbits", "group_size", "shape", "scale", "zero", "axis", "packing", "unpack_view_dtype",
              "view_as_float", "quant_scale", "quant_zero", "compute_dtype", "offload_meta", "encoded_state_dict",
              "stores_quant_config", "channel_wise", "optimize", "round_zero")
_REQUIRED = ("W_q", "nbits", "group_size", "shape", "scale", "zero", "axis", "packing")
# keys only an HQQ layer has (a dense model's tensors are .weight / .bias): one without its W_q is a broken layer
_HQQ_ONLY_KEYS = frozenset(LAYER_KEYS) - {"W_q", "shape", "scale"}
_DECODER_LINEAR = re.compile(r"^model\.layers\.\d+\..*_proj\.weight$")
_EMBEDDING = re.compile(r"(?:^|\.)(?:embed_tokens|wte|word_embeddings)\.weight$")
_INT_DTYPES = (torch.bool, torch.uint8, torch.int8, torch.int16, torch.int32, torch.int64)
_MAX_INT = 1 << 53
_MAX_DIM = 1 << 24  # no released model has a dimension near this
# dtypes a non-HQQ tensor may have (norms, embeddings, dense linears, biases; integer buffers)
_DENSE_DTYPES = (torch.float16, torch.bfloat16, torch.float32, torch.float64, torch.uint8, torch.int8,
                 torch.int16, torch.int32, torch.int64, torch.bool)


@dataclass
class HqqLayer:
    """The decoded state of one HQQLinear."""

    W_q: torch.Tensor
    bits: int
    group_size: int
    shape: tuple[int, int]
    scale: torch.Tensor
    zero: torch.Tensor
    axis: int
    packing: str
    view_as_float: bool
    compute_dtype: torch.dtype
    flags: dict = field(default_factory=dict)  # channel_wise / optimize / round_zero as stored
    nbits_stored: float = 0

    def params(self) -> GridParams:
        out_features, in_features = self.shape
        if self.axis == 1:
            s = self.scale.reshape(out_features, in_features // self.group_size)
            z = self.zero.reshape(out_features, in_features // self.group_size)
        else:  # [p, in] (kernels/hqq.py axis0_expand: the group size need not divide the rows)
            s = axis0_expand(self.scale, self.shape, self.group_size)
            z = axis0_expand(self.zero, self.shape, self.group_size)
            return axis0_params(self.bits, self.shape, s, z, self.compute_dtype)
        return GridParams(bits=self.bits, group_size=self.group_size, scales=s, zeros=z, axis=self.axis,
                          compute_dtype=self.compute_dtype)

    def codes(self) -> torch.Tensor:
        packing = PACKINGS[self.packing]
        words = self.W_q
        if self.view_as_float:
            words = words.contiguous().view(packing.storage)
        rows = grouped_shape(self.shape, self.group_size, self.axis)[0]
        grouped = unpack_hqq(words, packing, rows)
        return grouped.reshape(self.shape)

    def grid(self) -> Grid:
        return Grid(self.params(), self.codes())


def axis0_params(bits: int, shape: tuple[int, int], scales: torch.Tensor, zeros: torch.Tensor,
                 compute_dtype: torch.dtype) -> GridParams:
    """records.py's axis-0 grid from the expanded [p, in] scales and zeros: R = p, group_size = out / p."""
    return GridParams(bits=bits, group_size=shape[0] // scales.shape[0], scales=scales, zeros=zeros, axis=0,
                      compute_dtype=compute_dtype)


# --------------------------------------------------------------------------------------------------
# decoding the per-layer state (both encodings) with validation


class _LayerDecoder:
    """Decodes one layer's values, from encoded safetensors tensors or from plain python values."""

    def __init__(self, values: dict, where: Path, prefix: str):
        self.values, self.where, self.prefix = values, where, prefix

    def bad(self, msg: str, key: str | None = None) -> BadInput:
        return BadInput(msg, path=self.where, tensor=f"{self.prefix}.{key}" if key else self.prefix)

    def has(self, key: str) -> bool:
        return key in self.values and self.values[key] is not None

    def tensor(self, key: str) -> torch.Tensor:
        v = self.values[key]
        if isinstance(v, _ShapeOnly):  # W_q while planning: header facts only
            return v  # type: ignore[return-value]
        if not isinstance(v, torch.Tensor):
            raise self.bad(f"expected a tensor, found {type(v).__name__}", key)
        return v.data if isinstance(v, torch.nn.Parameter) else v

    def number(self, key: str) -> float:
        v = self.values[key]
        if isinstance(v, torch.Tensor):
            if v.numel() != 1:
                raise self.bad(f"expected a scalar, found shape {tuple(v.shape)}", key)
            if not (v.dtype.is_floating_point or v.dtype in _INT_DTYPES):
                raise self.bad(f"expected a number, found a {v.dtype} tensor", key)
            v = v.item()
        if not isinstance(v, (bool, int, float)):
            raise self.bad(f"expected a number, found {type(v).__name__}", key)
        if isinstance(v, float) and not math.isfinite(v) or isinstance(v, int) and abs(v) > _MAX_INT:
            raise self.bad(f"expected a finite number of at most {_MAX_INT}, found {str(v)[:30]}", key)
        return v

    def integer(self, key: str) -> int:
        v = self.number(key)
        if isinstance(v, float) and not v.is_integer():
            raise self.bad(f"expected an integer, found {v}", key)
        return int(v)

    def flag(self, key: str, default: bool = False) -> bool:
        return bool(self.number(key)) if self.has(key) else default

    def text(self, key: str) -> str:
        v = self.values[key]
        if isinstance(v, torch.Tensor):
            if v.dtype != torch.uint8 or v.dim() != 1 or v.numel() > 64:
                raise self.bad(f"expected a uint8 character vector, found {v.dtype} {tuple(v.shape)}", key)
            return bytes(v.tolist()).decode("ascii", errors="replace")
        if isinstance(v, torch.dtype):
            return str(v)
        if isinstance(v, str):
            return v
        raise self.bad(f"expected a string, found {type(v).__name__}", key)

    def dtype(self, key: str) -> torch.dtype:
        name = self.text(key)
        if name not in DTYPE_NAMES:
            raise self.bad(f"unknown dtype {name[:40]!r}; expected one of {', '.join(DTYPE_NAMES)}", key)
        return DTYPE_NAMES[name]

    def shape(self, key: str) -> tuple[int, int]:
        v = self.values[key]
        if isinstance(v, torch.Tensor):
            if v.dtype not in (torch.int64, torch.int32) or v.dim() != 1 or v.numel() > 8:
                raise self.bad(f"expected an integer vector, found {v.dtype} {tuple(v.shape)}", key)
            dims = tuple(int(x) for x in v.tolist())
        elif isinstance(v, (torch.Size, tuple, list)) and len(v) <= 8:
            if not all(isinstance(x, int) and not isinstance(x, bool) for x in v):
                raise self.bad("expected a shape of integers", key)
            dims = tuple(int(x) for x in v)
        else:
            raise self.bad(f"expected a shape, found {type(v).__name__}", key)
        if len(dims) != 2 or min(dims) <= 0 or max(dims) > _MAX_DIM:
            raise self.bad(f"expected a 2-D [out, in] shape of sizes 1..{_MAX_DIM}, found {list(dims)[:8]}", key)
        return dims  # type: ignore[return-value]

    def decode(self) -> HqqLayer:
        for key in _REQUIRED:
            if not self.has(key):
                raise self.bad(f"HQQ layer has no {key}", key)
        if self.flag("quant_zero") or self.flag("quant_scale") or self.has("zero_q") or self.has("scale_q"):
            raise self.bad("quantized zero/scale meta (hqq <= 0.1.8 quant_zero/quant_scale) is not supported")
        if self.flag("offload_meta") and self.has("zero_scale"):
            raise self.bad("offloaded zero_scale meta is not supported")
        nbits = self.number("nbits")
        if nbits == 1.58:
            bits = 2  # ternary codes 0..2 in 2-bit packing: a 2-bit grid
        elif float(nbits) == int(nbits) and int(nbits) in _SUPPORTED_BITS:
            bits = int(nbits)
        else:
            raise self.bad(f"unsupported nbits {nbits}; HQQ stores {', '.join(map(str, _SUPPORTED_BITS))} "
                           "(and 1.58)", "nbits")
        packing = self.text("packing")
        if packing not in PACKINGS:
            raise self.bad(f"unknown packing {packing[:40]!r}; expected one of {', '.join(PACKINGS)}", "packing")
        if packing != packing_for_bits(bits).name:
            raise self.bad(f"packing {packing} does not hold {nbits}-bit codes", "packing")
        axis = self.integer("axis")
        if axis not in (0, 1):
            raise self.bad(f"axis {axis} is not 0 or 1", "axis")
        group_size = self.integer("group_size")
        out_features, in_features = shape = self.shape("shape")
        if group_size <= 0 or (out_features * in_features) % group_size:
            raise self.bad(f"group_size {group_size} does not divide the {out_features}x{in_features} weight",
                           "group_size")
        if axis == 1 and in_features % group_size:
            raise self.bad(f"axis-1 groups of {group_size} cross rows of {in_features} inputs; not supported",
                           "group_size")
        n_groups = out_features * in_features // group_size
        want = (n_groups, 1) if axis == 1 else (1, n_groups)
        scale, zero = self.tensor("scale"), self.tensor("zero")
        for key, t in (("scale", scale), ("zero", zero)):
            if tuple(t.shape) != want:
                raise self.bad(f"{key} shape {tuple(t.shape)} does not match {want} for axis {axis}, group_size "
                               f"{group_size}, shape {list(shape)}", key)
            if not torch.is_floating_point(t):
                raise self.bad(f"{key} dtype {t.dtype} is not a float dtype", key)
        compute = self.dtype("compute_dtype") if self.has("compute_dtype") else scale.dtype
        if compute not in _COMPUTE_DTYPES:
            raise self.bad(f"compute_dtype {compute} is not a float dtype", "compute_dtype")
        view_as_float = self.flag("view_as_float")
        pk = PACKINGS[packing]
        if self.has("unpack_view_dtype") and self.dtype("unpack_view_dtype") != pk.storage:
            raise self.bad(f"unpack_view_dtype does not match packing {packing}", "unpack_view_dtype")
        w_q = self.tensor("W_q")
        rows = grouped_shape(shape, group_size, axis)[0]
        cols = out_features * in_features // rows
        want_words = (pk.packed_rows(rows), cols)
        if not pk.fits(rows):
            raise self.bad(f"{rows} group rows cannot be packed as {packing}", "W_q")
        if view_as_float:
            if w_q.dim() != 2 or not w_q.dtype.is_floating_point:
                raise self.bad(f"view_as_float W_q must be a 2-D float tensor, found {w_q.dtype}", "W_q")
            word = torch.tensor([], dtype=pk.storage).element_size()
            width, rest = divmod(w_q.shape[1] * w_q.element_size(), word)
            got = (w_q.shape[0], width if not rest else -1)
        else:
            if w_q.dtype != pk.storage:
                raise self.bad(f"W_q dtype {w_q.dtype} is not {pk.storage} ({packing})", "W_q")
            got = tuple(w_q.shape)
        if got != want_words:
            raise self.bad(f"W_q holds {list(got)} {packing} words, {list(want_words)} expected for shape "
                           f"{list(shape)}, group_size {group_size}, axis {axis}", "W_q")
        flags = {k: self.flag(k, k != "round_zero") for k in ("channel_wise", "optimize", "round_zero")}
        return HqqLayer(w_q, bits, group_size, shape, scale, zero, axis, packing, view_as_float, compute,
                        flags, nbits_stored=nbits)


def _unpacked(layer: HqqLayer, where: Path, prefix: str) -> Grid:
    """The layer's grid with its codes unpacked (the decoder checked the word counts; this is the net)."""
    try:
        return layer.grid()
    except (ValueError, RuntimeError, IndexError):
        raise BadInput(f"W_q words do not unpack into {list(layer.shape)} {layer.packing} codes", path=where,
                       tensor=f"{prefix}.W_q") from None


def _check_bias(layer: HqqLayer, bias, where: Path, prefix: str) -> None:
    if bias is None:
        return
    if not isinstance(bias, torch.Tensor) or not bias.dtype.is_floating_point or tuple(bias.shape) != (layer.shape[0],):
        what = f"{bias.dtype} {tuple(bias.shape)}" if isinstance(bias, torch.Tensor) else type(bias).__name__
        raise BadInput(f"bias is {what}; expected a float vector of the layer's {layer.shape[0]} outputs",
                       path=where, tensor=f"{prefix}.bias")


def _check_codes(layer: HqqLayer, codes: torch.Tensor, where: Path, prefix: str) -> None:
    top = 2 if layer.nbits_stored == 1.58 else (1 << layer.bits) - 1
    if codes.numel() and int(codes.max()) > top:
        raise BadInput(f"codes exceed {top}, the largest {layer.nbits_stored}-bit code", path=where,
                       tensor=f"{prefix}.W_q")


def _grid_record(prefix: str, layer: HqqLayer, load_layer, source_file: str) -> TensorRecord:
    flags = {"hqq": {"packing": layer.packing, "view_as_float": layer.view_as_float,
                     "nbits": layer.nbits_stored, **layer.flags}}
    return TensorRecord(f"{prefix}.weight", layer.shape, "grid", load_layer, params=layer.params(),
                        source_file=source_file, layer_flags=flags,
                        source_groups=(layer.group_size,) if layer.axis == 0 else ())


# model types whose every decoder layer has these modules (transformers' Llama, Mistral, Qwen2, Qwen3): a
# checkpoint of one of them without one would convert into a model without it
_COMPLETE_CHECKED = frozenset({"llama", "mistral", "qwen2", "qwen3"})
_PER_LAYER = ("input_layernorm", "post_attention_layernorm", "self_attn.q_proj", "self_attn.k_proj",
              "self_attn.v_proj", "self_attn.o_proj", "mlp.gate_proj", "mlp.up_proj", "mlp.down_proj")


def _check_complete(config: dict, names: set[str], where: Path) -> None:
    """Every module config.json's model needs is there (`names`: `<module>.weight` of dense tensors and
    HQQ layers alike); checked only for the model types listed above."""
    from ...converters.validate import ConfigView

    model_type = config.get("model_type")
    if not isinstance(model_type, str) or model_type not in _COMPLETE_CHECKED or "num_hidden_layers" not in config:
        return
    view = ConfigView(config, where.parent / "config.json" if where.is_file() else where / "config.json")
    layers = view.int("num_hidden_layers", lo=1, hi=1 << 16)
    want = ["model.embed_tokens.weight", "model.norm.weight"]
    if not view.bool("tie_word_embeddings", default=False):
        want.append("lm_head.weight")
    want += [f"model.layers.{i}.{m}.weight" for i in range(layers) for m in _PER_LAYER]
    missing = [n for n in want if n not in names]
    if missing:
        more = f" and {len(missing) - 3} more" if len(missing) > 3 else ""
        raise BadInput(f"{len(missing)} module(s) the model needs (config.json: {layers} layers) are missing: "
                       f"{', '.join(missing[:3])}{more}", path=where, tensor=missing[0])


def _side_files(path: Path) -> dict[str, Path]:
    return {n: path / n for n in SIDE_FILES if (path / n).exists()}


def _describe(fmt: str, container: str, layers: dict[str, HqqLayer], extra: dict) -> dict:
    schemes = Counter(f"{l.nbits_stored}-bit g{l.group_size} axis {l.axis} {l.packing} compute "
                      f"{str(l.compute_dtype)[6:]}{' view_as_float' if l.view_as_float else ''}"
                      for l in layers.values())
    return {"format": fmt, "container": container, "quantized_modules": len(layers), "schemes": dict(schemes),
            "layout": "W = (q - zero) * scale per group; axis 1: reshape(-1, gs) rows, axis 0: reshape(gs, -1) "
                      "columns; codes packed along dim 0 in slabs", **extra}


# --------------------------------------------------------------------------------------------------
# transformers safetensors


def _quantization_config(cfg: dict, where: Path) -> dict:
    """config.json's quantization_config ({} when absent or empty); anything but an object is bad input."""
    if not cfg.get("quantization_config"):
        return {}
    from ...converters.validate import ConfigView

    return dict(ConfigView(cfg, where).view("quantization_config").data)


class HqqSafetensorsSource(CheckpointSource):
    """A transformers (or hqq save_to_safetensors) HQQ directory: flat `<module>.<key>` tensors."""

    format_name = "hqq"
    container = "safetensors"

    def __init__(self, path: Path):
        self.path = Path(path)
        cfg = read_json(self.path / "config.json")
        self.quant_config = _quantization_config(cfg, self.path / "config.json")
        if self.quant_config and str(self.quant_config.get("quant_method", "")).lower() != "hqq":
            raise BadInput(f"quant_method is {self.quant_config.get('quant_method')!r}, not hqq",
                           path=self.path / "config.json")
        self.config = {k: v for k, v in cfg.items() if k != "quantization_config"}
        self.ckpt = CheckpointDir(self.path)
        self.modules: dict[str, dict[str, str]] = {}
        for name in self.ckpt.location:
            prefix, _, key = name.rpartition(".")
            if key == "W_q":
                self.modules[prefix] = {}
        for name in self.ckpt.location:
            prefix, _, key = name.rpartition(".")
            if prefix in self.modules and (key in LAYER_KEYS or key == "bias"):
                self.modules[prefix][key] = name
            elif prefix in self.modules:
                # e.g. a GPTQ `.qweight` or a dense `.weight` left beside the layer: which one would a loader
                # use? transformers' HQQ loader takes the 19 keys; we refuse rather than guess
                raise BadInput(f"stray tensor beside the HQQ layer {prefix}: an HQQ layer holds only "
                               f"{', '.join(_REQUIRED)} and hqq's flags (and bias)", path=self.ckpt.file_of(name),
                               tensor=name)
        if not self.modules:
            raise BadInput("no HQQ layers (no <module>.W_q tensors) in the safetensors files", path=self.path)
        for name in self.ckpt.location:
            prefix, _, key = name.rpartition(".")
            if key in _HQQ_ONLY_KEYS and prefix not in self.modules:
                raise BadInput(f"HQQ layer {key} without its {prefix}.W_q", path=self.ckpt.file_of(name), tensor=name)
        _check_complete(self.config, {f"{m}.weight" for m in self.modules} | set(self.ckpt.location), self.path)
        self.shapes = ModelShapes(self.config, self.path / "config.json")  # the dense tensors against config.json
        for prefix, parts in self.modules.items():
            if "bias" in parts:
                shape = tuple(self.ckpt.shape(parts["bias"]))
                if len(shape) != 1:
                    raise BadInput(f"bias of shape {shape} is not a vector", path=self.ckpt.file_of(parts["bias"]),
                                   tensor=parts["bias"])
        self._layers: dict[str, HqqLayer] = {}

    def layer(self, prefix: str, with_codes: bool = False) -> HqqLayer:
        """The decoded layer; the packed codes are read only when asked (planning reads the small tensors)."""
        if prefix in self._layers and not with_codes:
            return self._layers[prefix]
        parts = self.modules[prefix]
        values = {}
        for key, name in parts.items():
            if key == "bias":
                continue
            if key == "W_q" and not with_codes:
                values[key] = _ShapeOnly(self.ckpt, name)
            else:
                values[key] = self.ckpt.get(name)
        where = self.ckpt.file_of(parts["W_q"])
        layer = _LayerDecoder(values, where, prefix).decode()
        if not with_codes:
            self._layers[prefix] = layer
        return layer

    def _load_grid(self, prefix: str) -> Grid:
        layer = self.layer(prefix, with_codes=True)
        where = self.ckpt.file_of(self.modules[prefix]["W_q"])
        grid = _unpacked(layer, where, prefix)
        _check_codes(layer, grid.codes, where, prefix)
        return grid

    def records(self) -> Iterator[TensorRecord]:
        consumed = {n for parts in self.modules.values() for k, n in parts.items() if k not in ("W_q", "bias")}
        for shard in self.ckpt.shards:
            for name in self.ckpt.keys(shard):
                if name in consumed:
                    continue
                prefix, _, key = name.rpartition(".")
                if key == "W_q":
                    yield _grid_record(prefix, self.layer(prefix), lambda p=prefix: self._load_grid(p), shard)
                else:
                    self.shapes.check_dense(name, self.ckpt.shape(name), self.ckpt.path / shard, self.ckpt.dtype(name))
                    yield self.ckpt.dense_record(name, shard)

    def describe(self) -> dict:
        layers = {p: self.layer(p) for p in self.modules}
        return _describe("hqq", "transformers safetensors", layers,
                         {"skip_modules": self.quant_config.get("skip_modules"), "shards": len(self.ckpt.shards),
                          "ignored_files": self.ignored_files})


class _ShapeOnly:
    """Stands in for W_q while planning: shape and dtype from the safetensors header, no data read."""

    def __init__(self, ckpt: CheckpointDir, name: str):
        self.shape = torch.Size(ckpt.shape(name))
        self.dtype = {"U8": torch.uint8, "I32": torch.int32, "F16": torch.float16, "BF16": torch.bfloat16,
                      "F32": torch.float32}.get(ckpt.dtype(name), torch.float64)

    def dim(self) -> int:
        return len(self.shape)

    def element_size(self) -> int:
        return torch.tensor([], dtype=self.dtype).element_size()



# --------------------------------------------------------------------------------------------------
# hqq library qmodel.pt (current and legacy)


_PICKLE = re.compile(r"^[^/]+/data\.pkl$")


def _check_torch_zip(path: Path) -> None:
    """What torch.save writes (since torch 1.6, and hqq's save_quantized through it): an uncompressed zip
    with one `<archive>/data.pkl` and the storages as `<archive>/data/<key>` records. Checked from the zip's
    own directory before torch reads anything, so that every size it will use is bounded by the file: no
    compressed member (nothing can inflate), members inside the file, and a pickle torch must read whole
    of at most the file's size. A pre-1.6 (non-zip) pickle is refused: its storages are sized by the pickle
    itself and allocated before any check."""
    try:
        size = os.path.getsize(path)
        if not zipfile.is_zipfile(path):
            raise BadInput("not a zip-format torch file (torch.save has written zip files since torch 1.6; "
                           "hqq's save_quantized writes them)", path=path)
        with zipfile.ZipFile(path) as z:
            members = z.infolist()
    except BadInput:
        raise
    except FileNotFoundError:
        raise BadInput("file not found", path=path) from None
    except (zipfile.BadZipFile, OSError, ValueError, EOFError, OverflowError) as e:
        raise BadInput(f"not a readable zip file ({_zip_problem(e)})", path=path) from None
    pickles = [m for m in members if _PICKLE.match(m.filename)]
    if len(pickles) != 1:
        raise BadInput(f"expected one <archive>/data.pkl in the torch zip, found {len(pickles)}", path=path)
    for m in members:
        if m.compress_type != zipfile.ZIP_STORED:
            raise BadInput(f"zip member {m.filename[:80]!r} is compressed; torch.save stores members "
                           "uncompressed", path=path)
        if m.header_offset + m.file_size > size or m.file_size > size:
            raise BadInput(f"zip member {m.filename[:80]!r} claims {m.file_size} bytes past the end of the "
                           f"{size}-byte file (truncated?)", path=path)
    records = {m.filename: m.file_size for m in members}
    archive = pickles[0].filename.rpartition("/")[0]
    for key, type_name, numel in _pickled_storages(path, pickles[0]):
        record = f"{archive}/data/{key}"
        width = _STORAGE_BYTES.get(type_name)
        if record not in records:
            raise BadInput(f"the pickle names storage {key[:40]!r}, which the zip does not hold", path=path)
        if width is not None and numel * width != records[record]:
            raise BadInput(f"storage {key[:40]!r} claims {numel} x {width} bytes, its record holds "
                           f"{records[record]}", path=path)


# torch's typed storage classes (what torch.save names in each storage's persistent id) and their widths
_STORAGE_BYTES = {"DoubleStorage": 8, "FloatStorage": 4, "HalfStorage": 2, "BFloat16Storage": 2, "LongStorage": 8,
                  "IntStorage": 4, "ShortStorage": 2, "CharStorage": 1, "ByteStorage": 1, "BoolStorage": 1,
                  "ComplexFloatStorage": 8, "ComplexDoubleStorage": 16}
_MARK = object()


def _pickled_storages(path: Path, info: zipfile.ZipInfo) -> list[tuple[str, str, int]]:
    """(key, storage class, element count) of every storage the pickle names, read by walking its opcodes
    (pickletools, nothing executed) with a stack of the few values that matter: torch writes each
    storage as the persistent id ('storage', <class>, key, location, numel). Bounded by the pickle's size."""
    import pickletools

    with open(path, "rb") as f:
        f.seek(info.header_offset)
        local = f.read(30)
        if len(local) != 30 or local[:4] != b"PK\x03\x04":
            raise BadInput("the zip's entry for data.pkl does not point at a file header", path=path)
        f.seek(info.header_offset + 30 + int.from_bytes(local[26:28], "little") + int.from_bytes(local[28:30], "little"))
        data = f.read(info.file_size)
    found: list[tuple[str, str, int]] = []
    stack: list = []
    memo: dict = {}
    try:
        for op, arg, _ in pickletools.genops(data):
            name = op.name
            if name in ("BINPUT", "LONG_BINPUT", "PUT"):
                memo[arg] = stack[-1]
            elif name == "MEMOIZE":
                memo[len(memo)] = stack[-1]
            elif name in ("BINGET", "LONG_BINGET", "GET"):
                stack.append(memo.get(arg))
            elif name == "GLOBAL":
                stack.append(("global", str(arg).rpartition(" ")[2]))
            elif name == "STACK_GLOBAL":  # protocol 4: module and name strings from the stack
                qualname = stack.pop()
                stack.pop()
                stack.append(("global", qualname if isinstance(qualname, str) else None))
            elif name == "MARK":
                stack.append(_MARK)
            elif name == "TUPLE":
                i = len(stack) - 1 - stack[::-1].index(_MARK)
                items, stack[i:] = tuple(stack[i + 1:]), []
                stack.append(items)
            elif name in ("TUPLE1", "TUPLE2", "TUPLE3"):
                n = int(name[-1])
                if len(stack) < n:
                    raise IndexError
                items, stack[-n:] = tuple(stack[-n:]), []
                stack.append(items)
            elif name == "BINPERSID":
                pid = stack.pop()
                if isinstance(pid, tuple) and len(pid) == 5 and pid[0] == "storage":
                    _, cls, key, _, numel = pid
                    if not (isinstance(key, str) and isinstance(numel, int)):
                        raise BadInput("a storage's persistent id is not (storage, class, key, location, numel)",
                                       path=path)
                    found.append((key, cls[1] if isinstance(cls, tuple) else None, numel))
                stack.append(None)
            elif isinstance(arg, (str, int)) and not op.stack_before and len(op.stack_after) == 1:
                stack.append(arg)  # strings and integers (BINUNICODE, BININT, LONG1...)
            else:  # any other opcode: pop what it takes, push placeholders for what it leaves
                before = [s.name for s in op.stack_before]
                if "mark" in before:
                    i = len(stack) - 1 - stack[::-1].index(_MARK)
                    del stack[i:]
                    before = before[: before.index("mark")]
                if len(stack) < len(before):
                    raise IndexError
                del stack[len(stack) - len(before):]
                stack.extend([None] * len(op.stack_after))
    except BadInput:
        raise
    except Exception:  # a bad opcode, a pop from an empty stack, a missing mark: not a pickle torch wrote
        raise BadInput("corrupt torch file: data.pkl does not decode as a pickle", path=path) from None
    return found


def _zip_problem(e: Exception) -> str:
    """Why zipfile could not read a torch.save archive, in our words (its exception names are not for users)."""
    if isinstance(e, UnicodeDecodeError):
        return "a member name is not valid text: the directory is damaged"
    if isinstance(e, zipfile.BadZipFile):
        return "its directory is damaged or missing"
    if isinstance(e, (EOFError, OverflowError)):
        return "it ends before its directory says"
    if isinstance(e, OSError):
        return e.strerror or "an I/O error"
    return "a value in its directory is out of range"


def load_qmodel(path: Path) -> dict:
    """torch.load with weights_only=True (tensors, numbers, strings, dtypes, torch.Size only), memory-mapped
    (so no storage is read, and a storage claiming more bytes than the file holds fails in torch);
    anything else is refused, never unpickled. Every failure of torch's unpickler on a corrupt pickle
    (it raises UnpicklingError, but also KeyError, TypeError, IndexError, UnicodeDecodeError, struct.error
    ... on flipped bytes) is a BadInput, and torch's warnings about odd pickles are not printed."""
    path = Path(path)
    _check_torch_zip(path)
    try:
        with warnings.catch_warnings():
            warnings.simplefilter("ignore")
            data = torch.load(str(path), map_location="cpu", weights_only=True, mmap=True)
    except pickle.UnpicklingError as e:
        text = " ".join(str(e).split())
        m = re.search(r"GLOBAL (\S+) was not an allowed global|whose module (\S+) is blocked", text)
        if m:  # the pickle names a callable outside torch's weights-only allowlist
            what = (m[1] or m[2] or "")[:80]
            raise BadInput(f"refused: not a weights-only torch file, its pickle asks for {what!r}, which is not "
                           "a tensor, number, string or dtype; such files are never unpickled", path=path) from None
        raise BadInput("corrupt torch file: data.pkl does not decode as a weights-only pickle", path=path) from None
    except Exception:  # whatever torch's unpickler or zip reader raises on flipped bytes or a bad storage
        raise BadInput("corrupt torch file: data.pkl or the storages it names do not decode", path=path) from None
    if not isinstance(data, dict) or not all(isinstance(k, str) and isinstance(v, dict) for k, v in data.items()):
        raise BadInput("expected a dict {module name: {key: value}} (hqq save_quantized layout)", path=path)
    # a pickle may mark a tensor requires_grad (hqq's files do not): weights are read as plain data, so that
    # reading a scalar of it does not warn about autograd
    for state in data.values():
        for key, value in state.items():
            if isinstance(value, torch.Tensor) and value.requires_grad:
                state[key] = value.detach()
    return data


class HqqPickleSource:
    """An hqq library `save_quantized` directory: qmodel.pt + config.json."""

    format_name = "hqq"
    container = "qmodel"

    def __init__(self, path: Path):
        path = Path(path)
        self.path = path.parent if path.is_file() else path
        self.file = path if path.is_file() else path / QMODEL
        cfg = read_json(self.path / "config.json")
        self.quant_config = _quantization_config(cfg, self.path / "config.json")
        self.config = {k: v for k, v in cfg.items() if k != "quantization_config"}
        self.weights = load_qmodel(self.file)
        self.legacy = any("meta" in v for v in self.weights.values() if "W_q" in v)
        self._layers: dict[str, HqqLayer] = {}
        for module, state in self.weights.items():
            if "W_q" in state:
                self._layers[module] = self._decode(module, state)
                _check_bias(self._layers[module], state.get("bias"), self.file, module)
            else:
                for key, value in state.items():
                    name = f"{module}.{key}"
                    if not isinstance(key, str):
                        raise BadInput(f"key {str(key)[:40]!r} is not a string", path=self.file, tensor=module)
                    if not isinstance(value, torch.Tensor):
                        raise BadInput(f"expected a tensor, found {type(value).__name__}", path=self.file,
                                       tensor=name)
                    if value.dtype not in _DENSE_DTYPES or value.is_sparse or value.dim() > 8:
                        raise BadInput(f"{value.dtype} tensor of {value.dim()} dimensions is not a weight this "
                                       "reader passes through", path=self.file, tensor=name)
        if not self._layers:
            raise BadInput("no HQQ layers (no entry with W_q)", path=self.file)
        names = {f"{m}.weight" for m in self._layers}
        names |= {f"{m}.{k}" if m else str(k) for m, state in self.weights.items() if m not in self._layers for k in state}
        _check_complete(self.config, names, self.file)
        self.shapes = ModelShapes(self.config, self.path / "config.json")

    def _decode(self, module: str, state: dict) -> HqqLayer:
        values = dict(state)
        if "meta" in values:  # hqq <= 0.1.8
            meta = values.pop("meta")
            if not isinstance(meta, dict):
                raise BadInput("legacy meta is not a dict", path=self.file, tensor=f"{module}.meta")
            values.update(meta)
        return _LayerDecoder(values, self.file, module).decode()

    def _load_grid(self, module: str) -> Grid:
        layer = self._layers[module]
        grid = _unpacked(layer, self.file, module)
        _check_codes(layer, grid.codes, self.file, module)
        return grid

    def records(self) -> Iterator[TensorRecord]:
        for module, state in self.weights.items():
            if module in self._layers:
                yield _grid_record(module, self._layers[module], lambda m=module: self._load_grid(m), self.file.name)
                bias = state.get("bias")
                if bias is not None:
                    yield self._dense(f"{module}.bias", bias)
            else:
                for key, value in state.items():
                    yield self._dense(f"{module}.{key}" if module else key, value)

    def _dense(self, name: str, value) -> TensorRecord:
        t = value.data if isinstance(value, torch.nn.Parameter) else value
        if not isinstance(t, torch.Tensor):
            raise BadInput(f"expected a tensor, found {type(t).__name__}", path=self.file, tensor=name)
        self.shapes.check_dense(name, tuple(t.shape), self.file, safetensors_tag(t.dtype))
        return TensorRecord(name, tuple(t.shape), str(t.dtype)[6:], lambda t=t: Dense(t), source_file=self.file.name)

    def side_files(self) -> dict[str, Path]:
        return _side_files(self.path)

    def describe(self) -> dict:
        return _describe("hqq", "hqq qmodel.pt (legacy meta)" if self.legacy else "hqq qmodel.pt", self._layers,
                         {"modules": len(self.weights)})


def open_hqq(path: Path, **_: object):
    path = Path(path)
    if path.is_file() and path.suffix == ".pt":
        return HqqPickleSource(path)
    if not path.is_dir():
        raise BadInput("not a directory (expected an HQQ checkpoint folder or a qmodel.pt)", path=path)
    if (path / QMODEL).exists():
        return HqqPickleSource(path)
    return HqqSafetensorsSource(path)


def sniff_hqq(path: Path) -> bool:
    path = Path(path)
    if path.is_file():
        return path.name == QMODEL
    if not path.is_dir():
        return False
    if (path / QMODEL).exists():
        return True
    try:
        qc = read_json(path / "config.json").get("quantization_config") or {}
    except BadInput:
        return False
    if not isinstance(qc, dict):  # not for detection to judge: the reader named by the user refuses it
        return False
    if str(qc.get("quant_method", "")).lower() == "hqq":
        return True
    # hqq's save_to_safetensors writes no quantization_config: the per-layer W_q tensors of the model's own
    # files decide (not of an adapter or another weight file beside them)
    try:
        return any(k.endswith(".W_q") for k in CheckpointDir(path).location)
    except BadInput:
        return False


# --------------------------------------------------------------------------------------------------
# Writer

_STYLES = {"safetensors": "safetensors", "transformers": "safetensors", "hf": "safetensors", "st": "safetensors",
           "qmodel": "qmodel", "pt": "qmodel", "hqq-lib": "qmodel", "lib": "qmodel"}
_SCHEME_RE = re.compile(r"^(?:b|q)?(?P<bits>[1-8])(?:bit)?[-_]?g(?P<group>\d+)(?:[-_]?a(?:xis)?(?P<axis>[01]))?$")


@dataclass(frozen=True)
class HqqScheme:
    bits: int
    group_size: int
    axis: int = 1

    def label(self) -> str:
        return f"hqq {self.bits}-bit g{self.group_size} axis {self.axis}"


def parse_hqq_type(text: str | None) -> tuple[str | None, HqqScheme | None]:
    """`qmodel`, `safetensors`, `4g64`, `4g64a0`, `qmodel:3g64a1` -> (style or None, scheme or None)."""
    style, scheme = None, None
    for token in re.split(r"[:,+]", (text or "").strip().lower()):
        if not token:
            continue
        if token in _STYLES:
            style = _STYLES[token]
            continue
        m = _SCHEME_RE.match(token)
        if not m or int(m["bits"]) not in _SUPPORTED_BITS:
            raise QConvertError(f"unknown HQQ type {text!r}; write a container (safetensors, qmodel) and/or a "
                                "scheme bits-g-group-a-axis, e.g. 4g64, 4g64a0, qmodel:3g64a1")
        scheme = HqqScheme(int(m["bits"]), int(m["group"]), int(m["axis"] or 1))
    return style, scheme


def _scheme_fits(scheme: HqqScheme, shape: tuple[int, int]) -> str:
    """'' when hqq can store a weight of this shape with this scheme, else why not."""
    out_features, in_features = shape
    gs = scheme.group_size
    if scheme.axis == 1 and in_features % gs:
        return f"rows of {in_features} are not whole groups of {gs}"
    if scheme.axis == 0 and (out_features * in_features) % gs:  # hqq: W.reshape(gs, -1), numel % gs == 0
        return f"the {out_features}x{in_features} weight is not whole axis-0 groups of {gs}"
    rows = grouped_shape(shape, gs, scheme.axis)[0]
    if not packing_for_bits(scheme.bits).fits(rows):
        return f"{rows} group rows cannot be packed as {packing_for_bits(scheme.bits).name}"
    return ""


def _axis0_layout(p: GridParams, shape: tuple[int, int], prefer: tuple[int, ...] = ()):
    """(group_size, scale [1, M], zero [1, M]) of the hqq layout an axis-0 grid is stored in, or None."""
    return axis0_compact(p.scales, p.zeros, shape, p.bits, prefer)


def _source_scheme(p: GridParams, shape: tuple[int, int], prefer: tuple[int, ...] = ()) -> HqqScheme:
    """The grid's own hqq scheme (axis 0: the group size of its hqq layout, not records.py's out / p)."""
    if p.axis == 0:
        layout = _axis0_layout(p, shape, prefer) if p.row_idx is None else None
        return HqqScheme(p.bits, layout[0] if layout else p.group_size, 0)
    return HqqScheme(p.bits, p.group_size, p.axis)


def _grid_as_hqq(p, shape: tuple[int, int], s: TargetScheme, native=None, prefer: tuple[int, ...] = ()) -> Decision:
    """The alignment checker's "hqq" family: can hqq store this grid as it is (its own scheme kept)?"""
    if not isinstance(p, GridParams):
        return Decision(REQUANTIZE, "dense weights quantized with hqq's rule (no calibration)")
    if p.bits not in s.code_bits:
        return Decision(REQUANTIZE, f"{p.bits}-bit codes have no hqq packing")
    if p.mins is not None:
        return Decision(REQUANTIZE, "min-form grids (W = s*q + m) have no exact hqq zero point")
    if p.axis not in (0, 1) or (p.axis == 1 and not p.contiguous_groups(shape[1])):
        return Decision(REQUANTIZE, "act-order groups are not hqq groups")
    if p.axis == 0 and p.row_idx is not None:
        return Decision(REQUANTIZE, "reordered axis-0 rows are not hqq groups")
    if p.axis == 0 and _axis0_layout(p, shape, prefer) is None:
        return Decision(REFUSED, f"no hqq axis-0 group size gives these {tuple(p.scales.shape)} scales with "
                                 f"{packing_for_bits(p.bits).name} packing")
    why = _scheme_fits(_source_scheme(p, shape, prefer), shape)
    if why:
        return Decision(REFUSED, why)
    if not torch.is_floating_point(p.zeros) and not bool((p.zeros.abs() <= 256).all()):
        return Decision(REQUANTIZE, "zero points are not exact in the compute dtype")
    return Decision(EXACT, "codes, scales and zeros kept", keeps_codes=True)


register_family("hqq", _grid_as_hqq)
# the hqq target that keeps a grid's own scheme (bits, group, axis): float zero points, meta in the compute
# dtype, hqq's packings (kernels/hqq.py PACKINGS)
HQQ_KEEP = TargetScheme("hqq", "hqq", zero="float", scale="source", code_bits=tuple(_SUPPORTED_BITS))


class HqqWriter:
    name = "hqq"
    output_is_file = False

    def plan_tensor(self, rec: TensorRecord, options: Options, source) -> TensorPlan:
        _, scheme = parse_hqq_type(options.explicit_type(rec.name) or options.type)
        if rec.is_grid and _EMBEDDING.search(rec.name):
            # hqq (and transformers' HQQ loader) quantize nn.Linear only: a quantized token embedding (UQFF
            # 1.2, GGUF) is stored as its dequantized values in the source's compute dtype, which is exact
            cd = rec.params.compute_dtype
            return TensorPlan(rec.name, rec.shape, describe_grid(rec.params, rec.shape[1]), str(cd)[6:], EXACT,
                              f"hqq quantizes linear layers only: the embedding is stored dequantized ({str(cd)[6:]})",
                              out_name=rec.name, info={"kind": "dequant", "dtype": cd})
        if rec.is_grid:
            p = rec.params
            src = describe_grid(p, rec.shape[1])
            prefer = tuple(g for g in rec.source_groups if g > 0)  # the hqq group it was stored with
            own = _source_scheme(p, rec.shape, prefer)
            same = scheme is None or scheme == own
            kept = check(p, rec.shape, HQQ_KEEP, prefer_groups=prefer)
            verdict, reason = (kept.verdict, kept.reason) if same else (REQUANTIZE, "scheme differs from the source grid")
            if verdict == EXACT:
                return TensorPlan(rec.name, rec.shape, src, own.label(), EXACT, reason, out_name=rec.name,
                                  info={"kind": "grid", "hqq": rec.layer_flags.get("hqq", {}), "axis0_group_size": prefer})
            want = scheme or HqqScheme(p.bits if p.bits in _SUPPORTED_BITS else 4,
                                       p.group_size if p.axis == 1 else 64, 1)
            why = _scheme_fits(want, rec.shape)
            if why:
                return TensorPlan(rec.name, rec.shape, src, want.label(), REFUSED, why, out_name=rec.name)
            alt = ""
            if not same and kept.verdict == EXACT:
                alt = f"--type {own.bits}g{own.group_size}a{own.axis} (exact)"
            return TensorPlan(rec.name, rec.shape, src, want.label(), REQUANTIZE,
                              reason + "; quantized again with hqq's rule", alternative=alt, out_name=rec.name,
                              info={"kind": "requant", "scheme": want})
        if scheme is not None and len(rec.shape) == 2 and _DECODER_LINEAR.match(rec.name):
            why = _scheme_fits(scheme, rec.shape)
            if why:
                return TensorPlan(rec.name, rec.shape, rec.dtype, scheme.label(), REFUSED, why, out_name=rec.name)
            return TensorPlan(rec.name, rec.shape, rec.dtype, scheme.label(), REQUANTIZE,
                              "dense weights quantized with hqq's rule (no calibration)", out_name=rec.name,
                              info={"kind": "requant", "scheme": scheme})
        return TensorPlan(rec.name, rec.shape, rec.dtype, rec.dtype, EXACT, "copied", out_name=rec.name,
                          info={"kind": "dense"})

    def check_model(self, source, plans, options) -> None:
        return None

    def style(self, source, options: Options) -> str:
        style, _ = parse_hqq_type(options.type)
        style = style or options.extra.get("hqq_style")
        if style is None:
            style = "qmodel" if getattr(source, "container", "") == "qmodel" else "safetensors"
        if style not in ("safetensors", "qmodel"):
            raise QConvertError(f"unknown HQQ container {style!r}; choose safetensors or qmodel")
        return style

    def open(self, path: Path, source, plans: list[TensorPlan], options: Options):
        return HqqSession(Path(path), source, plans, self.style(source, options))


def _layer_state(grid: Grid, notes: dict) -> dict:
    """The HQQLinear state (python values) of one grid: codes packed, scale/zero in hqq's keepdim shapes,
    both in the compute dtype (hqq casts them to it at load, so values not exact there would change)."""
    p = grid.params
    out_features, in_features = shape = grid.shape
    packing = packing_for_bits(p.bits)
    cd = p.compute_dtype
    group_size, scale, zero = p.group_size, p.scales, p.zeros
    if p.axis == 0:  # the compact [1, M] meta of the hqq layout (the planner checked there is one)
        layout = _axis0_layout(p, shape, tuple(notes.get("axis0_group_size", ())))
        if layout is None:
            raise QConvertError(f"no hqq axis-0 layout holds scales of shape {tuple(p.scales.shape)}")
        group_size, scale, zero = layout
    words = pack_hqq(codes_to_grouped(grid.codes, group_size, p.axis), packing)
    n_groups = out_features * in_features // group_size
    keep = (n_groups, 1) if p.axis == 1 else (1, n_groups)
    scale = scale.to(cd).reshape(keep).contiguous()
    zero = zero.to(cd).reshape(keep).contiguous()
    hq = notes.get("hqq", {})
    view_as_float = bool(hq.get("view_as_float", False))
    if view_as_float:
        words = words.view(cd)
    nbits = hq.get("nbits", p.bits)
    nbits = 1.58 if nbits == 1.58 else int(p.bits)
    return {"W_q": words, "nbits": nbits, "group_size": int(group_size), "shape": torch.Size(shape),
            "scale": scale, "zero": zero, "axis": int(p.axis), "packing": packing.name,
            "unpack_view_dtype": packing.storage, "view_as_float": view_as_float, "quant_scale": False,
            "quant_zero": False, "compute_dtype": cd, "offload_meta": False, "stores_quant_config": True,
            "channel_wise": bool(hq.get("channel_wise", True)), "optimize": bool(hq.get("optimize", True)),
            "round_zero": bool(hq.get("round_zero", p.bits == 4))}


def encode_value(value) -> torch.Tensor:
    """hqq's safetensors encoding (hqq/core/utils.py encode_safetensor_type)."""
    if isinstance(value, torch.Tensor):
        return value
    if isinstance(value, torch.Size):
        return torch.tensor(list(value), dtype=torch.int64)
    if isinstance(value, torch.dtype):
        value = str(value)
    if isinstance(value, bool):
        return torch.tensor(int(value), dtype=torch.uint8)
    if isinstance(value, int):
        return torch.tensor(value, dtype=torch.int32)
    if isinstance(value, float):
        return torch.tensor(value, dtype=torch.float32)
    if isinstance(value, str):
        return torch.tensor([ord(c) for c in value], dtype=torch.uint8)
    raise TypeError(type(value))


class HqqSession:
    """Streams HQQ layers into either container."""

    def __init__(self, path: Path, source, plans: list[TensorPlan], style: str):
        self.path, self.source, self.style = path, source, style
        self.schemes: Counter = Counter()  # (bits, group_size, axis, view_as_float, round_zero) -> layers
        self.dense_linears: list[str] = []
        self.grid_modules: set[str] = set()
        if style == "safetensors":
            self.shards = ShardWriter(path)
        else:
            # qmodel.pt is one pickle: parts go to temporary files now and are memory-mapped into it at close,
            # so the model is never held in memory
            self.parts_dir = path / ".qmodel-parts"
            self.parts_dir.mkdir()
            self.parts: list[tuple[str, str, Path]] = []  # (module, key, file)

    def add(self, plan: TensorPlan, item: Dense | Grid) -> torch.Tensor:
        kind = plan.info.get("kind")
        if kind == "dequant":
            item = Dense(item.dequantize(plan.info["dtype"]))
        if kind == "requant":
            s = plan.info["scheme"]
            w = item.dequantize(torch.float32)
            codes, scale, zero = quantize_hqq(w, s.bits, s.group_size, s.axis)
            if s.axis == 0:
                shape = tuple(w.shape)
                params = axis0_params(s.bits, shape, axis0_expand(scale, shape, s.group_size),
                                      axis0_expand(zero, shape, s.group_size), torch.float32)
            else:
                params = GridParams(bits=s.bits, group_size=s.group_size, scales=scale.reshape(w.shape[0], -1),
                                    zeros=zero.reshape(w.shape[0], -1), axis=1, compute_dtype=torch.float32)
            item, plan_notes = Grid(params, codes), {"axis0_group_size": (s.group_size,)}
        else:
            plan_notes = {}
        if isinstance(item, Grid):
            prefix = plan.name[: -len(".weight")] if plan.name.endswith(".weight") else plan.name
            state = _layer_state(item, {**self._notes_of(plan), **plan_notes})
            self._put_layer(prefix, state)
            self.grid_modules.add(prefix)
            p = item.params
            self.schemes[(p.bits, p.group_size, p.axis, state["view_as_float"], state["round_zero"])] += 1
            return self._decode_back(state, item.shape)
        tensor = item.tensor
        if len(plan.shape) == 2 and _DECODER_LINEAR.match(plan.name):
            self.dense_linears.append(plan.name[: -len(".weight")])
        self._put_dense(plan.name, tensor)
        return tensor.to(torch.float32)

    def _notes_of(self, plan: TensorPlan) -> dict:
        """hqq's own flags of the source layer (view_as_float, nbits 1.58, optimize...) and its axis-0 group
        size to keep, if any."""
        if plan.info.get("kind") != "grid":
            return {}
        return {"hqq": plan.info.get("hqq", {}), "axis0_group_size": tuple(plan.info.get("axis0_group_size", ()))}

    def _decode_back(self, state: dict, shape) -> torch.Tensor:
        """What hqq decodes from the state written: unpack the written words and dequantize them."""
        layer = HqqLayer(state["W_q"], 2 if state["nbits"] == 1.58 else state["nbits"], state["group_size"],
                         tuple(shape), state["scale"], state["zero"], state["axis"], state["packing"],
                         state["view_as_float"], state["compute_dtype"])
        return layer.grid().dequantize(torch.float32)

    def _put_layer(self, prefix: str, state: dict) -> None:
        if self.style == "safetensors":
            for key, value in state.items():
                self.shards.put(f"{prefix}.{key}", encode_value(value))
            self.shards.put(f"{prefix}.encoded_state_dict", encode_value(True))
        else:
            self._put_part(prefix, None, state)

    def _put_dense(self, name: str, tensor: torch.Tensor) -> None:
        if self.style == "safetensors":
            self.shards.put(name, tensor)
            return
        module, _, key = name.rpartition(".")
        self._put_part(module, key, tensor)

    def _put_part(self, module: str, key: str | None, value) -> None:
        f = self.parts_dir / f"{len(self.parts):06d}.pt"
        torch.save(value, f)
        self.parts.append((module, key, f))

    def close(self) -> None:
        if not self.schemes:
            raise QConvertError("nothing to write as HQQ: the source has no quantized tensors (pass --type, e.g. 4g64)")
        config = {k: v for k, v in self.source.config.items() if k != "quantization_config"}
        if self.style == "safetensors":
            self.shards.close()
            write_json(self.path / "config.json", {**config, "quantization_config": self._quant_config()})
        else:
            weights: dict[str, dict] = {}
            for module, key, f in self.parts:
                value = torch.load(str(f), weights_only=True, mmap=True)
                if key is None:
                    weights.setdefault(module, {}).update(value)
                else:
                    weights.setdefault(module, {})[key] = value
            torch.save(weights, str(self.path / QMODEL))
            del weights
            for _, _, f in self.parts:
                f.unlink()
            self.parts_dir.rmdir()
            # the hqq library writes the plain model config (with architectures) and no quantization_config
            write_json(self.path / "config.json", config)
        copy_side_files(self.source, self.path)

    def _quant_config(self) -> dict:
        bits, group_size, axis, view_as_float, round_zero = self.schemes.most_common(1)[0][0]
        weight = {"nbits": bits, "group_size": group_size, "axis": axis, "channel_wise": True, "optimize": True,
                  "round_zero": round_zero, "view_as_float": view_as_float}
        # transformers leaves skip_modules as nn.Linear and would drop a quantized lm_head's 19 keys (random
        # weights instead): lm_head is skipped only when it is not written quantized
        skip = ([] if "lm_head" in self.grid_modules else ["lm_head"]) + [m for m in self.dense_linears
                                                                        if m != "lm_head"]
        # transformers reads every layer's settings from its own tensors; quant_config, quant_method and
        # skip_modules must still be there (HqqConfig.from_dict and the loader index them)
        return {"quant_config": {"offload_meta": False, "scale_quant_params": None, "zero_quant_params": None,
                                 "weight_quant_params": weight},
                "quant_method": "hqq", "skip_modules": skip}


register_format(FormatEntry("hqq", aliases=("hqq-lib",),
                            description="HQQ: transformers safetensors (19 keys per layer) or hqq qmodel.pt "
                                        "(also the <=0.1.8 W_q/meta layout); any bits/group/axis per layer",
                            open_reader=open_hqq, writer=HqqWriter(), sniff=sniff_hqq,
                            # the --type vocabulary as parse_hqq_type reads it
                            type_help="a container (safetensors, qmodel) and/or a scheme BITSgGROUP[aAXIS], bits "
                                      f"{', '.join(map(str, _SUPPORTED_BITS))}, axis 1 (default) or 0: 4g64, 4g64a0, "
                                      "qmodel:3g64a1; without a scheme each grid keeps its own, without a container "
                                      "the source's (else safetensors)",
                            examples=("qconvert 'gptq->hqq' model-gptq/ model-hqq/",
                                      "qconvert 'hf->hqq' model/ model-hqq/ --type qmodel:4g64 --allow-requant")))
