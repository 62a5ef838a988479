"""bitsandbytes checkpoints as transformers saves them (quant_method "bitsandbytes"), read without bitsandbytes.

4-bit (load_in_4bit, NF4 or FP4), per quantized linear `<prefix>` (bitsandbytes 0.50 nn/modules.py
Params4bit.from_prequantized, functional.py QuantState.from_dict / as_dict(packed=True)):
- `<prefix>.weight` uint8 [ceil(out*in/2), 1]: the row-major flattened [out, in] codes, two per byte, the
  FIRST element in the HIGH nibble (backends/default/ops.py _dequantize_4bit_compute: out[::2] = A >> 4,
  out[1::2] = A & 0xF);
- `weight.quant_map` float32 [16]: the codebook (get_4bit_type's NF4 / FP4 table);
- `weight.absmax`: one scale per `blocksize` elements of the flattened weight, float32 -- or, double
  quantized (`nested_absmax` present), uint8 codes of a blockwise 8-bit quantization of the absmax:
  absmax = nested_quant_map[q] * nested_absmax[i // nested_blocksize] + nested_offset, in `nested_dtype`
  (functional.py dequantize_4bit: dequantize_blockwise(...) then `absmax += quant_state.offset`): float32, or
  float16 / bfloat16 when the model ran forward on the CPU before it was saved (see nested_absmax);
- saved after a CPU forward WITHOUT double quant, `weight.absmax` is bfloat16 [in/blocksize, out]: bitsandbytes'
  CPU layout left behind, which its own loader misreads; refused (see BnbSource._absmax);
- `weight.quant_state.bitsandbytes__<nf4|fp4>` uint8: a JSON blob (quant_type, blocksize, dtype, shape and
  the nested blocksize / dtype / offset).
  W[n, k] = quant_map[code] * absmax[block], in float32, then cast to `dtype` (one rounding each step).
  Into the intermediate: a codebook grid, group_size = blocksize along each row (the flattened blocks stay
  inside a row when in_features % blocksize == 0; other shapes are refused), scales = absmax [out, in/bs].

LLM.int8 (load_in_8bit): `<prefix>.weight` int8 [out, in], `<prefix>.SCB` float32 [out] (the row absmax),
`<prefix>.weight_format` uint8 (0 = "row", the only layout transformers saves). bitsandbytes 0.50 _ops.py
int8_vectorwise_dequant: W = q * SCB[n] * 7.874015718698502e-3 in float32 (two roundings). Into the
intermediate: a symmetric 8-bit grid (codes q + 128, zero 128) whose single scale fl(SCB * 1/127) is what
a target stores, and whose `scale_steps` (SCB, 1/127) make our own dequantization bnb's, bit for bit.
"""

from __future__ import annotations

import json
import re
from pathlib import Path
from typing import Iterator

import torch

from ...converters.errors import BadInput
from ...converters.records import Grid, GridParams, TensorRecord, codebook_name, register_codebook
from ...kernels.triton import route as triton_route
from ...converters.model_shapes import ModelShapes
from ..common.checkpoint import CheckpointDir, CheckpointSource, quantization_config_of
from ..common.quant_config import read_config

__all__ = ["BnbSource", "open_bnb", "sniff_bnb", "unpack_4bit", "nested_absmax", "INT8_RECIPROCAL", "BNB_BLOCKSIZES"]

# bitsandbytes 0.50 _ops.py int8_vectorwise_dequant: "we divide by 127, or multiply by the reciprocal"
INT8_RECIPROCAL = 7.874015718698502e-3
# functional.py dequantize_4bit: the blocksizes bitsandbytes accepts
BNB_BLOCKSIZES = (32, 64, 128, 256, 512, 1024, 2048, 4096)
QUANT_TYPES = ("nf4", "fp4")
# functional.py get_4bit_type: the two 16-value tables the 4-bit types index (registered, so that a grid is
# described by its table's name: "4-bit nf4 codebook blocksize 64")
NF4_TABLE = (-1.0, -0.6961928009986877, -0.5250730514526367, -0.39491748809814453, -0.28444138169288635,
             -0.18477343022823334, -0.09105003625154495, 0.0, 0.07958029955625534, 0.16093020141124725,
             0.24611230194568634, 0.33791524171829224, 0.44070982933044434, 0.5626170039176941,
             0.7229568362236023, 1.0)
