/* y = x W^T (+ bias) for float32 on CPU, with W packed once at load time. Built on first use by
 * pagellm/kernels/__init__.py.
 *
 * MKL's sgemm (behind F.linear) re-packs W on every call. At decode batch sizes (M = 1..64 rows)
 * that packing and a cold weight stream cost up to half the time: measured here 1.3-2.3x slower
 * than this kernel for M = 8..64 (benchmarks/gemm.py). Packing W once into panels of 32 output
 * features, [ceil(N / 32)][K][32], makes each panel one contiguous stream that is read from memory
 * once per call and then from L2 for every tile of rows. Each thread walks its panels in order and
 * prefetches the next one into L2 while it computes on this one, so the weight stream overlaps the
 * arithmetic instead of stalling the first tile of every panel (the previous scheme prefetched the
 * current panel 8 KiB ahead: 3-20 % slower at 16-128 rows, benchmarks/gemm.py --baseline-source).
 *
 * x:    [M, K] rows ldx apart (last dimension contiguous)
 * wp:   the packed weight (pack_weight_f32), N padded with zero columns to a multiple of 32
 * bias: [N] or NULL
 * y:    [M, N] rows ldy apart
 *
 * The micro-kernel holds a tile of up to 14 rows x 32 outputs in 28 AVX-512 registers and walks
 * K once: per k, two weight loads and one broadcast of x per row feed two FMAs per row. Every
 * output is the plain sum over k in order, so the result does not depend on M, on the tiling or
 * on the number of threads. Only built with AVX-512 (gemm_f32_supported() says so); the caller
 * keeps F.linear otherwise.
 */
#include <stdint.h>
#ifdef __AVX512F__
#include <immintrin.h>
#endif

#define NR 32 /* outputs per panel: two 16-float registers */
#define MR 14 /* rows per tile: 28 accumulators + 2 weights + 1 broadcast of 32 registers */
#define XBLOCK (1024 * 1024) /* bytes of x per row block: it stays in L2 (2 MiB) across all panels */

int gemm_f32_supported(void) {
#ifdef __AVX512F__
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

#ifdef __AVX512F__
/* Rows [0, R) of one panel: y[r][0:32] = x[r] . panel (+ bias), columns masked to `mask`.
 * Meanwhile, one row of `next` (2 cache lines) is prefetched into L2 every T steps of k: the T
 * tiles of a panel together bring in the whole next panel while this one computes from L2. */
static inline __attribute__((always_inline)) void tile(float *y, int64_t ldy, const float *x, int64_t ldx,
                                                       const float *wp, const float *bias, int64_t K,
                                                       __mmask16 m0, __mmask16 m1, const int R,
                                                       const float *next, int64_t T) {
  __m512 acc[MR][2];
  for (int r = 0; r < R; ++r) acc[r][0] = acc[r][1] = _mm512_setzero_ps();
  int64_t c = 0;
  for (int64_t k = 0; k < K; ++k) {
    if (++c == T) {
      c = 0;
      _mm_prefetch((const char *)next, _MM_HINT_T1);
      _mm_prefetch((const char *)(next + 16), _MM_HINT_T1);
      next += NR;
    }
    const __m512 w0 = _mm512_loadu_ps(wp + k * NR), w1 = _mm512_loadu_ps(wp + k * NR + 16);
    for (int r = 0; r < R; ++r) {
      const __m512 xb = _mm512_set1_ps(x[r * ldx + k]);
      acc[r][0] = _mm512_fmadd_ps(xb, w0, acc[r][0]);
      acc[r][1] = _mm512_fmadd_ps(xb, w1, acc[r][1]);
    }
  }
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

#define CASE(R) case R: TILE(R); break;
#define TILE(R) tile(yy, ldy, xx, ldx, w, bb, K, m0, m1, R, nx, tiles)
#endif

/* Rows [0, M) against every panel; the panels are split between the threads in contiguous ranges
 * (static schedule), so the panel after p is the one this thread takes next. */
static void row_block(float *y, int64_t ldy, const float *x, int64_t ldx, const float *wp, const float *bias,
                      int64_t M, int64_t N, int64_t K) {
#ifdef __AVX512F__
  const int64_t P = (N + NR - 1) / NR;
  /* Rows split into tiles of near-equal height (64 -> 5 tiles of 12-13, not 4 of 14 and one of 8). */
  const int64_t tiles = (M + MR - 1) / MR;
#pragma omp parallel for schedule(static)
  for (int64_t p = 0; p < P; ++p) {
    const float *w = wp + p * K * NR;
    const int64_t left = N - p * NR;
    const __mmask16 m0 = left >= 16 ? 0xFFFF : (__mmask16)((1u << left) - 1);
    const __mmask16 m1 = left >= 32 ? 0xFFFF : left <= 16 ? 0 : (__mmask16)((1u << (left - 16)) - 1);
    const float *bb = bias == NULL ? NULL : bias + p * NR;
    int64_t m = 0;
    for (int64_t t = 0; t < tiles; ++t) {
      const int64_t rows = (M - m + (tiles - t) - 1) / (tiles - t);
      float *yy = y + m * ldy + p * NR;
      const float *xx = x + m * ldx;
      const float *nx = (p + 1 < P ? w + K * NR : w) + t * K / tiles * NR; /* its share of the next panel */
      switch (rows) { /* a constant R per case, so the accumulators stay in registers */
        CASE(1) CASE(2) CASE(3) CASE(4) CASE(5) CASE(6) CASE(7)
        CASE(8) CASE(9) CASE(10) CASE(11) CASE(12) CASE(13)
        default: TILE(14); break;
      }
      m += rows;
    }
  }
#else
  (void)y; (void)ldy; (void)x; (void)ldx; (void)wp; (void)bias; (void)M; (void)N; (void)K;
#endif
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
    row_block(y + m * ldy, ldy, x + m * ldx, ldx, wp, bias, M - m < rows ? M - m : rows, N, K);
}
