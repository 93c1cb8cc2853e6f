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
#include <math.h>
#include <stdint.h>
#include <string.h>
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
  store_tile(y, ldy, acc, bias, m0, m1, R);
}

#endif

/* ---- 4-bit weights -------------------------------------------------------------------------------
 * A weight whose every run of 32 values along K is exactly fl(fl(d * q) + m) for one d and m and
 * integers q in 0..15 (GGUF's Q4_1 blocks, dequantized, are) is packed a second time in 4 bits:
 * per panel of 32 outputs and block of 32 k, a record of d[32] and m[32] as floats and 32 x 16
 * bytes of q (byte j of row k: output j in the low nibble, output j + 16 in the high). The kernel
 * rebuilds each weight with the same unfused multiply and add, so it runs the very same FMAs on the
 * very same values as the float32 kernel, bit for bit, reading 0.75 bytes per weight instead of 4:
 * at decode batch sizes the weight stream, not the arithmetic, is what a step waits for. */
#define QB 32                       /* k per block */
#define Q4_REC (2 * NR + QB * 16 / 4) /* floats per (panel, block) record: d, m, then the nibbles */
#define RN (_MM_FROUND_TO_NEAREST_INT | _MM_FROUND_NO_EXC)

int64_t packed_size_q4(int64_t N, int64_t K) { return (N + NR - 1) / NR * (K / QB) * Q4_REC; }

#ifdef __AVX512F__
/* fl(fl(d * q) + m): explicit rounding ops, which the compiler never fuses into one FMA. */
static inline float q4_value(float d, float q, float m) {
  const __m128 p = _mm_mul_round_ss(_mm_set_ss(d), _mm_set_ss(q), RN);
  return _mm_cvtss_f32(_mm_add_round_ss(p, _mm_set_ss(m), RN));
}

/* d, m and q of one run of 32 values if it is exactly fl(fl(d * q) + m); 0 otherwise. As GGUF's
 * quantizer makes them, m is the run's minimum (q = 0 there) and its maximum has q = 15: d is tried
 * as the half-precision rounding of (max - min) / 15 (GGUF stores d in half precision), its two
 * neighbours and the unrounded quotient, and kept if every value comes back bit for bit. */
static int fit_q4(const float *w, float *d_out, float *m_out, uint8_t *q) {
  float lo = w[0], hi = w[0];
  for (int i = 1; i < QB; ++i) {
    lo = w[i] < lo ? w[i] : lo;
    hi = w[i] > hi ? w[i] : hi;
  }
  const float est = (hi - lo) / 15.f;
  const unsigned short h = _cvtss_sh(est, RN);
  const float cands[4] = {_cvtsh_ss(h), _cvtsh_ss((unsigned short)(h + 1)), _cvtsh_ss((unsigned short)(h - 1)), est};
  for (int c = 0; c < 4; ++c) {
    const float d = cands[c];
    if (!(d >= 0.f) || d > 1e30f) continue; /* also rejects NaN */
    int ok = 1;
    for (int i = 0; i < QB && ok; ++i) {
      float r = d > 0.f ? nearbyintf((w[i] - lo) / d) : 0.f;
      r = r < 0.f ? 0.f : r > 15.f ? 15.f : r;
      const float v = q4_value(d, r, lo);
      ok = memcmp(&v, &w[i], sizeof v) == 0;
      q[i] = (uint8_t)r;
    }
    if (ok) {
      *d_out = d;
      *m_out = lo;
      return 1;
    }
  }
  return 0;
}
#endif

/* Pack w [N, K] in 4 bits into dst (packed_size_q4 floats) if every run is exact; returns 1 if it
 * packed, 0 if some run is not (dst is then garbage) or K is not a multiple of 32. */
int pack_weight_q4(float *dst, const float *w, int64_t N, int64_t K) {
#ifdef __AVX512F__
  if (K % QB != 0) return 0;
  const int64_t P = (N + NR - 1) / NR, B = K / QB;
  int failed = 0; /* set once by any thread; the others then skip the rest (a float32 model fails at once) */
#pragma omp parallel for schedule(static)
  for (int64_t pb = 0; pb < P * B; ++pb) {
    if (__atomic_load_n(&failed, __ATOMIC_RELAXED)) continue;
    const int64_t p = pb / B, b = pb % B;
    float *rec = dst + pb * Q4_REC;
    uint8_t *qs = (uint8_t *)(rec + 2 * NR);
    memset(qs, 0, QB * 16);
    for (int j = 0; j < NR; ++j) {
      const int64_t n = p * NR + j;
      uint8_t q[QB] = {0};
      rec[j] = rec[NR + j] = 0.f; /* padding outputs: d = m = q = 0 */
      if (n < N && !fit_q4(w + n * K + b * QB, &rec[j], &rec[NR + j], q)) __atomic_store_n(&failed, 1, __ATOMIC_RELAXED);
      for (int k = 0; k < QB; ++k) qs[k * 16 + (j & 15)] |= (uint8_t)(q[k] << (j < 16 ? 0 : 4));
    }
  }
  return !failed;
#else
  (void)dst; (void)w; (void)N; (void)K;
  return 0;
#endif
}

