/* out[m, n] = sum_k x[m, k] w[n, k], w's rows in GGUF blocks: the CPU's product for weights
 * kept quantised.
 *
 * A decode step is bound by the weight bytes it streams; float32 weights are 6.4 times the
 * bytes of Q4_1's. Each thread takes 4 output channels at a time, dequantises their rows into a
 * float buffer of its own (exactly, gguf_dequant.c: 4 x K floats, in L1/L2) and multiplies it
 * with x in register tiles of up to ROWS rows x 4 channels of LANES-wide float32 sums, so the
 * blocks are read from memory once per call whatever the rows (one row against 32-element
 * blocks skips the buffer: legacy_dot). From OUTER_MIN_ROWS rows on, every type on AVX-512
 * with VBMI takes the outer-product path below instead (16 channels dequantised
 * transposed, gguf_panel.c), whatever the rows, where the caller asks for it (`panels`): on
 * AMD Zen 4 / Zen 5, SmolLM2's layers at 92-95% of the FMA limit from 128 rows on and 73% at 16,
 * where the 4 x 4 tiles reached 65% at 64 rows and 54% at 16 (before the tiles' prefetches); up
 * to 16 rows it multiplies each block as it is dequantised, in registers (Zen 4, 2 cores,
 * SmolLM2's 30 layers at 16 rows 22.5 against 24.2 ms, the Q8_0 head 5.1 against 6.1; at 4 rows
 * 10.3 against 11.2, the head 2.1 against 2.7). The tiles with their prefetches still lose to
 * it there at 4-32 rows (16 rows: 31.2 against 26.4 ms before the change). On
 * a Xeon (AVX-512, 2 cores) the prefetching tiles beat it at every row count measured (SmolLM2's
 * 30 layers out of cache: Q4_1 at 4 rows 11.6 against 13.4 ms, 16 rows 24.8 against 25.5, 64
 * rows 71.9 against 72.8; the Q8_0 head at 16 rows 27.2 against 30.3), so mmserve.kernels.
 * cpu_gguf asks for it only off Intel processors.
 * Threads are OpenMP's: the library links libgomp.so.1, which resolves to the runtime torch
 * loaded (the same threads, no second pool spinning against torch's).
 */
#include "gguf_legacy.h"

#include <stdlib.h>

/* The row-at-a-time paths read each thread's channels' blocks in one ascending stream, and the
 * hardware prefetchers alone did not keep it fed: SmolLM2's 30 layers of Q4_1 blocks (85 MB, not
 * in cache) at one row took 18.4 ms on 2 cores of a Xeon, 7.9 with the bytes AHEAD further on
 * fetched as each channel starts (1-4 KiB measured alike; 8 KiB slower); its Q8_0 head 2.9
 * against 1.3-1.8; Q4_K 21.1 against 9.0, Q6_K 19.6 against 13.6. The 4-channel tiles (2-3
 * rows; every row count where the outer-product path does not run) gain as much at 2-4 rows
 * (Q4_1 at 2 rows 14.5 against 9.0, Q4_K at 4 23.8 against 16.2) except Q6_K's, whose heavier
 * dequantisation the prefetchers keep up with: there the prefetches cost 4-7% at 3-8 rows, and
 * it goes without. A prefetch never faults, past the end of the blocks included. */
#define AHEAD 2048

static inline void prefetch_ahead(const uint8_t *from, int64_t bytes) { prefetch_bytes(from + AHEAD, bytes); }

/* AVX-512: 4 x 4 measured as fast as 8 x 3, 6 x 3 or 6 x 4 at 1-16 rows (SmolLM2's layers, 2
 * cores). AVX2 (Zen 2, 2 cores, SmolLM2's Q4_1 layers, session 30): 3 x 4 (12 sums and the 4
 * weights in its 16 registers, x an FMA's memory operand) took 16 rows in 4.17-4.32 ms against
 * 4.93-5.00 at 2 x 4 (4 x 3 about as 3 x 4; 3 x 3 and 4 x 2 slower), 8 rows 11-15% less; 16
 * streams' decode step 119-120 ms against 136-138, `bench throughput`. */
#define CHANNELS 4  /* output channels a thread dequantises at a time */
#define ROWS (LANES == 16 ? 4 : 3)  /* rows of x in one register tile */

/* rows (1..ROWS) of x against channels (1..CHANNELS) dequantised rows of w, k a multiple of
 * LANES; unused rows / channels repeat the first, computed and not stored. */
