"""IQ4_NL (ggml type 20): 4-bit codes that index a fixed non-linear table of 16 int8 values.

A block covers 32 consecutive values of a row in 18 bytes (ggml-common.h block_iq4_nl): fp16 `d`, then
16 bytes of nibbles, byte j holding code j in its low and code j + 16 in its high nibble. A value decodes
as `d * KVALUES[code]` (ggml-quants.c dequantize_row_iq4_nl; gguf-py quants.IQ4_NL the same, in float32).

`quantize_iq4_nl` reproduces ggml's `quantize_iq4_nl` (ggml-quants.c, llama-cpp-python 0.3.36's vendored
llama.cpp), which is what `ggml_quantize_chunk(GGML_TYPE_IQ4_NL, ...)` and so llama-quantize run, with or
without an importance matrix. Per block, quantize_row_iq4_nl_impl(32, 32, ..., ntry=7):

- weights w = x*x, or with an imatrix qw * sqrt(sigma2 + x*x), sigma2 = 2/32 * sum(x*x);
- blocks whose largest |x| is below GROUP_MAX_EPS (1e-15) get d = 0 (and every code 8, the table's
  nearest entry to 0*x);
- otherwise `max` is the first value of largest magnitude, a first scale d = max/127 picks codes by the
  nearest table entry to x/d (best_index_int8: ties go to the upper entry), d is refitted as
  sum(w*q*x)/sum(w*q*q), and 15 more inverse scales (itry - 127)/max, itry = -7..7, are tried, each kept
  when it lowers the weighted error (sumqx^2 > best * sumq2); the codes are then chosen again from the
  final float32 d (not its fp16 rounding).

Exactness: the float32 expressions are evaluated in C's association order ((w*q)*x), and every
per-block sum is accumulated element after element as C does. The C library llama-cpp-python ships is
built for baseline x86-64 (no FMA contraction; see kernels/ggml/kquants.py), so plain float32 numpy gives
the same bytes (tests/kernels/test_iq_vs_ggml.py compares with ggml_quantize_chunk). ggml's other entry point,
quantize_row_iq4_nl_ref (ntry = -1, used by no converter), is not reproduced, nor are NaN inputs (C's
`fabsf(x) > amax` skips a NaN, np.argmax takes it as the largest).

Speed: every block of a band of rows is processed at once (Python loops only over the 16 scale trials
and the 32 positions of a sum), bands from a thread pool; the nearest entry is a count of midpoints
(best_index). Measured on 2048x4096 float32: 3.6 s on one thread, 2.0 s on two (ggml's C, one thread: 4.4 s).

IQ4_XS (kernels/ggml/iq4_xs.py) runs the same quantize_row_iq4_nl_impl over 256-element super-blocks, so the
per-32-block steps live here for both: `block_weights` (C's weight[], sigma2 taken over the super-block),
`block_scales` (the scale search), `best_index`, `pack_nibbles` and the banded driver `quantize_bands`.
"""

from __future__ import annotations

from concurrent.futures import ThreadPoolExecutor

import numpy as np

from ..dispatch import usable_cpus

__all__ = ["KVALUES", "BLOCK", "BLOCK_BYTES", "best_index", "seq_sum", "block_weights", "block_scales",
           "pack_nibbles", "quantize_bands", "quantize_iq4_nl", "dequantize_iq4_nl"]

F32 = np.float32
BLOCK = 32
BLOCK_BYTES = 2 + BLOCK // 2
# ggml-common.h kvalues_iq4nl
KVALUES = np.array([-127, -104, -83, -65, -49, -35, -22, -10, 1, 13, 25, 38, 53, 69, 89, 113], dtype=np.int8)
_VALUES_F32 = KVALUES.astype(F32)
_MIDPOINTS = (_VALUES_F32[1:] + _VALUES_F32[:-1]) / F32(2)  # -115.5, -93.5, ..., 101: exact in float32
_GROUP_MAX_EPS = F32(1e-15)  # ggml-quants.c GROUP_MAX_EPS
_NTRY = 7  # quantize_iq4_nl passes ntry = 7
_BAND_VALUES = 1 << 18  # values per band of rows: work arrays of a few MiB stay in cache


