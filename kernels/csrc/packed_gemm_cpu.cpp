// bf16 linears over a weight packed once for AVX512-BF16 dot products: y = x w^T (+ bias).
//
// The packed weight is [ceil(N / 16)][K / 2][16][2]: panels of 16 output features, each a run of K/2 vectors
// of 16 (feature, k-pair) lanes, so one vdpbf16ps multiplies a vector of the panel by a broadcast pair of x's
// row and accumulates 16 outputs in float32 lanes: no horizontal sums, every weight byte read in order. A
// micro-kernel keeps kRows x kPanels accumulators (8 x 3 = 24 of the 32 vector registers) over the whole K;
// threads claim the output features in groups of kPanels panels, and rows run in chunks of kChunkRows (each
// chunk a pass over the weight: 192 rows made a 2,200-token fill read SmolLM2's weights from DRAM 12 times,
// 2-4% slower than oneDNN; 1,024 ties). Figures against oneDNN's packed bf16 weight: `kernels/cpu_linear.py`.
#include "common.h"

#include <algorithm>
#include <cstdint>
#include <cstring>

#if defined(__AVX512BF16__)
#include <immintrin.h>
#endif

namespace {

using namespace parrot_cpu;  // NOLINT: BF16, parallel_for
constexpr int64_t kPanel = 16;        // output features per panel (float32 lanes of a vector)
constexpr int kPanels = 3;            // panels per micro-kernel call
constexpr int kRows = 8;              // rows of x per micro-kernel call
constexpr int64_t kChunkRows = 1024;  // rows of x per pass over the weight

// Packs w [N, K] (K even) into [ceil(N / 16)][K / 2][16][2], zeros where a last panel has no feature.
void pack(const BF16* w, BF16* out, int64_t N, int64_t K, int threads) {
  const int64_t panels = (N + kPanel - 1) / kPanel, pairs = K / 2;
  const auto* src = reinterpret_cast<const uint32_t*>(w);  // a pair of bf16 as one word
  auto* dst = reinterpret_cast<uint32_t*>(out);
  parallel_for(0, panels, 1, threads, [&](int64_t begin, int64_t end) {
    for (int64_t p = begin; p < end; ++p) {
      std::memset(dst + p * pairs * kPanel, 0, pairs * kPanel * sizeof(uint32_t));
      for (int64_t j = 0; j < kPanel && p * kPanel + j < N; ++j) {
        const uint32_t* row = src + (p * kPanel + j) * pairs;
        for (int64_t kp = 0; kp < pairs; ++kp) dst[(p * pairs + kp) * kPanel + j] = row[kp];
      }
    }
  });
}

#if defined(__AVX512BF16__)

// Rows [0, R) of x over panels [0, V) starting at output feature n: the whole K, then bias and one rounding.
// With Prefetch, each step over K also asks for one cache line at ``ahead`` + 64 * kp into L2.
template <int R, int V, bool Bias, bool Prefetch = false>
__attribute__((always_inline)) inline void micro(const BF16* x, int64_t K, const BF16* w, int64_t pairs,
                                                 const float* bias, BF16* y, int64_t N, int64_t n,
                                                 const char* ahead = nullptr) {
  __m512 acc[R][V];
  for (int r = 0; r < R; ++r)
    for (int v = 0; v < V; ++v) acc[r][v] = _mm512_setzero_ps();
  const int64_t panel = pairs * kPanel * 2;  // bf16 per panel
  for (int64_t kp = 0; kp < pairs; ++kp) {
    if constexpr (Prefetch) _mm_prefetch(ahead + 64 * kp, _MM_HINT_T1);
    __m512bh wv[V];
    for (int v = 0; v < V; ++v) wv[v] = (__m512bh)_mm512_loadu_si512(w + v * panel + kp * 2 * kPanel);
    for (int r = 0; r < R; ++r) {
      int32_t pair;
      std::memcpy(&pair, x + r * K + 2 * kp, sizeof(pair));
      const auto xb = (__m512bh)_mm512_set1_epi32(pair);
      for (int v = 0; v < V; ++v) acc[r][v] = _mm512_dpbf16_ps(acc[r][v], xb, wv[v]);
    }
  }
  for (int v = 0; v < V; ++v) {
    const int64_t col = n + v * kPanel, left = N - col;
    const __mmask16 mask = left >= kPanel ? __mmask16(0xFFFF) : __mmask16((1u << left) - 1);
    const __m512 b = Bias ? _mm512_maskz_loadu_ps(mask, bias + col) : _mm512_setzero_ps();
    for (int r = 0; r < R; ++r) {
      const __m256bh out = _mm512_cvtneps_pbh(_mm512_add_ps(acc[r][v], b));
      _mm256_mask_storeu_epi16(y + r * N + col, mask, (__m256i)out);
    }
  }
}

// Rows [0, M) (M <= kChunkRows) over the V panels at output feature n, kRows at a time. The first kRows
// stream these panels from memory; while later ones reuse them from cache, the next panels (``next``,
// ``next_bytes``; none: nullptr) are fetched into L2, a line per step over K, so the next group's first
// rows do not wait on memory. SmolLM2's 30 layers of linears, weights cold (as in a step): 13.7 -> 11.0 ms
// at 44 rows, 18.0 -> 15.0 at 64, 31.5 -> 28.6 at 128 (warm: 10 ms at 44); unchanged at <= 8 rows, which
// have no later tiles, and at 512. Fetching the whole next group even with one later tile (several lines a
// step) measured within the noise at 16-32 rows.
template <int V, bool Bias>
void panels(const BF16* x, int64_t M, int64_t K, const BF16* w, int64_t pairs, const float* bias, BF16* y,
            int64_t N, int64_t n, const char* next, int64_t next_bytes) {
  int64_t m = 0, fetched = 0;
  for (; m + kRows <= M; m += kRows) {
    if (m == 0 || next == nullptr || fetched >= next_bytes) {
      micro<kRows, V, Bias>(x + m * K, K, w, pairs, bias, y + m * N, N, n);
    } else {
      micro<kRows, V, Bias, true>(x + m * K, K, w, pairs, bias, y + m * N, N, n, next + fetched);
      fetched += 64 * pairs;
    }
  }
  const BF16* xm = x + m * K;
  BF16* ym = y + m * N;
  switch (M - m) {
    case 1: micro<1, V, Bias>(xm, K, w, pairs, bias, ym, N, n); break;
    case 2: micro<2, V, Bias>(xm, K, w, pairs, bias, ym, N, n); break;
    case 3: micro<3, V, Bias>(xm, K, w, pairs, bias, ym, N, n); break;
    case 4: micro<4, V, Bias>(xm, K, w, pairs, bias, ym, N, n); break;
    case 5: micro<5, V, Bias>(xm, K, w, pairs, bias, ym, N, n); break;
    case 6: micro<6, V, Bias>(xm, K, w, pairs, bias, ym, N, n); break;
    case 7: micro<7, V, Bias>(xm, K, w, pairs, bias, ym, N, n); break;
    default: break;
  }
}

template <bool Bias>
void gemm(const BF16* x, const BF16* w, const float* bias, BF16* y, int64_t M, int64_t K, int64_t N,
          int64_t num_panels, int threads) {
  const int64_t pairs = K / 2, groups = (num_panels + kPanels - 1) / kPanels;
  // At a row or two a group is ~30k multiply-adds: a claim takes several, or waking a thread costs more.
  // Claims of many groups where there are many (an LM head's 1,024): a claim fetches its next group while
  // it runs the current one, and ~8 claims a thread still even out a late start.
  const int64_t step = std::max<int64_t>(M >= 4 ? 2 : 4, groups / (8 * std::max(threads, 1)));
  for (int64_t m0 = 0; m0 < M; m0 += kChunkRows) {
    const int64_t rows = std::min(kChunkRows, M - m0);
    claimed(groups, step, threads, [&](int64_t begin, int64_t end) {
      for (int64_t g = begin; g < end; ++g) {
        const int64_t p = g * kPanels, n = p * kPanel, panel_bytes = pairs * kPanel * 2 * sizeof(BF16);
        const BF16* wg = w + p * pairs * kPanel * 2;
        const BF16* xm = x + m0 * K;
        BF16* ym = y + m0 * N;
        // This claim's next group, if it has one (its panels follow this group's in memory).
        const bool more = g + 1 < end;
        const char* next = more ? reinterpret_cast<const char*>(wg) + kPanels * panel_bytes : nullptr;
        const int64_t next_panels = more ? std::min<int64_t>(kPanels, num_panels - p - kPanels) : 0;
        const int64_t next_bytes = next_panels * panel_bytes;
        switch (std::min<int64_t>(kPanels, num_panels - p)) {
          case 1: panels<1, Bias>(xm, rows, K, wg, pairs, bias, ym, N, n, next, next_bytes); break;
          case 2: panels<2, Bias>(xm, rows, K, wg, pairs, bias, ym, N, n, next, next_bytes); break;
          default: panels<kPanels, Bias>(xm, rows, K, wg, pairs, bias, ym, N, n, next, next_bytes); break;
        }
      }
    });
  }
}
#endif

}  // namespace

