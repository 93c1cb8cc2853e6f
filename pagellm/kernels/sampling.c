/* Random sampling on CPU: temperature, top-k, top-p and min-p, then one draw per row. Built on first
 * use by pagellm/kernels/__init__.py; wrapped by pagellm/kernels/sampling.py.
 *
 * The PyTorch path (pagellm/sampling/sampler.py, draw_native) sorts every row of the vocabulary
 * for top-k / top-p and draws one exponential variate per token for the "exponential race": 64
 * rows of SmolLM2's 49,152 logits take ~75 ms at temperature 1 and ~200 ms with top-p, more than
 * the decode step that produced them. Here a row costs a few passes over its logits:
 *
 *   x = logits / T, m = max x, w = exp(x - m)       (unnormalised probabilities; w of the max is 1)
 *   top-k: the k-th largest x, found by counting the tokens per bucket of m - x (1/16 nat wide)
 *          and sorting only the bucket where the count reaches k; tokens below it get w = 0
 *   top-p: the same buckets weighted by w: every bucket before the one where the mass reaches
 *          p * sum(w) is kept whole, every one after it dropped, and only that bucket is sorted
 *   min-p: w < min_p * max(w) dropped (the ratio needs no normalisation)
 *   draw:  the first token whose running sum of w exceeds u * sum(w), u uniform in [0, 1) --
 *          inverse-CDF sampling, exact, with one random number per row (the caller's generator)
 *
 * The filters keep what draw_native keeps, in the same order (top-k on the scaled logits, top-p on
 * what top-k left, min-p last); tokens tied at a top-k or top-p boundary are all kept, where a sort
 * keeps an arbitrary share of them. A row's token depends on nothing but that row and its u.
 */
#include <math.h>
#include <stdint.h>
#include <stdlib.h>
#include <string.h>

#ifdef __AVX512F__
#include <immintrin.h>
#endif

#include "simd_common.h" /* exp_f32 */

#define NB 512       /* buckets of m - x: 32 nats at 16 per nat; anything further in the last */
#define PER_NAT 16.f
#define SUM_BLOCK 64 /* tokens per partial sum of the draw */

/* Bucket of each token: its distance below the maximum, in 1/PER_NAT nat, the last bucket for
 * everything further (and for -inf). One vectorised pass, shared by top-k and top-p. */
static void buckets_of(const float *x, float m, int64_t V, uint16_t *bk) {
#pragma omp simd
  for (int64_t i = 0; i < V; ++i) {
    const float b = (m - x[i]) * PER_NAT;
    bk[i] = (uint16_t)(b < (float)(NB - 1) ? (int)b : NB - 1);
  }
}

/* tmp <- every v[i] > floor in bucket b, in token order; returns how many. tmp has room for V + 16. */
static int64_t gather_bucket(const float *v, const uint16_t *bk, int64_t V, int b, float floor, float *tmp) {
  int64_t n = 0, i = 0;
#ifdef __AVX512F__
  const __m512i want = _mm512_set1_epi32(b);
  const __m512 lo = _mm512_set1_ps(floor);
  for (; i + 16 <= V; i += 16) {
    const __m512i bi = _mm512_cvtepu16_epi32(_mm256_loadu_si256((const __m256i *)(bk + i)));
    const __m512 vi = _mm512_loadu_ps(v + i);
    const __mmask16 k = _mm512_cmpeq_epi32_mask(bi, want) & _mm512_cmp_ps_mask(vi, lo, _CMP_GT_OQ);
    if (k) { /* compress in a register, store whole: a compressing store to memory is slow on Zen 4 */
      _mm512_storeu_ps(tmp + n, _mm512_maskz_compress_ps(k, vi));
      n += __builtin_popcount(k);
    }
  }
#endif
  for (; i < V; ++i)
    if (bk[i] == b && v[i] > floor) tmp[n++] = v[i];
  return n;
}

