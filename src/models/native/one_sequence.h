// One sequence's decode or verification step, its whole decoder stack in one parallel region.
// One part of the CPU kernels (cpu_kernels.cpp includes every part, in one translation
// unit; the conventions are stated there).

#pragma once

#include <algorithm>
#include <cstdint>
#include <cstring>
#include <vector>

#include <omp.h>

#include "attention.h"
#include "decoder_layer.h"
#include "elementwise.h"
#include "quantized_int8.h"
#include "quantized_share.h"

namespace {

// ------------------------------------------ one sequence's step in one parallel region
//
// A plain decode step of one sequence on the VNNI integer path streams each weight once, in
// 120 small matrices (a 576x576 Q4_1 matrix is 0.2 MB). Run op by op (decode_layers in
// decode_stack.h, which calls try_one_sequence first), each kernel is its own
// OpenMP region (about 240 forks and joins a step) and each matrix starts cold. Here the
// whole stack is one region instead: each thread takes a fixed share of every projection's
// four-row weight tiles (vnni_rows_share: the tiles the one-row call runs, so each output is
// that call's, bit for bit), and the threads meet at a barrier between dependent ops. The
// small ops between (norms, SiLU, the activations' quantization, the residual) each thread
// does for itself, on its own copy: the same arithmetic in the same order as op by op. Attention
// is shared by query heads (attend_heads_f32), and the new K/V rows by kv head. Before each
// barrier a thread prefetches the opening rows of its share of the next matrix into L2,
// where its tiles' own prefetch (prefetch_rows_ahead) does not reach.
//
// A verification step (T rows of one sequence: its last token, then its drafts) runs the
// same region over its T rows: each thread's share of a matrix is the one-row step's, run
// over every row while its weights are in cache, so the step streams the weights once, as a
// plain step does. Row t attends to seq_lens[t] keys (its own position and before), and every
// row's K/V is written before any row's attention reads; each row is the one-row step's.

int one_region_choice = 1;  // decode_one_region: 0 pins the op-by-op path (tests compare)

int decode_one_region(int request) {
  if (request >= 0) one_region_choice = request != 0;
  return one_region_choice;
}

// decode_verify_rows: 0 runs a verification step's T > 1 rows in one_sequence_region
// (every thread quantizing every row) instead of verify_rows_region (benchmarks compare)
int verify_rows_choice = 1;

int decode_verify_rows(int request) {
  if (request >= 0) verify_rows_choice = request != 0;
  return verify_rows_choice;
}

#if defined(LEGATO_HAVE_X86)
struct ShareKernels {  // per projection (qkv, o, gate_up, down), per part
  VnniRowsShare fn[4][kMaxParts];
};

// The share kernels of one projection; false if a part's layout has none or the parts do
// not add up to N columns.
bool share_kernels(const QuantProjection& w, int64_t K, int64_t N, VnniRowsShare (&fn)[kMaxParts]) {
  int64_t rows = 0;
  if (K % 32 != 0 || w.num_parts < 1 || w.num_parts > kMaxParts) return false;
  for (int p = 0; p < w.num_parts; ++p) {
    const QuantPart& part = w.parts[p];
    fn[p] = vnni_rows_share_for(part.bits, part.group, part.offsets != nullptr);
    if (fn[p] == nullptr) return false;
    rows += part.rows;
  }
  return rows == N;
}

// This thread's share of y[T, N] = x[T, K] @ W^T over the projection's parts (y's rows N
// apart); `a` is the thread's own activation codes (quantized again only where a part's
// layout reads others).
void project_share(const QuantProjection& w, const VnniRowsShare (&fn)[kMaxParts],
                   const float* x, int64_t T, int64_t K, float* y, int64_t N, ActivationCodes& a,
                   int part, int parts) {
  int64_t column = 0;
  for (int p = 0; p < w.num_parts; ++p) {
    const QuantPart& wp = w.parts[p];
    const bool nibbles = wp.bits != 8;  // vnni_nibble_order
    if (p == 0 || wp.group != w.parts[p - 1].group || nibbles != (w.parts[p - 1].bits != 8))
      quantize_activations(x, K, T, K, wp.group, a, nibbles, T > 1);
    fn[p](a, T, K, wp.codes, wp.rows, wp.scales, wp.offsets, y + column, N, part, parts);
    column += wp.rows;
  }
}

// Into L2: the first prefetch_rows_ahead rows of this thread's share of each part (codes, scales,
// offsets), the rows its first tiles read before their own prefetch runs ahead.
void prefetch_share(const QuantProjection& w, int64_t K, int part, int parts) {
  for (int p = 0; p < w.num_parts; ++p) {
    const QuantPart& wp = w.parts[p];
    const int64_t q_stride = K * wp.bits / 8, groups = K / wp.group;
    const int64_t n0 = (wp.rows + 3) / 4 * part / parts * 4;
    const int64_t n1 = std::min<int64_t>(wp.rows, n0 + prefetch_rows_ahead(q_stride));
    if (n1 <= n0) continue;
    const char* codes = reinterpret_cast<const char*>(wp.codes);
    for (int64_t b = n0 * q_stride; b < n1 * q_stride; b += 64) _mm_prefetch(codes + b, kPrefetchHint);
    for (int64_t g = n0 * groups; g < n1 * groups; g += 16) {
      _mm_prefetch(reinterpret_cast<const char*>(wp.scales + g), kPrefetchHint);
      if (wp.offsets != nullptr) _mm_prefetch(reinterpret_cast<const char*>(wp.offsets + g), kPrefetchHint);
    }
  }
}

// Where a one-sequence step's T rows read and write: row t's block-table row, length (keys
// 0 .. seq_lens[t] - 1), K/V slot (< 0: none written) and position.
struct SequenceRows {
  int64_t T;
  const int32_t* table;
  int64_t table_stride;
  const int32_t* seq_lens;
  const int64_t* slots;
  const int64_t* positions;
};

// Rotary on query heads h0 .. h1 - 1 and kv heads k0 .. k1 - 1 of the T rows of qkv_rows
// (a thread's share), then those kv heads' new K/V rows into the layer's caches.
void rotate_and_write_kv(const DecoderLayerWeights& layer, float* qkv_rows,
                         const SequenceRows& rows, int h0, int h1, int k0, int k1, int num_heads,
                         int num_kv_heads, int head_dim, const float* cos_sin,
                         int64_t max_position) {
  const int64_t T = rows.T;
  const int64_t q_width = static_cast<int64_t>(num_heads) * head_dim;
  const int64_t kv_width = static_cast<int64_t>(num_kv_heads) * head_dim;
  const int64_t qkv_width = q_width + 2 * kv_width;
  rotary_neox<float>(qkv_rows + h0 * head_dim, qkv_width, head_dim, T, h1 - h0, head_dim,
                     rows.positions, cos_sin, max_position, 1);
  rotary_neox<float>(qkv_rows + q_width + k0 * head_dim, qkv_width, head_dim, T, k1 - k0,
                     head_dim, rows.positions, cos_sin, max_position, 1);
  for (int64_t t = 0; t < T; ++t) {
    const int64_t slot = rows.slots[t];
    if (slot < 0) continue;
    const float* new_rows = qkv_rows + t * qkv_width + q_width;
    for (int k = k0; k < k1; ++k) {
      std::memcpy(layer.key_cache + slot * kv_width + k * head_dim, new_rows + k * head_dim,
                  sizeof(float) * head_dim);
      std::memcpy(layer.value_cache + slot * kv_width + k * head_dim,
                  new_rows + kv_width + k * head_dim, sizeof(float) * head_dim);
    }
  }
}

// A one-sequence step's row widths, and the calling thread's buffers for its T rows' qkv,
// attention output and gate/up projections, which a region's threads share (sized here;
// valid until the calling thread's next step).
struct StepRows {
  int64_t q_width, qkv_width, gate_up_width;
  float* qkv;
  float* attn;
  float* gate_up;
};

StepRows step_rows(int64_t T, int num_heads, int num_kv_heads, int head_dim, int intermediate) {
  thread_local std::vector<float> qkv, attn, gate_up;
  const int64_t q_width = static_cast<int64_t>(num_heads) * head_dim;
  const int64_t qkv_width = q_width + 2 * static_cast<int64_t>(num_kv_heads) * head_dim;
  const int64_t gate_up_width = 2 * static_cast<int64_t>(intermediate);
  qkv.resize(T * qkv_width);
  attn.resize(T * q_width);
  gate_up.resize(T * gate_up_width);
  return {q_width, qkv_width, gate_up_width, qkv.data(), attn.data(), gate_up.data()};
}

// The stack for the T rows of one sequence in one region, as described above.
// `kernels` holds every layer's share kernels (checked by the caller).
void one_sequence_region(const DecoderLayerWeights* layers, const ShareKernels* kernels,
                         int num_layers, float* hidden, float* residual, int H, int num_heads,
                         int num_kv_heads, int head_dim, int intermediate, int block_size,
                         const SequenceRows& rows, const float* cos_sin, int64_t max_position,
                         float eps, float scale, int num_threads) {
  const int64_t T = rows.T;
  const StepRows step = step_rows(T, num_heads, num_kv_heads, head_dim, intermediate);
#pragma omp parallel num_threads(num_threads)
  {
    const int part = omp_get_thread_num(), parts = omp_get_num_threads();
    thread_local ActivationCodes codes;
    thread_local std::vector<float> res, normed, act;  // this thread's own copies
    res.assign(hidden, hidden + T * H);  // layer 0: the residual is the input
    normed.resize(T * H);
    act.resize(T * intermediate);
    const int h0 = num_heads * part / parts, h1 = num_heads * (part + 1) / parts;
    const int k0 = num_kv_heads * part / parts, k1 = num_kv_heads * (part + 1) / parts;
    rms_norm<float>(hidden, H, nullptr, layers[0].input_norm, normed.data(), T, H, eps, 1);
    for (int l = 0; l < num_layers; ++l) {
      const DecoderLayerWeights& layer = layers[l];
      const ShareKernels& fns = kernels[l];
      if (l > 0)  // residual += hidden; normed = norm(residual)
        rms_norm<float>(hidden, H, res.data(), layer.input_norm, normed.data(), T, H, eps, 1);
      project_share(layer.qkv, fns.fn[0], normed.data(), T, H, step.qkv, step.qkv_width, codes,
                    part, parts);
      prefetch_share(layer.o, step.q_width, part, parts);
#pragma omp barrier
      rotate_and_write_kv(layer, step.qkv, rows, h0, h1, k0, k1, num_heads, num_kv_heads,
                          head_dim, cos_sin, max_position);
#pragma omp barrier
      for (int64_t t = 0; t < T; ++t)
        attend_heads_f32(step.qkv + t * step.qkv_width, layer.key_cache, layer.value_cache,
                         rows.table + t * rows.table_stride, rows.seq_lens[t], h0, h1,
                         num_heads, num_kv_heads, head_dim, block_size, scale,
                         step.attn + t * step.q_width);
#pragma omp barrier
      project_share(layer.o, fns.fn[1], step.attn, T, step.q_width, hidden, H, codes, part, parts);
      prefetch_share(layer.gate_up, H, part, parts);
#pragma omp barrier
      rms_norm<float>(hidden, H, res.data(), layer.post_norm, normed.data(), T, H, eps, 1);
      project_share(layer.gate_up, fns.fn[2], normed.data(), T, H, step.gate_up, step.gate_up_width,
                    codes, part, parts);
      prefetch_share(layer.down, intermediate, part, parts);
#pragma omp barrier
      silu_and_mul<float>(step.gate_up, step.gate_up_width, act.data(), T, intermediate, 1);
      project_share(layer.down, fns.fn[3], act.data(), T, intermediate, hidden, H, codes, part,
                    parts);
      if (l + 1 < num_layers) prefetch_share(layers[l + 1].qkv, H, part, parts);
#pragma omp barrier
    }
    if (part == 0) std::memcpy(residual, res.data(), sizeof(float) * T * H);
  }
}

// ------------------------------------- a verification step's rows in one parallel region
//
// one_sequence_region over T > 1 rows has every thread norm and quantize all T rows itself,
// four times a layer (about a tenth of a 5-row step). Here each thread norms, applies SiLU to
// and quantizes only its own rows (rows T * part / parts .. T * (part + 1) / parts: the same
// per-row arithmetic) into codes the threads share, and the threads meet at one more barrier
// before the tiles read them: four more barriers a layer, against half the per-row work.
// Attention is shared by (row, query head) pairs, not by heads alone (9 heads split 4/5).
// Every row is still the one-row step's, bit for bit.

// Rows m0 .. m0 + rows - 1 of `all` from `mine` (the same K and order, so every array's rows
// are as wide in both; `all` sized for them).
void put_code_rows(const ActivationCodes& mine, int64_t rows, int64_t m0, ActivationCodes& all) {
  auto put = [&](const auto& from, auto& to) {
    if (from.empty()) return;
    const int64_t width = static_cast<int64_t>(from.size()) / rows;
    std::copy(from.begin(), from.end(), to.begin() + m0 * width);
  };
  put(mine.q, all.q), put(mine.r, all.r), put(mine.d, all.d), put(mine.lane_d, all.lane_d);
  put(mine.bias_q, all.bias_q), put(mine.bias_r, all.bias_r), put(mine.gsum, all.gsum);
  put(mine.nq, all.nq), put(mine.nr, all.nr), put(mine.nlane_d, all.nlane_d);
  put(mine.nbias_q, all.nbias_q), put(mine.nbias_r, all.nbias_r);
  put(mine.v_even, all.v_even), put(mine.v_odd, all.v_odd);
}

// Room for T rows of K <= k_max codes in either order, for every group size.
void size_shared_codes(ActivationCodes& a, int64_t T, int64_t k_max) {
  const int64_t kp = (k_max + 63) / 64 * 64, kn = (k_max + 127) / 128 * 128;
  for (auto* v : {&a.q, &a.r}) v->resize(T * kp);
  for (auto* v : {&a.nq, &a.nr}) v->resize(T * kn);
  a.d.resize(T * kp / 32), a.lane_d.resize(T * kp / 4), a.nlane_d.resize(T * kn / 8);
  for (auto* v : {&a.bias_q, &a.bias_r}) v->resize(T * kp / 4);
  for (auto* v : {&a.nbias_q, &a.nbias_r}) v->resize(T * kn / 4);
  for (auto* v : {&a.v_even, &a.v_odd}) v->resize(T * kp / 2);
  a.gsum.resize(T * k_max);
}

// The shared codes part p of a projection reads: the slot of the first part of its run of
// parts with one layout (project_share quantizes again where the layout changes).
int code_slot(const QuantProjection& w, int p) {
  while (p > 0 && w.parts[p].group == w.parts[p - 1].group &&
         (w.parts[p].bits != 8) == (w.parts[p - 1].bits != 8))
    --p;
  return p;
}

// This thread's rows m0 .. m1 - 1 of x[T, K] (x at row m0), quantized for each layout of the
// projection into `shared` (part 0 also sets the order's widths). A barrier must follow
// before project_rows_share reads them.
void quantize_rows_share(const QuantProjection& w, const float* x, int64_t m0, int64_t m1,
                         int64_t K, ActivationCodes& mine, ActivationCodes* shared, int part) {
  for (int p = 0; p < w.num_parts; ++p) {
    if (code_slot(w, p) != p) continue;
    ActivationCodes& all = shared[p];
    if (part == 0) all.kp = (K + 63) / 64 * 64, all.kn = (K + 127) / 128 * 128;
    if (m1 <= m0) continue;
    // T > 1 here (verify_rows_region): the tiles read the int16 pairs of every row
    quantize_activations(x, K, m1 - m0, K, w.parts[p].group, mine, w.parts[p].bits != 8, true);
    put_code_rows(mine, m1 - m0, m0, all);
  }
}

// This thread's share of y[T, N] = x[T, K] @ W^T from the shared codes of every row.
void project_rows_share(const QuantProjection& w, const VnniRowsShare (&fn)[kMaxParts],
                        const ActivationCodes* shared, int64_t T, int64_t K, float* y, int64_t N,
                        int part, int parts) {
  int64_t column = 0;
  for (int p = 0; p < w.num_parts; ++p) {
    const QuantPart& wp = w.parts[p];
    fn[p](shared[code_slot(w, p)], T, K, wp.codes, wp.rows, wp.scales, wp.offsets, y + column,
          N, part, parts);
    column += wp.rows;
  }
}

// The stack for T > 1 rows of one sequence in one region, as described above.
void verify_rows_region(const DecoderLayerWeights* layers, const ShareKernels* kernels,
                        int num_layers, float* hidden, float* residual, int H, int num_heads,
                        int num_kv_heads, int head_dim, int intermediate, int block_size,
                        const SequenceRows& rows, const float* cos_sin, int64_t max_position,
                        float eps, float scale, int num_threads) {
  const int64_t T = rows.T;
  const StepRows step = step_rows(T, num_heads, num_kv_heads, head_dim, intermediate);
  thread_local ActivationCodes shared[kMaxParts];
  for (ActivationCodes& a : shared)
    size_shared_codes(a, T, std::max<int64_t>({H, step.q_width, intermediate}));
  ActivationCodes* const codes = shared;
#pragma omp parallel num_threads(num_threads)
  {
    const int part = omp_get_thread_num(), parts = omp_get_num_threads();
    thread_local ActivationCodes mine;
    thread_local std::vector<float> res, normed, act;  // this thread's rows (others unused)
    const int64_t m0 = T * part / parts, m1 = T * (part + 1) / parts, own = m1 - m0;
    res.resize(T * H);
    normed.resize(T * H);
    act.resize(T * intermediate);
    std::copy(hidden + m0 * H, hidden + m1 * H, res.begin() + m0 * H);  // layer 0: the input
    float* const my_res = res.data() + m0 * H;
    float* const my_normed = normed.data() + m0 * H;
    const int k0 = num_kv_heads * part / parts, k1 = num_kv_heads * (part + 1) / parts;
    const int h0 = num_heads * part / parts, h1 = num_heads * (part + 1) / parts;
    const int64_t pairs = T * num_heads;  // (row, query head), for attention
    const int64_t p0 = pairs * part / parts, p1 = pairs * (part + 1) / parts;
    if (own > 0)
      rms_norm<float>(hidden + m0 * H, H, nullptr, layers[0].input_norm, my_normed, own, H, eps,
                      1);
    for (int l = 0; l < num_layers; ++l) {
      const DecoderLayerWeights& layer = layers[l];
      const ShareKernels& fns = kernels[l];
      if (l > 0 && own > 0)  // residual += hidden; normed = norm(residual)
        rms_norm<float>(hidden + m0 * H, H, my_res, layer.input_norm, my_normed, own, H, eps, 1);
      quantize_rows_share(layer.qkv, my_normed, m0, m1, H, mine, codes, part);
#pragma omp barrier
      project_rows_share(layer.qkv, fns.fn[0], codes, T, H, step.qkv, step.qkv_width, part, parts);
      prefetch_share(layer.o, step.q_width, part, parts);
#pragma omp barrier
      rotate_and_write_kv(layer, step.qkv, rows, h0, h1, k0, k1, num_heads, num_kv_heads,
                          head_dim, cos_sin, max_position);
#pragma omp barrier
      for (int64_t t = p0 / num_heads; t * num_heads < p1; ++t) {  // this thread's pairs
        const int a0 = static_cast<int>(std::max<int64_t>(p0 - t * num_heads, 0));
        const int a1 = static_cast<int>(std::min<int64_t>(p1 - t * num_heads, num_heads));
        attend_heads_f32(step.qkv + t * step.qkv_width, layer.key_cache, layer.value_cache,
                         rows.table + t * rows.table_stride, rows.seq_lens[t], a0, a1,
                         num_heads, num_kv_heads, head_dim, block_size, scale,
                         step.attn + t * step.q_width);
      }
#pragma omp barrier
      quantize_rows_share(layer.o, step.attn + m0 * step.q_width, m0, m1, step.q_width, mine,
                          codes, part);
#pragma omp barrier
      project_rows_share(layer.o, fns.fn[1], codes, T, step.q_width, hidden, H, part, parts);
      prefetch_share(layer.gate_up, H, part, parts);
#pragma omp barrier
      if (own > 0)
        rms_norm<float>(hidden + m0 * H, H, my_res, layer.post_norm, my_normed, own, H, eps, 1);
      quantize_rows_share(layer.gate_up, my_normed, m0, m1, H, mine, codes, part);
#pragma omp barrier
      project_rows_share(layer.gate_up, fns.fn[2], codes, T, H, step.gate_up, step.gate_up_width,
                         part, parts);
      prefetch_share(layer.down, intermediate, part, parts);
#pragma omp barrier
      float* const my_act = act.data() + m0 * intermediate;
      if (own > 0)
        silu_and_mul<float>(step.gate_up + m0 * step.gate_up_width, step.gate_up_width, my_act, own,
                            intermediate, 1);
      quantize_rows_share(layer.down, my_act, m0, m1, intermediate, mine, codes, part);
#pragma omp barrier
      project_rows_share(layer.down, fns.fn[3], codes, T, intermediate, hidden, H, part, parts);
      if (l + 1 < num_layers) prefetch_share(layers[l + 1].qkv, H, part, parts);
#pragma omp barrier
    }
    std::copy(my_res, my_res + own * H, residual + m0 * H);
  }
}

// Whether the step takes one_sequence_region (and, if so, runs it): T >= 1 rows of one
// sequence on the VNNI integer path, fp32 attention's vector form, every projection's
// layouts held. Returns 1 if taken, 0 if not (the caller runs the op-by-op path), or the
// op-by-op path's error code for arguments it would refuse (checked before any write).
int try_one_sequence(const DecoderLayerWeights* layers, int num_layers, float* hidden,
                     float* residual, int H, int num_heads, int num_kv_heads, int head_dim,
                     int intermediate, int64_t table_cols, int64_t num_blocks, int block_size,
                     const SequenceRows& rows, const float* cos_sin, int64_t max_position,
                     float eps, float scale, RowMode mode, int num_threads) {
  const int64_t T = rows.T;
  if (one_region_choice == 0 || T < 1 || mode != RowMode::kInteger ||
      quantized_isa(-1) != kAvx512Vnni || head_dim % 16 != 0 || num_kv_heads <= 0 ||
      num_heads % num_kv_heads != 0 || block_size <= 0 || num_layers < 1)
    return 0;
  const int64_t q_width = static_cast<int64_t>(num_heads) * head_dim;
  const int64_t kv_width = static_cast<int64_t>(num_kv_heads) * head_dim;
  thread_local std::vector<ShareKernels> kernels;
  kernels.resize(num_layers);
  for (int l = 0; l < num_layers; ++l) {
    const DecoderLayerWeights& w = layers[l];
    VnniRowsShare(&fn)[4][kMaxParts] = kernels[l].fn;
    if (!(share_kernels(w.qkv, H, q_width + 2 * kv_width, fn[0]) &&
          share_kernels(w.o, q_width, H, fn[1]) &&
          share_kernels(w.gate_up, H, 2 * static_cast<int64_t>(intermediate), fn[2]) &&
          share_kernels(w.down, intermediate, H, fn[3])))
      return 0;
  }
  // what the op-by-op kernels check (rotary, write_kv, decode_attention), in their order
  for (int64_t t = 0; t < T; ++t)
    if (rows.positions[t] < 0 || rows.positions[t] >= max_position) return -2;
  for (int64_t t = 0; t < T; ++t)
    if (rows.slots[t] >= num_blocks * block_size) return -2;
  for (int64_t t = 0; t < T; ++t) {
    const int64_t len = rows.seq_lens[t];
    if (len < 1 || (len + block_size - 1) / block_size > table_cols) return -2;
    const int32_t* table = rows.table + t * rows.table_stride;
    for (int64_t b = 0; b < (len + block_size - 1) / block_size; ++b)
      if (table[b] < 0 || table[b] >= num_blocks) return -3;
  }
  if (T > 1 && verify_rows_choice != 0)
    verify_rows_region(layers, kernels.data(), num_layers, hidden, residual, H, num_heads,
                       num_kv_heads, head_dim, intermediate, block_size, rows, cos_sin,
                       max_position, eps, scale, num_threads);
  else
    one_sequence_region(layers, kernels.data(), num_layers, hidden, residual, H, num_heads,
                        num_kv_heads, head_dim, intermediate, block_size, rows, cos_sin,
                        max_position, eps, scale, num_threads);
  return 1;
}
#endif

}  // namespace
