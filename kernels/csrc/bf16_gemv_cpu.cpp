// bf16 linears of one or a few rows (decode at batch 1-2): y = x w^T (+ bias), reading the plain row-major
// weight once with AVX512-BF16 dot products (vdpbf16ps), float32 accumulation, one rounding to bf16 at the
// end (bias added in float32 first, as oneDNN does). A decode step of a small model is bound by these weight
// reads; oneDNN's GEMM through a packed weight reads them at ~35 GB/s on 2 cores at one row, this loop at
// 45-70 (see `kernels/cpu_linear.py`). Eight weight rows per inner loop: eight sequential streams the
// hardware prefetchers follow (software prefetch measured slower), x's chunk loaded once for all eight.
#include <ATen/ATen.h>
#include <ATen/Parallel.h>
#include <c10/util/BFloat16.h>
#include <torch/library.h>

#include <algorithm>
#include <cstdint>

#if defined(__AVX512F__) && defined(__AVX512BF16__)
#include <immintrin.h>
#endif

namespace {

constexpr int64_t kRowsPerTile = 8;   // weight rows per inner loop
constexpr int64_t kMaxInputRows = 4;  // x rows one call takes: beyond, oneDNN's GEMM is as fast

#if defined(__AVX512F__) && defined(__AVX512BF16__)

// Output columns n..n+R for all M rows of x; a tail of K % 32 lanes is read masked (zeros beyond).
template <int M, int R>
void tile(const c10::BFloat16* x, const c10::BFloat16* w, const float* bias, c10::BFloat16* y, int64_t K,
          int64_t N, int64_t n) {
  __m512 acc[M][R];
  for (int m = 0; m < M; ++m)
    for (int r = 0; r < R; ++r) acc[m][r] = _mm512_setzero_ps();
  const int64_t whole = K - K % 32;
  for (int64_t k = 0; k < whole; k += 32) {
    __m512bh wv[R];
    for (int r = 0; r < R; ++r) wv[r] = (__m512bh)_mm512_loadu_si512(w + (n + r) * K + k);
    for (int m = 0; m < M; ++m) {
      const __m512bh xv = (__m512bh)_mm512_loadu_si512(x + m * K + k);
      for (int r = 0; r < R; ++r) acc[m][r] = _mm512_dpbf16_ps(acc[m][r], xv, wv[r]);
    }
  }
  if (whole < K) {
    const __mmask32 mask = (__mmask32(1) << (K - whole)) - 1;
    for (int r = 0; r < R; ++r)
      for (int m = 0; m < M; ++m) {
        const auto wv = (__m512bh)_mm512_maskz_loadu_epi16(mask, w + (n + r) * K + whole);
        const auto xv = (__m512bh)_mm512_maskz_loadu_epi16(mask, x + m * K + whole);
        acc[m][r] = _mm512_dpbf16_ps(acc[m][r], xv, wv);
      }
  }
  for (int m = 0; m < M; ++m)
    for (int r = 0; r < R; ++r) {
      const float sum = _mm512_reduce_add_ps(acc[m][r]) + (bias ? bias[n + r] : 0.0f);
      y[m * N + n + r] = c10::BFloat16(sum);
    }
}

template <int M>
void columns(const c10::BFloat16* x, const c10::BFloat16* w, const float* bias, c10::BFloat16* y, int64_t K,
             int64_t N, int64_t n0, int64_t n1) {
  int64_t n = n0;
  for (; n + kRowsPerTile <= n1; n += kRowsPerTile) tile<M, kRowsPerTile>(x, w, bias, y, K, N, n);
  for (; n < n1; ++n) tile<M, 1>(x, w, bias, y, K, N, n);
}

constexpr bool kNative = true;
#else
constexpr bool kNative = false;
#endif

bool bf16_gemv_native() { return kNative; }

at::Tensor bf16_gemv(const at::Tensor& x, const at::Tensor& w, const c10::optional<at::Tensor>& bias) {
  TORCH_CHECK(kNative, "bf16_gemv: built without AVX512-BF16 (check bf16_gemv_native() first)");
  TORCH_CHECK(x.dim() == 2 && w.dim() == 2 && x.size(1) == w.size(1), "bf16_gemv: x [M, K] and w [N, K]");
  TORCH_CHECK(x.size(0) >= 1 && x.size(0) <= kMaxInputRows, "bf16_gemv: 1 to ", kMaxInputRows, " rows of x");
  TORCH_CHECK(x.scalar_type() == at::kBFloat16 && w.scalar_type() == at::kBFloat16, "bf16_gemv: bfloat16");
  TORCH_CHECK(w.is_contiguous(), "bf16_gemv: a contiguous weight");
  const auto xc = x.contiguous();
  const int64_t M = xc.size(0), K = xc.size(1), N = w.size(0);
  at::Tensor bias_f;
  if (bias.has_value() && bias->defined()) {
    TORCH_CHECK(bias->numel() == N, "bf16_gemv: bias of ", N, " values");
    bias_f = bias->to(at::kFloat).contiguous();
  }
  auto y = at::empty({M, N}, xc.options());
#if defined(__AVX512F__) && defined(__AVX512BF16__)
  const auto* xp = reinterpret_cast<const c10::BFloat16*>(xc.data_ptr());
  const auto* wp = reinterpret_cast<const c10::BFloat16*>(w.data_ptr());
  const float* bp = bias_f.defined() ? bias_f.data_ptr<float>() : nullptr;
  auto* yp = reinterpret_cast<c10::BFloat16*>(y.data_ptr());
  const int64_t tiles = (N + kRowsPerTile - 1) / kRowsPerTile;
  // 16 tiles (128 rows x K) per task at least: below that, waking a thread costs more than it saves.
  at::parallel_for(0, tiles, 16, [&](int64_t begin, int64_t end) {
    const int64_t n0 = begin * kRowsPerTile, n1 = std::min(end * kRowsPerTile, N);
    switch (M) {
      case 1: columns<1>(xp, wp, bp, yp, K, N, n0, n1); break;
      case 2: columns<2>(xp, wp, bp, yp, K, N, n0, n1); break;
      case 3: columns<3>(xp, wp, bp, yp, K, N, n0, n1); break;
      default: columns<4>(xp, wp, bp, yp, K, N, n0, n1); break;
    }
  });
#endif
  return y;
}

}  // namespace

TORCH_LIBRARY_FRAGMENT(parrot_cpu, m) {
  m.def("bf16_gemv_native() -> bool", &bf16_gemv_native);  // catch-all: it takes no tensor
  m.def("bf16_gemv(Tensor x, Tensor w, Tensor? bias) -> Tensor");
}

TORCH_LIBRARY_IMPL(parrot_cpu, CPU, m) { m.impl("bf16_gemv", &bf16_gemv); }
