"""Hugging Face FP8 checkpoints (DeepSeek-V3 / Kimi-K2 / Qwen3-FP8 block-scaled, fbgemm per-channel): a reader,
and a writer of 128x128 tiles under E8M0 scales (writer.py), into which MXFP4 casts exactly.

Layout and dequantization: reader.py. Every quantized linear is a float grid (e4m3 codes, float32 scales), which
GGUF targets requantize (ggml has no FP8 type; F16/BF16 hold the values near-exactly) and UQFF's fp8 keeps when
the checkpoint has one scale per tensor.
"""

from __future__ import annotations

from ...converters.registry import FormatEntry, register_format
from .reader import Fp8Source, open_fp8, sniff_fp8
from .writer import Fp8Writer

__all__ = ["Fp8Source", "Fp8Writer", "open_fp8", "sniff_fp8"]

register_format(FormatEntry("fp8", aliases=("deepseek-fp8", "finegrained-fp8", "fbgemm-fp8"),
                            description="FP8 checkpoint (transformers' FineGrainedFP8: DeepSeek-V3, Kimi-K2, "
                                        "Qwen3-FP8 128x128 blocks; fbgemm per-channel); writes 128x128 tiles with E8M0 "
                                        "scales (scale_fmt ue8m0): MXFP4 casts exactly",
                            open_reader=open_fp8, writer=Fp8Writer(), sniff=sniff_fp8,
                            type_help="fp8 (= fp8-128x128-e8m0): also quantize the dense decoder linears "
                                      "(lossy, with --allow-requant); without --type only grids become FP8 "
                                      "(MXFP4 exactly) and dense tensors are copied",
                            examples=("qconvert 'modelopt->fp8' Llama-MXFP4/ Llama-FP8/",
                                      "qconvert 'fp8->gguf' DeepSeek-V3/ ds.gguf --type q4_k_m --allow-requant",
                                      "qconvert 'fp8->gguf' Qwen3-8B-FP8/ q.gguf --type bf16")))
