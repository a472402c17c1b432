// The residual add and RMSNorm of a decoder layer in one pass per row: h += delta (rounded to h's dtype, as
// an in-place add is), then the row's RMS in float32 and (h / rms -> h's dtype) * weight, the Hugging Face
// reference's two roundings. On CPU a small model's norm is ~9 tiny ops per call, 61 calls per step.
#include "bf16_avx512.h"
#include "common.h"

#include <cmath>
#include <cstdint>
#include <type_traits>
#include <vector>

namespace {

using namespace parrot_cpu;  // NOLINT: the bf16 lane helpers of bf16_avx512.h

// Rows a call keeps on its thread (~0.2 us a row of 576 in bf16, AVX-512): a second thread's wake-up from a
// passive wait cost more than it saved up to ~250 rows (54 vs 7 us at 16 rows, 60 vs 15 at 64).
constexpr int64_t kGrainRows = 512;

template <typename T>
void norm_row(T* hr, const T* dr, const T* weight, T* o, int64_t hidden, float eps, float* x) {
  float sum = 0.0f;
  for (int64_t i = 0; i < hidden; ++i) {
    if (dr != nullptr) hr[i] = static_cast<T>(static_cast<float>(hr[i]) + static_cast<float>(dr[i]));
    x[i] = static_cast<float>(hr[i]);
    sum += x[i] * x[i];
  }
  const float inv = 1.0f / std::sqrt(sum / static_cast<float>(hidden) + eps);
  for (int64_t i = 0; i < hidden; ++i)
    o[i] = static_cast<T>(static_cast<float>(static_cast<T>(x[i] * inv)) * static_cast<float>(weight[i]));
}

#if defined(__AVX512F__) && defined(__AVX512BF16__)

// bf16 with hidden % 16 == 0: the same arithmetic sixteen lanes at a time.
void norm_row_bf16_avx512(BF16* hr, const BF16* dr, const BF16* weight,
                          BF16* o, int64_t hidden, float eps, float* x) {
  __m512 acc = _mm512_setzero_ps();
  for (int64_t i = 0; i < hidden; i += 16) {
    __m512 v = bf16_load(hr + i);
    if (dr != nullptr) {
      v = bf16_round(_mm512_add_ps(v, bf16_load(dr + i)));
      bf16_store(hr + i, v);
    }
    _mm512_storeu_ps(x + i, v);
    acc = _mm512_fmadd_ps(v, v, acc);
  }
  const float inv = 1.0f / std::sqrt(_mm512_reduce_add_ps(acc) / static_cast<float>(hidden) + eps);
  const __m512 scale = _mm512_set1_ps(inv);
  for (int64_t i = 0; i < hidden; i += 16)
    bf16_store(o + i, _mm512_mul_ps(bf16_round(_mm512_mul_ps(_mm512_loadu_ps(x + i), scale)), bf16_load(weight + i)));
}
#endif

template <typename T>
void norm_rows(T* h, const T* delta, const T* weight, T* out, int64_t rows, int64_t hidden, float eps,
               int threads) {
  parallel_for(0, rows, kGrainRows, threads, [&](int64_t begin, int64_t end) {
    std::vector<float> x(hidden);
    for (int64_t r = begin; r < end; ++r) {
      T* hr = h + r * hidden;
      const T* dr = delta != nullptr ? delta + r * hidden : nullptr;
      T* o = out + r * hidden;
#if defined(__AVX512F__) && defined(__AVX512BF16__)
      if constexpr (std::is_same_v<T, BF16>) {
        if (hidden % 16 == 0) {
          norm_row_bf16_avx512(hr, dr, weight, o, hidden, eps, x.data());
          continue;
        }
      }
#endif
      norm_row<T>(hr, dr, weight, o, hidden, eps, x.data());
    }
  });
}

}  // namespace

// h [rows, hidden] (updated in place by delta [rows, hidden] where given), weight [hidden], out [rows,
// hidden], all of one dtype and contiguous (the binding checks).
PARROT_API int parrot_add_rms_norm(int dtype, void* h, const void* delta, const void* weight, void* out, int64_t rows,
                                   int64_t hidden, float eps, int threads) {
  return dispatch(dtype, "add_rms_norm", [&](auto* type_tag) {
    using T = std::remove_pointer_t<decltype(type_tag)>;
    norm_rows<T>(static_cast<T*>(h), static_cast<const T*>(delta), static_cast<const T*>(weight),
                 static_cast<T*>(out), rows, hidden, eps, threads);
  });
}
