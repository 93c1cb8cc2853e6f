/* Multi-LoRA update of one projection, float32: for every run of rows that share an adapter
 * slot, y[rows] += (x[rows] At[slot]) Bt[slot], shrink and expand fused per block of 8 rows so
 * the [8, W] intermediate never leaves L1 (Punica's SGMV idea on a CPU). Built on first use by
 * pagellm/kernels/__init__.py; pagellm/lora/layers.py keeps the torch version as the oracle.
 *
 * x:     [T, in]  row stride ldx          y: [T, out] row stride ldy (updated in place)
 * segs:  [nseg, 3] int64 (start, end, slot): rows start..end-1 use slot
 * At:    [slots, in, W]                   Bt: [slots, W, out]
 * parts: [nparts, 4] int64 (col, rank, out_off, out_len): a fused projection's part p reads rank
 *        columns col.. of the intermediate and writes out_len outputs from out_off. Passing the
 *        parts skips the zero blocks of a fused Bt (2/3 of qkv's expand, 1/2 of gate_up's),
 *        which torch's one dense addmm must multiply.
 *
 * Work items are (segment, block of 8 rows), shared over the OpenMP threads. A block's tail rows
 * read the segment's last row again and write to a scratch row, so one unrolled code path serves
 * every block.
 */
#include <omp.h>
#include <stdint.h>
#include <stdlib.h>
#include <string.h>
#ifdef __AVX512F__
#include <immintrin.h>
#endif

#define R 8          /* rows per block */
#define MAX_W 256    /* widest intermediate (parts x max rank) handled here */
#define MAX_OUT 65536

int lora_max_width(void) { return MAX_W; }

#ifdef __AVX512F__
/* t[R][W] = x[R rows] At, NC 16-column chunks at a time (NC a constant when inlined). */
static inline __attribute__((always_inline)) void shrink_nc(const float *const *xr, const float *At, int64_t in,
                                                              int64_t W, int64_t c0, const int NC, float *t) {
  __m512 acc[R][4];
  for (int r = 0; r < R; ++r)
    for (int c = 0; c < NC; ++c) acc[r][c] = _mm512_setzero_ps();
  for (int64_t k = 0; k < in; ++k) {
    __m512 a[4];
    for (int c = 0; c < NC; ++c) a[c] = _mm512_loadu_ps(At + k * W + c0 + 16 * c);
    for (int r = 0; r < R; ++r) {
      const __m512 xv = _mm512_set1_ps(xr[r][k]);
      for (int c = 0; c < NC; ++c) acc[r][c] = _mm512_fmadd_ps(xv, a[c], acc[r][c]);
    }
  }
  for (int r = 0; r < R; ++r)
    for (int c = 0; c < NC; ++c) _mm512_storeu_ps(t + r * W + c0 + 16 * c, acc[r][c]);
}

static void shrink(const float *const *xr, const float *At, int64_t in, int64_t W, float *t) {
  int64_t c0 = 0;
  for (; c0 + 48 <= W; c0 += 48) shrink_nc(xr, At, in, W, c0, 3, t);
  if (W - c0 == 32) shrink_nc(xr, At, in, W, c0, 2, t);
  else if (W - c0 == 16) shrink_nc(xr, At, in, W, c0, 1, t);
}

/* y[R rows, o..o+32*CC) += t[:, col..col+rank) Bt[col.., o..]. */
static inline __attribute__((always_inline)) void expand_cc(float *const *yr, const float *t, int64_t W,
                                                              const float *Bt, int64_t out, int64_t col,
                                                              int64_t rank, int64_t o, const int CC) {
  __m512 acc[R][2];
  for (int r = 0; r < R; ++r)
    for (int c = 0; c < CC; ++c) acc[r][c] = _mm512_loadu_ps(yr[r] + o + 16 * c);
  for (int64_t j = col; j < col + rank; ++j) {
    __m512 b[2];
    for (int c = 0; c < CC; ++c) b[c] = _mm512_loadu_ps(Bt + j * out + o + 16 * c);
    for (int r = 0; r < R; ++r) {
      const __m512 tv = _mm512_set1_ps(t[r * W + j]);
      for (int c = 0; c < CC; ++c) acc[r][c] = _mm512_fmadd_ps(tv, b[c], acc[r][c]);
    }
  }
  for (int r = 0; r < R; ++r)
    for (int c = 0; c < CC; ++c) _mm512_storeu_ps(yr[r] + o + 16 * c, acc[r][c]);
}

