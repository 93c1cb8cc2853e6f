/* State layers' per-token arithmetic on CPU, float32: a causal depthwise convolution that continues
 * from each sequence's convolution state, the gated delta rule (Qwen3.5's gated DeltaNet) and
 * Mamba2's selective state update (Granite 4) over each sequence's recurrent state. Built on first use by pagellm/kernels/__init__.py; wrapped by
 * pagellm/kernels/linear_attention.py, whose PyTorch functions are the oracle the tests compare with.
 *
 * A step's sequences are spans of its flat rows, each ``(first row, rows, fresh, state block)``: a
 * fresh span starts its request (its states from zeros), any other continues from the states its
 * last step left in its block, and leaves them there. Each token is computed on its own, in order,
 * with the same operations in the same order whatever the span around it (a prefill, a chunk, a
 * decode among others): scheduling never changes a state's bits. PyTorch's elementwise
 * transcendentals do not promise that (a row's sigmoid or softplus rounds differently where it
 * falls in a vector or in the scalar tail of a larger batch).
 *
 * Compiled without FMA contraction: products and sums round as the PyTorch reference's do (the
 * convolution is bit-equal to it; the delta rule's sums over keys run in another order).
 */
#pragma GCC optimize("fp-contract=off")
#include <math.h>
#include <stdint.h>
#include <stdlib.h>
#include <string.h>

#include "simd_common.h" /* exp_f32 */

#define MAX_HEAD 512

/* out[r, c] = act(sum_j w[c, j] * xp[r + j, c] + bias[c]) for each span's rows (bias may be NULL), where xp is the span's
 * convolution state (``taps - 1`` rows, zeros where fresh) followed by its rows of x; then the
 * state becomes the last ``taps - 1`` rows of xp. x [T, C] (row stride ldx), out [T, C], w [C, taps],
 * state [blocks, C, taps - 1] (blocks state_stride apart); act SiLU where silu, else none. */
void causal_conv_f32(const float *x, int64_t ldx, float *state, int64_t state_stride, const float *w,
                     const float *bias, float *out, const int64_t *spans, int64_t S, int64_t C, int64_t taps,
                     int silu) {
  const int64_t keep = taps - 1, chunk = 64;
  const int64_t nchunks = (C + chunk - 1) / chunk;
#pragma omp parallel for collapse(2) schedule(static)
  for (int64_t s = 0; s < S; ++s) {
    for (int64_t cc = 0; cc < nchunks; ++cc) {
      const int64_t row0 = spans[4 * s], n = spans[4 * s + 1], fresh = spans[4 * s + 2], block = spans[4 * s + 3];
      const int64_t c0 = cc * chunk, c1 = c0 + chunk < C ? c0 + chunk : C, width = c1 - c0;
      float past[16 * 64]; /* the state's rows [keep][chunk] (taps <= 17) */
      float wt[17 * 64];   /* the taps [taps][chunk] */
      float *st = state + block * state_stride;
      for (int64_t j = 0; j < keep; ++j)
        for (int64_t c = 0; c < width; ++c) past[j * chunk + c] = fresh ? 0.f : st[(c0 + c) * keep + j];
      for (int64_t j = 0; j < taps; ++j)
        for (int64_t c = 0; c < width; ++c) wt[j * chunk + c] = w[(c0 + c) * taps + j];
      for (int64_t t = 0; t < n; ++t) {
        float *o = out + (row0 + t) * C + c0;
        for (int64_t j = 0; j < taps; ++j) {
          const int64_t p = t + j; /* row p of xp */
          const float *xr = p < keep ? past + p * chunk : x + (row0 + p - keep) * ldx + c0;
          const float *wj = wt + j * chunk;
          if (j == 0) {
            for (int64_t c = 0; c < width; ++c) o[c] = xr[c] * wj[c];
          } else {
            for (int64_t c = 0; c < width; ++c) o[c] = o[c] + xr[c] * wj[c];
          }
        }
        if (bias)
          for (int64_t c = 0; c < width; ++c) o[c] = o[c] + bias[c0 + c];
        if (silu)
          for (int64_t c = 0; c < width; ++c) o[c] = o[c] / (1.f + exp_f32(-o[c]));
      }
      /* the new state: xp's last keep rows (rows of x, or of the old state where n < keep) */
      float keep_rows[16 * 64];
      for (int64_t j = 0; j < keep; ++j) {
        const int64_t p = n + j;
        const float *xr = p < keep ? past + p * chunk : x + (row0 + p - keep) * ldx + c0;
        memcpy(keep_rows + j * chunk, xr, (size_t)width * sizeof(float));
      }
      for (int64_t j = 0; j < keep; ++j)
        for (int64_t c = 0; c < width; ++c) st[(c0 + c) * keep + j] = keep_rows[j * chunk + c];
    }
  }
}

