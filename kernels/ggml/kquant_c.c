/* qconvert: ggml's reference K-quantizers (quantize_row_q{2,3,4,5,6}_K_ref) written once more in plain C,
 * from the float32 numpy codecs of kernels/ggml/kquants.py, for speed: tiles of super-blocks are laid out
 * element-major (one column per sub-block) in a small buffer, so that every step of the scale searches
 * is a loop over 32 independent sub-blocks that the compiler vectorizes, and a tile's whole search runs
 * in the L1 cache.
 *
 * Exactness: every value is computed by the same float32 expression, in the same association order, as
 * ggml's C (and the numpy code); sums run over a sub-block's elements in order. Vectorizing across
 * sub-blocks changes no result; the build uses -ffp-contract=off and no fast-math (no FMA, no
 * reassociation, no reciprocal). Conditional updates are selects. kernels/ggml/kquant_c.py builds and loads
 * this file; tests/test_kquants.py compares it with the numpy codecs and with ggml.
 *
 * Also here: the legacy reference quantizers (quantize_row_q4_0_ref .. q8_0_ref, tests/test_legacy_vs_ggml.py), the
 * 1-2-bit ones (quantize_row_q1_0_ref, _q2_0_ref, _tq1_0_ref, _tq2_0_ref, tests/kernels/test_lowbit_vs_ggml.py),
 * the GPTQ word decode and the GPTQ 4-bit -> Q4_0 repack with its proof, and the report's error measurement.
 */
#include <stdint.h>
#include <string.h>
#include <float.h>
#include <math.h>

#define NC 32           /* sub-blocks (columns) per tile */
#define MAXN 32         /* elements per sub-block at most */
#define GROUP_MAX_EPS 1e-15f

#if defined(__GNUC__) && defined(__x86_64__) && !defined(__clang__) && !defined(QC_NO_CLONES)
#define QC_CLONES __attribute__((target_clones("avx2", "default")))
#else
#define QC_CLONES
#endif

static inline int32_t f2i_bits(float f) { int32_t i; memcpy(&i, &f, 4); return i; }
static inline float i2f_bits(uint32_t i) { float f; memcpy(&f, &i, 4); return f; }

/* C's nearest_int: the 1.5*2^23 bit trick, also outside |v| < 2^22 */
static inline int nearest_int(float fval) {
    float val = fval + 12582912.f;
    return (f2i_bits(val) & 0x007fffff) - 0x00400000;
}

/* fp32 -> fp16, round to nearest even (subnormals, overflow to inf) */
static uint16_t fp32_to_fp16(float f) {
    const float scale_to_inf = 0x1.0p+112f;
    const float scale_to_zero = 0x1.0p-110f;
    float base = (fabsf(f) * scale_to_inf) * scale_to_zero;
    const uint32_t w = (uint32_t)f2i_bits(f);
    const uint32_t shl1_w = w + w;
    const uint32_t sign = w & 0x80000000u;
    uint32_t bias = shl1_w & 0xFF000000u;
    if (bias < 0x71000000u) bias = 0x71000000u;
    base = i2f_bits((bias >> 1) + 0x07800000u) + base;
    const uint32_t bits = (uint32_t)f2i_bits(base);
    const uint32_t exp_bits = (bits >> 13) & 0x00007C00u;
    const uint32_t mantissa_bits = bits & 0x00000FFFu;
    const uint32_t nonsign = exp_bits + mantissa_bits;
    return (uint16_t)((sign >> 16) | (shl1_w > 0xFF000000u ? 0x7E00u : nonsign));
}

static float fp16_to_fp32(uint16_t h) {
    uint32_t sign = (uint32_t)(h & 0x8000u) << 16, e = (h >> 10) & 0x1fu, m = h & 0x3ffu;
    if (e == 31) return i2f_bits(sign | 0x7f800000u | (m << 13));
    float v = e == 0 ? (float)m * 0x1p-24f : i2f_bits(((e + 112u) << 23) | (m << 13));
    return sign ? -v : v;
}

static inline float fp16_round(float f) { return fp16_to_fp32(fp32_to_fp16(f)); }

static inline void put16(uint8_t *p, uint16_t v) { p[0] = (uint8_t)(v & 0xff); p[1] = (uint8_t)(v >> 8); }

/* --------------------------------------------------------------------------------------------------
 * make_qkx2_quants for NC columns of n rows (X, W element-major: X[i*NC + c]).
 * Out: scale, the_min (= -min), and what rebuilds the accepted L: best iscale and the min it used. */
typedef struct {
    float scale[NC], the_min[NC], isc[NC], vmin[NC];
    int degen[NC];
} qkx2_res;

QC_CLONES static void qkx2_tile(int n, int nmax, const float *X, const float *W, float rmin, float rdelta,
                                int nstep, int use_mad, qkx2_res *r) {
    float mn[NC], mx[NC], sw[NC], sx[NC], best[NC], scale[NC], cur[NC], bisc[NC], bmin[NC];
    float Lf[MAXN * NC];
    const float fmax = (float)nmax;
    for (int c = 0; c < NC; c++) {
        mn[c] = X[c];
        mx[c] = X[c];
        sw[c] = W[c];
        sx[c] = W[c] * X[c];
    }
    for (int i = 1; i < n; i++) {
        for (int c = 0; c < NC; c++) {
            float x = X[i * NC + c], w = W[i * NC + c];
            mn[c] = x < mn[c] ? x : mn[c];
            mx[c] = x > mx[c] ? x : mx[c];
            sw[c] += w;
            sx[c] += w * x;
        }
    }
    for (int c = 0; c < NC; c++) {
        mn[c] = mn[c] > 0 ? 0 : mn[c];
        float isc = fmax / (mx[c] - mn[c]);
        bisc[c] = isc;
        bmin[c] = mn[c];
        cur[c] = mn[c];
        scale[c] = 1 / isc;
        best[c] = 0;
    }
    for (int i = 0; i < n; i++) {
        for (int c = 0; c < NC; c++) {
            float x = X[i * NC + c];
            int l = nearest_int(bisc[c] * (x - mn[c]));
            l = l < nmax ? l : nmax;
            l = l > 0 ? l : 0;
            float diff = scale[c] * (float)l + mn[c] - x;
            diff = use_mad ? fabsf(diff) : diff * diff;
            best[c] += W[i * NC + c] * diff;
        }
    }
    for (int is = 0; is <= nstep; is++) {
        const float num = rmin + rdelta * is + nmax;
        float isc[NC], sl[NC], sl2[NC], sxl[NC];
        for (int c = 0; c < NC; c++) {
            isc[c] = num / (mx[c] - cur[c]);
            sl[c] = sl2[c] = sxl[c] = 0;
        }
        for (int i = 0; i < n; i++) {
            for (int c = 0; c < NC; c++) {
                float x = X[i * NC + c], w = W[i * NC + c];
                int l = nearest_int(isc[c] * (x - cur[c]));
                l = l < nmax ? l : nmax;
                l = l > 0 ? l : 0;
                float lf = (float)l;
                Lf[i * NC + c] = lf;
                float wl = w * lf;
                sl[c] += wl;
                sl2[c] += wl * lf;
                sxl[c] += wl * x;
            }
        }
        float ts[NC], tm[NC], D[NC], err[NC];
        for (int c = 0; c < NC; c++) {
            D[c] = sw[c] * sl2[c] - sl[c] * sl[c];
            float s = (sw[c] * sxl[c] - sx[c] * sl[c]) / D[c];
            float m = (sl2[c] * sx[c] - sl[c] * sxl[c]) / D[c];
            int pos = m > 0;
            ts[c] = pos ? sxl[c] / sl2[c] : s;
            tm[c] = pos ? 0.f : m;
            err[c] = 0;
        }
        for (int i = 0; i < n; i++) {
            for (int c = 0; c < NC; c++) {
                float diff = ts[c] * Lf[i * NC + c] + tm[c] - X[i * NC + c];
                diff = use_mad ? fabsf(diff) : diff * diff;
                err[c] += W[i * NC + c] * diff;
            }
        }
        for (int c = 0; c < NC; c++) {
            int acc = (D[c] > 0) & (err[c] < best[c]);
            best[c] = acc ? err[c] : best[c];
            scale[c] = acc ? ts[c] : scale[c];
            bisc[c] = acc ? isc[c] : bisc[c];
            bmin[c] = acc ? cur[c] : bmin[c];
            cur[c] = acc ? tm[c] : cur[c];
        }
    }
    for (int c = 0; c < NC; c++) {
        int dg = mx[c] == mn[c];
        r->degen[c] = dg;
        r->scale[c] = dg ? 0.f : scale[c];
        r->the_min[c] = dg ? -mn[c] : -cur[c];
        r->isc[c] = bisc[c];
        r->vmin[c] = bmin[c];
    }
}

