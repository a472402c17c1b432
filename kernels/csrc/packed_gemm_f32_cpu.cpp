// float32 linears over a weight packed once for AVX2 FMA: y = x w^T (+ bias), on CPUs without AVX-512.
//
// There the engine runs float32 (bf16 would be emulated), and oneDNN's float32 GEMM reads a decode step's
// weights slowly. The packed weight is [ceil(N / 8)][K][8]: panels of 8 output features whose k-th vector
// holds those features' k-th weights, so one FMA multiplies it by a broadcast x[r][k] and accumulates 8
// outputs in the lanes of a register: no horizontal sums, every weight byte read once per pass, in order.
// A micro-kernel keeps kRows x kPanels accumulators (6 x 2 = 12 of the 16 vector registers, plus two
// weight vectors and the broadcast) over the whole K; threads claim the output features in groups of
// kPanels panels, and rows run in chunks of kChunkRows (each chunk a pass over the weight). Each output is
// one float32 sum over k in order, plus the bias: the same at every row count.
//
// SmolLM2's 30 layers of linears on an AVX2 EPYC (Zen 3, 2 cores), against oneDNN's float32 GEMM: 22 vs 38
// ms at 1 row (the weight stream at the machine's ~20 GB/s), 45 vs 72 at 16, 117 vs 145 at 64, 442 vs 462
// at 256 (123 GFLOP/s, ~80% of two cores' FMA peak at 2.45 GHz); a 4 x 3 micro-kernel ran 64 rows in 143.
#include <ATen/ATen.h>
#include <ATen/Parallel.h>
#include <torch/library.h>

#include <algorithm>
#include <atomic>
#include <cstdint>

#if defined(__AVX2__) && defined(__FMA__) && !defined(__AVX512F__)
#define PARROT_F32_PACKED 1
#include <immintrin.h>
#endif

