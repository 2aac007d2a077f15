// Weight-only quantized matmul (the code layout), fp32 activations.
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

// ---------------------------------------------------------------- weight-only quantized matmul
//
// y[m, n] = sum_k x[m, k] * w[n, k], with w held quantized (quantized.py repacks GGUF blocks
// into this layout once, at load): per output row n, K unsigned codes q (BITS = 8: int8, one
// a byte; BITS = 4: 16 bytes per 32 codes, byte j holding code j in its low and code j + 16 in
// its high nibble; BITS = 5 / 6: the low nibbles as for 4 bits, K / 2 bytes, then one bit
// plane of K / 8 bytes per high bit, bit k % 8 of byte k / 8 being bit 4 (then 5) of code k)
// and per group of G codes an fp32 scale s (and, with HAS_MIN, an fp32 offset m):
// w = (q - C) * s (+ m), where the centre C is 2^(BITS-1) for 5- and 6-bit codes without
// offsets (Q5_0, Q6_K) and 0 otherwise. The weight is formed exactly so, in fp32 without
// fusing, which is what gguf's dequantize computes, so the dequantized values are
// bit-identical; the products are summed in fp32 (fused multiply-add where the CPU has it) in
// another order than a BLAS would, as any two fp32 matmuls differ.
//
// The kernel is written on GCC vector types of 16 floats: with AVX-512 each is one register,
// with AVX2 or SSE the compiler splits it (the build is -march=native, so the machine that runs
// it picks the path; no intrinsics are needed for the portable fallback). Tiles of NR weight
// rows x MR input rows keep NR * MR accumulators in registers; rows n are split over threads.

typedef float f32x16 __attribute__((vector_size(64)));
typedef int32_t i32x16 __attribute__((vector_size(64)));
typedef uint8_t u8x16 __attribute__((vector_size(16)));
typedef int8_t i8x16 __attribute__((vector_size(16)));

inline f32x16 fma16(f32x16 a, f32x16 b, f32x16 c) {
#if defined(__AVX512F__)
  return reinterpret_cast<f32x16>(_mm512_fmadd_ps(reinterpret_cast<__m512>(a),
                                                  reinterpret_cast<__m512>(b),
                                                  reinterpret_cast<__m512>(c)));
#else
  return a * b + c;
#endif
}

inline f32x16 load16(const float* p) {
  f32x16 v;
  std::memcpy(&v, p, sizeof(v));
  return v;
}

inline f32x16 splat(float s) { return f32x16{} + s; }

// 16 signed bytes as floats (GCC scalarises the generic conversion of signed bytes).
inline f32x16 int8_to_f32(const uint8_t* p) {
#if defined(__AVX512F__)
  const __m128i bytes = _mm_loadu_si128(reinterpret_cast<const __m128i*>(p));
  return reinterpret_cast<f32x16>(_mm512_cvtepi32_ps(_mm512_cvtepi8_epi32(bytes)));
#else
  i8x16 bytes;
  std::memcpy(&bytes, p, sizeof(bytes));
  return __builtin_convertvector(__builtin_convertvector(bytes, i32x16), f32x16);
#endif
}

inline float hsum(f32x16 v) {
  float lanes[16];
  std::memcpy(lanes, &v, sizeof(lanes));
  float total = 0.0f;
  for (int j = 0; j < 16; ++j) total += lanes[j];
  return total;
}

// The centre C taken from every code (see above).
template <int BITS, bool HAS_MIN>
constexpr int code_centre() {
  return (BITS == 5 || BITS == 6) && !HAS_MIN ? 1 << (BITS - 1) : 0;
}

// Code k of a row of K codes, centred (the portable paths).
template <int BITS, bool HAS_MIN>
inline int code_at(const uint8_t* row, int64_t K, int64_t k) {
  if constexpr (BITS == 8) {
    return static_cast<int8_t>(row[k]);
  } else {
    const uint8_t byte = row[(k / 32) * 16 + (k % 16)];
    int code = (k % 32) < 16 ? (byte & 0x0F) : (byte >> 4);
    for (int p = 0; p < BITS - 4; ++p)
      code |= ((row[K / 2 + p * (K / 8) + k / 8] >> (k % 8)) & 1) << (4 + p);
    return code - code_centre<BITS, HAS_MIN>();
  }
}

