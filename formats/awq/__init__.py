"""AWQ checkpoints (AutoAWQ / transformers / gptqmodel), GEMM layout: reader only.

Layout: layout.py; reading: reader.py (gptqmodel 7.6's AWQ loader is the reference for both).
A read-only format carries no `examples` (the registry's examples are command lines with it as the target).
"""

from ...converters.registry import FormatEntry, register_format
from .reader import open_awq, sniff_awq

register_format(FormatEntry("awq", aliases=("autoawq", "awq-gemm"),
                            description="AWQ checkpoint (AutoAWQ / gptqmodel), GEMM layout: 4-bit, integer zero "
                                        "points, fp16 scales (read only)",
                            open_reader=open_awq, sniff=sniff_awq))
