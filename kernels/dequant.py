"""Grid dequantization, the vectorized torch path (CPU or any device torch runs on).

    W[n, k] = scales[n, g(k)] * (codes[n, k] - zeros[n, g(k)])

computed in float32. For integer zeros every step is exact in float32 (an fp16 scale times an integer
below 2**9 needs at most 20 significant bits), so the float32 result is the exact value of the grid
and rounding it once to fp16 gives what GPTQ's fp16 kernels compute. bf16 output rounds to nearest even.

Two source runtimes need their own operation order (converters/records.py): codebook grids (bitsandbytes
NF4/FP4, W = codebook[q] * absmax) and two-step scales (bitsandbytes LLM.int8, W = (q * SCB) * 1/127).
"""

from __future__ import annotations

import torch

__all__ = ["dequantize_grid_torch", "dequantize_axis0_torch", "dequantize_codebook_torch",
           "dequantize_two_step_torch"]


def dequantize_grid_torch(codes: torch.Tensor, scales: torch.Tensor, zeros: torch.Tensor,
                          group_size: int, g_idx: torch.Tensor | None,
                          dtype: torch.dtype = torch.float32, mins: torch.Tensor | None = None,
                          compute_dtype: torch.dtype = torch.float32) -> torch.Tensor:
    """Zero-point form (q - z) * s, or min form s * q + m when `mins` is given, in `compute_dtype`."""
    out_features, in_features = codes.shape
    cd = compute_dtype
    s = scales.to(cd)
    offset = (mins if mins is not None else zeros).to(cd)
    q = codes.to(cd)
    if g_idx is None and in_features % group_size == 0:
        # contiguous groups: broadcast one scale over each run, no gather
        n_groups = in_features // group_size
        qg = q.view(out_features, n_groups, group_size)
        if mins is not None:
            w = s[:, :, None] * qg + offset[:, :, None]
        else:
            w = (qg - offset[:, :, None]) * s[:, :, None]
        w = w.view(out_features, in_features)
    else:
        g = g_idx if g_idx is not None else torch.arange(in_features, device=codes.device) // group_size
        w = s[:, g] * q + offset[:, g] if mins is not None else (q - offset[:, g]) * s[:, g]
    return w if dtype == w.dtype else w.to(dtype)


def dequantize_axis0_torch(codes: torch.Tensor, scales: torch.Tensor, zeros: torch.Tensor, row_groups: torch.Tensor,
                           dtype: torch.dtype = torch.float32,
                           compute_dtype: torch.dtype = torch.float32) -> torch.Tensor:
    """Axis-0 grids (HQQ): W[n, k] = (q[n, k] - zeros[h(n), k]) * scales[h(n), k], scales/zeros [R, in],
    h = `row_groups` [out]. The same two elementwise operations in the same dtype as hqq's
    `(W_q - zero) * scale` on its [group_size, numel/group_size] view, so the result is hqq's bit for bit."""
    cd = compute_dtype
    q = codes.to(cd)
    out_features, in_features = codes.shape
    r = scales.shape[0]
    natural = out_features % r == 0 and torch.equal(
        row_groups, torch.arange(out_features, dtype=row_groups.dtype, device=row_groups.device) % r)
    if natural:  # [gs, R, in] view: broadcast the [R, in] scales without a gather
        w = (q.view(-1, r, in_features) - zeros.to(cd)[None]) * scales.to(cd)[None]
        w = w.view(out_features, in_features)
    else:
        w = (q - zeros.to(cd)[row_groups]) * scales.to(cd)[row_groups]
    return w if dtype == w.dtype else w.to(dtype)


_CODEBOOK_BAND = 1 << 18  # elements of a codebook grid decoded at once


def dequantize_codebook_torch(codes: torch.Tensor, scales: torch.Tensor, codebook: torch.Tensor, group_size: int,
                              dtype: torch.dtype = torch.float32, post_scale: torch.Tensor | None = None
                              ) -> torch.Tensor:
    """Codebook grids (bitsandbytes NF4/FP4, float grids): W[n, k] = codebook[q[n, k]] * scales[n, k // group_size]
    (times `post_scale` afterwards when given: llama.cpp's NVFP4 `.scale`).

    The operations of bitsandbytes 0.50 backends/default/ops.py _dequantize_4bit_compute (its CPU C kernel
    gives the same bits): the float32 table value times the float32 block absmax, one float32 rounding,
    then one cast to the output dtype. A row whose last group is partial (compressed-tensors' padded fp8
    blocks) takes the gather path."""
    out_features, in_features = codes.shape
    table = codebook.to(codes.device, torch.float32)
    s = scales.to(codes.device, torch.float32)
    post = None if post_scale is None else post_scale.to(codes.device, torch.float32)
    col_group = None if in_features % group_size == 0 else \
        torch.arange(in_features, device=codes.device) // group_size
    out = torch.empty((out_features, in_features), dtype=dtype, device=codes.device)
    # a band of rows at a time: the table lookup's index and values are a band, not the tensor (an FP8 weight
    # is 1 byte an element on disk; the whole-tensor temporaries would be 16)
    step = max(1, _CODEBOOK_BAND // max(1, in_features))
    for r0 in range(0, out_features, step):
        r1 = min(out_features, r0 + step)
        values = table[codes[r0:r1].to(torch.int64)]
        if col_group is None:
            w = (values.view(r1 - r0, in_features // group_size, group_size) * s[r0:r1, :, None]).view(r1 - r0, -1)
        else:
            w = values * s[r0:r1][:, col_group]
        if post is not None:
            w = w * post
        out[r0:r1] = w
    return out


def dequantize_two_step_torch(codes: torch.Tensor, zeros: torch.Tensor, pre_scales: torch.Tensor, factor: float,
                              group_size: int, dtype: torch.dtype = torch.float32) -> torch.Tensor:
    """W = ((q - z) * a) * c in float32, two roundings in this order: bitsandbytes 0.50 _ops.py
    int8_vectorwise_dequant computes `A * stats.view(-1, 1) * 7.874015718698502e-3` (int8 times float32
    SCB, then times the Python constant, which torch applies as a float32 scalar)."""
    out_features, in_features = codes.shape
    n_groups = in_features // group_size
    dev = codes.device
    q = (codes.to(torch.int16) - zeros.to(dev, torch.int16).repeat_interleave(group_size, dim=1)).to(torch.float32)
    a = pre_scales.to(dev, torch.float32)
    a = a.repeat_interleave(group_size, dim=1) if n_groups > 1 else a
    w = q * a * factor
    return w if dtype == w.dtype else w.to(dtype)
