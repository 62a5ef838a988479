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
 *
 * Speed (docs/benchmarks.md: about 1.6-2.6x ggml's CPU time, bytes equal) comes from doing ggml's arithmetic with
 * less around it, never from other arithmetic: the neighbour searches take 8 candidates per AVX2 vector where the
 * CPU has AVX2 (chosen at run time, so the library stays portable; the portable C otherwise, which the tests force
 * and compare too), each type's search inlined with its sizes as constants, a trial that lands on the same grid
 * points as the one before reuses its sums, IQ1's split scan skips the splits that cannot pass its test, and IQ1's
 * block sort calls qsort only where its order is ambiguous (NaN, or ties where the C library's qsort is not stable).
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

#if defined(__GNUC__)
#define QC_INLINE static inline __attribute__((always_inline))
#define QC_MAYBE_UNUSED __attribute__((unused))
#else
#define QC_INLINE static inline
#define QC_MAYBE_UNUSED
#endif

#define EPS_DEFAULT 1e-15f  /* GROUP_MAX_EPS: IQ2_XS, IQ2_XXS */
#define EPS_1E8 1e-8f       /* GROUP_MAX_EPS_IQ3_XXS, GROUP_MAX_EPS_IQ2_S */

enum { T_IQ3_S = 0, T_IQ3_XXS = 1, T_IQ2_S = 2, T_IQ2_XS = 3, T_IQ2_XXS = 4, T_IQ1_S = 5, T_IQ1_M = 6, N_TYPES = 7 };
enum { REFINE_ALL = 0, REFINE_OFF = 1, REFINE_ALWAYS = 2 };
/* error codes: a GGML_ASSERT ggml would abort on */
enum { QC_OK = 0, QC_NO_NEIGHBOUR = 1, QC_NAN_SCALE = 2, QC_NO_TABLES = 3, QC_BAD_TYPE = 4, QC_NO_WEIGHTS = 5 };

typedef struct {
    int bits, dim, npoints, kmap_size;
    const float *values;    /* [npoints * dim]: 2*l + 1 per coordinate */
    const int32_t *kmap;    /* [kmap_size]: grid index of a packed code, -1 off the grid */
    const int64_t *start;   /* [kmap_size]: where an off-grid code's neighbour list starts in flat */
    const int64_t *count;   /* [kmap_size]: its length */
    const int32_t *flat;
    int64_t total;          /* entries in flat */
    float *cand_values;     /* [dim][stride]: coordinate i of the candidate at flat[p] at cand_values[i*stride + p]
                             * (lattice types only) */
    int64_t stride;         /* total + 8: a load of 8 candidates from a list's start never reads past a row */
    uint8_t *codes;         /* [npoints * dim]: the code l of each coordinate ((value - 1) / 2), IQ1's table index */
    float *iq1_levels;      /* IQ1 only, [2][npoints][8]: each grid point's 8 levels with delta +IQ1_DELTA, then
                             * with -IQ1_DELTA (x_p[l], x_m[l]: the values ggml's neighbour search reads) */
} lattice_t;

static lattice_t LAT[N_TYPES];

int qc_iq_abi_version(void) { return 5; }

static int use_avx2 QC_MAYBE_UNUSED;  /* the CPU runs AVX2: the neighbour searches take their AVX2 versions (the same float32 ops) */
static int portable_only QC_MAYBE_UNUSED;  /* set by the tests: the portable C searches, as on a CPU without AVX2 */

static int qsort_is_stable;  /* defined with the IQ1 sort below */
static int probe_qsort_stability(void);

/* on: the portable searches (no AVX2) and every tied IQ1 block sorted by qsort, as on a CPU without AVX2 and a C
 * library whose qsort is not stable; off: both as this machine allows. */
void qc_iq_portable_only(int on) {
    portable_only = on;
    qsort_is_stable = on ? 0 : probe_qsort_stability();
}

#define IQ1_DELTA 0.125f     /* IQ1S_DELTA = IQ1M_DELTA */

void qc_iq_set_lattice(int type, int bits, int dim, int npoints, int kmap_size, const float *values,
                       const int32_t *kmap, const int64_t *start, const int64_t *count, const int32_t *flat) {
    if (type < 0 || type >= N_TYPES) return;
#if defined(__GNUC__) && defined(__x86_64__) && !defined(QC_NO_CLONES)
    __builtin_cpu_init();
    use_avx2 = __builtin_cpu_supports("avx2");
#endif
    const int iq1 = type == T_IQ1_S || type == T_IQ1_M;
    if (iq1 && qsort_is_stable < 0) qsort_is_stable = probe_qsort_stability();
    int64_t total = 0;
    for (int u = 0; u < kmap_size; ++u) if (start[u] + count[u] > total) total = start[u] + count[u];
    const int64_t stride = total + 8;
    /* the candidates' coordinates laid out list by list, one row per coordinate, so that the distance loop over a
     * list's candidates reads contiguous memory and vectorizes (the same float32 operations per candidate). IQ1's
     * lists are 4x longer over a 4x larger grid: there the search reads each candidate's 8 levels instead. */
    float *cv = iq1 ? NULL : malloc(sizeof(float) * (size_t)stride * (size_t)dim);
    uint8_t *codes = malloc((size_t)npoints * (size_t)dim);
    float *levels = iq1 ? malloc(sizeof(float) * 2 * (size_t)npoints * 8) : NULL;
    if ((!iq1 && !cv) || !codes || (iq1 && !levels)) { free(cv); free(codes); free(levels); return; }
    for (int64_t p = 0; p < (int64_t)npoints * dim; ++p) codes[p] = (uint8_t)((int)(values[p] - 1) / 2);
    if (cv) {
        for (int i = 0; i < dim; ++i) {
            for (int64_t p = 0; p < total; ++p) cv[i * stride + p] = values[(int64_t)flat[p] * dim + i];
            for (int64_t p = total; p < stride; ++p) cv[i * stride + p] = 0;
        }
    }
    if (levels) {
        const float x_p[3] = {-1 + IQ1_DELTA, IQ1_DELTA, 1 + IQ1_DELTA}, x_m[3] = {-1 - IQ1_DELTA, -IQ1_DELTA, 1 - IQ1_DELTA};
        for (int64_t p = 0; p < (int64_t)npoints * 8; ++p) {
            levels[p] = x_p[codes[p]];
            levels[(int64_t)npoints * 8 + p] = x_m[codes[p]];
        }
    }
    free(LAT[type].cand_values);
    free(LAT[type].codes);
    free(LAT[type].iq1_levels);
    lattice_t l = {bits, dim, npoints, kmap_size, values, kmap, start, count, flat, total, cv, stride, codes, levels};
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

#if defined(__GNUC__) && defined(__x86_64__) && !defined(QC_NO_CLONES)
#define QC_AVX2 1
#include <immintrin.h>
#define AVX2 __attribute__((target("avx2")))

/* The first lane of the least of 8 distances if it is below *best_d2 (then *best_d2 takes it), else -1: the scalar
 * scan's `if (d2[j] < best_d2)` over the 8 in order. A NaN or a distance >= FLT_MAX never wins there, nor here
 * (min_ps keeps its second operand, FLT_MAX, for a NaN). Lanes >= m are not candidates. */
AVX2 static inline int pick_first_least(__m256 d2, int m, float *best_d2) {
    const __m256 big = _mm256_set1_ps(FLT_MAX);
    if (m < 8) {
        const __m256i past = _mm256_cmpgt_epi32(_mm256_setr_epi32(1, 2, 3, 4, 5, 6, 7, 8), _mm256_set1_epi32(m));
        d2 = _mm256_blendv_ps(d2, big, _mm256_castsi256_ps(past));
    }
    const __m256 c = _mm256_min_ps(d2, big);
    __m256 mn = _mm256_min_ps(c, _mm256_permute2f128_ps(c, c, 1));
    mn = _mm256_min_ps(mn, _mm256_shuffle_ps(mn, mn, _MM_SHUFFLE(1, 0, 3, 2)));
    mn = _mm256_min_ps(mn, _mm256_shuffle_ps(mn, mn, _MM_SHUFFLE(2, 3, 0, 1)));
    const float least = _mm_cvtss_f32(_mm256_castps256_ps128(mn));
    if (!(least < *best_d2)) return -1;
    *best_d2 = least;
    return __builtin_ctz((unsigned)_mm256_movemask_ps(_mm256_cmp_ps(c, mn, _CMP_EQ_OQ)));
}

/* best_neighbour's search, 8 candidates a vector: per candidate the same float32 operations in the same order
 * (d2 = 0, then d2 += (w*diff)*diff coordinate by coordinate, diff = scale*q - x), no FMA. */
AVX2 static inline __attribute__((always_inline)) int nb_avx2(const lattice_t *lat, int u, const float *xval,
                                                              const float *waux, float scale, const int dim) {
    const int64_t st = lat->start[u], nc = lat->count[u], stride = lat->stride;
    const float *cv = lat->cand_values + st;
    const __m256 vs = _mm256_set1_ps(scale);
    __m256 vx[8], vw[8];
    for (int i = 0; i < dim; ++i) { vx[i] = _mm256_set1_ps(xval[i]); vw[i] = _mm256_set1_ps(waux[i]); }
    float best_d2 = FLT_MAX;
    int best = -1;
    for (int64_t c0 = 0; c0 < nc; c0 += 8) {
        __m256 d2 = _mm256_setzero_ps();
        for (int i = 0; i < dim; ++i) {
            const __m256 diff = _mm256_sub_ps(_mm256_mul_ps(vs, _mm256_loadu_ps(cv + i * stride + c0)), vx[i]);
            d2 = _mm256_add_ps(d2, _mm256_mul_ps(_mm256_mul_ps(vw[i], diff), diff));
        }
        const int lane = pick_first_least(d2, nc - c0 < 8 ? (int)(nc - c0) : 8, &best_d2);
        if (lane >= 0) best = lat->flat[st + c0 + lane];
    }
    return best;
}
AVX2 static int best_neighbour_avx2_4(const lattice_t *lat, int u, const float *x, const float *w, float scale) {
    return nb_avx2(lat, u, x, w, scale, 4);
}
AVX2 static int best_neighbour_avx2_8(const lattice_t *lat, int u, const float *x, const float *w, float scale) {
    return nb_avx2(lat, u, x, w, scale, 8);
}

/* iq1_neighbour's search, 8 candidates at a time: each candidate's 8 terms (w*diff)*diff computed across its
 * coordinates, the 8x8 block transposed, then summed coordinate by coordinate from 0 as the scalar loop adds them. */
AVX2 static int iq1_neighbour_avx2(const lattice_t *lat, int u, const float *x, const float *w, float scale,
                                   int minus) {
    const int64_t st = lat->start[u], nc = lat->count[u];
    const float *lv = lat->iq1_levels + (minus ? (int64_t)lat->npoints * 8 : 0);
    const __m256 vs = _mm256_set1_ps(scale), vx = _mm256_loadu_ps(x), vw = _mm256_loadu_ps(w);
    float best_d2 = FLT_MAX;
    int best = -1;
    for (int64_t c0 = 0; c0 < nc; c0 += 8) {
        const int m = nc - c0 < 8 ? (int)(nc - c0) : 8;
        __m256 r[8];
        for (int j = 0; j < 8; ++j) {
            const int p = lat->flat[st + c0 + (j < m ? j : 0)];
            const __m256 diff = _mm256_sub_ps(_mm256_mul_ps(vs, _mm256_loadu_ps(lv + (int64_t)p * 8)), vx);
            r[j] = _mm256_mul_ps(_mm256_mul_ps(vw, diff), diff);
        }
        const __m256 t0 = _mm256_unpacklo_ps(r[0], r[1]), t1 = _mm256_unpackhi_ps(r[0], r[1]);
        const __m256 t2 = _mm256_unpacklo_ps(r[2], r[3]), t3 = _mm256_unpackhi_ps(r[2], r[3]);
        const __m256 t4 = _mm256_unpacklo_ps(r[4], r[5]), t5 = _mm256_unpackhi_ps(r[4], r[5]);
        const __m256 t6 = _mm256_unpacklo_ps(r[6], r[7]), t7 = _mm256_unpackhi_ps(r[6], r[7]);
        const __m256 s0 = _mm256_shuffle_ps(t0, t2, _MM_SHUFFLE(1, 0, 1, 0));
        const __m256 s1 = _mm256_shuffle_ps(t0, t2, _MM_SHUFFLE(3, 2, 3, 2));
        const __m256 s2 = _mm256_shuffle_ps(t1, t3, _MM_SHUFFLE(1, 0, 1, 0));
        const __m256 s3 = _mm256_shuffle_ps(t1, t3, _MM_SHUFFLE(3, 2, 3, 2));
        const __m256 s4 = _mm256_shuffle_ps(t4, t6, _MM_SHUFFLE(1, 0, 1, 0));
        const __m256 s5 = _mm256_shuffle_ps(t4, t6, _MM_SHUFFLE(3, 2, 3, 2));
        const __m256 s6 = _mm256_shuffle_ps(t5, t7, _MM_SHUFFLE(1, 0, 1, 0));
        const __m256 s7 = _mm256_shuffle_ps(t5, t7, _MM_SHUFFLE(3, 2, 3, 2));
        /* coordinate i of the 8 candidates: */
        __m256 d2 = _mm256_add_ps(_mm256_setzero_ps(), _mm256_permute2f128_ps(s0, s4, 0x20));
        d2 = _mm256_add_ps(d2, _mm256_permute2f128_ps(s1, s5, 0x20));
        d2 = _mm256_add_ps(d2, _mm256_permute2f128_ps(s2, s6, 0x20));
        d2 = _mm256_add_ps(d2, _mm256_permute2f128_ps(s3, s7, 0x20));
        d2 = _mm256_add_ps(d2, _mm256_permute2f128_ps(s0, s4, 0x31));
        d2 = _mm256_add_ps(d2, _mm256_permute2f128_ps(s1, s5, 0x31));
        d2 = _mm256_add_ps(d2, _mm256_permute2f128_ps(s2, s6, 0x31));
        d2 = _mm256_add_ps(d2, _mm256_permute2f128_ps(s3, s7, 0x31));
        const int lane = pick_first_least(d2, m, &best_d2);
        if (lane >= 0) best = lat->flat[st + c0 + lane];
    }
    return best;
}
#endif

/* The best neighbour of an off-grid code: least sum(waux * (scale*q - xval)^2), the first of equal ones; -1 when
 * none is below FLT_MAX (ggml asserts). */
QC_CLONES static int best_neighbour(const lattice_t *lat, int u, const float *xval, const float *waux, float scale) {
#ifdef QC_AVX2
    if (use_avx2 && !portable_only) return lat->dim == 4 ? best_neighbour_avx2_4(lat, u, xval, waux, scale)
                                       : best_neighbour_avx2_8(lat, u, xval, waux, scale);
#endif
    const int64_t st = lat->start[u], nc = lat->count[u];
    const int dim = lat->dim;
    float best_d2 = FLT_MAX;
    int best = -1;
    float d2[256];
    for (int64_t c0 = 0; c0 < nc; c0 += 256) {
        const int m = (int)(nc - c0 < 256 ? nc - c0 : 256);
        for (int j = 0; j < m; ++j) d2[j] = 0;
        for (int i = 0; i < dim; ++i) {  /* d2 += weight[i]*diff*diff, coordinate after coordinate as ggml */
            const float *q = lat->cand_values + i * lat->stride + st + c0;
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
QC_INLINE int code_group(const lattice_t *lat, float id, float scale, const float *xval, const float *waux, int kmaxq,
                         int *on, const int dim, const int bits) {
    int u = 0;
    for (int i = 0; i < dim; ++i) {
        int l = clampi(nearest_int(0.5f * (id * xval[i] - 1)), 0, kmaxq - 1);
        u |= l << (bits * i);
    }
    int gi = lat->kmap[u];
    *on = gi >= 0;
    if (gi < 0) gi = best_neighbour(lat, u, xval, waux, scale);
    return gi;
}

QC_INLINE void block_sums(const lattice_t *lat, int bs, const int *gi, const float *xval, const float *weight,
                          float *sumqx, float *sumq2, const int dim) {
    float sx = 0, s2 = 0;
    for (int i = 0; i < bs; ++i) {
        float w = weight[i];
        float q = lat->values[(int64_t)gi[i / dim] * dim + i % dim];
        sx += w * xval[i] * q;
        s2 += w * q * q;
    }
    *sumqx = sx; *sumq2 = s2;
}

/* The scale search of a live block (iq_lattice.search_blocks): trials id = (2*kmaxq - 1 + is*step)/mx for
 * is = -trials..trials, the refit per `refine`. gi[groups] out; returns the scale (before the sign check), or
 * sets *err. */
QC_INLINE float search_block(const lattice_t *lat, int bs, const float *xval, const float *weight, const float *waux,
                             float mx, int kmaxq, float step, int trials, int refine, float start_scale, int *gi,
                             int *err, const int dim, const int bits) {
    const int groups = bs / dim;
    int aux[16], on[16], on_aux[16], prev[16];  /* prev: the previous trial's points (none yet: -1) */
    float sumqx = 0, sumq2 = 0;
    for (int k = 0; k < 16; ++k) prev[k] = -1;
    float best = 0;
    float scale = start_scale;
    int g0 = lat->kmap[0];  /* code 0 (L = 0) */
    for (int k = 0; k < groups; ++k) { gi[k] = g0; on[k] = refine != REFINE_ALL; }
    for (int is = -trials; is <= trials; ++is) {
        float id = (2 * kmaxq - 1 + is * step) / mx;
        float this_scale = 1 / id;
        for (int k = 0; k < groups; ++k) {
            aux[k] = code_group(lat, id, this_scale, xval + k * dim, waux + k * dim, kmaxq, &on_aux[k], dim,
                                bits);
            if (aux[k] < 0) { *err = QC_NO_NEIGHBOUR; return 0; }
        }
        /* the sums depend on the grid points only: a trial that picked the same points as the one before
         * (neighbouring trial scales often do) has the same sums */
        int same = 1;
        for (int k = 0; k < groups; ++k) same &= aux[k] == prev[k];
        if (!same) {
            block_sums(lat, bs, aux, xval, weight, &sumqx, &sumq2, dim);
            for (int k = 0; k < groups; ++k) prev[k] = aux[k];
        }
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
            gi[k] = code_group(lat, id, scale, xval + k * dim, waux + k * dim, kmaxq, &dummy, dim, bits);
            if (gi[k] < 0) { *err = QC_NO_NEIGHBOUR; return 0; }
        }
        float sumqx, sumq2;
        block_sums(lat, bs, gi, xval, weight, &sumqx, &sumq2, dim);
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
    /* IQ1_S, IQ1_M: their own search below (quantize_iq1_s_super, quantize_iq1_m_super); block size, bytes only */
    /* IQ1_S   */ {32, 0, 0.f, 0, 0, 0, 0.f, 0.f, 0.f, 50},
    /* IQ1_M   */ {16, 0, 0.f, 0, 0, 0, 0.f, 0.f, 0.f, 56},
};

/* One super-block of 256 values -> its bytes (zeroed first by the caller). Inlined into one function per type (below),
 * so that the type's block size, group size and bits are constants: the loops over a group's coordinates and a
 * block's values unroll, the code's bit shifts and the q lookups need no division. */
QC_INLINE int quantize_super(const int type, const float *xbl, const float *qwbl, uint8_t *y) {
    const int dim = type == T_IQ3_S || type == T_IQ3_XXS ? 4 : 8, bits = dim == 4 ? 3 : 2;
    const spec_t *sp = &SPECS[type];
    const lattice_t *lat = &LAT[type];
    const int bs = sp->bs, nblocks = 256 / bs, groups = bs / dim, sgroups = bs / 8;
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
                                   start, gi, &err, dim, bits);
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

/* ------------------------------------------------------------------------------------------------------------
 * IQ1_S and IQ1_M (ggml-quants.c quantize_row_iq1_s_impl / quantize_row_iq1_m_impl). Each value of a block takes
 * one of three levels {-1, 0, +1} + delta, delta = +-IQ1_DELTA shared by a block (IQ1_S) or by each 8-group (IQ1_M,
 * the two groups of a 16-block chosen independently); groups of 8 codes must then lie on the 2048-point grid
 * (kgrid_1bit_2048, codes 0..2 in 2 bits each). The block scale is found exactly: with the values sorted, every
 * split of them into the three levels (two boundaries i1 <= i2) is scored from prefix sums, both deltas (IQ1_M:
 * the four combinations of the halves' deltas), keeping the first strict best of sumqx^2/sumq2. An off-grid group
 * takes the neighbour of least weighted error at that scale (a different error than the IQ2 types': the
 * candidate's levels shifted by the delta, the signed values, the weights themselves rather than their roots),
 * and the scale is refitted where a group moved. The super-block scale d is max_scale/15 with a fudge factor
 * (IQ1_S: fp16(d*1.125); IQ1_M: d refitted over all blocks' 3-bit scales, fp16(d*1.1125) spread over the top
 * nibbles of the four uint16 scales).
 *
 * The sort is the C library's qsort with ggml's comparator on ggml's (value, index) pairs: where values tie (or a
 * NaN makes the comparison inconsistent) the order is whatever qsort gives, so calling the same qsort keeps the
 * same order on any platform, where a hand-written sort would have to copy glibc's merge sort to agree. */

#define IQ1S_EPS 1e-12f      /* GROUP_MAX_EPS_IQ1_S */
#define IQ1M_EPS 1e-7f       /* GROUP_MAX_EPS_IQ1_M */

typedef struct { float value; int index; } iq1_pair_t;  /* ggml's float pairs[2*j], (int)pairs[2*j + 1] */

static int iq1_pair_cmp(const void *a, const void *b) {
    const float l = ((const iq1_pair_t *)a)->value, r = ((const iq1_pair_t *)b)->value;
    return l < r ? -1 : l > r ? 1 : 0;
}

/* The neighbour of least sum(w * (scale*levels[l] - x)^2) among an off-grid code's list, the first of equal ones
 * (iq1_find_best_neighbour2). -1 when none is below FLT_MAX: ggml then scans the whole grid comparing with x[i]
 * for grid index i (past the group's 8 values) and asserts; we stop there. */
static int iq1_neighbour(const lattice_t *lat, int u, const float *x, const float *w, float scale,
                         const float *levels) {
#ifdef QC_AVX2
    if (use_avx2 && !portable_only) return iq1_neighbour_avx2(lat, u, x, w, scale, levels[1] < 0);  /* x_m[1] = -IQ1_DELTA */
#endif
    const int64_t st = lat->start[u], nc = lat->count[u];
    float best_d2 = FLT_MAX;
    int best = -1;
    for (int64_t j = 0; j < nc; ++j) {
        const int p = lat->flat[st + j];
        const uint8_t *l = lat->codes + (int64_t)p * 8;
        float d2 = 0;
        for (int i = 0; i < 8; ++i) {
            float q = levels[l[i]];
            float diff = scale * q - x[i];
            d2 += w[i] * diff * diff;
        }
        if (d2 < best_d2) { best_d2 = d2; best = p; }
    }
    return best;
}

/* Whether this process's qsort keeps tied pairs in their input order on the block sizes IQ1 sorts (16: IQ1_M, 32:
 * IQ1_S): glibc's qsort is a merge sort there (stable; its quicksort fallback needs arrays beyond a quarter of
 * physical memory), musl's a smoothsort (not stable). Probed once per process on 4096 tie-heavy arrays against a
 * stable insertion sort: -1 not yet probed, 1 stable, 0 not (or forced off by qc_iq_portable_only for the tests). */
static int qsort_is_stable = -1;

/* The block's values with their positions in ascending order, ties kept in input order (an element moves only past
 * strictly greater ones): the order iq1_sorted keeps and the probe below compares qsort's with. */
QC_INLINE void insertion_sorted(const float *xb, int bs, iq1_pair_t *pairs) {
    for (int j = 0; j < bs; ++j) {
        const float v = xb[j];
        int k = j;
        while (k > 0 && pairs[k - 1].value > v) { pairs[k] = pairs[k - 1]; --k; }
        pairs[k].value = v; pairs[k].index = j;
    }
}

static int probe_qsort_stability(void) {
    uint32_t state = 12345u;
    float x[32];
    iq1_pair_t a[32], b[32];
    for (int trial = 0; trial < 4096; ++trial) {
        const int bs = trial & 1 ? 32 : 16;
        const uint32_t levels = 1u + (uint32_t)(trial % 7);  /* 1 to 7 distinct values: every kind of tie run */
        for (int j = 0; j < bs; ++j) {
            state = state * 1664525u + 1013904223u;
            x[j] = (float)((state >> 16) % levels);
            a[j].value = x[j]; a[j].index = j;
        }
        insertion_sorted(x, bs, b);
        qsort(a, (size_t)bs, sizeof(iq1_pair_t), iq1_pair_cmp);
        for (int j = 0; j < bs; ++j) if (a[j].index != b[j].index) return 0;
    }
    return 1;
}

int qc_iq1_stable_sort(void) { return qsort_is_stable == 1; }  /* for the tests: whether ties skip qsort here */

/* Sort a block's values with their positions, as ggml does before its split search (qsort with a comparator on the
 * values only). insertion_sorted is stable, so it gives qsort's order where the values are distinct (the one order
 * there is) and, where two values tie, wherever this C library's qsort is stable (probed above). Where a
 * value is NaN (the comparator is then inconsistent), or ties meet a qsort that is not stable, the order is
 * whatever qsort gives, so qsort sorts the block again. (Ties are common: a 4-bit GPTQ checkpoint's dequantized
 * weights repeat within every group, and bf16 weights often do; qsort took a quarter of IQ1_S's time on them.) */
static void iq1_sorted(const float *xb, int bs, iq1_pair_t *pairs) {
    insertion_sorted(xb, bs, pairs);
    int nan = pairs[0].value != pairs[0].value, tie = 0;
    for (int j = 1; j < bs; ++j) {
        nan |= pairs[j].value != pairs[j].value;
        tie |= pairs[j - 1].value == pairs[j].value;
    }
    if (!nan && (!tie || qsort_is_stable == 1)) return;
    for (int j = 0; j < bs; ++j) { pairs[j].value = xb[j]; pairs[j].index = j; }
    qsort(pairs, (size_t)bs, sizeof(iq1_pair_t), iq1_pair_cmp);
}

/* The grid index of each 8-group of codes L (off-grid: best neighbour at `scale`, the group's own levels).
 * -> whether all were on the grid, or -1 on no neighbour. */
static int iq1_groups(const lattice_t *lat, int groups, const uint8_t *L, const float *xb, const float *weight,
                      float scale, const float *const *levels, int *index) {
    int all_on = 1;
    for (int k = 0; k < groups; ++k) {
        int u = 0;
        for (int j = 0; j < 8; ++j) u |= L[8 * k + j] << 2 * j;
        int gi = lat->kmap[u];
        if (gi < 0) {
            all_on = 0;
            gi = iq1_neighbour(lat, u, xb + 8 * k, weight + 8 * k, scale, levels[k]);
            if (gi < 0) return -1;
        }
        index[k] = gi;
    }
    return all_on;
}

/* sum(w*q*x), sum(w*q*q) over a block's groups on their grid points, q the group's levels (the refit). */
static void iq1_refit_sums(const lattice_t *lat, int groups, const int *index, const float *xb, const float *weight,
                           const float *const *levels, float *sumqx, float *sumq2) {
    float sx = 0, s2 = 0;
    for (int k = 0; k < groups; ++k) {
        const uint8_t *l = lat->codes + (int64_t)index[k] * 8;
        for (int j = 0; j < 8; ++j) {
            float w = weight[8 * k + j];
            float q = levels[k][l[j]];
            sx += w * q * xb[8 * k + j];
            s2 += w * q * q;
        }
    }
    *sumqx = sx; *sumq2 = s2;
}

/* One IQ1_S super-block (50 bytes: fp16 d, qs[32] index lows, qh[8] uint16: 3 index highs per group, the 3-bit
 * block scale at bit 12, the delta's sign at bit 15), zeroed by the caller. The importance matrix is required. */
QC_CLONES static int quantize_iq1_s_super(const lattice_t *lat, const float *xbl, const float *qwbl, uint8_t *y) {
    static const float x_p[3] = {-1 + IQ1_DELTA, IQ1_DELTA, 1 + IQ1_DELTA};
    static const float x_m[3] = {-1 - IQ1_DELTA, -IQ1_DELTA, 1 - IQ1_DELTA};
    enum { BS = 32, NB = 256 / 32 };
    float scales[NB], weight[BS], sumx[BS + 1], sumw[BS + 1];
    int shifts[NB], index[4];
    uint8_t L[BS];
    uint16_t qh[NB];
    iq1_pair_t pairs[BS];
    memset(qh, 0, sizeof qh);
    float max_scale = 0;
    float sumx2 = 0;
    for (int i = 0; i < 256; ++i) sumx2 += xbl[i] * xbl[i];
    float sigma2 = 2 * sumx2 / 256;
    for (int ib = 0; ib < NB; ++ib) {
        const float *xb = xbl + BS * ib, *qw = qwbl + BS * ib;
        for (int i = 0; i < BS; ++i) weight[i] = qw[i] * sqrtf(sigma2 + xb[i] * xb[i]);
        float max = fabsf(xb[0]);
        for (int i = 1; i < BS; ++i) { float a = fabsf(xb[i]); max = max > a ? max : a; }
        if (max < IQ1S_EPS) { scales[ib] = 0; shifts[ib] = 1; continue; }
        iq1_sorted(xb, BS, pairs);
        sumx[0] = sumw[0] = 0;
        for (int j = 0; j < BS; ++j) {
            int i = pairs[j].index;
            sumx[j + 1] = sumx[j] + weight[i] * xb[i];
            sumw[j + 1] = sumw[j] + weight[i];
        }
        float best_score = -FLT_MAX, scale = max;
        int b1 = -1, b2 = -1, shift = 0;
        for (int i1 = 0; i1 <= BS; ++i1) {
            /* every split's sums for this i1 first, in a loop without branches the compiler vectorizes (the same
             * float32 expressions per element), then the scan for the first strict best in ggml's order */
            float qxp[BS + 1], q2p[BS + 1], qxm[BS + 1], q2m[BS + 1];
            const float x0 = sumx[i1] - sumx[0], w0 = sumw[i1] - sumw[0];
            for (int i2 = i1; i2 <= BS; ++i2) {
                const float x1 = sumx[i2] - sumx[i1], x2 = sumx[BS] - sumx[i2];
                const float w1 = sumw[i2] - sumw[i1], w2 = sumw[BS] - sumw[i2];
                /* the three levels' sums, left to right as ggml adds them */
                qxp[i2] = x0 * x_p[0] + x1 * x_p[1] + x2 * x_p[2];
                q2p[i2] = w0 * x_p[0] * x_p[0] + w1 * x_p[1] * x_p[1] + w2 * x_p[2] * x_p[2];
                qxm[i2] = x0 * x_m[0] + x1 * x_m[1] + x2 * x_m[2];
                q2m[i2] = w0 * x_m[0] * x_m[0] + w1 * x_m[1] * x_m[1] + w2 * x_m[2] * x_m[2];
            }
            /* whether any split beats the best so far: the scan's own test, branch-free over all of them, with
             * best_score as it stands. Where none does, the scan below changes nothing (best_score changes only
             * when a test passes) and is skipped; as the best grows, most rows are. */
            int pass[BS + 1], any = 0;
            for (int i2 = i1; i2 <= BS; ++i2) {
                pass[i2] = ((q2p[i2] > 0) & (qxp[i2] * qxp[i2] > best_score * q2p[i2])) |
                           ((q2m[i2] > 0) & (qxm[i2] * qxm[i2] > best_score * q2m[i2]));
                any |= pass[i2];
            }
            if (!any) continue;
            /* likewise the splits before the first that passes; from there on the scan runs as ggml's */
            int first = i1;
            while (!pass[first]) ++first;
            for (int i2 = first; i2 <= BS; ++i2) {
                float sqx = qxp[i2], sq2 = q2p[i2];
                if (sq2 > 0 && sqx * sqx > best_score * sq2) {
                    scale = sqx / sq2; best_score = scale * sqx; b1 = i1; b2 = i2; shift = 1;
                }
                sqx = qxm[i2]; sq2 = q2m[i2];
                if (sq2 > 0 && sqx * sqx > best_score * sq2) {
                    scale = sqx / sq2; best_score = scale * sqx; b1 = i1; b2 = i2; shift = -1;
                }
            }
        }
        if (b1 < 0 || b2 < 0 || shift == 0) { scales[ib] = 0; shifts[ib] = 1; continue; }
        for (int j = 0; j < BS; ++j) L[pairs[j].index] = (uint8_t)(j < b1 ? 0 : j < b2 ? 1 : 2);
        if (scale < 0) {
            for (int j = 0; j < BS; ++j) L[j] = (uint8_t)(2 - L[j]);
            scale = -scale; shift = -shift;
        }
        const float *xx = shift == 1 ? x_p : x_m;
        const float *levels[4] = {xx, xx, xx, xx};
        int on = iq1_groups(lat, 4, L, xb, weight, scale, levels, index);
        if (on < 0) return QC_NO_NEIGHBOUR;
        if (!on) {
            float sqx, sq2;
            iq1_refit_sums(lat, 4, index, xb, weight, levels, &sqx, &sq2);
            if (sqx > 0 && sq2 > 0) scale = sqx / sq2;
        }
        uint16_t h = 0;
        for (int k = 0; k < 4; ++k) {
            y[2 + 4 * ib + k] = (uint8_t)(index[k] & 255);
            h |= (uint16_t)((index[k] >> 8) << 3 * k);
        }
        qh[ib] = h;
        if (!(scale >= 0)) return QC_NAN_SCALE;
        scales[ib] = scale;
        shifts[ib] = shift;
        max_scale = max_scale > scale ? max_scale : scale;
    }
    if (max_scale) {
        float d = max_scale / 15;
        uint16_t dh = fp32_to_fp16(d * 1.125f);
        y[0] = (uint8_t)(dh & 255); y[1] = (uint8_t)(dh >> 8);
        float id = 1 / d;
        for (int ib = 0; ib < NB; ++ib) {
            int l = clampi(nearest_int(0.5f * (id * scales[ib] - 1)), 0, 7);
            if (shifts[ib] == -1) l |= 8;
            qh[ib] |= (uint16_t)(l << 12);
        }
    }
    memcpy(y + 34, qh, sizeof qh);
    return QC_OK;
}

/* One IQ1_M super-block (56 bytes: qs[32] index lows; qh[16], per 16-block the two groups' index highs in its
 * nibbles and their delta signs at bits 3 and 7; four uint16 of 3-bit block scales, fp16 d in their top nibbles),
 * zeroed by the caller. Without an importance matrix the weights are x*x (ggml allows it for IQ1_M). */
QC_CLONES static int quantize_iq1_m_super(const lattice_t *lat, const float *xbl, const float *qwbl, uint8_t *y) {
    static const float x_p[3] = {-1 + IQ1_DELTA, IQ1_DELTA, 1 + IQ1_DELTA};
    static const float x_m[3] = {-1 - IQ1_DELTA, -IQ1_DELTA, 1 - IQ1_DELTA};
    static const uint8_t masks[4] = {0x00, 0x80, 0x08, 0x88};
    enum { BS = 16, NB = 256 / 16 };
    float scales[NB], weight[256];
    int shifts[NB], index[2];
    uint8_t L[BS], qs[32], qh[NB];
    uint16_t sc[4] = {0, 0, 0, 0};
    iq1_pair_t pairs[BS];
    memset(qs, 0, sizeof qs);
    memset(qh, 0, sizeof qh);
    float max_scale = 0;
    float sumx2 = 0;
    for (int i = 0; i < 256; ++i) sumx2 += xbl[i] * xbl[i];
    float sigma2 = 2 * sumx2 / 256;
    /* the weights of every block: the search's, and the final refit's (ggml computes them twice, alike) */
    if (qwbl) for (int i = 0; i < 256; ++i) weight[i] = qwbl[i] * sqrtf(sigma2 + xbl[i] * xbl[i]);
    else for (int i = 0; i < 256; ++i) weight[i] = xbl[i] * xbl[i];
    const float p2 = x_p[2], m2 = x_m[2];
    const float cp1 = x_p[0] * x_p[0] - x_p[1] * x_p[1], cp2 = x_p[1] * x_p[1] - x_p[2] * x_p[2];
    const float cm1 = x_m[0] * x_m[0] - x_m[1] * x_m[1], cm2 = x_m[1] * x_m[1] - x_m[2] * x_m[2];
    for (int ib = 0; ib < NB; ++ib) {
        const float *xb = xbl + BS * ib, *wb = weight + BS * ib;
        float max = fabsf(xb[0]);
        for (int i = 1; i < BS; ++i) { float a = fabsf(xb[i]); max = max > a ? max : a; }
        if (max < IQ1M_EPS) { scales[ib] = 0; shifts[ib] = 0; continue; }
        iq1_sorted(xb, BS, pairs);
        /* prefix sums per half (each half has its own delta sign); a value of the other half repeats the sum */
        float px[2][BS + 1], pw[2][BS + 1];
        px[0][0] = px[1][0] = pw[0][0] = pw[1][0] = 0;
        for (int j = 0; j < BS; ++j) {
            const int i = pairs[j].index, h = i < BS / 2 ? 0 : 1;
            px[h][j + 1] = px[h][j] + wb[i] * xb[i];
            px[1 - h][j + 1] = px[1 - h][j];
            pw[h][j + 1] = pw[h][j] + wb[i];
            pw[1 - h][j + 1] = pw[1 - h][j];
        }
        const float txs[2] = {px[0][BS], px[1][BS]}, tws[2] = {pw[0][BS], pw[1][BS]};
        float best_score = -FLT_MAX, scale = max;
        int b1 = -1, b2 = -1, bk = -1;
        for (int i1 = 0; i1 <= BS; ++i1) {
            /* the sums of every split for this i1 in a branch-free loop the compiler vectorizes (the same float32
             * expressions per element), then the scan for the first strict best in ggml's order (i2, then k) */
            float sqx[4][BS + 1], sq2[4][BS + 1];
            for (int i2 = i1; i2 <= BS; ++i2) {
                float qx_p[2], qx_m[2], q2_p[2], q2_m[2];
                for (int h = 0; h < 2; ++h) {
                    const float sx = px[h][i1] + px[h][i2];
                    qx_p[h] = txs[h] * p2 - sx;
                    qx_m[h] = txs[h] * m2 - sx;
                    q2_p[h] = tws[h] * p2 * p2 + pw[h][i1] * cp1 + pw[h][i2] * cp2;
                    q2_m[h] = tws[h] * m2 * m2 + pw[h][i1] * cm1 + pw[h][i2] * cm2;
                }
                /* k: the deltas of (first half, second half): 0 (+,+), 1 (+,-), 2 (-,+), 3 (-,-) */
                sqx[0][i2] = qx_p[0] + qx_p[1]; sq2[0][i2] = q2_p[0] + q2_p[1];
                sqx[1][i2] = qx_p[0] + qx_m[1]; sq2[1][i2] = q2_p[0] + q2_m[1];
                sqx[2][i2] = qx_m[0] + qx_p[1]; sq2[2][i2] = q2_m[0] + q2_p[1];
                sqx[3][i2] = qx_m[0] + qx_m[1]; sq2[3][i2] = q2_m[0] + q2_m[1];
            }
            /* skipped where no split passes the scan's test at the best as it stands (see IQ1_S) */
            int pass[BS + 1], any = 0;
            for (int i2 = i1; i2 <= BS; ++i2) {
                pass[i2] = 0;
                for (int k = 0; k < 4; ++k)
                    pass[i2] |= (sq2[k][i2] > 0) & (sqx[k][i2] * sqx[k][i2] > best_score * sq2[k][i2]);
                any |= pass[i2];
            }
            if (!any) continue;
            int first = i1;
            while (!pass[first]) ++first;
            for (int i2 = first; i2 <= BS; ++i2) {
                for (int k = 0; k < 4; ++k) {
                    const float a = sqx[k][i2], b = sq2[k][i2];
                    if (b > 0 && a * a > best_score * b) {
                        scale = a / b; best_score = scale * a; b1 = i1; b2 = i2; bk = k;
                    }
                }
            }
        }
        if (b1 < 0 || b2 < 0 || bk < 0) { scales[ib] = 0; shifts[ib] = 0; continue; }
        for (int j = 0; j < BS; ++j) L[pairs[j].index] = (uint8_t)(j < b1 ? 0 : j < b2 ? 1 : 2);
        if (scale < 0) {
            for (int j = 0; j < BS; ++j) L[j] = (uint8_t)(2 - L[j]);
            scale = -scale;
            bk = 3 - bk;  /* both halves' deltas flip */
        }
        const float *levels[2] = {bk < 2 ? x_p : x_m, bk % 2 == 0 ? x_p : x_m};
        int on = iq1_groups(lat, 2, L, xb, wb, scale, levels, index);
        if (on < 0) return QC_NO_NEIGHBOUR;
        if (!on) {
            float sqxf, sq2f;
            iq1_refit_sums(lat, 2, index, xb, wb, levels, &sqxf, &sq2f);
            if (sqxf > 0 && sq2f > 0) scale = sqxf / sq2f;
        }
        qs[2 * ib] = (uint8_t)(index[0] & 255);
        qs[2 * ib + 1] = (uint8_t)(index[1] & 255);
        qh[ib] = (uint8_t)((index[0] >> 8) | ((index[1] >> 8) << 4));
        if (!(scale >= 0)) return QC_NAN_SCALE;
        scales[ib] = scale;
        shifts[ib] = bk;
        max_scale = max_scale > scale ? max_scale : scale;
    }
    if (max_scale) {
        float d = max_scale / 15;
        float id = 1 / d;
        float sqxf = 0, sq2f = 0;
        for (int ib = 0; ib < NB; ++ib) {
            int l = clampi(nearest_int(0.5f * (id * scales[ib] - 1)), 0, 7);
            sc[ib / 4] |= (uint16_t)(l << 3 * (ib % 4));
            qh[ib] |= masks[shifts[ib]];
            const float *xb = xbl + BS * ib, *wb = weight + BS * ib;
            for (int k = 0; k < 2; ++k) {
                const float *xx = k == 0 ? (shifts[ib] < 2 ? x_p : x_m) : (shifts[ib] % 2 == 0 ? x_p : x_m);
                const int gi = qs[2 * ib + k] + ((qh[ib] << (8 - 4 * k)) & 0x700);
                const uint8_t *lv = lat->codes + (int64_t)gi * 8;
                for (int j = 0; j < 8; ++j) {
                    float w = wb[8 * k + j];
                    float q = xx[lv[j]] * (2 * l + 1);
                    sqxf += w * q * xb[8 * k + j];
                    sq2f += w * q * q;
                }
            }
        }
        if (sq2f > 0) d = sqxf / sq2f;
        uint16_t s = fp32_to_fp16(d * 1.1125f);
        sc[0] |= (uint16_t)((s & 0x000f) << 12);
        sc[1] |= (uint16_t)((s & 0x00f0) << 8);
        sc[2] |= (uint16_t)((s & 0x0f00) << 4);
        sc[3] |= (uint16_t)(s & 0xf000);
    }
    memcpy(y, qs, sizeof qs);
    memcpy(y + 32, qh, sizeof qh);
    memcpy(y + 48, sc, sizeof sc);
    return QC_OK;
}

QC_CLONES static int quantize_iq3_s_super(const float *x, const float *qw, uint8_t *y) {
    return quantize_super(T_IQ3_S, x, qw, y);
}
QC_CLONES static int quantize_iq3_xxs_super(const float *x, const float *qw, uint8_t *y) {
    return quantize_super(T_IQ3_XXS, x, qw, y);
}
QC_CLONES static int quantize_iq2_s_super(const float *x, const float *qw, uint8_t *y) {
    return quantize_super(T_IQ2_S, x, qw, y);
}
QC_CLONES static int quantize_iq2_xs_super(const float *x, const float *qw, uint8_t *y) {
    return quantize_super(T_IQ2_XS, x, qw, y);
}
QC_CLONES static int quantize_iq2_xxs_super(const float *x, const float *qw, uint8_t *y) {
    return quantize_super(T_IQ2_XXS, x, qw, y);
}

/* rows [r0, r1) of x [rows, n] -> their bytes in y (row r at y + r * row_bytes); qw [n] or NULL. */
QC_CLONES int qc_iq_quantize(int type, const float *x, int64_t n, const float *qw, uint8_t *y, int64_t r0, int64_t r1) {
    if (type < 0 || type >= N_TYPES) return QC_BAD_TYPE;
    if (!LAT[type].kmap) return QC_NO_TABLES;
    if (type == T_IQ1_S && !qw) return QC_NO_WEIGHTS;  /* ggml: GGML_ASSERT(quant_weights) */
    const int nbytes = SPECS[type].nbytes;
    const int64_t nsup = n / 256, row_bytes = nsup * nbytes;
    for (int64_t r = r0; r < r1; ++r) {
        for (int64_t s = 0; s < nsup; ++s) {
            uint8_t *yb = y + r * row_bytes + s * nbytes;
            memset(yb, 0, nbytes);
            const float *xs = x + r * n + 256 * s, *qs = qw ? qw + 256 * s : NULL;
            int err = type == T_IQ1_S ? quantize_iq1_s_super(&LAT[type], xs, qs, yb)
                    : type == T_IQ1_M ? quantize_iq1_m_super(&LAT[type], xs, qs, yb)
                    : type == T_IQ3_S ? quantize_iq3_s_super(xs, qs, yb)
                    : type == T_IQ3_XXS ? quantize_iq3_xxs_super(xs, qs, yb)
                    : type == T_IQ2_S ? quantize_iq2_s_super(xs, qs, yb)
                    : type == T_IQ2_XS ? quantize_iq2_xs_super(xs, qs, yb)
                    : quantize_iq2_xxs_super(xs, qs, yb);
            if (err) return err;
        }
    }
    return QC_OK;
}

/* ---------------------------------------------------------------------------------------------------------------
 * The IQ1 decoders (dequantize_row_iq1_s / _iq1_m of ggml-quants.c): what the writer decodes its own bytes to, for
 * the report's error, and what the GGUF reader gives for an IQ1 tensor. gguf-py's numpy decoder (the fallback)
 * takes ~0.2 s per 10 M values; this is a table lookup per value. Each value is ggml's float32 expression,
 * dl * ((float)level + delta) with dl = d * (float)(2*scale + 1), so the values are ggml's bit for bit
 * (tests/kernels/test_iq1.py compares them with ggml's own dequantize_row_iq1_*). The grid's levels are the
 * lattice table handed over by qc_iq_set_lattice (codes 0..2 for the levels -1, 0, +1). */

static float half_to_float(uint16_t h) {  /* exact: every fp16 is a float32 */
    const uint32_t sign = (uint32_t)(h & 0x8000u) << 16, exp = (h >> 10) & 0x1fu, man = h & 0x3ffu;
    if (exp == 0x1f) return i2f_bits(sign | 0x7f800000u | (man << 13));           /* inf, NaN */
    if (exp != 0) return i2f_bits(sign | ((exp + 112u) << 23) | (man << 13));      /* normal */
    const float mag = (float)man * 0x1.0p-24f;                                      /* subnormal, exact */
    return sign ? -mag : mag;
}

/* nb super-blocks of y -> 256 float32 values each in x. Returns QC_NO_TABLES before the IQ1 lattice is set. */
int qc_iq1_dequantize(int type, const uint8_t *y, float *x, int64_t nb) {
    if (type != T_IQ1_S && type != T_IQ1_M) return QC_BAD_TYPE;
    const uint8_t *levels = LAT[T_IQ1_S].codes;  /* IQ1_M shares IQ1_S's grid and tables */
    if (!levels) return QC_NO_TABLES;
    for (int64_t i = 0; i < nb; ++i) {
        if (type == T_IQ1_S) {  /* 50 bytes: d, qs[32], qh[8] (uint16) */
            const uint8_t *b = y + i * 50, *qs = b + 2;
            const float d = half_to_float((uint16_t)(b[0] | (b[1] << 8)));
            for (int ib = 0; ib < 8; ++ib) {
                const unsigned qh = (unsigned)(b[34 + 2 * ib] | (b[35 + 2 * ib] << 8));
                const float dl = d * (float)(2 * ((qh >> 12) & 7) + 1);
                const float delta = (qh & 0x8000u) ? -IQ1_DELTA : IQ1_DELTA;
                for (int l = 0; l < 4; ++l) {
                    const uint8_t *g = levels + 8 * (int64_t)(qs[4 * ib + l] | (((qh >> (3 * l)) & 7) << 8));
                    for (int j = 0; j < 8; ++j) *x++ = dl * ((float)((int)g[j] - 1) + delta);
                }
            }
        } else {  /* 56 bytes: qs[32], qh[16], scales[8] (4 uint16; fp16 d in their top nibbles) */
            const uint8_t *b = y + i * 56, *qs = b, *qh = b + 32, *sb = b + 48;
            uint16_t sc[4];
            for (int k = 0; k < 4; ++k) sc[k] = (uint16_t)(sb[2 * k] | (sb[2 * k + 1] << 8));
            const uint16_t dh = (uint16_t)((sc[0] >> 12) | ((sc[1] >> 8) & 0x00f0) | ((sc[2] >> 4) & 0x0f00) |
                                           (sc[3] & 0xf000));
            const float d = half_to_float(dh);
            for (int ib = 0; ib < 8; ++ib) {
                const unsigned s = sc[ib / 2] >> (6 * (ib % 2));
                const float dl[2] = {d * (float)(2 * (s & 7) + 1), d * (float)(2 * ((s >> 3) & 7) + 1)};
                const uint8_t h[2] = {qh[2 * ib], qh[2 * ib + 1]};
                for (int l = 0; l < 4; ++l) {
                    const unsigned hb = h[l / 2] >> (4 * (l % 2));  /* this group's nibble: 3 index bits, sign */
                    const uint8_t *g = levels + 8 * (int64_t)(qs[4 * ib + l] | ((hb & 7) << 8));
                    const float delta = (hb & 8) ? -IQ1_DELTA : IQ1_DELTA;
                    for (int j = 0; j < 8; ++j) *x++ = dl[l / 2] * ((float)((int)g[j] - 1) + delta);
                }
            }
        }
    }
    return QC_OK;
}
