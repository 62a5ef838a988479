"""Tag 3, FP8: a per-tensor scaled F8E4M3 matrix, w = fp8 * `dequant_w_scale` (float32 scalars
`dequant_w_scale`, `dequant_x_scale`, `quant_scale`, and the dtype code `weight.dtype`, 9 = F8E4M3).

It loads as a float grid (E4M3 codes, one scale for the tensor), so that a float target keeps its codes;
written either from such a grid's codes or with mistral.rs' scale rule (absmax to 448).
"""

from __future__ import annotations

from typing import TYPE_CHECKING

import torch

from ....converters.plan import TensorPlan
from ....converters.records import Dense, Grid, GridParams, unused_zeros
from ....kernels.floatq import element_table
from ..layout import UqffType
from .base import EncodedLayer, FloatGridCodec, keeps_float_codes, u32_tensor

if TYPE_CHECKING:
    from ..layer_view import LayerView

__all__ = ["Fp8Codec", "FP8_DTYPE_CODE", "encode_fp8"]

FP8_DTYPE_CODE = 9  # F8E4M3 in UQFF's dtype code table
# mistral.rs' ISQ stores absmax / 448 (> 0); a scale past 65504 / 448 would put weights beyond float16's range,
# which no model's weights reach: a corrupt value, not a model
_MAX_SCALE = 65504.0 / 448.0


class Fp8Codec(FloatGridCodec, family="fp8"):
    @classmethod
    def grid_params(cls, layer: LayerView) -> tuple[tuple[int, ...], GridParams]:
        """(shape, GridParams) of the E4M3 codes times one float32 scale, from the weight's header and the
        scalars (the codes are not read)."""
        dtype, wshape = layer.header("weight")
        if dtype != "F8_E4M3":
            raise layer.bad(f"FP8 weight dtype {dtype} is not F8_E4M3")
        if "weight.dtype" in layer:
            layer.meta_int("weight.dtype", (FP8_DTYPE_CODE,), "FP8 dtype code (9 = F8E4M3)")
        scale = layer.meta_float("weight.dequant_w_scale", "FP8 dequant scale").to(torch.float32)
        if not 0.0 < float(scale) <= _MAX_SCALE:
            raise layer.bad(f"FP8 dequant scale {float(scale):.6g} is outside (0, {_MAX_SCALE:.6g}]: the weights "
                            "would be beyond float16's range", "weight.dequant_w_scale")
        shape = tuple(wshape)
        scales = scale.reshape(1, 1).expand(shape[0], 1).contiguous()
        params = GridParams(bits=8, group_size=shape[1], scales=scales,
                            zeros=unused_zeros(scales.shape), codebook=element_table("e4m3"))
        return shape, params

    @classmethod
    def codes_of(cls, weight: torch.Tensor) -> torch.Tensor:
        return weight.view(torch.uint8)

    @classmethod
    def encode(cls, t: UqffType, plan: TensorPlan, item: Dense | Grid) -> EncodedLayer:
        if keeps_float_codes(plan, item, "e4m3"):  # one scale for the tensor: its codes move as they are
            q = item.codes.view(torch.float8_e4m3fn)
            scale = item.params.folded_scales().reshape(-1)[0].reshape(()).clone()
        else:
            q, scale = encode_fp8(item.dequantize(torch.float32))
        tensors = {"": q, "weight.format": cls.format_tensor(), "weight.dequant_w_scale": scale,
                   "weight.dequant_x_scale": scale.clone(), "weight.quant_scale": (1.0 / scale).to(torch.float32),
                   "weight.dtype": u32_tensor(FP8_DTYPE_CODE)}
        return EncodedLayer(tensors, q.to(torch.float32) * scale)



def encode_fp8(w: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """float [out, in] -> (F8E4M3 weight, float32 scalar dequant scale), mistral.rs' rule: the tensor's
    absmax maps to 448."""
    x = w.to(torch.float32)
    amax = float(x.abs().max())
    scale = torch.tensor(amax / 448.0 if amax > 0 else 1.0, dtype=torch.float32)
    q = (x / scale).clamp(-448.0, 448.0).to(torch.float8_e4m3fn)
    return q, scale
