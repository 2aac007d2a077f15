// Decode attention over a paged KV cache (fp32, bf16; vdpbf16ps where the CPU has it).
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

// ------------------------------------------------------------------ attention

// The rows of tokens first .. first + 15 of a sequence in a paged cache (a token past
// len repeats the last one: its lanes are computed and never stored).
template <typename T>
inline void token_rows(const T* cache, const int32_t* table, int first, int len, int block_size,
                       int64_t token_stride, int64_t block_stride, const T* (&rows)[16]) {
  if (block_size % 16 == 0 && first % 16 == 0) {  // one block holds them: no divisions
    const int last = std::min(15, len - 1 - first);
    const T* row = cache + table[first / block_size] * block_stride +
                   (first % block_size) * token_stride;
    for (int t = 0; t < 16; ++t) rows[t] = row + std::min(t, last) * token_stride;
    return;
  }
  for (int t = 0; t < 16; ++t) {
    const int token = std::min(first + t, len - 1);
    rows[t] = cache + table[token / block_size] * block_stride + (token % block_size) * token_stride;
  }
}

// Prefetch the share of part `part` of `parts` of the 16 rows (row_bytes each): the next
// chunk's rows are fetched while this chunk computes (blocks lie anywhere in the pool, so
// the hardware's stream prefetcher would start afresh at each one).
template <typename T>
inline void prefetch_rows(const T* const (&rows)[16], int64_t row_bytes, int part, int parts) {
  for (int t = part * 16 / parts; t < (part + 1) * 16 / parts; ++t)
    for (int64_t b = 0; b < row_bytes; b += 64)
      __builtin_prefetch(reinterpret_cast<const char*>(rows[t]) + b, 0, 2);  // into L2
}

// A sequence's tokens 16 at a time, in order (a block's rows are contiguous, all kv heads):
// per chunk and query head, per_head(rows, first, n, h) with the chunk's 16 rows (`n` of them
// real). While it computes, the rows kChunksAhead chunks further on are prefetched into L2,
// a share per head; past the last chunk the prefetch runs on into `then` (the cache the next
// walk over the same table reads: the values after the keys), when given. A walk that does
// not continue such a prefetch (continued false) first prefetches its own opening chunks.
// Into L2, not L1: 16 rows of a chunk do not fit beside the current ones in L1, and at L1
// the prefetches measured 1.5x slower on this EPYC (fp32, batch 64, 192 tokens).
constexpr int kChunksAhead = 1;

template <typename T, typename PerHead>
inline void for_token_chunks(const T* cache, const T* then, bool continued, const int32_t* table,
                             int len, int num_heads, int block_size, int64_t token_stride,
                             int64_t block_stride, PerHead&& per_head) {
  const int64_t row_bytes = token_stride * static_cast<int64_t>(sizeof(T));
  const int chunks = (len + 15) / 16;
  const T* rows[16];
  const T* ahead[16];
  if (!continued)
    for (int c = 0; c < std::min(kChunksAhead, chunks); ++c) {
      token_rows(cache, table, c * 16, len, block_size, token_stride, block_stride, ahead);
      prefetch_rows(ahead, row_bytes, 0, 1);
    }
  for (int c = 0; c < chunks; ++c) {
    const int first = c * 16;
    const int n = std::min(16, len - first);
    token_rows(cache, table, first, len, block_size, token_stride, block_stride, rows);
    int target = c + kChunksAhead;
    const T* source = cache;
    if (target >= chunks) {
      target -= chunks;
      source = then;
    }
    const bool fetch = source != nullptr && target < chunks;
    if (fetch)
      token_rows(source, table, target * 16, len, block_size, token_stride, block_stride, ahead);
    for (int h = 0; h < num_heads; ++h) {
      if (fetch) prefetch_rows(ahead, row_bytes, h, num_heads);
      per_head(rows, first, n, h);
    }
  }
}

