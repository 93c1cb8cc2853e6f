/* Paged decode attention for CPU over a float32, float16 or int8 cache (an int8 head row ends with
 * its scale, applied to the row's score and softmax weight): one query
 * token per sequence attends to its cached K/V read straight from the blocks (no gather copy). Built on first use by pagellm/kernels/__init__.py.
 *
 * q:             [B, Hq, D]            row b at q + b * q_stride (heads contiguous; a view of the qkv output)
 * out:           [B, Hq, D]
 * key/value:     [num_slots, Hkv, D]   slot = block_id * block_size + offset
 * block_tables:  [B, max_blocks]       int64
 * seq_lens:      [B]                   int64, context length including the new token
 *
 * One task per (sequence, KV head): its g = Hq / Hkv query heads share every K/V row loaded.
 * Two passes (scores, then a weighted sum of V) with an exact softmax in between. The next
 * block's rows are prefetched into L2 while this one is read (blocks are scattered, so the hardware
 * prefetcher cannot guess them: 1.3-1.5x on 64 decodes), the first blocks of each pass all at
 * once when it starts, and the head size is a compile-time constant so the dot products vectorize
 * fully: on AVX-512 for 64, 80, 96, 128 and 256 (q and the sums in registers; every cache type; any
 * other multiple of 16 up to 256 runs the same sums with the size a run-time value), in the portable
 * path for 64 and 128 (any other size runs it generically; a float16 or int8 row is converted to
 * float32 first, 8 values at a time with F16C).
 */
#include <math.h>
#include <omp.h>
#include <stdint.h>
#include <stdlib.h>
#include <string.h>
#if defined(__AVX512F__) || defined(__F16C__)
#include <immintrin.h>
#endif
#include "gguf_blocks.h" /* from_half: the portable path's float16 rows */
#include "simd_common.h"

/* Prefetch hint for the next blocks' rows: into L2 (prefetcht1 on x86), not L1. On a 2-core AMD
 * EPYC (Zen 4) the T0 hint's prefetches held back the loop's own misses; T1 read the same
 * scattered cache 1.25-1.46x faster on the AVX-512 path (float16; float32 1.38x, int8 1.17x) and
 * 1.40-1.66x on the generic one (float32, head size 128; 64 decodes scattered over the cache,
 * performance.md). The L1 is filled by the loads themselves, blocks later, from L2. */
static inline __attribute__((always_inline)) void prefetch_l2(const void *p) { __builtin_prefetch(p, 0, 2); }

/* Cached row `r` of element type et (a float16 or int8 one converted into buf; int8 times its
 * scale *s, 1 otherwise): the portable path's view of a K or V row. */
static inline __attribute__((always_inline)) const float *row_f32(const void *c, int64_t r, const int64_t D,
                                                                  const int et, float *buf, float *s) {
  *s = 1.f;
  if (et == ET_F32) return (const float *)c + r;
  if (et == ET_I8) {
    const int8_t *x = (const int8_t *)c + r;
    *s = row_scale_d(c, r, D);
    for (int64_t d = 0; d < D; ++d) buf[d] = (float)x[d];
    return buf;
  }
  const uint16_t *x = (const uint16_t *)c + r;
  int64_t d = 0;
#ifdef __F16C__
  for (; d + 8 <= D; d += 8) _mm256_storeu_ps(buf + d, _mm256_cvtph_ps(_mm_loadu_si128((const __m128i *)(x + d))));
#endif
  for (; d < D; ++d) buf[d] = from_half(x[d]);
  return buf;
}

/* One (sequence, KV head) task, head_dim D known at compile time when inlined with a constant.
 * Positions [lo, L) are read (lo > 0: a sliding window); softcap > 0 caps each score s to
 * softcap * tanh(s / softcap) before the softmax. et: the cache's element type (float16 and int8
 * rows converted to float32 first; an int8 row's scale multiplies its score and its weight). */
