// Linears of few rows (decode steps): y = x w^T (+ bias) for float32 and bf16, reading the plain row-major
// weight once. A decode step of a small model is bound by these weight reads, and oneDNN reads them slowly
// at few rows on this kind of CPU (measured in `kernels/cpu_linear.py`). Each task takes tiles of eight
// weight rows (eight sequential streams the hardware prefetchers follow; software prefetch measured slower)
// and runs x's rows over a tile four at a time, so the tile is read from memory once and from cache after.
// float32 accumulates with FMA; bf16 with AVX512-BF16 dot products (vdpbf16ps) into float32 and rounds once
// at the end. The bias is added in float32 before that rounding, as oneDNN does.
#include "common.h"

#include <algorithm>
#include <cstdint>
#include <type_traits>

#if defined(__AVX512F__)
#include <immintrin.h>
#endif

namespace {

using namespace parrot_cpu;  // NOLINT: BF16, parallel_for

constexpr int64_t kTileRows = 8;  // weight rows per tile
constexpr int kRowGroup = 4;      // x rows per pass over a tile

#if defined(__AVX512F__)

// The lanes one multiply-accumulate takes: 16 floats, or 32 bf16 (pairs, for vdpbf16ps).
template <typename T>
constexpr int64_t kLanes = std::is_same_v<T, float> ? 16 : 32;

template <typename T>
inline void madd(__m512& acc, const T* x, const T* w, int64_t k, __mmask32 tail) {
  if constexpr (std::is_same_v<T, float>) {
    const __mmask16 m = static_cast<__mmask16>(tail);
    acc = _mm512_fmadd_ps(_mm512_maskz_loadu_ps(m, x + k), _mm512_maskz_loadu_ps(m, w + k), acc);
  } else {
#if defined(__AVX512BF16__)
    const auto xv = (__m512bh)_mm512_maskz_loadu_epi16(tail, x + k);
    acc = _mm512_dpbf16_ps(acc, xv, (__m512bh)_mm512_maskz_loadu_epi16(tail, w + k));
#endif
  }
}

// Output columns n..n+R for M rows of x. Whole chunks run unmasked (the loop the compiler unrolls); a
// tail of K % lanes is read masked (zeros beyond).
template <typename T, int M, int R, bool Bias, bool Tail>
__attribute__((always_inline)) inline void tile(const T* x, const T* w, const float* bias, T* y, int64_t K,
                                                int64_t N, int64_t n) {
  constexpr int64_t L = kLanes<T>;
  __m512 acc[M][R];
  for (int m = 0; m < M; ++m)
    for (int r = 0; r < R; ++r) acc[m][r] = _mm512_setzero_ps();
  const int64_t whole = K - K % L;
  for (int64_t k = 0; k < whole; k += L) {
    if constexpr (std::is_same_v<T, float>) {
      __m512 wv[R];
      for (int r = 0; r < R; ++r) wv[r] = _mm512_loadu_ps(w + (n + r) * K + k);
      for (int m = 0; m < M; ++m) {
        const __m512 xv = _mm512_loadu_ps(x + m * K + k);
        for (int r = 0; r < R; ++r) acc[m][r] = _mm512_fmadd_ps(xv, wv[r], acc[m][r]);
      }
    } else {
#if defined(__AVX512BF16__)
      __m512bh wv[R];
      for (int r = 0; r < R; ++r) wv[r] = (__m512bh)_mm512_loadu_si512(w + (n + r) * K + k);
      for (int m = 0; m < M; ++m) {
        const auto xv = (__m512bh)_mm512_loadu_si512(x + m * K + k);
        for (int r = 0; r < R; ++r) acc[m][r] = _mm512_dpbf16_ps(acc[m][r], xv, wv[r]);
      }
#endif
    }
  }
  if constexpr (Tail) {
    const __mmask32 tail = (__mmask32(1) << (K - whole)) - 1;
    for (int m = 0; m < M; ++m)
      for (int r = 0; r < R; ++r) madd<T>(acc[m][r], x + m * K, w + (n + r) * K, whole, tail);
  }
  for (int m = 0; m < M; ++m)
    for (int r = 0; r < R; ++r) {
      float sum = _mm512_reduce_add_ps(acc[m][r]);
      if constexpr (Bias) sum += bias[n + r];
      y[m * N + n + r] = T(sum);
    }
}

template <typename T, int M, bool Bias, bool Tail>
void rows(const T* x, const T* w, const float* bias, T* y, int64_t K, int64_t N, int64_t n0, int64_t n1) {
  int64_t n = n0;
  for (; n + kTileRows <= n1; n += kTileRows) tile<T, M, kTileRows, Bias, Tail>(x, w, bias, y, K, N, n);
  for (; n < n1; ++n) tile<T, M, 1, Bias, Tail>(x, w, bias, y, K, N, n);
}

// x's rows m..m+G (G <= kRowGroup) over weight rows [n0, n1).
template <typename T, bool Bias, bool Tail>
void group(const T* x, const T* w, const float* bias, T* y, int64_t M, int64_t K, int64_t N, int64_t m,
           int64_t n0, int64_t n1) {
  const T* xm = x + m * K;
  T* ym = y + m * N;
  switch (std::min<int64_t>(kRowGroup, M - m)) {
    case 1: rows<T, 1, Bias, Tail>(xm, w, bias, ym, K, N, n0, n1); break;
    case 2: rows<T, 2, Bias, Tail>(xm, w, bias, ym, K, N, n0, n1); break;
    case 3: rows<T, 3, Bias, Tail>(xm, w, bias, ym, K, N, n0, n1); break;
    default: rows<T, 4, Bias, Tail>(xm, w, bias, ym, K, N, n0, n1); break;
  }
}

template <typename T, bool Bias, bool Tail>
void gemv_into(const T* x, const T* w, const float* bias, T* y, int64_t M, int64_t K, int64_t N, int threads) {
  // 16 tiles (128 weight rows) per task at least: below that, waking a thread costs more than it saves.
  parallel_for(0, (N + kTileRows - 1) / kTileRows, 16, threads, [&](int64_t begin, int64_t end) {
    const int64_t n0 = begin * kTileRows, n1 = std::min(end * kTileRows, N);
    if (M <= kRowGroup) {  // one pass over the task's rows (a loop per tile measured slower at 1 row)
      group<T, Bias, Tail>(x, w, bias, y, M, K, N, 0, n0, n1);
      return;
    }
    // Tile by tile, all of x's row groups over each: the tile stays in cache after the first group.
    for (int64_t n = n0; n < n1; n += kTileRows) {
      const int64_t stop = std::min(n + kTileRows, n1);
      for (int64_t m = 0; m < M; m += kRowGroup) group<T, Bias, Tail>(x, w, bias, y, M, K, N, m, n, stop);
    }
  });
}

// The bias and the lane tail are template arguments and `tile` is inlined by force: at K in the hundreds a
// tile is ~20 trips of its loop, and a call per tile or a run-time test in its epilogue made one row ~12%
// slower than the bare loop (each measured on the 56 MB LM head).
template <typename T>
void gemv_any(const T* x, const T* w, const float* bias, T* y, int64_t M, int64_t K, int64_t N, int threads) {
  const bool tail = K % kLanes<T> != 0;
  if (bias != nullptr && tail) gemv_into<T, true, true>(x, w, bias, y, M, K, N, threads);
  else if (bias != nullptr) gemv_into<T, true, false>(x, w, bias, y, M, K, N, threads);
  else if (tail) gemv_into<T, false, true>(x, w, bias, y, M, K, N, threads);
  else gemv_into<T, false, false>(x, w, bias, y, M, K, N, threads);
}
#endif

}  // namespace

