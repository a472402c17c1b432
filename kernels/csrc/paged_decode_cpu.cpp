// Paged decode attention on CPU, read straight from the block cache: one task per (sequence, KV head) (per
// sequence, all its KV heads, on AVX2 at batch >= 2 x threads), its query heads attended together with an online softmax over the sequence's blocks, accumulated in float32.
// Returns the normalised output and its log-sum-exp (the partial state the shared-prefix path merges).
//
// Why a kernel of our own: torch's fused CPU attention pays microseconds of fixed cost per (sequence, head)
// pair (GEMMs of 1-8 query rows) and needs the blocks gathered into a contiguous workspace first; decode of a
// small model at batch 16-64 spends most of its attention time on those.
#include "bf16_avx512.h"
#include "common.h"

#include <algorithm>
#include <cmath>
#include <cstdint>
#include <limits>
#include <type_traits>
#include <vector>

#if defined(__AVX512F__)
#define PARROT_DECODE_VECTOR 512
#elif defined(__AVX2__) && defined(__FMA__) && defined(__F16C__)
#define PARROT_DECODE_VECTOR 256
#endif
#if defined(PARROT_DECODE_VECTOR)
#include <immintrin.h>
#include <sleef.h>  // torch links SLEEF: its vectorised exp
#endif

namespace {

using namespace parrot_cpu;  // NOLINT: BF16, Half, parallel_for

constexpr float kNegInf = -std::numeric_limits<float>::infinity();

// Scalar loads of the cache dtype as float32 (the portable path).
inline float load(const float* p, int64_t i) { return p[i]; }
inline float load(const Half* p, int64_t i) { return static_cast<float>(p[i]); }
inline float load(const BF16* p, int64_t i) { return static_cast<float>(p[i]); }

// What one task works on.
template <typename T>
struct Task {
  const T* q;             // [G, D] query heads of this KV head
  const T* k_cache;       // [num_blocks, block_size, KVH, D], offset to this KV head
  const T* v_cache;
  const int32_t* table;   // this sequence's blocks
  int64_t len;            // keys to attend
  int64_t kv_head;        // which KV head (k_cache/v_cache are offset to it)
  int64_t group, head_dim, token_stride, block_size;
  float scale;
  int64_t heads;          // KV heads from kv_head on (q, out and lse hold heads * group rows): AVX2 only
  float* out;             // [G, D] float32
  float* lse;             // [G]
};

// Online-softmax bookkeeping after a block's scores are known: rescale the running state to the new maximum
// and turn the scores into probabilities in place. Returns the correction applied to earlier outputs.
inline float softmax_step(float* scores, int64_t n, float& m, float& l) {
  float block_max = kNegInf;
  for (int64_t j = 0; j < n; ++j) block_max = std::max(block_max, scores[j]);
  const float new_m = std::max(m, block_max);
  const float correction = std::exp(m - new_m);  // exp(-inf) = 0 on the first block
  float sum = 0.0f;
  for (int64_t j = 0; j < n; ++j) {
    scores[j] = std::exp(scores[j] - new_m);
    sum += scores[j];
  }
  l = l * correction + sum;
  m = new_m;
  return correction;
}

inline void finish(float* out, float* lse, int64_t group, int64_t head_dim, const float* m, const float* l) {
  for (int64_t g = 0; g < group; ++g) {
    if (l[g] > 0.0f) {
      const float inv = 1.0f / l[g];
      for (int64_t d = 0; d < head_dim; ++d) out[g * head_dim + d] *= inv;
      lse[g] = m[g] + std::log(l[g]);
    } else {
      lse[g] = kNegInf;  // an empty sequence: output 0, log-sum-exp -inf
    }
  }
}

// Any head_dim, any ISA: plain loops.
template <typename T>
void attend_scalar(const Task<T>& t, float* scratch) {
  const int64_t G = t.group, D = t.head_dim, BS = t.block_size;
  float* qf = scratch;          // [G, D]
  float* scores = qf + G * D;   // [G, BS]
  std::vector<float> m(G, kNegInf), l(G, 0.0f);
  for (int64_t i = 0; i < G * D; ++i) qf[i] = load(t.q, i) * t.scale;
  std::fill(t.out, t.out + G * D, 0.0f);
  for (int64_t start = 0; start < t.len; start += BS) {
    const int64_t n = std::min(BS, t.len - start);
    const int64_t base = static_cast<int64_t>(t.table[start / BS]) * BS * t.token_stride;
    for (int64_t j = 0; j < n; ++j)
      for (int64_t g = 0; g < G; ++g) {
        float s = 0.0f;
        for (int64_t d = 0; d < D; ++d) s += qf[g * D + d] * load(t.k_cache + base + j * t.token_stride, d);
        scores[g * BS + j] = s;
      }
    for (int64_t g = 0; g < G; ++g) {
      const float c = softmax_step(scores + g * BS, n, m[g], l[g]);
      for (int64_t d = 0; d < D; ++d) t.out[g * D + d] *= c;
    }
    for (int64_t j = 0; j < n; ++j)
      for (int64_t g = 0; g < G; ++g)
        for (int64_t d = 0; d < D; ++d)
          t.out[g * D + d] += scores[g * BS + j] * load(t.v_cache + base + j * t.token_stride, d);
  }
  finish(t.out, t.lse, G, D, m.data(), l.data());
}

#if defined(PARROT_DECODE_VECTOR)
// Blocks lie anywhere in the cache, so the hardware prefetcher cannot run ahead across them: the first head's
// task asks for the next two blocks' whole token rows (every head's K and V), and the other heads' tasks,
// which run next on this thread, find them in cache (measured 1.3-1.5x on KV in DRAM).
template <typename T>
inline void prefetch_ahead(const Task<T>& t, int64_t start) {
  if (t.kv_head != 0) return;
  const int64_t BS = t.block_size, stride = t.token_stride;
  const int64_t row_bytes = BS * stride * static_cast<int64_t>(sizeof(T));
  for (int64_t ahead = 1; ahead <= 2 && start + ahead * BS < t.len; ++ahead) {
    const int64_t next = static_cast<int64_t>(t.table[start / BS + ahead]) * BS * stride;
    const char* kp = reinterpret_cast<const char*>(t.k_cache + next);
    const char* vp = reinterpret_cast<const char*>(t.v_cache + next);
    for (int64_t byte = 0; byte < row_bytes; byte += 64) {
      _mm_prefetch(kp + byte, _MM_HINT_T1);
      _mm_prefetch(vp + byte, _MM_HINT_T1);
    }
  }
}
#endif

#if PARROT_DECODE_VECTOR == 512
inline __m512 load16(const float* p) { return _mm512_loadu_ps(p); }
inline __m512 load16(const BF16* p) { return bf16_load(p); }
inline __m512 load16(const Half* p) {
  return _mm512_cvtph_ps(_mm256_loadu_si256(reinterpret_cast<const __m256i*>(p)));
}

// head_dim = 16 * C, block_size <= 16 (one vector of scores per query head): the common LLaMA shapes.
template <typename T, int C>
void attend_avx512(const Task<T>& t) {
  const int64_t G = t.group, stride = t.token_stride, BS = t.block_size;
  constexpr int64_t D = 16 * C;
  __m512 qv[8][C];  // G <= 8 (checked by the caller)
  __m512 acc[8][C];
  float m[8], l[8];
  const __m512 scale = _mm512_set1_ps(t.scale);
  for (int64_t g = 0; g < G; ++g) {
    for (int c = 0; c < C; ++c) {
      qv[g][c] = _mm512_mul_ps(load16(t.q + g * D + 16 * c), scale);
      acc[g][c] = _mm512_setzero_ps();
    }
    m[g] = kNegInf;
    l[g] = 0.0f;
  }
  alignas(64) float probs[8][16];
  for (int64_t start = 0; start < t.len; start += BS) {
    const int64_t n = std::min(BS, t.len - start);
    const __mmask16 live = static_cast<__mmask16>((1u << n) - 1u);
    const T* kb = t.k_cache + static_cast<int64_t>(t.table[start / BS]) * BS * stride;
    const T* vb = t.v_cache + static_cast<int64_t>(t.table[start / BS]) * BS * stride;
    prefetch_ahead(t, start);
    for (int64_t j = 0; j < n; ++j) {
      __m512 kv[C];
      for (int c = 0; c < C; ++c) kv[c] = load16(kb + j * stride + 16 * c);
      for (int64_t g = 0; g < G; ++g) {
        __m512 dot = _mm512_mul_ps(qv[g][0], kv[0]);
        for (int c = 1; c < C; ++c) dot = _mm512_fmadd_ps(qv[g][c], kv[c], dot);
        probs[g][j] = _mm512_reduce_add_ps(dot);  // a shuffle tree, not 16 dependent adds
      }
    }
    for (int64_t g = 0; g < G; ++g) {
      const __m512 s = _mm512_mask_loadu_ps(_mm512_set1_ps(kNegInf), live, probs[g]);
      const float new_m = std::max(m[g], _mm512_reduce_max_ps(s));
      const __m512 p = Sleef_expf16_u10(_mm512_sub_ps(s, _mm512_set1_ps(new_m)));  // masked lanes: 0
      const float correction = std::exp(m[g] - new_m);
      l[g] = l[g] * correction + _mm512_reduce_add_ps(p);
      m[g] = new_m;
      _mm512_store_ps(probs[g], p);
      const __m512 cv = _mm512_set1_ps(correction);
      for (int c = 0; c < C; ++c) acc[g][c] = _mm512_mul_ps(acc[g][c], cv);
    }
    for (int64_t j = 0; j < n; ++j) {
      __m512 vv[C];
      for (int c = 0; c < C; ++c) vv[c] = load16(vb + j * stride + 16 * c);
      for (int64_t g = 0; g < G; ++g) {
        const __m512 p = _mm512_set1_ps(probs[g][j]);
        for (int c = 0; c < C; ++c) acc[g][c] = _mm512_fmadd_ps(p, vv[c], acc[g][c]);
      }
    }
  }
  for (int64_t g = 0; g < G; ++g)
    for (int c = 0; c < C; ++c) _mm512_storeu_ps(t.out + g * D + 16 * c, acc[g][c]);
  finish(t.out, t.lse, G, D, m, l);
}
#endif

#if PARROT_DECODE_VECTOR == 256
inline __m256 load8(const float* p) { return _mm256_loadu_ps(p); }
inline __m256 load8(const BF16* p) {  // exact: bf16 is the top half of a float32
  const __m128i bits = _mm_loadu_si128(reinterpret_cast<const __m128i*>(p));
  return _mm256_castsi256_ps(_mm256_slli_epi32(_mm256_cvtepu16_epi32(bits), 16));
}
inline __m256 load8(const Half* p) {
  return _mm256_cvtph_ps(_mm_loadu_si128(reinterpret_cast<const __m128i*>(p)));
}

inline float hsum8(__m256 v) {
  const __m128 s = _mm_add_ps(_mm256_castps256_ps128(v), _mm256_extractf128_ps(v, 1));
  const __m128 t = _mm_add_ps(s, _mm_movehl_ps(s, s));
  return _mm_cvtss_f32(_mm_add_ss(t, _mm_movehdup_ps(t)));
}

inline float hmax8(__m256 v) {
  const __m128 s = _mm_max_ps(_mm256_castps256_ps128(v), _mm256_extractf128_ps(v, 1));
  const __m128 t = _mm_max_ps(s, _mm_movehl_ps(s, s));
  return _mm_cvtss_f32(_mm_max_ss(t, _mm_movehdup_ps(t)));
}

// Lanes [0, n) of a vector (n may be <= 0 or >= 8).
inline __m256 live_lanes(int64_t n) {
  const __m256i index = _mm256_setr_epi32(0, 1, 2, 3, 4, 5, 6, 7);
  return _mm256_castsi256_ps(_mm256_cmpgt_epi32(_mm256_set1_epi32(static_cast<int>(n)), index));
}

// The AVX-512 kernel's algorithm on AVX2's 8 lanes: head_dim = 8 * C, block_size <= 16 (two vectors of
// scores per query head). A task may cover ``t.heads`` consecutive KV heads (``heads * group <= 16``): each
// block's token rows are then read once for all of them, where one task per KV head reads the sequence's
// blocks once per head (from DRAM again once they outgrow L2: 3x the traffic for SmolLM2's 3 KV heads).
// Each query head's arithmetic is the same either way.
template <typename T, int C>
void attend_avx2(const Task<T>& t) {
  const int64_t G = t.group, H = t.heads, rows = H * G, stride = t.token_stride, BS = t.block_size;
  constexpr int64_t D = 8 * C;
  __m256 qv[16][C];  // heads * group <= 16 (checked by the caller)
  __m256 acc[16][C];
  float m[16], l[16];
  const __m256 scale = _mm256_set1_ps(t.scale), neg_inf = _mm256_set1_ps(kNegInf);
  for (int64_t g = 0; g < rows; ++g) {
    for (int c = 0; c < C; ++c) {
      qv[g][c] = _mm256_mul_ps(load8(t.q + g * D + 8 * c), scale);
      acc[g][c] = _mm256_setzero_ps();
    }
    m[g] = kNegInf;
    l[g] = 0.0f;
  }
  alignas(32) float probs[16][16];
  for (int64_t start = 0; start < t.len; start += BS) {
    const int64_t n = std::min(BS, t.len - start);
    const __m256 live_lo = live_lanes(n), live_hi = live_lanes(n - 8);
    const T* kb = t.k_cache + static_cast<int64_t>(t.table[start / BS]) * BS * stride;
    const T* vb = t.v_cache + static_cast<int64_t>(t.table[start / BS]) * BS * stride;
    prefetch_ahead(t, start);
    for (int64_t j = 0; j < n; ++j)
      for (int64_t h = 0; h < H; ++h) {
        __m256 kv[C];
        for (int c = 0; c < C; ++c) kv[c] = load8(kb + j * stride + h * D + 8 * c);
        for (int64_t g = h * G; g < (h + 1) * G; ++g) {
          __m256 dot = _mm256_mul_ps(qv[g][0], kv[0]);
          for (int c = 1; c < C; ++c) dot = _mm256_fmadd_ps(qv[g][c], kv[c], dot);
          probs[g][j] = hsum8(dot);
        }
      }
    for (int64_t g = 0; g < rows; ++g) {
      // Lanes past the block's n tokens read as -inf (whatever probs holds there): their exp is 0.
      const __m256 s_lo = _mm256_blendv_ps(neg_inf, _mm256_load_ps(probs[g]), live_lo);
      const __m256 s_hi = _mm256_blendv_ps(neg_inf, _mm256_load_ps(probs[g] + 8), live_hi);
      const float new_m = std::max(m[g], hmax8(_mm256_max_ps(s_lo, s_hi)));
      const __m256 top = _mm256_set1_ps(new_m);
      const __m256 p_lo = Sleef_expf8_u10avx2(_mm256_sub_ps(s_lo, top));
      const __m256 p_hi = Sleef_expf8_u10avx2(_mm256_sub_ps(s_hi, top));
      const float correction = std::exp(m[g] - new_m);
      l[g] = l[g] * correction + hsum8(_mm256_add_ps(p_lo, p_hi));
      m[g] = new_m;
      _mm256_store_ps(probs[g], p_lo);
      _mm256_store_ps(probs[g] + 8, p_hi);
      const __m256 cv = _mm256_set1_ps(correction);
      for (int c = 0; c < C; ++c) acc[g][c] = _mm256_mul_ps(acc[g][c], cv);
    }
    for (int64_t j = 0; j < n; ++j)
      for (int64_t h = 0; h < H; ++h) {
        __m256 vv[C];
        for (int c = 0; c < C; ++c) vv[c] = load8(vb + j * stride + h * D + 8 * c);
        for (int64_t g = h * G; g < (h + 1) * G; ++g) {
          const __m256 p = _mm256_set1_ps(probs[g][j]);
          for (int c = 0; c < C; ++c) acc[g][c] = _mm256_fmadd_ps(p, vv[c], acc[g][c]);
        }
      }
  }
  for (int64_t g = 0; g < rows; ++g)
    for (int c = 0; c < C; ++c) _mm256_storeu_ps(t.out + g * D + 8 * c, acc[g][c]);
  finish(t.out, t.lse, rows, D, m, l);
}
#endif

template <typename T>
void attend(const Task<T>& t, float* scratch) {
#if PARROT_DECODE_VECTOR == 512
  if (t.group <= 8 && t.block_size <= 16) {
    switch (t.head_dim) {
      case 32: return attend_avx512<T, 2>(t);
      case 64: return attend_avx512<T, 4>(t);
      case 128: return attend_avx512<T, 8>(t);
      default: break;
    }
  }
#elif PARROT_DECODE_VECTOR == 256
  if (t.heads * t.group <= 16 && t.block_size <= 16) {
    switch (t.head_dim) {
      case 32: return attend_avx2<T, 4>(t);
      case 64: return attend_avx2<T, 8>(t);
      case 128: return attend_avx2<T, 16>(t);
      default: break;
    }
  }
#endif
  attend_scalar<T>(t, scratch);
}

}  // namespace

