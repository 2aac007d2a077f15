// Writing K/V to their cache slots, the elementwise ops of a layer, greedy argmax.
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

#include "common.h"
namespace {

// ------------------------------------------------------------------ kv write

// Copy rows of `row_bytes` from key/value (row strides in bytes) to the caches' slots
// (a slot is block * block_size + offset, i.e. a row of the flattened cache). Slots < 0
// are skipped (padding); a slot >= num_slots is refused (-2) before anything is written.
int write_kv(const char* key, int64_t key_stride, const char* value, int64_t value_stride,
             char* key_cache, char* value_cache, const int64_t* slots, int64_t num_tokens,
             int64_t num_slots, int64_t row_bytes, int num_threads) {
  for (int64_t t = 0; t < num_tokens; ++t)
    if (slots[t] >= num_slots) return -2;
#pragma omp parallel for schedule(static) num_threads(num_threads) if (num_tokens >= 64)
  for (int64_t t = 0; t < num_tokens; ++t) {
    if (slots[t] < 0) continue;
    std::memcpy(key_cache + slots[t] * row_bytes, key + t * key_stride, row_bytes);
    std::memcpy(value_cache + slots[t] * row_bytes, value + t * value_stride, row_bytes);
  }
  return 0;
}

// ------------------------------------------------------------- elementwise

// out = rms_norm(x) * weight over rows of `cols`; with `residual` (not null) first
// residual = x + residual (in place) and the sum is normalised. As torch_ops.rms_norm:
// normalised in fp32, rounded to T, then multiplied by the weight in T.
template <typename T>
int rms_norm(const T* x, int64_t x_stride, T* residual, const T* weight, T* out,
             int64_t rows, int64_t cols, float eps, int num_threads) {
  const bool fused = residual != nullptr;
#pragma omp parallel for schedule(static) num_threads(num_threads) if (rows * cols >= 16384)
  for (int64_t r = 0; r < rows; ++r) {
    const T* xr = x + r * x_stride;
    T* rr = fused ? residual + r * cols : nullptr;
    T* o = out + r * cols;
    float sum = 0.f;
    if (fused) {
#pragma omp simd reduction(+ : sum)
      for (int64_t c = 0; c < cols; ++c) {
        const float v = as_stored(to_float(xr[c]) + to_float(rr[c]), xr);
        store(v, rr + c);
        sum += v * v;
      }
    } else {
#pragma omp simd reduction(+ : sum)
      for (int64_t c = 0; c < cols; ++c) sum += to_float(xr[c]) * to_float(xr[c]);
    }
    const T* src = fused ? rr : xr;
    const float inv = 1.f / std::sqrt(sum / static_cast<float>(cols) + eps);
#pragma omp simd
    for (int64_t c = 0; c < cols; ++c)
      store(as_stored(to_float(src[c]) * inv, src) * to_float(weight[c]), o + c);
  }
  return 0;
}

// out[r, :d] = silu(x[r, :d]) * x[r, d:2d]; silu rounded to T before the product.
// Two passes per row (exp(-gate) into a scratch row, then the rest): gcc vectorises
// each far better than the fused loop.
template <typename T>
int silu_and_mul(const T* x, int64_t x_stride, T* out, int64_t rows, int64_t d,
                 int num_threads) {
#pragma omp parallel num_threads(num_threads) if (rows * d >= 16384)
  {
    std::vector<float> e(d);
#pragma omp for schedule(static)
    for (int64_t r = 0; r < rows; ++r) {
      const T* gate = x + r * x_stride;
      const T* up = gate + d;
      T* o = out + r * d;
#pragma omp simd
      for (int64_t c = 0; c < d; ++c) e[c] = exp_approx(-to_float(gate[c]));
#pragma omp simd
      for (int64_t c = 0; c < d; ++c) {
        const float g = to_float(gate[c]);
        store(as_stored(g / (1.f + e[c]), gate) * to_float(up[c]), o + c);
      }
    }
  }
  return 0;
}

// Neox rotary in place on x[t, h, :] for h < heads (strides tok_stride, head_stride, 1),
// at positions[t], from cos_sin [max_position, head_dim] fp32 (cos | sin halves). As
// torch_ops.rotate_neox: cos and sin rounded to T, x*cos rounded to T, then + rot*sin.
template <typename T>
int rotary_neox(T* x, int64_t tok_stride, int64_t head_stride, int64_t tokens, int heads,
                int head_dim, const int64_t* positions, const float* cos_sin,
                int64_t max_position, int num_threads) {
  for (int64_t t = 0; t < tokens; ++t)
    if (positions[t] < 0 || positions[t] >= max_position) return -2;
  const int half = head_dim / 2;
  const T* tag = nullptr;
#pragma omp parallel for schedule(static) num_threads(num_threads) if (tokens * heads >= 512)
  for (int64_t t = 0; t < tokens; ++t) {
    const float* cs = cos_sin + positions[t] * head_dim;
    for (int h = 0; h < heads; ++h) {
      T* v = x + t * tok_stride + h * head_stride;
#pragma omp simd
      for (int i = 0; i < half; ++i) {
        const float c = as_stored(cs[i], tag), s = as_stored(cs[half + i], tag);
        const float a = to_float(v[i]), b = to_float(v[half + i]);
        const float lo = as_stored(a * c, tag) - b * s;
        const float hi = as_stored(b * c, tag) + a * s;
        store(lo, v + i);
        store(hi, v + half + i);
      }
    }
  }
  return 0;
}

// ------------------------------------------------------------------ sampling

#if defined(__AVX512F__) && defined(__AVX512BW__) && defined(__AVX512VL__)
#define LEGATO_ARGMAX_BF16X16 1
// 16 bf16 values from p (the first `n` of them when n < 16), widened exactly; lanes past n
// hold -inf, which never wins an argmax.
inline __m512 argmax_lanes_bf16(const bf16* p, int64_t n) {
  const __mmask16 keep = n >= 16 ? __mmask16(0xFFFF) : __mmask16((1u << n) - 1);
  const __m256i bits = _mm256_maskz_loadu_epi16(keep, p);
  const __m512 wide = _mm512_castsi512_ps(_mm512_slli_epi32(_mm512_cvtepu16_epi32(bits), 16));
  return _mm512_mask_blend_ps(keep, _mm512_set1_ps(-INFINITY), wide);
}

// argmax_rows' answer for one bf16 row, read in place 16 values at a time: one pass for the
// largest value (and whether a NaN is there), one to the first lane holding it (or the NaN).
inline int64_t argmax_row_bf16x16(const bf16* row, int64_t cols) {
  __m512 top = _mm512_set1_ps(-INFINITY);
  __mmask16 nan = 0;
  for (int64_t c = 0; c < cols; c += 16) {
    const __m512 v = argmax_lanes_bf16(row + c, cols - c);
    nan |= _mm512_cmp_ps_mask(v, v, _CMP_UNORD_Q);
    top = _mm512_max_ps(top, v);
  }
  const __m512 best = _mm512_set1_ps(_mm512_reduce_max_ps(top));
  for (int64_t c = 0; c < cols; c += 16) {
    const __m512 v = argmax_lanes_bf16(row + c, cols - c);
    const __mmask16 hit =
        nan ? _mm512_cmp_ps_mask(v, v, _CMP_UNORD_Q) : _mm512_cmp_ps_mask(v, best, _CMP_EQ_OQ);
    if (hit) return c + __builtin_ctz(hit);
  }
  return 0;  // unreachable: the largest value is in some lane
}
#endif

// out[r] = the first index of the largest value of row r (a NaN counts as largest). A bf16
// row is read in place on AVX-512 (argmax_row_bf16x16), else first widened (exactly) into
// this thread's buffer: the answer is its fp32 values'. bf16 logits then need no fp32 copy
// of the whole batch to be argmaxed.
template <typename T>
int argmax_rows(const T* x, int64_t stride, int64_t rows, int64_t cols, int64_t* out,
                int num_threads) {
#pragma omp parallel for schedule(static) num_threads(num_threads) if (rows * cols >= 65536)
  for (int64_t r = 0; r < rows; ++r) {
#if defined(LEGATO_ARGMAX_BF16X16)
    if constexpr (std::is_same_v<T, bf16>) {
      out[r] = argmax_row_bf16x16(x + r * stride, cols);
      continue;
    }
#endif
    const float* row;
    if constexpr (std::is_same_v<T, float>) {
      row = x + r * stride;
    } else {
      thread_local std::vector<float> wide;
      wide.resize(cols);
      const T* in = x + r * stride;
#pragma omp simd
      for (int64_t c = 0; c < cols; ++c) wide[c] = to_float(in[c]);
      row = wide.data();
    }
    const int64_t first_nan = find_first(row, cols, [](float v) { return v != v; });
    if (first_nan < cols) {
      out[r] = first_nan;
      continue;
    }
    const float best = max_of(row, cols);
    out[r] = find_first(row, cols, [best](float v) { return v == best; });
  }
  return 0;
}

}  // namespace
