/* y = x W^T (+ bias) with W kept in GGUF's 4- or 8-bit blocks and x quantized to int8 on the fly, per
 * block of 32 values (llama.cpp's scheme): integer dot products on AVX512-VNNI (vpdpbusd, 64
 * multiply-adds per instruction, twice vdpbf16ps), one float multiply-add per block and output.
 * Without VNNI the same records are read by an AVX2 path, or plain C, that gives the same bits.
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
 * Grouped 4-bit blocks (format G4 + G, G >= 2; an AWQ / GPTQ group of 32 G k): the 4-bit blocks of
 * 32 with one d and m for G consecutive blocks, so a record holds d[32], m[32], then G blocks' q:
 * 4.5 bits per weight where the legacy record's 6. Activations and the float work are the 4-bit
 * blocks' op for op (each block's d and m read from its group's record): the same bits as those
 * blocks with d and m repeated.
 *
 * K-quant super-blocks (formats K4 and K6, packed by pack_kquant from the file's own blocks, as
 * llama.cpp's vec_dot_q4_K_q8_K does it): 256 k per super-block with one float d and dmin per output,
 * S sub-blocks of L k each with int8 scale sc and min mn, q unsigned:
 *   w = d sc q - dmin mn   ->  sum_k w x_k = dx (d sum_j sc_j sum_{k in j} q xq_k - dmin sum_j mn_j bsum_j)
 * K4 (Q4_K): L = 32, q 4 bits. K6 (Q5_K, Q6_K, or a fused mix of the two; it holds Q4_K too): L = 16,
 * q 6 bits (Q6_K: q in 0..63 with mn = sc, dmin = 32 d). Activations per row and super-block: one
 * dx = max|x| / 127, xq in -127..127 and the integer sums bsum of each 16 and of each 32 (int16, BSUMS).
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
#ifndef AMX_ROW_BLOCK
#define AMX_ROW_BLOCK 1024 /* rows per call on AMX: a super-block's operands cost about what 256 rows' tdp do */
#endif
#define QBYTES(bits) (NR * QB * (bits) / 8)          /* bytes of q per block of a panel */
#define GRECB(bits, G) (2 * NR * 4 + (G) * QBYTES(bits)) /* bytes per record of G blocks */
#define RECB(bits) GRECB(bits, 1)
#define FMT_G4 0x10000 /* + G: 4-bit blocks whose d and m G consecutive blocks share */
#define FMT_K4 0x104
#define FMT_K6 0x106
#define FMT_PARTS 0x200 /* int64 header [count, (format, rows, byte offset) per part], then the parts */
#define QK 256                                    /* k per super-block */
#define KPF 2 /* records ahead the first tile of a K panel prefetches, every line of them (below) */
#define MRK 4                                     /* rows per K tile: acc, sum and dot, 2 each per row */
#define KSUB(fmt) ((fmt) == FMT_K4 ? 8 : 16)      /* sub-blocks per super-block */
#define KQB(fmt) ((fmt) == FMT_K4 ? 512 : 384)  /* bytes of q per sub-block of a panel */
#define KREC(fmt) (2 * NR * 4 + KSUB(fmt) * NR * 2 + KSUB(fmt) * KQB(fmt)) /* d, dmin, sc, mn, q */
#define BSUMS(K) ((K) / 16 + (K) / 32) /* int16 bsum per row for a K format: the sums of each 16, then of each 32 */

/* The path this build takes: 3 AVX512-VNNI, 2 AVX2 + FMA, 1 plain C (every one gives the same bits). */
int gemm_i8_supported(void) {
#if defined(__AVX512F__) && defined(__AVX512VNNI__) && defined(__AVX512BW__)
  return 3;
#elif defined(__AVX2__) && defined(__FMA__)
  return 2;
#else
  return 1;
#endif
}

static int is_kfmt(int64_t fmt) { return fmt == FMT_K4 || fmt == FMT_K6; }

/* A row's bsum (BSUMS(K) int16): quantize_row_k writes the sums of each 16 k, this the sums of each 32
 * after them; sub_sums finds super-block b's sums per sub-block (16 k for K6, 32 for K4). */
static void sums_of_32(int16_t *bsum, int64_t K) {
  for (int64_t j = 0; j < K / 32; ++j) bsum[K / 16 + j] = (int16_t)(bsum[2 * j] + bsum[2 * j + 1]);
}
static inline const int16_t *sub_sums(const int16_t *bsum, int64_t K, int64_t b, int fmt) {
  return bsum + (fmt == FMT_K4 ? K / 16 + b * (QK / 32) : b * (QK / 16));
}
static int64_t fmt_group(int64_t fmt) { return fmt > FMT_G4 ? fmt - FMT_G4 : 1; } /* blocks per record */
static int fmt_bits(int64_t fmt) { return fmt > FMT_G4 ? 4 : (int)fmt; }

int64_t packed_size_i8(int64_t N, int64_t K, int64_t fmt) {
  if (is_kfmt(fmt)) return (N + NR - 1) / NR * (K / QK) * KREC(fmt);
  const int64_t G = fmt_group(fmt);
  return (N + NR - 1) / NR * (K / QB / G) * GRECB(fmt_bits(fmt), G);
}

/* Output j's 32 q (0..15) of a 4-bit block whose q start at qs. */
static void lay_q4(uint8_t *qs, int j, const int8_t *q) {
  const int half = j / 16, lane = j % 16;
  for (int k = 0; k < QB; ++k) {
    const int g = k / 4; /* group of 4 k: vector g % 4, low nibbles for g < 4 */
    qs[(half * 4 + g % 4) * 64 + lane * 4 + k % 4] |= (uint8_t)(q[k] << (g < 4 ? 0 : 4));
  }
}

/* Output j of a zeroed record of `bits` (4 or 8): d, m and the block's 32 q (0..15 for 4 bits,
 * -128..127 for 8). */
static void lay_output(uint8_t *rec, int j, float d, float m, const int8_t *q, const int bits) {
  uint8_t *qs = rec + 2 * NR * 4;
  ((float *)rec)[j] = d;
  const int half = j / 16, lane = j % 16;
  if (bits == 4) {
    ((float *)rec)[NR + j] = m;
    lay_q4(qs, j, q);
  } else {
    int32_t sum = 0;
    for (int k = 0; k < QB; ++k) {
      qs[(half * 8 + k / 4) * 64 + lane * 4 + k % 4] = (uint8_t)q[k];
      sum += q[k];
    }
    ((int32_t *)rec)[NR + j] = -128 * sum;
  }
}

/* Group record (p, c) of G blocks from explicit d, m [N, K / 32] and q [N, K] (int8: 0..15 for 4 bits,
 * -128..127 for 8; bytes, not ints: a 1.7B's packing read 6 GB of int32 q); outputs past N are
 * zero. 0 if a block's d or m differs from its group's first (no record holds it). */
static int put_group(uint8_t *rec, const float *d, const float *m, const int8_t *q, int64_t N, int64_t K,
                     int64_t p, int64_t c, const int bits, const int64_t G) {
  const int64_t B = K / QB, b0 = c * G;
  int same = 1;
  memset(rec, 0, GRECB(bits, G));
  for (int j = 0; j < NR && p * NR + j < N; ++j) {
    const int64_t n = p * NR + j;
    const float dn = d[n * B + b0], mn = bits == 4 ? m[n * B + b0] : 0.f;
    lay_output(rec, j, dn, mn, q + n * K + b0 * QB, bits);
    for (int64_t i = 1; i < G; ++i) {
      same &= !memcmp(&d[n * B + b0 + i], &dn, 4) && !memcmp(&m[n * B + b0 + i], &mn, 4);
      lay_q4(rec + 2 * NR * 4 + i * QBYTES(4), j, q + n * K + (b0 + i) * QB);
    }
  }
  return same;
}

/* Pack GGUF blocks of 32 given as d, m and q (see put_group) without a float round trip in format
 * 4, 8 or G4 + G; 1, or 0 for a K that is not a multiple of 32 G, another format, or (G4) blocks
 * of a group whose d or m differ. */
int pack_blocks_i8(uint8_t *dst, const float *d, const float *m, const int8_t *q, int64_t N, int64_t K,
                   int64_t fmt) {
  const int64_t G = fmt_group(fmt);
  const int bits = fmt_bits(fmt);
  if (K % (QB * G) != 0 || (bits != 4 && bits != 8)) return 0;
  const int64_t P = (N + NR - 1) / NR, C = K / QB / G;
  int failed = 0;
#pragma omp parallel for schedule(static)
  for (int64_t pc = 0; pc < P * C; ++pc)
    if (!put_group(dst + pc * GRECB(bits, G), d, m, q, N, K, pc / C, pc % C, bits, G))
      __atomic_store_n(&failed, 1, __ATOMIC_RELAXED);
  return !failed;
}

