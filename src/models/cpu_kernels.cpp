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

#if defined(__AVX512F__)
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
    std::vector<float> scores;  // [num_heads, seq_len]
    std::vector<float> totals(num_heads);
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
          for (int h = 0; h < num_heads; ++h)
            s[h * len + start + t] = dot(&q[h * head_dim], k + (h / group) * head_dim, head_dim);
        }
      }
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
      std::fill(acc.begin(), acc.end(), 0.f);
      for (int start = 0; start < len; start += block_size) {
        const T* values = value_cache + table[start / block_size] * block_stride;
        const int n = std::min(block_size, len - start);
        for (int t = 0; t < n; ++t) {
          const T* v = values + t * token_stride;
          for (int h = 0; h < num_heads; ++h)
            axpy(s[h * len + start + t], v + (h / group) * head_dim, &acc[h * head_dim], head_dim);
        }
      }
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
// into this layout once, at load): per output row n, K codes q (BITS = 8: int8, one a byte;
// BITS = 4: unsigned nibbles, 16 bytes per 32 codes, byte j holding code j in its low and code
// j + 16 in its high nibble) and per group of G codes an fp32 scale s (and, with HAS_MIN, an
// fp32 offset m): w = q * s (+ m). The weight is formed exactly so, in fp32 without fusing,
// which is what gguf's dequantize computes, so the dequantized values are bit-identical; the
// products are summed in fp32 (fused multiply-add where the CPU has it) in another order than
// a BLAS would, as any two fp32 matmuls differ.
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

// The 32 weights of chunk c (codes c*32 .. c*32+31) of one row, as two vectors.
template <int BITS, int G, bool HAS_MIN>
inline void dequant_chunk(const uint8_t* row, const float* scales, const float* mins, int64_t c,
                          f32x16& w0, f32x16& w1) {
  f32x16 q0, q1;
  if constexpr (BITS == 4) {
    u8x16 b;
    std::memcpy(&b, row + c * 16, 16);
    q0 = __builtin_convertvector(__builtin_convertvector(b & 0x0F, i32x16), f32x16);
    q1 = __builtin_convertvector(__builtin_convertvector(b >> 4, i32x16), f32x16);
  } else {
    q0 = int8_to_f32(row + c * 32);
    q1 = int8_to_f32(row + c * 32 + 16);
  }
  const int64_t g0 = (c * 32) / G, g1 = (c * 32 + 16) / G;
  w0 = q0 * splat(scales[g0]);
  w1 = q1 * splat(scales[g1]);
  if constexpr (HAS_MIN) {
    w0 = w0 + splat(mins[g0]);
    w1 = w1 + splat(mins[g1]);
  }
}

template <int BITS, int G, bool HAS_MIN, int NR, int MR>
void qmatmul_tile(const float* x, int64_t ldx, int64_t m0, int64_t mr, const uint8_t* q,
                  int64_t q_stride, const float* scales, const float* mins, int64_t groups,
                  int64_t n0, int64_t nr, int64_t K, float* y, int64_t ldy) {
  f32x16 acc[NR][MR];
  for (int i = 0; i < NR; ++i)
    for (int j = 0; j < MR; ++j) acc[i][j] = f32x16{};
  const uint8_t* rows[NR];
  const float* srow[NR];
  const float* mrow[NR];
  for (int i = 0; i < NR; ++i) {
    const int64_t n = n0 + (i < nr ? i : 0);  // a short tile repeats its first row, unstored
    rows[i] = q + n * q_stride;
    srow[i] = scales + n * groups;
    mrow[i] = HAS_MIN ? mins + n * groups : nullptr;
  }
  const float* xr[MR];
  for (int j = 0; j < MR; ++j) xr[j] = x + (m0 + (j < mr ? j : 0)) * ldx;
  const int64_t chunks = K / 32;
  for (int64_t c = 0; c < chunks; ++c) {
    f32x16 xa[MR], xb[MR];
    for (int j = 0; j < MR; ++j) {
      xa[j] = load16(xr[j] + c * 32);
      xb[j] = load16(xr[j] + c * 32 + 16);
    }
    for (int i = 0; i < NR; ++i) {
      f32x16 w0, w1;
      dequant_chunk<BITS, G, HAS_MIN>(rows[i], srow[i], mrow[i], c, w0, w1);
      for (int j = 0; j < MR; ++j) acc[i][j] = fma16(w1, xb[j], fma16(w0, xa[j], acc[i][j]));
    }
  }
  for (int i = 0; i < nr; ++i)
    for (int j = 0; j < mr; ++j) y[(m0 + j) * ldy + n0 + i] = hsum(acc[i][j]);
}

// The 32 codes of chunk c of one row, as floats (not yet scaled).
template <int BITS>
inline void codes_chunk(const uint8_t* row, int64_t c, f32x16& q0, f32x16& q1) {
  if constexpr (BITS == 4) {
    u8x16 b;
    std::memcpy(&b, row + c * 16, 16);
    q0 = __builtin_convertvector(__builtin_convertvector(b & 0x0F, i32x16), f32x16);
    q1 = __builtin_convertvector(__builtin_convertvector(b >> 4, i32x16), f32x16);
  } else {
    q0 = int8_to_f32(row + c * 32);
    q1 = int8_to_f32(row + c * 32 + 16);
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
      codes_chunk<BITS>(rows[i], c, q0, q1);
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
  constexpr int NR = 2, MR = 6;  // 12 accumulators, 4 weight and 12 input vectors: 28 registers
  const int64_t n_tiles = (N + NR - 1) / NR, m_tiles = (M + MR - 1) / MR;
#pragma omp parallel for schedule(static) num_threads(num_threads)
  for (int64_t t = 0; t < n_tiles; ++t) {
    const int64_t n0 = t * NR, nr = std::min<int64_t>(NR, N - n0);
    for (int64_t mt = 0; mt < m_tiles; ++mt) {
      const int64_t m0 = mt * MR;
      qmatmul_tile<BITS, G, HAS_MIN, NR, MR>(x, ldx, m0, std::min<int64_t>(MR, M - m0), q,
                                             q_stride, scales, mins, groups, n0, nr, K, y, ldy);
    }
  }
  return 0;
}

int quantized_matmul(const float* x, int64_t ldx, int64_t M, int64_t K, const uint8_t* q,
                     int bits, int group, int64_t N, const float* scales, const float* mins,
                     float* y, int64_t ldy, int num_threads) {
  if (M < 0 || N < 0 || K <= 0 || K % 32 != 0 || ldx < K || ldy < N) return -1;
  const bool has_min = mins != nullptr;
  if (bits == 4 && group == 32)
    return has_min ? qmatmul<4, 32, true>(x, ldx, M, K, q, N, scales, mins, y, ldy, num_threads)
                   : qmatmul<4, 32, false>(x, ldx, M, K, q, N, scales, mins, y, ldy, num_threads);
  if (bits == 8 && group == 32)
    return has_min ? qmatmul<8, 32, true>(x, ldx, M, K, q, N, scales, mins, y, ldy, num_threads)
                   : qmatmul<8, 32, false>(x, ldx, M, K, q, N, scales, mins, y, ldy, num_threads);
  if (bits == 8 && group == 16)
    return has_min ? qmatmul<8, 16, true>(x, ldx, M, K, q, N, scales, mins, y, ldy, num_threads)
                   : qmatmul<8, 16, false>(x, ldx, M, K, q, N, scales, mins, y, ldy, num_threads);
  return -2;
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

}  // extern "C"
