"""bitsandbytes checkpoints (transformers' BitsAndBytesConfig: 4-bit NF4/FP4, double quant, LLM.int8): a reader.

Read without importing bitsandbytes (formats/bitsandbytes/reader.py describes the layout)."""

from __future__ import annotations

from ...converters.registry import FormatEntry, register_format
from .reader import BnbSource, open_bnb, sniff_bnb

__all__ = ["BnbSource", "open_bnb", "sniff_bnb"]

register_format(FormatEntry("bitsandbytes", aliases=("bnb",),
                            description="bitsandbytes checkpoint saved by transformers (NF4/FP4 4-bit with or "
                                        "without double quant, LLM.int8); read only",
                            open_reader=open_bnb, sniff=sniff_bnb,
                            examples=("qconvert 'bnb->gguf' model-bnb-int8/ model.gguf --type Q8_0",
                                      "qconvert 'bnb->gguf' model-bnb-nf4/ model.gguf --type Q4_K --allow-requant",
                                      "qconvert 'bnb->hf' model-bnb-nf4/ model-fp16/")))
