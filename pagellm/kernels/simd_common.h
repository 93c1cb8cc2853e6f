/* What the kernels share (included by cpu_ops.c, gemm.c, paged_decode.c, paged_prefill.c and
 * paged_prefill_amx.c;
 * pagellm/kernels/__init__.py hashes this header into every kernel's build key). */
#ifndef PAGELLM_SIMD_COMMON_H
#define PAGELLM_SIMD_COMMON_H
#include <stdint.h>
#include <string.h>

/* A paged K/V cache's element type (the attention kernels' `et`): int8 head rows end with their
 * float32 scale (pagellm/attention/kv_quant.py). */
enum { ET_F32 = 0, ET_F16 = 1, ET_I8 = 2 };
#define ET_SIZE(et) ((et) == ET_I8 ? 1 : (et) == ET_F16 ? 2 : 4) /* bytes per cached element */

/* The float32 scale stored after an int8 head row's d values (attention/kv_quant.py). */
static inline float row_scale_d(const void *base, int64_t off, int64_t d) {
  float s;
  memcpy(&s, (const int8_t *)base + off + d, sizeof s);
  return s;
}

/* The attention kernels' head sizes, as DV = D / 16 vectors: any multiple of 16 up to 256 (0: none).
 * 64, 80, 96, 128 and 256 have instances with DV a compile-time constant; the others run one
 * generic instance (DV a run-time value: the same operations in the same order, loops rolled). */
static inline int head_dv(int64_t D) { return D % 16 == 0 && D >= 16 && D <= 256 ? (int)(D / 16) : 0; }

/* exp(x) in float32 to ~2 ulp: Cephes' expf. x = n ln2 + r with |r| <= ln2/2, a degree-6
 * polynomial for exp(r), times 2^n. One set of constants for the scalar version (written so the
 * compiler vectorises it; glibc's expf is a scalar call without -ffast-math) and exp512 below. */
#define EXP_HI 88.0f
#define EXP_LO -87.0f
#define EXP_LOG2E 1.44269504088896341f
#define EXP_LN2_HI 0.693359375f
#define EXP_LN2_LO -2.12194440e-4f
#define EXP_P0 1.9875691500e-4f
#define EXP_P1 1.3981999507e-3f
#define EXP_P2 8.3334519073e-3f
#define EXP_P3 4.1665795894e-2f
#define EXP_P4 1.6666665459e-1f
#define EXP_P5 5.0000001201e-1f

static inline float exp_f32(float x) {
  x = x < EXP_LO ? EXP_LO : (x > EXP_HI ? EXP_HI : x);
  const float big = 12582912.0f; /* 1.5 * 2^23: adding it rounds to an integer */
  const float n = (x * EXP_LOG2E + big) - big;
  float r = x - n * EXP_LN2_HI;
  r = r - n * EXP_LN2_LO;
  float p = EXP_P0;
  p = p * r + EXP_P1;
  p = p * r + EXP_P2;
  p = p * r + EXP_P3;
  p = p * r + EXP_P4;
  p = p * r + EXP_P5;
  p = p * r * r + r + 1.0f;
  const int32_t bits = ((int32_t)n + 127) << 23; /* 2^n in the exponent bits */
  float scale;
  memcpy(&scale, &bits, sizeof scale);
  return p * scale;
}

/* tanh(x) = 1 - 2 / (exp(2x) + 1), with exp_f32 (clamped, so large |x| give +-1): attention logit
 * soft-capping, cap * tanh(s / cap) (Gemma 2), in the decode kernel's two paths alike. */
static inline float tanh_f32(float x) { return 1.0f - 2.0f / (exp_f32(2.0f * x) + 1.0f); }

/* float32 -> bfloat16, rounded to nearest even (torch's .bfloat16()); a NaN stays a quiet NaN. The
 * bfloat16 GEMMs' weights and x, and the AMX prefill attention's q, K, V and P. */
static inline uint16_t bf16_round(float f) {
  uint32_t u;
  memcpy(&u, &f, sizeof u);
  if ((u & 0x7FFFFFFFu) > 0x7F800000u) return (uint16_t)((u >> 16) | 0x40); /* NaN stays a (quiet) NaN */
  return (uint16_t)((u + 0x7FFFu + ((u >> 16) & 1u)) >> 16);
}

#ifdef __AVX512F__
#include <immintrin.h>

/* 16 cached values from element offset `off` of a float32 (et = ET_F32), float16 (ET_F16) or int8
 * (ET_I8: the raw integers; the caller applies the row's scale) cache. */