namespace {

constexpr int64_t kPanel = 8;         // output features per panel (float32 lanes of a ymm register)
constexpr int kPanels = 2;            // panels per micro-kernel call
constexpr int kRows = 6;              // rows of x per micro-kernel call
constexpr int64_t kChunkRows = 256;   // rows of x per pass over the weight

bool packed_gemm_f32_supported() {
#if defined(PARROT_F32_PACKED)
  return true;
#else
  return false;
#endif
}

at::Tensor pack_f32(const at::Tensor& w) {
  TORCH_CHECK(w.dim() == 2 && w.scalar_type() == at::kFloat, "pack_f32: a float32 weight [N, K], not ",
              w.scalar_type(), " ", w.sizes());
  const auto wc = w.contiguous();
  const int64_t N = wc.size(0), K = wc.size(1), panels = (N + kPanel - 1) / kPanel;
  auto out = at::zeros({panels, K, kPanel}, wc.options());  // zeros: a last panel's missing features
  const float* src = wc.data_ptr<float>();
  float* dst = out.data_ptr<float>();
  at::parallel_for(0, panels, 1, [&](int64_t begin, int64_t end) {
    for (int64_t p = begin; p < end; ++p)
      for (int64_t j = 0; j < kPanel && p * kPanel + j < N; ++j) {
        const float* row = src + (p * kPanel + j) * K;
        for (int64_t k = 0; k < K; ++k) dst[(p * K + k) * kPanel + j] = row[k];
      }
  });
  return out;
}

#if defined(PARROT_F32_PACKED)

// Lanes [0, n) of a vector: a mask for the last panel's partial loads and stores.
inline __m256i lanes(int64_t n) {
  const __m256i index = _mm256_setr_epi32(0, 1, 2, 3, 4, 5, 6, 7);
  return _mm256_cmpgt_epi32(_mm256_set1_epi32(static_cast<int>(n)), index);
}

// Rows [0, R) of x over panels [0, V) starting at output feature n: the whole K, then the bias. With
// Prefetch, each step over K also asks for one cache line at ``ahead`` + 64 * k into L2.
template <int R, int V, bool Bias, bool Prefetch = false>
__attribute__((always_inline)) inline void micro(const float* x, int64_t K, const float* w, const float* bias,
                                                 float* y, int64_t N, int64_t n, const char* ahead = nullptr) {
  __m256 acc[R][V];
  for (int r = 0; r < R; ++r)
    for (int v = 0; v < V; ++v) acc[r][v] = _mm256_setzero_ps();
  const int64_t panel = K * kPanel;  // floats per panel
  for (int64_t k = 0; k < K; ++k) {
    if constexpr (Prefetch) _mm_prefetch(ahead + 64 * k, _MM_HINT_T1);
    __m256 wv[V];
    for (int v = 0; v < V; ++v) wv[v] = _mm256_loadu_ps(w + v * panel + k * kPanel);
    for (int r = 0; r < R; ++r) {
      const __m256 xb = _mm256_broadcast_ss(x + r * K + k);
      for (int v = 0; v < V; ++v) acc[r][v] = _mm256_fmadd_ps(xb, wv[v], acc[r][v]);
    }
  }
  for (int v = 0; v < V; ++v) {
    const int64_t col = n + v * kPanel, left = N - col;
    if (left >= kPanel) {
      const __m256 b = Bias ? _mm256_loadu_ps(bias + col) : _mm256_setzero_ps();
      for (int r = 0; r < R; ++r) _mm256_storeu_ps(y + r * N + col, _mm256_add_ps(acc[r][v], b));
    } else {
      const __m256i mask = lanes(left);
      const __m256 b = Bias ? _mm256_maskload_ps(bias + col, mask) : _mm256_setzero_ps();
      for (int r = 0; r < R; ++r) _mm256_maskstore_ps(y + r * N + col, mask, _mm256_add_ps(acc[r][v], b));
    }
  }
}

// Rows [0, M) over the V panels at output feature n, kRows at a time. The first kRows stream these panels
// from memory; while later ones reuse them from cache, the next panels (``next``, ``next_bytes``; none:
// nullptr) are fetched into L2, a line per step over K, so the next group's first rows do not wait on
// memory (as the bf16 GEMM does).
template <int V, bool Bias>
void panels(const float* x, int64_t M, int64_t K, const float* w, const float* bias, float* y, int64_t N,
            int64_t n, const char* next, int64_t next_bytes) {
  int64_t m = 0, fetched = 0;
  auto prefetching = [&] { return m > 0 && next != nullptr && fetched < next_bytes; };
  for (; m + kRows <= M; m += kRows) {
    if (prefetching()) {
      micro<kRows, V, Bias, true>(x + m * K, K, w, bias, y + m * N, N, n, next + fetched);
      fetched += 64 * K;
    } else {
      micro<kRows, V, Bias>(x + m * K, K, w, bias, y + m * N, N, n);
    }
  }
  const float* xm = x + m * K;
  float* ym = y + m * N;
  const char* ahead = prefetching() ? next + fetched : nullptr;
  switch ((M - m) * 2 + (ahead != nullptr)) {
    case 2: micro<1, V, Bias>(xm, K, w, bias, ym, N, n); break;
    case 3: micro<1, V, Bias, true>(xm, K, w, bias, ym, N, n, ahead); break;
    case 4: micro<2, V, Bias>(xm, K, w, bias, ym, N, n); break;
    case 5: micro<2, V, Bias, true>(xm, K, w, bias, ym, N, n, ahead); break;
    case 6: micro<3, V, Bias>(xm, K, w, bias, ym, N, n); break;
    case 7: micro<3, V, Bias, true>(xm, K, w, bias, ym, N, n, ahead); break;
    case 8: micro<4, V, Bias>(xm, K, w, bias, ym, N, n); break;
    case 9: micro<4, V, Bias, true>(xm, K, w, bias, ym, N, n, ahead); break;
    case 10: micro<5, V, Bias>(xm, K, w, bias, ym, N, n); break;
    case 11: micro<5, V, Bias, true>(xm, K, w, bias, ym, N, n, ahead); break;
    default: break;
  }
}

// Calls ``body(begin, end)`` over [0, count) in pieces of ``step``, each claimed by whichever thread is free
// (a shared counter), not a fixed share per thread: a thread that starts late (woken from a passive wait,
// or preempted by another process on its core) leaves its work to the others instead of making them wait
// for it at the region's end.
template <class Body>
void claimed(int64_t count, int64_t step, const Body& body) {
  std::atomic<int64_t> next{0};
  at::parallel_for(0, at::get_num_threads(), 1, [&](int64_t, int64_t) {
    for (int64_t begin; (begin = next.fetch_add(step, std::memory_order_relaxed)) < count;)
      body(begin, std::min(count, begin + step));
  });
}

template <bool Bias>
void gemm(const float* x, const float* w, const float* bias, float* y, int64_t M, int64_t K, int64_t N,
          int64_t num_panels) {
  const int64_t groups = (num_panels + kPanels - 1) / kPanels;
  // At a row or two a group is ~10k multiply-adds: a claim takes several, or the claims cost more.
  const int64_t step = M >= 4 ? 2 : 4;
  for (int64_t m0 = 0; m0 < M; m0 += kChunkRows) {
    const int64_t rows = std::min(kChunkRows, M - m0);
    claimed(groups, step, [&](int64_t begin, int64_t end) {
      for (int64_t g = begin; g < end; ++g) {
        const int64_t p = g * kPanels, n = p * kPanel, panel_bytes = K * kPanel * sizeof(float);
        const float* wg = w + p * K * kPanel;
        const float* xm = x + m0 * K;
        float* ym = y + m0 * N;
        // This claim's next group, if it has one (its panels follow this group's in memory).
        const bool more = g + 1 < end;
        const char* next = more ? reinterpret_cast<const char*>(wg) + kPanels * panel_bytes : nullptr;
        const int64_t next_bytes = more ? std::min<int64_t>(kPanels, num_panels - p - kPanels) * panel_bytes : 0;
        switch (std::min<int64_t>(kPanels, num_panels - p)) {
          case 1: panels<1, Bias>(xm, rows, K, wg, bias, ym, N, n, next, next_bytes); break;
          default: panels<kPanels, Bias>(xm, rows, K, wg, bias, ym, N, n, next, next_bytes); break;
        }
      }
    });
  }
}
#endif

at::Tensor packed_linear_f32(const at::Tensor& x, const at::Tensor& packed, int64_t out_features,
                             const c10::optional<at::Tensor>& bias) {
  TORCH_CHECK(packed_gemm_f32_supported(), "packed_linear_f32: this build has no AVX2 float32 path");
  TORCH_CHECK(x.dim() == 2 && x.scalar_type() == at::kFloat && packed.scalar_type() == at::kFloat,
              "packed_linear_f32: float32 x [M, K] and a weight from pack_f32");
  TORCH_CHECK(packed.dim() == 3 && packed.size(2) == kPanel && packed.is_contiguous(),
              "packed_linear_f32: a weight from pack_f32, not ", packed.sizes());
  const int64_t M = x.size(0), K = x.size(1), N = out_features, num_panels = packed.size(0);
  TORCH_CHECK(packed.size(1) == K && (N + kPanel - 1) / kPanel == num_panels && N > 0,
              "packed_linear_f32: x has ", K, " features and the packed weight ", packed.size(1), " for ",
              num_panels * kPanel, " outputs at most; asked for ", N);
  const auto xc = x.contiguous();
  at::Tensor bias_f;
  if (bias.has_value() && bias->defined()) {
    TORCH_CHECK(bias->numel() == N, "packed_linear_f32: bias of ", N, " values");
    bias_f = bias->to(at::kFloat).contiguous();
  }
  auto y = at::empty({M, N}, xc.options());
  if (M == 0) return y;
#if defined(PARROT_F32_PACKED)
  const float* xp = xc.data_ptr<float>();
  const float* wp = packed.data_ptr<float>();
  float* yp = y.data_ptr<float>();
  if (bias_f.defined()) gemm<true>(xp, wp, bias_f.data_ptr<float>(), yp, M, K, N, num_panels);
  else gemm<false>(xp, wp, nullptr, yp, M, K, N, num_panels);
#endif
  return y;
}

}  // namespace

TORCH_LIBRARY_FRAGMENT(parrot_cpu, m) {
  m.def("packed_gemm_f32_supported() -> bool", &packed_gemm_f32_supported);
  m.def("pack_f32(Tensor w) -> Tensor");
  m.def("packed_linear_f32(Tensor x, Tensor packed, int out_features, Tensor? bias) -> Tensor");
}

TORCH_LIBRARY_IMPL(parrot_cpu, CPU, m) {
  m.impl("pack_f32", &pack_f32);
  m.impl("packed_linear_f32", &packed_linear_f32);
}
