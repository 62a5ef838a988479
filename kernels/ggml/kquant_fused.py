"""Compiled twins of the K-quant scale searches in kernels/ggml/kquants.py (`_QxRmse1`, `_Qkx2`).

Where they run. Since the C quantizers (kernels/ggml/kquant_c.c) took over llama-quantize's default path (no
importance matrix), these searches serve the importance-weighted quantizers (--imatrix) on large tensors,
and every K type where no C compiler is available. Each new process pays torch.compile's tracing once per
function, sub-block length and thread count (10-15 s for Q4_K on this 2-core machine, measured), which is
why the default path no longer goes through them.

Why. In numpy every candidate scale of a search is ~8 passes over the chunk (scale, clamp, round,
three products, two reductions), each pass streaming megabytes through the caches; the searches are
80% of a K-quant's time. torch.compile (inductor's C++ backend) turns one candidate into a single
loop over the sub-blocks that reads each sub-block's 16 or 32 values once and keeps the rest in
registers: ~5x faster on one core, and the loop is split over torch's intra-op threads (the
compiled call holds the GIL, so Python threads would not run it in parallel).

Exactness. Each compiled function evaluates, per sub-block (one column of the element-major
(n, M) arrays), the very float32 expressions of the numpy code in the same association order:
the sums are written as explicit left-to-right chains over the n rows (the order of numpy's
``add.reduce(axis=0)`` and of C), clamp-then-round equals C's round-then-clamp on integer bounds,
and ``torch.round`` is round-half-to-even like ``np.rint``. Inductor compiles with
-ffp-contract=off and without unsafe-math, so no product is fused into an FMA and no sum is
reassociated; constants come in as 0-d tensors so that no division is turned into a multiplication
by a rounded reciprocal. tests/kernels/test_kquants.py checks the compiled searches against the numpy ones
bit for bit and the bytes against ggml.

Without a working compiler, or with QCONVERT_COMPILE=0, `available()` is False and the numpy
searches run; both give the same bytes.
"""

from __future__ import annotations

import os
from contextlib import contextmanager

import numpy as np
import torch

__all__ = ["available", "intra_op_threads", "qx_search", "qkx2_search", "MIN_VALUES"]

# Tensors below this many values keep the numpy path: compiling costs seconds once per process
# (inductor caches the C++ on disk for later processes), which small tensors would not earn back.
MIN_VALUES = 1 << 22

_state: dict = {"broken": False}


def available() -> bool:
    return os.environ.get("QCONVERT_COMPILE", "1") != "0" and not _state["broken"]


def _scalar(v) -> torch.Tensor:
    return torch.tensor(float(np.float32(v)), dtype=torch.float32)


@contextmanager
def intra_op_threads(n: int):
    """torch.set_num_threads(n) for the duration (the compiled loops run on torch's thread pool)."""
    old = torch.get_num_threads()
    if n != old:
        torch.set_num_threads(n)
    try:
        yield
    finally:
        if n != old:
            torch.set_num_threads(old)


# ----------------------------------------------------------------------------------------------
# make_qx_quants(rmse_type 1, weights W): Q6_K, and Q3_K with an importance matrix


def _qx_sums(X, W, isc, lo, hi):
    """sum_i (w*x)*l and sum_i (w*l)*l with l = round(clamp(x*isc, lo, hi)), left to right."""
    slx = sl2 = None
    for i in range(X.shape[0]):
        x, w = X[i], W[i]
        l = torch.round(torch.clamp(x * isc, lo, hi))
        a = (w * x) * l
        b = (w * l) * l
        slx = a if slx is None else slx + a
        sl2 = b if sl2 is None else sl2 + b
    return slx, sl2


def _qx_first(X, W, mx, neg_nmax, lo, hi):
    isc = neg_nmax / mx
    slx, sl2 = _qx_sums(X, W, isc, lo, hi)
    scale = torch.where(sl2 != 0, slx / sl2, torch.zeros_like(slx))
    return scale, scale * slx, isc


def _qx_candidate(X, W, mx, num, lo, hi, scale, best, best_isc):
    isc = num / mx
    slx, sl2 = _qx_sums(X, W, isc, lo, hi)
    acc = (sl2 > 0) & (slx * slx > best * sl2)
    new_scale = slx / sl2
    return (torch.where(acc, new_scale, scale), torch.where(acc, new_scale * slx, best),
            torch.where(acc, isc, best_isc))


# ----------------------------------------------------------------------------------------------
# make_qkx2_quants / make_qkx3_quants: Q2_K, Q4_K, Q5_K (with and without importance matrix)


def _qkx2_codes(X, isc, vmin, fmax):
    """C: l = MAX(0, MIN(nmax, nearest_int(iscale*(x - min)))), as float32. Clamp-then-round is
    C's nearest_int only while |iscale*(x - min)| < 2**22; the caller redoes in numpy the columns
    where that is not guaranteed (C's bit trick needs a float->int bitcast, which inductor
    compiles to a scalar loop)."""
    zero = torch.zeros_like(fmax)
    return [torch.round(torch.clamp((X[i] - vmin) * isc, zero, fmax)) for i in range(X.shape[0])]


def _qkx2_error(X, W, L, scale, vmin, mad: bool):
    err = None
    for i in range(X.shape[0]):
        diff = (L[i] * scale + vmin) - X[i]
        t = (diff.abs() if mad else diff * diff) * W[i]
        err = t if err is None else err + t
    return err


def _qkx2_first(X, W, mx, mn, fmax, mad: bool):
    isc = fmax / (mx - mn)
    scale = 1 / isc
    L = _qkx2_codes(X, isc, mn, fmax)
    return isc, _qkx2_error(X, W, L, scale, mn, mad), scale


