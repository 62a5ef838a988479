/* qconvert: ggml's lattice quantizers IQ3_S, IQ3_XXS, IQ2_S, IQ2_XS, IQ2_XXS (quantize_row_*_impl of ggml-quants.c,
 * as ggml_quantize_chunk runs them) written once more in plain C, from the float32 numpy codecs of
 * kernels/ggml/iq3_s.py, iq2.py and iq_lattice.py (whose docstrings describe the algorithm), for speed: the numpy
 * codecs make tens of array passes per trial scale, this file walks one block at a time in the L1 cache.
 *
 * The lattice tables (each grid's points, the map from a packed code to its grid index, the neighbour lists of
 * the codes off the grid) are not repeated here: kernels/ggml/iq_c.py hands over the arrays iq_lattice.lattice()
 * derives, so both paths search the same candidates in the same order.
 *
 * Exactness: every value is computed by the same float32 expression, in the same association order, as ggml's C;
 * sums run over a block's elements in order; the build uses -ffp-contract=off and no fast-math (no FMA, no
 * reassociation). tests/kernels/test_iq_c.py compares the bytes with ggml_quantize_chunk.
 */
#include <stdint.h>
#include <string.h>
#include <float.h>
#include <math.h>
#include <stdlib.h>

#if defined(__GNUC__) && defined(__x86_64__) && !defined(__clang__) && !defined(QC_NO_CLONES)
#define QC_CLONES __attribute__((target_clones("avx2", "default")))
#else
#define QC_CLONES
#endif

#define EPS_DEFAULT 1e-15f  /* GROUP_MAX_EPS: IQ2_XS, IQ2_XXS */
#define EPS_1E8 1e-8f       /* GROUP_MAX_EPS_IQ3_XXS, GROUP_MAX_EPS_IQ2_S */

enum { T_IQ3_S = 0, T_IQ3_XXS = 1, T_IQ2_S = 2, T_IQ2_XS = 3, T_IQ2_XXS = 4, N_TYPES = 5 };
enum { REFINE_ALL = 0, REFINE_OFF = 1, REFINE_ALWAYS = 2 };
/* error codes: a GGML_ASSERT ggml would abort on */
enum { QC_OK = 0, QC_NO_NEIGHBOUR = 1, QC_NAN_SCALE = 2, QC_NO_TABLES = 3, QC_BAD_TYPE = 4 };

typedef struct {
    int bits, dim, npoints, kmap_size;
    const float *values;    /* [npoints * dim]: 2*l + 1 per coordinate */
    const int32_t *kmap;    /* [kmap_size]: grid index of a packed code, -1 off the grid */
    const int64_t *start;   /* [kmap_size]: where an off-grid code's neighbour list starts in flat */
    const int64_t *count;   /* [kmap_size]: its length */
    const int32_t *flat;
    int64_t total;          /* entries in flat */
    float *cand_values;     /* [dim][total]: coordinate i of the candidate at flat[p] at cand_values[i*total + p] */
} lattice_t;

static lattice_t LAT[N_TYPES];

int qc_iq_abi_version(void) { return 1; }

void qc_iq_set_lattice(int type, int bits, int dim, int npoints, int kmap_size, const float *values,
                       const int32_t *kmap, const int64_t *start, const int64_t *count, const int32_t *flat) {
    if (type < 0 || type >= N_TYPES) return;
    int64_t total = 0;
    for (int u = 0; u < kmap_size; ++u) if (start[u] + count[u] > total) total = start[u] + count[u];
    /* the candidates' coordinates laid out list by list, one row per coordinate, so that the distance loop over a
     * list's candidates reads contiguous memory and vectorizes (the same float32 operations per candidate) */
    float *cv = malloc(sizeof(float) * (size_t)(total > 0 ? total : 1) * (size_t)dim);
    if (!cv) return;
    for (int64_t p = 0; p < total; ++p)
        for (int i = 0; i < dim; ++i) cv[i * total + p] = values[(int64_t)flat[p] * dim + i];
    free(LAT[type].cand_values);
    lattice_t l = {bits, dim, npoints, kmap_size, values, kmap, start, count, flat, total, cv};
    LAT[type] = l;
}

