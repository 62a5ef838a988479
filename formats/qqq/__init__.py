"""QQQ W4A8 checkpoints (gptqmodel's qqq format, and the QQQ repo's own configs), read and written.

Layout: layout.py (the runtime grid of a stored module, and the module a 4-bit symmetric grid becomes);
the checker's family: schemes.py; reading: reader.py; writing: writer.py.
"""

from ...converters.registry import FormatEntry, register_format
from .reader import QqqSource, open_qqq, sniff_qqq
from .schemes import qqq_scheme
from .writer import QqqWriter

__all__ = ["QqqSource", "QqqWriter", "open_qqq", "qqq_scheme"]

register_format(FormatEntry("qqq", aliases=("qqq-w4a8",),
                            description="QQQ W4A8 checkpoint (gptqmodel / QQQ repo): Marlin-tiled int4, per-channel "
                                        "and per-group scales",
                            open_reader=open_qqq, writer=QqqWriter(), sniff=sniff_qqq,
                            # the --type vocabulary as schemes.parse_qqq_type reads it (QqqWriter's default group)
                            type_help="g128 or g-1 (per-channel): QQQ holds 4-bit symmetric weights; without --type "
                                      "the source's group (128 unless the source is per-channel)",
                            examples=("qconvert 'gptq->qqq' model-gptq-4bit-per-channel/ model-qqq/",
                                      "qconvert 'hf->qqq' model/ model-qqq/ --type g128 --allow-requant")))
