"""Kernels: bit packing, dequantization and quantization as pure functions over tensors.

Each operation is a vectorized torch function that runs on any device torch supports; the grid
dequantization also has Triton twins (kernels/triton_dequant.py) with the same float32 results, used
for CUDA tensors when Triton is installed. `QCONVERT_KERNELS=torch|triton|auto` overrides the choice
(`triton` on CPU tensors needs TRITON_INTERPRET=1: that is how the tests compare the two paths).
This package imports neither `converters` nor `formats`.
"""

from __future__ import annotations

import os
from functools import lru_cache

import torch

from .dequant import (dequantize_axis0_torch, dequantize_codebook_torch, dequantize_grid_torch,
                      dequantize_two_step_torch)

__all__ = ["dequantize_grid", "kernel_backend", "usable_cpus"]


def usable_cpus() -> int:
    """The CPUs this process may run on (its affinity mask on Linux, else every CPU): what thread pools
    and worker counts are sized to."""
    return len(os.sched_getaffinity(0)) if hasattr(os, "sched_getaffinity") else (os.cpu_count() or 1)


@lru_cache(maxsize=1)
def _triton_importable() -> bool:
    try:
        import triton  # noqa: F401
    except Exception:
        return False
    return True


def kernel_backend(tensor: torch.Tensor) -> str:
    """"triton" or "torch" for a tensor on its device, honouring QCONVERT_KERNELS."""
    mode = os.environ.get("QCONVERT_KERNELS", "auto").lower()
    # a CPU tensor in auto mode never needs Triton: decided before importing it (half a second a process)
    if mode == "torch" or (mode != "triton" and not tensor.is_cuda):
        return "torch"
    return "triton" if _triton_importable() else "torch"


def dequantize_grid(grid, dtype: torch.dtype = torch.float32) -> torch.Tensor:
    """Dequantize a `converters.records.Grid` (duck-typed: .params, .codes, .packed)."""
    p = grid.params
    if p.axis == 0:  # HQQ's strided-row groups (see converters/records.py); the torch path serves every device
        codes = grid.codes
        return dequantize_axis0_torch(codes, p.scales, p.zeros, p.row_groups(codes.shape[0]), dtype,
                                      compute_dtype=p.compute_dtype)
    if p.axis != 1:
        raise NotImplementedError(f"grid axis {p.axis} is not supported")
    if getattr(p, "codebook", None) is not None:  # bitsandbytes NF4/FP4, float grids: a table lookup, the torch path
        return dequantize_codebook_torch(grid.codes, p.effective_scales(), p.codebook, p.group_size, dtype,
                                         post_scale=p.post_scale)
    if getattr(p, "scale_steps", None) is not None:  # bitsandbytes LLM.int8's two float32 roundings
        pre, factor = p.scale_steps
        return dequantize_two_step_torch(grid.codes, p.zeros, pre, factor, p.group_size, dtype)
    packed = grid.packed
    probe = packed.words if packed is not None else grid.codes
    if kernel_backend(probe) == "triton" and p.compute_dtype == torch.float32:
        from .triton_dequant import dequantize_grid_triton, dequantize_gptq_words_triton

        if (packed is not None and packed.layout == "gptq-rows" and packed.bits in (2, 4, 8)
                and p.mins is None):
            return dequantize_gptq_words_triton(packed.words, packed.bits, p.scales, p.zeros, p.group_size,
                                                p.g_idx, dtype)
        return dequantize_grid_triton(grid.codes, p.scales, p.zeros, p.group_size, p.g_idx, dtype, mins=p.mins)
    return dequantize_grid_torch(grid.codes, p.scales, p.zeros, p.group_size, p.g_idx, dtype,
                                 mins=p.mins, compute_dtype=p.compute_dtype)