FP4_TABLE = tuple(v / 12.0 for v in (0, 0.0625, 8.0, 12.0, 4.0, 6.0, 2.0, 3.0, -0, -0.0625, -8.0, -12.0, -4.0,
                                     -6.0, -2.0, -3.0))  # normalized to [-1, 1] as get_4bit_type does
register_codebook("nf4", NF4_TABLE)
register_codebook("fp4", FP4_TABLE)
_OUT_DTYPES = {"float16": torch.float16, "bfloat16": torch.bfloat16, "float32": torch.float32}
_4BIT_PART = re.compile(r"^(?P<prefix>.+)\.weight\.(?P<part>absmax|quant_map|nested_absmax|nested_quant_map|"
                        r"quant_state\.bitsandbytes__\w+)$")
_INT8_PART = re.compile(r"^(?P<prefix>.+)\.(?P<part>SCB|weight_format)$")
# transformers' integrations/bitsandbytes.py: weight_format 0 = "row" (the others are GPU tile layouts)
_ROW_FORMAT = 0


def sniff_bnb(path: Path) -> bool:
    qc = quantization_config_of(path)
    return isinstance(qc, dict) and str(qc.get("quant_method", "")).lower() == "bitsandbytes"


def open_bnb(path: Path, **_: object) -> "BnbSource":
    return BnbSource(path)


def _quant_state_json(blob: torch.Tensor, where: Path, tensor: str) -> dict:
    """bitsandbytes' pack_dict_to_tensor: JSON, utf-8, as a uint8 tensor."""
    raw = bytes(blob.reshape(-1).tolist())
    try:
        text = raw.decode("utf-8")
    except UnicodeDecodeError as e:  # said in our words: the codec's message is library text (scripts/fuzz)
        raise BadInput(f"quant_state JSON is corrupt (not UTF-8 at byte {e.start})", path=where,
                       tensor=tensor) from None
    try:
        data = json.loads(text)
    except ValueError as e:
        raise BadInput(f"quant_state JSON is corrupt ({str(e)[:60]})", path=where, tensor=tensor) from None
    if not isinstance(data, dict):
        raise BadInput("quant_state JSON is not an object", path=where, tensor=tensor)
    return data


def unpack_4bit(packed: torch.Tensor, out_features: int, in_features: int) -> torch.Tensor:
    """uint8 [ceil(n/2), 1] -> codes [out, in]: element 2i in the high nibble of byte i, 2i+1 in the low."""
    flat = packed.reshape(-1)
    routed = triton_route.bitstream(flat[None, :], 4, out_features * in_features, word_bits=8, order=(1, 0))
    if routed is not None:  # Triton where chosen: bytes as 8-bit words, the high nibble first
        return routed.reshape(out_features, in_features)
    codes = torch.stack((flat >> 4, flat & 0xF), dim=1).reshape(-1)
    return codes[: out_features * in_features].reshape(out_features, in_features).contiguous()


def nested_absmax(q: torch.Tensor, code: torch.Tensor, absmax2: torch.Tensor, blocksize: int,
                  offset: float, nested_dtype: torch.dtype = torch.float32) -> torch.Tensor:
    """Double quantization undone as bitsandbytes does (functional.py dequantize_4bit): dequantize_blockwise
    into `nested_dtype` -- code[q] * absmax2[i // blocksize] in float32, rounded once to that dtype (the CPU
    kernels cdequantize_blockwise_cpu_fp32/fp16/bf16) -- then `+= offset` in that dtype, with the offset a
    float32 0-dim tensor (QuantState.from_dict: torch.tensor(float(offset))), then `.float()`. A float16 or
    bfloat16 nested state is what bitsandbytes 0.50 writes when a model ran on the CPU before it was saved
    (_convert_weight_packed_for_cpu_inverse quantizes the absmax again in the model dtype)."""
    n = q.numel()
    scale = absmax2.to(torch.float32).repeat_interleave(blocksize)[:n]
    out = (code.to(torch.float32)[q.reshape(-1).to(torch.int64)] * scale).to(nested_dtype)
    out += torch.tensor(float(offset))
    return out.to(torch.float32)


