"""Hugging Face FP8 checkpoints: transformers' FineGrainedFP8 layout (DeepSeek-V3 / R1, Kimi-K2, Qwen3-*-FP8,
GLM-4.5-FP8, ...) and fbgemm's per-channel FP8 (Llama-3.1-405B-FP8).

config.json quantization_config:
- quant_method "fp8": `weight_block_size` [rows, columns] (DeepSeek: [128, 128]), `fmt` "e4m3",
  `activation_scheme` "dynamic" (or "static" with an `input_scale` per module), `modules_to_not_convert`.
  Per quantized linear `<prefix>`: `weight` F8_E4M3 [out, in] and `weight_scale_inv` float32
  [ceil(out/rows), ceil(in/columns)] -- despite its name the multiplier of its block:
  W = fp8(weight) * weight_scale_inv[block] (DeepSeek-V3 inference/kernel.py weight_dequant; transformers 5.24
  integrations/finegrained_fp8.py Fp8Dequantize: `(q.float() * s.float()).to(dtype)`). Edge blocks are partial.
- quant_method "fbgemm_fp8": `weight` F8_E4M3 and `weight_scale` float32 [out, 1], one scale per output row.

Every module becomes a float grid (codes = the fp8 bytes, codebook = E4M3's 256 values; converters/records.py),
whose float32 dequantization is the exact product of the fp8 value and its float32 scale, i.e. the producer's
float32 value; rounded to bf16 it is transformers' dequantized weight bit for bit (the tests compare). Scales
of activations (`input_scale`) and of the KV cache (`k_scale`, `v_scale`) are a runtime's choice, not weights:
describe() counts them and they are not carried.
"""

from __future__ import annotations

from pathlib import Path
import torch

from ...converters.errors import BadInput
from ...converters.records import Grid
from ...converters.validate import ConfigView
from ..common.float_grids import (FloatModuleSource, block_grid_shape, expand_block_rows, float_grid, fp8_element,
                                  refuse_unscaled_fp8)
from ...converters.model_shapes import ModelShapes
from ..common.checkpoint import CheckpointDir, quantization_config_of, release_layout_of
from ..common.quant_config import read_config

__all__ = ["Fp8Source", "open_fp8", "sniff_fp8", "METHODS"]

METHODS = ("fp8", "fbgemm_fp8")
_SCALE = {"fp8": "weight_scale_inv", "fbgemm_fp8": "weight_scale"}
# activation and kv-cache scales: a runtime's choice (see the module docstring)
RUNTIME_PARTS = ("input_scale", "input_scale_inv", "k_scale", "v_scale", "activation_scale_ub")
# weight_scale_inv: float32 as DeepSeek-V3 ships it; E8M0 powers of two where the config says scale_fmt "ue8m0"
# (DeepSeek-V3.1; transformers' Fp8Quantize stores them as float8_e8m0fnu then)
_SCALE_DTYPES = {"F32": torch.float32, "BF16": torch.bfloat16, "F16": torch.float16, "F8_E8M0": torch.float8_e8m0fnu}


def sniff_fp8(path: Path) -> bool:
    qc = quantization_config_of(path)
    # DeepSeek-V4's release (E8M0 `.scale` exponents, DeepSeek's names) is the hf reader's (formats/hf/deepseek_v4.py)
    return isinstance(qc, dict) and str(qc.get("quant_method", "")).lower() in METHODS and not release_layout_of(path)


