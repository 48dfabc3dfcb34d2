// kvcore layout-to-layout copy: the CUDA implementation of kvcore::copy_rows.
//
// One launch moves every layer and every plane: blockIdx.y is (plane, layer),
// blockIdx.x walks that plane's T * units_per_row transfer units. A unit is the widest
// of 16/8/4/2/1 bytes that every base, stride, chunk and head length of both sides
// allows, so the common layouts move as 16-byte loads and stores; consecutive threads
// cover consecutive bytes of one token row, so both the read and the write side are
// coalesced over each side's contiguous runs (a whole row for NHD, a head for HND).
// Each thread keeps kUnroll independent loads in flight before its stores. The address
// arithmetic of each side is specialised (row-contiguous, per-head runs, chunked heads).
// A side in pinned host memory is read or written in place through its mapped address
// (zero-copy, e.g. device -> pinned host offload with the layout conversion fused).
// Offsets are 64-bit. Rows with a slot outside [0, num_slots) on either side are skipped.
#include "kvcore_copy.h"

#include <c10/cuda/CUDAStream.h>
#include <cuda_runtime.h>

#include <algorithm>
#include <limits>
#include <string>

namespace kvcore {
namespace copy {
namespace {

constexpr int kThreads = 256;
constexpr int kUnroll = 4;

struct DevSide {
  int64_t block, token, head, chunk, token_group_stride;  // bytes
  uint32_t run_units;                                     // units per contiguous run of a head (one chunk, or the whole head)
  uint32_t token_group;                                   // 0: no token groups
  int32_t run_shift;                                      // log2(run_units) when a power of two, else -1
};

struct DevPlane {
  DevSide s, d;
  uint32_t units_per_row, head_units;
  int32_t row_shift, head_shift;  // log2 of units_per_row / head_units when powers of two, else -1
};

struct Params {
  const int64_t* src_ptrs;
  const int64_t* dst_ptrs;
  const int64_t* src_slots;
  const int64_t* dst_slots;
  DevPlane plane[kMaxPlanes];
  int64_t src_num_slots, dst_num_slots;
  uint32_t NL, T, src_bs, dst_bs;
  int32_t src_bs_shift, dst_bs_shift;  // log2 of the block sizes when powers of two, else -1
  bool slots32;
};

// v / d, as a shift when d is a power of two (the divisors are launch constants, so the
// branch is uniform): four divisions per 16-byte unit would otherwise cost a large share
// of the SMs' integer throughput at HBM speed.
__device__ __forceinline__ uint32_t divu(uint32_t v, uint32_t d, int32_t shift) { return shift >= 0 ? (v >> shift) : v / d; }

enum Mode { kRow = 0, kHeads = 1, kChunks = 2 };

__device__ __forceinline__ int64_t token_offset(const DevSide& s, uint32_t t) {
  if (s.token_group) {
    const uint32_t g = t / s.token_group;
    return static_cast<int64_t>(g) * s.token_group_stride + static_cast<int64_t>(t - g * s.token_group) * s.token;
  }
  return static_cast<int64_t>(t) * s.token;
}

__device__ __forceinline__ int64_t slot_offset(const DevSide& s, int64_t slot, uint32_t bs, int32_t bs_shift, bool slots32) {
  if (slots32) {
    const uint32_t s32 = static_cast<uint32_t>(slot);
    const uint32_t b = divu(s32, bs, bs_shift);
    return static_cast<int64_t>(b) * s.block + token_offset(s, s32 - b * bs);
  }
  const int64_t b = slot / bs;
  return b * s.block + token_offset(s, static_cast<uint32_t>(slot - b * bs));
}

template <int kMode, uint32_t W>
__device__ __forceinline__ int64_t unit_offset(const DevSide& s, uint32_t u, uint32_t h, uint32_t e) {
  if (kMode == kRow) return static_cast<int64_t>(u) * W;
  if (kMode == kHeads) return static_cast<int64_t>(h) * s.head + static_cast<int64_t>(e) * W;
  const uint32_t c = divu(e, s.run_units, s.run_shift);
  const uint32_t r = e - c * s.run_units;
  return static_cast<int64_t>(h) * s.head + static_cast<int64_t>(c) * s.chunk + static_cast<int64_t>(r) * W;
}

template <typename V, int kSrc, int kDst>
__global__ void __launch_bounds__(kThreads) copy_kernel(const Params p) {
  constexpr uint32_t W = sizeof(V);
  __shared__ DevPlane sp;
  const uint32_t pl_idx = blockIdx.y / p.NL;
  const uint32_t l = blockIdx.y - pl_idx * p.NL;
  if (threadIdx.x == 0) sp = p.plane[pl_idx];
  __syncthreads();
  const uint32_t n = p.T * sp.units_per_row;
  const uint32_t first = blockIdx.x * (kThreads * kUnroll) + threadIdx.x;
  if (blockIdx.x * (kThreads * kUnroll) >= n) return;
  const int np = static_cast<int>(gridDim.y / p.NL);
  const char* const sbase = reinterpret_cast<const char*>(p.src_ptrs[l * np + pl_idx]);
  char* const dbase = reinterpret_cast<char*>(p.dst_ptrs[l * np + pl_idx]);

  V buf[kUnroll];
  V* dst[kUnroll];
#pragma unroll
  for (int j = 0; j < kUnroll; ++j) {
    dst[j] = nullptr;
    const uint32_t i = first + j * kThreads;
    if (i >= n) continue;
    const uint32_t t = divu(i, sp.units_per_row, sp.row_shift);
    const uint32_t u = i - t * sp.units_per_row;
    const int64_t ss = p.src_slots[t];
    const int64_t ds = p.dst_slots[t];
    if (ss < 0 || ss >= p.src_num_slots || ds < 0 || ds >= p.dst_num_slots) continue;
    uint32_t h = 0, e = 0;
    if (kSrc != kRow || kDst != kRow) {
      h = divu(u, sp.head_units, sp.head_shift);
      e = u - h * sp.head_units;
    }
    const int64_t so = slot_offset(sp.s, ss, p.src_bs, p.src_bs_shift, p.slots32) + unit_offset<kSrc, W>(sp.s, u, h, e);
    const int64_t dof = slot_offset(sp.d, ds, p.dst_bs, p.dst_bs_shift, p.slots32) + unit_offset<kDst, W>(sp.d, u, h, e);
    buf[j] = __ldcs(reinterpret_cast<const V*>(sbase + so));
    dst[j] = reinterpret_cast<V*>(dbase + dof);
  }
#pragma unroll
  for (int j = 0; j < kUnroll; ++j)
    if (dst[j] != nullptr) __stcs(dst[j], buf[j]);
}

template <typename V, int kSrc>
void launch_dst(int dmode, const Params& p, dim3 grid, cudaStream_t stream) {
  if (dmode == kRow)
    copy_kernel<V, kSrc, kRow><<<grid, kThreads, 0, stream>>>(p);
  else if (dmode == kHeads)
    copy_kernel<V, kSrc, kHeads><<<grid, kThreads, 0, stream>>>(p);
  else
    copy_kernel<V, kSrc, kChunks><<<grid, kThreads, 0, stream>>>(p);
}

template <typename V>
void launch_modes(int smode, int dmode, const Params& p, dim3 grid, cudaStream_t stream) {
  if (smode == kRow)
    launch_dst<V, kRow>(dmode, p, grid, stream);
  else if (smode == kHeads)
    launch_dst<V, kHeads>(dmode, p, grid, stream);
  else
    launch_dst<V, kChunks>(dmode, p, grid, stream);
}

void launch(int width, int smode, int dmode, const Params& p, dim3 grid, cudaStream_t stream) {
  switch (width) {
    case 16: launch_modes<uint4>(smode, dmode, p, grid, stream); break;
    case 8: launch_modes<uint2>(smode, dmode, p, grid, stream); break;
    case 4: launch_modes<unsigned int>(smode, dmode, p, grid, stream); break;
    case 2: launch_modes<unsigned short>(smode, dmode, p, grid, stream); break;
    default: launch_modes<unsigned char>(smode, dmode, p, grid, stream); break;
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

thread_local std::string g_error;

const char* fail(const std::string& msg) {
  g_error = msg;
  return g_error.c_str();
}

// A side in host memory must be pinned and mapped at the same address (unified virtual
// addressing), so that the base addresses the kernel receives are usable as they are.
const char* check_mapped(int64_t probe, const char* side) {
  if (probe == 0) return nullptr;
  cudaPointerAttributes attr{};
  void* ptr = reinterpret_cast<void*>(probe);
  if (cudaPointerGetAttributes(&attr, ptr) != cudaSuccess) {
    (void)cudaGetLastError();
    return fail(std::string("the ") + side + " cache is in host memory that CUDA does not know: pin it (pin_memory=True)");
  }
  if (attr.type != cudaMemoryTypeHost || attr.devicePointer != ptr)
    return fail(std::string("the ") + side +
                " cache is in host memory that is not pinned and mapped at its host address: allocate it with pin_memory=True");
  return nullptr;
}

int32_t log2_exact(int64_t v) {
  if (v <= 0 || (v & (v - 1)) != 0) return -1;
  int32_t k = 0;
  while ((int64_t{1} << k) < v) ++k;
  return k;
}

int side_mode(const Side& s, int64_t nh, int64_t hb) {
  if (s.n_chunks == 1 && (nh == 1 || s.head == hb)) return kRow;
  return s.n_chunks == 1 ? kHeads : kChunks;
}

const char* run_copy(const CudaCopy& a) {
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
  if (const char* e = check_mapped(a.src_host_probe, "source")) return e;
  if (const char* e = check_mapped(a.dst_host_probe, "destination")) return e;

  // widest unit every address and length of both sides allows
  int64_t g = std::min<int64_t>(16, a.base_align);
  int smode = kRow, dmode = kRow;
  for (int64_t k = 0; k < a.P; ++k) {
    for (const Side* s : {&a.src[k], &a.dst[k]})
      for (int64_t v : {s->block, s->token, s->head, s->chunk, s->chunk_bytes, s->token_group_stride}) g = gcd64(g, v);
    g = gcd64(g, a.head_bytes[k]);
    smode = std::max(smode, side_mode(a.src[k], a.num_heads[k], a.head_bytes[k]));
    dmode = std::max(dmode, side_mode(a.dst[k], a.num_heads[k], a.head_bytes[k]));
  }
  int width = static_cast<int>(g == 0 ? 16 : g);
  if (width != 16 && width != 8 && width != 4 && width != 2) width = (width % 2 == 0) ? 2 : 1;

  Params p{};
  p.src_ptrs = a.src_ptrs;
  p.dst_ptrs = a.dst_ptrs;
  p.src_num_slots = a.src_num_slots;
  p.dst_num_slots = a.dst_num_slots;
  p.NL = static_cast<uint32_t>(a.NL);
  p.src_bs = static_cast<uint32_t>(a.src_block_size);
  p.dst_bs = static_cast<uint32_t>(a.dst_block_size);
  p.src_bs_shift = log2_exact(a.src_block_size);
  p.dst_bs_shift = log2_exact(a.dst_block_size);
  p.slots32 = a.src_num_slots <= (int64_t{1} << 31) && a.dst_num_slots <= (int64_t{1} << 31);
  if (a.src_block_size > int64_t{0xFFFFFFFF} || a.dst_block_size > int64_t{0xFFFFFFFF}) return fail("block_size is too large");
  int64_t max_upr = 1;
  for (int64_t k = 0; k < a.P; ++k) {
    const int64_t upr = a.num_heads[k] * a.head_bytes[k] / width;
    if (upr > std::numeric_limits<int32_t>::max()) return fail("a token row is too large (more than 2^31 units)");
    max_upr = std::max(max_upr, upr);
    auto dev_side = [&](const Side& s) {
      const int64_t run = (s.n_chunks == 1 ? a.head_bytes[k] : s.chunk_bytes) / width;
      return DevSide{s.block,
                     s.token,
                     s.head,
                     s.chunk,
                     s.token_group_stride,
                     static_cast<uint32_t>(run),
                     static_cast<uint32_t>(s.token_group),
                     log2_exact(run)};
    };
    const int64_t hu = a.head_bytes[k] / width;
    p.plane[k] = DevPlane{dev_side(a.src[k]), dev_side(a.dst[k]), static_cast<uint32_t>(upr), static_cast<uint32_t>(hu),
                          log2_exact(upr), log2_exact(hu)};
  }

  cudaStream_t stream = c10::cuda::getCurrentCUDAStream(static_cast<c10::DeviceIndex>(a.device)).stream();
  // token chunks keep T * units_per_row within 32 bits
  const int64_t max_tokens = std::max<int64_t>(1, (int64_t{1} << 31) / max_upr);
  for (int64_t t0 = 0; t0 < a.T; t0 += max_tokens) {
    const int64_t tn = std::min(max_tokens, a.T - t0);
    Params q = p;
    q.src_slots = a.src_slots + t0;
    q.dst_slots = a.dst_slots + t0;
    q.T = static_cast<uint32_t>(tn);
    const int64_t per_block = int64_t{kThreads} * kUnroll;
    dim3 grid(static_cast<unsigned>((tn * max_upr + per_block - 1) / per_block), static_cast<unsigned>(a.P * a.NL));
    launch(width, smode, dmode, q, grid, stream);
    cudaError_t err = cudaGetLastError();
    if (err != cudaSuccess) return fail(std::string("kernel launch failed: ") + cudaGetErrorString(err));
  }
  return nullptr;
}

}  // namespace

const char* cuda_copy(const CudaCopy& a) noexcept { return run_copy(a); }

}  // namespace copy
}  // namespace kvcore
