"""One HQQ linear as hqq 0.2.8 stores it (HQQLinear.state_dict): the per-layer state, decoded and validated from
either encoding (safetensors tensors or python values), and the grid it means.
"""

from __future__ import annotations

import math
import re
from dataclasses import dataclass, field
from pathlib import Path

import torch

from ...converters.errors import BadInput
from ...converters.records import Grid, GridParams, TensorRecord
from ...kernels.hqq import PACKINGS, axis0_expand, grouped_shape, packing_for_bits, unpack_hqq

from ..common.checkpoint import CheckpointDir


QMODEL = "qmodel.pt"
# dtype strings hqq writes (str(torch.dtype)) -> dtype; nothing else is accepted
DTYPE_NAMES = {"torch.float16": torch.float16, "torch.bfloat16": torch.bfloat16, "torch.float32": torch.float32,
               "torch.uint8": torch.uint8, "torch.int32": torch.int32}
_COMPUTE_DTYPES = (torch.float16, torch.bfloat16, torch.float32)
SUPPORTED_BITS = (1, 2, 3, 4, 5, 6, 8)
# the per-layer keys of HQQLinear.state_dict() (hqq 0.2.8); bias is optional
LAYER_KEYS = ("W_q", "nbits", "group_size", "shape", "scale", "zero", "axis", "packing", "unpack_view_dtype",
              "view_as_float", "quant_scale", "quant_zero", "compute_dtype", "offload_meta", "encoded_state_dict",
              "stores_quant_config", "channel_wise", "optimize", "round_zero")
REQUIRED_KEYS = ("W_q", "nbits", "group_size", "shape", "scale", "zero", "axis", "packing")
# keys only an HQQ layer has (a dense model's tensors are .weight / .bias): one without its W_q is a broken layer
HQQ_ONLY_KEYS = frozenset(LAYER_KEYS) - {"W_q", "shape", "scale"}
DECODER_LINEAR = re.compile(r"^model\.layers\.\d+\..*_proj\.weight$")
EMBEDDING = re.compile(r"(?:^|\.)(?:embed_tokens|wte|word_embeddings)\.weight$")
_INT_DTYPES = (torch.bool, torch.uint8, torch.int8, torch.int16, torch.int32, torch.int64)
_MAX_INT = 1 << 53
_MAX_DIM = 1 << 24  # no released model has a dimension near this
# dtypes a non-HQQ tensor may have (norms, embeddings, dense linears, biases; integer buffers)
DENSE_DTYPES = (torch.float16, torch.bfloat16, torch.float32, torch.float64, torch.uint8, torch.int8,
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


class LayerDecoder:
    """Decodes one layer's values, from encoded safetensors tensors or from plain python values."""

    def __init__(self, values: dict, where: Path, prefix: str):
        self.values, self.where, self.prefix = values, where, prefix

    def bad(self, msg: str, key: str | None = None) -> BadInput:
        return BadInput(msg, path=self.where, tensor=f"{self.prefix}.{key}" if key else self.prefix)

    def has(self, key: str) -> bool:
        return key in self.values and self.values[key] is not None

    def tensor(self, key: str) -> torch.Tensor:
        v = self.values[key]
        if isinstance(v, ShapeOnly):  # W_q while planning: header facts only
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
        for key in REQUIRED_KEYS:
            if not self.has(key):
                raise self.bad(f"HQQ layer has no {key}", key)
        if self.flag("quant_zero") or self.flag("quant_scale") or self.has("zero_q") or self.has("scale_q"):
            raise self.bad("quantized zero/scale meta (hqq <= 0.1.8 quant_zero/quant_scale) is not supported")
        if self.flag("offload_meta") and self.has("zero_scale"):
            raise self.bad("offloaded zero_scale meta is not supported")
        nbits = self.number("nbits")
        if nbits == 1.58:
            bits = 2  # ternary codes 0..2 in 2-bit packing: a 2-bit grid
        elif float(nbits) == int(nbits) and int(nbits) in SUPPORTED_BITS:
            bits = int(nbits)
        else:
            raise self.bad(f"unsupported nbits {nbits}; HQQ stores {', '.join(map(str, SUPPORTED_BITS))} "
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


def unpacked_grid(layer: HqqLayer, where: Path, prefix: str) -> Grid:
    """The layer's grid with its codes unpacked (the decoder checked the word counts; this is the net)."""
    try:
        return layer.grid()
    except (ValueError, RuntimeError, IndexError):
        raise BadInput(f"W_q words do not unpack into {list(layer.shape)} {layer.packing} codes", path=where,
                       tensor=f"{prefix}.W_q") from None


def check_bias(layer: HqqLayer, bias, where: Path, prefix: str) -> None:
    if bias is None:
        return
    if not isinstance(bias, torch.Tensor) or not bias.dtype.is_floating_point or tuple(bias.shape) != (layer.shape[0],):
        what = f"{bias.dtype} {tuple(bias.shape)}" if isinstance(bias, torch.Tensor) else type(bias).__name__
        raise BadInput(f"bias is {what}; expected a float vector of the layer's {layer.shape[0]} outputs",
                       path=where, tensor=f"{prefix}.bias")


def check_codes(layer: HqqLayer, codes: torch.Tensor, where: Path, prefix: str) -> None:
    top = 2 if layer.nbits_stored == 1.58 else (1 << layer.bits) - 1
    if codes.numel() and int(codes.max()) > top:
        raise BadInput(f"codes exceed {top}, the largest {layer.nbits_stored}-bit code", path=where,
                       tensor=f"{prefix}.W_q")


def grid_record(prefix: str, layer: HqqLayer, load_layer, source_file: str) -> TensorRecord:
    flags = {"hqq": {"packing": layer.packing, "view_as_float": layer.view_as_float,
                     "nbits": layer.nbits_stored, **layer.flags}}
    return TensorRecord(f"{prefix}.weight", layer.shape, "grid", load_layer, params=layer.params(),
                        source_file=source_file, layer_flags=flags,
                        source_groups=(layer.group_size,) if layer.axis == 0 else ())


class ShapeOnly:
    """Stands in for W_q while planning: shape and dtype from the safetensors header, no data read."""

    def __init__(self, ckpt: CheckpointDir, name: str):
        self.shape = torch.Size(ckpt.shape(name))
        self.dtype = {"U8": torch.uint8, "I32": torch.int32, "F16": torch.float16, "BF16": torch.bfloat16,
                      "F32": torch.float32}.get(ckpt.dtype(name), torch.float64)

    def dim(self) -> int:
        return len(self.shape)

    def element_size(self) -> int:
        return torch.tensor([], dtype=self.dtype).element_size()
