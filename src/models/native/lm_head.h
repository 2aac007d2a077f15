// A greedy decode step's last norm, LM head and argmax in one call.
// One part of the CPU kernels (cpu_kernels.cpp includes every part, in one translation
// unit; the conventions are stated there).

#pragma once

#include <algorithm>
#include <cmath>
#include <cstdint>
#include <cstring>
#include <vector>

#include <omp.h>

#include "decoder_layer.h"
#include "elementwise.h"
#include "quantized_int8.h"
#include "quantized_share.h"
namespace {

// ------------------------------------------------- the head of a greedy one-row step
//
// After the decoder stack, a plain greedy step of one sequence needs only the argmax of one
// row of logits: residual += hidden, normed = norm(residual), logits = normed @ W^T, token =
// argmax(logits). Run as three calls (the fused add-norm, the one-row int8 matmul, argmax) that
// is three OpenMP regions and three trips through Python. Here it is one region: each thread
// norms the row on its own copy (the same rms_norm arithmetic), quantizes it, runs its share
// of the head's four-row weight tiles (vnni_row_share: the one-row call's tiles, so every
// logit is that call's, bit for bit) and scans its share for the first NaN and the first
// largest value; the shares, taken in order, give argmax_rows' answer (the first NaN if any,
// else the first index of the largest value).

struct ArgmaxShare {
  int64_t first_nan;  // in the share, or -1
  int64_t best_at;    // the first index of the share's largest value, or -1 (an empty share)
  float best;
};

// The first NaN (if any) and the first largest value of x[n0 .. n1).
inline ArgmaxShare argmax_share(const float* x, int64_t n0, int64_t n1) {
  ArgmaxShare s{-1, -1, 0.0f};
  if (n1 <= n0) return s;
  const int64_t nan = find_first(x + n0, n1 - n0, [](float v) { return v != v; });
  if (nan < n1 - n0) {
    s.first_nan = n0 + nan;
    return s;
  }
  s.best = max_of(x + n0, n1 - n0);
  s.best_at = n0 + find_first(x + n0, n1 - n0, [b = s.best](float v) { return v == b; });
  return s;
}

#if defined(LEGATO_HAVE_X86)
// Returns 1 with *token and logits[N] (and normed[H], residual updated) written, 0 where the
// call is not taken (not the VNNI path, or a layout without a share kernel: nothing written),
// or -1 for arguments it refuses.
int greedy_head_vnni(const float* hidden, float* residual, const float* norm_weight,
                     float* normed, const QuantProjection& head, int64_t H, int64_t N, float eps,
                     float* logits, int64_t* token, int num_threads) {
  VnniRowsShare fn[kMaxParts];
  if (quantized_isa(-1) != kAvx512Vnni || !share_kernels(head, H, N, fn)) return 0;
  std::vector<ArgmaxShare> shares(std::max(num_threads, 1));
  int team = 1;
#pragma omp parallel num_threads(num_threads)
  {
    const int part = omp_get_thread_num(), parts = omp_get_num_threads();
    thread_local ActivationCodes codes;
    thread_local std::vector<float> res, row;  // this thread's own copies
    res.assign(residual, residual + H);
    row.resize(H);
    rms_norm<float>(hidden, H, res.data(), norm_weight, row.data(), 1, H, eps, 1);
    project_share(head, fn, row.data(), 1, H, logits, N, codes, part, parts);
#pragma omp barrier
    if (part == 0) {  // after the barrier: every thread has read the residual
      team = parts;
      std::memcpy(residual, res.data(), sizeof(float) * H);
      std::memcpy(normed, row.data(), sizeof(float) * H);
    }
    shares[part] = argmax_share(logits, N * part / parts, N * (part + 1) / parts);
  }
  int64_t first_nan = -1, best_at = -1;
  float best = 0.0f;
  for (int p = 0; p < team; ++p) {
    const ArgmaxShare& s = shares[p];
    if (s.first_nan >= 0) {
      first_nan = s.first_nan;
      break;
    }
    if (s.best_at >= 0 && (best_at < 0 || s.best > best)) best = s.best, best_at = s.best_at;
  }
  *token = first_nan >= 0 ? first_nan : best_at;
  return 1;
}
#endif

int greedy_head(const float* hidden, float* residual, const float* norm_weight, float* normed,
                const QuantProjection& head, int64_t H, int64_t N, float eps, float* logits,
                int64_t* token, int num_threads) {
  if (H <= 0 || N <= 0 || num_threads < 1) return -1;
#if defined(LEGATO_HAVE_X86)
  return greedy_head_vnni(hidden, residual, norm_weight, normed, head, H, N, eps, logits, token,
                          num_threads);
#else
  return 0;
#endif
}

}  // namespace
