// kvcore layout-to-layout copy: op schema, argument checks and the CPU implementation.
//
// kvcore::copy_rows moves token rows from one paged cache to another, both given as
// stride tables (see kvcore_copy.h): one pass, no staging buffer. The CPU version walks
// rows (plane, layer, token) in parallel (at::parallel_for) and copies each run that is
// contiguous on both sides at once: a whole row when both sides keep a token's heads
// together (NHD -> NHD), one head's run when either side splits heads (NHD <-> HND), and
// the common divisor of the two sides' chunk lengths when a side splits heads in chunks.
// Bytes move unchanged, so every dtype (fp8, NaN payloads, -0) is bit-exact.
// The op never throws: it returns non-zero and kvcore::copy_last_error() says why.
#include "kvcore_copy.h"

#include <ATen/ATen.h>
#include <ATen/Parallel.h>
#include <torch/library.h>

#include <algorithm>
#include <cstring>
#include <numeric>
#include <string>
#include <vector>

namespace kvcore {
namespace copy {
namespace {

thread_local std::string g_last_error;

// Messages are built without iostreams (see kvcore_ops.h: ostream insertion crashed in
// libstdc++'s locale facets on the GPU machine's torch build).
inline void cat1(std::string& s, const char* v) { s += v; }
inline void cat1(std::string& s, const std::string& v) { s += v; }
inline void cat1(std::string& s, int64_t v) { s += std::to_string(v); }
inline void cat1(std::string& s, int v) { s += std::to_string(v); }
template <typename... A>
std::string cat(const A&... a) {
  std::string s;
  (cat1(s, a), ...);
  return s;
}

#define KVCORE_COPY_REQUIRE(cond, ...) \
  if (!(cond)) return cat("kvcore.copy_rows: ", __VA_ARGS__)

// Everything the op can check about its arguments before any byte moves; "" or why not.
// (The base addresses are raw pointers: kvcore's Python layer proved them, and the slot
// ranges, against the caches' storages; the op still skips slots outside [0, num_slots).)
std::string check_args(const at::Tensor& src_ptrs, const at::Tensor& src_geom, const at::Tensor& src_slots,
                       const at::Tensor& dst_ptrs, const at::Tensor& dst_geom, const at::Tensor& dst_slots,
                       const at::Tensor& plane_rows, int64_t src_block_size, int64_t src_num_slots, int64_t dst_block_size,
                       int64_t dst_num_slots) {
  KVCORE_COPY_REQUIRE(src_ptrs.defined() && src_geom.defined() && src_slots.defined() && dst_ptrs.defined() &&
                          dst_geom.defined() && dst_slots.defined() && plane_rows.defined(),
                      "every tensor argument is required");
  KVCORE_COPY_REQUIRE(src_ptrs.scalar_type() == at::kLong && src_ptrs.dim() == 2 && src_ptrs.is_contiguous() &&
                          dst_ptrs.scalar_type() == at::kLong && dst_ptrs.dim() == 2 && dst_ptrs.is_contiguous(),
                      "src_ptrs and dst_ptrs must be contiguous int64 [num_layers, num_planes] tensors");
  const int64_t nl = src_ptrs.size(0), np = src_ptrs.size(1);
  KVCORE_COPY_REQUIRE(dst_ptrs.size(0) == nl && dst_ptrs.size(1) == np, "src_ptrs is [", nl, ", ", np, "] but dst_ptrs is [",
                      dst_ptrs.size(0), ", ", dst_ptrs.size(1), "]: both sides move the same layers and planes");
  KVCORE_COPY_REQUIRE(np >= 1 && np <= kMaxPlanes, "between 1 and ", static_cast<int64_t>(kMaxPlanes), " planes, got ", np);
  for (const at::Tensor* g : {&src_geom, &dst_geom})
    KVCORE_COPY_REQUIRE(g->device().is_cpu() && g->scalar_type() == at::kLong && g->dim() == 2 && g->size(0) == np &&
                            g->size(1) == kGeomFields && g->is_contiguous(),
                        "src_geom and dst_geom must be contiguous CPU int64 [num_planes, 8] tensors (block, token, head, chunk, "
                        "chunk_bytes, n_chunks, token_group, token_group_stride)");
  KVCORE_COPY_REQUIRE(plane_rows.device().is_cpu() && plane_rows.scalar_type() == at::kLong && plane_rows.dim() == 2 &&
                          plane_rows.size(0) == np && plane_rows.size(1) == 2 && plane_rows.is_contiguous(),
                      "plane_rows must be a contiguous CPU int64 [num_planes, 2] tensor (num_heads, head_bytes)");
  KVCORE_COPY_REQUIRE(src_slots.scalar_type() == at::kLong && src_slots.dim() == 1 && src_slots.is_contiguous() &&
                          dst_slots.scalar_type() == at::kLong && dst_slots.dim() == 1 && dst_slots.is_contiguous(),
                      "src_slots and dst_slots must be contiguous int64 [T] tensors");
  KVCORE_COPY_REQUIRE(src_slots.size(0) == dst_slots.size(0), "src_slots has ", src_slots.size(0), " rows, dst_slots ",
                      dst_slots.size(0));
  KVCORE_COPY_REQUIRE(src_slots.device() == dst_slots.device() && src_ptrs.device() == src_slots.device() &&
                          dst_ptrs.device() == src_slots.device(),
                      "the pointer and slot tensors must be on one device (the device that runs the copy)");
  KVCORE_COPY_REQUIRE(src_block_size >= 1 && dst_block_size >= 1 && src_num_slots >= 0 && dst_num_slots >= 0,
                      "block sizes must be >= 1 and slot counts >= 0");
  const int64_t* rows = plane_rows.data_ptr<int64_t>();
  for (int64_t p = 0; p < np; ++p) {
    const int64_t nh = rows[2 * p], hb = rows[2 * p + 1];
    KVCORE_COPY_REQUIRE(nh >= 1 && hb >= 1, "plane ", p, ": num_heads and head_bytes must be >= 1, got ", nh, " and ", hb);
    for (const at::Tensor* g : {&src_geom, &dst_geom}) {
      const int64_t* f = g->data_ptr<int64_t>() + p * kGeomFields;
      for (int k = 0; k < kGeomFields; ++k) KVCORE_COPY_REQUIRE(f[k] >= 0, "plane ", p, " has a negative geometry field ", k);
      KVCORE_COPY_REQUIRE(f[4] >= 1 && f[5] >= 1 && f[4] * f[5] == hb, "plane ", p, ": chunk_bytes ", f[4], " x n_chunks ", f[5],
                          " != head_bytes ", hb);
    }
  }
  return std::string();
}

Side side_at(const at::Tensor& geom, int64_t p) {
  const int64_t* f = geom.data_ptr<int64_t>() + p * kGeomFields;
  return Side{f[0], f[1], f[2], f[3], f[4], f[5], f[6], f[7]};
}

inline int64_t token_offset(const Side& s, int64_t t) {
  return s.token_group ? (t / s.token_group) * s.token_group_stride + (t % s.token_group) * s.token : t * s.token;
}

// A run of bytes with plain 16-byte vector loads and stores (glibc's memcpy sends runs of
// a few KiB to `rep movsb`, which ran at about half the copy speed on the development
// machines; see kvcore_cpu.cpp). Short or odd runs go to memcpy.
inline void copy_run(char* __restrict dst, const char* __restrict src, int64_t n) {
  if (n < 64 || (n & 15) != 0) {
    std::memcpy(dst, src, static_cast<size_t>(n));
    return;
  }
  int64_t i = 0;
  for (; i + 64 <= n; i += 64) {
    char a[16], b[16], c[16], d[16];
    std::memcpy(a, src + i, 16);
    std::memcpy(b, src + i + 16, 16);
    std::memcpy(c, src + i + 32, 16);
    std::memcpy(d, src + i + 48, 16);
    std::memcpy(dst + i, a, 16);
    std::memcpy(dst + i + 16, b, 16);
    std::memcpy(dst + i + 32, c, 16);
    std::memcpy(dst + i + 48, d, 16);
  }
  for (; i < n; i += 16) std::memcpy(dst + i, src + i, 16);
}

enum Mode { kRow = 0, kHeads = 1, kChunks = 2 };

struct PlaneRun {
  Side s, d;
  int64_t nh, hb, row_bytes;
  int mode;
  int64_t seg;  // kChunks: bytes of a run contiguous on both sides
  int64_t s_run, d_run;
};

inline bool row_contig(const Side& s, int64_t nh, int64_t hb) { return s.n_chunks == 1 && (nh == 1 || s.head == hb); }

inline void copy_row(const PlaneRun& r, char* dst, const char* src) {
  if (r.mode == kRow) {
    copy_run(dst, src, r.row_bytes);
  } else if (r.mode == kHeads) {
    for (int64_t h = 0; h < r.nh; ++h) copy_run(dst + h * r.d.head, src + h * r.s.head, r.hb);
  } else {
    for (int64_t h = 0; h < r.nh; ++h) {
      const char* sh = src + h * r.s.head;
      char* dh = dst + h * r.d.head;
      for (int64_t x = 0; x < r.hb; x += r.seg) {
        const char* a = sh + (x / r.s_run) * r.s.chunk + x % r.s_run;
        char* b = dh + (x / r.d_run) * r.d.chunk + x % r.d_run;
        copy_run(b, a, r.seg);
      }
    }
  }
}

int64_t fail(std::string msg) {
  g_last_error = std::move(msg);
  return 1;
}

int64_t copy_cpu(const at::Tensor& src_ptrs, const at::Tensor& src_geom, const at::Tensor& src_slots, const at::Tensor& dst_ptrs,
                 const at::Tensor& dst_geom, const at::Tensor& dst_slots, const at::Tensor& plane_rows, int64_t src_block_size,
                 int64_t src_num_slots, int64_t dst_block_size, int64_t dst_num_slots, int64_t base_align, int64_t src_host_probe,
                 int64_t dst_host_probe) {
  (void)base_align;
  (void)src_host_probe;
  (void)dst_host_probe;
  std::string why = check_args(src_ptrs, src_geom, src_slots, dst_ptrs, dst_geom, dst_slots, plane_rows, src_block_size,
                               src_num_slots, dst_block_size, dst_num_slots);
  if (!why.empty()) return fail(why);
  if (!src_slots.device().is_cpu()) return fail("kvcore.copy_rows (CPU): the pointer and slot tensors must be CPU tensors");
  const int64_t nl = src_ptrs.size(0), np = src_ptrs.size(1), T = src_slots.size(0);
  if (T == 0 || nl == 0) return 0;
  const int64_t* sp = src_ptrs.data_ptr<int64_t>();
  const int64_t* dp = dst_ptrs.data_ptr<int64_t>();
  const int64_t* ss = src_slots.data_ptr<int64_t>();
  const int64_t* ds = dst_slots.data_ptr<int64_t>();
  const int64_t* rows = plane_rows.data_ptr<int64_t>();
  std::vector<PlaneRun> runs(static_cast<size_t>(np));
  int64_t max_row = 1;
  for (int64_t p = 0; p < np; ++p) {
    PlaneRun& r = runs[p];
    r.s = side_at(src_geom, p);
    r.d = side_at(dst_geom, p);
    r.nh = rows[2 * p];
    r.hb = rows[2 * p + 1];
    r.row_bytes = r.nh * r.hb;
    max_row = std::max(max_row, r.row_bytes);
    if (row_contig(r.s, r.nh, r.hb) && row_contig(r.d, r.nh, r.hb))
      r.mode = kRow;
    else if (r.s.n_chunks == 1 && r.d.n_chunks == 1)
      r.mode = kHeads;
    else
      r.mode = kChunks;
    r.s_run = r.s.n_chunks == 1 ? r.hb : r.s.chunk_bytes;
    r.d_run = r.d.n_chunks == 1 ? r.hb : r.d.chunk_bytes;
    r.seg = std::gcd(r.s_run, r.d_run);
  }
  // each slot split once per plane: byte offset of the token in its block on each side, -1 = skip
  std::vector<int64_t> soff(static_cast<size_t>(np * T)), doff(static_cast<size_t>(np * T));
  for (int64_t p = 0; p < np; ++p)
    for (int64_t t = 0; t < T; ++t) {
      const int64_t s = ss[t], d = ds[t];
      const bool ok = s >= 0 && s < src_num_slots && d >= 0 && d < dst_num_slots;
      soff[p * T + t] = ok ? (s / src_block_size) * runs[p].s.block + token_offset(runs[p].s, s % src_block_size) : -1;
      doff[p * T + t] = ok ? (d / dst_block_size) * runs[p].d.block + token_offset(runs[p].d, d % dst_block_size) : -1;
    }
  const int64_t per_plane = nl * T;
  const int64_t total = np * per_plane;
  // at least ~64 KiB of rows per thread: below that a thread costs more than it saves
  const int64_t grain = std::max<int64_t>(1, (64 << 10) / max_row);
  at::parallel_for(0, total, grain, [&](int64_t begin, int64_t end) {
    int64_t p = begin / per_plane, rem = begin % per_plane;
    int64_t l = rem / T, t = rem % T;
    for (int64_t i = begin; i < end; ++i) {
      const int64_t so = soff[p * T + t];
      if (so >= 0) {
        const char* src = reinterpret_cast<const char*>(sp[l * np + p]) + so;
        char* dst = reinterpret_cast<char*>(dp[l * np + p]) + doff[p * T + t];
        copy_row(runs[p], dst, src);
      }
      if (++t == T) {
        t = 0;
        if (++l == nl) {
          l = 0;
          ++p;
        }
      }
    }
  });
  return 0;
}

#ifdef KVCORE_WITH_CUDA
int64_t copy_cuda(const at::Tensor& src_ptrs, const at::Tensor& src_geom, const at::Tensor& src_slots, const at::Tensor& dst_ptrs,
                  const at::Tensor& dst_geom, const at::Tensor& dst_slots, const at::Tensor& plane_rows, int64_t src_block_size,
                  int64_t src_num_slots, int64_t dst_block_size, int64_t dst_num_slots, int64_t base_align, int64_t src_host_probe,
                  int64_t dst_host_probe) {
  std::string why = check_args(src_ptrs, src_geom, src_slots, dst_ptrs, dst_geom, dst_slots, plane_rows, src_block_size,
                               src_num_slots, dst_block_size, dst_num_slots);
  if (!why.empty()) return fail(why);
  if (!src_slots.is_cuda()) return fail("kvcore.copy_rows (CUDA): the pointer and slot tensors must be on the GPU that runs the copy");
  if (!(base_align >= 1 && base_align <= 16 && (base_align & (base_align - 1)) == 0))
    return fail(cat("kvcore.copy_rows (CUDA): base_align must be a power of two <= 16, got ", base_align));
  const int64_t nl = src_ptrs.size(0), np = src_ptrs.size(1);
  if (nl * np > 65535) return fail(cat("kvcore.copy_rows (CUDA): at most 65535 (layer, plane) pairs per launch, got ", nl * np));
  CudaCopy a{};
  a.src_ptrs = src_ptrs.data_ptr<int64_t>();
  a.dst_ptrs = dst_ptrs.data_ptr<int64_t>();
  a.src_slots = src_slots.data_ptr<int64_t>();
  a.dst_slots = dst_slots.data_ptr<int64_t>();
  const int64_t* rows = plane_rows.data_ptr<int64_t>();
  for (int64_t p = 0; p < np; ++p) {
    a.src[p] = side_at(src_geom, p);
    a.dst[p] = side_at(dst_geom, p);
    a.num_heads[p] = rows[2 * p];
    a.head_bytes[p] = rows[2 * p + 1];
  }
  a.P = np;
  a.NL = nl;
  a.T = src_slots.size(0);
  a.src_block_size = src_block_size;
  a.dst_block_size = dst_block_size;
  a.src_num_slots = src_num_slots;
  a.dst_num_slots = dst_num_slots;
  a.base_align = base_align;
  a.src_host_probe = src_host_probe;
  a.dst_host_probe = dst_host_probe;
  a.device = src_slots.device().index();
  const char* err = cuda_copy(a);
  if (err != nullptr) return fail(cat("kvcore.copy_rows (CUDA): ", err));
  return 0;
}
#endif  // KVCORE_WITH_CUDA

}  // namespace
}  // namespace copy
}  // namespace kvcore

TORCH_LIBRARY_FRAGMENT(kvcore, m) {
  m.def(
      "copy_rows(Tensor src_ptrs, Tensor src_geom, Tensor src_slots, Tensor dst_ptrs, Tensor dst_geom, Tensor dst_slots, "
      "Tensor plane_rows, int src_block_size, int src_num_slots, int dst_block_size, int dst_num_slots, int base_align, "
      "int src_host_probe, int dst_host_probe) -> int");
  // copy_rows returns 0, or non-zero with the reason here (the op never throws)
  m.def("copy_last_error() -> str", []() -> std::string { return kvcore::copy::g_last_error; });
  // bumped whenever copy_rows' schema or semantics change
  m.def("copy_abi_version() -> int", []() -> int64_t { return 1; });
}

TORCH_LIBRARY_IMPL(kvcore, CPU, m) { m.impl("copy_rows", &kvcore::copy::copy_cpu); }

#ifdef KVCORE_WITH_CUDA
TORCH_LIBRARY_IMPL(kvcore, CUDA, m) { m.impl("copy_rows", &kvcore::copy::copy_cuda); }
#endif
