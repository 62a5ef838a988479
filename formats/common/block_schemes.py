"""The checker's rules for block formats that GGUF and UQFF share, registered as two families:

- `ggml`: ggml's integer block types (legacy Q4_0..Q8_0 with fp16 block parameters, K types with quantized
  sub-block scales), whose layouts come from kernels/ggml/layouts.py (sizes from gguf-py);
- `float-block`: codes of a float element format under a scale per block (GGUF MXFP4 / NVFP4, UQFF mxfp4 /
  fp8, compressed-tensors' mxfp4 / nvfp4), decided from the scale values.

`ggml_scheme(name)` makes the TargetScheme of a ggml type; `block_layout(scheme)` finds its layout again."""

from __future__ import annotations

from dataclasses import replace

import torch

from ...converters.checker import (EXACT, NEAR_EXACT, REFUSED, REQUANTIZE, Decision, Source, TargetScheme,
                                   float_scheme, fp16_exact, register_family)
from ...converters.records import GridParams, codebook_name
from ...kernels.floatq import e4m3_exact, is_e8m0_exact
from ...kernels.ggml.kquant_grid import plan_kept_blocks
from ...kernels.ggml.layouts import LAYOUTS, BlockLayout

__all__ = ["ggml_scheme", "block_layout", "check_grid_to_blocks"]

_LAYOUT_OF_ID = {lay.ggml_type: lay for lay in LAYOUTS.values()}


def block_layout(scheme: TargetScheme) -> BlockLayout:
    """The ggml block layout of a "ggml" scheme (found by type id: the scheme's name is its format's)."""
    return _LAYOUT_OF_ID[scheme.ggml_type]


def ggml_scheme(name: str, scheme_name: str | None = None) -> TargetScheme:
    """A ggml block type as a target, from kernels.ggml.layouts (sizes from gguf-py)."""
    lay = LAYOUTS[name]
    if lay.kind == "float":
        return replace(float_scheme(name, scheme_name=scheme_name), ggml_type=lay.ggml_type, block=1,
                       block_bytes=lay.nbytes)
    zero = "min" if lay.has_min else "none"
    scale = "fp16" if lay.kind == "legacy" else ("k8" if name == "Q6_K" else "k6")
    return TargetScheme(scheme_name or name, "ggml", bits=lay.bits, group=lay.sub_block or lay.block,
                        block=lay.block, zero=zero, scale=scale, offset=lay.offset, signed=lay.signed_codes,
                        ggml_type=lay.ggml_type, block_bytes=lay.nbytes)


def check_grid_to_blocks(p: GridParams, shape: tuple[int, ...], lay: BlockLayout) -> Decision:
    """Can a ggml block type (fp16 params per 32-block; K types: quantized sub-block scales) hold this grid?"""
    out_features, in_features = shape
    if in_features % lay.block:
        return Decision(REFUSED, f"rows of {in_features} are not a whole number of {lay.name} blocks of {lay.block}")
    if lay.kind == "k":
        return Decision(REQUANTIZE, f"{lay.name} sub-block scales are quantized; the grid's scales are not kept")
    if p.bits > lay.bits:
        return Decision(REQUANTIZE, f"{p.bits}-bit codes do not fit {lay.name}'s {lay.bits} bits")
    if p.axis != 1:
        return Decision(REQUANTIZE, f"axis-{p.axis} groups run down strided output rows; {lay.name} blocks run "
                                    "along the input features")
    if not p.blocks_within_groups(in_features, lay.block):
        return Decision(REQUANTIZE, f"groups (act-order or size {p.group_size}) do not cover whole {lay.block}-blocks")
    keep = dict(keeps_codes=True)
    scales_fp16 = fp16_exact(p.scales)
    if p.scale_steps is not None and not lay.has_min and p.integer_zeros and _zeros_fit(p, lay):
        # LLM.int8: the codes fit as they are; only the row scale SCB/127 becomes one fp16 block scale
        return Decision(NEAR_EXACT, "codes kept; the row scale (two float32 steps in the source) rounds to "
                                    "fp16", **keep)
    if not scales_fp16 and not lay.has_min:
        return Decision(REQUANTIZE, "scales are not representable in fp16")
    rounds_in = str(p.compute_dtype)[6:] if p.compute_dtype != torch.float32 else ""
    if rounds_in:
        if lay.has_min:
            return Decision(NEAR_EXACT, f"the source dequantizes in {rounds_in}; {lay.name} decodes in float32", **keep)
        if not p.integer_zeros:
            return Decision(REQUANTIZE, f"the source dequantizes in {rounds_in}; {lay.name} decodes in float32")
        # integer zeros (AWQ): the source's value is the exact product s * (q - z) rounded once to its dtype, which
        # a symmetric block type holds unrounded when the zero sits at its offset (below): the codes stay
    if lay.has_min:
        # d = s, m = -s*z (or the source's own min): the codes stay; d and m round to fp16
        if not scales_fp16:
            return Decision(NEAR_EXACT, "codes kept; scales and block min -s*z round to fp16", **keep)
        if p.mins is None and torch.is_floating_point(p.zeros) and not torch.equal(p.zeros, p.zeros.round()):
            # a fractional zero: (q - z) * s and d*q + m round at different steps, even with m exact
            return Decision(NEAR_EXACT, "codes kept; float zero point becomes block min -s*z (fp16, rounds)", **keep)
        mins = p.mins.to(torch.float32) if p.mins is not None else -(p.scales.to(torch.float32) * p.zeros.to(torch.float32))
        if fp16_exact(mins):
            return Decision(EXACT, "codes kept; block min -s*z is exact in fp16", **keep)
        return Decision(NEAR_EXACT, "codes kept; block min -s*z rounds to fp16", **keep)
    # symmetric block types: value = d * (q' - offset) with q' = q - z + offset
    if not p.integer_zeros:
        return Decision(REQUANTIZE, f"float zero points cannot be expressed in {lay.name} (no block min)")
    if not _zeros_fit(p, lay):
        return Decision(REQUANTIZE, f"zero points do not sit where {lay.name} puts its zero (codes would leave its range)")
    if rounds_in:
        return Decision(NEAR_EXACT, f"codes and fp16 scales kept; the source rounds each value to {rounds_in}, "
                                    f"{lay.name} decodes the exact product in float32", **keep)
    return Decision(EXACT, "codes and fp16 scales kept", **keep)


