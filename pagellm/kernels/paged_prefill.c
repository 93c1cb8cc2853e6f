/* Paged prefill attention for CPU: every prefill chunk of a step, float32, float16 or int8 cache,
 * head size 64, 80, 96, 128 or 256 (AVX-512; D = 16 * DV below, each instance compiled with its own
 * constant) or another multiple of 16 up to 256 (one instance, DV a run-time value), a sliding
 * window and a logit soft-cap where the layer has them.
 * Each query token attends causally to its sequence's cached K/V, read straight from the blocks
 * (the chunk's own K/V were written there first), so a chunk that starts after cached tokens
 * (prefix-cache hit, chunked prefill) needs no gather and no mask tensor.
 *
 * out:          [T, out_stride]       row t, head j at out + t * out_stride + j * D
 * q:            [T, q_stride]         the same layout (q is a strided view of the qkv output)
 * key/value:    [num_slots, Hkv, D]   slot = block_id * block_size + offset
 * block_tables: [C, max_blocks]       int64, one row per chunk
 * token_starts, num_computed, q_lens: [C] int64; chunk c's tokens are rows token_starts[c] ..,
 *               at positions num_computed[c] .. num_computed[c] + q_lens[c] - 1
 *
 * A task is (chunk, KV head, a tile of query tokens). Its rows are the tile's tokens times the
 * g = Hq / Hkv query heads of that KV head, so every K/V row loaded serves g heads. Rows are
 * the vector lanes throughout: q is transposed once per task (Qt[d][row], pre-scaled), the
 * scores are computed key-major (St[key][row]: a key's element broadcast against 32 rows of Qt),
 * the softmax runs down the keys 16 rows at a time, and P V accumulates 32 rows x 8 dims in
 * registers (rows as lanes again: a key's weights are one load, its values broadcasts) over slices
 * of V that stay in L1. No K transpose is needed. Every sum runs in
 * the decode kernel's order (paged_decode.c): a score as its 16 partial sums folded by sum16's
 * tree, the softmax denominator as 16 running sums added by hsum512's, P V key by key. So a
 * token's result is the same bits whether it was decoded or prefilled, and whatever the chunking
 * or batching (a request preempted by recompute prefills the tokens it had decoded).
 */
#include <math.h>
#include <omp.h>
#include <stdint.h>
#include <stdlib.h>
#include <string.h>
#ifdef __AVX512F__
#include <immintrin.h>
#endif
#include "simd_common.h"

/* The decode kernel's AVX-512 head sizes (head_dv): instances for 64 (SmolLM2, Llama 3.2 1B), 80
 * (Phi-2), 96 (Phi-3), 128 (Llama 3, Qwen3, Mistral) and 256 (Gemma 2 and 3), one generic instance
 * for the other multiples of 16 up to 256. */
int paged_prefill_supported(int64_t D) {
#ifdef __AVX512F__
  return head_dv(D) != 0;
#else
  (void)D;
  return 0;
#endif
}

#ifdef __AVX512F__
#define KEYS_MAX 8 /* keys per score micro-tile (x 32 rows): 8 at D = 64, 4 at 128 (registers) */
#define SCORE_KEYS(DV) ((DV) == 4 ? KEYS_MAX : KEYS_MAX / 2)
#define PV_BYTES (32 * 1024) /* bytes of V per P V slice, reused from L1 by every row block */
#define ST_FLOATS (1 << 16) /* score buffer target per task (256 KiB, L2): sets the token tile */

typedef struct {
  int64_t c, h, t0, nt; /* chunk, KV head, first query token of the tile, tokens in it */
} Task;

typedef struct {
  float *qt, *st, *o, *inv, *kb, *vb, *ks, *vs; /* kb, vb: K, V rows widened; ks, vs: int8 row scales */
  int64_t *pos;
  int64_t cap_rows, cap_keys;
} Scratch;

