// One thread's share of a VNNI int8 matmul over the few rows of one sequence, for the decode
// stack's one parallel region (one_sequence.h). One part of the CPU kernels (cpu_kernels.cpp
// includes every part, in one translation unit; the conventions are stated there); it reads
// the tiles of quantized_int8.h and never changes their arithmetic.

#pragma once

#include <algorithm>
#include <cstdint>
#include <type_traits>

#include "quantized_int8.h"

namespace {

#if defined(LEGATO_HAVE_X86)
// One thread's share of y[T, N] = x[T, K] @ W^T (a's T rows of digits in the layout's order:
// vnni_nibble_order). The thread takes the same weight rows as vnni_row_share (four-row tiles
// part * n / parts .. (part + 1) * n / parts of the n = ceil(N / 4)), so a T-row step streams
// each thread's share of every matrix exactly as a one-row step does. With T == 1 it is
// vnni_row_share. With T > 1 each two weight rows run input tiles of kShareRows rows and then
// one of exactly the rows left (weight_pair_over_rows): the VNNI tile's arithmetic
// for a (weight row, input row) pair does not depend on its NR or MR (each pair has its own
// accumulator chain, and a row's lanes are summed four rows at a time whatever NR), so every
// row's output is the one-row call's, bit for bit. The two weight rows are read from memory
// once and from L1 for the second input tile.
constexpr int kShareRows = 5;  // input rows a tile runs at most

template <int BITS, int G, bool HAS_MIN>
void vnni_rows_share(const ActivationCodes& a, int64_t T, int64_t K, const uint8_t* q,
                     int64_t N, const float* scales, const float* mins, float* y, int64_t ldy,
                     int part, int parts) {
  if (T == 1) {
    vnni_row_share<BITS, G, HAS_MIN>(a, K, q, N, scales, mins, y, part, parts);
    return;
  }
  const int64_t q_stride = K * BITS / 8, n_tiles = (N + 3) / 4;
  const int64_t r0 = n_tiles * part / parts * 4;
  const int64_t r1 = std::min<int64_t>(N, n_tiles * (part + 1) / parts * 4);
  for (int64_t n0 = r0; n0 < r1; n0 += 2)
    weight_pair_over_rows<BITS, G, HAS_MIN, kShareRows>(a, T, K, q, q_stride, scales, mins, n0,
                                                        std::min<int64_t>(2, r1 - n0), N, y,
                                                        ldy);
}

using VnniRowsShare = void (*)(const ActivationCodes&, int64_t, int64_t, const uint8_t*, int64_t,
                               const float*, const float*, float*, int64_t, int, int);

// The share kernel of a layout, or null for one the kernels do not hold.
VnniRowsShare vnni_rows_share_for(int bits, int group, bool has_min) {
  return with_layout(bits, group, has_min, VnniRowsShare{nullptr}, [](auto layout) {
    using L = decltype(layout);
    return VnniRowsShare{&vnni_rows_share<L::bits, L::group, L::has_min>};
  });
}
#endif

}  // namespace