static inline __attribute__((always_inline)) void task_impl(
    float *out, const float *qh, const void *kc, const void *vc, const int64_t *bt, int64_t L,
    int64_t g, int64_t row, int64_t h, const int64_t D, int64_t block_size, float scale, float *scores,
    float *acc, int64_t lo, float softcap, const int et) {
  float buf[256], rs;
  const int64_t hd = h * (et == ET_I8 ? D + 4 : D); /* the head's offset in a slot's row */
  float *m = acc + g * D, *inv = m + g; /* per query head: running max, then 1 / sum */
  for (int64_t j = 0; j < g; ++j) m[j] = -INFINITY;
  const int64_t first = lo / block_size * block_size; /* the first block the window reaches */
  for (int64_t t0 = first; t0 < L; t0 += block_size) {
    const int64_t kb = bt[t0 / block_size] * block_size * row + hd;
    const int64_t n = L - t0 < block_size ? L - t0 : block_size;
    const int64_t kn = t0 + block_size < L ? bt[t0 / block_size + 1] * block_size * row + hd : kb;
    for (int64_t i = t0 < lo ? lo - t0 : 0; i < n; ++i) {
      for (int64_t c = 0; c < D; c += 16) prefetch_l2((const char *)kc + (kn + i * row + c) * ET_SIZE(et));
      const float *k = row_f32(kc, kb + i * row, D, et, buf, &rs);
      for (int64_t j = 0; j < g; ++j) {
        const float *qj = qh + j * D;
        float s = 0.f;
#pragma omp simd reduction(+ : s)
        for (int64_t d = 0; d < D; ++d) s += qj[d] * k[d];
        s *= scale * rs;
        if (softcap > 0.f) s = softcap * tanh_f32(s / softcap);
        scores[j * L + t0 + i] = s;
        m[j] = s > m[j] ? s : m[j];
      }
    }
  }
  for (int64_t j = 0; j < g; ++j) {
    float *sj = scores + j * L;
    float sum = 0.f;
    const float mj = m[j];
    for (int64_t t = lo; t < L; ++t) {
      sj[t] = exp_f32(sj[t] - mj);
      sum += sj[t];
    }
    inv[j] = 1.f / sum;
  }
  memset(acc, 0, sizeof(float) * g * D);
  for (int64_t t0 = first; t0 < L; t0 += block_size) {
    const int64_t vb = bt[t0 / block_size] * block_size * row + hd;
    const int64_t n = L - t0 < block_size ? L - t0 : block_size;
    const int64_t vn = t0 + block_size < L ? bt[t0 / block_size + 1] * block_size * row + hd : vb;
    for (int64_t i = t0 < lo ? lo - t0 : 0; i < n; ++i) {
      for (int64_t c = 0; c < D; c += 16) prefetch_l2((const char *)vc + (vn + i * row + c) * ET_SIZE(et));
      const float *v = row_f32(vc, vb + i * row, D, et, buf, &rs);
      for (int64_t j = 0; j < g; ++j) {
        const float p = scores[j * L + t0 + i] * rs;
        float *a = acc + j * D;
#pragma omp simd
        for (int64_t d = 0; d < D; ++d) a[d] += p * v[d];
      }
    }
  }
  for (int64_t j = 0; j < g; ++j)
    for (int64_t d = 0; d < D; ++d) out[j * D + d] = acc[j * D + d] * inv[j];
}

#ifdef __AVX512F__
static inline __attribute__((always_inline)) void prefetch_row(const void *base, int64_t off, const int et,
                                                                const int D) {
  const int size = ET_SIZE(et);
  const char *p = (const char *)base + off * size;
  for (int c = 0; c < D * size; c += 64) prefetch_l2(p + c);
  if (et == ET_I8) prefetch_l2(p + D + 3); /* the scale may start the next line */
}

/* sums[i] = the sum of v[i]'s 16 lanes, for 16 vectors at once: a shuffle tree of 30 shuffles and
 * 15 adds, where 16 _mm512_reduce_add_ps cost 64 shuffles. Lane i of the result is v[i]'s sum. */
