/* y = x W^T (+ bias) on CPU with W packed once at load time (float32; 4/8-bit exact copies; bfloat16 on
 * AMX tiles or AVX512-BF16 dot products, at the end of this file). Built on first use by
 * pagellm/kernels/__init__.py.
 *
 * MKL's sgemm (behind F.linear) re-packs W on every call. At decode batch sizes (M = 1..64 rows)
 * that packing and a cold weight stream cost up to half the time: measured here 1.3-2.3x slower
 * than this kernel for M = 8..64 (benchmarks/gemm.py). Packing W once into panels of 32 output
 * features, [ceil(N / 32)][K][32], makes each panel one contiguous stream that is read from memory
 * once per call and then from L2 for every tile of rows. Each thread walks its panels in order and
 * prefetches the next one into L2 while it computes on this one, so the weight stream overlaps the
 * arithmetic instead of stalling the first tile of every panel (prefetching the current panel a
 * few KiB ahead instead was 3-20 % slower at 16-128 rows, benchmarks/gemm.py --baseline-source).
 *
 * x:    [M, K] rows ldx apart (last dimension contiguous)
 * wp:   the packed weight (pack_weight_f32), N padded with zero columns to a multiple of 32
 * bias: [N] or NULL
 * y:    [M, N] rows ldy apart
 *
 * The micro-kernel holds a tile of up to 14 rows x 32 outputs in 28 AVX-512 registers and walks
 * K once: per k, two weight loads and one broadcast of x per row feed two FMAs per row. Every
 * output is the plain sum over k in order, so the result does not depend on M, on the tiling or
 * on the number of threads. The AVX2 path (with FMA) holds 3 rows x 32 outputs in 12 of its 16
 * registers and runs the very same FMAs in the same order, so it gives the same bits. Without
 * either (gemm_f32_supported() says so) the caller keeps F.linear.
 */
#include <math.h>
#include <stdint.h>
#include <stdlib.h>
#include <string.h>
#if defined(__AVX512F__) || (defined(__AVX2__) && defined(__FMA__))
#include <immintrin.h>
#endif
#if !defined(__AVX512F__) && defined(__AVX2__) && defined(__FMA__)
#define GEMM_AVX2 1
#endif
#include "gguf_blocks.h" /* QB, RN, fit_q */
#include "gemm_tile.h"   /* NR, PanelOut, tile_height, store_tile */
#include "simd_common.h" /* exp512: the SiLU of silu_and_mul_f32 */

#ifdef __AVX512F__
#define MR 14 /* rows per tile: 28 accumulators + 2 weights + 1 broadcast of 32 registers */
#else
#define MR 3 /* AVX2: 12 accumulators + 1 broadcast of 16 registers (weights as memory operands) */
#endif
#ifdef __AVX512F__
#define STORE_PANEL(y, ldy, acc, out, R) store_tile(y, ldy, acc, (out).bias, (out).m0, (out).m1, R)
#else /* AVX2's store_tile takes the panel's column count */
#define STORE_PANEL(y, ldy, acc, out, R) store_tile(y, ldy, acc, out, R)
#endif
#define XBLOCK (1024 * 1024) /* bytes of x per row block: it stays in L2 (2 MiB) across all panels */

int gemm_f32_supported(void) {
#if defined(__AVX512F__) || defined(GEMM_AVX2)
  return 1;
#else
  return 0;
#endif
}

int64_t packed_size_f32(int64_t N, int64_t K) { return (N + NR - 1) / NR * NR * K; }

/* dst[p][k][j] = w[p * 32 + j][k], zero past N. */
void pack_weight_f32(float *dst, const float *w, int64_t N, int64_t K) {
  const int64_t P = (N + NR - 1) / NR;
#pragma omp parallel for schedule(static)
  for (int64_t p = 0; p < P; ++p)
    for (int64_t k = 0; k < K; ++k)
      for (int64_t j = 0; j < NR; ++j) {
        const int64_t n = p * NR + j;
        dst[(p * K + k) * NR + j] = n < N ? w[n * K + k] : 0.f;
      }
}

#if defined(__AVX512F__) || defined(GEMM_AVX2)
/* Rows [0, R) of one panel: y[r][0:32] = x[r] . panel (+ bias), columns masked to `mask`.
 * Meanwhile, one row of `next` (2 cache lines) is prefetched into L2 every T steps of k: the T
 * tiles of a panel together bring in the whole next panel while this one computes from L2. On
 * AVX2, per k, each of the panel's four 8-output weight vectors feeds one FMA per row. */
