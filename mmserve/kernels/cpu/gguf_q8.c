/* GGUF blocks against int8 activations on AVX-512 VNNI, every type mmserve keeps (Q4_0, Q4_1,
 * Q5_0, Q5_1, Q8_0, Q4_K, Q5_K, Q6_K): llama.cpp's arithmetic for these files (vec_dot_q4_0_q8_0
 * and its kin), and the one mmserve's CUDA products use for Q4_K / Q5_K / w4a16 (ggml's q8_1,
 * by 32).
 *
 * x is quantised by 32 along K as mmserve.kernels._common.q8_round_trip does (q = x 127 /
 * max |x|, rounded half away from zero; d_x = max |x| / 127), bit-equal to it: compiled with
 * -ffp-contract=off. Each block's integers meet x's in int32 (vpdpbusd: the weight's unsigned
 * bytes, q + offset, times x's signed ones, the offset taken back as offset * sum q_x), scaled
 * once by d_w d_x; a type with a min adds m_w times the rounded x's sum over the block, d_x sum
 * q_x (q8_1's s, as ggml's vec_dot_q4_1_q8_1): the rounded x times the whole weight d_w q + m.
 * Measured on SmolLM2's Q4_1 (BENCHMARKS.md, session 39), the min meeting x's own float sum
 * instead moved the next-token distribution 4x further from float32's (mean KL 0.012 against
 * 0.0029): d_w q alone is not centred, so x's rounding errors add up against it.
 *
 * The weights are repacked once (gguf_q8_pack) into panels of 16 output channels: per 32
 * elements of K, 8 vectors (4 for the 4-bit types, two nibbles a byte) whose lane c holds 4
 * consecutive integers of channel c, then the 16 d's, m's (the types with a min) and second d's
 * (Q6_K's scale of elements 16-31): the 32-element types' own float16 (so Q4_1's panels are its
 * blocks' bytes), a K-quant's float32. A K-quant's 32 elements are one sub-block: Q4_K packs as a
 * Q4_1 block would (d sc, -dmin m), Q5_K as Q5_1, Q6_K as bytes q less 32 with a d sc for each
 * 16 (its scales rounded as gguf_dequant.c rounds them). A step broadcasts 4 bytes
 * of a row of x into every lane, so each vpdpbusd is 64 multiply-adds for 16 channels with no
 * horizontal sums, and up to ROWS rows share each panel's unpacked block.
 */
#include "gguf_legacy.h"

#include <stdlib.h>

#if VECTORISED && LANES == 16 && defined(__AVX512VNNI__) && defined(__AVX512BW__)
#define Q8_BUILT 1
#else
#define Q8_BUILT 0
#endif

#define ROWS 16         /* rows of x a panel's unpacked block serves (16 float sums in registers) */
#define ROW_BLOCK 256   /* rows quantised x keeps in L2 while the panels pass */

/* A type's record of 32 elements of K for 16 channels: its integers (nibbles for the 4-bit
 * types, else bytes: q + offset), then its scales: d, m (the types with a min), d of elements
 * 16-31 (Q6_K: a scale for each 16). A 32-element type's d and m are the file's float16 (exact,
 * the blocks' own bytes); a K-quant's d sc and dmin m are float32 products, kept as such. */
static inline int four_bit(int qtype) { return qtype == GGUF_Q4_0 || qtype == GGUF_Q4_1 || qtype == GGUF_Q4_K; }
static inline int has_min(int qtype) {
    return qtype == GGUF_Q4_1 || qtype == GGUF_Q5_1 || qtype == GGUF_Q4_K || qtype == GGUF_Q5_K;
}
static inline int split(int qtype) { return qtype == GGUF_Q6_K; }
static inline int half_scales(int qtype) { return gguf_block_elements(qtype) == 32; }
static inline int offset_of(int qtype) {
    return qtype == GGUF_Q4_0 ? 8 : qtype == GGUF_Q5_0 ? 16 : qtype == GGUF_Q8_0 ? 128 : qtype == GGUF_Q6_K ? 32 : 0;
}
static inline int quant_bytes(int qtype) { return four_bit(qtype) ? 256 : 512; }
static inline int scale_bytes(int qtype) { return half_scales(qtype) ? 32 : 64; }
static inline int64_t record_bytes(int qtype) {
    return quant_bytes(qtype) + scale_bytes(qtype) * (1 + has_min(qtype) + split(qtype));
}