static inline __attribute__((always_inline)) __m512 sum16(const __m512 *v) {
  __m512 t[8], w[4];
  for (int i = 0; i < 8; ++i) /* per 128-bit lane: [v0 0+2, v1 0+2, v0 1+3, v1 1+3] */
    t[i] = _mm512_add_ps(_mm512_unpacklo_ps(v[2 * i], v[2 * i + 1]), _mm512_unpackhi_ps(v[2 * i], v[2 * i + 1]));
  for (int i = 0; i < 4; ++i) { /* per 128-bit lane: that lane's sums of v[4i .. 4i+3] */
    const __m512d a = _mm512_castps_pd(t[2 * i]), b = _mm512_castps_pd(t[2 * i + 1]);
    w[i] = _mm512_add_ps(_mm512_castpd_ps(_mm512_unpacklo_pd(a, b)), _mm512_castpd_ps(_mm512_unpackhi_pd(a, b)));
  }
  /* 128-bit lane k of the result: w[k]'s four lanes added */
  const __m512 s01 = _mm512_add_ps(_mm512_shuffle_f32x4(w[0], w[1], 0x88), _mm512_shuffle_f32x4(w[0], w[1], 0xDD));
  const __m512 s23 = _mm512_add_ps(_mm512_shuffle_f32x4(w[2], w[3], 0x88), _mm512_shuffle_f32x4(w[2], w[3], 0xDD));
  return _mm512_add_ps(_mm512_shuffle_f32x4(s01, s23, 0x88), _mm512_shuffle_f32x4(s01, s23, 0xDD));
}

/* How many blocks ahead to prefetch: at least 32 rows, about one DRAM latency of this loop's work
 * at 16-row blocks (benchmarks/decode_attention.py --cache-dtype float16: 2 blocks ahead of 16
 * rows ~10 % faster than 1; with 32-row or larger blocks one block ahead is best). */
static inline int64_t prefetch_blocks(int64_t bs) { return bs >= 32 ? 1 : (32 + bs - 1) / bs; }

/* The first `pf` blocks' rows of one head, before a pass reads them: the loop's own prefetches run
 * pf blocks ahead, so without this each pass (K, then V, of every task) would start with pf blocks
 * of demand misses, one reorder window at a time (+3-8 % on 64 scattered decodes, float16). */
static inline __attribute__((always_inline)) void prefetch_first_blocks(const void *base, const int64_t *bt, int64_t nb,
                                                                        int64_t L, int64_t pf, int64_t bs, int64_t row,
                                                                        int64_t head_off, const int et, const int D) {
  for (int64_t b = 0; b < pf && b < nb; ++b)
    for (int64_t i = 0; i < bs && b * bs + i < L; ++i)
      prefetch_row(base, bt[b] * bs * row + head_off + i * row, et, D);
}

/* The scores of the c (<= 16) tokens gathered in part (one query head's 16-lane partial sums, one
 * vector per token): folded by sum16, times the int8 rows' scales, capped (softcap > 0), stored at
 * dst; returns the running maximum mv updated. */
static inline __attribute__((always_inline)) __m512 flush_scores(__m512 *part, int c, const float *ks, const int et,
                                                                 float softcap, float *dst, __m512 mv) {
  const __mmask16 mk = (__mmask16)((1u << c) - 1);
  for (int z = c; z < 16; ++z) part[z] = _mm512_setzero_ps();
  __m512 s = sum16(part);
  if (et == ET_I8) s = _mm512_mul_ps(s, _mm512_maskz_loadu_ps(mk, ks));
  if (softcap > 0.f) {
    const __m512 cap = _mm512_set1_ps(softcap);
    s = _mm512_mul_ps(cap, tanh512(_mm512_div_ps(s, cap)));
  }
  _mm512_mask_storeu_ps(dst, mk, s);
  return _mm512_mask_max_ps(mv, mk, mv, s);
}