static int desc(const void *a, const void *b) {
  const float x = *(const float *)a, y = *(const float *)b;
  return (x < y) - (x > y);
}

/* The k-th largest of x[0..V) (k in 1..V-1), bk its buckets (buckets_of); -INFINITY when fewer
 * than k are finite. tmp holds V + 16 floats. */
static float kth_largest(const float *x, const uint16_t *bk, int64_t V, int64_t k, float *tmp) {
  /* Four histograms over interleaved tokens, so that runs of tokens in one bucket (most of a
   * vocabulary sits far below the maximum) do not wait on each other's increments. */
  int32_t part[4][NB];
  memset(part, 0, sizeof(part));
  int64_t i = 0;
  for (; i + 4 <= V; i += 4)
    for (int j = 0; j < 4; ++j) part[j][bk[i + j]] += x[i + j] > -INFINITY;
  for (; i < V; ++i) part[0][bk[i]] += x[i] > -INFINITY;
  int64_t count[NB];
  for (int b = 0; b < NB; ++b) count[b] = (int64_t)part[0][b] + part[1][b] + part[2][b] + part[3][b];
  int64_t before = 0;
  int b = 0;
  while (b < NB && before + count[b] < k) before += count[b++];
  if (b == NB) return -INFINITY;
  const int64_t n = gather_bucket(x, bk, V, b, -INFINITY, tmp);
  qsort(tmp, (size_t)n, sizeof(float), desc);
  return tmp[k - before - 1];
}

/* Top-p over the tokens with w > 0: drops (w = 0) every token whose descending-order mass before
 * it reaches p * sum(w). */
static void top_p_filter(const uint16_t *bk, float *w, int64_t V, double p, float *tmp) {
  double part[4][NB]; /* interleaved, as in kth_largest */
  memset(part, 0, sizeof(part));
  int64_t i = 0;
  for (; i + 4 <= V; i += 4)
    for (int j = 0; j < 4; ++j) part[j][bk[i + j]] += w[i + j]; /* w = 0 adds nothing */
  for (; i < V; ++i) part[0][bk[i]] += w[i];
  double mass[NB], total = 0.0;
  for (int b = 0; b < NB; ++b) {
    mass[b] = part[0][b] + part[1][b] + part[2][b] + part[3][b];
    total += mass[b];
  }
  const double target = p * total;
  double before = 0.0;
  int b = 0;
  while (b < NB && before + mass[b] < target) before += mass[b++];
  if (b == NB) return; /* rounding: the whole mass is below the target; keep everything */
  const int64_t n = gather_bucket(w, bk, V, b, 0.f, tmp);
  if (n == 0) return;
  qsort(tmp, (size_t)n, sizeof(float), desc);
  float smallest_kept = tmp[0];
  for (int64_t j = 0; j < n && before < target; ++j) {
    smallest_kept = tmp[j];
    before += tmp[j];
  }
  for (int64_t i = 0; i < V; ++i) {
    if (w[i] == 0.f) continue;
    if (bk[i] > b || (bk[i] == b && w[i] < smallest_kept)) w[i] = 0.f;
  }
}

/* One row: the drawn token, or -1 when the row has no finite maximum (all -inf, or a NaN). With
 * probs != NULL, also the normalised distribution the token was drawn from. */