/* 1 on success; 0 when memory ran out (the scratch is then empty and the task must not run). */
static int scratch_reserve(Scratch *s, int64_t rows, int64_t keys, int64_t D) {
  if (rows > s->cap_rows) {
    free(s->qt), free(s->o), free(s->inv), free(s->pos);
    s->cap_rows = rows;
    s->qt = (float *)aligned_alloc(64, sizeof(float) * D * rows);
    s->o = (float *)aligned_alloc(64, sizeof(float) * D * rows);
    s->inv = (float *)malloc(sizeof(float) * rows);
    s->pos = (int64_t *)malloc(sizeof(int64_t) * rows);
    s->cap_keys = 0; /* st depends on rows too */
    if (!s->qt || !s->o || !s->inv || !s->pos) s->cap_rows = 0;
  }
  if (keys > s->cap_keys && s->cap_rows) {
    free(s->st), free(s->kb), free(s->vb), free(s->ks), free(s->vs);
    s->cap_keys = keys;
    s->st = (float *)aligned_alloc(64, sizeof(float) * keys * s->cap_rows);
    s->kb = (float *)aligned_alloc(64, sizeof(float) * D * keys);
    s->vb = (float *)aligned_alloc(64, sizeof(float) * D * keys);
    s->ks = (float *)malloc(sizeof(float) * keys);
    s->vs = (float *)malloc(sizeof(float) * keys);
    if (!s->st || !s->kb || !s->vb || !s->ks || !s->vs) s->cap_keys = 0;
  }
  return s->cap_rows >= rows && s->cap_keys >= keys;
}

/* The 16 partial sums p_l (pa: rows r0 .. r0 + 16, pb: the next 16) of keys k + jj * D, jj < KEYS:
 * p_l = q_l k_l, then DV - 1 fused multiply-adds of q_{l+16i} k_{l+16i} in i order. Up to DV = 8 the
 * 2 DV vectors of q stay in registers while the keys go by; at DV = 16 they would not fit, so i is
 * the outer loop and the keys' sums stay in registers instead (the same operations per sum). */
static inline __attribute__((always_inline)) void partial_sums(__m512 *pa, __m512 *pb, const float *qt, int64_t rp,
                                                               int64_t r0, const float *k, int l, const int KEYS,
                                                               const int DV) {
  const int D = 16 * DV;
  if (DV <= 8) {
    __m512 qa[8], qb[8];
    for (int i = 0; i < DV; ++i) {
      qa[i] = _mm512_load_ps(qt + (l + 16 * i) * rp + r0);
      qb[i] = _mm512_load_ps(qt + (l + 16 * i) * rp + r0 + 16);
    }
    for (int jj = 0; jj < KEYS; ++jj) {
      const float *kj = k + jj * D + l;
      const __m512 k0 = _mm512_set1_ps(kj[0]);
      __m512 a = _mm512_mul_ps(qa[0], k0), b = _mm512_mul_ps(qb[0], k0);
      for (int i = 1; i < DV; ++i) {
        const __m512 ki = _mm512_set1_ps(kj[16 * i]);
        a = _mm512_fmadd_ps(qa[i], ki, a);
        b = _mm512_fmadd_ps(qb[i], ki, b);
      }
      pa[jj] = a, pb[jj] = b;
    }
    return;
  }
  for (int i = 0; i < DV; ++i) {
    const __m512 qa = _mm512_load_ps(qt + (l + 16 * i) * rp + r0);
    const __m512 qb = _mm512_load_ps(qt + (l + 16 * i) * rp + r0 + 16);
    for (int jj = 0; jj < KEYS; ++jj) {
      const __m512 ki = _mm512_set1_ps(k[jj * D + l + 16 * i]);
      pa[jj] = i == 0 ? _mm512_mul_ps(qa, ki) : _mm512_fmadd_ps(qa, ki, pa[jj]);
      pb[jj] = i == 0 ? _mm512_mul_ps(qb, ki) : _mm512_fmadd_ps(qb, ki, pb[jj]);
    }
  }
}

