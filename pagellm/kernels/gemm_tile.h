/* What the GEMM kernels share about a panel of 32 outputs (included by gemm.c and gemm_int8.c;
 * pagellm/kernels/__init__.py hashes this header into every kernel's build key). */
#ifndef PAGELLM_GEMM_TILE_H
#define PAGELLM_GEMM_TILE_H
#include <stdint.h>
#ifdef __AVX512F__
#include <immintrin.h>
#endif

#define NR 32 /* outputs per panel: two 16-float registers */

#ifdef __AVX512F__
/* The two 16-lane masks of a panel with `left` outputs still to write (the last panel may be partial). */
static inline void panel_masks(int64_t left, __mmask16 *m0, __mmask16 *m1) {
  *m0 = left >= 16 ? 0xFFFF : (__mmask16)((1u << left) - 1);
  *m1 = left >= 32 ? 0xFFFF : left <= 16 ? 0 : (__mmask16)((1u << (left - 16)) - 1);
}

/* A finished tile: y[r][0:32] = acc[r] (+ bias), columns masked to m0 | m1. */
static inline __attribute__((always_inline)) void store_tile(float *y, int64_t ldy, __m512 acc[][2], const float *bias,
                                                             __mmask16 m0, __mmask16 m1, const int R) {
  if (bias != NULL) {
    const __m512 b0 = _mm512_maskz_loadu_ps(m0, bias), b1 = _mm512_maskz_loadu_ps(m1, bias + 16);
    for (int r = 0; r < R; ++r) {
      acc[r][0] = _mm512_add_ps(acc[r][0], b0);
      acc[r][1] = _mm512_add_ps(acc[r][1], b1);
    }
  }
  for (int r = 0; r < R; ++r) {
    _mm512_mask_storeu_ps(y + r * ldy, m0, acc[r][0]);
    _mm512_mask_storeu_ps(y + r * ldy + 16, m1, acc[r][1]);
  }
}

#endif

#endif