// The 32 codes of chunk c (codes c*32 .. c*32+31) of a row of K codes, centred, as floats.
template <int BITS, bool HAS_MIN>
inline void codes_chunk(const uint8_t* row, int64_t K, int64_t c, f32x16& q0, f32x16& q1) {
  if constexpr (BITS == 8) {
    q0 = int8_to_f32(row + c * 32);
    q1 = int8_to_f32(row + c * 32 + 16);
  } else {
#if defined(__AVX512BW__) && defined(__AVX512VL__)
    // in bytes: the nibbles, each plane's bits added by a masked byte add, then widened
    constexpr int centre = code_centre<BITS, HAS_MIN>();
    const __m128i bytes = _mm_loadu_si128(reinterpret_cast<const __m128i*>(row + c * 16));
    const __m128i nibble = _mm_set1_epi8(0x0F);
    __m128i lo = _mm_and_si128(bytes, nibble), hi = _mm_and_si128(_mm_srli_epi16(bytes, 4), nibble);
    for (int p = 0; p < BITS - 4; ++p) {
      uint32_t plane;
      std::memcpy(&plane, row + K / 2 + p * (K / 8) + c * 4, sizeof(plane));
      const __m128i bit = _mm_set1_epi8(char(16 << p));
      lo = _mm_mask_add_epi8(lo, static_cast<__mmask16>(plane & 0xFFFFu), lo, bit);
      hi = _mm_mask_add_epi8(hi, static_cast<__mmask16>(plane >> 16), hi, bit);
    }
    __m512i lo32 = _mm512_cvtepu8_epi32(lo), hi32 = _mm512_cvtepu8_epi32(hi);
    if constexpr (centre != 0) {
      lo32 = _mm512_sub_epi32(lo32, _mm512_set1_epi32(centre));
      hi32 = _mm512_sub_epi32(hi32, _mm512_set1_epi32(centre));
    }
    q0 = reinterpret_cast<f32x16>(_mm512_cvtepi32_ps(lo32));
    q1 = reinterpret_cast<f32x16>(_mm512_cvtepi32_ps(hi32));
#else
    u8x16 b;
    std::memcpy(&b, row + c * 16, 16);
    i32x16 lo = __builtin_convertvector(b & 0x0F, i32x16);
    i32x16 hi = __builtin_convertvector(b >> 4, i32x16);
    if constexpr (BITS >= 5) {
      const i32x16 lane = {0, 1, 2, 3, 4, 5, 6, 7, 8, 9, 10, 11, 12, 13, 14, 15};
      for (int p = 0; p < BITS - 4; ++p) {
        uint32_t plane;
        std::memcpy(&plane, row + K / 2 + p * (K / 8) + c * 4, sizeof(plane));
        lo |= (((i32x16{} + static_cast<int32_t>(plane & 0xFFFFu)) >> lane) & 1) << (4 + p);
        hi |= (((i32x16{} + static_cast<int32_t>(plane >> 16)) >> lane) & 1) << (4 + p);
      }
    }
    constexpr int centre = code_centre<BITS, HAS_MIN>();
    if constexpr (centre != 0) {
      lo -= centre;
      hi -= centre;
    }
    q0 = __builtin_convertvector(lo, f32x16);
    q1 = __builtin_convertvector(hi, f32x16);
#endif
  }
}

// The 32 weights of chunk c (codes c*32 .. c*32+31) of one row, as two vectors.
template <int BITS, int G, bool HAS_MIN>
inline void dequant_chunk(const uint8_t* row, int64_t K, const float* scales, const float* mins,
                          int64_t c, f32x16& w0, f32x16& w1) {
  f32x16 q0, q1;
  codes_chunk<BITS, HAS_MIN>(row, K, c, q0, q1);
  const int64_t g0 = (c * 32) / G, g1 = (c * 32 + 16) / G;
  w0 = q0 * splat(scales[g0]);
  w1 = q1 * splat(scales[g1]);
  if constexpr (HAS_MIN) {
    w0 = w0 + splat(mins[g0]);
    w1 = w1 + splat(mins[g1]);
  }
}