static inline int32_t f2i_bits(float f) { int32_t i; memcpy(&i, &f, 4); return i; }
static inline float i2f_bits(uint32_t i) { float f; memcpy(&f, &i, 4); return f; }

/* C's nearest_int: the 1.5*2^23 bit trick */
static inline int nearest_int(float fval) {
    float val = fval + 12582912.f;
    return (f2i_bits(val) & 0x007fffff) - 0x00400000;
}

/* fp32 -> fp16, round to nearest even (subnormals, overflow to inf), as GGML_FP32_TO_FP16 */
static uint16_t fp32_to_fp16(float f) {
    float base = (fabsf(f) * 0x1.0p+112f) * 0x1.0p-110f;
    const uint32_t w = (uint32_t)f2i_bits(f);
    const uint32_t shl1_w = w + w;
    const uint32_t sign = w & 0x80000000u;
    uint32_t bias = shl1_w & 0xFF000000u;
    if (bias < 0x71000000u) bias = 0x71000000u;
    base = i2f_bits((bias >> 1) + 0x07800000u) + base;
    const uint32_t bits = (uint32_t)f2i_bits(base);
    const uint32_t nonsign = ((bits >> 13) & 0x00007C00u) + (bits & 0x00000FFFu);
    return (uint16_t)((sign >> 16) | (shl1_w > 0xFF000000u ? 0x7E00u : nonsign));
}

static inline int clampi(int v, int lo, int hi) { return v < lo ? lo : (v > hi ? hi : v); }

/* The best neighbour of an off-grid code: least sum(waux * (scale*q - xval)^2), the first of equal ones; -1 when
 * none is below FLT_MAX (ggml asserts). */
QC_CLONES static int best_neighbour(const lattice_t *lat, int u, const float *xval, const float *waux, float scale) {
    const int64_t st = lat->start[u], nc = lat->count[u];
    const int dim = lat->dim;
    float best_d2 = FLT_MAX;
    int best = -1;
    float d2[256];
    for (int64_t c0 = 0; c0 < nc; c0 += 256) {
        const int m = (int)(nc - c0 < 256 ? nc - c0 : 256);
        for (int j = 0; j < m; ++j) d2[j] = 0;
        for (int i = 0; i < dim; ++i) {  /* d2 += weight[i]*diff*diff, coordinate after coordinate as ggml */
            const float *q = lat->cand_values + i * lat->total + st + c0;
            const float xi = xval[i], wi = waux[i];
            for (int j = 0; j < m; ++j) {
                float diff = scale * q[j] - xi;
                d2[j] += wi * diff * diff;
            }
        }
        for (int j = 0; j < m; ++j)
            if (d2[j] < best_d2) { best_d2 = d2[j]; best = lat->flat[st + c0 + j]; }
    }
    return best;
}

/* Code one group at trial id: the packed code of clamp(nearest_int(0.5*(id*x - 1)), 0, kmaxq - 1), its grid index
 * (best neighbour at `scale` when off the grid). *on says whether the code was on the grid. */
static int code_group(const lattice_t *lat, float id, float scale, const float *xval, const float *waux, int kmaxq,
                      int *on) {
    int u = 0;
    for (int i = 0; i < lat->dim; ++i) {
        int l = clampi(nearest_int(0.5f * (id * xval[i] - 1)), 0, kmaxq - 1);
        u |= l << (lat->bits * i);
    }
    int gi = lat->kmap[u];
    *on = gi >= 0;
    if (gi < 0) gi = best_neighbour(lat, u, xval, waux, scale);
    return gi;
}

static void block_sums(const lattice_t *lat, int bs, const int *gi, const float *xval, const float *weight,
                       float *sumqx, float *sumq2) {
    float sx = 0, s2 = 0;
    for (int i = 0; i < bs; ++i) {
        float w = weight[i];
        float q = lat->values[(int64_t)gi[i / lat->dim] * lat->dim + i % lat->dim];
        sx += w * xval[i] * q;
        s2 += w * q * q;
    }
    *sumqx = sx; *sumq2 = s2;
}

/* The scale search of a live block (iq_lattice.search_blocks): trials id = (2*kmaxq - 1 + is*step)/mx for
 * is = -trials..trials, the refit per `refine`. gi[groups] out; returns the scale (before the sign check), or
 * sets *err. */
