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
            for (int64_t p = first; p < n; p++) {
                const float *k = cache + ((int64_t)table[p / block_size] * block_size + p % block_size) * row;
                for (int64_t h = 0; h < heads; h++)
                    scores[h * stride + p - first] = dot(qi + h * d, k + h / group * d, d) * scale;
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
