"""llama.cpp's own quantizer, `ggml_quantize_chunk`, called through ctypes from the C library that
llama-cpp-python ships (llama_cpp/lib/libggml-base.so). Optional: used by `--quantizer llama.cpp`, by
the benchmark and by tests as the byte-exact oracle; nothing else needs llama-cpp-python.

ctypes releases the GIL during the call, so row ranges quantized from a thread pool run in parallel.
"""

from __future__ import annotations

import ctypes
from concurrent.futures import ThreadPoolExecutor
from functools import lru_cache
from pathlib import Path

import numpy as np

from .layouts import IQ1_LAYOUTS, TARGET_LAYOUTS

__all__ = ["available", "ggml_quantize", "ggml_dequantize", "library_path"]


def library_path() -> Path | None:
    try:
        import llama_cpp
    except ImportError:
        return None
    lib = Path(llama_cpp.__file__).parent / "lib" / "libggml-base.so"
    return lib if lib.exists() else None


def available() -> bool:
    return library_path() is not None


@lru_cache(maxsize=1)
def _lib():
    path = library_path()
    if path is None:
        raise RuntimeError("llama.cpp's quantizer needs llama-cpp-python (pip install llama-cpp-python)")
    lib = ctypes.CDLL(str(path))
    f = lib.ggml_quantize_chunk
    f.restype = ctypes.c_size_t
    f.argtypes = [ctypes.c_int, ctypes.c_void_p, ctypes.c_void_p, ctypes.c_int64, ctypes.c_int64,
                  ctypes.c_int64, ctypes.c_void_p]
    lib.ggml_quantize_init.argtypes = [ctypes.c_int]
    lib.ggml_quantize_init.restype = None
    return lib


def ggml_quantize(x: np.ndarray, type_name: str, imatrix: np.ndarray | None = None, threads: int = 1) -> np.ndarray:
    """float32 [rows, n] -> uint8 [rows, row_bytes] from ggml_quantize_chunk (imatrix: [n] or None),
    rows split over `threads` threads."""
    from ..dispatch import note_kernel  # the report's "kernel": no Triton twin of this quantizer

    note_kernel("quantize", "llama.cpp")
    lay = {**TARGET_LAYOUTS, **IQ1_LAYOUTS}[type_name.upper()]  # grid, codebook (IQ4_NL) and IQ1 types alike
    x = np.ascontiguousarray(x, dtype=np.float32)
    rows, n = x.shape
    out = np.empty((rows, lay.row_bytes(n)), np.uint8)
    qw = None if imatrix is None else np.ascontiguousarray(imatrix, dtype=np.float32)
    if qw is not None and qw.size != n:
        raise ValueError(f"imatrix has {qw.size} values, the rows have {n} columns")
    lib = _lib()
    lib.ggml_quantize_init(lay.ggml_type)

    def run(start: int, stop: int) -> None:
        # ggml_quantize_chunk's `start` is an element offset into src and dst alike
        lib.ggml_quantize_chunk(lay.ggml_type, x.ctypes.data, out.ctypes.data, start * n, stop - start, n,
                                None if qw is None else qw.ctypes.data)

    if threads <= 1 or rows < 2:
        run(0, rows)
        return out
    bounds = np.linspace(0, rows, threads + 1).astype(int)
    with ThreadPoolExecutor(threads) as pool:
        list(pool.map(lambda i: run(bounds[i], bounds[i + 1]), range(threads)))
    return out


def ggml_dequantize(data: np.ndarray, type_name: str, n: int) -> np.ndarray:
    """uint8 [rows, row_bytes] of `type_name` blocks -> float32 [rows, n] from ggml's own dequantize_row_<type>
    (the oracle the readers are checked against, for the types gguf-py cannot decode or decodes its own way)."""
    lay = {**TARGET_LAYOUTS, **IQ1_LAYOUTS}[type_name.upper()]
    data = np.ascontiguousarray(data, dtype=np.uint8)
    rows = data.shape[0]
    if data.shape[1] != lay.row_bytes(n):
        raise ValueError(f"{type_name} rows of {n} take {lay.row_bytes(n)} bytes, not {data.shape[1]}")
    f = getattr(_lib(), f"dequantize_row_{lay.name.lower()}")
    f.restype = None
    f.argtypes = [ctypes.c_void_p, ctypes.c_void_p, ctypes.c_int64]
    out = np.empty((rows, n), np.float32)
    f(data.ctypes.data, out.ctypes.data, rows * n)  # rows are whole blocks: one call over them all
    return out