/* the L the search accepted, for one column (C keeps it where the requantization scale is 0) */
static inline int qkx2_L(const qkx2_res *r, int c, float x, int nmax) {
    if (r->degen[c]) return 0;
    int l = nearest_int(r->isc[c] * (x - r->vmin[c]));
    l = l < nmax ? l : nmax;
    return l > 0 ? l : 0;
}

/* --------------------------------------------------------------------------------------------------
 * make_qx_quants(n, nmax, x, L, rmse_type = 1, qw = NULL) for NC columns: scale and the accepted iscale */
QC_CLONES static void qx_tile(int n, int nmax, const float *X, float *scale_out, float *isc_out, int *zero) {
    float amax[NC], mx[NC], slx[NC], sl2[NC], scale[NC], best[NC], bisc[NC];
    for (int c = 0; c < NC; c++) amax[c] = mx[c] = 0;
    for (int i = 0; i < n; i++) {
        for (int c = 0; c < NC; c++) {
            float x = X[i * NC + c], ax = fabsf(x);
            int gt = ax > amax[c];
            amax[c] = gt ? ax : amax[c];
            mx[c] = gt ? x : mx[c];
        }
    }
    for (int c = 0; c < NC; c++) {
        bisc[c] = -nmax / mx[c];
        slx[c] = sl2[c] = 0;
    }
    for (int i = 0; i < n; i++) {
        for (int c = 0; c < NC; c++) {
            float x = X[i * NC + c];
            int li = nearest_int(bisc[c] * x);
            li = li < -nmax ? -nmax : li;
            li = li > nmax - 1 ? nmax - 1 : li;
            float l = (float)li;
            float w = x * x;
            slx[c] += w * x * l;
            sl2[c] += w * l * l;
        }
    }
    for (int c = 0; c < NC; c++) {
        scale[c] = sl2[c] != 0 ? slx[c] / sl2[c] : 0.f;
        best[c] = scale[c] * slx[c];
    }
    for (int is = -9; is <= 9; is++) {
        if (is == 0) continue;
        const float num = -(nmax + 0.1f * is);
        float isc[NC];
        for (int c = 0; c < NC; c++) {
            isc[c] = num / mx[c];
            slx[c] = sl2[c] = 0;
        }
        for (int i = 0; i < n; i++) {
            for (int c = 0; c < NC; c++) {
                float x = X[i * NC + c];
                int li = nearest_int(isc[c] * x);
                li = li < -nmax ? -nmax : li;
                li = li > nmax - 1 ? nmax - 1 : li;
                float l = (float)li;
                float w = x * x;
                slx[c] += w * x * l;
                sl2[c] += w * l * l;
            }
        }
        for (int c = 0; c < NC; c++) {
            int acc = (sl2[c] > 0) & (slx[c] * slx[c] > best[c] * sl2[c]);
            float s = slx[c] / sl2[c];
            scale[c] = acc ? s : scale[c];
            best[c] = acc ? s * slx[c] : best[c];
            bisc[c] = acc ? isc[c] : bisc[c];
        }
    }
    for (int c = 0; c < NC; c++) {
        zero[c] = amax[c] < GROUP_MAX_EPS;
        scale_out[c] = zero[c] ? 0.f : scale[c];
        isc_out[c] = bisc[c];
    }
}

/* --------------------------------------------------------------------------------------------------
 * make_q3_quants(n, 4, x, L, do_rmse = true) for NC columns: scale and L (+nmax) */
QC_CLONES static void q3_tile(const float *X, float *scale_out, int8_t *Lout) {
    enum { n = 16, nmax = 4 };
    float amax[NC], mx[NC], slx[NC], sl2[NC];
    float Lf[n * NC];
    for (int c = 0; c < NC; c++) amax[c] = mx[c] = 0;
    for (int i = 0; i < n; i++) {
        for (int c = 0; c < NC; c++) {
            float x = X[i * NC + c], ax = fabsf(x);
            int gt = ax > amax[c];
            amax[c] = gt ? ax : amax[c];
            mx[c] = gt ? x : mx[c];
        }
    }
    float isc[NC];
    for (int c = 0; c < NC; c++) {
        isc[c] = -nmax / mx[c];
        slx[c] = sl2[c] = 0;
    }
    for (int i = 0; i < n; i++) {
        for (int c = 0; c < NC; c++) {
            float x = X[i * NC + c];
            int li = nearest_int(isc[c] * x);
            li = li < -nmax ? -nmax : li;
            li = li > nmax - 1 ? nmax - 1 : li;
            float l = (float)li;
            Lf[i * NC + c] = l;
            float w = x * x;
            slx[c] += w * x * l;
            sl2[c] += w * l * l;
        }
    }
    /* The first pass of the coordinate descent runs on every column at once; a column whose pass changed
     * nothing is done (the same state would make the same decisions: C's early exit). The few that changed
     * (a fifth on LLM-like data) finish their passes one column at a time. */
    int changed[NC];
    for (int c = 0; c < NC; c++) changed[c] = 0;
    for (int i = 0; i < n; i++) {
        for (int c = 0; c < NC; c++) {
            float x = X[i * NC + c], Li = Lf[i * NC + c];
            float w = x * x;
            float s1 = slx[c] - w * x * Li;
            float s2 = sl2[c] - w * Li * Li;
            int nl = nearest_int(x * s2 / s1);
            nl = nl < -nmax ? -nmax : nl;
            nl = nl > nmax - 1 ? nmax - 1 : nl;
            float nf = (float)nl;
            float s1b = s1 + w * x * nf;
            float s2b = s2 + w * nf * nf;
            int acc = (s1 > 0) & (nf != Li) & (s2b > 0) & (s1b * s1b * sl2[c] > slx[c] * slx[c] * s2b);
            Lf[i * NC + c] = acc ? nf : Li;
            slx[c] = acc ? s1b : slx[c];
            sl2[c] = acc ? s2b : sl2[c];
            changed[c] |= acc;
        }
    }
    for (int c = 0; c < NC; c++) {
        if (!changed[c]) continue;
        float sx = slx[c], s2c = sl2[c];
        for (int itry = 1; itry < 5; itry++) {
            int ch = 0;
            for (int i = 0; i < n; i++) {
                float x = X[i * NC + c], Li = Lf[i * NC + c];
                float w = x * x;
                float s1 = sx - w * x * Li;
                if (!(s1 > 0)) continue;
                float s2 = s2c - w * Li * Li;
                int nl = nearest_int(x * s2 / s1);
                nl = nl < -nmax ? -nmax : nl;
                nl = nl > nmax - 1 ? nmax - 1 : nl;
                float nf = (float)nl;
                if (nf == Li) continue;
                float s1b = s1 + w * x * nf;
                float s2b = s2 + w * nf * nf;
                if (s2b > 0 && s1b * s1b * s2c > sx * sx * s2b) {
                    Lf[i * NC + c] = nf;
                    sx = s1b;
                    s2c = s2b;
                    ch = 1;
                }
            }
            if (!ch) break;
        }
        slx[c] = sx;
        sl2[c] = s2c;
    }
    for (int c = 0; c < NC; c++) {
        int zero = amax[c] < GROUP_MAX_EPS;
        float s = sl2[c] > 0 ? slx[c] / sl2[c] : 0.f;
        scale_out[c] = zero ? 0.f : s;
        for (int i = 0; i < n; i++) Lout[i * NC + c] = zero ? 0 : (int8_t)((int)Lf[i * NC + c] + nmax);
    }
}

