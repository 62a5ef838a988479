"""torchao safetensors checkpoints (config.json quantization_config.quant_method "torchao"): what transformers 5.24's
TorchAoConfig saves with torchao 0.18, and what pytorch's own releases on the Hub (Qwen3 INT4 / FP8) are.

Layout (torchao/prototype/safetensors: flatten_tensor_state_dict): every quantized weight `<module>.weight` is a
torchao tensor subclass stored as its tensor parts `<module>._weight_<part>` (qdata, scale, zero_point, ...) and a
JSON entry `<module>.weight` in the safetensors header metadata: {"_type": the class, "_data": its attributes
(block_size, dtype, target_dtype, ...), "_tensor_data_names": the parts stored}; `tensor_names` lists every
weight of the file, plain ones as {"_type": "Tensor"}. Read here (torchao 0.18 quantize_/workflows):

- IntxUnpackedToInt8Tensor (IntxWeightOnlyConfig, Int8DynamicActivationIntxWeightConfig): qdata int8 [out, in]
  holding target_dtype's signed codes (int1..int8), scale [out, in/g] and zero_point int8 [out, in/g] per
  block_size [1, g]; dequantize_affine: (q - zp) * scale, in the model dtype.
- Int8Tensor (Int8WeightOnlyConfig, Int8DynamicActivationInt8WeightConfig): qdata int8 (-127..127 as torchao
  quantizes; any int8 read), float32 scale [out, in/g], optional zero_point; the same dequantization.
- Float8Tensor (Float8WeightOnlyConfig, Float8DynamicActivationFloat8WeightConfig): qdata E4M3/E5M2 [out, in],
  float32 scale per block_size (per row [1, in], per tensor, or [rows, cols] blocks);
  _dequantize_affine_float8: float32(q) * scale, then the model dtype.

Each becomes a grid whose float32 dequantization is the exact product (codes offset by 2**(b-1) to the unsigned
codes of the grid convention, the zero points likewise), which equals torchao's own dequantize_affine with
output_dtype float32 bit for bit; rounded once to the model dtype it is the tensor's dequantize() (the model
dtype holds (q - zp) exactly, so torchao's one rounding of the product is ours). A dynamic activation
quantization is a runtime's choice: described, not carried.

Not read, refused in one line naming the file and tensor: Int4Tensor (its qdata packs two codes a byte whose order
no CPU dequantization of torchao documents: its quantizer and matmul are mslk's CUDA kernels),
Int4TilePackedTo4dTensor (tinygemm's CUDA packing, pytorch's Qwen3-8B-INT4), Int4PlainInt32Tensor,
Int4PreshuffledTensor, MXTensor, NVFP4Tensor.
"""

from __future__ import annotations

import json
from pathlib import Path
from typing import Iterator

import torch

from ...converters.errors import BadInput
from ...converters.model_shapes import ModelShapes
from ...converters.records import Grid, GridParams, TensorRecord
from ..common.checkpoint import CheckpointDir, CheckpointSource, quantization_config_of
from ..common.float_grids import FP8_ELEMENTS, expand_block_rows, float_grid
from ..common.quant_config import read_config
from ..common.safetensors_header import read_header

__all__ = ["TorchAoSource", "open_torchao", "sniff_torchao", "READ_TYPES"]

READ_TYPES = ("IntxUnpackedToInt8Tensor", "Int8Tensor", "Float8Tensor")
# torchao's other tensor subclasses (safetensors_utils.ALLOWED_TENSORS_SUBCLASSES), and why each is not read
_NOT_READ = {
    "Int4Tensor": "its packed int4 qdata is made and used only by mslk's CUDA kernels (no CPU dequantization "
                  "documents its nibble order)",
    "Int4TilePackedTo4dTensor": "tinygemm's CUDA tile packing (int4_packing_format tile_packed_to_4d)",
    "Int4PlainInt32Tensor": "XPU/NPU int32 packing",
    "Int4PreshuffledTensor": "mslk's preshuffled CUDA layout",
    "MXTensor": "torchao's MX training format",
    "NVFP4Tensor": "torchao's NVFP4 training format",
}
_PART = "._weight_"  # flatten_tensor_state_dict: "<module>._<weight name>_<part>"


def sniff_torchao(path: Path) -> bool:
    qc = quantization_config_of(path)
    return isinstance(qc, dict) and str(qc.get("quant_method", "")).lower() == "torchao"


def _int_bits(name: object) -> int | None:
    """torch dtype name "int4" -> 4 (torchao's target_dtype for Intx: int1..int8)."""
    if isinstance(name, str) and name.startswith("int") and name[3:].isdigit() and 1 <= int(name[3:]) <= 8:
        return int(name[3:])
    return None


