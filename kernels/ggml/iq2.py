"""The IQ2 types: groups of 8 values on a lattice codebook of 2-bit coordinates, signs apart, 2.06-2.56 bits per
weight. Each reproduces ggml's quantizer (ggml-quants.c of llama-cpp-python 0.3.36's vendored llama.cpp), which
`ggml_quantize_chunk` and so llama-quantize run; the search is kernels/ggml/iq_lattice.py's, shared with IQ3_S.

IQ2_S (ggml type 22, 2.5625 bpw): a super-block covers 256 values in 82 bytes (ggml-common.h block_iq2_s): fp16
`d`, 32 bytes `qs` (the low 8 bits of a 10-bit grid index per group of 8, group i8 = 2*ib + k of 16-block ib),
32 bytes of signs (one per group: bit i the sign of value i), 8 bytes `qh` (bits 2*(i8 % 4) of byte i8 / 4: the
index's high 2 bits) and 8 bytes of 4-bit scales s (16-block ib in nibble ib % 2 of byte ib / 2). A value
decodes as `((d * (0.5 + s)) * 0.25) * grid[index][j] * sign` in float32, the grid's coordinates 8, 25, 43 (codes
0, 1, 2; ggml-common.h iq2s_grid, gguf-py quants.IQ2_S). quantize_iq2_s (quantize_row_iq2_s_impl), per 16-block:

- weights qw * sqrt(sigma2 + x*x) with an imatrix, 0.25*sigma2 + x*x without (sigma2 = 2*sum(x*x)/256 over the
  super-block); a block whose largest |x| is below GROUP_MAX_EPS_IQ2_S (1e-8) keeps scale 0 and writes nothing;
- the scale search of iq_lattice.search_blocks with kMaxQ = 3 (codes 0..2 on the 1, 3, 5 lattice), 19 trials
  id = (5 + is*0.1)/max, groups starting "on the grid" (a block no trial improves keeps grid point 0 and is not
  refined), the refinement recoding only the groups that were off the grid; the 1024-point grid's neighbour
  lists hold the points at the nearest distance only (nwant = 1);
- d = max_scale/31 stored as fp16(d*0.9875), s = nearest_int(0.5*(scale/d - 1)) in 0..15.

IQ2_XS (type 17, 2.3125 bpw; block_iq2_xs, 74 bytes): fp16 `d`, a little-endian uint16 per group of 8 (a 9-bit
index into the 512-point grid, and 7 sign bits above it: the 8th sign is their parity, ggml's ksigns_iq2xs) and 8
bytes of 4-bit scales of the 16-blocks; decoded as IQ2_S. quantize_iq2_xs (quantize_row_iq2_xs_impl) differs from
IQ2_S in: an importance matrix is required (ggml asserts it); sigma2 = sum(x*x)/256; the signs are
iq_lattice.even_signs' (a group with an odd number of negatives flips its value of least w*x*x, whose |x| enters
the search negated); blocks below GROUP_MAX_EPS (1e-15) are dead; d is stored as fp16(d); a super-block whose
max_scale is 0 has all its uint16 cleared.

IQ2_XXS (type 16, 2.0625 bpw; block_iq2_xxs, 66 bytes): fp16 `d`, then per 32-block two little-endian uint32: the
four 8-bit indices of its groups of 8 (the 256-point grid), and their four 7-bit signs (bits 7*k..) under its 4-bit
scale s (bits 28..31); a value decodes as `((d * (0.5 + s)) * 0.25) * grid[index][j] * sign`. quantize_iq2_xxs
(quantize_row_iq2_xxs_impl), per 32-block: IQ2_XS's weights, signs and dead test; the start is make_qp_quants(32,
4, xval, L, weight) (kernels/ggml/kquants.py's, the K quantizers' scale search), a block whose eff_max = 3*scale is
not positive being dead too; 13 trials id = (5 + is*0.1)/eff_max, is = -6..6, then every group recoded from the
kept scale (when positive); d stored as fp16(d); max_scale 0 clears the super-block's words.

The default CPU path is the C twin, kernels/ggml/iq_c.c (same bytes; this numpy code is the reference and the
fallback without a C compiler or with QCONVERT_COMPILE=0). Exactness and limits as kernels/ggml/iq3_s.py: float32 in C's association order, sums element by element, inputs
where C aborts raise ValueError, NaN inputs not reproduced. Speed (2048x4096 with an imatrix, one thread, README):
numpy takes 4-8x ggml's C time; the neighbour lists of the 2-bit grids are long (IQ2_XS: about 58 candidates a
group searched on weight-like data), each candidate costing a handful of array operations per coordinate.
"""

from __future__ import annotations

import numpy as np

from . import iq_c
from .iq4_nl import quantize_bands
from .iq_lattice import (decode_values, even_signs, lattice, lattice_weights, parity_sign_values, positive_scales,
                         search_blocks, sign_bytes, signs_and_values, super_scales)

