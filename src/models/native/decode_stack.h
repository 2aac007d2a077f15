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

#if defined(__x86_64__) || defined(_M_X64)
#include <immintrin.h>
#endif

#include "attention.h"
#include "elementwise.h"
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
// (row_mode). For fp32 models whose projections are all kept quantized, without biases,
// q/k norms or sliding windows; the caller checks that (legato.models.decode_stack).

struct QuantPart {  // one row block of a quantized projection (QuantizedWeight)
  const uint8_t* codes;
  const float* scales;
  const float* offsets;  // null: none
  int64_t rows;
  int32_t bits;
  int32_t group;
};

constexpr int kMaxParts = 4;

struct QuantProjection {
  int32_t num_parts;
  int32_t pad;
  QuantPart parts[kMaxParts];
};

struct DecoderLayerWeights {
  const float* input_norm;
  const float* post_norm;
  float* key_cache;  // [blocks, block_size, kv_heads, head_dim]
  float* value_cache;
  QuantProjection qkv, o, gate_up, down;
};

// How a step's rows go through the quantized projections. The choice depends on the number
// of sequences in the step, never on its number of rows, so that a verification step (a few
// rows a sequence: its last token, then its drafts) computes each row exactly as a plain
// decode step of as many sequences computes it: each kernel's per-row arithmetic does not
// depend on the other rows (the int8 path quantizes and sums each row alone; the fp32 tile
// forms each weight once and runs one accumulator chain per row), except the fp32 kernel's
// one-row vector form, which a one-sequence step in fp32 mode then takes row by row.
enum class RowMode { kFp32Tile = 0, kInteger = 1, kFp32RowByRow = 2 };

RowMode row_mode(int64_t sequences, int int8_max_rows) {
  if (sequences <= int8_max_rows) return RowMode::kInteger;
  return sequences == 1 ? RowMode::kFp32RowByRow : RowMode::kFp32Tile;
}

// The integer path for the few rows of a verification step (1 < T <= 3 * kMaxTileRows):
// quantized_matmul_int8 pads the last input tile to its MR rows (5 rows cost 6), so here each
// weight tile runs input tiles of 3 rows and then one of exactly the rows left (1 or 2). The
// VNNI tile's arithmetic for a (weight row, input row) pair does not depend on MR, so every
// row's result is the one-row call's, bit for bit. Other ISAs take quantized_matmul_int8.
template <int BITS, int G, bool HAS_MIN>
int verify_rows_int8(const float* x, int64_t T, int64_t K, const QuantPart& part, float* y,
                     int64_t ldy, int num_threads) {
#if defined(LEGATO_HAVE_X86)
  if (quantized_isa(-1) == kAvx512Vnni) {
    thread_local ActivationCodes scratch;
    const ActivationCodes& a = scratch;  // the calling thread's, shared by the team below
    quantize_activations(x, K, T, K, G, scratch, vnni_nibble_order<BITS>());
    constexpr int NR = 2, MR = 3;
    const int64_t N = part.rows, q_stride = K * BITS / 8, n_tiles = (N + NR - 1) / NR;
    const int64_t full = T / MR * MR, rest = T - full;
#pragma omp parallel for schedule(static) num_threads(num_threads)
    for (int64_t t = 0; t < n_tiles; ++t) {
      const int64_t n0 = t * NR, nr = std::min<int64_t>(NR, N - n0);
      for (int64_t m0 = 0; m0 < full; m0 += MR)
        vnni_tile<BITS, G, HAS_MIN, NR, MR>(a, m0, MR, K, part.codes, q_stride, part.scales,
                                            part.offsets, n0, nr, N, y, ldy);
      if (rest == 2)
        vnni_tile<BITS, G, HAS_MIN, NR, 2>(a, full, 2, K, part.codes, q_stride, part.scales,
                                           part.offsets, n0, nr, N, y, ldy);
      else if (rest == 1)
        vnni_tile<BITS, G, HAS_MIN, NR, 1>(a, full, 1, K, part.codes, q_stride, part.scales,
                                           part.offsets, n0, nr, N, y, ldy);
    }
    return 0;
  }
#endif
  return quantized_matmul_int8(x, K, T, K, part.codes, part.bits, part.group, part.rows,
                               part.scales, part.offsets, y, ldy, num_threads);
}

int project_int8(const QuantPart& part, const float* x, int64_t T, int64_t K, float* y,
                 int64_t ldy, int num_threads) {
  if (T == 1 || K % 32 != 0 || T % 3 == 0)  // nothing padded: the general call
    return quantized_matmul_int8(x, K, T, K, part.codes, part.bits, part.group, part.rows,
                                 part.scales, part.offsets, y, ldy, num_threads);
  const bool has_min = part.offsets != nullptr;
#define LEGATO_ROWS(B, G)                                                             \
  if (part.bits == B && part.group == G)                                              \
    return has_min ? verify_rows_int8<B, G, true>(x, T, K, part, y, ldy, num_threads) \
                   : verify_rows_int8<B, G, false>(x, T, K, part, y, ldy, num_threads);
  LEGATO_FOR_EACH_LAYOUT(LEGATO_ROWS)
#undef LEGATO_ROWS
  return -2;
}

// y[T, N] = x[T, K] @ W^T over the projection's row blocks (each writes its columns).
int project(const QuantProjection& w, const float* x, int64_t T, int64_t K, float* y, int64_t N,
            RowMode mode, int num_threads) {
  int64_t column = 0;
  for (int p = 0; p < w.num_parts; ++p) {
    const QuantPart& part = w.parts[p];
    int code = 0;
    if (mode == RowMode::kInteger) {
      code = project_int8(part, x, T, K, y + column, N, num_threads);
    } else if (mode == RowMode::kFp32Tile || T == 1) {
      code = quantized_matmul(x, K, T, K, part.codes, part.bits, part.group, part.rows,
                              part.scales, part.offsets, y + column, N, num_threads);
    } else {
      for (int64_t t = 0; t < T && code == 0; ++t)
        code = quantized_matmul(x + t * K, K, 1, K, part.codes, part.bits, part.group, part.rows,
                                part.scales, part.offsets, y + t * N + column, N, num_threads);
    }
    if (code != 0) return code;
    column += part.rows;
  }
  return column == N ? 0 : -4;
}

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
