"""IQ4_XS (ggml type 23): IQ4_NL's 16-value table under 6-bit sub-block scales, 4.25 bits per weight.

A super-block covers 256 consecutive values of a row in 136 bytes (ggml-common.h block_iq4_xs): fp16 `d`,
uint16 `scales_h`, 4 bytes `scales_l`, 128 bytes of nibbles. Its eight 32-blocks each have a 6-bit scale
`ls` (low 4 bits: nibble ib % 2 of scales_l[ib / 2]; high 2 bits: bits 2*ib of scales_h), and their nibbles
are laid out as IQ4_NL's (byte j of block ib: code j low, code j + 16 high). A value decodes as
`(d * (ls - 32)) * KVALUES[code]` in float32 (ggml-quants.c dequantize_row_iq4_xs; gguf-py quants.IQ4_XS).

`quantize_iq4_xs` reproduces ggml's `quantize_iq4_xs` (ggml-quants.c, llama-cpp-python 0.3.36's vendored
llama.cpp), which is what `ggml_quantize_chunk(GGML_TYPE_IQ4_XS, ...)` and so llama-quantize run, with or
without an importance matrix. Per super-block, quantize_row_iq4_nl_impl(256, 32, ..., ntry=7):

- weights as for IQ4_NL, except that with an imatrix sigma2 = 2/256 * sum(x*x) over the whole super-block
  (kernels/iq4_nl.block_weights);
- each 32-block gets IQ4_NL's float32 scale search (iq4_nl.block_scales: GROUP_MAX_EPS, 15 trials), C's
  scales[ib]; a dead block's scale is 0;
- `max_scale` is the first scales[ib] of largest magnitude (C's `fabsf(d) > amax_scale` from 0: NaN never
  wins; none above 0 leaves it +0), the super-block scale is d = -max_scale/32 (so an all-zero super-block
  stores d = -0.0, fp16 0x8000), and each block's 6-bit scale is l = nearest_int(id * scales[ib]) clamped
  to [-32, 31], id = 1/d (0 when d is 0). nearest_int is C's float trick (add 1.5 * 2**23, keep the low
  mantissa bits), reproduced on the bits, so even the inf/NaN products of degenerate blocks match;
- the codes are chosen again with the scale as stored: best_index(x / (d*l)) (0 when d*l is 0), and l + 32
  is packed into scales_l / scales_h.

Exactness: the shared steps are IQ4_NL's (float32 in C's association order, sums element after element,
exact midpoint test: see kernels/ggml/iq4_nl.py); the rest is a few float32 operations per super-block done in
the same order (`-max_scale/32`, `1/d`, `id*scales[ib]`, `d*l`, `1/dl`, `idl*x`). The C library that
llama-cpp-python ships is built for baseline x86-64 without FMA contraction, so plain float32 numpy gives
the same bytes (tests/kernels/test_iq4_xs.py compares with ggml_quantize_chunk). NaN inputs are not reproduced
(as for IQ4_NL: np.argmax takes a NaN as the largest |x|, C's comparison skips it).

Speed: the whole band of rows at once, bands from a thread pool (iq4_nl.quantize_bands); the super-block
step adds a handful of array operations to IQ4_NL's work. Measured on 2048x4096 float32 (N(0, 0.02)), one
thread, best of 3: 0.62 s without an imatrix, 0.64 s with one; ggml's C 1.9 s / 2.0 s. (On that machine
IQ4_NL's kernel took 0.66 s and its C 2.3 s: a faster machine than the one iq4_nl.py's figures come from.)
"""

from __future__ import annotations

import numpy as np

from .iq4_nl import BLOCK, KVALUES, best_index, block_scales, block_weights, pack_nibbles, quantize_bands

__all__ = ["SUPER_BLOCK", "SUPER_BLOCK_BYTES", "quantize_iq4_xs", "dequantize_iq4_xs"]

F32 = np.float32
SUPER_BLOCK = 256  # QK_K
_SUBS = SUPER_BLOCK // BLOCK  # 8 scales per super-block
SUPER_BLOCK_BYTES = 2 + 2 + _SUBS // 2 + SUPER_BLOCK // 2  # d, scales_h, scales_l[4], qs[128]: 136
_VALUES_F32 = KVALUES.astype(F32)
_ROUND_MAGIC = F32(12582912.0)  # 1.5 * 2**23: nearest_int's addend


def nearest_int(f: np.ndarray) -> np.ndarray:
    """ggml-quants.c nearest_int elementwise: float32 f + 1.5*2**23, then the low 23 bits of the sum minus
    2**22. For |f| < 2**22 that is f rounded half to even; for anything else (C asserts against it only in
    debug builds) it is the same bits C computes, so inf and NaN products give C's l too."""
    bits = (np.asarray(f, F32) + _ROUND_MAGIC).view(np.int32)
    return (bits & 0x007FFFFF) - 0x00400000


