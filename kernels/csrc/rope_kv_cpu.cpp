// RoPE on a step's fused q/k/v projection and the step's K/V written into the block cache, in one pass per
// token: on CPU a small model's attention prologue was ~7 tiny ops per layer (the halves swapped, two
// products, a sum, two index copies, views). Arithmetic as Hugging Face's reference in the activation dtype:
// x * cos and swapped(x) * sin (sin with its first half negated: `server.engine.rope`) each rounded to the
// dtype, then their sum rounded.
#include "bf16_avx512.h"
#include "common.h"

#include <cstdint>
#include <cstring>
#include <type_traits>

namespace {

using namespace parrot_cpu;  // NOLINT: the bf16 lane helpers of bf16_avx512.h

// Tokens a call keeps on its thread (~0.3 us a token of SmolLM2's 15 heads in bf16): a second thread's wake-up
// from a passive wait cost more than it saved up to ~200 tokens (61 vs 10 us at 16, 80 vs 36 at 128).
constexpr int64_t kGrainTokens = 256;

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
inline void rotate_range_bf16(const BF16* x, const BF16* swapped, const BF16* cos,
                              const BF16* sin, BF16* out, int64_t n) {
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
  if constexpr (std::is_same_v<T, BF16>) {
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
               int64_t tokens, int64_t heads, int64_t kv_heads, int64_t d, int threads) {
  const int64_t row = (heads + 2 * kv_heads) * d, kv_row = kv_heads * d;
  parallel_for(0, tokens, kGrainTokens, threads, [&](int64_t begin, int64_t end) {
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

}  // namespace

// qkv [T, (H + 2 KVH) D]; cos, sin [T, D]; caches [num_slots, KVH, D] (blocks of slots); slots [T]; q [T, H, D]
// and k [T, KVH, D] out; all contiguous, of one dtype but the slots (the binding checks). Writes rotated k and
// v at each token's slot, every slot checked first: a bad one must never write outside the cache.
PARROT_API int parrot_rope_write_kv(int dtype, const void* qkv, const void* cos, const void* sin, void* k_cache,
                                    void* v_cache, const int64_t* slots, int64_t num_slots, void* q, void* k,
                                    int64_t tokens, int64_t heads, int64_t kv_heads, int64_t d, int threads) {
  for (int64_t t = 0; t < tokens; ++t)
    if (slots[t] < 0 || slots[t] >= num_slots)
      return fail("slot " + std::to_string(slots[t]) + " outside the cache");
  return dispatch(dtype, "rope_write_kv", [&](auto* type_tag) {
    using T = std::remove_pointer_t<decltype(type_tag)>;
    rope_rows<T>(static_cast<const T*>(qkv), static_cast<const T*>(cos), static_cast<const T*>(sin),
                 static_cast<T*>(q), static_cast<T*>(k), static_cast<T*>(k_cache), static_cast<T*>(v_cache), slots,
                 tokens, heads, kv_heads, d, threads);
  });
}
