/* GGUF blocks -> float32, as ggml (and the gguf package's reference) computes them.
 *
 * Compiled with -ffp-contract=off: d * q + m is two roundings, as in the reference, so every
 * weight comes out bit-equal to the dequantised-at-load path. The block layouts are ggml's
 * block_q4_0 ... block_q6_K structs, little-endian (mmserve/kernels/gguf_blocks.py lists them).
 * Every block is read LANES elements at a time (cpu_vec.h): bytes widened to int32 lanes,
 * then masked, shifted and converted there.
 */
#include "gguf_cpu.h"
#include "cpu_vec.h"

#if defined(__F16C__)
#include <immintrin.h>
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

/* 32-element blocks. Q4_0: d, 16 bytes of nibbles (element j low, j + 16 high), (q - 8) d.
 * Q4_1: d, m, q d + m. Q5_0 / Q5_1: the same with element j's fifth bit as bit j of qh. Q8_0:
 * d, 32 int8. */
static inline void q4_0(const uint8_t *restrict b, float *restrict y) {
    vf d = vsplat(f16(b));
    for (int j = 0; j < 16; j += LANES) {
        vi q = vbytes(b + 2 + j, 0);
        vstore(y + j, vfloat((q & 0x0f) - 8) * d);
        vstore(y + 16 + j, vfloat((q >> 4) - 8) * d);
    }
}

static inline void q4_1(const uint8_t *restrict b, float *restrict y) {
    vf d = vsplat(f16(b)), m = vsplat(f16(b + 2));
    for (int j = 0; j < 16; j += LANES) {
        vi q = vbytes(b + 4 + j, 0);
        vstore(y + j, vfloat(q & 0x0f) * d + m);
        vstore(y + 16 + j, vfloat(q >> 4) * d + m);
    }
}

/* the fifth bits of elements j .. j + LANES (bits j .. of qh), as 16s */
static inline vi fifth(uint32_t qh, int j) {
    vi bits = (vi){0} + (int32_t)qh;  /* (bit 31 of qh sign-extends; only bit j + lane is kept) */
    return ((bits >> vindex(j)) & 1) << 4;
}

static inline void q5_0(const uint8_t *restrict b, float *restrict y) {
    vf d = vsplat(f16(b));
    uint32_t qh = u32(b + 2);
    for (int j = 0; j < 16; j += LANES) {
        vi q = vbytes(b + 6 + j, 0);
        vstore(y + j, vfloat(((q & 0x0f) | fifth(qh, j)) - 16) * d);
        vstore(y + 16 + j, vfloat(((q >> 4) | fifth(qh, j + 16)) - 16) * d);
    }
}

static inline void q5_1(const uint8_t *restrict b, float *restrict y) {
    vf d = vsplat(f16(b)), m = vsplat(f16(b + 2));
    uint32_t qh = u32(b + 4);
    for (int j = 0; j < 16; j += LANES) {
        vi q = vbytes(b + 8 + j, 0);
        vstore(y + j, vfloat((q & 0x0f) | fifth(qh, j)) * d + m);
        vstore(y + 16 + j, vfloat((q >> 4) | fifth(qh, j + 16)) * d + m);
    }
}

static inline void q8_0(const uint8_t *restrict b, float *restrict y) {
    vf d = vsplat(f16(b));
    for (int j = 0; j < 32; j += LANES) vstore(y + j, vfloat(vbytes(b + 2 + j, 1)) * d);
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
 * bytes of fifth bits before the nibbles. Sub-block j of 32: q (d sc_j) - (dmin m_j), the two
 * products rounded first as ggml computes them; sub-blocks 2i and 2i + 1 are the low and high
 * nibbles of bytes 32 i .., their fifth bits bits 2i and 2i + 1 of qh. */
static inline void q45_k(const uint8_t *restrict b, float *restrict y, int five) {
    float d = f16(b), dmin = f16(b + 2);
    const uint8_t *scales = b + 4, *qh = b + 16, *ql = b + (five ? 48 : 16);
    for (int i = 0; i < 4; i++) {
        int sc, m;
        scale_min_k4(2 * i, scales, &sc, &m);
        vf d1 = vsplat(d * (float)sc), m1 = vsplat(dmin * (float)m);
        scale_min_k4(2 * i + 1, scales, &sc, &m);
        vf d2 = vsplat(d * (float)sc), m2 = vsplat(dmin * (float)m);
        for (int l = 0; l < 32; l += LANES) {
            vi q = vbytes(ql + 32 * i + l, 0), lo = q & 0x0f, hi = q >> 4;
            if (five) {
                vi h = vbytes(qh + l, 0);
                lo += ((h >> (2 * i)) & 1) << 4;
                hi += ((h >> (2 * i + 1)) & 1) << 4;
            }
            vstore(y + 64 * i + l, d1 * vfloat(lo) - m1);
            vstore(y + 64 * i + 32 + l, d2 * vfloat(hi) - m2);
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
        for (int l = 0; l < 32; l += LANES) {  /* (LANES <= 16: one scale per vector) */
            vi lo_a = vbytes(ql + l, 0), lo_b = vbytes(ql + 32 + l, 0), hi = vbytes(qh + l, 0);
            vi q[4] = {(lo_a & 0x0f) | ((hi & 3) << 4), (lo_b & 0x0f) | (((hi >> 2) & 3) << 4),
                       (lo_a >> 4) | (((hi >> 4) & 3) << 4), (lo_b >> 4) | (((hi >> 6) & 3) << 4)};
            for (int j = 0; j < 4; j++) {
                vf ds = vsplat(d * (float)sc[l / 16 + 2 * j]);
                vstore(y + 128 * half + 32 * j + l, vfloat(q[j] - 32) * ds);
            }
        }
    }
}

int gguf_cpu_vectorised(void) { return VECTORISED; }

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