// Whether this build has the AVX512-BF16 path.
PARROT_API int parrot_packed_gemm_supported() {
#if defined(__AVX512BF16__)
  return 1;
#else
  return 0;
#endif
}

// w [N, K] bf16 (K even) -> out [ceil(N / 16), K / 2, 16, 2] bf16, contiguous.
PARROT_API int parrot_pack_bf16(const void* w, void* out, int64_t N, int64_t K, int threads) {
  pack(static_cast<const BF16*>(w), static_cast<BF16*>(out), N, K, threads);
  return 0;
}

// y [M, N] = x [M, K] w^T (+ bias [N], float32) over w packed by `parrot_pack_bf16` (num_panels panels), bf16.
PARROT_API int parrot_packed_linear(const void* x, const void* packed, const float* bias, void* y, int64_t M,
                                    int64_t K, int64_t N, int64_t num_panels, int threads) {
#if defined(__AVX512BF16__)
  const auto* xp = static_cast<const BF16*>(x);
  const auto* wp = static_cast<const BF16*>(packed);
  auto* yp = static_cast<BF16*>(y);
  if (bias != nullptr) gemm<true>(xp, wp, bias, yp, M, K, N, num_panels, threads);
  else gemm<false>(xp, wp, nullptr, yp, M, K, N, num_panels, threads);
  return 0;
#else
  (void)x, (void)packed, (void)bias, (void)y, (void)M, (void)K, (void)N, (void)num_panels, (void)threads;
  return fail("packed_linear: this build has no AVX512-BF16 path");
#endif
}