def quantize_iq4_xs(x: np.ndarray, imatrix: np.ndarray | None = None, threads: int | None = None) -> np.ndarray:
    """float32 [rows, n] (n a multiple of 256) -> uint8 [rows, n // 256 * 136], ggml's quantize_iq4_xs bytes.
    imatrix: [n] importance per column (llama-quantize --imatrix), or None. Bands of rows are quantized from
    `threads` threads (default: the usable CPUs, at most 8); the bytes do not depend on the split."""
    from ..dispatch import note_kernel  # the report's "kernel": no Triton twin of this quantizer

    note_kernel("quantize", "numpy")
    return quantize_bands(x, imatrix, threads, "IQ4_XS", SUPER_BLOCK, SUPER_BLOCK_BYTES, _quantize_band)


def _quantize_band(x: np.ndarray, qw: np.ndarray | None) -> np.ndarray:
    """The bytes of a few whole rows (quantize_iq4_xs: super-block i of a row takes qw[256*i:])."""
    rows, n = x.shape
    nsup = rows * (n // SUPER_BLOCK)
    with np.errstate(all="ignore"):  # inf/NaN follow IEEE as in C
        X, W = block_weights(x, qw, SUPER_BLOCK)
        scales = block_scales(X, W).reshape(nsup, _SUBS)  # C's scales[ib], super-block-major
        # max_scale: the first scale of largest magnitude; `abs_d > amax_scale` starts from 0 and is false for
        # NaN, so NaN counts as 0 and nothing above 0 leaves max_scale = +0 (not a -0 scale)
        mag = np.abs(scales)
        mag = np.where(np.isnan(mag), F32(0), mag)
        first = np.argmax(mag, axis=1)
        rows_ix = np.arange(nsup)
        max_scale = np.where(mag[rows_ix, first] > 0, scales[rows_ix, first], F32(0)).astype(F32)
        d = (-max_scale / F32(32)).astype(F32)
        inv = np.where(d != 0, F32(1) / np.where(d != 0, d, F32(1)), F32(0)).astype(F32)  # `d ? 1/d : 0.f`
        ls = np.clip(nearest_int(inv[:, None] * scales), -32, 31)  # MAX(-32, MIN(31, l))
        dl = (d[:, None] * ls.astype(F32)).astype(F32)  # the block's scale as dequantization will see it
        idl = np.where(dl != 0, F32(1) / np.where(dl != 0, dl, F32(1)), F32(0)).astype(F32)
        L = best_index(idl.reshape(1, -1) * X)  # the second pass: codes from the stored scale, [32, blocks]
    l6 = (ls + 32).astype(np.uint16)  # 0..63
    out = np.empty((nsup, SUPER_BLOCK_BYTES), np.uint8)
    out[:, 0:2] = d.astype(np.float16).view(np.uint8).reshape(nsup, 2)
    # scales_h: 2 high bits of block ib at bits 2*ib; little-endian uint16 as ggml stores it on x86
    high = ((l6 >> 4) << (2 * np.arange(_SUBS, dtype=np.uint16))).sum(axis=1, dtype=np.uint16)
    out[:, 2:4] = high.astype("<u2").view(np.uint8).reshape(nsup, 2)
    low = (l6 & 0xF).astype(np.uint8)
    out[:, 4:8] = low[:, 0::2] | (low[:, 1::2] << 4)  # scales_l[ib/2]: even block low nibble, odd high
    out[:, 8:] = pack_nibbles(L).reshape(nsup, SUPER_BLOCK // 2)
    return out.reshape(rows, -1)


def dequantize_iq4_xs(data: np.ndarray, n: int) -> np.ndarray:
    """uint8 [rows, n // 256 * 136] -> float32 [rows, n]: (d * (ls - 32)) * KVALUES[code], in float32 in that
    order, as gguf-py and ggml's dequantize_row_iq4_xs decode."""
    rows = data.shape[0]
    blocks = np.ascontiguousarray(data).reshape(-1, SUPER_BLOCK_BYTES)
    nsup = blocks.shape[0]
    d = blocks[:, 0:2].copy().view(np.float16).astype(F32)  # [nsup, 1]
    high = blocks[:, 2:4].copy().view("<u2").astype(np.int32)  # [nsup, 1]
    low = blocks[:, 4:8].astype(np.int32)
    ib = np.arange(_SUBS)
    ls = ((low[:, ib // 2] >> (4 * (ib % 2))) & 0xF) | (((high >> (2 * ib)) & 3) << 4)  # [nsup, 8]
    dl = d * (ls - 32).astype(F32)  # [nsup, 8]
    qs = blocks[:, 8:].reshape(nsup, _SUBS, 16)
    codes = np.concatenate([qs & 0x0F, qs >> 4], axis=2)  # [nsup, 8, 32]
    return (dl[:, :, None] * _VALUES_F32[codes]).reshape(rows, n)
