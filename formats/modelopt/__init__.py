"""NVIDIA ModelOpt checkpoints (FP8, NVFP4, MXFP4 weights): a reader. Layout and dequantization: reader.py."""

from __future__ import annotations

from ...converters.registry import FormatEntry, register_format
from .reader import ModelOptSource, open_modelopt, sniff_modelopt

__all__ = ["ModelOptSource", "open_modelopt", "sniff_modelopt"]

register_format(FormatEntry("modelopt", aliases=("nvidia-modelopt", "trtllm"),
                            description="NVIDIA ModelOpt checkpoint (export_hf_checkpoint): FP8, NVFP4 (a per-tensor "
                                        "weight_scale_2) or MXFP4 weights; read only",
                            open_reader=open_modelopt, sniff=sniff_modelopt,
                            examples=("qconvert 'modelopt->gguf' model-nvfp4/ model.gguf",
                                      "qconvert 'modelopt->uqff' model-mxfp4/ model-uqff/")))