def best_index(x: np.ndarray) -> np.ndarray:
    """ggml-quants.c best_index_int8(16, kvalues_iq4nl, x) elementwise: the nearest table entry, ties to
    the upper one; C's binary search sends NaN to 15.

    C decides between neighbours a < b by `x - a < b - x` in float32. That equals `x < (a + b) / 2`
    (the midpoints are half-integers, exact in float32): rounding is monotonic, so the float32 test can
    only differ where both differences round to one value, i.e. within an ulp of the midpoint, and there
    both are exact (each midpoint is at least as large in magnitude as its half-gap, or in the same
    binade, so x - a is a multiple of ulp(x - a)). So the index is the count of midpoints <= x
    (tests/kernels/test_iq4_nl.py checks this against C's formula near every midpoint, and the bytes against ggml)."""
    acc = (x >= _MIDPOINTS[0]).view(np.uint8).copy()
    for m in _MIDPOINTS[1:]:
        acc += (x >= m).view(np.uint8)
    nan = np.isnan(x)
    if nan.any():
        acc[nan] = 15
    return acc


def seq_sum(p: np.ndarray) -> np.ndarray:
    """Sum over axis 0 (the positions of a block, element-major) one element after another, as C's
    `for (j...) s += p[j]` does (0 + p[0] is p[0] exactly)."""
    acc = p[0].copy()
    for j in range(1, p.shape[0]):
        acc += p[j]
    return acc


def _fit(X: np.ndarray, W: np.ndarray, inv_scale: np.ndarray) -> tuple[np.ndarray, np.ndarray, np.ndarray]:
    """Codes for x * inv_scale, and C's sumqx = sum(w*q*x), sumq2 = sum(w*q*q) over each block."""
    L = best_index(inv_scale * X)
    Q = _VALUES_F32[L]
    WQ = W * Q
    return L, seq_sum(WQ * X), seq_sum(WQ * Q)


def block_scales(X: np.ndarray, W: np.ndarray) -> np.ndarray:
    """float32 d per 32-block: the first loop of quantize_row_iq4_nl_impl (ntry = 7), C's scales[ib]; for
    IQ4_NL (one 32-block per call) the block's d itself. X, W: [32, blocks]; dead blocks get 0."""
    A = np.abs(X)
    first = np.argmax(A, axis=0)  # C keeps the first |x| that is strictly larger: the first maximum
    cols = np.arange(X.shape[1])
    amax = A[first, cols]
    mx = X[first, cols]
    live = amax >= _GROUP_MAX_EPS
    mx_safe = np.where(live, mx, F32(1))  # dead blocks get d = 0 below; avoid 1/0 noise for them
    d = -mx_safe / _VALUES_F32[0]
    _, sumqx, sumq2 = _fit(X, W, F32(1) / d)
    d = np.where(sumq2 > 0, sumqx / np.where(sumq2 > 0, sumq2, F32(1)), F32(0)).astype(F32)
    best = d * sumqx
    for itry in range(-_NTRY, _NTRY + 1):
        inv = F32(itry + int(KVALUES[0])) / mx_safe
        _, sumqx, sumq2 = _fit(X, W, inv)
        better = (sumq2 > 0) & (sumqx * sumqx > best * sumq2)
        d_try = sumqx / np.where(better, sumq2, F32(1))
        d = np.where(better, d_try, d)
        best = np.where(better, d_try * sumqx, best)
    return np.where(live, d, F32(0)).astype(F32)


def block_weights(x: np.ndarray, qw: np.ndarray | None, super_block: int) -> tuple[np.ndarray, np.ndarray]:
    """A band of whole rows x [rows, n] -> (X, W), both [32, blocks] element-major (block b = row-major
    32-block b of the band): the values, and quantize_row_iq4_nl_impl's weight[] for them. Without an
    imatrix W = x*x; with one W = qw * sqrt(sigma2 + x*x), where sigma2 = 2/super_block * sum(x*x) runs
    over the whole super-block (32 values for IQ4_NL, 256 for IQ4_XS), in C's element order, and 32-block
    i of a row takes qw[32*i:] (C offsets quant_weights by the super-block, then by the block in it)."""
    rows, n = x.shape
    X = np.ascontiguousarray(x.reshape(-1, BLOCK).T)  # element-major: C's sums run down axis 0
    X2 = X * X
    if qw is None:
        return X, X2
    per = super_block // BLOCK
    # [super_block, super-blocks]: position j of the super-block is element j % 32 of its block j // 32
    S2 = X2 if per == 1 else \
        np.ascontiguousarray(X2.reshape(BLOCK, -1, per).transpose(2, 0, 1)).reshape(super_block, -1)
    sigma2 = seq_sum(S2) * (F32(2) / F32(super_block))  # 2/32 and 2/256 are exact in float32
    if per > 1:
        sigma2 = np.repeat(sigma2, per)  # each 32-block sees its super-block's
    QW = np.tile(qw.reshape(-1, BLOCK), (rows, 1)).T  # each block's 32 importances, element-major
    return X, QW * np.sqrt(sigma2 + X2)


