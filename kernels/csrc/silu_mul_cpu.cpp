// SwiGLU's activation in one pass: silu(gate) * up over the fused gate/up projection [T, 2n] -> [T, n], with
// Hugging Face's roundings in the activation dtype (silu computed in float32 and rounded, then the product
// rounded). torch runs it as two ops and an intermediate tensor per layer.
#include <ATen/ATen.h>
#include <ATen/Parallel.h>
#include <c10/util/BFloat16.h>
#include <c10/util/Half.h>
#include <torch/library.h>

#include "bf16_avx512.h"

#include <cmath>
#include <cstdint>
#include <type_traits>

#if defined(__AVX512F__) || (defined(__AVX2__) && defined(__FMA__))
#include <immintrin.h>
#include <sleef.h>  // torch links SLEEF: its vectorised exp, as torch's own silu uses
#endif

namespace {

using namespace parrot_cpu;  // NOLINT: the bf16 lane helpers of bf16_avx512.h

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
void silu_mul_row_bf16(const c10::BFloat16* gate, const c10::BFloat16* up, c10::BFloat16* out, int64_t n) {
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

at::Tensor silu_mul(const at::Tensor& gate_up) {
  TORCH_CHECK(gate_up.dim() == 2 && gate_up.size(1) % 2 == 0, "gate_up must be [T, 2n]");
  const auto x = gate_up.contiguous();
  const int64_t tokens = x.size(0), n = x.size(1) / 2;
  auto out = at::empty({tokens, n}, x.options());
  auto run = [&](auto* type_tag) {
    using T = std::remove_pointer_t<decltype(type_tag)>;
    const T* in = reinterpret_cast<const T*>(x.data_ptr());
    T* o = reinterpret_cast<T*>(out.data_ptr());
    at::parallel_for(0, tokens, 1, [&](int64_t begin, int64_t end) {
      for (int64_t t = begin; t < end; ++t) {
#if defined(__AVX512F__) && defined(__AVX512BF16__)
        if constexpr (std::is_same_v<T, c10::BFloat16>) {
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
  };
  switch (x.scalar_type()) {
    case at::kFloat: run(static_cast<float*>(nullptr)); break;
    case at::kBFloat16: run(static_cast<c10::BFloat16*>(nullptr)); break;
    case at::kHalf: run(static_cast<c10::Half*>(nullptr)); break;
    default: TORCH_CHECK(false, "silu_mul: float32, bfloat16 or float16, not ", x.scalar_type());
  }
  return out;
}

}  // namespace

TORCH_LIBRARY_FRAGMENT(parrot_cpu, m) { m.def("silu_mul(Tensor gate_up) -> Tensor"); }

TORCH_LIBRARY_IMPL(parrot_cpu, CPU, m) { m.impl("silu_mul", &silu_mul); }