/* One query head's scores sj[lo .. L) (maximum in mv's lanes) -> their exponentials; returns
 * 1 / their sum. Key t goes into lane t % 16 (a window's first vector masked below lo): the lanes the
 * prefill kernel gives its sixteen running sums, whatever the window. */
static inline __attribute__((always_inline)) float softmax_row(float *sj, int64_t L, int64_t lo, __m512 mv) {
  const __m512 mj = _mm512_set1_ps(_mm512_reduce_max_ps(mv));
  __m512 sum = _mm512_setzero_ps();
  for (int64_t t = lo & ~(int64_t)15; t < L; t += 16) {
    __mmask16 mk = t < lo ? (__mmask16)(0xFFFFu << (lo - t)) : (__mmask16)0xFFFF;
    if (L - t < 16) mk &= (__mmask16)((1u << (L - t)) - 1);
    __m512 e = exp512(_mm512_sub_ps(_mm512_maskz_loadu_ps(mk, sj + t), mj));
    _mm512_mask_storeu_ps(sj + t, mk, e);
    sum = _mm512_add_ps(sum, _mm512_maskz_mov_ps(mk, e));
  }
  return 1.f / hsum512(sum);
}

/* A cached head row as DV vectors of float32 (an int8 row's integers, its scale applied by the caller). */
static inline __attribute__((always_inline)) void load_row(__m512 *r, const void *cache, int64_t off, const int et,
                                                           const int DV) {
  for (int v = 0; v < DV; ++v) r[v] = load16(cache, off + 16 * v, et);
}

/* A query head's 16-lane partial sums against a key row: a product, then DV - 1 fused multiply-adds. */
static inline __attribute__((always_inline)) __m512 dot_row(const __m512 *q, const __m512 *k, const int DV) {
  __m512 a = _mm512_mul_ps(q[0], k[0]);
  for (int v = 1; v < DV; ++v) a = _mm512_fmadd_ps(q[v], k[v], a);
  return a;
}

/* The rows of KV head h at positions lo .. L - 1 of one sequence (block table bt; the names below
 * are the tasks' own), in order: the body runs with `off` (the row's element offset in `cache`) and
 * `p` (its position), the rows pf blocks ahead prefetched meanwhile. A macro, so that each pass's
 * body inlines with its constants. */
#define FOR_EACH_ROW(cache, off, p, ...)                                                            \
  for (int64_t b_ = b0; b_ < nb; ++b_) {                                                           \
    const int64_t base_ = bt[b_] * bs * row + h * hs;                                              \
    const int64_t next_ = b_ + pf < nb ? bt[b_ + pf] * bs * row + h * hs : base_;                  \
    const int64_t n_ = L - b_ * bs < bs ? L - b_ * bs : bs;                                        \
    for (int64_t i_ = b_ == b0 ? lo - b0 * bs : 0; i_ < n_; ++i_) {                                \
      const int64_t off = base_ + i_ * row, p = b_ * bs + i_;                                      \
      prefetch_row(cache, next_ + i_ * row, et, D);                                                \
      __VA_ARGS__                                                                                  \
    }                                                                                              \
  }

/* Head size D = 16 * DV (64, 80, 96, 128 or 256), G query heads of KV head h (G * DV <= 16): q and
 * the accumulators live in registers. kc/vc are float32, float16 or int8 caches (et; a head row is hs
 * elements apart, D + the scale's 4 for int8); the arithmetic is float32 either way, an int8 row's
 * scale applied to its score and to its softmax weight. Every sum runs in the order the prefill kernel
 * reproduces (paged_prefill.c), with or without a window and a soft-cap. */
