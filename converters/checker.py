"""The alignment contract: can a target type hold a source tensor, and at what cost? Decided here only.

Verdicts, per tensor:
- `exact`: the target decodes to the source dequantization bit for bit (float32).
- `near-exact`: the codes are kept; only stored float values round once to the target's float format
  (Q4_1's fp16 min, an fp16 copy of float weights). The report gives the measured error.
- `requantize`: the target grid cannot hold the source grid (bit width, group size, act-order scatter,
  zero points); the tensor is dequantized and quantized again with the target format's own quantizer.
  Lossy, allowed only with --allow-requant; the report gives the measured error.
- `refused`: the target cannot hold the tensor at all (a row that is not a whole number of blocks).

Every writable type of every format is a `TargetScheme` (data, declared once in its format's table:
formats/gguf/schemes.py, formats/uqff/schemes.py, formats/gptq.py). `check(source, shape, scheme)` returns
a `Decision` (verdict, reason, how many blocks keep their codes, the facts a writer needs to keep them);
`best_aligned(source, shape, schemes)` is the one search for the cheapest scheme that holds a grid.
Writers read Decisions, never reason text; their quirks (llama-quantize's K fallback, mistral.rs'
dtype rule) are small hooks beside their tables.

Decisions come from the data that the source carries (zero points, act-order index, scales), not only
from its config: an act-order index whose 32-blocks each fall inside one group still aligns.

Two source kinds are decided once in check(), before or after the family handler: a codebook grid
(bitsandbytes NF4/FP4: table values, not s * (q - z)) is requantized by every target that stores integer
codes, with the reason saying so; a grid with two-step scales (bitsandbytes LLM.int8) is never `exact` in a
target that stores one scale (at best `near-exact`).
"""

from __future__ import annotations

from dataclasses import dataclass, field, replace
from typing import Callable, Iterable, Union

import torch

from ..kernels.ggml.layouts import LAYOUTS, BlockLayout
from .records import GridParams, describe_grid

__all__ = ["EXACT", "NEAR_EXACT", "REQUANTIZE", "REFUSED", "VERDICTS", "Verdict", "Decision", "TargetScheme",
           "FAMILIES", "check", "decide", "best_aligned", "register_family", "ggml_scheme", "float_scheme", "check_grid_to_blocks",
           "check_dense_to_float", "check_grid_to_float", "fp16_exact", "describe_grid"]

class Verdict:
    """The four verdicts, as plans, reports and their JSON carry them (plain strings, best first)."""

    EXACT = "exact"
    NEAR_EXACT = "near-exact"
    REQUANTIZE = "requantize"
    REFUSED = "refused"
    ALL = (EXACT, NEAR_EXACT, REQUANTIZE, REFUSED)


EXACT, NEAR_EXACT, REQUANTIZE, REFUSED = Verdict.ALL
VERDICTS = Verdict.ALL

_FLOAT_DTYPES = {"F32": torch.float32, "F16": torch.float16, "BF16": torch.bfloat16}
_LAYOUT_OF_ID = {lay.ggml_type: lay for lay in LAYOUTS.values()}

# how the checker reads a scheme: one handler per family (_HANDLERS at the end; formats may add theirs)
FAMILIES = ("float", "ggml", "gptq", "afq", "hqq-axis0", "codebook", "float-block")


