/* y = x W^T (+ bias) with W kept in GGUF's 4- or 8-bit blocks and x quantized to int8 on the fly, per
 * block of 32 values (llama.cpp's scheme): integer dot products on AVX512-VNNI (vpdpbusd, 64
 * multiply-adds per instruction, twice vdpbf16ps), one float multiply-add per block and output.
 * Built on first use by pagellm/kernels/__init__.py; wrapped by pagellm/kernels/gemm_int8.py.
 *
 * Weights (pack_weight_i8, from the dequantized float32 weight, each block checked value by value
 * by fit_q so nothing is approximated on this side):
 *   Q4_1  w = d * q + m, q in 0..15   ->  sum_k w x_k = d dx sum_k q xq_k + m (dx sum_k xq_k)
 *   Q8_0  w = d * q,     q in -128..127 ->  d dx sum_k q xq_k
 * Activations (quantize_rows): per row and block of 32, dx = max|x| / 127 and xq = round(x / dx) in
 * -127..127, plus sx = dx * sum(xq) for the Q4_1 offset.
 *
 * Per panel of 32 outputs and block of 32 k, a record holds d[32] (float), then e[32]: m as float
 * for 4 bits, for 8 bits the int32 correction -128 * sum_k q (x is fed to vpdpbusd's unsigned side as
 * xq + 128 there, since both sides are signed), then the q: for each half of 16 outputs, 64-byte
 * vectors whose 32-bit lane j holds the q of 4 consecutive k of output j. 4 bits: 4 vectors per half,
 * vector g holding k-groups g (low nibbles) and g + 4 (high nibbles); 8 bits: 8 vectors per half.
 *
 * Every block's integer sum is exact, and the float work per row runs in block order, so a row's
 * result depends on nothing but that row (not on M, the tiling or the threads): batch invariant.
 */
#include <stdint.h>
#include <stdlib.h>
#include <string.h>
#ifdef __AVX512F__
#include <immintrin.h>
#endif
#include "gguf_blocks.h" /* QB, fit_q */
#include "gemm_tile.h"   /* NR, PanelOut, tile_height, store_tile */

#define MRQ 6 /* rows per tile: 2 x (int + float) accumulators per row, 24 of 32 registers */
#define RECB(bits) (2 * NR * 4 + ((bits) == 4 ? NR * QB / 2 : NR * QB)) /* bytes per record */

int gemm_i8_supported(void) {
#if defined(__AVX512F__) && defined(__AVX512VNNI__) && defined(__AVX512BW__)
  return 1;
#else
  return 0;
#endif
}

int64_t packed_size_i8(int64_t N, int64_t K, int64_t bits) { return (N + NR - 1) / NR * (K / QB) * RECB(bits); }

/* Pack w [N, K] (K a multiple of 32) into dst (packed_size_i8 bytes) if every run of 32 is exactly a
 * block of `bits`; 1 if it packed, 0 if not (dst is then garbage). */
int pack_weight_i8(uint8_t *dst, const float *w, int64_t N, int64_t K, int64_t bits) {
#if defined(__AVX512F__)
  if (K % QB != 0 || (bits != 4 && bits != 8)) return 0;
  const int64_t P = (N + NR - 1) / NR, B = K / QB, rec_size = RECB(bits);
  int failed = 0;
#pragma omp parallel for schedule(static)
  for (int64_t pb = 0; pb < P * B; ++pb) {
    if (__atomic_load_n(&failed, __ATOMIC_RELAXED)) continue;
    const int64_t p = pb / B, b = pb % B;
    uint8_t *rec = dst + pb * rec_size;
    float *d_rec = (float *)rec;
    float *m_rec = (float *)rec + NR;
    int32_t *c_rec = (int32_t *)rec + NR;
    uint8_t *qs = rec + 2 * NR * 4;
    memset(qs, 0, rec_size - 2 * NR * 4);
    for (int j = 0; j < NR; ++j) {
      const int64_t n = p * NR + j;
      int q[QB] = {0};
      float d = 0.f, m = 0.f; /* padding outputs: d = m = q = 0 */
      if (n < N && !fit_q(w + n * K + b * QB, &d, &m, q, (int)bits)) __atomic_store_n(&failed, 1, __ATOMIC_RELAXED);
      d_rec[j] = d;
      const int half = j / 16, lane = j % 16;
      if (bits == 4) {
        m_rec[j] = m;
        for (int k = 0; k < QB; ++k) {
          const int g = k / 4; /* group of 4 k: vector g % 4, low nibbles for g < 4 */
          qs[(half * 4 + g % 4) * 64 + lane * 4 + k % 4] |= (uint8_t)(q[k] << (g < 4 ? 0 : 4));
        }
      } else {
        int32_t sum = 0;
        for (int k = 0; k < QB; ++k) {
          qs[(half * 8 + k / 4) * 64 + lane * 4 + k % 4] = (uint8_t)(int8_t)q[k];
          sum += q[k];
        }
        c_rec[j] = -128 * sum;
      }
    }
  }
  return !failed;
#else
  (void)dst; (void)w; (void)N; (void)K; (void)bits;
  return 0;
#endif
}