// Whether this build runs ``dtype`` (float32 with AVX-512; bf16 with AVX512-BF16 too).
PARROT_API int parrot_gemv_supports(int dtype) {
#if defined(__AVX512F__)
  if (dtype == kFloat32) return 1;
#if defined(__AVX512BF16__)
  if (dtype == kBFloat16) return 1;
#endif
#endif
  (void)dtype;
  return 0;
}

// y [M, N] = x [M, K] w [N, K]^T (+ bias [N], float32), contiguous, x, w and y of one supported dtype.
PARROT_API int parrot_gemv(int dtype, const void* x, const void* w, const float* bias, void* y, int64_t M, int64_t K,
                           int64_t N, int threads) {
  if (!parrot_gemv_supports(dtype)) return fail("gemv: this build has no vector path for dtype code " + std::to_string(dtype));
#if defined(__AVX512F__)
  if (dtype == kFloat32) {
    gemv_any<float>(static_cast<const float*>(x), static_cast<const float*>(w), bias, static_cast<float*>(y), M, K, N,
                    threads);
  } else {
    gemv_any<BF16>(static_cast<const BF16*>(x), static_cast<const BF16*>(w), bias, static_cast<BF16*>(y), M, K, N,
                   threads);
  }
#else
  (void)x, (void)w, (void)bias, (void)y, (void)M, (void)K, (void)N, (void)threads;
#endif
  return 0;
}
