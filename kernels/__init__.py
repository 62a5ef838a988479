"""Kernels: bit packing, dequantization and quantization as pure functions over tensors.

Each operation is a vectorized torch function that runs on any device torch supports. `dequantize_grid`
is the dispatch point where a Triton twin for CUDA tensors joins (not written yet: the torch path
serves CUDA tensors too). This package imports neither `converters` nor `formats`.
"""

from __future__ import annotations

import torch

from .dequant import dequantize_grid_torch

__all__ = ["dequantize_grid"]


def dequantize_grid(grid, dtype: torch.dtype = torch.float32) -> torch.Tensor:
    """Dequantize a `converters.records.Grid` (duck-typed: .codes and .params)."""
    p = grid.params
    if p.axis != 1:
        raise NotImplementedError(f"grid axis {p.axis} is not supported yet")
    return dequantize_grid_torch(grid.codes, p.scales, p.zeros, p.group_size, p.g_idx, dtype,
                                 mins=p.mins, compute_dtype=p.compute_dtype)
