/* GGUF blocks -> float32, as ggml (and the gguf package's reference) computes them.
 *
 * Compiled with -ffp-contract=off: d * q + m is two roundings, as in the reference, so every
 * weight comes out bit-equal to the dequantised-at-load path. The block layouts are ggml's
 * block_q4_0 ... block_q6_K structs, little-endian (mmserve/kernels/gguf_blocks.py lists them).
 */
#include "gguf_cpu.h"

#include <string.h>

#if defined(__SSE2__)
#include <immintrin.h>
#endif

#if defined(__F16C__)
static inline float f16(const uint8_t *p) {
    uint16_t h;
    memcpy(&h, p, 2);
    return _cvtsh_ss(h);
}
#else
static inline float f16(const uint8_t *p) {
    uint16_t h = (uint16_t)(p[0] | (p[1] << 8));
    uint32_t sign = (uint32_t)(h & 0x8000) << 16, exp = (h >> 10) & 0x1f, man = h & 0x3ff, bits;
    if (exp == 0x1f) {
        bits = sign | 0x7f800000u | (man << 13);  /* inf, nan */
    } else if (exp) {
        bits = sign | ((exp + 112) << 23) | (man << 13);
    } else if (man) {  /* subnormal: normalise */
        int shift = 0;
        while (!(man & 0x400)) { man <<= 1; shift++; }
        bits = sign | ((uint32_t)(113 - shift) << 23) | ((man & 0x3ff) << 13);
    } else {
        bits = sign;
    }
    float f;
    memcpy(&f, &bits, 4);
    return f;
}
#endif

static inline uint32_t u32(const uint8_t *p) {
    return (uint32_t)p[0] | ((uint32_t)p[1] << 8) | ((uint32_t)p[2] << 16) | ((uint32_t)p[3] << 24);
}

/* 32-element blocks. Q4_0: d, 16 bytes of nibbles, (q - 8) d. Q4_1: d, m, q d + m. Q5_0 / Q5_1:
 * the same with a fifth bit per element in 4 bytes qh. Q8_0: d, 32 int8. Written on 16-lane
 * vectors (GCC / Clang vector extensions) so that every compiler vectorises them whole. */
typedef uint8_t u8x16 __attribute__((vector_size(16)));
typedef int32_t i32x16 __attribute__((vector_size(64)));
typedef float f32x16 __attribute__((vector_size(64)));

static inline u8x16 bytes16(const uint8_t *p) {
#if defined(__SSE2__)  /* a vector load: from a memcpy GCC 12 may assemble the bytes one by one */
    return (u8x16)_mm_loadu_si128((const __m128i *)p);
#else
    u8x16 v;
    memcpy(&v, p, 16);
    return v;
#endif
}

static inline void store16(float *y, f32x16 v) { memcpy(y, &v, sizeof v); }

/* 16 bytes widened to int32 lanes: by the instructions themselves where the compiler targets
 * them; GCC 12 lowers a generic uint8 -> int32 / float conversion byte by byte (a 6x slower
 * dequantisation, measured), which the generic path below is left to only elsewhere */
static inline i32x16 widen(u8x16 v, int is_signed) {
#if defined(__AVX512F__)
    __m512i w = is_signed ? _mm512_cvtepi8_epi32((__m128i)v) : _mm512_cvtepu8_epi32((__m128i)v);
    return (i32x16)w;
#elif defined(__AVX2__)
    __m128i x = (__m128i)v, h = _mm_srli_si128(x, 8);
    __m256i lo = is_signed ? _mm256_cvtepi8_epi32(x) : _mm256_cvtepu8_epi32(x);
    __m256i hi = is_signed ? _mm256_cvtepi8_epi32(h) : _mm256_cvtepu8_epi32(h);
    i32x16 r;
    memcpy(&r, &lo, 32);
    memcpy((char *)&r + 32, &hi, 32);
    return r;
#else
    i32x16 r = __builtin_convertvector(v, i32x16);
    return is_signed ? (r ^ 128) - 128 : r;
#endif
}

