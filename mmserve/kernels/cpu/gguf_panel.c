/* 16 output channels' weights of a GGUF type, dequantised exactly and transposed for the
 * outer-product GEMM (gguf_gemm.c): wt[j * 16 + c] is channel c's weight k0 + j. Every type
 * the library reads: the 32-element ones and the K-quants (Q4_K, Q5_K, Q6_K: their 6-bit and
 * int8 scales unpacked for the 16 channels in vectors too).
 *
 * Channels are rows of blocks row_bytes apart. Each block's quant bytes are loaded 16 at a
 * time from the 16 channels and transposed as bytes by AVX-512 VBMI's two-table byte permute
 * (3 permutes for 4 output vectors), so that byte j of every channel lies in one vector; the
 * integers are then widened, scaled and stored a k at a time (gguf_dequant_panel), or multiplied
 * at once with up to 16 rows of x (gguf_fused_panel). Compiled with -ffp-contract=off:
 * q d + m rounds as legacy() (and q45_k(), q6_k()) in gguf_dequant.c do, bit-equal to the gguf
 * package.
 *
 * Only AVX-512 builds with VBMI (Ice Lake, Zen 4 and newer) have it; gguf_panel_supported()
 * says where it does not, and the row-at-a-time path (gguf_gemm.c) runs instead.
 */
#include "gguf_legacy.h"

#if VECTORISED && LANES == 16 && defined(__AVX512VBMI__)

/* The byte permutes' indices. A[s] holds channels 4s .. 4s + 3, 16 bytes each. Step 1:
 * P[pair] (from A[0] | A[1], channels 0-7) and Q[pair] (A[2] | A[3], channels 8-15) gather,
 * at 32 h + 8 t + c, byte 4 (2 pair + h) + t of channel c. Step 2: O[q] takes, at 16 t + c,
 * byte 4 q + t of channel c from P[q / 2] (c < 8) or Q[q / 2]. */
static uint8_t STEP1[2][64], STEP2[4][64];

__attribute__((constructor)) static void panel_indices(void) {
    for (int pair = 0; pair < 2; pair++)
        for (int h = 0; h < 2; h++)
            for (int t = 0; t < 4; t++)
                for (int c = 0; c < 8; c++)
                    STEP1[pair][32 * h + 8 * t + c] = (uint8_t)((c / 4) * 64 + (c % 4) * 16 + 4 * (2 * pair + h) + t);
    for (int q = 0; q < 4; q++)
        for (int t = 0; t < 4; t++)
            for (int c = 0; c < 16; c++)
                STEP2[q][16 * t + c] = (uint8_t)((c < 8 ? 0 : 64) + 32 * (q % 2) + 8 * t + c % 8);
}

/* 16 bytes at p[c] + at for each channel c -> O[q]: byte 4 q + t of channel c at 16 t + c */
static inline void transpose_bytes(const uint8_t *const p[16], int64_t at, __m512i O[4]) {
    __m512i A[4], P[2], Q[2];
    /* (the lane of an insert or extract must be a literal: spelled out, not left to unrolling) */
#define BYTES16(c) _mm_loadu_si128((const __m128i *)(p[c] + at))
    for (int s = 0; s < 4; s++) {
        __m512i v = _mm512_castsi128_si512(BYTES16(4 * s));
        v = _mm512_inserti32x4(v, BYTES16(4 * s + 1), 1);
        v = _mm512_inserti32x4(v, BYTES16(4 * s + 2), 2);
        A[s] = _mm512_inserti32x4(v, BYTES16(4 * s + 3), 3);
    }
#undef BYTES16
    for (int pair = 0; pair < 2; pair++) {
        __m512i index = _mm512_loadu_si512(STEP1[pair]);
        P[pair] = _mm512_permutex2var_epi8(A[0], index, A[1]);
        Q[pair] = _mm512_permutex2var_epi8(A[2], index, A[3]);
    }
    for (int q = 0; q < 4; q++) O[q] = _mm512_permutex2var_epi8(P[q / 2], _mm512_loadu_si512(STEP2[q]), Q[q / 2]);
}

