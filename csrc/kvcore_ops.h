// kvcore native transfer kernels: shared definitions (op ABI version 5).
//
// A kernel never sees a format name. It receives the layout's stride table as data:
//
//   ptrs    int64 [NL, P]   base address (bytes) of plane p of layer l
//   planes  int64 [P, 18]   one record per plane, fields below (bytes unless noted)
//   slots   int64 [T]       slot = block * block_size + offset; outside [0, num_slots)
//                           (negative = engine padding) the row is skipped
//   staging a list of B buffers; plane p writes (gather) / reads (scatter) buffer
//           planes[p][kBuffer], which is [kv_size, NL, T, row] when the plane has a
//           K/V index (planes[p][kKvIndex] >= 0: the classic "kv" buffer) and
//           [NL, T, row] otherwise; the last dim is contiguous.
//
// The bytes of (slot, head h, chunk c, sub-run s) of plane p in layer l start at
//   ptrs[l][p] + (slot / block_size) * block + token_offset(slot % block_size)
//              + h * head + c * chunk + s * sub               ... chunk_bytes bytes
//   token_offset(o) = o * token                                   (token_group == 0)
//                   = (o / token_group) * token_group_stride + (o % token_group) * token
// and n_chunks * n_sub * chunk_bytes = head_bytes is one head's bytes, staged in (chunk,
// sub-run) order. n_sub > 1 is a second strided level inside a chunk (vLLM CPU's AMX V tile:
// a token's 16 elements of a chunk two elements apart); n_sub == 1 (sub unused) is a chunk of
// one run, the common case. In the staged row of token t
// (buffer b, K/V index k, layer l) head h of the plane starts at byte
//   st_offset + h * st_head
// so several planes may share one staged row (a blocked-scale record: values at byte 0,
// scales after them) and planes of one head may interleave (st_head > head_bytes).
// base_align is a power of two dividing every ptrs[.][p] (0 or 1: unknown); the CUDA
// kernel picks each plane's vector width from it and the strides.
//
// The same record drives the CPU op, the CUDA op and (in Python) the torch reference
// kernel; other kernels of the family (a layout-to-layout copy, a Triton kernel) read the
// same fields.
#pragma once
#include <cstdint>