static inline __attribute__((always_inline)) void tile(float *y, int64_t ldy, const float *x, int64_t ldx,
                                                       const float *wp, const PanelOut out, int64_t K, const int R,
                                                       const float *next, int64_t T, const int bf16) {
#ifdef __AVX512F__
  __m512 acc[MR][2];
  for (int r = 0; r < R; ++r) acc[r][0] = acc[r][1] = _mm512_setzero_ps();
#else
  __m256 acc[MR][4]; /* (indexed by constants only: GCC then keeps it in registers) */
  for (int r = 0; r < R; ++r) acc[r][0] = acc[r][1] = acc[r][2] = acc[r][3] = _mm256_setzero_ps();
#endif
  int64_t c = 0;
  for (int64_t k = 0; k < K; ++k) {
    if (++c == T) {
      c = 0;
      _mm_prefetch((const char *)next, _MM_HINT_T1);
      _mm_prefetch((const char *)(next + 16), _MM_HINT_T1);
      next += NR;
    }
#ifdef __AVX512BF16__
    if (bf16) { /* x and the panel hold bf16 pairs (k = 2i, 2i + 1; K counts pairs): one vdpbf16ps
                 * per 16 outputs adds both products of a pair, the same order for every row */
      const __m512bh w0 = (__m512bh)_mm512_loadu_si512(wp + k * NR), w1 = (__m512bh)_mm512_loadu_si512(wp + k * NR + 16);
      for (int r = 0; r < R; ++r) {
        const __m512bh xb = (__m512bh)_mm512_set1_epi32(((const int32_t *)x)[r * ldx + k]);
        acc[r][0] = _mm512_dpbf16_ps(acc[r][0], xb, w0);
        acc[r][1] = _mm512_dpbf16_ps(acc[r][1], xb, w1);
      }
      continue;
    }
#endif
#ifdef __AVX512F__
    const __m512 w0 = _mm512_loadu_ps(wp + k * NR), w1 = _mm512_loadu_ps(wp + k * NR + 16);
    for (int r = 0; r < R; ++r) {
      const __m512 xb = _mm512_set1_ps(x[r * ldx + k]);
      acc[r][0] = _mm512_fmadd_ps(xb, w0, acc[r][0]);
      acc[r][1] = _mm512_fmadd_ps(xb, w1, acc[r][1]);
    }
#else
    const float *wk = wp + k * NR;
    for (int r = 0; r < R; ++r) {
      const __m256 xb = _mm256_broadcast_ss(x + r * ldx + k);
      acc[r][0] = _mm256_fmadd_ps(xb, _mm256_loadu_ps(wk), acc[r][0]);
      acc[r][1] = _mm256_fmadd_ps(xb, _mm256_loadu_ps(wk + 8), acc[r][1]);
      acc[r][2] = _mm256_fmadd_ps(xb, _mm256_loadu_ps(wk + 16), acc[r][2]);
      acc[r][3] = _mm256_fmadd_ps(xb, _mm256_loadu_ps(wk + 24), acc[r][3]);
    }
#endif
  }
  (void)bf16;
  STORE_PANEL(y, ldy, acc, out, R);
}
#endif

/* ---- 4- and 8-bit weights --------------------------------------------------------------------------
 * A weight whose every run of 32 values along K is exactly one of GGUF's quantized blocks, as its
 * reader dequantizes them, is packed a second time in that form:
 *   bits = 4 (Q4_1): fl(fl(d * q) + m), q in 0..15;   bits = 8 (Q8_0): fl(d * q), q in -128..127.
 * Per panel of 32 outputs and block of 32 k, a record holds d[32] (and for 4 bits m[32]) as floats,
 * then the q of the 32 k x 32 outputs: for 4 bits 16 bytes per k (output j in the low nibble of
 * byte j, output j + 16 in the high), for 8 bits 32 signed bytes per k. The kernel rebuilds each
 * weight with the same unfused multiply (and add), so it runs the very same FMAs on the very same
 * values as the float32 kernel, bit for bit, reading 0.75 (4 bits) or 1.125 (8 bits) bytes per
 * weight instead of 4: at decode batch sizes the weight stream, not the arithmetic, is what a step
 * waits for. */
#define QREC(bits) ((bits) == 4 ? 2 * NR + QB * 16 / 4 : NR + QB * 32 / 4) /* floats per record */

int64_t packed_size_q(int64_t N, int64_t K, int64_t bits) { return (N + NR - 1) / NR * (K / QB) * QREC(bits); }

/* Pack w [N, K] in `bits` (4 or 8) into dst (packed_size_q floats) if every run is exactly such a
 * block; returns 1 if it packed, 0 if some run is not (dst is then garbage) or K is not a multiple
 * of 32. */
int pack_weight_q(float *dst, const float *w, int64_t N, int64_t K, int64_t bits) {
#if defined(__AVX512F__) || defined(GEMM_AVX2)
  if (K % QB != 0 || (bits != 4 && bits != 8)) return 0;
  const int64_t P = (N + NR - 1) / NR, B = K / QB, rec_size = QREC(bits);
  const int qbytes = bits == 4 ? 16 : 32; /* per k */
  int failed = 0; /* set once by any thread; the others then skip the rest (a float32 model fails at once) */
#pragma omp parallel for schedule(static)
  for (int64_t pb = 0; pb < P * B; ++pb) {
    if (__atomic_load_n(&failed, __ATOMIC_RELAXED)) continue;
    const int64_t p = pb / B, b = pb % B;
    float *rec = dst + pb * rec_size;
    float *mrec = bits == 4 ? rec + NR : NULL;
    uint8_t *qs = (uint8_t *)(rec + (bits == 4 ? 2 * NR : NR));
    memset(qs, 0, QB * qbytes);
    for (int j = 0; j < NR; ++j) {
      const int64_t n = p * NR + j;
      int q[QB] = {0};
      float d = 0.f, m = 0.f; /* padding outputs: d = m = q = 0 */
      if (n < N && !fit_q(w + n * K + b * QB, &d, &m, q, (int)bits)) __atomic_store_n(&failed, 1, __ATOMIC_RELAXED);
      rec[j] = d;
      if (mrec) mrec[j] = m;
      for (int k = 0; k < QB; ++k) {
        if (bits == 4) qs[k * 16 + (j & 15)] |= (uint8_t)(q[k] << (j < 16 ? 0 : 4));
        else qs[k * 32 + j] = (uint8_t)(int8_t)q[k];
      }
    }
  }
  return !failed;
#else
  (void)dst; (void)w; (void)N; (void)K; (void)bits;
  return 0;
#endif
}

#ifdef GEMM_AVX2
/* Outputs 8j..8j+7 of a record's k-th weights: d * q (+ m), rounded after each step; the empty asm
 * keeps the compiler from contracting them into an FMA. 4 bits: the low nibbles of bytes 0-7 or
 * 8-15 (j < 2), then the high ones. */
