// kvcore layout-to-layout copy: the CUDA implementation of kvcore::copy_rows and of the
// point-to-point control kernels.
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
//
// Device validation (validate = 1): check_kernel (one block) runs first and writes a
// verdict; the copy kernel issues its loads, then waits for the check grid
// (griddepcontrol.wait; with programmatic dependent launch its blocks are resident and
// loading while the check runs) and stores nothing when the verdict is a refusal.
#define KVCORE_NO_TORCH
#include <cuda_runtime.h>

#include <algorithm>
#include <climits>
#include <limits>
#include <string>

#include "kvcore_copy.h"
#include "kvcore_device.cuh"

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
  const int* flag;  // validation verdict (nullptr: none): stores only when 0
  DevPlane plane[kMaxPlanes];
  int64_t src_num_slots, dst_num_slots;
  uint32_t NL, T, src_bs, dst_bs;
  int32_t src_bs_shift, dst_bs_shift;  // log2 of the block sizes when powers of two, else -1
  bool slots32;
};

using dev::grid_dependency_wait;
using dev::grid_dependents_launch;

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
__global__ void __launch_bounds__(kThreads) copy_kernel(const __grid_constant__ Params p) {
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
  if (p.flag != nullptr) {
    // the loads above are in flight; nothing is stored before the check kernel's verdict
    grid_dependency_wait();
    if (*reinterpret_cast<const volatile int*>(p.flag) != 0) return;
  }
#pragma unroll
  for (int j = 0; j < kUnroll; ++j)
    if (dst[j] != nullptr) __stcs(dst[j], buf[j]);
}

template <typename V, int kSrc>
const void* fn_dst(int dmode) {
  if (dmode == kRow) return reinterpret_cast<const void*>(&copy_kernel<V, kSrc, kRow>);
  if (dmode == kHeads) return reinterpret_cast<const void*>(&copy_kernel<V, kSrc, kHeads>);
  return reinterpret_cast<const void*>(&copy_kernel<V, kSrc, kChunks>);
}

template <typename V>
const void* fn_modes(int smode, int dmode) {
  if (smode == kRow) return fn_dst<V, kRow>(dmode);
  if (smode == kHeads) return fn_dst<V, kHeads>(dmode);
  return fn_dst<V, kChunks>(dmode);
}

const void* copy_fn(int width, int smode, int dmode) {
  switch (width) {
    case 16: return fn_modes<uint4>(smode, dmode);
    case 8: return fn_modes<uint2>(smode, dmode);
    case 4: return fn_modes<unsigned int>(smode, dmode);
    case 2: return fn_modes<unsigned short>(smode, dmode);
    default: return fn_modes<unsigned char>(smode, dmode);
  }
}

