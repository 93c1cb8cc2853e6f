/* A decode step's decoder layers in one call: the CPU's answer to a captured CUDA graph.
 *
 * A decode step of a small model on a CPU spends ~4 ms in Python (module calls, argument checks,
 * tensor allocations) around ~10 kernel calls per layer; at one request that is ~40 % of the step.
 * This file holds no arithmetic of its own: it calls the same compiled kernels, with the same
 * arguments, in the same order as the Python layers do (models/decoder.py), so every output is
 * the same bits. The kernels live in their own libraries; their addresses come in `fns` (taken
 * from the loaded libraries by kernels/decode_graph.py), which also checks every pointer and size.
 *
 * Per layer (all rows decodes; each projection through the GEMM Linear.matmul picks):
 *   xn = rms_norm(x) (layer 0; x is kept as the residual) or rms_norm(x, residual += x)
 *   qkv = xn Wqkv^T (+ b); [q, k = per-head rms_norm(q), rms_norm(k)]; rotary on q and k in place
 *   (the layer's table); K/V written to their slots
 *   attn = paged decode attention of q over the cache [with the layer's window and soft-cap];
 *   o = attn Wo^T (+ b)
 *   Llama: xn = rms_norm(o, residual += o)
 *   Gemma: o = rms_norm(o); xn = rms_norm(o, residual += o) (its pre-feedforward norm)
 *   x = down(act(gate) * up) with gate|up = xn Wgu^T (+ b), act SiLU or GELU (tanh)
 *   [Gemma: x = rms_norm(x), its post-feedforward norm]
 */
#include <stddef.h>
#include <stdint.h>
#include <stdlib.h>
#include <string.h>

typedef int (*gemm_i8_fn)(float *y, int64_t ldy, const float *x, int64_t ldx, const void *w, const float *bias,
                          int64_t m, int64_t n, int64_t k, int64_t bits);
typedef void (*gemm_f32_fn)(float *y, int64_t ldy, const float *x, int64_t ldx, const void *w, const float *bias,
                            int64_t m, int64_t n, int64_t k);
typedef void (*gemm_q_fn)(float *y, int64_t ldy, const float *x, int64_t ldx, const void *w, const float *bias,
                          int64_t m, int64_t n, int64_t k, int64_t bits);
typedef int (*gemm_bf16_fn)(float *y, int64_t ldy, const float *x, int64_t ldx, const void *w, const float *bias,
                            int64_t m, int64_t n, int64_t k);
typedef void (*rms_norm_fn)(const float *x, int64_t x_stride, float *residual, const float *weight, float *out,
                            int64_t t, int64_t n, float eps);
typedef void (*rotary_fn)(float *x, int64_t x_stride, const float *cos, const float *sin, int64_t t, int64_t h,
                          int64_t d);
typedef void (*silu_and_mul_fn)(const float *gate_up, float *out, int64_t t, int64_t i);
typedef void (*write_kv_fn)(const float *key, int64_t key_stride, const float *value, int64_t value_stride,
                            void *key_cache, void *value_cache, const int64_t *slots, int64_t t, int64_t hkv,
                            int64_t d);
typedef int (*decode_fn)(float *out, const float *q, int64_t q_stride, const void *kc, const void *vc,
                         const int64_t *block_tables, const int64_t *seq_lens, int64_t b, int64_t hq, int64_t hkv,
                         int64_t d, int64_t block_size, int64_t max_blocks, float scale);
typedef int (*decode_windowed_fn)(float *out, const float *q, int64_t q_stride, const void *kc, const void *vc,
                                  const int64_t *block_tables, const int64_t *seq_lens, int64_t b, int64_t hq,
                                  int64_t hkv, int64_t d, int64_t block_size, int64_t max_blocks, float scale,
                                  int64_t et, int64_t window, float softcap);
typedef void (*rms_norm_heads_fn)(const float *x, int64_t x_stride, const float *weight, float *out, int64_t t,
                                  int64_t h, int64_t n, float eps);

