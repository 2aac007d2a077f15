// Dense fp32 matmul over weights held in column panels, for a few rows (decode steps).
// One part of the CPU kernels (cpu_kernels.cpp includes every part, in one translation
// unit; the conventions are stated there).

#pragma once

#include <algorithm>
#include <cmath>
#include <cstdint>

#include <omp.h>

#if defined(__x86_64__) || defined(_M_X64)
#include <immintrin.h>
#endif

#include "common.h"

namespace {

// ------------------------------------------------ dense fp32 matmul, weights in panels
//
// y[M, N] = x[M, K] W^T (+ bias) with W [N, K] held as panels of kPanel columns:
// panels[p][k][j] = W[p * kPanel + j][k], zero past N (legato.models.cpu_linear packs them).
// A step of the loop reads one panel row (kPanel floats, contiguous) and multiplies it by
// one input value per row, so the weights stream once in order, as a decode step wants.
//
// Why not oneDNN: at 1 to 128 rows its packed fp32 matmul leaves the weight stream and the
// arithmetic one after the other; here each thread walks its panels in order, computes a
// block of kBlock panel rows for every row tile from L1, and prefetches the next block
// meanwhile (only as many lines a step as the block's tiles need: a prefetch a step where
// none is needed costs a tenth of the arithmetic's speed). The default model's 120 layer
// matrices, 2 threads (benchmarks/linear_floor.py, method "panels"): about 1.5x oneDNN's
// speed at 1 and 32 rows, the same from 256 to 1024 rows.
//
// Paths, chosen at run time (dense_matmul_path): AVX-512 (tiles of 8 rows x 48 columns in 24
// registers) and portable C++. Both sum each output over k in order, one fused multiply-add
// a term, starting from the bias (or 0), so they give the same bits.

constexpr int kPanel = 48;               // columns a panel holds: three vectors of 16
constexpr int kTileRows = 8;             // rows of x an AVX-512 tile holds
constexpr int64_t kBlock = 128;          // panel rows computed for every row tile in turn
constexpr int64_t kRowBlockBytes = 1 << 19;  // rows of x kept hot per pass over the panels
constexpr int64_t kOnePassBytes = 1 << 20;   // an x this small takes a single pass

inline int64_t panel_count(int64_t N) { return (N + kPanel - 1) / kPanel; }

// Rows of x a pass over the panels covers. Each pass streams every panel from memory once,
// and a pass of a few rows does little arithmetic for it, so: x whole while it fits
// kOnePassBytes (a 256-token prompt's 576-wide rows: one pass, not 224 rows and then 32);
// else passes of equal size, whole tiles, each within kRowBlockBytes. The default model's 120
// layer matrices with cold weights at 256 rows: 160-169 ms against 168-174 ms with full
// 512 KB passes and a short last one (three runs alternated in one process).
inline int64_t rows_per_pass(int64_t M, int64_t K) {
  if (M * K * 4 <= kOnePassBytes) return M;
  const int64_t most = std::max<int64_t>(kTileRows, kRowBlockBytes / (K * 4) / kTileRows * kTileRows);
  const int64_t passes = (M + most - 1) / most;
  return std::min(most, ((M + passes - 1) / passes + kTileRows - 1) / kTileRows * kTileRows);
}

// Portable: each output row of a panel summed over k in order.
void dense_panel_portable(const float* x, int64_t ldx, int64_t rows, int64_t K,
                          const float* panel, const float* bias, int64_t width, float* y,
                          int64_t ldy) {
  for (int64_t m = 0; m < rows; ++m) {
    float acc[kPanel];
    for (int j = 0; j < kPanel; ++j) acc[j] = bias != nullptr && j < width ? bias[j] : 0.f;
    const float* xm = x + m * ldx;
    for (int64_t k = 0; k < K; ++k) {
      const float v = xm[k];
      const float* w = panel + k * kPanel;
      for (int j = 0; j < kPanel; ++j) acc[j] = std::fma(w[j], v, acc[j]);
    }
    for (int64_t j = 0; j < width; ++j) y[m * ldy + j] = acc[j];
  }
}

#if defined(__x86_64__) || defined(_M_X64)
#define LEGATO_DENSE_AVX512 __attribute__((target("avx512f")))

// R rows of x times kBlock (or fewer, `steps`) rows of one panel, into y's R x kPanel tile
// (the first `width` columns). `first`: start from the bias (or 0) instead of y. Prefetches
// PF cache lines a step from `ahead` on (the next block).
template <int R, int PF>
LEGATO_DENSE_AVX512 void dense_tile_avx512(const float* x, int64_t ldx, const float* w,
                                           int64_t steps, float* y, int64_t ldy,
                                           const float* bias, int64_t width, bool first,
                                           const char* ahead) {
  const auto keep = [width](int64_t from) -> __mmask16 {
    const int64_t left = width - from;
    return left >= 16 ? __mmask16(0xFFFF) : left <= 0 ? __mmask16(0) : __mmask16((1u << left) - 1);
  };
  const __mmask16 m0 = keep(0), m1 = keep(16), m2 = keep(32);
  __m512 acc[R][3];
  if (first) {
    const __m512 b0 = bias ? _mm512_maskz_loadu_ps(m0, bias) : _mm512_setzero_ps();
    const __m512 b1 = bias ? _mm512_maskz_loadu_ps(m1, bias + 16) : _mm512_setzero_ps();
    const __m512 b2 = bias ? _mm512_maskz_loadu_ps(m2, bias + 32) : _mm512_setzero_ps();
    for (int i = 0; i < R; ++i) {
      acc[i][0] = b0;
      acc[i][1] = b1;
      acc[i][2] = b2;
    }
  } else {
    for (int i = 0; i < R; ++i) {
      acc[i][0] = _mm512_maskz_loadu_ps(m0, y + i * ldy);
      acc[i][1] = _mm512_maskz_loadu_ps(m1, y + i * ldy + 16);
      acc[i][2] = _mm512_maskz_loadu_ps(m2, y + i * ldy + 32);
    }
  }
  for (int64_t k = 0; k < steps; ++k) {
    for (int q = 0; q < PF; ++q) _mm_prefetch(ahead + (k * PF + q) * 64, _MM_HINT_T1);
    const __m512 w0 = _mm512_loadu_ps(w + k * kPanel);
    const __m512 w1 = _mm512_loadu_ps(w + k * kPanel + 16);
    const __m512 w2 = _mm512_loadu_ps(w + k * kPanel + 32);
    for (int i = 0; i < R; ++i) {
      const __m512 v = _mm512_set1_ps(x[i * ldx + k]);
      acc[i][0] = _mm512_fmadd_ps(w0, v, acc[i][0]);
      acc[i][1] = _mm512_fmadd_ps(w1, v, acc[i][1]);
      acc[i][2] = _mm512_fmadd_ps(w2, v, acc[i][2]);
    }
  }
  for (int i = 0; i < R; ++i) {
    _mm512_mask_storeu_ps(y + i * ldy, m0, acc[i][0]);
    _mm512_mask_storeu_ps(y + i * ldy + 16, m1, acc[i][1]);
    _mm512_mask_storeu_ps(y + i * ldy + 32, m2, acc[i][2]);
  }
}

using DenseTile = void (*)(const float*, int64_t, const float*, int64_t, float*, int64_t,
                           const float*, int64_t, bool, const char*);
constexpr int kMaxPrefetch = 3;  // lines a step: a block of one row tile (3 lines a panel row)

template <int PF>
struct DenseTiles {  // dense_tile_avx512<R, PF> by R
  static constexpr DenseTile by_rows[kTileRows + 1] = {
      nullptr,
      dense_tile_avx512<1, PF>,
      dense_tile_avx512<2, PF>,
      dense_tile_avx512<3, PF>,
      dense_tile_avx512<4, PF>,
      dense_tile_avx512<5, PF>,
      dense_tile_avx512<6, PF>,
      dense_tile_avx512<7, PF>,
      dense_tile_avx512<8, PF>,
  };
};
const DenseTile* const dense_tiles_avx512[kMaxPrefetch + 1] = {
    DenseTiles<0>::by_rows, DenseTiles<1>::by_rows, DenseTiles<2>::by_rows,
    DenseTiles<3>::by_rows};

// `rows` rows of x (from row 0 of the pointers) times one panel, block by block: each block
// of kBlock panel rows goes through every row tile while the next block is prefetched, the
// fewest lines a step that cover it, by the first tiles.
void dense_panel_avx512(const float* x, int64_t ldx, int64_t rows, int64_t K,
                        const float* panel, const float* bias, int64_t width, float* y,
                        int64_t ldy) {
  const int64_t tiles = (rows + kTileRows - 1) / kTileRows;
  for (int64_t k0 = 0; k0 < K; k0 += kBlock) {
    const int64_t steps = std::min(kBlock, K - k0);
    const float* w = panel + k0 * kPanel;
    // The next block follows this one in memory (the next panel's first after the last).
    const char* next = reinterpret_cast<const char*>(w + steps * kPanel);
    const int64_t lines = steps * kPanel * 4 / 64;
    const int64_t per_step = (lines + tiles * steps - 1) / (tiles * steps);  // 1 .. kMaxPrefetch
    for (int64_t t = 0; t < tiles; ++t) {
      const int64_t m = t * kTileRows, from = t * steps * per_step;  // this tile's first line
      const int r = static_cast<int>(std::min<int64_t>(kTileRows, rows - m));
      const int64_t pf = from < lines ? per_step : 0;
      dense_tiles_avx512[pf][r](x + m * ldx + k0, ldx, w, steps, y + m * ldy, ldy, bias, width,
                                k0 == 0, next + from * 64);
    }
  }
}

#endif

int dense_path = -1;  // dense_matmul_path: -1 the best this CPU runs, 0 portable, 1 AVX-512

// Which loop dense_matmul runs: request 0 the portable one, 1 AVX-512 where the CPU has it,
// < 0 only reads. Returns the one in use (1 AVX-512, 0 portable).
int dense_matmul_path(int request) {
#if defined(__x86_64__) || defined(_M_X64)
  const int best = cpu_has_avx512f() ? 1 : 0;
#else
  const int best = 0;
#endif
  return choose_path(dense_path, request, best);
}

// y [M, N] (row stride ldy) = x [M, K] (row stride ldx) W^T + bias (bias [N] or null), W held
// in panels (above). The threads split the panels; each walks its own in order, a pass per
// rows_per_pass(M, K) rows of x. Returns 0, or -1 for sizes it cannot take.
int dense_matmul(const float* x, int64_t ldx, int64_t M, int64_t K, const float* panels,
                 int64_t N, const float* bias, float* y, int64_t ldy, int num_threads) {
  if (M < 0 || K <= 0 || N <= 0 || ldx < K || ldy < N || num_threads <= 0) return -1;
  if (M == 0) return 0;
  [[maybe_unused]] const bool avx512 = dense_matmul_path(-1) == 1;
  const int64_t count = panel_count(N), pass = rows_per_pass(M, K);
  const int threads = static_cast<int>(std::min<int64_t>(num_threads, count));
#pragma omp parallel num_threads(threads)
  {
    const int t = omp_get_thread_num(), T = omp_get_num_threads();
    const int64_t p0 = count * t / T, p1 = count * (t + 1) / T;
    for (int64_t m0 = 0; m0 < M; m0 += pass) {
      const int64_t rows = std::min(pass, M - m0);
      for (int64_t p = p0; p < p1; ++p) {
        const int64_t n0 = p * kPanel, width = std::min<int64_t>(kPanel, N - n0);
        const float* panel = panels + p * K * kPanel;
        const float* b = bias != nullptr ? bias + n0 : nullptr;
#if defined(__x86_64__) || defined(_M_X64)
        if (avx512) {
          dense_panel_avx512(x + m0 * ldx, ldx, rows, K, panel, b, width, y + m0 * ldy + n0, ldy);
          continue;
        }
#endif
        dense_panel_portable(x + m0 * ldx, ldx, rows, K, panel, b, width, y + m0 * ldy + n0, ldy);
      }
    }
  }
  return 0;
}

}  // namespace
