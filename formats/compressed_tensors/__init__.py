"""compressed-tensors (llm-compressor's checkpoint format, what vLLM loads): reader and pack-quantized writer."""

from __future__ import annotations

from pathlib import Path

from ...converters.registry import FormatEntry, register_format
from ..common.checkpoint import quantization_config_of
from .reader import CtSource, open_ct
from .writer import CtWriter

__all__ = ["CtSource", "CtWriter", "open_ct"]


def sniff(path: Path) -> bool:
    """A checkpoint folder whose config says quant_method compressed-tensors (the data, not the name)."""
    qc = quantization_config_of(path)
    return isinstance(qc, dict) and qc.get("quant_method") == "compressed-tensors"


register_format(FormatEntry(
    "compressed-tensors", aliases=("ct", "llm-compressor"),
    description="compressed-tensors checkpoint (llm-compressor, vLLM): pack-quantized int weights; reads "
                "int-/naive-/float-quantized and nvfp4 too",
    open_reader=open_ct, writer=CtWriter(), sniff=sniff,
    type_help="BITSgGROUP as for GPTQ (4g128, 4g32, 8g-1 per channel, a trailing a = asymmetric: 4g128a); "
              "without --type each grid keeps its own; fp8: E4M3 in 128x128 tiles under power-of-two scales (MXFP4 "
              "casts exactly)",
    examples=("qconvert 'gptq->compressed-tensors' model-gptq/ model-ct/",
              "qconvert 'hf->compressed-tensors' model/ model-ct/ --type 4g128 --allow-requant",
              "qconvert 'compressed-tensors->gguf' model-ct/ model.gguf --type Q4_0")))