/* St[j][r0 .. r0 + 32) for keys j0 .. j0 + KEYS of kb (the task's keys, contiguous; rows past the
 * last key are zero). Each score is summed exactly as the decode kernel sums it (paged_decode.c
 * taskv and sum16): the 16 partial sums p_l of partial_sums, folded as
 * x_c = (p_4c + p_4c+2) + (p_4c+1 + p_4c+3) and score = (x_0 + x_1) + (x_2 + x_3), times the key
 * row's scale over an int8 cache, then capped (softcap > 0: softcap * tanh(score / softcap)). */
static inline __attribute__((always_inline)) void scores_tile(float *st, int64_t rp, const float *qt, int64_t r0,
                                                              const float *kb, const float *ks, int64_t j0,
                                                              const int et, const int DV, float softcap) {
  const int D = 16 * DV, KEYS = SCORE_KEYS(DV);
  const float *k = kb + j0 * D;
  const __m512 cap = _mm512_set1_ps(softcap);
  __m512 x2[KEYS_MAX][2]; /* x_2, kept until x_3 is there */
  for (int c = 0; c < 4; ++c) {
    __m512 e[2][KEYS_MAX][2]; /* p_4c + p_4c+2, p_4c+1 + p_4c+3; per key and 16-row half */
    for (int m = 0; m < 4; ++m) {
      __m512 pa[KEYS_MAX], pb[KEYS_MAX];
      partial_sums(pa, pb, qt, rp, r0, k, 4 * c + m, KEYS, DV);
      for (int jj = 0; jj < KEYS; ++jj) {
        if (m < 2) {
          e[m][jj][0] = pa[jj], e[m][jj][1] = pb[jj];
        } else {
          e[m - 2][jj][0] = _mm512_add_ps(e[m - 2][jj][0], pa[jj]);
          e[m - 2][jj][1] = _mm512_add_ps(e[m - 2][jj][1], pb[jj]);
        }
      }
    }
    for (int jj = 0; jj < KEYS; ++jj)
      for (int h = 0; h < 2; ++h) {
        float *dst = st + (j0 + jj) * rp + r0 + 16 * h;
        const __m512 x = _mm512_add_ps(e[0][jj][h], e[1][jj][h]);
        if (c == 0) _mm512_store_ps(dst, x);                                      /* x_0 */
        else if (c == 1) _mm512_store_ps(dst, _mm512_add_ps(_mm512_load_ps(dst), x)); /* x_0 + x_1 */
        else if (c == 2) x2[jj][h] = x;
        else {
          __m512 score = _mm512_add_ps(_mm512_load_ps(dst), _mm512_add_ps(x2[jj][h], x));
          if (et == ET_I8) score = _mm512_mul_ps(score, _mm512_set1_ps(ks[j0 + jj])); /* the key's scale */
          if (softcap > 0.f) score = _mm512_mul_ps(cap, tanh512(_mm512_div_ps(score, cap)));
          _mm512_store_ps(dst, score);
        }
      }
  }
}

/* Dims per pv_cols tile: 8 dims x 32 rows of accumulators (16 registers). */
#define PV_DIMS 8

/* Ot[d][r0 .. r0 + 32) (+)= sum over keys j0 .. j1 of St[j][r] * V[j][d] for dims d0 .. d0 + 8, V
 * widened in vb (first: the first keys of this row group, so the sums start from zero). Rows are the
 * lanes, as in the scores: a key's weights are one load from St and its values broadcasts, and every
 * output is summed key by key from zero (the decode kernel's order). */
