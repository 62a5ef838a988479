"""What GPTQ holds, as the checker reads it: the `gptq` family (registered here) and the v1 / v2 target schemes.
The --type vocabulary (4g128, 4g32a) is formats/common/gptq_type.py, which compressed-tensors shares."""

from __future__ import annotations

import torch

from ...converters.checker import EXACT, REFUSED, REQUANTIZE, Decision, Source, TargetScheme, fp16_exact, register_family
from ...converters.records import GridParams
from ...kernels.bitpack import SUPPORTED_PACK_BITS
from ..common.gptq_type import ModuleScheme, parse_gptq_type

__all__ = ["GPTQ_SCHEMES", "ModuleScheme", "parse_gptq_type"]


def _gptq(src: Source, shape, s: TargetScheme, native, prefer_groups=()) -> Decision:
    """GPTQ's packed words: 2/3/4/8-bit codes along the input features, integer zero points, fp16 scales,
    any group size and an act-order index. zero "none": the v1 writer stores symmetric grids only
    (gptqmodel loads asymmetric v1 only from files it wrote itself)."""
    if not isinstance(src, GridParams):
        return Decision(REQUANTIZE, "dense weights quantized with round-to-nearest (no calibration)")
    p = src
    if p.axis != 1 or not p.integer_zeros or p.bits not in s.code_bits:
        return Decision(REQUANTIZE, "GPTQ holds integer zero points at 2/3/4/8 bits only")
    if p.scales.dtype != torch.float16 and not fp16_exact(p.scales):
        return Decision(REQUANTIZE, "scales are not representable in fp16")
    if s.zero == "none" and not p.symmetric:
        return Decision(REFUSED, "asymmetric v1 cannot store a zero point of 0 without borrowing, and gptqmodel "
                                 "loads asymmetric v1 only from its own files")
    return Decision(EXACT, "codes, zeros and fp16 scales kept", keeps_codes=True)


register_family("gptq", _gptq)

# the GPTQ target schemes (the alignment checker's view of what each writer stores): packed 2/3/4/8-bit codes
# along the input features, integer zero points, fp16 scales, any group size, act-order index. v1 is
# written symmetric only (gptqmodel 7.6 loads asymmetric v1 only from files it wrote itself, which
# borrow one from the stored zero); v2 stores the zero point as it is.
GPTQ_SCHEMES = {
    "v1": TargetScheme("gptq", "gptq", zero="none", scale="fp16", act_order=True, code_bits=SUPPORTED_PACK_BITS),
    "v2": TargetScheme("gptq-v2", "gptq", zero="int", scale="fp16", act_order=True, code_bits=SUPPORTED_PACK_BITS),
}
