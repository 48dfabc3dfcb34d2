// kvcore layout-to-layout copy and point-to-point control: shared definitions of the C++ op
// (kvcore_copy.cpp) and its CUDA implementation (kvcore_copy.cu).
//
// A copy moves token rows from one paged cache to another, each described by its own
// stride table (bytes): per (layer, plane) a base address, per plane
//   block, token, head, chunk, chunk_bytes, n_chunks, token_group, token_group_stride
// so that the bytes of (slot, head, chunk) of one side live at
//   base + (slot / block_size) * block + token_offset(slot % block_size)
//        + head * head + chunk * chunk          ... chunk_bytes contiguous bytes
// with token_offset(t) = t * token, or, for tokens split in groups (token_group > 0),
//   (t / token_group) * token_group_stride + (t % token_group) * token.
// Both sides agree per plane on num_heads and head_bytes (= n_chunks * chunk_bytes on
// each side; the chunking may differ). Row i moves src_slots[i] -> dst_slots[i]; a row
// with a slot outside [0, num_slots) on either side (negative = padding) is skipped.
//
// Validation on the device (validate = 1): a one-block check kernel runs first on the same
// stream (programmatic dependent launch lets the copy's blocks load meanwhile); it checks
// both slot mappings (range; repeats of destination slots, through a bitmap it sets and
// clears; with shared memory, a slot read and written) and writes a verdict that the copy
// reads before its first store. The same check kernel validates the slots of
// kvcore.send (range, the padding mask) and kvcore.recv (range, repeats); the gate kernel
// decides on the receiver whether a chunk may land, the verdict kernel reports the
// receiver's answer on the sender (kvcore/distributed.py describes the protocol).
// Plain data only: the CUDA translation unit never sees an at::Tensor and never throws.
#pragma once
#include <cstdint>

#include "kvcore_ops.h"  // DeviceErrorRecord (the .cu unit defines KVCORE_NO_TORCH first)

