// bfloat16 <-> float32 lanes for the AVX-512 paths of our CPU kernels (rounding and stores need AVX512-BF16).
#pragma once

#include "common.h"  // BF16, and the namespace the kernels use even where this header adds nothing

#if defined(__AVX512F__)
namespace parrot_cpu {

// Sixteen bf16 values widened to float32 (exact; bf16 is the top half of a float32).
inline __m512 bf16_load(const BF16* p) {
  const __m256i bits = _mm256_loadu_si256(reinterpret_cast<const __m256i*>(p));
  return _mm512_castsi512_ps(_mm512_slli_epi32(_mm512_cvtepu16_epi32(bits), 16));
}

#if defined(__AVX512BF16__)
// Rounded to bf16 (to nearest even) and widened back: the rounding an op in bf16 applies.
inline __m512 bf16_round(__m512 v) {
  return _mm512_castsi512_ps(_mm512_slli_epi32(_mm512_cvtepu16_epi32((__m256i)_mm512_cvtneps_pbh(v)), 16));
}

inline void bf16_store(BF16* p, __m512 v) {
  _mm256_storeu_si256(reinterpret_cast<__m256i*>(p), (__m256i)_mm512_cvtneps_pbh(v));
}
#endif

}  // namespace parrot_cpu
#endif
