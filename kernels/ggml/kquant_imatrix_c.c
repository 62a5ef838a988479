/* qconvert: ggml's K quantizers WITH an importance matrix (quantize_row_q2_K_impl .. _q6_K_impl of
 * ggml-quants.c, what ggml_quantize_chunk runs when it is given quant_weights) in plain C, one super-block at a
 * time. Built with kernels/ggml/iq_c.c into one library by kernels/ggml/iq_c.py (kquant_c.c, the reference K
 * quantizers without an imatrix, is another helper's file).
 *
 * Why: the numpy codecs of kernels/ggml/kquants.py run these searches compiled by torch.compile on large tensors,
 * which costs every new process 10-15 s of tracing before its first imatrix K tensor. This path has no such cost.
 *
 * Exactness: the same float32 expressions in the same association order as ggml's C (the numpy codecs describe
 * them: make_qkx3_quants, make_qp_quants, make_qx_quants), built with -ffp-contract=off and no fast-math;
 * tests/kernels/test_iq_c.py compares the bytes with ggml_quantize_chunk.
 */
#include <stdint.h>
#include <string.h>
#include <math.h>

#define K_EPS 1e-15f  /* GROUP_MAX_EPS */

static inline int32_t k_f2i(float f) { int32_t i; memcpy(&i, &f, 4); return i; }
static inline float k_i2f(uint32_t i) { float f; memcpy(&f, &i, 4); return f; }

static inline int k_nearest_int(float fval) {
    float val = fval + 12582912.f;
    return (k_f2i(val) & 0x007fffff) - 0x00400000;
}

static uint16_t k_fp32_to_fp16(float f) {
    float base = (fabsf(f) * 0x1.0p+112f) * 0x1.0p-110f;
    const uint32_t w = (uint32_t)k_f2i(f);
    const uint32_t shl1_w = w + w;
    const uint32_t sign = w & 0x80000000u;
    uint32_t bias = shl1_w & 0xFF000000u;
    if (bias < 0x71000000u) bias = 0x71000000u;
    base = k_i2f((bias >> 1) + 0x07800000u) + base;
    const uint32_t bits = (uint32_t)k_f2i(base);
    const uint32_t nonsign = ((bits >> 13) & 0x00007C00u) + (bits & 0x00000FFFu);
    return (uint16_t)((sign >> 16) | (shl1_w > 0xFF000000u ? 0x7E00u : nonsign));
}

static float k_fp16_to_fp32(uint16_t h) {
    uint32_t sign = (uint32_t)(h & 0x8000u) << 16, e = (h >> 10) & 0x1fu, m = h & 0x3ffu;
    if (e == 31) return k_i2f(sign | 0x7f800000u | (m << 13));
    float v = e == 0 ? (float)m * 0x1p-24f : k_i2f(((e + 112u) << 23) | (m << 13));
    return sign ? -v : v;
}

static inline int k_clamp(int v, int lo, int hi) { return v < lo ? lo : (v > hi ? hi : v); }

/* make_qp_quants: non-negative x, codes 0..nmax (L uint8_t as ggml's: an unclamped start wraps alike) */
/* ggml's make_qp_quants; not static: iq_c.c (linked into the same library) starts IQ2_XXS's search from it */
float k_make_qp(int n, int nmax, const float *x, uint8_t *L, const float *w) {
    float max = 0;
    for (int i = 0; i < n; ++i) max = max > x[i] ? max : x[i];
    if (max < K_EPS) { memset(L, 0, n); return 0.f; }
    float iscale = nmax / max;
    for (int i = 0; i < n; ++i) L[i] = (uint8_t)k_nearest_int(iscale * x[i]);
    float scale = 1 / iscale;
    float best_mse = 0;
    for (int i = 0; i < n; ++i) {
        float diff = x[i] - scale * L[i];
        best_mse += w[i] * diff * diff;
    }
    for (int is = -4; is <= 4; ++is) {
        if (is == 0) continue;
        float iscale_is = (0.1f * is + nmax) / max;
        float scale_is = 1 / iscale_is;
        float mse = 0;
        for (int i = 0; i < n; ++i) {
            int l = k_nearest_int(iscale_is * x[i]);
            if (l > nmax) l = nmax;
            float diff = x[i] - scale_is * l;
            mse += w[i] * diff * diff;
        }
        if (mse < best_mse) { best_mse = mse; iscale = iscale_is; }
    }
    float sumlx = 0, suml2 = 0;
    for (int i = 0; i < n; ++i) {
        int l = k_nearest_int(iscale * x[i]);
        if (l > nmax) l = nmax;
        L[i] = (uint8_t)l;
        sumlx += w[i] * x[i] * l;
        suml2 += w[i] * l * l;
    }
    for (int itry = 0; itry < 5; ++itry) {
        int n_changed = 0;
        for (int i = 0; i < n; ++i) {
            float wi = w[i];
            float slx = sumlx - wi * x[i] * L[i];
            float sl2 = suml2 - wi * L[i] * L[i];
            if (slx > 0 && sl2 > 0) {
                int new_l = k_nearest_int(x[i] * sl2 / slx);
                if (new_l > nmax) new_l = nmax;
                if (new_l != L[i]) {
                    slx += wi * x[i] * new_l;
                    sl2 += wi * new_l * new_l;
                    if (slx * slx * suml2 > sumlx * sumlx * sl2) {
                        L[i] = (uint8_t)new_l; sumlx = slx; suml2 = sl2;
                        ++n_changed;
                    }
                }
            }
        }
        if (!n_changed) break;
    }
    return suml2 > 0.0f ? sumlx / suml2 : 0.0f;
}