static inline __attribute__((always_inline)) void taskv(
    float *out, const float *qh, const void *kc, const void *vc, const int64_t *bt, int64_t L,
    const int G, int64_t row, int64_t h, int64_t bs, float scale, float *scores, const int et, int64_t lo,
    float softcap, const int DV) {
  const int D = 16 * DV;
  const int64_t hs = et == ET_I8 ? D + 4 : D; /* an int8 row's values, then its float32 scale */
  __m512 q[4][16];
  for (int j = 0; j < G; ++j)
    for (int c = 0; c < DV; ++c) q[j][c] = _mm512_mul_ps(_mm512_loadu_ps(qh + j * D + c * 16), _mm512_set1_ps(scale));
  /* Scores 16 tokens at a time: each token's q.k products stay as 16-lane partial sums until 16
   * of them are folded at once by sum16 (one horizontal reduction per token cost more than the
   * dot products themselves on a core that splits 512-bit shuffles). */
  __m512 part[4][16], mv[4];
  float ks[16]; /* the int8 rows' scales of the tokens gathered in part */
  for (int j = 0; j < G; ++j) mv[j] = _mm512_set1_ps(-INFINITY);
  int c = 0;    /* tokens gathered in part */
  int64_t t = lo; /* position of part[.][0] */
  const int64_t nb = (L + bs - 1) / bs, b0 = lo / bs; /* (a window's first block: b0) */
  const int64_t pf = prefetch_blocks(bs);
  prefetch_first_blocks(kc, bt + b0, nb - b0, L - b0 * bs, pf, bs, row, h * hs, et, D);
  FOR_EACH_ROW(kc, k, p, {
    __m512 kv[16];
    load_row(kv, kc, k, et, DV);
    if (et == ET_I8) ks[c] = row_scale_d(kc, k, D);
    for (int j = 0; j < G; ++j) part[j][c] = dot_row(q[j], kv, DV);
    if (++c == 16 || p + 1 == L) {
      for (int j = 0; j < G; ++j) mv[j] = flush_scores(part[j], c, ks, et, softcap, scores + j * L + t, mv[j]);
      t += c;
      c = 0;
    }
  })
  prefetch_first_blocks(vc, bt + b0, nb - b0, L - b0 * bs, pf, bs, row, h * hs, et, D); /* arriving while the softmax runs */
  float inv[4];
  for (int j = 0; j < G; ++j) inv[j] = softmax_row(scores + j * L, L, lo, mv[j]);
  __m512 acc[4][16];
  for (int j = 0; j < G; ++j)
    for (int c = 0; c < DV; ++c) acc[j][c] = _mm512_setzero_ps();
  FOR_EACH_ROW(vc, v, p, {
    __m512 vv[16];
    load_row(vv, vc, v, et, DV);
    const float vs = et == ET_I8 ? row_scale_d(vc, v, D) : 1.f; /* (x * 1.f is x: other caches unchanged) */
    for (int j = 0; j < G; ++j) {
      const __m512 w = _mm512_set1_ps(scores[j * L + p] * vs);
      for (int c2 = 0; c2 < DV; ++c2) acc[j][c2] = _mm512_fmadd_ps(w, vv[c2], acc[j][c2]);
    }
  })
  for (int j = 0; j < G; ++j)
    for (int c = 0; c < DV; ++c) _mm512_storeu_ps(out + j * D + c * 16, _mm512_mul_ps(acc[j][c], _mm512_set1_ps(inv[j])));
}

/* taskv for more query heads than fit in registers (g > GMAX below: Gemma's 4 per KV head at head
 * size 256, Llama 3 8B's 4 at 128): every head in one pass over K and one over V, so each K/V row is
 * read from memory once per KV head rather than once per register-sized group of heads. A row stays
 * in registers while the heads' q (scaled), partial sums and accumulators are read from `work`
 * (L1-resident: g * (2 D + 273) floats, 64-byte aligned); every sum is taskv's, in taskv's order. */
