"""Kernels: bit packing, dequantization and quantization as pure functions over tensors.

Each operation has a vectorized torch path that runs anywhere and, where it pays, a Triton twin for
CUDA tensors that gives the same result. `dequantize_grid` picks the path from the tensor's device.
This package imports neither `converters` nor `formats`.
"""

from __future__ import annotations

import torch

from .dequant import dequantize_grid_torch

__all__ = ["dequantize_grid", "triton_available"]


def triton_available() -> bool:
    try:
        import triton  # noqa: F401
    except Exception:
        return False
    return torch.cuda.is_available()


def dequantize_grid(grid, dtype: torch.dtype = torch.float32) -> torch.Tensor:
    """Dequantize a `converters.records.Grid` (duck-typed: .codes and .params)."""
    p = grid.params
    if p.axis != 1:
        raise NotImplementedError(f"grid axis {p.axis} is not supported yet")
    if grid.codes.is_cuda and triton_available():
        from .triton_dequant import dequantize_grid_triton

        return dequantize_grid_triton(grid.codes, p.scales, p.zeros, p.group_size, p.g_idx, dtype)
    return dequantize_grid_torch(grid.codes, p.scales, p.zeros, p.group_size, p.g_idx, dtype)