static int64_t sample_row(const float *logits, int64_t V, float temperature, int64_t top_k, float top_p,
                          float min_p, double u, float *x, float *w, float *tmp, float *block_sums, uint16_t *bk,
                          float *probs) {
  float m = -INFINITY;
  int nan = 0;
#pragma omp simd reduction(max : m) reduction(| : nan)
  for (int64_t i = 0; i < V; ++i) {
    x[i] = logits[i] / temperature;
    m = x[i] > m ? x[i] : m;
    nan |= x[i] != x[i];
  }
  if (nan || !(m > -INFINITY) || m == INFINITY) return -1;
#pragma omp simd
  for (int64_t i = 0; i < V; ++i) w[i] = x[i] > -INFINITY ? exp_f32(x[i] - m) : 0.f;
  const int use_top_k = top_k > 0 && top_k < V;
  if (use_top_k || top_p < 1.f) buckets_of(x, m, V, bk);
  if (use_top_k) {
    const float kth = kth_largest(x, bk, V, top_k, tmp);
    for (int64_t i = 0; i < V; ++i)
      if (x[i] < kth) w[i] = 0.f;
  }
  if (top_p < 1.f) top_p_filter(bk, w, V, top_p, tmp);
  if (min_p > 0.f) {
    float wmax = 0.f;
    for (int64_t i = 0; i < V; ++i) wmax = w[i] > wmax ? w[i] : wmax;
    const float floor_w = min_p * wmax;
    for (int64_t i = 0; i < V; ++i)
      if (w[i] < floor_w) w[i] = 0.f;
  }
  /* Sums per block of SUM_BLOCK tokens (vectorised), so the draw walks blocks, then one block. */
  const int64_t nblocks = (V + SUM_BLOCK - 1) / SUM_BLOCK;
  double total = 0.0;
  for (int64_t b = 0; b < nblocks; ++b) {
    const int64_t end = (b + 1) * SUM_BLOCK < V ? (b + 1) * SUM_BLOCK : V;
    float s = 0.f;
#pragma omp simd reduction(+ : s)
    for (int64_t i = b * SUM_BLOCK; i < end; ++i) s += w[i];
    block_sums[b] = s;
    total += s;
  }
  if (probs != NULL)
    for (int64_t i = 0; i < V; ++i) probs[i] = (float)(w[i] / total);
  const double target = u * total;
  double cum = 0.0;
  for (int64_t b = 0; b < nblocks; ++b) {
    if (cum + block_sums[b] > target) {
      const int64_t end = (b + 1) * SUM_BLOCK < V ? (b + 1) * SUM_BLOCK : V;
      double c = cum;
      for (int64_t i = b * SUM_BLOCK; i < end; ++i) {
        c += w[i];
        if (w[i] > 0.f && c > target) return i;
      }
    }
    cum += block_sums[b];
  }
  for (int64_t i = V - 1; i > 0; --i) /* u * total rounded up to the whole sum: the last token with mass */
    if (w[i] > 0.f) return i;
  return 0;
}

/* tokens[r] for each row r of logits [R, V] (row stride ld): temperatures[r] > 0, top_ks[r] (0 or
 * >= V: off), top_ps[r] (1: off), min_ps[r] (0: off), uniforms[r] in [0, 1). probs: NULL, or
 * [R, V] to receive each row's final distribution (for tests). Returns 0, or -1 if the scratch
 * could not be allocated. */
int sample_rows_f32(int64_t *tokens, const float *logits, int64_t ld, int64_t R, int64_t V,
                    const float *temperatures, const int64_t *top_ks, const float *top_ps, const float *min_ps,
                    const double *uniforms, float *probs) {
  int failed = 0;
#pragma omp parallel if (R >= 2)
  {
    /* x, w, tmp, the block sums, then the buckets (uint16) */
    const size_t floats = 3 * (size_t)V + 16 + (size_t)V / SUM_BLOCK + 1;
    float *scratch = (float *)malloc(sizeof(float) * floats + sizeof(uint16_t) * (size_t)V);
    if (scratch == NULL) __atomic_store_n(&failed, 1, __ATOMIC_RELAXED);
#pragma omp for schedule(dynamic, 1)
    for (int64_t r = 0; r < R; ++r) {
      if (scratch == NULL) continue;
      tokens[r] = sample_row(logits + r * ld, V, temperatures[r], top_ks[r], top_ps[r], min_ps[r], uniforms[r],
                             scratch, scratch + V, scratch + 2 * V, scratch + 3 * V + 16, (uint16_t *)(scratch + floats),
                             probs == NULL ? NULL : probs + r * V);
    }
    free(scratch);
  }
  return failed ? -1 : 0;
}
