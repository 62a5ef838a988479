"""What hqq can hold: the --type vocabulary (container and BITSgGROUP[aAXIS] scheme) and the checker's `hqq`
family (registered here): a grid keeps its codes when hqq's packings, group and axis hold it.
"""

from __future__ import annotations

import re
from dataclasses import dataclass

import torch

from ...converters.checker import EXACT, REFUSED, REQUANTIZE, Decision, TargetScheme, register_family
from ...converters.errors import QConvertError
from ...converters.records import GridParams
from ...kernels.hqq import axis0_compact, grouped_shape, packing_for_bits
from .layer import SUPPORTED_BITS


# --------------------------------------------------------------------------------------------------
# Writer

_STYLES = {"safetensors": "safetensors", "transformers": "safetensors", "hf": "safetensors", "st": "safetensors",
           "qmodel": "qmodel", "pt": "qmodel", "hqq-lib": "qmodel", "lib": "qmodel"}
_SCHEME_RE = re.compile(r"^(?:b|q)?(?P<bits>[1-8])(?:bit)?[-_]?g(?P<group>\d+)(?:[-_]?a(?:xis)?(?P<axis>[01]))?$")


@dataclass(frozen=True)
class HqqScheme:
    bits: int
    group_size: int
    axis: int = 1

    def label(self) -> str:
        return f"hqq {self.bits}-bit g{self.group_size} axis {self.axis}"


def parse_hqq_type(text: str | None) -> tuple[str | None, HqqScheme | None]:
    """`qmodel`, `safetensors`, `4g64`, `4g64a0`, `qmodel:3g64a1` -> (style or None, scheme or None)."""
    style, scheme = None, None
    for token in re.split(r"[:,+]", (text or "").strip().lower()):
        if not token:
            continue
        if token in _STYLES:
            style = _STYLES[token]
            continue
        m = _SCHEME_RE.match(token)
        if not m or int(m["bits"]) not in SUPPORTED_BITS:
            raise QConvertError(f"unknown HQQ type {text!r}; write a container (safetensors, qmodel) and/or a "
                                "scheme bits-g-group-a-axis, e.g. 4g64, 4g64a0, qmodel:3g64a1")
        scheme = HqqScheme(int(m["bits"]), int(m["group"]), int(m["axis"] or 1))
    return style, scheme


def scheme_fits(scheme: HqqScheme, shape: tuple[int, int]) -> str:
    """'' when hqq can store a weight of this shape with this scheme, else why not."""
    out_features, in_features = shape
    gs = scheme.group_size
    if scheme.axis == 1 and in_features % gs:
        return f"rows of {in_features} are not whole groups of {gs}"
    if scheme.axis == 0 and (out_features * in_features) % gs:  # hqq: W.reshape(gs, -1), numel % gs == 0
        return f"the {out_features}x{in_features} weight is not whole axis-0 groups of {gs}"
    rows = grouped_shape(shape, gs, scheme.axis)[0]
    if not packing_for_bits(scheme.bits).fits(rows):
        return f"{rows} group rows cannot be packed as {packing_for_bits(scheme.bits).name}"
    return ""


def axis0_layout(p: GridParams, shape: tuple[int, int], prefer: tuple[int, ...] = ()):
    """(group_size, scale [1, M], zero [1, M]) of the hqq layout an axis-0 grid is stored in, or None."""
    return axis0_compact(p.scales, p.zeros, shape, p.bits, prefer)


def source_scheme(p: GridParams, shape: tuple[int, int], prefer: tuple[int, ...] = ()) -> HqqScheme:
    """The grid's own hqq scheme (axis 0: the group size of its hqq layout, not records.py's out / p)."""
    if p.axis == 0:
        layout = axis0_layout(p, shape, prefer) if p.row_idx is None else None
        return HqqScheme(p.bits, layout[0] if layout else p.group_size, 0)
    return HqqScheme(p.bits, p.group_size, p.axis)


def _grid_as_hqq(p, shape: tuple[int, int], s: TargetScheme, native=None, prefer: tuple[int, ...] = ()) -> Decision:
    """The alignment checker's "hqq" family: can hqq store this grid as it is (its own scheme kept)?"""
    if not isinstance(p, GridParams):
        return Decision(REQUANTIZE, "dense weights quantized with hqq's rule (no calibration)")
    if p.bits not in s.code_bits:
        return Decision(REQUANTIZE, f"{p.bits}-bit codes have no hqq packing")
    if p.mins is not None:
        return Decision(REQUANTIZE, "min-form grids (W = s*q + m) have no exact hqq zero point")
    if p.axis not in (0, 1) or (p.axis == 1 and not p.contiguous_groups(shape[1])):
        return Decision(REQUANTIZE, "act-order groups are not hqq groups")
    if p.axis == 0 and p.row_idx is not None:
        return Decision(REQUANTIZE, "reordered axis-0 rows are not hqq groups")
    if p.axis == 0 and axis0_layout(p, shape, prefer) is None:
        return Decision(REFUSED, f"no hqq axis-0 group size gives these {tuple(p.scales.shape)} scales with "
                                 f"{packing_for_bits(p.bits).name} packing")
    why = scheme_fits(source_scheme(p, shape, prefer), shape)
    if why:
        return Decision(REFUSED, why)
    if not torch.is_floating_point(p.zeros) and not bool((p.zeros.abs() <= 256).all()):
        return Decision(REQUANTIZE, "zero points are not exact in the compute dtype")
    return Decision(EXACT, "codes, scales and zeros kept", keeps_codes=True)


register_family("hqq", _grid_as_hqq)
# the hqq target that keeps a grid's own scheme (bits, group, axis): float zero points, meta in the compute
# dtype, hqq's packings (kernels/hqq.py PACKINGS)
HQQ_KEEP = TargetScheme("hqq", "hqq", zero="float", scale="source", code_bits=tuple(SUPPORTED_BITS))
