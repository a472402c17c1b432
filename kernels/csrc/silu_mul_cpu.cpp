// SwiGLU's activation in one pass: silu(gate) * up over the fused gate/up projection [T, 2n] -> [T, n], with
// Hugging Face's roundings in the activation dtype (silu computed in float32 and rounded, then the product
// rounded). torch runs it as two ops and an intermediate tensor per layer.
#include "bf16_avx512.h"
#include "common.h"

#include <cmath>
#include <cstdint>
#include <type_traits>

#if defined(__AVX512F__) || (defined(__AVX2__) && defined(__FMA__))
#include <immintrin.h>
#include <sleef.h>  // torch links SLEEF: its vectorised exp, as torch's own silu uses
#endif

namespace {

using namespace parrot_cpu;  // NOLINT: the bf16 lane helpers of bf16_avx512.h

// Tokens a call keeps on its thread (~1 us a token of 1,536 in bf16): a second thread's wake-up from a
// passive wait cost more than it saved up to ~100 tokens (57 vs 17 us at 16, 76 vs 60 at 64, 134 vs 147 at 128).
constexpr int64_t kGrainTokens = 64;

template <typename T>
void silu_mul_row(const T* gate, const T* up, T* out, int64_t n) {
  for (int64_t j = 0; j < n; ++j) {
    const float g = static_cast<float>(gate[j]);
    const T s = static_cast<T>(g / (1.0f + std::exp(-g)));
    out[j] = static_cast<T>(static_cast<float>(s) * static_cast<float>(up[j]));
  }
}

#if defined(__AVX512F__) && defined(__AVX512BF16__)

// The same arithmetic sixteen lanes at a time (n % 16 == 0).
void silu_mul_row_bf16(const BF16* gate, const BF16* up, BF16* out, int64_t n) {
  const __m512 one = _mm512_set1_ps(1.0f);
  for (int64_t j = 0; j < n; j += 16) {
    const __m512 g = bf16_load(gate + j);
    const __m512 e = Sleef_expf16_u10(_mm512_sub_ps(_mm512_setzero_ps(), g));
    const __m512 s = bf16_round(_mm512_div_ps(g, _mm512_add_ps(one, e)));
    bf16_store(out + j, _mm512_mul_ps(s, bf16_load(up + j)));
  }
}
#endif

#if defined(__AVX2__) && defined(__FMA__)

// float32 eight lanes at a time (n % 8 == 0) with SLEEF's exp, as torch's own AVX2 silu: the scalar loop
// (libm's exp, one lane) took 6% of a SmolLM2 prefill on an AVX2 CPU.
void silu_mul_row_f32(const float* gate, const float* up, float* out, int64_t n) {
  const __m256 one = _mm256_set1_ps(1.0f);
  for (int64_t j = 0; j < n; j += 8) {
    const __m256 g = _mm256_loadu_ps(gate + j);
    const __m256 e = Sleef_expf8_u10avx2(_mm256_sub_ps(_mm256_setzero_ps(), g));
    const __m256 s = _mm256_div_ps(g, _mm256_add_ps(one, e));
    _mm256_storeu_ps(out + j, _mm256_mul_ps(s, _mm256_loadu_ps(up + j)));
  }
}
#endif

}  // namespace

// gate_up [tokens, 2n] -> out [tokens, n], contiguous, of one dtype.
PARROT_API int parrot_silu_mul(int dtype, const void* gate_up, void* out, int64_t tokens, int64_t n, int threads) {
  return dispatch(dtype, "silu_mul", [&](auto* type_tag) {
    using T = std::remove_pointer_t<decltype(type_tag)>;
    const T* in = static_cast<const T*>(gate_up);
    T* o = static_cast<T*>(out);
    parallel_for(0, tokens, kGrainTokens, threads, [&](int64_t begin, int64_t end) {
      for (int64_t t = begin; t < end; ++t) {
#if defined(__AVX512F__) && defined(__AVX512BF16__)
        if constexpr (std::is_same_v<T, BF16>) {
          if (n % 16 == 0) {
            silu_mul_row_bf16(in + t * 2 * n, in + t * 2 * n + n, o + t * n, n);
            continue;
          }
        }
#endif
#if defined(__AVX2__) && defined(__FMA__)
        if constexpr (std::is_same_v<T, float>) {
          if (n % 8 == 0) {
            silu_mul_row_f32(in + t * 2 * n, in + t * 2 * n + n, o + t * n, n);
            continue;
          }
        }
#endif
        silu_mul_row<T>(in + t * 2 * n, in + t * 2 * n + n, o + t * n, n);
      }
    });
  });
}