int gguf_q8_supported(int qtype) { return Q8_BUILT && gguf_block_elements(qtype) > 0; }

int64_t gguf_q8_packed_bytes(int qtype, int64_t n, int64_t k) {
    int elements = gguf_block_elements(qtype);
    if (!elements || k % elements || n < 0) return -1;
    return (n + 15) / 16 * (k / 32) * record_bytes(qtype);
}

/* Elements 32 s .. 32 s + 31 of one GGUF block at bp (a 32-element type's: s = 0): their
 * integers as unsigned bytes u (q + the type's offset); a K-quant's also the d of the first and
 * last 16 and the min (the weight is d (u - offset) + m). */
static void sub_block(int qtype, const uint8_t *bp, int s, uint8_t u[32], float *d_lo, float *d_hi, float *m) {
    *m = 0.0f;
    if (qtype == GGUF_Q6_K) {
        int half = s / 4, j = s % 4;
        const uint8_t *ql = bp + 64 * half, *qh = bp + 128 + 32 * half;
        const int8_t *sc = (const int8_t *)(bp + 192 + 8 * half);
        float d = f16(bp + 208);
        for (int l = 0; l < 32; l++) {
            int low = j % 2 ? ql[l + 32] : ql[l];
            u[l] = (uint8_t)((j < 2 ? low & 15 : low >> 4) | (((qh[l] >> (2 * j)) & 3) << 4));
        }
        *d_lo = d * (float)sc[2 * j];
        *d_hi = d * (float)sc[2 * j + 1];
        return;
    }
    if (qtype == GGUF_Q4_K || qtype == GGUF_Q5_K) {
        int five = qtype == GGUF_Q5_K, i = s / 2, hi = s % 2, sc, mn;
        const uint8_t *qh = bp + 16, *ql = bp + (five ? 48 : 16);
        scale_min_k4(s, bp + 4, &sc, &mn);
        for (int l = 0; l < 32; l++) {
            int q = hi ? ql[32 * i + l] >> 4 : ql[32 * i + l] & 15;
            u[l] = (uint8_t)(q | (five ? ((qh[l] >> s) & 1) << 4 : 0));
        }
        *d_lo = *d_hi = f16(bp) * (float)sc;
        *m = -(f16(bp + 2) * (float)mn);
        return;
    }
    /* (a 32-element type's d and m: pack_block copies the block's own float16 bytes) */
    if (qtype == GGUF_Q8_0) {
        for (int e = 0; e < 32; e++) u[e] = bp[2 + e] ^ 0x80;
        return;
    }
    int five = qtype == GGUF_Q5_0 || qtype == GGUF_Q5_1;
    uint32_t qh = five ? u32(bp + (qtype == GGUF_Q5_0 ? 2 : 4)) : 0;
    const uint8_t *nib = bp + (qtype == GGUF_Q4_0 ? 2 : qtype == GGUF_Q4_1 ? 4 : qtype == GGUF_Q5_0 ? 6 : 8);
    for (int i = 0; i < 16; i++) {
        u[i] = (uint8_t)((nib[i] & 15) | (((qh >> i) & 1) << 4));
        u[i + 16] = (uint8_t)((nib[i] >> 4) | (((qh >> (i + 16)) & 1) << 4));
    }
}

/* Sub-block s (32 elements of K) of channel c (bp: its GGUF block; NULL: a channel past n, all
 * zero) into rec, the panel's record of those 32 elements. */
