"""Grid dequantization, the vectorized torch path (CPU or any device torch runs on).

    W[n, k] = scales[n, g(k)] * (codes[n, k] - zeros[n, g(k)])

computed in float32. For integer zeros every step is exact in float32 (an fp16 scale times an integer
below 2**9 needs at most 20 significant bits), so the float32 result is the exact value of the grid
and rounding it once to fp16 gives what GPTQ's fp16 kernels compute. bf16 output rounds to nearest even.
"""

from __future__ import annotations

import torch

__all__ = ["dequantize_grid_torch"]


def dequantize_grid_torch(codes: torch.Tensor, scales: torch.Tensor, zeros: torch.Tensor,
                          group_size: int, g_idx: torch.Tensor | None,
                          dtype: torch.dtype = torch.float32) -> torch.Tensor:
    out_features, in_features = codes.shape
    s = scales.to(torch.float32)
    z = zeros.to(torch.float32)
    q = codes.to(torch.float32)
    if g_idx is None and in_features % group_size == 0:
        # contiguous groups: broadcast one scale over each run, no gather
        n_groups = in_features // group_size
        w = (q.view(out_features, n_groups, group_size) - z[:, :, None]) * s[:, :, None]
        w = w.view(out_features, in_features)
    else:
        g = g_idx if g_idx is not None else torch.arange(in_features, device=codes.device) // group_size
        w = (q - z[:, g]) * s[:, g]
    return w if dtype == torch.float32 else w.to(dtype)
