"""Tag 2, HQQ: hqq's axis-0 layout as mistral.rs stores it. The flattened weight is viewed as [gs, numel/gs]
(a group is a column: `gs` elements of one input column taken every R-th output row); its codes are packed
along dim 0, 4-bit as "two halves" (the first gs/2 rows in the high nibbles) or 8-bit as they are, U8
`weight` [gs * bits / 8, numel/gs]; `weight.scales` / `weight.zeros` [1, numel/gs] in the dtype the layer is
dequantized in, (q - zero) * scale; `weight.shape`, `weight.bits`, `weight.group_size`, `weight.axis` (0),
and hqq's informational `optimization_steps`, `round_zeros`, `channel_wise`.

It loads as an axis-0 grid (records.py), with the stored group size and flags as record fields so that a
HQQ or UQFF writer stores the same layout; written from such a grid's codes, or with hqq's quantizer as
mistral.rs' ISQ runs it (axis 0, 10 steps, no zero rounding).
"""

from __future__ import annotations

from typing import TYPE_CHECKING

import torch

from ....converters.errors import QConvertError
from ....converters.plan import TensorPlan
from ....converters.records import Dense, Grid, GridParams
from ....kernels.hqq import axis0_compact, axis0_expand, pack_hqq, packing_for_bits, quantize_hqq, unpack_hqq
from ..layout import UqffType
from .base import EncodedLayer, LayerCodec, LayerDescription, UqffAction, u8_tensor, u32_tensor

if TYPE_CHECKING:
    from ..layer_view import LayerView

__all__ = ["HqqCodec", "hqq_halves_unpack", "hqq_halves_pack"]

_FLAGS = ("optimization_steps", "round_zeros", "channel_wise")