/* --------------------------------------------------------------------------------------------------
 * tiles: T = NC / nsub super-blocks, x row-major [T][256]; `have` of them are real (the rest zeros) */

static void load_tile(const float *x, int have, int T, int n, float *X) {
    /* X[i*NC + b*nsub + j] = x[b*256 + j*n + i] */
    const int nsub = 256 / n;
    for (int b = 0; b < T; b++) {
        for (int j = 0; j < nsub; j++) {
            for (int i = 0; i < n; i++) X[i * NC + b * nsub + j] = b < have ? x[b * 256 + j * n + i] : 0.f;
        }
    }
}

static void pack_k4_scales(const uint8_t *ls, const uint8_t *lm, uint8_t *s) {
    for (int j = 0; j < 4; j++) {
        s[j] = (uint8_t)(ls[j] | ((ls[j + 4] >> 4) << 6));
        s[j + 4] = (uint8_t)(lm[j] | ((lm[j + 4] >> 4) << 6));
        s[j + 8] = (uint8_t)((ls[j + 4] & 0xF) | ((lm[j + 4] & 0xF) << 4));
    }
}

static void pack_2bit(const uint8_t *L, uint8_t *q) {
    for (int h = 0; h < 2; h++)
        for (int l = 0; l < 32; l++)
            q[h * 32 + l] = (uint8_t)(L[h * 128 + l] | (L[h * 128 + 32 + l] << 2) | (L[h * 128 + 64 + l] << 4)
                                      | (L[h * 128 + 96 + l] << 6));
}

/* Q4_K (nmax 15) and Q5_K (nmax 31) */
QC_CLONES static void q45k_tile(const float *x, uint8_t *y, int have, int nmax) {
    enum { n = 32, T = NC / 8 };
    float X[n * NC], W[n * NC], s2[NC];
    qkx2_res r;
    const int bbytes = nmax == 15 ? 144 : 176;
    load_tile(x, have, T, n, X);
    for (int c = 0; c < NC; c++) s2[c] = 0;
    for (int i = 0; i < n; i++)
        for (int c = 0; c < NC; c++) s2[c] += X[i * NC + c] * X[i * NC + c];
    for (int c = 0; c < NC; c++) s2[c] = sqrtf(s2[c] / 32);
    for (int i = 0; i < n; i++)
        for (int c = 0; c < NC; c++) W[i * NC + c] = s2[c] + fabsf(X[i * NC + c]);
    if (nmax == 15) qkx2_tile(n, 15, X, W, -1.f, 0.1f, 20, 0, &r);
    else qkx2_tile(n, 31, X, W, -0.5f, 0.1f, 15, 0, &r);
    for (int b = 0; b < have; b++) {
        const float *xb = x + b * 256;
        uint8_t *o = y + b * bbytes;
        const float *sc = r.scale + b * 8, *mi = r.the_min + b * 8;
        float max_scale = 0, max_min = 0;
        for (int j = 0; j < 8; j++) {
            if (sc[j] > max_scale) max_scale = sc[j];
            if (mi[j] > max_min) max_min = mi[j];
        }
        float inv_scale = max_scale > 0 ? 63.f / max_scale : 0.f;
        float inv_min = max_min > 0 ? 63.f / max_min : 0.f;
        uint8_t ls[8], lm[8], L[256];
        for (int j = 0; j < 8; j++) {
            uint8_t a = (uint8_t)nearest_int(inv_scale * sc[j]);
            uint8_t m = (uint8_t)nearest_int(inv_min * mi[j]);
            ls[j] = a < 63 ? a : 63;
            lm[j] = m < 63 ? m : 63;
        }
        uint16_t d16 = fp32_to_fp16(max_scale / 63.f), dm16 = fp32_to_fp16(max_min / 63.f);
        float df = fp16_to_fp32(d16), dmf = fp16_to_fp32(dm16);
        for (int j = 0; j < 8; j++) {
            float d = df * ls[j];
            if (!d) {
                for (int i = 0; i < 32; i++) L[j * 32 + i] = (uint8_t)qkx2_L(&r, b * 8 + j, xb[j * 32 + i], nmax);
                continue;
            }
            float dm = dmf * lm[j];
            for (int i = 0; i < 32; i++) {
                int l = nearest_int((xb[j * 32 + i] + dm) / d);
                l = l < nmax ? l : nmax;
                L[j * 32 + i] = (uint8_t)(l > 0 ? l : 0);
            }
        }
        put16(o, d16);
        put16(o + 2, dm16);
        pack_k4_scales(ls, lm, o + 4);
        if (nmax == 15) {
            for (int c = 0; c < 4; c++)
                for (int l = 0; l < 32; l++) o[16 + c * 32 + l] = (uint8_t)(L[c * 64 + l] | (L[c * 64 + 32 + l] << 4));
        } else {
            for (int c = 0; c < 4; c++)
                for (int l = 0; l < 32; l++)
                    o[48 + c * 32 + l] = (uint8_t)((L[c * 64 + l] & 0xF) | (L[c * 64 + 32 + l] << 4));
            for (int l = 0; l < 32; l++) {
                uint8_t h = 0;
                for (int k = 0; k < 8; k++) h |= (uint8_t)((L[32 * k + l] >> 4) << k);
                o[16 + l] = h;
            }
        }
    }
}

