"""Triton twins of ggml's K-quant quantizers (Q2_K, Q3_K, Q4_K, Q5_K, Q6_K), with and without an importance
matrix, byte for byte with the CPU path (kernels/ggml/kquants.py, itself ggml's quantize_row_q*_K_ref and
quantize_row_q*_K_impl reimplemented). The algorithms are ggml's, reimplemented from their description in
kernels/ggml/kquants.py: the same float32 operations in the same order, the same candidate order and tie rules.

A tensor goes through four launches:

1. the sub-block search, one lane per sub-block (16 or 32 values), looping over the values in C's order so that
   every running sum is C's sequential sum: make_qkx2_quants (Q2_K, Q4_K, Q5_K), make_qkx3_quants (the same with
   the importance weights qw*sqrt(sigma2 + x*x), rmin -0.9, rdelta 0.05, 36 steps), make_qx_quants with
   rmse_type 1 (Q6_K; Q3_K with an imatrix) or make_q3_quants' coordinate descent (Q3_K). It writes each
   sub-block's scale (and min, and the sum of its weights) and the search's own codes L;
2. the super-block: the sub-block scales (and mins) become 4/6/8-bit integers under fp16 super-scales, by the
   reference's max rule or, with an imatrix, by make_qp_quants (Q2_K, Q4_K, Q5_K) / make_qx_quants (Q3_K); it
   writes the block header bytes and each sub-block's decoded d*sc (and dmin*m);
3. the requantization of every value under those decoded scales (nearest_int((x + dm)/d), clamped), keeping the
   search's L where d*sc is 0, as C's `if (!d) continue` does;
4. the packing of the codes into the block layout (kernels/ggml/kquants.py's byte layouts, ggml's block_q*_K).

Exactness on a GPU: every division is `tl.div_rn` and every square root `tl.sqrt_rn` (Triton's plain `/` and
`tl.sqrt` are approximate on NVIDIA GPUs), launches pass enable_fp_fusion=False (no a*b+c contracted into an
FMA), nearest_int is C's 1.5*2**23 bit trick, and fp16 conversions round to nearest even. Under
TRITON_INTERPRET=1 each operation is one numpy float32 operation.
"""

from __future__ import annotations

import numpy as np
import torch
import triton
import triton.language as tl

from .dequant import interpreting, launch
from .quant import c_int8, fp16_bits

__all__ = ["quantize_k_triton", "K_BLOCK_BYTES"]

K_BLOCK_BYTES = {"Q2_K": 84, "Q3_K": 110, "Q4_K": 144, "Q5_K": 176, "Q6_K": 210}
_F32 = np.float32


@triton.jit
def _f16_value(bits):
    return bits.to(tl.int16).to(tl.float16, bitcast=True).to(tl.float32)


@triton.jit
def _store_u8(ptr, v, mask):
    tl.store(ptr, (v & 0xFF).to(tl.uint8), mask=mask)


# Under TRITON_INTERPRET=1 every call of a @triton.jit helper re-patches triton.language (about 0.2 ms), so the
# kernels spell ggml's nearest_int out inline instead of calling a helper: the int32 bits of v + 1.5*2**23,
# ((v + 12582912.0).to(int32, bitcast) & 0x7FFFFF) - 0x400000 (round to nearest even within +-2**22, and C's
# garbage outside); on a GPU it makes no difference (helpers are inlined).


@triton.jit
def _sumsq_kernel(x_ptr, out_ptr, n_super, FACTOR: tl.constexpr, B: tl.constexpr):
    # sigma2 of each super-block: FACTOR*sum_x2/QK_K, the sum sequential over the 256 values
    sb = tl.program_id(0) * B + tl.arange(0, B)
    live = sb < n_super
    base = x_ptr + tl.minimum(sb, n_super - 1).to(tl.int64) * 256
    acc = tl.zeros([B], tl.float32)
    for j in range(256):
        x = tl.load(base + j)
        acc = acc + x * x
    if FACTOR == 2:
        acc = 2.0 * acc
    tl.store(out_ptr + sb, tl.div_rn(acc, 256.0), mask=live)


