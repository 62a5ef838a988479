"""AMD Quark OCP MXFP4 / MXFP8 checkpoints (quant_method "quark": amd-quark's export_safetensors): a reader. Layout and
dequantization: reader.py."""

from __future__ import annotations

from ...converters.registry import FormatEntry, register_format
from .reader import QuarkSource, open_quark, sniff_quark

__all__ = ["QuarkSource", "open_quark", "sniff_quark"]

register_format(FormatEntry("quark", aliases=("amd-quark",),
                            description="AMD Quark OCP MXFP4 / MXFP8 checkpoint (weight: E2M1 codes two a byte "
                                        "or E4M3 codes one a byte, weight_scale: E8M0 per 32); read only",
                            open_reader=open_quark, sniff=sniff_quark,
                            examples=("qconvert 'quark->gguf' DeepSeek-R1-MXFP4/ r1.gguf",)))