// Scores of one sequence, head_dim a multiple of 16: s[h * len + t] = q[h] . k_t (q already
// scaled), for the query heads first_head .. first_head + num_heads - 1 (q, s: those only). Per chunk and query head each token keeps one accumulator, and one lane_sums adds
// all 16 up.
template <typename T>
void seq_scores(const float* q, const T* key_cache, const T* value_cache, const int32_t* table,
                int len, int num_heads, int group, int head_dim, int block_size,
                int64_t token_stride, int64_t block_stride, float* s, int first_head = 0) {
  const int chunks = head_dim / 16;
  for_token_chunks(key_cache, value_cache, false, table, len, num_heads, block_size,
                   token_stride, block_stride,
                   [&](const T* const (&rows)[16], int first, int n, int h) {
    const int64_t head = ((first_head + h) / group) * head_dim;
    const float* qh = q + h * head_dim;
    attn_f32x16 acc[16];
    for (int t = 0; t < 16; ++t) acc[t] = attn_f32x16{};
    for (int c = 0; c < chunks; ++c) {
      const attn_f32x16 qc = attn_load(qh + c * 16);
#pragma GCC unroll 16
      for (int t = 0; t < 16; ++t) acc[t] = attn_fma(qc, attn_load(rows[t] + head + c * 16), acc[t]);
    }
    const attn_f32x16 sums = lane_sums(acc);
    float lanes[16];
    std::memcpy(lanes, &sums, sizeof(lanes));
    std::memcpy(s + static_cast<int64_t>(h) * len + first, lanes, sizeof(float) * n);
  });
}

// W consecutive 16-wide slices of one head's acc (out) += sum over the n tokens of
// ph[t] * rows[t][slice]: 2 W accumulator chains (even and odd tokens), so the FMAs run
// at their throughput, not their latency (one chain per slice measured 2x slower).
template <int W, typename T>
inline void weighted_slices(const float* ph, const T* const (&rows)[16], int n, int64_t offset,
                            float* out) {
  attn_f32x16 even[W], odd[W];
#pragma GCC unroll 8
  for (int i = 0; i < W; ++i) {
    even[i] = attn_load(out + i * 16);
    odd[i] = attn_f32x16{};
  }
  int t = 0;
  for (; t + 2 <= n; t += 2) {
    const attn_f32x16 pe = attn_f32x16{} + ph[t], po = attn_f32x16{} + ph[t + 1];
#pragma GCC unroll 8
    for (int i = 0; i < W; ++i) {
      even[i] = attn_fma(pe, attn_load(rows[t] + offset + i * 16), even[i]);
      odd[i] = attn_fma(po, attn_load(rows[t + 1] + offset + i * 16), odd[i]);
    }
  }
  if (t < n) {
    const attn_f32x16 pe = attn_f32x16{} + ph[t];
#pragma GCC unroll 8
    for (int i = 0; i < W; ++i) even[i] = attn_fma(pe, attn_load(rows[t] + offset + i * 16), even[i]);
  }
#pragma GCC unroll 8
  for (int i = 0; i < W; ++i) {
    const attn_f32x16 sum = even[i] + odd[i];
    std::memcpy(out + i * 16, &sum, sizeof(sum));
  }
}

// acc[h] (head_dim floats each) = sum over t of p[h * len + t] * v_t, head_dim a multiple of
// 16, for the query heads from first_head (as seq_scores); the tokens walked as in seq_scores.
// Per chunk and query head, up to 4 slices of the head at once (weighted_slices).
template <typename T>
void seq_weighted_values(const float* p, const T* value_cache, const int32_t* table, int len,
                         int num_heads, int group, int head_dim, int block_size,
                         int64_t token_stride, int64_t block_stride, float* acc,
                         int first_head = 0) {
  const int slices = head_dim / 16;
  std::fill(acc, acc + static_cast<int64_t>(num_heads) * head_dim, 0.f);
  for_token_chunks(value_cache, static_cast<const T*>(nullptr), true, table, len, num_heads,
                   block_size, token_stride, block_stride,
                   [&](const T* const (&rows)[16], int first, int n, int h) {
    const int64_t head = ((first_head + h) / group) * head_dim;
    const float* ph = p + static_cast<int64_t>(h) * len + first;
    float* out = acc + static_cast<int64_t>(h) * head_dim;
    int c = 0;
    for (; c + 4 <= slices; c += 4) weighted_slices<4>(ph, rows, n, head + c * 16, out + c * 16);
    switch (slices - c) {
      case 3: weighted_slices<3>(ph, rows, n, head + c * 16, out + c * 16); break;
      case 2: weighted_slices<2>(ph, rows, n, head + c * 16, out + c * 16); break;
      case 1: weighted_slices<1>(ph, rows, n, head + c * 16, out + c * 16); break;
      default: break;
    }
  });
}

