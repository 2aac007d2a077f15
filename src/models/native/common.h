// Shared helpers: bf16 bits, rounding, exp, reductions, vectors of 16 floats.
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

namespace {

using bf16 = uint16_t;

inline float to_float(float x) { return x; }

inline float to_float(bf16 bits) {
  const uint32_t wide = static_cast<uint32_t>(bits) << 16;
  float out;
  std::memcpy(&out, &wide, sizeof(out));
  return out;
}

inline bf16 round_bf16(float x) {  // round to nearest even; NaN stays NaN (branch-free)
  uint32_t bits;
  std::memcpy(&bits, &x, sizeof(bits));
  const uint32_t rounded = (bits + 0x7fffu + ((bits >> 16) & 1u)) >> 16;
  const uint32_t quiet_nan = (bits >> 16) | 0x40u;
  return static_cast<bf16>((bits & 0x7fffffffu) > 0x7f800000u ? quiet_nan : rounded);
}

// A kernel family's run-time path, kept in `choice` (-1 until first asked): request >= 0 picks
// the lower of request and `best` (what this CPU runs; a test pins a lower path so), request
// < 0 only reads, the first read taking `best`. Returns the path in use.
inline int choose_path(int& choice, int request, int best) {
  if (request >= 0) choice = std::min(request, best);
  else if (choice < 0) choice = best;
  return choice;
}

#if defined(__x86_64__) || defined(_M_X64)
// Whether this CPU runs AVX-512F (the dense matmul's and the prefill attention's tiles).
inline bool cpu_has_avx512f() {
  static const bool available = __builtin_cpu_supports("avx512f");
  return available;
}
#endif

inline void store(float x, float* dst) { *dst = x; }
inline void store(float x, bf16* dst) { *dst = round_bf16(x); }

// x rounded to T and back: the value a T tensor holds after an op rounds its fp32 result.
inline float as_stored(float x, const float*) { return x; }
inline float as_stored(float x, const bf16*) { return to_float(round_bf16(x)); }

// exp(x), 2 ulp over the float range, in plain arithmetic so loops over it vectorize.
// Cephes' expf: x = n ln2 + r with |r| <= ln2/2, a degree-6 polynomial for exp(r).
inline float exp_approx(float x) {
  x = std::min(std::max(x, -87.3f), 88.3f);
  const float n = std::floor(x * 1.44269504088896341f + 0.5f);
  float r = x - n * 0.693359375f;
  r = r + n * 2.12194440e-4f;
  float p = 1.9875691500e-4f;
  p = p * r + 1.3981999507e-3f;
  p = p * r + 8.3334519073e-3f;
  p = p * r + 4.1665795894e-2f;
  p = p * r + 1.6666665459e-1f;
  p = p * r + 5.0000001201e-1f;
  p = p * r * r + r + 1.0f;
  const int32_t bits = (static_cast<int32_t>(n) + 127) << 23;
  float scale;
  std::memcpy(&scale, &bits, sizeof(scale));
  return p * scale;
}

// The largest of n floats (NaNs ignored; n >= 1), with independent accumulators so the
// loop runs at load speed rather than at the latency of one max chain.
inline float max_of(const float* x, int64_t n) {
  constexpr int kLanes = 32;
  float lanes[kLanes];
  for (int j = 0; j < kLanes; ++j) lanes[j] = x[0];
  int64_t c = 0;
  for (; c + kLanes <= n; c += kLanes) {
#pragma omp simd
    for (int j = 0; j < kLanes; ++j) lanes[j] = lanes[j] > x[c + j] ? lanes[j] : x[c + j];
  }
  float best = lanes[0];
  for (int j = 1; j < kLanes; ++j) best = best > lanes[j] ? best : lanes[j];
  for (; c < n; ++c) best = best > x[c] ? best : x[c];
  return best;
}

// The first index i < n with pred(x[i]); n if none. Chunks are tested vectorised.
template <typename Pred>
inline int64_t find_first(const float* x, int64_t n, Pred pred) {
  constexpr int kChunk = 32;
  int64_t c = 0;
  for (; c + kChunk <= n; c += kChunk) {
    int hit = 0;
#pragma omp simd reduction(| : hit)
    for (int j = 0; j < kChunk; ++j) hit |= pred(x[c + j]);
    if (hit) break;
  }
  for (; c < n; ++c)
    if (pred(x[c])) return c;
  return n;
}

template <typename T>
inline float dot(const float* q, const T* k, int n) {
  float acc = 0.f;
#pragma omp simd reduction(+ : acc)
  for (int i = 0; i < n; ++i) acc += q[i] * to_float(k[i]);
  return acc;
}

template <typename T>
inline void axpy(float a, const T* x, float* y, int n) {
#pragma omp simd
  for (int i = 0; i < n; ++i) y[i] += a * to_float(x[i]);
}

// Vectors of 16 floats (decode attention, the fp32 quantized tile) (GCC vector types: one register with
// AVX-512, split by the compiler elsewhere; the build is -march=native).
typedef float attn_f32x16 __attribute__((vector_size(64)));
typedef uint16_t attn_u16x16 __attribute__((vector_size(32)));
typedef uint32_t attn_u32x16 __attribute__((vector_size(64)));

inline attn_f32x16 attn_load(const float* p) {
  attn_f32x16 v;
  std::memcpy(&v, p, sizeof(v));
  return v;
}

inline attn_f32x16 attn_load(const bf16* p) {  // 16 bf16 widened exactly
  attn_u16x16 bits;
  std::memcpy(&bits, p, sizeof(bits));
  return reinterpret_cast<attn_f32x16>(__builtin_convertvector(bits, attn_u32x16) << 16);
}

inline attn_f32x16 attn_fma(attn_f32x16 a, attn_f32x16 b, attn_f32x16 c) {
#if defined(__AVX512F__)
  return reinterpret_cast<attn_f32x16>(_mm512_fmadd_ps(reinterpret_cast<__m512>(a),
                                                       reinterpret_cast<__m512>(b),
                                                       reinterpret_cast<__m512>(c)));
#else
  return a * b + c;
#endif
}

// Lane j of the result is the sum of the 16 lanes of v[j]: a transpose-and-add tree of 15
// shuffle pairs, instead of 16 horizontal sums.
inline attn_f32x16 lane_sums(const attn_f32x16 (&v)[16]) {
  attn_f32x16 a[8], b[4], c[2];
  for (int i = 0; i < 8; ++i)  // halves: v[i] in lanes 0..7, v[i + 8] in 8..15
    a[i] = __builtin_shufflevector(v[i], v[i + 8], 0, 1, 2, 3, 4, 5, 6, 7, 16, 17, 18, 19, 20,
                                   21, 22, 23) +
           __builtin_shufflevector(v[i], v[i + 8], 8, 9, 10, 11, 12, 13, 14, 15, 24, 25, 26, 27,
                                   28, 29, 30, 31);
  for (int i = 0; i < 4; ++i)  // quarters: v[i], v[i + 4], v[i + 8], v[i + 12]
    b[i] = __builtin_shufflevector(a[i], a[i + 4], 0, 1, 2, 3, 16, 17, 18, 19, 8, 9, 10, 11, 24,
                                   25, 26, 27) +
           __builtin_shufflevector(a[i], a[i + 4], 4, 5, 6, 7, 20, 21, 22, 23, 12, 13, 14, 15, 28,
                                   29, 30, 31);
  for (int i = 0; i < 2; ++i)  // pairs: v[i], v[i + 2], v[i + 4], ..., v[i + 14]
    c[i] = __builtin_shufflevector(b[i], b[i + 2], 0, 1, 16, 17, 4, 5, 20, 21, 8, 9, 24, 25, 12,
                                   13, 28, 29) +
           __builtin_shufflevector(b[i], b[i + 2], 2, 3, 18, 19, 6, 7, 22, 23, 10, 11, 26, 27, 14,
                                   15, 30, 31);
  return __builtin_shufflevector(c[0], c[1], 0, 16, 2, 18, 4, 20, 6, 22, 8, 24, 10, 26, 12, 28,
                                 14, 30) +
         __builtin_shufflevector(c[0], c[1], 1, 17, 3, 19, 5, 21, 7, 23, 9, 25, 11, 27, 13, 29,
                                 15, 31);
}

}  // namespace
