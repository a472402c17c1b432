// The residual add and RMSNorm of a decoder layer in one pass per row: h += delta (rounded to h's dtype, as
// an in-place add is), then the row's RMS in float32 and (h / rms -> h's dtype) * weight, the Hugging Face
// reference's two roundings. On CPU a small model's norm is ~9 tiny ops per call, 61 calls per step.
#include <ATen/ATen.h>
#include <ATen/Parallel.h>
#include <c10/util/BFloat16.h>
#include <c10/util/Half.h>
#include <torch/library.h>

#include "bf16_avx512.h"

#include <cmath>
#include <cstdint>
#include <type_traits>
#include <vector>

namespace {

using namespace parrot_cpu;  // NOLINT: the bf16 lane helpers of bf16_avx512.h

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
void norm_row_bf16_avx512(c10::BFloat16* hr, const c10::BFloat16* dr, const c10::BFloat16* weight,
                          c10::BFloat16* o, int64_t hidden, float eps, float* x) {
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
void norm_rows(T* h, const T* delta, const T* weight, T* out, int64_t rows, int64_t hidden, float eps) {
  at::parallel_for(0, rows, 8, [&](int64_t begin, int64_t end) {
    std::vector<float> x(hidden);
    for (int64_t r = begin; r < end; ++r) {
      T* hr = h + r * hidden;
      const T* dr = delta != nullptr ? delta + r * hidden : nullptr;
      T* o = out + r * hidden;
#if defined(__AVX512F__) && defined(__AVX512BF16__)
      if constexpr (std::is_same_v<T, c10::BFloat16>) {
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

at::Tensor add_rms_norm(at::Tensor& h, const c10::optional<at::Tensor>& delta, const at::Tensor& weight,
                        double eps) {
  TORCH_CHECK(h.dim() == 2 && h.is_contiguous(), "h must be a contiguous [rows, hidden] tensor");
  TORCH_CHECK(weight.dim() == 1 && weight.size(0) == h.size(1) && weight.scalar_type() == h.scalar_type(),
              "weight must be [hidden] of h's dtype");
  if (delta.has_value())
    TORCH_CHECK(delta->sizes() == h.sizes() && delta->scalar_type() == h.scalar_type(), "delta must be like h");
  const auto d = delta.has_value() ? delta->contiguous() : at::Tensor();
  const auto w = weight.contiguous();
  auto out = at::empty_like(h);
  auto run = [&](auto* type_tag) {
    using T = std::remove_pointer_t<decltype(type_tag)>;
    norm_rows<T>(reinterpret_cast<T*>(h.data_ptr()), d.defined() ? reinterpret_cast<const T*>(d.data_ptr()) : nullptr,
                 reinterpret_cast<const T*>(w.data_ptr()), reinterpret_cast<T*>(out.data_ptr()), h.size(0), h.size(1),
                 static_cast<float>(eps));
  };
  switch (h.scalar_type()) {
    case at::kFloat: run(static_cast<float*>(nullptr)); break;
    case at::kBFloat16: run(static_cast<c10::BFloat16*>(nullptr)); break;
    case at::kHalf: run(static_cast<c10::Half*>(nullptr)); break;
    default: TORCH_CHECK(false, "add_rms_norm: float32, bfloat16 or float16, not ", h.scalar_type());
  }
  return out;
}

}  // namespace

TORCH_LIBRARY_FRAGMENT(parrot_cpu, m) {
  m.def("add_rms_norm(Tensor(a!) h, Tensor? delta, Tensor weight, float eps) -> Tensor");
}

TORCH_LIBRARY_IMPL(parrot_cpu, CPU, m) { m.impl("add_rms_norm", &add_rms_norm); }
