/* Paged prefill attention on AMX bfloat16 tiles, for runs that never decode (a pooling model in
 * bfloat16 numerics: pagellm/attention/cpu_paged.py chooses it). The interface of paged_prefill.c's
 * entry points, over a float32 or float16 cache, head size 64 or 128.
 *
 * Numerics: q, K and V are rounded to bfloat16 (nearest even, as the bfloat16 GEMMs round x); the
 * scores and P V are float32 sums of bfloat16 products (tdpbf16ps); the softmax runs in float32 and
 * its weights enter P V rounded to bfloat16, unnormalised, the float32 denominator divided out at the
 * end (what a bfloat16 SDPA does). It does not sum as the decode kernel does, hence pooling only:
 * a generating run must give a token the same bits decoded or prefilled (paged_prefill.c).
 *
 * Batch invariant all the same: a row's result depends only on its query, its position and keys
 * 0 .. position. A score sums over d in tile order whatever rows share the tile; the softmax runs
 * over the row's own keys (key j in lane j % 16, blocks in order, hsum512's tree); P V sums 32-key
 * blocks from key 0 in order, and keys past the row's position weigh exact zeros.
 *
 * A task is (chunk, KV head, a tile of query tokens); its rows are the tokens times the KV head's g
 * query heads (row r: token t0 + r / g, head h * g + r % g). It rounds the keys 0 .. L that its last
 * token sees once, into K^T pairs (the scores' B operand) and V pairs (P V's B operand), then takes
 * its rows 32 at a time: scores into a float32 buffer, the softmax into bfloat16 P (P V's A
 * operand), P V into float32, scaled into out.
 */
#include <math.h>
#include <omp.h>
#include <stdint.h>
#include <stdlib.h>
#include <string.h>
#ifdef __AVX512F__
#include <immintrin.h>
#endif
#include "gemm_tile.h"   /* amx_ready, amx_configure_16x64 */
#include "simd_common.h" /* bf16_round16, exp512, hsum512, load16 */

/* 1 where this machine has the kernel for head size D (AMX granted to the process). */
int paged_prefill_amx_supported(int64_t D) {
#ifdef __AMX_BF16__
  return (D == 64 || D == 128) && amx_ready();
#else
  (void)D;
  return 0;
#endif
}

#ifdef __AMX_BF16__
#define ROWS_TARGET 1024 /* query rows per task: the K/V rounding is paid once per task (512: 1.1x slower) */

typedef struct {
  int64_t c, h, t0, nt; /* chunk, KV head, first query token of the tile, tokens in it */
} Task;

typedef struct {
  uint16_t *kt, *vt, *qb, *pb; /* K^T pairs, V pairs, q rows, P rows (bfloat16) */
  float *st, *ob, *inv;        /* 32 rows of scores, of P V, their 1 / denominators */
  int64_t cap_keys, cap_rows;
} Scratch;

static void scratch_free(Scratch *s) {
  free(s->kt), free(s->vt), free(s->qb), free(s->pb), free(s->st), free(s->ob), free(s->inv);
  memset(s, 0, sizeof *s);
}

/* 1 when the scratch holds `keys` (a multiple of 32) keys and `rows` (a multiple of 32) rows. */
static int scratch_reserve(Scratch *s, int64_t keys, int64_t rows, int64_t D) {
  if (rows > s->cap_rows) {
    free(s->qb), free(s->ob), free(s->inv);
    s->qb = (uint16_t *)aligned_alloc(64, sizeof(uint16_t) * rows * D);
    s->ob = (float *)aligned_alloc(64, sizeof(float) * 32 * D);
    s->inv = (float *)aligned_alloc(64, sizeof(float) * 32);
    s->cap_rows = s->qb && s->ob && s->inv ? rows : 0;
  }
  if (keys > s->cap_keys) {
    free(s->kt), free(s->vt), free(s->pb), free(s->st);
    s->kt = (uint16_t *)aligned_alloc(64, sizeof(uint16_t) * keys * D);
    s->vt = (uint16_t *)aligned_alloc(64, sizeof(uint16_t) * keys * D);
    s->pb = (uint16_t *)aligned_alloc(64, sizeof(uint16_t) * 32 * keys);
    s->st = (float *)aligned_alloc(64, sizeof(float) * 32 * keys);
    s->cap_keys = s->kt && s->vt && s->pb && s->st ? keys : 0;
  }
  return s->cap_rows >= rows && s->cap_keys >= keys;
}