static inline __attribute__((always_inline)) void pv_cols(float *ot, const float *st, int64_t rp, int64_t r0,
                                                          const float *vb, const float *vs, int64_t j0, int64_t j1,
                                                          int first, int64_t d0, const int et, const int D) {
  __m512 a[PV_DIMS][2];
  for (int i = 0; i < PV_DIMS; ++i)
    for (int h = 0; h < 2; ++h)
      a[i][h] = first ? _mm512_setzero_ps() : _mm512_load_ps(ot + (d0 + i) * rp + r0 + 16 * h);
  for (int64_t j = j0; j < j1; ++j) {
    __m512 pa = _mm512_load_ps(st + j * rp + r0), pb = _mm512_load_ps(st + j * rp + r0 + 16);
    if (et == ET_I8) { /* an int8 V row's scale, on each weight as decode does */
      const __m512 sc = _mm512_set1_ps(vs[j]);
      pa = _mm512_mul_ps(pa, sc), pb = _mm512_mul_ps(pb, sc);
    }
    const float *v = vb + j * D + d0;
    for (int i = 0; i < PV_DIMS; ++i) {
      const __m512 vi = _mm512_set1_ps(v[i]);
      a[i][0] = _mm512_fmadd_ps(pa, vi, a[i][0]);
      a[i][1] = _mm512_fmadd_ps(pb, vi, a[i][1]);
    }
  }
  for (int i = 0; i < PV_DIMS; ++i)
    for (int h = 0; h < 2; ++h) _mm512_store_ps(ot + (d0 + i) * rp + r0 + 16 * h, a[i][h]);
}

/* Which of the 16 rows whose positions are pv (rows 0-7) and pv2 (rows 8-15) may see key j: j <= the
 * row's position and, with a window, j >= its first key (lo, lo2: position - window + 1). */
static inline __mmask16 sees(int64_t j, __m512i pv, __m512i pv2, __m512i lo, __m512i lo2) {
  const __m512i jv = _mm512_set1_epi64(j);
  const __mmask8 a = _mm512_cmple_epi64_mask(jv, pv) & _mm512_cmpge_epi64_mask(jv, lo);
  const __mmask8 b = _mm512_cmple_epi64_mask(jv, pv2) & _mm512_cmpge_epi64_mask(jv, lo2);
  return (__mmask16)(a | (b << 8));
}

static inline int64_t max64(int64_t a, int64_t b) { return a > b ? a : b; }

/* One task. Keys are held from klo, the first key a row of the task may see (0, or with a window its
 * first row's position - window + 1, rounded down to 16 so that key j's softmax lane, j % 16, is the
 * decode kernel's); st, kb and vb are indexed by key - klo. W: the window, or more positions than
 * any context when there is none. */
