"""What QQQ holds: the --type vocabulary (a group size) and the checker's `qqq` family (registered here): a
4-bit symmetric grid keeps its codes when its groups restate at QQQ's group and, grouped, when every group
scale is an integer multiple of the channel scale.
"""

from __future__ import annotations

import re

import torch

from ...converters.checker import EXACT, REFUSED, REQUANTIZE, Decision, TargetScheme, describe_grid, register_family
from ...converters.errors import QConvertError
from ...converters.records import GridParams
from ...kernels.qqq_perm import check_qqq_dims
from .layout import exact_channel_scale, layout_mode


def parse_qqq_type(text: str) -> int:
    """`g128` / `4g128` / `128` -> 128, `g-1` / `4g-1` / `-1` / `channel` -> -1."""
    key = text.strip().lower().replace("qqq:", "")
    if key in ("channel", "per-channel"):
        return -1
    m = re.match(r"^(?:4(?:bit)?[-_:]?)?g?(-1|128)$", key)
    if not m:
        raise QConvertError(f"unknown QQQ type {text!r}; QQQ holds 4-bit symmetric weights with group 128 or -1: "
                            "write g128 or g-1")
    return int(m.group(1))


def _qqq_decision(src, shape, s: TargetScheme, native=None, prefer=()) -> Decision:
    """The alignment checker's "qqq" family: QQQ's 4-bit symmetric codes in Marlin tiles with an fp16 channel
    scale (s.group = in_features) or an int8 group scale under an fp16 channel scale. facts["how"] says how
    the session writes it: copy (the source's own B words), channel, grouped (codes kept), rtn."""
    out_features, in_features = shape
    mode = "channel" if s.group == in_features else "grouped"
    why = check_qqq_dims(in_features, out_features)  # Marlin's tiles
    if why is None and mode == "grouped" and in_features % s.group:
        why = f"in_features {in_features} is not a multiple of the group size {s.group}"
    if why:
        return Decision(REFUSED, why)
    if native == "qqq":
        return Decision(EXACT, "B words and scales copied", copied=True, keeps_codes=True, facts={"how": "copy"})
    if not isinstance(src, GridParams):
        return Decision(REQUANTIZE, f"dense {src} weights quantized to QQQ with round-to-nearest (no calibration)",
                        facts={"how": "rtn"})
    p = src
    sym4 = p.bits == 4 and p.symmetric and p.axis == 1 and p.mins is None
    regrouped = regroup(p, in_features, s.group) if sym4 else None
    if regrouped is not None:
        facts = {"how": mode, "params": regrouped}
        if mode == "channel":
            sc = regrouped.scales.to(torch.float32)
            if torch.equal((sc / 16).to(torch.float16).to(torch.float32) * 16, sc):
                return Decision(EXACT, "codes kept; s_channel = scale/16 exact in fp16", keeps_codes=True, facts=facts)
            return Decision(REQUANTIZE, "scale/16 is not an fp16 value (gptqmodel runs s_channel in fp16)", facts=facts)
        if exact_channel_scale(regrouped.scales.to(torch.float32)) is not None:
            return Decision(EXACT, "codes kept; every group scale is an integer multiple of the channel scale",
                            keeps_codes=True, facts=facts)
        return Decision(REQUANTIZE, "codes kept; QQQ rounds (c-8)*s_group to int8 steps of a per-channel scale, "
                                    "up to half a step per weight", keeps_codes=True, facts=facts)
    return Decision(REQUANTIZE, f"{describe_grid(p, in_features)} is not QQQ's 4-bit symmetric "
                                f"{'per-channel' if mode == 'channel' else f'g{s.group} contiguous'} grid; "
                                "re-quantized (RTN)", facts={"how": "rtn"})


register_family("qqq", _qqq_decision)


def qqq_scheme(group: int, in_features: int) -> TargetScheme:
    """QQQ's target for a layer: per-channel (group -1, or a group as wide as the row) or grouped."""
    per_channel = layout_mode(group, in_features) == "channel"
    return TargetScheme("qqq", "qqq", bits=4, group=in_features if per_channel else group, zero="none",
                        scale="fp16" if per_channel else "int8 under fp16", offset=8)


def regroup(p: GridParams, in_features: int, group: int) -> GridParams | None:
    """The same grid with contiguous groups of `group` columns (`in_features` = one per row), or None when
    some target group would hold two different scales or zero points. Act-order or finer groups whose
    scales agree within every target group are thereby proven equivalent (e.g. Q4_0 blocks of a
    per-channel grid)."""
    if in_features % group:
        return None
    cols = p.group_of_column(in_features)
    per_col_s, per_col_z = p.scales[:, cols], p.zeros[:, cols]
    s = per_col_s.reshape(p.scales.shape[0], in_features // group, group)
    z = per_col_z.reshape(p.zeros.shape[0], in_features // group, group)
    if not (bool((s == s[..., :1]).all()) and bool((z == z[..., :1]).all())):
        return None
    return GridParams(bits=p.bits, group_size=group, scales=s[..., 0].contiguous(), zeros=z[..., 0].contiguous(),
                      compute_dtype=p.compute_dtype)