QC_CLONES static void q6k_tile(const float *x, uint8_t *y, int have) {
    enum { n = 16, T = NC / 16 };
    float X[n * NC], scale[NC], bisc[NC];
    int zero[NC];
    load_tile(x, have, T, n, X);
    qx_tile(n, 32, X, scale, bisc, zero);
    for (int b = 0; b < have; b++) {
        const float *xb = x + b * 256;
        uint8_t *o = y + b * 210;
        const float *sc = scale + b * 16;
        float max_scale = 0, max_abs = 0;
        for (int j = 0; j < 16; j++) {
            float a = fabsf(sc[j]);
            if (a > max_abs) { max_abs = a; max_scale = sc[j]; }
        }
        if (max_abs < GROUP_MAX_EPS) {
            memset(o, 0, 210);
            continue;
        }
        float iscale = -128.f / max_scale;
        uint16_t d16 = fp32_to_fp16(1 / iscale);
        float df = fp16_to_fp32(d16);
        int8_t s8[16];
        uint8_t L[256];
        for (int j = 0; j < 16; j++) {
            int v = nearest_int(iscale * sc[j]);
            s8[j] = (int8_t)(v < 127 ? v : 127);
        }
        for (int j = 0; j < 16; j++) {
            float d = df * s8[j];
            int c = b * 16 + j;
            if (!d) {
                for (int i = 0; i < 16; i++) {
                    if (zero[c]) { L[j * 16 + i] = 0; continue; }
                    int l = nearest_int(bisc[c] * xb[j * 16 + i]);
                    l = l < -32 ? -32 : l;
                    l = l > 31 ? 31 : l;
                    L[j * 16 + i] = (uint8_t)(l + 32);
                }
                continue;
            }
            for (int i = 0; i < 16; i++) {
                int l = nearest_int(xb[j * 16 + i] / d);
                l = l < -32 ? -32 : l;
                l = l > 31 ? 31 : l;
                L[j * 16 + i] = (uint8_t)(l + 32);
            }
        }
        for (int h = 0; h < 2; h++) {
            const uint8_t *Lh = L + h * 128;
            for (int l = 0; l < 32; l++) {
                o[h * 64 + l] = (uint8_t)((Lh[l] & 0xF) | ((Lh[64 + l] & 0xF) << 4));
                o[h * 64 + 32 + l] = (uint8_t)((Lh[32 + l] & 0xF) | ((Lh[96 + l] & 0xF) << 4));
                o[128 + h * 32 + l] = (uint8_t)((Lh[l] >> 4) | ((Lh[32 + l] >> 4) << 2) | ((Lh[64 + l] >> 4) << 4)
                                                | ((Lh[96 + l] >> 4) << 6));
            }
        }
        memcpy(o + 192, s8, 16);
        put16(o + 208, d16);
    }
}

QC_CLONES static void q3k_tile(const float *x, uint8_t *y, int have) {
    enum { n = 16, T = NC / 16 };
    float X[n * NC], scale[NC];
    int8_t Ls[n * NC];
    load_tile(x, have, T, n, X);
    q3_tile(X, scale, Ls);
    for (int b = 0; b < have; b++) {
        const float *xb = x + b * 256;
        uint8_t *o = y + b * 110;
        const float *sc = scale + b * 16;
        float amax = 0, max_scale = 0;
        for (int j = 0; j < 16; j++) {
            float a = fabsf(sc[j]);
            if (a > amax) { amax = a; max_scale = sc[j]; }
        }
        uint8_t lu[16];
        uint16_t d16;
        if (max_scale != 0) {
            float iscale = -32.f / max_scale;
            for (int j = 0; j < 16; j++) {
                int l = (int8_t)nearest_int(iscale * sc[j]);
                l = l < -32 ? -32 : l;
                l = l > 31 ? 31 : l;
                lu[j] = (uint8_t)(l + 32);
            }
            d16 = fp32_to_fp16(1 / iscale);
        } else {
            memset(lu, 0, 16);
            d16 = 0;
        }
        float df = fp16_to_fp32(d16);
        uint8_t L[256];
        for (int j = 0; j < 16; j++) {
            float d = df * (float)((int)lu[j] - 32);
            if (!d) {
                for (int i = 0; i < 16; i++) L[j * 16 + i] = (uint8_t)Ls[i * NC + b * 16 + j];
                continue;
            }
            for (int i = 0; i < 16; i++) {
                int l = nearest_int(xb[j * 16 + i] / d);
                l = l < -4 ? -4 : l;
                l = l > 3 ? 3 : l;
                L[j * 16 + i] = (uint8_t)(l + 4);
            }
        }
        uint8_t *hm = o, *qs = o + 32, *sb = o + 96;
        memset(hm, 0, 32);
        for (int k = 0; k < 8; k++)
            for (int l = 0; l < 32; l++) {
                uint8_t v = L[32 * k + l];
                hm[l] |= (uint8_t)((v > 3) << k);
                L[32 * k + l] = (uint8_t)(v & 3);  /* v - 4 where v > 3 */
            }
        pack_2bit(L, qs);
        for (int j = 0; j < 8; j++) sb[j] = (uint8_t)((lu[j] & 0xF) | ((lu[j + 8] & 0xF) << 4));
        for (int m = 0; m < 4; m++)
            sb[8 + m] = (uint8_t)((lu[m] >> 4) | ((lu[4 + m] >> 4) << 2) | ((lu[8 + m] >> 4) << 4) | ((lu[12 + m] >> 4) << 6));
        put16(o + 108, d16);
    }
}

QC_CLONES static void q2k_tile(const float *x, uint8_t *y, int have) {
    enum { n = 16, T = NC / 16 };
    float X[n * NC], W[n * NC];
    qkx2_res r;
    load_tile(x, have, T, n, X);
    for (int i = 0; i < n * NC; i++) W[i] = fabsf(X[i]);
    qkx2_tile(n, 3, X, W, -0.5f, 0.1f, 15, 1, &r);
    for (int b = 0; b < have; b++) {
        const float *xb = x + b * 256;
        uint8_t *o = y + b * 84;
        const float *sc = r.scale + b * 16, *mi = r.the_min + b * 16;
        float max_scale = 0, max_min = 0;
        for (int j = 0; j < 16; j++) {
            if (sc[j] > max_scale) max_scale = sc[j];
            if (mi[j] > max_min) max_min = mi[j];
        }
        uint8_t sb[16], L[256];
        uint16_t d16 = 0, dm16 = 0;
        if (max_scale > 0) {
            float iscale = 15.f / max_scale;
            for (int j = 0; j < 16; j++) sb[j] = (uint8_t)nearest_int(iscale * sc[j]);
            d16 = fp32_to_fp16(max_scale / 15.f);
        } else {
            memset(sb, 0, 16);
        }
        if (max_min > 0) {
            float iscale = 15.f / max_min;
            for (int j = 0; j < 16; j++) sb[j] = (uint8_t)(sb[j] | (nearest_int(iscale * mi[j]) << 4));
            dm16 = fp32_to_fp16(max_min / 15.f);
        }
        float df = fp16_to_fp32(d16), dmf = fp16_to_fp32(dm16);
        for (int j = 0; j < 16; j++) {
            float d = df * (sb[j] & 0xF);
            if (!d) {
                for (int i = 0; i < 16; i++) L[j * 16 + i] = (uint8_t)qkx2_L(&r, b * 16 + j, xb[j * 16 + i], 3);
                continue;
            }
            float dm = dmf * (sb[j] >> 4);
            for (int i = 0; i < 16; i++) {
                int l = nearest_int((xb[j * 16 + i] + dm) / d);
                l = l < 3 ? l : 3;
                L[j * 16 + i] = (uint8_t)(l > 0 ? l : 0);
            }
        }
        memcpy(o, sb, 16);
        pack_2bit(L, o + 16);
        put16(o + 80, d16);
        put16(o + 82, dm16);
    }
}

/* --------------------------------------------------------------------------------------------------
 * entry point: nb super-blocks of x (row-major float32) -> y. type: 2..6 (Q2_K..Q6_K). Returns 0, or -1
 * for an unknown type. Thread-safe (no shared state): callers split the blocks between threads. */
int qc_quantize_k(int type, const float *x, uint8_t *y, int64_t nb) {
    static const int bytes[7] = {0, 0, 84, 110, 144, 176, 210};
    if (type < 2 || type > 6) return -1;
    const int per = type == 4 || type == 5 ? NC / 8 : NC / 16;
    for (int64_t s = 0; s < nb; s += per) {
        int have = (int)(nb - s < per ? nb - s : per);
        const float *xs = x + s * 256;
        uint8_t *ys = y + s * bytes[type];
        switch (type) {
        case 2: q2k_tile(xs, ys, have); break;
        case 3: q3k_tile(xs, ys, have); break;
        case 4: q45k_tile(xs, ys, have, 15); break;
        case 5: q45k_tile(xs, ys, have, 31); break;
        case 6: q6k_tile(xs, ys, have); break;
        }
    }
    return 0;
}

