"""The UQFF target types (mistral.rs' ISQ names) as alignment schemes, and mistral.rs' rules beside them.

One scheme per `layout.UQFF_TYPES` entry; the checker (converters/checker.py) decides every verdict from
them. The families of mistral.rs' own types are registered here: `afq` (MLX's affine scheme), `hqq-axis0`
(hqq's strided-row groups) and `codebook` (F8Q8); its GGUF block types and float blocks follow the shared
`ggml` and `float-block` families (formats/common/block_schemes.py). Quirks of mistral.rs that are not the
scheme's (its K fallback, the run dtype an Unquant layer needs) are the hooks below.
"""

from __future__ import annotations

import torch

from ...converters.checker import (EXACT, NEAR_EXACT, REFUSED, REQUANTIZE, Decision, Source, TargetScheme,
                                   float_scheme, register_family)
from ...converters.records import GridParams
from ...kernels.ggml.layouts import LAYOUTS
from ...kernels.hqq import axis0_compact
from ..common.block_schemes import ggml_scheme
from .layout import AFQ_BITS, AFQ_GROUPS, K_FALLBACK, UQFF_TYPES, UqffType

__all__ = ["UQFF_SCHEMES", "candidates_for_bits", "REQUANT_DEFAULT", "scheme_for"]


def _afq(src: Source, shape, s: TargetScheme, native, prefer_groups=()) -> Decision:
    """mistral.rs' AFQ (MLX's affine scheme): value = scale * q + bias per group of 32/64/128 along a row,
    scales and biases stored in float32 by our writer (mistral.rs dequantizes in the stored dtype)."""
    in_features = shape[-1]
    p = src if isinstance(src, GridParams) else None
    if p is not None and p.axis == 1 and p.contiguous_groups(in_features) and p.bits <= s.bits:
        g = next((g for g in s.groups if p.group_size % g == 0 and in_features % g == 0), None)
        if g is not None:
            keep = dict(group_size=g, keeps_codes=True)
            if p.compute_dtype != torch.float32:
                return Decision(NEAR_EXACT, f"codes kept; the source dequantizes in {str(p.compute_dtype)[6:]}, "
                                            "AFQ in float32", **keep)
            if p.mins is not None:
                return Decision(EXACT, f"codes, scales and mins kept in float32 (group {g})", **keep)
            if p.integer_zeros:
                return Decision(NEAR_EXACT, f"codes and scales kept; bias = -scale*zero in float32 (group {g})", **keep)
            return Decision(NEAR_EXACT, f"codes kept; the float zero point becomes bias = -scale*zero (group {g})",
                            **keep)
    g = 64 if in_features % 64 == 0 else 32 if in_features % 32 == 0 else None
    if g is None:
        return Decision(REFUSED, f"rows of {in_features} are not whole AFQ groups of 32")
    why = ("dense weights quantized with AFQ's affine rule" if p is None else
           "the grid's groups (act-order, axis 0 or size) or bits do not map onto AFQ groups")
    return Decision(REQUANTIZE, why + f" (group {g})", group_size=g)


def _hqq_axis0(src: Source, shape, s: TargetScheme, native, prefer_groups: tuple[int, ...] = ()) -> Decision:
    """mistral.rs' HQQ: hqq's axis-0 layout (a group is a column of W.reshape(group, -1)), scales and zeros
    [1, numel/group] in the source's compute dtype."""
    p = src if isinstance(src, GridParams) else None
    in_features = shape[-1]
    layout = None
    if p is not None and p.axis == 0 and p.row_idx is None and p.bits <= s.bits:
        # the compact [1, M] meta of an hqq layout of this grid, the source's own group size first
        layout = axis0_compact(p.scales, p.zeros, tuple(shape), s.bits, prefer_groups)
    if layout is not None:
        store = p.compute_dtype if p.compute_dtype in (torch.float32, torch.float16, torch.bfloat16) else torch.float32
        keep = dict(group_size=layout[0], meta_dtype=store, keeps_codes=True)
        if store == p.scales.dtype or (torch.equal(p.scales.to(store).to(p.scales.dtype), p.scales)
                                       and torch.equal(p.zeros.to(store).to(p.zeros.dtype), p.zeros)):
            return Decision(EXACT, f"codes, scales and zeros kept (axis 0, group {layout[0]}, {str(store)[6:]})", **keep)
        return Decision(NEAR_EXACT, f"codes kept; scales and zeros round to {str(store)[6:]}", **keep)
    gs = s.group
    if shape[0] * in_features % gs:  # hqq's W.reshape(gs, -1): the element count must divide (not the rows)
        return Decision(REFUSED, f"the {shape[0]}x{in_features} weight is not whole HQQ axis-0 groups of {gs}")
    if p is None:
        why = f"dense {src} weights quantized with HQQ (axis 0, group {gs})"
    elif p.axis == 1 and p.zeros.is_floating_point() and p.mins is None:
        why = "HQQ axis-1 groups run along the input features; mistral.rs' HQQ holds axis 0 only"
    else:
        why = "mistral.rs' HQQ groups run down strided output rows (axis 0)"
    return Decision(REQUANTIZE, why, group_size=gs)


def _codebook(src: Source, shape, s: TargetScheme, native, prefer_groups=()) -> Decision:
    """Codebook targets no grid keeps its codes in (mistral.rs' F8Q8)."""
    if s.block and shape[-1] % s.block:
        return Decision(REFUSED, f"rows of {shape[-1]} are not whole {s.name.upper()} blocks of {s.block}")
    return Decision(REQUANTIZE, f"{s.name} has no integer grid; weights are quantized with mistral.rs' {s.name} rule")


register_family("afq", _afq)
register_family("hqq-axis0", _hqq_axis0)
register_family("codebook", _codebook)



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