static inline i32x16 ints(u8x16 v) { return widen(v, 0); }
static inline f32x16 floats(i32x16 v) { return __builtin_convertvector(v, f32x16); }

/* the fifth bits of elements j and j + 16, j = 0..15, as 16s: bit j and bit j + 16 of qh */
static inline i32x16 fifth_bits(uint32_t qh, int high) {
    const i32x16 j = {0, 1, 2, 3, 4, 5, 6, 7, 8, 9, 10, 11, 12, 13, 14, 15};
    i32x16 bits = (i32x16){0} + (int32_t)(high ? qh >> 16 : qh);
    return ((bits >> j) & 1) << 4;
}

static inline void q4_0(const uint8_t *restrict b, float *restrict y) {
    f32x16 d = (f32x16){0} + f16(b);
    u8x16 q = bytes16(b + 2);
    store16(y, floats(ints(q & 0x0f) - 8) * d);
    store16(y + 16, floats(ints(q >> 4) - 8) * d);
}

static inline void q4_1(const uint8_t *restrict b, float *restrict y) {
    f32x16 d = (f32x16){0} + f16(b), m = (f32x16){0} + f16(b + 2);
    u8x16 q = bytes16(b + 4);
    store16(y, floats(ints(q & 0x0f)) * d + m);
    store16(y + 16, floats(ints(q >> 4)) * d + m);
}

static inline void q5_0(const uint8_t *restrict b, float *restrict y) {
    f32x16 d = (f32x16){0} + f16(b);
    uint32_t qh = u32(b + 2);
    u8x16 q = bytes16(b + 6);
    i32x16 lo = ints(q & 0x0f) | fifth_bits(qh, 0), hi = ints(q >> 4) | fifth_bits(qh, 1);
    store16(y, floats(lo - 16) * d);
    store16(y + 16, floats(hi - 16) * d);
}

static inline void q5_1(const uint8_t *restrict b, float *restrict y) {
    f32x16 d = (f32x16){0} + f16(b), m = (f32x16){0} + f16(b + 2);
    uint32_t qh = u32(b + 4);
    u8x16 q = bytes16(b + 8);
    i32x16 lo = ints(q & 0x0f) | fifth_bits(qh, 0), hi = ints(q >> 4) | fifth_bits(qh, 1);
    store16(y, floats(lo) * d + m);
    store16(y + 16, floats(hi) * d + m);
}

static inline void q8_0(const uint8_t *restrict b, float *restrict y) {
    f32x16 d = (f32x16){0} + f16(b);
    store16(y, floats(widen(bytes16(b + 2), 1)) * d);
    store16(y + 16, floats(widen(bytes16(b + 18), 1)) * d);
}

/* The 6-bit scale and min of sub-block j of a Q4_K / Q5_K super-block (12 bytes at q). */
static void scale_min_k4(int j, const uint8_t *q, int *sc, int *m) {
    if (j < 4) {
        *sc = q[j] & 63;
        *m = q[j + 4] & 63;
    } else {
        *sc = (q[j + 4] & 0x0f) | ((q[j - 4] >> 6) << 4);
        *m = (q[j + 4] >> 4) | ((q[j] >> 6) << 4);
    }
}

/* 256-element super-blocks. Q4_K: d, dmin, 12 bytes of scales, 128 of nibbles; Q5_K: with 32
 * bytes of fifth bits before the nibbles. Sub-block j of 32: q (d sc_j) - (dmin m_j). */
static inline void q45_k(const uint8_t *restrict b, float *restrict y, int five) {
    float d = f16(b), dmin = f16(b + 2);
    const uint8_t *scales = b + 4, *qh = b + 16, *ql = b + (five ? 48 : 16);
    for (int j = 0; j < 4; j++) {
        int sc, m;
        scale_min_k4(2 * j, scales, &sc, &m);
        float d1 = d * (float)sc, m1 = dmin * (float)m;
        scale_min_k4(2 * j + 1, scales, &sc, &m);
        float d2 = d * (float)sc, m2 = dmin * (float)m;
        for (int l = 0; l < 32; l++) {
            int h1 = five ? ((qh[l] >> (2 * j)) & 1) << 4 : 0;
            int h2 = five ? ((qh[l] >> (2 * j + 1)) & 1) << 4 : 0;
            y[64 * j + l] = d1 * (float)((ql[32 * j + l] & 0x0f) + h1) - m1;
            y[64 * j + 32 + l] = d2 * (float)((ql[32 * j + l] >> 4) + h2) - m2;
        }
    }
}

