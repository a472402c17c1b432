// RoPE on a step's fused q/k/v projection and the step's K/V written into the block cache, in one pass per
// token: on CPU a small model's attention prologue was ~7 tiny ops per layer (the halves swapped, two
// products, a sum, two index copies, views). Arithmetic as Hugging Face's reference in the activation dtype:
// x * cos and swapped(x) * sin (sin with its first half negated: `server.engine.rope`) each rounded to the
// dtype, then their sum rounded.
#include <ATen/ATen.h>
#include <ATen/Parallel.h>
#include <c10/util/BFloat16.h>
#include <c10/util/Half.h>
#include <torch/library.h>

#include "bf16_avx512.h"

#include <cstdint>
#include <cstring>
#include <tuple>
#include <type_traits>

namespace {

using namespace parrot_cpu;  // NOLINT: the bf16 lane helpers of bf16_avx512.h

// out[j] = x[j] * cos[j] + swapped[j] * sin[j] over n lanes, each product and the sum rounded to T.
template <typename T>
inline void rotate_range(const T* x, const T* swapped, const T* cos, const T* sin, T* out, int64_t n) {
  for (int64_t j = 0; j < n; ++j) {
    const T a = static_cast<T>(static_cast<float>(swapped[j]) * static_cast<float>(sin[j]));
    const T b = static_cast<T>(static_cast<float>(x[j]) * static_cast<float>(cos[j]));
    out[j] = static_cast<T>(static_cast<float>(a) + static_cast<float>(b));
  }
}

#if defined(__AVX512F__) && defined(__AVX512BF16__)

// The same arithmetic sixteen lanes at a time (n % 16 == 0).
inline void rotate_range_bf16(const c10::BFloat16* x, const c10::BFloat16* swapped, const c10::BFloat16* cos,
                              const c10::BFloat16* sin, c10::BFloat16* out, int64_t n) {
  for (int64_t j = 0; j < n; j += 16) {
    const __m512 a = bf16_round(_mm512_mul_ps(bf16_load(swapped + j), bf16_load(sin + j)));
    const __m512 b = bf16_round(_mm512_mul_ps(bf16_load(x + j), bf16_load(cos + j)));
    bf16_store(out + j, _mm512_add_ps(a, b));
  }
}
#endif

// One head's vector x [D] rotated into out [D]: the first half pairs with the second and the other way round.
template <typename T>
inline void rotate_head(const T* x, const T* cos, const T* sin, T* out, int64_t d) {
  const int64_t half = d / 2;
#if defined(__AVX512F__) && defined(__AVX512BF16__)
  if constexpr (std::is_same_v<T, c10::BFloat16>) {
    if (half % 16 == 0) {
      rotate_range_bf16(x, x + half, cos, sin, out, half);
      rotate_range_bf16(x + half, x, cos + half, sin + half, out + half, half);
      return;
    }
  }
#endif
  rotate_range<T>(x, x + half, cos, sin, out, half);
  rotate_range<T>(x + half, x, cos + half, sin + half, out + half, half);
}

template <typename T>
void rope_rows(const T* qkv, const T* cos, const T* sin, T* q, T* k, T* k_cache, T* v_cache, const int64_t* slots,
               int64_t tokens, int64_t heads, int64_t kv_heads, int64_t d) {
  const int64_t row = (heads + 2 * kv_heads) * d, kv_row = kv_heads * d;
  at::parallel_for(0, tokens, 4, [&](int64_t begin, int64_t end) {
    for (int64_t t = begin; t < end; ++t) {
      const T* x = qkv + t * row;
      const T* c = cos + t * d;
      const T* s = sin + t * d;
      for (int64_t h = 0; h < heads; ++h) rotate_head<T>(x + h * d, c, s, q + (t * heads + h) * d, d);
      T* kt = k + t * kv_row;
      for (int64_t h = 0; h < kv_heads; ++h) rotate_head<T>(x + (heads + h) * d, c, s, kt + h * d, d);
      std::memcpy(k_cache + slots[t] * kv_row, kt, kv_row * sizeof(T));
      std::memcpy(v_cache + slots[t] * kv_row, x + (heads + kv_heads) * d, kv_row * sizeof(T));
    }
  });
}

// qkv [T, (H + 2 KVH) D]; cos, sin [T, D] (or [T, 1, D]); caches [blocks, block_size, KVH, D]; slots [T] int64.
// Returns q [T, H, D] and k [T, KVH, D], rotated; writes rotated k and v at each token's slot.
std::tuple<at::Tensor, at::Tensor> rope_write_kv(const at::Tensor& qkv, const at::Tensor& cos, const at::Tensor& sin,
                                                 at::Tensor& k_cache, at::Tensor& v_cache,
                                                 const at::Tensor& slot_mapping, int64_t heads, int64_t kv_heads) {
  TORCH_CHECK(k_cache.dim() == 4 && v_cache.sizes() == k_cache.sizes() && k_cache.is_contiguous() &&
                  v_cache.is_contiguous(),
              "k_cache and v_cache must be contiguous [num_blocks, block_size, kv_heads, head_dim]");
  const int64_t d = k_cache.size(3), tokens = qkv.size(0);
  TORCH_CHECK(k_cache.size(2) == kv_heads && d % 2 == 0, "the cache's head shape disagrees with kv_heads");
  TORCH_CHECK(qkv.dim() == 2 && qkv.size(1) == (heads + 2 * kv_heads) * d, "qkv must be [T, (H + 2 KVH) D]");
  TORCH_CHECK(cos.numel() == tokens * d && sin.sizes() == cos.sizes(), "cos and sin must hold [T, D] values");
  TORCH_CHECK(slot_mapping.scalar_type() == at::kLong && slot_mapping.numel() == tokens, "one int64 slot per token");
  const auto dtype = qkv.scalar_type();
  TORCH_CHECK(cos.scalar_type() == dtype && sin.scalar_type() == dtype && k_cache.scalar_type() == dtype &&
                  v_cache.scalar_type() == dtype,
              "qkv, cos, sin and the caches must share one dtype");
  const auto x = qkv.contiguous(), c = cos.contiguous(), s = sin.contiguous(), slots = slot_mapping.contiguous();
  const int64_t* slot_ptr = slots.data_ptr<int64_t>();
  const int64_t num_slots = k_cache.size(0) * k_cache.size(1);
  for (int64_t t = 0; t < tokens; ++t)  // bounds first: a bad slot must never write outside the cache
    TORCH_CHECK(slot_ptr[t] >= 0 && slot_ptr[t] < num_slots, "slot ", slot_ptr[t], " outside the cache");
  auto q = at::empty({tokens, heads, d}, qkv.options());
  auto k = at::empty({tokens, kv_heads, d}, qkv.options());
  auto run = [&](auto* type_tag) {
    using T = std::remove_pointer_t<decltype(type_tag)>;
    rope_rows<T>(reinterpret_cast<const T*>(x.data_ptr()), reinterpret_cast<const T*>(c.data_ptr()),
                 reinterpret_cast<const T*>(s.data_ptr()), reinterpret_cast<T*>(q.data_ptr()),
                 reinterpret_cast<T*>(k.data_ptr()), reinterpret_cast<T*>(k_cache.data_ptr()),
                 reinterpret_cast<T*>(v_cache.data_ptr()), slot_ptr, tokens, heads, kv_heads, d);
  };
  switch (dtype) {
    case at::kFloat: run(static_cast<float*>(nullptr)); break;
    case at::kBFloat16: run(static_cast<c10::BFloat16*>(nullptr)); break;
    case at::kHalf: run(static_cast<c10::Half*>(nullptr)); break;
    default: TORCH_CHECK(false, "rope_write_kv: float32, bfloat16 or float16, not ", dtype);
  }
  return {q, k};
}

}  // namespace

TORCH_LIBRARY_FRAGMENT(parrot_cpu, m) {
  m.def(
      "rope_write_kv(Tensor qkv, Tensor cos, Tensor sin, Tensor(a!) k_cache, Tensor(b!) v_cache, "
      "Tensor slot_mapping, int heads, int kv_heads) -> (Tensor, Tensor)");
}

TORCH_LIBRARY_IMPL(parrot_cpu, CPU, m) { m.impl("rope_write_kv", &rope_write_kv); }
