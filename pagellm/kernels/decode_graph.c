/* A decode step's decoder layers in one call: the CPU's answer to a captured CUDA graph.
 *
 * A decode step of a small model on a CPU spends ~4 ms in Python (module calls, argument checks,
 * tensor allocations) around ~10 kernel calls per layer; at one request that is ~40 % of the step.
 * This file holds no arithmetic of its own: it calls the same compiled kernels, with the same
 * arguments, in the same order as the Python layers do (models/decoder.py), so every output is
 * the same bits. The kernels live in their own libraries; their addresses come in `fns` (taken
 * from the loaded libraries by kernels/decode_graph.py), which also checks every pointer and size.
 *
 * Per layer (Llama's block, int8 GEMMs over GGUF blocks, all rows decodes):
 *   xn = rms_norm(x) (layer 0; x is kept as the residual) or rms_norm(x, residual += x)
 *   qkv = xn Wqkv^T (+ b); rotary on q and k in place; K/V written to their slots
 *   attn = paged decode attention of q over the cache; o = attn Wo^T (+ b)
 *   xn = rms_norm(o, residual += o); x = down(silu(gate) * up) with gate|up = xn Wgu^T (+ b)
 */
#include <stddef.h>
#include <stdint.h>

typedef int (*gemm_i8_fn)(float *y, int64_t ldy, const float *x, int64_t ldx, const void *w, const float *bias,
                          int64_t m, int64_t n, int64_t k, int64_t bits);
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

/* fns: the kernels, in this order. */
enum { FN_GEMM, FN_RMS_NORM, FN_ROTARY, FN_SILU_AND_MUL, FN_WRITE_KV, FN_DECODE, NUM_FNS };
/* dims: the model's sizes, in this order. */
enum { DIM_HIDDEN, DIM_HEADS, DIM_KV_HEADS, DIM_HEAD, DIM_INTERMEDIATE, DIM_BLOCK_SIZE, NUM_DIMS };
/* layers: one row of these per layer (pointers and bit widths as int64). */
enum {
  L_IN_NORM, L_POST_NORM,
  L_QKV_W, L_QKV_B, L_QKV_BITS, L_O_W, L_O_B, L_O_BITS,
  L_GU_W, L_GU_B, L_GU_BITS, L_DOWN_W, L_DOWN_B, L_DOWN_BITS,
  L_KEY_CACHE, L_VALUE_CACHE, NUM_LAYER_FIELDS
};

int decode_graph_num_fields(void) { return NUM_FNS * 10000 + NUM_DIMS * 100 + NUM_LAYER_FIELDS; }

/* Floats of workspace a step of t rows needs (xn, qkv, attention out, o / down out, gate|up, act). */
int64_t decode_graph_workspace(const int64_t *dims, int64_t t) {
  const int64_t h = dims[DIM_HIDDEN], d = dims[DIM_HEAD], i = dims[DIM_INTERMEDIATE];
  const int64_t qkv = (dims[DIM_HEADS] + 2 * dims[DIM_KV_HEADS]) * d;
  return t * (h + qkv + dims[DIM_HEADS] * d + h + 2 * i + i);
}

/* Runs layers [0, num_layers) over t decode rows. x [t, hidden] holds the embedded tokens and is
 * the residual stream afterwards; the last layer's MLP output is left at *out_x (inside ws).
 * cos / sin [t, head]; slots [t]; block_tables [t, max_blocks]; seq_lens [t]. Returns 0, or the
 * failing kernel's status (a GEMM or the attention could not allocate its scratch). */
int decode_graph_run(const int64_t *fns, const int64_t *dims, const int64_t *layers, int64_t num_layers, float eps,
                     float scale, float *x, float *ws, const float *cos, const float *sin, const int64_t *slots,
                     const int64_t *block_tables, int64_t max_blocks, const int64_t *seq_lens, int64_t t,
                     int64_t *out_x_offset) {
  const gemm_i8_fn gemm = (gemm_i8_fn)(intptr_t)fns[FN_GEMM];
  const rms_norm_fn rms_norm = (rms_norm_fn)(intptr_t)fns[FN_RMS_NORM];
  const rotary_fn rotary = (rotary_fn)(intptr_t)fns[FN_ROTARY];
  const silu_and_mul_fn silu_and_mul = (silu_and_mul_fn)(intptr_t)fns[FN_SILU_AND_MUL];
  const write_kv_fn write_kv = (write_kv_fn)(intptr_t)fns[FN_WRITE_KV];
  const decode_fn decode = (decode_fn)(intptr_t)fns[FN_DECODE];
  const int64_t h = dims[DIM_HIDDEN], hq = dims[DIM_HEADS], hkv = dims[DIM_KV_HEADS], d = dims[DIM_HEAD];
  const int64_t inter = dims[DIM_INTERMEDIATE], bs = dims[DIM_BLOCK_SIZE];
  const int64_t nqkv = (hq + 2 * hkv) * d;
  float *xn = ws, *qkv = xn + t * h, *attn = qkv + t * nqkv, *o = attn + t * hq * d, *gu = o + t * h,
        *act = gu + t * 2 * inter;
  float *residual = x;
  for (int64_t l = 0; l < num_layers; ++l) {
    const int64_t *L = layers + l * NUM_LAYER_FIELDS;
#define P(field) ((void *)(intptr_t)L[field])
    if (l == 0)
      rms_norm(x, h, NULL, P(L_IN_NORM), xn, t, h, eps);
    else
      rms_norm(o, h, residual, P(L_IN_NORM), xn, t, h, eps); /* o holds the last layer's MLP output */
    int status = gemm(qkv, nqkv, xn, h, P(L_QKV_W), P(L_QKV_B), t, nqkv, h, L[L_QKV_BITS]);
    if (status) return status;
    rotary(qkv, nqkv, cos, sin, t, hq + hkv, d); /* k's heads follow q's in every row */
    write_kv(qkv + hq * d, nqkv, qkv + (hq + hkv) * d, nqkv, P(L_KEY_CACHE), P(L_VALUE_CACHE), slots, t, hkv, d);
    status = decode(attn, qkv, nqkv, P(L_KEY_CACHE), P(L_VALUE_CACHE), block_tables, seq_lens, t, hq, hkv, d, bs,
                    max_blocks, scale);
    if (status) return status;
    status = gemm(o, h, attn, hq * d, P(L_O_W), P(L_O_B), t, h, hq * d, L[L_O_BITS]);
    if (status) return status;
    rms_norm(o, h, residual, P(L_POST_NORM), xn, t, h, eps);
    status = gemm(gu, 2 * inter, xn, h, P(L_GU_W), P(L_GU_B), t, 2 * inter, h, L[L_GU_BITS]);
    if (status) return status;
    silu_and_mul(gu, act, t, inter);
    status = gemm(o, h, act, inter, P(L_DOWN_W), P(L_DOWN_B), t, h, inter, L[L_DOWN_BITS]);
    if (status) return status;
#undef P
  }
  *out_x_offset = o - ws;
  return 0;
}
