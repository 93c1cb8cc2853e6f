/* What the attention kernels share (included by paged_decode.c and paged_prefill.c;
 * pagellm/kernels/__init__.py hashes this header into every kernel's build key). */
#ifndef PAGELLM_SIMD_COMMON_H
#define PAGELLM_SIMD_COMMON_H
#include <stdint.h>

/* The AVX-512 paths are written for head size 64 only. */
static inline int avx512_head64(int64_t D) {
#ifdef __AVX512F__
  return D == 64;
#else
  (void)D;
  return 0;
#endif
}

#ifdef __AVX512F__
#include <immintrin.h>

/* exp(x) for 16 floats: Cephes' range reduction and degree-6 polynomial (~2 ulp), 2^n by scalef. */
static inline __m512 exp512(__m512 x) {
  x = _mm512_max_ps(_mm512_min_ps(x, _mm512_set1_ps(88.0f)), _mm512_set1_ps(-87.0f));
  __m512 n = _mm512_roundscale_ps(_mm512_mul_ps(x, _mm512_set1_ps(1.44269504088896341f)), _MM_FROUND_TO_NEAREST_INT | _MM_FROUND_NO_EXC);
  __m512 r = _mm512_fnmadd_ps(n, _mm512_set1_ps(0.693359375f), x);
  r = _mm512_fnmadd_ps(n, _mm512_set1_ps(-2.12194440e-4f), r);
  __m512 p = _mm512_set1_ps(1.9875691500e-4f);
  p = _mm512_fmadd_ps(p, r, _mm512_set1_ps(1.3981999507e-3f));
  p = _mm512_fmadd_ps(p, r, _mm512_set1_ps(8.3334519073e-3f));
  p = _mm512_fmadd_ps(p, r, _mm512_set1_ps(4.1665795894e-2f));
  p = _mm512_fmadd_ps(p, r, _mm512_set1_ps(1.6666665459e-1f));
  p = _mm512_fmadd_ps(p, r, _mm512_set1_ps(5.0000001201e-1f));
  p = _mm512_fmadd_ps(_mm512_mul_ps(p, r), r, _mm512_add_ps(r, _mm512_set1_ps(1.0f)));
  return _mm512_scalef_ps(p, n);
}
#endif
#endif