static void pack_block(int qtype, const uint8_t *bp, int s, int c, uint8_t *rec) {
    const int qb = quant_bytes(qtype), sb = scale_bytes(qtype);
    float d_lo = 0.0f, d_hi = 0.0f, m = 0.0f;
    uint8_t u[32] = {0};
    if (bp) sub_block(qtype, bp, s, u, &d_lo, &d_hi, &m);
    if (four_bit(qtype)) {  /* vector j, lane c: elements 4j .. 4j + 3 low, 16 + 4j .. high */
        for (int j = 0; j < 4; j++)
            for (int t = 0; t < 4; t++) rec[64 * j + 4 * c + t] = (uint8_t)(u[4 * j + t] | (u[16 + 4 * j + t] << 4));
    } else {  /* vector g, lane c: elements 4g .. 4g + 3 */
        for (int g = 0; g < 8; g++)
            for (int t = 0; t < 4; t++) rec[64 * g + 4 * c + t] = u[4 * g + t];
    }
    if (half_scales(qtype)) {  /* the block's own float16 d (and m, after it) */
        static const uint8_t zero[4] = {0};
        const uint8_t *h = bp ? bp : zero;
        memcpy(rec + qb + 2 * c, h, 2);
        if (has_min(qtype)) memcpy(rec + qb + sb + 2 * c, h + 2, 2);
        return;
    }
    memcpy(rec + qb + 4 * c, &d_lo, 4);
    if (has_min(qtype) || split(qtype)) memcpy(rec + qb + sb + 4 * c, has_min(qtype) ? &m : &d_hi, 4);
}

/* w [n rows of k / elements blocks] -> out (gguf_q8_packed_bytes of it). Returns 0; -1 for an
 * unsupported type or a k that is not whole blocks. */
int gguf_q8_pack(int qtype, int threads, const uint8_t *w, int64_t n, int64_t k, uint8_t *out) {
    if (gguf_q8_packed_bytes(qtype, n, k) < 0) return -1;
    const int64_t elements = gguf_block_elements(qtype), bytes = gguf_block_bytes(qtype);
    const int64_t subs = k / 32, row_bytes = k / elements * bytes, rb = record_bytes(qtype);
    const int64_t panels = (n + 15) / 16;
#pragma omp parallel for num_threads(threads) schedule(static)
    for (int64_t p = 0; p < panels; p++)
        for (int64_t b = 0; b < subs; b++)
            for (int c = 0; c < 16; c++) {
                int64_t ch = 16 * p + c, first = b * 32;  /* the sub-block's first element */
                const uint8_t *bp = ch < n ? w + ch * row_bytes + first / elements * bytes : NULL;
                pack_block(qtype, bp, (int)(first % elements / 32), c, out + (p * subs + b) * rb);
            }
    return 0;
}

#if Q8_BUILT
/* One row of k floats -> its int8 integers xq, and per block of 32 its d_x, its corrections
 * -offset sum q over elements 0-15 and 16-31 (int32, corr[2 b], corr[2 b + 1]) and its rounded
 * values' sum d_x sum q (ggml's q8_1 s, which a min meets): q8_round_trip's rounding (a block
 * with a NaN gets a NaN d_x, as torch's amax keeps it). */
#include <immintrin.h>

