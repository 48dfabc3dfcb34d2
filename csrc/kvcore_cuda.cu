// kvcore native transfer kernels: the CUDA implementation of kvcore::gather / scatter.
//
// One launch moves every layer and every plane of the record (up to 8 planes per launch:
// K, V, their scales and zeros...): blockIdx.y is the layer, blockIdx.x walks the planes'
// blocks one plane after another (plane p owns blocks [block_begin_p, block_begin_p +
// nblocks_p)), so no thread block straddles two planes and no block is idle. Each plane
// moves in units of its own width: the widest of 16/8/4/2/1 bytes that its bases, strides,
// run lengths and staging addresses allow, so the common layouts move as 16-byte loads and
// stores, each warp covering consecutive bytes of one row (coalesced), while a plane of
// 2-byte scales beside them moves in whatever its own addresses allow. When every plane has
// one width and one addressing mode the kernel is instantiated for exactly that (the
// classic K/V layouts: no per-plane branch at all); otherwise one kernel switches per
// block on its plane's (width, mode). Each thread keeps kUnroll independent loads in flight
// before its stores. Offsets are 64-bit. Slots outside [0, num_slots) (negative = padding)
// and tokens before `skip` are skipped: the destination row stays untouched.
//
// Device validation (validate = 1): a one-block check kernel runs first on the same stream.
// It checks every slot against [.., num_slots) and, for a scatter, that no slot repeats
// (one bit per slot in a bitmap that it sets and clears again), writes the verdict to a
// per-call device flag and, for a refused call, the details to a pinned host record. The
// transfer kernel issues its loads, then reads the flag and stores nothing when it is set,
// so a refused call writes no byte and the host never waits. With programmatic dependent
// launch (pdl) the transfer kernel's blocks are resident and loading while the check runs;
// griddepcontrol.wait orders the flag read after the check kernel's writes.
//
// The staging buffer is device memory or pinned host memory, read or written in place
// (zero-copy, through its mapped device address). Validation of the arguments and op
// registration live in kvcore_cpu.cpp; this unit throws nothing.
#define KVCORE_NO_TORCH
#include <cuda_runtime.h>

#include <algorithm>
#include <climits>
#include <cstring>
#include <limits>
#include <mutex>
#include <string>

#include "kvcore_ops.h"
#include "kvcore_device.cuh"

