// Weight-only quantized matmul with int8 activations: AVX-512 VNNI, AVX2, portable.
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
#include "int8_activations.h"
#include "quantized_matmul.h"

namespace {

// ------------------------------------------------ quantized matmul, int8 activations
//
// The fast path: integer dot products as llama.cpp computes them, with activations held
// as two int8 digits (int8_activations.h). Each group's sum(w_code * (256 q + r)) is exact in
// int32; y = sum_g s_g * d * dot_g + m_g * sum(x_g) (the offset term uses the exact fp32 sum
// of x over the group).
//
// Paths, chosen at run time (quantized_isa): AVX-512 VNNI (vpdpbusd: u8 x s8 -> s32, 64
// codes an instruction), AVX2 (vpmaddubsw + vpmaddwd, 32 codes), and portable C++. Each
// ISA path is compiled with a target attribute, so one build holds all three whatever
// -march says, and __builtin_cpu_supports picks the best this CPU runs (a test can ask for
// a lower one).
//
// vpdpbusd wants unsigned weights: 8-bit codes are biased by 128 (code ^ 0x80) and the bias
// is taken back exactly by starting each lane's sum at -128 * (its 4 activation codes' sum).
// Over several input rows, 8-bit codes take vpdpwssd instead: the two digits as one int16,
// v = 256 q + r (ActivationCodes::v_even, v_odd), against the codes sign-extended to int16
// once per weight row and step (a lane's codes 0 and 2, then 1 and 3), two instructions a
// pair of rows and 64 codes instead of two vpdpbusd, a shift and an add. Each lane's int32 is
// the same exact sum of code * v over its 4 codes either way, so a row's output does not depend
// on how many rows its tile holds.
// vpmaddubsw saturates at 16 bits, so AVX2 uses |w| * sign(x, w) instead (|w| <= 128).

inline float offset_term(const float* mins, const float* gsum, int64_t groups) {
  float total = 0.0f;
#pragma omp simd reduction(+ : total)
  for (int64_t g = 0; g < groups; ++g) total += mins[g] * gsum[g];
  return total;
}

// Portable: per group an int32 dot product, then the scales.
template <int BITS, int G, bool HAS_MIN>
void rows_portable(const ActivationCodes& a, int64_t M, int64_t K, const uint8_t* q,
                   int64_t q_stride, const float* scales, const float* mins, int64_t n,
                   float* y, int64_t ldy) {
  const int64_t groups = K / G;
  const uint8_t* row = q + n * q_stride;
  for (int64_t m = 0; m < M; ++m) {
    const int8_t* xq = a.q.data() + m * a.kp;
    const int8_t* xr = a.r.data() + m * a.kp;
    const float* xd = a.d.data() + m * a.kp / 32;
    float total = 0.0f;
    for (int64_t g = 0; g < groups; ++g) {
      int32_t dot = 0;
      if constexpr (BITS == 4) {  // G == 32: one chunk of 16 bytes, code j low, j + 16 high
        const uint8_t* b = row + g * 16;
        const int8_t* xg = xq + g * 32;
        const int8_t* rg = xr + g * 32;
        for (int j = 0; j < 16; ++j)
          dot += (b[j] & 0x0F) * (256 * xg[j] + rg[j]) + (b[j] >> 4) * (256 * xg[j + 16] + rg[j + 16]);
      } else {
        for (int64_t k = g * G; k < (g + 1) * G; ++k)
          dot += code_at<BITS, HAS_MIN>(row, K, k) * (256 * xq[k] + xr[k]);
      }
      total += scales[n * groups + g] * xd[g * G / 32] * static_cast<float>(dot);
    }
    if constexpr (HAS_MIN) total += offset_term(mins + n * groups, a.gsum.data() + m * groups, groups);
    y[m * ldy + n] = total;
  }
}

#if defined(__x86_64__) || defined(_M_X64)
#define LEGATO_HAVE_X86 1
#define LEGATO_VNNI __attribute__((target("avx512f,avx512bw,avx512vl,avx512dq,avx512vnni")))
#define LEGATO_AVX2 __attribute__((target("avx2,fma")))

// Where a tile's rows lie: weight rows n0 .. n0 + NR - 1 (their codes and scales; a short
// tile repeats its first row, computed and not stored) and input rows m0 .. m0 + MR - 1 (a
// short tile repeats its first row too).
template <int NR, int MR>
struct TileRows {
  const uint8_t* rows[NR];
  const float* srow[NR];
  int64_t xm[MR];