namespace kvcore {

enum PlaneField : int {
  kBlock = 0,
  kToken = 1,
  kHead = 2,
  kChunk = 3,
  kChunkBytes = 4,
  kNChunks = 5,
  kTokenGroup = 6,
  kTokenGroupStride = 7,
  kNumHeads = 8,
  kHeadBytes = 9,
  kBuffer = 10,
  kKvIndex = 11,
  kStOffset = 12,
  kStHead = 13,
  kBaseAlign = 14,
  kSub = 15,
  kNSub = 16,
  kReserved = 17,
};
constexpr int kPlaneFields = 18;

// One plane, decoded, with its staging addressing resolved for one call (bytes).
struct PlaneDesc {
  int64_t block, token, head, chunk, chunk_bytes, n_chunks, token_group, token_group_stride;
  int64_t num_heads, head_bytes;
  int64_t buffer, kv_index, st_offset, st_head, base_align;
  int64_t sub, n_sub;  // sub-runs of a chunk (n_sub == 1: a chunk is one run)
  // resolved per call: staging[t = 0] of layer 0 of this plane (offset included), and strides
  char* st_base;
  int64_t st_layer, st_tok;
  int64_t row_bytes() const { return num_heads * head_bytes; }
  // a whole token row, cache side and staging side, is one contiguous run
  bool row_contiguous() const {
    return n_chunks == 1 && n_sub == 1 && (num_heads == 1 || (head == head_bytes && st_head == head_bytes));
  }
  // a head's bytes are one run (no chunks, no sub-runs)
  bool head_contiguous() const { return n_chunks == 1 && n_sub == 1; }
  int64_t token_offset(int64_t o) const {
    return token_group ? (o / token_group) * token_group_stride + (o % token_group) * token : o * token;
  }
};

// Validation failures recorded by the CUDA check kernel (pinned host memory, written by the
// device only when a call is refused; read by the host at the next call or a synchronize).
struct DeviceErrorRecord {
  volatile int64_t seq;     // bumped (last) by the device for each recorded failure
  volatile int64_t ack;     // the host's copy of seq once it reported the failure
  volatile int64_t kind;    // 1: slot out of range, 2: a scatter slot repeats
  volatile int64_t index;   // first bad index (kind 1)
  volatile int64_t value;   // its slot (kind 1), the smallest repeated slot (kind 2)
  volatile int64_t num_slots;
  volatile int64_t call;    // the host's call number
  volatile int64_t gather;  // the refused operation: RecordOp (0 scatter, 1 gather, 2 copy, 3 send, 4 recv)
  volatile int64_t dropped; // failures not recorded because one was pending
  volatile int64_t peer;    // send / recv: the peer's rank
  volatile int64_t detail;  // send: the receiver's own refusal kind; recv: 1 when the sender refused its own arguments
  volatile int64_t tokens;  // send / recv: the peer's token count
};

// The operation a record describes (DeviceErrorRecord::gather).
enum RecordOp : int64_t { kOpScatter = 0, kOpGather = 1, kOpCopy = 2, kOpSend = 3, kOpRecv = 4 };

// Refusal kinds (DeviceErrorRecord::kind): 1 a (source) slot out of range, 2 a (destination)
// slot repeats, 3 a destination slot out of range, 4 a copy reads a slot it writes (shared
// memory), 5 the receiver refused (its kind in `detail`), 6 the receiver did not expect this
// transfer, 7 the sender's slots were refused, 8 the sender sent a changed transfer (or
// refused its own arguments), 9 a control message that is not kvcore's.
enum RefusalKind : int64_t {
  kSlotRange = 1,
  kSlotRepeat = 2,
  kDstRange = 3,
  kOverlap = 4,
  kPeerRefused = 5,
  kPeerUnexpected = 6,
  kSenderSlots = 7,
  kSenderChanged = 8,
  kGarbled = 9,
};

constexpr int kMaxPlanesPerLaunch = 8;

constexpr int kMaxPlanes = 64;  // planes per table (launched kMaxPlanesPerLaunch at a time)

// One CUDA transfer, fully validated by the caller (kvcore_cpu.cpp). Plain data only:
// the CUDA translation unit never sees an at::Tensor and never throws.
struct CudaTransfer {
  const int64_t* ptrs;   // device [NL, P] plane base addresses
  const int64_t* slots;  // device [T]
  int64_t P;
  PlaneDesc plane[kMaxPlanes];  // st_base: a device address (pinned host staging already mapped)
  int64_t num_slots, T, NL, block_size, skip;
  int64_t unroll;  // loads in flight per thread: 4 or 8
  int device;
  void* stream;    // cudaStream_t
  // device validation (validate != 0): the check kernel runs first and sets *flag
  int validate;              // 0 none, 1 device
  int* flag;                 // device int32: non-zero = refused, the transfer writes nothing
  uint32_t* bitmap;          // device, num_slots bits, all zero between calls (scatter only)
  DeviceErrorRecord* record; // pinned host record, its mapped device address
  int64_t call;
  int gated;                 // 1: no check kernel; `flag` (set by an earlier kernel on the stream) gates the stores
  bool pdl;                  // overlap the check with the transfer (programmatic dependent launch)
};

// Launches on a.stream. nullptr on success, else why (never throws).
const char* cuda_transfer(bool gather, const CudaTransfer& a) noexcept;
// Helpers kept in the CUDA unit (the C++ unit includes no CUDA runtime header):
// the mapped device address of pinned host memory, or nullptr when it is not pinned;
void* cuda_host_device_ptr(void* host) noexcept;
// the process's pinned error record (host address; *device gets its mapped device address),
// nullptr when it cannot be allocated;
DeviceErrorRecord* cuda_error_record(int device, DeviceErrorRecord** device_addr) noexcept;
// 1 when the stream is capturing a CUDA graph, 0 when not, -1 on error;
int cuda_stream_capturing(void* stream) noexcept;
// wait for the stream; nullptr or why not
const char* cuda_stream_sync(void* stream) noexcept;
// read one device int32 (synchronous); nullptr or why not
const char* cuda_read_flag(const int* flag, int* out) noexcept;

}  // namespace kvcore