/* fns: the kernels, in this order (a GEMM kind no weight uses, or a kernel no layer calls, may be 0). */
enum {
  FN_GEMM_I8, FN_GEMM_F32, FN_GEMM_Q, FN_GEMM_BF16, FN_GEMM_BF16_AMX,
  FN_RMS_NORM, FN_ROTARY, FN_SILU_AND_MUL, FN_WRITE_KV, FN_DECODE,
  FN_RMS_NORM_HEADS, FN_GELU_AND_MUL, FN_DECODE_WINDOWED, NUM_FNS
};
/* dims: the model's sizes, in this order (cache_et: the cache's element type, as the attention
 * kernels number them; rope_tables: how many cos/sin tables the layers choose from). */
enum {
  DIM_HIDDEN, DIM_HEADS, DIM_KV_HEADS, DIM_HEAD, DIM_INTERMEDIATE, DIM_BLOCK_SIZE, DIM_CACHE_ET, DIM_ROPE_TABLES,
  NUM_DIMS
};
/* A projection, as Linear.matmul runs it: its kind (the GEMM it calls), packed weight, bias (0 for
 * none), bits (int8 kind), and for float32 a quantized copy read by batches of up to q_max_rows;
 * for int8, W_Q_PTR is the int64 [k] order its inputs were packed in (GPTQ act-order; 0: none). */
enum { W_KIND, W_PTR, W_BIAS, W_BITS, W_Q_PTR, W_Q_BITS, W_Q_MAX_ROWS, NUM_W_FIELDS };
enum { KIND_I8, KIND_F32, KIND_BF16, KIND_BF16_AMX };
/* layers: one row of these per layer (pointers as int64); each projection NUM_W_FIELDS wide. */
/* pre_ff_norm / post_ff_norm: Gemma's pre- and post-feedforward norms (0: a Llama block); q_norm /
 * k_norm: per-head norms (0: none); rope: the cos/sin table; window (0: none) and softcap (its float32
 * bits; 0: none) of the attention; act: 0 SiLU, 1 GELU (tanh). */
enum {
  L_IN_NORM, L_POST_NORM,
  L_QKV, L_O = L_QKV + NUM_W_FIELDS, L_GATE_UP = L_O + NUM_W_FIELDS, L_DOWN = L_GATE_UP + NUM_W_FIELDS,
  L_KEY_CACHE = L_DOWN + NUM_W_FIELDS, L_VALUE_CACHE,
  L_PRE_FF_NORM, L_POST_FF_NORM, L_Q_NORM, L_K_NORM, L_ROPE, L_WINDOW, L_SOFTCAP, L_ACT, L_KV_GROUP, NUM_LAYER_FIELDS
};

int decode_graph_num_fields(void) { return NUM_FNS * 10000 + NUM_DIMS * 100 + NUM_LAYER_FIELDS; }

#define FN(i) ((void *)(intptr_t)fns[i])

