"""Where the kernels run and which path ran them: the compute device (`use_device`, what `--device` sets for a
conversion), the backend choice (QCONVERT_KERNELS=torch|triton|auto), and the kernel trace (`kernel_trace`,
which path dequantized and quantized each tensor: the report's "kernel"). A leaf module: every kernel imports
it, and it imports no kernel."""

from __future__ import annotations

import contextvars
import os
import re
from contextlib import contextmanager
from functools import lru_cache

import torch

__all__ = ["usable_cpus", "kernel_backend", "resolve_device", "use_device", "compute_device", "kernel_trace",
           "note_kernel", "triton_device", "triton_importable", "current_trace"]


def usable_cpus() -> int:
    """The CPUs this process may run on (its affinity mask on Linux, else every CPU): what thread pools
    and worker counts are sized to."""
    return len(os.sched_getaffinity(0)) if hasattr(os, "sched_getaffinity") else (os.cpu_count() or 1)


@lru_cache(maxsize=1)
def triton_importable() -> bool:
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
    return "triton" if triton_importable() else "torch"


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


def current_trace() -> dict | None:
    """The trace being recorded in this thread ({stage: [paths]}), or None outside kernel_trace."""
    return _TRACE.get()


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
    if (mode != "triton" and dev is None) or not triton_importable():
        return None
    return dev if dev is not None else (tensor.device if tensor is not None else torch.device("cpu"))