static inline __attribute__((always_inline)) void taskv_all(
    float *out, const float *qh, const void *kc, const void *vc, const int64_t *bt, int64_t L, int64_t g,
    int64_t row, int64_t h, int64_t bs, float scale, float *scores, const int et, int64_t lo, float softcap,
    const int DV, float *work) {
  const int D = 16 * DV;
  const int64_t hs = et == ET_I8 ? D + 4 : D;
  __m512 *q = (__m512 *)work, *part = q + g * DV, *acc = part + g * 16, *mv = acc + g * DV;
  float *inv = (float *)(mv + g);
  for (int64_t j = 0; j < g; ++j) {
    for (int c = 0; c < DV; ++c) q[j * DV + c] = _mm512_mul_ps(_mm512_loadu_ps(qh + j * D + c * 16), _mm512_set1_ps(scale));
    mv[j] = _mm512_set1_ps(-INFINITY);
  }
  float ks[16];
  int c = 0;
  int64_t t = lo;
  const int64_t nb = (L + bs - 1) / bs, b0 = lo / bs, pf = prefetch_blocks(bs);
  prefetch_first_blocks(kc, bt + b0, nb - b0, L - b0 * bs, pf, bs, row, h * hs, et, D);
  FOR_EACH_ROW(kc, k, p, {
    __m512 kv[16];
    load_row(kv, kc, k, et, DV);
    if (et == ET_I8) ks[c] = row_scale_d(kc, k, D);
    for (int64_t j = 0; j < g; ++j) part[j * 16 + c] = dot_row(q + j * DV, kv, DV);
    if (++c == 16 || p + 1 == L) {
      for (int64_t j = 0; j < g; ++j) mv[j] = flush_scores(part + j * 16, c, ks, et, softcap, scores + j * L + t, mv[j]);
      t += c;
      c = 0;
    }
  })
  prefetch_first_blocks(vc, bt + b0, nb - b0, L - b0 * bs, pf, bs, row, h * hs, et, D);
  for (int64_t j = 0; j < g; ++j) inv[j] = softmax_row(scores + j * L, L, lo, mv[j]);
  for (int64_t j = 0; j < g * DV; ++j) acc[j] = _mm512_setzero_ps();
  FOR_EACH_ROW(vc, v, p, {
    __m512 vv[16];
    load_row(vv, vc, v, et, DV);
    const float vs = et == ET_I8 ? row_scale_d(vc, v, D) : 1.f;
    for (int64_t j = 0; j < g; ++j) {
      const __m512 w = _mm512_set1_ps(scores[j * L + p] * vs);
      __m512 *aj = acc + j * DV;
      for (int c2 = 0; c2 < DV; ++c2) aj[c2] = _mm512_fmadd_ps(w, vv[c2], aj[c2]);
    }
  })
  for (int64_t j = 0; j < g; ++j)
    for (int c2 = 0; c2 < DV; ++c2)
      _mm512_storeu_ps(out + j * D + c2 * 16, _mm512_mul_ps(acc[j * DV + c2], _mm512_set1_ps(inv[j])));
}

/* One (sequence, KV head) task of the AVX-512 path: query heads in register-sized groups (GMAX of
 * them: q and the accumulators of a group fill at most 16 registers), or all at once (taskv_all)
 * where there are more. */
#define TASKV(GG) taskv(o + j0 * D, qh + j0 * D, kc, vc, bt, L, GG, row, h, bs, scale, scores, et, lo, softcap, DV)
static inline __attribute__((always_inline)) void taskv_groups(
    float *o, const float *qh, const void *kc, const void *vc, const int64_t *bt, int64_t L, int64_t g,
    int64_t row, int64_t h, int64_t bs, float scale, float *scores, const int et, int64_t lo, float softcap,
    const int DV, float *work) {
  const int D = 16 * DV, GMAX = DV <= 4 ? 4 : DV == 5 ? 3 : DV <= 8 ? 2 : 1;
  if (g > GMAX) {
    taskv_all(o, qh, kc, vc, bt, L, g, row, h, bs, scale, scores, et, lo, softcap, DV, work);
    return;
  }
  for (int64_t j0 = 0; j0 < g; j0 += GMAX) {
    const int G = g - j0 < GMAX ? (int)(g - j0) : GMAX;
    /* (G <= GMAX; the GMAX terms, constant per DV, let the compiler drop the groups DV cannot have) */
    if (G == 1 || GMAX == 1) TASKV(1);
    else if (G == 2 || GMAX == 2) TASKV(2);
    else if (G == 3 || GMAX == 3) TASKV(3);
    else TASKV(4);
  }
}
#undef TASKV