static void expand(float *const *yr, const float *t, int64_t W, const float *Bt, int64_t out, int64_t col,
                   int64_t rank, int64_t off, int64_t len) {
  int64_t o = off;
  for (; o + 32 <= off + len; o += 32) expand_cc(yr, t, W, Bt, out, col, rank, o, 2);
  if (o < off + len) expand_cc(yr, t, W, Bt, out, col, rank, o, 1); /* len % 16 == 0 checked */
}
#endif

/* Any shape, any ISA: what the compiler makes of plain loops. */
static void shrink_plain(const float *const *xr, const float *At, int64_t in, int64_t W, float *t) {
  memset(t, 0, sizeof(float) * R * W);
  for (int r = 0; r < R; ++r)
    for (int64_t k = 0; k < in; ++k) {
      const float xv = xr[r][k];
      const float *a = At + k * W;
      float *tr = t + r * W;
      for (int64_t w = 0; w < W; ++w) tr[w] += xv * a[w];
    }
}

static void expand_plain(float *const *yr, const float *t, int64_t W, const float *Bt, int64_t out, int64_t col,
                         int64_t rank, int64_t off, int64_t len) {
  for (int r = 0; r < R; ++r)
    for (int64_t j = col; j < col + rank; ++j) {
      const float tv = t[r * W + j];
      const float *b = Bt + j * out + off;
      float *yo = yr[r] + off;
      for (int64_t o = 0; o < len; ++o) yo[o] += tv * b[o];
    }
}

/* 0 on success; -1 when the shapes are beyond this kernel (the caller then uses torch). */
int lora_add_f32(const float *x, int64_t ldx, float *y, int64_t ldy, const int64_t *segs, int64_t nseg,
                 const float *At, const float *Bt, int64_t in, int64_t W, int64_t out, const int64_t *parts,
                 int64_t nparts) {
  if (W > MAX_W || W <= 0 || out > MAX_OUT) return -1;
  int fast = 0;
#ifdef __AVX512F__
  fast = W % 16 == 0;
  for (int64_t p = 0; p < nparts; ++p) fast = fast && parts[4 * p + 3] % 16 == 0;
#endif
  /* Work items: prefix sums of each segment's blocks. */
  int64_t *first = malloc(sizeof(int64_t) * (nseg + 1));
  if (!first) return -1;
  first[0] = 0;
  for (int64_t s = 0; s < nseg; ++s) first[s + 1] = first[s] + (segs[3 * s + 1] - segs[3 * s] + R - 1) / R;
  const int64_t items = first[nseg];
#pragma omp parallel if (items > 1)
  {
    float t[R * MAX_W] __attribute__((aligned(64)));
    float *scratch = malloc(sizeof(float) * out);
    int64_t s = 0;
#pragma omp for schedule(static)
    for (int64_t it = 0; it < items; ++it) {
      while (first[s + 1] <= it) ++s;
      while (first[s] > it) --s;
      const int64_t start = segs[3 * s], end = segs[3 * s + 1], slot = segs[3 * s + 2];
      const int64_t r0 = start + (it - first[s]) * R;
      const float *xr[R];
      float *yr[R];
      for (int r = 0; r < R; ++r) {
        const int64_t row = r0 + r < end ? r0 + r : end - 1;
        xr[r] = x + row * ldx;
        yr[r] = r0 + r < end ? y + row * ldy : scratch;
      }
      const float *A = At + slot * in * W, *B = Bt + slot * W * out;
#ifdef __AVX512F__
      if (fast) {
        shrink(xr, A, in, W, t);
        for (int64_t p = 0; p < nparts; ++p)
          expand(yr, t, W, B, out, parts[4 * p], parts[4 * p + 1], parts[4 * p + 2], parts[4 * p + 3]);
        continue;
      }
#endif
      shrink_plain(xr, A, in, W, t);
      for (int64_t p = 0; p < nparts; ++p)
        expand_plain(yr, t, W, B, out, parts[4 * p], parts[4 * p + 1], parts[4 * p + 2], parts[4 * p + 3]);
    }
    free(scratch);
  }
  free(first);
  return 0;
}