cudaError_t launch(const void* fn, dim3 grid, dim3 block, cudaStream_t stream, bool pdl, void** args) {
  cudaLaunchConfig_t cfg{};
  cfg.gridDim = grid;
  cfg.blockDim = block;
  cfg.dynamicSmemBytes = 0;
  cfg.stream = stream;
  cudaLaunchAttribute attr[1];
  if (pdl) {
    attr[0].id = cudaLaunchAttributeProgrammaticStreamSerialization;
    attr[0].val.programmaticStreamSerializationAllowed = 1;
    cfg.attrs = attr;
    cfg.numAttrs = 1;
  }
  return cudaLaunchKernelExC(&cfg, fn, args);
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
bool g_pdl_failed = false;  // set once a launch with programmatic dependent launch was refused

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

struct DeviceGuard {
  int prev = -1, cur = -1;
  const char* set(int device) {
    if (cudaGetDevice(&prev) != cudaSuccess) return fail("cudaGetDevice failed");
    cur = device;
    if (device >= 0 && prev != device && cudaSetDevice(device) != cudaSuccess) return fail("cudaSetDevice failed");
    return nullptr;
  }
  ~DeviceGuard() {
    if (cur >= 0 && prev >= 0 && prev != cur) (void)cudaSetDevice(prev);
  }
};

// -- the slot check: one block ------------------------------------------------------------

__device__ __forceinline__ void bits_set(uint32_t* bitmap, const int64_t* slots, const int64_t* other, int64_t other_n, uint32_t t0,
                                         uint32_t t1, int64_t n, bool valid_rows_only, unsigned long long* min_dup) {
  // each thread covers a run of consecutive tokens: an engine's slots come in runs of a
  // block's tokens, so bits of one bitmap word are combined before one atomicOr
  uint64_t word = ~uint64_t{0};
  uint32_t mask = 0;
  auto flush = [&]() {
    if (mask == 0) return;
    const uint32_t old = atomicOr(bitmap + word, mask);
    if ((old & mask) && min_dup != nullptr) atomicMin(min_dup, static_cast<unsigned long long>(word * 32 + __ffs(old & mask) - 1));
  };
  for (uint32_t t = t0; t < t1; ++t) {
    const int64_t s = slots[t];
    if (s < 0 || s >= n) continue;
    if (valid_rows_only && (other[t] < 0 || other[t] >= other_n)) continue;
    const uint64_t w = static_cast<uint64_t>(s) >> 5;
    const uint32_t bit = 1u << (static_cast<uint64_t>(s) & 31);
    if (w != word) {
      flush();
      word = w;
      mask = 0;
    }
    if ((mask & bit) && min_dup != nullptr) atomicMin(min_dup, static_cast<unsigned long long>(s));  // twice in this run
    mask |= bit;
  }
  flush();
}

using dev::bits_clear;

__global__ void __launch_bounds__(1024) check_kernel(const CheckArgs a) {
  if (a.pdl) grid_dependents_launch();  // the copy's blocks may become resident and start loading
  __shared__ unsigned int bad_src, bad_dst;
  __shared__ unsigned long long min_dup, min_ovl;
  if (threadIdx.x == 0) {
    bad_src = UINT_MAX;
    bad_dst = UINT_MAX;
    min_dup = ULLONG_MAX;
    min_ovl = ULLONG_MAX;
  }
  __syncthreads();
  const uint32_t per = (a.T + blockDim.x - 1) / blockDim.x;
  const uint32_t t0 = min(a.T, threadIdx.x * per);
  const uint32_t t1 = min(a.T, t0 + per);
  for (uint32_t t = t0; t < t1; ++t) {
    if (a.src != nullptr) {
      const int64_t s = a.src[t];
      if (s >= a.src_n) atomicMin(&bad_src, t);
      if (a.mask != nullptr) a.mask[t] = s >= 0 ? 1 : 0;
    }
    if (a.dst != nullptr && a.dst[t] >= a.dst_n) atomicMin(&bad_dst, t);
  }
  if (a.dst != nullptr && a.bitmap != nullptr) {
    bits_set(a.bitmap, a.dst, nullptr, 0, t0, t1, a.dst_n, false, &min_dup);
    __syncthreads();
    bits_clear(a.bitmap, a.dst, t0, t1, a.dst_n);
    if (a.shared && a.src != nullptr) {
      // a slot read by one valid row and written by another: the bits of the valid rows'
      // destination slots, then the valid rows' source slots against them
      __syncthreads();
      bits_set(a.bitmap, a.dst, a.src, a.src_n, t0, t1, a.dst_n, true, nullptr);
      __syncthreads();
      for (uint32_t t = t0; t < t1; ++t) {
        const int64_t s = a.src[t], d = a.dst[t];
        if (s < 0 || s >= a.src_n || d < 0 || d >= a.dst_n || s >= a.dst_n) continue;
        if (a.bitmap[static_cast<uint64_t>(s) >> 5] & (1u << (static_cast<uint64_t>(s) & 31)))
          atomicMin(&min_ovl, static_cast<unsigned long long>(s));
      }
      __syncthreads();
      for (uint32_t t = t0; t < t1; ++t) {
        const int64_t s = a.src[t], d = a.dst[t];
        if (s < 0 || s >= a.src_n || d < 0 || d >= a.dst_n) continue;
        atomicAnd(a.bitmap + (static_cast<uint64_t>(d) >> 5), ~(1u << (static_cast<uint64_t>(d) & 31)));
      }
    }
  }
  __syncthreads();
  if (threadIdx.x != 0) return;
  int64_t kind = 0, index = -1, value = 0, num = 0;
  if (bad_src != UINT_MAX) {
    kind = kSlotRange, index = bad_src, value = a.src[bad_src], num = a.src_n;
  } else if (bad_dst != UINT_MAX) {
    kind = kDstRange, index = bad_dst, value = a.dst[bad_dst], num = a.dst_n;
  } else if (min_dup != ULLONG_MAX) {
    kind = kSlotRepeat, value = static_cast<int64_t>(min_dup), num = a.dst_n;
  } else if (min_ovl != ULLONG_MAX) {
    kind = kOverlap, value = static_cast<int64_t>(min_ovl), num = a.dst_n;
  }
  *a.flag = static_cast<int>(kind);
  if (a.report != nullptr) {
    a.report[kMagic] = a.magic;
    a.report[kMode] = a.mode;
    a.report[kEpoch] = a.epoch;
    a.report[kTokens] = a.T;
    a.report[kVerdict] = kind;
    a.report[kIndex] = index;
    a.report[kValue] = value;
    a.report[kNumSlots] = num;
  }
  DeviceErrorRecord* rec = a.record;
  if (kind != 0 && rec != nullptr) {
    if (rec->seq == rec->ack) {
      rec->kind = kind;
      rec->index = index;
      rec->value = value;
      rec->num_slots = num;
      rec->call = a.call;
      rec->gather = a.op;
      rec->peer = a.peer;
      rec->detail = 0;
      rec->tokens = a.T;
      __threadfence_system();
      rec->seq = rec->seq + 1;
    } else {
      rec->dropped = rec->dropped + 1;
    }
    __threadfence_system();
  }
}

__device__ void put_record(DeviceErrorRecord* rec, const DeviceErrorRecord& r, int64_t call, int64_t op, int64_t peer) {
  if (rec == nullptr) return;
  if (rec->seq == rec->ack) {
    rec->kind = r.kind;
    rec->index = r.index;
    rec->value = r.value;
    rec->num_slots = r.num_slots;
    rec->detail = r.detail;
    rec->tokens = r.tokens;
    rec->call = call;
    rec->gather = op;
    rec->peer = peer;
    __threadfence_system();
    rec->seq = rec->seq + 1;
  } else {
    rec->dropped = rec->dropped + 1;
  }
  __threadfence_system();
}

__global__ void __launch_bounds__(1024) gate_kernel(const GateArgs a) {
  __shared__ int64_t verdict;
  if (threadIdx.x == 0) {
    const int64_t v = gate_verdict(a.drec, a.prefix, *a.own_flag, a.magic, a.epoch, a.tokens);
    verdict = v;
    *a.gate = static_cast<int>(v);
    if (v > 0) {
      DeviceErrorRecord r{};
      gate_record(r, v, a.drec, a.prefix, a.tokens);
      put_record(a.record, r, a.call, kOpRecv, a.peer);
    }
  }
  __syncthreads();
  const bool land = verdict == 0;
  for (uint32_t t = threadIdx.x; t < a.T; t += blockDim.x) a.eff[t] = (land && a.mask[t]) ? a.slots[t] : -1;
}

__global__ void verdict_kernel(const VerdictArgs a) {
  const int64_t v = sender_verdict(a.r0, a.v, a.magic, a.epoch, a.tokens);
  if (a.flag != nullptr) *a.flag = static_cast<int>(v);
  if (v != 0) {
    DeviceErrorRecord r{};
    verdict_record(r, v, a.r0, a.v, a.tokens);
    put_record(a.record, r, a.call, kOpSend, a.peer);
  }
}

const char* run_copy(const CudaCopy& a) {
  if (a.T == 0 || a.NL == 0) return nullptr;
  DeviceGuard guard;
  if (const char* e = guard.set(a.device)) return e;
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
  p.flag = a.validate ? a.flag : nullptr;
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

  cudaStream_t stream = static_cast<cudaStream_t>(a.stream);
  const bool pdl = a.validate && a.pdl && !g_pdl_failed;
  if (a.validate) {
    if (a.T > std::numeric_limits<uint32_t>::max()) return fail("at most 2^32 - 1 rows per call");
    CheckArgs c{};
    c.src = a.src_slots;
    c.src_n = a.src_num_slots;
    c.dst = a.dst_slots;
    c.dst_n = a.dst_num_slots;
    c.T = static_cast<uint32_t>(a.T);
    c.bitmap = a.bitmap;
    c.shared = a.shared;
    c.flag = a.flag;
    c.record = a.record;
    c.call = a.call;
    c.op = kOpCopy;
    c.pdl = pdl ? 1 : 0;
    const unsigned threads = static_cast<unsigned>(std::min<int64_t>(1024, std::max<int64_t>(32, (a.T + 31) / 32 * 32)));
    check_kernel<<<1, threads, 0, stream>>>(c);
    cudaError_t err = cudaGetLastError();
    if (err != cudaSuccess) return fail(std::string("check kernel launch failed: ") + cudaGetErrorString(err));
  }
  const void* fn = copy_fn(width, smode, dmode);
  // token chunks keep T * units_per_row within 32 bits
  const int64_t max_tokens = std::max<int64_t>(1, (int64_t{1} << 31) / max_upr);
  bool first = true;
  for (int64_t t0 = 0; t0 < a.T; t0 += max_tokens) {
    const int64_t tn = std::min(max_tokens, a.T - t0);
    Params q = p;
    q.src_slots = a.src_slots + t0;
    q.dst_slots = a.dst_slots + t0;
    q.T = static_cast<uint32_t>(tn);
    const int64_t per_block = int64_t{kThreads} * kUnroll;
    dim3 grid(static_cast<unsigned>((tn * max_upr + per_block - 1) / per_block), static_cast<unsigned>(a.P * a.NL));
    void* args[] = {&q};
    cudaError_t err = launch(fn, grid, dim3(kThreads), stream, pdl && first, args);
    if (err != cudaSuccess && pdl && first) {
      // no programmatic dependent launch here: plain stream order (still correct: the check
      // kernel has finished before the copy starts)
      (void)cudaGetLastError();
      g_pdl_failed = true;
      err = launch(fn, grid, dim3(kThreads), stream, false, args);
    }
    first = false;
    if (err != cudaSuccess) {
      (void)cudaGetLastError();
      return fail(std::string("kernel launch failed: ") + cudaGetErrorString(err));
    }
  }
  return nullptr;
}

}  // namespace

