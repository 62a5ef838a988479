"""IQ3_S (ggml type 21): groups of 4 values on a 512-point lattice codebook with signs apart, 3.4375 bits per weight;
and IQ3_XXS (type 18), its 256-point sibling (at the end of the module).

A super-block covers 256 consecutive values of a row in 110 bytes (ggml-common.h block_iq3_s): fp16 `d`, 64 bytes
`qs` (the low 8 bits of a grid index per group of 4), 8 bytes `qh` (bit k of byte ib: the 9th bit of group k of
32-block ib), 32 bytes `signs` (bit i of byte 4*ib + k: the sign of value 8*k + i of block ib) and 4 bytes of
4-bit block scales s (block ib in nibble ib % 2 of byte ib / 2). A value decodes as
`(d * (1 + 2*s)) * grid[index][j] * (-1 if its sign bit else 1)` in float32 (ggml-quants.c dequantize_row_iq3_s;
gguf-py quants.IQ3_S), the grid values odd integers 1..15 (kernels/ggml/iq_lattice.py, from kernels/ggml/iq_grids.py).

`quantize_iq3_s` reproduces ggml's `quantize_iq3_s` (ggml-quants.c, llama-cpp-python 0.3.36's vendored llama.cpp),
which `ggml_quantize_chunk(GGML_TYPE_IQ3_S, ...)` and so llama-quantize run, with or without an importance matrix.
Per 32-block, quantize_row_iq3_s_impl(32, ...):

- weights w = x*x, or with an imatrix qw * sqrt(sigma2 + x*x), sigma2 = 2*sum(x*x)/256 over the super-block;
  waux = sqrt(w) weighs the neighbour search; the signs are taken off (|x|, C's `x >= 0` test) and stored apart;
- a block whose largest |x| is 0 keeps scale 0 and writes nothing (see the quirk below);
- 19 trial scales id = (15 + is*0.2)/max, is = -9..9: codes l = nearest_int(0.5*(id*|x| - 1)) clamped to 0..7,
  each group of 4 taken as the grid point it packs to, or off the grid its best neighbour at scale 1/id; the
  trial is kept when sumqx^2 > best*sumq2 (sumqx = sum(w*|x|*q), sumq2 = sum(w*q*q), q = 2*l + 1), scale =
  sumqx/sumq2 (the start: max/15);
- when a group of the kept trial was off the grid (and the scale is positive), once more from id = 1/scale, the
  neighbours searched at that scale, and scale = sumqx/sumq2 refitted; a negative scale flips the signs;
- the super-block: d = max_scale/31, stored as fp16(d*1.033), each block's 4-bit s = nearest_int(0.5*(scale/d - 1))
  clamped to 0..15 (id = 1/d first); with max_scale 0, d = 0 and the scales are 0.

C's quirk, reproduced: a dead block (largest |x| 0) `continue`s before its qs and signs pointers advance, so the
groups and signs of the blocks after it land one block earlier and the super-block's last slots stay 0; its qh
bits (indexed by the block) are 0. Such a super-block decodes wrongly in llama.cpp too (a 32-block of zeros in a
live super-block of weights is rare in real models).

Exactness: every float32 expression in C's association order, every sum element after element (seq_sum), the
neighbour search as kernels/ggml/iq_lattice.py; the C library llama-cpp-python ships is built for baseline x86-64
without FMA contraction, so plain float32 numpy gives the same bytes (tests/kernels/test_iq3_s.py compares with
ggml_quantize_chunk). Inputs where C aborts (its GGML_ASSERTs: no neighbour of finite error, a NaN scale: values
whose squares or weighted sums overflow float32) raise ValueError here; NaN inputs are not reproduced.

Speed: the default CPU path is the C twin, kernels/ggml/iq_c.c (same bytes; docs/benchmarks.md); this numpy code is
the reference and the fallback (no C compiler, QCONVERT_COMPILE=0): all live blocks of a band of rows at once (Python loops over the 19 trials, the 32 positions of a sum and
the 4 coordinates of a distance), the neighbour candidates of every off-grid group in one flat array; bands from
a thread pool (iq4_nl.quantize_bands). Timings: README.md.
"""