static inline __attribute__((always_inline)) void tile(
    int rows, int channels, const float *x, int64_t ldx, const float *w, int64_t k,
    float *out, int64_t ldo) {
    const float *xr[ROWS], *wc[CHANNELS];
    for (int r = 0; r < ROWS; r++) xr[r] = x + (r < rows ? r : 0) * ldx;
    for (int c = 0; c < CHANNELS; c++) wc[c] = w + (c < channels ? c : 0) * k;
    vf acc[ROWS][CHANNELS];
    memset(acc, 0, sizeof acc);
    for (int64_t i = 0; i < k; i += LANES) {
        vf wv[CHANNELS];
        for (int c = 0; c < CHANNELS; c++) wv[c] = vload(wc[c] + i);
        for (int r = 0; r < rows; r++) {
            vf xv = vload(xr[r] + i);
            for (int c = 0; c < CHANNELS; c++) acc[r][c] += xv * wv[c];
        }
    }
#if ROWS * CHANNELS == LANES
    /* (AVX-512) the 16 sums at once, by one transposing tree: SmolLM2's layers out of cache on 2
     * Xeon cores, Q4_1 at 16 rows 23.2 against 23.6 ms by 16 trees, 64 rows 66.9 against 70.4;
     * Q4_K at 16 rows 30.8 against 31.5 */
    float sums[LANES];
    vstore(sums, vsums(&acc[0][0]));
    for (int r = 0; r < rows; r++)
        for (int c = 0; c < channels; c++) out[r * ldo + c] = sums[r * CHANNELS + c];
#else
    for (int r = 0; r < rows; r++)
        for (int c = 0; c < channels; c++) out[r * ldo + c] = vsum(acc[r][c]);
#endif
}

/* rows is a compile-time constant in each call, so each gets its own unrolled loop */
static void tiles(int64_t m, int channels, const float *x, int64_t ldx, const float *w,
                  int64_t k, float *out, int64_t ldo) {
    int64_t r = 0;
    for (; r + ROWS <= m; r += ROWS) tile(ROWS, channels, x + r * ldx, ldx, w, k, out + r * ldo, ldo);
    x += r * ldx;
    out += r * ldo;
    switch (m - r) {  /* the last rows, fewer than ROWS */
    case 1: tile(1, channels, x, ldx, w, k, out, ldo); break;
#if ROWS > 2
    case 2: tile(2, channels, x, ldx, w, k, out, ldo); break;
#endif
#if ROWS > 3
    case 3: tile(3, channels, x, ldx, w, k, out, ldo); break;
#endif
    }
}

/* One row of x against one output channel of 32-element blocks, without dequantising:
 * sum_b d_b (sum_j x_j q_bj) + m_b (sum_j x_j), the block's integers times x in float32 lanes,
 * scaled once per block; xsums[b]: x's sum over block b (used by the types with an m). The
 * weights are the file's; the sums run in another order than x . (q d + m). */
static float legacy_dot(int qtype, const float *x, const float *xsums, const uint8_t *row,
                        int64_t blocks, int64_t bytes) {
    vf total = vsplat(0.0f);
    float mins = 0.0f;
    for (int64_t b = 0; b < blocks; b++, row += bytes, x += 32) {
        vi q[32 / LANES];
        float d, m;
        legacy_ints(qtype, row, q, &d, &m);
        vf acc = vfloat(q[0]) * vload(x);
        for (int i = 1; i < 32 / LANES; i++) acc += vfloat(q[i]) * vload(x + i * LANES);
        total += acc * d;
        mins += m * xsums[b];
    }
    return vsum(total) + mins;
}


/* One row of x against one output channel of 256-element K-quant blocks, without
 * dequantising: each sub-block's integers times x in float32 lanes, scaled once by its d sc
 * (Q4_K / Q5_K: less its dmin m times x's sub-block sum, xsums[s] over x's 32 elements s;
 * Q6_K: q - 32, 16 elements to a scale). The scales round as gguf_dequant.c's q45_k / q6_k
 * compute them; the sums run in another order than x . w. */
