"""Vectorized GGUF K-quant codecs (Q2_K..Q6_K, Q8_K) that reproduce llama.cpp's reference
quantizers (`quantize_row_q*_K_ref` in ggml-quants.c) byte for byte.

Every super-block covers 256 consecutive values of a row:

- Q2_K (84 B):  16 sub-blocks of 16; 4-bit scale + 4-bit min per sub-block, fp16 d and dmin,
  2-bit codes q; value = d*sc*q - dmin*m.
- Q3_K (110 B): 16 sub-blocks of 16; 6-bit signed scales (stored +32), fp16 d, 3-bit codes split
  into a high-bit mask and 2 low bits; value = d*(sc-32)*(q-4).
- Q4_K (144 B): 8 sub-blocks of 32; 6-bit scale + 6-bit min, fp16 d and dmin, 4-bit codes.
- Q5_K (176 B): as Q4_K with 5-bit codes (5th bit in qh).
- Q6_K (210 B): 16 sub-blocks of 16; int8 scales, fp16 d, 6-bit codes; value = d*sc*(q-32).
- Q8_K (292 B): fp32 d, int8 codes, int16 sums of each 16 codes (an activation format).

The byte layouts are ggml's block_q2_K .. block_q8_K structs in ggml-common.h.

Exactness. The C reference in llama-cpp-python's libggml-base.so is compiled for baseline x86-64
SSE (it contains no vfmadd instruction), so every C expression is a chain of individually rounded
float32 operations, and the code below evaluates the same expressions in the same association order
in float32 numpy (tested: 100% identical blocks). A ggml built with FMA contraction (-march=native
-ffp-contract=fast on an FMA machine) would round some a*b+c differently and could disagree on a
few near-tie blocks; that is a property of such a build, not of the algorithm.

Where C accumulates a sum over a sub-block sequentially, the data is laid out element-major, shape
(n, M) with M sub-blocks, and reduced with ``np.add.reduce(axis=0)``: numpy adds the rows one after
another into the accumulator (pairwise summation only happens along a contiguous reduction axis),
which is exactly C's order. ``nearest_int`` is C's
``fval + 1.5*2**23`` bit trick; it equals round-half-to-even (``np.rint``) for |v| < 2**22, and the
trick itself is used wherever the argument is not provably in that range. One detail of
make_qkx2_quants (ggml-quants.c) that is easy to miss: C's search overwrites its `min` when it
accepts a candidate, and later candidates use that min in `iscale*(x - min)` and `(max - min)`;
this is reproduced.

Speed. Without an importance matrix (llama-quantize's default) `quantize_k` runs the C twin of these
codecs (kernels/ggml/kquant_c.c, built once per machine where a C compiler exists: the same expressions, a
tile of 32 sub-blocks searched in the L1 cache by vectorized loops, chunks spread over a thread pool;
measured 2-7x llama.cpp's reference quantizer, Q3_K the slowest at 2.1-2.4x: scripts/bench_quantize.py). The numpy code
below is the reference that the C code and the tests follow, and the path with an importance matrix or
without a compiler: all super-blocks of a chunk are processed at once; Python loops run only over the
candidate scales of the searches (<= 21) and, for Q3_K, over the 16 positions x <= 5 coordinate-descent
passes. For tensors of >= 4M values the scale searches (make_qx_quants, make_qkx2/qkx3_quants; 80% of
the time in numpy) run as compiled loops instead (kernels/ggml/kquant_fused.py: torch.compile, the same
float32 expressions in the same order, so the same bytes), on torch's intra-op threads. Q3_K's
coordinate descent and the make_qp_quants scale quantization stay in numpy.

Importance weights (``imatrix``, one float per column of a row, as llama-quantize --imatrix passes
them): llama.cpp then switches to different, weighted algorithms (``quantize_row_q*_K_impl``) and so
does this module, byte for byte with ``ggml_quantize_chunk(type, ..., imatrix)``:
- Q2_K/Q4_K/Q5_K: weights ``qw * sqrt(sigma2 + x*x)``, make_qkx3_quants (the qkx2 search with
  rmin -0.9, rdelta 0.05, 36 steps), then the sub-block scales and mins themselves are quantized by
  make_qp_quants (a weighted search plus coordinate descent) instead of a plain max/63 rounding.
- Q3_K: make_qx_quants with the weights for the codes and again (nmax 32) for the 16 scales.
- Q6_K: make_qx_quants with the imatrix values themselves as weights.
"""

from __future__ import annotations

import os
from concurrent.futures import ThreadPoolExecutor

import numpy as np
from gguf import GGML_QUANT_SIZES, GGMLQuantizationType

from ..dispatch import usable_cpus
from . import iq_c, kquant_c, kquant_fused
from .layouts import K_TYPES as _LAYOUT_K_TYPES
from .layouts import LAYOUTS

__all__ = [
    "QK_K",
    "K_TYPES",
    "BLOCK_BYTES",
    "quantize_k",
    "default_threads",
    "dequantize_k",
    "pack_q45_K",
    "quantize_q2_K",
    "quantize_q3_K",
    "quantize_q4_K",
    "quantize_q5_K",
    "quantize_q6_K",
    "quantize_q8_K",
    "dequantize_q2_K",
    "dequantize_q3_K",
    "dequantize_q4_K",
    "dequantize_q5_K",
    "dequantize_q6_K",
    "dequantize_q8_K",
]

QK_K = 256
K_TYPES = _LAYOUT_K_TYPES  # "Q2_K" .. "Q6_K", the weight formats
# Q8_K is llama.cpp's activation format (fp32 d, 256 int8, 16 int16 sums); not a weight layout.
BLOCK_BYTES = {**{t: LAYOUTS[t].nbytes for t in K_TYPES}, "Q8_K": GGML_QUANT_SIZES[GGMLQuantizationType.Q8_K][1]}

F32 = np.float32
_MAGIC = F32(12582912.0)  # 1.5 * 2**23, C's nearest_int constant
_GROUP_MAX_EPS = F32(1e-15)

# Super-blocks per chunk (256K values, 1 MiB per float32 work array). Chosen by measurement: smaller
# chunks pay numpy's per-call overhead on the per-sub-block bookkeeping, larger ones fall out of L2/L3.
_CHUNK = 1024
# Q3_K's coordinate descent revisits small subsets of a chunk; larger chunks keep those numpy calls
# long enough for two threads to overlap (measured on 4096x4096: 1024 -> 107/111 MB/s at 1/2
# threads, 4096 -> 101/155)
_Q3_CHUNK_FACTOR = 4
_FUSED_CHUNK = 8192  # 2M values per chunk on the compiled path (32 MiB of float32 work arrays)


# ----------------------------------------------------------------------------------------------
# small helpers


def _nearest_int(v: np.ndarray) -> np.ndarray:
    """C's nearest_int on a float32 array, including its behaviour outside |v| < 2**22 (inf/NaN and
    huge quotients give the same garbage as C, which the callers then clamp exactly as C does)."""
    t = np.add(v, _MAGIC, dtype=F32)
    i = t.view(np.int32)
    i &= 0x007FFFFF
    i -= 0x00400000
    return i


def _fp16_round(v: np.ndarray) -> np.ndarray:
    """GGML_FP32_TO_FP16: round to nearest even (numpy's float16 cast does the same)."""
    return v.astype(np.float16)


def _as_blocks(x: np.ndarray) -> tuple[np.ndarray, tuple[int, ...]]:
    x = np.asarray(x)
    if x.ndim == 0 or x.shape[-1] % QK_K:
        raise ValueError(f"last dimension must be a multiple of {QK_K}, got shape {x.shape}")
    xb = np.ascontiguousarray(x, dtype=F32).reshape(-1, QK_K)
    return xb, x.shape