static inline __attribute__((always_inline)) int run_task(
    Scratch *s, const Task *tk, float *out, int64_t out_stride, const float *q, int64_t q_stride, const void *kc,
    const void *vc, const int64_t *bt, int64_t ts, int64_t nc, int64_t h, int64_t g, int64_t Hkv, int64_t bs,
    float scale, const int et, const int DV, int64_t W, float softcap) {
  const int D = 16 * DV, KEYS = SCORE_KEYS(DV), PV_KEYS = PV_BYTES / (4 * D);
  const int64_t R = tk->nt * g, rp = (R + 31) / 32 * 32;
  const int64_t L = nc + tk->t0 + tk->nt; /* keys the last token attends to */
  const int64_t klo = max64(0, nc + tk->t0 - W + 1) / 16 * 16;
  const int64_t lk = (L - klo + KEYS - 1) / KEYS * KEYS;
  if (!scratch_reserve(s, rp, lk, D)) return 0;
  const int64_t hs = et == ET_I8 ? D + 4 : D; /* an int8 row's values, then its float32 scale */
  const int64_t row = Hkv * hs;
  for (int64_t j = klo; j < L; ++j) {
    const int64_t off = (bt[j / bs] * bs + j % bs) * row + h * hs, jr = j - klo;
    /* Widened once here (exactly): pv_cols reads each key again for every 8 dims. */
    for (int c = 0; c < DV; ++c) {
      _mm512_store_ps(s->kb + jr * D + c * 16, load16(kc, off + c * 16, et));
      _mm512_store_ps(s->vb + jr * D + c * 16, load16(vc, off + c * 16, et));
    }
    if (et == ET_I8) s->ks[jr] = row_scale_d(kc, off, D), s->vs[jr] = row_scale_d(vc, off, D);
  }
  memset(s->kb + (L - klo) * D, 0, sizeof(float) * D * (lk - (L - klo)));
  /* rows r = t * g + i: token t0 + t, query head h * g + i; padding rows repeat the last row's
   * position (computed and discarded) and have zero queries. Positions never decrease with r, so
   * the last row of a group sees the most keys and the first the earliest. */
  for (int64_t r = 0; r < rp; ++r) s->pos[r] = nc + tk->t0 + (r < R ? r / g : tk->nt - 1);
  /* Qt[d][r] = q[row r][d] * scale, 16 rows per gather. */
  const float *q0 = q + (ts + tk->t0) * q_stride + h * g * D;
  const __m512 sc = _mm512_set1_ps(scale);
  for (int64_t r0 = 0; r0 < rp; r0 += 16) {
    int32_t off[16];
    __mmask16 live = 0;
    for (int i = 0; i < 16; ++i) {
      const int64_t r = r0 + i;
      off[i] = r < R ? (int32_t)((r / g) * q_stride + (r % g) * D) : 0;
      live |= (__mmask16)((r < R) << i);
    }
    const __m512i idx = _mm512_loadu_si512((const void *)off);
    for (int d = 0; d < D; ++d) {
      const __m512 v = _mm512_mask_i32gather_ps(_mm512_setzero_ps(), live, idx, q0 + d, 4);
      _mm512_store_ps(s->qt + d * rp + r0, _mm512_mul_ps(v, sc));
    }
  }
  /* Scores: each 32-row group only from the first key its first row sees to the last its last row
   * sees (whole key tiles; relative to klo). */
  for (int64_t r0 = 0; r0 < rp; r0 += 32) {
    const int64_t j0 = (max64(klo, s->pos[r0] - W + 1) - klo) / KEYS * KEYS, nk = s->pos[r0 + 31] + 1 - klo;
    for (int64_t j = j0; j < nk; j += KEYS) scores_tile(s->st, rp, s->qt, r0, s->kb, s->ks, j, et, DV, softcap);
  }
  /* Softmax down the keys, 16 rows per vector; keys a row does not see become exact zeros. */
  const __m512i wv = _mm512_set1_epi64(W - 1);
  for (int64_t r0 = 0; r0 < rp; r0 += 16) {
    const __m512i pv = _mm512_loadu_si512((const void *)(s->pos + r0));
    const __m512i pv2 = _mm512_loadu_si512((const void *)(s->pos + r0 + 8));
    const __m512i lo = _mm512_sub_epi64(pv, wv), lo2 = _mm512_sub_epi64(pv2, wv);
    const int64_t j0 = max64(klo, s->pos[r0] - W + 1), j32 = max64(klo, s->pos[r0 & ~(int64_t)31] - W + 1);
    const int64_t nk = s->pos[r0 + 15] + 1, nk32 = s->pos[(r0 | 31)] + 1;
    float *st = s->st; /* row of key j: j - klo */
    __m512 m = _mm512_set1_ps(-INFINITY);
    for (int64_t j = j0; j < nk; ++j) m = _mm512_mask_max_ps(m, sees(j, pv, pv2, lo, lo2), m, _mm512_load_ps(st + (j - klo) * rp + r0));
    /* The decode kernel's order: sixteen running sums (key j into sum j % 16), then hsum512's tree. */
    __m512 sum[16];
    for (int i = 0; i < 16; ++i) sum[i] = _mm512_setzero_ps();
    for (int64_t j = j0; j < nk; ++j) {
      const __m512 e = _mm512_maskz_mov_ps(sees(j, pv, pv2, lo, lo2), exp512(_mm512_sub_ps(_mm512_load_ps(st + (j - klo) * rp + r0), m)));
      _mm512_store_ps(st + (j - klo) * rp + r0, e);
      sum[j & 15] = _mm512_add_ps(sum[j & 15], e);
    }
    /* pv_cols reads 32 rows over the keys any of them sees: zeros for these 16 outside their own. */
    for (int64_t j = j32; j < j0; ++j) _mm512_store_ps(st + (j - klo) * rp + r0, _mm512_setzero_ps());
    for (int64_t j = nk; j < nk32; ++j) _mm512_store_ps(st + (j - klo) * rp + r0, _mm512_setzero_ps());
    for (int i = 0; i < 8; ++i) sum[i] = _mm512_add_ps(sum[i + 8], sum[i]);
    for (int i = 0; i < 4; ++i) sum[i] = _mm512_add_ps(sum[i + 4], sum[i]);
    const __m512 total = _mm512_add_ps(_mm512_add_ps(sum[0], sum[2]), _mm512_add_ps(sum[1], sum[3]));
    _mm512_storeu_ps(s->inv + r0, _mm512_div_ps(_mm512_set1_ps(1.f), total));
  }
  /* P V (into Ot[d][r], in s->o) over slices of V that stay in L1; a 32-row group runs over the keys
   * its rows see (relative to klo). */
  for (int64_t r0 = 0; r0 < rp; r0 += 32) {
    const int64_t j32 = max64(klo, s->pos[r0] - W + 1) - klo, nk = s->pos[r0 + 31] + 1 - klo;
    for (int64_t j0 = j32; j0 < nk; j0 += PV_KEYS)
      for (int64_t d0 = 0; d0 < D; d0 += PV_DIMS)
        pv_cols(s->o, s->st, rp, r0, s->vb, s->vs, j0, nk < j0 + PV_KEYS ? nk : j0 + PV_KEYS, j0 == j32, d0, et, D);
  }
  int32_t dix[16]; /* Ot's column of a row: 16 of its dims, rp apart */
  for (int i = 0; i < 16; ++i) dix[i] = (int32_t)(i * rp);
  const __m512i di = _mm512_loadu_si512((const void *)dix);
  for (int64_t r = 0; r < R; ++r) {
    float *dst = out + (ts + tk->t0 + r / g) * out_stride + (h * g + r % g) * D;
    const __m512 iv = _mm512_set1_ps(s->inv[r]);
    for (int c = 0; c < DV; ++c)
      _mm512_storeu_ps(dst + c * 16, _mm512_mul_ps(_mm512_i32gather_ps(di, s->o + c * 16 * rp + r, 4), iv));
  }
  return 1;
}
/* Query tokens per task for a chunk whose rows see up to L keys: rows (tokens x g) a multiple of 32
 * that keeps the score buffer near ST_FLOATS, but never under 32 rows (long contexts would otherwise
 * get tasks of a few rows padded to 32). */