/* y [m, n] = x [m, k] W^T (+ bias) through the projection's own kernel; 0 or the kernel's status. */
static int gemm(const int64_t *fns, const int64_t *w, float *y, const float *x, int64_t m, int64_t n, int64_t k) {
  const void *wp = (const void *)(intptr_t)w[W_PTR];
  const float *bias = (const float *)(intptr_t)w[W_BIAS];
  const int64_t ldx = k; /* rows of x are contiguous, as Linear gives them */
  switch (w[W_KIND]) {
    case KIND_I8:
      if (w[W_Q_PTR]) { /* blocks packed with their inputs in this order: x gathered alike first */
        const int64_t *order = (const int64_t *)(intptr_t)w[W_Q_PTR];
        float *xo = malloc((size_t)(m * k) * sizeof *xo);
        if (!xo) return -1;
        for (int64_t r = 0; r < m; r++)
          for (int64_t i = 0; i < k; i++) xo[r * k + i] = x[r * ldx + order[i]];
        const int status = ((gemm_i8_fn)FN(FN_GEMM_I8))(y, n, xo, k, wp, bias, m, n, k, w[W_BITS]);
        free(xo);
        return status;
      }
      return ((gemm_i8_fn)FN(FN_GEMM_I8))(y, n, x, ldx, wp, bias, m, n, k, w[W_BITS]);
    case KIND_F32:
      if (w[W_Q_PTR] && m <= w[W_Q_MAX_ROWS])
        ((gemm_q_fn)FN(FN_GEMM_Q))(y, n, x, ldx, (const void *)(intptr_t)w[W_Q_PTR], bias, m, n, k, w[W_Q_BITS]);
      else
        ((gemm_f32_fn)FN(FN_GEMM_F32))(y, n, x, ldx, wp, bias, m, n, k);
      return 0;
    case KIND_BF16:
      return ((gemm_bf16_fn)FN(FN_GEMM_BF16))(y, n, x, ldx, wp, bias, m, n, k);
    case KIND_BF16_AMX:
      return ((gemm_bf16_fn)FN(FN_GEMM_BF16_AMX))(y, n, x, ldx, wp, bias, m, n, k);
  }
  return -1;
}

/* Floats of workspace a step of t rows needs (xn, qkv, attention out, o / down out, gate|up, act,
 * then the normed q and k and a second hidden-sized buffer for Gemma's extra norms). */
int64_t decode_graph_workspace(const int64_t *dims, int64_t t) {
  const int64_t h = dims[DIM_HIDDEN], d = dims[DIM_HEAD], i = dims[DIM_INTERMEDIATE];
  const int64_t qkv = (dims[DIM_HEADS] + 2 * dims[DIM_KV_HEADS]) * d;
  return t * (h + qkv + dims[DIM_HEADS] * d + h + 2 * i + i + (dims[DIM_HEADS] + dims[DIM_KV_HEADS]) * d + h);
}

static float float_bits(int64_t bits) {
  const uint32_t b = (uint32_t)bits;
  float f;
  memcpy(&f, &b, sizeof f);
  return f;
}

/* Runs layers [0, num_layers) over t decode rows. x [t, hidden] holds the embedded tokens and is
 * the residual stream afterwards; the last layer's output is left at *out_x (inside ws).
 * cos / sin [rope_tables, t, head]; slots [groups, t]; block_tables [groups][t, max_blocks] (a group's
 * table group_stride elements after the one before); seq_lens [t]. A layer writes and reads its KV cache
 * group's slots and table (L_KV_GROUP: 0 where every layer shares one). Returns 0, or the failing
 * kernel's status (a GEMM or the attention could not allocate its scratch). */
