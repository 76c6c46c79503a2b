/* Decode attention over the paged KV cache on the CPU: each decoding request's one query per
 * head against its context, read where it lies in the cache blocks (no gathered copy), in
 * float32: scores q.k * scale, a softmax over the positions the request may see, and the
 * weighted sum of V. The maths of mmserve/kernels/paged_ref.py attend() for one query at the
 * last position; the sums run in another order and exp is a polynomial (cpu_vec.h), so the
 * results agree with it to float32 rounding, not bit for bit.
 */
#include "cpu_vec.h"

#include <stdlib.h>

static inline float dot(const float *a, const float *b, int64_t d) {
    vf acc = vsplat(0.0f);
    int64_t i = 0;
    for (; i + LANES <= d; i += LANES) acc += vload(a + i) * vload(b + i);
    float s = vsum(acc);
    for (; i < d; i++) s += a[i] * b[i];
    return s;
}

/* lane t: the sum of v[t]'s lanes, t < LANES (a transposing tree: LANES - 1 adds of vectors
 * where one sum each would take a tree of its own) */
static inline vf vsums(const vf *v) {
#if VECTORISED && LANES == 16
    __m512 x[8], y[4], z[2];
    for (int i = 0; i < 8; i++)
        x[i] = _mm512_add_ps(_mm512_unpacklo_ps((__m512)v[2 * i], (__m512)v[2 * i + 1]),
                             _mm512_unpackhi_ps((__m512)v[2 * i], (__m512)v[2 * i + 1]));
    for (int i = 0; i < 4; i++)
        y[i] = _mm512_add_ps(_mm512_shuffle_ps(x[2 * i], x[2 * i + 1], 0x44), _mm512_shuffle_ps(x[2 * i], x[2 * i + 1], 0xee));
    for (int i = 0; i < 2; i++)
        z[i] = _mm512_add_ps(_mm512_shuffle_f32x4(y[2 * i], y[2 * i + 1], 0x88),
                             _mm512_shuffle_f32x4(y[2 * i], y[2 * i + 1], 0xdd));
    return (vf)_mm512_add_ps(_mm512_shuffle_f32x4(z[0], z[1], 0x88), _mm512_shuffle_f32x4(z[0], z[1], 0xdd));
#elif VECTORISED
    __m256 a = _mm256_hadd_ps(_mm256_hadd_ps((__m256)v[0], (__m256)v[1]), _mm256_hadd_ps((__m256)v[2], (__m256)v[3]));
    __m256 b = _mm256_hadd_ps(_mm256_hadd_ps((__m256)v[4], (__m256)v[5]), _mm256_hadd_ps((__m256)v[6], (__m256)v[7]));
    return (vf)_mm256_add_ps(_mm256_permute2f128_ps(a, b, 0x20), _mm256_permute2f128_ps(a, b, 0x31));
#else
    vf out;
    for (int t = 0; t < LANES; t++) out[t] = vsum(v[t]);
    return out;
#endif
}

/* scores[h * stride + p - first] = q_h . k_p * scale for positions first .. n - 1, LANES
 * positions at a time: each head's LANES partial-sum vectors reduced by one vsums; D (a
 * multiple of LANES; 0: d, at run time) a constant where it can be, so that q_h stays in
 * registers. The next LANES positions' K rows are prefetched, and their V rows into L2 for
 * the weighted sum that follows (the cache's blocks lie anywhere: a new block is a jump the
 * hardware prefetchers do not foresee). */
#define SCORES(D)                                                                                             \
    static void scores_##D(const float *qi, const float *cache, const float *values, const int32_t *table,    \
                           int64_t block_size, int64_t row, int64_t heads, int64_t group, int64_t d,          \
                           int64_t first, int64_t n, float scale, float *scores, int64_t stride) {            \
        const int64_t dim = D ? D : d;                                                                        \
        vf parts[LANES];                                                                                      \
        const float *k[LANES];                                                                                \
        for (int64_t p0 = first; p0 < n; p0 += LANES) {                                                       \
            int count = n - p0 < LANES ? (int)(n - p0) : LANES;                                               \
            for (int t = 0; t < LANES; t++) { /* (past n: the last position again, not stored) */             \
                int64_t p = p0 + (t < count ? t : count - 1);                                                 \
                k[t] = cache + ((int64_t)table[p / block_size] * block_size + p % block_size) * row;          \
            }                                                                                                 \
            for (int64_t p = p0 + LANES; p < p0 + 2 * LANES && p < n; p++) {                                  \
                int64_t at = ((int64_t)table[p / block_size] * block_size + p % block_size) * row;            \
                for (int64_t b = 0; b < row; b += 64 / sizeof(float)) {                                       \
                    __builtin_prefetch(cache + at + b, 0, 3);                                                 \
                    __builtin_prefetch(values + at + b, 0, 2);                                                \
                }                                                                                             \
            }                                                                                                 \
            for (int64_t h = 0; h < heads; h++) {                                                             \
                const float *qh = qi + h * dim;                                                               \
                int64_t at = h / group * dim;                                                                 \
                for (int t = 0; t < LANES; t++) {                                                             \
                    vf acc = vload(qh) * vload(k[t] + at);                                                    \
                    for (int64_t c = LANES; c < dim; c += LANES) acc += vload(qh + c) * vload(k[t] + at + c); \
                    parts[t] = acc;                                                                           \
                }                                                                                             \
                vf sc = vsums(parts) * scale;                                                                 \
                float *out = scores + h * stride + p0 - first;                                                \
                if (count == LANES) {                                                                         \
                    vstore(out, sc);                                                                          \
                } else {                                                                                      \
                    for (int t = 0; t < count; t++) out[t] = sc[t];                                           \
                }                                                                                             \
            }                                                                                                 \
        }                                                                                                     \
    }