/* r[i] lane j <- r[j] lane i, 16 x 16 dwords. */
static inline void transpose16(__m512i r[16]) {
  __m512i t[16];
  for (int i = 0; i < 16; i += 2) {
    t[i] = _mm512_unpacklo_epi32(r[i], r[i + 1]);
    t[i + 1] = _mm512_unpackhi_epi32(r[i], r[i + 1]);
  }
  /* u[4a + c], 128-bit lane l: column 4l + c of rows 4a .. 4a + 3 */
  __m512i u[16];
  for (int a = 0; a < 4; ++a) {
    u[4 * a] = _mm512_unpacklo_epi64(t[4 * a], t[4 * a + 2]);
    u[4 * a + 1] = _mm512_unpackhi_epi64(t[4 * a], t[4 * a + 2]);
    u[4 * a + 2] = _mm512_unpacklo_epi64(t[4 * a + 1], t[4 * a + 3]);
    u[4 * a + 3] = _mm512_unpackhi_epi64(t[4 * a + 1], t[4 * a + 3]);
  }
  for (int c = 0; c < 4; ++c) {
    const __m512i even0 = _mm512_shuffle_i32x4(u[c], u[4 + c], 0x88);  /* lanes 0, 2 of rows 0-7 */
    const __m512i odd0 = _mm512_shuffle_i32x4(u[c], u[4 + c], 0xdd);   /* lanes 1, 3 */
    const __m512i even1 = _mm512_shuffle_i32x4(u[8 + c], u[12 + c], 0x88);
    const __m512i odd1 = _mm512_shuffle_i32x4(u[8 + c], u[12 + c], 0xdd);
    r[c] = _mm512_shuffle_i32x4(even0, even1, 0x88);      /* column c */
    r[8 + c] = _mm512_shuffle_i32x4(even0, even1, 0xdd);  /* column 8 + c */
    r[4 + c] = _mm512_shuffle_i32x4(odd0, odd1, 0x88);    /* column 4 + c */
    r[12 + c] = _mm512_shuffle_i32x4(odd0, odd1, 0xdd);   /* column 12 + c */
  }
}

/* 32 cached values of a row from element offset `off`, rounded to bfloat16: 16 pairs as dwords. */
static inline __m512i pairs32(const void *cache, int64_t off, const int et) {
  const __m256i lo = bf16_round16(load16(cache, off, et)), hi = bf16_round16(load16(cache, off + 16, et));
  return _mm512_inserti64x4(_mm512_castsi256_si512(lo), hi, 1);
}

/* The task's keys [0, L) of KV head h, rounded: kt, blocks of 16 keys (16 * D values each): pair dp
 * of key kk at dp * 32 + kk * 2 (a score tile's B: 16 pairs of d x 16 keys, 64-byte rows); vt,
 * blocks of 32 keys: pair kp (keys 2kp, 2kp + 1) of dim d at kp * 2 * D + d * 2 (P V's B: 16 pairs of
 * keys x 16 dims, rows 4 D bytes apart). Keys from L to the next multiple of 32 are zero. */
