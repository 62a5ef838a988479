"""Tag 5, F8Q8: the flattened weight in blocks of 32 elements, each 33 bytes (an F8E4M3 scale `d`, then 32
int8 codes), as U8 `weight`; `weight.num_blocks` and the torch-order `weight.shape` beside it. mistral.rs
decodes `qs * (d / F8E4M3::MAX)`. No grid holds it: it loads as dense float32 and is written by mistral.rs'
own quantizer rule.
"""

from __future__ import annotations

from typing import TYPE_CHECKING

import torch

from ....converters.plan import TensorPlan
from ....converters.records import Dense, Grid
from ..layout import UqffType
from .base import EncodedLayer, LayerCodec, LayerDescription, u32_tensor

if TYPE_CHECKING:
    from ..layer_view import LayerView

__all__ = ["F8q8Codec", "F8Q8_DIVISOR", "decode_f8q8", "encode_f8q8"]

# F8Q8 divides by F8E4M3::MAX, which the float8 0.7 crate linked into mistral.rs 0.9.5 evaluates to 416, not 448:
# with 416 the decoding of mistral.rs' own F8Q8 layers matches its runtime exactly, with 448 it does not
F8Q8_DIVISOR = 416.0


class F8q8Codec(LayerCodec, family="f8q8"):
    @classmethod
    def describe(cls, layer: LayerView) -> LayerDescription:
        return LayerDescription(layer.shape(), "float32")

    @classmethod
    def load(cls, layer: LayerView) -> Dense:
        w = layer.part("weight")
        shape = layer.shape()
        nblocks = layer.meta_int("weight.num_blocks", range(1, 1 << 32), "F8Q8 block count")
        if w.dtype != torch.uint8 or w.numel() != nblocks * 33 or nblocks * 32 < shape[0] * shape[1]:
            raise layer.bad(f"F8Q8 weight of {w.numel()} bytes does not hold {nblocks} blocks of 33 "
                            f"for shape {list(shape)}")
        return Dense(decode_f8q8(w, shape[0] * shape[1]).view(shape))

    @classmethod
    def encode(cls, t: UqffType, plan: TensorPlan, item: Dense | Grid) -> EncodedLayer:
        data = encode_f8q8(item.dequantize(torch.float32))
        numel = plan.shape[0] * plan.shape[1]
        tensors = {"": data, "weight.format": cls.format_tensor(), "weight.num_blocks": u32_tensor(data.numel() // 33),
                   "weight.shape": u32_tensor(list(plan.shape))}
        return EncodedLayer(tensors, decode_f8q8(data, numel).view(plan.shape))


def decode_f8q8(data: torch.Tensor, numel: int) -> torch.Tensor:
    b = data.view(-1, 33)
    d = b[:, :1].contiguous().view(torch.float8_e4m3fn).to(torch.float32)
    scale = d / F8Q8_DIVISOR  # mistral.rs: d.to_f32() / F8E4M3::MAX, then qs * scale
    q = b[:, 1:].contiguous().view(torch.int8).to(torch.float32)
    return (q * scale).reshape(-1)[:numel]


def encode_f8q8(w: torch.Tensor) -> torch.Tensor:
    """float -> uint8 [num_blocks*33], mistral.rs' quantizer: d = fp8(amax/127*416), qs = round(x*127/amax)."""
    x = w.to(torch.float32).reshape(-1)
    pad = (-x.numel()) % 32
    x = torch.cat([x, x.new_zeros(pad)]).view(-1, 32)
    amax = x.abs().max(-1, keepdim=True).values
    d = (amax / 127.0 * F8Q8_DIVISOR).to(torch.float8_e4m3fn)
    inv = torch.where(amax > 0, 127.0 / amax, torch.zeros_like(amax))
    q = torch.round(x * inv).clamp(-127, 127).to(torch.int8)
    return torch.cat([d.view(torch.uint8), q.view(torch.uint8)], dim=1).reshape(-1)
