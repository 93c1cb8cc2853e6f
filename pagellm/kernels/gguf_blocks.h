/* GGUF's quantized blocks recognised in a dequantized float32 weight (included by gemm.c and
 * gemm_int8.c; pagellm/kernels/__init__.py hashes this header into every kernel's build key).
 *   bits = 4 (Q4_1): fl(fl(d * q) + m), q in 0..15;   bits = 8 (Q8_0): fl(d * q), q in -128..127. */
#ifndef PAGELLM_GGUF_BLOCKS_H
#define PAGELLM_GGUF_BLOCKS_H
#include <math.h>
#include <string.h>
#ifdef __AVX512F__
#include <immintrin.h>
#endif

#define QB 32 /* k per block */
#define RN (_MM_FROUND_TO_NEAREST_INT | _MM_FROUND_NO_EXC)

#ifdef __AVX512F__
/* fl(d * q) (+ m, rounded again): explicit rounding ops, which the compiler never fuses into an FMA. */
static inline float q_value(float d, float q, float m, const int bits) {
  const __m128 p = _mm_mul_round_ss(_mm_set_ss(d), _mm_set_ss(q), RN);
  return bits == 4 ? _mm_cvtss_f32(_mm_add_round_ss(p, _mm_set_ss(m), RN)) : _mm_cvtss_f32(p);
}

/* d (and m) and q of one run of 32 values if it is exactly a block of `bits`; 0 otherwise. As
 * GGUF's quantizers make them: for 4 bits m is the run's minimum (q = 0 there) and its maximum has
 * q = 15; for 8 bits the largest magnitude has |q| = 127. d is tried as the half-precision rounding
 * of that quotient (GGUF stores d in half precision), its two neighbours and the unrounded
 * quotient, and kept if every value comes back bit for bit. */
static int fit_q(const float *w, float *d_out, float *m_out, int *q, const int bits) {
  float lo = w[0], hi = w[0], amax = 0.f;
  for (int i = 0; i < QB; ++i) {
    lo = w[i] < lo ? w[i] : lo;
    hi = w[i] > hi ? w[i] : hi;
    amax = fabsf(w[i]) > amax ? fabsf(w[i]) : amax;
  }
  const float m = bits == 4 ? lo : 0.f, qmin = bits == 4 ? 0.f : -128.f, qmax = bits == 4 ? 15.f : 127.f;
  const float est = bits == 4 ? (hi - lo) / 15.f : amax / 127.f;
  const unsigned short h = _cvtss_sh(est, RN);
  const float cands[4] = {_cvtsh_ss(h), _cvtsh_ss((unsigned short)(h + 1)), _cvtsh_ss((unsigned short)(h - 1)), est};
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

#endif