static void quantise_row(const float *x, int64_t k, int offset, int8_t *xq, float *dx, int32_t *corr, float *sx) {
    const __m512 half = _mm512_set1_ps(0.5f), minus_half = _mm512_set1_ps(-0.5f);
    for (int64_t b = 0; b < k / 32; b++, x += 32, xq += 32) {
        __m512 v0 = _mm512_loadu_ps(x), v1 = _mm512_loadu_ps(x + 16);
        __m512 a = _mm512_max_ps(_mm512_abs_ps(v0), _mm512_abs_ps(v1));
        float amax = _mm512_reduce_max_ps(a);
        if (_mm512_cmp_ps_mask(v0, v1, _CMP_UNORD_Q)) amax = __builtin_nanf("");
        float inv = 127.0f / (amax > 0 ? amax : 1.0f);
        __m512 s = _mm512_set1_ps(inv);
        __m512 p0 = _mm512_mul_ps(v0, s), p1 = _mm512_mul_ps(v1, s);
        /* v >= 0 ? v + 0.5 : v - 0.5, then truncated: half away from zero */
        __m512i q0 = _mm512_cvttps_epi32(_mm512_add_ps(p0, _mm512_mask_blend_ps(_mm512_cmp_ps_mask(p0, _mm512_setzero_ps(), _CMP_GE_OQ), minus_half, half)));
        __m512i q1 = _mm512_cvttps_epi32(_mm512_add_ps(p1, _mm512_mask_blend_ps(_mm512_cmp_ps_mask(p1, _mm512_setzero_ps(), _CMP_GE_OQ), minus_half, half)));
        _mm_storeu_si128((__m128i *)xq, _mm512_cvtepi32_epi8(q0));
        _mm_storeu_si128((__m128i *)(xq + 16), _mm512_cvtepi32_epi8(q1));
        int32_t lo = _mm512_reduce_add_epi32(q0), hi = _mm512_reduce_add_epi32(q1);
        dx[b] = amax / 127.0f;
        corr[2 * b] = -offset * lo;
        corr[2 * b + 1] = -offset * hi;
        sx[b] = dx[b] * (float)(lo + hi);
    }
}

/* rows (1 .. ROWS, a constant in each instance) of quantised x against one panel, every
 * block of k; out's 16 columns from the panel's first (mask: those that exist) */
/* 16 scales at p: float16 (a 32-element type's) or float32 */
static inline __m512 scales16(const uint8_t *p, int half) {
    return half ? _mm512_cvtph_ps(_mm256_loadu_si256((const __m256i *)p)) : _mm512_loadu_ps(p);
}

static inline __attribute__((always_inline)) void panel_rows(
    int qtype, int rows, const uint8_t *rec, int64_t blocks, const int8_t *xq, int64_t k, const float *dx,
    const int32_t *corr, const float *sx, float *out, int64_t ldo, __mmask16 mask) {
    const int qb = quant_bytes(qtype), sb = scale_bytes(qtype), minv = has_min(qtype), two = split(qtype);
    const int half = half_scales(qtype);
    const int64_t rb = record_bytes(qtype);
    const __m512i nibble = _mm512_set1_epi8(15);
    __m512 acc[ROWS];
    for (int r = 0; r < rows; r++) acc[r] = _mm512_setzero_ps();
    for (int64_t b = 0; b < blocks; b++, rec += rb) {
        __m512i wv[8];
        if (four_bit(qtype)) {
            for (int j = 0; j < 4; j++) {
                __m512i v = _mm512_loadu_si512(rec + 64 * j);
                wv[j] = _mm512_and_si512(v, nibble);
                wv[j + 4] = _mm512_and_si512(_mm512_srli_epi16(v, 4), nibble);
            }
        } else {
            for (int g = 0; g < 8; g++) wv[g] = _mm512_loadu_si512(rec + 64 * g);
        }
        __m512 d = scales16(rec + qb, half);
        __m512 m = minv || two ? scales16(rec + qb + sb, half) : _mm512_setzero_ps();  /* two: d of 16-31 */
        for (int r = 0; r < rows; r++) {
            const int8_t *xb = xq + r * k + 32 * b;
            const int64_t i = r * (k / 32) + b;
            int32_t x4[8];
            memcpy(x4, xb, 32);
            /* elements 0-15 and 16-31 in two chains, each starting from its offset's correction */
            __m512i lo = _mm512_set1_epi32(corr[2 * i]), hi = _mm512_set1_epi32(corr[2 * i + 1]);
            for (int g = 0; g < 4; g++) {
                lo = _mm512_dpbusd_epi32(lo, wv[g], _mm512_set1_epi32(x4[g]));
                hi = _mm512_dpbusd_epi32(hi, wv[g + 4], _mm512_set1_epi32(x4[g + 4]));
            }
            const __m512 scale = _mm512_set1_ps(dx[i]);
            if (two) {
                acc[r] = _mm512_fmadd_ps(d, _mm512_mul_ps(_mm512_cvtepi32_ps(lo), scale), acc[r]);
                acc[r] = _mm512_fmadd_ps(m, _mm512_mul_ps(_mm512_cvtepi32_ps(hi), scale), acc[r]);
            } else {
                __m512 t = _mm512_mul_ps(_mm512_cvtepi32_ps(_mm512_add_epi32(lo, hi)), scale);
                acc[r] = _mm512_fmadd_ps(d, t, acc[r]);
                if (minv) acc[r] = _mm512_fmadd_ps(m, _mm512_set1_ps(sx[i]), acc[r]);
            }
        }
    }
    for (int r = 0; r < rows; r++) _mm512_mask_storeu_ps(out + r * ldo, mask, acc[r]);
}