// The fp32 tile (2 or more input rows). Each tile of NR weight rows is formed in fp32 once per
// block of kPanelCodes codes into a panel (NR x the block, in L1) that every input tile of
// MR rows then reads, so a weight is formed once per call, not once per input tile. The
// accumulators of every input tile wait in `sums` between blocks; after the last block one
// lane_sums turns a tile's NR * MR (<= 16) accumulators into its results. Each output's
// arithmetic (one fused multiply-add chain over k, then the same reduction tree) does not
// depend on M, on MR or on the row's place in the tile, so a row's result is the same in any
// call of two or more rows (verification rows rely on it).
constexpr int64_t kPanelCodes = 1024;  // 16 KB of panel at NR = 4; 576-wide rows in one block
constexpr int64_t kPanelPrefetchTiles = 1;  // 2 or 4 tiles ahead measured the same

// Keeps a loaded vector in its register: without it GCC reloads it for every use (one load
// per fused multiply-add), which halves the tile's speed.
inline void pin(f32x16& v) {
#if defined(__AVX512F__)
  asm("" : "+v"(v));
#endif
}

// acc[i][j] += panel row i . x row j over `steps` vectors of 16 codes.
template <int NR, int MR>
inline void panel_tile(const float* panel, int64_t steps, const float* const* xr,
                       f32x16 (&acc)[NR][MR]) {
  for (int64_t s = 0; s < steps; ++s) {
    f32x16 w[NR];
    for (int i = 0; i < NR; ++i) {
      w[i] = load16(panel + (s * NR + i) * 16);
      pin(w[i]);
    }
    for (int j = 0; j < MR; ++j) {
      f32x16 xv = load16(xr[j] + s * 16);
      pin(xv);
      for (int i = 0; i < NR; ++i) acc[i][j] = fma16(w[i], xv, acc[i][j]);
    }
  }
}

// One input tile of mr = MR rows over one panel block: the accumulators come from `sums`
// (zero at the first block) and go back there, or after the last block are reduced and
// written (nr of the NR weight rows are real).
template <int NR, int MR>
void qmatmul_tile(const float* panel, int64_t steps, const float* x, int64_t ldx, int64_t m0,
                  int64_t k0, f32x16* sums, bool first, bool last, int64_t n0, int64_t nr,
                  float* y, int64_t ldy) {
  static_assert(NR * MR <= 16, "one lane_sums per tile");
  f32x16 acc[NR][MR];
  for (int i = 0; i < NR; ++i)
    for (int j = 0; j < MR; ++j) acc[i][j] = first ? f32x16{} : sums[i * MR + j];
  const float* xr[MR];
  for (int j = 0; j < MR; ++j) xr[j] = x + (m0 + j) * ldx + k0;
  panel_tile<NR, MR>(panel, steps, xr, acc);
  if (!last) {
    for (int i = 0; i < NR; ++i)
      for (int j = 0; j < MR; ++j) sums[i * MR + j] = acc[i][j];
    return;
  }
  attn_f32x16 v[16] = {};
  for (int i = 0; i < NR; ++i)
    for (int j = 0; j < MR; ++j) v[i * MR + j] = reinterpret_cast<attn_f32x16>(acc[i][j]);
  float lanes[16];
  const attn_f32x16 total = lane_sums(v);
  std::memcpy(lanes, &total, sizeof(lanes));
  for (int i = 0; i < nr; ++i)
    for (int j = 0; j < MR; ++j) y[(m0 + j) * ldy + n0 + i] = lanes[i * MR + j];
}