static inline __attribute__((always_inline)) __m256 q_weights8(const float *rec, const uint8_t *qs, int k, const int j,
                                                               const int bits, const __m256i low) {
  __m256i q;
  if (bits == 4) {
    q = _mm256_cvtepu8_epi32(_mm_loadl_epi64((const __m128i *)(qs + k * 16 + 8 * (j & 1))));
    q = j < 2 ? _mm256_and_si256(q, low) : _mm256_srli_epi32(q, 4);
  } else {
    q = _mm256_cvtepi8_epi32(_mm_loadl_epi64((const __m128i *)(qs + k * 32 + 8 * j)));
  }
  __m256 w = _mm256_mul_ps(_mm256_loadu_ps(rec + 8 * j), _mm256_cvtepi32_ps(q));
  __asm__("" : "+x"(w));
  if (bits == 4) w = _mm256_add_ps(w, _mm256_loadu_ps(rec + NR + 8 * j));
  __asm__("" : "+x"(w));
  return w;
}
#endif

#if defined(__AVX512F__) || defined(GEMM_AVX2)
/* tile() over a panel of `bits` records. Tile t of T also prefetches the next panel's records t, t + T, ...
 * On AVX2 each 8-output weight vector is rebuilt with the same unfused multiply (and add):
 * q_weights8 (AVX-512's explicit rounding ops are never contracted). */
static inline __attribute__((always_inline)) void tile_q(float *y, int64_t ldy, const float *x, int64_t ldx,
                                                         const float *rec, const PanelOut out, int64_t K,
                                                         const int R, const float *next, int64_t T, int64_t t,
                                                         const int bits) {
#ifdef __AVX512F__
  __m512 acc[MR][2];
  for (int r = 0; r < R; ++r) acc[r][0] = acc[r][1] = _mm512_setzero_ps();
  const __m512i low = _mm512_set1_epi32(15);
#else
  __m256 acc[MR][4]; /* (indexed by constants only: GCC then keeps it in registers) */
  for (int r = 0; r < R; ++r) acc[r][0] = acc[r][1] = acc[r][2] = acc[r][3] = _mm256_setzero_ps();
  const __m256i low = _mm256_set1_epi32(15);
#endif
  const int64_t rec_size = QREC(bits);
  for (int64_t b = 0; b < K / QB; ++b, rec += rec_size) {
    if (b % T == t)
      for (int c = 0; c < rec_size; c += 16) _mm_prefetch((const char *)(next + b * rec_size + c), _MM_HINT_T1);
#ifdef __AVX512F__
    const __m512 d0 = _mm512_loadu_ps(rec), d1 = _mm512_loadu_ps(rec + 16);
    __m512 z0 = _mm512_setzero_ps(), z1 = z0;
    if (bits == 4) z0 = _mm512_loadu_ps(rec + NR), z1 = _mm512_loadu_ps(rec + NR + 16);
    const uint8_t *qs = (const uint8_t *)(rec + (bits == 4 ? 2 * NR : NR));
    for (int k = 0; k < QB; ++k) {
      __m512 w0, w1;
      if (bits == 4) {
        const __m512i v = _mm512_cvtepu8_epi32(_mm_loadu_si128((const __m128i *)(qs + k * 16)));
        w0 = _mm512_add_round_ps(_mm512_mul_round_ps(d0, _mm512_cvtepi32_ps(_mm512_and_si512(v, low)), RN), z0, RN);
        w1 = _mm512_add_round_ps(_mm512_mul_round_ps(d1, _mm512_cvtepi32_ps(_mm512_srli_epi32(v, 4)), RN), z1, RN);
      } else {
        const __m128i *qk = (const __m128i *)(qs + k * 32);
        w0 = _mm512_mul_round_ps(d0, _mm512_cvtepi32_ps(_mm512_cvtepi8_epi32(_mm_loadu_si128(qk))), RN);
        w1 = _mm512_mul_round_ps(d1, _mm512_cvtepi32_ps(_mm512_cvtepi8_epi32(_mm_loadu_si128(qk + 1))), RN);
      }
      const float *xk = x + b * QB + k;
      for (int r = 0; r < R; ++r) {
        const __m512 xb = _mm512_set1_ps(xk[r * ldx]);
        acc[r][0] = _mm512_fmadd_ps(xb, w0, acc[r][0]);
        acc[r][1] = _mm512_fmadd_ps(xb, w1, acc[r][1]);
      }
    }
#else
    const uint8_t *qs = (const uint8_t *)(rec + (bits == 4 ? 2 * NR : NR));
    for (int k = 0; k < QB; ++k) {
      const float *xk = x + b * QB + k;
      const __m256 w0 = q_weights8(rec, qs, k, 0, bits, low), w1 = q_weights8(rec, qs, k, 1, bits, low);
      const __m256 w2 = q_weights8(rec, qs, k, 2, bits, low), w3 = q_weights8(rec, qs, k, 3, bits, low);
      for (int r = 0; r < R; ++r) {
        const __m256 xb = _mm256_broadcast_ss(xk + r * ldx);
        acc[r][0] = _mm256_fmadd_ps(xb, w0, acc[r][0]);
        acc[r][1] = _mm256_fmadd_ps(xb, w1, acc[r][1]);
        acc[r][2] = _mm256_fmadd_ps(xb, w2, acc[r][2]);
        acc[r][3] = _mm256_fmadd_ps(xb, w3, acc[r][3]);
      }
    }
#endif
  }
  STORE_PANEL(y, ldy, acc, out, R);
}
#endif