/* make_qkx3_quants with weights, squared error (use_mad false): codes 0..nmax of (x - min), -> scale, *the_min */
static float k_make_qkx3(int n, int nmax, const float *x, const float *w, uint8_t *L, float *the_min,
                         float rmin, float rdelta, int nstep) {
    uint8_t Laux[32];
    float min = x[0], max = x[0];
    float sum_w = w[0];
    float sum_x = sum_w * x[0];
    for (int i = 1; i < n; ++i) {
        if (x[i] < min) min = x[i];
        if (x[i] > max) max = x[i];
        sum_w += w[i];
        sum_x += w[i] * x[i];
    }
    if (min > 0) min = 0;
    if (max <= min) { memset(L, 0, n); *the_min = -min; return 0.f; }
    float iscale = nmax / (max - min);
    float scale = 1 / iscale;
    float best_mad = 0;
    for (int i = 0; i < n; ++i) {
        int l = k_nearest_int(iscale * (x[i] - min));
        L[i] = (uint8_t)k_clamp(l, 0, nmax);
        float diff = scale * L[i] + min - x[i];
        best_mad += w[i] * (diff * diff);
    }
    for (int is = 0; is <= nstep; ++is) {
        iscale = (rmin + rdelta * is + nmax) / (max - min);
        float sum_l = 0, sum_l2 = 0, sum_xl = 0;
        for (int i = 0; i < n; ++i) {
            int l = k_clamp(k_nearest_int(iscale * (x[i] - min)), 0, nmax);
            Laux[i] = (uint8_t)l;
            sum_l += w[i] * l;
            sum_l2 += w[i] * l * l;
            sum_xl += w[i] * l * x[i];
        }
        float D = sum_w * sum_l2 - sum_l * sum_l;
        if (D > 0) {
            float this_scale = (sum_w * sum_xl - sum_x * sum_l) / D;
            float this_min = (sum_l2 * sum_x - sum_l * sum_xl) / D;
            if (this_min > 0) { this_min = 0; this_scale = sum_xl / sum_l2; }
            float mad = 0;
            for (int i = 0; i < n; ++i) {
                float diff = this_scale * Laux[i] + this_min - x[i];
                mad += w[i] * (diff * diff);
            }
            if (mad < best_mad) {
                memcpy(L, Laux, n);
                best_mad = mad; scale = this_scale; min = this_min;
            }
        }
    }
    *the_min = -min;
    return scale;
}

/* make_qx_quants(n, nmax, x, L, rmse_type = 1, qw): signed codes, L = l + nmax */
static float k_make_qx(int n, int nmax, const float *x, int8_t *L, const float *qw) {
    float max = 0, amax = 0;
    for (int i = 0; i < n; ++i) {
        float ax = fabsf(x[i]);
        if (ax > amax) { amax = ax; max = x[i]; }
    }
    if (amax < K_EPS) { memset(L, 0, n); return 0.f; }
    float iscale = -nmax / max;
    float sumlx = 0, suml2 = 0;
    for (int i = 0; i < n; ++i) {
        int l = k_clamp(k_nearest_int(iscale * x[i]), -nmax, nmax - 1);
        L[i] = (int8_t)(l + nmax);
        float w = qw[i];
        sumlx += w * x[i] * l;
        suml2 += w * l * l;
    }
    float scale = suml2 ? sumlx / suml2 : 0.0f;
    float best = scale * sumlx;
    for (int is = -9; is <= 9; ++is) {
        if (is == 0) continue;
        iscale = -(nmax + 0.1f * is) / max;
        sumlx = suml2 = 0;
        for (int i = 0; i < n; ++i) {
            int l = k_clamp(k_nearest_int(iscale * x[i]), -nmax, nmax - 1);
            float w = qw[i];
            sumlx += w * x[i] * l;
            suml2 += w * l * l;
        }
        if (suml2 > 0 && sumlx * sumlx > best * suml2) {
            for (int i = 0; i < n; ++i) L[i] = (int8_t)(nmax + k_clamp(k_nearest_int(iscale * x[i]), -nmax, nmax - 1));
            scale = sumlx / suml2; best = scale * sumlx;
        }
    }
    return scale;
}