const char* cuda_copy(const CudaCopy& a) noexcept { return run_copy(a); }

const char* cuda_slots_check(const CheckArgs& a, void* stream) noexcept {
  const unsigned threads = static_cast<unsigned>(std::min<int64_t>(1024, std::max<int64_t>(32, (int64_t{a.T} + 31) / 32 * 32)));
  check_kernel<<<1, threads, 0, static_cast<cudaStream_t>(stream)>>>(a);
  cudaError_t err = cudaGetLastError();
  if (err != cudaSuccess) return fail(std::string("check kernel launch failed: ") + cudaGetErrorString(err));
  return nullptr;
}

const char* cuda_p2p_gate(const GateArgs& a, void* stream) noexcept {
  const unsigned threads = static_cast<unsigned>(std::min<int64_t>(1024, std::max<int64_t>(32, (int64_t{a.T} + 31) / 32 * 32)));
  gate_kernel<<<1, threads, 0, static_cast<cudaStream_t>(stream)>>>(a);
  cudaError_t err = cudaGetLastError();
  if (err != cudaSuccess) return fail(std::string("gate kernel launch failed: ") + cudaGetErrorString(err));
  return nullptr;
}

const char* cuda_p2p_verdict(const VerdictArgs& a, void* stream) noexcept {
  verdict_kernel<<<1, 1, 0, static_cast<cudaStream_t>(stream)>>>(a);
  cudaError_t err = cudaGetLastError();
  if (err != cudaSuccess) return fail(std::string("verdict kernel launch failed: ") + cudaGetErrorString(err));
  return nullptr;
}

}  // namespace copy
}  // namespace kvcore
