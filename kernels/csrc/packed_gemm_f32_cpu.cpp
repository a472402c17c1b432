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
#include "common.h"

#include <algorithm>
#include <cstdint>
#include <cstring>

#if defined(__AVX2__) && defined(__FMA__) && !defined(__AVX512F__)
#define PARROT_F32_PACKED 1
#include <immintrin.h>
#endif

namespace {

using namespace parrot_cpu;  // NOLINT: parallel_for, claimed

constexpr int64_t kPanel = 8;         // output features per panel (float32 lanes of a ymm register)
constexpr int kPanels = 2;            // panels per micro-kernel call
constexpr int kRows = 6;              // rows of x per micro-kernel call
constexpr int64_t kChunkRows = 256;   // rows of x per pass over the weight

// Packs w [N, K] into [ceil(N / 8)][K][8], zeros where a last panel has no feature.
void pack(const float* w, float* out, int64_t N, int64_t K, int threads) {
  const int64_t panels = (N + kPanel - 1) / kPanel;
  parallel_for(0, panels, 1, threads, [&](int64_t begin, int64_t end) {
    for (int64_t p = begin; p < end; ++p) {
      std::memset(out + p * K * kPanel, 0, K * kPanel * sizeof(float));
      for (int64_t j = 0; j < kPanel && p * kPanel + j < N; ++j) {
        const float* row = w + (p * kPanel + j) * K;
        for (int64_t k = 0; k < K; ++k) out[(p * K + k) * kPanel + j] = row[k];
      }
    }
  });
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

template <bool Bias>
void gemm(const float* x, const float* w, const float* bias, float* y, int64_t M, int64_t K, int64_t N,
          int64_t num_panels, int threads) {
  const int64_t groups = (num_panels + kPanels - 1) / kPanels;
  // At a row or two a group is ~10k multiply-adds: a claim takes several, or the claims cost more.
  const int64_t step = M >= 4 ? 2 : 4;
  for (int64_t m0 = 0; m0 < M; m0 += kChunkRows) {
    const int64_t rows = std::min(kChunkRows, M - m0);
    claimed(groups, step, threads, [&](int64_t begin, int64_t end) {
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

}  // namespace

// Whether this build has the AVX2 float32 path (AVX2 and FMA, no AVX-512).
PARROT_API int parrot_packed_gemm_f32_supported() {
#if defined(PARROT_F32_PACKED)
  return 1;
#else
  return 0;
#endif
}

// w [N, K] float32 -> out [ceil(N / 8), K, 8] float32, contiguous.
PARROT_API int parrot_pack_f32(const float* w, float* out, int64_t N, int64_t K, int threads) {
  pack(w, out, N, K, threads);
  return 0;
}

// y [M, N] = x [M, K] w^T (+ bias [N]) over w packed by `parrot_pack_f32` (num_panels panels), float32.
PARROT_API int parrot_packed_linear_f32(const float* x, const float* packed, const float* bias, float* y, int64_t M,
                                        int64_t K, int64_t N, int64_t num_panels, int threads) {
#if defined(PARROT_F32_PACKED)
  if (bias != nullptr) gemm<true>(x, packed, bias, y, M, K, N, num_panels, threads);
  else gemm<false>(x, packed, nullptr, y, M, K, N, num_panels, threads);
  return 0;
#else
  (void)x, (void)packed, (void)bias, (void)y, (void)M, (void)K, (void)N, (void)num_panels, (void)threads;
  return fail("packed_linear_f32: this build has no AVX2 float32 path");
#endif
}