@triton.jit
def _weights_kernel(x_ptr, qw_ptr, sig_ptr, w_ptr, n_sub, n_cols, N: tl.constexpr, WMODE: tl.constexpr,
                    SUBS: tl.constexpr, S: tl.constexpr):
    # the weight of every value, as each quantizer defines it: WMODE 0 (Q4_K/Q5_K reference) av_x + |x| with
    # av_x = sqrt(sum_x2/N) of the sub-block; 1 (Q2_K reference) |x|; 2 (an imatrix) qw * sqrt(sigma2 + x*x)
    sub = tl.program_id(0) * S + tl.arange(0, S)
    live = sub < n_sub
    off = tl.minimum(sub, n_sub - 1).to(tl.int64) * N
    base = x_ptr + off
    if WMODE == 0:
        sx2 = tl.zeros([S], tl.float32)
        for j in range(N):
            x = tl.load(base + j)
            sx2 = sx2 + x * x
        av = tl.sqrt_rn(tl.div_rn(sx2, N * 1.0))
        for j in range(N):
            x = tl.load(base + j)
            tl.store(w_ptr + off + j, av + tl.abs(x), mask=live)
    elif WMODE == 1:
        for j in range(N):
            x = tl.load(base + j)
            tl.store(w_ptr + off + j, tl.abs(x), mask=live)
    else:
        sig = tl.load(sig_ptr + off // (N * SUBS))
        qoff = off % n_cols
        for j in range(N):
            x = tl.load(base + j)
            q = tl.load(qw_ptr + qoff + j)
            tl.store(w_ptr + off + j, q * tl.sqrt_rn(sig + x * x), mask=live)


@triton.jit
def _qkx_kernel(x_ptr, w_ptr, nums_ptr, scale_ptr, min_ptr, sw_ptr, l_ptr, n_sub,
                N: tl.constexpr, NMAX: tl.constexpr, NCAND: tl.constexpr, USE_MAD: tl.constexpr, S: tl.constexpr):
    """make_qkx2_quants / make_qkx3_quants(N, NMAX, x, weights, L, &the_min, Laux, rmin, rdelta, nstep, use_mad)
    for S sub-blocks, one per lane; nums_ptr: the NCAND candidate numerators rmin + rdelta*is + nmax."""
    sub = tl.program_id(0) * S + tl.arange(0, S)
    live = sub < n_sub
    off = tl.minimum(sub, n_sub - 1).to(tl.int64) * N
    base = x_ptr + off
    wb = w_ptr + off
    x0 = tl.load(base)
    w0 = tl.load(wb)
    mn = x0
    mx = x0
    sum_w = w0
    sum_x = w0 * x0
    for j in range(1, N):
        x = tl.load(base + j)
        w = tl.load(wb + j)
        mn = tl.where(x < mn, x, mn)
        mx = tl.where(x > mx, x, mx)
        sum_w = sum_w + w
        sum_x = sum_x + w * x
    mn = tl.where(mn > 0, 0.0, mn)
    degenerate = mx == mn
    isc0 = tl.div_rn(tl.full([S], NMAX, tl.float32), mx - mn)
    scale = tl.div_rn(tl.full([S], 1.0, tl.float32), isc0)
    err = tl.zeros([S], tl.float32)
    for j in range(N):
        x = tl.load(base + j)
        w = tl.load(wb + j)
        lf = tl.minimum(tl.maximum(((isc0 * (x - mn) + 12582912.0).to(tl.int32, bitcast=True) & 0x007FFFFF)
                                   - 0x00400000, 0), NMAX).to(tl.float32)
        diff = scale * lf + mn - x
        if USE_MAD:
            diff = tl.abs(diff)
        else:
            diff = diff * diff
        err = err + w * diff
    best_isc = isc0
    best_xmin = mn
    vmin = mn
    for c in range(NCAND):
        isc = tl.div_rn(tl.load(nums_ptr + c) + tl.zeros([S], tl.float32), mx - vmin)
        sl = tl.zeros([S], tl.float32)
        sl2 = tl.zeros([S], tl.float32)
        sxl = tl.zeros([S], tl.float32)
        for j in range(N):
            x = tl.load(base + j)
            w = tl.load(wb + j)
            lf = tl.minimum(tl.maximum(((isc * (x - vmin) + 12582912.0).to(tl.int32, bitcast=True) & 0x007FFFFF)
                                       - 0x00400000, 0), NMAX).to(tl.float32)
            wl = w * lf
            sl = sl + wl
            sl2 = sl2 + wl * lf
            sxl = sxl + wl * x
        dd = sum_w * sl2 - sl * sl
        ts = tl.div_rn(sum_w * sxl - sum_x * sl, dd)
        tm = tl.div_rn(sl2 * sum_x - sl * sxl, dd)
        pos = tm > 0
        tm = tl.where(pos, 0.0, tm)
        ts = tl.where(pos, tl.div_rn(sxl, sl2), ts)
        cur = tl.zeros([S], tl.float32)
        for j in range(N):
            x = tl.load(base + j)
            w = tl.load(wb + j)
            lf = tl.minimum(tl.maximum(((isc * (x - vmin) + 12582912.0).to(tl.int32, bitcast=True) & 0x007FFFFF)
                                       - 0x00400000, 0), NMAX).to(tl.float32)  # Laux[i]
            diff = ts * lf + tm - x
            if USE_MAD:
                diff = tl.abs(diff)
            else:
                diff = diff * diff
            cur = cur + w * diff
        acc = (dd > 0) & (cur < err)
        err = tl.where(acc, cur, err)
        best_isc = tl.where(acc, isc, best_isc)
        best_xmin = tl.where(acc, vmin, best_xmin)
        scale = tl.where(acc, ts, scale)
        vmin = tl.where(acc, tm, vmin)
    scale = tl.where(degenerate, 0.0, scale)
    vmin = tl.where(degenerate, mn, vmin)
    tl.store(scale_ptr + sub, scale, mask=live)
    tl.store(min_ptr + sub, -vmin, mask=live)
    tl.store(sw_ptr + sub, sum_w, mask=live)  # C's sw[j]: 0 + w0 + w1 + ... (the same sum)
    for j in range(N):  # the search's L: a pure function of the winning (iscale, min it was used with)
        x = tl.load(base + j)
        li = tl.minimum(tl.maximum(((best_isc * (x - best_xmin) + 12582912.0).to(tl.int32, bitcast=True)
                                    & 0x007FFFFF) - 0x00400000, 0), NMAX)
        tl.store(l_ptr + off + j, tl.where(degenerate, 0, li).to(tl.uint8), mask=live)


@triton.jit
def _qx_search(v_ptr, voff, w_ptr, woff, live, nums_ptr, N: tl.constexpr, NMAX: tl.constexpr,
               NCAND: tl.constexpr, W_X2: tl.constexpr, S: tl.constexpr):
    """make_qx_quants(N, NMAX, x, L, rmse_type=1, qw) for S lanes (values at v_ptr + voff, weights x*x when W_X2
    else at w_ptr + woff): (scale, best iscale, all-zero flag)."""
    base = v_ptr + voff
    amax = tl.zeros([S], tl.float32)
    mx = tl.zeros([S], tl.float32)
    for j in range(N):
        x = tl.load(base + j)
        ax = tl.abs(x)
        take = ax > amax
        amax = tl.where(take, ax, amax)
        mx = tl.where(take, x, mx)
    zero = amax < 1e-15
    isc = tl.div_rn(tl.full([S], -NMAX, tl.float32), mx)
    slx = tl.zeros([S], tl.float32)
    sl2 = tl.zeros([S], tl.float32)
    for j in range(N):
        x = tl.load(base + j)
        if W_X2:
            w = x * x
        else:
            w = tl.load(w_ptr + woff + j)
        lf = tl.minimum(tl.maximum(((isc * x + 12582912.0).to(tl.int32, bitcast=True) & 0x007FFFFF) - 0x00400000,
                                   -NMAX), NMAX - 1).to(tl.float32)
        slx = slx + (w * x) * lf
        sl2 = sl2 + (w * lf) * lf
    scale = tl.where(sl2 != 0, tl.div_rn(slx, tl.where(sl2 != 0, sl2, 1.0)), 0.0)
    best = scale * slx
    best_isc = isc
    for c in range(NCAND):
        iscc = tl.div_rn(tl.load(nums_ptr + c) + tl.zeros([S], tl.float32), mx)
        a = tl.zeros([S], tl.float32)
        b = tl.zeros([S], tl.float32)
        for j in range(N):
            x = tl.load(base + j)
            if W_X2:
                w = x * x
            else:
                w = tl.load(w_ptr + woff + j)
            lf = tl.minimum(tl.maximum(((iscc * x + 12582912.0).to(tl.int32, bitcast=True) & 0x007FFFFF)
                                       - 0x00400000, -NMAX), NMAX - 1).to(tl.float32)
            a = a + (w * x) * lf
            b = b + (w * lf) * lf
        acc = (b > 0) & (a * a > best * b)
        ns = tl.div_rn(a, b)
        scale = tl.where(acc, ns, scale)
        best = tl.where(acc, ns * a, best)
        best_isc = tl.where(acc, iscc, best_isc)
    scale = tl.where(zero, 0.0, scale)
    return scale, best_isc, zero


@triton.jit
def _qx_kernel(x_ptr, w_ptr, nums_ptr, scale_ptr, sw_ptr, l_ptr, n_sub, w_cols, NMAX: tl.constexpr,
               NCAND: tl.constexpr, W_X2: tl.constexpr, S: tl.constexpr):
    # make_qx_quants(16, NMAX, x, L, 1, weights) per 16-value sub-block (Q6_K; Q3_K with an imatrix); the weights
    # of value k at w_ptr + k % w_cols (x*x when W_X2)
    sub = tl.program_id(0) * S + tl.arange(0, S)
    live = sub < n_sub
    off = tl.minimum(sub, n_sub - 1).to(tl.int64) * 16
    woff = off % w_cols
    scale, best_isc, zero = _qx_search(x_ptr, off, w_ptr, woff, live, nums_ptr, 16, NMAX, NCAND, W_X2, S)
    tl.store(scale_ptr + sub, scale, mask=live)
    sw = tl.zeros([S], tl.float32)
    for j in range(16):
        x = tl.load(x_ptr + off + j)
        if W_X2:
            sw = sw + x * x
        else:
            sw = sw + tl.load(w_ptr + woff + j)
        lv = NMAX + tl.minimum(tl.maximum(((best_isc * x + 12582912.0).to(tl.int32, bitcast=True) & 0x007FFFFF)
                                          - 0x00400000, -NMAX), NMAX - 1)
        tl.store(l_ptr + off + j, tl.where(zero, 0, lv).to(tl.uint8), mask=live)
    tl.store(sw_ptr + sub, sw, mask=live)


@triton.jit
def _q3_kernel(x_ptr, scale_ptr, lw_ptr, l_ptr, n_sub, S: tl.constexpr):
    # make_q3_quants(16, 4, x, L, do_rmse=true): the rmse-weighted start, then up to 5 coordinate-descent passes
    # (a pass that changes nothing leaves the state as it was, so running all 5 equals C's early exit)
    sub = tl.program_id(0) * S + tl.arange(0, S)
    live = sub < n_sub
    off = tl.minimum(sub, n_sub - 1).to(tl.int64) * 16
    base = x_ptr + off
    amax = tl.zeros([S], tl.float32)
    mx = tl.zeros([S], tl.float32)
    for j in range(16):
        x = tl.load(base + j)
        ax = tl.abs(x)
        take = ax > amax
        amax = tl.where(take, ax, amax)
        mx = tl.where(take, x, mx)
    zero = amax < 1e-15
    isc = tl.div_rn(tl.full([S], -4.0, tl.float32), mx)
    slx = tl.zeros([S], tl.float32)
    sl2 = tl.zeros([S], tl.float32)
    for j in range(16):
        x = tl.load(base + j)
        ni = ((isc * x + 12582912.0).to(tl.int32, bitcast=True) & 0x007FFFFF) - 0x00400000  # nearest_int
        lf = tl.minimum(tl.maximum(ni, -4), 3).to(tl.float32)
        tl.store(lw_ptr + off + j, lf, mask=live)
        w = x * x
        slx = slx + (w * x) * lf
        sl2 = sl2 + (w * lf) * lf
    for _ in range(5):
        for j in range(16):
            x = tl.load(base + j)
            w = x * x
            li = tl.load(lw_ptr + off + j)
            s1 = slx - (w * x) * li
            s2 = sl2 - (w * li) * li
            ni = ((tl.div_rn(x * s2, s1) + 12582912.0).to(tl.int32, bitcast=True) & 0x007FFFFF) - 0x00400000
            newf = tl.minimum(tl.maximum(ni, -4), 3).to(tl.float32)
            a = s1 + (w * x) * newf
            b = s2 + (w * newf) * newf
            acc = (s1 > 0) & (newf != li) & (b > 0) & ((a * a) * sl2 > (slx * slx) * b)
            tl.store(lw_ptr + off + j, tl.where(acc, newf, li), mask=live)
            slx = tl.where(acc, a, slx)
            sl2 = tl.where(acc, b, sl2)
    scale = tl.where(sl2 > 0, tl.div_rn(slx, tl.where(sl2 > 0, sl2, 1.0)), 0.0)
    tl.store(scale_ptr + sub, tl.where(zero, 0.0, scale), mask=live)
    for j in range(16):
        li = tl.load(lw_ptr + off + j).to(tl.int32)
        _store_u8(l_ptr + off + j, tl.where(zero, 0, li + 4), live)


@triton.jit
def _qp_quants(v_ptr, w_ptr, l_ptr, sb, live, n_super, nums_ptr, N: tl.constexpr, NMAX: tl.constexpr,
               B: tl.constexpr):
    """make_qp_quants(N, NMAX, x, L, quant_weights) for B super-blocks (x: their N sub-block scales or mins at
    v_ptr + sb*N, weights at w_ptr + sb*N); writes L (C's uint8, as float) at l_ptr + sb*N, returns the scale."""
    off = tl.minimum(sb, n_super - 1).to(tl.int64) * N
    mx = tl.zeros([B], tl.float32)
    for i in range(N):
        v = tl.load(v_ptr + off + i)
        mx = tl.where(mx > v, mx, v)
    zero = mx < 1e-15
    isc = tl.div_rn(tl.full([B], NMAX, tl.float32), mx)
    sc0 = tl.div_rn(tl.full([B], 1.0, tl.float32), isc)
    best = tl.zeros([B], tl.float32)
    for i in range(N):
        v = tl.load(v_ptr + off + i)
        w = tl.load(w_ptr + off + i)
        ni = ((isc * v + 12582912.0).to(tl.int32, bitcast=True) & 0x007FFFFF) - 0x00400000
        lf = (ni & 0xFF).to(tl.float32)  # stored into uint8 L without a clamp
        diff = v - sc0 * lf
        best = best + (w * diff) * diff
    for c in range(8):
        iscc = tl.div_rn(tl.load(nums_ptr + c) + tl.zeros([B], tl.float32), mx)
        scc = tl.div_rn(tl.full([B], 1.0, tl.float32), iscc)
        mse = tl.zeros([B], tl.float32)
        for i in range(N):
            v = tl.load(v_ptr + off + i)
            w = tl.load(w_ptr + off + i)
            ni = ((iscc * v + 12582912.0).to(tl.int32, bitcast=True) & 0x007FFFFF) - 0x00400000
            lf = tl.minimum(ni, NMAX).to(tl.float32)
            diff = v - scc * lf
            mse = mse + (w * diff) * diff
        acc = mse < best
        best = tl.where(acc, mse, best)
        isc = tl.where(acc, iscc, isc)
    slx = tl.zeros([B], tl.float32)
    sl2 = tl.zeros([B], tl.float32)
    for i in range(N):
        v = tl.load(v_ptr + off + i)
        w = tl.load(w_ptr + off + i)
        li = tl.minimum((((isc * v) + 12582912.0).to(tl.int32, bitcast=True) & 0x007FFFFF) - 0x00400000, NMAX)
        lf = li.to(tl.float32)
        tl.store(l_ptr + off + i, (li & 0xFF).to(tl.float32), mask=live)
        slx = slx + (w * v) * lf
        sl2 = sl2 + (w * lf) * lf
    for _ in range(5):
        for i in range(N):
            v = tl.load(v_ptr + off + i)
            w = tl.load(w_ptr + off + i)
            li = tl.load(l_ptr + off + i)
            s1 = slx - (w * v) * li
            s2 = sl2 - (w * li) * li
            ni = ((tl.div_rn(v * s2, s1) + 12582912.0).to(tl.int32, bitcast=True) & 0x007FFFFF) - 0x00400000
            new = tl.minimum(ni, NMAX)
            newf = new.to(tl.float32)
            a = s1 + (w * v) * newf
            b = s2 + (w * newf) * newf
            acc = (s1 > 0) & (s2 > 0) & (newf != li) & ((a * a) * sl2 > (slx * slx) * b)
            tl.store(l_ptr + off + i, tl.where(acc, (new & 0xFF).to(tl.float32), li), mask=live)
            slx = tl.where(acc, a, slx)
            sl2 = tl.where(acc, b, sl2)
    scale = tl.where(sl2 > 0, tl.div_rn(slx, tl.where(sl2 > 0, sl2, 1.0)), 0.0)
    for i in range(N):
        li = tl.load(l_ptr + off + i)
        tl.store(l_ptr + off + i, tl.where(zero, 0.0, li), mask=live)
    return tl.where(zero, 0.0, scale)


@triton.jit
def _super_q45_kernel(out_ptr, sc_ptr, mn_ptr, sw_ptr, ls_ptr, lm_ptr, nums_ptr, dq_ptr, dmq_ptr, n_super,
                      NBYTES: tl.constexpr, IMATRIX: tl.constexpr, B: tl.constexpr):
    # Q4_K / Q5_K: 8 sub-block scales and mins -> 6-bit integers under fp16 d and dmin
    sb = tl.program_id(0) * B + tl.arange(0, B)
    live = sb < n_super
    off = tl.minimum(sb, n_super - 1).to(tl.int64) * 8
    if IMATRIX:  # quantize_row_q{4,5}_K_impl: make_qp_quants(8, 63, scales|mins, L, sw)
        d16 = fp16_bits(_qp_quants(sc_ptr, sw_ptr, ls_ptr, sb, live, n_super, nums_ptr, 8, 63, B))
        dm16 = fp16_bits(_qp_quants(mn_ptr, sw_ptr, lm_ptr, sb, live, n_super, nums_ptr, 8, 63, B))
        tl.debug_barrier()
    else:  # the reference: running max from 0 with `>`, then nearest_int(63/max * s) into a uint8, MIN 63
        max_s = tl.zeros([B], tl.float32)
        max_m = tl.zeros([B], tl.float32)
        for j in range(8):
            s = tl.load(sc_ptr + off + j)
            m = tl.load(mn_ptr + off + j)
            max_s = tl.where(s > max_s, s, max_s)
            max_m = tl.where(m > max_m, m, max_m)
        inv_s = tl.where(max_s > 0, tl.div_rn(tl.full([B], 63.0, tl.float32), tl.where(max_s > 0, max_s, 1.0)), 0.0)
        inv_m = tl.where(max_m > 0, tl.div_rn(tl.full([B], 63.0, tl.float32), tl.where(max_m > 0, max_m, 1.0)), 0.0)
        for j in range(8):
            s = tl.load(sc_ptr + off + j)
            m = tl.load(mn_ptr + off + j)
            ni_s = ((inv_s * s + 12582912.0).to(tl.int32, bitcast=True) & 0x007FFFFF) - 0x00400000
            ni_m = ((inv_m * m + 12582912.0).to(tl.int32, bitcast=True) & 0x007FFFFF) - 0x00400000
            tl.store(ls_ptr + off + j, (ni_s & 0xFF).to(tl.float32), mask=live)
            tl.store(lm_ptr + off + j, (ni_m & 0xFF).to(tl.float32), mask=live)
        tl.debug_barrier()
        d16 = fp16_bits(tl.div_rn(max_s, 63.0))
        dm16 = fp16_bits(tl.div_rn(max_m, 63.0))
    base = out_ptr + sb.to(tl.int64) * NBYTES
    _store_u8(base, d16, live)
    _store_u8(base + 1, d16 >> 8, live)
    _store_u8(base + 2, dm16, live)
    _store_u8(base + 3, dm16 >> 8, live)
    df = _f16_value(d16)
    dmf = _f16_value(dm16)
    for j in range(4):
        ls_a = tl.minimum(tl.load(ls_ptr + off + j).to(tl.int32), 63)
        ls_b = tl.minimum(tl.load(ls_ptr + off + j + 4).to(tl.int32), 63)
        lm_a = tl.minimum(tl.load(lm_ptr + off + j).to(tl.int32), 63)
        lm_b = tl.minimum(tl.load(lm_ptr + off + j + 4).to(tl.int32), 63)
        _store_u8(base + 4 + j, ls_a | ((ls_b >> 4) << 6), live)
        _store_u8(base + 8 + j, lm_a | ((lm_b >> 4) << 6), live)
        _store_u8(base + 12 + j, (ls_b & 0xF) | ((lm_b & 0xF) << 4), live)
        tl.store(dq_ptr + off + j, df * ls_a.to(tl.float32), mask=live)
        tl.store(dq_ptr + off + j + 4, df * ls_b.to(tl.float32), mask=live)
        tl.store(dmq_ptr + off + j, dmf * lm_a.to(tl.float32), mask=live)
        tl.store(dmq_ptr + off + j + 4, dmf * lm_b.to(tl.float32), mask=live)


@triton.jit
def _super_q2_kernel(out_ptr, sc_ptr, mn_ptr, sw_ptr, ls_ptr, lm_ptr, nums_ptr, dq_ptr, dmq_ptr, n_super,
                     IMATRIX: tl.constexpr, B: tl.constexpr):
    # Q2_K: 16 sub-block scales and mins -> 4-bit integers under fp16 d and dmin, one byte each
    sb = tl.program_id(0) * B + tl.arange(0, B)
    live = sb < n_super
    off = tl.minimum(sb, n_super - 1).to(tl.int64) * 16
    if IMATRIX:  # quantize_row_q2_K_impl: make_qp_quants(16, 15, scales|mins, L, sw)
        d16 = fp16_bits(_qp_quants(sc_ptr, sw_ptr, ls_ptr, sb, live, n_super, nums_ptr, 16, 15, B))
        dm16 = fp16_bits(_qp_quants(mn_ptr, sw_ptr, lm_ptr, sb, live, n_super, nums_ptr, 16, 15, B))
        tl.debug_barrier()
    else:  # the reference: 15/max, nearest_int, stored into a uint8 (wrapping), d = max/15 (0 without a max)
        max_s = tl.zeros([B], tl.float32)
        max_m = tl.zeros([B], tl.float32)
        for j in range(16):
            s = tl.load(sc_ptr + off + j)
            m = tl.load(mn_ptr + off + j)
            max_s = tl.where(s > max_s, s, max_s)
            max_m = tl.where(m > max_m, m, max_m)
        inv_s = tl.div_rn(tl.full([B], 15.0, tl.float32), tl.where(max_s > 0, max_s, 1.0))
        inv_m = tl.div_rn(tl.full([B], 15.0, tl.float32), tl.where(max_m > 0, max_m, 1.0))
        for j in range(16):
            s = tl.load(sc_ptr + off + j)
            m = tl.load(mn_ptr + off + j)
            ni_s = ((inv_s * s + 12582912.0).to(tl.int32, bitcast=True) & 0x007FFFFF) - 0x00400000
            ni_m = ((inv_m * m + 12582912.0).to(tl.int32, bitcast=True) & 0x007FFFFF) - 0x00400000
            tl.store(ls_ptr + off + j, tl.where(max_s > 0, ni_s, 0).to(tl.float32), mask=live)
            tl.store(lm_ptr + off + j, tl.where(max_m > 0, ni_m, 0).to(tl.float32), mask=live)
        tl.debug_barrier()
        d16 = tl.where(max_s > 0, fp16_bits(tl.div_rn(max_s, 15.0)), 0)
        dm16 = tl.where(max_m > 0, fp16_bits(tl.div_rn(max_m, 15.0)), 0)
    base = out_ptr + sb.to(tl.int64) * 84
    df = _f16_value(d16)
    dmf = _f16_value(dm16)
    for j in range(16):
        ls = tl.load(ls_ptr + off + j).to(tl.int32)
        lm = tl.load(lm_ptr + off + j).to(tl.int32)
        byte = (ls | (lm << 4)) & 0xFF
        _store_u8(base + j, byte, live)
        tl.store(dq_ptr + off + j, df * (byte & 0xF).to(tl.float32), mask=live)
        tl.store(dmq_ptr + off + j, dmf * (byte >> 4).to(tl.float32), mask=live)
    _store_u8(base + 80, d16, live)
    _store_u8(base + 81, d16 >> 8, live)
    _store_u8(base + 82, dm16, live)
    _store_u8(base + 83, dm16 >> 8, live)


@triton.jit
def _super_q6_kernel(out_ptr, sc_ptr, dq_ptr, zf_ptr, n_super, B: tl.constexpr):
    # Q6_K: the scale of largest magnitude (first one on ties) -> iscale -128/max, int8 scales, fp16 d = 1/iscale;
    # an all-zero super-block (max |scale| < GROUP_MAX_EPS) is memset to zero
    sb = tl.program_id(0) * B + tl.arange(0, B)
    live = sb < n_super
    off = tl.minimum(sb, n_super - 1).to(tl.int64) * 16
    amax = tl.zeros([B], tl.float32)
    mx = tl.zeros([B], tl.float32)
    for j in range(16):
        s = tl.load(sc_ptr + off + j)
        a = tl.abs(s)
        take = a > amax
        amax = tl.where(take, a, amax)
        mx = tl.where(take, s, mx)
    zero = amax < 1e-15
    isc = tl.div_rn(tl.full([B], -128.0, tl.float32), tl.where(zero, 1.0, mx))
    d16 = tl.where(zero, 0, fp16_bits(tl.div_rn(tl.full([B], 1.0, tl.float32), isc)))
    df = _f16_value(d16)
    base = out_ptr + sb.to(tl.int64) * 210
    for j in range(16):
        s = tl.load(sc_ptr + off + j)
        ni = ((isc * s + 12582912.0).to(tl.int32, bitcast=True) & 0x007FFFFF) - 0x00400000
        byte = tl.where(zero, 0, tl.minimum(ni, 127) & 0xFF)  # MIN(127, ...) into an int8
        _store_u8(base + 192 + j, byte, live)
        tl.store(dq_ptr + off + j, df * c_int8(byte).to(tl.float32), mask=live)
        tl.store(zf_ptr + off + j, zero.to(tl.int8), mask=live)
    _store_u8(base + 208, d16, live)
    _store_u8(base + 209, d16 >> 8, live)


@triton.jit
def _super_q3_kernel(out_ptr, sc_ptr, sw_ptr, ls_ptr, nums_ptr, dq_ptr, n_super, IMATRIX: tl.constexpr,
                     NCAND: tl.constexpr, B: tl.constexpr):
    # Q3_K: 16 signed sub-block scales -> 6-bit integers (stored + 32) under fp16 d
    sb = tl.program_id(0) * B + tl.arange(0, B)
    live = sb < n_super
    off = tl.minimum(sb, n_super - 1).to(tl.int64) * 16
    if IMATRIX:  # quantize_row_q3_K_impl: make_qx_quants(16, 32, scales, Ls, 1, sw)
        d_block, best_isc, zero = _qx_search(sc_ptr, off, sw_ptr, off, live, nums_ptr, 16, 32, NCAND, False, B)
        d16 = fp16_bits(d_block)
        for j in range(16):
            s = tl.load(sc_ptr + off + j)
            ni = ((best_isc * s + 12582912.0).to(tl.int32, bitcast=True) & 0x007FFFFF) - 0x00400000
            lv = 32 + tl.minimum(tl.maximum(ni, -32), 31)
            tl.store(ls_ptr + off + j, tl.where(zero, 0, lv).to(tl.float32), mask=live)
    else:  # the reference: -32/max of the first largest |scale|, int8 nearest_int clamped to -32..31, + 32
        amax = tl.zeros([B], tl.float32)
        mx = tl.zeros([B], tl.float32)
        for j in range(16):
            s = tl.load(sc_ptr + off + j)
            a = tl.abs(s)
            take = a > amax
            amax = tl.where(take, a, amax)
            mx = tl.where(take, s, mx)
        nz = mx != 0
        isc = tl.div_rn(tl.full([B], -32.0, tl.float32), tl.where(nz, mx, 1.0))
        for j in range(16):
            s = tl.load(sc_ptr + off + j)
            ni = ((isc * s + 12582912.0).to(tl.int32, bitcast=True) & 0x007FFFFF) - 0x00400000
            lv = tl.minimum(tl.maximum(c_int8(ni), -32), 31) + 32  # int8_t l = nearest_int(...)
            tl.store(ls_ptr + off + j, tl.where(nz, lv, 0).to(tl.float32), mask=live)
        d16 = tl.where(nz, fp16_bits(tl.div_rn(tl.full([B], 1.0, tl.float32), isc)), 0)
    tl.debug_barrier()
    base = out_ptr + sb.to(tl.int64) * 110
    df = _f16_value(d16)
    for j in range(8):
        la = tl.load(ls_ptr + off + j).to(tl.int32)
        lb = tl.load(ls_ptr + off + j + 8).to(tl.int32)
        _store_u8(base + 96 + j, (la & 0xF) | ((lb & 0xF) << 4), live)
        tl.store(dq_ptr + off + j, df * (la - 32).to(tl.float32), mask=live)
        tl.store(dq_ptr + off + j + 8, df * (lb - 32).to(tl.float32), mask=live)
    for m in range(4):
        hb = tl.zeros([B], tl.int32)
        for k in range(4):
            lv = tl.load(ls_ptr + off + m + 4 * k).to(tl.int32)
            hb = hb | ((lv >> 4) << (2 * k))
        _store_u8(base + 104 + m, hb, live)
    _store_u8(base + 108, d16, live)
    _store_u8(base + 109, d16 >> 8, live)


@triton.jit
def _requant_kernel(x_ptr, dq_ptr, dmq_ptr, zf_ptr, l_ptr, n, SUB: tl.constexpr, LO: tl.constexpr,
                    HI: tl.constexpr, HAS_MIN: tl.constexpr, HAS_ZF: tl.constexpr, BE: tl.constexpr):
    # l = MAX(LO, MIN(HI, nearest_int((x + dm)/d))) - LO under the decoded sub-block scales; the search's L where
    # d is 0 (C: `if (!d) continue`); an all-zero Q6_K super-block is all zeros
    e = tl.program_id(0).to(tl.int64) * BE + tl.arange(0, BE)
    live = e < n
    ec = tl.minimum(e, n - 1)  # tail lanes read the last value (valid addresses, no mask); they store nothing
    s = ec // SUB
    d = tl.load(dq_ptr + s)
    x = tl.load(x_ptr + ec)
    if HAS_MIN:
        q = tl.div_rn(x + tl.load(dmq_ptr + s), tl.where(d == 0, 1.0, d))
    else:
        q = tl.div_rn(x, tl.where(d == 0, 1.0, d))
    ni = ((q + 12582912.0).to(tl.int32, bitcast=True) & 0x007FFFFF) - 0x00400000
    lv = tl.minimum(tl.maximum(ni, LO), HI) - LO
    lv = tl.where(d == 0, tl.load(l_ptr + ec).to(tl.int32), lv)
    if HAS_ZF:
        lv = tl.where(tl.load(zf_ptr + s) != 0, 0, lv)
    _store_u8(l_ptr + e, lv, live)


@triton.jit
def _pack_k_kernel(l_ptr, out_ptr, n_super, KIND: tl.constexpr, NBYTES: tl.constexpr, B: tl.constexpr):
    # the codes L (uint8, 256 per super-block) into the block layout of Q2_K..Q6_K (KIND 2..6); lane = (block, l)
    t = tl.program_id(0).to(tl.int64) * B + tl.arange(0, B)
    sb = t // 32
    lane = t % 32
    live = sb < n_super
    lb = l_ptr + sb * 256 + lane
    ob = out_ptr + sb * NBYTES + lane
    if KIND == 2 or KIND == 3:
        QS: tl.constexpr = 16 if KIND == 2 else 32
        for h in tl.static_range(2):
            byte = tl.zeros([B], tl.int32)
            for k in tl.static_range(4):
                byte = byte | ((tl.load(lb + 128 * h + 32 * k, mask=live, other=0).to(tl.int32) & 3) << (2 * k))
            _store_u8(ob + QS + 32 * h, byte, live)
        if KIND == 3:  # the high bit (L > 3) of element 32k + l is bit k of hmask[l]
            hm = tl.zeros([B], tl.int32)
            for k in tl.static_range(8):
                hm = hm | ((tl.load(lb + 32 * k, mask=live, other=0).to(tl.int32) > 3).to(tl.int32) << k)
            _store_u8(ob, hm, live)
    elif KIND == 4 or KIND == 5:
        QS: tl.constexpr = 16 if KIND == 4 else 48
        for c in tl.static_range(4):
            a = tl.load(lb + 64 * c, mask=live, other=0).to(tl.int32)
            b = tl.load(lb + 64 * c + 32, mask=live, other=0).to(tl.int32)
            _store_u8(ob + QS + 32 * c, (a & 0xF) | ((b & 0xF) << 4), live)
        if KIND == 5:
            qh = tl.zeros([B], tl.int32)
            for k in tl.static_range(8):
                qh = qh | ((tl.load(lb + 32 * k, mask=live, other=0).to(tl.int32) >> 4) << k)
            _store_u8(ob + 16, qh, live)
    else:
        for h in tl.static_range(2):
            for a in tl.static_range(2):
                lo = tl.load(lb + 128 * h + 32 * a, mask=live, other=0).to(tl.int32)
                hi = tl.load(lb + 128 * h + 32 * a + 64, mask=live, other=0).to(tl.int32)
                _store_u8(ob + 64 * h + 32 * a, (lo & 0xF) | ((hi & 0xF) << 4), live)
            qh = tl.zeros([B], tl.int32)
            for k in tl.static_range(4):
                qh = qh | ((tl.load(lb + 128 * h + 32 * k, mask=live, other=0).to(tl.int32) >> 4) << (2 * k))
            _store_u8(ob + 128 + 32 * h, qh, live)


# ---------------------------------------------------------------------------------------------------
# host side


def _qkx_numerators(nmax: int, rmin: float, rdelta: float, nstep: int) -> np.ndarray:
    """make_qkx2/qkx3's iscale numerators rmin + rdelta*is + nmax, is = 0..nstep, each step a float32 operation."""
    return np.array([_F32(_F32(_F32(rmin) + _F32(_F32(rdelta) * _F32(s))) + _F32(nmax)) for s in range(nstep + 1)],
                    dtype=_F32)


def _qx_numerators(nmax: int) -> np.ndarray:
    """make_qx_quants' -(nmax + 0.1f*is), is = -9..9 without 0."""
    return np.array([-_F32(_F32(nmax) + _F32(_F32(0.1) * _F32(s))) for s in range(-9, 10) if s], dtype=_F32)


def _qp_numerators(nmax: int) -> np.ndarray:
    """make_qp_quants' 0.1f*is + nmax, is = -4..4 without 0."""
    return np.array([_F32(_F32(_F32(0.1) * _F32(s)) + _F32(nmax)) for s in range(-4, 5) if s], dtype=_F32)


# (N, NMAX, rmin, rdelta, nstep, weight mode, use_mad) of the sub-block search, without / with an imatrix
_QKX = {("Q2_K", False): (16, 3, -0.5, 0.1, 15, 1, True), ("Q2_K", True): (16, 3, -0.9, 0.05, 36, 2, False),
        ("Q4_K", False): (32, 15, -1.0, 0.1, 20, 0, False), ("Q4_K", True): (32, 15, -0.9, 0.05, 36, 2, False),
        ("Q5_K", False): (32, 31, -0.5, 0.1, 15, 0, False), ("Q5_K", True): (32, 31, -0.9, 0.05, 36, 2, False)}


def _lanes(n: int, gpu: int, interp: int) -> int:
    """Lanes of one program: a warp-friendly count on a GPU, the whole problem (up to a cap) under the
    interpreter, where every operation is one numpy call over all lanes."""
    return min(interp, triton.next_power_of_2(max(1, n))) if interpreting() else gpu


def _t(a: np.ndarray, dev) -> torch.Tensor:
    return torch.from_numpy(a).to(dev)


def quantize_k_triton(x: torch.Tensor, name: str, imatrix: torch.Tensor | None = None) -> torch.Tensor:
    """float32 [rows, n] (n % 256 == 0) on a Triton device -> uint8 [rows, n/256*block bytes], byte-identical to
    kernels/kquants.quantize_k(x, name, imatrix) (ggml's quantize_row_q*_K_ref, or _impl with `imatrix` [n])."""
    if name not in K_BLOCK_BYTES:
        raise ValueError(f"no Triton quantizer for {name}")
    rows, n = x.shape
    if n % 256:
        raise ValueError(f"rows of {n} values are not whole 256-value super-blocks")
    dev = x.device
    nbytes = K_BLOCK_BYTES[name]
    x = x.to(torch.float32).contiguous()
    total = rows * n
    n_super = total // 256
    out = torch.empty((rows, n // 256 * nbytes), dtype=torch.uint8, device=dev)
    codes = torch.empty(total, dtype=torch.uint8, device=dev)
    qw = None if imatrix is None else imatrix.to(dev, torch.float32).contiguous()
    has_im = qw is not None
    sub_n = 32 if name in ("Q4_K", "Q5_K") else 16
    n_sub = total // sub_n
    subs = 256 // sub_n
    f32 = dict(dtype=torch.float32, device=dev)
    scales = torch.empty(n_sub, **f32)
    mins = torch.empty(n_sub, **f32)
    sw = torch.empty(n_sub, **f32)
    dq = torch.empty(n_sub, **f32)
    dmq = torch.zeros(n_sub, **f32)
    zflag = torch.zeros(n_sub, dtype=torch.int8, device=dev)
    ls = torch.zeros(n_sub, **f32)
    lm = torch.zeros(n_sub, **f32)
    sig = torch.zeros(max(1, n_super), **f32)
    dummy = torch.zeros(1, **f32)
    S = _lanes(n_sub, 128, 1 << 14)
    B = _lanes(n_super, 64, 1 << 12)
    if has_im and name != "Q6_K":
        launch(_sumsq_kernel, (triton.cdiv(n_super, B),), x, sig, n_super, FACTOR=1 if name == "Q2_K" else 2, B=B)
    qw_arg = qw if has_im else dummy
    qp_nums = _t(_qp_numerators(63 if name in ("Q4_K", "Q5_K") else 15), dev)
    if name in ("Q2_K", "Q4_K", "Q5_K"):
        N, nmax, rmin, rdelta, nstep, wmode, mad = _QKX[(name, has_im)]
        nums = _t(_qkx_numerators(nmax, rmin, rdelta, nstep), dev)
        weights = torch.empty(total, **f32)
        launch(_weights_kernel, (triton.cdiv(n_sub, S),), x, qw_arg, sig, weights, n_sub, n, N=N, WMODE=wmode,
               SUBS=subs, S=S)
        launch(_qkx_kernel, (triton.cdiv(n_sub, S),), x, weights, nums, scales, mins, sw, codes, n_sub,
               N=N, NMAX=nmax, NCAND=nstep + 1, USE_MAD=mad, S=S)
        del weights
        if name == "Q2_K":
            launch(_super_q2_kernel, (triton.cdiv(n_super, B),), out, scales, mins, sw, ls, lm, qp_nums, dq, dmq,
                   n_super, IMATRIX=has_im, B=B)
        else:
            launch(_super_q45_kernel, (triton.cdiv(n_super, B),), out, scales, mins, sw, ls, lm, qp_nums, dq, dmq,
                   n_super, NBYTES=nbytes, IMATRIX=has_im, B=B)
        lo, hi, has_min = 0, nmax, True
    elif name == "Q6_K":
        nums = _t(_qx_numerators(32), dev)
        launch(_qx_kernel, (triton.cdiv(n_sub, S),), x, qw_arg, nums, scales, sw, codes, n_sub, n,
               NMAX=32, NCAND=18, W_X2=not has_im, S=S)  # weights: the imatrix values themselves, or x*x
        launch(_super_q6_kernel, (triton.cdiv(n_super, B),), out, scales, dq, zflag, n_super, B=B)
        lo, hi, has_min = -32, 31, False
    else:  # Q3_K
        if has_im:  # make_qx_quants(16, 4, x, L, 1, qw*sqrt(sigma2 + x*x))
            weights = torch.empty(total, **f32)
            launch(_weights_kernel, (triton.cdiv(n_sub, S),), x, qw_arg, sig, weights, n_sub, n, N=16, WMODE=2,
                   SUBS=subs, S=S)
            launch(_qx_kernel, (triton.cdiv(n_sub, S),), x, weights, _t(_qx_numerators(4), dev), scales, sw,
                   codes, n_sub, total, NMAX=4, NCAND=18, W_X2=False, S=S)
            del weights
        else:
            lw = torch.empty(total, **f32)
            launch(_q3_kernel, (triton.cdiv(n_sub, S),), x, scales, lw, codes, n_sub, S=S)
            del lw
        launch(_super_q3_kernel, (triton.cdiv(n_super, B),), out, scales, sw, ls, _t(_qx_numerators(32), dev), dq,
               n_super, IMATRIX=has_im, NCAND=18, B=B)
        lo, hi, has_min = -4, 3, False
    BE = _lanes(total, 256, 1 << 18)
    launch(_requant_kernel, (triton.cdiv(total, BE),), x, dq, dmq, zflag, codes, total, SUB=sub_n, LO=lo, HI=hi,
           HAS_MIN=has_min, HAS_ZF=name == "Q6_K", BE=BE)
    kind = int(name[1])
    BP = _lanes(n_super * 32, 128, 1 << 16)
    launch(_pack_k_kernel, (triton.cdiv(n_super * 32, BP),), codes, out, n_super, KIND=kind, NBYTES=nbytes, B=BP)
    return out