static int64_t tile_tokens(int64_t L, int64_t q_len, int64_t g) {
  int64_t rows = ST_FLOATS / L / 32 * 32;
  rows = rows < 32 ? 32 : rows;
  int64_t nt = rows / g;
  nt = nt < 1 ? 1 : nt;
  return nt > q_len ? q_len : nt;
}
#endif

/* 0, or -1 when scratch memory could not be allocated (out is then not valid). window > 0: a query
 * at position p sees keys p - window < k <= p; softcap > 0: scores capped to softcap * tanh(s / softcap). */
static inline __attribute__((always_inline)) int prefill_all(
    float *out, int64_t out_stride, const float *q, int64_t q_stride, const void *kc, const void *vc,
    const int64_t *block_tables, int64_t max_blocks, const int64_t *token_starts, const int64_t *num_computed,
    const int64_t *q_lens, int64_t C, int64_t Hq, int64_t Hkv, int64_t block_size, float scale, const int et,
    const int DV, int64_t window, float softcap) {
#ifdef __AVX512F__
  const int64_t g = Hq / Hkv;
  const int64_t W = window > 0 ? window : INT64_MAX / 4;
  int64_t n = 0;
  /* (a windowed chunk's rows see at most its window plus the tile's own tokens: W + q_len bounds it) */
#define CHUNK_TILE(c) \
  tile_tokens(num_computed[c] + q_lens[c] < W + q_lens[c] ? num_computed[c] + q_lens[c] : W + q_lens[c], q_lens[c], g)
  for (int64_t c = 0; c < C; ++c) {
    const int64_t nt = CHUNK_TILE(c);
    n += Hkv * ((q_lens[c] + nt - 1) / nt);
  }
  Task *tasks = (Task *)malloc(sizeof(Task) * (n ? n : 1));
  if (tasks == NULL) return -1;
  n = 0;
  /* Longest tasks first (the later tiles of a chunk see the most keys) for dynamic scheduling. */
  for (int64_t c = 0; c < C; ++c) {
    const int64_t nt = CHUNK_TILE(c);
    for (int64_t t0 = (q_lens[c] - 1) / nt * nt; t0 >= 0; t0 -= nt)
      for (int64_t h = 0; h < Hkv; ++h) {
        tasks[n].c = c;
        tasks[n].h = h;
        tasks[n].t0 = t0;
        tasks[n].nt = q_lens[c] - t0 < nt ? q_lens[c] - t0 : nt;
        ++n;
      }
  }
#undef CHUNK_TILE
  int failed = 0;
#pragma omp parallel
  {
    Scratch s = {0};
#pragma omp for schedule(dynamic, 1)
    for (int64_t i = 0; i < n; ++i) {
      const int64_t c = tasks[i].c;
      const int64_t *bt = block_tables + c * max_blocks;
      /* (DV spelled as constants here: the parallel region is outlined before inlining, so a DV
       * passed through would stay a run-time value and leave every per-dimension loop rolled) */
#define RUN(DVC) run_task(&s, &tasks[i], out, out_stride, q, q_stride, kc, vc, bt, token_starts[c], num_computed[c], \
                          tasks[i].h, g, Hkv, block_size, scale, et, DVC, W, softcap)
      const int ok = DV == 4 ? RUN(4) : DV == 5 ? RUN(5) : DV == 6 ? RUN(6) : DV == 8 ? RUN(8) : DV == 16 ? RUN(16)
                                                                                                   : RUN(DV);
#undef RUN
      if (!ok) {
#pragma omp atomic write
        failed = 1;
      }
    }
    free(s.qt), free(s.st), free(s.o), free(s.inv), free(s.pos), free(s.kb), free(s.vb), free(s.ks);
    free(s.vs);
  }
  free(tasks);
  return failed ? -1 : 0;
