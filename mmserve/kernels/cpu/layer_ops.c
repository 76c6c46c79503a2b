/* A decoder layer's small float32 operations on the CPU, each one call instead of the several
 * torch operations (and their dispatch, a few microseconds each) that a decode step of a
 * small model spends most of its time between products on: the residual add with RMSNorm,
 * rotary embedding, the KV cache write, and SiLU-and-mul; and a grammar's bitmask on the logits.
 *
 * Compiled with -ffp-contract=off, so each product and sum rounds as torch's separate
 * operations do (mmserve.models.layers): rotary and the cache write are bit-equal to the torch
 * path, RMSNorm differs only in the order of its sum of squares, SiLU in its exp (a polynomial,
 * cpu_vec.h's vexp).
 */
#include "cpu_vec.h"

#include <math.h>

/* the parallel regions' threshold: below it (a decode step's rows) one thread, no fork */
#define PARALLEL_ELEMENTS (1 << 16)
/* silu's exp costs more an element: two threads pay from a decode step's 16 x 1536 on */
#define SILU_PARALLEL_ELEMENTS (1 << 13)

/* sum[r] = x[r] + residual[r] (when residual is given; else s = x), out[r] = weight *
 * (s * (1 / sqrt(mean(s^2) + eps))), rows of dim floats, x's and residual's rows ldx / ldr
 * apart, out's and sum's dim. */
int rms_norm_f32(int threads, const float *x, int64_t ldx, const float *residual, int64_t ldr,
                 const float *weight, int64_t rows, int64_t dim, float eps, float *out, float *sum) {
#pragma omp parallel for num_threads(threads) schedule(static) if (rows * dim >= PARALLEL_ELEMENTS)
    for (int64_t r = 0; r < rows; r++) {
        const float *s = x + r * ldx;
        if (residual) {
            float *t = sum + r * dim;
            const float *res = residual + r * ldr;
            for (int64_t i = 0; i < dim; i++) t[i] = s[i] + res[i];
            s = t;
        }
        vf acc = vsplat(0.0f);
        int64_t i = 0;
        for (; i + LANES <= dim; i += LANES) {
            vf v = vload(s + i);
            acc += v * v;
        }
        float squares = vsum(acc);
        for (; i < dim; i++) squares += s[i] * s[i];
        float scale = 1.0f / sqrtf(squares / (float)dim + eps);
        float *o = out + r * dim;
        for (i = 0; i < dim; i++) o[i] = weight[i] * (s[i] * scale);
    }
    return 0;
}

/* Rotary embedding, neox style: each head's halves x1, x2 (d / 2 each) become x1 cos - x2 sin
 * and x2 cos + x1 sin. x [tokens, heads, d], its rows ldx apart (heads d apart); cos, sin
 * [tokens, d / 2]; out [tokens, heads, d] contiguous. */
int rotary_f32(int threads, const float *x, int64_t ldx, int64_t tokens, int64_t heads, int64_t d,
               const float *cos, const float *sin, float *out) {
    int64_t half = d / 2;
#pragma omp parallel for num_threads(threads) schedule(static) if (tokens * heads * d >= PARALLEL_ELEMENTS)
    for (int64_t t = 0; t < tokens; t++) {
        const float *c = cos + t * half, *s = sin + t * half;
        for (int64_t h = 0; h < heads; h++) {
            const float *x1 = x + t * ldx + h * d, *x2 = x1 + half;
            float *o1 = out + (t * heads + h) * d, *o2 = o1 + half;
            for (int64_t i = 0; i < half; i++) {
                o1[i] = x1[i] * c[i] - x2[i] * s[i];
                o2[i] = x2[i] * c[i] + x1[i] * s[i];
            }
        }
    }
    return 0;
}

/* Each token's K and V rows (width floats, ldk / ldv apart) into cache [2, num_slots, width]
 * at its slot; a negative slot is skipped. Returns 0; -3 for a slot past the cache (nothing
 * written). */