#ifdef __AVX512BF16__
#define TILE_BF16(R) tile(yy, ldy, xx, ldx, w, out, K, R, wn + t * K / tiles * NR, tiles, 1)
#else
#define TILE_BF16(R) (void)0
#endif

#define CASE(R) case R: TILE(R); break;
#define TILE(R)                                                                 \
  if (bits == 4) tile_q(yy, ldy, xx, ldx, w, out, K, R, wn, tiles, t, 4);      \
  else if (bits == 8) tile_q(yy, ldy, xx, ldx, w, out, K, R, wn, tiles, t, 8); \
  else if (bits == 16) TILE_BF16(R);                                            \
  else tile(yy, ldy, xx, ldx, w, out, K, R, wn + t * K / tiles * NR, tiles, 0)

#if defined(__AVX512F__) || defined(GEMM_AVX2)
/* Rows [0, M) of x against one panel `w` (`wn`: the panel this thread takes next, prefetched a share
 * per tile) into y's columns of that panel. */
static inline __attribute__((always_inline)) void panel_rows(float *y, int64_t ldy, const float *x, int64_t ldx,
                                                             const float *w, const float *wn, const PanelOut out,
                                                             int64_t M, int64_t K, const int bits) {
  /* Rows in tiles of near-equal height (tile_height in gemm_tile.h). */
  const int64_t tiles = (M + MR - 1) / MR;
  int64_t m = 0;
  for (int64_t t = 0; t < tiles; ++t) {
    const int64_t rows = tile_height(M, m, tiles, t);
    float *yy = y + m * ldy;
    const float *xx = x + m * ldx;
    switch (rows) { /* a constant R per case, so the accumulators stay in registers */
#ifdef __AVX512F__
      CASE(1) CASE(2) CASE(3) CASE(4) CASE(5) CASE(6) CASE(7)
      CASE(8) CASE(9) CASE(10) CASE(11) CASE(12) CASE(13)
      default: TILE(14); break;
#else
      CASE(1) CASE(2)
      default: TILE(3); break;
#endif
    }
    m += rows;
  }
}
#endif

/* Floats (or bf16 pairs) per panel of `bits` weights. */
#define PANEL(bits, K) ((bits) == 32 || (bits) == 16 ? (K) * NR : (K) / QB * QREC(bits))

/* Rows [0, M) against every panel; the panels are split between the threads in contiguous ranges
 * (static schedule), so the panel after p is the one this thread takes next. bits: 32 for float32
 * panels (pack_weight_f32), 4 or 8 for quantized records (pack_weight_q), 16 for bfloat16 pair
 * panels (pack_weight_bf16; x and K in pairs then). */
static inline __attribute__((always_inline)) void row_block(float *y, int64_t ldy, const float *x, int64_t ldx,
                                                            const float *wp, const float *bias, int64_t M,
                                                            int64_t N, int64_t K, const int bits) {
#if defined(__AVX512F__) || defined(GEMM_AVX2)
  const int64_t P = (N + NR - 1) / NR;
  const int64_t panel = PANEL(bits, K);
#pragma omp parallel for schedule(static)
  for (int64_t p = 0; p < P; ++p) {
    const float *w = wp + p * panel;
    panel_rows(y + p * NR, ldy, x, ldx, w, p + 1 < P ? w + panel : w, panel_out(p, N, bias), M, K, bits);
  }
#else
  (void)y; (void)ldy; (void)x; (void)ldx; (void)wp; (void)bias; (void)M; (void)N; (void)K; (void)bits;
#endif
}

/* y = x W^T (+ bias) for W packed by pack_weight_q in `bits` (K a multiple of 32): the same results
 * as gemm_packed_f32 over the float32 W, bit for bit. For decode-sized M (no row blocks). */
void gemm_packed_q(float *y, int64_t ldy, const float *x, int64_t ldx, const float *wp, const float *bias,
                   int64_t M, int64_t N, int64_t K, int64_t bits) {
  if (bits == 4)
    row_block(y, ldy, x, ldx, wp, bias, M, N, K, 4);
  else
    row_block(y, ldy, x, ldx, wp, bias, M, N, K, 8);
}

void gemm_packed_f32(float *y, int64_t ldy, const float *x, int64_t ldx, const float *wp, const float *bias,
                     int64_t M, int64_t N, int64_t K) {
  /* Large M: blocks of rows whose x fits in L2, each against all panels. Without them the whole x
   * (4.7 MB at 2048 x 576) is re-read from L3 for every panel (0.86x MKL's speed). Each block
   * streams the weights once more, so blocks are as large as L2 allows: the decode batches the
   * layers send here (<= 128 rows) are one block for K <= 2048. */
  int64_t rows = XBLOCK / (4 * K) / MR * MR;
  if (rows < 4 * MR) rows = 4 * MR;
  for (int64_t m = 0; m < M; m += rows)
    row_block(y + m * ldy, ldy, x + m * ldx, ldx, wp, bias, M - m < rows ? M - m : rows, N, K, 32);
}

/* ---- bfloat16 ---------------------------------------------------------------------------------------
 * Weights rounded once to bfloat16 (nearest even) and packed as pairs: panel p, pair i holds, for
 * each of its 32 outputs j, (w[p * 32 + j][2i], w[..][2i + 1]) in one 32-bit slot (even k in the
 * low half), zero past N and past K. x is rounded to bfloat16 the same way, row by row, then every
 * output is the float32 sum of its pairs' products in k order (vdpbf16ps): half the weight bytes of
 * float32 and two multiply-adds per lane per instruction, and still the same result for a row
 * whatever else is in the batch (unlike oneDNN's bf16 GEMM behind F.linear, whose result for a row
 * changes with M). Only built with AVX512-BF16 (gemm_bf16_supported() says so). */