#if defined(__AVX512F__) && defined(__AVX512VNNI__) && defined(__AVX512BW__)
/* One row of x: xq[K] int8 (4-byte groups read as int32), and per block dx and sx = dx * sum(xq). */
static void quantize_row(const float *x, int8_t *xq, float *dx, float *sx, int64_t K) {
  for (int64_t b = 0; b < K / QB; ++b) {
    const __m512 v0 = _mm512_loadu_ps(x + b * QB), v1 = _mm512_loadu_ps(x + b * QB + 16);
    const float amax = _mm512_reduce_max_ps(_mm512_max_ps(_mm512_abs_ps(v0), _mm512_abs_ps(v1)));
    const float d = amax / 127.f, id = amax > 0.f ? 127.f / amax : 0.f;
    const __m512 s = _mm512_set1_ps(id);
    const __m512i q0 = _mm512_cvt_roundps_epi32(_mm512_mul_ps(v0, s), RN);
    const __m512i q1 = _mm512_cvt_roundps_epi32(_mm512_mul_ps(v1, s), RN);
    _mm_storeu_si128((__m128i *)(xq + b * QB), _mm512_cvtsepi32_epi8(q0));
    _mm_storeu_si128((__m128i *)(xq + b * QB + 16), _mm512_cvtsepi32_epi8(q1));
    dx[b] = d;
    sx[b] = d * (float)_mm512_reduce_add_epi32(_mm512_add_epi32(q0, q1));
  }
}

/* Rows [0, R) of one panel over all blocks. xq rows are K bytes apart, dx / sx rows B floats apart.
 * Tile t of T also prefetches the next panel's records t, t + T, ... */
static inline __attribute__((always_inline)) void tile_i8(float *y, int64_t ldy, const int8_t *xq, const float *dx,
                                                          const float *sx, const uint8_t *rec, const float *bias,
                                                          int64_t K, __mmask16 m0, __mmask16 m1, const int R,
                                                          const uint8_t *next, int64_t T, int64_t t, const int bits) {
  const int64_t B = K / QB, rec_size = RECB(bits);
  __m512 acc[MRQ][2];
  for (int r = 0; r < R; ++r) acc[r][0] = acc[r][1] = _mm512_setzero_ps();
  const __m512i low = _mm512_set1_epi8(0x0F), flip = _mm512_set1_epi8((char)0x80);
  for (int64_t b = 0; b < B; ++b, rec += rec_size) {
    if (b % T == t)
      for (int64_t c = 0; c < rec_size; c += 64) _mm_prefetch((const char *)(next + b * rec_size + c), _MM_HINT_T1);
    const uint8_t *qs = rec + 2 * NR * 4;
    __m512i is[MRQ][2];
    for (int r = 0; r < R; ++r) is[r][0] = is[r][1] = _mm512_setzero_si512();
    const int32_t *xk = (const int32_t *)(xq + b * QB); /* the 8 groups of 4 int8 of this block */
    if (bits == 4) {
      for (int g = 0; g < 4; ++g) {
        const __m512i v0 = _mm512_loadu_si512(qs + g * 64), v1 = _mm512_loadu_si512(qs + (4 + g) * 64);
        const __m512i lo0 = _mm512_and_si512(v0, low), hi0 = _mm512_and_si512(_mm512_srli_epi16(v0, 4), low);
        const __m512i lo1 = _mm512_and_si512(v1, low), hi1 = _mm512_and_si512(_mm512_srli_epi16(v1, 4), low);
        for (int r = 0; r < R; ++r) {
          const __m512i xa = _mm512_set1_epi32(xk[r * K / 4 + g]), xb = _mm512_set1_epi32(xk[r * K / 4 + g + 4]);
          is[r][0] = _mm512_dpbusd_epi32(_mm512_dpbusd_epi32(is[r][0], lo0, xa), hi0, xb);
          is[r][1] = _mm512_dpbusd_epi32(_mm512_dpbusd_epi32(is[r][1], lo1, xa), hi1, xb);
        }
      }
    } else {
      for (int g = 0; g < 8; ++g) {
        const __m512i w0 = _mm512_loadu_si512(qs + g * 64), w1 = _mm512_loadu_si512(qs + (8 + g) * 64);
        for (int r = 0; r < R; ++r) {
          const __m512i xu = _mm512_xor_si512(_mm512_set1_epi32(xk[r * K / 4 + g]), flip); /* xq + 128 */
          is[r][0] = _mm512_dpbusd_epi32(is[r][0], xu, w0);
          is[r][1] = _mm512_dpbusd_epi32(is[r][1], xu, w1);
        }
      }
      const __m512i c0 = _mm512_loadu_si512(rec + NR * 4), c1 = _mm512_loadu_si512(rec + NR * 4 + 64);
      for (int r = 0; r < R; ++r) {
        is[r][0] = _mm512_add_epi32(is[r][0], c0);
        is[r][1] = _mm512_add_epi32(is[r][1], c1);
      }
    }
    const __m512 d0 = _mm512_loadu_ps((const float *)rec), d1 = _mm512_loadu_ps((const float *)rec + 16);
    for (int r = 0; r < R; ++r) {
      const __m512 s = _mm512_set1_ps(dx[r * B + b]);
      acc[r][0] = _mm512_fmadd_ps(_mm512_cvtepi32_ps(is[r][0]), _mm512_mul_ps(d0, s), acc[r][0]);
      acc[r][1] = _mm512_fmadd_ps(_mm512_cvtepi32_ps(is[r][1]), _mm512_mul_ps(d1, s), acc[r][1]);
    }
    if (bits == 4) {
      const __m512 e0 = _mm512_loadu_ps((const float *)rec + NR), e1 = _mm512_loadu_ps((const float *)rec + NR + 16);
      for (int r = 0; r < R; ++r) {
        const __m512 s = _mm512_set1_ps(sx[r * B + b]);
        acc[r][0] = _mm512_fmadd_ps(e0, s, acc[r][0]);
        acc[r][1] = _mm512_fmadd_ps(e1, s, acc[r][1]);
      }
    }
  }
  store_tile(y, ldy, acc, bias, m0, m1, R);
}