int write_kv_f32(const float *k, int64_t ldk, const float *v, int64_t ldv, int64_t tokens,
                 int64_t width, const int64_t *slots, int64_t num_slots, float *cache) {
    for (int64_t t = 0; t < tokens; t++)
        if (slots[t] >= num_slots) return -3;
    float *values = cache + num_slots * width;
    for (int64_t t = 0; t < tokens; t++) {
        if (slots[t] < 0) continue;
        memcpy(cache + slots[t] * width, k + t * ldk, sizeof(float) * width);
        memcpy(values + slots[t] * width, v + t * ldv, sizeof(float) * width);
    }
    return 0;
}

/* out[r, i] = silu(g) u = g / (1 + e^-g) u for gate_up's row r = [g (width), u (width)], rows
 * ldg apart: as g / (1 + t) for g >= 0 and g t / (1 + t) below, t = e^-|g| (vexp's range).
 * exp is a polynomial (cpu_vec.h) where torch's silu uses its own: within a few float32 ulp
 * of torch's silu and product, not bit-equal. */
static inline vf silu_mul(vf x, vf u) {
    vi negative = x < 0.0f;
    vf t = vexp((vf)((vi)x | INT32_MIN));  /* e^-|x|: x with its sign bit set */
    vf num = (vf)(((vi)(x * t) & negative) | ((vi)x & ~negative));
    return num / (1.0f + t) * u;
}

int silu_and_mul_f32(int threads, const float *gate_up, int64_t ldg, int64_t rows, int64_t width, float *out) {
#pragma omp parallel for num_threads(threads) schedule(static) if (rows * width >= SILU_PARALLEL_ELEMENTS)
    for (int64_t r = 0; r < rows; r++) {
        const float *g = gate_up + r * ldg, *u = g + width;
        float *o = out + r * width;
        int64_t i = 0;
        for (; i + LANES <= width; i += LANES) vstore(o + i, silu_mul(vload(g + i), vload(u + i)));
        if (i < width) {  /* the last elements through the same vector code, so that an element's
                           * value does not depend on where it falls (a tensor-parallel shard) */
            float x[LANES] = {0}, y[LANES] = {0}, z[LANES];
            memcpy(x, g + i, sizeof(float) * (width - i));
            memcpy(y, u + i, sizeof(float) * (width - i));
            vstore(z, silu_mul(vload(x), vload(y)));
            memcpy(o + i, z, sizeof(float) * (width - i));
        }
    }
    return 0;
}

/* A grammar's masks: logits[rows[i]] (float32 rows ld apart) set to -inf at each token t <
 * vocab whose bit t % 32 of word t / 32 in bitmask[rows[i]] (int32 rows ldw apart) is clear.
 * Words of all ones are skipped; AVX-512 stores a word's clear bits as two masked stores. */
int apply_bitmask_f32(int threads, float *logits, int64_t ld, const int32_t *bitmask, int64_t ldw,
                      const int64_t *rows, int64_t n, int64_t vocab) {
    const int64_t words = (vocab + 31) / 32;
#pragma omp parallel for num_threads(threads) schedule(static) if (n * vocab >= PARALLEL_ELEMENTS)
    for (int64_t i = 0; i < n; i++) {
        float *row = logits + rows[i] * ld;
        const int32_t *bits = bitmask + rows[i] * ldw;
        for (int64_t w = 0; w < words; w++) {
            uint32_t clear = ~(uint32_t)bits[w];
            if (w == words - 1 && vocab % 32) clear &= (1u << (vocab % 32)) - 1;  /* past vocab: kept */
            if (!clear) continue;
            float *at = row + 32 * w;
#if VECTORISED && LANES == 16
            const __m512 ninf = _mm512_set1_ps(-INFINITY);
            _mm512_mask_storeu_ps(at, (__mmask16)(clear & 0xFFFF), ninf);
            _mm512_mask_storeu_ps(at + 16, (__mmask16)(clear >> 16), ninf);
#else
            for (; clear; clear &= clear - 1) at[__builtin_ctz(clear)] = -INFINITY;
#endif
        }
    }
    return 0;
}
