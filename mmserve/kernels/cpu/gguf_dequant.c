/* GGUF blocks -> float32, as ggml (and the gguf package's reference) computes them.
 *
 * Compiled with -ffp-contract=off: d * q + m is two roundings, as in the reference, so every
 * weight comes out bit-equal to the dequantised-at-load path. The block layouts are ggml's
 * block_q4_0 ... block_q6_K structs, little-endian (mmserve/kernels/gguf_blocks.py lists them).
 * Every block is read LANES elements at a time (cpu_vec.h): bytes widened to int32 lanes,
 * then masked, shifted and converted there.
 */
#include "gguf_legacy.h"

/* 32-element blocks (gguf_legacy.h): q d, plus m for the types with one (not + 0: that would
 * turn a -0 into +0). */
static inline void legacy(int qtype, const uint8_t *restrict b, float *restrict y) {
    vi q[32 / LANES];
    float d, m;
    legacy_ints(qtype, b, q, &d, &m);
    for (int i = 0; i < 32 / LANES; i++) {
        vf w = vfloat(q[i]) * d;
        vstore(y + i * LANES, qtype == GGUF_Q4_1 || qtype == GGUF_Q5_1 ? w + m : w);
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
            vi lo, hi;
            k45_ints(ql, qh, five, i, l, &lo, &hi);
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
            vi q[4];
            q6_ints(ql, qh, l, q);
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
    case GGUF_Q4_0: EACH_BLOCK(legacy(GGUF_Q4_0, row, y)); break;
    case GGUF_Q4_1: EACH_BLOCK(legacy(GGUF_Q4_1, row, y)); break;
    case GGUF_Q5_0: EACH_BLOCK(legacy(GGUF_Q5_0, row, y)); break;
    case GGUF_Q5_1: EACH_BLOCK(legacy(GGUF_Q5_1, row, y)); break;
    case GGUF_Q8_0: EACH_BLOCK(legacy(GGUF_Q8_0, row, y)); break;
    case GGUF_Q4_K: EACH_BLOCK(q45_k(row, y, 0)); break;
    case GGUF_Q5_K: EACH_BLOCK(q45_k(row, y, 1)); break;
    case GGUF_Q6_K: EACH_BLOCK(q6_k(row, y)); break;
    }
}
