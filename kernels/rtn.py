"""Round-to-nearest min/max quantization onto a GPTQ-style grid (the scale/zero rule of GPTQ's quantizer).

Used when a target needs a GPTQ grid and the source grid cannot be repacked: no calibration data and no
Hessian, so this is plain RTN with GPTQ's range rule; the report measures what it costs.
"""

from __future__ import annotations

import torch

__all__ = ["quantize_rtn"]


def quantize_rtn(w: torch.Tensor, bits: int, group_size: int, sym: bool):
    """float [out, in] -> (scales fp16 [out, n_groups], integer zeros int16 [out, n_groups], codes uint8
    [out, in], the group size used); group_size -1 = one group per row. The caller makes the grid of it
    (GridParams(bits, group, scales, zeros)): kernels import nothing above them."""
    out_features, in_features = w.shape
    gs = in_features if group_size <= 0 else group_size
    if in_features % gs:
        raise ValueError(f"in_features {in_features} is not a multiple of group size {gs}")
    maxq = (1 << bits) - 1
    x = w.to(torch.float32).reshape(out_features, in_features // gs, gs)
    xmin = x.min(-1).values.clamp(max=0)
    xmax = x.max(-1).values.clamp(min=0)
    if sym:
        xmax = torch.maximum(xmin.abs(), xmax)
        xmin = torch.where(xmin < 0, -xmax, xmin)
    both_zero = (xmin == 0) & (xmax == 0)
    xmin = torch.where(both_zero, -1.0, xmin)
    xmax = torch.where(both_zero, 1.0, xmax)
    scale = ((xmax - xmin) / maxq).to(torch.float16)
    s = scale.to(torch.float32)
    if sym:
        zero = torch.full_like(s, (maxq + 1) // 2)
    else:
        zero = torch.round(-xmin / s).clamp(0, maxq)
    q = torch.clamp(torch.round(x / s[..., None]) + zero[..., None], 0, maxq)
    return scale, zero.to(torch.int16), q.to(torch.uint8).reshape(out_features, in_features), gs
