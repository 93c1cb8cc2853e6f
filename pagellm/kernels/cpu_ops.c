/* Fused elementwise ops of the decoder for CPU, float32. Built on first use by
 * pagellm/kernels/__init__.py; wrapped by pagellm/kernels/cpu_ops.py.
 *
 * PyTorch runs each of these as several passes over freshly allocated tensors (RMSNorm is
 * add, pow, mean, add, rsqrt, mul, mul; rotary is cat, neg, four muls and adds); on a CPU those
 * passes are memory-bound and cost a sixth of a prefill step. Here each op is one pass, in place
 * where the caller allows it, with the same float32 arithmetic as Hugging Face's modules: the
 * products and sums are rounded in the same order (the file is compiled without FMA
 * contraction), only the reduction order of RMSNorm's mean differs.
 *
 * Rows are ``T`` tokens; every op parallelises over tokens when there are enough of them.
 */
#pragma GCC optimize("fp-contract=off")
#include <math.h>
#include <stdint.h>
#include <string.h>
#ifdef __AVX512F__
#include <immintrin.h>
#endif

#include "simd_common.h" /* exp_f32 */

#define PAR_MIN_ROWS 16

/* h[0:n] = norm(xr[0:n]). HF: h * rsqrt(mean(h^2) + eps), then weight * h. */
static inline __attribute__((always_inline)) void norm_row(const float *xr, const float *weight, float *h, int64_t n,
                                                           float eps) {
  float ss = 0.f;
#pragma omp simd reduction(+ : ss)
  for (int64_t i = 0; i < n; ++i) ss += xr[i] * xr[i];
  const float inv = 1.f / sqrtf(ss / (float)n + eps);
#pragma omp simd
  for (int64_t i = 0; i < n; ++i) h[i] = weight[i] * (xr[i] * inv);
}

/* x [T, n] (row stride x_stride); if residual: residual += x, out = norm(residual); else out =
 * norm(x). out [T, n] contiguous. */
void rms_norm_f32(const float *x, int64_t x_stride, float *residual, const float *weight, float *out,
                  int64_t T, int64_t n, float eps) {
#pragma omp parallel for if (T >= PAR_MIN_ROWS)
  for (int64_t t = 0; t < T; ++t) {
    const float *xr = x + t * x_stride;
    if (residual) {
      float *r = residual + t * n;
#pragma omp simd
      for (int64_t i = 0; i < n; ++i) r[i] += xr[i];
      xr = r;
    }
    norm_row(xr, weight, out + t * n, n, eps);
  }
}

/* A norm per head (Qwen3's q/k norm): x [T, H, n] with row stride x_stride and heads contiguous
 * (a strided view of the qkv output, read in place); out [T, H, n] contiguous. */
void rms_norm_heads_f32(const float *x, int64_t x_stride, const float *weight, float *out, int64_t T, int64_t H,
                        int64_t n, float eps) {
#pragma omp parallel for if (T >= PAR_MIN_ROWS)
  for (int64_t t = 0; t < T; ++t)
    for (int64_t h = 0; h < H; ++h) norm_row(x + t * x_stride + h * n, weight, out + (t * H + h) * n, n, eps);
}

/* Rotate-half rotary, in place: x [T, H, D] with row stride x_stride (heads contiguous), per-token
 * cos/sin [T, D]. HF: x * cos + cat(-x2, x1) * sin. */
void rotary_f32(float *x, int64_t x_stride, const float *cos, const float *sin, int64_t T, int64_t H,
                int64_t D) {
  const int64_t half = D / 2;
#pragma omp parallel for if (T >= PAR_MIN_ROWS)
  for (int64_t t = 0; t < T; ++t) {
    const float *c = cos + t * D, *s = sin + t * D;
    for (int64_t h = 0; h < H; ++h) {
      float *v = x + t * x_stride + h * D;
#pragma omp simd
      for (int64_t i = 0; i < half; ++i) {
        const float x1 = v[i], x2 = v[i + half];
        v[i] = x1 * c[i] + (-x2) * s[i];
        v[i + half] = x2 * c[i + half] + x1 * s[i + half];
      }
    }
  }
}

/* out [T, I] = act(gate) * up with gate_up [T, 2I] = [gate | up], act SiLU (gelu = 0) or GELU with
 * tanh (gelu = 1: Gemma's GeGLU, HF's gelu_pytorch_tanh). silu(g) = g / (1 + exp(-g));
 * gelu(g) = 0.5 g (1 + tanh(sqrt(2 / pi) (g + 0.044715 g^3))), tanh as simd_common.h's (the GeGLU
 * layer's reference, F.gelu, rounds differently in the last bits; the decode graph calls this same
 * kernel). On AVX-512, 16 lanes at a time through exp512 (fused multiply-adds: about half the
 * instructions of the compiler's vectorisation of exp_f32, which this file's fp-contract=off keeps
 * unfused); SmolLM2's 30 MLPs spent 2-3 % of a W64 run here. */