static float kquant_dot(int qtype, const float *x, const float *xsums, const uint8_t *row, int64_t blocks) {
    vf total = vsplat(0.0f);
    float mins = 0.0f;
    const int bytes = gguf_block_bytes(qtype), five = qtype == GGUF_Q5_K;
    for (int64_t b = 0; b < blocks; b++, row += bytes, x += 256, xsums += 8) {
        if (qtype == GGUF_Q6_K) {
            float d = f16(row + 208);
            for (int half = 0; half < 2; half++) {
                const uint8_t *ql = row + 64 * half, *qh = row + 128 + 32 * half;
                const int8_t *sc = (const int8_t *)(row + 192 + 8 * half);
                const float *xh = x + 128 * half;
                for (int l = 0; l < 32; l += LANES) {
                    vi q[4];
                    q6_ints(ql, qh, l, q);
                    for (int j = 0; j < 4; j++) {
                        float ds = d * (float)sc[l / 16 + 2 * j];
                        total += vfloat(q[j] - 32) * vload(xh + 32 * j + l) * ds;
                    }
                }
            }
            continue;
        }
        float d = f16(row), dmin = f16(row + 2);
        const uint8_t *scales = row + 4, *qh = row + 16, *ql = row + (five ? 48 : 16);
        for (int i = 0; i < 4; i++) {
            int sc1, m1, sc2, m2;
            scale_min_k4(2 * i, scales, &sc1, &m1);
            scale_min_k4(2 * i + 1, scales, &sc2, &m2);
            vf acc1 = vsplat(0.0f), acc2 = vsplat(0.0f);
            for (int l = 0; l < 32; l += LANES) {
                vi lo, hi;
                k45_ints(ql, qh, five, i, l, &lo, &hi);
                acc1 += vfloat(lo) * vload(x + 64 * i + l);
                acc2 += vfloat(hi) * vload(x + 64 * i + 32 + l);
            }
            float d1 = d * (float)sc1, d2 = d * (float)sc2, min1 = dmin * (float)m1, min2 = dmin * (float)m2;
            total += acc1 * d1;
            total += acc2 * d2;
            mins += min1 * xsums[2 * i] + min2 * xsums[2 * i + 1];
        }
    }
    return vsum(total) - mins;
}

#if VECTORISED && LANES == 16
/* The outer-product path, for the types gguf_panel.c transposes (all; AVX-512 with VBMI): panels of
 * 16 output channels, KC weights of k at a time dequantised into wt[KC][16] (the 16 channels'
 * weights at each k in one vector), then ROWS_OUTER rows' 16 sums each held in registers while
 * k runs, x broadcast one element at a time: no horizontal sums, each sum in the order of k.
 * Up to ROWS_OUTER rows (a decode step) there is one pass over the rows, and each block's 32
 * weights go from their dequantisation straight into the sums (gguf_fused_panel): the
 * dequantisation's work then overlaps the multiplies instead of running between chunks, with
 * the same sums in the same order (bit-equal). x is transposed for it first, so that every
 * broadcast element is at a constant offset from one pointer (the rows' 16 pointers took the
 * general registers). */
#define KC 256  /* wt and 16 rows of x's chunk fill 32 KiB, an L1 */
#define ROWS_OUTER 16
#define ROW_BLOCK 256
/* one row takes the row-at-a-time path, faster there (Zen 4, 2 cores, SmolLM2's 30 layers 6.2
 * against the fused panels' 9.7 ms; Q4_K layers 1.8 against 2.8). From 2 rows the fused panels
 * win (layers at 2 rows 9.7 against the tiles' 11.1, at 3 11.0 against 13.2; Q4_K 2.9 against
 * 4.3); before them, chunked panels lost at 2-3 rows (13.4 against 11.0 ms at 2). */
#define OUTER_MIN_ROWS 2

static inline __attribute__((always_inline)) void outer(
    int rows, const float *x, int64_t ldx, const float *wt, int64_t kc, float *out, int64_t ldo,
    int first, __mmask16 mask) {
    __m512 acc[ROWS_OUTER];
    for (int r = 0; r < rows; r++)
        acc[r] = first ? _mm512_setzero_ps() : _mm512_maskz_loadu_ps(mask, out + r * ldo);
    for (int64_t i = 0; i < kc; i++) {
        __m512 wv = _mm512_load_ps(wt + 16 * i);
        for (int r = 0; r < rows; r++) acc[r] = _mm512_fmadd_ps(_mm512_set1_ps(x[r * ldx + i]), wv, acc[r]);
    }
    for (int r = 0; r < rows; r++) _mm512_mask_storeu_ps(out + r * ldo, mask, acc[r]);
}

/* all m rows against one chunk of one panel; first: the chunk at k = 0 (sums start at 0) */
static void outer_rows(int64_t m, const float *x, int64_t ldx, const float *wt, int64_t kc,
                       float *out, int64_t ldo, int first, __mmask16 mask) {
    for (int64_t r = 0; r < m; r += ROWS_OUTER, x += ROWS_OUTER * ldx, out += ROWS_OUTER * ldo) {
        switch (m - r < ROWS_OUTER ? m - r : ROWS_OUTER) {  /* a constant row count in each */
#define CASE(R) case R: outer(R, x, ldx, wt, kc, out, ldo, first, mask); break;
        CASE(1) CASE(2) CASE(3) CASE(4) CASE(5) CASE(6) CASE(7) CASE(8)
        CASE(9) CASE(10) CASE(11) CASE(12) CASE(13) CASE(14) CASE(15) CASE(16)
#undef CASE
        }
    }
}