/* the 4 bytes at p[c] + at of each channel, as int32 lanes */
static inline __m512i words(const uint8_t *const p[16], int64_t at) {
    uint32_t v[16];
    for (int c = 0; c < 16; c++) memcpy(v + c, p[c] + at, 4);
    return _mm512_loadu_si512(v);
}

/* group t (a literal, < 4) of O, bytes widened to int32 lanes */
#define WIDEN(O, t, is_signed) \
    (is_signed ? _mm512_cvtepi8_epi32(_mm512_extracti32x4_epi32(O, t)) : _mm512_cvtepu8_epi32(_mm512_extracti32x4_epi32(O, t)))

/* Where a block's weights go, a vector of 16 channels' weight k at a time: stored at wt[k][16]
 * (wt non-null), or multiplied at once with `rows` rows of x, transposed (xt[k * rows + r]),
 * into acc[r]. With the walk inlined and rows a constant, acc lives in registers and every
 * element of xt is at a constant offset from one pointer. */
typedef struct {
    float *wt;
    const float *xt;
    int rows;
    __m512 acc[16];
} sink_t;

static inline __attribute__((always_inline)) void emit(sink_t *s, int j, __m512 wv) {
    if (s->wt) {
        _mm512_store_ps(s->wt + j * 16, wv);
        return;
    }
    for (int r = 0; r < s->rows; r++) s->acc[r] = _mm512_fmadd_ps(_mm512_set1_ps(s->xt[j * s->rows + r]), wv, s->acc[r]);
}

/* element j of a 32-element block for the 16 channels (q: its integers, widened): with its
 * fifth bit (bit j of qh) where the type has one, less the type's offset, times d, plus m where
 * it has one (legacy() in gguf_dequant.c, the same roundings) */
static inline __attribute__((always_inline)) void element(__m512i q, int j, __m512i qh, int five, int offset,
                                                          __m512 d, int has_m, __m512 m, sink_t *s) {
    if (five) q = _mm512_or_si512(q, _mm512_slli_epi32(_mm512_and_si512(_mm512_srli_epi32(qh, j), _mm512_set1_epi32(1)), 4));
    __m512 wv = _mm512_mul_ps(_mm512_cvtepi32_ps(_mm512_sub_epi32(q, _mm512_set1_epi32(offset))), d);
    emit(s, j, has_m ? _mm512_add_ps(wv, m) : wv);
}

/* the next block of each channel; the sink past its `elements` weights */
static inline __attribute__((always_inline)) void advance(const uint8_t *p[16], int bytes, int elements, sink_t *s) {
    for (int c = 0; c < 16; c++) p[c] += bytes;
    if (s->wt) s->wt += elements * 16;
    else s->xt += elements * s->rows;
}

/* the 2 bytes at p[c] + at of each channel, as int32 lanes (Q6_K's d: its block's last 2) */
static inline __m512i halfwords(const uint8_t *const p[16], int64_t at) {
    uint32_t v[16] = {0};
    for (int c = 0; c < 16; c++) memcpy(v + c, p[c] + at, 2);
    return _mm512_loadu_si512(v);
}

/* prefetch the next slice of `fetch` bytes at next into L2 (a slice a block) */
static inline void fetch_slice(const char *next, int64_t slice, int64_t fetch, int64_t *fetched) {
    for (int64_t o = 0; o < slice && *fetched < fetch; o += 64, *fetched += 64) _mm_prefetch(next + *fetched, _MM_HINT_T1);
}

/* p[c]: channel c's block holding weight k0 (channels past `channels` read the first's);
 * returns the bytes of `fetch` to prefetch a block, kc / elements blocks in all */
static inline __attribute__((always_inline)) int64_t start_walk(
    const uint8_t *p[16], const uint8_t *w, int64_t row_bytes, int channels, int64_t k0, int64_t kc, int elements,
    int bytes, int64_t fetch) {
    for (int c = 0; c < 16; c++) p[c] = w + (c < channels ? c : 0) * row_bytes + k0 / elements * bytes;
    return fetch ? ((fetch / (kc / elements) + 63) & ~(int64_t)63) : 0;
}

/* The blocks [k0, k0 + kc) of 16 channels, a block at a time, into the sink (its wt or x
 * advanced a block each); `fetch` bytes from `next` are prefetched into L2 a slice a block
 * (the next panel's blocks, while this one's are multiplied) */