static void k_scale_min(int j, const uint8_t *q, uint8_t *d, uint8_t *m) {
    if (j < 4) { *d = q[j] & 63; *m = q[j + 4] & 63; }
    else { *d = (q[j + 4] & 0xF) | ((q[j - 4] >> 6) << 4); *m = (q[j + 4] >> 4) | ((q[j - 0] >> 6) << 4); }
}

/* Q4_K (nmax 15, 144 bytes) and Q5_K (nmax 31, 176 bytes) of one super-block, quant_weights qw [256] */
static void k_q45(int nmax, const float *x, const float *qwb, uint8_t *y) {
    uint8_t L[256], Ls[8], Lm[8];
    float weights[32], sw[8], mins[8], scales[8];
    float sum_x2 = 0;
    for (int l = 0; l < 256; ++l) sum_x2 += x[l] * x[l];
    float sigma2 = 2 * sum_x2 / 256;
    for (int j = 0; j < 8; ++j) {
        const float *qw = qwb + 32 * j;
        for (int l = 0; l < 32; ++l) weights[l] = qw[l] * sqrtf(sigma2 + x[32 * j + l] * x[32 * j + l]);
        float sumw = 0;
        for (int l = 0; l < 32; ++l) sumw += weights[l];
        sw[j] = sumw;
        scales[j] = k_make_qkx3(32, nmax, x + 32 * j, weights, L + 32 * j, &mins[j], -0.9f, 0.05f, 36);
    }
    float d_block = k_make_qp(8, 63, scales, Ls, sw);
    float m_block = k_make_qp(8, 63, mins, Lm, sw);
    uint8_t *sc = y + 4;
    memset(sc, 0, 12);
    for (int j = 0; j < 8; ++j) {
        uint8_t ls = Ls[j], lm = Lm[j];
        if (nmax == 31) { ls = ls < 63 ? ls : 63; lm = lm < 63 ? lm : 63; }  /* Q5_K clamps, Q4_K does not */
        if (j < 4) { sc[j] = ls; sc[j + 4] = lm; }
        else {
            sc[j + 4] = (uint8_t)((ls & 0xF) | ((lm & 0xF) << 4));
            sc[j - 4] |= (uint8_t)((ls >> 4) << 6);
            sc[j - 0] |= (uint8_t)((lm >> 4) << 6);
        }
    }
    uint16_t dh = k_fp32_to_fp16(d_block), mh = k_fp32_to_fp16(m_block);
    memcpy(y, &dh, 2); memcpy(y + 2, &mh, 2);
    for (int j = 0; j < 8; ++j) {
        uint8_t s, m;
        k_scale_min(j, sc, &s, &m);
        const float d = k_fp16_to_fp32(dh) * s;
        if (!d) continue;
        const float dm = k_fp16_to_fp32(mh) * m;
        for (int ii = 0; ii < 32; ++ii) L[32 * j + ii] = (uint8_t)k_clamp(k_nearest_int((x[32 * j + ii] + dm) / d), 0, nmax);
    }
    if (nmax == 15) {
        uint8_t *q = y + 16;
        for (int j = 0; j < 256; j += 64) {
            for (int l = 0; l < 32; ++l) q[l] = (uint8_t)(L[j + l] | (L[j + l + 32] << 4));
            q += 32;
        }
    } else {
        uint8_t *qh = y + 16, *ql = y + 48;
        memset(qh, 0, 32);
        uint8_t m1 = 1, m2 = 2;
        for (int n = 0; n < 256; n += 64) {
            for (int j = 0; j < 32; ++j) {
                int l1 = L[n + j];
                if (l1 > 15) { l1 -= 16; qh[j] |= m1; }
                int l2 = L[n + j + 32];
                if (l2 > 15) { l2 -= 16; qh[j] |= m2; }
                ql[j] = (uint8_t)(l1 | (l2 << 4));
            }
            m1 <<= 2; m2 <<= 2;
            ql += 32;
        }
    }
}