class HqqCodec(LayerCodec, family="hqq"):
    @classmethod
    def describe(cls, layer: LayerView) -> LayerDescription:
        params, shape = _grid_params(layer)
        fields = {"source_groups": (layer.meta_int("weight.group_size", range(1, 1 << 32), "group size"),),
                  "layer_flags": {"uqff": {k: layer.meta_int(f"weight.{k}", range(0, 1 << 32), k)
                                           for k in _FLAGS if f"weight.{k}" in layer}}}
        return LayerDescription(shape, "grid", params, fields)

    @classmethod
    def load(cls, layer: LayerView) -> Grid:
        params, (out, n) = _grid_params(layer)
        grouped = hqq_halves_unpack(layer.part("weight"), params.bits)  # [gs, numel/gs]
        return Grid(params, grouped.reshape(out, n))

    @classmethod
    def encode(cls, t: UqffType, plan: TensorPlan, item: Dense | Grid) -> EncodedLayer:
        out, n = plan.shape
        action: UqffAction = plan.action
        if action.aligned:
            p = item.params
            store = action.meta_dtype
            layout = axis0_compact(p.scales, p.zeros, (out, n), t.bits, (action.group_size,))
            if layout is None or layout[0] != action.group_size:
                raise QConvertError("the grid's axis-0 scales changed between planning and writing", tensor=plan.name)
            gs, scales, zeros = layout
            codes, scales, zeros = item.codes, scales.to(store), zeros.to(store)
            # a UQFF source's informational flags are kept as it stored them (0 steps: not optimized here)
            flags = action.hqq_flags
            steps, round_zeros = flags.get("optimization_steps", 0), flags.get("round_zeros", 0)
            channel_wise = flags.get("channel_wise", 1)
        else:
            gs, store, steps = action.group_size, torch.float32, 10  # mistral.rs ISQ: 10 steps, no round
            round_zeros, channel_wise = 0, 1
            codes, scales, zeros = quantize_hqq(item.dequantize(torch.float32), t.bits, gs, axis=0, optimize=True,
                                                round_zero=False, iters=steps)
        e_s, e_z = axis0_expand(scales, (out, n), gs), axis0_expand(zeros, (out, n), gs)
        params = GridParams(bits=t.bits, group_size=out // e_s.shape[0], scales=e_s, zeros=e_z, axis=0,
                            compute_dtype=store)
        grouped = codes.reshape(gs, out * n // gs)
        tensors = {"": hqq_halves_pack(grouped, t.bits), "weight.format": cls.format_tensor(),
                   "weight.scales": scales.reshape(1, -1).contiguous(),
                   "weight.zeros": zeros.reshape(1, -1).contiguous(),
                   "weight.shape": u32_tensor([out, n]), "weight.bits": u8_tensor(t.bits),
                   "weight.group_size": u32_tensor(gs), "weight.axis": u8_tensor(0),
                   "weight.optimization_steps": u32_tensor(steps), "weight.round_zeros": u8_tensor(round_zeros),
                   "weight.channel_wise": u8_tensor(channel_wise)}
        return EncodedLayer(tensors, Grid(params, codes).dequantize(torch.float32))


def _grid_params(layer: LayerView) -> tuple[GridParams, tuple[int, int]]:
    """The layer's axis-0 GridParams and [out, in], every header and scalar checked before the codes are read."""
    out, n = layer.shape()
    numel = out * n
    bits = layer.meta_int("weight.bits", (4, 8), "HQQ bits (mistral.rs writes 4 and 8)")
    layer.meta_int("weight.axis", (0,), "HQQ axis (mistral.rs dequantizes axis 0 only)")
    gs = layer.meta_int("weight.group_size", range(1, numel + 1), f"HQQ group size (1..{numel})")
    for suffix in ("weight.round_zeros", "weight.channel_wise"):
        if suffix in layer:
            layer.meta_int(suffix, (0, 1), suffix[len("weight."):] + " flag")
    if "weight.optimization_steps" in layer:
        layer.meta_int("weight.optimization_steps", range(0, 1 << 32), "optimization steps")
    # hqq and mistral.rs view the flattened weight as [gs, numel/gs]: gs must divide the element count
    # (not the rows: k/v projections of 32 rows with gs 64 are what mistral.rs writes), and the 4-bit
    # packing stores the two halves of the gs rows in one byte
    if numel % gs or gs * bits % 8:
        raise layer.bad(f"HQQ group size {gs} does not divide the {out}x{n} weight's {numel} elements "
                        f"into whole {bits}-bit packed groups", "weight.group_size")
    m = numel // gs
    for suffix in ("weight.scales", "weight.zeros"):
        dtype, shape = layer.header(suffix)
        if dtype not in ("F32", "F16", "BF16") or _numel(shape) != m or len(shape) > 2:
            raise layer.bad(f"HQQ {suffix[7:]} {shape[:4]} {dtype} do not hold {m} float groups ([1, {m}])", suffix)
    if layer.header("weight.scales")[0] != layer.header("weight.zeros")[0]:
        raise layer.bad("HQQ scales and zeros have different dtypes", "weight.zeros")
    wdtype, wshape = layer.header("weight")
    if wdtype != "U8" or list(wshape) != [gs * bits // 8, m]:
        raise layer.bad(f"HQQ weight {wshape[:4]} {wdtype}, expected U8 {[gs * bits // 8, m]} for shape "
                        f"{[out, n]}, group size {gs}, {bits} bits")
    scales, zeros = layer.part("weight.scales"), layer.part("weight.zeros")
    # the [1, M] meta as records.py's axis-0 [p, in] matrix (kernels/hqq.py axis0_expand)
    e_s, e_z = axis0_expand(scales, (out, n), gs), axis0_expand(zeros, (out, n), gs)
    params = GridParams(bits=bits, group_size=out // e_s.shape[0], scales=e_s, zeros=e_z, axis=0,
                        compute_dtype=scales.dtype)
    return params, (out, n)


def _numel(shape) -> int:
    total = 1
    for d in shape:
        total *= int(d)
    return total


# -- HQQ 4-bit "two halves" / 8-bit packing along dim 0 of the [gs, numel/gs] group matrix --------------
def hqq_halves_unpack(words: torch.Tensor, bits: int) -> torch.Tensor:
    packing = packing_for_bits(bits)
    return unpack_hqq(words, packing, words.shape[0] * packing.per_word)


def hqq_halves_pack(grouped: torch.Tensor, bits: int) -> torch.Tensor:
    return pack_hqq(grouped, packing_for_bits(bits))