class BnbSource(CheckpointSource):
    """A transformers bitsandbytes checkpoint (4-bit NF4/FP4 or LLM.int8), read lazily tensor by tensor."""

    format_name = "bitsandbytes"

    def __init__(self, path: Path):
        self.path = Path(path)
        conf = read_config(self.path)
        qc = conf.raw.get("quantization_config")
        if not isinstance(qc, dict) or str(qc.get("quant_method", "")).lower() != "bitsandbytes":
            raise BadInput("config.json's quantization_config is not quant_method \"bitsandbytes\"",
                           path=self.path / "config.json")
        self.quant_config = qc
        self.config = conf.model
        self.ckpt = CheckpointDir(self.path)
        self.shapes = ModelShapes(self.config, self.path / "config.json")
        self.modules4, self.modules8 = self._group()
        self._params_cache: dict[str, tuple] = {}

    def _group(self) -> tuple[dict[str, dict[str, str]], dict[str, dict[str, str]]]:
        four: dict[str, dict[str, str]] = {}
        eight: dict[str, dict[str, str]] = {}
        for name in self.ckpt.location:
            m = _4BIT_PART.match(name)
            if m:
                four.setdefault(m["prefix"], {})[m["part"]] = name
                continue
            m = _INT8_PART.match(name)
            if m:
                eight.setdefault(m["prefix"], {})[m["part"]] = name
        for group, kind in ((four, "4-bit"), (eight, "int8")):
            for prefix, parts in group.items():
                if f"{prefix}.weight" not in self.ckpt:
                    first = parts[min(parts)]
                    raise BadInput(f"{kind} quantization state without its weight", path=self.ckpt.file_of(first),
                                   tensor=f"{prefix}.weight")
        # a packed 4-bit weight whose state is gone entirely: uint8 [n, 1] is no dense weight
        for name in self.ckpt.location:
            if name.endswith(".weight") and name[: -len(".weight")] not in four and self.ckpt.dtype(name) == "U8" \
                    and len(self.ckpt.shape(name)) == 2 and self.ckpt.shape(name)[1] == 1:
                raise BadInput("packed 4-bit weight without absmax / quant_map / quant_state", path=self.ckpt.file_of(name),
                               tensor=name)
        return four, eight

    # -- 4-bit ------------------------------------------------------------------------------------
    def _state(self, prefix: str) -> tuple[dict, str, Path]:
        parts = self.modules4[prefix]
        weight = f"{prefix}.weight"
        where = self.ckpt.file_of(weight)
        state_keys = [p for p in parts if p.startswith("quant_state.")]
        if not state_keys:
            raise BadInput("4-bit weight without its quant_state.bitsandbytes__nf4/fp4 blob", path=where,
                           tensor=f"{weight}.quant_state")
        if len(state_keys) > 1:
            raise BadInput(f"more than one quant_state blob ({', '.join(sorted(state_keys))})", path=where, tensor=weight)
        qs_name = parts[state_keys[0]]
        if self.ckpt.dtype(qs_name) != "U8":
            raise BadInput(f"quant_state dtype {self.ckpt.dtype(qs_name)} is not U8", path=self.ckpt.file_of(qs_name),
                           tensor=qs_name)
        state = _quant_state_json(self.ckpt.get(qs_name), self.ckpt.file_of(qs_name), qs_name)
        key_type = state_keys[0].rsplit("__", 1)[1]
        qtype = state.get("quant_type")
        if qtype not in QUANT_TYPES or key_type not in QUANT_TYPES:
            raise BadInput(f"unknown quant_type {qtype if qtype not in QUANT_TYPES else key_type!r}: bitsandbytes "
                           f"4-bit is {' or '.join(QUANT_TYPES)}", path=self.ckpt.file_of(qs_name), tensor=qs_name)
        if qtype != key_type:
            raise BadInput(f"quant_type {qtype!r} in the JSON but the tensor is named bitsandbytes__{key_type}",
                           path=self.ckpt.file_of(qs_name), tensor=qs_name)
        for needed in ("absmax", "quant_map"):
            if needed not in parts:
                raise BadInput(f"4-bit weight without {needed}", path=where, tensor=f"{weight}.{needed}")
        return state, qs_name, where

    def _params4(self, prefix: str) -> tuple[GridParams, tuple[int, int], torch.dtype]:
        if prefix in self._params_cache:
            return self._params_cache[prefix]
        state, qs_name, where = self._state(prefix)
        parts = self.modules4[prefix]
        weight = f"{prefix}.weight"
        qs_file = self.ckpt.file_of(qs_name)
        shape = state.get("shape")
        if not (isinstance(shape, list) and len(shape) == 2 and all(isinstance(d, int) and d > 0 for d in shape)):
            raise BadInput(f"quant_state shape {shape!r} is not a 2-D [out, in] of positive integers", path=qs_file,
                           tensor=qs_name)
        out_features, in_features = shape
        blocksize = state.get("blocksize")
        if blocksize not in BNB_BLOCKSIZES:
            raise BadInput(f"blocksize {blocksize!r} is not supported (bitsandbytes: "
                           f"{', '.join(map(str, BNB_BLOCKSIZES))})", path=qs_file, tensor=qs_name)
        if in_features % blocksize:
            # blocks run along the flattened weight: here one would straddle two rows, no per-row group
            raise BadInput(f"in_features {in_features} is not a multiple of blocksize {blocksize} (blocks would "
                           "straddle rows)", path=qs_file, tensor=qs_name)
        out_dtype = _OUT_DTYPES.get(state.get("dtype"))
        if out_dtype is None:
            raise BadInput(f"quant_state dtype {state.get('dtype')!r} is not float16, bfloat16 or float32", path=qs_file,
                           tensor=qs_name)
        n = out_features * in_features
        wshape, wdtype = self.ckpt.shape(weight), self.ckpt.dtype(weight)
        if wdtype != "U8":
            raise BadInput(f"packed 4-bit weight dtype {wdtype} is not U8 (quant_storage other than uint8 is not read)",
                           path=where, tensor=weight)
        packed_n = 1
        for d in wshape:
            packed_n *= d
        if packed_n != (n + 1) // 2:
            raise BadInput(f"quant_state shape {shape} needs {(n + 1) // 2} packed bytes, the weight {tuple(wshape)} "
                           f"holds {packed_n}", path=qs_file, tensor=qs_name)
        self.shapes.check_linear(prefix, out_features, in_features, where, weight, f"quant_state shape {shape}")
        n_blocks = n // blocksize
        absmax = self._absmax(prefix, parts, state, n_blocks, qs_file, qs_name)
        qmap_name = parts["quant_map"]
        if self.ckpt.shape(qmap_name) != (16,) or self.ckpt.dtype(qmap_name) != "F32":
            raise BadInput(f"quant_map {self.ckpt.dtype(qmap_name)} {self.ckpt.shape(qmap_name)} is not float32 [16]",
                           path=self.ckpt.file_of(qmap_name), tensor=qmap_name)
        codebook = self.ckpt.get(qmap_name).to(torch.float32)
        scales = absmax.view(out_features, in_features // blocksize)
        params = GridParams(bits=4, group_size=blocksize, scales=scales, zeros=torch.zeros_like(scales),
                            codebook=codebook)
        self._params_cache[prefix] = (params, (out_features, in_features), out_dtype)
        return self._params_cache[prefix]

    def _absmax(self, prefix: str, parts: dict, state: dict, n_blocks: int, qs_file: Path, qs_name: str) -> torch.Tensor:
        name = parts["absmax"]
        afile = self.ckpt.file_of(name)
        out_features, in_features = state["shape"]
        cpu_layout = (in_features // state["blocksize"], out_features)
        if "nested_absmax" not in parts and self.ckpt.shape(name) == cpu_layout and self.ckpt.dtype(name) == "BF16":
            # bitsandbytes 0.50's CPU inference layout (functional._convert_weight_packed_for_cpu: absmax
            # un-nested, reshaped [out, in/bs], transposed and rounded to bfloat16), left in the file when a model
            # that ran forward on a CPU with AVX-512 BF16 is saved: _convert_weight_packed_for_cpu_inverse
            # restores the weight and the dtype but re-nests the absmax only under double quant, so without it the
            # block scales stay transposed. bitsandbytes' loader (QuantState.from_dict + dequantize_4bit) then
            # takes them in flat order: block b of row r gets the scale of another block (0.15 off on the
            # producer fixture). The transpose is recoverable, but only as bfloat16-rounded scales, so neither
            # the loader's reading (wrong) nor ours (what no loader computes) is the checkpoint as quantized:
            # refused, with the remedy.
            raise BadInput(f"absmax is BF16 {self.ckpt.shape(name)} = [in/blocksize, out]: bitsandbytes' CPU "
                           "inference layout, saved after the model ran on the CPU (bitsandbytes 0.50 does not "
                           "restore it without double quant) and misread by bitsandbytes' own loader; quantize and "
                           "save again before running the model, or with bnb_4bit_use_double_quant=True",
                           path=afile, tensor=name)
        if self.ckpt.shape(name) != (n_blocks,):
            raise BadInput(f"absmax shape {self.ckpt.shape(name)} does not match {n_blocks} blocks of "
                           f"{state['blocksize']}", path=afile, tensor=name)
        nested = "nested_absmax" in parts
        if not nested:
            if self.ckpt.dtype(name) != "F32":
                raise BadInput(f"absmax dtype {self.ckpt.dtype(name)} is not F32 (and there is no nested_absmax: "
                               "not double quantized)", path=afile, tensor=name)
            return self.ckpt.get(name).to(torch.float32)
        if self.ckpt.dtype(name) != "U8":
            raise BadInput(f"double-quantized absmax dtype {self.ckpt.dtype(name)} is not U8", path=afile, tensor=name)
        if "nested_quant_map" not in parts:
            raise BadInput("nested_absmax without nested_quant_map", path=afile,
                           tensor=f"{prefix}.weight.nested_quant_map")
        nbs, offset = state.get("nested_blocksize"), state.get("nested_offset")
        if not isinstance(nbs, int) or nbs <= 0:
            raise BadInput(f"nested_blocksize {nbs!r} is not a positive integer", path=qs_file, tensor=qs_name)
        if not isinstance(offset, (int, float)) or isinstance(offset, bool):
            raise BadInput(f"nested_offset {offset!r} is not a number", path=qs_file, tensor=qs_name)
        nested_dtype = _OUT_DTYPES.get(state.get("nested_dtype", "float32"))
        if nested_dtype is None:
            raise BadInput(f"nested_dtype {state.get('nested_dtype')!r} is not float32, float16 or bfloat16",
                           path=qs_file, tensor=qs_name)
        a2, code2 = parts["nested_absmax"], parts["nested_quant_map"]
        want = (n_blocks + nbs - 1) // nbs
        if self.ckpt.shape(a2) != (want,) or self.ckpt.dtype(a2) != "F32":
            raise BadInput(f"nested_absmax {self.ckpt.dtype(a2)} {self.ckpt.shape(a2)} is not float32 [{want}] "
                           f"({n_blocks} absmax in blocks of {nbs})", path=self.ckpt.file_of(a2), tensor=a2)
        if self.ckpt.shape(code2) != (256,) or self.ckpt.dtype(code2) != "F32":
            raise BadInput(f"nested_quant_map {self.ckpt.dtype(code2)} {self.ckpt.shape(code2)} is not float32 [256]",
                           path=self.ckpt.file_of(code2), tensor=code2)
        return nested_absmax(self.ckpt.get(name), self.ckpt.get(code2), self.ckpt.get(a2), nbs, offset,
                             nested_dtype)

    def _load4(self, prefix: str) -> Grid:
        params, (out_features, in_features), _ = self._params4(prefix)
        codes = unpack_4bit(self.ckpt.get(f"{prefix}.weight"), out_features, in_features)
        return Grid(params, codes)

    # -- LLM.int8 ---------------------------------------------------------------------------------
    def _params8(self, prefix: str) -> tuple[GridParams, tuple[int, int]]:
        parts = self.modules8[prefix]
        weight = f"{prefix}.weight"
        where = self.ckpt.file_of(weight)
        if "SCB" not in parts:
            raise BadInput("int8 weight without SCB (its row scales)", path=where, tensor=f"{prefix}.SCB")
        wshape, wdtype = self.ckpt.shape(weight), self.ckpt.dtype(weight)
        if wdtype != "I8" or len(wshape) != 2:
            raise BadInput(f"LLM.int8 weight {wdtype} {tuple(wshape)} is not int8 [out, in]", path=where, tensor=weight)
        out_features, in_features = wshape
        scb = parts["SCB"]
        if self.ckpt.shape(scb) != (out_features,) or self.ckpt.dtype(scb) != "F32":
            raise BadInput(f"SCB {self.ckpt.dtype(scb)} {self.ckpt.shape(scb)} is not float32 [{out_features}]",
                           path=self.ckpt.file_of(scb), tensor=scb)
        if "weight_format" in parts:
            fmt = self.ckpt.get(parts["weight_format"]).reshape(-1)
            if fmt.numel() != 1 or int(fmt[0]) != _ROW_FORMAT:
                raise BadInput(f"weight_format {fmt.tolist()} is not 0 (row-major); GPU tile layouts are not read",
                               path=self.ckpt.file_of(parts["weight_format"]), tensor=parts["weight_format"])
        self.shapes.check_linear(prefix, out_features, in_features, where, weight, f"int8 weight {tuple(wshape)}")
        row_absmax = self.ckpt.get(scb).to(torch.float32).view(-1, 1)
        scales = row_absmax * INT8_RECIPROCAL  # the one scale a target stores (float32, one rounding)
        zeros = torch.full_like(scales, 128, dtype=torch.int16)
        params = GridParams(bits=8, group_size=in_features, scales=scales, zeros=zeros,
                            scale_steps=(row_absmax, INT8_RECIPROCAL))
        return params, (out_features, in_features)

    def _load8(self, prefix: str) -> Grid:
        params, _ = self._params8(prefix)
        q = self.ckpt.get(f"{prefix}.weight")
        return Grid(params, (q.to(torch.int16) + 128).to(torch.uint8))

    # -- the ModelSource interface ----------------------------------------------------------------
    def records(self) -> Iterator[TensorRecord]:
        consumed = {n for parts in (*self.modules4.values(), *self.modules8.values()) for n in parts.values()}
        for shard in self.ckpt.shards:
            for name in self.ckpt.keys(shard):
                if name in consumed:
                    continue
                prefix = name[: -len(".weight")] if name.endswith(".weight") else None
                if prefix in self.modules4:
                    params, shape, _ = self._params4(prefix)
                    yield TensorRecord(name, shape, "grid", lambda p=prefix: self._load4(p), params=params,
                                       source_file=shard)
                elif prefix in self.modules8:
                    params, shape = self._params8(prefix)
                    yield TensorRecord(name, shape, "grid", lambda p=prefix: self._load8(p), params=params,
                                       source_file=shard)
                else:
                    self.shapes.check_dense(name, self.ckpt.shape(name), self.ckpt.path / shard, self.ckpt.dtype(name))
                    yield self.ckpt.dense_record(name, shard)

    def dequant_dtype(self, name: str) -> torch.dtype:
        """The dtype bitsandbytes dequantizes a tensor to: the quant_state dtype (4-bit), float32 (int8)."""
        prefix = name[: -len(".weight")]
        if prefix in self.modules4:
            return self._params4(prefix)[2]
        return torch.float32

    def describe(self) -> dict:
        qc = self.quant_config
        kinds = set()
        for prefix in self.modules4:
            kinds.add(codebook_name(self._params4(prefix)[0].codebook))
        if self.modules8:
            kinds.add("int8")
        double = any("nested_absmax" in parts for parts in self.modules4.values())
        blocksizes = sorted({self._params4(p)[0].group_size for p in self.modules4})
        desc = {"format": self.format_name, "quant_types": sorted(kinds),
                "double_quant": double if self.modules4 else None,
                "blocksize": blocksizes[0] if len(blocksizes) == 1 else blocksizes or None,
                "compute_dtype": qc.get("bnb_4bit_compute_dtype") if self.modules4 else None,
                "shards": len(self.ckpt.shards), "quantized_modules": len(self.modules4) + len(self.modules8),
                "layout": ("4-bit: weight uint8 [n/2, 1] (high nibble first), absmax per block, quant_map codebook, "
                           "quant_state JSON" if self.modules4 else "int8: weight int8 [out, in], SCB float32 [out]"),
                "ignored_files": self.ignored_files}
        return desc