/* Q6_K of one super-block (210 bytes: ql[128], qh[64], scales[16] int8, d) */
static void k_q6(const float *x, const float *qwb, uint8_t *y) {
    int8_t L[256];
    float scales[16];
    float max_scale = 0, max_abs_scale = 0;
    for (int ib = 0; ib < 16; ++ib) {
        float scale = k_make_qx(16, 32, x + 16 * ib, L + 16 * ib, qwb + 16 * ib);
        scales[ib] = scale;
        const float abs_scale = fabsf(scale);
        if (abs_scale > max_abs_scale) { max_abs_scale = abs_scale; max_scale = scale; }
    }
    memset(y, 0, 210);
    if (max_abs_scale < K_EPS) return;
    float iscale = -128.f / max_scale;
    uint16_t dh = k_fp32_to_fp16(1 / iscale);
    memcpy(y + 208, &dh, 2);
    int8_t *ysc = (int8_t *)(y + 192);
    for (int ib = 0; ib < 16; ++ib) {
        int v = k_nearest_int(iscale * scales[ib]);
        ysc[ib] = (int8_t)(v < 127 ? v : 127);
    }
    for (int j = 0; j < 16; ++j) {
        float d = k_fp16_to_fp32(dh) * ysc[j];
        if (!d) continue;
        for (int ii = 0; ii < 16; ++ii) {
            int l = k_clamp(k_nearest_int(x[16 * j + ii] / d), -32, 31);
            L[16 * j + ii] = (int8_t)(l + 32);
        }
    }
    uint8_t *ql = y, *qh = y + 128;
    for (int j = 0; j < 256; j += 128) {
        for (int l = 0; l < 32; ++l) {
            const uint8_t q1 = L[j + l + 0] & 0xF, q2 = L[j + l + 32] & 0xF;
            const uint8_t q3 = L[j + l + 64] & 0xF, q4 = L[j + l + 96] & 0xF;
            ql[l + 0] = (uint8_t)(q1 | (q3 << 4));
            ql[l + 32] = (uint8_t)(q2 | (q4 << 4));
            qh[l] = (uint8_t)((L[j + l] >> 4) | ((L[j + l + 32] >> 4) << 2) | ((L[j + l + 64] >> 4) << 4) |
                              ((L[j + l + 96] >> 4) << 6));
        }
        ql += 64;
        qh += 32;
    }
}

/* Q2_K of one super-block (84 bytes: scales[16], qs[64], d, dmin), quantize_row_q2_K_impl */
static void k_q2(const float *x, const float *qwb, uint8_t *y) {
    uint8_t L[256], Ls[16], Lm[16];
    float mins[16], scales[16], sw[16], weight[16];
    float sumx2 = 0;
    for (int j = 0; j < 256; ++j) sumx2 += x[j] * x[j];
    float sigma2 = sumx2 / 256;
    for (int j = 0; j < 16; ++j) {
        const float *qw = qwb + 16 * j;
        for (int l = 0; l < 16; ++l) weight[l] = qw[l] * sqrtf(sigma2 + x[16 * j + l] * x[16 * j + l]);
        sw[j] = 0;
        for (int l = 0; l < 16; ++l) sw[j] += weight[l];
        scales[j] = k_make_qkx3(16, 3, x + 16 * j, weight, L + 16 * j, &mins[j], -0.9f, 0.05f, 36);
    }
    float dm = k_make_qp(16, 15, scales, Ls, sw);
    float mm = k_make_qp(16, 15, mins, Lm, sw);
    uint16_t dh = k_fp32_to_fp16(dm), mh = k_fp32_to_fp16(mm);
    memcpy(y + 80, &dh, 2); memcpy(y + 82, &mh, 2);
    dm = k_fp16_to_fp32(dh);
    mm = k_fp16_to_fp32(mh);
    for (int j = 0; j < 16; ++j) y[j] = (uint8_t)(Ls[j] | (Lm[j] << 4));
    for (int j = 0; j < 16; ++j) {
        const float d = dm * (y[j] & 0xF);
        if (!d) continue;
        const float m = mm * (y[j] >> 4);
        for (int ii = 0; ii < 16; ++ii) L[16 * j + ii] = (uint8_t)k_clamp(k_nearest_int((x[16 * j + ii] + m) / d), 0, 3);
    }
    for (int j = 0; j < 256; j += 128)
        for (int l = 0; l < 32; ++l)
            y[16 + j / 4 + l] = (uint8_t)(L[j + l] | (L[j + l + 32] << 2) | (L[j + l + 64] << 4) | (L[j + l + 96] << 6));
}

