// CPU kernels for legato's torch backend: plain C++17 with OpenMP, no torch headers.
//
// Built on first use by legato/models/cpu_kernels.py (g++ -O3 -march=native -fopenmp)
// and loaded with ctypes. OpenMP binds to the libgomp that torch has already loaded
// (same soname), so these loops share torch's thread pool instead of adding a second one.
// Tensors arrive as raw pointers plus the strides the Python side checked; bf16 travels
// as uint16_t bit patterns. Every entry point returns 0, or a negative code for
// arguments it cannot take.
//
// Numerics follow the plain-torch versions in torch_ops.py (and so transformers): fp32
// math throughout, and in bf16 the same rounding points as the torch ops they replace.
//
// The kernels live in native/, one concern a file, each included here once and in order
// (one translation unit: the build compiles this file alone; cpu_kernels.py hashes every
// part into the build's name):
//   native/common.h            bf16 bits, rounding, exp, reductions, vectors of 16 floats
//   native/attention.h         decode attention over the paged KV cache
//   native/elementwise.h       K/V writes, RMS norm, SiLU-and-mul, rotary, argmax
//   native/quantized_matmul.h  weight-only quantized matmul: the code layout, fp32 activations
//   native/int8_activations.h  input rows as two int8 digits, for the int8 matmul
//   native/quantized_int8.h    the same with int8 activations (AVX-512 VNNI, AVX2, portable)
//   native/quantized_share.h   one thread's share of an int8 matmul over one sequence's rows
//   native/dense_matmul.h      dense fp32 matmul over weights held in column panels
//   native/decoder_layer.h     a decoder layer's weights (quantized or panels); one projection
//   native/one_sequence.h      one sequence's decode or verification step in one parallel region
//   native/decode_stack.h      every decoder layer of a decode step in one call
//   native/lm_head.h           a greedy one-row step's last norm, LM head and argmax in one call
//   native/prefill_attention.h causal attention of a fresh prompt over its own keys
// This file holds the C entry points only.

#include <cstdint>

#include "native/common.h"
#include "native/attention.h"
#include "native/elementwise.h"
#include "native/quantized_matmul.h"
#include "native/int8_activations.h"
#include "native/quantized_int8.h"
#include "native/quantized_share.h"
#include "native/dense_matmul.h"
#include "native/decoder_layer.h"
#include "native/one_sequence.h"
#include "native/decode_stack.h"
#include "native/lm_head.h"
#include "native/prefill_attention.h"

extern "C" {

#define LEGATO_TYPED(SUFFIX, T)                                                               \
  int legato_decode_attention_##SUFFIX(                                                       \
      const T* query, int64_t q_seq_stride, int64_t q_head_stride, const T* key_cache,        \
      const T* value_cache, const int32_t* block_table, int64_t table_stride,                 \
      int64_t table_cols, int64_t num_blocks, const int32_t* seq_lens, T* out,                \
      int64_t num_seqs, int num_heads, int num_kv_heads, int head_dim, int block_size,        \
      float scale, int num_threads) {                                                         \
    return decode_attention(query, q_seq_stride, q_head_stride, key_cache, value_cache,       \
                            block_table, table_stride, table_cols, num_blocks, seq_lens, out, \
                            num_seqs, num_heads, num_kv_heads, head_dim, block_size, scale,   \
                            num_threads);                                                     \
  }                                                                                           \
  int legato_rms_norm_##SUFFIX(const T* x, int64_t x_stride, T* residual, const T* weight,   \
                               T* out, int64_t rows, int64_t cols, float eps,                 \
                               int num_threads) {                                             \
    return rms_norm(x, x_stride, residual, weight, out, rows, cols, eps, num_threads);        \
  }                                                                                           \
  int legato_silu_and_mul_##SUFFIX(const T* x, int64_t x_stride, T* out, int64_t rows,       \
                                   int64_t d, int num_threads) {                              \
    return silu_and_mul(x, x_stride, out, rows, d, num_threads);                              \
  }                                                                                           \
  int legato_rotary_neox_##SUFFIX(T* x, int64_t tok_stride, int64_t head_stride,             \
                                  int64_t tokens, int heads, int head_dim,                    \
                                  const int64_t* positions, const float* cos_sin,             \
                                  int64_t max_position, int num_threads) {                    \
    return rotary_neox(x, tok_stride, head_stride, tokens, heads, head_dim, positions,       \
                       cos_sin, max_position, num_threads);                                   \
  }

LEGATO_TYPED(f32, float)
LEGATO_TYPED(bf16, bf16)

int legato_write_kv(const char* key, int64_t key_stride, const char* value, int64_t value_stride,
                    char* key_cache, char* value_cache, const int64_t* slots, int64_t num_tokens,
                    int64_t num_slots, int64_t row_bytes, int num_threads) {
  return write_kv(key, key_stride, value, value_stride, key_cache, value_cache, slots,
                  num_tokens, num_slots, row_bytes, num_threads);
}

int legato_argmax_f32(const float* x, int64_t stride, int64_t rows, int64_t cols, int64_t* out,
                      int num_threads) {
  return argmax_rows(x, stride, rows, cols, out, num_threads);
}

int legato_argmax_bf16(const bf16* x, int64_t stride, int64_t rows, int64_t cols, int64_t* out,
                       int num_threads) {
  return argmax_rows(x, stride, rows, cols, out, num_threads);
}