/* m rows (any count) against one panel, ROWS at a time, each count its own unrolled loop */
#define PANEL_FOR(QT)                                                                               \
    static void panel_##QT(int64_t m, const uint8_t *rec, int64_t blocks, const int8_t *xq, int64_t k, \
                           const float *dx, const int32_t *corr, const float *sx, float *out, int64_t ldo, \
                           __mmask16 mask) {                                                            \
        for (int64_t r = 0; r < m; r += ROWS) {                                                         \
            int64_t at = r * (k / 32);                                                                  \
            switch (m - r < ROWS ? m - r : ROWS) {                                                      \
            CASES(QT)                                                                                   \
            }                                                                                           \
        }                                                                                               \
    }
#define CASE(QT, R) \
    case R: panel_rows(QT, R, rec, blocks, xq + r * k, k, dx + at, corr + 2 * at, sx + at, out + r * ldo, ldo, mask); break;
#define CASES(QT) CASE(QT, 1) CASE(QT, 2) CASE(QT, 3) CASE(QT, 4) CASE(QT, 5) CASE(QT, 6) CASE(QT, 7) \
    CASE(QT, 8) CASE(QT, 9) CASE(QT, 10) CASE(QT, 11) CASE(QT, 12) CASE(QT, 13) CASE(QT, 14)           \
    CASE(QT, 15) CASE(QT, 16)
PANEL_FOR(GGUF_Q4_0)
PANEL_FOR(GGUF_Q4_1)
PANEL_FOR(GGUF_Q5_0)
PANEL_FOR(GGUF_Q5_1)
PANEL_FOR(GGUF_Q8_0)
PANEL_FOR(GGUF_Q4_K)
PANEL_FOR(GGUF_Q5_K)
PANEL_FOR(GGUF_Q6_K)
#undef CASES
#undef CASE
#undef PANEL_FOR

typedef void (*panel_fn)(int64_t, const uint8_t *, int64_t, const int8_t *, int64_t, const float *,
                         const int32_t *, const float *, float *, int64_t, __mmask16);

static panel_fn panel_for(int qtype) {
    switch (qtype) {
    case GGUF_Q4_0: return panel_GGUF_Q4_0;
    case GGUF_Q4_1: return panel_GGUF_Q4_1;
    case GGUF_Q5_0: return panel_GGUF_Q5_0;
    case GGUF_Q5_1: return panel_GGUF_Q5_1;
    case GGUF_Q8_0: return panel_GGUF_Q8_0;
    case GGUF_Q4_K: return panel_GGUF_Q4_K;
    case GGUF_Q5_K: return panel_GGUF_Q5_K;
    case GGUF_Q6_K: return panel_GGUF_Q6_K;
    }
    return NULL;
}

/* Up to this many rows, a thread fetches its next panel ahead (the hardware prefetchers alone
 * left the stream short: SmolLM2's 30 layers out of cache, 2 Xeon cores, Q4_1 at 1 row 4.1
 * against 3.6 ms, at 4 rows 5.8 against 5.2; Q4_K 7.4 / 9.5 against 6.7 / 8.7; at 16 rows the
 * products hide the fetches: 11.7 against 12.0). A prefetch never faults, past the end included. */
