// Causal attention of a fresh prompt over its own keys (fp32, AVX-512).
// One part of the CPU kernels (cpu_kernels.cpp includes every part, in one translation
// unit; the conventions are stated there).

#pragma once

#include <algorithm>
#include <cmath>
#include <cstdint>
#include <cstring>
#include <vector>

#include <omp.h>

#if defined(__x86_64__) || defined(_M_X64)
#include <immintrin.h>
#endif

#include "common.h"
#include "dense_matmul.h"

namespace {

// ------------------------------------------------ prefill attention, a fresh prompt
//
// Query row i of a prompt of L tokens attends keys 0..i of the same prompt (no cached
// context). A work item is one kv head and kPrefillBlock query positions, times the query
// heads that share the kv head (rows (position, head), the positions in order). It computes
// the rows' scores against keys 0 .. its last position, exactly as two small matmuls:
//
// - scores = q k^T from the kv head's keys held once per call as dense_matmul.h's panels
//   (48 keys a panel: [panel][d][48], the keys past the last one zero), by its tiles of 8 rows
//   x 48 keys;
// - softmax per row over its own keys (exp_approx, as the decode kernel), the rest zeroed;
// - p v in tiles of a few rows x head_dim, from the kv head's values copied into rows (read
//   in place from the step's qkv rows instead: level at 128-256 tokens, 6-7% slower at 1024).
//
// The work is the causal half (plus the diagonal block), where torch's flash attention
// computes whole 512-key blocks: with the default model's heads (9, 3 kv, head_dim 64) a
// 256-token prompt takes 0.46-0.50 ms against SDPA's 0.75-0.80, 1024 tokens 5.7 against 7.9
// (in benchmarks/prefill_step.py the 256-token prefill's attention: 20 against 32-35 ms).
// head_dim 64 or 128 only.

constexpr int kPrefillBlock = 16;  // query positions a work item takes

#if defined(__x86_64__) || defined(_M_X64)
#define LEGATO_PREFILL_AVX512 __attribute__((target("avx512f")))

// o[i][0..16 V) = sum over j < keys of p[i][j] v_j (v_j at v + j ldv), i < R.
template <int R, int V>
LEGATO_PREFILL_AVX512 void value_tile(const float* p, int64_t ldp, const float* v, int64_t ldv,
                                      int keys, float* o) {
  __m512 acc[R][V];
  for (int i = 0; i < R; ++i)
    for (int c = 0; c < V; ++c) acc[i][c] = _mm512_setzero_ps();
  for (int j = 0; j < keys; ++j) {
    __m512 row[V];
    for (int c = 0; c < V; ++c) row[c] = _mm512_loadu_ps(v + j * ldv + c * 16);
    for (int i = 0; i < R; ++i) {
      const __m512 w = _mm512_set1_ps(p[i * ldp + j]);
      for (int c = 0; c < V; ++c) acc[i][c] = _mm512_fmadd_ps(row[c], w, acc[i][c]);
    }
  }
  for (int i = 0; i < R; ++i)
    for (int c = 0; c < V; ++c) _mm512_storeu_ps(o + i * V * 16 + c * 16, acc[i][c]);
}

// `rows` rows of p times v, in tiles of R rows (then single rows).
template <int V>
LEGATO_PREFILL_AVX512 void value_rows(int rows, const float* p, int64_t ldp, const float* v,
                                      int64_t ldv, int keys, float* o) {
  constexpr int R = V == 4 ? 6 : 2;  // 24 or 16 accumulators beside V loads
  int r = 0;
  for (; r + R <= rows; r += R)
    value_tile<R, V>(p + r * ldp, ldp, v, ldv, keys, o + r * V * 16);
  for (; r < rows; ++r) value_tile<1, V>(p + r * ldp, ldp, v, ldv, keys, o + r * V * 16);
}

// row[0..valid) becomes exp(row - max) (exp_approx), row[valid..keys) zero; returns the sum.
LEGATO_PREFILL_AVX512 float softmax_numerators_row(float* row, int valid, int keys) {
  __m512 top = _mm512_set1_ps(-INFINITY);
  for (int j = 0; j < valid; j += 16) {
    const __mmask16 m = valid - j >= 16 ? __mmask16(0xFFFF) : __mmask16((1u << (valid - j)) - 1);
    top = _mm512_max_ps(top, _mm512_mask_loadu_ps(_mm512_set1_ps(-INFINITY), m, row + j));
  }
  const float high = _mm512_reduce_max_ps(top);
  float total = 0.f;
#pragma omp simd reduction(+ : total) simdlen(16)
  for (int j = 0; j < valid; ++j) {
    row[j] = exp_approx(row[j] - high);
    total += row[j];
  }
  std::fill(row + valid, row + keys, 0.f);
  return total;
}

// One work item: positions i0 .. i1 - 1 against one kv head (its key panels kt, kPanel keys
// and panel_stride floats each; its values v, a row every kv_tok floats). qb: the rows' queries, scaled ([rows][head_dim], rows (position,
// head) in order); s: [rows][lds] scratch; o: [rows][head_dim] out, unnormalised, with each
// row's softmax total in totals.
void prefill_item(const float* kt, int64_t panel_stride, const float* v, int64_t kv_tok,
                  int group, int head_dim, int i0, int i1, const float* qb, float* s,
                  int64_t lds, float* o, float* totals) {
  const int rows = (i1 - i0) * group, keys = i1;
  const int panels = (keys + kPanel - 1) / kPanel;
  for (int r = 0; r < rows; r += kTileRows) {  // dense tiles: no bias, no prefetch
    const DenseTile tile = dense_tiles_avx512[0][std::min(kTileRows, rows - r)];
    for (int p = 0; p < panels; ++p)
      tile(qb + r * head_dim, head_dim, kt + p * panel_stride, head_dim, s + r * lds + p * kPanel,
           lds, nullptr, kPanel, true, nullptr);
  }
  for (int r = 0; r < rows; ++r)  // row r: position i0 + r / group sees keys 0 .. that
    totals[r] = softmax_numerators_row(s + r * lds, i0 + r / group + 1, keys);
  if (head_dim == 64) value_rows<4>(rows, s, lds, v, kv_tok, keys, o);
  else value_rows<8>(rows, s, lds, v, kv_tok, keys, o);
}
#endif

// Whether prefill_attention runs here (1: AVX-512) or refuses every call (0).
int prefill_attention_path() {
#if defined(__x86_64__) || defined(_M_X64)
  return cpu_has_avx512f() ? 1 : 0;
#else
  return 0;
#endif
}

// Causal attention of one fresh prompt of L tokens: out[i, h] = softmax over j <= i of
// (scale q[i, h] . k[j, h / group]) v[j, h / group].
// query [L, H, D] with strides (q_tok, q_head, 1); key and value [L, Hkv, D] with strides
// (k_tok, k_head, 1) and (v_tok, v_head, 1); out [L, H, D] contiguous. Returns 0; -1 for sizes it does not take
// (D not 64 or 128, H not a multiple of Hkv), -4 where the CPU has no AVX-512.
int prefill_attention(const float* query, int64_t q_tok, int64_t q_head, const float* key,
                      int64_t k_tok, int64_t k_head, const float* value, int64_t v_tok,
                      int64_t v_head, int64_t L,
                      int num_heads, int num_kv_heads, int head_dim, float scale, float* out,
                      int num_threads) {
  if (L < 0 || num_kv_heads <= 0 || num_heads % num_kv_heads != 0 ||
      (head_dim != 64 && head_dim != 128) || num_threads <= 0)
    return -1;
  if (prefill_attention_path() != 1) return -4;
  if (L == 0) return 0;
#if defined(__x86_64__) || defined(_M_X64)
  const int group = num_heads / num_kv_heads;
  const int64_t padded = (L + kPanel - 1) / kPanel * kPanel;
  const int64_t panel_stride = static_cast<int64_t>(head_dim) * kPanel;
  const int64_t head_panels = padded / kPanel * panel_stride;  // floats a kv head's panels take
  static thread_local std::vector<float> kt, vt;  // grown, never shrunk: no map and unmap a call
  kt.resize(std::max(kt.size(), static_cast<size_t>(head_panels) * num_kv_heads));
  vt.resize(std::max(vt.size(), static_cast<size_t>(L) * head_dim * num_kv_heads));
  float* panels = kt.data();
  float* values = vt.data();  // [Hkv][L][D]: each head's values in a row, read by every item
  const int blocks = static_cast<int>((L + kPrefillBlock - 1) / kPrefillBlock);
#pragma omp parallel num_threads(num_threads)
  {
#pragma omp for schedule(static)
    for (int64_t item = 0; item < num_kv_heads * (padded / kPanel); ++item) {
      const int64_t g = item / (padded / kPanel), p = item % (padded / kPanel);
      float* panel = panels + g * head_panels + p * panel_stride;
      for (int j = 0; j < kPanel; ++j) {
        const int64_t t = p * kPanel + j;
        if (t >= L) {
          for (int d = 0; d < head_dim; ++d) panel[d * kPanel + j] = 0.f;
          continue;
        }
        const float* k = key + t * k_tok + g * k_head;
        for (int d = 0; d < head_dim; ++d) panel[d * kPanel + j] = k[d];
        std::memcpy(values + (g * L + t) * head_dim, value + t * v_tok + g * v_head,
                    sizeof(float) * head_dim);
      }
    }
    const int64_t rows = static_cast<int64_t>(kPrefillBlock) * group;
    static thread_local std::vector<float> qb, s, o, totals;  // grown, never shrunk
    qb.resize(std::max<size_t>(qb.size(), rows * head_dim));
    s.resize(std::max<size_t>(s.size(), rows * padded));
    o.resize(std::max<size_t>(o.size(), rows * head_dim));
    totals.resize(std::max<size_t>(totals.size(), rows));
    // Later blocks carry more keys: the last first, so the dynamic schedule ends level.
#pragma omp for schedule(dynamic, 1)
    for (int64_t item = 0; item < static_cast<int64_t>(num_kv_heads) * blocks; ++item) {
      const int g = static_cast<int>(item % num_kv_heads);
      const int b = blocks - 1 - static_cast<int>(item / num_kv_heads);
      const int i0 = b * kPrefillBlock, i1 = static_cast<int>(std::min<int64_t>(L, i0 + kPrefillBlock));
      for (int i = i0; i < i1; ++i)
        for (int hh = 0; hh < group; ++hh) {
          const float* src = query + i * q_tok + (g * group + hh) * q_head;
          float* dst = qb.data() + ((i - i0) * group + hh) * head_dim;
          for (int d = 0; d < head_dim; ++d) dst[d] = src[d] * scale;
        }
      prefill_item(panels + g * head_panels, panel_stride, values + g * L * head_dim, head_dim,
                   group, head_dim, i0, i1, qb.data(), s.data(), padded, o.data(), totals.data());
      for (int i = i0; i < i1; ++i)
        for (int hh = 0; hh < group; ++hh) {
          const int r = (i - i0) * group + hh;
          const float inv = 1.f / totals[r];
          float* dst = out + (i * static_cast<int64_t>(num_heads) + g * group + hh) * head_dim;
          for (int d = 0; d < head_dim; ++d) dst[d] = o[r * head_dim + d] * inv;
        }
    }
  }
#endif
  return 0;
}

}  // namespace