/* the channels of the panel from n0 (16 but the last); the bytes of the panel after it (0: none) */
static inline int panel_channels(int64_t n0, int64_t n) { return n - n0 < 16 ? (int)(n - n0) : 16; }

static inline int64_t next_panel_bytes(int64_t n0, int64_t n, int64_t row_bytes) {
    return n0 + 16 < n ? panel_channels(n0 + 16, n) * row_bytes : 0;
}

/* One panel (16 channels from n0) against rows of x, KC weights of k at a time; the next
 * panel's blocks are prefetched into L2 a slice a chunk meanwhile (a panel reads 16 rows of
 * blocks in step, more streams than the hardware prefetchers follow: without it, the cold
 * weights of SmolLM2 at 2 rows took 20 ms, with it 13). */
static void panel(int qtype, const float *x, int64_t rows, int64_t k, int64_t ldx, const uint8_t *w,
                  int64_t row_bytes, int64_t n0, int64_t n, float *out, int64_t ldo, float *wt) {
    int channels = panel_channels(n0, n);
    __mmask16 mask = (__mmask16)((1u << channels) - 1);
    const char *next = (const char *)(w + (n0 + 16) * row_bytes);
    int64_t span = next_panel_bytes(n0, n, row_bytes);
    int64_t slice = (span / ((k + KC - 1) / KC) + 63) & ~(int64_t)63, fetched = 0;
    for (int64_t k0 = 0; k0 < k; k0 += KC) {
        int64_t kc = k - k0 < KC ? k - k0 : KC;
        for (int64_t o = 0; o < slice && fetched < span; o += 64, fetched += 64)
            _mm_prefetch(next + fetched, _MM_HINT_T1);
        gguf_dequant_panel(qtype, w + n0 * row_bytes, row_bytes, channels, k0, kc, wt);
        outer_rows(rows, x + k0, ldx, wt, kc, out + n0, ldo, k0 == 0, mask);
    }
}

/* One panel against m <= ROWS_OUTER rows of x, transposed (xt, mp >= m rows: m rounded up to
 * even, the padding zeros), dequantised and multiplied a block at a time (gguf_fused_panel);
 * the next panel's blocks prefetched meanwhile, as panel() does. */
static void fused_panel(int qtype, const float *xt, int64_t m, int64_t mp, int64_t k, const uint8_t *w,
                        int64_t row_bytes, int64_t n0, int64_t n, float *out, int64_t ldo) {
    gguf_fused_panel(qtype, (int)mp, (int)m, xt, w + n0 * row_bytes, row_bytes, panel_channels(n0, n), k, out + n0,
                     ldo, w + (n0 + 16) * row_bytes, next_panel_bytes(n0, n, row_bytes));
}

static int outer_gemm(int qtype, int threads, const float *x, int64_t m, int64_t k, int64_t ldx,
                      const uint8_t *w, int64_t n, float *out, int64_t ldo) {
    int64_t row_bytes = k / gguf_block_elements(qtype) * gguf_block_bytes(qtype), panels = (n + 15) / 16;
    if (m <= ROWS_OUTER) {
        int64_t mp = (m + 1) & ~(int64_t)1;
        float *xt = aligned_alloc(64, sizeof(float) * ((mp * k + 15) & ~(int64_t)15));
        if (!xt) return -2;
        for (int64_t i = 0; i < k; i++) {
            for (int64_t r = 0; r < m; r++) xt[i * mp + r] = x[r * ldx + i];
            if (mp > m) xt[i * mp + m] = 0.0f;
        }
#pragma omp parallel for num_threads(threads) schedule(static)
        for (int64_t p = 0; p < panels; p++) fused_panel(qtype, xt, m, mp, k, w, row_bytes, 16 * p, n, out, ldo);
        free(xt);
        return 0;
    }
    /* Rows of x whose stride is a multiple of 2 KiB (k = 512, 1024, 4096, ...) fall in one or
     * two L1 sets, and 16 of them thrash its 8 ways (K = 4096 at 16 rows took 18.4 ms where 8
     * rows took 6.1): those are copied ld = k + 16 floats apart, each row a set further. Others
     * are read in place (the copy cost SmolLM2's K = 576 about 4%). */
    int pack = ldx % 512 == 0;
    int64_t ld = pack ? k + 16 : ldx, block = m < ROW_BLOCK ? m : ROW_BLOCK;
    float *xp = pack ? aligned_alloc(64, sizeof(float) * block * ld) : NULL;
    if (pack && !xp) return -2;
    int failed = 0;
#pragma omp parallel num_threads(threads)
    {
        float *wt = aligned_alloc(64, sizeof(float) * 16 * KC);
        if (!wt) {
#pragma omp atomic write
            failed = 1;
        }
        /* ROW_BLOCK rows of x at a time, which stay in L2 while the panels pass */
        for (int64_t r0 = 0; r0 < m; r0 += ROW_BLOCK) {
            int64_t rows = m - r0 < ROW_BLOCK ? m - r0 : ROW_BLOCK;
            const float *xr = x + r0 * ldx;
            if (pack) {
#pragma omp for schedule(static)
                for (int64_t r = 0; r < rows; r++) memcpy(xp + r * ld, xr + r * ldx, sizeof(float) * k);
                xr = xp;
            }
#pragma omp for schedule(static)
            for (int64_t p = 0; p < panels; p++)
                if (wt) panel(qtype, xr, rows, k, ld, w, row_bytes, 16 * p, n, out + r0 * ldo, ldo, wt);
        }
        free(wt);
    }
    free(xp);
    return failed ? -2 : 0;
}
#endif

