// What every CPU kernel shares: the 16-bit float types, torch's parallel-for semantics over OpenMP, work
// claimed from a shared counter, and errors a caller can read back.
//
// The kernels include no torch header (parsing ATen's took ~18 of the ~25 s each file cost to compile); they
// take raw pointers and sizes through a plain C ABI, bound in `kernels/cpu_binding.py`, which also checks
// the tensors' shapes and dtypes and allocates the outputs. OpenMP is torch's own runtime: the binary links
// libgomp.so.1, which the loader resolves to the copy torch has loaded (one runtime, one thread pool).
#pragma once

#include <algorithm>
#include <atomic>
#include <cstdint>
#include <cstring>
#include <string>

#if defined(_OPENMP)
#include <omp.h>
#endif
#if defined(__x86_64__)
#include <immintrin.h>
#endif

#define PARROT_API extern "C" __attribute__((visibility("default")))

namespace parrot_cpu {

// The dtype codes of the C ABI (`kernels/cpu_binding.py` maps torch dtypes to them).
enum Dtype : int { kFloat32 = 0, kBFloat16 = 1, kFloat16 = 2 };

// bfloat16 as its bits: the top half of a float32; rounded to nearest even from one, NaN kept a quiet NaN.
struct BF16 {
  uint16_t bits;
  BF16() = default;
  explicit BF16(float f) {
    uint32_t u;
    std::memcpy(&u, &f, sizeof(u));
    if ((u & 0x7fffffffu) > 0x7f800000u) {
      bits = 0x7fc0;
    } else {
      bits = static_cast<uint16_t>((u + 0x7fffu + ((u >> 16) & 1u)) >> 16);
    }
  }
  operator float() const {
    const uint32_t u = static_cast<uint32_t>(bits) << 16;
    float f;
    std::memcpy(&f, &u, sizeof(f));
    return f;
  }
};

// IEEE half precision as its bits, converted by the CPU's F16C instructions where it has them.
struct Half {
  uint16_t bits;
  Half() = default;
#if defined(__F16C__)
  explicit Half(float f) : bits(static_cast<uint16_t>(_cvtss_sh(f, _MM_FROUND_TO_NEAREST_INT))) {}
  operator float() const { return _cvtsh_ss(bits); }
#else
  explicit Half(float f) {
    const _Float16 h = static_cast<_Float16>(f);
    std::memcpy(&bits, &h, sizeof(bits));
  }
  operator float() const {
    _Float16 h;
    std::memcpy(&h, &bits, sizeof(h));
    return static_cast<float>(h);
  }
#endif
};

// Waking a thread that waits passively (the servers' OpenMP setting) costs ~45 us on a 2-core EPYC VM, as
// much as norming 200 rows: the row kernels' grains (each measured where it is set) keep smaller calls on
// the calling thread.
//
// Calls ``f(begin, end)`` over [begin, end) as torch's ``at::parallel_for`` does with its OpenMP backend:
// one contiguous piece per thread, at most ``threads`` of them and none smaller than ``grain``; inline where
// the range is one grain, one thread is asked for, or the caller is already in a parallel region.
template <class F>
void parallel_for(int64_t begin, int64_t end, int64_t grain, int threads, const F& f) {
  if (begin >= end) return;
  const int64_t range = end - begin;
#if defined(_OPENMP)
  if (range > grain && range > 1 && threads > 1 && !omp_in_parallel()) {
    const int64_t wanted = std::min<int64_t>(threads, grain > 0 ? (range + grain - 1) / grain : range);
#pragma omp parallel num_threads(static_cast<int>(wanted))
    {
      const int64_t team = omp_get_num_threads(), chunk = (range + team - 1) / team;
      const int64_t first = begin + omp_get_thread_num() * chunk;
      if (first < end) f(first, std::min(end, first + chunk));
    }
    return;
  }
#endif
  (void)grain;
  (void)threads;
  f(begin, end);
}

// Calls ``body(begin, end)`` over [0, count) in pieces of ``step``, each claimed by whichever thread is free
// (a shared counter), not a fixed share per thread: a thread that starts late (woken from a passive wait,
// or preempted by another process on its core) leaves its work to the others instead of making them wait
// for it at the region's end.
// No more threads than there are pieces; one piece runs on the calling thread.
template <class Body>
void claimed(int64_t count, int64_t step, int threads, const Body& body) {
  std::atomic<int64_t> next{0};
  const int team = static_cast<int>(std::min<int64_t>(threads, (count + step - 1) / step));
  parallel_for(0, team, 1, team, [&](int64_t, int64_t) {
    for (int64_t begin; (begin = next.fetch_add(step, std::memory_order_relaxed)) < count;)
      body(begin, std::min(count, begin + step));
  });
}

// The calling thread's last error, for `parrot_last_error`: entry points return nonzero after setting it.
inline std::string& last_error() {
  thread_local std::string message;
  return message;
}

inline int fail(const std::string& message) {
  last_error() = message;
  return 1;
}

// Calls ``run(static_cast<T*>(nullptr))`` with T the element type of ``dtype`` (float32, bf16, fp16); 0, or
// an error naming ``op`` for another code.
template <class Run>
int dispatch(int dtype, const char* op, const Run& run) {
  switch (dtype) {
    case kFloat32: run(static_cast<float*>(nullptr)); return 0;
    case kBFloat16: run(static_cast<BF16*>(nullptr)); return 0;
    case kFloat16: run(static_cast<Half*>(nullptr)); return 0;
    default: return fail(std::string(op) + ": float32, bfloat16 or float16, not dtype code " + std::to_string(dtype));
  }
}

}  // namespace parrot_cpu
