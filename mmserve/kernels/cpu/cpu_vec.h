/* The vectors the CPU library computes on: LANES float32 / int32 lanes (GCC / Clang vector
 * extensions), 16 with AVX-512, 8 with AVX2, and bytes widened to int32 lanes by the ISA's
 * own instructions. GCC 12 turns a generic uint8 -> int32 vector conversion into one scalar
 * conversion per byte (a 6x slower dequantisation, measured), so the generic build (no AVX2)
 * is correct but not fast: gguf_cpu_vectorised() says which this build is. */
#ifndef MMSERVE_CPU_VEC_H
#define MMSERVE_CPU_VEC_H

#include <stdint.h>
#include <string.h>

#if defined(__AVX512F__) && defined(__F16C__)
#define LANES 16
#define VECTORISED 1
#elif defined(__AVX2__) && defined(__F16C__)
#define LANES 8
#define VECTORISED 1
#else
#define LANES 8
#define VECTORISED 0
#endif

#if VECTORISED
#include <immintrin.h>
#endif

typedef float vf __attribute__((vector_size(LANES * sizeof(float))));
typedef int32_t vi __attribute__((vector_size(LANES * sizeof(int32_t))));

static inline vf vload(const float *p) {
    vf v;
    memcpy(&v, p, sizeof v);
    return v;
}

static inline void vstore(float *p, vf v) { memcpy(p, &v, sizeof v); }

static inline vf vsplat(float x) { return (vf){0} + x; }

static inline vf vfloat(vi v) { return __builtin_convertvector(v, vf); }

/* bytes p[0 .. LANES) as int32 lanes, zero- or sign-extended */
static inline vi vbytes(const uint8_t *p, int is_signed) {
#if VECTORISED && LANES == 16
    __m128i b = _mm_loadu_si128((const __m128i *)p);
    return (vi)(is_signed ? _mm512_cvtepi8_epi32(b) : _mm512_cvtepu8_epi32(b));
#elif VECTORISED
    __m128i b = _mm_loadl_epi64((const __m128i *)p);
    return (vi)(is_signed ? _mm256_cvtepi8_epi32(b) : _mm256_cvtepu8_epi32(b));
#else
    vi v;
    for (int i = 0; i < LANES; i++) v[i] = is_signed ? (int8_t)p[i] : p[i];
    return v;
#endif
}

/* the sum of the lanes, as a tree */
static inline float vsum(vf v) {
#if VECTORISED && LANES == 16
    return _mm512_reduce_add_ps((__m512)v);
#elif VECTORISED
    __m128 x = _mm_add_ps(_mm256_castps256_ps128((__m256)v), _mm256_extractf128_ps((__m256)v, 1));
    x = _mm_add_ps(x, _mm_movehl_ps(x, x));
    return _mm_cvtss_f32(_mm_add_ss(x, _mm_shuffle_ps(x, x, 1)));
#else
    float s = 0.0f;
    for (int i = 0; i < LANES; i++) s += v[i];
    return s;
#endif
}

/* bytes [p, p + bytes) fetched into the caches ahead of their reads, a line of 64 at a time (a
 * prefetch never faults, past the end of an allocation included) */
static inline void prefetch_bytes(const void *p, int64_t bytes) {
    for (int64_t o = 0; o < bytes; o += 64) __builtin_prefetch((const char *)p + o, 0, 3);
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

/* lane i: i + first */
static inline vi vindex(int first) {
    vi v;
    for (int i = 0; i < LANES; i++) v[i] = i + first;
    return v;
}

/* e^x for x <= 0 (attention's scores less their maximum, silu's e^-|g|), to about 2 ulp: x =
 * n ln2 + r, |r| <= ln2 / 2, e^r by Cephes' expf polynomial, 2^n put into the exponent; below
 * -87 it is 0. */
static inline vf vexp(vf x) {
    const vf lo = vsplat(-87.0f);
    vi under = x < lo;
    x = (vf)((vi)x & ~under) + (vf)((vi)lo & under);  /* max(x, -87) */
    vf t = x * 1.44269504088896341f + 0.5f;
    vi n = __builtin_convertvector(t, vi);
    n += (vi)(vfloat(n) > t);  /* truncation -> floor (a true compare is -1) */
    vf fn = vfloat(n);
    vf r = x - fn * 0.693359375f + fn * 2.12194440e-4f;
    vf p = vsplat(1.9875691500e-4f);
    p = p * r + 1.3981999507e-3f;
    p = p * r + 8.3334519073e-3f;
    p = p * r + 4.1665795894e-2f;
    p = p * r + 1.6666665459e-1f;
    p = p * r + 5.0000001201e-1f;
    vf y = p * r * r + r + 1.0f;
    vi scale = (n + 127) << 23;
    vf out = y * (vf)scale;
    return (vf)((vi)out & ~under);
}

#endif
