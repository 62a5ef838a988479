"""Tag 6, MXFP4: FP4 E2M1 nibbles (low nibble first) as U8 `weight` [out, in/2], times 2^(e8m0 - 127) per
block of 32 along a row (`weight.scales`, U8 [out, in/32]).

It loads as a float grid (E2M1 codes under E8M0 block scales), so that an MXFP4 / float target keeps its
codes; written either from such a grid's codes or with mistral.rs' scale rule.
"""

from __future__ import annotations

from typing import TYPE_CHECKING

import torch

from ....converters.plan import TensorPlan
from ....converters.records import Dense, Grid, GridParams, unused_zeros
from ....kernels.floatq import element_table, float_to_e8m0, pack_fp4, unpack_fp4
from ..layout import UqffType
from .base import EncodedLayer, FloatGridCodec, keeps_float_codes

if TYPE_CHECKING:
    from ..layer_view import LayerView

__all__ = ["Mxfp4Codec", "MXFP4_VALUES", "decode_mxfp4", "encode_mxfp4"]

MXFP4_VALUES = (0.0, 0.5, 1.0, 1.5, 2.0, 3.0, 4.0, 6.0)


class Mxfp4Codec(FloatGridCodec, family="mxfp4"):
    @classmethod
    def grid_params(cls, layer: LayerView) -> tuple[tuple[int, int], GridParams]:
        """(shape, GridParams) of the E2M1 codes under E8M0 block scales, from the weight's header and the
        scales (the codes are not read)."""
        dtype, wshape = layer.header("weight")
        scales = layer.part("weight.scales")
        if dtype != "U8" or scales.dtype != torch.uint8 or len(wshape) != 2 or (wshape[1] * 2) % 32 or \
                tuple(scales.shape) != (wshape[0], wshape[1] * 2 // 32):
            raise layer.bad(f"MXFP4 weight {list(wshape)} / scales {list(scales.shape)} do not match")
        scales = scales.view(torch.float8_e8m0fnu)
        params = GridParams(bits=4, group_size=32, scales=scales, zeros=unused_zeros(scales.shape),
                            codebook=element_table("e2m1"))
        return (wshape[0], wshape[1] * 2), params

    @classmethod
    def codes_of(cls, weight: torch.Tensor) -> torch.Tensor:
        return unpack_fp4(weight)

    @classmethod
    def encode(cls, t: UqffType, plan: TensorPlan, item: Dense | Grid) -> EncodedLayer:
        if keeps_float_codes(plan, item, "e2m1"):  # E2M1 codes and E8M0 exponents, the source's bits
            p = item.params
            n = item.shape[1]
            weight = pack_fp4(item.codes)
            scales = float_to_e8m0(p.folded_scales()[:, torch.arange(0, n, 32) // p.group_size]).contiguous()
        else:
            weight, scales = encode_mxfp4(item.dequantize(torch.float32))
        return EncodedLayer({"": weight, "weight.format": cls.format_tensor(), "weight.scales": scales},
                            decode_mxfp4(weight, scales))



def decode_mxfp4(weight: torch.Tensor, scales: torch.Tensor) -> torch.Tensor:
    """uint8 [out, in/2] nibbles (low nibble = even element), uint8 [out, in/32] E8M0 -> float32 [out, in]."""
    out = weight.shape[0]
    table = torch.tensor(MXFP4_VALUES + tuple(-v for v in MXFP4_VALUES), dtype=torch.float32)
    nib = torch.stack([weight & 0x0F, weight >> 4], dim=-1).reshape(out, -1).to(torch.int64)
    vals = table[nib]
    scale = torch.ldexp(torch.ones_like(scales, dtype=torch.float32), scales.to(torch.int32) - 127)
    return (vals.view(out, -1, 32) * scale[..., None]).view(out, -1)


def encode_mxfp4(w: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """float [out, in] -> (uint8 nibbles [out, in/2], uint8 E8M0 [out, in/32]); mistral.rs' scale rule
    s = floor(log2(amax/6)) + 127, then each element to the nearest E2M1 value."""
    x = w.to(torch.float32)
    out, n = x.shape
    xb = x.view(out, n // 32, 32)
    amax = xb.abs().max(-1).values
    e = torch.where(amax > 0, torch.floor(torch.log2(amax / 6.0)), torch.zeros_like(amax)) + 127
    e = e.clamp(0, 254)
    scaled = xb / torch.ldexp(torch.ones_like(e), (e - 127).to(torch.int32))[..., None]
    grid = torch.tensor(MXFP4_VALUES, dtype=torch.float32)
    idx = (scaled.abs()[..., None] - grid).abs().argmin(-1)
    code = (idx | torch.where(scaled < 0, 8, 0)).to(torch.uint8).view(out, n)
    packed = code[:, 0::2] | (code[:, 1::2] << 4)
    return packed.contiguous(), e.to(torch.uint8)