@dataclass(frozen=True)
class TargetScheme:
    """One writable target type, as data. `name` is the type as its format spells it ("Q4_0", "afq4").

    zero: "none" (symmetric: codes decode as d * (q - offset)), "int" (an integer zero point per group),
          "min" (a float block min: d * q + m), "float" (HQQ's float zero point).
    scale: how scales are stored: "fp16", "bf16", "fp32", "k6" (6-bit sub-block scales under an fp16
           super-scale), "k8" (8-bit, Q6_K), "source" (in the source's own dtype), "e8m0", "e4m3"...
    group: elements sharing one scale along a row (0: the target keeps the source's group size;
           for K types the sub-block); block: elements per stored block (ggml: 32 or 256).
    """

    name: str
    family: str
    bits: int = 0  # bits per code (0: the source's); float targets: bits per element
    group: int = 0
    block: int = 0
    zero: str = "none"
    scale: str = "fp16"
    offset: int = 0  # symmetric codes decode as d * (q - offset)
    signed: bool = False  # codes stored as signed integers (Q8_0's int8)
    axis: int = 1  # 1: groups along the input features; 0: HQQ's strided output rows
    act_order: bool = False  # an act-order index (g_idx) can be stored
    code_bits: tuple[int, ...] = ()  # bit widths the target stores (empty: only `bits`)
    groups: tuple[int, ...] = ()  # group sizes the target may choose from, largest first (AFQ)
    dtype: torch.dtype | None = None  # float targets
    ggml_type: int | None = None  # gguf.GGMLQuantizationType value
    block_bytes: int = 0  # bytes per block (ggml: gguf-py's GGML_QUANT_SIZES)
    note: str = ""  # what the runtime needs to know, appended to every reason (mistral.rs' run dtype)
    element: str = ""  # float-block targets: the element format of the codes ("e2m1", "e4m3")
    # float-block targets: a float32 scale per tensor beside the block scales (NVFP4), and how it applies, as
    # GridParams.global_scale_op: "post" (llama.cpp's `.scale`, after the block product), "div" (compressed-
    # tensors' weight_global_scale divides the block scale), "mul"; "" for none
    tensor_scale: str = ""

    def __post_init__(self):
        if self.family not in _HANDLERS:
            raise ValueError(f"unknown scheme family {self.family!r} (register_family first)")

    @property
    def layout(self) -> BlockLayout:
        """The ggml block layout of a "ggml" scheme (found by type id: the scheme's name is its format's)."""
        return _LAYOUT_OF_ID[self.ggml_type]


@dataclass(frozen=True)
class Decision:
    """What the checker decided for one tensor and one target scheme."""

    verdict: str
    reason: str
    scheme: str = ""  # the scheme's name
    kept_blocks: int | None = None  # K types: super-blocks that keep the grid's codes
    total_blocks: int | None = None
    copied: bool = False  # the source's own packed bytes are the target's (same ggml type)
    group_size: int | None = None  # the group the target stores (AFQ, HQQ axis 0), when it chose one
    meta_dtype: torch.dtype | None = None  # HQQ axis 0: the dtype scales and zeros are stored in
    keeps_codes: bool = False  # the target is written from the source's codes (not requantized)
    facts: dict = field(default_factory=dict)  # anything else a handler measured (read-only by convention)
    fallback: str = ""  # the type stored instead of the one asked for (a K type on rows of no whole 256-blocks)
    alternative: tuple[str, str] | None = None  # (scheme, verdict) that would hold the grid, when this does not

    @property
    def lossless(self) -> bool:
        return self.verdict == EXACT

    def with_reason(self, prefix: str = "", suffix: str = "") -> "Decision":
        return replace(self, reason=prefix + self.reason + suffix)


Source = Union[GridParams, str]  # a grid's parameters, or a dense tensor's torch dtype name ("float16")


def fp16_exact(x: torch.Tensor) -> bool:
    """True when every value survives a round trip through fp16 unchanged."""
    xf = x.to(torch.float32)
    return bool(torch.equal(xf.to(torch.float16).to(torch.float32), xf))


def float_scheme(name: str, note: str = "", scheme_name: str | None = None) -> TargetScheme:
    """F32 / F16 / BF16 as a target."""
    return TargetScheme(scheme_name or name, "float", bits=torch.finfo(_FLOAT_DTYPES[name]).bits,
                        dtype=_FLOAT_DTYPES[name], note=note)


def ggml_scheme(name: str, scheme_name: str | None = None) -> TargetScheme:
    """A ggml block type as a target, from kernels.ggml_layouts (sizes from gguf-py)."""
    lay = LAYOUTS[name]
    if lay.kind == "float":
        return replace(float_scheme(name, scheme_name=scheme_name), ggml_type=lay.ggml_type, block=1,
                       block_bytes=lay.nbytes)
    zero = "min" if lay.has_min else "none"
    scale = "fp16" if lay.kind == "legacy" else ("k8" if name == "Q6_K" else "k6")
    return TargetScheme(scheme_name or name, "ggml", bits=lay.bits, group=lay.sub_block or lay.block,
                        block=lay.block, zero=zero, scale=scale, offset=lay.offset, signed=lay.signed_codes,
                        ggml_type=lay.ggml_type, block_bytes=lay.nbytes)


