"""Kernels: bit packing, dequantization and quantization as pure functions over tensors.

Each operation is a vectorized torch function that runs on any device torch supports; the grid
dequantization also has Triton twins (kernels/triton_dequant.py) with the same float32 results, used
for CUDA tensors when Triton is installed. `QCONVERT_KERNELS=torch|triton|auto` overrides the choice
(`triton` on CPU tensors needs TRITON_INTERPRET=1: that is how the tests compare the two paths).
This package imports neither `converters` nor `formats`.

The compute device (`use_device`, what `--device` sets for a conversion) and the kernel trace
(`kernel_trace`, which path dequantized and quantized each tensor: the report's "kernel") live here;
kernels/triton_route.py holds the one dispatch per path that sends a tensor to a Triton kernel.
"""

from __future__ import annotations

import contextvars
import os
import re
from contextlib import contextmanager
from functools import lru_cache

import torch

from .dequant import (dequantize_axis0_torch, dequantize_codebook_torch, dequantize_grid_torch,
                      dequantize_two_step_torch)

__all__ = ["dequantize_grid", "kernel_backend", "usable_cpus", "resolve_device", "use_device", "compute_device",
           "kernel_trace", "note_kernel", "triton_device"]


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


# --- the compute device and the kernel trace --------------------------------------------------------------

# the device is process-wide (a writer's worker threads see it too); the trace follows the thread recording it
_DEVICE: dict[str, torch.device | None] = {"device": None}
_TRACE: contextvars.ContextVar = contextvars.ContextVar("qconvert_kernel_trace", default=None)
_DEVICE_NAME = re.compile(r"^(cpu|auto|cuda(:\d+)?)$")


def resolve_device(name: str | None) -> torch.device:
    """`--device cpu|cuda|cuda:N|auto` -> a torch.device (auto: the first CUDA device when torch sees one,
    else the CPU). A device that is absent raises ValueError with a one-line reason."""
    text = (name or "cpu").strip().lower()
    if not _DEVICE_NAME.match(text):
        raise ValueError(f"--device expects cpu, cuda, cuda:N or auto, got {name!r}")
    if text == "auto":
        return torch.device("cuda") if torch.cuda.is_available() else torch.device("cpu")
    dev = torch.device(text)
    if dev.type == "cuda":
        if not torch.cuda.is_available():
            raise ValueError(f"--device {text}: torch sees no CUDA device here (use --device cpu or auto)")
        if dev.index is not None and dev.index >= torch.cuda.device_count():
            raise ValueError(f"--device {text}: torch sees {torch.cuda.device_count()} CUDA device(s)")
    return dev


@contextmanager
def use_device(device):
    """Within the block, the kernels' dispatch points move each tensor they work on to `device` (a CUDA device;
    None or the CPU: where the tensors already are), one tensor at a time, and give the results back on the
    caller's device."""
    dev = None if device is None else torch.device(device)
    before = _DEVICE["device"]
    _DEVICE["device"] = None if dev is None or dev.type == "cpu" else dev
    try:
        yield dev
    finally:
        _DEVICE["device"] = before


def compute_device() -> torch.device | None:
    """The accelerator `use_device` chose, or None (the CPU: tensors stay where they are)."""
    return _DEVICE["device"]


@contextmanager
def kernel_trace():
    """Collect, for the work done inside the block, which path ran each stage: {"dequantize": ["triton"],
    "quantize": ["c"]} (several entries when parts of one tensor took different paths)."""
    trace: dict[str, list[str]] = {}
    token = _TRACE.set(trace)
    try:
        yield trace
    finally:
        _TRACE.reset(token)


def note_kernel(stage: str, path: str) -> None:
    """Record that `path` ("triton", "torch", "c", "numpy") ran `stage` ("dequantize", "quantize", "repack") of
    the tensor being traced (no-op outside kernel_trace)."""
    trace = _TRACE.get()
    if trace is not None:
        paths = trace.setdefault(stage, [])
        if path not in paths:
            paths.append(path)


def triton_device(tensor: torch.Tensor | None = None) -> torch.device | None:
    """Where a Triton kernel should run for `tensor` (None: no Triton). QCONVERT_KERNELS=torch: never;
    =triton: on the compute device, else the tensor's own (a CPU tensor needs TRITON_INTERPRET=1); auto: on a
    CUDA compute device, or on the tensor's CUDA device."""
    mode = os.environ.get("QCONVERT_KERNELS", "auto").lower()
    if mode == "torch":
        return None
    dev = compute_device()
    if dev is None and tensor is not None and tensor.is_cuda:
        dev = tensor.device
    # decided before importing Triton (half a second a process): on the CPU in auto mode it is never needed
    if (mode != "triton" and dev is None) or not _triton_importable():
        return None
    return dev if dev is not None else (tensor.device if tensor is not None else torch.device("cpu"))


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
    chosen (kernels/triton_route.py), else the torch / C path below; the trace notes which ran."""
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