// q [batch, q_heads, head_dim]; caches [num_blocks, block_size, kv_heads, head_dim]; block tables [batch,
// max_blocks] and context lengths [batch] int32; out [batch, q_heads, head_dim] and lse [batch, q_heads]
// float32; all contiguous, q and the caches of one dtype (the binding checks). Every length and every block
// a length reaches is checked first: a bad table must never read outside the cache.
PARROT_API int parrot_paged_decode_partial(int dtype, const void* q, const void* k_cache, const void* v_cache,
                                           const int32_t* tables, const int32_t* lens, float* out, float* lse,
                                           int64_t batch, int64_t q_heads, int64_t head_dim, int64_t num_blocks,
                                           int64_t block_size, int64_t kv_heads, int64_t max_blocks, float scale,
                                           int threads) {
  for (int64_t b = 0; b < batch; ++b) {
    const int64_t len = lens[b];
    if (len < 0 || len > max_blocks * block_size)
      return fail("context length " + std::to_string(len) + " outside its table");
    for (int64_t i = 0; i < (len + block_size - 1) / block_size; ++i) {
      const int32_t blk = tables[b * max_blocks + i];
      if (blk < 0 || blk >= num_blocks) return fail("block " + std::to_string(blk) + " outside the cache");
    }
  }
  const int64_t group = q_heads / kv_heads;
  bool fused = false;
#if PARROT_DECODE_VECTOR == 256
  fused = kv_heads * group <= 16 && block_size <= 16 && (head_dim == 32 || head_dim == 64 || head_dim == 128) &&
          batch >= 2 * static_cast<int64_t>(threads);
#endif
  return dispatch(dtype, "paged_decode_partial", [&](auto* type_tag) {
    using T = std::remove_pointer_t<decltype(type_tag)>;
    const T* q_ptr = static_cast<const T*>(q);
    const T* k_ptr = static_cast<const T*>(k_cache);
    const T* v_ptr = static_cast<const T*>(v_cache);
    // A task per sequence, covering all its KV heads, where there are sequences enough to keep every
    // thread busy and the AVX2 kernel takes them; else a task per (sequence, KV head).
    const int64_t task_heads = fused ? kv_heads : 1, tasks_per_seq = kv_heads / task_heads;
    parallel_for(0, batch * tasks_per_seq, 1, threads, [&](int64_t begin, int64_t end) {
      std::vector<float> scratch(group * head_dim + group * block_size);
      for (int64_t i = begin; i < end; ++i) {
        const int64_t b = i / tasks_per_seq, h = i % tasks_per_seq * task_heads;
        const int64_t row = b * q_heads + h * group;
        const Task<T> task{q_ptr + row * head_dim, k_ptr + h * head_dim, v_ptr + h * head_dim,
                           tables + b * max_blocks, lens[b], h, group, head_dim, kv_heads * head_dim,
                           block_size, scale, task_heads, out + row * head_dim, lse + row};
        attend<T>(task, scratch.data());
      }
    });
  });
}

// Which vector path this build runs head dims 32/64/128 with: 512 (AVX-512), 256 (AVX2 with FMA and F16C)
// or 0 (the plain loops only).
PARROT_API int parrot_paged_decode_vector_bits() {
#if defined(PARROT_DECODE_VECTOR)
  return PARROT_DECODE_VECTOR;
#else
  return 0;
#endif
}