static inline __attribute__((always_inline)) void legacy_walk(
    int qtype, const uint8_t *w, int64_t row_bytes, int channels, int64_t k0, int64_t kc, sink_t *s,
    const char *next, int64_t fetch) {
    const int bytes = gguf_block_bytes(qtype), has_m = qtype == GGUF_Q4_1 || qtype == GGUF_Q5_1;
    const int five = qtype == GGUF_Q5_0 || qtype == GGUF_Q5_1;
    const int offset = qtype == GGUF_Q4_0 ? 8 : qtype == GGUF_Q5_0 ? 16 : 0;
    const int quants = qtype == GGUF_Q4_1 ? 4 : qtype == GGUF_Q5_0 ? 6 : qtype == GGUF_Q5_1 ? 8 : 2;
    const uint8_t *p[16];
    const __m512i nibble = _mm512_set1_epi8(15);
    int64_t blocks = kc / 32, fetched = 0, slice = start_walk(p, w, row_bytes, channels, k0, kc, 32, bytes, fetch);
    for (int64_t b = 0; b < blocks; b++) {
        fetch_slice(next, slice, fetch, &fetched);
        __m512i head = words(p, 0), O[4];
        __m512 d = _mm512_cvtph_ps(_mm512_cvtepi32_epi16(head)), m = _mm512_setzero_ps();
        if (has_m) m = _mm512_cvtph_ps(_mm512_cvtepi32_epi16(_mm512_srli_epi32(head, 16)));
        if (qtype == GGUF_Q8_0) {
            for (int half = 0; half < 2; half++) {
                transpose_bytes(p, quants + 16 * half, O);
                for (int q = 0; q < 4; q++) {
                    int j = 16 * half + 4 * q;  /* elements j + t */
#define SIGNED(t) emit(s, j + t, _mm512_mul_ps(_mm512_cvtepi32_ps(WIDEN(O[q], t, 1)), d));
                    SIGNED(0) SIGNED(1) SIGNED(2) SIGNED(3)
#undef SIGNED
                }
            }
        } else {
            __m512i qh = five ? words(p, qtype == GGUF_Q5_0 ? 2 : 4) : _mm512_setzero_si512();
            transpose_bytes(p, quants, O);
            /* element j < 16: the low nibble of byte j; j + 16: its high nibble (in the order of
             * k: the sink may be summing) */
            for (int high = 0; high < 2; high++)
                for (int q = 0; q < 4; q++) {
                    __m512i v = _mm512_and_si512(high ? _mm512_srli_epi16(O[q], 4) : O[q], nibble);
#define ELEMENT(t) element(WIDEN(v, t, 0), 16 * high + 4 * q + t, qh, five, offset, d, has_m, m, s);
                    ELEMENT(0) ELEMENT(1) ELEMENT(2) ELEMENT(3)
#undef ELEMENT
                }
        }
        advance(p, bytes, 32, s);
    }
}

/* Q4_K / Q5_K super-blocks [k0, k0 + kc) of 16 channels (k0, kc whole super-blocks), into the
 * sink in the order of k: sub-block j of 32 is q (d sc_j) - (dmin m_j), both products rounded
 * first (q45_k() in gguf_dequant.c); the 6-bit scales and mins of all 16 channels unpacked in
 * vectors from bytes 4-15, transposed with the rest of the first 16. */