static inline __attribute__((always_inline)) __m512 load16(const void *base, int64_t off, const int et) {
  if (et == ET_I8)
    return _mm512_cvtepi32_ps(_mm512_cvtepi8_epi32(_mm_loadu_si128((const __m128i *)((const int8_t *)base + off))));
  return et == ET_F16 ? _mm512_cvtph_ps(_mm256_loadu_si256((const __m256i *)((const uint16_t *)base + off)))
                      : _mm512_loadu_ps((const float *)base + off);
}

/* The sum of x's 16 lanes in a fixed order, GCC's _mm512_reduce_add_ps spelled out: lanes i + 8,
 * then i + 4, then (0 + 2) + (1 + 3). The decode kernel's softmax denominator; the prefill kernel
 * adds its sixteen running sums in the same order, so both give the same bits on any compiler. */
static inline float hsum512(__m512 x) {
  const __m256 a = _mm256_add_ps(_mm256_castpd_ps(_mm512_extractf64x4_pd(_mm512_castps_pd(x), 1)),
                                 _mm512_castps512_ps256(x));
  const __m128 b = _mm_add_ps(_mm256_extractf128_ps(a, 1), _mm256_castps256_ps128(a));
  const __m128 c = _mm_add_ps(b, _mm_shuffle_ps(b, b, _MM_SHUFFLE(1, 0, 3, 2)));
  return _mm_cvtss_f32(c) + _mm_cvtss_f32(_mm_shuffle_ps(c, c, 1));
}

/* exp_f32 for 16 floats (the same constants), 2^n by scalef. */
static inline __m512 exp512(__m512 x) {
  x = _mm512_max_ps(_mm512_min_ps(x, _mm512_set1_ps(EXP_HI)), _mm512_set1_ps(EXP_LO));
  __m512 n = _mm512_roundscale_ps(_mm512_mul_ps(x, _mm512_set1_ps(EXP_LOG2E)), _MM_FROUND_TO_NEAREST_INT | _MM_FROUND_NO_EXC);
  __m512 r = _mm512_fnmadd_ps(n, _mm512_set1_ps(EXP_LN2_HI), x);
  r = _mm512_fnmadd_ps(n, _mm512_set1_ps(EXP_LN2_LO), r);
  __m512 p = _mm512_set1_ps(EXP_P0);
  p = _mm512_fmadd_ps(p, r, _mm512_set1_ps(EXP_P1));
  p = _mm512_fmadd_ps(p, r, _mm512_set1_ps(EXP_P2));
  p = _mm512_fmadd_ps(p, r, _mm512_set1_ps(EXP_P3));
  p = _mm512_fmadd_ps(p, r, _mm512_set1_ps(EXP_P4));
  p = _mm512_fmadd_ps(p, r, _mm512_set1_ps(EXP_P5));
  p = _mm512_fmadd_ps(_mm512_mul_ps(p, r), r, _mm512_add_ps(r, _mm512_set1_ps(1.0f)));
  return _mm512_scalef_ps(p, n);
}

/* tanh_f32 for 16 floats. */
static inline __m512 tanh512(__m512 x) {
  const __m512 one = _mm512_set1_ps(1.0f);
  const __m512 e = exp512(_mm512_add_ps(x, x));
  return _mm512_sub_ps(one, _mm512_div_ps(_mm512_set1_ps(2.0f), _mm512_add_ps(e, one)));
}

/* bf16_round of 16 floats at once, bit for bit (the scalar loop was a quarter of a 2048-row GEMM's
 * time at K = 2048, one thread; vcvtneps2bf16 is not used: it flushes denormals). */
static inline __m256i bf16_round16(__m512 v) {
  const __m512i u = _mm512_castps_si512(v);
  const __m512i odd = _mm512_and_si512(_mm512_srli_epi32(u, 16), _mm512_set1_epi32(1));
  const __m512i r = _mm512_srli_epi32(_mm512_add_epi32(_mm512_add_epi32(u, _mm512_set1_epi32(0x7FFF)), odd), 16);
  const __mmask16 nan = _mm512_cmpgt_epu32_mask(_mm512_and_si512(u, _mm512_set1_epi32(0x7FFFFFFF)),
                                                _mm512_set1_epi32(0x7F800000));
  const __m512i q = _mm512_or_si512(_mm512_srli_epi32(u, 16), _mm512_set1_epi32(0x40));
  return _mm512_cvtepi32_epi16(_mm512_mask_mov_epi32(r, nan, q));
}
#endif
#endif