static inline __attribute__((always_inline)) void round_keys(uint16_t *kt, uint16_t *vt, const void *kc,
                                                             const void *vc, const int64_t *bt, int64_t L,
                                                             int64_t h, int64_t Hkv, int64_t bs, const int et,
                                                             const int D) {
  const int64_t L32 = (L + 31) / 32 * 32;
  for (int64_t j0 = 0; j0 < L32; j0 += 16) {
    int64_t off[16];
    for (int kk = 0; kk < 16; ++kk) {
      const int64_t j = j0 + kk;
      off[kk] = j < L ? (bt[j / bs] * bs + j % bs) * Hkv * D + h * D : -1;
    }
    for (int kk = 0; kk < 16 && j0 + 16 + kk < L; ++kk) { /* the next 16 keys' rows, scattered over blocks */
      const int64_t jn = j0 + 16 + kk, bytes = et == ET_F32 ? 4 : 2;
      const char *kn = (const char *)kc + ((bt[jn / bs] * bs + jn % bs) * Hkv * D + h * D) * bytes;
      const char *vn = (const char *)vc + ((bt[jn / bs] * bs + jn % bs) * Hkv * D + h * D) * bytes;
      for (int l = 0; l < D * bytes; l += 64) _mm_prefetch(kn + l, _MM_HINT_T0), _mm_prefetch(vn + l, _MM_HINT_T0);
    }
    for (int t = 0; t < D / 32; ++t) {
      __m512i r[16];
      for (int kk = 0; kk < 16; ++kk) r[kk] = off[kk] < 0 ? _mm512_setzero_si512() : pairs32(kc, off[kk] + t * 32, et);
      transpose16(r);
      for (int i = 0; i < 16; ++i) _mm512_store_si512((void *)(kt + j0 * D + (t * 16 + i) * 32), r[i]);
    }
    static const uint16_t pairs[32] = {0, 16, 1, 17, 2, 18, 3, 19, 4, 20, 5, 21, 6, 22, 7, 23,
                                       8, 24, 9, 25, 10, 26, 11, 27, 12, 28, 13, 29, 14, 30, 15, 31};
    const __m512i inter = _mm512_loadu_si512((const void *)pairs); /* a[0] b[0] a[1] b[1] .. */
    for (int kk = 0; kk < 16; kk += 2) {
      const int64_t kp = (j0 % 32 + kk) / 2;
      uint16_t *dst = vt + (j0 / 32) * 32 * D + kp * 2 * D;
      for (int c = 0; c < D / 16; ++c) {
        const __m256i a = off[kk] < 0 ? _mm256_setzero_si256() : bf16_round16(load16(vc, off[kk] + c * 16, et));
        const __m256i b = off[kk + 1] < 0 ? _mm256_setzero_si256()
                                          : bf16_round16(load16(vc, off[kk + 1] + c * 16, et));
        const __m512i ab = _mm512_inserti64x4(_mm512_castsi256_si512(a), b, 1);
        _mm512_store_si512((void *)(dst + c * 32), _mm512_permutexvar_epi16(inter, ab));
      }
    }
  }
}

/* Tiles 0-3 = 0, then += A x B over the 2 x 2 block both products are made of: A rows at a0 (tile 4)
 * and a1 (5), B at b0 (6) and b1 (7); into c, c + 16, c + 16 ld and c + 16 ld + 16 (floats). */
static inline __attribute__((always_inline)) void zero_2x2(void) {
  _tile_zero(0);
  _tile_zero(1);
  _tile_zero(2);
  _tile_zero(3);
}

static inline __attribute__((always_inline)) void dot_2x2(const void *a0, const void *a1, int64_t lda,
                                                          const void *b0, const void *b1, int64_t ldb) {
  _tile_loadd(4, a0, lda);
  _tile_loadd(5, a1, lda);
  _tile_loadd(6, b0, ldb);
  _tile_loadd(7, b1, ldb);
  _tile_dpbf16ps(0, 4, 6);
  _tile_dpbf16ps(1, 4, 7);
  _tile_dpbf16ps(2, 5, 6);
  _tile_dpbf16ps(3, 5, 7);
}

static inline __attribute__((always_inline)) void store_2x2(float *c, int64_t ld) {
  _tile_stored(0, c, ld * 4);
  _tile_stored(1, c + 16, ld * 4);
  _tile_stored(2, c + 16 * ld, ld * 4);
  _tile_stored(3, c + 16 * ld + 16, ld * 4);
}

