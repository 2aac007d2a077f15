// CPU kernels for legato's torch backend: plain C++17 with OpenMP, no torch headers.
//
// Built on first use by legato/models/cpu_kernels.py (g++ -O3 -march=native -fopenmp)
// and loaded with ctypes. OpenMP binds to the libgomp that torch has already loaded
// (same soname), so these loops share torch's thread pool instead of adding a second one.
// Tensors arrive as raw pointers plus the strides the Python side checked; bf16 travels
// as uint16_t bit patterns. Every entry point returns 0, or a negative code for
// arguments it cannot take (the caller then uses the plain-torch path).

#include <algorithm>
#include <cmath>
#include <cstdint>
#include <cstring>
#include <vector>

namespace {

inline float to_float(float x) { return x; }

inline float to_float(uint16_t bits) {
  const uint32_t wide = static_cast<uint32_t>(bits) << 16;
  float out;
  std::memcpy(&out, &wide, sizeof(out));
  return out;
}

inline void from_float(float x, float* dst) { *dst = x; }

inline void from_float(float x, uint16_t* dst) {  // round to nearest even; NaN stays NaN
  uint32_t bits;
  std::memcpy(&bits, &x, sizeof(bits));
  if ((bits & 0x7fffffffu) > 0x7f800000u) {
    *dst = static_cast<uint16_t>((bits >> 16) | 0x40u);
    return;
  }
  bits += 0x7fffu + ((bits >> 16) & 1u);
  *dst = static_cast<uint16_t>(bits >> 16);
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
// scores (K), then the softmax-weighted sum (V). Accumulates in fp32.
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
#pragma omp parallel num_threads(num_threads)
  {
    std::vector<float> q(static_cast<size_t>(num_heads) * head_dim);
    std::vector<float> acc(q.size());
    std::vector<float> scores;  // [seq_len, num_heads]
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
      for (int start = 0; start < len; start += block_size) {
        const T* keys = key_cache + table[start / block_size] * block_stride;
        const int n = std::min(block_size, len - start);
        for (int t = 0; t < n; ++t) {
          const T* k = keys + t * token_stride;
          float* row = s + (start + t) * num_heads;
          for (int h = 0; h < num_heads; ++h)
            row[h] = dot(&q[h * head_dim], k + (h / group) * head_dim, head_dim);
        }
      }
      for (int h = 0; h < num_heads; ++h) {
        float top = s[h];
        for (int t = 1; t < len; ++t) top = std::max(top, s[t * num_heads + h]);
        float total = 0.f;
        for (int t = 0; t < len; ++t) {
          const float p = std::exp(s[t * num_heads + h] - top);
          s[t * num_heads + h] = p;
          total += p;
        }
        const float inv = 1.f / total;
        for (int t = 0; t < len; ++t) s[t * num_heads + h] *= inv;
      }
      std::fill(acc.begin(), acc.end(), 0.f);
      for (int start = 0; start < len; start += block_size) {
        const T* values = value_cache + table[start / block_size] * block_stride;
        const int n = std::min(block_size, len - start);
        for (int t = 0; t < n; ++t) {
          const T* v = values + t * token_stride;
          const float* row = s + (start + t) * num_heads;
          for (int h = 0; h < num_heads; ++h)
            axpy(row[h], v + (h / group) * head_dim, &acc[h * head_dim], head_dim);
        }
      }
      T* dst = out + seq * num_heads * static_cast<int64_t>(head_dim);
      for (int i = 0; i < num_heads * head_dim; ++i) from_float(acc[i], dst + i);
    }
  }
  return 0;
}

}  // namespace

extern "C" {

int legato_decode_attention_f32(const float* query, int64_t q_seq_stride, int64_t q_head_stride,
                                const float* key_cache, const float* value_cache,
                                const int32_t* block_table, int64_t table_stride,
                                int64_t table_cols, int64_t num_blocks, const int32_t* seq_lens, float* out, int64_t num_seqs,
                                int num_heads, int num_kv_heads, int head_dim, int block_size,
                                float scale, int num_threads) {
  return decode_attention(query, q_seq_stride, q_head_stride, key_cache, value_cache, block_table,
                          table_stride, table_cols, num_blocks, seq_lens, out, num_seqs, num_heads, num_kv_heads,
                          head_dim, block_size, scale, num_threads);
}

int legato_decode_attention_bf16(const uint16_t* query, int64_t q_seq_stride,
                                 int64_t q_head_stride, const uint16_t* key_cache,
                                 const uint16_t* value_cache, const int32_t* block_table,
                                 int64_t table_stride, int64_t table_cols, int64_t num_blocks,
                                 const int32_t* seq_lens, uint16_t* out,
                                 int64_t num_seqs, int num_heads, int num_kv_heads, int head_dim,
                                 int block_size, float scale, int num_threads) {
  return decode_attention(query, q_seq_stride, q_head_stride, key_cache, value_cache, block_table,
                          table_stride, table_cols, num_blocks, seq_lens, out, num_seqs, num_heads, num_kv_heads,
                          head_dim, block_size, scale, num_threads);
}

}  // extern "C"