/* Pack K-quant super-blocks: d, dmin [N, K / 256], sc, mn [N, K / 16] (each L = 32 sub-block's
 * value given for both its 16s in K4), q [N, K] unsigned (0..15 for K4, 0..63 for K6); 1, or 0 for
 * a K that is not a multiple of 256 or another fmt. Record: d[32], dmin[32] float, sc[S][32],
 * mn[S][32] int8, then per sub-block the q: K4 as the 4-bit legacy blocks of 32 k (512 bytes); K6
 * per half of 16 outputs three vectors over the 4 groups of 4 k: low nibbles of groups 0 | 1 << 4,
 * of groups 2 | 3 << 4, and the high 2 bits of group g at bits 2g (384 bytes). */
int pack_kquant(uint8_t *dst, const float *d, const float *dmin, const int8_t *sc, const int8_t *mn,
                const uint8_t *q, int64_t N, int64_t K, int64_t fmt) {
  if (K % QK != 0 || !is_kfmt(fmt)) return 0;
  const int64_t P = (N + NR - 1) / NR, B = K / QK, S = KSUB(fmt), L = QK / S, rec_size = KREC(fmt);
#pragma omp parallel for schedule(static)
  for (int64_t pb = 0; pb < P * B; ++pb) {
    const int64_t p = pb / B, b = pb % B;
    uint8_t *rec = dst + pb * rec_size;
    memset(rec, 0, rec_size);
    float *d_rec = (float *)rec, *dm_rec = (float *)rec + NR;
    int8_t *sc_rec = (int8_t *)(rec + 2 * NR * 4), *mn_rec = sc_rec + S * NR;
    uint8_t *qs = (uint8_t *)(mn_rec + S * NR);
    for (int j = 0; j < NR; ++j) {
      const int64_t n = p * NR + j;
      if (n >= N) continue;
      d_rec[j] = d[n * B + b];
      dm_rec[j] = dmin[n * B + b];
      const int half = j / 16, lane = j % 16;
      for (int64_t s = 0; s < S; ++s) {
        sc_rec[s * NR + j] = sc[n * (K / 16) + b * 16 + s * L / 16];
        mn_rec[s * NR + j] = mn[n * (K / 16) + b * 16 + s * L / 16];
        const uint8_t *qn = q + n * K + b * QK + s * L;
        uint8_t *qsub = qs + s * KQB(fmt);
        for (int k = 0; k < L; ++k) {
          const int g = k / 4, at = lane * 4 + k % 4;
          if (fmt == FMT_K4) {
            qsub[(half * 4 + g % 4) * 64 + at] |= (uint8_t)(qn[k] << (g < 4 ? 0 : 4));
          } else {
            qsub[(half * 3 + g / 2) * 64 + at] |= (uint8_t)((qn[k] & 0x0F) << (4 * (g % 2)));
            qsub[(half * 3 + 2) * 64 + at] |= (uint8_t)((qn[k] >> 4) << (2 * g));
          }
        }
      }
    }
  }
  return 1;
}

/* Pack w [N, K] (K a multiple of 32) into dst (packed_size_i8 bytes) if every run of 32 is exactly a
 * block of `bits`; 1 if it packed, 0 if not (dst is then garbage). */
