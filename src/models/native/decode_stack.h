// A decode step's decoder stack in one call.
// One part of the CPU kernels (cpu_kernels.cpp includes every part, in one translation
// unit; the conventions are stated there).

#pragma once

#include <algorithm>
#include <cmath>
#include <cstdint>
#include <cstring>
#include <type_traits>
#include <vector>

#include <omp.h>

#if defined(__x86_64__) || defined(_M_X64)
#include <immintrin.h>
#endif

#include "attention.h"
#include "decoder_layer.h"
#include "elementwise.h"
#include "one_sequence.h"
#include "quantized_int8.h"
#include "quantized_matmul.h"

namespace {

// ------------------------------------------------------- a decode step's decoder stack
//
// Every decoder layer of a Llama-family model, for a batch of decode rows, in one call: the
// Python forward's ~15 kernel calls a layer become loops here, with the same kernels in the
// same order (so the numbers are those of the layer-by-layer path). A row is one query token
// with its own seq_len (keys 0..seq_len-1) and block-table row: a plain decode step has one
// row per sequence; a speculative verification step several rows of one sequence (its last
// token, then its drafts, each attending up to itself: their K/V are all written before the
// attention reads), computed as a plain decode step of `sequences` rows computes each row
// (row_mode). For fp32 models whose projections are all kept quantized or all held dense in
// column panels (kDenseBits), without biases, q/k norms or sliding windows; the caller checks
// that (legato.models.decode_stack).
// Rows of one sequence on the VNNI integer path take one parallel region instead
// (one_sequence.h); the rest run op by op, each kernel its own OpenMP region.

int decode_layers(const DecoderLayerWeights* layers, int num_layers, float* hidden,
                  float* residual, int64_t T, int H, int num_heads, int num_kv_heads,
                  int head_dim, int intermediate, const int32_t* block_table,
                  int64_t table_stride, int64_t table_cols, int64_t num_blocks, int block_size,
                  const int32_t* seq_lens, const int64_t* slots, const int64_t* positions,
                  const float* cos_sin, int64_t max_position, float eps, float scale,
                  int int8_max_rows, int num_threads, int64_t sequences) {
  const int64_t q_width = static_cast<int64_t>(num_heads) * head_dim;
  const int64_t kv_width = static_cast<int64_t>(num_kv_heads) * head_dim;
  const int64_t qkv_width = q_width + 2 * kv_width;
  if (sequences < 1 || sequences > T) return -5;
  const RowMode mode = row_mode(sequences, int8_max_rows);
#if defined(LEGATO_HAVE_X86)
  if (sequences == 1) {
    const SequenceRows rows{T, block_table, table_stride, seq_lens, slots, positions};
    const int taken = try_one_sequence(layers, num_layers, hidden, residual, H, num_heads,
                                       num_kv_heads, head_dim, intermediate, table_cols,
                                       num_blocks, block_size, rows, cos_sin, max_position, eps,
                                       scale, mode, num_threads);
    if (taken != 0) return taken == 1 ? 0 : taken;
  }
#endif
  thread_local std::vector<float> normed, qkv, attn, gate_up, act;
  normed.resize(T * H);
  qkv.resize(T * qkv_width);
  attn.resize(T * q_width);
  gate_up.resize(T * 2 * intermediate);
  act.resize(T * intermediate);
  std::memcpy(residual, hidden, sizeof(float) * T * H);  // layer 0: the residual is the input
  int code = rms_norm<float>(hidden, H, nullptr, layers[0].input_norm, normed.data(), T, H, eps,
                             num_threads);
  for (int l = 0; l < num_layers && code == 0; ++l) {
    const DecoderLayerWeights& layer = layers[l];
    if (l > 0)  // residual += hidden; normed = norm(residual)
      code = rms_norm<float>(hidden, H, residual, layer.input_norm, normed.data(), T, H, eps,
                             num_threads);
    if (code == 0)
      code = project(layer.qkv, normed.data(), T, H, qkv.data(), qkv_width, mode, num_threads);
    if (code == 0)
      code = rotary_neox<float>(qkv.data(), qkv_width, head_dim, T, num_heads + num_kv_heads,
                                head_dim, positions, cos_sin, max_position, num_threads);
    if (code == 0) {
      const char* key = reinterpret_cast<const char*>(qkv.data() + q_width);
      const char* value = reinterpret_cast<const char*>(qkv.data() + q_width + kv_width);
      code = write_kv(key, qkv_width * 4, value, qkv_width * 4,
                      reinterpret_cast<char*>(layer.key_cache),
                      reinterpret_cast<char*>(layer.value_cache), slots, T,
                      num_blocks * block_size, kv_width * 4, num_threads);
    }
    if (code == 0)
      code = decode_attention<float>(qkv.data(), qkv_width, head_dim, layer.key_cache,
                                     layer.value_cache, block_table, table_stride, table_cols,
                                     num_blocks, seq_lens, attn.data(), T, num_heads,
                                     num_kv_heads, head_dim, block_size, scale, num_threads);
    if (code == 0) code = project(layer.o, attn.data(), T, q_width, hidden, H, mode, num_threads);
    if (code == 0)
      code = rms_norm<float>(hidden, H, residual, layer.post_norm, normed.data(), T, H, eps,
                             num_threads);
    if (code == 0)
      code = project(layer.gate_up, normed.data(), T, H, gate_up.data(), 2 * intermediate,
                     mode, num_threads);
    if (code == 0)
      code = silu_and_mul<float>(gate_up.data(), 2 * intermediate, act.data(), T, intermediate,
                                 num_threads);
    if (code == 0)
      code = project(layer.down, act.data(), T, intermediate, hidden, H, mode, num_threads);
  }
  return code;
}

}  // namespace