// NR weight rows n0 .. n0 + nr - 1 (of n_total) against all M input rows (see kPanelCodes
// above). The weights stream from memory: the next tile's are prefetched first, since the
// hardware prefetcher does not run ahead across this tile's long compute.
template <int BITS, int G, bool HAS_MIN, int NR, int MR>
void qmatmul_panel(const float* x, int64_t ldx, int64_t M, const uint8_t* q, int64_t q_stride,
                   const float* scales, const float* mins, int64_t groups, int64_t n0,
                   int64_t nr, int64_t n_total, int64_t K, float* y, int64_t ldy, f32x16* panel,
                   f32x16* sums) {
  const uint8_t* rows[NR];
  const float* srow[NR];
  const float* mrow[NR];
  for (int i = 0; i < NR; ++i) {
    const int64_t n = n0 + (i < nr ? i : 0);  // a short tile repeats its first row, unstored
    rows[i] = q + n * q_stride;
    srow[i] = scales + n * groups;
    mrow[i] = HAS_MIN ? mins + n * groups : nullptr;
  }
  const int64_t ahead = n0 + kPanelPrefetchTiles * NR;
  if (ahead + NR <= n_total) {  // a later tile's codes and scales, fetched while this one runs
    const char* next = reinterpret_cast<const char*>(q + ahead * q_stride);
    for (int64_t b = 0; b < NR * q_stride; b += 64) __builtin_prefetch(next + b);
    const int64_t scale_bytes = NR * groups * static_cast<int64_t>(sizeof(float));
    const char* next_scales = reinterpret_cast<const char*>(scales + ahead * groups);
    for (int64_t b = 0; b < scale_bytes; b += 64) __builtin_prefetch(next_scales + b);
    if constexpr (HAS_MIN) {
      const char* next_mins = reinterpret_cast<const char*>(mins + ahead * groups);
      for (int64_t b = 0; b < scale_bytes; b += 64) __builtin_prefetch(next_mins + b);
    }
  }
  const int64_t full = M / MR * MR, rest = M - full;
  for (int64_t k0 = 0; k0 < K; k0 += kPanelCodes) {
    const int64_t codes = std::min<int64_t>(kPanelCodes, K - k0), steps = codes / 16;
    for (int64_t c = 0; c < codes / 32; ++c)
      for (int i = 0; i < NR; ++i)
        dequant_chunk<BITS, G, HAS_MIN>(rows[i], K, srow[i], mrow[i], k0 / 32 + c,
                                        panel[2 * c * NR + i], panel[(2 * c + 1) * NR + i]);
    const bool first = k0 == 0, last = k0 + codes == K;
    const float* p = reinterpret_cast<const float*>(panel);
    for (int64_t m0 = 0; m0 < full; m0 += MR)
      qmatmul_tile<NR, MR>(p, steps, x, ldx, m0, k0, sums + m0 / MR * 16, first, last, n0, nr,
                           y, ldy);
    f32x16* tail = sums + full / MR * 16;
    if (rest == 3) qmatmul_tile<NR, 3>(p, steps, x, ldx, full, k0, tail, first, last, n0, nr, y, ldy);
    if (rest == 2) qmatmul_tile<NR, 2>(p, steps, x, ldx, full, k0, tail, first, last, n0, nr, y, ldy);
    if (rest == 1) qmatmul_tile<NR, 1>(p, steps, x, ldx, full, k0, tail, first, last, n0, nr, y, ldy);
  }
}

// One input row (decode): sum_g s_g * (q_g . x_g) + sum_g m_g * sum(x_g), with the group
// sums of x computed once per call (xsum). Three vector ops per 32 codes instead of the
// six of forming each weight; the result differs from the dequantized product only by
// fp32 rounding order.
template <int BITS, int G, bool HAS_MIN, int NR>
void qmatmul_vec_tile(const float* x, const float* xsum, const uint8_t* q, int64_t q_stride,
                      const float* scales, const float* mins, int64_t groups, int64_t n0,
                      int64_t nr, int64_t K, float* y) {
  f32x16 acc[NR];
  const uint8_t* rows[NR];
  const float* srow[NR];
  for (int i = 0; i < NR; ++i) {
    const int64_t n = n0 + (i < nr ? i : 0);
    acc[i] = f32x16{};
    rows[i] = q + n * q_stride;
    srow[i] = scales + n * groups;
  }
  const int64_t chunks = K / 32;
  for (int64_t c = 0; c < chunks; ++c) {
    const f32x16 xa = load16(x + c * 32), xb = load16(x + c * 32 + 16);
    for (int i = 0; i < NR; ++i) {
      f32x16 q0, q1;
      codes_chunk<BITS, HAS_MIN>(rows[i], K, c, q0, q1);
      if constexpr (G == 32) {
        acc[i] = fma16(splat(srow[i][c]), fma16(q1, xb, q0 * xa), acc[i]);
      } else {
        acc[i] = fma16(splat(srow[i][2 * c]), q0 * xa, acc[i]);
        acc[i] = fma16(splat(srow[i][2 * c + 1]), q1 * xb, acc[i]);
      }
    }
  }
  for (int i = 0; i < nr; ++i) {
    float total = hsum(acc[i]);
    if constexpr (HAS_MIN) {
      const float* m = mins + (n0 + i) * groups;
      float offset = 0.0f;
      for (int64_t g = 0; g < groups; ++g) offset += m[g] * xsum[g];
      total += offset;
    }
    y[n0 + i] = total;
  }
}