static inline __attribute__((always_inline)) void q45k_walk(
    int five, const uint8_t *w, int64_t row_bytes, int channels, int64_t k0, int64_t kc, sink_t *s,
    const char *next, int64_t fetch) {
    const int bytes = five ? 176 : 144, ql = five ? 48 : 16;
    const uint8_t *p[16];
    const __m512i nibble = _mm512_set1_epi8(15), six = _mm512_set1_epi32(63), four = _mm512_set1_epi32(15);
    int64_t blocks = kc / 256, fetched = 0, slice = start_walk(p, w, row_bytes, channels, k0, kc, 256, bytes, fetch);
    for (int64_t b = 0; b < blocks; b++) {
        fetch_slice(next, slice, fetch, &fetched);
        __m512i head = words(p, 0), S[4], sb[12];
        __m512 d = _mm512_cvtph_ps(_mm512_cvtepi32_epi16(head));
        __m512 dmin = _mm512_cvtph_ps(_mm512_cvtepi32_epi16(_mm512_srli_epi32(head, 16)));
        transpose_bytes(p, 0, S);  /* bytes 4 .. 15: the 12 scale bytes */
#define SCALE_BYTE(i) sb[i] = WIDEN(S[(4 + i) / 4], (4 + i) % 4, 0);
        SCALE_BYTE(0) SCALE_BYTE(1) SCALE_BYTE(2) SCALE_BYTE(3) SCALE_BYTE(4) SCALE_BYTE(5)
        SCALE_BYTE(6) SCALE_BYTE(7) SCALE_BYTE(8) SCALE_BYTE(9) SCALE_BYTE(10) SCALE_BYTE(11)
#undef SCALE_BYTE
        __m512 dj[8], mj[8];  /* scale_min_k4() for the 16 channels */
        for (int j = 0; j < 8; j++) {
            __m512i sc, m;
            if (j < 4) {
                sc = _mm512_and_si512(sb[j], six);
                m = _mm512_and_si512(sb[j + 4], six);
            } else {
                sc = _mm512_or_si512(_mm512_and_si512(sb[j + 4], four), _mm512_slli_epi32(_mm512_srli_epi32(sb[j - 4], 6), 4));
                m = _mm512_or_si512(_mm512_srli_epi32(sb[j + 4], 4), _mm512_slli_epi32(_mm512_srli_epi32(sb[j], 6), 4));
            }
            dj[j] = _mm512_mul_ps(d, _mm512_cvtepi32_ps(sc));
            mj[j] = _mm512_mul_ps(dmin, _mm512_cvtepi32_ps(m));
        }
        __m512i H[2][4];  /* Q5_K: the 32 fifth-bit bytes */
        if (five) {
            transpose_bytes(p, 16, H[0]);
            transpose_bytes(p, 32, H[1]);
        }
        for (int i = 0; i < 4; i++) {  /* elements 64 i ..: sub-blocks 2 i (low nibbles), 2 i + 1 */
            __m512i Q[2][4];
            transpose_bytes(p, ql + 32 * i, Q[0]);
            transpose_bytes(p, ql + 32 * i + 16, Q[1]);
            for (int high = 0; high < 2; high++) {
                const int j = 2 * i + high;
                for (int half = 0; half < 2; half++)
                    for (int q = 0; q < 4; q++) {
                        __m512i v = _mm512_and_si512(high ? _mm512_srli_epi16(Q[half][q], 4) : Q[half][q], nibble);
                        /* element 64 i + 32 high + l, l = 16 half + 4 q + t: byte l's nibble */
#define K45(t)                                                                                                   \
    {                                                                                                            \
        __m512i qv = WIDEN(v, t, 0);                                                                             \
        if (five)                                                                                                \
            qv = _mm512_add_epi32(qv, _mm512_slli_epi32(                                                         \
                                          _mm512_and_si512(_mm512_srli_epi32(WIDEN(H[half][q], t, 0), j),      \
                                                           _mm512_set1_epi32(1)), 4));                            \
        emit(s, 64 * i + 32 * high + 16 * half + 4 * q + t,                                                      \
             _mm512_sub_ps(_mm512_mul_ps(dj[j], _mm512_cvtepi32_ps(qv)), mj[j]));                                \
    }
                        K45(0) K45(1) K45(2) K45(3)
#undef K45
                    }
            }
        }
        advance(p, bytes, 256, s);
    }
}

/* Q6_K super-blocks [k0, k0 + kc) of 16 channels, into the sink in the order of k: sub-block s
 * of 16 is (q - 32) (d sc_s), d sc_s rounded first (q6_k() in gguf_dequant.c). Each half of 128
 * takes 64 low-nibble bytes and 32 high-bit bytes, transposed 16 at a time; element 32 j + l of
 * a half has the low nibble of byte l (j odd: l + 32; j >= 2: the high nibble) and bit pair j
 * of high byte l. */
