/* The 32-element GGUF blocks' integers (and the K-quants' scales and integers), shared by the
 * dequantisation (gguf_dequant.c) and the fused one-row products (gguf_gemm.c): integer work
 * only, so either file's floating-point contraction setting leaves it alone. Layouts: ggml's
 * block_q4_0 ... block_q8_0, block_q4_K, block_q5_K. */
#ifndef MMSERVE_GGUF_LEGACY_H
#define MMSERVE_GGUF_LEGACY_H

#include "cpu_vec.h"
#include "gguf_cpu.h"

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

/* the fifth bits of elements j .. j + LANES (bits j .. of qh), as 16s */
static inline vi fifth(uint32_t qh, int j) {
    vi bits = (vi){0} + (int32_t)qh;  /* (bit 31 of qh sign-extends; only bit j + lane is kept) */
    return ((bits >> vindex(j)) & 1) << 4;
}

/* A 32-element block's integers as the format offsets them (Q4_0: q - 8, Q5_0: q - 16), in
 * 32 / LANES vectors, element j in lane j % LANES of vector j / LANES; its d, and its m (the
 * types with one: Q4_1, Q5_1; else 0). Q4: 16 bytes of nibbles, element j low, j + 16 high; Q5:
 * element j's fifth bit is bit j of qh; Q8_0: 32 int8. */
static inline void legacy_ints(int qtype, const uint8_t *b, vi *q, float *d, float *m) {
    *d = f16(b);
    *m = qtype == GGUF_Q4_1 || qtype == GGUF_Q5_1 ? f16(b + 2) : 0.0f;
    if (qtype == GGUF_Q8_0) {
        for (int j = 0; j < 32; j += LANES) q[j / LANES] = vbytes(b + 2 + j, 1);
        return;
    }
    int five = qtype == GGUF_Q5_0 || qtype == GGUF_Q5_1, offset = qtype == GGUF_Q4_0 ? 8 : qtype == GGUF_Q5_0 ? 16 : 0;
    uint32_t qh = five ? u32(b + (qtype == GGUF_Q5_0 ? 2 : 4)) : 0;
    const uint8_t *nibbles = b + (qtype == GGUF_Q4_0 ? 2 : qtype == GGUF_Q4_1 ? 4 : qtype == GGUF_Q5_0 ? 6 : 8);
    for (int j = 0; j < 16; j += LANES) {
        vi v = vbytes(nibbles + j, 0), lo = v & 0x0f, hi = v >> 4;
        if (five) {
            lo |= fifth(qh, j);
            hi |= fifth(qh, j + 16);
        }
        q[j / LANES] = lo - offset;
        q[(16 + j) / LANES] = hi - offset;
    }
}

static inline int is_legacy(int qtype) { return gguf_block_elements(qtype) == 32; }

/* The 6-bit scale and min of sub-block j of a Q4_K / Q5_K super-block (12 bytes at q). */
static inline void scale_min_k4(int j, const uint8_t *q, int *sc, int *m) {
    if (j < 4) {
        *sc = q[j] & 63;
        *m = q[j + 4] & 63;
    } else {
        *sc = (q[j + 4] & 0x0f) | ((q[j - 4] >> 6) << 4);
        *m = (q[j + 4] >> 4) | ((q[j] >> 6) << 4);
    }
}

/* Q4_K / Q5_K: the integers of elements l .. l + LANES of sub-blocks 2i (lo, the low nibbles of
 * bytes 32 i + l ..) and 2i + 1 (hi, the high nibbles), with their fifth bits (bits 2i and
 * 2i + 1 of qh[l ..]) for Q5_K. ql: the 128 nibble bytes, qh: the 32 fifth-bit bytes. */
static inline void k45_ints(const uint8_t *ql, const uint8_t *qh, int five, int i, int l, vi *lo, vi *hi) {
    vi q = vbytes(ql + 32 * i + l, 0);
    *lo = q & 0x0f;
    *hi = q >> 4;
    if (five) {
        vi h = vbytes(qh + l, 0);
        *lo += ((h >> (2 * i)) & 1) << 4;
        *hi += ((h >> (2 * i + 1)) & 1) << 4;
    }
}

/* Q6_K: the integers (0 .. 63, before its - 32) of elements l + 32 j .. (j < 4, l < 32) of a
 * half of 128: the low nibble (j odd: of byte l + 32 of ql) and bit pair j of high byte l. */
static inline void q6_ints(const uint8_t *ql, const uint8_t *qh, int l, vi q[4]) {
    vi lo_a = vbytes(ql + l, 0), lo_b = vbytes(ql + 32 + l, 0), hi = vbytes(qh + l, 0);
    q[0] = (lo_a & 0x0f) | ((hi & 3) << 4);
    q[1] = (lo_b & 0x0f) | (((hi >> 2) & 3) << 4);
    q[2] = (lo_a >> 4) | (((hi >> 4) & 3) << 4);
    q[3] = (lo_b >> 4) | (((hi >> 6) & 3) << 4);
}


#endif
