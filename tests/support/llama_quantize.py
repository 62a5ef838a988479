"""llama.cpp's quantize tool (llama_model_quantize, through llama-cpp-python), the oracle of the GGUF presets,
the IQ types and the float grids' Q4_K_M: importing this module skips a test module where llama_cpp is not
installed."""

from __future__ import annotations

import ctypes
from pathlib import Path

import numpy as np
import pytest

llama_cpp = pytest.importorskip("llama_cpp")


def llama_quantize(src: Path, dst: Path, ftype: int, imatrix: dict[str, np.ndarray] | None = None,
                   allow_requantize: bool = False) -> Path:
    """llama.cpp's quantize tool (llama_model_quantize), optionally with importance data passed the way
    llama-quantize passes it (a NULL-terminated array of {name, data, size}); `allow_requantize`: its
    --allow-requantize (a source tensor already quantized, DeepSeek-V4's MXFP4 experts, is requantized)."""
    params = llama_cpp.llama_model_quantize_default_params()
    params.ftype = ftype
    params.allow_requantize = allow_requantize
    params.nthread = 2
    keep = []
    if imatrix:
        entry_t = llama_cpp.llama_model_imatrix_data
        arr = (entry_t * (len(imatrix) + 1))()
        for i, (name, vec) in enumerate(imatrix.items()):
            data = np.ascontiguousarray(vec, np.float32)
            keep.append((name.encode(), data))
            arr[i].name = keep[-1][0]
            arr[i].data = data.ctypes.data_as(ctypes.POINTER(ctypes.c_float))
            arr[i].size = data.size
        arr[len(imatrix)].name = None
        params.imatrix = ctypes.cast(arr, ctypes.POINTER(entry_t))
        keep.append(arr)
    rc = llama_cpp.llama_model_quantize(str(src).encode(), str(dst).encode(), ctypes.byref(params))
    assert rc == 0, f"llama_model_quantize failed ({rc})"
    return dst