/* softplus as torch's (threshold 20: x itself above it). */
static inline float softplus_f32(float x) { return x > 20.f ? x : log1pf(exp_f32(x)); }

/* The gated delta rule and its gated RMSNorm, for each span and value head h: its key head is h / (Hv / Hk)
 * (HF's grouped order) or, with tiled, h % Hk (llama.cpp's GGUF order: the value heads' rows permuted
 * consistently in every tensor, so only this map changes).
 * mixed [T, 2 Hk K + Hv V] holds each row's convolved q | k | v; z [T, Hv V], b and a [T, Hv] the
 * row's output gate and per-head inputs (row stride ld). Per token: q and k L2-normed (q then over
 * sqrt(K)); beta = sigmoid(b); decay = exp(A softplus(a + dt_bias)), A = -exp(A_log) as the model
 * loads it; S = decay S;
 * S += k (beta (v - S^T k))^T; o = S^T q; out = norm_w * rmsnorm(o) * silu(z). state [blocks, Hv,
 * K, V] (blocks state_stride apart); out [T, Hv V]. */
void gated_delta_rule_f32(const float *mixed, const float *z, const float *b, const float *a, int64_t ld,
                          const float *A, const float *dt_bias, const float *norm_w, float eps, float *state,
                          int64_t state_stride, const int64_t *spans, int64_t S, int64_t Hk, int64_t Hv, int64_t K, int64_t V,
                          int64_t tiled, float *out) {
  const int64_t key_dim = Hk * K, width = 2 * key_dim + Hv * V, rep = Hv / Hk;
  const float sqrt_k = sqrtf((float)K);
#pragma omp parallel for collapse(2) schedule(static)
  for (int64_t s = 0; s < S; ++s) {
    for (int64_t h = 0; h < Hv; ++h) {
      const int64_t row0 = spans[4 * s], n = spans[4 * s + 1], fresh = spans[4 * s + 2], block = spans[4 * s + 3];
      float *st = state + block * state_stride + h * K * V;
      if (fresh) memset(st, 0, (size_t)(K * V) * sizeof(float));
      const int64_t kh = tiled ? h % Hk : h / rep;
      const float a_scale = A[h];
      float qn[MAX_HEAD], kn[MAX_HEAD], kv[MAX_HEAD], delta[MAX_HEAD], o[MAX_HEAD];
      for (int64_t t = 0; t < n; ++t) {
        const int64_t r = row0 + t;
        const float *q = mixed + r * width + kh * K, *k = q + key_dim, *v = mixed + r * width + 2 * key_dim + h * V;
        float sq = 0.f, sk = 0.f;
        for (int64_t i = 0; i < K; ++i) {
          sq += q[i] * q[i];
          sk += k[i] * k[i];
        }
        const float iq = 1.f / sqrtf(sq + 1e-6f), ik = 1.f / sqrtf(sk + 1e-6f);
        for (int64_t i = 0; i < K; ++i) {
          qn[i] = (q[i] * iq) / sqrt_k;
          kn[i] = k[i] * ik;
        }
        const float beta = 1.f / (1.f + exp_f32(-b[r * ld + h]));
        const float decay = exp_f32(a_scale * softplus_f32(a[r * ld + h] + dt_bias[h]));
        /* S = decay S, and kv = S^T k, in one pass */
        for (int64_t j = 0; j < V; ++j) kv[j] = 0.f;
        for (int64_t i = 0; i < K; ++i) {
          float *row = st + i * V;
          const float ki = kn[i];
          for (int64_t j = 0; j < V; ++j) {
            const float x = row[j] * decay;
            row[j] = x;
            kv[j] = kv[j] + x * ki;
          }
        }
        for (int64_t j = 0; j < V; ++j) delta[j] = (v[j] - kv[j]) * beta;
        /* S += k delta^T, and o = S^T q, in one pass */
        for (int64_t j = 0; j < V; ++j) o[j] = 0.f;
        for (int64_t i = 0; i < K; ++i) {
          float *row = st + i * V;
          const float ki = kn[i], qi = qn[i];
          for (int64_t j = 0; j < V; ++j) {
            const float x = row[j] + ki * delta[j];
            row[j] = x;
            o[j] = o[j] + x * qi;
          }
        }
        float ss = 0.f;
        for (int64_t j = 0; j < V; ++j) ss += o[j] * o[j];
        const float inv = 1.f / sqrtf(ss / (float)V + eps);
        const float *zr = z + r * ld + h * V;
        float *outr = out + r * Hv * V + h * V;
        for (int64_t j = 0; j < V; ++j) {
          const float g = zr[j];
          outr[j] = (norm_w[j] * (o[j] * inv)) * (g / (1.f + exp_f32(-g)));
        }
      }
    }
  }
}