def pack_nibbles(L: np.ndarray) -> np.ndarray:
    """Codes [32, blocks] -> [blocks, 16] bytes: byte j holds code j low and code j + 16 high (the q4[]
    loop at the end of quantize_row_iq4_nl_impl; block_iq4_nl.qs and each 32 of block_iq4_xs.qs)."""
    return (L[:16] | (L[16:] << 4)).T


def quantize_bands(x: np.ndarray, imatrix: np.ndarray | None, threads: int | None, name: str, block: int,
                   block_bytes: int, band_fn) -> np.ndarray:
    """The driver both types share: checks the row length and the imatrix, then fills [rows, row bytes] with
    band_fn(rows x[start:stop], qw) -> bytes, over bands of rows from `threads` threads (default: the usable
    CPUs, at most 8; numpy releases the GIL in its array operations). Every (super-)block is independent,
    so the bytes do not depend on the split."""
    x = np.asarray(x, dtype=F32)
    rows, n = x.shape
    if n % block:
        raise ValueError(f"row of {n} elements is not a multiple of {name}'s block of {block}")
    qw = None
    if imatrix is not None:
        qw = np.ascontiguousarray(imatrix, dtype=F32).reshape(-1)
        if qw.size != n:
            raise ValueError(f"imatrix has {qw.size} values, the rows have {n} columns")
    out = np.empty((rows, n // block * block_bytes), np.uint8)
    band_rows = max(1, _BAND_VALUES // n)
    starts = range(0, rows, band_rows)

    def band(start: int) -> None:
        stop = min(rows, start + band_rows)
        out[start:stop] = band_fn(x[start:stop], qw)

    threads = min(8, usable_cpus()) if threads is None else max(1, int(threads))
    if threads == 1 or len(starts) < 2:
        for start in starts:
            band(start)
    else:
        with ThreadPoolExecutor(threads) as pool:
            list(pool.map(band, starts))
    return out


def quantize_iq4_nl(x: np.ndarray, imatrix: np.ndarray | None = None, threads: int | None = None) -> np.ndarray:
    """float32 [rows, n] (n a multiple of 32) -> uint8 [rows, n // 32 * 18], ggml's quantize_iq4_nl bytes.
    imatrix: [n] importance per column (llama-quantize --imatrix), or None. Bands of rows are quantized
    from `threads` threads (default: the usable CPUs, at most 8; numpy releases the GIL in its array
    operations); every block is independent, so the bytes do not depend on the split."""
    from ..dispatch import note_kernel  # the report's "kernel": no Triton twin of this quantizer

    note_kernel("quantize", "numpy")
    return quantize_bands(x, imatrix, threads, "IQ4_NL", BLOCK, BLOCK_BYTES, _quantize_band)


def _quantize_band(x: np.ndarray, qw: np.ndarray | None) -> np.ndarray:
    """The bytes of a few whole rows (quantize_iq4_nl's blocks; block i of a row takes qw[32*i:])."""
    rows, n = x.shape
    nb = rows * (n // BLOCK)
    with np.errstate(all="ignore"):  # inf/NaN follow IEEE as in C
        X, W = block_weights(x, qw, BLOCK)  # a super-block of one 32-block
        d = block_scales(X, W)
        # quantize_row_iq4_nl_impl's one-block branch: dh = fp16(scales[0]), codes again from the float32 d
        inv = np.where(d != 0, F32(1) / np.where(d != 0, d, F32(1)), F32(0)).astype(F32)
        L = best_index(inv * X)  # [32, blocks]
    out = np.empty((nb, BLOCK_BYTES), np.uint8)
    out[:, :2] = d.astype(np.float16).view(np.uint8).reshape(nb, 2)
    out[:, 2:] = pack_nibbles(L)
    return out.reshape(rows, -1)


def dequantize_iq4_nl(data: np.ndarray, n: int) -> np.ndarray:
    """uint8 [rows, n // 32 * 18] -> float32 [rows, n]: d * KVALUES[code], as gguf-py and ggml decode."""
    rows = data.shape[0]
    blocks = np.ascontiguousarray(data).reshape(-1, BLOCK_BYTES)
    d = blocks[:, :2].copy().view(np.float16).astype(F32)  # [blocks, 1]
    qs = blocks[:, 2:]
    codes = np.concatenate([qs & 0x0F, qs >> 4], axis=1)  # low nibbles are codes 0..15, high 16..31
    return (d * _VALUES_F32[codes]).reshape(rows, n)