/* Q3_K of one super-block (110 bytes: hmask[32], qs[64], scales[12], d), quantize_row_q3_K_impl */
static void k_q3(const float *x, const float *qwb, uint8_t *y) {
    int8_t L[256], Ls[16];
    float scales[16], weight[16], sw[16];
    float sumx2 = 0;
    for (int j = 0; j < 256; ++j) sumx2 += x[j] * x[j];
    float sigma2 = 2 * sumx2 / 256;
    for (int j = 0; j < 16; ++j) {
        const float *qw = qwb + 16 * j;
        for (int l = 0; l < 16; ++l) weight[l] = qw[l] * sqrtf(sigma2 + x[16 * j + l] * x[16 * j + l]);
        float sumw = 0;
        for (int l = 0; l < 16; ++l) sumw += weight[l];
        sw[j] = sumw;
        scales[j] = k_make_qx(16, 4, x + 16 * j, L + 16 * j, weight);
    }
    uint8_t *ysc = y + 96;
    memset(ysc, 0, 12);
    float d_block = k_make_qx(16, 32, scales, Ls, sw);
    for (int j = 0; j < 16; ++j) {
        int l = Ls[j];
        if (j < 8) ysc[j] = (uint8_t)(l & 0xF);
        else ysc[j - 8] |= (uint8_t)((l & 0xF) << 4);
        l >>= 4;
        ysc[j % 4 + 8] |= (uint8_t)(l << (2 * (j / 4)));
    }
    uint16_t dh = k_fp32_to_fp16(d_block);
    memcpy(y + 108, &dh, 2);
    for (int j = 0; j < 16; ++j) {
        int8_t sc = (int8_t)(j < 8 ? ysc[j] & 0xF : ysc[j - 8] >> 4);
        sc = (int8_t)((sc | (((ysc[8 + j % 4] >> (2 * (j / 4))) & 3) << 4)) - 32);
        float d = k_fp16_to_fp32(dh) * sc;
        if (!d) continue;
        for (int ii = 0; ii < 16; ++ii) L[16 * j + ii] = (int8_t)(k_clamp(k_nearest_int(x[16 * j + ii] / d), -4, 3) + 4);
    }
    uint8_t *hmask = y;
    memset(hmask, 0, 32);
    int m = 0;
    uint8_t hm = 1;
    for (int j = 0; j < 256; ++j) {
        if (L[j] > 3) { hmask[m] |= hm; L[j] -= 4; }
        if (++m == 32) { m = 0; hm <<= 1; }
    }
    for (int j = 0; j < 256; j += 128)
        for (int l = 0; l < 32; ++l)
            y[32 + j / 4 + l] = (uint8_t)(L[j + l] | (L[j + l + 32] << 2) | (L[j + l + 64] << 4) | (L[j + l + 96] << 6));
}

/* rows [r0, r1) of x [rows, n] with quant_weights qw [n] -> bytes (type 2: Q2_K, 3: Q3_K, 4: Q4_K, 5: Q5_K, 6: Q6_K); 0 on success */
int qc_k_imatrix_quantize(int type, const float *x, int64_t n, const float *qw, uint8_t *y, int64_t r0, int64_t r1) {
    const int nbytes = type == 2 ? 84 : type == 3 ? 110 : type == 4 ? 144 : type == 5 ? 176 : type == 6 ? 210 : 0;
    if (!nbytes || !qw) return 4;
    const int64_t nsup = n / 256, row_bytes = nsup * nbytes;
    for (int64_t r = r0; r < r1; ++r) {
        for (int64_t s = 0; s < nsup; ++s) {
            const float *xb = x + r * n + 256 * s;
            uint8_t *yb = y + r * row_bytes + s * nbytes;
            if (type == 6) k_q6(xb, qw + 256 * s, yb);
            else if (type == 2) k_q2(xb, qw + 256 * s, yb);
            else if (type == 3) k_q3(xb, qw + 256 * s, yb);
            else k_q45(type == 4 ? 15 : 31, xb, qw + 256 * s, yb);
        }
    }
    return 0;
}