// ---- bf16 with AVX512_BF16: the same two passes on vdpbf16ps (pairs of bf16 products
// summed into fp32), q and p rounded to bf16 first as the plain-torch reference rounds them
// (q * scale and the probabilities are bf16 tensors there). head_dim a multiple of 32.
// Compiled for that ISA whatever the build flags; called only where the CPU has it
// (attention_bf16_dot).
#if (defined(__x86_64__) || defined(_M_X64)) && defined(__GNUC__)
#define LEGATO_ATTN_BF16_DOT 1
#define LEGATO_BF16_DOT __attribute__((target("avx512f,avx512bw,avx512bf16")))

struct ScoresBf16Dot {  // s[h * len + t] = qb[h] . k_t
  const bf16* qb;
  int group, head_dim, len;
  float* s;
  LEGATO_BF16_DOT void operator()(const bf16* const (&rows)[16], int first, int n, int h) const {
    const int64_t head = (h / group) * head_dim;
    const bf16* qh = qb + h * head_dim;
    attn_f32x16 acc[16];
    for (int t = 0; t < 16; ++t) acc[t] = attn_f32x16{};
    for (int c = 0; c < head_dim; c += 32) {
      const __m512bh qc = reinterpret_cast<__m512bh>(_mm512_loadu_si512(qh + c));
#pragma GCC unroll 16
      for (int t = 0; t < 16; ++t)
        acc[t] = reinterpret_cast<attn_f32x16>(_mm512_dpbf16_ps(
            reinterpret_cast<__m512>(acc[t]), qc,
            reinterpret_cast<__m512bh>(_mm512_loadu_si512(rows[t] + head + c))));
    }
    const attn_f32x16 sums = lane_sums(acc);
    float lanes[16];
    std::memcpy(lanes, &sums, sizeof(lanes));
    std::memcpy(s + static_cast<int64_t>(h) * len + first, lanes, sizeof(float) * n);
  }
};

// acc[h] += sum over t of pb[h * padded + t] * v_t, two tokens per vdpbf16ps: the rows of
// tokens t and t + 1 interleaved (unpacklo / unpackhi of 16-bit words) meet the pair
// (p_t, p_t+1). The accumulators hold each 32-wide slice of a head permuted: dims 8k..8k+3
// in lanes 4k.. of the low half, dims 8k+4..8k+7 in the high half (unpermute_bf16_dot).
// An odd count pairs its last token with a probability of 0 (the padding of pb). Up to 4
// slices of a head at once (8 accumulator chains: vdpbf16ps at its throughput, not its
// latency; one slice at a time measured slower).
template <int W>
LEGATO_BF16_DOT inline void values_bf16_slices(const bf16* ph, const bf16* const (&rows)[16],
                                               int n, int64_t offset, float* out) {
  __m512 lo[W], hi[W];
#pragma GCC unroll 4
  for (int i = 0; i < W; ++i) {
    lo[i] = _mm512_loadu_ps(out + i * 32);
    hi[i] = _mm512_loadu_ps(out + i * 32 + 16);
  }
  for (int t = 0; t < n; t += 2) {
    uint32_t pair;
    std::memcpy(&pair, ph + t, sizeof(pair));
    const __m512bh w = reinterpret_cast<__m512bh>(_mm512_set1_epi32(static_cast<int>(pair)));
#pragma GCC unroll 4
    for (int i = 0; i < W; ++i) {
      const __m512i a = _mm512_loadu_si512(rows[t] + offset + i * 32);
      const __m512i b = _mm512_loadu_si512(rows[t + 1] + offset + i * 32);
      lo[i] = _mm512_dpbf16_ps(lo[i], w, reinterpret_cast<__m512bh>(_mm512_unpacklo_epi16(a, b)));
      hi[i] = _mm512_dpbf16_ps(hi[i], w, reinterpret_cast<__m512bh>(_mm512_unpackhi_epi16(a, b)));
    }
  }
#pragma GCC unroll 4
  for (int i = 0; i < W; ++i) {
    _mm512_storeu_ps(out + i * 32, lo[i]);
    _mm512_storeu_ps(out + i * 32 + 16, hi[i]);
  }
}