namespace kvcore {
namespace copy {

constexpr int kGeomFields = 8;  // block, token, head, chunk, chunk_bytes, n_chunks, token_group, token_group_stride
constexpr int kMaxPlanes = 8;

struct Side {
  int64_t block;
  int64_t token;
  int64_t head;
  int64_t chunk;
  int64_t chunk_bytes;
  int64_t n_chunks;
  int64_t token_group;
  int64_t token_group_stride;
};

struct CudaCopy {
  const int64_t* src_ptrs;   // device-readable [NL, P] base addresses (device memory or mapped pinned host memory)
  const int64_t* dst_ptrs;   // device-readable [NL, P]
  const int64_t* src_slots;  // device [T]
  const int64_t* dst_slots;  // device [T]
  Side src[kMaxPlanes];
  Side dst[kMaxPlanes];
  int64_t num_heads[kMaxPlanes];
  int64_t head_bytes[kMaxPlanes];
  int64_t P, NL, T;
  int64_t src_block_size, dst_block_size, src_num_slots, dst_num_slots;
  int64_t base_align;  // a power of two dividing every base address of both sides
  int64_t src_host_probe, dst_host_probe;  // a base address of a side in pinned host memory (checked mapped), else 0
  int device;
  void* stream;  // cudaStream_t
  // device validation (validate = 1): the check kernel first, then the copy reads *flag before storing
  int validate;
  int* flag;                  // device int32
  uint32_t* bitmap;           // device, dst_num_slots bits, all zero between calls
  DeviceErrorRecord* record;  // mapped device address of the pinned record
  int64_t call;
  int shared;  // the two tables share memory: refuse a slot that is read and written
  bool pdl;
};

// Launches on a.stream. nullptr on success, else why (never throws).
const char* cuda_copy(const CudaCopy& a) noexcept;

// -- control records of kvcore.send / kvcore.recv ---------------------------------------------

// A control record: 8 int64 (64 bytes), the first bytes of every control message.
enum CtlField : int { kMagic = 0, kMode = 1, kEpoch = 2, kTokens = 3, kVerdict = 4, kIndex = 5, kValue = 6, kNumSlots = 7 };
constexpr int kCtlFields = 8;
constexpr int64_t kModeFast = 1;  // the side repeats the agreed transfer (no host reads)
constexpr int64_t kModeSlow = 2;  // the side changed (or refused): the other side reads the header on the host

// One slot check (one block on a GPU, a loop on the CPU): `src` range-checked against
// src_n (and its padding mask written), `dst` range-checked against dst_n and for repeats
// (bitmap, dst_n bits, zero on entry and on exit), and with `shared` a valid row whose source
// slot is a valid row's destination slot refused. The verdict (0 or a RefusalKind) goes to
// *flag, a control record to `report` (when given), a refusal to `record` (when given).
struct CheckArgs {
  const int64_t* src;  // nullptr: none
  int64_t src_n;
  const int64_t* dst;  // nullptr: none
  int64_t dst_n;
  uint32_t T;
  uint32_t* bitmap;  // nullptr: no repeat check
  int shared;
  int* flag;
  int64_t* report;  // nullptr, or a control record: magic, mode, epoch, T, verdict, index, value, num_slots
  int64_t magic, mode, epoch;
  uint8_t* mask;  // nullptr, or T bytes: src[t] >= 0
  DeviceErrorRecord* record;
  int64_t call, op, peer;
  int pdl;  // let the next kernel launch early (programmatic dependent launch)
};

// The receiver's gate for the chunks of one transfer: the sender's header record `drec`,
// the first chunk's prefix record (followed by the sender's padding mask, T bytes) and this
// side's own slot verdict decide; `eff` gets slots[t] where the row lands, else -1.
struct GateArgs {
  const int64_t* drec;
  const int64_t* prefix;
  const uint8_t* mask;
  const int* own_flag;
  int64_t magic, epoch, tokens;
  const int64_t* slots;
  int64_t* eff;
  uint32_t T;
  int* gate;
  DeviceErrorRecord* record;
  int64_t call, peer;
};

// The sender's reading of the receiver's answers: `r0` (sent before the chunks: the
// receiver's mode) and `v` (after them: its slot verdict).
struct VerdictArgs {
  const int64_t* r0;
  const int64_t* v;
  int64_t magic, epoch, tokens;
  int* flag;  // nullptr, or the verdict
  DeviceErrorRecord* record;
  int64_t call, peer;
};

// The decisions themselves, shared by the CPU code and the CUDA kernels (one thread).
#if defined(__CUDACC__)
#define KVCORE_HD __host__ __device__
#else
#define KVCORE_HD
#endif

// 0: land; else a RefusalKind (kGarbled, kSenderChanged, kSenderSlots) or -1 (this side's own refusal)
KVCORE_HD inline int64_t gate_verdict(const int64_t* d, const int64_t* p, int own, int64_t magic, int64_t epoch, int64_t tokens) {
  if (d[kMagic] != magic || p[kMagic] != magic) return kGarbled;
  if (d[kMode] != kModeFast || d[kEpoch] != epoch || d[kTokens] != tokens) return kSenderChanged;
  if (p[kVerdict] != 0) return kSenderSlots;
  return own ? -1 : 0;
}

// 0: the receiver took the transfer; else a RefusalKind (kGarbled, kPeerUnexpected, kPeerRefused)
KVCORE_HD inline int64_t sender_verdict(const int64_t* r0, const int64_t* v, int64_t magic, int64_t epoch, int64_t tokens) {
  if (r0[kMagic] != magic || v[kMagic] != magic) return kGarbled;
  if (r0[kMode] != kModeFast || r0[kEpoch] != epoch || r0[kTokens] != tokens) return kPeerUnexpected;
  if (v[kVerdict] != 0) return kPeerRefused;
  return 0;
}

// Fill a refusal record (host or device memory) for a gate / sender verdict.
KVCORE_HD inline void gate_record(DeviceErrorRecord& r, int64_t kind, const int64_t* d, const int64_t* p, int64_t tokens) {
  r.kind = kind;
  r.detail = (kind == kSenderChanged && d[kVerdict] != 0) ? 1 : 0;
  r.tokens = d[kTokens];
  r.index = kind == kSenderSlots ? p[kIndex] : -1;
  r.value = kind == kSenderSlots ? p[kValue] : tokens;
  r.num_slots = kind == kSenderSlots ? p[kNumSlots] : 0;
}
KVCORE_HD inline void verdict_record(DeviceErrorRecord& r, int64_t kind, const int64_t* r0, const int64_t* v, int64_t tokens) {
  r.kind = kind;
  r.detail = kind == kPeerRefused ? v[kVerdict] : 0;
  r.tokens = r0[kTokens];
  r.index = kind == kPeerRefused ? v[kIndex] : -1;
  r.value = kind == kPeerRefused ? v[kValue] : tokens;
  r.num_slots = kind == kPeerRefused ? v[kNumSlots] : 0;
}

// CUDA launches (on `stream`); nullptr on success, else why (never throw).
const char* cuda_slots_check(const CheckArgs& a, void* stream) noexcept;
const char* cuda_p2p_gate(const GateArgs& a, void* stream) noexcept;
const char* cuda_p2p_verdict(const VerdictArgs& a, void* stream) noexcept;

}  // namespace copy
}  // namespace kvcore

#ifndef KVCORE_NO_TORCH
#include <torch/extension.h>
namespace kvcore {
namespace copy {
// Registers the copy plan and the point-to-point control functions on the op module.
void bind(pybind11::module_& m);
}  // namespace copy
}  // namespace kvcore
#endif