static float search_block(const lattice_t *lat, int bs, const float *xval, const float *weight, const float *waux,
                          float mx, int kmaxq, float step, int trials, int refine, float start_scale, int *gi,
                          int *err) {
    const int groups = bs / lat->dim;
    int aux[16], on[16], on_aux[16];
    float best = 0;
    float scale = start_scale;
    int g0 = lat->kmap[0];  /* code 0 (L = 0) */
    for (int k = 0; k < groups; ++k) { gi[k] = g0; on[k] = refine != REFINE_ALL; }
    for (int is = -trials; is <= trials; ++is) {
        float id = (2 * kmaxq - 1 + is * step) / mx;
        float this_scale = 1 / id;
        for (int k = 0; k < groups; ++k) {
            aux[k] = code_group(lat, id, this_scale, xval + k * lat->dim, waux + k * lat->dim, kmaxq, &on_aux[k]);
            if (aux[k] < 0) { *err = QC_NO_NEIGHBOUR; return 0; }
        }
        float sumqx, sumq2;
        block_sums(lat, bs, aux, xval, weight, &sumqx, &sumq2);
        if (sumq2 > 0 && sumqx * sumqx > best * sumq2) {
            scale = sumqx / sumq2; best = scale * sumqx;
            for (int k = 0; k < groups; ++k) { gi[k] = aux[k]; on[k] = on_aux[k]; }
        }
    }
    int redo = 0;
    if (refine == REFINE_ALWAYS) redo = 1;
    else for (int k = 0; k < groups; ++k) if (!on[k]) redo = 1;
    if (redo && scale > 0) {
        float id = 1 / scale;
        for (int k = 0; k < groups; ++k) {
            if (refine == REFINE_OFF && on[k]) continue;
            int dummy;
            gi[k] = code_group(lat, id, scale, xval + k * lat->dim, waux + k * lat->dim, kmaxq, &dummy);
            if (gi[k] < 0) { *err = QC_NO_NEIGHBOUR; return 0; }
        }
        float sumqx, sumq2;
        block_sums(lat, bs, gi, xval, weight, &sumqx, &sumq2);
        if (sumq2 > 0) scale = sumqx / sumq2;
    }
    return scale;
}

/* make_qp_quants(n, nmax, x, L, w) of ggml (the K quantizers' scale search; kquant_imatrix_c.c, linked into the
 * same library), only its returned scale: IQ2_XXS's starting point. L is uint8_t as in ggml: a negative code (a
 * sign-flipped xval) wraps to 255 there too. */
float k_make_qp(int n, int nmax, const float *x, uint8_t *L, const float *w);

static float make_qp_scale(int n, int nmax, const float *x, const float *w) {
    uint8_t L[32];
    return k_make_qp(n, nmax, x, L, w);
}

typedef struct {
    int bs;            /* block size: 32 or 16 */
    int kmaxq;
    float step;
    int trials;
    int refine;
    int even;          /* 7 stored sign bits per group of 8, the 8th their parity */
    float eps;         /* dead when max < eps (IQ3_S: when !max) */
    float sigma2_mult; /* sigma2 = sigma2_mult*sumx2/256 */
    float d_mult;      /* fp16(d * d_mult) */
    int nbytes;
} spec_t;

static const spec_t SPECS[N_TYPES] = {
    /* IQ3_S   */ {32, 8, 0.2f, 9, REFINE_ALL, 0, 0.f, 2.f, 1.033f, 110},
    /* IQ3_XXS */ {32, 8, 0.2f, 15, REFINE_OFF, 1, EPS_1E8, 2.f, 1.0125f, 98},
    /* IQ2_S   */ {16, 3, 0.1f, 9, REFINE_OFF, 0, EPS_1E8, 2.f, 0.9875f, 82},
    /* IQ2_XS  */ {16, 3, 0.1f, 9, REFINE_OFF, 1, EPS_DEFAULT, 1.f, 1.f, 74},
    /* IQ2_XXS */ {32, 3, 0.1f, 6, REFINE_ALWAYS, 1, EPS_DEFAULT, 1.f, 1.f, 66},
};