#define FETCH_ROWS 4

/* out[m, n] (ldo apart) = x [m, k] (ldx apart) against the packed weight, on `threads`
 * OpenMP threads. Returns 0; -1 for an unsupported type or k; -2 when memory ran out. */
int gguf_q8_gemm(int qtype, int threads, const float *x, int64_t m, int64_t k, int64_t ldx,
                 const uint8_t *packed, int64_t n, float *out, int64_t ldo) {
    if (!gguf_q8_supported(qtype) || k <= 0 || gguf_q8_packed_bytes(qtype, n, k) < 0) return -1;
    const int64_t blocks = k / 32, panels = (n + 15) / 16, rb = record_bytes(qtype);
    const int offset = offset_of(qtype);
    const panel_fn fn = panel_for(qtype);
    int8_t *xq = aligned_alloc(64, (size_t)((m * k + 63) / 64 * 64));
    float *dx = malloc(sizeof(float) * m * blocks), *sx = malloc(sizeof(float) * m * blocks);
    int32_t *corr = malloc(sizeof(int32_t) * 2 * m * blocks);
    int status = 0;
    if (!xq || !dx || !sx || !corr) {
        status = -2;
        goto done;
    }
#pragma omp parallel num_threads(threads)
    {
#pragma omp for schedule(static)
        for (int64_t r = 0; r < m; r++)
            quantise_row(x + r * ldx, k, offset, xq + r * k, dx + r * blocks, corr + 2 * r * blocks, sx + r * blocks);
        for (int64_t r0 = 0; r0 < m; r0 += ROW_BLOCK) {
            int64_t rows = m - r0 < ROW_BLOCK ? m - r0 : ROW_BLOCK, at = r0 * blocks;
#pragma omp for schedule(static)
            for (int64_t p = 0; p < panels; p++) {
                int channels = n - 16 * p < 16 ? (int)(n - 16 * p) : 16;
                if (rows <= FETCH_ROWS)  /* the next panel, fetched while this one's products run */
                    prefetch_bytes(packed + (p + 1) * blocks * rb, blocks * rb);
                fn(rows, packed + p * blocks * rb, blocks, xq + r0 * k, k, dx + at, corr + 2 * at, sx + at,
                   out + r0 * ldo + 16 * p, ldo, (__mmask16)((1u << channels) - 1));
            }
        }
    }
done:
    free(xq);
    free(dx);
    free(sx);
    free(corr);
    return status;
}

/* The quantisation alone (tests: bit-equal to q8_round_trip): m rows of x -> xq [m, k],
 * dx [m, k / 32]. */
int gguf_q8_quantise(const float *x, int64_t m, int64_t k, int64_t ldx, int8_t *xq, float *dx) {
    if (k % 32 || k <= 0) return -1;
    int32_t *corr = malloc(sizeof(int32_t) * 2 * (k / 32));
    float *sx = malloc(sizeof(float) * (k / 32));
    int status = corr && sx ? 0 : -2;
    for (int64_t r = 0; r < m && !status; r++) quantise_row(x + r * ldx, k, 0, xq + r * k, dx + r * (k / 32), corr, sx);
    free(corr);
    free(sx);
    return status;
}

#else  /* no VNNI: no product (gguf_q8_supported says so) */

int gguf_q8_gemm(int qtype, int threads, const float *x, int64_t m, int64_t k, int64_t ldx,
                 const uint8_t *packed, int64_t n, float *out, int64_t ldo) {
    (void)qtype, (void)threads, (void)x, (void)m, (void)k, (void)ldx, (void)packed, (void)n, (void)out, (void)ldo;
    return -1;
}

int gguf_q8_quantise(const float *x, int64_t m, int64_t k, int64_t ldx, int8_t *xq, float *dx) {
    (void)x, (void)m, (void)k, (void)ldx, (void)xq, (void)dx;
    return -1;
}

#endif