int decode_graph_run(const int64_t *fns, const int64_t *dims, const int64_t *layers, int64_t num_layers, float eps,
                     float scale, float *x, float *ws, const float *cos, const float *sin, const int64_t *slots,
                     const int64_t *block_tables, int64_t max_blocks, int64_t group_stride,
                     const int64_t *seq_lens, int64_t t, int64_t *out_x_offset) {
  const rms_norm_fn rms_norm = (rms_norm_fn)FN(FN_RMS_NORM);
  const rms_norm_heads_fn rms_norm_heads = (rms_norm_heads_fn)FN(FN_RMS_NORM_HEADS);
  const rotary_fn rotary = (rotary_fn)FN(FN_ROTARY);
  const write_kv_fn write_kv = (write_kv_fn)FN(FN_WRITE_KV);
  const decode_fn decode = (decode_fn)FN(FN_DECODE);
  const decode_windowed_fn decode_windowed = (decode_windowed_fn)FN(FN_DECODE_WINDOWED);
  const int64_t h = dims[DIM_HIDDEN], hq = dims[DIM_HEADS], hkv = dims[DIM_KV_HEADS], d = dims[DIM_HEAD];
  const int64_t inter = dims[DIM_INTERMEDIATE], bs = dims[DIM_BLOCK_SIZE], et = dims[DIM_CACHE_ET];
  const int64_t nqkv = (hq + 2 * hkv) * d;
  float *xn = ws, *qkv = xn + t * h, *attn = qkv + t * nqkv, *o = attn + t * hq * d, *gu = o + t * h,
        *act = gu + t * 2 * inter, *qn = act + t * inter, *kn = qn + t * hq * d, *o2 = kn + t * hkv * d;
  float *residual = x, *out = o; /* out: the last layer's output (o, or o2 after a post-feedforward norm) */
  for (int64_t l = 0; l < num_layers; ++l) {
    const int64_t *L = layers + l * NUM_LAYER_FIELDS;
#define P(field) ((void *)(intptr_t)L[field])
    if (l == 0)
      rms_norm(x, h, NULL, P(L_IN_NORM), xn, t, h, eps);
    else
      rms_norm(out, h, residual, P(L_IN_NORM), xn, t, h, eps);
    int status = gemm(fns, L + L_QKV, qkv, xn, t, nqkv, h);
    if (status) return status;
    const float *c = cos + L[L_ROPE] * t * d, *sn = sin + L[L_ROPE] * t * d;
    float *q = qkv, *k = qkv + hq * d;
    int64_t q_stride = nqkv, k_stride = nqkv;
    if (L[L_Q_NORM]) { /* per-head norms into contiguous copies, rotated there (as the layer does) */
      rms_norm_heads(qkv, nqkv, P(L_Q_NORM), qn, t, hq, d, eps);
      rms_norm_heads(qkv + hq * d, nqkv, P(L_K_NORM), kn, t, hkv, d, eps);
      q = qn, k = kn, q_stride = hq * d, k_stride = hkv * d;
      rotary(qn, q_stride, c, sn, t, hq, d);
      rotary(kn, k_stride, c, sn, t, hkv, d);
    } else {
      rotary(qkv, nqkv, c, sn, t, hq + hkv, d); /* k's heads follow q's in every row */
    }
    const int64_t *group_slots = slots + L[L_KV_GROUP] * t;
    const int64_t *tables = block_tables + L[L_KV_GROUP] * group_stride;
    write_kv(k, k_stride, qkv + (hq + hkv) * d, nqkv, P(L_KEY_CACHE), P(L_VALUE_CACHE), group_slots, t, hkv, d);
    const float softcap = float_bits(L[L_SOFTCAP]);
    if (L[L_WINDOW] || softcap > 0.f)
      status = decode_windowed(attn, q, q_stride, P(L_KEY_CACHE), P(L_VALUE_CACHE), tables, seq_lens, t, hq,
                               hkv, d, bs, max_blocks, scale, et, L[L_WINDOW], softcap);
    else
      status = decode(attn, q, q_stride, P(L_KEY_CACHE), P(L_VALUE_CACHE), tables, seq_lens, t, hq, hkv, d,
                      bs, max_blocks, scale);
    if (status) return status;
    status = gemm(fns, L + L_O, o, attn, t, h, hq * d);
    if (status) return status;
    if (L[L_PRE_FF_NORM]) {
      rms_norm(o, h, NULL, P(L_POST_NORM), o2, t, h, eps);
      rms_norm(o2, h, residual, P(L_PRE_FF_NORM), xn, t, h, eps);
    } else {
      rms_norm(o, h, residual, P(L_POST_NORM), xn, t, h, eps);
    }
    status = gemm(fns, L + L_GATE_UP, gu, xn, t, 2 * inter, h);
    if (status) return status;
    ((silu_and_mul_fn)FN(L[L_ACT] ? FN_GELU_AND_MUL : FN_SILU_AND_MUL))(gu, act, t, inter);
    status = gemm(fns, L + L_DOWN, o, act, t, h, inter);
    if (status) return status;
    out = o;
    if (L[L_POST_FF_NORM]) {
      rms_norm(o, h, NULL, P(L_POST_FF_NORM), o2, t, h, eps);
      out = o2;
    }
#undef P
  }
  *out_x_offset = out - ws;
  return 0;
}
