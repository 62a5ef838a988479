"""ggml's 1- and 2-bit block types Q1_0, Q2_0, TQ1_0 and TQ2_0 (ggml-common.h block_q1_0, block_q2_0, block_tq1_0,
block_tq2_0): unpacked into codes and one fp16 scale per block, decoded as ggml's dequantize_row_* decode, and
quantized as ggml's quantize_row_*_ref (the C twin in kquant_c.c).

Every one of them is a uniform grid `d * (q - z)` with 2-bit codes, which is how the GGUF reader hands them on:

- Q1_0 (type 41, 128-value blocks of fp16 `d` + 16 bytes of sign bits, bit j of byte j/8): w = +d for a set bit,
  -d otherwise. As a grid: codes 3 and 1 around the zero point 2, so the codes are already GPTQ 2-bit symmetric
  codes (and Q4_0's 9 and 7 after a shift of 6).
- Q2_0 (type 42, 64-value blocks of fp16 `d` + 2-bit codes, value j at bits 2*(j%4) of byte j/4): w = (q - 1) * d,
  q - 1 in {-1, 0, 1, 2}. PrismML's llama.cpp fork writes 128-value blocks (fp16 `d` + 32 bytes) under the same
  type id; the GGUF reader tells them apart by the tensor's byte size (`Q2_0_PRISM`).
- TQ2_0 (type 35, 256-value blocks of 64 bytes of 2-bit codes, then fp16 `d`): byte m of each 32-byte half holds
  values m, m+32, m+64, m+96 of that half's 128 at bits 0, 2, 4, 6; w = (q - 1) * d.
- TQ1_0 (type 34, 256-value blocks of 48 bytes of five trits each, 4 bytes of four trits, then fp16 `d`): a byte
  holds its trits as the fraction t/243 scaled to 256 (ceil), the first trit most significant; trit n of byte
  m comes back as ((uint8)(byte * 3**n) * 3) >> 8; w = (q - 1) * d with q in {0, 1, 2}.

Decoding as `d * (q - z)` in float32 gives ggml's values bit for bit: (q - z) is a small integer, so
`((int)q - 1) * d` and `(q - z) * d` are the same product.
"""

from __future__ import annotations

import numpy as np

from .layouts import LOWBIT_LAYOUTS, Q2_0_PRISM, BlockLayout

__all__ = ["ZERO_POINT", "unpack_lowbit", "dequantize_lowbit", "quantize_lowbit", "q2_0_layout_for_size"]

# the grid's zero point per type: Q1_0's signs are the codes 1 / 3 around 2, the others' codes are q with w = (q-1)*d
ZERO_POINT = {"Q1_0": 2, "Q2_0": 1, "TQ1_0": 1, "TQ2_0": 1}
_POW3 = np.array([1, 3, 9, 27, 81], dtype=np.uint8)


def _trits(b: np.ndarray, count: int) -> np.ndarray:
    """uint8 [..., k] -> uint8 [..., count, k]: trit n of each byte (n = 0 the most significant)."""
    q = (b[..., None, :].astype(np.uint16) * _POW3[:count, None]) & 0xFF  # the uint8 product of ggml
    return ((q * 3) >> 8).astype(np.uint8)


def unpack_lowbit(lay: BlockLayout, data: np.ndarray) -> tuple[np.ndarray, np.ndarray]:
    """uint8 [rows, row_bytes] -> (codes uint8 [rows, n] in 0..3, fp16 block scales [rows, n / block])."""
    data = np.ascontiguousarray(data, dtype=np.uint8)
    rows = data.shape[0]
    b = data.reshape(rows, -1, lay.nbytes)
    nblk = b.shape[1]
    if lay.name == "Q1_0":
        d = b[..., 0:2]
        bits = np.unpackbits(b[..., 2:], axis=-1, bitorder="little")  # bit j of byte j/8 -> value j
        codes = 1 + 2 * bits
    elif lay.name == "Q2_0":
        d = b[..., 0:2]
        qs = b[..., 2:]
        codes = (qs[..., :, None] >> np.array([0, 2, 4, 6], np.uint8)) & 3  # value j: byte j/4, bits 2*(j%4)
    elif lay.name == "TQ2_0":
        d = b[..., 64:66]
        qs = b[..., :64].reshape(rows, nblk, 2, 1, 32)
        codes = (qs >> np.array([0, 2, 4, 6], np.uint8)[:, None]) & 3  # [half, l, m]: value 128*half + 32*l + m
    elif lay.name == "TQ1_0":
        d = b[..., 52:54]
        first = _trits(b[..., 0:32], 5)  # [5, 32]: value 32*n + m
        second = _trits(b[..., 32:48], 5)  # [5, 16]: value 160 + 16*n + m
        third = _trits(b[..., 48:52], 4)  # [4, 4]: value 240 + 4*n + j
        codes = np.concatenate([first.reshape(rows, nblk, -1), second.reshape(rows, nblk, -1),
                                third.reshape(rows, nblk, -1)], axis=-1)
    else:
        raise KeyError(f"{lay.name} is not a 1- or 2-bit ggml type")
    scales = np.ascontiguousarray(d).view(np.float16).reshape(rows, nblk)
    return codes.reshape(rows, nblk * lay.block).astype(np.uint8), scales


def dequantize_lowbit(lay: BlockLayout, data: np.ndarray) -> np.ndarray:
    """uint8 [rows, row_bytes] -> float32 [rows, n], ggml's dequantize_row_* values bit for bit."""
    codes, scales = unpack_lowbit(lay, data)
    rows, n = codes.shape
    if lay.name == "Q1_0":  # ggml: bit ? d : -d (a NaN d keeps ggml's sign bits too)
        # times 1: a signalling-NaN fp16 comes out of ggml's (F16C) conversion quiet, out of numpy's as it was
        d = np.repeat(scales.astype(np.float32) * np.float32(1), lay.block, axis=1)
        return np.where(codes == 3, d, -d)
    q = codes.reshape(rows, -1, lay.block).astype(np.float32) - np.float32(ZERO_POINT[lay.name])
    return (q * scales.astype(np.float32)[..., None]).reshape(rows, n)


def quantize_lowbit(x: np.ndarray, type_name: str, threads: int = 1) -> np.ndarray:
    """float32 [rows, n] -> uint8 [rows, row_bytes], the bytes of ggml's quantize_row_*_ref (kquant_c.c; these types
    take no importance matrix: ggml's quantize_q1_0 / _q2_0 pass it over, the TQ quantizers ignore it)."""
    from . import kquant_c

    if not kquant_c.available():
        raise RuntimeError(f"the {type_name} quantizer is C (kernels/ggml/kquant_c.c) and no C compiler is available")
    return kquant_c.quantize_lowbit(x, type_name.upper(), threads)


def q2_0_layout_for_size(n_elements: int, nbytes: int) -> BlockLayout | None:
    """The Q2_0 layout whose size a tensor of `n_elements` taking `nbytes` (its data extent, alignment padding
    included or not) has: upstream's 64-value blocks or PrismML's 128-value ones; None when neither fits or both
    do (a tensor too small to tell)."""
    fits = []
    for lay in (LOWBIT_LAYOUTS["Q2_0"], Q2_0_PRISM):
        if n_elements % lay.block == 0 and nbytes == n_elements // lay.block * lay.nbytes:
            fits.append(lay)
    return fits[0] if len(fits) == 1 else None