def _qkx2_candidate(X, W, mx, sum_w, sum_x, num, fmax, best_isc, best_xmin, best_err, scale, vmin,
                    mad: bool):
    isc = num / (mx - vmin)
    L = _qkx2_codes(X, isc, vmin, fmax)
    sum_l = sum_l2 = sum_xl = None
    for i in range(X.shape[0]):
        wl = W[i] * L[i]
        a, b = wl * L[i], wl * X[i]
        sum_l = wl if sum_l is None else sum_l + wl
        sum_l2 = a if sum_l2 is None else sum_l2 + a
        sum_xl = b if sum_xl is None else sum_xl + b
    D = sum_w * sum_l2 - sum_l * sum_l
    this_scale = (sum_w * sum_xl - sum_x * sum_l) / D
    this_min = (sum_l2 * sum_x - sum_l * sum_xl) / D
    pos = this_min > 0
    this_scale = torch.where(pos, sum_xl / sum_l2, this_scale)
    this_min = torch.where(pos, torch.zeros_like(this_min), this_min)
    cur = _qkx2_error(X, W, L, this_scale, this_min, mad)
    acc = (D > 0) & (cur < best_err)
    return (torch.where(acc, isc, best_isc), torch.where(acc, vmin, best_xmin), torch.where(acc, cur, best_err),
            torch.where(acc, this_scale, scale), torch.where(acc, this_min, vmin))


# Distinct top-level functions per `mad` value: dynamo keeps a separate cache per code object.
def _qkx2_first_sq(*args):
    return _qkx2_first(*args, mad=False)


def _qkx2_first_mad(*args):
    return _qkx2_first(*args, mad=True)


def _qkx2_candidate_sq(*args):
    return _qkx2_candidate(*args, mad=False)


def _qkx2_candidate_mad(*args):
    return _qkx2_candidate(*args, mad=True)


_EAGER = {
    "qx_first": _qx_first, "qx_candidate": _qx_candidate,
    "qkx2_first_sq": _qkx2_first_sq, "qkx2_first_mad": _qkx2_first_mad,
    "qkx2_candidate_sq": _qkx2_candidate_sq, "qkx2_candidate_mad": _qkx2_candidate_mad,
}
_compiled: dict = {}


def _fn(name: str):
    fn = _compiled.get(name)
    if fn is None:
        fn = _compiled[name] = torch.compile(_EAGER[name], dynamic=True)
    return fn


def _run(calls):
    """Run `calls(fn)` with compiled kernels; a compiler failure (no C++ compiler, unsupported
    platform) marks the module unavailable and returns None, so the caller takes the numpy path."""
    try:
        # Each function is compiled once per sub-block length (16 or 32) and per intra-op thread
        # count (inductor bakes it into the C++): more variants than dynamo's default limit of 8.
        with torch.no_grad(), torch._dynamo.config.patch(recompile_limit=64):
            return calls(_fn)
    except Exception:  # noqa: BLE001 - any compile/runtime failure of inductor: numpy for good
        _state["broken"] = True
        return None


def _t(a: np.ndarray) -> torch.Tensor:
    return torch.from_numpy(np.ascontiguousarray(a, dtype=np.float32))


def qx_search(X: np.ndarray, W: np.ndarray, mx: np.ndarray, nmax: int, numerators):
    """The candidate loop of make_qx_quants(rmse_type 1) for element-major X, W (n, M), with mx the
    first absolute maximum of each column and the candidates' iscale numerators (float32, in C's
    order): (scale, best iscale) as float32 [M], or None when the compiled path is unavailable.
    Zero columns (amax < eps) are the caller's to fix up."""
    Xt, Wt, mxt = _t(X), _t(W), _t(mx)
    lo, hi = _scalar(-nmax), _scalar(nmax - 1)

    def calls(fn):
        st = fn("qx_first")(Xt, Wt, mxt, _scalar(-nmax), lo, hi)
        for num in numerators:
            st = fn("qx_candidate")(Xt, Wt, mxt, _scalar(num), lo, hi, *st)
        return st

    st = _run(calls)
    if st is None:
        return None
    return st[0].numpy(), st[2].numpy()


def qkx2_search(X, W, mx, mn, sum_w, sum_x, nmax, numerators, use_mad):
    """make_qkx2_quants' search for element-major X, W (n, M) with column max mx, clamped min mn
    (<= 0), the weight sums and the candidates' iscale numerators (float32, in C's order): (best
    iscale, min it was used with, scale, running min) as float32 [M], or None when the compiled path
    is unavailable. Degenerate columns, and columns whose codes could leave the range where rounding
    is C's nearest_int, are the caller's."""
    Xt, Wt, mxt, mnt = _t(X), _t(W), _t(mx), _t(mn)
    swt, sxt = _t(sum_w), _t(sum_x)
    fmax_t = _scalar(nmax)
    kind = "mad" if use_mad else "sq"

    def calls(fn):
        isc, err, scale = fn(f"qkx2_first_{kind}")(Xt, Wt, mxt, mnt, fmax_t)
        st = (isc, mnt, err, scale, mnt.clone())  # two tensors: an aliased pair would be another compile
        for num in numerators:
            st = fn(f"qkx2_candidate_{kind}")(Xt, Wt, mxt, swt, sxt, _scalar(num), fmax_t, *st)
        return st

    st = _run(calls)
    if st is None:
        return None
    best_isc, best_xmin, _, scale, vmin = (t.numpy() for t in st)
    return best_isc, best_xmin, scale, vmin

