"""The alignment checker: can a target type hold a source tensor, and at what cost?

Verdicts, per tensor:
- `exact`: the target decodes to the source dequantization bit for bit (float32).
- `near-exact`: the codes are kept; only stored float values round once to the target's float format
  (Q4_1's fp16 min, an fp16 copy of float weights). The report gives the measured error.
- `requantize`: the target grid cannot hold the source grid (bit width, group size, act-order scatter,
  zero points); the tensor is dequantized and quantized again with the target format's own quantizer.
  Lossy, allowed only with --allow-requant; the report gives the measured error.
- `refused`: the target cannot hold the tensor at all (a row that is not a whole number of blocks).

Decisions come from the data that the source carries (zero points, act-order index, scales), not only
from its config: an act-order index whose 32-blocks each fall inside one group still aligns.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch

from ..kernels.ggml_layouts import BlockLayout
from .records import GridParams

__all__ = ["EXACT", "NEAR_EXACT", "REQUANTIZE", "REFUSED", "VERDICTS", "Verdict",
           "check_grid_to_blocks", "check_dense_to_float", "check_grid_to_float", "fp16_exact",
           "describe_grid"]

EXACT = "exact"
NEAR_EXACT = "near-exact"
REQUANTIZE = "requantize"
REFUSED = "refused"
VERDICTS = (EXACT, NEAR_EXACT, REQUANTIZE, REFUSED)

_FLOAT_DTYPES = {"F32": torch.float32, "F16": torch.float16, "BF16": torch.bfloat16}


@dataclass(frozen=True)
class Verdict:
    verdict: str
    reason: str = ""

    @property
    def lossless(self) -> bool:
        return self.verdict == EXACT


def describe_grid(p: GridParams, in_features: int) -> str:
    sym = "sym" if p.symmetric else ("asym" if p.integer_zeros else "float-zero")
    group = "per-channel" if p.n_groups == 1 else f"g{p.group_size}"
    act = "" if p.contiguous_groups(in_features) else " act-order"
    axis = "" if p.axis == 1 else f" axis {p.axis}"
    return f"{p.bits}-bit {group} {sym}{act}{axis}"


def fp16_exact(x: torch.Tensor) -> bool:
    """True when every value survives a round trip through fp16 unchanged."""
    xf = x.to(torch.float32)
    return bool(torch.equal(xf.to(torch.float16).to(torch.float32), xf))


def check_grid_to_blocks(p: GridParams, shape: tuple[int, ...], lay: BlockLayout) -> Verdict:
    """Can a ggml legacy block type (32-element blocks, fp16 params) hold this grid?"""
    out_features, in_features = shape
    if in_features % lay.block:
        return Verdict(REFUSED, f"rows of {in_features} are not a whole number of {lay.name} blocks of {lay.block}")
    if lay.kind == "k":
        return Verdict(REQUANTIZE, f"{lay.name} sub-block scales are quantized; the grid's scales are not kept")
    if p.bits > lay.bits:
        return Verdict(REQUANTIZE, f"{p.bits}-bit codes do not fit {lay.name}'s {lay.bits} bits")
    if p.axis != 1:
        return Verdict(REQUANTIZE, f"axis-{p.axis} groups run down strided output rows; {lay.name} blocks run "
                                   "along the input features")
    if not p.blocks_within_groups(in_features, lay.block):
        return Verdict(REQUANTIZE, f"groups (act-order or size {p.group_size}) do not cover whole {lay.block}-blocks")
    scales_fp16 = fp16_exact(p.scales)
    if not scales_fp16 and not lay.has_min:
        return Verdict(REQUANTIZE, "scales are not representable in fp16")
    if p.compute_dtype != torch.float32:
        return Verdict(NEAR_EXACT if lay.has_min else REQUANTIZE,
                       f"the source dequantizes in {str(p.compute_dtype)[6:]}; {lay.name} decodes in float32")
    if lay.has_min:
        # d = s, m = -s*z (or the source's own min): the codes stay; d and m round to fp16
        if not scales_fp16:
            return Verdict(NEAR_EXACT, "codes kept; scales and block min -s*z round to fp16")
        if p.mins is None and torch.is_floating_point(p.zeros) and not torch.equal(p.zeros, p.zeros.round()):
            # a fractional zero: (q - z) * s and d*q + m round at different steps, even with m exact
            return Verdict(NEAR_EXACT, "codes kept; float zero point becomes block min -s*z (fp16, rounds)")
        mins = p.mins.to(torch.float32) if p.mins is not None else -(p.scales.to(torch.float32) * p.zeros.to(torch.float32))
        if fp16_exact(mins):
            return Verdict(EXACT, "codes kept; block min -s*z is exact in fp16")
        return Verdict(NEAR_EXACT, "codes kept; block min -s*z rounds to fp16")
    # symmetric block types: value = d * (q' - offset) with q' = q - z + offset
    if not p.integer_zeros:
        return Verdict(REQUANTIZE, f"float zero points cannot be expressed in {lay.name} (no block min)")
    lo = 0 if not lay.signed_codes else -(1 << (lay.bits - 1))
    hi = lay.code_max if not lay.signed_codes else (1 << (lay.bits - 1)) - 1
    z = p.zeros.to(torch.int64)
    shifted_lo = lay.offset - z  # code 0
    shifted_hi = (1 << p.bits) - 1 - z + lay.offset  # largest code
    if bool((shifted_lo < lo).any()) or bool((shifted_hi > hi).any()):
        return Verdict(REQUANTIZE, f"zero points do not sit where {lay.name} puts its zero (codes would leave its range)")
    return Verdict(EXACT, "codes and fp16 scales kept")


def check_grid_to_float(p: GridParams, target: str) -> Verdict:
    if target == "F32" and p.integer_zeros:
        return Verdict(EXACT, "dequantized in float32, which holds every grid value exactly")
    if target == "F32":
        return Verdict(EXACT, "dequantized in float32")
    return Verdict(NEAR_EXACT, f"dequantized weights round once to {target.lower()}")


def check_dense_to_float(src_dtype: str, target: str) -> Verdict:
    src = getattr(torch, src_dtype, None)
    dst = _FLOAT_DTYPES[target]
    if src == dst:
        return Verdict(EXACT, "copied")
    widening = {(torch.float16, torch.float32), (torch.bfloat16, torch.float32)}
    if (src, dst) in widening:
        return Verdict(EXACT, f"{src_dtype} widens to {target.lower()} exactly")
    return Verdict(NEAR_EXACT, f"{src_dtype} rounds to {target.lower()}")