#endif

/* Whether the float16 and int8 caches' decode path exists for head size D: the AVX-512 path at
 * head_dv's sizes, the portable one (rows converted to float32) at any size up to 256. */
int paged_decode_f16_supported(int64_t D) { return D >= 1 && D <= 256; }

/* Every (sequence, KV head) task of one call. et: the caches' element type (float16 and int8 up
 * to head size 256: paged_decode_f16_supported); inlined into each entry point with a constant
 * et, so the element type costs no branch in the inner loops. */
static inline __attribute__((always_inline)) int decode_all(
    float *out, const float *q, int64_t q_stride, const void *kc, const void *vc, const int64_t *block_tables,
    const int64_t *seq_lens, int64_t B, int64_t Hq, int64_t Hkv, int64_t D, int64_t block_size,
    int64_t max_blocks, float scale, const int et, int64_t window, float softcap) {
  const int64_t g = Hq / Hkv;
  const int64_t row = Hkv * (et == ET_I8 ? D + 4 : D);
  /* With enough sequences to keep every thread busy, one thread takes all KV heads of a sequence
   * in turn: their rows share cache lines' neighbours and DRAM pages, and the heads after the
   * first find much of each block already fetched (benchmarks/decode_attention.py, 64 decodes over
   * a 2 GiB cache: 19.6 -> 21.1 GB/s). Few sequences are still split by head, so one request uses
   * every core. */
  const int chunk = B >= 4 * omp_get_max_threads() ? (int)Hkv : 1;
  int failed = 0;
#pragma omp parallel
  {
    float *scores = NULL;
    int64_t cap = 0;
    /* task_impl's accumulators, max and 1/sum, or taskv_all's work (the larger) */
    float *acc = (float *)aligned_alloc(64, (sizeof(float) * (g * (2 * D + 16 * 17 + 1) + 16) + 63) / 64 * 64);
    if (acc == NULL) {
#pragma omp atomic write
      failed = 1;
    }
#pragma omp for schedule(dynamic, chunk)
    for (int64_t task = 0; task < B * Hkv; ++task) {
      int stop;
#pragma omp atomic read
      stop = failed;
      if (stop) continue; /* out of memory somewhere: the caller raises, the output is garbage */
      const int64_t b = task / Hkv, h = task % Hkv;
      const int64_t L = seq_lens[b];
      const int64_t lo = window > 0 && L > window ? L - window : 0; /* keys p - window < k <= p */
      if (g * L + 16 > cap) { /* + 16: the vector softmax may touch a partial vector past L */
        cap = (g * L + 16) * 2;
        free(scores);
        scores = (float *)malloc(sizeof(float) * cap);
        if (scores == NULL) {
          cap = 0;
#pragma omp atomic write
          failed = 1;
          continue;
        }
      }
      float *o = out + (b * Hq + h * g) * D;
      const float *qh = q + b * q_stride + h * g * D;
      const int64_t *bt = block_tables + b * max_blocks;
#ifdef __AVX512F__
      const int dv = head_dv(D);
      switch (dv) { /* a constant DV per case: q and the sums stay in registers */
        case 4: taskv_groups(o, qh, kc, vc, bt, L, g, row, h, block_size, scale, scores, et, lo, softcap, 4, acc); continue;
        case 5: taskv_groups(o, qh, kc, vc, bt, L, g, row, h, block_size, scale, scores, et, lo, softcap, 5, acc); continue;
        case 6: taskv_groups(o, qh, kc, vc, bt, L, g, row, h, block_size, scale, scores, et, lo, softcap, 6, acc); continue;
        case 8: taskv_groups(o, qh, kc, vc, bt, L, g, row, h, block_size, scale, scores, et, lo, softcap, 8, acc); continue;
        case 16: taskv_groups(o, qh, kc, vc, bt, L, g, row, h, block_size, scale, scores, et, lo, softcap, 16, acc); continue;
        case 0: break;
        default: /* another multiple of 16: taskv_all's order, DV a run-time value */
          taskv_all(o, qh, kc, vc, bt, L, g, row, h, block_size, scale, scores, et, lo, softcap, dv, acc);
          continue;
      }
#endif
      if (D == 64)
        task_impl(o, qh, kc, vc, bt, L, g, row, h, 64, block_size, scale, scores, acc, lo, softcap, et);
      else if (D == 128)
        task_impl(o, qh, kc, vc, bt, L, g, row, h, 128, block_size, scale, scores, acc, lo, softcap, et);
      else
        task_impl(o, qh, kc, vc, bt, L, g, row, h, D, block_size, scale, scores, acc, lo, softcap, et);
    }
    free(scores);
    free(acc);
  }
  return failed ? -1 : 0;
}