def _zeros_fit(p: GridParams, lay: BlockLayout) -> bool:
    """A symmetric block type decodes d * (q' - offset), q' = q - z + offset: do all codes stay in its range?"""
    lo = 0 if not lay.signed_codes else -(1 << (lay.bits - 1))
    hi = lay.code_max if not lay.signed_codes else (1 << (lay.bits - 1)) - 1
    z = p.zeros.to(torch.int64)
    shifted_lo = lay.offset - z  # code 0
    shifted_hi = (1 << p.bits) - 1 - z + lay.offset  # largest code
    return not (bool((shifted_lo < lo).any()) or bool((shifted_hi > hi).any()))


def _kept_k_blocks(p: GridParams, shape, name: str) -> Decision | None:
    """Grid -> Q4_K/Q5_K: how many 256-super-blocks can hold the grid's codes and scales exactly
    (kernels/ggml/kquant_grid.py); None when no block can (then the generic K verdict applies)."""

    fit = plan_kept_blocks(p, shape, name)
    if fit is None:
        return None
    kept, total = int(fit[0].sum()), int(fit[0].size)
    counts = dict(kept_blocks=kept, total_blocks=total, keeps_codes=kept > 0)
    if kept == total:
        return Decision(EXACT, f"{kept} of {total} blocks kept their codes ({name}'s 6-bit sub-block scales "
                               "hold the grid's scales exactly)", **counts)
    return Decision(REQUANTIZE, f"{kept} of {total} blocks kept their codes; the other {total - kept} are "
                                f"requantized with {name}'s quantizer", **counts)


def _ggml(src: Source, shape, s: TargetScheme, native, prefer_groups=()) -> Decision:
    lay = block_layout(s)
    if native == lay.name:
        return Decision(EXACT, f"{lay.name} blocks copied byte for byte", copied=True, keeps_codes=True)
    if not isinstance(src, GridParams):
        if shape[-1] % lay.block:
            return Decision(REFUSED, f"rows of {shape[-1]} are not a whole number of {lay.name} blocks of {lay.block}")
        return Decision(REQUANTIZE, f"dense {src} weights quantized with {lay.name}'s quantizer")
    if lay.kind == "k" and shape[-1] % lay.block == 0:
        kept = _kept_k_blocks(src, shape, lay.name)
        if kept is not None:
            return kept
    return check_grid_to_blocks(src, shape, lay)