  TileRows(const uint8_t* q, int64_t q_stride, const float* scales, int64_t groups, int64_t n0,
           int64_t nr, int64_t m0, int64_t mr) {
    for (int i = 0; i < NR; ++i) {
      const int64_t n = n0 + (i < nr ? i : 0);
      rows[i] = q + n * q_stride;
      srow[i] = scales + n * groups;
    }
    for (int j = 0; j < MR; ++j) xm[j] = m0 + (j < mr ? j : 0);
  }
};

// The lane sums of four vectors, as one vector of 4 (a transpose-and-add tree).
LEGATO_VNNI inline __m128 sums_of_4(__m512 a, __m512 b, __m512 c, __m512 d) {
  const __m512 ab = _mm512_add_ps(_mm512_unpacklo_ps(a, b), _mm512_unpackhi_ps(a, b));
  const __m512 cd = _mm512_add_ps(_mm512_unpacklo_ps(c, d), _mm512_unpackhi_ps(c, d));
  const __m512 abcd = _mm512_add_ps(
      _mm512_castpd_ps(_mm512_unpacklo_pd(_mm512_castps_pd(ab), _mm512_castps_pd(cd))),
      _mm512_castpd_ps(_mm512_unpackhi_pd(_mm512_castps_pd(ab), _mm512_castps_pd(cd))));
  const __m256 half = _mm256_add_ps(_mm512_castps512_ps256(abcd),
                                    _mm256_castpd_ps(_mm512_extractf64x4_pd(_mm512_castps_pd(abcd), 1)));
  return _mm_add_ps(_mm256_castps256_ps128(half), _mm256_extractf128_ps(half, 1));
}

// A VNNI tile's results: with offsets, sum_g m_g * sum(x_g) added into each accumulator
// (16 groups a vector, in order), then each accumulator's lanes summed, four accumulators at
// a time (sums_of_4 sums each of its four the same way whichever slot it takes, so a row's
// sum does not depend on NR or MR), and stored to y[m0 + j, n0 + i]. Every index into acc is
// a constant once the loops are unrolled, so the tile's accumulators can stay in registers.
template <int NR, int MR, bool HAS_MIN>
LEGATO_VNNI inline void finish_tile(__m512 (&acc)[NR][MR], const ActivationCodes& a,
                                    const float* mins, int64_t groups, int64_t n0, int64_t nr,
                                    int64_t m0, int64_t mr, float* y, int64_t ldy) {
  if constexpr (HAS_MIN) {
    const float* m[NR];
    const float* sums[MR];
    for (int i = 0; i < NR; ++i) m[i] = mins + (n0 + (i < nr ? i : 0)) * groups;
    for (int j = 0; j < MR; ++j) sums[j] = a.gsum.data() + (m0 + (j < mr ? j : 0)) * groups;
    for (int64_t g = 0; g < groups; g += 16) {
      const __mmask16 gmask = groups - g >= 16 ? __mmask16(0xFFFF) : __mmask16((1u << (groups - g)) - 1);
      __m512 mv[NR], sv[MR];
#pragma GCC unroll 8
      for (int i = 0; i < NR; ++i) mv[i] = _mm512_maskz_loadu_ps(gmask, m[i] + g);
#pragma GCC unroll 8
      for (int j = 0; j < MR; ++j) sv[j] = _mm512_maskz_loadu_ps(gmask, sums[j] + g);
#pragma GCC unroll 8
      for (int i = 0; i < NR; ++i)
#pragma GCC unroll 8
        for (int j = 0; j < MR; ++j) acc[i][j] = _mm512_fmadd_ps(mv[i], sv[j], acc[i][j]);
    }
  }
  constexpr int kCount = NR * MR;  // accumulator t is acc[t / MR][t % MR]
  float total[(kCount + 3) / 4 * 4];
#pragma GCC unroll 8
  for (int t = 0; t < kCount; t += 4) {
    constexpr int last = kCount - 1;
    const int t1 = std::min(t + 1, last), t2 = std::min(t + 2, last), t3 = std::min(t + 3, last);
    _mm_storeu_ps(total + t, sums_of_4(acc[t / MR][t % MR], acc[t1 / MR][t1 % MR],
                                       acc[t2 / MR][t2 % MR], acc[t3 / MR][t3 % MR]));
  }
  for (int j = 0; j < mr; ++j)
    for (int i = 0; i < nr; ++i) y[(m0 + j) * ldy + n0 + i] = total[i * MR + j];
}

// AVX-512 VNNI for 8-bit codes: 64 codes a step; lanes of 4 codes, so with G = 32 lanes 0-7 / 8-15 are the
// step's two groups, with G = 16 lanes 4g..4g+3 its four.
// How far ahead a tile prefetches. A decode step streams every weight from memory once (the
// model is larger than the L3 cache) in small matrices (K = 576 is 9 steps a row), so the
// hardware prefetcher alone left the batch-1 matmuls at about half the measured read
// bandwidth; software prefetch of rows ahead measured 1.2-1.4x faster. The distance is in
// bytes (16 KB: 28 rows of 8-bit codes at K = 576, 57 of 4-bit ones), into L2, not L1: on
// this EPYC, 16 rows ahead into L1 held a one-sequence Q8_0 stack at 7.0-7.6 ms a step,
// into L2 5.3-5.8 ms, and 16 KB ahead 4.3-4.8 ms (its LM head 1.6 -> 0.8-1.1 ms).
constexpr int64_t kPrefetchBytes = 16384;
constexpr auto kPrefetchHint = _MM_HINT_T1;

// The rows ahead a tile prefetches: kPrefetchBytes of codes (at least a tile's 4 rows).
inline int64_t prefetch_rows_ahead(int64_t q_stride) {
  return std::max<int64_t>(4, (kPrefetchBytes + q_stride - 1) / q_stride);
}

template <int BITS, int G, bool HAS_MIN, int NR, int MR>
LEGATO_VNNI void tile_vnni(const ActivationCodes& a, int64_t m0, int64_t mr, int64_t K,
                           const uint8_t* q, int64_t q_stride, const float* scales,
                           const float* mins, int64_t n0, int64_t nr, int64_t n_total, float* y,
                           int64_t ldy) {
  const int64_t groups = K / G, kp = a.kp, steps = kp / 64;
  const bool partial = (K % 64) != 0;  // the last step holds 32 codes
  constexpr int per_step = 64 / G;     // scales a step uses
  const __m512i scale_lanes = G == 32
      ? _mm512_set_epi32(1, 1, 1, 1, 1, 1, 1, 1, 0, 0, 0, 0, 0, 0, 0, 0)
      : _mm512_set_epi32(3, 3, 3, 3, 2, 2, 2, 2, 1, 1, 1, 1, 0, 0, 0, 0);
  static_assert(BITS == 8, "8-bit codes only (tile_vnni_nibbles takes the rest)");
  const __m512i flip = _mm512_set1_epi8(char(0x80));
  const int64_t ahead_rows = prefetch_rows_ahead(q_stride);
  const TileRows<NR, MR> tile(q, q_stride, scales, groups, n0, nr, m0, mr);
  const uint8_t* const(&rows)[NR] = tile.rows;
  const float* const(&srow)[NR] = tile.srow;
  const int64_t(&xm)[MR] = tile.xm;
  __m512 acc[NR][MR];
  for (int i = 0; i < NR; ++i)
    for (int j = 0; j < MR; ++j) acc[i][j] = _mm512_setzero_ps();
  for (int64_t s = 0; s < steps; ++s) {
    const bool half = partial && s == steps - 1;
    __m512 xd[MR];
    __m512i xq{}, xr{}, bq{}, br{};  // one input row: two digits and lane biases (vpdpbusd)
    __m512i v_even[MR], v_odd[MR];   // more: v = 256 q + r as int16 pairs (vpdpwssd)
    for (int j = 0; j < MR; ++j) {
      xd[j] = _mm512_loadu_ps(a.lane_d.data() + xm[j] * kp / 4 + s * 16);
      if constexpr (MR == 1) {
        xq = _mm512_loadu_si512(a.q.data() + xm[j] * kp + s * 64);
        xr = _mm512_loadu_si512(a.r.data() + xm[j] * kp + s * 64);
        bq = _mm512_loadu_si512(a.bias_q.data() + xm[j] * kp / 4 + s * 16);
        br = _mm512_loadu_si512(a.bias_r.data() + xm[j] * kp / 4 + s * 16);
      } else {
        v_even[j] = _mm512_loadu_si512(a.v_even.data() + xm[j] * kp / 2 + s * 32);
        v_odd[j] = _mm512_loadu_si512(a.v_odd.data() + xm[j] * kp / 2 + s * 32);
      }
    }
    const __mmask16 smask = half ? __mmask16((1u << (per_step / 2)) - 1) : __mmask16((1u << per_step) - 1);
    if (n0 + ahead_rows + NR <= n_total) {  // the tile ahead_rows ahead: codes, scales
      for (int i = 0; i < NR; ++i) {
        const char* ahead = reinterpret_cast<const char*>(rows[i] + ahead_rows * q_stride);
        _mm_prefetch(ahead + s * 64, kPrefetchHint);
        if (s % (64 / per_step) == 0) {
          _mm_prefetch(reinterpret_cast<const char*>(srow[i] + ahead_rows * groups + s * per_step), kPrefetchHint);
          if constexpr (HAS_MIN)
            _mm_prefetch(reinterpret_cast<const char*>(mins + (n0 + i + ahead_rows) * groups + s * per_step), kPrefetchHint);
        }
      }
    }
    const __mmask64 bmask = half ? 0xFFFFFFFFull : ~0ull;
    for (int i = 0; i < NR; ++i) {
      const __m512 ws = _mm512_permutexvar_ps(
          scale_lanes, _mm512_maskz_loadu_ps(smask, srow[i] + s * per_step));
      const __m512i codes = _mm512_maskz_loadu_epi8(bmask, rows[i] + s * 64);
      if constexpr (MR == 1) {  // codes biased by 128 (see above)
        const __m512i w = _mm512_xor_si512(codes, flip);
        const __m512i high = _mm512_slli_epi32(_mm512_dpbusd_epi32(bq, w, xq), 8);
        const __m512i dot = _mm512_dpbusd_epi32(_mm512_add_epi32(high, br), w, xr);
        acc[i][0] = _mm512_fmadd_ps(_mm512_cvtepi32_ps(dot), _mm512_mul_ps(ws, xd[0]), acc[i][0]);
      } else {  // a lane's codes 0 and 2, 1 and 3 as int16 pairs against v (see above)
        const __m512i w_even = _mm512_srai_epi16(_mm512_slli_epi16(codes, 8), 8);
        const __m512i w_odd = _mm512_srai_epi16(codes, 8);
        for (int j = 0; j < MR; ++j) {
          const __m512i dot = _mm512_dpwssd_epi32(
              _mm512_dpwssd_epi32(_mm512_setzero_si512(), w_even, v_even[j]), w_odd, v_odd[j]);
          acc[i][j] = _mm512_fmadd_ps(_mm512_cvtepi32_ps(dot), _mm512_mul_ps(ws, xd[j]), acc[i][j]);
        }
      }
    }
  }
  finish_tile<NR, MR, HAS_MIN>(acc, a, mins, groups, n0, nr, m0, mr, y, ldy);
}

// AVX-512 VNNI for 4/5/6-bit codes: 128 codes a step, one 64-byte load of low nibbles (4
// blocks of 16 bytes) split into its low-nibble and high-nibble codes without a shuffle, the
// activations being held in the same (nibble) order (ActivationCodes::nq). A lane of either
// half holds 4 codes of one block, so with G = 32 the two halves' lanes add up in int32
// before the one conversion to fp32 a step; with G = 16 (the halves are the block's two
// groups) each half is scaled alone. The high bits of 5/6-bit codes come from the step's 16
// bytes of each bit plane, reordered once (pshufb) into the two halves' 64-bit masks.
template <int BITS, int G, bool HAS_MIN, int NR, int MR>
LEGATO_VNNI void tile_vnni_nibbles(const ActivationCodes& a, int64_t m0, int64_t mr, int64_t K,
                                   const uint8_t* q, int64_t q_stride, const float* scales,
                                   const float* mins, int64_t n0, int64_t nr, int64_t n_total,
                                   float* y, int64_t ldy) {
  static_assert(BITS >= 4 && BITS <= 6 && (G == 32 || G == 16), "nibble layouts only");
  const int64_t groups = K / G, kn = a.kn, steps = kn / 128;
  const int tail_blocks = static_cast<int>((K - (steps - 1) * 128) / 32);  // 1..4, last step
  constexpr int centre = code_centre<BITS, HAS_MIN>();
  // Centred codes (code - centre) go in as their unsigned codes, 0 .. 2^BITS - 1, and each
  // lane's sum starts at -centre * (its 4 activation digits' sum): the activations' -128 *
  // sum (ActivationCodes::nbias_q, nbias_r) shifted right, exact as centre divides 128. So
  // the int32 dot is the centred one, the same as with the codes biased to code - centre +
  // 128 and a -128 * sum start (tile_vnni), without an add per row and step.
  constexpr bool biased = centre != 0;
  static_assert(!biased || (centre == 16 || centre == 32), "a centre that divides 128 (shift below)");
  constexpr int centre_shift = centre == 16 ? 3 : 2;  // -128 * sum >> shift = -centre * sum
  constexpr int per_block = 32 / G;     // scales a block uses
  const __m512i low_nibbles = _mm512_set1_epi8(0x0F);
  // lane l lies in block l / 4: its scale is the step's scale l / 4 (G = 32), or 2 (l / 4)
  // for the low half and 2 (l / 4) + 1 for the high half (G = 16)
  const __m512i block_of_lane = _mm512_set_epi32(3, 3, 3, 3, 2, 2, 2, 2, 1, 1, 1, 1, 0, 0, 0, 0);
  const __m512i low_group = _mm512_add_epi32(block_of_lane, block_of_lane);
  const __m512i high_group = _mm512_add_epi32(low_group, _mm512_set1_epi32(1));
  // bit plane bytes of a step: bytes 4b, 4b + 1 (codes 0-15 of block b) to the low mask,
  // 4b + 2, 4b + 3 to the high one
  const __m128i plane_order = _mm_setr_epi8(0, 1, 4, 5, 8, 9, 12, 13, 2, 3, 6, 7, 10, 11, 14, 15);
  const TileRows<NR, MR> tile(q, q_stride, scales, groups, n0, nr, m0, mr);
  const uint8_t* const(&rows)[NR] = tile.rows;
  const float* const(&srow)[NR] = tile.srow;
  const int64_t(&xm)[MR] = tile.xm;
  __m512 acc[NR][MR];
  for (int i = 0; i < NR; ++i)
    for (int j = 0; j < MR; ++j) acc[i][j] = _mm512_setzero_ps();
  const int64_t ahead_rows = prefetch_rows_ahead(q_stride);
  const bool prefetch = n0 + ahead_rows + NR <= n_total;
  for (int64_t s = 0; s < steps; ++s) {
    const int blocks = s == steps - 1 ? tail_blocks : 4;
    const __mmask64 bmask = blocks == 4 ? ~0ull : (1ull << (16 * blocks)) - 1;
    const __mmask16 smask = __mmask16((1u << (blocks * per_block)) - 1);
    const __mmask16 pmask = __mmask16((1u << (4 * blocks)) - 1);
    if (prefetch) {  // the tile ahead_rows ahead: nibbles, planes, scales (and offsets)
      for (int i = 0; i < NR; ++i) {
        const char* ahead = reinterpret_cast<const char*>(rows[i] + ahead_rows * q_stride);
        _mm_prefetch(ahead + s * 64, kPrefetchHint);
        if (s % 4 == 0) {  // a line holds 4 steps of a bit plane, or of 4-per-step scales
          for (int p = 0; p < BITS - 4; ++p) _mm_prefetch(ahead + K / 2 + p * (K / 8) + s * 16, kPrefetchHint);
          const int64_t n_ahead = n0 + i + ahead_rows;
          for (int h = 0; h < per_block; ++h) {
            _mm_prefetch(reinterpret_cast<const char*>(scales + n_ahead * groups + s * 4 * per_block + h * 16), kPrefetchHint);
            if constexpr (HAS_MIN)
              _mm_prefetch(reinterpret_cast<const char*>(mins + n_ahead * groups + s * 4 * per_block + h * 16), kPrefetchHint);
          }
        }
      }
    }
    __m512i lo[NR], hi[NR];
    __m512 ws_lo[NR], ws_hi[NR];
    for (int i = 0; i < NR; ++i) {
      const __m512i bytes = _mm512_maskz_loadu_epi8(bmask, rows[i] + s * 64);
      lo[i] = _mm512_and_si512(bytes, low_nibbles);
      hi[i] = _mm512_and_si512(_mm512_srli_epi16(bytes, 4), low_nibbles);
      for (int p = 0; p < BITS - 4; ++p) {  // bit plane p: one bit per code
        const __m128i plane = _mm_shuffle_epi8(
            _mm_maskz_loadu_epi8(pmask, rows[i] + K / 2 + p * (K / 8) + s * 16), plane_order);
        const __m512i add = _mm512_set1_epi8(char(16 << p));
        lo[i] = _mm512_mask_add_epi8(lo[i], static_cast<__mmask64>(_mm_cvtsi128_si64(plane)), lo[i], add);
        hi[i] = _mm512_mask_add_epi8(hi[i], static_cast<__mmask64>(_mm_extract_epi64(plane, 1)), hi[i], add);
      }
      const __m512 s_step = _mm512_maskz_loadu_ps(smask, srow[i] + s * 4 * per_block);
      if constexpr (G == 32) {
        ws_lo[i] = _mm512_permutexvar_ps(block_of_lane, s_step);
      } else {
        ws_lo[i] = _mm512_permutexvar_ps(low_group, s_step);
        ws_hi[i] = _mm512_permutexvar_ps(high_group, s_step);
      }
    }
    for (int j = 0; j < MR; ++j) {
      const int8_t* xq = a.nq.data() + xm[j] * kn + s * 128;
      const int8_t* xr = a.nr.data() + xm[j] * kn + s * 128;
      const __m512i xq_lo = _mm512_loadu_si512(xq), xq_hi = _mm512_loadu_si512(xq + 64);
      const __m512i xr_lo = _mm512_loadu_si512(xr), xr_hi = _mm512_loadu_si512(xr + 64);
      const __m512 xd = _mm512_loadu_ps(a.nlane_d.data() + xm[j] * kn / 8 + s * 16);
      const int32_t* bq = a.nbias_q.data() + xm[j] * kn / 4 + s * 32;
      const int32_t* br = a.nbias_r.data() + xm[j] * kn / 4 + s * 32;
      if constexpr (G == 32) {
        const __m512i start_q = biased ? _mm512_srai_epi32(_mm512_add_epi32(_mm512_loadu_si512(bq), _mm512_loadu_si512(bq + 16)), centre_shift)
                                       : _mm512_setzero_si512();
        const __m512i start_r = biased ? _mm512_srai_epi32(_mm512_add_epi32(_mm512_loadu_si512(br), _mm512_loadu_si512(br + 16)), centre_shift)
                                       : _mm512_setzero_si512();
        for (int i = 0; i < NR; ++i) {
          __m512i dot = _mm512_dpbusd_epi32(_mm512_dpbusd_epi32(start_q, lo[i], xq_lo), hi[i], xq_hi);
          dot = _mm512_add_epi32(_mm512_slli_epi32(dot, 8), start_r);
          dot = _mm512_dpbusd_epi32(_mm512_dpbusd_epi32(dot, lo[i], xr_lo), hi[i], xr_hi);
          acc[i][j] = _mm512_fmadd_ps(_mm512_cvtepi32_ps(dot), _mm512_mul_ps(ws_lo[i], xd), acc[i][j]);
        }
      } else {
        const __m512i zero = _mm512_setzero_si512();
        auto start = [&](const int32_t* sums) {  // -centre * the lanes' sums (see above)
          return biased ? _mm512_srai_epi32(_mm512_loadu_si512(sums), centre_shift) : zero;
        };
        const __m512i bq_lo = start(bq), bq_hi = start(bq + 16);
        const __m512i br_lo = start(br), br_hi = start(br + 16);
        for (int i = 0; i < NR; ++i) {
          __m512i dl = _mm512_add_epi32(_mm512_slli_epi32(_mm512_dpbusd_epi32(bq_lo, lo[i], xq_lo), 8), br_lo);
          __m512i dh = _mm512_add_epi32(_mm512_slli_epi32(_mm512_dpbusd_epi32(bq_hi, hi[i], xq_hi), 8), br_hi);
          dl = _mm512_dpbusd_epi32(dl, lo[i], xr_lo);
          dh = _mm512_dpbusd_epi32(dh, hi[i], xr_hi);
          acc[i][j] = _mm512_fmadd_ps(_mm512_cvtepi32_ps(dl), _mm512_mul_ps(ws_lo[i], xd), acc[i][j]);
          acc[i][j] = _mm512_fmadd_ps(_mm512_cvtepi32_ps(dh), _mm512_mul_ps(ws_hi[i], xd), acc[i][j]);
        }
      }
    }
  }
  finish_tile<NR, MR, HAS_MIN>(acc, a, mins, groups, n0, nr, m0, mr, y, ldy);
}

// The VNNI tile for a layout: 8-bit codes a byte (tile_vnni), the rest nibbles plus bit
// planes (tile_vnni_nibbles, which wants the activations in the nibble order).
template <int BITS>
constexpr bool vnni_nibble_order() { return BITS != 8; }

template <int BITS, int G, bool HAS_MIN, int NR, int MR>
void vnni_tile(const ActivationCodes& a, int64_t m0, int64_t mr, int64_t K, const uint8_t* q,
               int64_t q_stride, const float* scales, const float* mins, int64_t n0, int64_t nr,
               int64_t n_total, float* y, int64_t ldy) {
  if constexpr (vnni_nibble_order<BITS>())
    tile_vnni_nibbles<BITS, G, HAS_MIN, NR, MR>(a, m0, mr, K, q, q_stride, scales, mins, n0, nr,
                                                n_total, y, ldy);
  else
    tile_vnni<BITS, G, HAS_MIN, NR, MR>(a, m0, mr, K, q, q_stride, scales, mins, n0, nr,
                                        n_total, y, ldy);
}

// A weight tile of nr <= 2 rows (from n0) over all M input rows: input tiles of MR rows,
// then one of exactly the rows left, never a padded one (a tile of MR rows computes all MR:
// a padded tail costs whole rows of work). A (weight row, input row) pair's arithmetic does
// not depend on the tile's NR or MR, so every row is the one-row call's, bit for bit.
template <int BITS, int G, bool HAS_MIN, int MR>
void weight_pair_over_rows(const ActivationCodes& a, int64_t M, int64_t K, const uint8_t* q,
                           int64_t q_stride, const float* scales, const float* mins, int64_t n0,
                           int64_t nr, int64_t n_total, float* y, int64_t ldy) {
  static_assert(MR >= 2 && MR <= 5, "a tail of 1 .. MR - 1 rows, each a tile instance");
  auto tile = [&](auto rows_tag, int64_t m0) {
    constexpr int R = decltype(rows_tag)::value;
    vnni_tile<BITS, G, HAS_MIN, 2, R>(a, m0, R, K, q, q_stride, scales, mins, n0, nr, n_total,
                                      y, ldy);
  };
  int64_t m0 = 0;
  for (; M - m0 >= MR; m0 += MR) tile(std::integral_constant<int, MR>{}, m0);
  switch (M - m0) {
    case 4:
      if constexpr (MR > 4) tile(std::integral_constant<int, 4>{}, m0);
      break;
    case 3:
      if constexpr (MR > 3) tile(std::integral_constant<int, 3>{}, m0);
      break;
    case 2:
      if constexpr (MR > 2) tile(std::integral_constant<int, 2>{}, m0);
      break;
    case 1: tile(std::integral_constant<int, 1>{}, m0); break;
    default: break;
  }
}

// One thread's share of a one-row VNNI matmul y[N] = x[K] @ W^T: weight tiles part * n /
// parts .. (part + 1) * n / parts of the n = ceil(N / 4) four-row tiles that
// quantized_matmul_int8 runs for one input row, so each output is that call's, bit for bit
// (a's digits in the layout's order: vnni_nibble_order). For the decode stack's one
// parallel region, where each thread runs its share of every projection (T rows of one
// sequence: vnni_rows_share in quantized_share.h).
template <int BITS, int G, bool HAS_MIN>
void vnni_row_share(const ActivationCodes& a, int64_t K, const uint8_t* q, int64_t N,
                    const float* scales, const float* mins, float* y, int part, int parts) {
  const int64_t q_stride = K * BITS / 8, n_tiles = (N + 3) / 4;
  for (int64_t t = n_tiles * part / parts; t < n_tiles * (part + 1) / parts; ++t)
    vnni_tile<BITS, G, HAS_MIN, 4, 1>(a, 0, 1, K, q, q_stride, scales, mins, t * 4,
                                      std::min<int64_t>(4, N - t * 4), N, y, N);
}

LEGATO_AVX2 inline float hsum256(__m256 v) {
  __m128 s = _mm_add_ps(_mm256_castps256_ps128(v), _mm256_extractf128_ps(v, 1));
  s = _mm_add_ps(s, _mm_movehl_ps(s, s));
  s = _mm_add_ss(s, _mm_movehdup_ps(s));
  return _mm_cvtss_f32(s);
}

// AVX2: 32 codes (one activation block) a step.
template <int BITS, int G, bool HAS_MIN, int NR, int MR>
LEGATO_AVX2 void tile_avx2(const ActivationCodes& a, int64_t m0, int64_t mr, int64_t K,
                           const uint8_t* q, int64_t q_stride, const float* scales,
                           const float* mins, int64_t n0, int64_t nr, float* y, int64_t ldy) {
  const int64_t groups = K / G, kp = a.kp;
  const __m256i ones = _mm256_set1_epi16(1);
  const __m128i low_nibbles = _mm_set1_epi8(0x0F);
  constexpr int centre = code_centre<BITS, HAS_MIN>();
  constexpr bool is_signed = BITS == 8 || centre != 0;  // else unsigned, below 64
  // a bit plane's 32 bits of one block to 32 bytes: byte j takes plane byte j / 8, bit j % 8
  const __m256i spread = _mm256_setr_epi8(0, 0, 0, 0, 0, 0, 0, 0, 1, 1, 1, 1, 1, 1, 1, 1,
                                          2, 2, 2, 2, 2, 2, 2, 2, 3, 3, 3, 3, 3, 3, 3, 3);
  const __m256i bit_of = _mm256_set1_epi64x(0x8040201008040201ll);
  const TileRows<NR, MR> tile(q, q_stride, scales, groups, n0, nr, m0, mr);
  const uint8_t* const(&rows)[NR] = tile.rows;
  const float* const(&srow)[NR] = tile.srow;
  const int64_t(&xm)[MR] = tile.xm;
  __m256 acc[NR][MR];
  for (int i = 0; i < NR; ++i)
    for (int j = 0; j < MR; ++j) acc[i][j] = _mm256_setzero_ps();
  for (int64_t b = 0; b < K / 32; ++b) {
    __m256i xq[MR], xr[MR];
    __m256 xd[MR];
    for (int j = 0; j < MR; ++j) {
      xq[j] = _mm256_loadu_si256(reinterpret_cast<const __m256i*>(a.q.data() + xm[j] * kp + b * 32));
      xr[j] = _mm256_loadu_si256(reinterpret_cast<const __m256i*>(a.r.data() + xm[j] * kp + b * 32));
      xd[j] = _mm256_set1_ps(a.d[xm[j] * kp / 32 + b]);
    }
    for (int i = 0; i < NR; ++i) {
      __m256i w;
      if constexpr (BITS != 8) {
        const __m128i bytes = _mm_loadu_si128(reinterpret_cast<const __m128i*>(rows[i] + b * 16));
        w = _mm256_set_m128i(_mm_and_si128(_mm_srli_epi16(bytes, 4), low_nibbles),
                             _mm_and_si128(bytes, low_nibbles));
        for (int p = 0; p < BITS - 4; ++p) {
          int32_t plane;
          std::memcpy(&plane, rows[i] + K / 2 + p * (K / 8) + b * 4, sizeof(plane));
          const __m256i bits = _mm256_and_si256(
              _mm256_shuffle_epi8(_mm256_set1_epi32(plane), spread), bit_of);
          const __m256i set = _mm256_cmpeq_epi8(bits, bit_of);
          w = _mm256_or_si256(w, _mm256_and_si256(set, _mm256_set1_epi8(char(16 << p))));
        }
        if constexpr (centre != 0) w = _mm256_sub_epi8(w, _mm256_set1_epi8(char(centre)));
      } else {
        w = _mm256_loadu_si256(reinterpret_cast<const __m256i*>(rows[i] + b * 32));
      }
      const __m256 ws = G == 32 ? _mm256_set1_ps(srow[i][b])
                                : _mm256_set_m128(_mm_set1_ps(srow[i][2 * b + 1]),
                                                  _mm_set1_ps(srow[i][2 * b]));
      const __m256i aw = is_signed ? _mm256_abs_epi8(w) : w;
      for (int j = 0; j < MR; ++j) {
        const __m256i sq = is_signed ? _mm256_sign_epi8(xq[j], w) : xq[j];
        const __m256i sr = is_signed ? _mm256_sign_epi8(xr[j], w) : xr[j];
        const __m256i high = _mm256_madd_epi16(_mm256_maddubs_epi16(aw, sq), ones);
        const __m256i low = _mm256_madd_epi16(_mm256_maddubs_epi16(aw, sr), ones);
        const __m256i dot = _mm256_add_epi32(_mm256_slli_epi32(high, 8), low);
        acc[i][j] = _mm256_fmadd_ps(_mm256_cvtepi32_ps(dot), _mm256_mul_ps(ws, xd[j]), acc[i][j]);
      }
    }
  }
  for (int i = 0; i < nr; ++i)
    for (int j = 0; j < mr; ++j) {
      float total = hsum256(acc[i][j]);
      if constexpr (HAS_MIN)
        total += offset_term(mins + (n0 + i) * groups, a.gsum.data() + (m0 + j) * groups, groups);
      y[(m0 + j) * ldy + n0 + i] = total;
    }
}
#endif  // x86

enum QuantizedIsa { kPortable = 0, kAvx2 = 1, kAvx512Vnni = 2 };

int best_quantized_isa() {
#if defined(LEGATO_HAVE_X86)
  __builtin_cpu_init();
  if (__builtin_cpu_supports("avx512vnni") && __builtin_cpu_supports("avx512bw") &&
      __builtin_cpu_supports("avx512vl") && __builtin_cpu_supports("avx512dq"))
    return kAvx512Vnni;
  if (__builtin_cpu_supports("avx2") && __builtin_cpu_supports("fma")) return kAvx2;
#endif
  return kPortable;
}

int chosen_isa = -1;  // set once (quantized_isa), read by every call

int quantized_isa(int request) {
  return choose_path(chosen_isa, request, best_quantized_isa());
}

// Weight tiles of NR rows over the input in tiles of MR rows (the weight tile is read from
// memory once and from L1 for the next input tile); weight tiles split over threads.
template <typename Tile, int NR, int MR>
void over_tiles(Tile tile, int64_t M, int64_t N, int num_threads) {
  const int64_t n_tiles = (N + NR - 1) / NR, m_tiles = (M + MR - 1) / MR;
#pragma omp parallel for schedule(static) num_threads(num_threads)
  for (int64_t t = 0; t < n_tiles; ++t)
    for (int64_t mt = 0; mt < m_tiles; ++mt)
      tile(mt * MR, std::min<int64_t>(MR, M - mt * MR), t * NR, std::min<int64_t>(NR, N - t * NR));
}

template <int BITS, int G, bool HAS_MIN>
int qmatmul_int8(const float* x, int64_t ldx, int64_t M, int64_t K, const uint8_t* q, int64_t N,
                 const float* scales, const float* mins, float* y, int64_t ldy, int num_threads) {
  const int64_t q_stride = K * BITS / 8;
  thread_local ActivationCodes scratch;  // reused: a decode step calls this ~200 times
  ActivationCodes& a = scratch;  // (a lambda naming `scratch` would see its own thread's)
  const int isa = quantized_isa(-1);
  quantize_activations(x, ldx, M, K, G, a, isa == kAvx512Vnni && vnni_nibble_order<BITS>(),
                       isa == kAvx512Vnni && M > 1);
#if defined(LEGATO_HAVE_X86)
  if (isa == kAvx512Vnni) {
    auto call = [&](auto nr_tag, auto mr_tag) {
      constexpr int NR = decltype(nr_tag)::value, MR = decltype(mr_tag)::value;
      auto tile = [&](int64_t m0, int64_t mr, int64_t n0, int64_t nr) {
        vnni_tile<BITS, G, HAS_MIN, NR, MR>(a, m0, mr, K, q, q_stride, scales, mins, n0, nr, N, y, ldy);
      };
      over_tiles<decltype(tile), NR, MR>(tile, M, N, num_threads);
    };
    if (M == 1) {
      call(std::integral_constant<int, 4>{}, std::integral_constant<int, 1>{});
      return 0;
    }
    // Weight tiles of 2 rows over input tiles of 3, the last exactly the rows left; up to 5
    // rows (a verification step's LM head) one tile of them all.
    auto pairs = [&](auto mr_tag) {
      constexpr int MR = decltype(mr_tag)::value;
      const int64_t n_tiles = (N + 1) / 2;
#pragma omp parallel for schedule(static) num_threads(num_threads)
      for (int64_t t = 0; t < n_tiles; ++t)
        weight_pair_over_rows<BITS, G, HAS_MIN, MR>(a, M, K, q, q_stride, scales, mins, t * 2,
                                                    std::min<int64_t>(2, N - t * 2), N, y, ldy);
    };
    if (M <= 5) pairs(std::integral_constant<int, 5>{});
    else pairs(std::integral_constant<int, 3>{});
    return 0;
  }
  if (isa == kAvx2) {
    auto call = [&](auto nr_tag, auto mr_tag) {
      constexpr int NR = decltype(nr_tag)::value, MR = decltype(mr_tag)::value;
      auto tile = [&](int64_t m0, int64_t mr, int64_t n0, int64_t nr) {
        tile_avx2<BITS, G, HAS_MIN, NR, MR>(a, m0, mr, K, q, q_stride, scales, mins, n0, nr, y, ldy);
      };
      over_tiles<decltype(tile), NR, MR>(tile, M, N, num_threads);
    };
    if (M == 1) call(std::integral_constant<int, 4>{}, std::integral_constant<int, 1>{});
    else call(std::integral_constant<int, 2>{}, std::integral_constant<int, 2>{});
    return 0;
  }
#endif
  (void)isa;
#pragma omp parallel for schedule(static) num_threads(num_threads)
  for (int64_t n = 0; n < N; ++n)
    rows_portable<BITS, G, HAS_MIN>(a, M, K, q, q_stride, scales, mins, n, y, ldy);
  return 0;
}

int quantized_matmul_int8(const float* x, int64_t ldx, int64_t M, int64_t K, const uint8_t* q,
                          int bits, int group, int64_t N, const float* scales, const float* mins,
                          float* y, int64_t ldy, int num_threads) {
  if (M < 0 || N < 0 || K <= 0 || K % 32 != 0 || ldx < K || ldy < N) return -1;
  return with_layout(bits, group, mins != nullptr, -2, [&](auto layout) {
    using L = decltype(layout);
    return qmatmul_int8<L::bits, L::group, L::has_min>(x, ldx, M, K, q, N, scales, mins, y, ldy,
                                                       num_threads);
  });
}

}  // namespace