struct ValuesBf16Dot {
  const bf16* pb;
  int group, head_dim, padded;
  float* acc;
  LEGATO_BF16_DOT void operator()(const bf16* const (&rows)[16], int first, int n, int h) const {
    const int64_t head = (h / group) * head_dim;
    const bf16* ph = pb + static_cast<int64_t>(h) * padded + first;
    float* out = acc + h * head_dim;
    const int slices = head_dim / 32;
    int c = 0;
    for (; c + 4 <= slices; c += 4) values_bf16_slices<4>(ph, rows, n, head + c * 32, out + c * 32);
    switch (slices - c) {
      case 3: values_bf16_slices<3>(ph, rows, n, head + c * 32, out + c * 32); break;
      case 2: values_bf16_slices<2>(ph, rows, n, head + c * 32, out + c * 32); break;
      case 1: values_bf16_slices<1>(ph, rows, n, head + c * 32, out + c * 32); break;
      default: break;
    }
  }
};

// Each 32-wide slice of acc back in dimension order (see ValuesBf16Dot).
inline void unpermute_bf16_dot(float* acc, int64_t size) {
  for (int64_t c = 0; c < size; c += 32) {
    const attn_f32x16 lo = attn_load(acc + c), hi = attn_load(acc + c + 16);
    const attn_f32x16 first = __builtin_shufflevector(lo, hi, 0, 1, 2, 3, 16, 17, 18, 19, 4, 5,
                                                      6, 7, 20, 21, 22, 23);
    const attn_f32x16 second = __builtin_shufflevector(lo, hi, 8, 9, 10, 11, 24, 25, 26, 27, 12,
                                                       13, 14, 15, 28, 29, 30, 31);
    std::memcpy(acc + c, &first, sizeof(first));
    std::memcpy(acc + c + 16, &second, sizeof(second));
  }
}

bool cpu_has_bf16_dot() {
  __builtin_cpu_init();
  return __builtin_cpu_supports("avx512bf16") && __builtin_cpu_supports("avx512bw");
}
#else
bool cpu_has_bf16_dot() { return false; }
#endif

int bf16_dot_choice = -1;  // set once (attention_bf16_dot), read by every bf16 attention call

// Whether bf16 decode attention runs on vdpbf16ps (1) or widens to fp32 (0): the CPU's best,
// or with request >= 0 the lower of request and that best (tests pin the fallback so).
int attention_bf16_dot(int request) {
  return choose_path(bf16_dot_choice, request, cpu_has_bf16_dot() ? 1 : 0);
}

// The same two passes for any head_dim, one dot / axpy per token and head.
template <typename T>
void seq_scores_scalar(const float* q, const T* key_cache, const T*, const int32_t* table,
                       int len, int num_heads, int group, int head_dim, int block_size,
                       int64_t token_stride, int64_t block_stride, float* s) {
  for (int start = 0; start < len; start += block_size) {
    const T* keys = key_cache + table[start / block_size] * block_stride;
    const int n = std::min(block_size, len - start);
    for (int t = 0; t < n; ++t) {
      const T* k = keys + t * token_stride;
      for (int h = 0; h < num_heads; ++h)
        s[h * len + start + t] = dot(&q[h * head_dim], k + (h / group) * head_dim, head_dim);
    }
  }
}

template <typename T>
void seq_weighted_values_scalar(const float* p, const T* value_cache, const int32_t* table,
                                int len, int num_heads, int group, int head_dim, int block_size,
                                int64_t token_stride, int64_t block_stride, float* acc) {
  std::fill(acc, acc + static_cast<int64_t>(num_heads) * head_dim, 0.f);
  for (int start = 0; start < len; start += block_size) {
    const T* values = value_cache + table[start / block_size] * block_stride;
    const int n = std::min(block_size, len - start);
    for (int t = 0; t < n; ++t) {
      const T* v = values + t * token_stride;
      for (int h = 0; h < num_heads; ++h)
        axpy(p[h * len + start + t], v + (h / group) * head_dim, &acc[h * head_dim], head_dim);
    }
  }
}

