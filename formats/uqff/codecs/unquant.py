"""Tag 1, Unquant (UQFF 1.1): the layer's plain F32 / F16 / BF16 matrix as `weight`, nothing else.

mistral.rs multiplies it in its stored dtype without a cast, so the writer stores the dtype the user names
(`--type f32/f16/bf16`: mistral.rs' run dtype; schemes.py says so in the plan).
"""

from __future__ import annotations

from typing import TYPE_CHECKING

import torch

from ....converters.plan import TensorPlan
from ....converters.records import Dense, Grid
from ..layout import UqffType
from .base import EncodedLayer, LayerCodec, LayerDescription

if TYPE_CHECKING:
    from ..layer_view import LayerView

__all__ = ["UnquantCodec"]

_FLOAT_NAMES = {"F32": "float32", "F16": "float16", "BF16": "bfloat16"}


class UnquantCodec(LayerCodec, family="unquant"):
    @classmethod
    def describe(cls, layer: LayerView) -> LayerDescription:
        dtype, shape = cls.plain_weight_header(layer)
        if dtype not in _FLOAT_NAMES:
            raise layer.bad(f"Unquant weight dtype {dtype} is not F32, F16 or BF16")
        return LayerDescription(tuple(shape), _FLOAT_NAMES[dtype])

    @classmethod
    def load(cls, layer: LayerView) -> Dense:
        return Dense(layer.part("weight"))

    @classmethod
    def encode(cls, t: UqffType, plan: TensorPlan, item: Dense | Grid) -> EncodedLayer:
        w = item.dequantize(t.unquant_dtype).contiguous()
        return EncodedLayer({"": w, "weight.format": cls.format_tensor()}, w.to(torch.float32))