from __future__ import annotations

import numpy as np

from . import iq_c
from .iq4_nl import quantize_bands
from .iq_lattice import (decode_values, even_signs, lattice, lattice_weights, parity_sign_values, positive_scales,
                         search_blocks, sign_bytes, super_scales)

__all__ = ["SUPER_BLOCK", "SUPER_BLOCK_BYTES", "quantize_iq3_s", "dequantize_iq3_s", "IQ3_XXS_BYTES",
           "quantize_iq3_xxs", "dequantize_iq3_xxs"]

F32 = np.float32
SUPER_BLOCK = 256  # QK_K
BLOCK = 32  # IQ3S_BLOCK_SIZE
_SUBS = SUPER_BLOCK // BLOCK  # 8 blocks
_GROUPS = BLOCK // 4  # 8 groups of 4 per block
SUPER_BLOCK_BYTES = 2 + SUPER_BLOCK // 4 + SUPER_BLOCK // 32 + SUPER_BLOCK // 8 + SUPER_BLOCK // 64  # 110
_KMAXQ = 8


def quantize_iq3_s(x: np.ndarray, imatrix: np.ndarray | None = None, threads: int | None = None) -> np.ndarray:
    """float32 [rows, n] (n a multiple of 256) -> uint8 [rows, n // 256 * 110], ggml's quantize_iq3_s bytes.
    imatrix: [n] importance per column (llama-quantize --imatrix), or None. Bands of rows are quantized from
    `threads` threads (default: the usable CPUs, at most 8); the bytes do not depend on the split."""
    from ..dispatch import note_kernel  # the report's "kernel": no Triton twin of this quantizer

    out = iq_c.c_twin(x, imatrix, "IQ3_S", threads)  # the C twin by default (same bytes), numpy without it
    if out is not None:
        return out
    note_kernel("quantize", "numpy")
    return quantize_bands(x, imatrix, threads, "IQ3_S", SUPER_BLOCK, SUPER_BLOCK_BYTES, _quantize_band)