/* --------------------------------------------------------------------------------------------------
 * dequantizers: the float32 expressions of kernels/ggml/kquants.py's dequantize_q*_K (and C's), nb blocks */

static void get_k4(const uint8_t *s, int j, uint8_t *sc, uint8_t *m) {
    if (j < 4) {
        *sc = s[j] & 63;
        *m = s[j + 4] & 63;
    } else {
        *sc = (uint8_t)((s[j + 4] & 0xF) | ((s[j - 4] >> 6) << 4));
        *m = (uint8_t)((s[j + 4] >> 4) | ((s[j] >> 6) << 4));
    }
}

QC_CLONES static void deq45(const uint8_t *b, float *y, int nmax) {
    float d = fp16_to_fp32((uint16_t)(b[0] | (b[1] << 8))), dmin = fp16_to_fp32((uint16_t)(b[2] | (b[3] << 8)));
    const uint8_t *qs = nmax == 15 ? b + 16 : b + 48, *qh = b + 16;
    for (int j = 0; j < 8; j++) {
        uint8_t sc, m;
        get_k4(b + 4, j, &sc, &m);
        float d1 = d * (float)sc, m1 = dmin * (float)m;
        const uint8_t *q = qs + (j / 2) * 32;
        int shift = (j & 1) * 4;
        for (int l = 0; l < 32; l++) {
            int v = (q[l] >> shift) & 0xF;
            if (nmax == 31) v |= ((qh[l] >> j) & 1) << 4;
            y[j * 32 + l] = d1 * (float)v - m1;
        }
    }
}

QC_CLONES static void deq6(const uint8_t *b, float *y) {
    const uint8_t *ql = b, *qh = b + 128;
    const int8_t *sc = (const int8_t *)(b + 192);
    float d = fp16_to_fp32((uint16_t)(b[208] | (b[209] << 8)));
    for (int h = 0; h < 2; h++) {
        for (int k = 0; k < 4; k++) {  /* element 128h + 32k + l */
            for (int half = 0; half < 2; half++) {
                const int e0 = 128 * h + 32 * k + 16 * half;
                const float dl = d * (float)sc[e0 / 16];
                const uint8_t *a = ql + h * 64 + (k & 1) * 32 + 16 * half, *c = qh + h * 32 + 16 * half;
                const int sa = (k >> 1) * 4, sh = 2 * k;
                for (int l = 0; l < 16; l++) {
                    int lo = (a[l] >> sa) & 0xF;
                    int hi = (c[l] >> sh) & 3;
                    y[e0 + l] = dl * (float)((lo | (hi << 4)) - 32);
                }
            }
        }
    }
}

QC_CLONES static void deq3(const uint8_t *b, float *y) {
    const uint8_t *hm = b, *qs = b + 32, *s = b + 96;
    float d = fp16_to_fp32((uint16_t)(b[108] | (b[109] << 8)));
    float dl[16];
    for (int j = 0; j < 16; j++) {
        int low = j < 8 ? s[j] & 0xF : s[j - 8] >> 4;
        int high = (s[8 + j % 4] >> (2 * (j / 4))) & 3;
        dl[j] = d * (float)((low | (high << 4)) - 32);
    }
    for (int j = 0; j < 16; j++) {  /* sub-block j: elements 16j.. of chunk 32j/32 */
        const int e0 = 16 * j, h = e0 / 128, k = (e0 % 128) / 32, l0 = e0 % 32, hs = e0 / 32;
        const float dj = dl[j];
        for (int l = 0; l < 16; l++) {
            int q2 = (qs[h * 32 + l0 + l] >> (2 * k)) & 3;
            int hb = (hm[l0 + l] >> hs) & 1;
            y[e0 + l] = dj * (float)(q2 - 4 * (1 - hb));
        }
    }
}

QC_CLONES static void deq2(const uint8_t *b, float *y) {
    const uint8_t *sc = b, *qs = b + 16;
    float d = fp16_to_fp32((uint16_t)(b[80] | (b[81] << 8))), dmin = fp16_to_fp32((uint16_t)(b[82] | (b[83] << 8)));
    for (int j = 0; j < 16; j++) {
        const int e0 = 16 * j, h = e0 / 128, k = (e0 % 128) / 32, l0 = e0 % 32;
        const float dl = d * (float)(sc[j] & 0xF), ml = dmin * (float)(sc[j] >> 4);
        for (int l = 0; l < 16; l++) {
            int q = (qs[h * 32 + l0 + l] >> (2 * k)) & 3;
            y[e0 + l] = dl * (float)q - ml;
        }
    }
}

int qc_dequantize_k(int type, const uint8_t *y, float *x, int64_t nb) {
    static const int bytes[7] = {0, 0, 84, 110, 144, 176, 210};
    if (type < 2 || type > 6) return -1;
    for (int64_t i = 0; i < nb; i++) {
        const uint8_t *b = y + i * bytes[type];
        float *o = x + i * 256;
        switch (type) {
        case 2: deq2(b, o); break;
        case 3: deq3(b, o); break;
        case 4: deq45(b, o, 15); break;
        case 5: deq45(b, o, 31); break;
        case 6: deq6(b, o); break;
        }
    }
    return 0;
}

/* --------------------------------------------------------------------------------------------------
 * GPTQ packed words (uint32 [in*bits/32, out], codes LSB-first along the inputs) -> float32 W [out, in],
 * output rows n_lo..n_hi: W[n,k] = ((float)q - z[n,g]) * s[n,g] (zero form) or s[n,g] * (float)q + z[n,g]
 * (min form, z = the mins), g = gcol[k]: the float32 expressions of kernels/dequant.py. */
QC_CLONES static void gptq_rows(const uint32_t *words, int64_t out_f, int64_t in_f, const float *s, const float *z,
                                int min_form, const int32_t *gcol, int64_t n_groups, float *W, int64_t n0, int64_t n1,
                                const int bits) {
    const int per = 32 / bits;
    const uint32_t mask = (1u << bits) - 1;
    for (int64_t r = 0; r < in_f / per; r++) {
        const uint32_t *wr = words + r * out_f;
        const int32_t *gr = gcol + r * per;
        int uniform = 1;  /* one group for the whole word: its scale and offset are loaded once */
        for (int j = 1; j < per; j++) uniform &= gr[j] == gr[0];
        for (int64_t n = n0; n < n1; n++) {
            const uint32_t w = wr[n];
            float *o = W + n * in_f + r * per;
            const float *sn = s + n * n_groups, *zn = z + n * n_groups;
            if (uniform) {
                const float sv = sn[gr[0]], zv = zn[gr[0]];
                if (min_form) {
                    for (int j = 0; j < per; j++) o[j] = sv * (float)((w >> (bits * j)) & mask) + zv;
                } else {
                    for (int j = 0; j < per; j++) o[j] = ((float)((w >> (bits * j)) & mask) - zv) * sv;
                }
                continue;
            }
            for (int j = 0; j < per; j++) {
                const int32_t g = gr[j];
                const float q = (float)((w >> (bits * j)) & mask);
                o[j] = min_form ? sn[g] * q + zn[g] : (q - zn[g]) * sn[g];
            }
        }
    }
}