int gemm_bf16_supported(void) {
#ifdef __AVX512BF16__
  return 1;
#else
  return 0;
#endif
}

/* Pairs of k per row, padded with zeros to whole AMX tiles (16 pairs = 32 bf16 = 64 bytes). */
#define KPAIRS(K) (((K) + 31) / 32 * 16)

/* In 32-bit slots: one per pair of k per output. */
int64_t packed_size_bf16(int64_t N, int64_t K) { return (N + NR - 1) / NR * NR * KPAIRS(K); }

void pack_weight_bf16(uint32_t *dst, const float *w, int64_t N, int64_t K) {
  const int64_t P = (N + NR - 1) / NR, KP = KPAIRS(K);
#pragma omp parallel for schedule(static)
  for (int64_t p = 0; p < P; ++p)
    for (int64_t i = 0; i < KP; ++i)
      for (int64_t j = 0; j < NR; ++j) {
        const int64_t n = p * NR + j;
        const uint16_t lo = n < N && 2 * i < K ? bf16_round(w[n * K + 2 * i]) : 0;
        const uint16_t hi = n < N && 2 * i + 1 < K ? bf16_round(w[n * K + 2 * i + 1]) : 0;
        dst[(p * KP + i) * NR + j] = (uint32_t)lo | ((uint32_t)hi << 16);
      }
}

/* xb rows [0, M) (2 * KPAIRS(K) bf16 each, zero past K) = x rows rounded to bfloat16. */
static void round_rows(uint16_t *xb, const float *x, int64_t ldx, int64_t M, int64_t K) {
  const int64_t KP = KPAIRS(K);
#pragma omp parallel for schedule(static) if (M * K >= 65536)
  for (int64_t m = 0; m < M; ++m) {
    uint16_t *row = xb + m * 2 * KP;
    int64_t k = 0;
#ifdef __AVX512F__
    for (; k + 16 <= K; k += 16)
      _mm256_storeu_si256((__m256i *)(row + k), bf16_round16(_mm512_loadu_ps(x + m * ldx + k)));
#endif
    for (; k < K; ++k) row[k] = bf16_round(x[m * ldx + k]);
    for (k = K; k < 2 * KP; ++k) row[k] = 0;
  }
}

#ifdef __AMX_BF16__
/* The lines of the panels a thread takes next, prefetched into L2 a few per k step of this one
 * (its first pass over a panel read it from L3 otherwise): up to two streams of `lines` lines. */
typedef struct {
  const char *next[2];
  int64_t left[2], per;
} Prefetch;

static Prefetch prefetch_plan(const char *a, const char *b, int64_t lines, int64_t steps) {
  Prefetch pf = {{a, b}, {a != NULL ? lines : 0, b != NULL ? lines : 0}, (lines + steps - 1) / steps};
  return pf;
}

/* Tiles 0-3 = rows [0, 16) and [16, 32) (the second only if `two`) of xb, KP pairs, times the B
 * tiles at b6 and b7 (rows NR * 4 bytes apart), summed over k in order. Tiles 0-3: C (2 row tiles x
 * 2 column halves of the panel, 16 x 16 floats each); 4-5: A (16 rows x 16 pairs of x); 6-7: B (16
 * pairs x 16 outputs of the panel), as amx_configure_16x64 sets them. */
static inline __attribute__((always_inline)) void amx_dot(const uint16_t *xb, int64_t KP, const char *b6,
                                                          const char *b7, int two, Prefetch *pf) {
  const int64_t lda = KP * 4, ldb = NR * 4; /* bytes */
  _tile_zero(0);
  _tile_zero(1);
  _tile_zero(2);
  _tile_zero(3);
  for (int64_t k0 = 0; k0 < KP; k0 += 16) {
    const char *a = (const char *)(xb + k0 * 2);
    _tile_loadd(4, a, lda);
    _tile_loadd(6, b6 + k0 * ldb, ldb);
    _tile_loadd(7, b7 + k0 * ldb, ldb);
    for (int s = 0; s < 2; ++s)
      for (int64_t l = 0; l < pf->per && pf->left[s] > 0; ++l, --pf->left[s], pf->next[s] += 64)
        _mm_prefetch(pf->next[s], _MM_HINT_T1);
    _tile_dpbf16ps(0, 4, 6);
    _tile_dpbf16ps(1, 4, 7);
    if (two) {
      _tile_loadd(5, a + 16 * lda, lda);
      _tile_dpbf16ps(2, 5, 6);
      _tile_dpbf16ps(3, 5, 7);
    }
  }
}

/* Tiles 0-3 (rows 0-15 and, if `two`, 16-31 of a 32-column panel) into dst, rows ld floats apart. */
static inline void amx_store_tiles(float *dst, int64_t ld, int two) {
  _tile_stored(0, dst, ld * 4);
  _tile_stored(1, dst + 16, ld * 4);
  if (two) {
    _tile_stored(2, dst + 16 * ld, ld * 4);
    _tile_stored(3, dst + 16 * ld + 16, ld * 4);
  }
}

/* One panel against rows [0, M16) of the padded bf16 x (M16 a multiple of 16), into y rows < M;
 * `next`: the panel this thread takes next (or NULL). Every output is the tile dot products' sum
 * over k in order, whatever the tiling of rows: the result of a row depends on nothing but that row. */
