// Input rows as two int8 digits for the int8 quantized matmul (quantized_int8.h).
// One part of the CPU kernels (cpu_kernels.cpp includes every part, in one translation
// unit; the conventions are stated there).

#pragma once

#include <cmath>
#include <cstdint>
#include <cstring>
#include <new>
#include <vector>

#if defined(__x86_64__) || defined(_M_X64)
#include <immintrin.h>
#endif

#include "common.h"

namespace {

// ------------------------------------------------ activations as two int8 digits
//
// The int8 path holds its activations as two int8 digits. Each input row is quantized per
// block of 32 values: with y = x * 127 / max|x|, the high digit q = round(y) (ggml's q8_0
// code) and the low digit r = round(256 * (y - q)) (clamped to +-127), so
// x = d * (256 q + r) with d = max|x| / (127 * 256), within d / 2 (about 1 / 65000 of the
// block's largest value). One int8 digit alone (llama.cpp's q8_0 activations) lost 6%
// teacher-forced top-1 agreement on the default model: the normed hidden states have
// outlier channels that coarsen whole blocks.

// A std::vector allocator that aligns to a cache line (64 bytes): the VNNI tiles read the
// codes in 64-byte loads, which cost two when they straddle two lines.
template <typename T>
struct CacheLineAllocator {
  using value_type = T;
  CacheLineAllocator() = default;
  template <typename U>
  CacheLineAllocator(const CacheLineAllocator<U>&) {}
  T* allocate(std::size_t n) {
    return static_cast<T*>(::operator new(n * sizeof(T), std::align_val_t(64)));
  }
  void deallocate(T* p, std::size_t) { ::operator delete(p, std::align_val_t(64)); }
  template <typename U>
  bool operator==(const CacheLineAllocator<U>&) const { return true; }
  template <typename U>
  bool operator!=(const CacheLineAllocator<U>&) const { return false; }
};
template <typename T>
using LineVector = std::vector<T, CacheLineAllocator<T>>;

struct ActivationCodes {
  int64_t kp = 0;              // K rounded up to 64 (codes past K are 0)
  LineVector<int8_t> q;       // [M, kp] high digits
  LineVector<int8_t> r;       // [M, kp] low digits
  LineVector<float> d;        // [M, kp / 32] block scales (of 256 q + r)
  LineVector<float> lane_d;   // [M, kp / 4] d of the block each 4-code lane lies in
  LineVector<int32_t> bias_q; // [M, kp / 4] -128 * the sum of the lane's 4 high digits
  LineVector<int32_t> bias_r; // [M, kp / 4] -128 * the sum of the lane's 4 low digits
  LineVector<float> gsum;     // [M, K / G] exact fp32 sum of x per weight group
  // The two digits as one int16, v = 256 q + r (|v| <= 127 * 257, exact), for the VNNI tile of
  // 8-bit codes over several input rows (vpdpwssd, tile_vnni): per 4-code lane (codes 4l ..
  // 4l + 3 of the plain order) two int16s in each, v_even codes 4l and 4l + 2, v_odd codes
  // 4l + 1 and 4l + 3. Filled with the plain order when asked (int16_pairs: the caller's tile
  // has several input rows; a one-row tile reads q .. bias_r only).
  LineVector<int16_t> v_even;  // [M, kp / 2]
  LineVector<int16_t> v_odd;   // [M, kp / 2]
  // The same digits in the nibble order (filled instead of q .. bias_r when asked: the VNNI
  // tile for 4/5/6-bit codes, tile_vnni_nibbles). Per step of 128 codes (4 blocks of 32):
  // 64 "low" codes (codes 0-15 of each block, block after block), then the 64 "high" codes
  // (codes 16-31 of each block), i.e. the codes a 64-byte load of 4-bit weights holds in its
  // low and in its high nibbles.
  int64_t kn = 0;                // K rounded up to 128 (codes past K are 0)
  LineVector<int8_t> nq;        // [M, kn] high digits, nibble order
  LineVector<int8_t> nr;        // [M, kn] low digits, nibble order
  LineVector<float> nlane_d;    // [M, kn / 8] per step: d of the block each 4-code lane lies in
  LineVector<int32_t> nbias_q;  // [M, kn / 4] per step: -128 * lane sums, 16 low lanes then 16 high
  LineVector<int32_t> nbias_r;  // [M, kn / 4] the same for the low digits
};

// round(v * times) half to even by the 1.5 * 2^23 trick (|v * times| <= 2^22), the product
// and the shift in one fused multiply-add
inline int32_t round_to_int_fused(float v, float times) {
  const float shifted = std::fma(v, times, 12582912.0f);
  int32_t bits;
  std::memcpy(&bits, &shifted, sizeof(bits));
  return bits - 0x4B400000;
}

// One block of 32 values as its two digits (see above) and its scale d (of 256 q + r). The
// products and their rounding are written as fused multiply-adds: y = v * max|v| / 127 is
// never rounded on its own, q = round(y) and r = round(256 (y - q)) each round once (the
// arithmetic GCC contracted the plain expressions to before, kept whatever the compiler).
inline void block_digits_scalar(const float* v, int32_t (&high)[32], int32_t (&low)[32],
                                float& d) {
  float amax = 0.0f;
#pragma omp simd reduction(max : amax)
  for (int j = 0; j < 32; ++j) amax = std::max(amax, std::fabs(v[j]));
  const float inv = amax > 0.0f ? 127.0f / amax : 0.0f;
  d = amax / 127.0f / 256.0f;
#pragma omp simd
  for (int j = 0; j < 32; ++j) {
    high[j] = round_to_int_fused(v[j], inv);
    const float rest = std::fma(v[j], inv, -static_cast<float>(high[j]));
    low[j] = std::min(127, std::max(-127, round_to_int_fused(rest, 256.0f)));
  }
}

#if defined(__x86_64__) || defined(_M_X64)
#define LEGATO_DIGITS_AVX512 __attribute__((target("avx512f,avx512bw,avx512vl,avx512dq")))
// block_digits_scalar on AVX-512: the same operations, 16 values an instruction (the same
// digits for finite values; a NaN in a block makes both paths' digits garbage).
LEGATO_DIGITS_AVX512 inline void block_digits_avx512(const float* v, int32_t (&high)[32],
                                                     int32_t (&low)[32], float& d) {
  const __m512 v0 = _mm512_loadu_ps(v), v1 = _mm512_loadu_ps(v + 16);
  const float amax = _mm512_reduce_max_ps(_mm512_max_ps(_mm512_abs_ps(v0), _mm512_abs_ps(v1)));
  const float inv_s = amax > 0.0f ? 127.0f / amax : 0.0f;
  d = amax / 127.0f / 256.0f;
  const __m512 inv = _mm512_set1_ps(inv_s), shift = _mm512_set1_ps(12582912.0f);
  const __m512 times = _mm512_set1_ps(256.0f);
  const __m512i bias = _mm512_set1_epi32(0x4B400000);
  const __m512i lo = _mm512_set1_epi32(-127), hi = _mm512_set1_epi32(127);
  const __m512 halves[2] = {v0, v1};
  for (int h = 0; h < 2; ++h) {
    const __m512i q = _mm512_sub_epi32(_mm512_castps_si512(_mm512_fmadd_ps(halves[h], inv, shift)), bias);
    const __m512 rest = _mm512_fmsub_ps(halves[h], inv, _mm512_cvtepi32_ps(q));
    __m512i r = _mm512_sub_epi32(_mm512_castps_si512(_mm512_fmadd_ps(rest, times, shift)), bias);
    r = _mm512_min_epi32(hi, _mm512_max_epi32(lo, r));
    _mm512_storeu_si512(high + 16 * h, q);
    _mm512_storeu_si512(low + 16 * h, r);
  }
}

// -128 * the sums of each 4 consecutive digits of `digits` (16 int32: 4 lanes), into out[0..3].
LEGATO_DIGITS_AVX512 inline void lane_biases_avx512(__m512i digits, int32_t* out) {
  const __m512i pairs = _mm512_add_epi32(digits, _mm512_shuffle_epi32(digits, _MM_PERM_CDAB));
  const __m512i fours = _mm512_add_epi32(pairs, _mm512_shuffle_epi32(pairs, _MM_PERM_BADC));
  const __m512i biased = _mm512_mullo_epi32(fours, _mm512_set1_epi32(-128));
  _mm_storeu_si128(reinterpret_cast<__m128i*>(out), _mm512_castsi512_si128(
      _mm512_maskz_compress_epi32(0x1111, biased)));
}

// Block b of row m (its 32 digits in high, low; scale d) into the nibble order's arrays:
// quantize_activations' stores, 16 values an instruction.
LEGATO_DIGITS_AVX512 inline void store_nibble_block_avx512(const int32_t (&high)[32],
                                                           const int32_t (&low)[32], float d,
                                                           ActivationCodes& a, int64_t m,
                                                           int64_t b) {
  const int64_t kn = a.kn, step = m * kn + b / 4 * 128, c = b % 4;
  const int64_t lanes = m * kn / 4 + b / 4 * 32 + c * 4;  // low lanes; high ones 16 on
  for (int h = 0; h < 2; ++h) {  // codes 0-15 to the step's low half, 16-31 to its high half
    const __m512i q = _mm512_loadu_si512(high + 16 * h), r = _mm512_loadu_si512(low + 16 * h);
    _mm_storeu_si128(reinterpret_cast<__m128i*>(a.nq.data() + step + 64 * h + c * 16), _mm512_cvtepi32_epi8(q));
    _mm_storeu_si128(reinterpret_cast<__m128i*>(a.nr.data() + step + 64 * h + c * 16), _mm512_cvtepi32_epi8(r));
    lane_biases_avx512(q, a.nbias_q.data() + lanes + 16 * h);
    lane_biases_avx512(r, a.nbias_r.data() + lanes + 16 * h);
  }
  _mm_storeu_ps(a.nlane_d.data() + m * kn / 8 + b / 4 * 16 + c * 4, _mm_set1_ps(d));
}

// The same for the plain order's arrays (and the int16 pairs when `paired`).
LEGATO_DIGITS_AVX512 inline void store_plain_block_avx512(const int32_t (&high)[32],
                                                          const int32_t (&low)[32], float d,
                                                          ActivationCodes& a, int64_t m,
                                                          int64_t b, bool paired) {
  const int64_t kp = a.kp, at = m * kp + b * 32, lanes = m * kp / 4 + b * 8;
  a.d[m * kp / 32 + b] = d;
  _mm256_storeu_ps(a.lane_d.data() + lanes, _mm256_set1_ps(d));
  for (int h = 0; h < 2; ++h) {
    const __m512i q = _mm512_loadu_si512(high + 16 * h), r = _mm512_loadu_si512(low + 16 * h);
    _mm_storeu_si128(reinterpret_cast<__m128i*>(a.q.data() + at + 16 * h), _mm512_cvtepi32_epi8(q));
    _mm_storeu_si128(reinterpret_cast<__m128i*>(a.r.data() + at + 16 * h), _mm512_cvtepi32_epi8(r));
    lane_biases_avx512(q, a.bias_q.data() + lanes + 4 * h);
    lane_biases_avx512(r, a.bias_r.data() + lanes + 4 * h);
    if (paired) {  // a lane's codes 0 and 2 to v_even, 1 and 3 to v_odd (8 of each a half)
      const __m512i v = _mm512_add_epi32(_mm512_slli_epi32(q, 8), r);
      const int64_t pairs_at = m * kp / 2 + (b * 32 + 16 * h) / 2;
      _mm_storeu_si128(reinterpret_cast<__m128i*>(a.v_even.data() + pairs_at),
                       _mm256_castsi256_si128(_mm512_cvtepi32_epi16(_mm512_maskz_compress_epi32(0x5555, v))));
      _mm_storeu_si128(reinterpret_cast<__m128i*>(a.v_odd.data() + pairs_at),
                       _mm256_castsi256_si128(_mm512_cvtepi32_epi16(_mm512_maskz_compress_epi32(0xAAAA, v))));
    }
  }
}

inline bool digits_avx512_available() {
  static const bool available = __builtin_cpu_supports("avx512f") &&
                                __builtin_cpu_supports("avx512bw") &&
                                __builtin_cpu_supports("avx512vl") &&
                                __builtin_cpu_supports("avx512dq");
  return available;
}
#endif

int digits_path = -1;  // activation_digits_path: -1 the best this CPU runs, 0 scalar, 1 AVX-512

// Which digits quantize_activations computes: request 0 the scalar one, 1 AVX-512 where the
// CPU has it, < 0 only reads. Returns the one in use (1 AVX-512, 0 scalar).
int activation_digits_path(int request) {
#if defined(__x86_64__) || defined(_M_X64)
  const int best = digits_avx512_available() ? 1 : 0;
#else
  const int best = 0;
#endif
  return choose_path(digits_path, request, best);
}

// Every row's two digits (see above), in the plain order (q .. bias_r, and with int16_pairs
// v_even, v_odd) or, with nibble_order, in the nibble order (nq .. nbias_r); gsum either way.
void quantize_activations(const float* x, int64_t ldx, int64_t M, int64_t K, int G,
                          ActivationCodes& a, bool nibble_order, bool int16_pairs) {
  const int64_t kp = (K + 63) / 64 * 64, kn = (K + 127) / 128 * 128;
  a.kp = kp;
  a.kn = kn;
  const int64_t plain = nibble_order ? 0 : M, nibbled = nibble_order ? M : 0;
  a.q.assign(plain * kp, 0);
  a.r.assign(plain * kp, 0);
  a.d.assign(plain * kp / 32, 0.0f);
  a.lane_d.assign(plain * kp / 4, 0.0f);
  a.bias_q.assign(plain * kp / 4, 0);
  a.bias_r.assign(plain * kp / 4, 0);
  const int64_t paired = int16_pairs ? plain : 0;
  a.v_even.assign(paired * kp / 2, 0);
  a.v_odd.assign(paired * kp / 2, 0);
  a.nq.assign(nibbled * kn, 0);
  a.nr.assign(nibbled * kn, 0);
  a.nlane_d.assign(nibbled * kn / 8, 0.0f);
  a.nbias_q.assign(nibbled * kn / 4, 0);
  a.nbias_r.assign(nibbled * kn / 4, 0);
  a.gsum.assign(M * (K / G), 0.0f);
  [[maybe_unused]] const bool avx512 = activation_digits_path(-1) == 1;  // once a call
  for (int64_t m = 0; m < M; ++m) {
    const float* row = x + m * ldx;
    for (int64_t b = 0; b < K / 32; ++b) {
      int32_t high[32], low[32];
      float d;
#if defined(__x86_64__) || defined(_M_X64)
      if (avx512) {
        block_digits_avx512(row + b * 32, high, low, d);
        if (nibble_order) store_nibble_block_avx512(high, low, d, a, m, b);
        else store_plain_block_avx512(high, low, d, a, m, b, paired != 0);
        continue;
      }
#endif
      block_digits_scalar(row + b * 32, high, low, d);
      int32_t sum_q[8], sum_r[8];  // per 4-code lane of the block
      for (int l = 0; l < 8; ++l) {
        sum_q[l] = -128 * (high[4 * l] + high[4 * l + 1] + high[4 * l + 2] + high[4 * l + 3]);
        sum_r[l] = -128 * (low[4 * l] + low[4 * l + 1] + low[4 * l + 2] + low[4 * l + 3]);
      }
      if (nibble_order) {  // block b is block b % 4 of step b / 4
        const int64_t step = m * kn + b / 4 * 128, c = b % 4;
        for (int j = 0; j < 32; ++j) {
          const int64_t at = step + (j < 16 ? 0 : 64) + c * 16 + j % 16;
          a.nq[at] = static_cast<int8_t>(high[j]);
          a.nr[at] = static_cast<int8_t>(low[j]);
        }
        const int64_t lanes = m * kn / 4 + b / 4 * 32 + c * 4;  // low lanes; high ones 16 on
        for (int u = 0; u < 4; ++u) {
          a.nlane_d[m * kn / 8 + b / 4 * 16 + c * 4 + u] = d;
          a.nbias_q[lanes + u] = sum_q[u];
          a.nbias_r[lanes + u] = sum_r[u];
          a.nbias_q[lanes + 16 + u] = sum_q[4 + u];
          a.nbias_r[lanes + 16 + u] = sum_r[4 + u];
        }
      } else {
        a.d[m * kp / 32 + b] = d;
        for (int j = 0; j < 32; ++j) {
          a.q[m * kp + b * 32 + j] = static_cast<int8_t>(high[j]);
          a.r[m * kp + b * 32 + j] = static_cast<int8_t>(low[j]);
        }
        for (int j = 0; paired && j < 32; ++j) {
          // lane (b * 32 + j) / 4: codes 0 and 2 of a lane to v_even, 1 and 3 to v_odd
          const int64_t at = m * kp / 2 + (b * 32 + j) / 4 * 2 + (j % 4) / 2;
          (j % 2 == 0 ? a.v_even : a.v_odd)[at] = static_cast<int16_t>(256 * high[j] + low[j]);
        }
        for (int l = 0; l < 8; ++l) {
          a.lane_d[m * kp / 4 + b * 8 + l] = d;
          a.bias_q[m * kp / 4 + b * 8 + l] = sum_q[l];
          a.bias_r[m * kp / 4 + b * 8 + l] = sum_r[l];
        }
      }
    }
    for (int64_t g = 0; g < K / G; ++g) {
      float total = 0.0f;
      for (int j = 0; j < G; ++j) total += row[g * G + j];
      a.gsum[m * (K / G) + g] = total;
    }
  }
}

}  // namespace