int legato_quantized_matmul_f32(const float* x, int64_t ldx, int64_t M, int64_t K,
                                const uint8_t* q, int bits, int group, int64_t N,
                                const float* scales, const float* mins, float* y, int64_t ldy,
                                int num_threads) {
  return quantized_matmul(x, ldx, M, K, q, bits, group, N, scales, mins, y, ldy, num_threads);
}

int legato_quantized_matmul_int8(const float* x, int64_t ldx, int64_t M, int64_t K,
                                 const uint8_t* q, int bits, int group, int64_t N,
                                 const float* scales, const float* mins, float* y, int64_t ldy,
                                 int num_threads) {
  return quantized_matmul_int8(x, ldx, M, K, q, bits, group, N, scales, mins, y, ldy,
                               num_threads);
}

// The int8-activation path's ISA: 2 AVX-512 VNNI, 1 AVX2, 0 portable. request >= 0 picks
// min(request, the best this CPU runs); request < 0 only reads it. Returns the path in use.
int legato_quantized_isa(int request) { return quantized_isa(request); }

// How the int8 path computes its activations' digits: 1 on AVX-512, 0 one value at a time (the
// same digits); request >= 0 picks min(request, what this CPU runs), < 0 only reads.
int legato_activation_digits_path(int request) { return activation_digits_path(request); }

// bf16 decode attention on vdpbf16ps (1) or widened to fp32 (0): request >= 0 picks
// min(request, what this CPU runs); request < 0 only reads it. Returns the choice in use.
int legato_attention_bf16_dot(int request) { return attention_bf16_dot(request); }

// Whether a decode step of one sequence runs its stack in one parallel region (1) or op by
// op (0; the same numbers, bit for bit): request >= 0 picks, request < 0 only reads.
int legato_decode_one_region(int request) { return decode_one_region(request); }

// Whether a one-sequence step of T > 1 rows in one region shares the rows' norms and
// quantization between the threads (1) or has each thread do every row (0; the same numbers,
// bit for bit): request >= 0 picks, request < 0 only reads.
int legato_decode_verify_rows(int request) { return decode_verify_rows(request); }

// The decoder stack of a decode step (decode_layers above): hidden [T, H] in (the
// embeddings) and out (the last layer's MLP output), residual [T, H] out; the T rows belong
// to `sequences` sequences (1 <= sequences <= T; -5 otherwise).
int legato_decode_layers_f32(const DecoderLayerWeights* layers, int num_layers, float* hidden,
                             float* residual, int64_t T, int H, int num_heads, int num_kv_heads,
                             int head_dim, int intermediate, const int32_t* block_table,
                             int64_t table_stride, int64_t table_cols, int64_t num_blocks,
                             int block_size, const int32_t* seq_lens, const int64_t* slots,
                             const int64_t* positions, const float* cos_sin,
                             int64_t max_position, float eps, float scale, int int8_max_rows,
                             int num_threads, int64_t sequences) {
  return decode_layers(layers, num_layers, hidden, residual, T, H, num_heads, num_kv_heads,
                       head_dim, intermediate, block_table, table_stride, table_cols, num_blocks,
                       block_size, seq_lens, slots, positions, cos_sin, max_position, eps, scale,
                       int8_max_rows, num_threads, sequences);
}

// A greedy one-row step's head (greedy_head in lm_head.h): residual[H] += hidden[H], normed[H]
// = norm(residual), logits[N] = normed @ W^T on the int8 path, *token = argmax(logits).
// Returns 1 if taken, 0 if not (nothing written: the caller runs the three ops), or -1.
int legato_greedy_head_f32(const float* hidden, float* residual, const float* norm_weight,
                           float* normed, const QuantProjection* head, int64_t H, int64_t N,
                           float eps, float* logits, int64_t* token, int num_threads) {
  return greedy_head(hidden, residual, norm_weight, normed, *head, H, N, eps, logits, token,
                     num_threads);
}

// y [M, N] = x [M, K] W^T (+ bias) with W held in column panels (dense_matmul.h).
int legato_dense_matmul_f32(const float* x, int64_t ldx, int64_t M, int64_t K,
                            const float* panels, int64_t N, const float* bias, float* y,
                            int64_t ldy, int num_threads) {
  return dense_matmul(x, ldx, M, K, panels, N, bias, y, ldy, num_threads);
}

// The dense matmul's loop: 1 AVX-512, 0 portable (the same bits); request >= 0 picks
// min(request, what this CPU runs), request < 0 only reads. Returns the one in use.
int legato_dense_matmul_path(int request) { return dense_matmul_path(request); }

// Causal attention of one fresh prompt (prefill_attention.h): query [L, H, D], key and
// value [L, Hkv, D] (token and head strides given, unit stride within a head), out [L, H, D]
// contiguous.
int legato_prefill_attention_f32(const float* query, int64_t q_tok, int64_t q_head,
                                 const float* key, int64_t k_tok, int64_t k_head,
                                 const float* value, int64_t v_tok, int64_t v_head, int64_t L,
                                 int num_heads, int num_kv_heads, int head_dim, float scale,
                                 float* out, int num_threads) {
  return prefill_attention(query, q_tok, q_head, key, k_tok, k_head, value, v_tok, v_head, L,
                           num_heads, num_kv_heads, head_dim, scale, out, num_threads);
}

// Whether legato_prefill_attention_f32 runs on this CPU (1: AVX-512) or refuses (0).
int legato_prefill_attention_path(int) { return prefill_attention_path(); }

}  // extern "C"
