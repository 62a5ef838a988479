"""The MLX target types as alignment schemes, and the "mlx" family handler that decides them.

An mlx-lm quantized linear stores, per output row, groups of 32/64/128 codes along the input features with
one scale and one bias per group, W = scales * q + biases (mlx's "affine" mode), scales and biases in the
model's dtype. mlx dequantizes in that dtype, rounding twice: fp(fp(s*q) + b) (measured bit for bit against
mx.dequantize and mx.quantized_matmul, mlx 0.32.4 CPU, fp16/bf16/fp32). So the handler decides:

- exact: the codes are kept and mlx's arithmetic is the source's own (a min-form source that dequantizes
  in the stored dtype with representable scales and mins: an mlx or Q4_1-in-float32 source), or float32
  storage of an integer-zero grid whose scales have at most 11 significant bits (s*q, s*z and s*(q-z) are
  then all exact in float32);
- near-exact: the codes are kept, scales kept and bias = -s*z rounded once to the stored dtype; the decoded
  values round in the stored dtype (the runner measures the error, and calls it exact when it is 0);
- requantize: the grid does not map onto mlx groups (act-order scatter across a group, axis 0, wider codes
  than asked for), or the source is dense: mlx's own affine rule (mx.quantize) is applied;
- refused: a row is not a whole number of the smallest mlx group, or its codes do not fill uint32 words.
"""

from __future__ import annotations

import re

import torch

from ...converters.checker import EXACT, NEAR_EXACT, REFUSED, REQUANTIZE, Decision, TargetScheme, register_family
from ...converters.errors import QConvertError
from ...converters.records import GridParams
from ..common import block_schemes  # noqa: F401  (registers the float-block family MLX_MXFP4 is decided by)
from .packing import MLX_BITS, MLX_GROUPS, packed_words

__all__ = ["FAMILY", "MLX_MXFP4", "MLX_MXFP8", "MLX_FLOAT_MODES", "MlxType", "parse_mlx_type", "mlx_scheme",
           "check_mlx", "bits_for", "TYPE_HELP"]

FAMILY = "mlx"
_DTYPE_NAMES = {torch.float16: "float16", torch.bfloat16: "bfloat16", torch.float32: "float32"}


class MlxType:
    """A parsed --type: bits, and a group size (0: chosen per tensor, the source's own first)."""

    __slots__ = ("bits", "group")

    def __init__(self, bits: int, group: int = 0):
        self.bits, self.group = bits, group

    @property
    def name(self) -> str:
        return f"mlx{self.bits}" + (f"g{self.group}" if self.group else "")


_TYPE_RE = re.compile(r"^(?:mlx[-_:]?|q|b)?(?P<bits>\d)(?:bit)?(?:[-_:]?g(?:roup)?(?P<group>\d+))?$")
TYPE_HELP = (f"mlxB or mlxBgG: bits B in {', '.join(map(str, MLX_BITS))}, group G in "
             f"{', '.join(map(str, sorted(MLX_GROUPS)))} (mlx4, mlx4g64, 8g32); without --type every grid keeps "
             "its own codes and bits, with the widest mlx group its groups allow")


def parse_mlx_type(text: str) -> MlxType:
    m = _TYPE_RE.match(text.strip().lower())
    bits = int(m["bits"]) if m else 0
    group = int(m["group"]) if m and m["group"] else 0
    if not m or bits not in MLX_BITS or (group and group not in MLX_GROUPS):
        raise QConvertError(f"unknown mlx type {text!r}; {TYPE_HELP}")
    return MlxType(bits, group)


def bits_for(source_bits: int) -> int | None:
    """The narrowest mlx width that holds `source_bits`-bit codes (7 -> 8), None above 8."""
    return next((b for b in MLX_BITS if b >= source_bits), None)


