/* GGUF's quantized blocks recognised in a dequantized float32 weight (included by gemm.c and
 * gemm_int8.c; pagellm/kernels/__init__.py hashes this header into every kernel's build key).
 *   bits = 4 (Q4_1): fl(fl(d * q) + m), q in 0..15;   bits = 8 (Q8_0): fl(d * q), q in -128..127. */
#ifndef PAGELLM_GGUF_BLOCKS_H
#define PAGELLM_GGUF_BLOCKS_H
#include <math.h>
#include <stdint.h>
#include <string.h>
#if defined(__AVX512F__) || defined(__F16C__)
#include <immintrin.h>
#endif

#define QB 32 /* k per block */
#define RN (_MM_FROUND_TO_NEAREST_INT | _MM_FROUND_NO_EXC)

#if defined(__AVX512F__)
/* fl(d * q) (+ m, rounded again): explicit rounding ops, which the compiler never fuses into an FMA. */
static inline float q_value(float d, float q, float m, const int bits) {
  const __m128 p = _mm_mul_round_ss(_mm_set_ss(d), _mm_set_ss(q), RN);
  return bits == 4 ? _mm_cvtss_f32(_mm_add_round_ss(p, _mm_set_ss(m), RN)) : _mm_cvtss_f32(p);
}
#else
/* The same in C; the pragma keeps the compiler from fusing the two roundings into an FMA. */
#pragma GCC push_options
#pragma GCC optimize("fp-contract=off")
static float q_value(float d, float q, float m, const int bits) {
  const volatile float p = d * q;
  return bits == 4 ? p + m : p;
}
#pragma GCC pop_options
#endif

#if defined(__F16C__)
static inline unsigned short to_half(float f) { return _cvtss_sh(f, RN); }
static inline float from_half(unsigned short h) { return _cvtsh_ss(h); }
#else
/* IEEE half precision, round to nearest even (F16C's vcvtps2ph / vcvtph2ps, in C). */
static unsigned short to_half(float f) {
  uint32_t x;
  memcpy(&x, &f, 4);
  const uint32_t sign = (x >> 16) & 0x8000, a = x & 0x7FFFFFFF;
  if (a >= 0x7F800000) return (unsigned short)(sign | 0x7C00 | (a > 0x7F800000 ? 0x200 : 0)); /* inf, NaN */
  if (a >= 0x477FF000) return (unsigned short)(sign | 0x7C00); /* rounds past 65504: inf */
  if (a < 0x38800000) { /* subnormal half (or zero): a multiple of 2^-24 */
    const float v = nearbyintf(fabsf(f) * 16777216.f); /* exact scaling, then RNE */
    return (unsigned short)(sign | (uint32_t)v);
  }
  const uint32_t r = a - 0x38000000; /* rebias exponent 127 -> 15 (still 13 extra mantissa bits) */
  const uint32_t h = (r >> 13) + (((r & 0x1FFF) > 0x1000 || ((r & 0x1FFF) == 0x1000 && ((r >> 13) & 1))) ? 1 : 0);
  return (unsigned short)(sign | h);
}
static float from_half(unsigned short h) {
  const uint32_t sign = (uint32_t)(h & 0x8000) << 16, e = (h >> 10) & 0x1F, m = h & 0x3FF;
  float v;
  if (e == 0) v = (float)m / 16777216.f;
  else if (e == 31) v = m ? NAN : INFINITY;
  else {
    const uint32_t x = ((e + 112) << 23) | (m << 13);
    memcpy(&v, &x, 4);
  }
  return sign ? -v : v;
}
#endif

/* d (and m) and q of one run of 32 values if it is exactly a block of `bits`; 0 otherwise. As
 * GGUF's quantizers make them: for 4 bits m is the run's minimum (q = 0 there) and its maximum has
 * q = 15; for 8 bits the largest magnitude has |q| = 127. d is tried as the half-precision rounding
 * of that quotient (GGUF stores d in half precision), its two neighbours and the unrounded
 * quotient, and kept if every value comes back bit for bit. */
static inline int fit_q(const float *w, float *d_out, float *m_out, int *q, const int bits) {
  float lo = w[0], hi = w[0], amax = 0.f;
  for (int i = 0; i < QB; ++i) {
    lo = w[i] < lo ? w[i] : lo;
    hi = w[i] > hi ? w[i] : hi;
    amax = fabsf(w[i]) > amax ? fabsf(w[i]) : amax;
  }
  const float m = bits == 4 ? lo : 0.f, qmin = bits == 4 ? 0.f : -128.f, qmax = bits == 4 ? 15.f : 127.f;
  const float est = bits == 4 ? (hi - lo) / 15.f : amax / 127.f;
  const unsigned short h = to_half(est);
  const float cands[4] = {from_half(h), from_half((unsigned short)(h + 1)), from_half((unsigned short)(h - 1)), est};
  for (int c = 0; c < 4; ++c) {
    const float d = cands[c];
    if (!(d >= 0.f) || d > 1e30f) continue; /* also rejects NaN */
    int ok = 1;
    for (int i = 0; i < QB && ok; ++i) {
      float r = d > 0.f ? nearbyintf((w[i] - m) / d) : 0.f;
      r = r < qmin ? qmin : r > qmax ? qmax : r;
      const float v = q_value(d, r, m, bits);
      ok = memcmp(&v, &w[i], sizeof v) == 0;
      q[i] = (int)r;
    }
    if (ok) {
      *d_out = d;
      *m_out = m;
      return 1;
    }
  }
  return 0;
}
#endif