int qc_dequant_gptq(const uint32_t *words, int bits, int64_t out_f, int64_t in_f, const float *s, const float *z,
                    int min_form, const int32_t *gcol, int64_t n_groups, float *W, int64_t n_lo, int64_t n_hi) {
    if (bits != 2 && bits != 4 && bits != 8) return -1;
    enum { NB = 16 };  /* output rows advanced together: 16 write streams, words read 64 bytes at a time */
    for (int64_t n0 = n_lo; n0 < n_hi; n0 += NB) {
        const int64_t n1 = n0 + NB < n_hi ? n0 + NB : n_hi;
        /* a constant bit width per call, so that the shifts unroll */
        if (bits == 4) gptq_rows(words, out_f, in_f, s, z, min_form, gcol, n_groups, W, n0, n1, 4);
        else if (bits == 8) gptq_rows(words, out_f, in_f, s, z, min_form, gcol, n_groups, W, n0, n1, 8);
        else gptq_rows(words, out_f, in_f, s, z, min_form, gcol, n_groups, W, n0, n1, 2);
    }
    return 0;
}

/* --------------------------------------------------------------------------------------------------
 * GPTQ 4-bit words <-> ggml Q4_0 blocks (kernels/ggml/gptq_q4_0.py says why the nibbles move as they do).
 * words uint32 [in/8, out]: word 4b+h of output n holds inputs 32b+8h .. 32b+8h+7, one nibble each;
 * a Q4_0 block: fp16 d, then byte j (j < 16) = e_j | e_(j+16) << 4. Rows n_lo..n_hi. */
static inline uint32_t spread_lo(uint32_t a, uint32_t b) {  /* bytes 0..3 of (a, b) interleaved: nibbles 0..3 */
    uint32_t r = 0;
    for (int j = 0; j < 4; j++) r |= (((a >> (4 * j)) & 0xFu) | (((b >> (4 * j)) & 0xFu) << 4)) << (8 * j);
    return r;
}

int qc_gptq4_to_q4_0(const uint32_t *words, const uint16_t *d, uint8_t *out, int64_t out_f, int64_t in_f,
                     int64_t n_lo, int64_t n_hi) {
    const int64_t nb = in_f / 32;
    enum { NB = 32 };
    for (int64_t n0 = n_lo; n0 < n_hi; n0 += NB) {
        const int64_t n1 = n0 + NB < n_hi ? n0 + NB : n_hi;
        for (int64_t b = 0; b < nb; b++) {
            const uint32_t *w0 = words + (4 * b) * out_f, *w1 = w0 + out_f, *w2 = w1 + out_f, *w3 = w2 + out_f;
            for (int64_t n = n0; n < n1; n++) {
                uint8_t *o = out + (n * nb + b) * 18;
                const uint16_t dv = d[n * nb + b];
                o[0] = (uint8_t)(dv & 0xff);
                o[1] = (uint8_t)(dv >> 8);
                uint32_t q[4] = {spread_lo(w0[n], w2[n]), spread_lo(w0[n] >> 16, w2[n] >> 16),
                                 spread_lo(w1[n], w3[n]), spread_lo(w1[n] >> 16, w3[n] >> 16)};
                memcpy(o + 2, q, 16);  /* little-endian: byte j of q is block byte j */
            }
        }
    }
    return 0;
}

/* The proof, the other way: rebuild each source word from the Q4_0 bytes and count the words and scales
 * that differ from the source's (0: the bytes hold exactly the GPTQ codes and fp16 scales). */
int64_t qc_q4_0_check_gptq4(const uint8_t *data, const uint32_t *words, const uint16_t *d, int64_t out_f,
                            int64_t in_f, int64_t n_lo, int64_t n_hi) {
    const int64_t nb = in_f / 32;
    int64_t bad = 0;
    for (int64_t n = n_lo; n < n_hi; n++) {
        for (int64_t b = 0; b < nb; b++) {
            const uint8_t *o = data + (n * nb + b) * 18;
            bad += (uint16_t)(o[0] | (o[1] << 8)) != d[n * nb + b];
            for (int h = 0; h < 4; h++) {  /* word h: nibbles of bytes 8*(h&1) .. +7, low (h < 2) or high */
                uint32_t w = 0;
                for (int j = 0; j < 8; j++) {
                    uint8_t byte = o[2 + 8 * (h & 1) + j];
                    w |= (uint32_t)(h < 2 ? byte & 0xF : byte >> 4) << (4 * j);
                }
                bad += w != words[(4 * b + h) * out_f + n];
            }
        }
    }
    return bad;
}

/* GPTQ 2/4/8-bit words (int32 [in * bits / 32, out], codes low bits first, "gptq-rows") with integer zero points
 * and fp16 scales given per 32-block (z, d: [out, in / 32]) -> Q8_0 blocks (d, then the 32 int8 values code - z),
 * the bytes legacy.repack_grid writes for an exact grid: no float is computed, codes move. Rows n_lo .. n_hi.
 * Returns the number of values whose code - z does not fit an int8 (0 where the checker said exact). */
int64_t qc_gptq_to_q8_0(const uint32_t *words, int bits, const int32_t *z, const uint16_t *d, uint8_t *out,
                        int64_t out_f, int64_t in_f, int64_t n_lo, int64_t n_hi) {
    const int64_t nb = in_f / 32, per_word = 32 / bits, words_per_block = 32 / per_word;
    const uint32_t mask = (1u << bits) - 1u;
    int64_t bad = 0;
    for (int64_t n = n_lo; n < n_hi; n++) {
        for (int64_t b = 0; b < nb; b++) {
            uint8_t *o = out + (n * nb + b) * 34;
            const uint16_t dv = d[n * nb + b];
            const int32_t zero = z[n * nb + b];
            o[0] = (uint8_t)(dv & 0xff);
            o[1] = (uint8_t)(dv >> 8);
            for (int64_t k = 0; k < words_per_block; k++) {
                const uint32_t w = words[(b * words_per_block + k) * out_f + n];
                for (int64_t j = 0; j < per_word; j++) {
                    const int32_t q = (int32_t)((w >> (bits * j)) & mask) - zero;
                    bad += q < -128 || q > 127;
                    o[2 + k * per_word + j] = (uint8_t)(int8_t)q;
                }
            }
        }
    }
    return bad;
}

/* The proof, the other way: each source word rebuilt from the Q8_0 bytes (code = value + z) and the fp16 scales
 * read back, counting those that differ from the source's (0: the bytes hold exactly the GPTQ codes and scales). */
int64_t qc_q8_0_check_gptq(const uint8_t *data, const uint32_t *words, int bits, const int32_t *z,
                           const uint16_t *d, int64_t out_f, int64_t in_f, int64_t n_lo, int64_t n_hi) {
    const int64_t nb = in_f / 32, per_word = 32 / bits, words_per_block = 32 / per_word;
    const int32_t top = (1 << bits) - 1;
    int64_t bad = 0;
    for (int64_t n = n_lo; n < n_hi; n++) {
        for (int64_t b = 0; b < nb; b++) {
            const uint8_t *o = data + (n * nb + b) * 34;
            const int32_t zero = z[n * nb + b];
            bad += (uint16_t)(o[0] | (o[1] << 8)) != d[n * nb + b];
            for (int64_t k = 0; k < words_per_block; k++) {
                uint32_t w = 0;
                for (int64_t j = 0; j < per_word; j++) {
                    const int32_t code = (int32_t)(int8_t)o[2 + k * per_word + j] + zero;
                    bad += code < 0 || code > top;
                    w |= (uint32_t)(code & top) << (bits * j);
                }
                bad += w != words[(b * words_per_block + k) * out_f + n];
            }
        }
    }
    return bad;
}

/* --------------------------------------------------------------------------------------------------
 * ggml's legacy reference quantizers, quantize_row_q4_0_ref .. quantize_row_q8_0_ref (ggml-quants.c), nb blocks
 * of 32. The float expressions are ggml's, in its order. C's float -> int8/uint8 casts, undefined out of range,
 * are written out as x86-64 gcc computes them (what llama.cpp's files hold): truncation to a 32-bit int
 * (cvttss2si: NaN and values outside int32 give INT32_MIN), then the low byte. */