static void amx_panel(float *y, int64_t ldy, const uint16_t *xb, int64_t KP, const uint32_t *wp, const float *bias,
                      int64_t M, int64_t M16, int64_t left, float *scratch, const char *next) {
  Prefetch pf = prefetch_plan(next, NULL, 2 * KP, (M16 + 31) / 32 * (KP / 16));
  for (int64_t m0 = 0; m0 < M16; m0 += 32) {
    const int two = m0 + 16 < M16;
    amx_dot(xb + m0 * 2 * KP, KP, (const char *)wp, (const char *)wp + 64, two, &pf);
    const int64_t rows = (two ? 32 : 16) < M - m0 ? (two ? 32 : 16) : M - m0;
    const int64_t cols = left < NR ? left : NR;
    if (bias == NULL && cols == NR && rows == (two ? 32 : 16)) { /* whole tiles: straight into y */
      amx_store_tiles(y + m0 * ldy, ldy, two);
      continue;
    }
    amx_store_tiles(scratch, NR, two);
    for (int64_t r = 0; r < rows; ++r)
      for (int64_t j = 0; j < cols; ++j)
        y[(m0 + r) * ldy + j] = scratch[r * NR + j] + (bias != NULL ? bias[j] : 0.f);
  }
}

/* The gate panel wg and the up panel wu (the same 32 features of each) against rows [0, M16) of x,
 * into act rows [0, M16): bfloat16(silu(gate) * up), columns [0, 32), rows ldact apart. Each tile
 * pair holds 16 gate and the same 16 up features; silu * up is silu_and_mul_f32's expression on the
 * same float32 sums, and the bfloat16 rounding round_rows', so act is what the unfused path gives
 * the down projection, bit for bit. Zero rows of x give zero rows. */
static void amx_panel_glu(uint16_t *act, int64_t ldact, const uint16_t *xb, int64_t KP, const uint32_t *wg,
                          const uint32_t *wu, int64_t M16, float *scratch, const char *next_g, const char *next_u) {
  Prefetch pf = prefetch_plan(next_g, next_u, 2 * KP, 2 * ((M16 + 31) / 32) * (KP / 16));
  const __m512 one = _mm512_set1_ps(1.f);
  for (int h = 0; h < 2; ++h)
    for (int64_t m0 = 0; m0 < M16; m0 += 32) {
      const int two = m0 + 16 < M16;
      amx_dot(xb + m0 * 2 * KP, KP, (const char *)wg + h * 64, (const char *)wu + h * 64, two, &pf);
      amx_store_tiles(scratch, NR, two);
      for (int64_t r = 0; r < (two ? 32 : 16); ++r) {
        const __m512 g = _mm512_loadu_ps(scratch + r * NR), u = _mm512_loadu_ps(scratch + r * NR + 16);
        const __m512 e = exp512(_mm512_sub_ps(_mm512_setzero_ps(), g));
        const __m512 o = _mm512_mul_ps(_mm512_div_ps(g, _mm512_add_ps(one, e)), u);
        _mm256_storeu_si256((__m256i *)(act + (m0 + r) * ldact + h * 16), bf16_round16(o));
      }
    }
}

/* A thread's scratch tile pair for amx_panel (on its stack: every thread of a region must enter each
 * of its worksharing loops, so none may drop out on a failed allocation). */
typedef struct {
  float f[32 * NR] __attribute__((aligned(64)));
} AmxScratch;
#endif

int gemm_amx_supported(void) {
#ifdef __AMX_BF16__
  return amx_ready();
#else
  return 0;
#endif
}

/* Rows per block of an AMX product with KP pairs of k: blocks whose bf16 x stays in L2 (half of it)
 * against every panel; at 2048 rows a panel otherwise streams all of x from L3 (1.2 -> 1.6 TFLOP/s,
 * benchmarks/gemm.py --bf16). */
static inline int64_t amx_row_block(int64_t KP) {
  const int64_t rb = XBLOCK / 2 / (KP * 4) / 32 * 32;
  return rb < 32 ? 32 : rb;
}

#ifdef __AMX_BF16__
/* Inside a parallel region: y = xb W^T (+ bias) for the rounded, padded x (round_rows), block of rows
 * (amx_row_block) by block. No barrier between blocks (a thread that finished its panels of one block
 * starts the next; 1.02-1.08x over a barrier per block), so y is complete only after the region's. */
static void amx_gemm_rows(float *y, int64_t ldy, const uint16_t *xb, int64_t KP, const float *wp, const float *bias,
                          int64_t M, int64_t N, float *scratch) {
  const int64_t M16 = (M + 15) / 16 * 16, P = (N + NR - 1) / NR, rb = amx_row_block(KP);
  for (int64_t m0 = 0; m0 < M16; m0 += rb) {
    const int64_t rows16 = M16 - m0 < rb ? M16 - m0 : rb, rows = M - m0 < rb ? M - m0 : rb;
#pragma omp for schedule(static) nowait
    for (int64_t p = 0; p < P; ++p)
      amx_panel(y + m0 * ldy + p * NR, ldy, xb + m0 * 2 * KP, KP, (const uint32_t *)wp + p * KP * NR,
                bias == NULL ? NULL : bias + p * NR, rows, rows16, N - p * NR, scratch,
                p + 1 < P ? (const char *)((const uint32_t *)wp + (p + 1) * KP * NR) : NULL);
  }
}

/* x [M, K] rounded into a new buffer of M16 rows (padding rows zero); NULL if out of memory. */
static uint16_t *rounded_copy(const float *x, int64_t ldx, int64_t M, int64_t K) {
  const int64_t KP = KPAIRS(K), M16 = (M + 15) / 16 * 16;
  uint16_t *xb = (uint16_t *)aligned_alloc(64, sizeof(uint16_t) * 2 * KP * (M16 ? M16 : 16));
  if (xb == NULL) return NULL;
  memset(xb + M * 2 * KP, 0, sizeof(uint16_t) * 2 * KP * (M16 - M));
  round_rows(xb, x, ldx, M, K);
  return xb;
}
#endif

