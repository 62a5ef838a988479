"""Reading a dense Hugging Face checkpoint (fp32 / fp16 / bf16 safetensors): every tensor as `Dense`. A quantized
folder is refused with the pair that reads it.
"""

from __future__ import annotations


from dataclasses import replace
from pathlib import Path
from typing import Iterator


from ...converters.errors import BadInput
from ...converters.records import TensorRecord
from ...converters.model_shapes import ModelShapes
from ..common.checkpoint import CheckpointDir, CheckpointSource
from ..common.checkpoint import quantization_config_of, release_layout_of
from ..common.quant_config import read_config
from .deepseek_v4 import (RELEASE_CLASSES, fp8_block_record, fp8_block_weights, packed_fp4_record, packed_fp4_weights,
                          release_name_to_hf, release_quantization)


class HfSource(CheckpointSource):
    format_name = "hf"

    def __init__(self, path: Path):
        self.path = Path(path)
        conf = read_config(self.path)
        cfg, qc = conf.raw, conf.raw.get("quantization_config")
        # DeepSeek-V4 as released (deepseek_v4.py): its names renamed to transformers', its FP4 experts and
        # (with the release's FP8 quantization_config) its FP8 block weights ({weight: its exponents}) read as
        # one grid each
        archs = cfg.get("architectures") or []
        self.release = any(a in RELEASE_CLASSES for a in archs if isinstance(a, str))
        if qc and not self.release:
            raise BadInput(_quantized_hint(self.path, qc), path=self.path / "config.json")
        self.config = cfg
        self.quant_config: dict = release_quantization(qc, self.path / "config.json") if qc else {}
        self.shapes = ModelShapes(cfg, self.path / "config.json")
        self.ckpt = CheckpointDir(self.path)
        self.fp4 = packed_fp4_weights(self.ckpt) if self.release else {}
        self.fp8 = fp8_block_weights(self.ckpt) if self.quant_config else {}
        self.fp4_scales = set(self.fp4.values()) | set(self.fp8.values())

    def records(self) -> Iterator[TensorRecord]:
        for shard in self.ckpt.shards:
            for name in self.ckpt.keys(shard):
                if name in self.fp4:
                    yield packed_fp4_record(self.ckpt, name, self.fp4[name], shard)
                    continue
                if name in self.fp8:
                    yield fp8_block_record(self.ckpt, name, self.fp8[name], shard)
                    continue
                if name in self.fp4_scales:
                    continue
                self.shapes.check_dense(name, self.ckpt.shape(name), self.ckpt.path / shard, self.ckpt.dtype(name))
                rec = self.ckpt.dense_record(name, shard)
                if self.release:
                    rec = replace(rec, name=release_name_to_hf(name), source_name=name)
                yield rec

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


def sniff_hf(path: Path) -> bool:
    """A folder of safetensors with a config.json without quantization_config, or of a class saved in its release
    layout (DeepSeek-V4, FP8 quantization_config and all: deepseek_v4.py); a mistral.rs UQFF directory also has
    config.json and residual.safetensors: its .uqff files tell it apart."""
    return ((quantization_config_of(path) == {} or release_layout_of(path)) and any(Path(path).glob("*.safetensors"))
            and not any(Path(path).glob("*.uqff")))