namespace kvcore {
namespace {

constexpr int kThreads = 256;

enum Mode : uint32_t { kRowContig = 0, kHeadRuns = 1, kChunks = 2 };

struct DevPlane {
  int64_t block, token, head, chunk, tgs;  // cache side, bytes
  int64_t sub;                             // bytes between a chunk's sub-runs (n_sub > 1)
  int64_t st_layer, st_tok, st_head;       // staging side, bytes
  char* st_base;                           // device address of this plane's staged row 0 of layer 0
  uint32_t token_group;                    // 0: no token groups
  uint32_t units_per_row, units_per_head, chunk_units;
  uint32_t n_runs, n_sub;                  // runs of a head (n_chunks * n_sub), sub-runs of a chunk
  uint32_t width, mode;
  uint32_t block_begin;  // first blockIdx.x of this plane
  uint32_t col;          // column of this plane in ptrs
};

struct Params {
  const int64_t* ptrs;   // device [NL, ncols]
  const int64_t* slots;  // device [T] (already offset to this launch's first token)
  const int* flag;       // device validation verdict, or nullptr
  int64_t num_slots;
  uint32_t T, ncols, P, block_size, skip;
  bool slots32;  // every valid slot < 2^31: 32-bit division
  DevPlane plane[kMaxPlanesPerLaunch];
};

template <typename V>
__device__ __forceinline__ V load_stream(const V* p) {
  return __ldcs(p);
}
template <typename V>
__device__ __forceinline__ void store_stream(V* p, const V& v) {
  __stcs(p, v);
}

using dev::grid_dependency_wait;
using dev::grid_dependents_launch;

// Move this block's units of plane `pl` in layer `l`; `bx` is the block's index within the plane.
template <typename V, int kMode, bool kGather, int kUnroll>
__device__ __forceinline__ void move_units(const Params& p, const DevPlane& pl, uint32_t bx, uint32_t l) {
  constexpr uint32_t W = sizeof(V);
  char* const base = reinterpret_cast<char*>(p.ptrs[static_cast<int64_t>(l) * p.ncols + pl.col]);
  char* const srow0 = pl.st_base + static_cast<int64_t>(l) * pl.st_layer;
  const uint32_t n = p.T * pl.units_per_row;
  const uint32_t first = bx * (kThreads * kUnroll) + threadIdx.x;

  V buf[kUnroll];
  V* dst[kUnroll];
#pragma unroll
  for (int j = 0; j < kUnroll; ++j) {
    dst[j] = nullptr;
    const uint32_t i = first + j * kThreads;
    if (i >= n) continue;
    const uint32_t t = i / pl.units_per_row;
    const uint32_t u = i - t * pl.units_per_row;
    if (t < p.skip) continue;
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
    int64_t cofs = blk * pl.block;
    if (pl.token_group) {
      const uint32_t g = static_cast<uint32_t>(off) / pl.token_group;
      cofs += g * pl.tgs + (static_cast<uint32_t>(off) - g * pl.token_group) * pl.token;
    } else {
      cofs += off * pl.token;
    }
    int64_t sofs;
    if (kMode == kRowContig) {
      cofs += static_cast<int64_t>(u) * W;
      sofs = static_cast<int64_t>(u) * W;
    } else if (kMode == kHeadRuns) {
      const uint32_t h = u / pl.units_per_head;
      const uint32_t e = u - h * pl.units_per_head;
      cofs += h * pl.head + static_cast<int64_t>(e) * W;
      sofs = h * pl.st_head + static_cast<int64_t>(e) * W;
    } else {
      // run r of the row: head h, run j = (chunk, sub-run) of the head in staged order
      const uint32_t r = u / pl.chunk_units;
      const uint32_t e = u - r * pl.chunk_units;
      const uint32_t h = r / pl.n_runs;
      const uint32_t j = r - h * pl.n_runs;
      int64_t run_ofs;
      if (pl.n_sub == 1) {
        run_ofs = j * pl.chunk;
      } else {
        const uint32_t c = j / pl.n_sub;
        run_ofs = c * pl.chunk + (j - c * pl.n_sub) * pl.sub;
      }
      cofs += h * pl.head + run_ofs + static_cast<int64_t>(e) * W;
      sofs = h * pl.st_head + (static_cast<int64_t>(j) * pl.chunk_units + e) * W;
    }
    V* cache = reinterpret_cast<V*>(base + cofs);
    V* row = reinterpret_cast<V*>(srow0 + static_cast<int64_t>(t) * pl.st_tok + sofs);
    if (kGather) {
      buf[j] = load_stream(cache);
      dst[j] = row;
    } else {
      buf[j] = load_stream(row);
      dst[j] = cache;
    }
  }
  if (p.flag != nullptr) {
    // the loads above are in flight; nothing is stored before the check kernel's verdict
    grid_dependency_wait();
    if (*reinterpret_cast<const volatile int*>(p.flag) != 0) return;
  }
#pragma unroll
  for (int j = 0; j < kUnroll; ++j)
    if (dst[j] != nullptr) store_stream(dst[j], buf[j]);
}

__device__ __forceinline__ int plane_of(const Params& p, uint32_t bx) {
  int pi = 0;
#pragma unroll
  for (int i = 1; i < kMaxPlanesPerLaunch; ++i)
    if (static_cast<uint32_t>(i) < p.P && bx >= p.plane[i].block_begin) pi = i;
  return pi;
}

// Every plane of the launch has one width and one mode: no per-plane dispatch.
template <typename V, int kMode, bool kGather, int kUnroll>
__global__ void __launch_bounds__(kThreads) uniform_kernel(const __grid_constant__ Params p) {
  const int pi = plane_of(p, blockIdx.x);
  const DevPlane& pl = p.plane[pi];
  move_units<V, kMode, kGather, kUnroll>(p, pl, blockIdx.x - pl.block_begin, blockIdx.y);
}

template <typename V, bool kGather, int kUnroll>
__device__ __forceinline__ void by_mode(const Params& p, const DevPlane& pl, uint32_t bx, uint32_t l) {
  if (pl.mode == kRowContig)
    move_units<V, kRowContig, kGather, kUnroll>(p, pl, bx, l);
  else if (pl.mode == kHeadRuns)
    move_units<V, kHeadRuns, kGather, kUnroll>(p, pl, bx, l);
  else
    move_units<V, kChunks, kGather, kUnroll>(p, pl, bx, l);
}

// Planes of different widths or modes: each block switches on its own plane's (uniform per block).
template <bool kGather, int kUnroll>
__global__ void __launch_bounds__(kThreads) mixed_kernel(const __grid_constant__ Params p) {
  const int pi = plane_of(p, blockIdx.x);
  const DevPlane& pl = p.plane[pi];
  const uint32_t bx = blockIdx.x - pl.block_begin;
  switch (pl.width) {
    case 16: by_mode<uint4, kGather, kUnroll>(p, pl, bx, blockIdx.y); break;
    case 8: by_mode<uint2, kGather, kUnroll>(p, pl, bx, blockIdx.y); break;
    case 4: by_mode<unsigned int, kGather, kUnroll>(p, pl, bx, blockIdx.y); break;
    case 2: by_mode<unsigned short, kGather, kUnroll>(p, pl, bx, blockIdx.y); break;
    default: by_mode<unsigned char, kGather, kUnroll>(p, pl, bx, blockIdx.y); break;
  }
}

// The device validation: one block. Sets *flag to 0 (go), 1 (a slot out of range) or 2 (a
// scatter slot repeats) and records a refusal in the pinned record.
__global__ void __launch_bounds__(1024) check_kernel(const int64_t* __restrict__ slots, uint32_t T, uint32_t skip, int64_t num_slots,
                                                     uint32_t* bitmap, int* flag, DeviceErrorRecord* rec, int64_t call, int gather,
                                                     int pdl) {
  if (pdl) grid_dependents_launch();  // the transfer's blocks may become resident and start loading
  __shared__ unsigned int first_bad;
  __shared__ unsigned long long min_dup;
  if (threadIdx.x == 0) {
    first_bad = UINT_MAX;
    min_dup = ULLONG_MAX;
  }
  __syncthreads();
  // each thread checks a run of consecutive tokens: an engine's slots come in runs of a
  // block's tokens, so bits of one bitmap word are combined before one atomicOr
  const uint32_t n = T - skip;
  const uint32_t per = (n + blockDim.x - 1) / blockDim.x;
  const uint32_t t0 = skip + threadIdx.x * per;
  const uint32_t t1 = min(T, t0 + per);
  uint64_t word = ~uint64_t{0};
  uint32_t mask = 0;
  auto flush = [&]() {
    if (mask == 0) return;
    const uint32_t old = atomicOr(bitmap + word, mask);
    if (old & mask) atomicMin(&min_dup, static_cast<unsigned long long>(word * 32 + __ffs(old & mask) - 1));
  };
  for (uint32_t t = t0; t < t1; ++t) {
    const int64_t s = slots[t];
    if (s >= num_slots) {
      atomicMin(&first_bad, t);
    } else if (bitmap != nullptr && s >= 0) {
      const uint64_t w = static_cast<uint64_t>(s) >> 5;
      const uint32_t bit = 1u << (static_cast<uint64_t>(s) & 31);
      if (w != word) {
        flush();
        word = w;
        mask = 0;
      }
      if (mask & bit) atomicMin(&min_dup, static_cast<unsigned long long>(s));  // twice in this run
      mask |= bit;
    }
  }
  if (bitmap != nullptr) flush();
  __syncthreads();
  if (bitmap != nullptr) dev::bits_clear(bitmap, slots, t0, t1, num_slots);  // leave the bitmap all zero for the next call
  if (threadIdx.x == 0) {
    const int verdict = first_bad != UINT_MAX ? 1 : (min_dup != ULLONG_MAX ? 2 : 0);
    *flag = verdict;
    if (verdict != 0 && rec != nullptr) {
      if (rec->seq == rec->ack) {
        rec->kind = verdict;
        rec->index = verdict == 1 ? static_cast<int64_t>(first_bad) : -1;
        rec->value = verdict == 1 ? slots[first_bad] : static_cast<int64_t>(min_dup);
        rec->num_slots = num_slots;
        rec->call = call;
        rec->gather = gather;
        __threadfence_system();
        rec->seq = rec->seq + 1;
      } else {
        rec->dropped = rec->dropped + 1;
      }
      __threadfence_system();
    }
  }
}

// -- host side -----------------------------------------------------------------------------

template <typename V, bool kGather, int kUnroll>
const void* uniform_fn(uint32_t mode) {
  if (mode == kRowContig) return reinterpret_cast<const void*>(&uniform_kernel<V, kRowContig, kGather, kUnroll>);
  if (mode == kHeadRuns) return reinterpret_cast<const void*>(&uniform_kernel<V, kHeadRuns, kGather, kUnroll>);
  return reinterpret_cast<const void*>(&uniform_kernel<V, kChunks, kGather, kUnroll>);
}

template <bool kGather, int kUnroll>
const void* kernel_fn(bool uniform, uint32_t width, uint32_t mode) {
  if (!uniform) return reinterpret_cast<const void*>(&mixed_kernel<kGather, kUnroll>);
  switch (width) {
    case 16: return uniform_fn<uint4, kGather, kUnroll>(mode);
    case 8: return uniform_fn<uint2, kGather, kUnroll>(mode);
    case 4: return uniform_fn<unsigned int, kGather, kUnroll>(mode);
    case 2: return uniform_fn<unsigned short, kGather, kUnroll>(mode);
    default: return uniform_fn<unsigned char, kGather, kUnroll>(mode);
  }
}

int64_t gcd64(int64_t a, int64_t b) {
  if (a < 0) a = -a;
  if (b < 0) b = -b;
  while (b) {
    int64_t t = a % b;
    a = b;
    b = t;
  }
  return a;
}

thread_local std::string g_error;
bool g_pdl_failed = false;  // set once a launch with programmatic dependent launch was refused

const char* fail(const std::string& msg) {
  g_error = msg;
  return g_error.c_str();
}

cudaError_t launch(const void* fn, dim3 grid, cudaStream_t stream, bool pdl, const Params& p) {
  cudaLaunchConfig_t cfg{};
  cfg.gridDim = grid;
  cfg.blockDim = dim3(kThreads);
  cfg.dynamicSmemBytes = 0;
  cfg.stream = stream;
  cudaLaunchAttribute attr[1];
  if (pdl) {
    attr[0].id = cudaLaunchAttributeProgrammaticStreamSerialization;
    attr[0].val.programmaticStreamSerializationAllowed = 1;
    cfg.attrs = attr;
    cfg.numAttrs = 1;
  }
  void* args[] = {const_cast<Params*>(&p)};
  return cudaLaunchKernelExC(&cfg, fn, args);
}

template <bool kGather>
const char* run_transfer(const CudaTransfer& a) {
  if (a.T == 0 || a.NL == 0 || a.P == 0) return nullptr;
  int prev = -1;
  if (cudaGetDevice(&prev) != cudaSuccess) return fail("cudaGetDevice failed");
  if (prev != a.device && cudaSetDevice(a.device) != cudaSuccess) return fail("cudaSetDevice failed");
  struct Restore {
    int prev, cur;
    ~Restore() {
      if (prev != cur) (void)cudaSetDevice(prev);
    }
  } restore{prev, a.device};
  cudaStream_t stream = static_cast<cudaStream_t>(a.stream);

  // per-plane units and modes (all planes of the call, then launched in groups of 8)
  const int64_t P = a.P;
  if (P > kMaxPlanes) return fail("too many planes");
  DevPlane dp[kMaxPlanes];
  int64_t max_tokens = std::numeric_limits<int32_t>::max();
  for (int64_t k = 0; k < P; ++k) {
    const PlaneDesc& s = a.plane[k];
    char* st = s.st_base;
    const uint32_t mode = s.row_contiguous() ? kRowContig : (s.head_contiguous() ? kHeadRuns : kChunks);
    // the widest unit every address this plane's mode forms allows: a contiguous row is
    // one run (its heads' own sizes do not matter: 8 heads of 2-byte scales move as one
    // 16-byte unit), head runs add the head strides, chunks the chunk strides
    int64_t g = s.base_align >= 1 ? std::min<int64_t>(16, s.base_align) : 1;
    for (int64_t v : {reinterpret_cast<int64_t>(st), s.st_layer, s.st_tok, s.block, s.token, s.token_group_stride}) g = gcd64(g, v);
    if (mode == kRowContig) {
      g = gcd64(g, s.num_heads * s.head_bytes);
    } else {
      for (int64_t v : {s.head, s.head_bytes, s.st_head}) g = gcd64(g, v);
      if (mode == kChunks)
        for (int64_t v : {s.chunk, s.chunk_bytes, s.n_sub > 1 ? s.sub : int64_t{0}}) g = gcd64(g, v);
    }
    int width = static_cast<int>(g == 0 ? 16 : g);
    if (width != 16 && width != 8 && width != 4 && width != 2) width = (width % 8 == 0) ? 8 : (width % 4 == 0) ? 4 : (width % 2 == 0) ? 2 : 1;
    const int64_t upr = s.num_heads * s.head_bytes / width;
    if (upr > std::numeric_limits<int32_t>::max() || upr <= 0) return fail("a token row is too large (more than 2^31 units)");
    max_tokens = std::min<int64_t>(max_tokens, std::max<int64_t>(1, std::numeric_limits<int32_t>::max() / upr));
    DevPlane d{};
    d.block = s.block;
    d.token = s.token;
    d.head = s.head;
    d.chunk = s.chunk;
    d.tgs = s.token_group_stride;
    d.st_layer = s.st_layer;
    d.st_tok = s.st_tok;
    d.st_head = s.st_head;
    d.st_base = st;
    d.token_group = static_cast<uint32_t>(s.token_group);
    d.units_per_row = static_cast<uint32_t>(upr);
    d.units_per_head = static_cast<uint32_t>(s.head_bytes / width);
    d.chunk_units = static_cast<uint32_t>(s.chunk_bytes / width);
    d.n_runs = static_cast<uint32_t>(s.n_chunks * s.n_sub);
    d.n_sub = static_cast<uint32_t>(s.n_sub);
    d.sub = s.n_sub > 1 ? s.sub : 0;
    d.width = static_cast<uint32_t>(width);
    d.mode = mode;
    d.col = static_cast<uint32_t>(k);
    dp[k] = d;
  }

  // device validation first: one block, same stream
  if (a.validate) {
    const int64_t n = a.T - std::min(a.skip, a.T);
    const unsigned threads = static_cast<unsigned>(std::min<int64_t>(1024, std::max<int64_t>(32, (n + 31) / 32 * 32)));
    check_kernel<<<1, threads, 0, stream>>>(a.slots, static_cast<uint32_t>(a.T), static_cast<uint32_t>(std::min(a.skip, a.T)),
                                            a.num_slots, kGather ? nullptr : a.bitmap, a.flag, a.record, a.call, kGather ? 1 : 0,
                                            a.pdl && !g_pdl_failed ? 1 : 0);
    cudaError_t err = cudaGetLastError();
    if (err != cudaSuccess) return fail(std::string("check kernel launch failed: ") + cudaGetErrorString(err));
  }

  const int64_t per_block = kThreads * (a.unroll == 8 ? 8 : 4);
  bool first_launch = true;
  for (int64_t t0 = 0; t0 < a.T; t0 += max_tokens) {
    const int64_t tn = std::min(max_tokens, a.T - t0);
    Params q{};
    q.ptrs = a.ptrs;
    q.slots = a.slots + t0;
    q.flag = (a.validate || a.gated) ? a.flag : nullptr;  // gated: set by an earlier kernel on the stream
    q.num_slots = a.num_slots;
    q.T = static_cast<uint32_t>(tn);
    q.ncols = static_cast<uint32_t>(P);
    q.block_size = static_cast<uint32_t>(a.block_size);
    q.skip = static_cast<uint32_t>(std::max<int64_t>(0, std::min(a.skip - t0, tn)));
    q.slots32 = a.num_slots <= (int64_t{1} << 31);
    if (q.skip >= q.T) continue;
    for (int64_t g0 = 0; g0 < P; g0 += kMaxPlanesPerLaunch) {
      const int64_t gn = std::min<int64_t>(kMaxPlanesPerLaunch, P - g0);
      q.P = static_cast<uint32_t>(gn);
      int64_t blocks = 0;
      bool uniform = true;
      for (int64_t k = 0; k < gn; ++k) {
        DevPlane d = dp[g0 + k];
        d.st_base += t0 * d.st_tok;
        d.block_begin = static_cast<uint32_t>(blocks);
        blocks += (tn * d.units_per_row + per_block - 1) / per_block;
        uniform = uniform && d.width == dp[g0].width && d.mode == dp[g0].mode;
        q.plane[k] = d;
      }
      if (blocks > std::numeric_limits<int32_t>::max()) return fail("too many thread blocks for one launch");
      dim3 grid(static_cast<unsigned>(blocks), static_cast<unsigned>(a.NL));
      const void* fn = a.unroll == 8 ? kernel_fn<kGather, 8>(uniform, dp[g0].width, dp[g0].mode)
                                     : kernel_fn<kGather, 4>(uniform, dp[g0].width, dp[g0].mode);
      const bool pdl = a.validate && a.pdl && !g_pdl_failed && first_launch;
      cudaError_t err = launch(fn, grid, stream, pdl, q);
      if (err != cudaSuccess && pdl) {
        // no programmatic dependent launch here: launch in plain stream order (still correct:
        // the check kernel has finished before the transfer starts)
        (void)cudaGetLastError();
        g_pdl_failed = true;
        err = launch(fn, grid, stream, false, q);
      }
      first_launch = false;
      if (err != cudaSuccess) {
        (void)cudaGetLastError();
        return fail(std::string("kernel launch failed: ") + cudaGetErrorString(err));
      }
    }
  }
  return nullptr;
}

}  // namespace

void* cuda_host_device_ptr(void* host) noexcept {
  cudaPointerAttributes attr{};
  cudaError_t err = cudaPointerGetAttributes(&attr, host);
  if (err != cudaSuccess) {
    (void)cudaGetLastError();
    return nullptr;
  }
  if (attr.type != cudaMemoryTypeHost || attr.devicePointer == nullptr) return nullptr;
  return attr.devicePointer;
}

const char* cuda_transfer(bool gather, const CudaTransfer& a) noexcept {
  return gather ? run_transfer<true>(a) : run_transfer<false>(a);
}

DeviceErrorRecord* cuda_error_record(int device, DeviceErrorRecord** device_addr) noexcept {
  static std::mutex mu;
  static DeviceErrorRecord* host = nullptr;
  std::lock_guard<std::mutex> lock(mu);
  if (host == nullptr) {
    void* p = nullptr;
    if (cudaHostAlloc(&p, sizeof(DeviceErrorRecord), cudaHostAllocMapped | cudaHostAllocPortable) != cudaSuccess) {
      (void)cudaGetLastError();
      return nullptr;
    }
    std::memset(p, 0, sizeof(DeviceErrorRecord));
    host = static_cast<DeviceErrorRecord*>(p);
  }
  if (device_addr != nullptr) {
    int prev = -1;
    (void)cudaGetDevice(&prev);
    if (device >= 0 && prev != device) (void)cudaSetDevice(device);
    void* d = nullptr;
    if (cudaHostGetDevicePointer(&d, host, 0) != cudaSuccess) {
      (void)cudaGetLastError();
      d = nullptr;
    }
    if (device >= 0 && prev != device && prev >= 0) (void)cudaSetDevice(prev);
    *device_addr = static_cast<DeviceErrorRecord*>(d);
    if (d == nullptr) return nullptr;
  }
  return host;
}

int cuda_stream_capturing(void* stream) noexcept {
  cudaStreamCaptureStatus st = cudaStreamCaptureStatusNone;
  if (cudaStreamIsCapturing(static_cast<cudaStream_t>(stream), &st) != cudaSuccess) {
    (void)cudaGetLastError();
    return -1;
  }
  return st == cudaStreamCaptureStatusNone ? 0 : 1;
}

const char* cuda_stream_sync(void* stream) noexcept {
  cudaError_t err = cudaStreamSynchronize(static_cast<cudaStream_t>(stream));
  if (err != cudaSuccess) {
    (void)cudaGetLastError();
    return fail(std::string("cudaStreamSynchronize failed: ") + cudaGetErrorString(err));
  }
  return nullptr;
}

const char* cuda_read_flag(const int* flag, int* out) noexcept {
  cudaError_t err = cudaMemcpy(out, flag, sizeof(int), cudaMemcpyDeviceToHost);
  if (err != cudaSuccess) {
    (void)cudaGetLastError();
    return fail(std::string("reading the validation flag failed: ") + cudaGetErrorString(err));
  }
  return nullptr;
}

}  // namespace kvcore
