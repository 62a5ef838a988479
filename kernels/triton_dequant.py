"""Triton twins of the grid dequantization for CUDA tensors, giving the torch path's float32 results.

Two kernels over a [out, in] grid, one program per (row block, column block):
- `dequantize_grid_triton`: unpacked uint8 codes, zero-point form (q - z) * s or min form s * q + m,
  with an act-order index (a group per column; the contiguous case passes k // group_size).
- `dequantize_gptq_words_triton`: GPTQ's packed int32 words (2, 4, 8 bits) straight to float32,
  so a GPU never materializes the unpacked codes.

The arithmetic is the torch path's, in float32 with the same single roundings: q - z is exact for
integer zero points, one rounding for the product. In the min form s * q is exact whenever the scale
has at most 24 - bits significant bits (fp16/bf16 scales, ggml K sub-block scales), so a fused
multiply-add on the GPU rounds the same way. Outputs are float32; a bf16/fp16 result is cast by torch
outside the kernel (Triton's CPU interpreter truncates float32 -> bf16 instead of rounding).
Without a GPU these kernels run under TRITON_INTERPRET=1, which is how the tests compare them.
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl

__all__ = ["dequantize_grid_triton", "dequantize_gptq_words_triton"]

_BLOCK_ROWS = 16
_BLOCK_COLS = 64


@triton.jit
def _grid_kernel(codes_ptr, scales_ptr, offsets_ptr, gidx_ptr, out_ptr, n_rows, n_cols, n_groups,
                 MIN_FORM: tl.constexpr, BLOCK_ROWS: tl.constexpr, BLOCK_COLS: tl.constexpr):
    rows = tl.program_id(0) * BLOCK_ROWS + tl.arange(0, BLOCK_ROWS)
    cols = tl.program_id(1) * BLOCK_COLS + tl.arange(0, BLOCK_COLS)
    mask = (rows[:, None] < n_rows) & (cols[None, :] < n_cols)
    groups = tl.load(gidx_ptr + cols, mask=cols < n_cols, other=0)
    q = tl.load(codes_ptr + rows[:, None] * n_cols + cols[None, :], mask=mask, other=0).to(tl.float32)
    param = rows[:, None] * n_groups + groups[None, :]
    s = tl.load(scales_ptr + param, mask=mask, other=0.0)
    o = tl.load(offsets_ptr + param, mask=mask, other=0.0)
    if MIN_FORM:
        w = s * q + o
    else:
        w = (q - o) * s
    tl.store(out_ptr + rows[:, None] * n_cols + cols[None, :], w, mask=mask)


@triton.jit
def _gptq_words_kernel(words_ptr, scales_ptr, zeros_ptr, gidx_ptr, out_ptr, n_rows, n_cols, n_groups,
                       BITS: tl.constexpr, BLOCK_ROWS: tl.constexpr, BLOCK_COLS: tl.constexpr):
    # words: [n_cols * BITS / 32, n_rows] int32; output row n = GPTQ output channel n
    rows = tl.program_id(0) * BLOCK_ROWS + tl.arange(0, BLOCK_ROWS)
    cols = tl.program_id(1) * BLOCK_COLS + tl.arange(0, BLOCK_COLS)
    mask = (rows[:, None] < n_rows) & (cols[None, :] < n_cols)
    per_word: tl.constexpr = 32 // BITS
    word = tl.load(words_ptr + (cols[None, :] // per_word) * n_rows + rows[:, None], mask=mask, other=0)
    shift = (cols[None, :] % per_word) * BITS
    q = ((word >> shift) & ((1 << BITS) - 1)).to(tl.float32)
    groups = tl.load(gidx_ptr + cols, mask=cols < n_cols, other=0)
    param = rows[:, None] * n_groups + groups[None, :]
    s = tl.load(scales_ptr + param, mask=mask, other=0.0)
    z = tl.load(zeros_ptr + param, mask=mask, other=0.0)
    tl.store(out_ptr + rows[:, None] * n_cols + cols[None, :], (q - z) * s, mask=mask)


def _group_index(in_features: int, group_size: int, g_idx: torch.Tensor | None, device) -> torch.Tensor:
    if g_idx is not None:
        return g_idx.to(device=device, dtype=torch.int32).contiguous()
    return (torch.arange(in_features, device=device, dtype=torch.int32) // group_size).contiguous()


def _grid(n_rows: int, n_cols: int):
    return (triton.cdiv(n_rows, _BLOCK_ROWS), triton.cdiv(n_cols, _BLOCK_COLS))


def dequantize_grid_triton(codes: torch.Tensor, scales: torch.Tensor, zeros: torch.Tensor, group_size: int,
                           g_idx: torch.Tensor | None, dtype: torch.dtype = torch.float32,
                           mins: torch.Tensor | None = None) -> torch.Tensor:
    n_rows, n_cols = codes.shape
    out = torch.empty((n_rows, n_cols), dtype=torch.float32, device=codes.device)
    offsets = (mins if mins is not None else zeros).to(torch.float32).contiguous()
    _grid_kernel[_grid(n_rows, n_cols)](
        codes.contiguous(), scales.to(torch.float32).contiguous(), offsets,
        _group_index(n_cols, group_size, g_idx, codes.device), out, n_rows, n_cols, scales.shape[1],
        MIN_FORM=mins is not None, BLOCK_ROWS=_BLOCK_ROWS, BLOCK_COLS=_BLOCK_COLS)
    return out if dtype == torch.float32 else out.to(dtype)


def dequantize_gptq_words_triton(words: torch.Tensor, bits: int, scales: torch.Tensor, zeros: torch.Tensor,
                                 group_size: int, g_idx: torch.Tensor | None,
                                 dtype: torch.dtype = torch.float32) -> torch.Tensor:
    """GPTQ qweight [in*b/32, out] (b in 2, 4, 8) with scales/zeros [out, G] -> [out, in]."""
    if bits not in (2, 4, 8):
        raise ValueError(f"packed Triton dequant handles 2, 4 and 8 bits, not {bits}")
    n_cols = words.shape[0] * 32 // bits
    n_rows = words.shape[1]
    out = torch.empty((n_rows, n_cols), dtype=torch.float32, device=words.device)
    _gptq_words_kernel[_grid(n_rows, n_cols)](
        words.contiguous(), scales.to(torch.float32).contiguous(), zeros.to(torch.float32).contiguous(),
        _group_index(n_cols, group_size, g_idx, words.device), out, n_rows, n_cols, scales.shape[1],
        BITS=bits, BLOCK_ROWS=_BLOCK_ROWS, BLOCK_COLS=_BLOCK_COLS)
    return out if dtype == torch.float32 else out.to(dtype)