class Fp8Source(FloatModuleSource):
    """An FP8 checkpoint folder, read tensor by tensor."""

    format_name = "fp8"

    def __init__(self, path: Path):
        self.path = Path(path)
        conf = read_config(self.path)
        where = conf.path
        qc = conf.quantization()
        if qc is None or not qc.data:
            raise BadInput("no quantization_config in config.json", path=where)
        self.method = str(qc.get("quant_method", "")).lower()
        if self.method not in METHODS:
            raise BadInput(f"{qc.prefix}quant_method is {qc.get('quant_method')!r}, not one of {', '.join(METHODS)}",
                           path=where)
        self.quant_config = qc.data
        self.config = conf.model
        self.block = self._block(qc) if self.method == "fp8" else None
        fmt = qc.get("fmt", "e4m3")
        if self.method == "fp8" and fmt != "e4m3":
            raise BadInput(f"{qc.prefix}fmt is {fmt!r}: transformers' FP8 checkpoints are e4m3", path=where)
        self.shapes = ModelShapes(self.config, where)
        self.ckpt = CheckpointDir(self.path)
        scale = _SCALE[self.method]
        self.modules = {name.rpartition(".")[0]: {"weight": name.rpartition(".")[0] + ".weight", scale: name}
                        for name in self.ckpt.location if name.rpartition(".")[2] == scale}
        for prefix, parts in self.modules.items():
            if parts["weight"] not in self.ckpt.location:
                raise BadInput(f"{scale} without weight", path=self.ckpt.file_of(parts[scale]), tensor=parts["weight"])
        refuse_unscaled_fp8(self.ckpt, {n for parts in self.modules.values() for n in parts.values()}, scale)
        self.runtime_params = sorted(n for n in self.ckpt.location if n.rpartition(".")[2] in RUNTIME_PARTS)

    @staticmethod
    def _block(qc: ConfigView) -> tuple[int, int]:
        block = qc.get("weight_block_size")
        if not (isinstance(block, list) and len(block) == 2 and
                all(isinstance(b, int) and not isinstance(b, bool) and 0 < b <= 1 << 16 for b in block)):
            raise BadInput(f"{qc.prefix}weight_block_size is {block!r}: expected [rows, columns] of a scale block",
                           path=qc.path)
        return block[0], block[1]

    # -- one module --------------------------------------------------------------------------------
    def _bad(self, msg: str, tensor: str) -> BadInput:
        return BadInput(msg, path=self.ckpt.file_of(tensor), tensor=tensor)

    def _params(self, prefix: str):
        wname, sname = f"{prefix}.weight", self.modules[prefix][_SCALE[self.method]]
        shape = self.ckpt.shape(wname)
        if len(shape) != 2 or min(shape) < 1:
            raise self._bad(f"FP8 weight of shape {list(shape)}: expected [out, in]", wname)
        element = fp8_element(self.ckpt.dtype(wname), self.ckpt.file_of(wname), wname)
        out_f, in_f = shape
        self.shapes.check_linear(prefix, out_f, in_f, self.ckpt.file_of(wname), wname, "weight shape")
        sdtype = self.ckpt.dtype(sname)
        if sdtype not in _SCALE_DTYPES:
            raise self._bad(f"scale dtype {sdtype} is not {', '.join(_SCALE_DTYPES)}", sname)
        if self.block is not None:
            rows, cols = self.block
            want = block_grid_shape(out_f, in_f, self.block)
        else:
            rows, cols, want = 1, in_f, (out_f, 1)
        if self.ckpt.shape(sname) != want:
            blocks = f"{rows}x{cols} blocks" if self.block else "one scale per output row"
            raise self._bad(f"scale shape {list(self.ckpt.shape(sname))} does not match a {list(shape)} weight in "
                            f"{blocks}: expected {list(want)}", sname)
        scales = expand_block_rows(self.ckpt.get(sname), out_f, rows)
        return float_grid(element, scales, cols, block_rows=rows), (out_f, in_f)

    def _load(self, prefix: str) -> Grid:
        params, _ = self._params(prefix)
        return Grid(params, codes=self.ckpt.get(f"{prefix}.weight").view(torch.uint8))

    # -- the ModelSource interface (records: FloatModuleSource) -----------------------------------
    def describe(self) -> dict:
        desc = {"format": self.format_name, "quant_method": self.method, "quantized_modules": len(self.modules),
                "shards": len(self.ckpt.shards), "ignored_files": self.ignored_files,
                "layout": ("fp8 e4m3 weights, one float32 scale per "
                           + (f"{self.block[0]}x{self.block[1]} block (weight_scale_inv, the multiplier)"
                              if self.block else "output row (weight_scale)"))}
        return self.describe_runtime(desc)


def open_fp8(path: Path, **_: object) -> Fp8Source:
    return Fp8Source(path)
