"""AWQ checkpoints (AutoAWQ / transformers / gptqmodel), GEMM (2-8 bits) and GEMV layouts: reader only.

Layout: layout.py; reading: reader.py (gptqmodel 7.6's AWQ loader is the reference for GEMM at every width,
AutoAWQ 0.2.9's packer for GEMV).
A read-only format carries no `examples` (the registry's examples are command lines with it as the target).
"""

from ...converters.registry import FormatEntry, register_format
from .reader import open_awq, sniff_awq

register_format(FormatEntry("awq", aliases=("autoawq", "awq-gemm"),
                            description="AWQ checkpoint (AutoAWQ / gptqmodel), GEMM (4-bit; gptqmodel 2-8-bit) "
                                        "or GEMV layout: integer zero points, fp16 scales (read only)",
                            open_reader=open_awq, sniff=sniff_awq))