def _float_block(src: Source, shape, s: TargetScheme, native, prefer_groups=()) -> Decision:
    """Float-block targets (GGUF MXFP4 / NVFP4, UQFF MXFP4 / FP8): codes of a float element format (`s.element`)
    times a scale per `s.group` elements of a row (group 0: one scale for the whole tensor; rows are whole
    `s.block`s, the stored block), stored as
    `s.scale` ("e8m0": a power of two; "ue4m3": an unsigned E4M3 value; "fp32"). A float grid of the same
    element format keeps its codes where every target block lies inside one source group and the target's
    scale format holds the source's scale exactly; anything else is dequantized and quantized again with
    the target's own quantizer. The verdicts are decided from the scale values, not from the source's name:
    an NVFP4 grid whose scales happen to be powers of two fits MXFP4's exponents."""

    in_f = shape[-1]
    if s.block and in_f % s.block:
        return Decision(REFUSED, f"rows of {in_f} are not whole {s.name.upper()} blocks of {s.block}")
    if native == s.name:
        return Decision(EXACT, f"{s.name} blocks copied byte for byte", copied=True, keeps_codes=True)
    if not isinstance(src, GridParams):
        return Decision(REQUANTIZE, f"dense {src} weights quantized with {s.name}'s quantizer")
    p = src
    requant = f"; dequantized and quantized with {s.name}'s quantizer"
    if p.element != s.element:
        what = (f"{p.element} codes" if p.element else "integer grid codes" if p.codebook is None
                else f"{codebook_name(p.codebook)} codebook codes")
        return Decision(REQUANTIZE, f"{what} are not {s.element} values" + requant)
    if p.axis != 1 or not p.contiguous_groups(in_f):
        return Decision(REQUANTIZE, "the source's scale groups do not run along the rows" + requant)
    if s.group and p.group_size % s.group:
        return Decision(REQUANTIZE, f"scale groups of {p.group_size} do not cover whole {s.group}-element scale "
                                    "blocks" + requant)
    keep = dict(keeps_codes=True)
    if s.scale == "e8m0" and s.group and p.scales.dtype == torch.float8_e8m0fnu and p.global_scale is None:
        # E8M0 bytes already (MXFP4 sources): every byte but NaN's 0xFF is a power of two an exponent holds, which
        # is is_e8m0_exact's answer without a float32 copy of a giant's scales
        if bool((p.scales.view(torch.uint8) == 0xFF).any()):
            return Decision(REQUANTIZE, "block scales are not powers of two, which E8M0 exponents hold" + requant)
        return Decision(EXACT, "codes and block scales kept (E8M0 exponents)", **keep)
    # the per-group scale a target without a tensor scale stores
    eff = p.effective_scales() if (s.scale == "ue4m3" and s.tensor_scale) else p.folded_scales()
    if not s.group and not bool((eff == eff.reshape(-1)[0]).all()):
        return Decision(REQUANTIZE, f"the source scales blocks or channels apart; {s.name} stores one scale per "
                                    "tensor" + requant)
    if s.scale == "e8m0":
        if not bool(is_e8m0_exact(eff).all()):
            return Decision(REQUANTIZE, "block scales are not powers of two, which E8M0 exponents hold" + requant)
        return Decision(EXACT, "codes and block scales kept (E8M0 exponents)", **keep)
    if s.scale == "ue4m3":
        block = p.scales.to(torch.float32) if (p.global_scale is not None and s.tensor_scale) else eff
        if not bool((e4m3_exact(block) & (block >= 0)).all()):
            return Decision(REQUANTIZE, "block scales are not non-negative E4M3 values" + requant)
        if p.global_scale is not None and s.tensor_scale:
            if p.global_scale_op == s.tensor_scale:
                return Decision(EXACT, "codes, E4M3 block scales and the global scale kept", **keep)
            inverse = (p.global_scale_op == "div") != (s.tensor_scale == "div")
            how = "its float32 reciprocal" if inverse else "the source's value"
            when = {"post": "after the block product", "div": "dividing the block scale first",
                    "mul": "multiplying the block scale first"}[s.tensor_scale]
            return Decision(NEAR_EXACT, f"codes and E4M3 block scales kept; the global scale is stored as {how}, "
                                        f"applied {when}: a float32 rounding apart from the source's order",
                            **keep)
        return Decision(EXACT, "codes and E4M3 block scales kept", **keep)
    if p.post_scale is not None:
        return Decision(NEAR_EXACT, f"codes kept; one {s.scale} scale (the source multiplies its global scale "
                                    "after the product)", **keep)
    return Decision(EXACT, f"codes kept; one {s.scale} scale", **keep)


register_family("ggml", _ggml)
register_family("float-block", _float_block, takes_codebooks=True)
