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

/* scores[h * stride + j] = q_h . k_j * scale for the context's positions j < len, LANES at a
 * time: each head's LANES partial-sum vectors reduced by one vsums; D (a multiple of LANES; 0:
 * d, at run time) a constant where it can be, so that q_h stays in registers. offs[j]: where
 * position j's row lies in the cache (context_rows). The next LANES positions' K rows are
 * prefetched, and their V rows into L2 for the weighted sum that follows (the cache's blocks
 * lie anywhere: a new block is a jump the hardware prefetchers do not foresee), a few positions
 * with each head's dot products: issued all at once before the heads (2 x 192 lines for
 * SmolLM2's rows), the prefetches stalled the loop (Zen 4, 16 requests of 1,000 positions, two
 * threads: 1.51-1.65 ms a call in a burst, 1.31-1.43 spread). */
#define SCORES(D)                                                                                             \
    static void scores_##D(const float *qi, const float *cache, const float *values, const int64_t *offs,     \
                           int64_t row, int64_t heads, int64_t group, int64_t d, int64_t len, float scale,    \
                           float *scores, int64_t stride) {                                                   \
        const int64_t dim = D ? D : d;                                                                        \
        vf parts[LANES];                                                                                      \
        const float *k[LANES];                                                                                \
        for (int64_t j0 = 0; j0 < len; j0 += LANES) {                                                         \
            int count = len - j0 < LANES ? (int)(len - j0) : LANES;                                           \
            for (int t = 0; t < LANES; t++) /* (past len: the last position again, not stored) */             \
                k[t] = cache + offs[j0 + (t < count ? t : count - 1)];                                        \
            for (int64_t h = 0; h < heads; h++) {                                                             \
                for (int64_t j = j0 + LANES + h; j < j0 + 2 * LANES && j < len; j += heads)                   \
                    for (int64_t b = 0; b < row; b += 64 / sizeof(float)) {                                   \
                        __builtin_prefetch(cache + offs[j] + b, 0, 3);                                        \
                        __builtin_prefetch(values + offs[j] + b, 0, 2);                                       \
                    }                                                                                         \
                const float *qh = qi + h * dim;                                                               \
                int64_t at = h / group * dim;                                                                 \
                for (int t = 0; t < LANES; t++) parts[t] = vsplat(0.0f);                                      \
                for (int64_t c = 0; c < dim; c += LANES) { /* (LANES independent sums in flight) */          \
                    vf qc = vload(qh + c);                                                                    \
                    for (int t = 0; t < LANES; t++) parts[t] += qc * vload(k[t] + at + c);                    \
                }                                                                                             \
                vf sc = vsums(parts) * scale;                                                                 \
                float *out = scores + h * stride + j0;                                                        \
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

/* out_h += sum_j w_h[j] v_j for every head, D (a multiple of LANES) floats held in registers
 * a head at a time while the positions pass (offs as in SCORES). Positions go in chunks of
 * 16 KB of a head's V, every head over a chunk before the next, so that a chunk's V rows are
 * read from the caches by the other heads of their group (SmolLM2: 9 heads, 3 KV), where each
 * head had passed over the whole context in turn. */
#define WEIGHTED_V(D)                                                                                         \
    static void weighted_v_##D(const float *values, const int64_t *offs, int64_t heads, int64_t group,       \
                               int64_t len, const float *scores, int64_t stride, float *oi) {                 \
        const int64_t chunk = 16384 / (D * sizeof(float));                                                    \
        for (int64_t j0 = 0; j0 < len; j0 += chunk) {                                                         \
            int64_t end = j0 + chunk < len ? j0 + chunk : len;                                                \
            for (int64_t h = 0; h < heads; h++) {                                                             \
                vf acc[D / LANES];                                                                            \
                for (int c = 0; c < D / LANES; c++) acc[c] = vload(oi + h * D + c * LANES);                   \
                const float *w = scores + h * stride;                                                         \
                const float *vh = values + h / group * D;                                                     \
                for (int64_t j = j0; j < end; j++) {                                                          \
                    vf wj = vsplat(w[j]);                                                                     \
                    for (int c = 0; c < D / LANES; c++) acc[c] += wj * vload(vh + offs[j] + c * LANES);       \
                }                                                                                             \
                for (int c = 0; c < D / LANES; c++) vstore(oi + h * D + c * LANES, acc[c]);                   \
            }                                                                                                 \
        }                                                                                                     \
    }
WEIGHTED_V(64)
WEIGHTED_V(128)

/* s[0 .. len) <- their softmax, in vectors (s has LANES floats past len to pad with), where
 * scalar loops had run the max, the sum and one division a position */
static void softmax(float *s, int64_t len) {
    for (int64_t p = len; p < len + LANES; p++) s[p] = s[0];  /* pad: no new maximum */
    vf top = vload(s);
    for (int64_t p = LANES; p < len; p += LANES) {
        vf x = vload(s + p);
        top = (vf)(((vi)top & (vi)(top >= x)) | ((vi)x & (vi)(top < x)));
    }
    float m = top[0];
    for (int t = 1; t < LANES; t++) m = top[t] > m ? top[t] : m;
    vf total = vsplat(0.0f);
    for (int64_t p = 0; p < len; p += LANES) {
        vf e = vexp(vload(s + p) - m);
        if (p + LANES > len)  /* the pad's lanes count nothing */
            e = (vf)((vi)e & (vi)(vindex((int)p) < (vi){0} + (int)len));
        vstore(s + p, e);
        total += e;
    }
    vf sum = vsplat(vsum(total));
    for (int64_t p = 0; p < len; p += LANES) vstore(s + p, vload(s + p) / sum);
}

/* offs[j] = where position first + j's row (K in the cache, V in values) starts, j < len:
 * block by block, once a request (the loops below had divided by block_size, known only at
 * run time, for each position, and the weighted sum for each head as well) */
static void context_rows(const int32_t *table, int64_t block_size, int64_t row, int64_t first, int64_t len,
                         int64_t *offs) {
    int64_t p = first, j = 0;
    while (j < len) {
        int64_t b = p / block_size, in = p - b * block_size;
        int64_t base = ((int64_t)table[b] * block_size + in) * row;
        for (; in < block_size && j < len; in++, j++, base += row) offs[j] = base;
        p = (b + 1) * block_size;
    }
}

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
        /* per thread: scores [heads, longest + LANES], and the positions' rows */
        int64_t stride = longest + LANES;
        float *scores = malloc(sizeof(float) * heads * stride);
        int64_t *offs = malloc(sizeof(int64_t) * stride);
        if (!scores || !offs) {
#pragma omp atomic write
            failed = 1;
        }
#pragma omp for schedule(dynamic)
        for (int64_t i = 0; i < reqs; i++) {
            if (!scores || !offs) continue;
            int64_t n = seq_lens[i], first = window > 0 && n > window ? n - window : 0;
            int64_t len = n - first;
            const float *qi = q + i * heads * d;
            float *oi = out + i * heads * d;
            context_rows(tables + i * max_blocks, block_size, row, first, len, offs);
            if (VECTORISED && d % LANES == 0) {
                (d == 64 ? scores_64 : d == 128 ? scores_128 : scores_0)(
                    qi, cache, values, offs, row, heads, group, d, len, scale, scores, stride);
            } else {
                for (int64_t j = 0; j < len; j++)
                    for (int64_t h = 0; h < heads; h++)
                        scores[h * stride + j] = dot(qi + h * d, cache + offs[j] + h / group * d, d) * scale;
            }
            for (int64_t h = 0; h < heads; h++) softmax(scores + h * stride, len);
            for (int64_t c = 0; c < heads * d; c++) oi[c] = 0.0f;
            if (d == 64 || d == 128) {
                (d == 64 ? weighted_v_64 : weighted_v_128)(values, offs, heads, group, len, scores, stride, oi);
                continue;
            }
            for (int64_t j = 0; j < len; j++) {
                const float *v = values + offs[j];
                for (int64_t h = 0; h < heads; h++) {
                    float w = scores[h * stride + j], *acc = oi + h * d;
                    const float *vh = v + h / group * d;
                    for (int64_t c = 0; c < d; c++) acc[c] += w * vh[c];
                }
            }
        }
        free(scores);
        free(offs);
    }
    return failed ? -2 : 0;
}
