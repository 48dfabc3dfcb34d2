// Device helpers shared by the transfer (kvcore_cuda.cu) and copy (kvcore_copy.cu) kernels.
#pragma once
#include <cstdint>

namespace kvcore {
namespace dev {

// Programmatic dependent launch (sm_90+): wait for the previous kernel's results / let the
// next kernel start its prologue. No-ops on older architectures.
__device__ __forceinline__ void grid_dependency_wait() {
#if defined(__CUDA_ARCH__) && __CUDA_ARCH__ >= 900
  asm volatile("griddepcontrol.wait;" ::: "memory");
#endif
}
__device__ __forceinline__ void grid_dependents_launch() {
#if defined(__CUDA_ARCH__) && __CUDA_ARCH__ >= 900
  asm volatile("griddepcontrol.launch_dependents;" ::: "memory");
#endif
}

// Clear the bits of slots[t0:t1] (those in [0, n)) in a duplicate-check bitmap, one atomic
// per run of slots in the same 32-bit word, leaving the bitmap all zero for the next call.
__device__ __forceinline__ void bits_clear(uint32_t* bitmap, const int64_t* slots, uint32_t t0, uint32_t t1, int64_t n) {
  uint64_t word = ~uint64_t{0};
  uint32_t mask = 0;
  for (uint32_t t = t0; t < t1; ++t) {
    const int64_t s = slots[t];
    if (s < 0 || s >= n) continue;
    const uint64_t w = static_cast<uint64_t>(s) >> 5;
    if (w != word) {
      if (mask) atomicAnd(bitmap + word, ~mask);
      word = w;
      mask = 0;
    }
    mask |= 1u << (static_cast<uint64_t>(s) & 31);
  }
  if (mask) atomicAnd(bitmap + word, ~mask);
}

}  // namespace dev
}  // namespace kvcore
