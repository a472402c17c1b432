// Linears of few rows (decode steps): y = x w^T (+ bias) for float32 and bf16, reading the plain row-major
// weight once. A decode step of a small model is bound by these weight reads, and oneDNN reads them slowly
// at few rows on this kind of CPU (measured in `kernels/cpu_linear.py`). Each task takes tiles of eight
// weight rows (eight sequential streams the hardware prefetchers follow; software prefetch measured slower)
// and runs x's rows over a tile four at a time, so the tile is read from memory once and from cache after.
// float32 accumulates with FMA; bf16 with AVX512-BF16 dot products (vdpbf16ps) into float32 and rounds once
// at the end. The bias is added in float32 before that rounding, as oneDNN does.
#include <ATen/ATen.h>
#include <ATen/Parallel.h>
#include <c10/util/BFloat16.h>
#include <torch/library.h>

#include <algorithm>
#include <cstdint>
#include <type_traits>

#if defined(__AVX512F__)
#include <immintrin.h>
#endif

namespace {

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
      y[m * N + n + r] = static_cast<T>(sum);
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
void gemv_into(const T* x, const T* w, const float* bias, T* y, int64_t M, int64_t K, int64_t N) {
  // 16 tiles (128 weight rows) per task at least: below that, waking a thread costs more than it saves.
  at::parallel_for(0, (N + kTileRows - 1) / kTileRows, 16, [&](int64_t begin, int64_t end) {
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
void gemv_any(const T* x, const T* w, const float* bias, T* y, int64_t M, int64_t K, int64_t N) {
  const bool tail = K % kLanes<T> != 0;
  if (bias != nullptr && tail) gemv_into<T, true, true>(x, w, bias, y, M, K, N);
  else if (bias != nullptr) gemv_into<T, true, false>(x, w, bias, y, M, K, N);
  else if (tail) gemv_into<T, false, true>(x, w, bias, y, M, K, N);
  else gemv_into<T, false, false>(x, w, bias, y, M, K, N);
}
#endif

bool gemv_supports(at::ScalarType dtype) {
#if defined(__AVX512F__)
  if (dtype == at::kFloat) return true;
#if defined(__AVX512BF16__)
  if (dtype == at::kBFloat16) return true;
#endif
#endif
  (void)dtype;
  return false;
}

at::Tensor gemv(const at::Tensor& x, const at::Tensor& w, const c10::optional<at::Tensor>& bias) {
  TORCH_CHECK(x.dim() == 2 && w.dim() == 2 && x.size(1) == w.size(1), "gemv: x [M, K] and w [N, K]");
  TORCH_CHECK(x.scalar_type() == w.scalar_type() && gemv_supports(x.scalar_type()),
              "gemv: x and w of one dtype this build runs (float32; bfloat16 with AVX512-BF16), not ",
              x.scalar_type(), " and ", w.scalar_type());
  TORCH_CHECK(w.is_contiguous(), "gemv: a contiguous weight");
  const auto xc = x.contiguous();
  const int64_t M = xc.size(0), K = xc.size(1), N = w.size(0);
  at::Tensor bias_f;
  if (bias.has_value() && bias->defined()) {
    TORCH_CHECK(bias->numel() == N, "gemv: bias of ", N, " values");
    bias_f = bias->to(at::kFloat).contiguous();
  }
  auto y = at::empty({M, N}, xc.options());
  if (M == 0 || N == 0) return y;
#if defined(__AVX512F__)
  const float* bp = bias_f.defined() ? bias_f.data_ptr<float>() : nullptr;
  if (x.scalar_type() == at::kFloat) {
    gemv_any<float>(xc.data_ptr<float>(), w.data_ptr<float>(), bp, y.data_ptr<float>(), M, K, N);
  } else {
    using B = c10::BFloat16;
    gemv_any<B>(reinterpret_cast<const B*>(xc.data_ptr()), reinterpret_cast<const B*>(w.data_ptr()), bp,
                 reinterpret_cast<B*>(y.data_ptr()), M, K, N);
  }
#endif
  return y;
}

}  // namespace

TORCH_LIBRARY_FRAGMENT(parrot_cpu, m) {
  m.def("gemv_supports(ScalarType dtype) -> bool", &gemv_supports);  // catch-all: it takes no tensor
  m.def("gemv(Tensor x, Tensor w, Tensor? bias) -> Tensor");
}

TORCH_LIBRARY_IMPL(parrot_cpu, CPU, m) { m.impl("gemv", &gemv); }
