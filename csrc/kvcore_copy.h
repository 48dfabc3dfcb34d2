// kvcore layout-to-layout copy: shared definitions of the C++ op (kvcore_copy.cpp) and
// its CUDA implementation (kvcore_copy.cu).
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
// Plain data only: the CUDA translation unit never sees an at::Tensor and never throws.
#pragma once
#include <cstdint>

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
};

// Launches on the current stream of a.device. nullptr on success, else why (never throws).
const char* cuda_copy(const CudaCopy& a) noexcept;

}  // namespace copy
}  // namespace kvcore
