// CPU kernels for legato's torch backend: plain C++17 with OpenMP, no torch headers.
//
// Built on first use by legato/models/cpu_kernels.py (g++ -O3 -march=native -fopenmp)
// and loaded with ctypes. OpenMP binds to the libgomp that torch has already loaded
// (same soname), so these loops share torch's thread pool instead of adding a second one.
// Tensors arrive as raw pointers plus the strides the Python side checked; bf16 travels
// as uint16_t bit patterns. Every entry point returns 0, or a negative code for
// arguments it cannot take.
//
// Numerics follow the plain-torch versions in torch_ops.py (and so transformers): fp32
// math throughout, and in bf16 the same rounding points as the torch ops they replace.

#include <algorithm>
#include <cmath>
#include <cstdint>
#include <cstring>
#include <vector>

#include <type_traits>

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

// ------------------------------------------------------------------ attention

// Vectors of 16 floats for the attention kernels (GCC vector types: one register with
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

// The rows of tokens first .. first + 15 of a sequence in a paged cache (a token past
// len repeats the last one: its lanes are computed and never stored).
template <typename T>
inline void token_rows(const T* cache, const int32_t* table, int first, int len, int block_size,
                       int64_t token_stride, int64_t block_stride, const T* (&rows)[16]) {
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
// scaled). Per chunk and query head each token keeps one accumulator, and one lane_sums adds
// all 16 up.
template <typename T>
void seq_scores(const float* q, const T* key_cache, const T* value_cache, const int32_t* table,
                int len, int num_heads, int group, int head_dim, int block_size,
                int64_t token_stride, int64_t block_stride, float* s) {
  const int chunks = head_dim / 16;
  for_token_chunks(key_cache, value_cache, false, table, len, num_heads, block_size,
                   token_stride, block_stride,
                   [&](const T* const (&rows)[16], int first, int n, int h) {
    const int64_t head = (h / group) * head_dim;
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

// acc[h] (head_dim floats each) = sum over t of p[h * len + t] * v_t, head_dim a multiple of
// 16; the tokens walked as in seq_scores.
template <typename T>
void seq_weighted_values(const float* p, const T* value_cache, const int32_t* table, int len,
                         int num_heads, int group, int head_dim, int block_size,
                         int64_t token_stride, int64_t block_stride, float* acc) {
  const int chunks = head_dim / 16;
  std::fill(acc, acc + static_cast<int64_t>(num_heads) * head_dim, 0.f);
  for_token_chunks(value_cache, static_cast<const T*>(nullptr), true, table, len, num_heads,
                   block_size, token_stride, block_stride,
                   [&](const T* const (&rows)[16], int first, int n, int h) {
    const int64_t head = (h / group) * head_dim;
    const float* ph = p + static_cast<int64_t>(h) * len + first;
    for (int c = 0; c < chunks; ++c) {
      float* out = acc + h * head_dim + c * 16;
      attn_f32x16 even = attn_load(out), odd = attn_f32x16{};
      int t = 0;
      for (; t + 2 <= n; t += 2) {  // two chains: the FMA latency, not its throughput
        even = attn_fma(attn_f32x16{} + ph[t], attn_load(rows[t] + head + c * 16), even);
        odd = attn_fma(attn_f32x16{} + ph[t + 1], attn_load(rows[t + 1] + head + c * 16), odd);
      }
      if (t < n) even = attn_fma(attn_f32x16{} + ph[t], attn_load(rows[t] + head + c * 16), even);
      even += odd;
      std::memcpy(out, &even, sizeof(even));
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
// An odd count pairs its last token with a probability of 0 (the padding of pb).
struct ValuesBf16Dot {
  const bf16* pb;
  int group, head_dim, padded;
  float* acc;
  LEGATO_BF16_DOT void operator()(const bf16* const (&rows)[16], int first, int n, int h) const {
    const int64_t head = (h / group) * head_dim;
    const bf16* ph = pb + static_cast<int64_t>(h) * padded + first;
    for (int c = 0; c < head_dim; c += 32) {
      float* out = acc + h * head_dim + c;
      __m512 lo = _mm512_loadu_ps(out), hi = _mm512_loadu_ps(out + 16);
      for (int t = 0; t < n; t += 2) {
        const __m512i a = _mm512_loadu_si512(rows[t] + head + c);
        const __m512i b = _mm512_loadu_si512(rows[t + 1] + head + c);
        uint32_t pair;
        std::memcpy(&pair, ph + t, sizeof(pair));
        const __m512bh w = reinterpret_cast<__m512bh>(_mm512_set1_epi32(static_cast<int>(pair)));
        lo = _mm512_dpbf16_ps(lo, w, reinterpret_cast<__m512bh>(_mm512_unpacklo_epi16(a, b)));
        hi = _mm512_dpbf16_ps(hi, w, reinterpret_cast<__m512bh>(_mm512_unpackhi_epi16(a, b)));
      }
      _mm512_storeu_ps(out, lo);
      _mm512_storeu_ps(out + 16, hi);
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
  const int best = cpu_has_bf16_dot() ? 1 : 0;
  if (request >= 0) bf16_dot_choice = std::min(request, best);
  else if (bf16_dot_choice < 0) bf16_dot_choice = best;
  return bf16_dot_choice;
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
      if (!bf16_dot)
        (vector ? seq_scores<T> : seq_scores_scalar<T>)(q.data(), key_cache, value_cache, table,
                                                        len, num_heads, group, head_dim,
                                                        block_size, token_stride, block_stride, s);
      for (int h = 0; h < num_heads; ++h) {
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
      if (!bf16_dot)
        (vector ? seq_weighted_values<T> : seq_weighted_values_scalar<T>)(
            s, value_cache, table, len, num_heads, group, head_dim, block_size, token_stride,
            block_stride, acc.data());
      T* dst = out + seq * num_heads * static_cast<int64_t>(head_dim);
      for (int h = 0; h < num_heads; ++h) {
        const float inv = 1.f / totals[h];
        for (int d = 0; d < head_dim; ++d) store(acc[h * head_dim + d] * inv, dst + h * head_dim + d);
      }
    }
  }
  return 0;
}

// ------------------------------------------------------------------ kv write

// Copy rows of `row_bytes` from key/value (row strides in bytes) to the caches' slots
// (a slot is block * block_size + offset, i.e. a row of the flattened cache). Slots < 0
// are skipped (padding); a slot >= num_slots is refused (-2) before anything is written.
int write_kv(const char* key, int64_t key_stride, const char* value, int64_t value_stride,
             char* key_cache, char* value_cache, const int64_t* slots, int64_t num_tokens,
             int64_t num_slots, int64_t row_bytes, int num_threads) {
  for (int64_t t = 0; t < num_tokens; ++t)
    if (slots[t] >= num_slots) return -2;
#pragma omp parallel for schedule(static) num_threads(num_threads) if (num_tokens >= 64)
  for (int64_t t = 0; t < num_tokens; ++t) {
    if (slots[t] < 0) continue;
    std::memcpy(key_cache + slots[t] * row_bytes, key + t * key_stride, row_bytes);
    std::memcpy(value_cache + slots[t] * row_bytes, value + t * value_stride, row_bytes);
  }
  return 0;
}

// ------------------------------------------------------------- elementwise

// out = rms_norm(x) * weight over rows of `cols`; with `residual` (not null) first
// residual = x + residual (in place) and the sum is normalised. As torch_ops.rms_norm:
// normalised in fp32, rounded to T, then multiplied by the weight in T.
template <typename T>
int rms_norm(const T* x, int64_t x_stride, T* residual, const T* weight, T* out,
             int64_t rows, int64_t cols, float eps, int num_threads) {
  const bool fused = residual != nullptr;
#pragma omp parallel for schedule(static) num_threads(num_threads) if (rows * cols >= 16384)
  for (int64_t r = 0; r < rows; ++r) {
    const T* xr = x + r * x_stride;
    T* rr = fused ? residual + r * cols : nullptr;
    T* o = out + r * cols;
    float sum = 0.f;
    if (fused) {
#pragma omp simd reduction(+ : sum)
      for (int64_t c = 0; c < cols; ++c) {
        const float v = as_stored(to_float(xr[c]) + to_float(rr[c]), xr);
        store(v, rr + c);
        sum += v * v;
      }
    } else {
#pragma omp simd reduction(+ : sum)
      for (int64_t c = 0; c < cols; ++c) sum += to_float(xr[c]) * to_float(xr[c]);
    }
    const T* src = fused ? rr : xr;
    const float inv = 1.f / std::sqrt(sum / static_cast<float>(cols) + eps);
#pragma omp simd
    for (int64_t c = 0; c < cols; ++c)
      store(as_stored(to_float(src[c]) * inv, src) * to_float(weight[c]), o + c);
  }
  return 0;
}

// out[r, :d] = silu(x[r, :d]) * x[r, d:2d]; silu rounded to T before the product.
// Two passes per row (exp(-gate) into a scratch row, then the rest): gcc vectorises
// each far better than the fused loop.
template <typename T>
int silu_and_mul(const T* x, int64_t x_stride, T* out, int64_t rows, int64_t d,
                 int num_threads) {
#pragma omp parallel num_threads(num_threads) if (rows * d >= 16384)
  {
    std::vector<float> e(d);
#pragma omp for schedule(static)
    for (int64_t r = 0; r < rows; ++r) {
      const T* gate = x + r * x_stride;
      const T* up = gate + d;
      T* o = out + r * d;
#pragma omp simd
      for (int64_t c = 0; c < d; ++c) e[c] = exp_approx(-to_float(gate[c]));
#pragma omp simd
      for (int64_t c = 0; c < d; ++c) {
        const float g = to_float(gate[c]);
        store(as_stored(g / (1.f + e[c]), gate) * to_float(up[c]), o + c);
      }
    }
  }
  return 0;
}

// Neox rotary in place on x[t, h, :] for h < heads (strides tok_stride, head_stride, 1),
// at positions[t], from cos_sin [max_position, head_dim] fp32 (cos | sin halves). As
// torch_ops.rotate_neox: cos and sin rounded to T, x*cos rounded to T, then + rot*sin.
template <typename T>
int rotary_neox(T* x, int64_t tok_stride, int64_t head_stride, int64_t tokens, int heads,
                int head_dim, const int64_t* positions, const float* cos_sin,
                int64_t max_position, int num_threads) {
  for (int64_t t = 0; t < tokens; ++t)
    if (positions[t] < 0 || positions[t] >= max_position) return -2;
  const int half = head_dim / 2;
  const T* tag = nullptr;
#pragma omp parallel for schedule(static) num_threads(num_threads) if (tokens * heads >= 512)
  for (int64_t t = 0; t < tokens; ++t) {
    const float* cs = cos_sin + positions[t] * head_dim;
    for (int h = 0; h < heads; ++h) {
      T* v = x + t * tok_stride + h * head_stride;
#pragma omp simd
      for (int i = 0; i < half; ++i) {
        const float c = as_stored(cs[i], tag), s = as_stored(cs[half + i], tag);
        const float a = to_float(v[i]), b = to_float(v[half + i]);
        const float lo = as_stored(a * c, tag) - b * s;
        const float hi = as_stored(b * c, tag) + a * s;
        store(lo, v + i);
        store(hi, v + half + i);
      }
    }
  }
  return 0;
}

// ------------------------------------------------------------------ sampling

// out[r] = the first index of the largest value of row r (a NaN counts as largest).
int argmax_rows(const float* x, int64_t stride, int64_t rows, int64_t cols, int64_t* out,
                int num_threads) {
#pragma omp parallel for schedule(static) num_threads(num_threads) if (rows * cols >= 65536)
  for (int64_t r = 0; r < rows; ++r) {
    const float* row = x + r * stride;
    const int64_t first_nan = find_first(row, cols, [](float v) { return v != v; });
    if (first_nan < cols) {
      out[r] = first_nan;
      continue;
    }
    const float best = max_of(row, cols);
    out[r] = find_first(row, cols, [best](float v) { return v == best; });
  }
  return 0;
}


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
// legato.models.quantized; Python's cpu_kernels.QUANTIZED_LAYOUTS lists the same). Each
// dispatcher below expands X(bits, group) once per layout. (8, 16): no GGUF type repacks so
// today; kept for callers' layouts.
#define LEGATO_FOR_EACH_LAYOUT(X) X(4, 32) X(8, 32) X(5, 32) X(6, 16) X(8, 16)

int quantized_matmul(const float* x, int64_t ldx, int64_t M, int64_t K, const uint8_t* q,
                     int bits, int group, int64_t N, const float* scales, const float* mins,
                     float* y, int64_t ldy, int num_threads) {
  if (M < 0 || N < 0 || K <= 0 || K % 32 != 0 || ldx < K || ldy < N) return -1;
  const bool has_min = mins != nullptr;
#define LEGATO_F32(B, G)                                                                     \
  if (bits == B && group == G)                                                               \
    return has_min ? qmatmul<B, G, true>(x, ldx, M, K, q, N, scales, mins, y, ldy, num_threads) \
                   : qmatmul<B, G, false>(x, ldx, M, K, q, N, scales, mins, y, ldy, num_threads);
  LEGATO_FOR_EACH_LAYOUT(LEGATO_F32)
#undef LEGATO_F32
  return -2;
}


// ------------------------------------------------ quantized matmul, int8 activations
//
// The fast path: integer dot products as llama.cpp computes them, with activations held
// as two int8 digits. Each input row is quantized per block of 32 values: with
// y = x * 127 / max|x|, the high digit q = round(y) (ggml's q8_0 code) and the low digit
// r = round(256 * (y - q)) (clamped to +-127), so x = d * (256 q + r) with d = max|x| /
// (127 * 256), within d / 2 (about 1 / 65000 of the block's largest value). One int8 digit
// alone (llama.cpp's q8_0 activations) lost 6% teacher-forced top-1 agreement on the default
// model: the normed hidden states have outlier channels that coarsen whole blocks. Each
// group's sum(w_code * (256 q + r)) is exact in int32; y = sum_g s_g * d * dot_g +
// m_g * sum(x_g) (the offset term uses the exact fp32 sum of x over the group).
//
// Paths, chosen at run time (quantized_isa): AVX-512 VNNI (vpdpbusd: u8 x s8 -> s32, 64
// codes an instruction), AVX2 (vpmaddubsw + vpmaddwd, 32 codes), and portable C++. Each
// ISA path is compiled with a target attribute, so one build holds all three whatever
// -march says, and __builtin_cpu_supports picks the best this CPU runs (a test can ask for
// a lower one).
//
// vpdpbusd wants unsigned weights: 8-bit codes are biased by 128 (code ^ 0x80) and the bias
// is taken back exactly by starting each lane's sum at -128 * (its 4 activation codes' sum).
// vpmaddubsw saturates at 16 bits, so AVX2 uses |w| * sign(x, w) instead (|w| <= 128).

struct ActivationCodes {
  int64_t kp = 0;              // K rounded up to 64 (codes past K are 0)
  std::vector<int8_t> q;       // [M, kp] high digits
  std::vector<int8_t> r;       // [M, kp] low digits
  std::vector<float> d;        // [M, kp / 32] block scales (of 256 q + r)
  std::vector<float> lane_d;   // [M, kp / 4] d of the block each 4-code lane lies in
  std::vector<int32_t> bias_q; // [M, kp / 4] -128 * the sum of the lane's 4 high digits
  std::vector<int32_t> bias_r; // [M, kp / 4] -128 * the sum of the lane's 4 low digits
  std::vector<float> gsum;     // [M, K / G] exact fp32 sum of x per weight group
  // The same digits in the nibble order (filled instead of q .. bias_r when asked: the VNNI
  // tile for 4/5/6-bit codes, tile_vnni_nibbles). Per step of 128 codes (4 blocks of 32):
  // 64 "low" codes (codes 0-15 of each block, block after block), then the 64 "high" codes
  // (codes 16-31 of each block), i.e. the codes a 64-byte load of 4-bit weights holds in its
  // low and in its high nibbles.
  int64_t kn = 0;                // K rounded up to 128 (codes past K are 0)
  std::vector<int8_t> nq;        // [M, kn] high digits, nibble order
  std::vector<int8_t> nr;        // [M, kn] low digits, nibble order
  std::vector<float> nlane_d;    // [M, kn / 8] per step: d of the block each 4-code lane lies in
  std::vector<int32_t> nbias_q;  // [M, kn / 4] per step: -128 * lane sums, 16 low lanes then 16 high
  std::vector<int32_t> nbias_r;  // [M, kn / 4] the same for the low digits
};

// round half to even by the 1.5 * 2^23 trick (|v| <= 2^22), in plain arithmetic (vectorises)
inline int32_t round_to_int(float v) {
  const float shifted = v + 12582912.0f;
  int32_t bits;
  std::memcpy(&bits, &shifted, sizeof(bits));
  return bits - 0x4B400000;
}

// Every row's two digits (see above), in the plain order (q .. bias_r) or, with
// nibble_order, in the nibble order (nq .. nbias_r); gsum either way.
void quantize_activations(const float* x, int64_t ldx, int64_t M, int64_t K, int G,
                          ActivationCodes& a, bool nibble_order = false) {
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
// (16 groups a vector), then each accumulator's lanes summed, four rows at a time (so a
// row's sum is computed the same way whatever NR), and stored to y[m0 + j, n0 + i].
template <int NR, int MR, bool HAS_MIN>
LEGATO_VNNI inline void finish_tile(__m512 (&acc)[NR][MR], const ActivationCodes& a,
                                    const float* mins, int64_t groups, int64_t n0, int64_t nr,
                                    int64_t m0, int64_t mr, float* y, int64_t ldy) {
  if constexpr (HAS_MIN)
    for (int i = 0; i < NR; ++i)
      for (int j = 0; j < MR; ++j) {
        const float* m = mins + (n0 + (i < nr ? i : 0)) * groups;
        const float* sums = a.gsum.data() + (m0 + (j < mr ? j : 0)) * groups;
        for (int64_t g = 0; g < groups; g += 16) {
          const __mmask16 gmask = groups - g >= 16 ? __mmask16(0xFFFF) : __mmask16((1u << (groups - g)) - 1);
          acc[i][j] = _mm512_fmadd_ps(_mm512_maskz_loadu_ps(gmask, m + g),
                                      _mm512_maskz_loadu_ps(gmask, sums + g), acc[i][j]);
        }
      }
  for (int j = 0; j < mr; ++j) {
    float total[(NR + 3) / 4 * 4];
    for (int i = 0; i < NR; i += 4)
      _mm_storeu_ps(total + i, sums_of_4(acc[i][j], acc[std::min(i + 1, NR - 1)][j],
                                         acc[std::min(i + 2, NR - 1)][j], acc[std::min(i + 3, NR - 1)][j]));
    for (int i = 0; i < nr; ++i) y[(m0 + j) * ldy + n0 + i] = total[i];
  }
}

// AVX-512 VNNI for 8-bit codes: 64 codes a step; lanes of 4 codes, so with G = 32 lanes 0-7 / 8-15 are the
// step's two groups, with G = 16 lanes 4g..4g+3 its four.
// How far ahead (in weight rows) a tile prefetches. A decode step streams every weight from
// memory once (the model is larger than the L3 cache) in small matrices (K = 576 is 9 steps a
// row), so the hardware prefetcher alone left the batch-1 matmuls at about half the measured
// read bandwidth; software prefetch of the rows 16 ahead measured 1.2-1.4x faster (8 and 32 less).
constexpr int64_t kPrefetchRows = 16;

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
  __m512 acc[NR][MR];
  const uint8_t* rows[NR];
  const float* srow[NR];
  for (int i = 0; i < NR; ++i) {
    const int64_t n = n0 + (i < nr ? i : 0);  // a short tile repeats its first row, unstored
    rows[i] = q + n * q_stride;
    srow[i] = scales + n * groups;
    for (int j = 0; j < MR; ++j) acc[i][j] = _mm512_setzero_ps();
  }
  int64_t xm[MR];
  for (int j = 0; j < MR; ++j) xm[j] = m0 + (j < mr ? j : 0);
  for (int64_t s = 0; s < steps; ++s) {
    const bool half = partial && s == steps - 1;
    __m512i xq[MR], xr[MR], bq[MR], br[MR];
    __m512 xd[MR];
    for (int j = 0; j < MR; ++j) {
      xq[j] = _mm512_loadu_si512(a.q.data() + xm[j] * kp + s * 64);
      xr[j] = _mm512_loadu_si512(a.r.data() + xm[j] * kp + s * 64);
      xd[j] = _mm512_loadu_ps(a.lane_d.data() + xm[j] * kp / 4 + s * 16);
      bq[j] = _mm512_loadu_si512(a.bias_q.data() + xm[j] * kp / 4 + s * 16);
      br[j] = _mm512_loadu_si512(a.bias_r.data() + xm[j] * kp / 4 + s * 16);
    }
    const __mmask16 smask = half ? __mmask16((1u << (per_step / 2)) - 1) : __mmask16((1u << per_step) - 1);
    if (n0 + kPrefetchRows + NR <= n_total) {  // the tile kPrefetchRows ahead: codes, scales
      for (int i = 0; i < NR; ++i) {
        const char* ahead = reinterpret_cast<const char*>(rows[i] + kPrefetchRows * q_stride);
        _mm_prefetch(ahead + s * 64, _MM_HINT_T0);
        if (s % (64 / per_step) == 0) {
          _mm_prefetch(reinterpret_cast<const char*>(srow[i] + kPrefetchRows * groups + s * per_step), _MM_HINT_T0);
          if constexpr (HAS_MIN)
            _mm_prefetch(reinterpret_cast<const char*>(mins + (n0 + i + kPrefetchRows) * groups + s * per_step), _MM_HINT_T0);
        }
      }
    }
    for (int i = 0; i < NR; ++i) {
      const __mmask64 bmask = half ? 0xFFFFFFFFull : ~0ull;  // codes biased by 128 (see above)
      const __m512i w = _mm512_xor_si512(_mm512_maskz_loadu_epi8(bmask, rows[i] + s * 64), flip);
      const __m512 ws = _mm512_permutexvar_ps(
          scale_lanes, _mm512_maskz_loadu_ps(smask, srow[i] + s * per_step));
      for (int j = 0; j < MR; ++j) {
        const __m512i high = _mm512_slli_epi32(_mm512_dpbusd_epi32(bq[j], w, xq[j]), 8);
        const __m512i dot = _mm512_dpbusd_epi32(_mm512_add_epi32(high, br[j]), w, xr[j]);
        acc[i][j] = _mm512_fmadd_ps(_mm512_cvtepi32_ps(dot), _mm512_mul_ps(ws, xd[j]), acc[i][j]);
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
  constexpr bool biased = centre != 0;  // signed codes go in biased by 128 (see tile_vnni)
  constexpr int per_block = 32 / G;     // scales a block uses
  const __m512i low_nibbles = _mm512_set1_epi8(0x0F), rebias = _mm512_set1_epi8(char(128 - centre));
  // lane l lies in block l / 4: its scale is the step's scale l / 4 (G = 32), or 2 (l / 4)
  // for the low half and 2 (l / 4) + 1 for the high half (G = 16)
  const __m512i block_of_lane = _mm512_set_epi32(3, 3, 3, 3, 2, 2, 2, 2, 1, 1, 1, 1, 0, 0, 0, 0);
  const __m512i low_group = _mm512_add_epi32(block_of_lane, block_of_lane);
  const __m512i high_group = _mm512_add_epi32(low_group, _mm512_set1_epi32(1));
  // bit plane bytes of a step: bytes 4b, 4b + 1 (codes 0-15 of block b) to the low mask,
  // 4b + 2, 4b + 3 to the high one
  const __m128i plane_order = _mm_setr_epi8(0, 1, 4, 5, 8, 9, 12, 13, 2, 3, 6, 7, 10, 11, 14, 15);
  __m512 acc[NR][MR];
  const uint8_t* rows[NR];
  const float* srow[NR];
  for (int i = 0; i < NR; ++i) {
    const int64_t n = n0 + (i < nr ? i : 0);  // a short tile repeats its first row, unstored
    rows[i] = q + n * q_stride;
    srow[i] = scales + n * groups;
    for (int j = 0; j < MR; ++j) acc[i][j] = _mm512_setzero_ps();
  }
  int64_t xm[MR];
  for (int j = 0; j < MR; ++j) xm[j] = m0 + (j < mr ? j : 0);
  const bool prefetch = n0 + kPrefetchRows + NR <= n_total;
  for (int64_t s = 0; s < steps; ++s) {
    const int blocks = s == steps - 1 ? tail_blocks : 4;
    const __mmask64 bmask = blocks == 4 ? ~0ull : (1ull << (16 * blocks)) - 1;
    const __mmask16 smask = __mmask16((1u << (blocks * per_block)) - 1);
    const __mmask16 pmask = __mmask16((1u << (4 * blocks)) - 1);
    if (prefetch) {  // the tile kPrefetchRows ahead: nibbles, planes, scales (and offsets)
      for (int i = 0; i < NR; ++i) {
        const char* ahead = reinterpret_cast<const char*>(rows[i] + kPrefetchRows * q_stride);
        _mm_prefetch(ahead + s * 64, _MM_HINT_T0);
        if (s % 4 == 0) {  // a line holds 4 steps of a bit plane, or of 4-per-step scales
          for (int p = 0; p < BITS - 4; ++p) _mm_prefetch(ahead + K / 2 + p * (K / 8) + s * 16, _MM_HINT_T0);
          const int64_t n_ahead = n0 + i + kPrefetchRows;
          for (int h = 0; h < per_block; ++h) {
            _mm_prefetch(reinterpret_cast<const char*>(scales + n_ahead * groups + s * 4 * per_block + h * 16), _MM_HINT_T0);
            if constexpr (HAS_MIN)
              _mm_prefetch(reinterpret_cast<const char*>(mins + n_ahead * groups + s * 4 * per_block + h * 16), _MM_HINT_T0);
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
      if constexpr (biased) {
        lo[i] = _mm512_add_epi8(lo[i], rebias);
        hi[i] = _mm512_add_epi8(hi[i], rebias);
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
        const __m512i start_q = biased ? _mm512_add_epi32(_mm512_loadu_si512(bq), _mm512_loadu_si512(bq + 16))
                                       : _mm512_setzero_si512();
        const __m512i start_r = biased ? _mm512_add_epi32(_mm512_loadu_si512(br), _mm512_loadu_si512(br + 16))
                                       : _mm512_setzero_si512();
        for (int i = 0; i < NR; ++i) {
          __m512i dot = _mm512_dpbusd_epi32(_mm512_dpbusd_epi32(start_q, lo[i], xq_lo), hi[i], xq_hi);
          dot = _mm512_add_epi32(_mm512_slli_epi32(dot, 8), start_r);
          dot = _mm512_dpbusd_epi32(_mm512_dpbusd_epi32(dot, lo[i], xr_lo), hi[i], xr_hi);
          acc[i][j] = _mm512_fmadd_ps(_mm512_cvtepi32_ps(dot), _mm512_mul_ps(ws_lo[i], xd), acc[i][j]);
        }
      } else {
        const __m512i zero = _mm512_setzero_si512();
        const __m512i bq_lo = biased ? _mm512_loadu_si512(bq) : zero, bq_hi = biased ? _mm512_loadu_si512(bq + 16) : zero;
        const __m512i br_lo = biased ? _mm512_loadu_si512(br) : zero, br_hi = biased ? _mm512_loadu_si512(br + 16) : zero;
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
  __m256 acc[NR][MR];
  const uint8_t* rows[NR];
  const float* srow[NR];
  for (int i = 0; i < NR; ++i) {
    const int64_t n = n0 + (i < nr ? i : 0);
    rows[i] = q + n * q_stride;
    srow[i] = scales + n * groups;
    for (int j = 0; j < MR; ++j) acc[i][j] = _mm256_setzero_ps();
  }
  int64_t xm[MR];
  for (int j = 0; j < MR; ++j) xm[j] = m0 + (j < mr ? j : 0);
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
  const int best = best_quantized_isa();
  if (request >= 0) chosen_isa = std::min(request, best);
  else if (chosen_isa < 0) chosen_isa = best;
  return chosen_isa;
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
  quantize_activations(x, ldx, M, K, G, a, isa == kAvx512Vnni && vnni_nibble_order<BITS>());
#if defined(LEGATO_HAVE_X86)
  if (isa == kAvx512Vnni) {
    auto call = [&](auto nr_tag, auto mr_tag) {
      constexpr int NR = decltype(nr_tag)::value, MR = decltype(mr_tag)::value;
      auto tile = [&](int64_t m0, int64_t mr, int64_t n0, int64_t nr) {
        vnni_tile<BITS, G, HAS_MIN, NR, MR>(a, m0, mr, K, q, q_stride, scales, mins, n0, nr, N, y, ldy);
      };
      over_tiles<decltype(tile), NR, MR>(tile, M, N, num_threads);
    };
    if (M == 1) call(std::integral_constant<int, 4>{}, std::integral_constant<int, 1>{});
    else call(std::integral_constant<int, 2>{}, std::integral_constant<int, 3>{});
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
  const bool has_min = mins != nullptr;
#define LEGATO_Q8A(B, G)                                                                       \
  if (bits == B && group == G)                                                                 \
    return has_min ? qmatmul_int8<B, G, true>(x, ldx, M, K, q, N, scales, mins, y, ldy, num_threads) \
                   : qmatmul_int8<B, G, false>(x, ldx, M, K, q, N, scales, mins, y, ldy, num_threads);
  LEGATO_FOR_EACH_LAYOUT(LEGATO_Q8A)
#undef LEGATO_Q8A
  return -2;
}

// ------------------------------------------------------- a decode step's decoder stack
//
// Every decoder layer of a Llama-family model, for a batch of decode rows, in one call: the
// Python forward's ~15 kernel calls a layer become loops here, with the same kernels in the
// same order (so the numbers are those of the layer-by-layer path). A row is one query token
// with its own seq_len (keys 0..seq_len-1) and block-table row: a plain decode step has one
// row per sequence; a speculative verification step several rows of one sequence (its last
// token, then its drafts, each attending up to itself: their K/V are all written before the
// attention reads), computed as a plain decode step of `sequences` rows computes each row
// (row_mode). For fp32 models whose projections are all kept quantized, without biases,
// q/k norms or sliding windows; the caller checks that (legato.models.decode_stack).

struct QuantPart {  // one row block of a quantized projection (QuantizedWeight)
  const uint8_t* codes;
  const float* scales;
  const float* offsets;  // null: none
  int64_t rows;
  int32_t bits;
  int32_t group;
};

constexpr int kMaxParts = 4;

struct QuantProjection {
  int32_t num_parts;
  int32_t pad;
  QuantPart parts[kMaxParts];
};

struct DecoderLayerWeights {
  const float* input_norm;
  const float* post_norm;
  float* key_cache;  // [blocks, block_size, kv_heads, head_dim]
  float* value_cache;
  QuantProjection qkv, o, gate_up, down;
};

// How a step's rows go through the quantized projections. The choice depends on the number
// of sequences in the step, never on its number of rows, so that a verification step (a few
// rows a sequence: its last token, then its drafts) computes each row exactly as a plain
// decode step of as many sequences computes it: each kernel's per-row arithmetic does not
// depend on the other rows (the int8 path quantizes and sums each row alone; the fp32 tile
// forms each weight once and runs one accumulator chain per row), except the fp32 kernel's
// one-row vector form, which a one-sequence step in fp32 mode then takes row by row.
enum class RowMode { kFp32Tile = 0, kInteger = 1, kFp32RowByRow = 2 };

RowMode row_mode(int64_t sequences, int int8_max_rows) {
  if (sequences <= int8_max_rows) return RowMode::kInteger;
  return sequences == 1 ? RowMode::kFp32RowByRow : RowMode::kFp32Tile;
}

// The integer path for the few rows of a verification step (1 < T <= 3 * kMaxTileRows):
// quantized_matmul_int8 pads the last input tile to its MR rows (5 rows cost 6), so here each
// weight tile runs input tiles of 3 rows and then one of exactly the rows left (1 or 2). The
// VNNI tile's arithmetic for a (weight row, input row) pair does not depend on MR, so every
// row's result is the one-row call's, bit for bit. Other ISAs take quantized_matmul_int8.
template <int BITS, int G, bool HAS_MIN>
int verify_rows_int8(const float* x, int64_t T, int64_t K, const QuantPart& part, float* y,
                     int64_t ldy, int num_threads) {
#if defined(LEGATO_HAVE_X86)
  if (quantized_isa(-1) == kAvx512Vnni) {
    thread_local ActivationCodes scratch;
    const ActivationCodes& a = scratch;  // the calling thread's, shared by the team below
    quantize_activations(x, K, T, K, G, scratch, vnni_nibble_order<BITS>());
    constexpr int NR = 2, MR = 3;
    const int64_t N = part.rows, q_stride = K * BITS / 8, n_tiles = (N + NR - 1) / NR;
    const int64_t full = T / MR * MR, rest = T - full;
#pragma omp parallel for schedule(static) num_threads(num_threads)
    for (int64_t t = 0; t < n_tiles; ++t) {
      const int64_t n0 = t * NR, nr = std::min<int64_t>(NR, N - n0);
      for (int64_t m0 = 0; m0 < full; m0 += MR)
        vnni_tile<BITS, G, HAS_MIN, NR, MR>(a, m0, MR, K, part.codes, q_stride, part.scales,
                                            part.offsets, n0, nr, N, y, ldy);
      if (rest == 2)
        vnni_tile<BITS, G, HAS_MIN, NR, 2>(a, full, 2, K, part.codes, q_stride, part.scales,
                                           part.offsets, n0, nr, N, y, ldy);
      else if (rest == 1)
        vnni_tile<BITS, G, HAS_MIN, NR, 1>(a, full, 1, K, part.codes, q_stride, part.scales,
                                           part.offsets, n0, nr, N, y, ldy);
    }
    return 0;
  }
#endif
  return quantized_matmul_int8(x, K, T, K, part.codes, part.bits, part.group, part.rows,
                               part.scales, part.offsets, y, ldy, num_threads);
}

int project_int8(const QuantPart& part, const float* x, int64_t T, int64_t K, float* y,
                 int64_t ldy, int num_threads) {
  if (T == 1 || K % 32 != 0 || T % 3 == 0)  // nothing padded: the general call
    return quantized_matmul_int8(x, K, T, K, part.codes, part.bits, part.group, part.rows,
                                 part.scales, part.offsets, y, ldy, num_threads);
  const bool has_min = part.offsets != nullptr;
#define LEGATO_ROWS(B, G)                                                             \
  if (part.bits == B && part.group == G)                                              \
    return has_min ? verify_rows_int8<B, G, true>(x, T, K, part, y, ldy, num_threads) \
                   : verify_rows_int8<B, G, false>(x, T, K, part, y, ldy, num_threads);
  LEGATO_FOR_EACH_LAYOUT(LEGATO_ROWS)
#undef LEGATO_ROWS
  return -2;
}

// y[T, N] = x[T, K] @ W^T over the projection's row blocks (each writes its columns).
int project(const QuantProjection& w, const float* x, int64_t T, int64_t K, float* y, int64_t N,
            RowMode mode, int num_threads) {
  int64_t column = 0;
  for (int p = 0; p < w.num_parts; ++p) {
    const QuantPart& part = w.parts[p];
    int code = 0;
    if (mode == RowMode::kInteger) {
      code = project_int8(part, x, T, K, y + column, N, num_threads);
    } else if (mode == RowMode::kFp32Tile || T == 1) {
      code = quantized_matmul(x, K, T, K, part.codes, part.bits, part.group, part.rows,
                              part.scales, part.offsets, y + column, N, num_threads);
    } else {
      for (int64_t t = 0; t < T && code == 0; ++t)
        code = quantized_matmul(x + t * K, K, 1, K, part.codes, part.bits, part.group, part.rows,
                                part.scales, part.offsets, y + t * N + column, N, num_threads);
    }
    if (code != 0) return code;
    column += part.rows;
  }
  return column == N ? 0 : -4;
}

int decode_layers(const DecoderLayerWeights* layers, int num_layers, float* hidden,
                  float* residual, int64_t T, int H, int num_heads, int num_kv_heads,
                  int head_dim, int intermediate, const int32_t* block_table,
                  int64_t table_stride, int64_t table_cols, int64_t num_blocks, int block_size,
                  const int32_t* seq_lens, const int64_t* slots, const int64_t* positions,
                  const float* cos_sin, int64_t max_position, float eps, float scale,
                  int int8_max_rows, int num_threads, int64_t sequences) {
  const int64_t q_width = static_cast<int64_t>(num_heads) * head_dim;
  const int64_t kv_width = static_cast<int64_t>(num_kv_heads) * head_dim;
  const int64_t qkv_width = q_width + 2 * kv_width;
  if (sequences < 1 || sequences > T) return -5;
  const RowMode mode = row_mode(sequences, int8_max_rows);
  thread_local std::vector<float> normed, qkv, attn, gate_up, act;
  normed.resize(T * H);
  qkv.resize(T * qkv_width);
  attn.resize(T * q_width);
  gate_up.resize(T * 2 * intermediate);
  act.resize(T * intermediate);
  std::memcpy(residual, hidden, sizeof(float) * T * H);  // layer 0: the residual is the input
  int code = rms_norm<float>(hidden, H, nullptr, layers[0].input_norm, normed.data(), T, H, eps,
                             num_threads);
  for (int l = 0; l < num_layers && code == 0; ++l) {
    const DecoderLayerWeights& layer = layers[l];
    if (l > 0)  // residual += hidden; normed = norm(residual)
      code = rms_norm<float>(hidden, H, residual, layer.input_norm, normed.data(), T, H, eps,
                             num_threads);
    if (code == 0)
      code = project(layer.qkv, normed.data(), T, H, qkv.data(), qkv_width, mode, num_threads);
    if (code == 0)
      code = rotary_neox<float>(qkv.data(), qkv_width, head_dim, T, num_heads + num_kv_heads,
                                head_dim, positions, cos_sin, max_position, num_threads);
    if (code == 0) {
      const char* key = reinterpret_cast<const char*>(qkv.data() + q_width);
      const char* value = reinterpret_cast<const char*>(qkv.data() + q_width + kv_width);
      code = write_kv(key, qkv_width * 4, value, qkv_width * 4,
                      reinterpret_cast<char*>(layer.key_cache),
                      reinterpret_cast<char*>(layer.value_cache), slots, T,
                      num_blocks * block_size, kv_width * 4, num_threads);
    }
    if (code == 0)
      code = decode_attention<float>(qkv.data(), qkv_width, head_dim, layer.key_cache,
                                     layer.value_cache, block_table, table_stride, table_cols,
                                     num_blocks, seq_lens, attn.data(), T, num_heads,
                                     num_kv_heads, head_dim, block_size, scale, num_threads);
    if (code == 0) code = project(layer.o, attn.data(), T, q_width, hidden, H, mode, num_threads);
    if (code == 0)
      code = rms_norm<float>(hidden, H, residual, layer.post_norm, normed.data(), T, H, eps,
                             num_threads);
    if (code == 0)
      code = project(layer.gate_up, normed.data(), T, H, gate_up.data(), 2 * intermediate,
                     mode, num_threads);
    if (code == 0)
      code = silu_and_mul<float>(gate_up.data(), 2 * intermediate, act.data(), T, intermediate,
                                 num_threads);
    if (code == 0)
      code = project(layer.down, act.data(), T, intermediate, hidden, H, mode, num_threads);
  }
  return code;
}

}  // namespace

extern "C" {

#define LEGATO_TYPED(SUFFIX, T)                                                               \
  int legato_decode_attention_##SUFFIX(                                                       \
      const T* query, int64_t q_seq_stride, int64_t q_head_stride, const T* key_cache,        \
      const T* value_cache, const int32_t* block_table, int64_t table_stride,                 \
      int64_t table_cols, int64_t num_blocks, const int32_t* seq_lens, T* out,                \
      int64_t num_seqs, int num_heads, int num_kv_heads, int head_dim, int block_size,        \
      float scale, int num_threads) {                                                         \
    return decode_attention(query, q_seq_stride, q_head_stride, key_cache, value_cache,       \
                            block_table, table_stride, table_cols, num_blocks, seq_lens, out, \
                            num_seqs, num_heads, num_kv_heads, head_dim, block_size, scale,   \
                            num_threads);                                                     \
  }                                                                                           \
  int legato_rms_norm_##SUFFIX(const T* x, int64_t x_stride, T* residual, const T* weight,   \
                               T* out, int64_t rows, int64_t cols, float eps,                 \
                               int num_threads) {                                             \
    return rms_norm(x, x_stride, residual, weight, out, rows, cols, eps, num_threads);        \
  }                                                                                           \
  int legato_silu_and_mul_##SUFFIX(const T* x, int64_t x_stride, T* out, int64_t rows,       \
                                   int64_t d, int num_threads) {                              \
    return silu_and_mul(x, x_stride, out, rows, d, num_threads);                              \
  }                                                                                           \
  int legato_rotary_neox_##SUFFIX(T* x, int64_t tok_stride, int64_t head_stride,             \
                                  int64_t tokens, int heads, int head_dim,                    \
                                  const int64_t* positions, const float* cos_sin,             \
                                  int64_t max_position, int num_threads) {                    \
    return rotary_neox(x, tok_stride, head_stride, tokens, heads, head_dim, positions,       \
                       cos_sin, max_position, num_threads);                                   \
  }

LEGATO_TYPED(f32, float)
LEGATO_TYPED(bf16, bf16)

int legato_write_kv(const char* key, int64_t key_stride, const char* value, int64_t value_stride,
                    char* key_cache, char* value_cache, const int64_t* slots, int64_t num_tokens,
                    int64_t num_slots, int64_t row_bytes, int num_threads) {
  return write_kv(key, key_stride, value, value_stride, key_cache, value_cache, slots,
                  num_tokens, num_slots, row_bytes, num_threads);
}

int legato_argmax_f32(const float* x, int64_t stride, int64_t rows, int64_t cols, int64_t* out,
                      int num_threads) {
  return argmax_rows(x, stride, rows, cols, out, num_threads);
}

int legato_quantized_matmul_f32(const float* x, int64_t ldx, int64_t M, int64_t K,
                                const uint8_t* q, int bits, int group, int64_t N,
                                const float* scales, const float* mins, float* y, int64_t ldy,
                                int num_threads) {
  return quantized_matmul(x, ldx, M, K, q, bits, group, N, scales, mins, y, ldy, num_threads);
}

int legato_quantized_matmul_int8(const float* x, int64_t ldx, int64_t M, int64_t K,
                                 const uint8_t* q, int bits, int group, int64_t N,
                                 const float* scales, const float* mins, float* y, int64_t ldy,
                                 int num_threads) {
  return quantized_matmul_int8(x, ldx, M, K, q, bits, group, N, scales, mins, y, ldy,
                               num_threads);
}

// The int8-activation path's ISA: 2 AVX-512 VNNI, 1 AVX2, 0 portable. request >= 0 picks
// min(request, the best this CPU runs); request < 0 only reads it. Returns the path in use.
int legato_quantized_isa(int request) { return quantized_isa(request); }

// bf16 decode attention on vdpbf16ps (1) or widened to fp32 (0): request >= 0 picks
// min(request, what this CPU runs); request < 0 only reads it. Returns the choice in use.
int legato_attention_bf16_dot(int request) { return attention_bf16_dot(request); }

// The decoder stack of a decode step (decode_layers above): hidden [T, H] in (the
// embeddings) and out (the last layer's MLP output), residual [T, H] out; the T rows belong
// to `sequences` sequences (1 <= sequences <= T; -5 otherwise).
int legato_decode_layers_f32(const DecoderLayerWeights* layers, int num_layers, float* hidden,
                             float* residual, int64_t T, int H, int num_heads, int num_kv_heads,
                             int head_dim, int intermediate, const int32_t* block_table,
                             int64_t table_stride, int64_t table_cols, int64_t num_blocks,
                             int block_size, const int32_t* seq_lens, const int64_t* slots,
                             const int64_t* positions, const float* cos_sin,
                             int64_t max_position, float eps, float scale, int int8_max_rows,
                             int num_threads, int64_t sequences) {
  return decode_layers(layers, num_layers, hidden, residual, T, H, num_heads, num_kv_heads,
                       head_dim, intermediate, block_table, table_stride, table_cols, num_blocks,
                       block_size, seq_lens, slots, positions, cos_sin, max_position, eps, scale,
                       int8_max_rows, num_threads, sequences);
}

}  // extern "C"