# mlx's mxfp4 mode (mlx 0.32 quantize modes): E2M1 codes with an E8M0 exponent per 32, no biases. The float-block
# family (formats/common/block_schemes.py) decides it from the scale values: an E2M1 grid whose 32-blocks' scales
# are powers of two keeps its codes and exponents; anything else is not written in this mode
MLX_MXFP4 = TargetScheme("mlx mxfp4", "float-block", bits=4, group=32, block=32, scale="e8m0", element="e2m1")
# mlx's mxfp8 mode, the same with E4M3 codes (one byte each): an OCP MXFP8 grid (compressed-tensors mxfp8-quantized,
# AMD Quark MXFP8, mlx's own) keeps its codes and exponents
MLX_MXFP8 = TargetScheme("mlx mxfp8", "float-block", bits=8, group=32, block=32, scale="e8m0", element="e4m3")
# element format -> (mlx quantize mode, its scheme): the float modes a float grid may be written in
MLX_FLOAT_MODES = {"e2m1": ("mxfp4", MLX_MXFP4), "e4m3": ("mxfp8", MLX_MXFP8)}


def mlx_scheme(bits: int, group: int, store: torch.dtype) -> TargetScheme:
    """One mlx type as data: `bits` (0: the source's own, widened to an mlx width), `group` (0: chosen),
    scales and biases stored in `store` (the model's dtype)."""
    name = f"mlx{bits or ''}" + (f"g{group}" if group else "") + f" ({_DTYPE_NAMES[store]})"
    return TargetScheme(name, FAMILY, bits=bits, group=group, zero="min", scale="source",
                        code_bits=MLX_BITS, groups=(group,) if group else MLX_GROUPS, dtype=store)


def _exact_in(x: torch.Tensor, dtype: torch.dtype) -> bool:
    xf = x.to(torch.float32)
    return bool(torch.equal(xf.to(dtype).to(torch.float32), xf))


def _overflow(p: GridParams, store: torch.dtype) -> str | None:
    """What of the grid leaves `store`'s finite range, or None: its scales, its bias -s*z (or its mins), or the
    largest value it decodes to |s| * max(|q - z|) (+ |min|), which requantizing would have to hold."""
    top = torch.finfo(store).max
    s = p.scales.to(torch.float32)
    if not bool(torch.isfinite(s).all()) or float(s.abs().max()) > top:
        return f"a scale ({float(s.abs().max()):.6g})"
    if p.mins is not None:
        lo = p.mins.to(torch.float32)
        if not bool(torch.isfinite(lo).all()) or float(lo.abs().max()) > top:
            return f"a min ({float(lo.abs().max()):.6g})"
        peak = float((s.abs() * ((1 << p.bits) - 1) + lo.abs()).max())
    elif p.codebook is not None:
        return None  # codebook grids: the table times the scale, checked by the requantizing rule
    else:
        z = p.zeros.to(torch.float32)
        bias = float((s * z).abs().max())
        if bias > top:
            return f"the bias -scale*zero ({bias:.6g})"
        peak = float((s.abs() * torch.maximum(z.abs(), ((1 << p.bits) - 1) - z).abs()).max())
    return f"the largest value ({peak:.6g})" if peak > top else None


def _group_for(p: GridParams, in_features: int, groups: tuple[int, ...], prefer: tuple[int, ...]) -> int | None:
    """The widest mlx group every one of whose runs of columns lies in one source group (an act-order index
    passes when its scatter stays inside mlx groups), the source's own group size tried first."""
    order = [g for g in prefer if g in groups] + [g for g in groups if g not in prefer]
    if p.group_size in groups and p.group_size not in order[:1]:
        order = [p.group_size] + [g for g in order if g != p.group_size]
    for g in order:
        if in_features % g == 0 and p.blocks_within_groups(in_features, g):
            return g
    return None


def _dense_group(in_features: int, s: TargetScheme) -> int | None:
    """mlx-lm's convert default group is 64 (quantize_model defaults_for_mode "affine": (64, 4))."""
    order = s.groups if s.group else (64, 128, 32)
    return next((g for g in order if in_features % g == 0), None)


