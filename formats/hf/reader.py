"""`hf`: a dense Hugging Face checkpoint (fp32 / fp16 / bf16 safetensors) in and out.

Reading yields every tensor as `Dense`. Writing dequantizes grids (float32 math, one rounding to the
target dtype) and writes sharded safetensors plus config.json and the tokenizer files, so that
`transformers.AutoModelForCausalLM.from_pretrained(out)` loads the result.
"""

from __future__ import annotations

import re

from pathlib import Path
from typing import Iterator

import torch

from ...converters.checker import EXACT, REFUSED, check_dense_to_float, check_grid_to_float, describe_grid
from ...converters.errors import BadInput, QConvertError
from ...converters.plan import Options, TensorPlan, unknown_type
from ...converters.records import Dense, Grid, TensorRecord, canonical_name
from ...converters.registry import FormatEntry, register_format
from ...converters.model_shapes import ModelShapes
from ..common.checkpoint import (CheckpointDir, CheckpointSource, ShardWriter, copy_side_files, quantization_config_of,
                              read_json, write_json)

__all__ = ["HfSource", "HfWriter"]

HF_TYPES = {"F32": torch.float32, "F16": torch.float16, "BF16": torch.bfloat16}
_TORCH_NAME = {torch.float32: "float32", torch.float16: "float16", torch.bfloat16: "bfloat16"}


class HfSource(CheckpointSource):
    format_name = "hf"

    def __init__(self, path: Path):
        self.path = Path(path)
        cfg = read_json(self.path / "config.json")
        qc = cfg.get("quantization_config")
        if qc:
            raise BadInput(_quantized_hint(self.path, qc), path=self.path / "config.json")
        self.config = cfg
        self.quant_config: dict = {}
        self.shapes = ModelShapes(cfg, self.path / "config.json")
        self.ckpt = CheckpointDir(self.path)

    def records(self) -> Iterator[TensorRecord]:
        for shard in self.ckpt.shards:
            for name in self.ckpt.keys(shard):
                self.shapes.check_dense(name, self.ckpt.shape(name), self.ckpt.path / shard, self.ckpt.dtype(name))
                yield self.ckpt.dense_record(name, shard)

    def describe(self) -> dict:
        dtypes = sorted({self.ckpt.dtype(n) for n in self.ckpt.location})
        return {"format": "hf", "dtypes": dtypes, "shards": len(self.ckpt.shards),
                "tensors": len(self.ckpt.location), "architectures": self.config.get("architectures"),
                "ignored_files": self.ignored_files}


def _quantized_hint(path: Path, qc) -> str:
    """Why a quantized folder is not `hf`, and the pair that reads it where qconvert has one."""
    from ...converters.errors import QConvertError
    from ...converters.registry import all_formats, detect_format

    method = qc.get("quant_method", qc.get("method")) if isinstance(qc, dict) else None
    try:
        fmt = detect_format(path)
    except QConvertError:
        fmt = None
    if fmt and fmt != "hf":
        return f"this checkpoint is quantized (quant_method {method!r}): read it as {fmt}, e.g. `qconvert '{fmt}->gguf'`"
    readers = ", ".join(e.name for e in all_formats() if e.can_read)
    return (f"this checkpoint is quantized with quant_method {method!r}, which qconvert does not read yet "
            f"(it reads {readers})")


def parse_hf_type(text: str | None) -> str:
    key = (text or "bf16").upper().replace("FLOAT32", "F32").replace("FLOAT16", "F16").replace("BFLOAT16", "BF16")
    if key not in HF_TYPES:
        raise unknown_type(text, [t.lower() for t in HF_TYPES], "hf")
    return key


_PER_EXPERT = re.compile(r"\.experts\.\d+\.")


class HfWriter:
    name = "hf"
    output_is_file = False

    def plan_tensor(self, rec: TensorRecord, options: Options, source) -> TensorPlan:
        plan = self._plan(rec, options)
        if plan.out_name:
            plan.out_name = canonical_name(plan.out_name, source.config)
        return plan

    def _plan(self, rec: TensorRecord, options: Options) -> TensorPlan:
        target = parse_hf_type(options.explicit_type(rec.name) or options.type)
        if rec.is_grid:
            v = check_grid_to_float(rec.params, target)
            return TensorPlan(rec.name, rec.shape, describe_grid(rec.params, rec.shape[1]), target, v.verdict,
                              v.reason, out_name=rec.name)
        if rec.dtype not in ("float32", "float16", "bfloat16"):
            if rec.dtype in ("int32", "int64", "int8", "uint8", "bool"):
                return TensorPlan(rec.name, rec.shape, rec.dtype, rec.dtype, EXACT, "copied", out_name=rec.name)
            return TensorPlan(rec.name, rec.shape, rec.dtype, target, REFUSED, f"dtype {rec.dtype} is not supported")
        v = check_dense_to_float(rec.dtype, target)
        return TensorPlan(rec.name, rec.shape, rec.dtype, target, v.verdict, v.reason, out_name=rec.name)

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
        return None

    def open(self, path: Path, source, plans: list[TensorPlan], options: Options) -> "HfSession":
        return HfSession(Path(path), source, parse_hf_type(options.type))


class HfSession:
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


register_format(FormatEntry("hf", aliases=("safetensors", "dense", "transformers"), extras={"generic": True},
                            description="dense Hugging Face safetensors checkpoint (f32/f16/bf16)",
                            open_reader=lambda path, **_: HfSource(path), writer=HfWriter(),
                            # a mistral.rs UQFF directory also has config.json and residual.safetensors
                            sniff=lambda path: quantization_config_of(path) == {} and any(Path(path).glob("*.safetensors"))
                            and not any(Path(path).glob("*.uqff")),
                            # the --type vocabulary as parse_hf_type reads it (bf16 when none is given)
                            type_help=", ".join(t.lower() for t in HF_TYPES) + " (default bf16)",
                            examples=("qconvert convert model.gguf model-hf/ --to hf",
                                      "qconvert 'gptq->hf' model-gptq/ model-hf/ --type f32")))