/* Mamba2's selective state update per span and head h (of group h / (H / G)): xbc [T, H P + 2 G N]
 * holds each row's convolved x | B | C, dt [T, H] (row stride ld). Per token: d = softplus(dt +
 * dt_bias), at least dt_min (Nemotron-H's time_step_limit floor; 0 is no floor); S = exp(d A) S + (d B) x^T
 * (A = -exp(A_log) as the model loads it); y = S C + D x. state [blocks, H, P, N]
 * (blocks state_stride apart); y [T, H P]. */
void mamba2_ssm_f32(const float *xbc, const float *dt, int64_t ld, const float *A, const float *dt_bias,
                    const float *D, float *state, int64_t state_stride, const int64_t *spans, int64_t S, int64_t H,
                    int64_t P, int64_t N, int64_t G, float dt_min, float *y) {
  const int64_t inner = H * P, width = inner + 2 * G * N, per_group = H / G;
#pragma omp parallel for collapse(2) schedule(static)
  for (int64_t s = 0; s < S; ++s) {
    for (int64_t h = 0; h < H; ++h) {
      const int64_t row0 = spans[4 * s], n = spans[4 * s + 1], fresh = spans[4 * s + 2], block = spans[4 * s + 3];
      float *st = state + block * state_stride + h * P * N;
      if (fresh) memset(st, 0, (size_t)(P * N) * sizeof(float));
      const float a = A[h];
      const int64_t g = h / per_group;
      float db[MAX_HEAD];
      for (int64_t t = 0; t < n; ++t) {
        const int64_t r = row0 + t;
        const float *x = xbc + r * width + h * P, *B = xbc + r * width + inner + g * N, *C = B + G * N;
        const float sp = softplus_f32(dt[r * ld + h] + dt_bias[h]);
        const float d = sp < dt_min ? dt_min : sp;
        const float da = exp_f32(d * a);
        for (int64_t k = 0; k < N; ++k) db[k] = d * B[k];
        float *yr = y + r * inner + h * P;
        for (int64_t p = 0; p < P; ++p) {
          float *row = st + p * N;
          const float xp = x[p];
          float acc = 0.f;
          for (int64_t k = 0; k < N; ++k) {
            const float v = row[k] * da + db[k] * xp;
            row[k] = v;
            acc = acc + v * C[k];
          }
          yr[p] = acc + xp * D[h];
        }
      }
    }
  }
}

/* out = weight * groupnorm(y * silu(z)): y [T, I], z [T, I] (row stride ldz), each row's I features
 * RMS-normed in groups of group_size (Mamba2's gated norm, the gate before the norm). */
void gated_group_norm_f32(const float *y, const float *z, int64_t ldz, const float *weight, int64_t T, int64_t I,
                          int64_t group_size, float eps, float *out) {
#pragma omp parallel for if (T >= 16)
  for (int64_t t = 0; t < T; ++t) {
    const float *yr = y + t * I, *zr = z + t * ldz;
    float *o = out + t * I;
    for (int64_t i = 0; i < I; ++i) o[i] = yr[i] * (zr[i] / (1.f + exp_f32(-zr[i])));
    for (int64_t g0 = 0; g0 < I; g0 += group_size) {
      float ss = 0.f;
      for (int64_t i = g0; i < g0 + group_size; ++i) ss += o[i] * o[i];
      const float inv = 1.f / sqrtf(ss / (float)group_size + eps);
      for (int64_t i = g0; i < g0 + group_size; ++i) o[i] = weight[i] * (o[i] * inv);
    }
  }
}