SCORES(0)
SCORES(64)
SCORES(128)

/* out_h += sum_p w_h[p] v_p for every head, D (a multiple of LANES) floats held in registers
 * a head at a time while the positions pass */
#define WEIGHTED_V(D)                                                                                         \
    static void weighted_v_##D(const float *values, const int32_t *table, int64_t block_size, int64_t row,    \
                               int64_t heads, int64_t group, int64_t first, int64_t n, const float *scores,   \
                               int64_t stride, float *oi) {                                                   \
        for (int64_t h = 0; h < heads; h++) {                                                                 \
            vf acc[D / LANES];                                                                                \
            for (int c = 0; c < D / LANES; c++) acc[c] = vsplat(0.0f);                                        \
            const float *w = scores + h * stride - first;                                                     \
            int64_t at = h / group * D;                                                                       \
            for (int64_t p = first; p < n; p++) {                                                             \
                const float *v = values + ((int64_t)table[p / block_size] * block_size + p % block_size) * row + at; \
                vf wp = vsplat(w[p]);                                                                         \
                for (int c = 0; c < D / LANES; c++) acc[c] += wp * vload(v + c * LANES);                      \
            }                                                                                                 \
            for (int c = 0; c < D / LANES; c++) vstore(oi + h * D + c * LANES, acc[c]);                       \
        }                                                                                                     \
    }
WEIGHTED_V(64)
WEIGHTED_V(128)

/* out[i, h, :] for i < reqs: q [reqs, heads, d]; cache [2, blocks, block_size, kv_heads, d]
 * (K then V); tables [reqs, max_blocks] block ids; seq_lens [reqs]: request i's query sits at
 * position seq_lens[i] - 1 and sees positions > seq_lens[i] - 1 - window (window <= 0: all).
 * Query heads h of kv head j: j * group .. (j + 1) * group - 1. A thread takes a request at a
 * time and reads each position's K and V for every head at once (one contiguous row).
 * Returns 0; -2 when a buffer could not be allocated; -3 for a context length out of its table
 * or a block id out of the cache (nothing read). */
int paged_decode_f32(int threads, const float *q, const float *cache, int64_t num_blocks,
                     int64_t block_size, int64_t kv_heads, int64_t d, const int32_t *tables,
                     int64_t max_blocks, const int64_t *seq_lens, int64_t reqs, int64_t heads,
                     float scale, int64_t window, float *out) {
    int64_t group = heads / kv_heads, longest = 0, row = kv_heads * d;
    for (int64_t i = 0; i < reqs; i++) {  /* every block a request reads is in the cache */
        if (seq_lens[i] < 1 || seq_lens[i] > max_blocks * block_size) return -3;
        for (int64_t b = 0; b < (seq_lens[i] + block_size - 1) / block_size; b++)
            if (tables[i * max_blocks + b] < 0 || tables[i * max_blocks + b] >= num_blocks) return -3;
        longest = seq_lens[i] > longest ? seq_lens[i] : longest;
    }
    const float *values = cache + num_blocks * block_size * row;
    int failed = 0;
#pragma omp parallel num_threads(threads)
    {
        /* per thread: scores [heads, longest + LANES] */
        int64_t stride = longest + LANES;
        float *scores = malloc(sizeof(float) * heads * stride);
        if (!scores) {
#pragma omp atomic write
            failed = 1;
        }
#pragma omp for schedule(dynamic)
        for (int64_t i = 0; i < reqs; i++) {
            if (!scores) continue;
            int64_t n = seq_lens[i], first = window > 0 && n > window ? n - window : 0;
            int64_t len = n - first;
            const int32_t *table = tables + i * max_blocks;
            const float *qi = q + i * heads * d;
            float *oi = out + i * heads * d;
            if (VECTORISED && d % LANES == 0) {
                (d == 64 ? scores_64 : d == 128 ? scores_128 : scores_0)(
                    qi, cache, values, table, block_size, row, heads, group, d, first, n, scale, scores, stride);
            } else {
                for (int64_t p = first; p < n; p++) {
                    const float *k = cache + ((int64_t)table[p / block_size] * block_size + p % block_size) * row;
                    for (int64_t h = 0; h < heads; h++)
                        scores[h * stride + p - first] = dot(qi + h * d, k + h / group * d, d) * scale;
                }
            }
            for (int64_t h = 0; h < heads; h++) {
                float *s = scores + h * stride, top = s[0], total = 0.0f;
                for (int64_t p = 1; p < len; p++) top = s[p] > top ? s[p] : top;
                for (int64_t p = len; p < len + LANES; p++) s[p] = top;  /* pad: e^0, dropped */
                for (int64_t p = 0; p < len; p += LANES) vstore(s + p, vexp(vload(s + p) - top));
                for (int64_t p = 0; p < len; p++) total += s[p];
                for (int64_t p = 0; p < len; p++) s[p] /= total;
                for (int64_t c = 0; c < d; c++) oi[h * d + c] = 0.0f;
            }
            if (d == 64 || d == 128) {
                (d == 64 ? weighted_v_64 : weighted_v_128)(values, table, block_size, row, heads, group, first, n,
                                                           scores, stride, oi);
                continue;
            }
            for (int64_t p = first; p < n; p++) {
                const float *v = values + ((int64_t)table[p / block_size] * block_size + p % block_size) * row;
                for (int64_t h = 0; h < heads; h++) {
                    float w = scores[h * stride + p - first], *acc = oi + h * d;
                    const float *vh = v + h / group * d;
                    for (int64_t c = 0; c < d; c++) acc[c] += w * vh[c];
                }
            }
        }
        free(scores);
    }
    return failed ? -2 : 0;
}