/* Both return 0, or -1 when scratch memory could not be allocated (out is then not valid). */
int paged_decode_f32(float *out, const float *q, int64_t q_stride, const float *kc, const float *vc,
                      const int64_t *block_tables, const int64_t *seq_lens, int64_t B, int64_t Hq,
                      int64_t Hkv, int64_t D, int64_t block_size, int64_t max_blocks, float scale) {
  return decode_all(out, q, q_stride, kc, vc, block_tables, seq_lens, B, Hq, Hkv, D, block_size, max_blocks, scale, ET_F32, 0, 0.f);
}

/* Decode attention over a float16 cache (kv_cache_dtype="float16"). Always exported, so the
 * library's symbols do not depend on the build machine's ISA. */
int paged_decode_f16(float *out, const float *q, int64_t q_stride, const uint16_t *kc, const uint16_t *vc,
                      const int64_t *block_tables, const int64_t *seq_lens, int64_t B, int64_t Hq,
                      int64_t Hkv, int64_t D, int64_t block_size, int64_t max_blocks, float scale) {
  return decode_all(out, q, q_stride, kc, vc, block_tables, seq_lens, B, Hq, Hkv, D, block_size, max_blocks, scale, ET_F16, 0, 0.f);
}

/* Decode attention over an int8 cache (kv_cache_dtype="int8"; rows of D + 4 elements). */
int paged_decode_i8(float *out, const float *q, int64_t q_stride, const int8_t *kc, const int8_t *vc,
                    const int64_t *block_tables, const int64_t *seq_lens, int64_t B, int64_t Hq, int64_t Hkv, int64_t D,
                    int64_t block_size, int64_t max_blocks, float scale) {
  return decode_all(out, q, q_stride, kc, vc, block_tables, seq_lens, B, Hq, Hkv, D, block_size, max_blocks, scale, ET_I8, 0, 0.f);
}

/* The three above with a sliding window (window > 0: a decode at position L - 1 reads keys from
 * L - window; 0: all) and logit soft-capping (softcap > 0), for the layers that have them. Separate
 * entry points, so the decode graph's calls keep their signature. et: 0 float32, 1 float16, 2 int8. */
int paged_decode_windowed(float *out, const float *q, int64_t q_stride, const void *kc, const void *vc,
                          const int64_t *block_tables, const int64_t *seq_lens, int64_t B, int64_t Hq, int64_t Hkv,
                          int64_t D, int64_t block_size, int64_t max_blocks, float scale, int64_t et, int64_t window,
                          float softcap) {
  if (et == ET_F16)
    return decode_all(out, q, q_stride, kc, vc, block_tables, seq_lens, B, Hq, Hkv, D, block_size, max_blocks, scale,
                      ET_F16, window, softcap);
  if (et == ET_I8)
    return decode_all(out, q, q_stride, kc, vc, block_tables, seq_lens, B, Hq, Hkv, D, block_size, max_blocks, scale,
                      ET_I8, window, softcap);
  return decode_all(out, q, q_stride, kc, vc, block_tables, seq_lens, B, Hq, Hkv, D, block_size, max_blocks, scale,
                    ET_F32, window, softcap);
}