#define GELU_K0 0.7978845608028654f
#define GELU_K1 0.044715f
static inline __attribute__((always_inline)) void gated_and_mul(const float *gate_up, float *out, int64_t T,
                                                                int64_t I, const int gelu) {
#pragma omp parallel for if (T >= PAR_MIN_ROWS)
  for (int64_t t = 0; t < T; ++t) {
    const float *g = gate_up + t * 2 * I, *u = g + I;
    float *o = out + t * I;
    int64_t i = 0;
#ifdef __AVX512F__
    const __m512 one = _mm512_set1_ps(1.f), half = _mm512_set1_ps(0.5f);
    const __m512 k0 = _mm512_set1_ps(GELU_K0), k1 = _mm512_set1_ps(GELU_K1);
    for (; i + 16 <= I; i += 16) {
      const __m512 x = _mm512_loadu_ps(g + i);
      __m512 y;
      if (gelu) {
        const __m512 inner = _mm512_mul_ps(k0, _mm512_add_ps(x, _mm512_mul_ps(k1, _mm512_mul_ps(_mm512_mul_ps(x, x), x))));
        y = _mm512_mul_ps(_mm512_mul_ps(half, x), _mm512_add_ps(one, tanh512(inner)));
      } else {
        y = _mm512_div_ps(x, _mm512_add_ps(one, exp512(_mm512_sub_ps(_mm512_setzero_ps(), x))));
      }
      _mm512_storeu_ps(o + i, _mm512_mul_ps(y, _mm512_loadu_ps(u + i)));
    }
#endif
    for (; i < I; ++i) {
      const float x = g[i];
      o[i] = (gelu ? 0.5f * x * (1.f + tanh_f32(GELU_K0 * (x + GELU_K1 * (x * x * x)))) : x / (1.f + exp_f32(-x)))
             * u[i];
    }
  }
}

void silu_and_mul_f32(const float *gate_up, float *out, int64_t T, int64_t I) { gated_and_mul(gate_up, out, T, I, 0); }

void gelu_tanh_and_mul_f32(const float *gate_up, float *out, int64_t T, int64_t I) {
  gated_and_mul(gate_up, out, T, I, 1);
}

/* A mixture of experts' outputs, combined per token: out[t] = sum_j fl(y[pos[t, j]] * w[t, j]), the
 * products added in j order starting from the first (no zero: the same bits as PyTorch's mul, then
 * one add per slot). y [*, H] holds every (token, slot)'s expert output, rows grouped by expert. */
void moe_combine_f32(const float *y, const int64_t *pos, const float *w, float *out, int64_t T, int64_t K,
                     int64_t H) {
#pragma omp parallel for if (T >= PAR_MIN_ROWS)
  for (int64_t t = 0; t < T; ++t) {
    float *o = out + t * H;
    const float *y0 = y + pos[t * K] * H;
    const float w0 = w[t * K];
    for (int64_t h = 0; h < H; ++h) o[h] = y0[h] * w0;
    for (int64_t j = 1; j < K; ++j) {
      const float *yj = y + pos[t * K + j] * H;
      const float wj = w[t * K + j];
      for (int64_t h = 0; h < H; ++h) o[h] = o[h] + yj[h] * wj;
    }
  }
}

/* Scatter this step's K and V rows ([T, Hkv * D] with row strides) into their cache slots. Every
 * write_kv_* takes the same arguments, whatever the cache holds. */
void write_kv_f32(const float *key, int64_t key_stride, const float *value, int64_t value_stride,
                  float *key_cache, float *value_cache, const int64_t *slots, int64_t T, int64_t Hkv, int64_t D) {
  const int64_t row = Hkv * D;
#pragma omp parallel for if (T >= 4 * PAR_MIN_ROWS)
  for (int64_t t = 0; t < T; ++t) {
    memcpy(key_cache + slots[t] * row, key + t * key_stride, sizeof(float) * row);
    memcpy(value_cache + slots[t] * row, value + t * value_stride, sizeof(float) * row);
  }
}

/* The same into a float16 cache (kv_cache_dtype="float16"): round to nearest even, as torch's
 * .to(torch.float16). */
void write_kv_f16(const float *key, int64_t key_stride, const float *value, int64_t value_stride,
                  uint16_t *key_cache, uint16_t *value_cache, const int64_t *slots, int64_t T, int64_t Hkv,
                  int64_t D) {
  const int64_t row = Hkv * D;
#pragma omp parallel for if (T >= 4 * PAR_MIN_ROWS)
  for (int64_t t = 0; t < T; ++t) {
    for (int kv = 0; kv < 2; ++kv) {
      const float *src = kv ? value + t * value_stride : key + t * key_stride;
      uint16_t *dst = (kv ? value_cache : key_cache) + slots[t] * row;
      int64_t i = 0;
#ifdef __AVX512F__
      for (; i + 16 <= row; i += 16)
        _mm256_storeu_si256((__m256i *)(dst + i),
                            _mm512_cvtps_ph(_mm512_loadu_ps(src + i), _MM_FROUND_TO_NEAREST_INT | _MM_FROUND_NO_EXC));
#endif
      for (; i < row; ++i) {
        _Float16 h = (_Float16)src[i];
        memcpy(dst + i, &h, sizeof h);
      }
    }
  }
}

