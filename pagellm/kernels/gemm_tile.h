/* What the GEMM kernels share about a panel of 32 outputs (included by gemm.c, gemm_int8.c and
 * paged_prefill_amx.c, which takes its AMX set-up;
 * pagellm/kernels/__init__.py hashes this header into every kernel's build key). */
#ifndef PAGELLM_GEMM_TILE_H
#define PAGELLM_GEMM_TILE_H
#include <stdint.h>
#if defined(__AVX512F__) || (defined(__AVX2__) && defined(__FMA__))
#include <immintrin.h>
#endif
#include <string.h>

#define NR 32 /* outputs per panel: two 16-float registers (four of 8 on AVX2) */

/* Rows are split into `tiles` tiles of near-equal height (64 rows in tiles of at most 14: 5 of
 * 12-13, not 4 of 14 and one of 8): the height of tile t, which starts at row m. */
static inline int64_t tile_height(int64_t M, int64_t m, int64_t tiles, int64_t t) {
  return (M - m + (tiles - t) - 1) / (tiles - t);
}

#ifdef __AVX512F__
/* Panel p of a weight with N outputs: its two 16-lane output masks (the last panel may be partial)
 * and its share of the bias (NULL without one). */
typedef struct {
  __mmask16 m0, m1;
  const float *bias;
} PanelOut;

static inline PanelOut panel_out(int64_t p, int64_t N, const float *bias) {
  const int64_t left = N - p * NR;
  PanelOut o;
  o.m0 = left >= 16 ? 0xFFFF : (__mmask16)((1u << left) - 1);
  o.m1 = left >= 32 ? 0xFFFF : left <= 16 ? 0 : (__mmask16)((1u << (left - 16)) - 1);
  o.bias = bias == NULL ? NULL : bias + p * NR;
  return o;
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

#elif defined(__AVX2__) && defined(__FMA__)
/* AVX2 has no lane masks: a panel's live columns and its share of the bias (NULL without one). */
typedef struct {
  int cols;
  const float *bias;
} PanelOut;

static inline PanelOut panel_out(int64_t p, int64_t N, const float *bias) {
  const int64_t left = N - p * NR;
  PanelOut o;
  o.cols = left >= NR ? NR : (int)left;
  o.bias = bias == NULL ? NULL : bias + p * NR;
  return o;
}

/* A finished tile: y[r][0:cols] = acc[r] (+ bias); a partial panel goes through a buffer. */
static inline __attribute__((always_inline)) void store_tile(float *y, int64_t ldy, __m256 acc[][4], const PanelOut out,
                                                             const int R) {
  /* (acc read by constant indices only, so the caller's loop keeps it in registers) */
  float b[NR] = {0}, t[NR];
  if (out.bias != NULL) memcpy(b, out.bias, sizeof(float) * out.cols);
  for (int r = 0; r < R; ++r) {
    __m256 v0 = acc[r][0], v1 = acc[r][1], v2 = acc[r][2], v3 = acc[r][3];
    if (out.bias != NULL) {
      v0 = _mm256_add_ps(v0, _mm256_loadu_ps(b));
      v1 = _mm256_add_ps(v1, _mm256_loadu_ps(b + 8));
      v2 = _mm256_add_ps(v2, _mm256_loadu_ps(b + 16));
      v3 = _mm256_add_ps(v3, _mm256_loadu_ps(b + 24));
    }
    float *dst = out.cols == NR ? y + r * ldy : t;
    _mm256_storeu_ps(dst, v0);
    _mm256_storeu_ps(dst + 8, v1);
    _mm256_storeu_ps(dst + 16, v2);
    _mm256_storeu_ps(dst + 24, v3);
    if (out.cols != NR) memcpy(y + r * ldy, t, sizeof(float) * out.cols);
  }
}
#endif

#ifdef __AMX_TILE__
#include <sys/syscall.h>
#include <unistd.h>
#define ARCH_REQ_XCOMP_PERM 0x1023
#define XFEATURE_XTILEDATA 18

/* Linux hands out the AMX tile state only on request, once per process. */
static int amx_ready(void) {
  static int state = 0; /* 0 unknown, 1 granted, -1 refused */
  if (state == 0) state = syscall(SYS_arch_prctl, ARCH_REQ_XCOMP_PERM, XFEATURE_XTILEDATA) == 0 ? 1 : -1;
  return state == 1;
}

/* ldtilecfg's 64-byte operand (palette 1). */
typedef struct {
  uint8_t palette_id, start_row, reserved[14];
  uint16_t colsb[16];
  uint8_t rows[16];
} TileConfig;

/* Tiles 0-7 all 16 rows of 64 bytes: 16 x 16 float32 sums, 16 rows x 32 bfloat16 (or 64 int8), or 16
 * pairs (quads) of k x 16 outputs. The tile state is per thread: each thread configures its own. */
static inline void amx_configure_16x64(void) {
  TileConfig cfg;
  memset(&cfg, 0, sizeof cfg);
  cfg.palette_id = 1;
  for (int t = 0; t < 8; ++t) cfg.rows[t] = 16, cfg.colsb[t] = 64;
  _tile_loadconfig(&cfg);
}
#endif

#endif