static inline __attribute__((always_inline)) void q6k_walk(
    const uint8_t *w, int64_t row_bytes, int channels, int64_t k0, int64_t kc, sink_t *s, const char *next,
    int64_t fetch) {
    const int bytes = 210;
    const uint8_t *p[16];
    const __m512i nibble = _mm512_set1_epi8(15), pair = _mm512_set1_epi8(3), bias = _mm512_set1_epi32(32);
    int64_t blocks = kc / 256, fetched = 0, slice = start_walk(p, w, row_bytes, channels, k0, kc, 256, bytes, fetch);
    for (int64_t b = 0; b < blocks; b++) {
        fetch_slice(next, slice, fetch, &fetched);
        __m512 d = _mm512_cvtph_ps(_mm512_cvtepi32_epi16(halfwords(p, 208))), ds[16];
        __m512i S[4];
        transpose_bytes(p, 192, S);  /* the 16 int8 scales */
#define SCALE(i) ds[i] = _mm512_mul_ps(d, _mm512_cvtepi32_ps(WIDEN(S[i / 4], i % 4, 1)));
        SCALE(0) SCALE(1) SCALE(2) SCALE(3) SCALE(4) SCALE(5) SCALE(6) SCALE(7)
        SCALE(8) SCALE(9) SCALE(10) SCALE(11) SCALE(12) SCALE(13) SCALE(14) SCALE(15)
#undef SCALE
        for (int h = 0; h < 2; h++) {
            __m512i L[4][4], Hb[2][4];  /* low-nibble bytes 16 u .. of the half; high bytes 16 u .. */
            for (int u = 0; u < 4; u++) transpose_bytes(p, 64 * h + 16 * u, L[u]);
            for (int u = 0; u < 2; u++) transpose_bytes(p, 128 + 32 * h + 16 * u, Hb[u]);
            for (int j = 0; j < 4; j++)
                for (int half = 0; half < 2; half++)  /* l = 16 half + 4 q + t */
                    for (int q = 0; q < 4; q++) {
                        __m512i lo = L[2 * (j & 1) + half][q];
                        __m512i v = _mm512_and_si512(j >= 2 ? _mm512_srli_epi16(lo, 4) : lo, nibble);
                        __m512i hv = _mm512_and_si512(_mm512_srli_epi16(Hb[half][q], 2 * j), pair);
#define Q6(t)                                                                                                    \
    {                                                                                                            \
        __m512i qv = _mm512_or_si512(WIDEN(v, t, 0), _mm512_slli_epi32(WIDEN(hv, t, 0), 4));                    \
        emit(s, 128 * h + 32 * j + 16 * half + 4 * q + t,                                                        \
             _mm512_mul_ps(_mm512_cvtepi32_ps(_mm512_sub_epi32(qv, bias)), ds[8 * h + half + 2 * j]));          \
    }
                        Q6(0) Q6(1) Q6(2) Q6(3)
#undef Q6
                    }
        }
        advance(p, bytes, 256, s);
    }
}

/* any type's walk (a constant qtype in each caller) */
static inline __attribute__((always_inline)) void walk(
    int qtype, const uint8_t *w, int64_t row_bytes, int channels, int64_t k0, int64_t kc, sink_t *s,
    const char *next, int64_t fetch) {
    if (qtype == GGUF_Q6_K) q6k_walk(w, row_bytes, channels, k0, kc, s, next, fetch);
    else if (qtype == GGUF_Q4_K || qtype == GGUF_Q5_K) q45k_walk(qtype == GGUF_Q5_K, w, row_bytes, channels, k0, kc, s, next, fetch);
    else legacy_walk(qtype, w, row_bytes, channels, k0, kc, s, next, fetch);
}

static inline __attribute__((always_inline)) void legacy_panel(
    int qtype, const uint8_t *w, int64_t row_bytes, int channels, int64_t k0, int64_t kc, float *wt) {
    sink_t s = {.wt = wt};
    walk(qtype, w, row_bytes, channels, k0, kc, &s, NULL, 0);
}

/* rows (a constant) of x, transposed, against the 16 channels, the whole of k, each block's
 * weights multiplied as they are dequantised: the sums in the order of k, as the outer-product
 * path's; the first `stored` rows' sums stored */
