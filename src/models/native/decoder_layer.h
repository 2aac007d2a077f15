// A decoder layer's weights as the native stack reads them (quantized, or dense fp32 in
// column panels), and how a step's rows go through one projection.
// One part of the CPU kernels (cpu_kernels.cpp includes every part, in one translation
// unit; the conventions are stated there).

#pragma once

#include <cstdint>

#include "dense_matmul.h"
#include "quantized_int8.h"
#include "quantized_matmul.h"

namespace {

struct QuantPart {  // one row block of a quantized projection (QuantizedWeight), or dense
  const uint8_t* codes;  // kDenseBits: fp32 column panels (dense_matmul.h), no bias
  const float* scales;
  const float* offsets;  // null: none
  int64_t rows;
  int32_t bits;
  int32_t group;
};

constexpr int32_t kDenseBits = 32;  // a part of dense fp32 weights in column panels

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

// y[T, N] = x[T, K] @ W^T over the projection's row blocks (each writes its columns). A
// dense part computes every row alike whatever the mode (dense_matmul's rows are independent).
int project(const QuantProjection& w, const float* x, int64_t T, int64_t K, float* y, int64_t N,
            RowMode mode, int num_threads) {
  int64_t column = 0;
  for (int p = 0; p < w.num_parts; ++p) {
    const QuantPart& part = w.parts[p];
    int code = 0;
    if (part.bits == kDenseBits) {
      code = dense_matmul(x, K, T, K, reinterpret_cast<const float*>(part.codes), part.rows,
                          nullptr, y + column, N, num_threads);
    } else if (mode == RowMode::kInteger) {
      code = quantized_matmul_int8(x, K, T, K, part.codes, part.bits, part.group, part.rows,
                                   part.scales, part.offsets, y + column, N, num_threads);
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

}  // namespace