__all__ = ["IQ2_BYTES", "quantize_iq2_s", "dequantize_iq2_s", "quantize_iq2_xs", "dequantize_iq2_xs",
           "quantize_iq2_xxs", "dequantize_iq2_xxs"]

F32 = np.float32
SUPER_BLOCK = 256  # QK_K
IQ2_BYTES = {"IQ2_S": 82, "IQ2_XS": 74, "IQ2_XXS": 66}
_EPS_IQ2_S = F32(1e-8)  # GROUP_MAX_EPS_IQ2_S
_EPS = F32(1e-15)  # GROUP_MAX_EPS (IQ2_XS, IQ2_XXS)


def quantize_iq2_s(x: np.ndarray, imatrix: np.ndarray | None = None, threads: int | None = None) -> np.ndarray:
    """float32 [rows, n] (n a multiple of 256) -> uint8 [rows, n // 256 * 82], ggml's quantize_iq2_s bytes.
    imatrix: [n] importance per column, or None. Bands of rows from `threads` threads, as quantize_iq3_s."""
    from ..dispatch import note_kernel  # the report's "kernel": no Triton twin of this quantizer

    out = iq_c.c_twin(x, imatrix, "IQ2_S", threads)  # the C twin by default (same bytes), numpy without it
    if out is not None:
        return out
    note_kernel("quantize", "numpy")
    return quantize_bands(x, imatrix, threads, "IQ2_S", SUPER_BLOCK, IQ2_BYTES["IQ2_S"], _iq2_s_band)