def _quantize_band(x: np.ndarray, qw: np.ndarray | None) -> np.ndarray:
    """The bytes of a few whole rows (quantize_iq3_s; super-block i of a row takes qw[256*i:])."""
    rows, n = x.shape
    nsup = rows * (n // SUPER_BLOCK)
    nb = nsup * _SUBS
    with np.errstate(all="ignore"):  # inf/NaN follow IEEE as in C
        X, W = lattice_weights(x, qw, BLOCK)  # x*x, or qw * sqrtf(sigma2 + x*x), sigma2 = 2*sumx2/256
        neg = ~(X >= 0)  # C stores a sign where `x >= 0` fails
        XV = np.where(neg, -X, X)  # xval
        mx = XV.max(axis=0)
        live = np.flatnonzero(mx != 0)  # `if (!max)`: a dead block keeps scale 0 and writes nothing
        scale, GI = search_blocks(lattice("IQ3_S"), XV[:, live], W[:, live], mx[live], kmaxq=_KMAXQ, step=0.2,
                                  refine="all")
        scale, flip = positive_scales(scale, "quantize_iq3_s")
        scales = np.zeros(nb, F32)
        scales[live] = scale
        grid = np.zeros((_GROUPS, nb), np.int32)
        grid[:, live] = GI
        if flip.any():
            neg[:, live[flip]] = ~neg[:, live[flip]]
        dh, ls = super_scales(scales.reshape(nsup, _SUBS), 1.033)  # fp16(d*1.033), 4-bit block scales

    out = np.zeros((nsup, SUPER_BLOCK_BYTES), np.uint8)
    out[:, 0:2] = dh.view(np.uint8).reshape(nsup, 2)
    gblk = grid.T  # [nb, 8]: the 8 group indices of each block
    qs = (gblk & 0xFF).astype(np.uint8)
    qh = ((gblk >> 8) << np.arange(_GROUPS)).sum(axis=1).astype(np.uint8)  # bit k: group k's 9th bit
    signs = sign_bytes(neg)  # [nb, 4]: bit i of byte k the sign of value 8k + i
    # a dead block does not advance C's qs / signs pointers: the live blocks' bytes fill the slots in order
    alive = np.zeros(nb, bool)
    alive[live] = True
    alive = alive.reshape(nsup, _SUBS)
    slot = (np.cumsum(alive, axis=1) - 1 + _SUBS * np.arange(nsup)[:, None]).reshape(-1)[live]
    qs_out = np.zeros((nb, _GROUPS), np.uint8)
    qs_out[slot] = qs[live]
    signs_out = np.zeros((nb, 4), np.uint8)
    signs_out[slot] = signs[live]
    qh = np.where(alive.reshape(-1), qh, 0)
    out[:, 2:66] = qs_out.reshape(nsup, 64)
    out[:, 66:74] = qh.reshape(nsup, 8)
    out[:, 74:106] = signs_out.reshape(nsup, 32)
    out[:, 106:110] = (ls[:, 0::2] | (ls[:, 1::2] << 4)).astype(np.uint8)
    return out.reshape(rows, -1)


def dequantize_iq3_s(data: np.ndarray, n: int) -> np.ndarray:
    """uint8 [rows, n // 256 * 110] -> float32 [rows, n]: ((d * (1 + 2*s)) * grid value) * sign, in float32 in that
    order, as gguf-py and ggml's dequantize_row_iq3_s decode."""
    rows = data.shape[0]
    blocks = np.ascontiguousarray(data).reshape(-1, SUPER_BLOCK_BYTES)
    nsup = blocks.shape[0]
    d = blocks[:, 0:2].copy().view(np.float16).astype(F32)  # [nsup, 1]
    qs = blocks[:, 2:66].astype(np.int32)
    qh = (blocks[:, 66:74, None] >> np.arange(8, dtype=np.uint8)) & 1  # [nsup, 8 blocks, 8 groups]
    index = qs | (qh.reshape(nsup, 64).astype(np.int32) << 8)  # [nsup, 64 groups]
    sc = blocks[:, 106:110, None] >> np.array([0, 4], np.uint8)
    s = (sc & 0x0F).reshape(nsup, _SUBS)
    db = d * (1 + 2 * s).astype(F32)  # [nsup, 8]
    values = lattice("IQ3_S").values[index].reshape(nsup, _SUBS, BLOCK)
    sign_bits = (blocks[:, 74:106, None] >> np.arange(8, dtype=np.uint8)) & 1
    sign = np.where(sign_bits == 0, F32(1), F32(-1)).reshape(nsup, _SUBS, BLOCK)
    return (db[:, :, None] * values * sign).reshape(rows, n)


# ---------------------------------------------------------------------------------------------------------
# IQ3_XXS (ggml type 18, 3.0625 bpw): a super-block of 256 values in 98 bytes (ggml-common.h block_iq3_xxs): fp16
# `d`, 64 bytes of 8-bit grid indices (group k of 32-block ib at byte 8*ib + k; the 256-point grid), then one uint32
# per 32-block: its four groups of 8 values' 7 sign bits (bits 7*k .. 7*k + 6; the 8th implied by even parity) and
# its 4-bit scale s in bits 28..31. A value decodes as `((d * (0.5 + s)) * 0.5) * grid[index][j] * sign`, the
# grid's coordinates 4, 12, .., 52, 62 (iq3xxs_grid; gguf-py quants.IQ3_XXS).
#
# quantize_iq3_xxs (quantize_row_iq3_xxs_impl(256, ...)) is IQ3_S's search with these differences: the signs are
# even_signs' (a group of 8 with an odd number of negatives flips its value of least w*x*x, whose |x| enters the
# search negated); a block below GROUP_MAX_EPS_IQ3_XXS (1e-8) is dead (no pointer quirk: its bytes stay 0);
# 31 trials is = -15..15; groups start "on the grid" and the refinement recodes only the off-grid ones; d is
# stored as fp16(d*1.0125); a super-block whose max_scale is 0 has all 96 bytes after d cleared. An importance
# matrix is optional for the kernel (llama-quantize requires one but for the embeddings and the output).

IQ3_XXS_BYTES = 98
_EPS_IQ3_XXS = F32(1e-8)  # GROUP_MAX_EPS_IQ3_XXS


def quantize_iq3_xxs(x: np.ndarray, imatrix: np.ndarray | None = None, threads: int | None = None) -> np.ndarray:
    """float32 [rows, n] (n a multiple of 256) -> uint8 [rows, n // 256 * 98], ggml's quantize_iq3_xxs bytes.
    imatrix: [n] importance per column, or None. Bands of rows as quantize_iq3_s."""
    from ..dispatch import note_kernel  # the report's "kernel": no Triton twin of this quantizer

    out = iq_c.c_twin(x, imatrix, "IQ3_XXS", threads)  # the C twin by default (same bytes), numpy without it
    if out is not None:
        return out
    note_kernel("quantize", "numpy")
    return quantize_bands(x, imatrix, threads, "IQ3_XXS", SUPER_BLOCK, IQ3_XXS_BYTES, _iq3_xxs_band)


def _iq3_xxs_band(x: np.ndarray, qw: np.ndarray | None) -> np.ndarray:
    rows, n = x.shape
    nsup = rows * (n // SUPER_BLOCK)
    nb = nsup * _SUBS
    with np.errstate(all="ignore"):
        X, W = lattice_weights(x, qw, BLOCK)  # x*x, or qw * sqrtf(sigma2 + x*x), sigma2 = 2*sumx2/256
        neg, XV, mx = even_signs(X, W)
        live = np.flatnonzero(~(mx < _EPS_IQ3_XXS))
        scale, GI = search_blocks(lattice("IQ3_XXS"), XV[:, live], W[:, live], mx[live], kmaxq=_KMAXQ, step=0.2,
                                  refine="off", trials=15)
        scale, flip = positive_scales(scale, "quantize_iq3_xxs")
        scales = np.zeros(nb, F32)
        scales[live] = scale
        if flip.any():
            neg[:, live[flip]] = ~neg[:, live[flip]]
        dh, ls = super_scales(scales.reshape(nsup, _SUBS), 1.0125)
    grid = np.zeros((_GROUPS, nb), np.int32)
    grid[:, live] = GI
    s7 = (sign_bytes(neg).astype(np.uint32) & 127) << (7 * np.arange(4, dtype=np.uint32))  # [nb, 4]
    alive = np.zeros(nb, bool)
    alive[live] = True
    words = np.where(alive, s7.sum(axis=1, dtype=np.uint32), 0).reshape(nsup, _SUBS)  # a dead block's signs: 0
    words |= ls.astype(np.uint32) << 28
    out = np.zeros((nsup, IQ3_XXS_BYTES), np.uint8)
    out[:, 0:2] = dh.view(np.uint8).reshape(nsup, 2)
    out[:, 2:66] = grid.T.reshape(nsup, 64)
    out[:, 66:98] = words.astype("<u4").view(np.uint8)
    out[scales.reshape(nsup, _SUBS).max(axis=1) == 0, 2:] = 0  # max_scale 0: C clears the quants
    return out.reshape(rows, -1)


def dequantize_iq3_xxs(data: np.ndarray, n: int) -> np.ndarray:
    """uint8 [rows, n // 256 * 98] -> float32 [rows, n] as gguf-py and ggml's dequantize_row_iq3_xxs decode:
    ((d * (0.5 + s)) * 0.5) * grid value * sign, in float32 in that order."""
    rows = data.shape[0]
    b = np.ascontiguousarray(data).reshape(-1, IQ3_XXS_BYTES)
    nsup = b.shape[0]
    d = b[:, 0:2].copy().view(np.float16).astype(F32)
    words = b[:, 66:98].copy().view("<u4")  # [nsup, 8]
    db = d * (F32(0.5) + (words >> 28).astype(F32)) * F32(0.5)
    values = decode_values("IQ3_XXS")[b[:, 2:66]].reshape(nsup, _SUBS, BLOCK)
    s7 = ((words[:, :, None] >> (7 * np.arange(4, dtype=np.uint32))) & 127).astype(np.int64)  # [nsup, 8, 4]
    return (db[:, :, None] * values * parity_sign_values(s7).reshape(nsup, _SUBS, BLOCK)).reshape(rows, n)