static inline __attribute__((always_inline)) void legacy_fused(
    int qtype, int rows, int stored, const float *xt, const uint8_t *w, int64_t row_bytes, int channels, int64_t k,
    float *out, int64_t ldo, const char *next, int64_t fetch) {
    sink_t s = {.xt = xt, .rows = rows};
    for (int r = 0; r < rows; r++) s.acc[r] = _mm512_setzero_ps();
    walk(qtype, w, row_bytes, channels, 0, k, &s, next, fetch);
    __mmask16 mask = (__mmask16)((1u << channels) - 1);
    for (int r = 0; r < stored; r++) _mm512_mask_storeu_ps(out + r * ldo, mask, s.acc[r]);
}

void gguf_fused_panel(int qtype, int rows, int stored, const float *xt, const uint8_t *w, int64_t row_bytes,
                      int channels, int64_t k, float *out, int64_t ldo, const void *next, int64_t fetch) {
    /* (an even row count only: each (type, rows) pair is a copy of the walk, about 0.15 s of
     * compiling at -O3) */
#define ROWS_CASE(T, R) case R: legacy_fused(T, R, stored, xt, w, row_bytes, channels, k, out, ldo, next, fetch); break;
#define TYPE_CASE(T) case T: switch (rows) { \
        ROWS_CASE(T, 2) ROWS_CASE(T, 4) ROWS_CASE(T, 6) ROWS_CASE(T, 8) \
        ROWS_CASE(T, 10) ROWS_CASE(T, 12) ROWS_CASE(T, 14) ROWS_CASE(T, 16) } break;
    switch (qtype) {
    TYPE_CASE(GGUF_Q4_0) TYPE_CASE(GGUF_Q4_1) TYPE_CASE(GGUF_Q5_0) TYPE_CASE(GGUF_Q5_1) TYPE_CASE(GGUF_Q8_0)
    TYPE_CASE(GGUF_Q4_K) TYPE_CASE(GGUF_Q5_K) TYPE_CASE(GGUF_Q6_K)
    }
#undef TYPE_CASE
#undef ROWS_CASE
}

int gguf_panel_supported(int qtype) { return gguf_block_elements(qtype) != 0; }

void gguf_dequant_panel(int qtype, const uint8_t *w, int64_t row_bytes, int channels, int64_t k0, int64_t kc,
                        float *wt) {
    switch (qtype) {
    case GGUF_Q4_0: legacy_panel(GGUF_Q4_0, w, row_bytes, channels, k0, kc, wt); break;
    case GGUF_Q4_1: legacy_panel(GGUF_Q4_1, w, row_bytes, channels, k0, kc, wt); break;
    case GGUF_Q5_0: legacy_panel(GGUF_Q5_0, w, row_bytes, channels, k0, kc, wt); break;
    case GGUF_Q5_1: legacy_panel(GGUF_Q5_1, w, row_bytes, channels, k0, kc, wt); break;
    case GGUF_Q8_0: legacy_panel(GGUF_Q8_0, w, row_bytes, channels, k0, kc, wt); break;
    case GGUF_Q4_K: legacy_panel(GGUF_Q4_K, w, row_bytes, channels, k0, kc, wt); break;
    case GGUF_Q5_K: legacy_panel(GGUF_Q5_K, w, row_bytes, channels, k0, kc, wt); break;
    case GGUF_Q6_K: legacy_panel(GGUF_Q6_K, w, row_bytes, channels, k0, kc, wt); break;
    }
}

#else

int gguf_panel_supported(int qtype) { return (void)qtype, 0; }

void gguf_dequant_panel(int qtype, const uint8_t *w, int64_t row_bytes, int channels, int64_t k0, int64_t kc,
                        float *wt) {
    (void)qtype, (void)w, (void)row_bytes, (void)channels, (void)k0, (void)kc, (void)wt;
}

void gguf_fused_panel(int qtype, int rows, int stored, const float *xt, const uint8_t *w, int64_t row_bytes,
                      int channels, int64_t k, float *out, int64_t ldo, const void *next, int64_t fetch) {
    (void)qtype, (void)rows, (void)stored, (void)xt, (void)w, (void)row_bytes, (void)channels, (void)k, (void)out,
        (void)ldo, (void)next, (void)fetch;
}

#endif