# --------------------------------------------------------------------------------------------------------
# the family handlers: (source, shape, scheme, native) -> Decision


def check_grid_to_float(p: GridParams, target: str) -> Decision:
    if target == "F32" and p.integer_zeros:
        return Decision(EXACT, "dequantized in float32, which holds every grid value exactly")
    if target == "F32":
        return Decision(EXACT, "dequantized in float32")
    return Decision(NEAR_EXACT, f"dequantized weights round once to {target.lower()}")


def check_dense_to_float(src_dtype: str, target: str) -> Decision:
    src = getattr(torch, src_dtype, None)
    dst = _FLOAT_DTYPES[target]
    if src == dst:
        return Decision(EXACT, "copied")
    widening = {(torch.float16, torch.float32), (torch.bfloat16, torch.float32)}
    if (src, dst) in widening:
        return Decision(EXACT, f"{src_dtype} widens to {target.lower()} exactly")
    return Decision(NEAR_EXACT, f"{src_dtype} rounds to {target.lower()}")


def _float(src: Source, shape, s: TargetScheme, native, prefer_groups=()) -> Decision:
    target = {torch.float32: "F32", torch.float16: "F16", torch.bfloat16: "BF16"}[s.dtype]
    if isinstance(src, GridParams):
        return check_grid_to_float(src, target)
    return check_dense_to_float(src, target)


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
    (kernels/kquant_grid.py); None when no block can (then the generic K verdict applies)."""
    from ..kernels.ggml.kquant_grid import plan_kept_blocks

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
    lay = s.layout
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
    from ..kernels.hqq import axis0_compact

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


def _float_block(src: Source, shape, s: TargetScheme, native, prefer_groups=()) -> Decision:
    """Float-block targets (GGUF MXFP4 / NVFP4, UQFF MXFP4 / FP8): codes of a float element format (`s.element`)
    times a scale per `s.group` elements of a row (group 0: one scale for the whole tensor; rows are whole
    `s.block`s, the stored block), stored as
    `s.scale` ("e8m0": a power of two; "ue4m3": an unsigned E4M3 value; "fp32"). A float grid of the same
    element format keeps its codes where every target block lies inside one source group and the target's
    scale format holds the source's scale exactly; anything else is dequantized and quantized again with
    the target's own quantizer. The verdicts are decided from the scale values, not from the source's name:
    an NVFP4 grid whose scales happen to be powers of two fits MXFP4's exponents."""
    from ..kernels.floatq import e4m3_exact, is_e8m0_exact
    from .records import codebook_name

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
    # the per-group scale a target without a tensor scale stores
    eff = p.effective_scales() if (s.scale == "ue4m3" and s.tensor_scale) else p.folded_scales()
    if s.group and p.group_size % s.group:
        return Decision(REQUANTIZE, f"scale groups of {p.group_size} do not cover whole {s.group}-element scale "
                                    "blocks" + requant)
    if not s.group and not bool((eff == eff.reshape(-1)[0]).all()):
        return Decision(REQUANTIZE, f"the source scales blocks or channels apart; {s.name} stores one scale per "
                                    "tensor" + requant)
    keep = dict(keeps_codes=True)
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


# family -> handler(source, shape, scheme, native, prefer_groups) -> Decision. A format whose targets follow
# rules no built-in family knows (hqq's own packings) registers its handler here with register_family:
# check() stays the one entry point and a Decision the one answer.
_HANDLERS: dict[str, Callable[..., Decision]] = {
    "float": _float, "ggml": _ggml, "gptq": _gptq, "afq": _afq, "hqq-axis0": _hqq_axis0, "codebook": _codebook,
    "float-block": _float_block,
}
# families whose handlers decide codebook sources themselves (float targets, float-block targets; a format's own
# registered with register_family(..., takes_codebooks=True))
_TAKES_CODEBOOKS = {"float", "float-block"}