static inline int32_t c_f2i(float v) {
    /* selects, not branches, so that loops over it vectorize; -2^31 itself gives INT32_MIN either way */
    const int in_range = fabsf(v) < 2147483648.0f;
    const float safe = in_range ? v : 0.0f;
    return in_range ? (int32_t)safe : INT32_MIN;
}
static inline int8_t c_f2i8(float v) { return (int8_t)(uint8_t)((uint32_t)c_f2i(v) & 0xffu); }
static inline uint8_t c_f2u8(float v) { return (uint8_t)((uint32_t)c_f2i(v) & 0xffu); }

/* The blocks go through in tiles of LB blocks laid out element-major (X[j*LB + b]: value j of block b), so that
 * every step below is a loop over LB independent blocks that the compiler vectorizes (one lane a block), each
 * block's own operations in ggml's order. Conditional updates are written as selects: `a < b ? b : a` is what
 * x86's maxps computes, NaN included, so the vector code keeps C's NaN behaviour. */
enum { LB = 8 };

static void load_blocks(const float *x, int have, float *X) {
    for (int b = 0; b < LB; b++)
        for (int j = 0; j < 32; j++) X[j * LB + b] = b < have ? x[b * 32 + j] : 0.0f;
}

/* (int8_t)roundf(v) (half away from zero) as the x86 cast computes it, written so that it vectorizes: below 2^23
 * truncate and step by the exact remainder v - trunc(v); from 2^23 up (and NaN, inf) v is its own roundf */
static inline int8_t round_away_i8(float v) {
    const int small = fabsf(v) < 8388608.0f;
    const float vc = small ? v : 0.0f;
    const float t = (float)(int32_t)vc;  /* trunc(vc), exact */
    const float f = vc - t;
    const float r = t + (f >= 0.5f ? 1.0f : 0.0f) - (f <= -0.5f ? 1.0f : 0.0f);
    return c_f2i8(small ? r : v);
}

/* block b's codes (Q element-major) into its bytes after the fp16 parameters, at p: Q4_*: qs[j] = q_j | q_(j+16) << 4
 * (the whole code bytes, as ggml's uint8 stores); Q5_*: the little-endian u32 qh of the fifth bits (ggml's memcpy
 * on x86), then the low nibbles */
static void pack_codes(const uint8_t *Q, int b, uint8_t *p, int five) {
    uint8_t *qs = p + (five ? 4 : 0);
    uint32_t qh = 0;
    for (int j = 0; j < 16; j++) {
        const uint8_t xi0 = Q[j * LB + b], xi1 = Q[(j + 16) * LB + b];
        qs[j] = (uint8_t)((xi0 & (five ? 0x0F : 0xFF)) | ((xi1 & (five ? 0x0F : 0xFF)) << 4));
        qh |= ((xi0 & 0x10u) >> 4) << j;
        qh |= ((xi1 & 0x10u) >> 4) << (j + 16);
    }
    if (five) memcpy(p, &qh, 4);
}

/* symmetric Q4_0 / Q5_0: d = max / -(2^(b-1)), max the signed value of largest magnitude (the first of ties) */
QC_CLONES static void q_sym_tile(const float *x, uint8_t *y, int have, int five) {
    const int bytes = five ? 22 : 18;
    const float div = five ? -16.0f : -8.0f, off = five ? 16.5f : 8.5f;
    const int8_t top = five ? 31 : 15;
    float X[32 * LB], amax[LB], max[LB], id[LB];
    uint8_t Q[32 * LB];
    load_blocks(x, have, X);
    for (int b = 0; b < LB; b++) amax[b] = max[b] = 0.0f;
    for (int j = 0; j < 32; j++)
        for (int b = 0; b < LB; b++) {
            const float v = X[j * LB + b], a = fabsf(v);
            const int take = amax[b] < a;
            amax[b] = take ? a : amax[b];
            max[b] = take ? v : max[b];
        }
    for (int b = 0; b < LB; b++) {
        const float d = max[b] / div;
        id[b] = d ? 1.0f / d : 0.0f;
        if (b < have) put16(y + b * bytes, fp32_to_fp16(d));
    }
    for (int j = 0; j < 32; j++)
        for (int b = 0; b < LB; b++) {
            const int8_t c = c_f2i8(X[j * LB + b] * id[b] + off);
            Q[j * LB + b] = (uint8_t)(c < top ? c : top);
        }
    for (int b = 0; b < have; b++) pack_codes(Q, b, y + b * bytes + 2, five);
}

/* Q4_1 / Q5_1: d = (max - min) / (2^b - 1), m = min */
QC_CLONES static void q_min_tile(const float *x, uint8_t *y, int have, int five) {
    const int bytes = five ? 24 : 20;
    const float levels = five ? 31.0f : 15.0f;
    float X[32 * LB], mn[LB], mx[LB], id[LB];
    uint8_t Q[32 * LB];
    load_blocks(x, have, X);
    for (int b = 0; b < LB; b++) {
        mn[b] = FLT_MAX;
        mx[b] = -FLT_MAX;
    }
    for (int j = 0; j < 32; j++)
        for (int b = 0; b < LB; b++) {
            const float v = X[j * LB + b];
            mn[b] = v < mn[b] ? v : mn[b];
            mx[b] = v > mx[b] ? v : mx[b];
        }
    for (int b = 0; b < LB; b++) {
        const float d = (mx[b] - mn[b]) / levels;
        id[b] = d ? 1.0f / d : 0.0f;
        if (b < have) {
            put16(y + b * bytes, fp32_to_fp16(d));
            put16(y + b * bytes + 2, fp32_to_fp16(mn[b]));
        }
    }
    for (int j = 0; j < 32; j++)
        for (int b = 0; b < LB; b++) {
            const float v = (X[j * LB + b] - mn[b]) * id[b] + 0.5f;
            if (five) {  /* Q5_1's reference has no clamp: (uint8_t) of the float */
                Q[j * LB + b] = c_f2u8(v);
            } else {
                const int8_t c = c_f2i8(v);
                Q[j * LB + b] = (uint8_t)(c < 15 ? c : 15);
            }
        }
    for (int b = 0; b < have; b++) pack_codes(Q, b, y + b * bytes + 4, five);
}

/* Q8_0: d = amax / 127, q = roundf(x * (1/d)) */
QC_CLONES static void q8_0_tile(const float *x, uint8_t *y, int have) {
    float X[32 * LB], amax[LB], id[LB];
    int8_t Q[32 * LB];
    load_blocks(x, have, X);
    for (int b = 0; b < LB; b++) amax[b] = 0.0f;
    for (int j = 0; j < 32; j++)
        for (int b = 0; b < LB; b++) {
            const float a = fabsf(X[j * LB + b]);
            /* ggml's MAX(amax, fabsf(v)): a NaN |v| is taken, the next value drops it */
            amax[b] = amax[b] > a ? amax[b] : a;
        }
    for (int b = 0; b < LB; b++) {
        const float d = amax[b] / 127.0f;
        id[b] = d ? 1.0f / d : 0.0f;
        if (b < have) put16(y + b * 34, fp32_to_fp16(d));
    }
    for (int j = 0; j < 32; j++)
        for (int b = 0; b < LB; b++) Q[j * LB + b] = round_away_i8(X[j * LB + b] * id[b]);
    for (int b = 0; b < have; b++)
        for (int j = 0; j < 32; j++) y[b * 34 + 2 + j] = (uint8_t)Q[j * LB + b];
}

