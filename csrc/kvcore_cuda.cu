// kvcore native transfer kernels: the CUDA implementation of kvcore::gather / scatter.
//
// One launch moves every layer and both K/V planes: blockIdx.y is the plane
// (kv * NL + layer), blockIdx.x walks that plane's T * units_per_row transfer units.
// A unit is the widest of 16/8/4/2/1 bytes that every base, stride, run length and the
// staging buffer allow, so the common layouts move as 16-byte loads and stores, each
// warp covering consecutive bytes of one row (coalesced). Each thread keeps kUnroll
// independent loads in flight before its stores. Offsets are 64-bit. Slots outside
// [0, num_slots) (negative = padding) are skipped: the destination row stays untouched.
// The staging buffer is device memory or pinned host memory, read or written in place
// (zero-copy, through its mapped device address): no device staging buffer, no copy.
// Validation and op registration live in kvcore_cpu.cpp; this unit throws nothing.
#define KVCORE_NO_TORCH
#include "kvcore_ops.h"

#include <c10/cuda/CUDAStream.h>
#include <cuda_runtime.h>

#include <algorithm>
#include <limits>
#include <string>

namespace kvcore {
namespace {

constexpr int kThreads = 256;

struct DevPlane {
  int64_t block, token, head, chunk;  // bytes
  uint32_t chunk_units;               // units per chunk run
  uint32_t n_chunks;
};

struct Params {
  const int64_t* ptrs;   // device [NL, kv] plane base addresses
  const int64_t* slots;  // device [T]
  char* staging;         // device address of staging[0, 0, 0, 0]
  int64_t s_kv, s_layer, s_tok;  // staging byte strides
  DevPlane plane[2];
  int64_t num_slots;
  uint32_t T, NL, kv, block_size;
  uint32_t units_per_row, units_per_head;
  bool slots32;  // every slot < 2^31: 32-bit division
};

enum Mode { kRowContig = 0, kHeadRuns = 1, kChunks = 2 };

template <typename V>
__device__ __forceinline__ V load_stream(const V* p) {
  return __ldcs(p);
}
template <typename V>
__device__ __forceinline__ void store_stream(V* p, const V& v) {
  __stcs(p, v);
}

template <typename V, int kMode, bool kGather, int kUnroll>
__global__ void __launch_bounds__(kThreads) kv_transfer_kernel(const Params p) {
  constexpr uint32_t W = sizeof(V);
  const uint32_t plane_idx = blockIdx.y;  // kv * NL + layer
  const uint32_t k = plane_idx / p.NL;
  const uint32_t l = plane_idx - k * p.NL;
  const DevPlane pl = k ? p.plane[1] : p.plane[0];
  char* const base = reinterpret_cast<char*>(p.ptrs[l * p.kv + k]);
  char* const srow0 = p.staging + k * p.s_kv + l * p.s_layer;
  const uint32_t n = p.T * p.units_per_row;
  const uint32_t first = blockIdx.x * (kThreads * kUnroll) + threadIdx.x;

  V buf[kUnroll];
  V* dst[kUnroll];
#pragma unroll
  for (int j = 0; j < kUnroll; ++j) {
    dst[j] = nullptr;
    const uint32_t i = first + j * kThreads;
    if (i >= n) continue;
    const uint32_t t = i / p.units_per_row;
    const uint32_t u = i - t * p.units_per_row;
    const int64_t s = p.slots[t];
    if (s < 0 || s >= p.num_slots) continue;
    int64_t blk, off;
    if (p.slots32) {
      const uint32_t s32 = static_cast<uint32_t>(s);
      const uint32_t b32 = s32 / p.block_size;
      blk = b32;
      off = s32 - b32 * p.block_size;
    } else {
      blk = s / p.block_size;
      off = s - blk * p.block_size;
    }
    int64_t cofs = blk * pl.block + off * pl.token;
    if (kMode == kRowContig) {
      cofs += static_cast<int64_t>(u) * W;
    } else if (kMode == kHeadRuns) {
      const uint32_t h = u / p.units_per_head;
      const uint32_t e = u - h * p.units_per_head;
      cofs += h * pl.head + static_cast<int64_t>(e) * W;
    } else {
      const uint32_t r = u / pl.chunk_units;
      const uint32_t e = u - r * pl.chunk_units;
      const uint32_t h = r / pl.n_chunks;
      const uint32_t c = r - h * pl.n_chunks;
      cofs += h * pl.head + c * pl.chunk + static_cast<int64_t>(e) * W;
    }
    V* cache = reinterpret_cast<V*>(base + cofs);
    V* row = reinterpret_cast<V*>(srow0 + t * p.s_tok + static_cast<int64_t>(u) * W);
    if (kGather) {
      buf[j] = load_stream(cache);
      dst[j] = row;
    } else {
      buf[j] = load_stream(row);
      dst[j] = cache;
    }
  }
#pragma unroll
  for (int j = 0; j < kUnroll; ++j)
    if (dst[j] != nullptr) store_stream(dst[j], buf[j]);
}

template <typename V, bool kGather, int kUnroll>
void launch_mode(int mode, const Params& p, dim3 grid, cudaStream_t stream) {
  if (mode == kRowContig)
    kv_transfer_kernel<V, kRowContig, kGather, kUnroll><<<grid, kThreads, 0, stream>>>(p);
  else if (mode == kHeadRuns)
    kv_transfer_kernel<V, kHeadRuns, kGather, kUnroll><<<grid, kThreads, 0, stream>>>(p);
  else
    kv_transfer_kernel<V, kChunks, kGather, kUnroll><<<grid, kThreads, 0, stream>>>(p);
}

template <bool kGather, int kUnroll>
void launch(int width, int mode, const Params& p, dim3 grid, cudaStream_t stream) {
  switch (width) {
    case 16: launch_mode<uint4, kGather, kUnroll>(mode, p, grid, stream); break;
    case 8: launch_mode<uint2, kGather, kUnroll>(mode, p, grid, stream); break;
    case 4: launch_mode<unsigned int, kGather, kUnroll>(mode, p, grid, stream); break;
    case 2: launch_mode<unsigned short, kGather, kUnroll>(mode, p, grid, stream); break;
    default: launch_mode<unsigned char, kGather, kUnroll>(mode, p, grid, stream); break;
  }
}

int64_t gcd64(int64_t a, int64_t b) {
  while (b) {
    int64_t t = a % b;
    a = b;
    b = t;
  }
  return a;
}

// Device address of pinned host memory (zero-copy), or nullptr when it is not pinned.
char* host_device_ptr(void* host) {
  cudaPointerAttributes attr{};
  cudaError_t err = cudaPointerGetAttributes(&attr, host);
  if (err != cudaSuccess) {
    (void)cudaGetLastError();
    return nullptr;
  }
  if (attr.type != cudaMemoryTypeHost || attr.devicePointer == nullptr) return nullptr;
  return static_cast<char*>(attr.devicePointer);
}

thread_local std::string g_error;

const char* fail(const std::string& msg) {
  g_error = msg;
  return g_error.c_str();
}

template <bool kGather>
const char* run_transfer(const CudaTransfer& a) {
  if (a.T == 0 || a.NL == 0) return nullptr;
  int prev = -1;
  if (cudaGetDevice(&prev) != cudaSuccess) return fail("cudaGetDevice failed");
  if (prev != a.device && cudaSetDevice(a.device) != cudaSuccess) return fail("cudaSetDevice failed");
  struct Restore {
    int prev, cur;
    ~Restore() {
      if (prev != cur) (void)cudaSetDevice(prev);
    }
  } restore{prev, a.device};

  char* st = static_cast<char*>(a.staging);
  if (a.staging_on_host) {
    st = host_device_ptr(a.staging);
    if (st == nullptr)
      return fail("a host staging buffer must be pinned (torch.empty(..., pin_memory=True)) so the kernel can reach it directly");
  }
  Params p{};
  p.ptrs = a.ptrs;
  p.slots = a.slots;
  p.s_kv = a.s_kv;
  p.s_layer = a.s_layer;
  p.s_tok = a.s_tok;
  p.num_slots = a.num_slots;
  p.NL = static_cast<uint32_t>(a.NL);
  p.kv = static_cast<uint32_t>(a.kv);
  p.block_size = static_cast<uint32_t>(a.block_size);
  p.slots32 = a.num_slots <= (int64_t{1} << 31);

  // widest unit every address and length allows; the caller vouches for the plane bases
  // (base_align: a power of two dividing every base address, computed once per layout)
  int64_t g = std::min<int64_t>(16, a.base_align);
  g = gcd64(g, reinterpret_cast<int64_t>(st));
  g = gcd64(g, p.s_kv);
  g = gcd64(g, p.s_layer);
  g = gcd64(g, p.s_tok);
  bool contig = true, whole_heads = true;
  for (int64_t k = 0; k < a.kv; ++k) {
    const PlaneStrides& s = a.plane[k];
    contig = contig && s.n_chunks == 1 && (a.num_heads == 1 || s.head == a.head_bytes);
    whole_heads = whole_heads && s.n_chunks == 1;
    for (int64_t v : {s.block, s.token, s.head, s.chunk, s.chunk_bytes}) g = gcd64(g, v);
  }
  g = gcd64(g, a.head_bytes);
  int width = static_cast<int>(g == 0 ? 16 : g);
  if (width != 16 && width != 8 && width != 4 && width != 2) width = (width % 2 == 0) ? 2 : 1;
  for (int64_t k = 0; k < a.kv; ++k) {
    const PlaneStrides& s = a.plane[k];
    p.plane[k] = DevPlane{s.block, s.token, s.head, s.chunk, static_cast<uint32_t>(s.chunk_bytes / width),
                          static_cast<uint32_t>(s.n_chunks)};
  }
  if (a.kv == 1) p.plane[1] = p.plane[0];
  const int mode = contig ? kRowContig : (whole_heads ? kHeadRuns : kChunks);
  const int64_t upr = a.num_heads * a.head_bytes / width;
  if (upr > std::numeric_limits<int32_t>::max()) return fail("a token row is too large (more than 2^31 units)");
  p.units_per_row = static_cast<uint32_t>(upr);
  p.units_per_head = static_cast<uint32_t>(a.head_bytes / width);

  cudaStream_t stream = c10::cuda::getCurrentCUDAStream(static_cast<c10::DeviceIndex>(a.device)).stream();
  // token chunks keep T * units_per_row within 32 bits
  const int64_t max_tokens = std::max<int64_t>(1, (int64_t{1} << 31) / upr);
  for (int64_t t0 = 0; t0 < a.T; t0 += max_tokens) {
    const int64_t tn = std::min(max_tokens, a.T - t0);
    Params q = p;
    q.slots = p.slots + t0;
    q.staging = st + t0 * p.s_tok;
    q.T = static_cast<uint32_t>(tn);
    const int64_t units = tn * upr;
    const int64_t per_block = kThreads * (a.unroll == 8 ? 8 : 4);
    dim3 grid(static_cast<unsigned>((units + per_block - 1) / per_block), static_cast<unsigned>(a.kv * a.NL));
    if (a.unroll == 8)
      launch<kGather, 8>(width, mode, q, grid, stream);
    else
      launch<kGather, 4>(width, mode, q, grid, stream);
    cudaError_t err = cudaGetLastError();
    if (err != cudaSuccess) return fail(std::string("kernel launch failed: ") + cudaGetErrorString(err));
  }
  return nullptr;
}

}  // namespace
}  // namespace kvcore

namespace kvcore {
const char* cuda_transfer(bool gather, const CudaTransfer& a) noexcept {
  return gather ? run_transfer<true>(a) : run_transfer<false>(a);
}
}  // namespace kvcore
