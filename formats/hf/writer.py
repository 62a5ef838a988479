"""Writing a dense Hugging Face checkpoint: grids dequantized (float32 math, one rounding to the target dtype) into
sharded safetensors plus config.json and the tokenizer files, so that
`transformers.AutoModelForCausalLM.from_pretrained(out)` loads the result.
"""

from __future__ import annotations

import re
from pathlib import Path

import torch

from ...converters.checker import EXACT, REFUSED, check_dense_to_float, check_grid_to_float
from ...converters.errors import QConvertError
from ...converters.model_shapes import canonical_name
from ...converters.plan import Options, TensorPlan, Writer, WriterSession, unknown_type
from ...converters.records import Dense, Grid, TensorRecord
from ..common.checkpoint import ShardWriter, copy_side_files, write_json


HF_TYPES = {"F32": torch.float32, "F16": torch.float16, "BF16": torch.bfloat16}
_TORCH_NAME = {torch.float32: "float32", torch.float16: "float16", torch.bfloat16: "bfloat16"}


def parse_hf_type(text: str | None) -> str:
    key = (text or "bf16").upper().replace("FLOAT32", "F32").replace("FLOAT16", "F16").replace("BFLOAT16", "BF16")
    if key not in HF_TYPES:
        raise unknown_type(text, [t.lower() for t in HF_TYPES], "hf")
    return key


_PER_EXPERT = re.compile(r"\.experts\.\d+\.")


class HfWriter(Writer):
    name = "hf"

    def plan_tensor(self, rec: TensorRecord, options: Options, source) -> TensorPlan:
        target = parse_hf_type(options.explicit_type(rec.name) or options.type)
        # written under the name transformers loads it by (a producer may have renamed it)
        out_name = canonical_name(rec.name, source.config)
        if rec.is_grid:
            return self.plan(rec, check_grid_to_float(rec.params, target), target, out_name=out_name)
        if rec.dtype not in ("float32", "float16", "bfloat16"):
            if rec.dtype in ("int32", "int64", "int8", "uint8", "bool"):
                return TensorPlan(rec.name, rec.shape, rec.dtype, rec.dtype, EXACT, "copied", out_name=out_name)
            return TensorPlan(rec.name, rec.shape, rec.dtype, target, REFUSED, f"dtype {rec.dtype} is not supported")
        return self.plan(rec, check_dense_to_float(rec.dtype, target), target, out_name=out_name)

    def check_model(self, source, plans, options) -> None:
        # transformers' GptOss holds each layer's experts fused ([experts, in, out], gate/up interleaved) and
        # loads no per-expert tensor: per-expert records (gpt-oss's MXFP4 stacks, read expert by expert) would
        # load as random experts, so they are refused here, naming the route that fuses them
        if "GptOssForCausalLM" in (source.config.get("architectures") or []):
            expert = next((p.name for p in plans if _PER_EXPERT.search(p.name)), None)
            if expert is not None:
                raise QConvertError(f"gpt-oss experts are read one per expert here ({expert}) and transformers' "
                                    "GptOss loads them only fused: convert to gguf first (--type f32), then "
                                    "gguf->hf, which fuses them", path=source.path)

    def open(self, path: Path, source, plans: list[TensorPlan], options: Options) -> "HfSession":
        return HfSession(Path(path), source, parse_hf_type(options.type))


    def open_split(self, folder: Path, name: str, source, plans: list[TensorPlan], options: Options):
        from ..common.split_replay import ReplaySplitOutput

        return ReplaySplitOutput(self, folder, name, source, plans, options, ("shards",))

    def open_part(self, folder: Path, source, plans: list[TensorPlan], options: Options, layout):
        from ..common.split_replay import open_recording_part

        return open_recording_part(self, folder, source, plans, options, layout)


class HfSession(WriterSession):
    def __init__(self, path: Path, source, dtype_name: str):
        self.path, self.source = path, source
        self.dtype = HF_TYPES[dtype_name]
        self.shards = ShardWriter(path)

    def add(self, plan: TensorPlan, item: Dense | Grid) -> torch.Tensor:
        if plan.target in HF_TYPES:
            tensor = item.dequantize(HF_TYPES[plan.target])
        else:
            tensor = item.tensor
        self.shards.put(plan.out_name, tensor)
        return tensor.to(torch.float32)

    def close(self) -> None:
        self.shards.close()
        config = {k: v for k, v in self.source.config.items() if k != "quantization_config"}
        config["torch_dtype"] = _TORCH_NAME[self.dtype]
        if "dtype" in config:
            config["dtype"] = _TORCH_NAME[self.dtype]
        write_json(self.path / "config.json", config)
        copy_side_files(self.source, self.path)