#define CASE_I8(R) case R: TILE_I8(R); break;
#define TILE_I8(R)                                                                                  \
  if (bits == 4) tile_i8(yy, ldy, xx, dd, ss, w, bb, K, m0, m1, R, wn, tiles, t, 4);                \
  else tile_i8(yy, ldy, xx, dd, ss, w, bb, K, m0, m1, R, wn, tiles, t, 8)

/* Quantized rows [0, M) against every panel (split between threads in contiguous ranges). */
static void row_block_i8(float *y, int64_t ldy, const int8_t *xq, const float *dx, const float *sx,
                         const uint8_t *wp, const float *bias, int64_t M, int64_t N, int64_t K, const int bits) {
  const int64_t P = (N + NR - 1) / NR, B = K / QB, panel = B * RECB(bits);
  const int64_t tiles = (M + MRQ - 1) / MRQ;
#pragma omp parallel for schedule(static)
  for (int64_t p = 0; p < P; ++p) {
    const uint8_t *w = wp + p * panel;
    const uint8_t *wn = p + 1 < P ? w + panel : w;
    const PanelOut out = panel_out(p, N, bias);
    const __mmask16 m0 = out.m0, m1 = out.m1;
    const float *bb = out.bias;
    int64_t m = 0;
    for (int64_t t = 0; t < tiles; ++t) {
      const int64_t rows = tile_height(M, m, tiles, t);
      float *yy = y + m * ldy + p * NR;
      const int8_t *xx = xq + m * K;
      const float *dd = dx + m * B, *ss = sx + m * B;
      switch (rows) {
        CASE_I8(1) CASE_I8(2) CASE_I8(3) CASE_I8(4) CASE_I8(5)
        default: TILE_I8(6); break;
      }
      m += rows;
    }
  }
}
#endif

/* y = x W^T (+ bias) for W packed by pack_weight_i8 in `bits`; 0, or -1 if the scratch for the
 * quantized x could not be allocated (or the kernel is not built here). */
int gemm_packed_i8(float *y, int64_t ldy, const float *x, int64_t ldx, const uint8_t *wp, const float *bias,
                   int64_t M, int64_t N, int64_t K, int64_t bits) {
#if defined(__AVX512F__) && defined(__AVX512VNNI__) && defined(__AVX512BW__)
  const int64_t B = K / QB;
  int8_t *xq = (int8_t *)malloc((size_t)(M ? M : 1) * (K + 8 * B));
  if (xq == NULL) return -1;
  float *dx = (float *)(xq + M * K), *sx = dx + M * B; /* K is a multiple of 32: aligned for floats */
  /* Rows are independent, so splitting them never changes a bit; from 8192 values (a 64-row decode
   * step at K = 576 is 36,864) the second thread pays for the parallel region. */
#pragma omp parallel for schedule(static) if (M * K >= 8192)
  for (int64_t m = 0; m < M; ++m) quantize_row(x + m * ldx, xq + m * K, dx + m * B, sx + m * B, K);
  /* Row blocks whose quantized x stays in L2 while every panel streams past it. */
  const int64_t rows = 256 / MRQ * MRQ;
  for (int64_t m = 0; m < M; m += rows) {
    const int64_t r = M - m < rows ? M - m : rows;
    if (bits == 4)
      row_block_i8(y + m * ldy, ldy, xq + m * K, dx + m * B, sx + m * B, wp, bias, r, N, K, 4);
    else
      row_block_i8(y + m * ldy, ldy, xq + m * K, dx + m * B, sx + m * B, wp, bias, r, N, K, 8);
  }
  free(xq);
  return 0;
#else
  (void)y; (void)ldy; (void)x; (void)ldx; (void)wp; (void)bias; (void)M; (void)N; (void)K; (void)bits;
  return -1;
#endif
}