template <int BITS, int G, bool HAS_MIN>
int qmatmul(const float* x, int64_t ldx, int64_t M, int64_t K, const uint8_t* q, int64_t N,
            const float* scales, const float* mins, float* y, int64_t ldy, int num_threads) {
  const int64_t q_stride = K * BITS / 8, groups = K / G;
  if (M == 1) {  // decode: four weight rows at a time for independent accumulator chains
    constexpr int NR = 4;
    std::vector<float> xsum(HAS_MIN ? groups : 0);
    for (int64_t g = 0; g < static_cast<int64_t>(xsum.size()); ++g) {
      float total = 0.0f;
      for (int j = 0; j < G; ++j) total += x[g * G + j];
      xsum[g] = total;
    }
    const int64_t tiles = (N + NR - 1) / NR;
#pragma omp parallel for schedule(static) num_threads(num_threads)
    for (int64_t t = 0; t < tiles; ++t) {
      const int64_t n0 = t * NR;
      qmatmul_vec_tile<BITS, G, HAS_MIN, NR>(x, xsum.data(), q, q_stride, scales, mins, groups,
                                             n0, std::min<int64_t>(NR, N - n0), K, y);
    }
    return 0;
  }
  constexpr int NR = 4, MR = 4;  // 16 accumulators, 4 weight and 1 input vector: 21 registers
  static_assert(MR <= 4, "the tail tiles above take 1..3 rows");
  const int64_t n_tiles = (N + NR - 1) / NR, m_tiles = (M + MR - 1) / MR;
#pragma omp parallel num_threads(num_threads)
  {
    std::vector<f32x16> panel(kPanelCodes / 16 * NR), sums(m_tiles * 16);
#pragma omp for schedule(static)
    for (int64_t t = 0; t < n_tiles; ++t) {
      const int64_t n0 = t * NR;
      qmatmul_panel<BITS, G, HAS_MIN, NR, MR>(x, ldx, M, q, q_stride, scales, mins, groups, n0,
                                              std::min<int64_t>(NR, N - n0), N, K, y, ldy,
                                              panel.data(), sums.data());
    }
  }
  return 0;
}

// Every (bits, group) code layout the quantized kernels take, in dispatch order (the layout:
// legato.models.quantized; Python's cpu_kernels.QUANTIZED_LAYOUTS lists the same).
// with_layout below expands X(bits, group) once per layout. (8, 16): no GGUF type repacks so
// today; kept for callers' layouts.
#define LEGATO_FOR_EACH_LAYOUT(X) X(4, 32) X(8, 32) X(5, 32) X(6, 16) X(8, 16)

// A code layout as a type, for the kernels' template arguments.
template <int B, int G, bool HAS_MIN>
struct Layout {
  static constexpr int bits = B, group = G;
  static constexpr bool has_min = HAS_MIN;
};

// What `kernel(Layout<bits, group, has_min>{})` returns, or `none` for a layout the kernels do
// not take: the one dispatch from run-time layouts to kernel instances.
template <typename R, typename Kernel>
R with_layout(int bits, int group, bool has_min, R none, Kernel&& kernel) {
#define LEGATO_LAYOUT(B, G) \
  if (bits == B && group == G) \
    return has_min ? R(kernel(Layout<B, G, true>{})) : R(kernel(Layout<B, G, false>{}));
  LEGATO_FOR_EACH_LAYOUT(LEGATO_LAYOUT)
#undef LEGATO_LAYOUT
  return none;
}

int quantized_matmul(const float* x, int64_t ldx, int64_t M, int64_t K, const uint8_t* q,
                     int bits, int group, int64_t N, const float* scales, const float* mins,
                     float* y, int64_t ldy, int num_threads) {
  if (M < 0 || N < 0 || K <= 0 || K % 32 != 0 || ldx < K || ldy < N) return -1;
  return with_layout(bits, group, mins != nullptr, -2, [&](auto layout) {
    using L = decltype(layout);
    return qmatmul<L::bits, L::group, L::has_min>(x, ldx, M, K, q, N, scales, mins, y, ldy,
                                                  num_threads);
  });
}

}  // namespace
