"""Writes Hugging Face FP8 checkpoints as transformers' FineGrainedFP8 loads them with E8M0 scales (DeepSeek-V3.1's
`scale_fmt` "ue8m0"): per quantized linear `<prefix>`, `weight` F8_E4M3 [out, in] and `weight_scale_inv` F8_E8M0
[ceil(out/128), ceil(in/128)], W = fp8(weight) * 2**k of its 128x128 tile; quantization_config {quant_method
"fp8", fmt "e4m3", activation_scheme "dynamic", weight_block_size [128, 128], scale_fmt "ue8m0",
modules_to_not_convert: lm_head and the linears left dense}.

What becomes FP8 (formats/common/fp8_tiles.py decides the verdicts): every decoder linear that is a grid (an
MXFP4 one casts exactly; others are requantized with transformers' own ue8m0 quantizer), and with `--type fp8`
the dense decoder linears too (requantized). Without `--type` a dense tensor is copied as it is; a quantized
embedding or head is dequantized to the model dtype, as FP8 checkpoints keep them.
"""

from __future__ import annotations

import re
from dataclasses import dataclass
from pathlib import Path

import torch

from ...converters.checker import EXACT, check, check_grid_to_float
from ...converters.plan import Options, TensorPlan, Writer, WriterSession, unknown_type
from ...converters.records import Dense, Grid, TensorRecord
from ...kernels.fp8_tiles import TILE
from ..common.checkpoint import ShardWriter, copy_side_files, write_json
from ..common.fp8_tiles import FP8_TILE, cast_to_fp8_tiles

__all__ = ["Fp8Writer", "FP8_TYPES"]

_QUANTIZABLE = re.compile(r"^model\.layers\.\d+\..*_proj\.weight$")  # the decoder blocks' linears
FP8_TYPES = ("fp8", "fp8-128x128-e8m0")
_DTYPES = {"bfloat16": torch.bfloat16, "float16": torch.float16, "float32": torch.float32}


def _wants_fp8(type_name: str | None) -> bool:
    if type_name is None:
        return False
    if type_name.lower() not in FP8_TYPES:
        raise unknown_type(type_name, FP8_TYPES, "fp8")
    return True


@dataclass(frozen=True)
class Fp8Action:
    """How the session stores one tensor: as FP8 tiles, or dense in `dense` (a quantized embedding or head)."""

    tiles: bool = False
    dense: torch.dtype | None = None


class Fp8Writer(Writer):
    name = "fp8"

    def plan_tensor(self, rec: TensorRecord, options: Options, source) -> TensorPlan:
        wants = _wants_fp8(options.explicit_type(rec.name) or options.type)
        linear = len(rec.shape) == 2 and _QUANTIZABLE.match(rec.name) is not None
        target = FP8_TILE.name
        if linear and rec.is_grid:
            return self.plan(rec, check(rec.params, rec.shape, FP8_TILE), target, action=Fp8Action(tiles=True))
        if linear and wants:
            return self.plan(rec, check(rec.dtype, rec.shape, FP8_TILE), target, action=Fp8Action(tiles=True))
        if rec.is_grid:
            dtype = _model_dtype(source.config)
            name = {torch.bfloat16: "BF16", torch.float16: "F16", torch.float32: "F32"}[dtype]
            return self.plan(rec, check_grid_to_float(rec.params, name), name.lower(), action=Fp8Action(dense=dtype))
        return TensorPlan(rec.name, rec.shape, rec.dtype, rec.dtype, EXACT, "copied", out_name=rec.name)

    def open(self, path: Path, source, plans: list[TensorPlan], options: Options) -> "Fp8Session":
        return Fp8Session(Path(path), source)


class Fp8Session(WriterSession):
    def __init__(self, path: Path, source):
        self.path, self.source = path, source
        self.shards = ShardWriter(path)
        self.dense_linears: list[str] = []
        self.fp8_modules = 0

    def add(self, plan: TensorPlan, item: Dense | Grid) -> torch.Tensor:
        action: Fp8Action = plan.action or Fp8Action()
        prefix = plan.out_name[: -len(".weight")] if plan.out_name.endswith(".weight") else plan.out_name
        if action.tiles:
            codes, e8m0, values = cast_to_fp8_tiles(item)
            self.shards.put(plan.out_name, codes.view(torch.float8_e4m3fn))
            self.shards.put(f"{prefix}.weight_scale_inv", e8m0.view(torch.float8_e8m0fnu))
            self.fp8_modules += 1
            return values
        tensor = item.dequantize(torch.float32).to(action.dense) if action.dense is not None else item.tensor
        if len(plan.shape) == 2 and _QUANTIZABLE.match(plan.name):
            self.dense_linears.append(prefix)
        self.shards.put(plan.out_name, tensor)
        return tensor.to(torch.float32)

    def close(self) -> None:
        self.shards.close()
        config = {k: v for k, v in self.source.config.items() if k != "quantization_config"}
        config["quantization_config"] = {"quant_method": "fp8", "fmt": "e4m3", "activation_scheme": "dynamic",
                                         "weight_block_size": list(TILE), "scale_fmt": "ue8m0",
                                         "modules_to_not_convert": ["lm_head"] + self.dense_linears}
        write_json(self.path / "config.json", config)
        copy_side_files(self.source, self.path)


def _model_dtype(config: dict) -> torch.dtype:
    return _DTYPES.get(str(config.get("dtype") or config.get("torch_dtype") or "bfloat16"), torch.bfloat16)