static inline __attribute__((always_inline)) int run_task(Scratch *s, const Task *tk, float *out,
                                                          int64_t out_stride, const float *q, int64_t q_stride,
                                                          const void *kc, const void *vc, const int64_t *bt,
                                                          int64_t ts, int64_t nc, int64_t g, int64_t Hkv,
                                                          int64_t bs, float scale, const int et, const int D) {
  const int64_t h = tk->h, R = tk->nt * g, rp = (R + 31) / 32 * 32;
  const int64_t L = nc + tk->t0 + tk->nt, L32 = (L + 31) / 32 * 32; /* keys the last token sees */
  if (!scratch_reserve(s, L32, rp, D)) return 0;
  round_keys(s->kt, s->vt, kc, vc, bt, L, h, Hkv, bs, et, D);
  for (int64_t r = 0; r < rp; ++r) { /* q rows, zero past R */
    uint16_t *dst = s->qb + r * D;
    const float *src = q + (ts + tk->t0 + r / g) * q_stride + (h * g + r % g) * D;
    if (r + 8 < R) { /* (rows are strided in the qkv output) */
      const char *next = (const char *)(q + (ts + tk->t0 + (r + 8) / g) * q_stride + (h * g + (r + 8) % g) * D);
      for (int l = 0; l < D * 4; l += 64) _mm_prefetch(next + l, _MM_HINT_T0);
    }
    for (int c = 0; c < D / 16; ++c)
      _mm256_store_si256((__m256i *)(dst + c * 16), r < R ? bf16_round16(_mm512_loadu_ps(src + c * 16))
                                                          : _mm256_setzero_si256());
  }
  const int64_t ldq = D * 2, ldk = 64, ldv = D * 4, ldp = L32 * 2; /* bytes */
  for (int64_t r0 = 0; r0 < rp; r0 += 32) {
    /* a row's position; padding rows take the last real row's and are not written out */
    const int64_t last = nc + tk->t0 + ((r0 + 31 < R ? r0 + 31 : R - 1) / g), nk32 = (last + 1 + 31) / 32 * 32;
    const uint16_t *qa = s->qb + r0 * D;
    for (int64_t j0 = 0; j0 < nk32; j0 += 32) {
      zero_2x2();
      for (int t = 0; t < D / 32; ++t)
        dot_2x2(qa + t * 32, qa + 16 * D + t * 32, ldq, s->kt + j0 * D + t * 16 * 32,
                s->kt + (j0 + 16) * D + t * 16 * 32, ldk);
      store_2x2(s->st + j0, L32);
    }
    const __m512 sc = _mm512_set1_ps(scale);
    for (int i = 0; i < 32; ++i) {
      const int64_t r = r0 + i < R ? r0 + i : R - 1, nk = nc + tk->t0 + r / g + 1; /* the row's keys */
      float *srow = s->st + i * L32;
      uint16_t *prow = s->pb + i * L32;
      __m512 m16 = _mm512_set1_ps(-INFINITY);
      for (int64_t j = 0; j < nk; j += 16) {
        const __mmask16 live = nk - j >= 16 ? 0xFFFF : (__mmask16)((1u << (nk - j)) - 1);
        m16 = _mm512_mask_max_ps(m16, live, m16, _mm512_mul_ps(_mm512_load_ps(srow + j), sc));
      }
      const __m512 m = _mm512_set1_ps(_mm512_reduce_max_ps(m16));
      __m512 sum = _mm512_setzero_ps();
      int64_t j = 0;
      for (; j < nk; j += 16) {
        const __mmask16 live = nk - j >= 16 ? 0xFFFF : (__mmask16)((1u << (nk - j)) - 1);
        const __m512 e = _mm512_maskz_mov_ps(live, exp512(_mm512_sub_ps(_mm512_mul_ps(_mm512_load_ps(srow + j), sc), m)));
        sum = _mm512_add_ps(sum, e);
        _mm256_store_si256((__m256i *)(prow + j), bf16_round16(e));
      }
      for (; j < nk32; j += 16) _mm256_store_si256((__m256i *)(prow + j), _mm256_setzero_si256());
      s->inv[i] = 1.f / hsum512(sum);
    }
    for (int d0 = 0; d0 < D; d0 += 32) {
      zero_2x2();
      for (int64_t j0 = 0; j0 < nk32; j0 += 32) {
        const uint16_t *vb = s->vt + j0 * D + d0 * 2;
        dot_2x2(s->pb + j0, s->pb + 16 * L32 + j0, ldp, vb, vb + 32, ldv);
      }
      store_2x2(s->ob + d0, D);
    }
    for (int i = 0; i < 32 && r0 + i < R; ++i) {
      const int64_t r = r0 + i;
      float *dst = out + (ts + tk->t0 + r / g) * out_stride + (h * g + r % g) * D;
      const __m512 iv = _mm512_set1_ps(s->inv[i]);
      /* Streamed past the caches where aligned (the next reader is another pass, the o projection's
       * rounding): 1.02x end to end; the region's end orders them (_mm_sfence there). */
      if ((((uintptr_t)dst) & 63) == 0)
        for (int c = 0; c < D / 16; ++c)
          _mm512_stream_ps(dst + c * 16, _mm512_mul_ps(_mm512_load_ps(s->ob + i * D + c * 16), iv));
      else
        for (int c = 0; c < D / 16; ++c)
          _mm512_storeu_ps(dst + c * 16, _mm512_mul_ps(_mm512_load_ps(s->ob + i * D + c * 16), iv));
    }
  }
  return 1;
}
#endif