#else
  (void)out, (void)out_stride, (void)q, (void)q_stride, (void)kc, (void)vc, (void)block_tables;
  (void)max_blocks, (void)token_starts, (void)num_computed, (void)q_lens, (void)C, (void)Hq, (void)Hkv;
  (void)block_size, (void)scale, (void)et, (void)DV, (void)window, (void)softcap;
  return -1; /* never called: paged_prefill_supported() is 0 without AVX-512 */
#endif
}

/* The exported entry points: over a float32 cache, a float16 one (kv_cache_dtype="float16") and an
 * int8 one (kv_cache_dtype="int8": rows of D values and their float32 scale); K/V widened exactly
 * as they are read, an int8 row's scale applied where the decode kernel applies it. D is one of
 * paged_prefill_supported's sizes; -2 for any other. window (0: none) and softcap (0: none) as in
 * prefill_all. */
#define PREFILL_ENTRY(name, T, et)                                                                                   \
  int name(float *out, int64_t out_stride, const float *q, int64_t q_stride, const T *kc, const T *vc,              \
           const int64_t *block_tables, int64_t max_blocks, const int64_t *token_starts, const int64_t *num_computed, \
           const int64_t *q_lens, int64_t C, int64_t Hq, int64_t Hkv, int64_t block_size, float scale, int64_t D,    \
           int64_t window, float softcap) {                                                                          \
    if (!paged_prefill_supported(D)) return -2;                                                                      \
    return prefill_all(out, out_stride, q, q_stride, kc, vc, block_tables, max_blocks, token_starts, num_computed, \
                       q_lens, C, Hq, Hkv, block_size, scale, et, (int)(D / 16), window, softcap);                  \
  }
PREFILL_ENTRY(paged_prefill_f32, float, ET_F32)
PREFILL_ENTRY(paged_prefill_f16, uint16_t, ET_F16)
PREFILL_ENTRY(paged_prefill_i8, int8_t, ET_I8)