int pack_weight_i8(uint8_t *dst, const float *w, int64_t N, int64_t K, int64_t bits) {
  if (K % QB != 0 || (bits != 4 && bits != 8)) return 0;
  const int64_t P = (N + NR - 1) / NR, B = K / QB, rec_size = RECB(bits);
  int failed = 0;
#pragma omp parallel for schedule(static)
  for (int64_t pb = 0; pb < P * B; ++pb) {
    if (__atomic_load_n(&failed, __ATOMIC_RELAXED)) continue;
    const int64_t p = pb / B, b = pb % B;
    uint8_t *rec = dst + pb * rec_size;
    memset(rec, 0, rec_size);
    for (int j = 0; j < NR && p * NR + j < N; ++j) { /* padding outputs: d = m = q = 0 */
      int32_t q32[QB] = {0};
      int8_t q[QB];
      float d = 0.f, m = 0.f;
      if (!fit_q(w + (p * NR + j) * K + b * QB, &d, &m, q32, (int)bits)) __atomic_store_n(&failed, 1, __ATOMIC_RELAXED);
      for (int k = 0; k < QB; ++k) q[k] = (int8_t)q32[k]; /* (0..15, or -128..127: fit_q's ranges) */
      lay_output(rec, j, d, m, q, (int)bits);
    }
  }
  return !failed;
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

/* The 4 operands of group g of a 4-bit block (lay_output's nibble layout, 512 bytes at qs): low and
 * high nibbles of outputs 0-15 and 16-31, as dot_q4 multiplies them. */
static inline __attribute__((always_inline)) void q4_operands(__m512i v[4], const uint8_t *qs, int g) {
  const __m512i low = _mm512_set1_epi8(0x0F);
  const __m512i v0 = _mm512_loadu_si512(qs + g * 64), v1 = _mm512_loadu_si512(qs + (4 + g) * 64);
  v[0] = _mm512_and_si512(v0, low), v[1] = _mm512_and_si512(_mm512_srli_epi16(v0, 4), low);
  v[2] = _mm512_and_si512(v1, low), v[3] = _mm512_and_si512(_mm512_srli_epi16(v1, 4), low);
}

/* acc[r] += the 32 k of a 4-bit block (at qs) against rows [0, R) of xq (xk: the block's 8 groups of
 * 4 int8 in row 0; rows K bytes apart). With uq (1 KiB, 64-aligned), its operands are read from there,
 * or with fill unpacked from qs and stored there for the next row tiles: the same bytes. */
static inline __attribute__((always_inline)) void dot_q4(__m512i acc[][2], const uint8_t *qs, uint8_t *uq,
                                                         const int fill, const int32_t *xk, int64_t K, const int R) {
  for (int g = 0; g < 4; ++g) {
    __m512i v[4];
    if (uq && !fill) {
      for (int i = 0; i < 4; ++i) v[i] = _mm512_load_si512(uq + (4 * g + i) * 64);
    } else {
      q4_operands(v, qs, g);
      if (fill)
        for (int i = 0; i < 4; ++i) _mm512_store_si512(uq + (4 * g + i) * 64, v[i]);
    }
    const __m512i lo0 = v[0], hi0 = v[1], lo1 = v[2], hi1 = v[3];
    for (int r = 0; r < R; ++r) {
      const __m512i xa = _mm512_set1_epi32(xk[r * K / 4 + g]), xb = _mm512_set1_epi32(xk[r * K / 4 + g + 4]);
      acc[r][0] = _mm512_dpbusd_epi32(_mm512_dpbusd_epi32(acc[r][0], lo0, xa), hi0, xb);
      acc[r][1] = _mm512_dpbusd_epi32(_mm512_dpbusd_epi32(acc[r][1], lo1, xa), hi1, xb);
    }
  }
}

/* Rows [0, R) of one panel over all blocks (G a record). xq rows are K bytes apart, dx / sx rows B
 * floats apart. Tile t of T also prefetches the next panel's share of blocks t, t + T, ... */
static inline __attribute__((always_inline)) void tile_i8(float *y, int64_t ldy, const int8_t *xq, const float *dx,
                                                          const float *sx, const uint8_t *rec, const float *bias,
                                                          int64_t K, __mmask16 m0, __mmask16 m1, const int R,
                                                          const uint8_t *next, int64_t T, int64_t t, const int bits,
                                                          const int64_t G) {
  const int64_t B = K / QB, grec = GRECB(bits, G), share = grec / G;
  __m512 acc[MRQ][2];
  for (int r = 0; r < R; ++r) acc[r][0] = acc[r][1] = _mm512_setzero_ps();
  const __m512i flip = _mm512_set1_epi8((char)0x80);
  for (int64_t b = 0, i = 0; b < B; ++b, i = i + 1 < G ? i + 1 : 0, rec += i ? 0 : grec) {
    if (b % T == t)
      for (int64_t c = (b * share) & ~63; c < (b + 1) * share; c += 64) _mm_prefetch((const char *)(next + c), _MM_HINT_T1);
    const uint8_t *qs = rec + 2 * NR * 4 + i * QBYTES(bits);
    __m512i is[MRQ][2];
    for (int r = 0; r < R; ++r) is[r][0] = is[r][1] = _mm512_setzero_si512();
    const int32_t *xk = (const int32_t *)(xq + b * QB); /* the 8 groups of 4 int8 of this block */
    if (bits == 4) {
      dot_q4(is, qs, NULL, 0, xk, K, R);
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

/* One row of x for the K formats: xq[K] int8, per super-block dx, and bsum (BSUMS(K) int16, |sum| <=
 * 32 * 127): sum(xq) of each 16 k, then of each 32, so consecutive sub-blocks' sums pair up as the
 * 32-bit operand of vpdpwssd in tile_k's mins pass (K6's sub-blocks are 16 k, K4's 32). */
static void quantize_row_k(const float *x, int8_t *xq, float *dx, int16_t *bsum, int64_t K) {
  for (int64_t b = 0; b < K / QK; ++b) {
    const float *xb = x + b * QK;
    __m512 amax = _mm512_setzero_ps();
    for (int i = 0; i < QK; i += 16) amax = _mm512_max_ps(amax, _mm512_abs_ps(_mm512_loadu_ps(xb + i)));
    const float a = _mm512_reduce_max_ps(amax), id = a > 0.f ? 127.f / a : 0.f;
    const __m512 s = _mm512_set1_ps(id);
    dx[b] = a / 127.f;
    for (int i = 0; i < QK; i += 16) {
      const __m512i q = _mm512_cvt_roundps_epi32(_mm512_mul_ps(_mm512_loadu_ps(xb + i), s), RN);
      _mm_storeu_si128((__m128i *)(xq + b * QK + i), _mm512_cvtsepi32_epi8(q));
      bsum[b * (QK / 16) + i / 16] = (int16_t)_mm512_reduce_add_epi32(q);
    }
  }
  sums_of_32(bsum, K);
}

/* The 2 operands of group g of a K6 sub-block (384 bytes at qs): the 6-bit q of outputs 0-15 and 16-31. */
static inline __attribute__((always_inline)) void k6_group(__m512i w[2], const uint8_t *qs, int g) {
  const __m512i low = _mm512_set1_epi8(0x0F), three = _mm512_set1_epi8(3);
  const __m512i h0 = _mm512_loadu_si512(qs + 2 * 64), h1 = _mm512_loadu_si512(qs + 5 * 64);
  const __m512i n0 = _mm512_loadu_si512(qs + (g / 2) * 64), n1 = _mm512_loadu_si512(qs + (3 + g / 2) * 64);
  const __m512i l0 = _mm512_and_si512(g % 2 ? _mm512_srli_epi16(n0, 4) : n0, low);
  const __m512i l1 = _mm512_and_si512(g % 2 ? _mm512_srli_epi16(n1, 4) : n1, low);
  w[0] = _mm512_or_si512(l0, _mm512_slli_epi16(_mm512_and_si512(_mm512_srli_epi16(h0, 2 * g), three), 4));
  w[1] = _mm512_or_si512(l1, _mm512_slli_epi16(_mm512_and_si512(_mm512_srli_epi16(h1, 2 * g), three), 4));
}

#define KUQ(fmt) ((fmt) == FMT_K4 ? 1024 : 512) /* bytes of a panel's sub-block as unpacked operands (tile_k) */

/* Rows [0, R) of one panel of a K format over all super-blocks (see the header comment). A panel that
 * several row tiles read is unpacked once: its first tile (fill) stores every sub-block's operands in
 * uq (B S KUQ bytes, 64-aligned) as it multiplies them, the next tiles read them from there rather than
 * unpacking them again for each 4 rows (K6's 6-bit q costs 7 operations per 64 bytes); uq NULL: each
 * tile unpacks. */
static inline __attribute__((always_inline)) void tile_k(float *y, int64_t ldy, const int8_t *xq, const float *dx,
                                                         const int16_t *bsum, const uint8_t *rec, uint8_t *uq,
                                                         const int fill, const float *bias, int64_t K, __mmask16 m0,
                                                         __mmask16 m1, const int R, const int fmt, const int first) {
  const int64_t B = K / QK, S = KSUB(fmt), rec_size = KREC(fmt);
  __m512 acc[MRK][2];
  for (int r = 0; r < R; ++r) acc[r][0] = acc[r][1] = _mm512_setzero_ps();
  for (int64_t b = 0; b < B; ++b, rec += rec_size) {
    /* The panel's first tile streams its records from memory: every line of the record KPF ahead
     * into L2, a share of them per sub-block below (one line ahead left one stream at 19-22 GB/s of a
     * 35 GB/s read bandwidth on a 2-core AMD EPYC, one row through SmolLM2-1.7B's Q4_K/Q6_K
     * projections; the whole record at once, 25-27 GB/s, but K6's 116 lines in one burst held its
     * rows at 24-25 GB/s; spread, 33-35 GB/s over Mistral 7B's Q6_K shapes). Later tiles find the
     * records in L2. */
    if (!first) _mm_prefetch((const char *)(rec + rec_size), _MM_HINT_T0);
    const int8_t *sc = (const int8_t *)(rec + 2 * NR * 4), *mn = sc + S * NR;
    const uint8_t *qs = (const uint8_t *)(mn + S * NR);
    __m512i sum[MRK][2];
    for (int r = 0; r < R; ++r) sum[r][0] = sum[r][1] = _mm512_setzero_si512();
    for (int64_t j = 0; j < S; ++j, qs += KQB(fmt), uq = uq ? uq + KUQ(fmt) : NULL) {
      if (first) { /* lines [j per, (j + 1) per) of the record KPF ahead */
        const int64_t per = (rec_size / 64 + S - 1) / S * 64, c1 = (j + 1) * per < rec_size ? (j + 1) * per : rec_size;
        for (int64_t c = j * per; c < c1; c += 64) _mm_prefetch((const char *)(rec + KPF * rec_size + c), _MM_HINT_T1);
      }
      __m512i dot[MRK][2];
      for (int r = 0; r < R; ++r) dot[r][0] = dot[r][1] = _mm512_setzero_si512();
      if (fmt == FMT_K4) {
        dot_q4(dot, qs, uq, fill, (const int32_t *)(xq + b * QK + j * 32), K, R);
      } else {
        const int32_t *xk = (const int32_t *)(xq + b * QK + j * 16);
        for (int g = 0; g < 4; ++g) {
          __m512i w[2];
          if (uq && !fill) {
            w[0] = _mm512_load_si512(uq + 2 * g * 64), w[1] = _mm512_load_si512(uq + (2 * g + 1) * 64);
          } else {
            k6_group(w, qs, g);
            if (fill) _mm512_store_si512(uq + 2 * g * 64, w[0]), _mm512_store_si512(uq + (2 * g + 1) * 64, w[1]);
          }
          for (int r = 0; r < R; ++r) {
            const __m512i xa = _mm512_set1_epi32(xk[r * K / 4 + g]);
            dot[r][0] = _mm512_dpbusd_epi32(dot[r][0], w[0], xa);
            dot[r][1] = _mm512_dpbusd_epi32(dot[r][1], w[1], xa);
          }
        }
      }
      const __m512i s0 = _mm512_cvtepi8_epi32(_mm_loadu_si128((const __m128i *)(sc + j * NR)));
      const __m512i s1 = _mm512_cvtepi8_epi32(_mm_loadu_si128((const __m128i *)(sc + j * NR + 16)));
      for (int r = 0; r < R; ++r) {
        sum[r][0] = _mm512_add_epi32(sum[r][0], _mm512_mullo_epi32(dot[r][0], s0));
        sum[r][1] = _mm512_add_epi32(sum[r][1], _mm512_mullo_epi32(dot[r][1], s1));
      }
    }
    const __m512 d0 = _mm512_loadu_ps((const float *)rec), d1 = _mm512_loadu_ps((const float *)rec + 16);
    for (int r = 0; r < R; ++r) {
      const __m512 s = _mm512_set1_ps(dx[r * B + b]);
      acc[r][0] = _mm512_fmadd_ps(_mm512_cvtepi32_ps(sum[r][0]), _mm512_mul_ps(d0, s), acc[r][0]);
      acc[r][1] = _mm512_fmadd_ps(_mm512_cvtepi32_ps(sum[r][1]), _mm512_mul_ps(d1, s), acc[r][1]);
      sum[r][0] = sum[r][1] = _mm512_setzero_si512(); /* now the mins' sum */
    }
    /* sum_j mn_j bsum_j two sub-blocks per vpdpwssd: lane o holds (mn_j, mn_j+1) of output o as int16,
     * the broadcast (bsum_j, bsum_j+1) of the row; exact in int32, so the same sum as one by one. */
    const int16_t *xp = sub_sums(bsum, K, b, fmt);
    for (int64_t j = 0; j < S; j += 2) {
      const __m128i a0 = _mm_loadu_si128((const __m128i *)(mn + j * NR));
      const __m128i c0 = _mm_loadu_si128((const __m128i *)(mn + (j + 1) * NR));
      const __m128i a1 = _mm_loadu_si128((const __m128i *)(mn + j * NR + 16));
      const __m128i c1 = _mm_loadu_si128((const __m128i *)(mn + (j + 1) * NR + 16));
      const __m512i n0 = _mm512_cvtepi8_epi16(_mm256_set_m128i(_mm_unpackhi_epi8(a0, c0), _mm_unpacklo_epi8(a0, c0)));
      const __m512i n1 = _mm512_cvtepi8_epi16(_mm256_set_m128i(_mm_unpackhi_epi8(a1, c1), _mm_unpacklo_epi8(a1, c1)));
      for (int r = 0; r < R; ++r) {
        int32_t pair;
        memcpy(&pair, xp + r * BSUMS(K) + j, sizeof pair);
        const __m512i x = _mm512_set1_epi32(pair);
        sum[r][0] = _mm512_dpwssd_epi32(sum[r][0], n0, x);
        sum[r][1] = _mm512_dpwssd_epi32(sum[r][1], n1, x);
      }
    }
    const __m512 e0 = _mm512_loadu_ps((const float *)rec + NR), e1 = _mm512_loadu_ps((const float *)rec + NR + 16);
    for (int r = 0; r < R; ++r) {
      const __m512 s = _mm512_set1_ps(dx[r * B + b]);
      acc[r][0] = _mm512_fnmadd_ps(_mm512_cvtepi32_ps(sum[r][0]), _mm512_mul_ps(e0, s), acc[r][0]);
      acc[r][1] = _mm512_fnmadd_ps(_mm512_cvtepi32_ps(sum[r][1]), _mm512_mul_ps(e1, s), acc[r][1]);
    }
  }
  store_tile(y, ldy, acc, bias, m0, m1, R);
}

#if defined(__AMX_INT8__) && defined(__AMX_TILE__)
/* K4 on AMX (Sapphire Rapids on), rows in tiles of 16. Q4_K's 6-bit sub-block scale splits as
 * sc = 8 sh + sl (sh, sl in 0..7), so sh q and sl q fit a byte and the scales fold into three
 * tdpbsud operands per half-panel: Bh = sh q, Bl = sl q and Bm = mn (broadcast over its sub-block).
 * Over a super-block's 256 k the tiles then hold 8 Ch + Cl = sum_j sc_j dot_j and Cm = sum_j mn_j
 * bsum_j, exactly tile_k's two integer sums; the float epilogue is tile_k's op for op in the same
 * order, so a row's result is bit for bit what tile_k gives it (batch invariance holds across the
 * two paths). Tiles: 0 the 16 rows' xq of 64 k, 1 an operand, 2-7 the sums (half x h, l, m).
 * K6 the same way, with the product itself split: P = sc q (sc signed 8-bit, q 6-bit) is
 * 256 Ph + Pl with Pl in 0..255 (tdpbsud) and Ph in -32..31 (tdpbssd), so 256 Ch + Cl is the sum,
 * and Bm = mn (signed: tdpbssd). */
#define AMX_ROWS 16
static int amx_enabled = -1; /* -1: not asked yet */

/* One super-block of a K4 panel as tdpbsud operands: ops[chunk of 64 k][half][h, l, m][16 groups of
 * 4 k][16 outputs x 4 bytes], the groups as tile_k feeds vpdpbusd. */
typedef uint8_t KOperands[4][2][3][16][64];

static void k4_operands(KOperands ops, const uint8_t *rec) {
  const int8_t *sc = (const int8_t *)(rec + 2 * NR * 4), *mn = sc + 8 * NR;
  const uint8_t *qs = (const uint8_t *)(mn + 8 * NR);
  const __m512i low = _mm512_set1_epi8(0x0F), seven = _mm512_set1_epi32(7), bytes = _mm512_set1_epi32(0x01010101);
  for (int j = 0; j < 8; ++j, qs += KQB(FMT_K4))
    for (int h = 0; h < 2; ++h) {
      const __m512i s = _mm512_cvtepu8_epi32(_mm_loadu_si128((const __m128i *)(sc + j * NR + h * 16)));
      const __m512i sh = _mm512_srli_epi32(s, 3), sl = _mm512_and_si512(s, seven);
      const __m512i shw = _mm512_or_si512(sh, _mm512_slli_epi32(sh, 16)), slw = _mm512_or_si512(sl, _mm512_slli_epi32(sl, 16));
      const __m512i m = _mm512_mullo_epi32(_mm512_cvtepu8_epi32(_mm_loadu_si128((const __m128i *)(mn + j * NR + h * 16))), bytes);
      for (int g = 0; g < 8; ++g) {
        const __m512i v = _mm512_loadu_si512(qs + (h * 4 + g % 4) * 64);
        const __m512i q = _mm512_and_si512(g < 4 ? v : _mm512_srli_epi16(v, 4), low);
        const int c = j / 2, row = (j % 2) * 8 + g; /* 8 groups per sub-block, 16 per chunk */
        /* byte products below 256 in both bytes of a 16-bit lane: vpmullw multiplies them apart */
        _mm512_store_si512(ops[c][h][0][row], _mm512_mullo_epi16(q, shw));
        _mm512_store_si512(ops[c][h][1][row], _mm512_mullo_epi16(q, slw));
        _mm512_store_si512(ops[c][h][2][row], m);
      }
    }
}

/* One super-block of a K6 panel as operands, laid out as K4's: [chunk][half][Ph, Pl, mn][group][64]. */
static void k6_operands(KOperands ops, const uint8_t *rec) {
  const int8_t *sc = (const int8_t *)(rec + 2 * NR * 4), *mn = sc + 16 * NR;
  const uint8_t *qs = (const uint8_t *)(mn + 16 * NR);
  const __m512i low = _mm512_set1_epi8(0x0F), three = _mm512_set1_epi8(3), bytes = _mm512_set1_epi32(0x01010101);
  const __m512i lo16 = _mm512_set1_epi16(0x00FF);
  for (int j = 0; j < 16; ++j, qs += KQB(FMT_K6))
    for (int h = 0; h < 2; ++h) {
      const __m512i s32 = _mm512_cvtepi8_epi32(_mm_loadu_si128((const __m128i *)(sc + j * NR + h * 16)));
      const __m512i s16 = _mm512_or_si512(_mm512_and_si512(s32, _mm512_set1_epi32(0xFFFF)), _mm512_slli_epi32(s32, 16));
      const __m512i m = _mm512_mullo_epi32(_mm512_and_si512(_mm512_cvtepi8_epi32(_mm_loadu_si128(
          (const __m128i *)(mn + j * NR + h * 16))), _mm512_set1_epi32(0xFF)), bytes);
      const __m512i hb = _mm512_loadu_si512(qs + (h * 3 + 2) * 64);
      for (int g = 0; g < 4; ++g) {
        const __m512i n = _mm512_loadu_si512(qs + (h * 3 + g / 2) * 64);
        const __m512i q = _mm512_or_si512(_mm512_and_si512(g % 2 ? _mm512_srli_epi16(n, 4) : n, low),
                                          _mm512_slli_epi16(_mm512_and_si512(_mm512_srli_epi16(hb, 2 * g), three), 4));
        /* sc q per byte, exact in 16 bits: the even and the odd bytes apart */
        const __m512i pe = _mm512_mullo_epi16(_mm512_and_si512(q, lo16), s16);
        const __m512i po = _mm512_mullo_epi16(_mm512_srli_epi16(q, 8), s16);
        const int c = j / 4, row = (j % 4) * 4 + g; /* 4 groups per sub-block, 16 per chunk */
        _mm512_store_si512(ops[c][h][0][row], _mm512_or_si512(_mm512_and_si512(_mm512_srai_epi16(pe, 8), lo16),
                                                               _mm512_slli_epi16(_mm512_srai_epi16(po, 8), 8)));
        _mm512_store_si512(ops[c][h][1][row], _mm512_or_si512(_mm512_and_si512(pe, lo16), _mm512_slli_epi16(po, 8)));
        _mm512_store_si512(ops[c][h][2][row], m);
      }
    }
}

#define K4_DP(h, t, T) _tile_loadd(1, ops[c][h][t], 64); _tile_dpbsud(T, 0, 1) /* T = 2 + 3 h + t */
#define K6_DP(h, t, T) _tile_loadd(1, ops[c][h][t], 64); _tile_dpbssd(T, 0, 1)
#define K4_ST(h, t, T) _tile_stored(T, sums[h][t], 64)

/* 16 rows of one super-block b of a K4 or K6 panel into acc[16][32] (tile_k's float accumulators). */
static void amx_rows_k(float acc[][NR], const int8_t *xq, const float *dx, const KOperands ops, const uint8_t *rec,
                       int64_t K, int64_t b, const int fmt) {
  const int64_t B = K / QK;
  const int shift = fmt == FMT_K4 ? 3 : 8; /* sum = Ch << shift + Cl */
  int32_t sums[2][3][AMX_ROWS][16] __attribute__((aligned(64)));
  _tile_zero(2); _tile_zero(3); _tile_zero(4); _tile_zero(5); _tile_zero(6); _tile_zero(7);
  for (int c = 0; c < 4; ++c) {
    _tile_loadd(0, xq + b * QK + c * 64, K);
    if (fmt == FMT_K4) {
      K4_DP(0, 0, 2); K4_DP(0, 1, 3); K4_DP(0, 2, 4); K4_DP(1, 0, 5); K4_DP(1, 1, 6); K4_DP(1, 2, 7);
    } else {
      K6_DP(0, 0, 2); K4_DP(0, 1, 3); K6_DP(0, 2, 4); K6_DP(1, 0, 5); K4_DP(1, 1, 6); K6_DP(1, 2, 7);
    }
  }
  K4_ST(0, 0, 2); K4_ST(0, 1, 3); K4_ST(0, 2, 4); K4_ST(1, 0, 5); K4_ST(1, 1, 6); K4_ST(1, 2, 7);
  const __m512 d0 = _mm512_loadu_ps((const float *)rec), d1 = _mm512_loadu_ps((const float *)rec + 16);
  const __m512 e0 = _mm512_loadu_ps((const float *)rec + NR), e1 = _mm512_loadu_ps((const float *)rec + NR + 16);
  for (int r = 0; r < AMX_ROWS; ++r) {
    const __m512i sum0 = _mm512_add_epi32(_mm512_slli_epi32(_mm512_load_si512(sums[0][0][r]), shift), _mm512_load_si512(sums[0][1][r]));
    const __m512i sum1 = _mm512_add_epi32(_mm512_slli_epi32(_mm512_load_si512(sums[1][0][r]), shift), _mm512_load_si512(sums[1][1][r]));
    const __m512 s = _mm512_set1_ps(dx[r * B + b]);
    __m512 a0 = _mm512_load_ps(acc[r]), a1 = _mm512_load_ps(acc[r] + 16);
    a0 = _mm512_fmadd_ps(_mm512_cvtepi32_ps(sum0), _mm512_mul_ps(d0, s), a0);
    a1 = _mm512_fmadd_ps(_mm512_cvtepi32_ps(sum1), _mm512_mul_ps(d1, s), a1);
    a0 = _mm512_fnmadd_ps(_mm512_cvtepi32_ps(_mm512_load_si512(sums[0][2][r])), _mm512_mul_ps(e0, s), a0);
    a1 = _mm512_fnmadd_ps(_mm512_cvtepi32_ps(_mm512_load_si512(sums[1][2][r])), _mm512_mul_ps(e1, s), a1);
    _mm512_store_ps(acc[r], a0);
    _mm512_store_ps(acc[r] + 16, a1);
  }
}

/* Rows [0, M16) of one K4 or K6 panel on AMX (M16 a multiple of 16, at most AMX_ROW_BLOCK): each
 * super-block's operands built once for all row tiles. */
static void amx_panel_k(float *y, int64_t ldy, const int8_t *xq, const float *dx, const uint8_t *rec,
                        const float *bias, int64_t M16, int64_t K, __mmask16 m0, __mmask16 m1, const int fmt) {
  static __thread KOperands ops __attribute__((aligned(64)));
  static __thread float acc[AMX_ROW_BLOCK][NR] __attribute__((aligned(64)));
  const int64_t B = K / QK;
  memset(acc, 0, (size_t)M16 * sizeof acc[0]);
  for (int64_t b = 0; b < B; ++b, rec += KREC(fmt)) {
    if (fmt == FMT_K4) k4_operands(ops, rec);
    else k6_operands(ops, rec);
    for (int64_t m = 0; m < M16; m += AMX_ROWS) amx_rows_k(acc + m, xq + m * K, dx + m * B, ops, rec, K, b, fmt);
  }
  for (int64_t r = 0; r < M16; ++r) {
    __m512 a[1][2] = {{_mm512_load_ps(acc[r]), _mm512_load_ps(acc[r] + 16)}};
    store_tile(y + r * ldy, ldy, a, bias, m0, m1, 1);
  }
}

/* The legacy blocks of 32 on AMX: per block one tdp per half-panel over 16 rows, the record's q
 * vectors taken as they are as the B operand (8 groups of 4 k x 16 outputs; 4-bit nibbles unpacked
 * first), then tile_i8's float epilogue for that block in the same order: the VNNI path's
 * bits. Tiles: 0 the rows' 32 xq of a block, 1 a half's q, 2-3 the halves' sums. */
static void amx_configure_legacy(void) {
  TileConfig c;
  memset(&c, 0, sizeof c);
  c.palette_id = 1;
  c.rows[0] = AMX_ROWS, c.colsb[0] = QB;
  c.rows[1] = QB / 4, c.colsb[1] = 64;
  c.rows[2] = c.rows[3] = AMX_ROWS, c.colsb[2] = c.colsb[3] = 64;
  _tile_loadconfig(&c);
}

/* Rows [0, M16) of one panel of a legacy format on AMX (M16 a multiple of 16). */
static void amx_panel_i8(float *y, int64_t ldy, const int8_t *xq, const float *dx, const float *sx,
                         const uint8_t *rec, const float *bias, int64_t M16, int64_t K, __mmask16 m0, __mmask16 m1,
                         const int bits, const int64_t G) {
  const int64_t B = K / QB, grec = GRECB(bits, G);
  const __m512i low = _mm512_set1_epi8(0x0F);
  uint8_t u[2][8][64] __attribute__((aligned(64))); /* a 4-bit block's q as bytes */
  int32_t c[2][AMX_ROWS][16] __attribute__((aligned(64)));
  for (int64_t m = 0; m < M16; m += AMX_ROWS) {
    __m512 acc[AMX_ROWS][2];
    for (int r = 0; r < AMX_ROWS; ++r) acc[r][0] = acc[r][1] = _mm512_setzero_ps();
    for (int64_t b = 0; b < B; ++b) {
      const uint8_t *rb = rec + b / G * grec, *qs = rb + 2 * NR * 4 + b % G * QBYTES(bits); /* d, m; q */
      _tile_zero(2);
      _tile_zero(3);
      _tile_loadd(0, xq + m * K + b * QB, K);
      if (bits == 8) {
        _tile_loadd(1, qs, 64);
        _tile_dpbssd(2, 0, 1);
        _tile_loadd(1, qs + 8 * 64, 64);
        _tile_dpbssd(3, 0, 1);
      } else {
        for (int h = 0; h < 2; ++h)
          for (int g = 0; g < 4; ++g) { /* vector g: groups g (low nibbles) and g + 4 (high) */
            const __m512i v = _mm512_loadu_si512(qs + (h * 4 + g) * 64);
            _mm512_store_si512(u[h][g], _mm512_and_si512(v, low));
            _mm512_store_si512(u[h][g + 4], _mm512_and_si512(_mm512_srli_epi16(v, 4), low));
          }
        _tile_loadd(1, u[0], 64);
        _tile_dpbsud(2, 0, 1);
        _tile_loadd(1, u[1], 64);
        _tile_dpbsud(3, 0, 1);
      }
      _tile_stored(2, c[0], 64);
      _tile_stored(3, c[1], 64);
      const __m512 d0 = _mm512_loadu_ps((const float *)rb), d1 = _mm512_loadu_ps((const float *)rb + 16);
      for (int r = 0; r < AMX_ROWS; ++r) {
        const __m512 s = _mm512_set1_ps(dx[(m + r) * B + b]);
        acc[r][0] = _mm512_fmadd_ps(_mm512_cvtepi32_ps(_mm512_load_si512(c[0][r])), _mm512_mul_ps(d0, s), acc[r][0]);
        acc[r][1] = _mm512_fmadd_ps(_mm512_cvtepi32_ps(_mm512_load_si512(c[1][r])), _mm512_mul_ps(d1, s), acc[r][1]);
      }
      if (bits == 4) {
        const __m512 e0 = _mm512_loadu_ps((const float *)rb + NR), e1 = _mm512_loadu_ps((const float *)rb + NR + 16);
        for (int r = 0; r < AMX_ROWS; ++r) {
          const __m512 s = _mm512_set1_ps(sx[(m + r) * B + b]);
          acc[r][0] = _mm512_fmadd_ps(e0, s, acc[r][0]);
          acc[r][1] = _mm512_fmadd_ps(e1, s, acc[r][1]);
        }
      }
    }
    store_tile(y + m * ldy, ldy, acc, bias, m0, m1, AMX_ROWS);
  }
}

/* Whether AMX is used (asking Linux for the tile state once); PAGELLM_CPU_AMX=0 says no. */
static int amx_usable(void) {
  if (amx_enabled < 0) {
    const char *env = getenv("PAGELLM_CPU_AMX");
    amx_enabled = (env == NULL || strcmp(env, "0") != 0) && amx_ready();
  }
  return amx_enabled;
}
#endif

/* Rows of [0, M) that go to AMX tiles: whole tiles of 16, from two tiles on (below that, building a
 * super-block's operands costs more than AMX saves); 0 where AMX is not built or not usable. */
static int64_t amx_rows_of(int64_t M) {
#if defined(__AMX_INT8__) && defined(__AMX_TILE__)
  return M >= 2 * AMX_ROWS && amx_usable() ? M / AMX_ROWS * AMX_ROWS : 0;
#else
  (void)M;
  return 0;
#endif
}

#define CASE_K(R) case R: TILE_K(R); break;
#define TILE_KF(R, F, FMT) tile_k(yy, ldy, xx, dd, bb_sum, w, uq, F, bb, K, m0, m1, R, FMT, t == 0)
#define TILE_K(R)                                              \
  if (uq && t == 0) {                                          \
    if (fmt == FMT_K4) TILE_KF(R, 1, FMT_K4);                  \
    else TILE_KF(R, 1, FMT_K6);                                \
  } else if (fmt == FMT_K4) TILE_KF(R, 0, FMT_K4);             \
  else TILE_KF(R, 0, FMT_K6)

/* Rows [0, M) of a K format against every panel (split between threads in contiguous ranges). */
static void row_block_k(float *y, int64_t ldy, const int8_t *xq, const float *dx, const int16_t *bsum,
                        const uint8_t *wp, const float *bias, int64_t M, int64_t N, int64_t K, const int fmt) {
  const int64_t P = (N + NR - 1) / NR, B = K / QK, panel = B * KREC(fmt);
  const int64_t amx_rows = amx_rows_of(M);
  const int64_t tiles = (M - amx_rows + MRK - 1) / MRK;
#pragma omp parallel
  {
#if defined(__AMX_INT8__) && defined(__AMX_TILE__)
  if (amx_rows) amx_configure_16x64(); /* tile state is per thread */
#endif
  /* A panel that 2 or more row tiles read is unpacked once, by its first (NULL: each tile unpacks). */
  uint8_t *uq = tiles >= 2 ? (uint8_t *)aligned_alloc(64, (size_t)(B * KSUB(fmt) * KUQ(fmt))) : NULL;
#pragma omp for schedule(static)
  for (int64_t p = 0; p < P; ++p) {
    const uint8_t *w = wp + p * panel;
    const PanelOut out = panel_out(p, N, bias);
    const __mmask16 m0 = out.m0, m1 = out.m1;
    const float *bb = out.bias;
    int64_t m = 0;
#if defined(__AMX_INT8__) && defined(__AMX_TILE__)
    if (amx_rows) amx_panel_k(y + p * NR, ldy, xq, dx, w, bb, amx_rows, K, m0, m1, fmt);
    m = amx_rows;
#endif
    for (int64_t t = 0; t < tiles; ++t) {
      const int64_t rows = tile_height(M - amx_rows, m - amx_rows, tiles, t);
      float *yy = y + m * ldy + p * NR;
      const int8_t *xx = xq + m * K;
      const float *dd = dx + m * B;
      const int16_t *bb_sum = bsum + m * BSUMS(K);
      switch (rows) {
        CASE_K(1) CASE_K(2) CASE_K(3)
        default: TILE_K(4); break;
      }
      m += rows;
    }
  }
  free(uq);
#if defined(__AMX_INT8__) && defined(__AMX_TILE__)
  if (amx_rows) _tile_release();
#endif
  }
}

/* The K formats' gemm_packed_i8. */
static int gemm_packed_k(float *y, int64_t ldy, const float *x, int64_t ldx, const uint8_t *wp, const float *bias,
                         int64_t M, int64_t N, int64_t K, const int fmt) {
  const int64_t B = K / QK;
  int8_t *xq = (int8_t *)malloc((size_t)(M ? M : 1) * (K + 4 * B + 2 * BSUMS(K)));
  if (xq == NULL) return -1;
  float *dx = (float *)(xq + M * K);
  int16_t *bsum = (int16_t *)(dx + M * B);
#pragma omp parallel for schedule(static) if (M * K >= 8192)
  for (int64_t m = 0; m < M; ++m) quantize_row_k(x + m * ldx, xq + m * K, dx + m * B, bsum + m * BSUMS(K), K);
  const int64_t rows = amx_rows_of(M) ? AMX_ROW_BLOCK : 256 / MRK * MRK;
  for (int64_t m = 0; m < M; m += rows) {
    const int64_t r = M - m < rows ? M - m : rows;
    row_block_k(y + m * ldy, ldy, xq + m * K, dx + m * B, bsum + m * BSUMS(K), wp, bias, r, N, K, fmt);
  }
  free(xq);
  return 0;
}

#define CASE_I8(R) case R: TILE_I8(R); break;
#define TILE_I8(R)                                                                                  \
  if (bits == 4) tile_i8(yy, ldy, xx, dd, ss, w, bb, K, m0, m1, R, wn, tiles, t, 4, G);             \
  else tile_i8(yy, ldy, xx, dd, ss, w, bb, K, m0, m1, R, wn, tiles, t, 8, 1)

/* Quantized rows [0, M) against every panel (split between threads in contiguous ranges). */
static void row_block_i8(float *y, int64_t ldy, const int8_t *xq, const float *dx, const float *sx,
                         const uint8_t *wp, const float *bias, int64_t M, int64_t N, int64_t K, const int bits,
                         const int64_t G) {
  const int64_t P = (N + NR - 1) / NR, panel = K / QB / G * GRECB(bits, G);
  const int64_t amx_rows = amx_rows_of(M);
  const int64_t tiles = (M - amx_rows + MRQ - 1) / MRQ;
#pragma omp parallel
  {
#if defined(__AMX_INT8__) && defined(__AMX_TILE__)
  if (amx_rows) amx_configure_legacy(); /* tile state is per thread */
#endif
#pragma omp for schedule(static)
  for (int64_t p = 0; p < P; ++p) {
    const uint8_t *w = wp + p * panel;
    const uint8_t *wn = p + 1 < P ? w + panel : w;
    const PanelOut out = panel_out(p, N, bias);
    const __mmask16 m0 = out.m0, m1 = out.m1;
    const float *bb = out.bias;
    int64_t m = 0;
#if defined(__AMX_INT8__) && defined(__AMX_TILE__)
    if (amx_rows) amx_panel_i8(y + p * NR, ldy, xq, dx, sx, w, bb, amx_rows, K, m0, m1, bits, G);
    m = amx_rows;
#endif
    for (int64_t t = 0; t < tiles; ++t) {
      const int64_t rows = tile_height(M - amx_rows, m - amx_rows, tiles, t);
      float *yy = y + m * ldy + p * NR;
      const int8_t *xx = xq + m * K;
      const float *dd = dx + m * (K / QB), *ss = sx + m * (K / QB);
      switch (rows) {
        CASE_I8(1) CASE_I8(2) CASE_I8(3) CASE_I8(4) CASE_I8(5)
        default: TILE_I8(6); break;
      }
      m += rows;
    }
  }
#if defined(__AMX_INT8__) && defined(__AMX_TILE__)
  if (amx_rows) _tile_release();
#endif
  }
}
#else
/* Without AVX512-VNNI: the same packed records read 8 outputs at a time (a quarter of a panel: half
 * q / 2, bytes (q % 2) * 32 on of that half's 64-byte vectors), with AVX2 byte dot products where the
 * compiler targets AVX2 and FMA (vpmaddubsw + vpmaddwd, llama.cpp's pre-VNNI idiom) and plain C
 * otherwise. Every integer sum is the VNNI path's exactly (8-bit blocks multiply signed by signed
 * instead of correcting an unsigned x, the same integer), and the float work is its ops in its
 * order with explicit fmaf, so every path gives the same bits: a row's result depends neither on
 * the batch nor on the machine's ISA. */
#include <math.h>
#define LANES 8
#if defined(__AVX2__) && defined(__FMA__)
#include <immintrin.h>
typedef __m256i VB; /* 8 lanes of 4 bytes */
typedef __m256i VI; /* 8 int32 */
static inline VB vb_load(const uint8_t *p) { return _mm256_loadu_si256((const __m256i *)p); }
static inline VB vb_nib(VB v, int hi) {
  return _mm256_and_si256(hi ? _mm256_srli_epi16(v, 4) : v, _mm256_set1_epi8(0x0F));
}
static inline VB vb_or(VB a, VB b) { return _mm256_or_si256(a, b); }
/* (v >> 2g & 3) << 4 per byte: K6's high 2 bits of group g */
static inline VB vb_high2(VB v, int g) {
  return _mm256_slli_epi16(_mm256_and_si256(_mm256_srli_epi16(v, 2 * g), _mm256_set1_epi8(3)), 4);
}
static inline VI vi_zero(void) { return _mm256_setzero_si256(); }
/* lane l += sum of its 4 unsigned bytes times x's 4 signed bytes (pairs stay below 2^15: u <= 63) */
static inline VI vi_dot_us(VI acc, VB u, int32_t x4) {
  const __m256i p = _mm256_maddubs_epi16(u, _mm256_set1_epi32(x4));
  return _mm256_add_epi32(acc, _mm256_madd_epi16(p, _mm256_set1_epi16(1)));
}
/* the same with signed weight bytes: |w| times x carrying w's sign (|x| <= 127, so no pair saturates) */
static inline VI vi_dot_ss(VI acc, VB w, int32_t x4) {
  const __m256i x = _mm256_set1_epi32(x4);
  const __m256i p = _mm256_maddubs_epi16(_mm256_sign_epi8(w, w), _mm256_sign_epi8(x, w));
  return _mm256_add_epi32(acc, _mm256_madd_epi16(p, _mm256_set1_epi16(1)));
}
static inline VI vi_add(VI a, VI b) { return _mm256_add_epi32(a, b); }
static inline VI vi_mul_i8(VI a, const int8_t *s) {
  return _mm256_mullo_epi32(a, _mm256_cvtepi8_epi32(_mm_loadl_epi64((const __m128i *)s)));
}
/* lane l += a[l] x0 + b[l] x1 (vpmaddwd on (a, b) as int16 pairs; every product and sum exact) */
static inline VI vi_madd_pair(VI acc, const int8_t *a, const int8_t *b, int16_t x0, int16_t x1) {
  const __m128i ab = _mm_unpacklo_epi8(_mm_loadl_epi64((const __m128i *)a), _mm_loadl_epi64((const __m128i *)b));
  const __m256i x = _mm256_set1_epi32((int32_t)((uint32_t)(uint16_t)x0 | (uint32_t)(uint16_t)x1 << 16));
  return _mm256_add_epi32(acc, _mm256_madd_epi16(_mm256_cvtepi8_epi16(ab), x));
}
static inline void vi_store(int32_t *out, VI v) { _mm256_storeu_si256((__m256i *)out, v); }
#else
typedef struct { uint8_t b[4 * LANES]; } VB;
typedef struct { int32_t l[LANES]; } VI;
static inline VB vb_load(const uint8_t *p) { VB v; memcpy(v.b, p, sizeof v.b); return v; }
static inline VB vb_nib(VB v, int hi) {
  for (int i = 0; i < 4 * LANES; ++i) v.b[i] = (uint8_t)((hi ? v.b[i] >> 4 : v.b[i]) & 0x0F);
  return v;
}
static inline VB vb_or(VB a, VB b) {
  for (int i = 0; i < 4 * LANES; ++i) a.b[i] |= b.b[i];
  return a;
}
static inline VB vb_high2(VB v, int g) {
  for (int i = 0; i < 4 * LANES; ++i) v.b[i] = (uint8_t)(((v.b[i] >> (2 * g)) & 3) << 4);
  return v;
}
static inline VI vi_zero(void) { VI v; memset(&v, 0, sizeof v); return v; }
static inline VI vi_dot_us(VI acc, VB u, int32_t x4) {
  int8_t x[4];
  memcpy(x, &x4, 4);
  for (int l = 0; l < LANES; ++l)
    for (int i = 0; i < 4; ++i) acc.l[l] += (int32_t)u.b[4 * l + i] * x[i];
  return acc;
}
static inline VI vi_dot_ss(VI acc, VB w, int32_t x4) {
  int8_t x[4];
  memcpy(x, &x4, 4);
  for (int l = 0; l < LANES; ++l)
    for (int i = 0; i < 4; ++i) acc.l[l] += (int32_t)(int8_t)w.b[4 * l + i] * x[i];
  return acc;
}
static inline VI vi_add(VI a, VI b) {
  for (int l = 0; l < LANES; ++l) a.l[l] += b.l[l];
  return a;
}
static inline VI vi_mul_i8(VI a, const int8_t *s) {
  for (int l = 0; l < LANES; ++l) a.l[l] *= s[l];
  return a;
}
static inline VI vi_madd_pair(VI acc, const int8_t *a, const int8_t *b, int16_t x0, int16_t x1) {
  for (int l = 0; l < LANES; ++l) acc.l[l] += a[l] * x0 + b[l] * x1;
  return acc;
}
static inline void vi_store(int32_t *out, VI v) { memcpy(out, v.l, sizeof v.l); }
#endif

#define MRV 4 /* rows per tile */

/* acc[l] = fma(is[l], d[l] * s, acc[l]) (sign -1: fnmadd), lane by lane as the VNNI path does */
static inline void fma_lanes(float *acc, VI is, const float *d, float s, float sign) {
  int32_t v[LANES];
  vi_store(v, is);
  for (int l = 0; l < LANES; ++l) acc[l] = fmaf(sign * (float)v[l], d[l] * s, acc[l]);
}

/* y[r][0:8] = acc[r] (+ bias), the first `live` lanes */
static void store_lanes(float *y, int64_t ldy, float acc[][LANES], const float *bias, int live, int R) {
  for (int r = 0; r < R; ++r)
    for (int l = 0; l < live; ++l) y[r * ldy + l] = bias ? acc[r][l] + bias[l] : acc[r][l];
}

/* One row, one block of 32 for the legacy formats: xq, dx and sx = dx * sum(xq) (quantize_row). */
static void quantize_row(const float *x, int8_t *xq, float *dx, float *sx, int64_t K) {
  for (int64_t b = 0; b < K / QB; ++b) {
    const float *xb = x + b * QB;
    float amax = 0.f;
    for (int i = 0; i < QB; ++i) amax = fmaxf(amax, fabsf(xb[i]));
    const float d = amax / 127.f, id = amax > 0.f ? 127.f / amax : 0.f;
    int32_t sum = 0;
    for (int i = 0; i < QB; ++i) {
      float v = nearbyintf(xb[i] * id);
      v = v < -128.f ? -128.f : v > 127.f ? 127.f : v;
      xq[b * QB + i] = (int8_t)v;
      sum += (int32_t)v;
    }
    dx[b] = d;
    sx[b] = d * (float)sum;
  }
}

static void quantize_row_k(const float *x, int8_t *xq, float *dx, int16_t *bsum, int64_t K) {
  for (int64_t b = 0; b < K / QK; ++b) {
    const float *xb = x + b * QK;
    float a = 0.f;
    for (int i = 0; i < QK; ++i) a = fmaxf(a, fabsf(xb[i]));
    const float id = a > 0.f ? 127.f / a : 0.f;
    dx[b] = a / 127.f;
    for (int i = 0; i < QK; i += 16) {
      int32_t sum = 0;
      for (int k = i; k < i + 16; ++k) {
        float v = nearbyintf(xb[k] * id);
        sum += (int32_t)v;
        v = v < -128.f ? -128.f : v > 127.f ? 127.f : v;
        xq[b * QK + k] = (int8_t)v;
      }
      bsum[b * (QK / 16) + i / 16] = (int16_t)sum;
    }
  }
  sums_of_32(bsum, K);
}

/* acc[r] += a 4-bit block's 32 k (a half's 4 vectors at qs, this quarter's bytes) against rows [0, R)
 * of xq (xk: the block's 8 groups of 4 int8 in row 0; rows K bytes apart), weights decoded once. */
static inline __attribute__((always_inline)) void dot_q4_v(VI acc[], const uint8_t *qs, const int32_t *xk, int64_t K,
                                                           const int R) {
  for (int g = 0; g < 4; ++g) {
    const VB v = vb_load(qs + g * 64), lo = vb_nib(v, 0), hi = vb_nib(v, 1);
    for (int r = 0; r < R; ++r) acc[r] = vi_dot_us(vi_dot_us(acc[r], lo, xk[r * K / 4 + g]), hi, xk[r * K / 4 + g + 4]);
  }
}

/* Rows [0, R) of quarter q of one panel of a legacy format over all blocks (tile_i8's arithmetic). */
static inline __attribute__((always_inline)) void tile_v(float *y, int64_t ldy, const int8_t *xq, const float *dx,
                                                         const float *sx, const uint8_t *rec, const float *bias,
                                                         int64_t K, int q, int live, const int R, const int bits,
                                                         const int64_t G) {
  const int64_t B = K / QB, grec = GRECB(bits, G);
  const int half = q / 2, off = (q % 2) * 32;
  float acc[MRV][LANES] = {{0.f}};
  for (int64_t b = 0, i = 0; b < B; ++b, i = i + 1 < G ? i + 1 : 0, rec += i ? 0 : grec) {
    const uint8_t *qs = rec + 2 * NR * 4 + i * QBYTES(bits) + half * (bits == 4 ? 4 : 8) * 64 + off;
    const float *d = (const float *)rec + q * LANES, *e = (const float *)rec + NR + q * LANES;
    const int32_t *xk = (const int32_t *)(xq + b * QB);
    VI is[MRV];
    for (int r = 0; r < R; ++r) is[r] = vi_zero();
    if (bits == 4) {
      dot_q4_v(is, qs, xk, K, R);
    } else {
      for (int g = 0; g < 8; ++g) {
        const VB w = vb_load(qs + g * 64);
        for (int r = 0; r < R; ++r) is[r] = vi_dot_ss(is[r], w, xk[r * K / 4 + g]);
      }
    }
    for (int r = 0; r < R; ++r) {
      fma_lanes(acc[r], is[r], d, dx[r * B + b], 1.f);
      if (bits == 4)
        for (int l = 0; l < LANES; ++l) acc[r][l] = fmaf(e[l], sx[r * B + b], acc[r][l]);
    }
  }
  store_lanes(y, ldy, acc, bias, live, R);
}

/* Rows [0, R) of quarter q of one panel of a K format over all super-blocks (tile_k's arithmetic). */
static inline __attribute__((always_inline)) void tile_kv(float *y, int64_t ldy, const int8_t *xq, const float *dx,
                                                          const int16_t *bsum, const uint8_t *rec, const float *bias,
                                                          int64_t K, int q, int live, const int R, const int fmt) {
  const int64_t B = K / QK, S = KSUB(fmt), rec_size = KREC(fmt);
  const int half = q / 2, off = (q % 2) * 32;
  float acc[MRV][LANES] = {{0.f}};
  for (int64_t b = 0; b < B; ++b, rec += rec_size) {
    const int8_t *sc = (const int8_t *)(rec + 2 * NR * 4), *mn = sc + S * NR;
    const uint8_t *qs = (const uint8_t *)(mn + S * NR);
    const float *d = (const float *)rec + q * LANES, *e = (const float *)rec + NR + q * LANES;
    VI sum[MRV];
    for (int r = 0; r < R; ++r) sum[r] = vi_zero();
    for (int64_t j = 0; j < S; ++j, qs += KQB(fmt)) {
      VI dot[MRV];
      for (int r = 0; r < R; ++r) dot[r] = vi_zero();
      if (fmt == FMT_K4) {
        dot_q4_v(dot, qs + half * 4 * 64 + off, (const int32_t *)(xq + b * QK + j * 32), K, R);
      } else {
        const int32_t *xk = (const int32_t *)(xq + b * QK + j * 16);
        const uint8_t *h = qs + half * 3 * 64 + off;
        const VB hb = vb_load(h + 2 * 64);
        for (int g = 0; g < 4; ++g) {
          const VB w = vb_or(vb_nib(vb_load(h + (g / 2) * 64), g % 2), vb_high2(hb, g));
          for (int r = 0; r < R; ++r) dot[r] = vi_dot_us(dot[r], w, xk[r * K / 4 + g]);
        }
      }
      for (int r = 0; r < R; ++r) sum[r] = vi_add(sum[r], vi_mul_i8(dot[r], sc + j * NR + q * LANES));
    }
    for (int r = 0; r < R; ++r) {
      fma_lanes(acc[r], sum[r], d, dx[r * B + b], 1.f);
      const int16_t *bs = sub_sums(bsum + r * BSUMS(K), K, b, fmt);
      VI msum = vi_zero(); /* tile_k's mins pass: two sub-blocks at a time */
      for (int64_t j = 0; j < S; j += 2)
        msum = vi_madd_pair(msum, mn + j * NR + q * LANES, mn + (j + 1) * NR + q * LANES, bs[j], bs[j + 1]);
      fma_lanes(acc[r], msum, e, dx[r * B + b], -1.f);
    }
  }
  store_lanes(y, ldy, acc, bias, live, R);
}

#define CASE_V(R)                                                                                            \
  case R:                                                                                                    \
    if (kf) tile_kv(yy, ldy, xq + m * K, dx + m * B, bsum + m * BSUMS(K), w, bb, K, (int)q, live, R, fmt);   \
    else if (bits == 4) tile_v(yy, ldy, xq + m * K, dx + m * B, sx + m * B, w, bb, K, (int)q, live, R, 4, G); \
    else tile_v(yy, ldy, xq + m * K, dx + m * B, sx + m * B, w, bb, K, (int)q, live, R, 8, 1);               \
    break;

/* gemm_packed_i8 for one format without VNNI: quantize every row, then panels x quarters x row tiles. */
static int gemm_packed_v(float *y, int64_t ldy, const float *x, int64_t ldx, const uint8_t *wp, const float *bias,
                         int64_t M, int64_t N, int64_t K, const int fmt) {
  const int kf = is_kfmt(fmt), bits = fmt_bits(fmt);
  const int64_t blk = kf ? QK : QB, B = K / blk, G = fmt_group(fmt);
  const int64_t panel = kf ? B * KREC(fmt) : B / G * GRECB(bits, G);
  int8_t *xq = (int8_t *)malloc((size_t)(M ? M : 1) * (K + 8 * B + 2 * BSUMS(K)));
  if (xq == NULL) return -1;
  float *dx = (float *)(xq + M * K), *sx = dx + M * B;
  int16_t *bsum = (int16_t *)(sx + M * B);
#pragma omp parallel for schedule(static) if (M * K >= 8192)
  for (int64_t m = 0; m < M; ++m) {
    if (kf) quantize_row_k(x + m * ldx, xq + m * K, dx + m * B, bsum + m * BSUMS(K), K);
    else quantize_row(x + m * ldx, xq + m * K, dx + m * B, sx + m * B, K);
  }
  const int64_t P = (N + NR - 1) / NR;
#pragma omp parallel for schedule(static)
  for (int64_t pq = 0; pq < P * 4; ++pq) {
    const int64_t p = pq / 4, q = pq % 4, n0 = p * NR + q * LANES;
    if (n0 >= N) continue;
    const int live = N - n0 < LANES ? (int)(N - n0) : LANES;
    for (int64_t m = 0; m < M; m += MRV) {
      const int R = M - m < MRV ? (int)(M - m) : MRV;
      float *yy = y + m * ldy + n0;
      const float *bb = bias ? bias + n0 : NULL;
      const uint8_t *w = wp + p * panel;
      switch (R) {
        CASE_V(1) CASE_V(2) CASE_V(3) CASE_V(4)
      }
    }
  }
  free(xq);
  return 0;
}
#endif

/* y = x W^T (+ bias) for W packed in format `fmt` (pack_weight_i8 / pack_blocks_i8: 4, 8 or FMT_G4 + G;
 * pack_kquant: K4, K6; or FMT_PARTS); 0, or -1 if the scratch for the quantized x could not be allocated. */
int gemm_packed_i8(float *y, int64_t ldy, const float *x, int64_t ldx, const uint8_t *wp, const float *bias,
                   int64_t M, int64_t N, int64_t K, int64_t fmt) {
  if (fmt == FMT_PARTS) { /* each run of output rows in its own format, into its columns of y */
    const int64_t *h = (const int64_t *)wp;
    for (int64_t i = 0, n0 = 0; i < h[0]; n0 += h[2 + 3 * i], ++i) {
      const int rc = gemm_packed_i8(y + n0, ldy, x, ldx, wp + h[3 + 3 * i], bias ? bias + n0 : NULL, M, h[2 + 3 * i], K,
                                    h[1 + 3 * i]);
      if (rc) return rc;
    }
    return 0;
  }
#if defined(__AVX512F__) && defined(__AVX512VNNI__) && defined(__AVX512BW__)
  if (is_kfmt(fmt)) return gemm_packed_k(y, ldy, x, ldx, wp, bias, M, N, K, (int)fmt);
  const int64_t B = K / QB, G = fmt_group(fmt);
  int8_t *xq = (int8_t *)malloc((size_t)(M ? M : 1) * (K + 8 * B));
  if (xq == NULL) return -1;
  float *dx = (float *)(xq + M * K), *sx = dx + M * B; /* K is a multiple of 32: aligned for floats */
  /* Rows are independent, so splitting them never changes a bit; from 8192 values (a 64-row decode
   * step at K = 576 is 36,864) the second thread pays for the parallel region. */
#pragma omp parallel for schedule(static) if (M * K >= 8192)
  for (int64_t m = 0; m < M; ++m) quantize_row(x + m * ldx, xq + m * K, dx + m * B, sx + m * B, K);
  /* Row blocks whose quantized x stays in L2 while every panel streams past it. */
  const int64_t rows = amx_rows_of(M) ? AMX_ROW_BLOCK : 256 / MRQ * MRQ;
  for (int64_t m = 0; m < M; m += rows) {
    const int64_t r = M - m < rows ? M - m : rows;
    if (fmt_bits(fmt) == 4)
      row_block_i8(y + m * ldy, ldy, xq + m * K, dx + m * B, sx + m * B, wp, bias, r, N, K, 4, G);
    else
      row_block_i8(y + m * ldy, ldy, xq + m * K, dx + m * B, sx + m * B, wp, bias, r, N, K, 8, 1);
  }
  free(xq);
  return 0;
#else
  return gemm_packed_v(y, ldy, x, ldx, wp, bias, M, N, K, (int)fmt);
#endif
}

/* 1 if the K formats run their 16-row tiles on AMX here; `enable` 0 or 1 turns that off or on (tests
 * compare the two paths bit for bit), -1 only asks. */
int gemm_i8_amx(int enable) {
#if defined(__AMX_INT8__) && defined(__AMX_TILE__) && defined(__AVX512VNNI__) && defined(__AVX512BW__)
  if (enable == 0) amx_enabled = 0;
  else if (enable == 1 && amx_enabled == 0) amx_enabled = -1;
  return amx_usable();
#else
  (void)enable;
  return 0;
#endif
}