def _out_shape(shape: tuple[int, ...], block_bytes: int) -> tuple[int, ...]:
    return (*shape[:-1], shape[-1] // QK_K * block_bytes)


def _check_imatrix(imatrix) -> None:
    if imatrix is not None:
        raise NotImplementedError("Q8_K is an activation format; it has no importance-weighted quantizer")


def _imatrix_blocks(imatrix, shape) -> np.ndarray | None:
    """The per-column importance of a row (n floats) -> (n/256, 256) float32: block i of every row
    uses imatrix[256*i : 256*(i+1)] (C passes the same pointer for each row)."""
    if imatrix is None:
        return None
    qw = np.ascontiguousarray(imatrix, dtype=F32).reshape(-1)
    if qw.size != shape[-1]:
        raise ValueError(f"imatrix has {qw.size} values, the rows have {shape[-1]} columns")
    return qw.reshape(-1, QK_K)


def _chunk_weights(qwb: np.ndarray, s: int, e: int) -> np.ndarray:
    """Importance rows (k, 256) for the global super-blocks s..e (rows of the tensor run one after another)."""
    return qwb[np.arange(s, e) % qwb.shape[0]]


def _block_sigma2(xc: np.ndarray, factor: float) -> np.ndarray:
    """C: sum_x2 over the 256 values (sequential), then factor*sum_x2/QK_K, per super-block."""
    XT = np.ascontiguousarray(xc.T)
    np.multiply(XT, XT, out=XT)
    s2 = np.add.reduce(XT, axis=0)
    if factor != 1:
        s2 = F32(factor) * s2
    return s2 / F32(QK_K)


def _importance_weights(X: np.ndarray, QW: np.ndarray, sigma2: np.ndarray, per_block: int) -> np.ndarray:
    """C: weights[l] = qw[l] * sqrtf(sigma2 + x*x), element-major like X."""
    W = np.multiply(X, X)
    W += np.repeat(sigma2, per_block)
    np.sqrt(W, out=W)
    W *= QW
    return W


def _first_absmax(X: np.ndarray) -> tuple[np.ndarray, np.ndarray]:
    """Per column of X: (max |x|, the signed x attaining it), i.e. C's
    `if (ax > amax) { amax = ax; max = x[i]; }`, which keeps the first one on ties (NaNs never
    win). Which index wins only matters when +a and -a both attain the maximum; those rare columns
    are resolved explicitly, the rest follow from the column max and min (argmax along a
    non-contiguous axis is slow)."""
    A = np.abs(X)
    amax = np.fmax.reduce(A, axis=0)
    hi = np.fmax.reduce(X, axis=0)
    lo = np.fmin.reduce(X, axis=0)
    pos = hi == amax
    mx = np.where(pos, hi, -amax)
    tie = pos & (lo == -amax) & (amax > 0)
    if tie.any():
        cols = np.flatnonzero(tie)
        idx = np.argmax(A[:, cols] == amax[cols], axis=0)
        mx[cols] = X[idx, cols]
    return amax, mx


def _mask32(acc: np.ndarray) -> np.ndarray:
    """bool -> int32 0 / -1, for _blend."""
    m = acc.view(np.int8).astype(np.int32)
    np.negative(m, out=m)
    return m


def _blend(dst: np.ndarray, src: np.ndarray, mask: np.ndarray) -> None:
    """dst[..., j] = src[..., j] where mask[j] == -1, bitwise (exact for every float, NaN included).
    On scattered masks this is several times faster than np.copyto(where=) or np.where."""
    d = dst.view(np.int32)
    t = np.bitwise_xor(d, src.view(np.int32))
    t &= mask
    d ^= t


def _fused_for(x: np.ndarray, name: str, imatrix) -> bool:
    """Whether a tensor's searches run compiled (kernels/ggml/kquant_fused.py): large tensors, when enabled,
    of a type that has one (Q3_K without an importance matrix has none: its descent stays in numpy)."""
    has_search = name != "Q3_K" or imatrix is not None
    return has_search and x.size >= kquant_fused.MIN_VALUES and kquant_fused.available()


def _chunks(nb: int, fused: bool = False, factor: int = 1):
    # the compiled searches read each value once per candidate, so they take larger chunks
    step = _FUSED_CHUNK if fused else _CHUNK * factor
    for s in range(0, nb, step):
        yield s, min(nb, s + step)


# ----------------------------------------------------------------------------------------------
# searches, all on element-major arrays X of shape (n, M): column m is one sub-block of n values


def _qkx2_numerators(nmax, rmin, rdelta, nstep) -> list:
    """make_qkx2_quants' candidate iscale numerators rmin + rdelta*is + nmax, rounded as C's floats."""
    if nstep < 1:
        return []
    fmax = F32(nmax)
    return [F32(F32(F32(rmin) + F32(F32(rdelta) * F32(step))) + fmax) for step in range(nstep + 1)]


def _qx_numerators(nmax) -> list:
    """make_qx_quants' candidate iscale numerators -(nmax + 0.1*is), is = -9..9 without 0."""
    fn = F32(nmax)
    return [-F32(fn + F32(F32(0.1) * F32(step))) for step in range(-9, 10) if step]


def _qkx2_round(X, isc, cur_min, raw_min, mx, nmax, out, check=True):
    """C: l = MAX(0, MIN(nmax, nearest_int(iscale*(x[i] - min)))) for every column.

    np.rint is C's nearest_int only for |v| < 2**22. |x - min|*iscale stays far below that unless
    max - min is (nearly) 0 (denormal data, or an accepted min close to max); with `check` such
    columns are detected and the exact bit trick (which also reproduces C on inf/NaN) is used."""
    np.subtract(X, cur_min, out=out)
    np.multiply(out, isc, out=out)
    if not check or np.all(np.maximum(mx - cur_min, cur_min - raw_min) * isc < F32(4.0e6)):
        np.clip(out, 0, nmax, out=out)  # clamp then round == round then clamp (integer bounds)
        np.rint(out, out=out)
    else:
        li = _nearest_int(out)
        np.clip(li, 0, nmax, out=li)
        out[...] = li
    return out


class _Qkx2:
    """make_qkx2_quants for M sub-blocks at once: `scale`, `the_min` per column, and `L(cols)`.

    C updates its `min` whenever a candidate is accepted, and later candidates compute
    `iscale = (...)/(max - min)` and `iscale*(x - min)` with that updated min; so does this code.
    Instead of carrying the best L through the search, the winning (iscale, min used) pair is kept:
    L is a pure function of them, and the callers need it only for sub-blocks whose requantization
    scale d*sc is 0 (the rest is requantized), so it is rebuilt for those columns only.
    """

    def __init__(self, X, W, nmax, rmin, rdelta, nstep, use_mad, fused=False):
        n, M = X.shape
        self.X, self.nmax = X, nmax
        fmax = F32(nmax)
        raw_min = np.minimum.reduce(X, axis=0)
        mx = np.maximum.reduce(X, axis=0)
        mn = np.minimum(raw_min, F32(0))  # C: if (min > 0) min = 0
        self.raw_min, self.mx = raw_min, mx
        self.degenerate = mx == mn  # C: L = 0, scale 0, the_min = -min
        # The running min stays <= 0, so with max > 0: max - min >= max and
        # |x - min| <= max(max - min, -raw_min), hence |iscale*(x - min)| <= top*(max - raw_min)/max.
        # When that is < 2**22 and iscale <= top/max cannot overflow (denormal data) for every
        # column, plain np.rint is exact for the whole search.
        top = F32(1.01 * max(nmax, rmin + rdelta * nstep + nmax))
        with np.errstate(over="ignore", invalid="ignore", divide="ignore"):
            safe = ((mx > 0) & np.isfinite(top / mx)
                    & ((mx - raw_min) * top < mx * F32(4.0e6)))
        check = not np.all(safe | self.degenerate)
        sum_w = np.add.reduce(W, axis=0)  # C starts from weights[0]: same as 0 + weights[0]
        sum_x = np.add.reduce(np.multiply(W, X), axis=0)

        found = None
        if fused:  # the compiled search: same bytes
            found = kquant_fused.qkx2_search(X, W, mx, mn, sum_w, sum_x, nmax,
                                             _qkx2_numerators(nmax, rmin, rdelta, nstep), use_mad)
        if found is not None:
            unsafe = np.flatnonzero(~(safe | self.degenerate))
            if unsafe.size:  # the few columns where rounding may not be C's nearest_int: numpy, exactly
                sub = _Qkx2(np.ascontiguousarray(X[:, unsafe]), np.ascontiguousarray(W[:, unsafe]), nmax,
                            rmin, rdelta, nstep, use_mad)
                for arr, val in zip(found, (sub.best_isc, sub.best_xmin, sub.scale, -sub.the_min)):
                    arr[unsafe] = val
            self._finish(*found, mn)
            return

        # the numpy search
        S = np.empty((2, n, M), F32)  # [candidate L, x]
        S[1] = X
        R = np.empty((3, n, M), F32)  # [w*l, w*l*l, w*l*x], later scratch
        T = R[0]

        def error(scale, vmin, Lc, out=None):
            # C: diff = scale*L + min - x; err += w * (mad ? |diff| : diff*diff)
            np.multiply(Lc, scale, out=T)
            np.add(T, vmin, out=T)
            np.subtract(T, X, out=T)
            if use_mad:
                np.abs(T, out=T)
            else:
                np.multiply(T, T, out=T)
            np.multiply(T, W, out=T)
            return np.add.reduce(T, axis=0, out=out)

        # ST: the running state [best iscale, min it was used with, best error, scale, min];
        # NEW: the same fields for the current candidate, blended in where it is accepted.
        ST = np.empty((5, M), F32)
        NEW = np.empty((5, M), F32)
        with np.errstate(divide="ignore", invalid="ignore", over="ignore"):
            ST[4] = mn
            np.divide(fmax, mx - mn, out=ST[0])
            ST[1] = mn
            ST[3] = F32(1) / ST[0]
            error(ST[3], mn, _qkx2_round(X, ST[0], mn, raw_min, mx, nmax, S[0], check), out=ST[2])
            vmin = ST[4]
            for num in _qkx2_numerators(nmax, rmin, rdelta, nstep):
                isc = np.divide(num, mx - vmin, out=NEW[0])
                Lc = _qkx2_round(X, isc, vmin, raw_min, mx, nmax, S[0], check)
                np.multiply(W, Lc, out=R[0])
                np.multiply(S, R[0], out=R[1:])  # (w*l)*l and (w*l)*x, C's association
                sum_l, sum_l2, sum_xl = np.add.reduce(R, axis=1)  # sequential over the n rows
                D = sum_w * sum_l2 - sum_l * sum_l
                this_scale = np.subtract(sum_w * sum_xl, sum_x * sum_l, out=NEW[3])
                this_scale /= D
                this_min = np.subtract(sum_l2 * sum_x, sum_l * sum_xl, out=NEW[4])
                this_min /= D
                pos = this_min > 0
                if pos.any():
                    this_min[pos] = 0
                    this_scale[pos] = sum_xl[pos] / sum_l2[pos]
                cur = error(this_scale, this_min, Lc, out=NEW[2])
                acc = (D > 0) & (cur < ST[2])
                NEW[1] = vmin
                _blend(ST, NEW, _mask32(acc))
        best_isc, best_xmin, _, scale, vmin = ST
        self._finish(best_isc, best_xmin, scale, vmin, mn)

    def _finish(self, best_isc, best_xmin, scale, vmin, mn):
        scale[self.degenerate] = 0
        vmin[self.degenerate] = mn[self.degenerate]
        self.scale, self.the_min = scale, -vmin
        self.best_isc, self.best_xmin = best_isc, best_xmin

    def L(self, cols: np.ndarray) -> np.ndarray:
        """Search result L (uint8, shape (len(cols), n)) for the given sub-block columns."""
        Xs = self.X[:, cols]
        with np.errstate(invalid="ignore", over="ignore"):
            Ls = _qkx2_round(Xs, self.best_isc[cols], self.best_xmin[cols], self.raw_min[cols],
                             self.mx[cols], self.nmax, np.empty_like(Xs))
        Ls[:, self.degenerate[cols]] = 0
        return Ls.T.astype(np.uint8)


class _QxRmse1:
    """make_qx_quants(n, nmax, x, L, rmse_type=1, qw) (Q6_K; Q3_K with weights) for M sub-blocks at once.
    `scale` per column and `L(cols)` (stored values l + nmax) as in _Qkx2. iscale*x is bounded by
    nmax + 0.9 here, so np.rint is exactly C's nearest_int."""

    def __init__(self, X, nmax, W=None, fused=False):
        n, M = X.shape
        self.X, self.nmax = X, nmax
        amax, mx = _first_absmax(X)
        self.zero = amax < _GROUP_MAX_EPS
        fn = F32(nmax)
        found = (kquant_fused.qx_search(X, np.multiply(X, X) if W is None else W, mx, nmax, _qx_numerators(nmax))
                 if fused else None)
        if found is not None:  # the compiled search, same bytes
            scale, self.best_isc = found
            scale[self.zero] = 0
            self.scale = scale
            return
        P = np.empty((2, n, M), F32)  # [w*x, w] with w = x*x, or the given weights (C's qw)
        if W is None:
            np.multiply(X, X, out=P[1])
        else:
            P[1] = W
        np.multiply(P[1], X, out=P[0])
        Q = np.empty((2, n, M), F32)
        V = np.empty_like(X)

        def sums(isc):
            np.multiply(X, isc, out=V)
            np.clip(V, -nmax, nmax - 1, out=V)
            np.rint(V, out=V)
            np.multiply(P, V, out=Q)  # (w*x)*l and w*l
            np.multiply(Q[1], V, out=Q[1])  # (w*l)*l
            return np.add.reduce(Q, axis=1)  # sequential over the n rows

        ST = np.empty((3, M), F32)  # [scale, best, best iscale]
        NEW = np.empty((3, M), F32)
        with np.errstate(divide="ignore", invalid="ignore", over="ignore"):
            np.divide(F32(-fn), mx, out=ST[2])
            sumlx, suml2 = sums(ST[2])
            ST[0] = np.where(suml2 != 0, sumlx / suml2, F32(0))
            np.multiply(ST[0], sumlx, out=ST[1])
            for num in _qx_numerators(nmax):
                isc = np.divide(num, mx, out=NEW[2])
                slx, sl2 = sums(isc)
                acc = (sl2 > 0) & (slx * slx > ST[1] * sl2)
                np.divide(slx, sl2, out=NEW[0])
                np.multiply(NEW[0], slx, out=NEW[1])
                _blend(ST, NEW, _mask32(acc))
        scale = ST[0]
        scale[self.zero] = 0
        self.scale, self.best_isc = scale, ST[2]

    def L(self, cols: np.ndarray) -> np.ndarray:
        nmax = self.nmax
        with np.errstate(invalid="ignore"):
            V = self.X[:, cols] * self.best_isc[cols]
        np.clip(V, -nmax, nmax - 1, out=V)
        np.rint(V, out=V)
        V += F32(nmax)
        V[:, self.zero[cols]] = 0
        return V.T.astype(np.uint8)


def make_qp_quants(X, nmax, W):
    """make_qp_quants(n, nmax, x, L, quant_weights) for M columns at once (X, W of shape (n, M)):
    the weighted quantization of a super-block's sub-block scales (or mins) to 0..nmax.
    Returns (scale [M], L (n, M) uint8). Like _make_q3_quants, the coordinate descent is sequential
    over the n positions, all columns together; C's int codes are stored into uint8 (wrapping) where
    C stores them and used as ints where C uses ints."""
    n, M = X.shape
    fn = F32(nmax)
    mx = np.maximum(np.maximum.reduce(X, axis=0), F32(0))  # C: max = MAX(max, x[i]) from 0
    zero = mx < _GROUP_MAX_EPS
    WX = np.multiply(W, X)

    def mse(scale, Lf):
        diff = np.subtract(X, scale * Lf)  # C: x - scale*L
        t = np.multiply(W, diff)
        t *= diff  # (w*diff)*diff
        return np.add.reduce(t, axis=0)

    with np.errstate(divide="ignore", invalid="ignore", over="ignore"):
        iscale = fn / mx
        L0 = (_nearest_int(X * iscale) & 0xFF).astype(F32)  # stored into uint8 L without a clamp
        best = mse(F32(1) / iscale, L0)
        for step in range(-4, 5):
            if step == 0:
                continue
            isc = F32(F32(F32(0.1) * F32(step)) + fn) / mx
            li = np.minimum(_nearest_int(X * isc), nmax).astype(F32)
            cur = mse(F32(1) / isc, li)
            acc = cur < best
            best = np.where(acc, cur, best)
            iscale = np.where(acc, isc, iscale)
        li = np.minimum(_nearest_int(X * iscale), nmax)
        lf = li.astype(F32)
        sumlx = np.add.reduce(WX * lf, axis=0)  # (w*x)*l
        suml2 = np.add.reduce((W * lf) * lf, axis=0)
        L = (li & 0xFF).astype(F32)  # C's uint8 L
        for _ in range(5):
            changed = False
            for i in range(n):
                x, w, wx, Li = X[i], W[i], WX[i], L[i]
                slx = sumlx - wx * Li
                sl2 = suml2 - (w * Li) * Li
                q = x * sl2
                q /= slx
                new = np.minimum(_nearest_int(q), nmax)
                newf = new.astype(F32)
                cand = (slx > 0) & (sl2 > 0) & (newf != Li)
                slx2 = slx + wx * newf
                sl2b = sl2 + (w * newf) * newf
                acc = cand & ((slx2 * slx2) * suml2 > (sumlx * sumlx) * sl2b)
                if acc.any():
                    changed = True
                    m = _mask32(acc)
                    _blend(Li, (new & 0xFF).astype(F32), m)
                    _blend(sumlx, slx2, m)
                    _blend(suml2, sl2b, m)
            if not changed:
                break
        scale = np.where(suml2 > 0, sumlx / suml2, F32(0))
    scale[zero] = 0
    L[:, zero] = 0
    return scale, L.astype(np.uint8)


def _make_q3_quants(X, nmax=4):
    """make_q3_quants(n, nmax, x, L, do_rmse=true) (Q3_K). Returns (scale, L + nmax), L (n, M).

    The coordinate descent is sequential over positions inside a sub-block, so it loops over the
    n rows; all sub-blocks advance together. A sub-block whose pass changed nothing would change
    nothing in a further pass either (same state, same decisions: C's per-block early exit), so each
    pass after the first runs only on the sub-blocks the previous pass changed (about 20%, then 5%,
    then 1% on LLM-like data) instead of on all of them.
    """
    amax, mx = _first_absmax(X)
    zero = amax < _GROUP_MAX_EPS
    fn = F32(nmax)
    with np.errstate(divide="ignore", invalid="ignore", over="ignore"):
        iscale = F32(-fn) / mx
        L = np.multiply(X, iscale)
        np.clip(L, -nmax, nmax - 1, out=L)
        np.rint(L, out=L)
        W = np.multiply(X, X)
        WX = np.multiply(W, X)
        sumlx = np.add.reduce(WX * L, axis=0)
        suml2 = np.add.reduce((W * L) * L, axis=0)
        changed = _q3_pass(X, W, WX, L, sumlx, suml2, nmax)
        active = np.flatnonzero(changed)
        for _ in range(4):
            if not active.size:
                break
            La, slx, sl2 = L[:, active], sumlx[active], suml2[active]  # copies, written back below
            changed = _q3_pass(X[:, active], W[:, active], WX[:, active], La, slx, sl2, nmax)
            L[:, active], sumlx[active], suml2[active] = La, slx, sl2
            active = active[changed]
        scale = np.where(suml2 > 0, sumlx / suml2, F32(0))
    L += fn
    L[:, zero] = 0
    scale[zero] = 0
    return scale, L


def _q3_pass(X, W, WX, L, sumlx, suml2, nmax) -> np.ndarray:
    """One pass of make_q3_quants' coordinate descent over the n positions, updating L, sumlx and
    suml2 in place; returns which columns (sub-blocks) changed."""
    changed = np.zeros(X.shape[1], bool)
    for i in range(X.shape[0]):
        x, w, wx, Li = X[i], W[i], WX[i], L[i]
        slx = sumlx - wx * Li
        sl2 = suml2 - (w * Li) * Li
        q = x * sl2
        q /= slx
        # the quotient is unbounded (slx can be tiny), so C's exact nearest_int is needed
        new = _nearest_int(q)
        np.clip(new, -nmax, nmax - 1, out=new)
        newf = new.astype(F32)
        cand = (slx > 0) & (newf != Li)
        slx2 = slx + wx * newf
        sl2b = sl2 + (w * newf) * newf
        acc = cand & (sl2b > 0) & ((slx2 * slx2) * suml2 > (sumlx * sumlx) * sl2b)
        if acc.any():
            changed |= acc
            m = _mask32(acc)
            _blend(Li, newf, m)
            _blend(sumlx, slx2, m)
            _blend(suml2, sl2b, m)
    return changed


# ----------------------------------------------------------------------------------------------
# packing helpers


def _rowmajor_to_elem_major(xc: np.ndarray, n: int) -> np.ndarray:
    """(nb, 256) super-blocks -> (n, nb*256/n): one column per sub-block of n values."""
    return np.ascontiguousarray(xc.reshape(-1, n).T)


def _pack_2bit(L: np.ndarray) -> np.ndarray:
    """qs for Q2_K / low bits of Q3_K: byte 32h+l holds elements 128h+l+32k at shift 2k."""
    nb = L.shape[0]
    Lr = L.reshape(nb, 2, 4, 32)
    q = Lr[:, :, 0] | (Lr[:, :, 1] << 2) | (Lr[:, :, 2] << 4) | (Lr[:, :, 3] << 6)
    return q.reshape(nb, 64)


def _pack_k4_scales(ls: np.ndarray, lm: np.ndarray) -> np.ndarray:
    """Q4_K/Q5_K 12-byte scales from 8 scales and 8 mins (each <= 63)."""
    nb = ls.shape[0]
    s = np.empty((nb, 12), np.uint8)
    s[:, 0:4] = ls[:, 0:4] | ((ls[:, 4:8] >> 4) << 6)
    s[:, 4:8] = lm[:, 0:4] | ((lm[:, 4:8] >> 4) << 6)
    s[:, 8:12] = (ls[:, 4:8] & 0xF) | ((lm[:, 4:8] & 0xF) << 4)
    return s


def _unpack_k4_scales(s: np.ndarray) -> tuple[np.ndarray, np.ndarray]:
    """get_scale_min_k4 for all 8 sub-blocks."""
    sc = np.concatenate([s[:, 0:4] & 63, (s[:, 8:12] & 0xF) | ((s[:, 0:4] >> 6) << 4)], axis=1)
    m = np.concatenate([s[:, 4:8] & 63, (s[:, 8:12] >> 4) | ((s[:, 4:8] >> 6) << 4)], axis=1)
    return sc, m


def _fp16_bytes(h: np.ndarray) -> np.ndarray:
    return np.ascontiguousarray(h.astype(np.float16)).view(np.uint8).reshape(-1, 2)


def _requant(q: np.ndarray, d: np.ndarray, lo: int, hi: int, search_L) -> np.ndarray:
    """Second stage shared by all types: codes = clamp(nearest_int(q), lo, hi) - lo as uint8, where
    q (k, nsub, n) is x/(d*sc) (or (x + dmin*m)/(d*sc)) computed by the caller with the
    fp16-rounded super scales. Sub-blocks whose d*sc is 0 keep the search's L (C:
    `if (!d) continue`); `search_L(cols)` supplies it for just those sub-blocks."""
    li = _nearest_int(q)
    np.clip(li, lo, hi, out=li)
    if lo:
        li -= lo
    L = li.astype(np.uint8)
    k, nsub, n = L.shape
    cols = np.flatnonzero(d.reshape(-1) == 0)
    if cols.size:
        L.reshape(k * nsub, n)[cols] = search_L(cols)
    return L.reshape(k, nsub * n)


# ----------------------------------------------------------------------------------------------
# quantizers


def quantize_q2_K(x: np.ndarray, imatrix=None) -> np.ndarray:
    """float32 [..., n] -> uint8 [..., n/256*84], byte-identical to quantize_row_q2_K_ref
    (with `imatrix`: quantize_row_q2_K_impl)."""
    xb, shape = _as_blocks(x)
    qwb = _imatrix_blocks(imatrix, shape)
    nb = xb.shape[0]
    out = np.empty((nb, 84), np.uint8)
    fused = _fused_for(xb, "Q2_K", imatrix)
    for s, e in _chunks(nb, fused):
        xc = xb[s:e]
        k = e - s
        X = _rowmajor_to_elem_major(xc, 16)
        if qwb is not None:
            _quantize_q2_K_weighted(xc, X, _rowmajor_to_elem_major(_chunk_weights(qwb, s, e), 16), out[s:e], fused)
            continue
        srch = _Qkx2(X, np.abs(X), 3, -0.5, 0.1, 15, True, fused)
        scales = srch.scale.reshape(k, 16)
        mins = srch.the_min.reshape(k, 16)
        # C: running max starting from 0 with `>` (a NaN never wins)
        max_scale = np.fmax(np.fmax.reduce(scales, axis=1), F32(0))
        max_min = np.fmax(np.fmax.reduce(mins, axis=1), F32(0))
        with np.errstate(divide="ignore", invalid="ignore", over="ignore"):
            pos_s = max_scale > 0
            ls = _nearest_int((F32(15) / max_scale)[:, None] * scales)
            ls[~pos_s] = 0
            pos_m = max_min > 0
            lm = _nearest_int((F32(15) / max_min)[:, None] * mins)
            lm[~pos_m] = 0
            # C stores `l` into a uint8 and then ORs `l << 4` into it: both wrap modulo 256.
            sc_byte = (((ls & 0xFF) | (lm << 4)) & 0xFF).astype(np.uint8)
            d16 = _fp16_round(np.where(pos_s, max_scale / F32(15), F32(0)))
            dmin16 = _fp16_round(np.where(pos_m, max_min / F32(15), F32(0)))
            d = d16.astype(F32)[:, None] * (sc_byte & 0xF).astype(F32)
            dm = dmin16.astype(F32)[:, None] * (sc_byte >> 4).astype(F32)
            q = xc.reshape(k, 16, 16) + dm[..., None]
            q /= d[..., None]
        L = _requant(q, d, 0, 3, srch.L)
        o = out[s:e]
        o[:, 0:16] = sc_byte
        o[:, 16:80] = _pack_2bit(L)
        o[:, 80:82] = _fp16_bytes(d16)
        o[:, 82:84] = _fp16_bytes(dmin16)
    return out.reshape(_out_shape(shape, 84))


def _quantize_q2_K_weighted(xc, X, QW, o, fused=False) -> None:
    """quantize_row_q2_K_impl for one chunk: make_qkx3_quants per 16, make_qp_quants (nmax 15) for
    the 16 scales and the 16 mins, then the reference's requantization."""
    k = xc.shape[0]
    W = _importance_weights(X, QW, _block_sigma2(xc, 1), 16)
    sw = np.add.reduce(W, axis=0)  # C: sw[j] = 0 + weight[0] + ... sequentially
    srch = _Qkx2(X, W, 3, -0.9, 0.05, 36, False, fused)
    del W
    swT = np.ascontiguousarray(sw.reshape(k, 16).T)
    dm, Ls = make_qp_quants(np.ascontiguousarray(srch.scale.reshape(k, 16).T), 15, swT)
    mm, Lm = make_qp_quants(np.ascontiguousarray(srch.the_min.reshape(k, 16).T), 15, swT)
    sc_byte = (Ls.T | (Lm.T << 4)).astype(np.uint8)  # C: uint8 Ls | (Lm << 4), wrapping
    d16 = _fp16_round(dm)
    dmin16 = _fp16_round(mm)
    with np.errstate(divide="ignore", invalid="ignore", over="ignore"):
        d = d16.astype(F32)[:, None] * (sc_byte & 0xF).astype(F32)
        dmv = dmin16.astype(F32)[:, None] * (sc_byte >> 4).astype(F32)
        q = xc.reshape(k, 16, 16) + dmv[..., None]
        q /= d[..., None]
    L = _requant(q, d, 0, 3, srch.L)
    o[:, 0:16] = sc_byte
    o[:, 16:80] = _pack_2bit(L)
    o[:, 80:82] = _fp16_bytes(d16)
    o[:, 82:84] = _fp16_bytes(dmin16)


def quantize_q3_K(x: np.ndarray, imatrix=None) -> np.ndarray:
    """float32 [..., n] -> uint8 [..., n/256*110], byte-identical to quantize_row_q3_K_ref
    (with `imatrix`: quantize_row_q3_K_impl)."""
    xb, shape = _as_blocks(x)
    qwb = _imatrix_blocks(imatrix, shape)
    nb = xb.shape[0]
    out = np.empty((nb, 110), np.uint8)
    fused = _fused_for(xb, "Q3_K", imatrix)
    for s, e in _chunks(nb, fused, _Q3_CHUNK_FACTOR):
        xc = xb[s:e]
        k = e - s
        X = _rowmajor_to_elem_major(xc, 16)
        if qwb is None:
            scale, Ls = _make_q3_quants(X, 4)
            scales = scale.reshape(k, 16)
            _, max_scale = _first_absmax(scales.T)
            nz = max_scale != 0
            with np.errstate(divide="ignore", invalid="ignore", over="ignore"):
                iscale = F32(-32) / max_scale
                li = _nearest_int(iscale[:, None] * scales)
                li = li.astype(np.int8).astype(np.int32)  # C: int8_t l = nearest_int(...)
                np.clip(li, -32, 31, out=li)
                li += 32
                li[~nz] = 0
                d16 = _fp16_round(np.where(nz, F32(1) / iscale, F32(0)))
        else:  # quantize_row_q3_K_impl: weighted make_qx_quants for the codes and for the scales
            W = _importance_weights(X, _rowmajor_to_elem_major(_chunk_weights(qwb, s, e), 16),
                                    _block_sigma2(xc, 2), 16)
            sw = np.add.reduce(W, axis=0)
            srch = _QxRmse1(X, 4, W, fused)
            del W
            Ls = srch.L(np.arange(X.shape[1])).T  # (16, M): l + 4, as make_q3_quants returns
            scales = srch.scale.reshape(k, 16)
            ssrch = _QxRmse1(np.ascontiguousarray(scales.T), 32, np.ascontiguousarray(sw.reshape(k, 16).T))
            li = ssrch.L(np.arange(k)).astype(np.int32)  # (k, 16): l + 32 in 0..63
            d16 = _fp16_round(ssrch.scale)
        lu = li.astype(np.uint8)
        sb = np.empty((k, 12), np.uint8)
        sb[:, 0:8] = (lu[:, 0:8] & 0xF) | ((lu[:, 8:16] & 0xF) << 4)
        hi = (lu >> 4).reshape(k, 4, 4)  # [k, j//4, j%4]
        sb[:, 8:12] = hi[:, 0] | (hi[:, 1] << 2) | (hi[:, 2] << 4) | (hi[:, 3] << 6)
        # decode what was stored: all-zero scales decode to -32 with d = 0, as in C
        with np.errstate(divide="ignore", invalid="ignore", over="ignore"):
            d = d16.astype(F32)[:, None] * (li - 32).astype(F32)
            q = xc.reshape(k, 16, 16) / d[..., None]
        L = _requant(q, d, -4, 3, lambda cols: Ls[:, cols].T.astype(np.uint8))
        hbit = (L > 3).astype(np.uint8).reshape(k, 8, 32)
        hm = hbit[:, 0].copy()
        for b in range(1, 8):
            hm |= hbit[:, b] << b
        o = out[s:e]
        o[:, 0:32] = hm
        o[:, 32:96] = _pack_2bit(L & 3)
        o[:, 96:108] = sb
        o[:, 108:110] = _fp16_bytes(d16)
    return out.reshape(_out_shape(shape, 110))


def _quantize_q45_K(x, nmax, rmin, nstep, block_bytes, imatrix=None):
    xb, shape = _as_blocks(x)
    qwb = _imatrix_blocks(imatrix, shape)
    nb = xb.shape[0]
    out = np.empty((nb, block_bytes), np.uint8)
    fused = _fused_for(xb, "Q4_K", imatrix)  # Q4_K and Q5_K alike
    for s, e in _chunks(nb, fused):
        xc = xb[s:e]
        k = e - s
        X = _rowmajor_to_elem_major(xc, 32)
        if qwb is None:
            W = np.multiply(X, X)
            av_x = np.sqrt(np.add.reduce(W, axis=0) / F32(32))  # C: sqrtf(sum_x2/32), sequential sum
            np.abs(X, out=W)
            W += av_x  # C: av_x + fabsf(x)
            srch = _Qkx2(X, W, nmax, rmin, 0.1, nstep, False, fused)
        else:  # quantize_row_q{4,5}_K_impl
            QW = _rowmajor_to_elem_major(_chunk_weights(qwb, s, e), 32)
            W = _importance_weights(X, QW, _block_sigma2(xc, 2), 8)
            sw = np.add.reduce(W, axis=0)  # sequential over the 32 weights
            srch = _Qkx2(X, W, nmax, -0.9, 0.05, 36, False, fused)  # make_qkx3_quants
        del W
        scales = srch.scale.reshape(k, 8)
        mins = srch.the_min.reshape(k, 8)
        if qwb is not None:
            swT = np.ascontiguousarray(sw.reshape(k, 8).T)
            d_block, Ls = make_qp_quants(np.ascontiguousarray(scales.T), 63, swT)
            m_block, Lm = make_qp_quants(np.ascontiguousarray(mins.T), 63, swT)
            ls = np.minimum(Ls.T, 63)
            lm = np.minimum(Lm.T, 63)
            d16 = _fp16_round(d_block)
            dmin16 = _fp16_round(m_block)
        else:
            max_scale = np.fmax(np.fmax.reduce(scales, axis=1), F32(0))  # C: running `>` from 0
            max_min = np.fmax(np.fmax.reduce(mins, axis=1), F32(0))
            with np.errstate(divide="ignore", invalid="ignore", over="ignore"):
                inv_scale = np.where(max_scale > 0, F32(63) / max_scale, F32(0))
                inv_min = np.where(max_min > 0, F32(63) / max_min, F32(0))
                # C: uint8_t ls = nearest_int(...); ls = MIN(63, ls)  (wraps mod 256 first)
                ls = np.minimum(_nearest_int(inv_scale[:, None] * scales) & 0xFF, 63).astype(np.uint8)
                lm = np.minimum(_nearest_int(inv_min[:, None] * mins) & 0xFF, 63).astype(np.uint8)
                d16 = _fp16_round(max_scale / F32(63))
                dmin16 = _fp16_round(max_min / F32(63))
        with np.errstate(divide="ignore", invalid="ignore", over="ignore"):
            d = d16.astype(F32)[:, None] * ls.astype(F32)
            dm = dmin16.astype(F32)[:, None] * lm.astype(F32)
            q = xc.reshape(k, 8, 32) + dm[..., None]
            q /= d[..., None]
        L = _requant(q, d, 0, nmax, srch.L)
        _pack_q45(out[s:e], L, ls, lm, d16, dmin16, nmax)
    return out.reshape(_out_shape(shape, block_bytes))


def _pack_q45(o, L, ls, lm, d16, dmin16, nmax) -> None:
    k = L.shape[0]
    o[:, 0:2] = _fp16_bytes(d16)
    o[:, 2:4] = _fp16_bytes(dmin16)
    o[:, 4:16] = _pack_k4_scales(ls, lm)
    Lr = L.reshape(k, 4, 2, 32)
    if nmax == 15:
        o[:, 16:144] = (Lr[:, :, 0] | (Lr[:, :, 1] << 4)).reshape(k, 128)
    else:
        o[:, 48:176] = ((Lr[:, :, 0] & 0xF) | (Lr[:, :, 1] << 4)).reshape(k, 128)
        hi = (L >> 4).reshape(k, 8, 32)
        qh = hi[:, 0].copy()
        for b in range(1, 8):
            qh |= hi[:, b] << b
        o[:, 16:48] = qh


def pack_q45_K(L: np.ndarray, sc: np.ndarray, m: np.ndarray, d16: np.ndarray, dmin16: np.ndarray,
               nmax: int) -> np.ndarray:
    """Given codes L (nb, 256) uint8 on 0..nmax (15: Q4_K, 31: Q5_K), 6-bit sub-block scales and mins
    (nb, 8) and the fp16 super-block d, dmin (nb,) -> the block bytes (nb, 144 | 176). No search:
    the grid-aware writer uses it to store a grid's own codes."""
    L = np.ascontiguousarray(L, dtype=np.uint8)
    out = np.empty((L.shape[0], 144 if nmax == 15 else 176), np.uint8)
    _pack_q45(out, L, np.asarray(sc, np.uint8), np.asarray(m, np.uint8), np.asarray(d16, np.float16),
              np.asarray(dmin16, np.float16), nmax)
    return out


def quantize_q4_K(x: np.ndarray, imatrix=None) -> np.ndarray:
    """float32 [..., n] -> uint8 [..., n/256*144], byte-identical to quantize_row_q4_K_ref
    (with `imatrix` [n]: to quantize_row_q4_K_impl, i.e. ggml_quantize_chunk with that imatrix)."""
    return _quantize_q45_K(x, 15, -1.0, 20, 144, imatrix)


def quantize_q5_K(x: np.ndarray, imatrix=None) -> np.ndarray:
    """float32 [..., n] -> uint8 [..., n/256*176], byte-identical to quantize_row_q5_K_ref
    (with `imatrix`: quantize_row_q5_K_impl)."""
    return _quantize_q45_K(x, 31, -0.5, 15, 176, imatrix)


def quantize_q6_K(x: np.ndarray, imatrix=None) -> np.ndarray:
    """float32 [..., n] -> uint8 [..., n/256*210], byte-identical to quantize_row_q6_K_ref
    (with `imatrix`: quantize_row_q6_K_impl, whose weights are the imatrix values themselves)."""
    xb, shape = _as_blocks(x)
    qwb = _imatrix_blocks(imatrix, shape)
    nb = xb.shape[0]
    out = np.empty((nb, 210), np.uint8)
    fused = _fused_for(xb, "Q6_K", imatrix)
    for s, e in _chunks(nb, fused):
        xc = xb[s:e]
        k = e - s
        X = _rowmajor_to_elem_major(xc, 16)
        QW = None if qwb is None else _rowmajor_to_elem_major(_chunk_weights(qwb, s, e), 16)
        srch = _QxRmse1(X, 32, QW, fused)
        scales = srch.scale.reshape(k, 16)
        amax, max_scale = _first_absmax(scales.T)
        zero = amax < _GROUP_MAX_EPS
        with np.errstate(divide="ignore", invalid="ignore", over="ignore"):
            iscale = F32(-128) / max_scale
            d16 = _fp16_round(np.where(zero, F32(0), F32(1) / iscale))
            sc = np.minimum(_nearest_int(iscale[:, None] * scales), 127).astype(np.int8)
            sc[zero] = 0
            d = d16.astype(F32)[:, None] * sc.astype(F32)
            q = xc.reshape(k, 16, 16) / d[..., None]
        L = _requant(q, d, -32, 31, srch.L)
        L[zero] = 0  # C memsets an all-zero super-block
        Lr = L.reshape(k, 2, 4, 32)
        lo = Lr & 0xF
        hi = Lr >> 4
        o = out[s:e]
        o[:, 0:128] = (lo[:, :, 0:2] | (lo[:, :, 2:4] << 4)).reshape(k, 128)
        o[:, 128:192] = (hi[:, :, 0] | (hi[:, :, 1] << 2) | (hi[:, :, 2] << 4)
                         | (hi[:, :, 3] << 6)).reshape(k, 64)
        o[:, 192:208] = sc.view(np.uint8)
        o[:, 208:210] = _fp16_bytes(d16)
    return out.reshape(_out_shape(shape, 210))


def quantize_q8_K(x: np.ndarray) -> np.ndarray:
    """float32 [..., n] -> uint8 [..., n/256*292] (fp32 d, int8 qs[256], int16 bsums[16]) as
    quantize_row_q8_K_ref. C leaves bsums of an all-zero block uninitialised; here they are 0."""
    xb, shape = _as_blocks(x)
    nb = xb.shape[0]
    out = np.zeros((nb, 292), np.uint8)
    A = np.abs(xb)
    idx = np.argmax(A, axis=1)  # first occurrence, as C's strict `>`
    rows = np.arange(nb)
    amax, mx = A[rows, idx], xb[rows, idx]
    nz = amax != 0
    with np.errstate(divide="ignore", invalid="ignore", over="ignore"):
        iscale = np.where(nz, F32(-127) / mx, F32(0))
        q = np.minimum(_nearest_int(xb * iscale[:, None]), 127)
        q[~nz] = 0
        d = np.where(nz, F32(1) / iscale, F32(0)).astype(F32)
    bsums = np.add.reduce(q.reshape(nb, 16, 16), axis=2).astype(np.int16)
    out[:, 0:4] = d.view(np.uint8).reshape(nb, 4)
    out[:, 4:260] = q.astype(np.int8).view(np.uint8)
    out[:, 260:292] = bsums.view(np.uint8).reshape(nb, 32)
    return out.reshape(_out_shape(shape, 292))


# ----------------------------------------------------------------------------------------------
# dequantizers (same float32 expression order as C's dequantize_row_q*_K and gguf-py)


def _as_byte_blocks(data: np.ndarray, block_bytes: int) -> tuple[np.ndarray, tuple[int, ...]]:
    data = np.asarray(data)
    if data.dtype != np.uint8:
        raise TypeError(f"expected uint8 block bytes, got {data.dtype}")
    if data.ndim == 0 or data.shape[-1] % block_bytes:
        raise ValueError(f"last dimension must be a multiple of {block_bytes} bytes, got {data.shape}")
    blocks = np.ascontiguousarray(data).reshape(-1, block_bytes)
    return blocks, (*data.shape[:-1], data.shape[-1] // block_bytes * QK_K)


def _f16(b: np.ndarray) -> np.ndarray:
    return np.ascontiguousarray(b).view(np.float16).astype(F32)  # (nb, 1)


def _unpack_2bit(qs: np.ndarray) -> np.ndarray:
    nb = qs.shape[0]
    q = qs.reshape(nb, 2, 1, 32) >> np.array([0, 2, 4, 6], np.uint8).reshape(1, 1, 4, 1)
    return (q & 3).reshape(nb, 256)


def dequantize_q2_K(data: np.ndarray) -> np.ndarray:
    b, shape = _as_byte_blocks(data, 84)
    nb = b.shape[0]
    sc = b[:, 0:16]
    d, dmin = _f16(b[:, 80:82]), _f16(b[:, 82:84])
    dl = d * (sc & 0xF).astype(F32)
    ml = dmin * (sc >> 4).astype(F32)
    q = _unpack_2bit(b[:, 16:80]).reshape(nb, 16, 16).astype(F32)
    y = dl[..., None] * q - ml[..., None]
    return y.reshape(shape)


def dequantize_q3_K(data: np.ndarray) -> np.ndarray:
    b, shape = _as_byte_blocks(data, 110)
    nb = b.shape[0]
    hm, qs, s = b[:, 0:32], b[:, 32:96], b[:, 96:108]
    d = _f16(b[:, 108:110])
    low = np.concatenate([s[:, 0:8] & 0xF, s[:, 0:8] >> 4], axis=1)  # j<8 / j>=8
    j = np.arange(16)
    high = (s[:, 8 + j % 4] >> (2 * (j // 4)).astype(np.uint8)) & 3
    sc = (low | (high << 4)).astype(np.int32) - 32
    dl = d * sc.astype(F32)
    q2 = _unpack_2bit(qs).astype(np.int32)
    hbit = (hm.reshape(nb, 1, 32) >> np.arange(8, dtype=np.uint8).reshape(1, 8, 1)) & 1
    q = q2 - 4 * (1 - hbit.reshape(nb, 256).astype(np.int32))
    y = dl[..., None] * q.reshape(nb, 16, 16).astype(F32)
    return y.reshape(shape)


def _dequantize_q45(b, nmax):
    nb = b.shape[0]
    d, dmin = _f16(b[:, 0:2]), _f16(b[:, 2:4])
    sc, m = _unpack_k4_scales(b[:, 4:16])
    d1 = d * sc.astype(F32)
    m1 = dmin * m.astype(F32)
    qs = b[:, 16:144] if nmax == 15 else b[:, 48:176]
    q = qs.reshape(nb, 4, 1, 32) >> np.array([0, 4], np.uint8).reshape(1, 1, 2, 1)
    q = (q & 0xF).reshape(nb, 8, 32)
    if nmax == 31:
        hb = (b[:, 16:48].reshape(nb, 1, 32) >> np.arange(8, dtype=np.uint8).reshape(1, 8, 1)) & 1
        q = q | (hb << 4)
    return d1[..., None] * q.astype(F32) - m1[..., None]


def dequantize_q4_K(data: np.ndarray) -> np.ndarray:
    b, shape = _as_byte_blocks(data, 144)
    return _dequantize_q45(b, 15).reshape(shape)


def dequantize_q5_K(data: np.ndarray) -> np.ndarray:
    b, shape = _as_byte_blocks(data, 176)
    return _dequantize_q45(b, 31).reshape(shape)


def dequantize_q6_K(data: np.ndarray) -> np.ndarray:
    b, shape = _as_byte_blocks(data, 210)
    nb = b.shape[0]
    ql, qh = b[:, 0:128], b[:, 128:192]
    sc = b[:, 192:208].view(np.int8).astype(F32)
    d = _f16(b[:, 208:210])
    lo = (ql.reshape(nb, 2, 1, 64) >> np.array([0, 4], np.uint8).reshape(1, 1, 2, 1)) & 0xF
    lo = lo.reshape(nb, 2, 4, 32)  # [half, (q1,q2,q3,q4), l]
    hi = (qh.reshape(nb, 2, 1, 32) >> np.array([0, 2, 4, 6], np.uint8).reshape(1, 1, 4, 1)) & 3
    q = (lo | (hi << 4)).astype(np.int32) - 32
    dl = d * sc  # C: d * sc[is] * q == (d*sc)*q
    y = dl.reshape(nb, 16, 1) * q.reshape(nb, 16, 16).astype(F32)
    return y.reshape(shape)


def dequantize_q8_K(data: np.ndarray) -> np.ndarray:
    b, shape = _as_byte_blocks(data, 292)
    d = np.ascontiguousarray(b[:, 0:4]).view(F32)
    q = b[:, 4:260].view(np.int8).astype(F32)
    return (d * q).reshape(shape)


# ----------------------------------------------------------------------------------------------
# dispatch

_QUANTIZERS = {
    "Q2_K": quantize_q2_K,
    "Q3_K": quantize_q3_K,
    "Q4_K": quantize_q4_K,
    "Q5_K": quantize_q5_K,
    "Q6_K": quantize_q6_K,
}
_DEQUANTIZERS = {
    "Q2_K": dequantize_q2_K,
    "Q3_K": dequantize_q3_K,
    "Q4_K": dequantize_q4_K,
    "Q5_K": dequantize_q5_K,
    "Q6_K": dequantize_q6_K,
    "Q8_K": dequantize_q8_K,
}


def _type_name(type_name) -> str:
    name = getattr(type_name, "name", type_name)  # accepts gguf.GGMLQuantizationType too
    if not isinstance(name, str) or name.upper() not in BLOCK_BYTES:
        raise ValueError(f"unknown K-quant type {type_name!r}; expected one of {tuple(BLOCK_BYTES)}")
    return name.upper()


def default_threads() -> int:
    """Threads for quantize_k: QCONVERT_THREADS, else the CPUs this process may use (at most 8)."""
    env = os.environ.get("QCONVERT_THREADS")
    if env:
        return max(1, int(env))
    return max(1, min(8, usable_cpus()))


def quantize_k(x: np.ndarray, type_name, imatrix=None, threads: int | None = None) -> np.ndarray:
    """Quantize float32 [..., n] (n % 256 == 0) to the uint8 block bytes of `type_name`
    ("Q2_K".."Q6_K", "Q8_K"), as llama.cpp's reference quantizer (llama-quantize without imatrix;
    with `imatrix` [n], as llama-quantize --imatrix).

    Without an importance matrix the C twin of the reference quantizers runs (kernels/ggml/kquant_c.c, where a C
    compiler is available: 2-7x llama.cpp's own reference quantizer), its chunks taken by `threads`
    threads. With one, ggml's quantize_row_q*_K_impl in C (kernels/ggml/kquant_imatrix_c.c via iq_c.py: no
    torch.compile tracing per process), bands of rows from `threads` threads. Without the C twins, `threads` (default: default_threads()): on the compiled path (large tensors) the compiled
    searches run on that many torch intra-op threads (they hold the GIL, so Python threads would
    serialize them); otherwise rows are split into bands quantized from a thread pool (numpy releases
    the GIL inside its array operations). Every super-block is independent, so the bytes do not depend
    on the split or the thread count."""
    name = _type_name(type_name)
    if name == "Q8_K":
        _check_imatrix(imatrix)
        return quantize_q8_K(x)
    from ..triton.route import k_quantize  # the Triton twin (kernels/triton/kquant.py) when chosen and covered

    c_path = kquant_c.available() if imatrix is None else (name in iq_c.K_IMATRIX_TYPES and iq_c.available())
    routed = k_quantize(x, name, imatrix, c_path)
    if routed is not None:
        return routed
    quantize = _QUANTIZERS[name]
    threads = default_threads() if threads is None else max(1, int(threads))
    x = np.asarray(x)
    rows = int(np.prod(x.shape[:-1])) if x.ndim > 1 else 1
    if imatrix is None and kquant_c.available():
        # the reference quantizers in C (kernels/ggml/kquant_c.c): same bytes, chunks taken by a thread pool
        xb, shape = _as_blocks(x)
        return kquant_c.quantize(xb, name, threads).reshape(_out_shape(shape, BLOCK_BYTES[name]))
    if imatrix is not None and name in iq_c.K_IMATRIX_TYPES and iq_c.available() and x.shape[-1] % QK_K == 0:
        # ggml's quantize_row_q*_K_impl in C (kernels/ggml/kquant_imatrix_c.c): same bytes, no torch.compile
        # tracing per process; bands of rows taken by a thread pool
        x2 = np.ascontiguousarray(x, dtype=F32).reshape(rows, x.shape[-1])
        out = iq_c.quantize_k_imatrix(x2, imatrix, name, threads)
        return out.reshape(_out_shape(x.shape, BLOCK_BYTES[name]))
    if _fused_for(x, name, imatrix):
        # the compiled searches hold the GIL: they run on torch's intra-op threads instead
        with kquant_fused.intra_op_threads(threads):
            return quantize(x, imatrix=imatrix)
    if threads == 1 or rows < 2 or x.size < 4 * _CHUNK * QK_K:
        return quantize(x, imatrix=imatrix)
    x2 = x.reshape(rows, x.shape[-1])
    out = np.empty((rows, x.shape[-1] // QK_K * BLOCK_BYTES[name]), np.uint8)
    # bands of whole rows (block i of a row keeps imatrix[256*i:]), a few per thread to even out the load
    bounds = np.linspace(0, rows, min(rows, 4 * threads) + 1).astype(int)

    def band(i: int) -> None:
        out[bounds[i]:bounds[i + 1]] = quantize(x2[bounds[i]:bounds[i + 1]], imatrix=imatrix)

    with ThreadPoolExecutor(threads) as pool:
        list(pool.map(band, range(len(bounds) - 1)))
    return out.reshape(_out_shape(x.shape, BLOCK_BYTES[name]))


def dequantize_k(data: np.ndarray, type_name) -> np.ndarray:
    """uint8 block bytes [..., nbytes] of `type_name` -> float32 [..., nbytes/block_bytes*256] (the C twin
    of the numpy dequantizers where it is built: the same float32 values)."""
    name = _type_name(type_name)
    from ..triton.route import k_decode

    routed = k_decode(data, name)  # the Triton twin when chosen
    if routed is not None:
        return routed
    if name in kquant_c.TYPE_IDS and kquant_c.available():
        blocks, shape = _as_byte_blocks(data, BLOCK_BYTES[name])
        return kquant_c.dequantize(blocks, name, default_threads()).reshape(shape)
    return _DEQUANTIZERS[name](data)