// Each of `heads` rows of `len` scores becomes its softmax numerators exp(s - max) in
// place; totals[h] gets row h's sum (the caller divides once at the end).
inline void softmax_numerators(float* s, int heads, int len, float* totals) {
  for (int h = 0; h < heads; ++h) {
    float* row = s + static_cast<int64_t>(h) * len;
    const float top = max_of(row, len);
    float total = 0.f;
#pragma omp simd reduction(+ : total)
    for (int t = 0; t < len; ++t) {
      row[t] = exp_approx(row[t] - top);
      total += row[t];
    }
    totals[h] = total;
  }
}

// Attention of one query row per sequence (decode) over that sequence's paged K/V.
//
// query  [num_seqs, num_heads, head_dim] with strides (q_seq_stride, q_head_stride, 1)
// caches [num_blocks, block_size, num_kv_heads, head_dim], contiguous
// block_table [num_seqs, >= ceil(seq_len / block_size)] int32, row stride table_stride
// seq_lens [num_seqs] int32 (>= 1): keys 0..seq_len-1 are attended, all of them
// (checked first: every length fits the table's table_cols columns, every block id used
// is in [0, num_blocks); -2 / -3 otherwise)
// out    [num_seqs, num_heads, head_dim], contiguous
//
// One work item per sequence, so each token's K/V row (all kv heads) is read once,
// contiguously, by one thread. Two passes over the blocks, reading the cache in place:
// scores (K), then the softmax-weighted sum (V). Accumulates in fp32. A head_dim that is a
// multiple of 16 takes the vector passes (seq_scores, seq_weighted_values); others the
// scalar ones.
template <typename T>
int decode_attention(const T* query, int64_t q_seq_stride, int64_t q_head_stride,
                     const T* key_cache, const T* value_cache, const int32_t* block_table,
                     int64_t table_stride, int64_t table_cols, int64_t num_blocks,
                     const int32_t* seq_lens, T* out, int64_t num_seqs, int num_heads,
                     int num_kv_heads, int head_dim, int block_size, float scale,
                     int num_threads) {
  if (num_kv_heads <= 0 || num_heads % num_kv_heads != 0 || head_dim <= 0 || block_size <= 0)
    return -1;
  for (int64_t seq = 0; seq < num_seqs; ++seq) {  // every read stays inside the cache
    const int64_t len = seq_lens[seq];
    if (len < 1 || (len + block_size - 1) / block_size > table_cols) return -2;
    const int32_t* table = block_table + seq * table_stride;
    for (int64_t b = 0; b < (len + block_size - 1) / block_size; ++b)
      if (table[b] < 0 || table[b] >= num_blocks) return -3;
  }
  const int group = num_heads / num_kv_heads;
  const int64_t token_stride = static_cast<int64_t>(num_kv_heads) * head_dim;
  const int64_t block_stride = token_stride * block_size;
  const bool vector = head_dim % 16 == 0;
  const bool bf16_dot = std::is_same<T, bf16>::value && head_dim % 32 == 0 &&
                        attention_bf16_dot(-1) == 1;
#pragma omp parallel num_threads(num_threads)
  {
    std::vector<float> q(static_cast<size_t>(num_heads) * head_dim);
    std::vector<float> acc(q.size());
    std::vector<float> scores;  // [num_heads, seq_len]
    std::vector<float> totals(num_heads);
    std::vector<bf16> q_bf16, p_bf16;  // the bf16_dot path's q and [num_heads, padded] p
#pragma omp for schedule(dynamic, 1)
    for (int64_t seq = 0; seq < num_seqs; ++seq) {
      const int len = seq_lens[seq];
      const int32_t* table = block_table + seq * table_stride;
      for (int h = 0; h < num_heads; ++h) {
        const T* src = query + seq * q_seq_stride + h * q_head_stride;
        for (int d = 0; d < head_dim; ++d) q[h * head_dim + d] = to_float(src[d]) * scale;
      }
      scores.resize(static_cast<size_t>(len) * num_heads);
      float* s = scores.data();
#if defined(LEGATO_ATTN_BF16_DOT)
      if constexpr (std::is_same<T, bf16>::value) {
        if (bf16_dot) {
          q_bf16.resize(q.size());
          for (size_t i = 0; i < q.size(); ++i) q_bf16[i] = round_bf16(q[i]);
          for_token_chunks(key_cache, value_cache, false, table, len, num_heads, block_size,
                           token_stride, block_stride,
                           ScoresBf16Dot{q_bf16.data(), group, head_dim, len, s});
        }
      }
#endif
      if (!bf16_dot && vector)
        seq_scores<T>(q.data(), key_cache, value_cache, table, len, num_heads, group, head_dim,
                      block_size, token_stride, block_stride, s);
      else if (!bf16_dot)
        seq_scores_scalar<T>(q.data(), key_cache, value_cache, table, len, num_heads, group,
                             head_dim, block_size, token_stride, block_stride, s);
      softmax_numerators(s, num_heads, len, totals.data());
#if defined(LEGATO_ATTN_BF16_DOT)
      if constexpr (std::is_same<T, bf16>::value) {
        if (bf16_dot) {
          const int padded = len + (len & 1);
          p_bf16.assign(static_cast<size_t>(padded) * num_heads, 0);
          for (int h = 0; h < num_heads; ++h)
            for (int t = 0; t < len; ++t)
              p_bf16[static_cast<size_t>(h) * padded + t] = round_bf16(s[h * len + t]);
          std::fill(acc.begin(), acc.end(), 0.f);
          for_token_chunks(value_cache, static_cast<const T*>(nullptr), true, table, len,
                           num_heads, block_size, token_stride, block_stride,
                           ValuesBf16Dot{p_bf16.data(), group, head_dim, padded, acc.data()});
          unpermute_bf16_dot(acc.data(), static_cast<int64_t>(acc.size()));
        }
      }
#endif
      if (!bf16_dot && vector)
        seq_weighted_values<T>(s, value_cache, table, len, num_heads, group, head_dim,
                               block_size, token_stride, block_stride, acc.data());
      else if (!bf16_dot)
        seq_weighted_values_scalar<T>(s, value_cache, table, len, num_heads, group, head_dim,
                                      block_size, token_stride, block_stride, acc.data());
      T* dst = out + seq * num_heads * static_cast<int64_t>(head_dim);
      for (int h = 0; h < num_heads; ++h) {
        const float inv = 1.f / totals[h];
        for (int d = 0; d < head_dim; ++d) store(acc[h * head_dim + d] * inv, dst + h * head_dim + d);
      }
    }
  }
  return 0;
}


