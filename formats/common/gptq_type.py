"""GPTQ's --type vocabulary, BITSgGROUP with a trailing `a` for asymmetric (4g128, 4g32a, 8g-1), and the
module scheme it names; the compressed-tensors writer takes the same names for its integer targets."""

from __future__ import annotations

import re
from dataclasses import dataclass

from ...converters.errors import QConvertError


@dataclass(frozen=True)
class ModuleScheme:
    bits: int
    group_size: int  # -1 = one group per row
    sym: bool
    desc_act: bool


_TYPE_RE = re.compile(r"^(?:gptq:)?(?:b|q)?(?P<bits>[2348])(?:bit)?[-_:]?g(?P<group>-?\d+)(?P<asym>a|-asym)?$")


def parse_gptq_type(text: str) -> ModuleScheme:
    """`4g128` / `q4g128` / `4bit-g128` (sym), `4g32a` (asym), `8g-1` (per-channel)."""
    m = _TYPE_RE.match(text.strip().lower())
    if not m:
        raise QConvertError(f"unknown GPTQ type {text!r}; write bits and group, e.g. 4g128, 4g32a (asym), 8g-1")
    return ModuleScheme(int(m["bits"]), int(m["group"]), not m["asym"], False)