/* 0; -1 when scratch memory could not be allocated (out is then not valid); -2 for a head size or
 * machine without the kernel (paged_prefill_amx_supported). */
static inline __attribute__((always_inline)) int prefill_amx_all(
    float *out, int64_t out_stride, const float *q, int64_t q_stride, const void *kc, const void *vc,
    const int64_t *block_tables, int64_t max_blocks, const int64_t *token_starts, const int64_t *num_computed,
    const int64_t *q_lens, int64_t C, int64_t Hq, int64_t Hkv, int64_t block_size, float scale, const int et,
    int64_t D) {
  if (!paged_prefill_amx_supported(D)) return -2;
#ifdef __AMX_BF16__
  const int64_t g = Hq / Hkv, per = (ROWS_TARGET + g - 1) / g; /* tokens per task */
  int64_t n = 0;
  for (int64_t c = 0; c < C; ++c) n += Hkv * ((q_lens[c] + per - 1) / per);
  Task *tasks = (Task *)malloc(sizeof(Task) * (n ? n : 1));
  if (tasks == NULL) return -1;
  n = 0;
  for (int64_t c = 0; c < C; ++c) /* the later tiles of a chunk (the most keys) first, for dynamic scheduling */
    for (int64_t t0 = q_lens[c] > 0 ? (q_lens[c] - 1) / per * per : -1; t0 >= 0; t0 -= per)
      for (int64_t h = 0; h < Hkv; ++h) {
        const Task tk = {c, h, t0, q_lens[c] - t0 < per ? q_lens[c] - t0 : per};
        tasks[n++] = tk;
      }
  int failed = 0;
#pragma omp parallel
  {
    Scratch s;
    memset(&s, 0, sizeof s);
    amx_configure_16x64();
#pragma omp for schedule(dynamic, 1)
    for (int64_t i = 0; i < n; ++i) {
      const int64_t c = tasks[i].c;
      /* (D spelled as constants: the region is outlined before inlining, see paged_prefill.c) */
      const int ok = D == 64 ? run_task(&s, &tasks[i], out, out_stride, q, q_stride, kc, vc,
                                        block_tables + c * max_blocks, token_starts[c], num_computed[c], g, Hkv,
                                        block_size, scale, et, 64)
                             : run_task(&s, &tasks[i], out, out_stride, q, q_stride, kc, vc,
                                        block_tables + c * max_blocks, token_starts[c], num_computed[c], g, Hkv,
                                        block_size, scale, et, 128);
      if (!ok) {
#pragma omp atomic write
        failed = 1;
      }
    }
    _mm_sfence();
    _tile_release();
    scratch_free(&s);
  }
  free(tasks);
  return failed ? -1 : 0;
#else
  (void)out, (void)out_stride, (void)q, (void)q_stride, (void)kc, (void)vc, (void)block_tables;
  (void)max_blocks, (void)token_starts, (void)num_computed, (void)q_lens, (void)C, (void)Hq, (void)Hkv;
  (void)block_size, (void)scale, (void)et;
  return -2;
#endif
}

/* The exported entry points, over a float32 cache and a float16 one; paged_prefill.c's arguments. */
#define PREFILL_AMX_ENTRY(name, T, et)                                                                               \
  int name(float *out, int64_t out_stride, const float *q, int64_t q_stride, const T *kc, const T *vc,              \
           const int64_t *block_tables, int64_t max_blocks, const int64_t *token_starts, const int64_t *num_computed, \
           const int64_t *q_lens, int64_t C, int64_t Hq, int64_t Hkv, int64_t block_size, float scale, int64_t D) { \
    return prefill_amx_all(out, out_stride, q, q_stride, kc, vc, block_tables, max_blocks, token_starts,          \
                           num_computed, q_lens, C, Hq, Hkv, block_size, scale, et, D);                             \
  }
PREFILL_AMX_ENTRY(paged_prefill_amx_f32, float, ET_F32)
PREFILL_AMX_ENTRY(paged_prefill_amx_f16, uint16_t, ET_F16)