def _iq2_s_band(x: np.ndarray, qw: np.ndarray | None) -> np.ndarray:
    rows, n = x.shape
    nsup = rows * (n // SUPER_BLOCK)
    nb = nsup * 16  # 16-blocks
    with np.errstate(all="ignore"):
        X, W = lattice_weights(x, qw, 16, plain="sigma2")
        neg, XV, mx = signs_and_values(X)
        live = np.flatnonzero(~(mx < _EPS_IQ2_S))
        scale, GI = search_blocks(lattice("IQ2_S"), XV[:, live], W[:, live], mx[live], kmaxq=3, step=0.1,
                                  refine="off")
        scale, flip = positive_scales(scale, "quantize_iq2_s")
        scales = np.zeros(nb, F32)
        scales[live] = scale
        if flip.any():
            neg[:, live[flip]] = ~neg[:, live[flip]]
        dh, ls = super_scales(scales.reshape(nsup, 16), 0.9875)
    grid = np.zeros((2, nb), np.int32)
    grid[:, live] = GI
    signs = np.where(_alive(nb, live)[:, None], sign_bytes(neg), 0)  # a dead block writes no signs
    g = grid.T.reshape(nsup, 32)  # group i8 = 2*ib + k of each super-block
    out = np.zeros((nsup, IQ2_BYTES["IQ2_S"]), np.uint8)
    out[:, 0:2] = dh.view(np.uint8).reshape(nsup, 2)
    out[:, 2:34] = g & 0xFF
    out[:, 34:66] = signs.reshape(nsup, 32)
    out[:, 66:74] = ((g >> 8).reshape(nsup, 8, 4) << (2 * np.arange(4))).sum(axis=2)
    out[:, 74:82] = ls[:, 0::2] | (ls[:, 1::2] << 4)
    return out.reshape(rows, -1)


def quantize_iq2_xs(x: np.ndarray, imatrix: np.ndarray | None = None, threads: int | None = None) -> np.ndarray:
    """float32 [rows, n] (n a multiple of 256) -> uint8 [rows, n // 256 * 74], ggml's quantize_iq2_xs bytes.
    imatrix: [n] importance per column, required (ggml asserts it). Bands of rows as quantize_iq2_s."""
    from ..dispatch import note_kernel  # the report's "kernel": no Triton twin of this quantizer

    if imatrix is None:
        raise ValueError("IQ2_XS needs an importance matrix: ggml asserts one (ggml_quantize_chunk's "
                         "GGML_ASSERT(imatrix != NULL), quantize_iq2_xs's GGML_ASSERT(quant_weights))")
    out = iq_c.c_twin(x, imatrix, "IQ2_XS", threads)  # the C twin by default (same bytes), numpy without it
    if out is not None:
        return out
    note_kernel("quantize", "numpy")
    return quantize_bands(x, imatrix, threads, "IQ2_XS", SUPER_BLOCK, IQ2_BYTES["IQ2_XS"], _iq2_xs_band)


def _iq2_xs_band(x: np.ndarray, qw: np.ndarray) -> np.ndarray:
    rows, n = x.shape
    nsup = rows * (n // SUPER_BLOCK)
    nb = nsup * 16
    with np.errstate(all="ignore"):
        X, W = lattice_weights(x, qw, 16, sigma2_factor=1)  # sigma2 = sumx2/256
        neg, XV, mx = even_signs(X, W)
        live = np.flatnonzero(~(mx < _EPS))
        scale, GI = search_blocks(lattice("IQ2_XS"), XV[:, live], W[:, live], mx[live], kmaxq=3, step=0.1,
                                  refine="off")
        scale, flip = positive_scales(scale, "quantize_iq2_xs")
        scales = np.zeros(nb, F32)
        scales[live] = scale
        if flip.any():
            neg[:, live[flip]] = ~neg[:, live[flip]]
        dh, ls = super_scales(scales.reshape(nsup, 16), 1.0)  # fp16(d)
    grid = np.zeros((2, nb), np.int32)
    grid[:, live] = GI
    q2 = (grid.T.reshape(-1) | (sign_bytes(neg).reshape(-1).astype(np.int32) & 127) << 9).astype("<u2")
    q2 = np.where(_alive(nb, live).repeat(2), q2, 0).reshape(nsup, 32)  # a dead block's entries stay 0
    q2[scales.reshape(nsup, 16).max(axis=1) == 0] = 0  # max_scale 0: C clears the super-block's qs
    out = np.zeros((nsup, IQ2_BYTES["IQ2_XS"]), np.uint8)
    out[:, 0:2] = dh.view(np.uint8).reshape(nsup, 2)
    out[:, 2:66] = q2.view(np.uint8)
    out[:, 66:74] = ls[:, 0::2] | (ls[:, 1::2] << 4)
    return out.reshape(rows, -1)


def dequantize_iq2_xs(data: np.ndarray, n: int) -> np.ndarray:
    """uint8 [rows, n // 256 * 74] -> float32 [rows, n] as gguf-py and ggml's dequantize_row_iq2_xs decode:
    ((d * (0.5 + s)) * 0.25) * grid value * sign, the 8th sign of a group its 7 stored ones' parity."""
    rows = data.shape[0]
    b = np.ascontiguousarray(data).reshape(-1, IQ2_BYTES["IQ2_XS"])
    nsup = b.shape[0]
    d = b[:, 0:2].copy().view(np.float16).astype(F32)
    q2 = b[:, 2:66].copy().view("<u2").astype(np.int32)  # [nsup, 32]
    s = (b[:, 66:74, None] >> np.array([0, 4], np.uint8)) & 0xF
    db = d * (F32(0.5) + s.reshape(nsup, 16).astype(F32)) * F32(0.25)
    values = decode_values("IQ2_XS")[q2 & 511].reshape(nsup, 16, 16)
    return (db[:, :, None] * values * parity_sign_values(q2 >> 9).reshape(nsup, 16, 16)).reshape(rows, n)


def quantize_iq2_xxs(x: np.ndarray, imatrix: np.ndarray | None = None, threads: int | None = None) -> np.ndarray:
    """float32 [rows, n] (n a multiple of 256) -> uint8 [rows, n // 256 * 66], ggml's quantize_iq2_xxs bytes.
    imatrix: [n] importance per column, required (ggml asserts it). Bands of rows as quantize_iq2_s."""
    from ..dispatch import note_kernel  # the report's "kernel": no Triton twin of this quantizer

    if imatrix is None:
        raise ValueError("IQ2_XXS needs an importance matrix: ggml asserts one (ggml_quantize_chunk's "
                         "GGML_ASSERT(imatrix != NULL), quantize_iq2_xxs's GGML_ASSERT(quant_weights))")
    out = iq_c.c_twin(x, imatrix, "IQ2_XXS", threads)  # the C twin by default (same bytes), numpy without it
    if out is not None:
        return out
    note_kernel("quantize", "numpy")
    return quantize_bands(x, imatrix, threads, "IQ2_XXS", SUPER_BLOCK, IQ2_BYTES["IQ2_XXS"], _iq2_xxs_band)


def _iq2_xxs_band(x: np.ndarray, qw: np.ndarray) -> np.ndarray:
    from .kquants import make_qp_quants  # the K quantizers' make_qp_quants (only IQ2_XXS needs kquants)

    rows, n = x.shape
    nsup = rows * (n // SUPER_BLOCK)
    nb = nsup * 8  # 32-blocks
    with np.errstate(all="ignore"):
        X, W = lattice_weights(x, qw, 32, sigma2_factor=1)  # sigma2 = sumx2/256
        neg, XV, mx = even_signs(X, W)
        cols = np.flatnonzero(~(mx < _EPS))
        # the start: make_qp_quants(32, kMaxQ + 1, xval, L, weight), the trials' range eff_max = 3*scale
        qp_scale, _ = make_qp_quants(np.ascontiguousarray(XV[:, cols]), 4, np.ascontiguousarray(W[:, cols]))
        eff_max = qp_scale * F32(3)
        ok = ~(eff_max <= 0)  # `if (eff_max <= 0)`: dead as well
        live = cols[ok]
        scale, GI = search_blocks(lattice("IQ2_XXS"), XV[:, live], W[:, live], eff_max[ok], kmaxq=3, step=0.1,
                                  refine="always", trials=6, start_scale=qp_scale[ok])
        scale, flip = positive_scales(scale, "quantize_iq2_xxs")
        scales = np.zeros(nb, F32)
        scales[live] = scale
        if flip.any():
            neg[:, live[flip]] = ~neg[:, live[flip]]
        dh, ls = super_scales(scales.reshape(nsup, 8), 1.0)  # fp16(d)
    grid = np.zeros((4, nb), np.uint32)
    grid[:, live] = GI
    shifts = np.arange(4, dtype=np.uint32)
    alive = _alive(nb, live)
    w0 = np.where(alive, (grid.T << (8 * shifts)).sum(axis=1, dtype=np.uint32), 0)  # 4 grid indices, a byte each
    s7 = (sign_bytes(neg).astype(np.uint32) & 127) << (7 * shifts)  # [nb, 4]
    w1 = np.where(alive, s7.sum(axis=1, dtype=np.uint32), 0) | (ls.reshape(-1).astype(np.uint32) << 28)
    words = np.stack([w0, w1], axis=1).reshape(nsup, 16)
    words[scales.reshape(nsup, 8).max(axis=1) == 0] = 0  # max_scale 0: C clears the super-block's qs
    out = np.zeros((nsup, IQ2_BYTES["IQ2_XXS"]), np.uint8)
    out[:, 0:2] = dh.view(np.uint8).reshape(nsup, 2)
    out[:, 2:66] = words.astype("<u4").view(np.uint8)
    return out.reshape(rows, -1)


def dequantize_iq2_xxs(data: np.ndarray, n: int) -> np.ndarray:
    """uint8 [rows, n // 256 * 66] -> float32 [rows, n] as gguf-py and ggml's dequantize_row_iq2_xxs decode:
    ((d * (0.5 + s)) * 0.25) * grid value * sign, s the top 4 bits of each 32-block's second word."""
    rows = data.shape[0]
    b = np.ascontiguousarray(data).reshape(-1, IQ2_BYTES["IQ2_XXS"])
    nsup = b.shape[0]
    d = b[:, 0:2].copy().view(np.float16).astype(F32)
    words = b[:, 2:66].copy().view("<u4").reshape(nsup, 8, 2)
    db = d * (F32(0.5) + (words[:, :, 1] >> 28).astype(F32)) * F32(0.25)  # [nsup, 8]
    index = b[:, 2:66].reshape(nsup, 8, 8)[:, :, :4]  # the first word's bytes: one grid index each
    values = decode_values("IQ2_XXS")[index.astype(np.int64)].reshape(nsup, 8, 32)
    s7 = ((words[:, :, 1, None] >> (7 * np.arange(4, dtype=np.uint32))) & 127).astype(np.int64)
    return (db[:, :, None] * values * parity_sign_values(s7).reshape(nsup, 8, 32)).reshape(rows, n)


def _alive(nb: int, live: np.ndarray) -> np.ndarray:
    a = np.zeros(nb, bool)
    a[live] = True
    return a


def dequantize_iq2_s(data: np.ndarray, n: int) -> np.ndarray:
    """uint8 [rows, n // 256 * 82] -> float32 [rows, n] as gguf-py and ggml's dequantize_row_iq2_s decode:
    ((d * (0.5 + s)) * 0.25) * grid value * sign, in float32 in that order."""
    rows = data.shape[0]
    b = np.ascontiguousarray(data).reshape(-1, IQ2_BYTES["IQ2_S"])
    nsup = b.shape[0]
    d = b[:, 0:2].copy().view(np.float16).astype(F32)  # [nsup, 1]
    qh = (b[:, 66:74, None] >> (2 * np.arange(4, dtype=np.uint8))) & 3  # [nsup, 8, 4]: group 4*j + l
    index = b[:, 2:34].astype(np.int32) | (qh.reshape(nsup, 32).astype(np.int32) << 8)
    s = (b[:, 74:82, None] >> np.array([0, 4], np.uint8)) & 0xF  # [nsup, 8, 2]: 16-block 2*j + h
    db = d * (F32(0.5) + s.reshape(nsup, 16).astype(F32)) * F32(0.25)  # [nsup, 16]
    values = decode_values("IQ2_S")[index].reshape(nsup, 16, 16)
    sign = np.where((b[:, 34:66, None] >> np.arange(8, dtype=np.uint8)) & 1, F32(-1), F32(1)).reshape(nsup, 16, 16)
    return (db[:, :, None] * values * sign).reshape(rows, n)