// One fp32 sequence's attention for query heads h0 .. h1 - 1 only (head_dim a multiple of
// 16, the table and len already checked as decode_attention checks them): what
// decode_attention computes for those heads, bit for bit (the same passes per head), so
// that one sequence's heads can be shared among threads. query: the sequence's row
// [num_heads, head_dim] (contiguous heads); out: the same shape, heads h0 .. h1 - 1 written.
void attend_heads_f32(const float* query, const float* key_cache, const float* value_cache,
                      const int32_t* table, int len, int h0, int h1, int num_heads,
                      int num_kv_heads, int head_dim, int block_size, float scale, float* out) {
  const int heads = h1 - h0;
  if (heads <= 0) return;
  const int group = num_heads / num_kv_heads;
  const int64_t token_stride = static_cast<int64_t>(num_kv_heads) * head_dim;
  const int64_t block_stride = token_stride * block_size;
  thread_local std::vector<float> q, acc, scores, totals;
  q.resize(static_cast<size_t>(heads) * head_dim);
  acc.resize(q.size());
  scores.resize(static_cast<size_t>(len) * heads);
  totals.resize(heads);
  for (int h = 0; h < heads; ++h)
    for (int d = 0; d < head_dim; ++d)
      q[h * head_dim + d] = query[(h0 + h) * head_dim + d] * scale;
  float* s = scores.data();
  seq_scores<float>(q.data(), key_cache, value_cache, table, len, heads, group, head_dim,
                    block_size, token_stride, block_stride, s, h0);
  softmax_numerators(s, heads, len, totals.data());
  seq_weighted_values<float>(s, value_cache, table, len, heads, group, head_dim, block_size,
                             token_stride, block_stride, acc.data(), h0);
  for (int h = 0; h < heads; ++h) {
    const float inv = 1.f / totals[h];
    for (int d = 0; d < head_dim; ++d) out[(h0 + h) * head_dim + d] = acc[h * head_dim + d] * inv;
  }
}

}  // namespace