/* Q6_K: 128 bytes of low nibbles, 64 of high bit pairs, 16 int8 scales, d last; sub-blocks of
 * 16: (q - 32) (d sc), (d sc) rounded first as ggml computes it. Each half of 128 elements
 * takes 64 low-nibble bytes and 32 high-bit bytes; element l + 32 j (l < 32) has the low
 * nibble (j odd: of byte l + 32) and bit pair j of high byte l. */
static inline void q6_k(const uint8_t *restrict b, float *restrict y) {
    float d = f16(b + 208);
    for (int half = 0; half < 2; half++) {
        const uint8_t *ql = b + 64 * half, *qh = b + 128 + 32 * half;
        const int8_t *sc = (const int8_t *)(b + 192 + 8 * half);
        for (int l = 0; l < 32; l += 16) {
            u8x16 lo_a = bytes16(ql + l), lo_b = bytes16(ql + 32 + l), hi = bytes16(qh + l);
            u8x16 q[4] = {(lo_a & 0x0f) | ((hi & 3) << 4), (lo_b & 0x0f) | (((hi >> 2) & 3) << 4),
                          (lo_a >> 4) | (((hi >> 4) & 3) << 4), (lo_b >> 4) | (((hi >> 6) & 3) << 4)};
            for (int j = 0; j < 4; j++) {
                float ds = d * (float)sc[l / 16 + 2 * j];
                store16(y + 128 * half + 32 * j + l, floats(ints(q[j]) - 32) * ds);
            }
        }
    }
}

int gguf_cpu_vectorised(void) {
#if defined(__AVX512F__) && defined(__F16C__)
    return 1;
#else
    return 0;
#endif
}

int gguf_block_elements(int qtype) {
    switch (qtype) {
    case GGUF_Q4_0: case GGUF_Q4_1: case GGUF_Q5_0: case GGUF_Q5_1: case GGUF_Q8_0: return 32;
    case GGUF_Q4_K: case GGUF_Q5_K: case GGUF_Q6_K: return 256;
    default: return 0;
    }
}

int gguf_block_bytes(int qtype) {
    switch (qtype) {
    case GGUF_Q4_0: return 18;
    case GGUF_Q4_1: return 20;
    case GGUF_Q5_0: return 22;
    case GGUF_Q5_1: return 24;
    case GGUF_Q8_0: return 34;
    case GGUF_Q4_K: return 144;
    case GGUF_Q5_K: return 176;
    case GGUF_Q6_K: return 210;
    default: return 0;
    }
}

/* one loop per type, so that each block's function is inlined and vectorised */
#define EACH_BLOCK(call) \
    for (int64_t i = 0; i < blocks; i++, row += bytes, y += elements) call

void gguf_dequant_row(int qtype, const uint8_t *restrict row, int64_t k, float *restrict y) {
    int64_t elements = gguf_block_elements(qtype), bytes = gguf_block_bytes(qtype);
    int64_t blocks = elements ? k / elements : 0;
    switch (qtype) {
    case GGUF_Q4_0: EACH_BLOCK(q4_0(row, y)); break;
    case GGUF_Q4_1: EACH_BLOCK(q4_1(row, y)); break;
    case GGUF_Q5_0: EACH_BLOCK(q5_0(row, y)); break;
    case GGUF_Q5_1: EACH_BLOCK(q5_1(row, y)); break;
    case GGUF_Q8_0: EACH_BLOCK(q8_0(row, y)); break;
    case GGUF_Q4_K: EACH_BLOCK(q45_k(row, y, 0)); break;
    case GGUF_Q5_K: EACH_BLOCK(q45_k(row, y, 1)); break;
    case GGUF_Q6_K: EACH_BLOCK(q6_k(row, y)); break;
    }
}