class TorchAoSource(CheckpointSource):
    """A torchao safetensors checkpoint folder, read tensor by tensor."""

    format_name = "torchao"

    def __init__(self, path: Path):
        self.path = Path(path)
        conf = read_config(self.path)
        qc = conf.quantization()
        if qc is None or str(qc.get("quant_method", "")).lower() != "torchao":
            raise BadInput("quantization_config.quant_method is not 'torchao'", path=conf.path)
        self.quant_config = qc.data
        self.config = conf.model
        self.shapes = ModelShapes(self.config, conf.path)
        self.ckpt = CheckpointDir(self.path)
        self.entries: dict[str, dict] = {}  # module prefix -> its metadata entry
        self.modules: dict[str, dict[str, str]] = {}  # module prefix -> {part: tensor name}
        for shard in self.ckpt.shards:
            self._read_metadata(shard)
        for name in self.ckpt.location:  # a part without its metadata entry would pass for a plain tensor
            prefix, sep, part = name.partition(_PART)
            if sep and prefix not in self.modules:
                raise BadInput(f"torchao tensor part '_weight_{part}' without its '{prefix}.weight' entry in the "
                               "safetensors metadata", path=self.ckpt.file_of(name), tensor=name)
        for prefix in self.modules:
            self._params(prefix)  # every module checked before a record is made

    def _read_metadata(self, shard: str) -> None:
        where = self.ckpt.path / shard
        meta = read_header(where).metadata
        if "tensor_names" not in meta:
            if any(_PART in n for n in self.ckpt.keys(shard)):
                raise BadInput("torchao tensor parts but no 'tensor_names' in the safetensors metadata", path=where)
            return
        try:
            names = json.loads(meta["tensor_names"])
        except (json.JSONDecodeError, RecursionError, ValueError):
            raise BadInput("safetensors metadata 'tensor_names' is not JSON", path=where) from None
        if not isinstance(names, list) or not all(isinstance(n, str) for n in names):
            raise BadInput("safetensors metadata 'tensor_names' is not a list of names", path=where)
        for tname in names:
            try:
                entry = json.loads(meta[tname]) if tname in meta else None
            except (json.JSONDecodeError, RecursionError, ValueError):
                entry = None
            if not isinstance(entry, dict) or not isinstance(entry.get("_type"), str):
                raise BadInput("safetensors metadata entry is missing or not a JSON object with a '_type'",
                               path=where, tensor=tname)
            kind = entry["_type"]
            if kind == "Tensor":
                continue
            if kind in _NOT_READ:
                raise BadInput(f"torchao {kind} is not read: {_NOT_READ[kind]}; quantize with "
                               "IntxWeightOnlyConfig, Int8WeightOnlyConfig or Float8WeightOnlyConfig instead",
                               path=where, tensor=tname)
            if kind not in READ_TYPES:
                raise BadInput(f"torchao tensor type {kind[:60]!r} is not one qconvert reads "
                               f"({', '.join(READ_TYPES)})", path=where, tensor=tname)
            module, _, weight = tname.rpartition(".")
            if weight != "weight" or not module:
                raise BadInput(f"a torchao {kind} that is not a module's weight", path=where, tensor=tname)
            parts = entry.get("_tensor_data_names")
            data = entry.get("_data")
            if not isinstance(parts, list) or not isinstance(data, dict):
                raise BadInput("metadata entry without '_tensor_data_names' / '_data'", path=where, tensor=tname)
            found = {}
            for part in parts:
                stored = f"{module}{_PART}{part}"
                if stored not in self.ckpt.location:
                    raise BadInput(f"torchao {kind} part '{part}' is missing", path=where, tensor=stored)
                found[str(part)] = stored
            if "qdata" not in found or "scale" not in found:
                raise BadInput(f"torchao {kind} without qdata and scale", path=where, tensor=tname)
            self.entries[module] = entry
            self.modules[module] = {"_weight_qdata": found["qdata"], **{f"_weight_{p}": n for p, n in found.items()}}

    # -- one module --------------------------------------------------------------------------------
    def _bad(self, msg: str, tensor: str) -> BadInput:
        return BadInput(msg, path=self.ckpt.file_of(tensor), tensor=tensor)

    def _part(self, prefix: str, part: str) -> str | None:
        return self.modules[prefix].get(f"_weight_{part}")

    def _block(self, prefix: str, shape: tuple[int, int]) -> tuple[int, int]:
        block = self.entries[prefix]["_data"].get("block_size")
        qdata = self._part(prefix, "qdata")
        if not (isinstance(block, list) and len(block) == 2 and all(isinstance(b, int) and b > 0 for b in block)
                and shape[0] % block[0] == 0 and shape[1] % block[1] == 0):
            raise self._bad(f"block_size {block!r} does not tile a {list(shape)} weight", qdata)
        return block[0], block[1]

    def _scale_of(self, prefix: str, shape, block) -> torch.Tensor:
        name = self._part(prefix, "scale")
        want = (shape[0] // block[0], shape[1] // block[1])
        got = tuple(self.ckpt.shape(name))
        if got != want and not (got == () and want == (1, 1)):
            raise self._bad(f"scale shape {list(got)} does not match a {list(shape)} weight in blocks of "
                            f"{list(block)}: expected {list(want)}", name)
        if self.ckpt.dtype(name) not in ("F32", "BF16", "F16"):
            raise self._bad(f"scale dtype {self.ckpt.dtype(name)} is not F32, BF16 or F16", name)
        return self.ckpt.get(name).reshape(want)

    def _params(self, prefix: str) -> tuple[GridParams, tuple[int, int]]:
        entry = self.entries[prefix]
        kind, data = entry["_type"], entry["_data"]
        qdata = self._part(prefix, "qdata")
        shape = tuple(self.ckpt.shape(qdata))
        if len(shape) != 2 or min(shape) < 1:
            raise self._bad(f"qdata of shape {list(shape)}: expected [out, in]", qdata)
        self.shapes.check_linear(prefix, shape[0], shape[1], self.ckpt.file_of(qdata), qdata, "qdata shape")
        block = self._block(prefix, shape)
        scales = self._scale_of(prefix, shape, block)
        if kind == "Float8Tensor":
            if self.ckpt.dtype(qdata) not in FP8_ELEMENTS:
                raise self._bad(f"qdata dtype {self.ckpt.dtype(qdata)} is not F8_E4M3 or F8_E5M2", qdata)
            scales = expand_block_rows(scales.to(torch.float32), shape[0], block[0])
            return float_grid(FP8_ELEMENTS[self.ckpt.dtype(qdata)], scales, block[1], block_rows=block[0]), shape
        if block[0] != 1:
            raise self._bad(f"block_size {list(block)}: integer grids are read per row or per group of a row", qdata)
        if self.ckpt.dtype(qdata) != "I8":
            raise self._bad(f"qdata dtype {self.ckpt.dtype(qdata)} is not I8", qdata)
        bits = 8 if kind == "Int8Tensor" else _int_bits((data.get("target_dtype") or {}).get("_data"))
        if bits is None:
            raise self._bad(f"target_dtype {data.get('target_dtype')!r} is not int1..int8", qdata)
        offset = 1 << (bits - 1)
        zname = self._part(prefix, "zero_point")
        if zname is None:
            zeros = torch.zeros(scales.shape, dtype=torch.int16)
        else:
            if tuple(self.ckpt.shape(zname)) not in (tuple(scales.shape), ()) or self.ckpt.dtype(zname) not in (
                    "I8", "I16", "I32", "I64"):
                raise self._bad(f"zero_point {self.ckpt.dtype(zname)} {list(self.ckpt.shape(zname))} does not "
                                f"match the scale {list(scales.shape)} as integers", zname)
            zeros = self.ckpt.get(zname).reshape(scales.shape).to(torch.int16)
        if int(zeros.min()) < -offset or int(zeros.max()) > offset - 1:
            raise self._bad(f"zero points outside int{bits}'s range {-offset}..{offset - 1}", zname)
        params = GridParams(bits=bits, group_size=block[1], scales=scales.contiguous(), zeros=zeros + offset)
        return params, shape

    def _load(self, prefix: str) -> Grid:
        params, shape = self._params(prefix)
        qdata = self._part(prefix, "qdata")
        q = self.ckpt.get(qdata)
        if params.element is not None:
            return Grid(params, codes=q.view(torch.uint8))
        offset = 1 << (params.bits - 1)
        if int(q.min()) < -offset or int(q.max()) > offset - 1:
            raise self._bad(f"codes outside int{params.bits}'s range {-offset}..{offset - 1}", qdata)
        return Grid(params, codes=(q.to(torch.int16) + offset).to(torch.uint8))

    def _record(self, prefix: str, shard: str) -> TensorRecord:
        params, shape = self._params(prefix)
        return TensorRecord(f"{prefix}.weight", shape, "grid", lambda p=prefix: self._load(p), params=params,
                            source_file=shard, source_name=f"{prefix}._weight_qdata ({self.entries[prefix]['_type']})")

    # -- the ModelSource interface -----------------------------------------------------------------
    def records(self) -> Iterator[TensorRecord]:
        yield from self.module_records(self.modules, "_weight_qdata", self._record)

    def describe(self) -> dict:
        kinds: dict[str, int] = {}
        for entry in self.entries.values():
            kinds[entry["_type"]] = kinds.get(entry["_type"], 0) + 1
        desc = {"format": self.format_name, "quantized_modules": len(self.modules), "tensor_types": kinds,
                "shards": len(self.ckpt.shards), "ignored_files": self.ignored_files,
                "layout": "torchao tensor subclasses flattened into <module>._weight_qdata / _scale / _zero_point, "
                          "their type and attributes in the safetensors metadata"}
        acts = [p for p, e in self.entries.items() if e["_data"].get("activation_quantization")
                or e["_data"].get("act_quant_kwargs")]
        if acts:
            desc["activation_quantization"] = (f"{len(acts)} modules quantize activations at run time (a runtime's "
                                               "choice): not carried")
        return desc


def open_torchao(path: Path, **_: object) -> TorchAoSource:
    return TorchAoSource(path)