/* On `threads` OpenMP threads; panels: whether the outer-product path may run (where built,
 * for the types it takes, from OUTER_MIN_ROWS rows). Returns 0; -1 for an unsupported type or a
 * k that is not whole blocks; -2 when a thread's buffer could not be allocated. */
int gguf_gemm_f32(int qtype, int threads, const float *x, int64_t m, int64_t k, int64_t ldx,
                  const uint8_t *w, int64_t n, float *out, int64_t ldo, int panels) {
    int64_t elements = gguf_block_elements(qtype);
    if (!elements || k % elements) return -1;
    int64_t row_bytes = k / elements * gguf_block_bytes(qtype);
    if (m == 1) {  /* a decode step of one request: no buffer */
        float *xsums = malloc(sizeof(float) * (k / 32));
        if (!xsums) return -2;
        for (int64_t b = 0; b < k / 32; b++) {
            float sum = 0.0f;
            for (int j = 0; j < 32; j++) sum += x[32 * b + j];
            xsums[b] = sum;
        }
        int legacy = is_legacy(qtype);
#pragma omp parallel for num_threads(threads) schedule(static)
        for (int64_t c = 0; c < n; c++) {
            prefetch_ahead(w + c * row_bytes, row_bytes);
            out[c] = legacy ? legacy_dot(qtype, x, xsums, w + c * row_bytes, k / 32, gguf_block_bytes(qtype))
                            : kquant_dot(qtype, x, xsums, w + c * row_bytes, k / 256);
        }
        free(xsums);
        return 0;
    }
#if VECTORISED && LANES == 16
    if (panels && m >= OUTER_MIN_ROWS && gguf_panel_supported(qtype))
        return outer_gemm(qtype, threads, x, m, k, ldx, w, n, out, ldo);
#else
    (void)panels;
#endif
    int64_t groups = (n + CHANNELS - 1) / CHANNELS;
    int failed = 0;
#pragma omp parallel num_threads(threads)
    {
        float *buf = aligned_alloc(64, sizeof(float) * CHANNELS * k);  /* (whole vectors: k is) */
        if (!buf) {
#pragma omp atomic write
            failed = 1;
        }
#pragma omp for schedule(static)
        for (int64_t g = 0; g < groups; g++) {
            if (!buf) continue;
            int64_t n0 = g * CHANNELS;
            int channels = n - n0 < CHANNELS ? (int)(n - n0) : CHANNELS;
            if (qtype != GGUF_Q6_K) prefetch_ahead(w + n0 * row_bytes, channels * row_bytes);
            for (int c = 0; c < channels; c++) gguf_dequant_row(qtype, w + (n0 + c) * row_bytes, k, buf + c * k);
            tiles(m, channels, x, ldx, buf, k, out + n0, ldo);
        }
        free(buf);
    }
    return failed ? -2 : 0;
}

/* w [n rows of blocks] -> out [n, k] float32, rows on `threads` threads. */
int gguf_dequant_f32(int qtype, int threads, const uint8_t *w, int64_t n, int64_t k, float *out) {
    int64_t elements = gguf_block_elements(qtype);
    if (!elements || k % elements) return -1;
    int64_t row_bytes = k / elements * gguf_block_bytes(qtype);
#pragma omp parallel for num_threads(threads) schedule(static)
    for (int64_t r = 0; r < n; r++) gguf_dequant_row(qtype, w + r * row_bytes, k, out + r * k);
    return 0;
}