/* gemm_packed_bf16 on AMX tiles: the same bfloat16 inputs; 0, or -1 (scratch or AMX unavailable). */
int gemm_packed_bf16_amx(float *y, int64_t ldy, const float *x, int64_t ldx, const float *wp, const float *bias,
                         int64_t M, int64_t N, int64_t K) {
#ifdef __AMX_BF16__
  if (!amx_ready()) return -1;
  uint16_t *xb = rounded_copy(x, ldx, M, K);
  if (xb == NULL) return -1;
#pragma omp parallel
  {
    AmxScratch scratch;
    amx_configure_16x64();
    amx_gemm_rows(y, ldy, xb, KPAIRS(K), wp, bias, M, N, scratch.f);
    _tile_release();
  }
  free(xb);
  return 0;
#else
  (void)y; (void)ldy; (void)x; (void)ldx; (void)wp; (void)bias; (void)M; (void)N; (void)K;
  return -1;
#endif
}

/* A gated MLP on AMX tiles: y [M, H] = down(silu(gate) * up), gate | up = x Wgu^T, for wgu packed from
 * [2I, H] (gate rows, then up rows) and wd from [H, I], I a multiple of 32, no biases. The same bits as
 * gemm_packed_bf16_amx, silu_and_mul_f32 and gemm_packed_bf16_amx again, but the activations go from
 * the gate/up tiles straight into the down projection's bfloat16 rows: a 2048-token step of
 * Qwen3-0.6B's shape no longer writes and re-reads a 48 MiB float32 gate/up output and a 24 MiB
 * product. 0, or -1 (scratch or AMX unavailable, or I not a multiple of 32). */
int mlp_silu_bf16_amx(float *y, int64_t ldy, const float *x, int64_t ldx, const float *wgu, const float *wd,
                      int64_t M, int64_t H, int64_t I) {
#ifndef __AMX_BF16__
  (void)y; (void)ldy; (void)x; (void)ldx; (void)wgu; (void)wd; (void)M; (void)H; (void)I;
  return -1;
#else
  if (!amx_ready() || I % 32 != 0) return -1;
  const int64_t KP = KPAIRS(H), M16 = (M + 15) / 16 * 16, PG = I / 32;
  uint16_t *xb = rounded_copy(x, ldx, M, H);
  uint16_t *act = (uint16_t *)aligned_alloc(64, sizeof(uint16_t) * I * (M16 ? M16 : 16)); /* KPAIRS(I) = I / 2 */
  if (xb == NULL || act == NULL) {
    free(xb);
    free(act);
    return -1;
  }
#pragma omp parallel
  {
    AmxScratch scratch;
    amx_configure_16x64();
    const int64_t rb = amx_row_block(KP);
    for (int64_t m0 = 0; m0 < M16; m0 += rb) {
      const int64_t rows16 = M16 - m0 < rb ? M16 - m0 : rb;
#pragma omp for schedule(static) nowait
      for (int64_t p = 0; p < PG; ++p) {
        const uint32_t *wg = (const uint32_t *)wgu + p * KP * NR, *wu = wg + PG * KP * NR;
        amx_panel_glu(act + m0 * I + p * NR, I, xb + m0 * 2 * KP, KP, wg, wu, rows16, scratch.f,
                      p + 1 < PG ? (const char *)(wg + KP * NR) : NULL,
                      p + 1 < PG ? (const char *)(wu + KP * NR) : NULL);
      }
    }
#pragma omp barrier
    amx_gemm_rows(y, ldy, act, I / 2, wd, NULL, M, H, scratch.f); /* (every row of act written) */
    _tile_release();
  }
  free(xb);
  free(act);
  return 0;
#endif
}

/* y = x W^T (+ bias) for W packed by pack_weight_bf16; 0, or -1 if the scratch for x failed. */
int gemm_packed_bf16(float *y, int64_t ldy, const float *x, int64_t ldx, const float *wp, const float *bias,
                     int64_t M, int64_t N, int64_t K) {
#ifdef __AVX512BF16__
  const int64_t KP = KPAIRS(K);
  uint16_t *xb = (uint16_t *)malloc(sizeof(uint16_t) * 2 * KP * (M ? M : 1));
  if (xb == NULL) return -1;
  round_rows(xb, x, ldx, M, K);
  /* Row blocks whose bf16 x fits in L2, as in gemm_packed_f32. */
  int64_t rows = XBLOCK / (4 * KP) / MR * MR;
  if (rows < 4 * MR) rows = 4 * MR;
  for (int64_t m = 0; m < M; m += rows)
    row_block(y + m * ldy, ldy, (const float *)(xb + m * 2 * KP), KP, wp, bias, M - m < rows ? M - m : rows, N, KP,
              16);
  free(xb);
  return 0;
#else
  (void)y; (void)ldy; (void)x; (void)ldx; (void)wp; (void)bias; (void)M; (void)N; (void)K;
  return -1;
#endif
}

/* ---- grouped: one call over many weights of one shape (a mixture of experts' experts) --------------
 * Group g is rows [off[g], off[g + 1]) of x and y (contiguous rows) against the weight at wps[g]:
 * every weight [N, K] packed alike (kind 32: pack_weight_f32; 16: pack_weight_bf16, on AMX tiles if
 * amx), no bias. A group's rows are cut into the same row blocks the single-weight kernels use, and
 * every (block, panel) pair of every group is one item of a single parallel loop: a thread's items
 * are contiguous and it prefetches the panel of its next item, whichever weight that is in. A call
 * per group paid a fork and join and a cold first panel each, and read the expert weights at a
 * quarter of the rate one weight of their total size streams at (benchmarks/moe.py). Each row gets
 * exactly what the single-weight kernel of its kind gives it: tiles never change a row's sums. */