#ifdef __AVX512F__
/* tile() over a 4-bit panel. Tile t of T also prefetches the next panel's records t, t + T, ... */
static inline __attribute__((always_inline)) void tile_q4(float *y, int64_t ldy, const float *x, int64_t ldx,
                                                          const float *rec, const float *bias, int64_t K,
                                                          __mmask16 m0, __mmask16 m1, const int R,
                                                          const float *next, int64_t T, int64_t t) {
  __m512 acc[MR][2];
  for (int r = 0; r < R; ++r) acc[r][0] = acc[r][1] = _mm512_setzero_ps();
  const __m512i low = _mm512_set1_epi32(15);
  for (int64_t b = 0; b < K / QB; ++b, rec += Q4_REC) {
    if (b % T == t)
      for (int c = 0; c < Q4_REC; c += 16) _mm_prefetch((const char *)(next + b * Q4_REC + c), _MM_HINT_T1);
    const __m512 d0 = _mm512_loadu_ps(rec), d1 = _mm512_loadu_ps(rec + 16);
    const __m512 z0 = _mm512_loadu_ps(rec + NR), z1 = _mm512_loadu_ps(rec + NR + 16);
    const uint8_t *qs = (const uint8_t *)(rec + 2 * NR);
    for (int k = 0; k < QB; ++k) {
      const __m512i v = _mm512_cvtepu8_epi32(_mm_loadu_si128((const __m128i *)(qs + k * 16)));
      const __m512 w0 = _mm512_add_round_ps(_mm512_mul_round_ps(d0, _mm512_cvtepi32_ps(_mm512_and_si512(v, low)), RN), z0, RN);
      const __m512 w1 = _mm512_add_round_ps(_mm512_mul_round_ps(d1, _mm512_cvtepi32_ps(_mm512_srli_epi32(v, 4)), RN), z1, RN);
      const float *xk = x + b * QB + k;
      for (int r = 0; r < R; ++r) {
        const __m512 xb = _mm512_set1_ps(xk[r * ldx]);
        acc[r][0] = _mm512_fmadd_ps(xb, w0, acc[r][0]);
        acc[r][1] = _mm512_fmadd_ps(xb, w1, acc[r][1]);
      }
    }
  }
  store_tile(y, ldy, acc, bias, m0, m1, R);
}

#define CASE(R) case R: TILE(R); break;
#define TILE(R)                                                                       \
  if (q4) tile_q4(yy, ldy, xx, ldx, w, bb, K, m0, m1, R, wn, tiles, t);              \
  else tile(yy, ldy, xx, ldx, w, bb, K, m0, m1, R, wn + t * K / tiles * NR, tiles)
#endif

/* Rows [0, M) against every panel; the panels are split between the threads in contiguous ranges
 * (static schedule), so the panel after p is the one this thread takes next. q4: the panels are
 * 4-bit records (pack_weight_q4), else float32 (pack_weight_f32). */
static inline __attribute__((always_inline)) void row_block(float *y, int64_t ldy, const float *x, int64_t ldx,
                                                            const float *wp, const float *bias, int64_t M,
                                                            int64_t N, int64_t K, const int q4) {
#ifdef __AVX512F__
  const int64_t P = (N + NR - 1) / NR;
  const int64_t panel = q4 ? K / QB * Q4_REC : K * NR; /* floats */
  /* Rows split into tiles of near-equal height (64 -> 5 tiles of 12-13, not 4 of 14 and one of 8). */
  const int64_t tiles = (M + MR - 1) / MR;
#pragma omp parallel for schedule(static)
  for (int64_t p = 0; p < P; ++p) {
    const float *w = wp + p * panel;
    const float *wn = p + 1 < P ? w + panel : w; /* the next panel, prefetched a share per tile */
    const int64_t left = N - p * NR;
    const __mmask16 m0 = left >= 16 ? 0xFFFF : (__mmask16)((1u << left) - 1);
    const __mmask16 m1 = left >= 32 ? 0xFFFF : left <= 16 ? 0 : (__mmask16)((1u << (left - 16)) - 1);
    const float *bb = bias == NULL ? NULL : bias + p * NR;
    int64_t m = 0;
    for (int64_t t = 0; t < tiles; ++t) {
      const int64_t rows = (M - m + (tiles - t) - 1) / (tiles - t);
      float *yy = y + m * ldy + p * NR;
      const float *xx = x + m * ldx;
      switch (rows) { /* a constant R per case, so the accumulators stay in registers */
        CASE(1) CASE(2) CASE(3) CASE(4) CASE(5) CASE(6) CASE(7)
        CASE(8) CASE(9) CASE(10) CASE(11) CASE(12) CASE(13)
        default: TILE(14); break;
      }
      m += rows;
    }
  }
#else
  (void)y; (void)ldy; (void)x; (void)ldx; (void)wp; (void)bias; (void)M; (void)N; (void)K; (void)q4;
#endif
}

/* y = x W^T (+ bias) for W packed by pack_weight_q4 (K a multiple of 32): the same results as
 * gemm_packed_f32 over the float32 W, bit for bit. For decode-sized M (no row blocks). */
void gemm_packed_q4(float *y, int64_t ldy, const float *x, int64_t ldx, const float *wp, const float *bias,
                    int64_t M, int64_t N, int64_t K) {
  row_block(y, ldy, x, ldx, wp, bias, M, N, K, 1);
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
    row_block(y + m * ldy, ldy, x + m * ldx, ldx, wp, bias, M - m < rows ? M - m : rows, N, K, 0);
}