def check_mlx(src, shape, s: TargetScheme, native, prefer_groups=()) -> Decision:
    in_features = shape[-1]
    store = s.dtype
    dname = _DTYPE_NAMES[store]
    p = src if isinstance(src, GridParams) else None
    bits = s.bits or (bits_for(p.bits) if p is not None else 4) or 8
    if packed_words(in_features, bits) is None or in_features % min(s.groups):
        return Decision(REFUSED, f"rows of {in_features} are not whole mlx groups of {min(s.groups)} "
                                 f"({bits}-bit codes in uint32 words)")
    if p is None:
        g = _dense_group(in_features, s)
        return Decision(REQUANTIZE, f"dense {src} weights quantized with mlx's affine rule (mx.quantize, "
                                    f"{bits}-bit, group {g})", group_size=g, facts={"bits": bits})
    requant = dict(group_size=_dense_group(in_features, s), facts={"bits": bits})
    overflow = _overflow(p, store)
    if overflow:
        # mlx stores scales and biases in the model dtype and has no other place for them; a grid whose values
        # leave that dtype's range becomes inf there, kept or requantized alike: refused at plan time, before
        # anything is written (the runner's measurement would only find the inf while writing)
        return Decision(REFUSED, f"{overflow} overflows {dname}, the model dtype mlx stores scales and biases in")
    if p.axis != 1:
        return Decision(REQUANTIZE, "axis-0 groups run down strided output rows; mlx groups run along the input "
                                    f"features (requantized with mlx's affine rule, {bits}-bit)", **requant)
    if p.bits > bits:
        return Decision(REQUANTIZE, f"{p.bits}-bit codes do not fit {bits} bits (requantized with mlx's affine "
                                    "rule)", **requant)
    g = _group_for(p, in_features, s.groups, tuple(prefer_groups))
    if g is None:
        act = "" if p.contiguous_groups(in_features) else "act-order "
        return Decision(REQUANTIZE, f"the {act}groups (size {p.group_size}) do not cover whole mlx groups of "
                                    f"{'/'.join(map(str, s.groups))} (requantized with mlx's affine rule, "
                                    f"{bits}-bit)", **requant)
    keep = dict(group_size=g, keeps_codes=True, facts={"bits": bits})
    scales_ok = _exact_in(p.scales, store)
    what = f"{p.bits}-bit codes kept as mlx {bits}-bit group {g}"
    if p.mins is not None or not p.integer_zeros:
        mins = p.mins if p.mins is not None else -(p.scales.to(torch.float32) * p.zeros.to(torch.float32))
        if p.mins is not None and scales_ok and _exact_in(mins, store) and p.compute_dtype == store:
            return Decision(EXACT, f"{what}; scales and biases kept in {dname}, mlx's own arithmetic", **keep)
        kind = "mins" if p.mins is not None else "float zero points (bias -s*z)"
        return Decision(NEAR_EXACT, f"{what}; scales and {kind} stored in {dname}; mlx decodes s*q + b in {dname} "
                                    f"(the source in {_DTYPE_NAMES.get(p.compute_dtype, 'float32')})", **keep)
    bias = -(p.scales.to(torch.float32) * p.zeros.to(torch.float32))
    narrow = _exact_in(p.scales, torch.float16) or _exact_in(p.scales, torch.bfloat16)
    if store == torch.float32 and p.compute_dtype == torch.float32 and narrow:
        return Decision(EXACT, f"{what}; scales kept, bias -s*z exact in float32, and s*q + b equals s*(q - z)",
                        **keep)
    parts = ["scales kept" if scales_ok else f"scales round to {dname}",
             f"bias -s*z {'exact' if _exact_in(bias, store) else 'rounds once'} in {dname}"]
    return Decision(NEAR_EXACT, f"{what}; {', '.join(parts)}; mlx decodes s*q + b in {dname} (two roundings)",
                    **keep)


register_family(FAMILY, check_mlx)
