"""torchao safetensors checkpoints (quant_method "torchao": transformers' TorchAoConfig, pytorch's own Hub releases):
a reader. Layout and dequantization: reader.py."""

from __future__ import annotations

from ...converters.registry import FormatEntry, register_format
from .reader import TorchAoSource, open_torchao, sniff_torchao

__all__ = ["TorchAoSource", "open_torchao", "sniff_torchao"]

register_format(FormatEntry("torchao", aliases=("torch-ao",),
                            description="torchao safetensors checkpoint (IntxUnpackedToInt8Tensor, Int8Tensor, "
                                        "Float8Tensor as <module>._weight_qdata / _scale / _zero_point); read only",
                            open_reader=open_torchao, sniff=sniff_torchao,
                            examples=("qconvert 'torchao->gguf' Qwen3-8B-INT4/ q.gguf --type q4_0",)))
