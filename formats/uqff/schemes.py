"""The UQFF target types (mistral.rs' ISQ names) as alignment schemes, and mistral.rs' rules beside them.

One scheme per `layout.UQFF_TYPES` entry; the alignment checker (converters/align.py) decides every
verdict from them. Quirks of mistral.rs that are not the scheme's (its K fallback, the run dtype an
Unquant layer needs) are the hooks below.
"""

from __future__ import annotations

import torch

from ...converters.checker import TargetScheme, float_scheme, ggml_scheme
from ...kernels.ggml.layouts import LAYOUTS
from .layout import AFQ_BITS, AFQ_GROUPS, K_FALLBACK, UQFF_TYPES, UqffType

__all__ = ["UQFF_SCHEMES", "candidates_for_bits", "REQUANT_DEFAULT", "scheme_for"]


def _scheme(t: UqffType) -> TargetScheme:
    if t.family == "unquant":
        name = {torch.float32: "F32", torch.float16: "F16", torch.bfloat16: "BF16"}[t.unquant_dtype]
        # mistral.rs multiplies an Unquant layer in its stored dtype (no cast): it must be the run's dtype
        return float_scheme(name, note=f"; load with dtype {name.lower()} in mistral.rs", scheme_name=t.name)
    if t.family == "gguf":
        return ggml_scheme(t.ggml, scheme_name=t.name)
    if t.family == "afq":  # scale and bias per group, float32 as our writer stores them
        return TargetScheme(t.name, "afq", bits=t.bits, group=t.group_size, zero="min", scale="fp32",
                            groups=AFQ_GROUPS, code_bits=AFQ_BITS)
    if t.family == "hqq":  # hqq's axis-0 layout, meta in the source's compute dtype
        return TargetScheme(t.name, "hqq-axis0", bits=t.bits, group=t.group_size, zero="float", scale="source",
                            axis=0)
    if t.family == "mxfp4":  # E2M1 codes, an E8M0 exponent per 32 along a row: a float grid keeps its codes
        return TargetScheme(t.name, "float-block", bits=4, group=32, block=32, scale="e8m0", element="e2m1")
    if t.family == "fp8":  # E4M3 codes, one float32 scale per tensor (dequant_w_scale)
        return TargetScheme(t.name, "float-block", bits=8, scale="fp32", element="e4m3")
    return TargetScheme(t.name, "codebook", bits=t.bits, scale="fp32")  # F8Q8: Q8_0-like blocks, fp8 scales


UQFF_SCHEMES: dict[str, TargetScheme] = {name: _scheme(t) for name, t in UQFF_TYPES.items()}
# aligned candidates per source bit width, cheapest first; the first exact (else near-exact) one is chosen
# (float grids: mxfp4 holds E2M1 codes under E8M0 scales, fp8 E4M3 codes under one scale per tensor)
_CANDIDATES = {2: ("afq2",), 3: ("afq3",), 4: ("q4_0", "afq4", "hqq4", "q4_1", "mxfp4"), 5: ("q5_0", "afq6", "q5_1"),
               6: ("afq6",), 8: ("q8_0", "afq8", "hqq8", "fp8")}
# when nothing aligns and no --type is given: the AFQ width that holds the bits
REQUANT_DEFAULT = {2: "afq2", 3: "afq3", 4: "afq4", 5: "afq6", 6: "afq6", 8: "afq8"}


def candidates_for_bits(bits: int) -> list[str]:
    """UQFF type names that could hold a `bits`-bit grid, cheapest first."""
    return list(dict.fromkeys(n for b in sorted(_CANDIDATES) if b >= bits for n in _CANDIDATES[b]))


def scheme_for(t: UqffType, in_features: int) -> tuple[TargetScheme, str]:
    """The scheme a tensor of rows `in_features` is checked against, and a note: a K type whose rows are
    not whole 256-blocks is stored as mistral.rs' fallback type."""
    s = UQFF_SCHEMES[t.name]
    if t.family == "gguf" and LAYOUTS[t.ggml].kind == "k" and in_features % 256:
        fb = K_FALLBACK[t.ggml]
        return ggml_scheme(fb, scheme_name=t.name), f"{t.ggml} needs rows of 256, mistral.rs' fallback {fb}: "
    return s, ""