/* The same into an int8 cache (kv_cache_dtype="int8", attention/kv_quant.py): each head row of D
 * values becomes D int8 and its float32 scale (D + 4 bytes), scale = max|x| / 127 and q =
 * round-half-even(x / scale), as to_cache computes it in torch. Portable C (no ISA needed). */
void write_kv_i8(const float *key, int64_t key_stride, const float *value, int64_t value_stride, int8_t *key_cache,
                 int8_t *value_cache, const int64_t *slots, int64_t T, int64_t Hkv, int64_t D) {
  const int64_t row = Hkv * (D + 4);
#pragma omp parallel for if (T >= 4 * PAR_MIN_ROWS)
  for (int64_t t = 0; t < T; ++t) {
    for (int kv = 0; kv < 2; ++kv) {
      const float *src = kv ? value + t * value_stride : key + t * key_stride;
      int8_t *dst = (kv ? value_cache : key_cache) + slots[t] * row;
      for (int64_t h = 0; h < Hkv; ++h, src += D, dst += D + 4) {
        float amax = 0.f;
#pragma omp simd reduction(max : amax)
        for (int64_t i = 0; i < D; ++i) amax = fabsf(src[i]) > amax ? fabsf(src[i]) : amax;
        const float scale = amax / 127.0f;
        for (int64_t i = 0; i < D; ++i) {
          float q = scale > 0.f ? nearbyintf(src[i] / scale) : 0.f;
          q = q > 127.f ? 127.f : (q < -127.f ? -127.f : q);
          dst[i] = (int8_t)q;
        }
        memcpy(dst + D, &scale, sizeof scale);
      }
    }
  }
}

/* Greedy sampling's two reductions over logits [R, V] (row stride ld) in one parallel call:
 * idx[r] = the first index of row r's maximum (torch.argmax's choice; torch's CPU argmax is a
 * scalar loop, 3.5 ms for 64 x 49152 here) and lse[r] = log(sum(exp(x - max))) + max, for the
 * sampled token's logprob without materialising log_softmax (lse = NULL: the argmax only).
 * idx[r] = -1 when the row holds a NaN: the caller then falls back to torch for that row. */
void argmax_logsumexp_f32(const float *x, int64_t ld, int64_t R, int64_t V, int64_t *idx, float *lse) {
#pragma omp parallel for if (R >= 2)
  for (int64_t r = 0; r < R; ++r) {
    const float *row = x + r * ld;
    float m = -INFINITY;
    int nan = 0;
#pragma omp simd reduction(max : m) reduction(| : nan)
    for (int64_t i = 0; i < V; ++i) {
      m = row[i] > m ? row[i] : m;
      nan |= row[i] != row[i];
    }
    int64_t best = -1;
    for (int64_t i = 0; i < V && !nan; ++i)
      if (row[i] == m) {
        best = i;
        break;
      }
    idx[r] = best;
    if (lse == NULL) continue; /* only the token: penalised logits, whose logprobs nobody reads */
    float s = 0.f;
#pragma omp simd reduction(+ : s)
    for (int64_t i = 0; i < V; ++i) s += exp_f32(row[i] - m);
    lse[r] = logf(s) + m;
  }
}

/* Structured output: row rows[i] of x [*, V] (row stride ld) keeps only the tokens set in bitmask
 * row mask_rows[i] (int32 words, bit t % 32 of word t / 32); the others become -inf. A word with
 * every bit set (inside a JSON string, most of them) is skipped whole: 64 rows x 49152 take well
 * under a millisecond, against 7-12 ms for unpacking the bits with numpy or torch. */
void apply_token_bitmask_f32(float *x, int64_t ld, int64_t V, const int32_t *bitmask, int64_t W,
                             const int64_t *rows, const int64_t *mask_rows, int64_t R) {
#pragma omp parallel for if (R >= 8)
  for (int64_t i = 0; i < R; ++i) {
    float *row = x + rows[i] * ld;
    const uint32_t *m = (const uint32_t *)(bitmask + mask_rows[i] * W);
    for (int64_t w = 0; w < W && w * 32 < V; ++w) {
      const uint32_t bits = m[w];
      if (bits == 0xFFFFFFFFu) continue;
      const int64_t n = V - w * 32 < 32 ? V - w * 32 : 32;
      for (int64_t b = 0; b < n; ++b)
        if (!((bits >> b) & 1u)) row[w * 32 + b] = -INFINITY;
    }
  }
}
