"""Kernels: bit packing, dequantization and quantization as pure functions over tensors.

Each operation is a vectorized torch function that runs on any device torch supports; the grid
dequantization also has Triton twins (kernels/triton/dequant.py) with the same float32 results, used
for CUDA tensors when Triton is installed. `QCONVERT_KERNELS=torch|triton|auto` overrides the choice
(`triton` on CPU tensors needs TRITON_INTERPRET=1: that is how the tests compare the two paths).
This package imports neither `converters` nor `formats`.

The rooms: the flat modules (bit packing, the packing registry, dequantization, float element formats, HQQ,
QQQ's permutation, the Hadamard rotation, round-to-nearest), ggml/ (ggml's block formats: layouts, the legacy,
K and IQ quantizers with their C twins, libggml), triton/ (the CUDA twins and route.py, the one dispatch per
path that sends a tensor to a Triton kernel) and dispatch.py (the compute device, the backend choice and the
kernel trace, which every kernel reports to). This module is the package's entry: `dequantize_grid` and the
dispatch API.
"""

from __future__ import annotations

import os

import torch

from .dequant import (dequantize_axis0_torch, dequantize_codebook_torch, dequantize_grid_torch,
                      dequantize_two_step_torch)
from .dispatch import (compute_device, kernel_backend, kernel_trace, note_kernel, resolve_device, triton_device,
                       usable_cpus, use_device)

__all__ = ["dequantize_grid", "kernel_backend", "usable_cpus", "resolve_device", "use_device", "compute_device",
           "kernel_trace", "note_kernel", "triton_device"]


def _dequantize_gptq_c(kquant_c, packed, p) -> torch.Tensor:
    in_features = packed.words.shape[0] * 32 // packed.bits
    offsets = p.mins if p.mins is not None else p.zeros
    w = kquant_c.dequantize_gptq(packed.words.numpy(), packed.bits, in_features,
                                 p.scales.to(torch.float32).numpy(), offsets.to(torch.float32).numpy(),
                                 p.mins is not None, p.group_of_column(in_features).numpy(),
                                 max(1, torch.get_num_threads()))
    note_kernel("dequantize", "c")
    return torch.from_numpy(w)


def dequantize_grid(grid, dtype: torch.dtype = torch.float32) -> torch.Tensor:
    """Dequantize a `converters.records.Grid` (duck-typed: .params, .codes, .packed): a Triton kernel when one is
    chosen (kernels/triton/route.py), else the torch / C path below; the trace notes which ran."""
    from .triton.route import dequantize_routed

    return dequantize_routed(grid, dtype, _dequantize_grid_here)


def _dequantize_grid_here(grid, dtype: torch.dtype = torch.float32) -> torch.Tensor:
    """The torch / C dequantization of a grid where its tensors are."""
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
    if (packed is not None and packed.layout == "gptq-rows" and packed.bits in (2, 4, 8)
            and p.compute_dtype == torch.float32 and not packed.words.is_cuda
            and os.environ.get("QCONVERT_KERNELS", "auto").lower() != "triton"):
        from .ggml import kquant_c

        if kquant_c.available():  # the words straight to float32 in C (same values), no uint8 codes in between
            w = _dequantize_gptq_c(kquant_c, packed, p)
            return w if dtype == w.dtype else w.to(dtype)
    if kernel_backend(probe) == "triton" and p.compute_dtype == torch.float32:
        from .triton.dequant import dequantize_grid_triton, dequantize_gptq_words_triton

        if (packed is not None and packed.layout == "gptq-rows" and packed.bits in (2, 4, 8)
                and p.mins is None):
            return dequantize_gptq_words_triton(packed.words, packed.bits, p.scales, p.zeros, p.group_size,
                                                p.g_idx, dtype)
        return dequantize_grid_triton(grid.codes, p.scales, p.zeros, p.group_size, p.g_idx, dtype, mins=p.mins)
    return dequantize_grid_torch(grid.codes, p.scales, p.zeros, p.group_size, p.g_idx, dtype,
                                 mins=p.mins, compute_dtype=p.compute_dtype)