def _codebook_source(p: GridParams, shape: tuple[int, ...], s: TargetScheme, prefer_groups) -> Decision:
    """A codebook grid (bitsandbytes NF4/FP4) into any target that stores integer-grid codes: its values are
    table entries, not s * (q - z), so no target keeps the codes. The target decides as for dense float32
    weights (a row that is not whole blocks is still refused; AFQ / HQQ still choose their group), and the
    reason says why the codes could not stay."""
    dense = _HANDLERS[s.family]("float32", shape, s, None, prefer_groups)
    if dense.verdict == REFUSED:
        return dense
    if p.element is not None:
        why = f"{p.element} float codes are not a uniform grid"
    else:
        why = f"a {2 ** p.bits}-value codebook is not a uniform grid"
    if s.name.upper().startswith("IQ4") and p.element is None:
        why += f" ({s.name.upper()}'s 16 values are a different codebook)"
    return replace(dense, verdict=REQUANTIZE, reason=f"{why}; weights are dequantized and quantized again "
                                                      f"with {s.name}'s quantizer", keeps_codes=False,
                   kept_blocks=None, copied=False)


def register_family(name: str, handler: Callable[..., Decision], takes_codebooks: bool = False) -> None:
    """Add a scheme family. `takes_codebooks`: its handler decides codebook (and float) grids itself; otherwise
    check() decides them as codebooks no integer target holds."""
    if _HANDLERS.get(name, handler) is not handler:
        raise ValueError(f"scheme family {name!r} is already registered")
    _HANDLERS[name] = handler
    if takes_codebooks:
        _TAKES_CODEBOOKS.add(name)


def check(source: Source, shape: tuple[int, ...], scheme: TargetScheme, *, native: str | None = None,
          prefer_groups: tuple[int, ...] = ()) -> Decision:
    """The verdict for storing a tensor (a grid's parameters, or a dense dtype name) as `scheme`.

    native: the name of the source's own packed type when it has one the target may copy (a GGUF grid's
    ggml type); prefer_groups: the source's own group sizes, tried first where the target chooses one."""
    shape = tuple(shape)
    if isinstance(source, GridParams) and source.codebook is not None and scheme.family not in _TAKES_CODEBOOKS:
        d = _codebook_source(source, shape, scheme, tuple(prefer_groups))
    else:
        d = _HANDLERS[scheme.family](source, shape, scheme, native, tuple(prefer_groups))
    if isinstance(source, GridParams) and source.scale_steps is not None and d.verdict == EXACT \
            and scheme.family != "float":
        # the source rounds twice ((q * a) * c); any target stores one scale fl(a * c): within an ulp, not exact
        d = replace(d, verdict=NEAR_EXACT, reason=d.reason + " (the source's two-step scale becomes one)")
    d = replace(d, scheme=scheme.name)
    return d.with_reason(suffix=scheme.note) if scheme.note else d


def decide(source: Source, shape: tuple[int, ...], scheme: TargetScheme, candidates: Iterable[TargetScheme] = (),
           *, native: str | None = None, prefer_groups: tuple[int, ...] = (), fallback: str = "") -> Decision:
    """check(), and for a grid the target cannot hold as it is (requantize, refused) the cheapest of
    `candidates` that can: the aligned alternative a refusal proposes."""
    d = check(source, shape, scheme, native=native, prefer_groups=prefer_groups)
    if fallback:
        d = replace(d, fallback=fallback)
    if d.verdict in (REQUANTIZE, REFUSED) and isinstance(source, GridParams) and candidates:
        best = best_aligned(source, shape, candidates, native=native, prefer_groups=prefer_groups)
        if best is not None:
            d = replace(d, alternative=(best[0].name, best[1].verdict))
    return d


def best_aligned(source: GridParams, shape: tuple[int, ...], schemes: Iterable[TargetScheme], *,
                 native: str | None = None, prefer_groups: tuple[int, ...] = ()
                 ) -> tuple[TargetScheme, Decision] | None:
    """The first scheme (cheapest first, as the table orders them) that holds the grid exactly, else the
    first that holds it near-exactly; None when none does."""
    decided = [(s, check(source, shape, s, native=native, prefer_groups=prefer_groups)) for s in schemes]
    for wanted in (EXACT, NEAR_EXACT):
        for s, d in decided:
            if d.verdict == wanted:
                return s, d
    return None
