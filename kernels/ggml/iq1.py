"""The IQ1 types: 1.56-1.75 bits per weight, the quants of the giant MoE models' smallest GGUFs. Each value is one
of three levels {-1, 0, +1} shifted by a delta of +-0.125, groups of 8 levels index ggml's 2048-point grid
(kgrid_1bit_2048, kernels/ggml/iq_grids.py), under 3-bit block scales. Written byte for byte as ggml's quantizers
(ggml-quants.c quantize_iq1_s / quantize_iq1_m of llama-cpp-python 0.3.36's vendored llama.cpp, which
ggml_quantize_chunk and so llama-quantize run) write them, by the C of kernels/ggml/iq_c.c (the algorithm is
described there).

IQ1_S (ggml type 19, 1.5625 bpw; block_iq1_s, 50 bytes a 256-block): fp16 d, 32 bytes of grid index lows (4
groups of 8 per 32-block), 8 uint16 qh (per 32-block: the 4 groups' 3 high index bits, the 3-bit block scale at
bit 12, the delta's sign at bit 15). ggml asserts an importance matrix.

IQ1_M (type 29, 1.75 bpw; block_iq1_m, 56 bytes): 32 bytes of index lows, 16 bytes qh (per 16-block: the 2 groups'
high index bits in its nibbles, each group's delta sign at bits 3 / 7), 4 uint16 of 3-bit scales of the 16-blocks,
the fp16 super-block scale in their top nibbles. ggml's quantizer runs without an importance matrix too (weights
x*x); llama-quantize refuses to make either type without one (formats/gguf/schemes.py imatrix_refusal).

No numpy twin: without a C compiler (or with QCONVERT_COMPILE=0) these writers raise, in one line. The decoders
(dequantize_iq1_s / _iq1_m: ggml's dequantize_row_iq1_* values) are C where it is built and gguf-py's numpy
decoder otherwise, the same float32 values either way (tests/kernels/test_iq1.py).
"""

from __future__ import annotations

import numpy as np

from . import iq_c

__all__ = ["IQ1_BYTES", "quantize_iq1_s", "quantize_iq1_m", "dequantize_iq1_s", "dequantize_iq1_m"]

IQ1_BYTES = {"IQ1_S": 50, "IQ1_M": 56}


def _quantize(x: np.ndarray, imatrix: np.ndarray | None, type_name: str, threads: int | None) -> np.ndarray:
    out = iq_c.c_twin(x, imatrix, type_name, threads)
    if out is None:
        raise RuntimeError(f"{type_name} is written by kernels/ggml/iq_c.c only, which needs a C compiler (cc, gcc "
                           "or clang; QCONVERT_COMPILE=0 turns it off)")
    return out


def quantize_iq1_s(x: np.ndarray, imatrix: np.ndarray | None = None, threads: int | None = None) -> np.ndarray:
    """float32 [rows, n] (n a multiple of 256) -> uint8 [rows, n // 256 * 50], ggml's quantize_iq1_s bytes.
    imatrix: [n] importance per column, required (ggml asserts it)."""
    if imatrix is None:
        raise ValueError("IQ1_S needs an importance matrix: ggml asserts one (ggml_quantize_chunk's "
                         "GGML_ASSERT(imatrix != NULL), quantize_iq1_s's GGML_ASSERT(quant_weights))")
    return _quantize(x, imatrix, "IQ1_S", threads)


def quantize_iq1_m(x: np.ndarray, imatrix: np.ndarray | None = None, threads: int | None = None) -> np.ndarray:
    """float32 [rows, n] (n a multiple of 256) -> uint8 [rows, n // 256 * 56], ggml's quantize_iq1_m bytes.
    imatrix: [n] importance per column, or None (ggml's quantizer then weighs by x*x)."""
    return _quantize(x, imatrix, "IQ1_M", threads)


def _dequantize(data: np.ndarray, n: int, type_name: str, threads: int | None) -> np.ndarray:
    data = np.ascontiguousarray(data, dtype=np.uint8).reshape(-1, n // 256 * IQ1_BYTES[type_name])
    if iq_c.available():
        from ..dispatch import usable_cpus

        return iq_c.dequantize_iq1(data, type_name, min(8, usable_cpus()) if threads is None else max(1, threads))
    import gguf  # the readable reference: gguf-py's numpy decoder, the same values

    return np.asarray(gguf.quants.dequantize(data, gguf.GGMLQuantizationType[type_name]), np.float32).reshape(-1, n)


def dequantize_iq1_s(data: np.ndarray, n: int, threads: int | None = None) -> np.ndarray:
    """uint8 [rows, n // 256 * 50] -> float32 [rows, n], ggml's dequantize_row_iq1_s values."""
    return _dequantize(data, n, "IQ1_S", threads)


def dequantize_iq1_m(data: np.ndarray, n: int, threads: int | None = None) -> np.ndarray:
    """uint8 [rows, n // 256 * 56] -> float32 [rows, n], ggml's dequantize_row_iq1_m values."""
    return _dequantize(data, n, "IQ1_M", threads)
