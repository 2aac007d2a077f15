// Input rows as two int8 digits for the int8 quantized matmul (quantized_int8.h).
// One part of the CPU kernels (cpu_kernels.cpp includes every part, in one translation
// unit; the conventions are stated there).

#pragma once

#include <cmath>
#include <cstdint>
#include <cstring>
#include <new>
#include <vector>

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

// round half to even by the 1.5 * 2^23 trick (|v| <= 2^22), in plain arithmetic (vectorises)
inline int32_t round_to_int(float v) {
  const float shifted = v + 12582912.0f;
  int32_t bits;
  std::memcpy(&bits, &shifted, sizeof(bits));
  return bits - 0x4B400000;
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
  for (int64_t m = 0; m < M; ++m) {
    const float* row = x + m * ldx;
    for (int64_t b = 0; b < K / 32; ++b) {
      const float* v = row + b * 32;
      float amax = 0.0f;
#pragma omp simd reduction(max : amax)
      for (int j = 0; j < 32; ++j) amax = std::max(amax, std::fabs(v[j]));
      const float inv = amax > 0.0f ? 127.0f / amax : 0.0f;
      const float d = amax / 127.0f / 256.0f;
      int32_t high[32], low[32];
#pragma omp simd
      for (int j = 0; j < 32; ++j) {
        const float y = v[j] * inv;
        high[j] = round_to_int(y);
        low[j] = std::min(127, std::max(-127, round_to_int((y - static_cast<float>(high[j])) * 256.0f)));
      }
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