/* One super-block of 256 values -> its bytes (zeroed first by the caller). */
static int quantize_super(int type, const float *xbl, const float *qwbl, uint8_t *y) {
    const spec_t *sp = &SPECS[type];
    const lattice_t *lat = &LAT[type];
    const int bs = sp->bs, nblocks = 256 / bs, groups = bs / lat->dim, sgroups = bs / 8;
    float weight[32], waux[32], xval[32], scales[16];
    uint8_t block_signs[4];
    int gi[8];
    float max_scale = 0;
    int slot = 0;  /* IQ3_S: the block whose qs/signs slots come next (a dead block does not advance it) */

    float sumx2 = 0;
    for (int i = 0; i < 256; ++i) sumx2 += xbl[i] * xbl[i];
    float sigma2 = sp->sigma2_mult == 2.f ? 2 * sumx2 / 256 : sumx2 / 256;

    uint32_t words[16];  /* IQ2_XXS: 2 per block; IQ3_XXS: scales_and_signs per block */
    uint16_t q2[32];     /* IQ2_XS */
    memset(words, 0, sizeof words);
    memset(q2, 0, sizeof q2);

    for (int ib = 0; ib < nblocks; ++ib) {
        const float *xb = xbl + bs * ib;
        if (qwbl) {
            const float *qw = qwbl + bs * ib;
            for (int i = 0; i < bs; ++i) weight[i] = qw[i] * sqrtf(sigma2 + xb[i] * xb[i]);
        } else if (type == T_IQ2_S) {
            for (int i = 0; i < bs; ++i) weight[i] = 0.25f * sigma2 + xb[i] * xb[i];
        } else {
            for (int i = 0; i < bs; ++i) weight[i] = xb[i] * xb[i];
        }
        for (int i = 0; i < bs; ++i) waux[i] = sqrtf(weight[i]);
        for (int k = 0; k < sgroups; ++k) {
            int nflip = 0;
            uint8_t s = 0;
            for (int i = 0; i < 8; ++i) {
                float v = xb[8 * k + i];
                if (v >= 0) xval[8 * k + i] = v;
                else { xval[8 * k + i] = -v; ++nflip; s |= (uint8_t)(1 << i); }
            }
            if (sp->even) {
                if (nflip % 2) {
                    int imin = 0;
                    float mn = weight[8 * k] * xb[8 * k] * xb[8 * k];
                    for (int i = 1; i < 8; ++i) {
                        float ax = weight[8 * k + i] * xb[8 * k + i] * xb[8 * k + i];
                        if (ax < mn) { mn = ax; imin = i; }
                    }
                    xval[8 * k + imin] = -xval[8 * k + imin];
                    s ^= (uint8_t)(1 << imin);
                }
                s &= 127;
            }
            block_signs[k] = s;
        }
        float max = xval[0];
        for (int i = 1; i < bs; ++i) max = max > xval[i] ? max : xval[i];  /* MAX(max, xval[i]) */
        int dead = type == T_IQ3_S ? !max : max < sp->eps;
        if (dead) { scales[ib] = 0; continue; }
        float mx = max, start = max / (2 * sp->kmaxq - 1);
        if (type == T_IQ2_XXS) {
            float qp = make_qp_scale(32, sp->kmaxq + 1, xval, weight);
            mx = qp * sp->kmaxq;  /* eff_max */
            if (mx <= 0) { scales[ib] = 0; continue; }
            start = qp;
        }
        int err = QC_OK;
        float scale = search_block(lat, bs, xval, weight, waux, mx, sp->kmaxq, sp->step, sp->trials, sp->refine,
                                   start, gi, &err);
        if (err) return err;
        if (scale < 0) {
            scale = -scale;
            for (int k = 0; k < sgroups; ++k) block_signs[k] = sp->even ? (uint8_t)(~block_signs[k] & 127)
                                                                         : (uint8_t)~block_signs[k];
        }
        if (!(scale >= 0)) return QC_NAN_SCALE;
        switch (type) {
        case T_IQ3_S:
            for (int k = 0; k < groups; ++k) {
                y[2 + 8 * slot + k] = (uint8_t)(gi[k] & 255);
                y[66 + ib] |= (uint8_t)((gi[k] >> 8) << k);
            }
            for (int k = 0; k < sgroups; ++k) y[74 + 4 * slot + k] = block_signs[k];
            ++slot;
            break;
        case T_IQ3_XXS:
            for (int k = 0; k < groups; ++k) y[2 + 8 * ib + k] = (uint8_t)gi[k];
            words[ib] = block_signs[0] | (block_signs[1] << 7) | (block_signs[2] << 14) | ((uint32_t)block_signs[3] << 21);
            break;
        case T_IQ2_S:
            for (int k = 0; k < groups; ++k) {
                int i8 = 2 * ib + k;
                y[2 + i8] = (uint8_t)(gi[k] & 255);
                y[66 + i8 / 4] |= (uint8_t)((gi[k] >> 8) << 2 * (i8 % 4));
                y[34 + i8] = block_signs[k];
            }
            break;
        case T_IQ2_XS:
            for (int k = 0; k < groups; ++k) q2[2 * ib + k] = (uint16_t)(gi[k] | (block_signs[k] << 9));
            break;
        case T_IQ2_XXS:
            for (int k = 0; k < groups; ++k) {
                words[2 * ib] |= (uint32_t)gi[k] << 8 * k;
                words[2 * ib + 1] |= (uint32_t)block_signs[k] << 7 * k;
            }
            break;
        }
        scales[ib] = scale;
        max_scale = max_scale > scale ? max_scale : scale;  /* MAX(max_scale, scale) */
    }
    if (!max_scale) {
        /* C leaves d = 0 and clears the quants (IQ3_S: nothing was written but what it memset) */
        if (type != T_IQ3_S && type != T_IQ2_S) memset(y + 2, 0, sp->nbytes - 2 - (type == T_IQ2_XS ? 8 : 0));
        return QC_OK;
    }
    float d = max_scale / 31;
    uint16_t dh = sp->d_mult == 1.f ? fp32_to_fp16(d) : fp32_to_fp16(d * sp->d_mult);
    y[0] = (uint8_t)(dh & 255); y[1] = (uint8_t)(dh >> 8);
    float id = 1 / d;
    for (int ib = 0; ib < nblocks; ++ib) {
        int l = clampi(nearest_int(0.5f * (id * scales[ib] - 1)), 0, 15);
        switch (type) {
        case T_IQ3_S: y[106 + ib / 2] |= (uint8_t)(l << 4 * (ib % 2)); break;
        case T_IQ2_S: y[74 + ib / 2] |= (uint8_t)(l << 4 * (ib % 2)); break;
        case T_IQ2_XS: y[66 + ib / 2] |= (uint8_t)(l << 4 * (ib % 2)); break;
        case T_IQ3_XXS: words[ib] |= (uint32_t)l << 28; break;
        case T_IQ2_XXS: words[2 * ib + 1] |= (uint32_t)l << 28; break;
        }
    }
    if (type == T_IQ3_XXS) for (int ib = 0; ib < 8; ++ib) memcpy(y + 66 + 4 * ib, &words[ib], 4);
    if (type == T_IQ2_XXS) for (int j = 0; j < 16; ++j) memcpy(y + 2 + 4 * j, &words[j], 4);
    if (type == T_IQ2_XS) for (int j = 0; j < 32; ++j) memcpy(y + 2 + 2 * j, &q2[j], 2);
    return QC_OK;
}

/* rows [r0, r1) of x [rows, n] -> their bytes in y (row r at y + r * row_bytes); qw [n] or NULL. */
QC_CLONES int qc_iq_quantize(int type, const float *x, int64_t n, const float *qw, uint8_t *y, int64_t r0, int64_t r1) {
    if (type < 0 || type >= N_TYPES) return QC_BAD_TYPE;
    if (!LAT[type].kmap) return QC_NO_TABLES;
    const int nbytes = SPECS[type].nbytes;
    const int64_t nsup = n / 256, row_bytes = nsup * nbytes;
    for (int64_t r = r0; r < r1; ++r) {
        for (int64_t s = 0; s < nsup; ++s) {
            uint8_t *yb = y + r * row_bytes + s * nbytes;
            memset(yb, 0, nbytes);
            int err = quantize_super(type, x + r * n + 256 * s, qw ? qw + 256 * s : NULL, yb);
            if (err) return err;
        }
    }
    return QC_OK;
}
