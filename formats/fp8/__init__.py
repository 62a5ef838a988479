"""Hugging Face FP8 checkpoints (DeepSeek-V3 / Kimi-K2 / Qwen3-FP8 block-scaled, fbgemm per-channel): a reader.

Layout and dequantization: reader.py. Every quantized linear is a float grid (e4m3 codes, float32 scales), which
GGUF targets requantize (ggml has no FP8 type; F16/BF16 hold the values near-exactly) and UQFF's fp8 keeps when
the checkpoint has one scale per tensor.
"""

from __future__ import annotations

from ...converters.registry import FormatEntry, register_format
from .reader import Fp8Source, open_fp8, sniff_fp8

__all__ = ["Fp8Source", "open_fp8", "sniff_fp8"]

register_format(FormatEntry("fp8", aliases=("deepseek-fp8", "finegrained-fp8", "fbgemm-fp8"),
                            description="FP8 checkpoint (transformers' FineGrainedFP8: DeepSeek-V3, Kimi-K2, "
                                        "Qwen3-FP8 128x128 blocks; fbgemm per-channel); read only",
                            open_reader=open_fp8, sniff=sniff_fp8,
                            examples=("qconvert 'fp8->gguf' DeepSeek-V3/ ds.gguf --type q4_k_m --allow-requant",
                                      "qconvert 'fp8->gguf' Qwen3-8B-FP8/ q.gguf --type bf16")))
