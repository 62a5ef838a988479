"""auto-round's native format (`quant_method` "auto-round"): a reader of its integer packings.

auto-round's `auto_gptq` export (quant_method "gptq") is a GPTQ checkpoint and goes through formats/gptq/;
its native packings (auto_round:auto_gptq, auto_round, auto_round:gptqmodel, auto_round:auto_awq) are read
here into integer grids (reader.py). Writing auto-round's format is not offered: gptq-v2 output holds the same
grids and auto-round's loader reads GPTQ checkpoints.
"""

from ...converters.registry import FormatEntry, register_format
from .reader import AutoRoundSource, open_auto_round, sniff_auto_round

__all__ = ["AutoRoundSource", "open_auto_round", "sniff_auto_round"]

register_format(FormatEntry("auto-round", aliases=("autoround", "intel-auto-round", "auto-round-native"),
                            description="auto-round native checkpoint (quant_method auto-round: auto_round:auto_gptq, "
                                        "auto_round, auto_round:gptqmodel and auto_round:auto_awq packings), read only",
                            open_reader=open_auto_round, sniff=sniff_auto_round))
# no `examples`: tests/apps/test_cli_registry.py runs every example against a fixture of its source format, and has
# none of auto-round's (the aligned paths: 'auto-round->gptq-v2' exact, 'auto-round->gguf' --type Q4_0 for sym g32)
