"""gpt-oss MXFP4 checkpoints (quant_method "mxfp4"): a reader. Layout and dequantization: reader.py."""

from __future__ import annotations

from ...converters.registry import FormatEntry, register_format
from .reader import Mxfp4Source, open_mxfp4, sniff_mxfp4

__all__ = ["Mxfp4Source", "open_mxfp4", "sniff_mxfp4"]

register_format(FormatEntry("mxfp4", aliases=("gpt-oss", "gpt-oss-mxfp4"),
                            description="gpt-oss MXFP4 checkpoint (experts as *_blocks / *_scales: e2m1 codes, "
                                        "E8M0 exponents per 32); read only",
                            open_reader=open_mxfp4, sniff=sniff_mxfp4,
                            examples=("qconvert 'mxfp4->gguf' gpt-oss-20b/ gpt-oss-20b.gguf",)))
