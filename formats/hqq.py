"""HQQ checkpoints (hqq 0.2.x, and the transformers integration that wraps it), read and written.

An HQQ linear is self-describing: packed codes `W_q`, a float `scale` (already inverted) and a float
`zero` per group, and its own nbits / group_size / axis / packing / compute dtype, so a model may mix
settings layer by layer. W = (q - zero) * scale, computed by hqq in the layer's compute dtype. Three
containers hold the same per-layer state (shared spec hqq.md section 3):

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

import pickle
import re
import zipfile
from collections import Counter
from dataclasses import dataclass, field
from pathlib import Path
from typing import Iterator

import torch

from ..converters.align import EXACT, REFUSED, REQUANTIZE, describe_grid
from ..converters.errors import BadInput, QConvertError
from ..converters.plan import Options, TensorPlan
from ..converters.records import Dense, Grid, GridParams, TensorRecord
from ..converters.registry import FormatEntry, register_format
from ..kernels.hqq import PACKINGS, codes_to_grouped, grouped_shape, pack_hqq, packing_for_bits, quantize_hqq, unpack_hqq
from .safetensors_dir import SIDE_FILES, CheckpointDir, ShardWriter, copy_side_files, read_json, write_json

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
_DECODER_LINEAR = re.compile(r"^model\.layers\.\d+\..*_proj\.weight$")


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
        else:
            s = self.scale.reshape(out_features // self.group_size, in_features)
            z = self.zero.reshape(out_features // self.group_size, in_features)
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
            return v.item()
        if isinstance(v, (bool, int, float)):
            return v
        raise self.bad(f"expected a number, found {type(v).__name__}", key)

    def integer(self, key: str) -> int:
        v = self.number(key)
        if float(v) != int(v):
            raise self.bad(f"expected an integer, found {v}", key)
        return int(v)

    def flag(self, key: str, default: bool = False) -> bool:
        return bool(self.number(key)) if self.has(key) else default

    def text(self, key: str) -> str:
        v = self.values[key]
        if isinstance(v, torch.Tensor):
            if v.dtype != torch.uint8 or v.dim() != 1:
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
            if v.dtype not in (torch.int64, torch.int32) or v.dim() != 1:
                raise self.bad(f"expected an integer vector, found {v.dtype} {tuple(v.shape)}", key)
            dims = tuple(int(x) for x in v.tolist())
        elif isinstance(v, (torch.Size, tuple, list)):
            dims = tuple(int(x) for x in v)
        else:
            raise self.bad(f"expected a shape, found {type(v).__name__}", key)
        if len(dims) != 2 or min(dims) <= 0:
            raise self.bad(f"expected a 2-D [out, in] shape, found {list(dims)}", key)
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
        if axis == 0 and out_features % group_size:
            raise self.bad(f"axis-0 groups of {group_size} do not divide {out_features} output rows; not "
                           "supported", "group_size")
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
            width = w_q.shape[1] * w_q.element_size() // torch.tensor([], dtype=pk.storage).element_size()
            got = (w_q.shape[0], width)
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


def _check_codes(layer: HqqLayer, codes: torch.Tensor, where: Path, prefix: str) -> None:
    top = 2 if layer.nbits_stored == 1.58 else (1 << layer.bits) - 1
    if codes.numel() and int(codes.max()) > top:
        raise BadInput(f"codes exceed {top}, the largest {layer.nbits_stored}-bit code", path=where,
                       tensor=f"{prefix}.W_q")


def _grid_record(prefix: str, layer: HqqLayer, load_layer, source_file: str) -> TensorRecord:
    return TensorRecord(f"{prefix}.weight", layer.shape, "grid", load_layer, params=layer.params(),
                        source_file=source_file,
                        notes={"hqq": {"packing": layer.packing, "view_as_float": layer.view_as_float,
                                       "nbits": layer.nbits_stored, **layer.flags}})


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


class HqqSafetensorsSource:
    """A transformers (or hqq save_to_safetensors) HQQ directory: flat `<module>.<key>` tensors."""

    format_name = "hqq"
    container = "safetensors"

    def __init__(self, path: Path):
        self.path = Path(path)
        cfg = read_json(self.path / "config.json")
        self.quant_config = dict(cfg.get("quantization_config") or {})
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
        if not self.modules:
            raise BadInput("no HQQ layers (no <module>.W_q tensors) in the safetensors files", path=self.path)
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
        grid = layer.grid()
        _check_codes(layer, grid.codes, self.ckpt.file_of(self.modules[prefix]["W_q"]), prefix)
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
                    yield self.ckpt.dense_record(name, shard)

    def side_files(self) -> dict[str, Path]:
        return self.ckpt.side_files()

    @property
    def ignored_files(self) -> dict[str, str]:
        """Weight files in the folder that are not part of the model, with why (CheckpointDir.ignored)."""
        return self.ckpt.ignored

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


def load_qmodel(path: Path) -> dict:
    """torch.load with weights_only=True (tensors, numbers, strings, dtypes, torch.Size only), memory-mapped
    where the file allows; anything else is refused, never unpickled."""
    try:
        try:
            data = torch.load(str(path), map_location="cpu", weights_only=True, mmap=True)
        except RuntimeError as e:
            if "mmap" not in str(e).lower():
                raise
            data = torch.load(str(path), map_location="cpu", weights_only=True)  # legacy non-zip files
    except FileNotFoundError:
        raise BadInput("file not found", path=path) from None
    except pickle.UnpicklingError as e:
        first = " ".join(str(e).split())[:200]
        raise BadInput(f"refused: not a weights-only torch file, it asks for objects that are not tensors "
                       f"({first})", path=path) from None
    except (RuntimeError, EOFError, zipfile.BadZipFile, ValueError, OSError) as e:
        raise BadInput(f"cannot read torch file ({' '.join(str(e).split())[:200]})", path=path) from None
    if not isinstance(data, dict) or not all(isinstance(k, str) and isinstance(v, dict) for k, v in data.items()):
        raise BadInput("expected a dict {module name: {key: value}} (hqq save_quantized layout)", path=path)
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
        self.quant_config = dict(cfg.get("quantization_config") or {})
        self.config = {k: v for k, v in cfg.items() if k != "quantization_config"}
        self.weights = load_qmodel(self.file)
        self.legacy = any("meta" in v for v in self.weights.values() if "W_q" in v)
        self._layers: dict[str, HqqLayer] = {}
        for module, state in self.weights.items():
            if "W_q" in state:
                self._layers[module] = self._decode(module, state)
            else:
                for key, value in state.items():
                    if not isinstance(value, torch.Tensor):
                        raise BadInput(f"expected a tensor, found {type(value).__name__}", path=self.file,
                                       tensor=f"{module}.{key}")
        if not self._layers:
            raise BadInput("no HQQ layers (no entry with W_q)", path=self.file)

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
        grid = layer.grid()
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
    if str(qc.get("quant_method", "")).lower() == "hqq":
        return True
    # hqq's save_to_safetensors writes no quantization_config: the per-layer W_q tensors decide
    shard = next(iter(sorted(path.glob("*.safetensors"))), None)
    if shard is None:
        return False
    try:
        from safetensors import safe_open

        with safe_open(str(shard), framework="pt") as f:
            return any(k.endswith(".W_q") for k in f.keys())
    except Exception:
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
    if scheme.axis == 0 and out_features % gs:
        return f"{out_features} output rows are not whole groups of {gs}"
    rows = grouped_shape(shape, gs, scheme.axis)[0]
    if not packing_for_bits(scheme.bits).fits(rows):
        return f"{rows} group rows cannot be packed as {packing_for_bits(scheme.bits).name}"
    return ""


def _grid_as_hqq(p: GridParams, shape: tuple[int, int]) -> tuple[str, str]:
    """(verdict, reason) for storing a grid as hqq without requantizing."""
    if p.bits not in _SUPPORTED_BITS:
        return REQUANTIZE, f"{p.bits}-bit codes have no hqq packing"
    if p.mins is not None:
        return REQUANTIZE, "min-form grids (W = s*q + m) have no exact hqq zero point"
    if p.axis not in (0, 1) or (p.axis == 1 and not p.contiguous_groups(shape[1])):
        return REQUANTIZE, "act-order groups are not hqq groups"
    if p.axis == 0 and p.row_idx is not None:
        return REQUANTIZE, "reordered axis-0 rows are not hqq groups"
    why = _scheme_fits(HqqScheme(p.bits, p.group_size, p.axis), shape)
    if why:
        return REFUSED, why
    if not torch.is_floating_point(p.zeros) and not bool((p.zeros.abs() <= 256).all()):
        return REQUANTIZE, "zero points are not exact in the compute dtype"
    return EXACT, "codes, scales and zeros kept"


class HqqWriter:
    name = "hqq"
    output_is_file = False

    def plan_tensor(self, rec: TensorRecord, options: Options, source) -> TensorPlan:
        _, scheme = parse_hqq_type(options.explicit_type(rec.name) or options.type)
        if rec.is_grid:
            p = rec.params
            src = describe_grid(p, rec.shape[1])
            same = scheme is None or scheme == HqqScheme(p.bits, p.group_size, p.axis)
            verdict, reason = _grid_as_hqq(p, rec.shape) if same else (REQUANTIZE, "scheme differs from the source grid")
            if verdict == EXACT:
                return TensorPlan(rec.name, rec.shape, src, HqqScheme(p.bits, p.group_size, p.axis).label(), EXACT,
                                  reason, out_name=rec.name, info={"kind": "grid", "hqq": rec.notes.get("hqq", {})})
            want = scheme or HqqScheme(p.bits if p.bits in _SUPPORTED_BITS else 4,
                                       p.group_size if p.axis == 1 else 64, 1)
            why = _scheme_fits(want, rec.shape)
            if why:
                return TensorPlan(rec.name, rec.shape, src, want.label(), REFUSED, why, out_name=rec.name)
            alt = ""
            if not same and _grid_as_hqq(p, rec.shape)[0] == EXACT:
                alt = f"--type {p.bits}g{p.group_size}a{p.axis} (exact)"
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
    words = pack_hqq(codes_to_grouped(grid.codes, p.group_size, p.axis), packing)
    n_groups = out_features * in_features // p.group_size
    keep = (n_groups, 1) if p.axis == 1 else (1, n_groups)
    scale = p.scales.to(cd).reshape(keep).contiguous()
    zero = p.zeros.to(cd).reshape(keep).contiguous()
    hq = notes.get("hqq", {})
    view_as_float = bool(hq.get("view_as_float", False))
    if view_as_float:
        words = words.view(cd)
    nbits = hq.get("nbits", p.bits)
    nbits = 1.58 if nbits == 1.58 else int(p.bits)
    return {"W_q": words, "nbits": nbits, "group_size": int(p.group_size), "shape": torch.Size(shape),
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
        if kind == "requant":
            s = plan.info["scheme"]
            w = item.dequantize(torch.float32)
            codes, scale, zero = quantize_hqq(w, s.bits, s.group_size, s.axis)
            r = w.shape[0] // s.group_size if s.axis == 0 else w.shape[0]
            params = GridParams(bits=s.bits, group_size=s.group_size, scales=scale.reshape(r, -1),
                                zeros=zero.reshape(r, -1), axis=s.axis, compute_dtype=torch.float32)
            item = Grid(params, codes)
        if isinstance(item, Grid):
            prefix = plan.name[: -len(".weight")] if plan.name.endswith(".weight") else plan.name
            state = _layer_state(item, self._notes_of(plan))
            self._put_layer(prefix, state)
            p = item.params
            self.schemes[(p.bits, p.group_size, p.axis, state["view_as_float"], state["round_zero"])] += 1
            return self._decode_back(state, item.shape)
        tensor = item.tensor
        if len(plan.shape) == 2 and _DECODER_LINEAR.match(plan.name):
            self.dense_linears.append(plan.name[: -len(".weight")])
        self._put_dense(plan.name, tensor)
        return tensor.to(torch.float32)

    def _notes_of(self, plan: TensorPlan) -> dict:
        """hqq's own flags of the source layer (view_as_float, nbits 1.58, optimize...) to keep, if any."""
        return {"hqq": plan.info.get("hqq", {})} if plan.info.get("kind") == "grid" else {}

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
        skip = ["lm_head"] + [m for m in self.dense_linears if m != "lm_head"]
        # transformers reads every layer's settings from its own tensors; quant_config, quant_method and
        # skip_modules must still be there (HqqConfig.from_dict and the loader index them)
        return {"quant_config": {"offload_meta": False, "scale_quant_params": None, "zero_quant_params": None,
                                 "weight_quant_params": weight},
                "quant_method": "hqq", "skip_modules": skip}


register_format(FormatEntry("hqq", aliases=("hqq-lib",),
                            description="HQQ: transformers safetensors (19 keys per layer) or hqq qmodel.pt "
                                        "(also the <=0.1.8 W_q/meta layout); any bits/group/axis per layer",
                            open_reader=open_hqq, writer=HqqWriter(), sniff=sniff_hqq))
