/* GGUF blocks on the CPU: dequantisation (gguf_dequant.c) and products (gguf_gemm.c). */
#ifndef MMSERVE_GGUF_CPU_H
#define MMSERVE_GGUF_CPU_H

#include <stdint.h>

/* ggml's GGMLQuantizationType values */
enum { GGUF_Q4_0 = 2, GGUF_Q4_1 = 3, GGUF_Q5_0 = 6, GGUF_Q5_1 = 7, GGUF_Q8_0 = 8,
       GGUF_Q4_K = 12, GGUF_Q5_K = 13, GGUF_Q6_K = 14 };

/* 1 where the build vectorises with AVX-512 or AVX2 (cpu_vec.h; measured faster than float32
 * weights); elsewhere the generic code runs, correct but slower */
int gguf_cpu_vectorised(void);
int gguf_block_elements(int qtype);  /* 0: not a supported type */
int gguf_block_bytes(int qtype);
/* One row of k weights (k / elements blocks at row) -> y[k] float32. */
void gguf_dequant_row(int qtype, const uint8_t *restrict row, int64_t k, float *restrict y);
/* 1 where this build dequantises 16 channels transposed for qtype (gguf_panel.c) */
int gguf_panel_supported(int qtype);
/* Weights [k0, k0 + kc) of 16 channels (rows of blocks at w, row_bytes apart; those past
 * `channels` are garbage) -> wt[kc][16] float32, 64-byte aligned; k0, kc whole blocks. */
void gguf_dequant_panel(int qtype, const uint8_t *w, int64_t row_bytes, int channels, int64_t k0, int64_t kc,
                        float *wt);
/* out[r, c] = sum_k x[r, k] w[c, k] for the first `stored` of `rows` (even, 2..16) rows of x,
 * given transposed (xt[k * rows + r]), and the 16 channels at w (those past `channels` not
 * stored), each block dequantised as gguf_dequant_panel does and multiplied in registers at
 * once; fetch bytes at next prefetched into L2 meanwhile. */
void gguf_fused_panel(int qtype, int rows, int stored, const float *xt, const uint8_t *w, int64_t row_bytes,
                      int channels, int64_t k, float *out, int64_t ldo, const void *next, int64_t fetch);

#endif