typedef struct {
  const float *w;   /* the group's packed weight */
  int64_t row0;     /* first row of the block in x and y */
  int64_t rows;
  int64_t xrow0;    /* AMX: first row in the padded bf16 copy of x */
} Block;

/* The non-empty groups cut into blocks of at most rb rows; NULL if out of memory. */
static Block *blocks_of(const int64_t *wps, const int64_t *off, int64_t G, int64_t rb, int64_t *count) {
  int64_t n = 0;
  for (int64_t g = 0; g < G; ++g) n += (off[g + 1] - off[g] + rb - 1) / rb;
  Block *b = (Block *)malloc(sizeof(Block) * (n ? n : 1));
  if (b == NULL) return NULL;
  int64_t i = 0, x16 = 0;
  for (int64_t g = 0; g < G; ++g)
    for (int64_t r = off[g]; r < off[g + 1]; r += rb) {
      const int64_t rows = off[g + 1] - r < rb ? off[g + 1] - r : rb;
      b[i++] = (Block){(const float *)(intptr_t)wps[g], r, rows, x16};
      x16 += (rows + 15) / 16 * 16;
    }
  *count = n;
  return b;
}

int gemm_grouped(float *y, int64_t ldy, const float *x, int64_t ldx, const int64_t *wps, const int64_t *off,
                 int64_t G, int64_t N, int64_t K, int64_t kind, int64_t amx) {
#if defined(__AVX512F__) || defined(GEMM_AVX2)
  const int64_t P = (N + NR - 1) / NR, M = off[G] - off[0];
  if (kind != 32 && kind != 16) return -1;
#ifndef __AVX512BF16__
  if (kind == 16) return -1;
#endif
#ifndef __AMX_BF16__
  if (amx) return -1;
#else
  if (amx && (kind != 16 || !amx_ready())) return -1;
#endif
  const int64_t KP = KPAIRS(K), kk = kind == 16 ? KP : K;
  int64_t rb = amx ? amx_row_block(KP) : XBLOCK / (4 * kk) / MR * MR;
  if (rb < 4 * MR && !amx) rb = 4 * MR;
  int64_t S = 0;
  Block *blocks = blocks_of(wps, off, G, rb, &S);
  if (blocks == NULL) return -1;
  const int64_t items = S * P;
  const uint16_t *xb = NULL;
  if (kind == 16) { /* x rounded once; for AMX each block's rows padded to 16 with zeros */
    const int64_t rows = S ? blocks[S - 1].xrow0 + (blocks[S - 1].rows + 15) / 16 * 16 : 16;
    uint16_t *buf = (uint16_t *)aligned_alloc(64, sizeof(uint16_t) * 2 * KP * (amx ? rows : (M ? M : 1)));
    if (buf == NULL) {
      free(blocks);
      return -1;
    }
    if (amx) {
      memset(buf, 0, sizeof(uint16_t) * 2 * KP * rows);
      for (int64_t s = 0; s < S; ++s)
        round_rows(buf + blocks[s].xrow0 * 2 * KP, x + blocks[s].row0 * ldx, ldx, blocks[s].rows, K);
    } else {
      round_rows(buf, x + off[0] * ldx, ldx, M, K);
    }
    xb = buf;
  }
  const int64_t panel = PANEL(kind, kk);
  if (!amx) {
    const float *xs = kind == 16 ? (const float *)xb - off[0] * KP : x; /* (rows addressed from off[0]) */
    const int64_t lx = kind == 16 ? KP : ldx;
#pragma omp parallel for schedule(static)
    for (int64_t i = 0; i < items; ++i) {
      const Block *b = blocks + i / P, *bn = blocks + (i + 1 < items ? i + 1 : i) / P;
      const int64_t p = i % P, pn = (i + 1 < items ? i + 1 : i) % P;
      const float *w = b->w + p * panel;
      if (kind == 16)
        panel_rows(y + b->row0 * ldy + p * NR, ldy, xs + b->row0 * lx, lx, w, bn->w + pn * panel,
                   panel_out(p, N, NULL), b->rows, KP, 16);
      else
        panel_rows(y + b->row0 * ldy + p * NR, ldy, xs + b->row0 * lx, lx, w, bn->w + pn * panel,
                   panel_out(p, N, NULL), b->rows, K, 32);
    }
  }
#ifdef __AMX_BF16__
  else {
#pragma omp parallel
    {
      AmxScratch scratch;
      amx_configure_16x64();
#pragma omp for schedule(static)
      for (int64_t i = 0; i < items; ++i) {
        const Block *b = blocks + i / P, *bn = blocks + (i + 1 < items ? i + 1 : i) / P;
        const int64_t p = i % P, pn = (i + 1) % P;
        amx_panel(y + b->row0 * ldy + p * NR, ldy, xb + b->xrow0 * 2 * KP, KP,
                  (const uint32_t *)b->w + p * KP * NR, NULL, b->rows, (b->rows + 15) / 16 * 16, N - p * NR,
                  scratch.f, i + 1 < items ? (const char *)((const uint32_t *)bn->w + pn * KP * NR) : NULL);
      }
      _tile_release();
    }
  }
#endif
  free((void *)xb);
  free(blocks);
  return 0;
#else
  (void)y; (void)ldy; (void)x; (void)ldx; (void)wps; (void)off; (void)G; (void)N; (void)K; (void)kind; (void)amx;
  return -1;
#endif
}