/* entry point: type 40 Q4_0, 41 Q4_1, 50 Q5_0, 51 Q5_1, 80 Q8_0; nb blocks of 32 values. 0, or -1 (type). */
int qc_quantize_legacy(int type, const float *x, uint8_t *y, int64_t nb) {
    int bytes;
    switch (type) {
    case 40: bytes = 18; break;
    case 41: bytes = 20; break;
    case 50: bytes = 22; break;
    case 51: bytes = 24; break;
    case 80: bytes = 34; break;
    default: return -1;
    }
    for (int64_t i = 0; i < nb; i += LB) {
        const int have = (int)(nb - i < LB ? nb - i : LB);
        const float *xs = x + i * 32;
        uint8_t *ys = y + i * bytes;
        switch (type) {
        case 40: q_sym_tile(xs, ys, have, 0); break;
        case 50: q_sym_tile(xs, ys, have, 1); break;
        case 41: q_min_tile(xs, ys, have, 0); break;
        case 51: q_min_tile(xs, ys, have, 1); break;
        default: q8_0_tile(xs, ys, have); break;
        }
    }
    return 0;
}

/* --------------------------------------------------------------------------------------------------
 * The 1- and 2-bit types (ggml-quants.c quantize_row_q1_0_ref, _q2_0_ref, _tq1_0_ref, _tq2_0_ref): one plain
 * loop per block, the same float32 expressions in the same order as ggml's, roundf / lroundf as ggml calls them
 * (round half away from zero; what a NaN becomes is what those calls and int conversions give on this machine,
 * as in ggml). Bytes per block: Q1_0 18 (128 values), Q2_0 18 (64), TQ1_0 54 (256), TQ2_0 66 (256).
 * -------------------------------------------------------------------------------------------------- */
#define LB_MAX(a, b) ((a) > (b) ? (a) : (b))  /* ggml's MAX: a NaN b replaces amax, as in ggml */

static void q1_0_block(const float *x, uint8_t *y) {
    float sum_abs = 0.0f;
    for (int j = 0; j < 128; j++) sum_abs += fabsf(x[j]);
    const float d = sum_abs / 128;
    put16(y, fp32_to_fp16(d));
    uint8_t *qs = y + 2;
    for (int j = 0; j < 16; j++) qs[j] = 0;
    for (int j = 0; j < 128; j++)
        if (x[j] >= 0.0f) qs[j / 8] |= (uint8_t)(1 << (j % 8));
}

static void q2_0_block(const float *x, uint8_t *y) {
    float amax = 0.0f;
    for (int j = 0; j < 64; j++) {
        const float a = fabsf(x[j]);
        if (a > amax) amax = a;
    }
    const float d = amax;
    const float id = d > 0.0f ? 1.0f / d : 0.0f;
    put16(y, fp32_to_fp16(d));
    uint8_t *qs = y + 2;
    for (int j = 0; j < 16; j++) qs[j] = 0;
    for (int j = 0; j < 64; j++) {
        int q = (int)roundf(x[j] * id) + 1;
        if (q < 0) q = 0;
        if (q > 3) q = 3;
        qs[j / 4] |= (uint8_t)((uint8_t)q << ((j % 4) * 2));
    }
}

static float tq_amax(const float *x) {
    float amax = 0.0f;
    for (int j = 0; j < 256; j++) amax = LB_MAX(amax, fabsf(x[j]));
    return amax;
}

/* five trits (the first most significant) as ggml stores them: ceil(t * 256 / 243) */
static void tq1_0_block(const float *x, uint8_t *y) {
    const float d = tq_amax(x);
    const float id = d ? 1.0f / d : 0.0f;
    uint8_t *qs = y, *qh = y + 48;
    put16(y + 52, fp32_to_fp16(d));
    for (int m = 0; m < 32; m++) {
        uint8_t q = 0;
        for (int n = 0; n < 5; n++) {
            int xi = lroundf(x[m + n * 32] * id) + 1;
            q *= 3;
            q += xi;
        }
        qs[m] = (uint8_t)(((uint16_t)q * 256 + (243 - 1)) / 243);
    }
    x += 160;
    for (int m = 0; m < 16; m++) {
        uint8_t q = 0;
        for (int n = 0; n < 5; n++) {
            int xi = lroundf(x[m + n * 16] * id) + 1;
            q *= 3;
            q += xi;
        }
        qs[32 + m] = (uint8_t)(((uint16_t)q * 256 + (243 - 1)) / 243);
    }
    x += 80;
    for (int j = 0; j < 4; j++) {
        uint8_t q = 0;
        for (int m = 0; m < 4; m++) {
            int xi = lroundf(x[j + m * 4] * id) + 1;
            q *= 3;
            q += xi;
        }
        q *= 3;  /* the first value to the most significant trit */
        qh[j] = (uint8_t)(((uint16_t)q * 256 + (243 - 1)) / 243);
    }
}

static void tq2_0_block(const float *x, uint8_t *y) {
    const float d = tq_amax(x);
    const float id = d ? 1.0f / d : 0.0f;
    put16(y + 64, fp32_to_fp16(d));
    for (int j = 0; j < 64; j += 32) {
        for (int m = 0; m < 32; m++) {
            uint8_t q = 0;
            for (int n = 0; n < 4; n++) {
                int xi = lroundf(x[m + n * 32] * id) + 1;
                q += (xi & 3) << (2 * n);
            }
            y[j + m] = q;
        }
        x += 128;
    }
}

/* entry point: type 1 Q1_0 (blocks of 128), 2 Q2_0 (64), 34 TQ1_0 (256), 35 TQ2_0 (256); nb blocks. 0, or -1. */
int qc_quantize_lowbit(int type, const float *x, uint8_t *y, int64_t nb) {
    for (int64_t i = 0; i < nb; i++) {
        switch (type) {
        case 1: q1_0_block(x + i * 128, y + i * 18); break;
        case 2: q2_0_block(x + i * 64, y + i * 18); break;
        case 34: tq1_0_block(x + i * 256, y + i * 54); break;
        case 35: tq2_0_block(x + i * 256, y + i * 66); break;
        default: return -1;
        }
    }
    return 0;
}

/* The report's error of n float32 pairs (converters/report.py measure): returns max |a - b| (NaN where any
 * difference is NaN) and adds sum (a - b)^2 to *sum_sq, each square taken in double from the float32 difference, as
 * torch's (got - ref).abs().double().pow(2) takes it. One pass over both arrays instead of six tensor passes;
 * the sum runs in 8 interleaved double accumulators (element i into lane i % 8, the lanes added in order at the
 * end): a fixed order, so the same inputs give the same RMSE on every machine and thread count. */
double qc_error_stats(const float *a, const float *b, int64_t n, double *sum_sq) {
    double acc[8] = {0, 0, 0, 0, 0, 0, 0, 0};
    float mx[8] = {0, 0, 0, 0, 0, 0, 0, 0};
    int nan = 0;
    int64_t i = 0;
    for (; i + 8 <= n; i += 8) {
        for (int j = 0; j < 8; ++j) {
            const float d = fabsf(a[i + j] - b[i + j]);
            nan |= d != d;
            mx[j] = d > mx[j] ? d : mx[j];
            acc[j] += (double)d * (double)d;
        }
    }
    for (int j = 0; i < n; ++i, ++j) {
        const float d = fabsf(a[i] - b[i]);
        nan |= d != d;
        mx[j] = d > mx[j] ? d : mx[j];
        acc[j] += (double)d * (double)d;
    }
    double total = 0, m = 0;
    for (int j = 0; j < 8; ++j) {
        total += acc[j];
        m = mx[j] > m ? mx[j] : m;
    }
    *sum_sq += total;
    return nan ? NAN : m;
}

int qc_abi_version(void) { return 8; }
