// kvcore native transfer kernels: shared definitions.
//
// A kernel never sees a format name. It receives, per (layer, K/V) plane, a base
// address, and per K/V plane six int64 numbers (bytes unless noted):
//   block, token, head, chunk, chunk_bytes, n_chunks (count)
// so that the bytes of (slot, head, chunk) live at
//   base + (slot / block_size) * block + (slot % block_size) * token
//        + head * head + chunk * chunk      ... chunk_bytes contiguous bytes,
// and one head's staged row is n_chunks * chunk_bytes = head_bytes bytes.
// The staging buffer is [kv_size, NL, T, row_bytes / itemsize] with a contiguous
// last dim; row r = (kv, layer, token) starts at kv*s0 + layer*s1 + token*s2 bytes.
// Slots outside [0, num_slots) (negative = engine padding) are skipped.
#pragma once
#include <cstdint>

namespace kvcore {

constexpr int kStrideFields = 6;  // block, token, head, chunk, chunk_bytes, n_chunks

struct PlaneStrides {
  int64_t block;
  int64_t token;
  int64_t head;
  int64_t chunk;
  int64_t chunk_bytes;
  int64_t n_chunks;
};

// One CUDA transfer, fully validated by the caller (kvcore_cpu.cpp). Plain data only:
// the CUDA translation unit never sees an at::Tensor and never throws.
struct CudaTransfer {
  const int64_t* ptrs;   // device [NL, kv] plane base addresses
  const int64_t* slots;  // device [T]
  void* staging;         // staging[0, 0, 0, 0]: device memory, or pinned host memory
  bool staging_on_host;
  int64_t s_kv, s_layer, s_tok;  // staging byte strides
  PlaneStrides plane[2];
  int64_t num_slots, T, NL, kv, block_size, num_heads, head_bytes, base_align;
  int64_t unroll;  // loads in flight per thread: 4 or 8
  int device;
};

// Launches on the current stream of a.device. nullptr on success, else why (never throws).
const char* cuda_transfer(bool gather, const CudaTransfer& a) noexcept;

}  // namespace kvcore

#ifndef KVCORE_NO_TORCH
#include <torch/library.h>
#include <ATen/ATen.h>

#include <string>
#include <type_traits>

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

// The ops never throw: a failed check returns its message, the op returns a non-zero
// code and kvcore.last_error() gives the message to the Python layer.
#define KVCORE_REQUIRE(cond, ...) \
  if (!(cond)) return cat("kvcore.", op, ": ", __VA_ARGS__)

// Checks everything the op can check about its arguments before any byte moves; returns
// "" or what is wrong. (The plane base addresses are raw pointers: kvcore's Python layer
// proved them and the slot range against the cache's storage; the op skips slots outside
// [0, num_slots).)
static inline std::string check_args(const at::Tensor& ptrs, const at::Tensor& strides, const at::Tensor& slots,
                                     const at::Tensor& staging, int64_t block_size, int64_t num_heads, int64_t head_bytes,
                                     int64_t num_slots, const char* op) {
  KVCORE_REQUIRE(ptrs.defined() && strides.defined() && slots.defined() && staging.defined(), "every tensor argument is required");
  KVCORE_REQUIRE(ptrs.scalar_type() == at::kLong && ptrs.dim() == 2 && ptrs.is_contiguous(),
                 "ptrs must be a contiguous int64 [num_layers, kv_size] tensor of plane base addresses, got ", ptrs.scalar_type(),
                 " of shape ", ptrs.sizes());
  const int64_t nl = ptrs.size(0), kv = ptrs.size(1);
  KVCORE_REQUIRE(kv == 1 || kv == 2, "kv_size (ptrs.size(1)) must be 1 (MLA) or 2 (K, V), got ", kv);
  KVCORE_REQUIRE(strides.device().is_cpu() && strides.scalar_type() == at::kLong && strides.dim() == 2 && strides.size(0) == kv &&
                     strides.size(1) == kStrideFields && strides.is_contiguous(),
                 "strides must be a contiguous CPU int64 [kv_size, 6] tensor (block, token, head, chunk, chunk_bytes, n_chunks), got ",
                 strides.scalar_type(), " of shape ", strides.sizes(), " on ", strides.device());
  KVCORE_REQUIRE(slots.scalar_type() == at::kLong && slots.dim() == 1 && slots.is_contiguous(),
                 "slots must be a contiguous int64 [T] tensor, got ", slots.scalar_type(), " of shape ", slots.sizes());
  KVCORE_REQUIRE(staging.dim() == 4 && staging.size(0) == kv && staging.size(1) == nl && staging.size(2) == slots.size(0),
                 "staging must be [kv_size=", kv, ", num_layers=", nl, ", T=", slots.size(0), ", row], got ", staging.sizes());
  KVCORE_REQUIRE(staging.numel() == 0 || staging.stride(3) == 1, "the staging buffer's last dim must be contiguous, got strides ",
                 staging.strides());
  for (int d = 0; d < 3; ++d)
    KVCORE_REQUIRE(staging.stride(d) >= 0, "negative staging strides are not supported, got ", staging.strides());
  KVCORE_REQUIRE(block_size >= 1 && num_heads >= 1 && head_bytes >= 1 && num_slots >= 0,
                 "block_size, num_heads and head_bytes must be >= 1 and num_slots >= 0, got ", block_size, ", ", num_heads, ", ",
                 head_bytes, ", ", num_slots);
  KVCORE_REQUIRE(staging.size(3) * static_cast<int64_t>(staging.element_size()) == num_heads * head_bytes, "a staging row holds ",
                 staging.size(3) * staging.element_size(), " bytes but num_heads * head_bytes = ", num_heads * head_bytes);
  const int64_t* s = strides.data_ptr<int64_t>();
  for (int64_t k = 0; k < kv; ++k) {
    const int64_t* p = s + k * kStrideFields;
    for (int f = 0; f < kStrideFields; ++f) KVCORE_REQUIRE(p[f] >= 0, "plane ", k, " has a negative stride field ", f, " (", p[f], ")");
    KVCORE_REQUIRE(p[4] >= 1 && p[5] >= 1 && p[4] * p[5] == head_bytes, "plane ", k, " has chunk_bytes ", p[4], " x n_chunks ", p[5],
                   " != head_bytes ", head_bytes);
  }
  return std::string();
}

static inline PlaneStrides plane_at(const at::Tensor& strides, int64_t k) {
  const int64_t* p = strides.data_ptr<int64_t>() + k * kStrideFields;
  return PlaneStrides{p[0], p[1], p[2], p[3], p[4], p[5]};
}

// A whole token row of the plane is one contiguous run of num_heads * head_bytes bytes.
static inline bool row_contiguous(const PlaneStrides& p, int64_t num_heads, int64_t head_bytes) {
  return p.n_chunks == 1 && (num_heads == 1 || p.head == head_bytes);
}

}  // namespace kvcore
#endif  // KVCORE_NO_TORCH