#ifndef KVCORE_NO_TORCH
#include <ATen/ATen.h>
#include <torch/library.h>

#include <string>
#include <type_traits>
#include <vector>

namespace kvcore {

// Messages are built without iostreams: with torch 2.11+cu130 on the GPU machine, any
// std::ostream insertion compiled into this library (c10::str, TORCH_CHECK's message)
// crashed in libstdc++'s locale facets (seen under cuda-gdb: codecvt::do_unshift from
// basic_ostream::_M_insert<long>), so a failed check would kill the process.
static inline void cat_one(std::string& s, const char* v) { s += v; }
static inline void cat_one(std::string& s, const std::string& v) { s += v; }
static inline void cat_one(std::string& s, c10::IntArrayRef v) {
  s += "[";
  for (size_t i = 0; i < v.size(); ++i) {
    if (i) s += ", ";
    s += std::to_string(v[i]);
  }
  s += "]";
}
static inline void cat_one(std::string& s, c10::ScalarType v) { s += c10::toString(v); }
static inline void cat_one(std::string& s, const c10::Device& v) {
  s += c10::DeviceTypeName(v.type(), /*lower_case=*/true);
  if (v.has_index()) s += ":" + std::to_string(static_cast<int>(v.index()));
}
template <typename T, typename std::enable_if<std::is_integral<T>::value, int>::type = 0>
static inline void cat_one(std::string& s, T v) {
  s += std::to_string(v);
}
template <typename... A>
static inline std::string cat(const A&... a) {
  std::string s;
  (cat_one(s, a), ...);
  return s;
}

// The message of a refusal record (kvcore_cpu.cpp). `now`: the refusal of the call that is
// returning (CPU, or validate="sync"), else an earlier call's (surfaced later).
std::string describe_record(const DeviceErrorRecord& r, bool now = false);
// The pending device-side refusal of an earlier CUDA call, once ("" when none, or without CUDA).
std::string take_device_error();
// Whether CUDA launches may use programmatic dependent launch (KVCORE_CUDA_PDL).
bool pdl_enabled();
// Bytes per thread of a CPU transfer (KVCORE_CPU_GRAIN_BYTES): below it, one thread.
int64_t cpu_grain_bytes();

// The tensors a prepared plan addresses, as they were when the layout was detected, checked
// again before every call (kvcore_cpu.cpp). One row per tensor: its storage must be the same
// storage at the same address and size (snapshot columns 0, 1); with snapshot rows of
// 4 + 2 * D columns (storage_offset, ndim, sizes[D], strides[D]; ndim -1: not checked) its
// shape, strides and storage offset must be unchanged too. Python passes the tensors the
// planes address and, for a view, the tensor it views (the caller's own) with the view's
// storage snapshot: a caller's tensor re-pointed to other memory (set_) is refused although
// the view still holds the old memory (kvcore.kernels.guard_rows).
class TensorGuard {
 public:
  // "" or why the arguments are malformed; `who` prefixes messages ("kvcore.copy: ").
  std::string init(const std::vector<at::Tensor>& tensors, const std::vector<std::string>& labels, const at::Tensor& snapshot,
                   const std::string& who);
  // "" or why a call must be refused (names the tensor, then and now).
  std::string check() const;

 private:
  struct Row {
    at::Tensor tensor;
    c10::StorageImpl* impl;
    uintptr_t ptr;
    int64_t nbytes, offset, ndim;
    std::vector<int64_t> sizes, strides;
    std::string label;
  };
  std::vector<Row> rows_;
  std::string who_;
};

}  // namespace kvcore
#endif  // KVCORE_NO_TORCH
