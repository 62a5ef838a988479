"""GPTQ checkpoints (gptqmodel / AutoGPTQ / transformers), read and written in the v1 (`gptq`) and v2
(`gptq-v2`) zero-point conventions.

Layout: layout.py (qzeros in v1 / v2); the checker's family and target schemes: schemes.py; reading:
reader.py (rotation folded in, the v1/v2 label checked against the data); writing: writer.py.
"""

from ...converters.registry import FormatEntry, register_format
from ...kernels.bitpack import SUPPORTED_PACK_BITS
from .reader import GptqSource, open_gptq, sniff_gptq
from .schemes import GPTQ_SCHEMES, ModuleScheme, parse_gptq_type
from .writer import GptqWriter

__all__ = ["GptqSource", "GptqWriter", "GPTQ_SCHEMES", "ModuleScheme", "open_gptq", "parse_gptq_type"]

# the --type vocabulary as parse_gptq_type reads it; v1 output refuses asymmetric grids (see GptqWriter)
_TYPE_HELP = (f"BITSgGROUP, bits {', '.join(map(str, SUPPORTED_PACK_BITS))}, group -1 for per-channel: "
              "4g128, 4g32, 8g-1; {asym}; without --type each grid keeps its own")

register_format(FormatEntry("gptq", aliases=("gptq-v1", "autogptq"),
                            description="GPTQ checkpoint, v1 zero-point convention (stored zero = z - 1)",
                            open_reader=open_gptq, writer=GptqWriter("v1"), sniff=sniff_gptq("v1"),
                            type_help=_TYPE_HELP.format(asym="symmetric only (asymmetric output is gptq-v2)"),
                            examples=("qconvert 'gguf->gptq' model-q4_0.gguf model-gptq/",
                                      "qconvert 'hf->gptq' model/ model-gptq/ --type 4g128 --allow-requant")))
register_format(FormatEntry("gptq-v2", aliases=("gptqv2",),
                            description="GPTQ checkpoint, v2 convention (true zero points)",
                            open_reader=open_gptq, writer=GptqWriter("v2"), sniff=sniff_gptq("v2"),
                            type_help=_TYPE_HELP.format(asym="a trailing a is asymmetric: 4g32a"),
                            examples=("qconvert 'gptq->gptq-v2' model-gptq/ model-gptq-v2/",
                                      "qconvert 'hf->gptq-v2' model/ model-gptq-v2/ --type 4g32a --allow-requant")))
