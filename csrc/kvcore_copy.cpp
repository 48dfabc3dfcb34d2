// kvcore layout-to-layout copy: op schema, the prepared copy plan, the CPU implementation and
// the point-to-point control functions of kvcore.send / kvcore.recv.
//
// kvcore::copy_rows moves token rows from one paged cache to another, both given as
// stride tables (see kvcore_copy.h): one pass, no staging buffer. The CPU version walks
// rows (plane, layer, token) in parallel (at::parallel_for) and copies each run that is
// contiguous on both sides at once: a whole row when both sides keep a token's heads
// together (NHD -> NHD), one head's run when either side splits heads (NHD <-> HND), and
// the common divisor of the two sides' chunk lengths when a side splits heads in chunks.
// Bytes move unchanged, so every dtype (fp8, NaN payloads, -0) is bit-exact.
//
// CopyPlan (kvcore's direct entry, built once per pair of tables by kvcore.layout_copy)
// holds both tables, the caches' storages with their address and size at detection
// (re-checked on every call: a freed, reallocated or replaced storage refuses the call), and
// on a GPU the validation flags and the destination bitmap. run() checks the slot tensors,
// validates slot values (CPU: here; CUDA: on the device, see kvcore_copy.cu) and copies,
// without the dispatcher and with the GIL released.
// Nothing throws across the ABI: a refused call returns non-zero, the reason in
// copy_last_error() / last_error().
#include <ATen/ATen.h>
#include <ATen/Parallel.h>
#include <torch/extension.h>
#include <torch/library.h>

#include <algorithm>
#include <atomic>
#include <cstring>
#include <numeric>
#include <optional>
#include <string>
#include <vector>

#include "kvcore_ops.h"
#include "kvcore_copy.h"

#ifdef KVCORE_WITH_CUDA
#include <c10/cuda/CUDAStream.h>
#endif

namespace kvcore {
namespace copy {
namespace {

enum Code : int64_t { kOk = 0, kRefused = 1, kStale = 3, kPending = 4 };

thread_local std::string g_last_error;

int64_t fail(std::string msg, int64_t code = kRefused) {
  g_last_error = std::move(msg);
  return code;
}

#define KVCORE_COPY_REQUIRE(cond, ...) \
  if (!(cond)) return cat("kvcore.copy_rows: ", __VA_ARGS__)

// The tables' static arguments (pointer tables, geometry, plane rows, block sizes); "" or why not.
std::string check_tables(const at::Tensor& src_ptrs, const at::Tensor& src_geom, const at::Tensor& dst_ptrs, const at::Tensor& dst_geom,
                         const at::Tensor& plane_rows, int64_t src_block_size, int64_t src_num_slots, int64_t dst_block_size,
                         int64_t dst_num_slots) {
  KVCORE_COPY_REQUIRE(src_ptrs.defined() && src_geom.defined() && dst_ptrs.defined() && dst_geom.defined() && plane_rows.defined(),
                      "every tensor argument is required");
  KVCORE_COPY_REQUIRE(src_ptrs.scalar_type() == at::kLong && src_ptrs.dim() == 2 && src_ptrs.is_contiguous() &&
                          dst_ptrs.scalar_type() == at::kLong && dst_ptrs.dim() == 2 && dst_ptrs.is_contiguous(),
                      "src_ptrs and dst_ptrs must be contiguous int64 [num_layers, num_planes] tensors");
  const int64_t nl = src_ptrs.size(0), np = src_ptrs.size(1);
  KVCORE_COPY_REQUIRE(dst_ptrs.size(0) == nl && dst_ptrs.size(1) == np, "src_ptrs is [", nl, ", ", np, "] but dst_ptrs is [",
                      dst_ptrs.size(0), ", ", dst_ptrs.size(1), "]: both sides move the same layers and planes");
  KVCORE_COPY_REQUIRE(src_ptrs.device() == dst_ptrs.device(), "src_ptrs and dst_ptrs must be on one device");
  KVCORE_COPY_REQUIRE(np >= 1 && np <= kMaxPlanes, "between 1 and ", static_cast<int64_t>(kMaxPlanes), " planes, got ", np);
  for (const at::Tensor* g : {&src_geom, &dst_geom})
    KVCORE_COPY_REQUIRE(g->device().is_cpu() && g->scalar_type() == at::kLong && g->dim() == 2 && g->size(0) == np &&
                            g->size(1) == kGeomFields && g->is_contiguous(),
                        "src_geom and dst_geom must be contiguous CPU int64 [num_planes, 8] tensors (block, token, head, chunk, "
                        "chunk_bytes, n_chunks, token_group, token_group_stride)");
  KVCORE_COPY_REQUIRE(plane_rows.device().is_cpu() && plane_rows.scalar_type() == at::kLong && plane_rows.dim() == 2 &&
                          plane_rows.size(0) == np && plane_rows.size(1) == 2 && plane_rows.is_contiguous(),
                      "plane_rows must be a contiguous CPU int64 [num_planes, 2] tensor (num_heads, head_bytes)");
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

std::string check_slot_tensors(const at::Tensor& src_slots, const at::Tensor& dst_slots, const c10::Device& dev) {
  KVCORE_COPY_REQUIRE(src_slots.defined() && dst_slots.defined() && src_slots.scalar_type() == at::kLong && src_slots.dim() == 1 &&
                          src_slots.is_contiguous() && dst_slots.scalar_type() == at::kLong && dst_slots.dim() == 1 &&
                          dst_slots.is_contiguous(),
                      "src_slots and dst_slots must be contiguous int64 [T] tensors");
  KVCORE_COPY_REQUIRE(src_slots.size(0) == dst_slots.size(0), "src_slots has ", src_slots.size(0), " rows, dst_slots ",
                      dst_slots.size(0));
  KVCORE_COPY_REQUIRE(src_slots.device() == dev && dst_slots.device() == dev, "the slot tensors must be on ", dev,
                      " (the device that runs the copy), got ", src_slots.device(), " and ", dst_slots.device());
  KVCORE_COPY_REQUIRE(src_slots.size(0) <= std::numeric_limits<int32_t>::max(), "at most 2^31 - 1 rows per call");
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

// The CPU copy of validated arguments.
void copy_cpu_rows(const int64_t* sp, const int64_t* dp, const at::Tensor& src_geom, const at::Tensor& dst_geom, const int64_t* rows,
                   int64_t nl, int64_t np, const int64_t* ss, const int64_t* ds, int64_t T, int64_t src_block_size, int64_t src_num_slots,
                   int64_t dst_block_size, int64_t dst_num_slots) {
  if (T == 0 || nl == 0) return;
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
  // the transfers' byte grain per thread (kvcore_cpu.cpp, set_cpu_grain): on a busy host,
  // waking a pool thread costs more than moving a few MB
  const int64_t grain = std::max<int64_t>(1, cpu_grain_bytes() / max_row);
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
}

// -- the slot check on the host (the CUDA check kernel's twin) ---------------------------------

struct HostVerdict {
  int64_t kind = 0, index = -1, value = 0, num_slots = 0;
};

HostVerdict host_check(const int64_t* src, int64_t src_n, const int64_t* dst, int64_t dst_n, int64_t T, bool repeats, bool shared,
                       uint8_t* mask) {
  HostVerdict v;
  if (src != nullptr) {
    for (int64_t t = 0; t < T; ++t) {
      if (mask != nullptr) mask[t] = src[t] >= 0 ? 1 : 0;
      if (v.kind == 0 && src[t] >= src_n) v = HostVerdict{kSlotRange, t, src[t], src_n};
    }
    if (v.kind) return v;
  }
  if (dst == nullptr) return v;
  for (int64_t t = 0; t < T; ++t)
    if (dst[t] >= dst_n) return HostVerdict{kDstRange, t, dst[t], dst_n};
  if (repeats && T > 1) {
    std::vector<int64_t> d;
    d.reserve(static_cast<size_t>(T));
    for (int64_t t = 0; t < T; ++t)
      if (dst[t] >= 0) d.push_back(dst[t]);
    std::sort(d.begin(), d.end());
    for (size_t i = 1; i < d.size(); ++i)
      if (d[i] == d[i - 1]) return HostVerdict{kSlotRepeat, -1, d[i], dst_n};
  }
  if (shared && src != nullptr) {
    std::vector<int64_t> d;
    for (int64_t t = 0; t < T; ++t)
      if (src[t] >= 0 && dst[t] >= 0) d.push_back(dst[t]);
    std::sort(d.begin(), d.end());
    for (int64_t t = 0; t < T; ++t)
      if (src[t] >= 0 && dst[t] >= 0 && std::binary_search(d.begin(), d.end(), src[t])) return HostVerdict{kOverlap, t, src[t], dst_n};
  }
  return v;
}

std::string host_message(int64_t op, int64_t kind, const HostVerdict& v, int64_t peer) {
  DeviceErrorRecord r{};
  r.kind = kind;
  r.index = v.index;
  r.value = v.value;
  r.num_slots = v.num_slots;
  r.gather = op;
  r.peer = peer;
  return describe_record(r, true);
}

// -- the prepared copy plan --------------------------------------------------------------------

class CopyPlan {
 public:
  CopyPlan(const at::Tensor& src_ptrs, const at::Tensor& src_geom, const at::Tensor& dst_ptrs, const at::Tensor& dst_geom,
           const at::Tensor& plane_rows, int64_t src_block_size, int64_t src_num_slots, int64_t dst_block_size, int64_t dst_num_slots,
           int64_t base_align, int64_t src_probe, int64_t dst_probe, bool shared, const std::vector<at::Tensor>& storages,
           const std::vector<std::string>& labels, const at::Tensor& snapshot, const at::Tensor& device_probe)
      : src_bs_(src_block_size),
        src_n_(src_num_slots),
        dst_bs_(dst_block_size),
        dst_n_(dst_num_slots),
        align_(base_align),
        src_probe_(src_probe),
        dst_probe_(dst_probe),
        shared_(shared),
        device_(c10::kCPU) {
    try {
      error_ = init(src_ptrs, src_geom, dst_ptrs, dst_geom, plane_rows, storages, labels, snapshot, device_probe);
    } catch (const std::exception& e) {
      error_ = cat("kvcore.copy: preparing the copy plan failed: ", e.what());
    }
  }

  bool ok() const { return error_.empty(); }
  std::string error() const { return error_; }

  // 0 ok; 1 refused (the reason in last_error); 3 a storage changed; 4 an earlier CUDA call's
  // device refusal (reported now; this call did nothing).
  int64_t run(const at::Tensor& ss, const at::Tensor& ds, int64_t validate) {
    try {
      return run_impl(ss, ds, validate);
    } catch (const std::exception& e) {
      return fail(cat("kvcore.copy: ", e.what()));
    }
  }

 private:
  std::string init(const at::Tensor& src_ptrs, const at::Tensor& src_geom, const at::Tensor& dst_ptrs, const at::Tensor& dst_geom,
                   const at::Tensor& plane_rows, const std::vector<at::Tensor>& storages, const std::vector<std::string>& labels,
                   const at::Tensor& snapshot, const at::Tensor& device_probe) {
    if (!src_ptrs.defined() || !src_ptrs.device().is_cpu() || !dst_ptrs.defined() || !dst_ptrs.device().is_cpu())
      return "kvcore.copy: the pointer tables must be CPU tensors";
    std::string e = check_tables(src_ptrs, src_geom, dst_ptrs, dst_geom, plane_rows, src_bs_, src_n_, dst_bs_, dst_n_);
    if (!e.empty()) return e;
    if (!(align_ >= 1 && align_ <= 16 && (align_ & (align_ - 1)) == 0)) return cat("kvcore.copy: base_align must be a power of two <= 16");
    e = guard_.init(storages, labels, snapshot, "kvcore.copy: ");
    if (!e.empty()) return e;
    src_geom_ = src_geom.clone();
    dst_geom_ = dst_geom.clone();
    rows_ = plane_rows.clone();
    NL_ = src_ptrs.size(0);
    P_ = src_ptrs.size(1);
    device_ = device_probe.device();
    if (device_.is_cpu()) {
      src_ptrs_ = src_ptrs.clone();
      dst_ptrs_ = dst_ptrs.clone();
      return std::string();
    }
#ifdef KVCORE_WITH_CUDA
    if (!device_.is_cuda()) return cat("kvcore.copy: the native copy serves CPU and CUDA, not ", device_);
    if (NL_ * P_ > 65535) return cat("kvcore.copy (CUDA): at most 65535 (layer, plane) pairs per launch, got ", NL_ * P_);
    src_ptrs_ = src_ptrs.to(device_);
    dst_ptrs_ = dst_ptrs.to(device_);
    if (cuda_error_record(device_.index(), &dev_rec_) == nullptr || dev_rec_ == nullptr)
      return "kvcore.copy (CUDA): could not allocate the pinned error record for device validation";
    flags_ = at::zeros({128}, at::TensorOptions().dtype(at::kInt).device(device_));
    bitmap_ = at::zeros({std::max<int64_t>(1, (dst_n_ + 31) / 32)}, at::TensorOptions().dtype(at::kInt).device(device_));
    return std::string();
#else
    return cat("kvcore.copy: this build of the op library has no CUDA implementation (copy on ", device_, ")");
#endif
  }

  int64_t run_impl(const at::Tensor& ss, const at::Tensor& ds, int64_t validate) {
    if (!error_.empty()) return fail(error_);
#ifdef KVCORE_WITH_CUDA
    if (device_.is_cuda()) {
      std::string pending = take_device_error();
      if (!pending.empty()) return fail(pending, kPending);
    }
#endif
    std::string e = guard_.check();
    if (!e.empty()) return fail(e, kStale);
    e = check_slot_tensors(ss, ds, device_);
    if (!e.empty()) return fail(e);
    const int64_t T = ss.size(0);
    if (T == 0) return kOk;
    if (device_.is_cpu()) {
      const int64_t* s = ss.data_ptr<int64_t>();
      const int64_t* d = ds.data_ptr<int64_t>();
      // on the CPU the slots are always checked (validate only chooses how a GPU checks them)
      HostVerdict v = host_check(s, src_n_, d, dst_n_, T, true, shared_, nullptr);
      if (v.kind) return fail(host_message(kOpCopy, v.kind, v, 0));
      copy_cpu_rows(src_ptrs_.data_ptr<int64_t>(), dst_ptrs_.data_ptr<int64_t>(), src_geom_, dst_geom_, rows_.data_ptr<int64_t>(), NL_, P_,
                    s, d, T, src_bs_, src_n_, dst_bs_, dst_n_);
      return kOk;
    }
#ifdef KVCORE_WITH_CUDA
    void* stream = c10::cuda::getCurrentCUDAStream(device_.index()).stream();
    int* flag = nullptr;
    int64_t call = 0;
    if (validate) {
      const int capturing = cuda_stream_capturing(stream);
      if (capturing < 0) return fail("kvcore.copy (CUDA): cudaStreamIsCapturing failed");
      if (capturing && validate == 2)
        return fail("kvcore.copy: validate='sync' waits for the GPU and cannot be captured in a CUDA graph; use 'device' or 'none'");
      call = ++calls_;
      const int64_t idx = capturing ? 64 + (captures_++ % 64) : (call % 64);
      flag = flags_.data_ptr<int>() + idx;
    }
    CudaCopy a{};
    a.src_ptrs = src_ptrs_.data_ptr<int64_t>();
    a.dst_ptrs = dst_ptrs_.data_ptr<int64_t>();
    a.src_slots = ss.data_ptr<int64_t>();
    a.dst_slots = ds.data_ptr<int64_t>();
    const int64_t* r = rows_.data_ptr<int64_t>();
    for (int64_t p = 0; p < P_; ++p) {
      a.src[p] = side_at(src_geom_, p);
      a.dst[p] = side_at(dst_geom_, p);
      a.num_heads[p] = r[2 * p];
      a.head_bytes[p] = r[2 * p + 1];
    }
    a.P = P_;
    a.NL = NL_;
    a.T = T;
    a.src_block_size = src_bs_;
    a.dst_block_size = dst_bs_;
    a.src_num_slots = src_n_;
    a.dst_num_slots = dst_n_;
    a.base_align = align_;
    a.src_host_probe = src_probe_;
    a.dst_host_probe = dst_probe_;
    a.device = device_.index();
    a.stream = stream;
    a.validate = validate ? 1 : 0;
    a.flag = flag;
    a.bitmap = reinterpret_cast<uint32_t*>(bitmap_.data_ptr<int>());
    a.record = dev_rec_;
    a.call = call;
    a.shared = shared_ ? 1 : 0;
    a.pdl = pdl_enabled();
    const char* err = cuda_copy(a);
    if (err != nullptr) return fail(cat("kvcore.copy (CUDA): ", err));
    if (validate == 2) {
      err = cuda_stream_sync(stream);
      if (err != nullptr) return fail(cat("kvcore.copy (CUDA): ", err));
      int verdict = 0;
      err = cuda_read_flag(flag, &verdict);
      if (err != nullptr) return fail(cat("kvcore.copy (CUDA): ", err));
      if (verdict != 0) {
        std::string msg = take_device_error();
        const std::string prefix = "an earlier ";
        if (msg.rfind(prefix, 0) == 0) msg = "this " + msg.substr(prefix.size());
        return fail(msg.empty() ? std::string("kvcore.copy: refused on the device (a slot out of range or repeated); nothing was written")
                                : msg);
      }
    }
    return kOk;
#else
    return fail("kvcore.copy: this build of the op library has no CUDA implementation");
#endif
  }

  int64_t src_bs_, src_n_, dst_bs_, dst_n_, align_, src_probe_, dst_probe_;
  bool shared_;
  c10::Device device_;
  int64_t NL_ = 0, P_ = 0;
  std::string error_;
  at::Tensor src_ptrs_, dst_ptrs_, src_geom_, dst_geom_, rows_, flags_, bitmap_;
  TensorGuard guard_;
  DeviceErrorRecord* dev_rec_ = nullptr;
  std::atomic<int64_t> calls_{0}, captures_{0};
};

// -- the raw op (torch.ops.kvcore.copy_rows: no storage check, no slot validation) -------------

int64_t copy_rows_impl(const at::Tensor& src_ptrs, const at::Tensor& src_geom, const at::Tensor& src_slots, const at::Tensor& dst_ptrs,
                       const at::Tensor& dst_geom, const at::Tensor& dst_slots, const at::Tensor& plane_rows, int64_t src_block_size,
                       int64_t src_num_slots, int64_t dst_block_size, int64_t dst_num_slots, int64_t base_align, int64_t src_host_probe,
                       int64_t dst_host_probe) {
  std::string why =
      check_tables(src_ptrs, src_geom, dst_ptrs, dst_geom, plane_rows, src_block_size, src_num_slots, dst_block_size, dst_num_slots);
  if (why.empty()) why = check_slot_tensors(src_slots, dst_slots, src_ptrs.device());
  if (!why.empty()) return fail(why);
  const int64_t nl = src_ptrs.size(0), np = src_ptrs.size(1), T = src_slots.size(0);
  if (src_slots.device().is_cpu()) {
    copy_cpu_rows(src_ptrs.data_ptr<int64_t>(), dst_ptrs.data_ptr<int64_t>(), src_geom, dst_geom, plane_rows.data_ptr<int64_t>(), nl, np,
                  src_slots.data_ptr<int64_t>(), dst_slots.data_ptr<int64_t>(), T, src_block_size, src_num_slots, dst_block_size,
                  dst_num_slots);
    return 0;
  }
#ifdef KVCORE_WITH_CUDA
  if (!(base_align >= 1 && base_align <= 16 && (base_align & (base_align - 1)) == 0))
    return fail(cat("kvcore.copy_rows (CUDA): base_align must be a power of two <= 16, got ", base_align));
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
  a.T = T;
  a.src_block_size = src_block_size;
  a.dst_block_size = dst_block_size;
  a.src_num_slots = src_num_slots;
  a.dst_num_slots = dst_num_slots;
  a.base_align = base_align;
  a.src_host_probe = src_host_probe;
  a.dst_host_probe = dst_host_probe;
  a.device = src_slots.device().index();
  a.stream = c10::cuda::getCurrentCUDAStream(src_slots.device().index()).stream();
  const char* err = cuda_copy(a);
  if (err != nullptr) return fail(cat("kvcore.copy_rows (CUDA): ", err));
  return 0;
#else
  (void)base_align, (void)src_host_probe, (void)dst_host_probe;
  return fail("kvcore.copy_rows: this build of the op library has no CUDA implementation");
#endif
}

// -- point-to-point control -------------------------------------------------------------------

const int64_t* ctl_ptr(const at::Tensor& t) { return reinterpret_cast<const int64_t*>(t.data_ptr()); }

bool ctl_ok(const at::Tensor& t, const c10::Device& dev, int64_t bytes = kCtlFields * 8) {
  return t.defined() && t.device() == dev && t.is_contiguous() && t.numel() * static_cast<int64_t>(t.element_size()) >= bytes &&
         reinterpret_cast<uintptr_t>(t.data_ptr()) % 8 == 0;
}

bool flag_ok(const at::Tensor& t, const c10::Device& dev) {
  return t.defined() && t.device() == dev && t.scalar_type() == at::kInt && t.numel() >= 1;
}

bool slots_ok(const at::Tensor& t, const c10::Device& dev) {
  return t.defined() && t.device() == dev && t.scalar_type() == at::kLong && t.dim() == 1 && t.is_contiguous() &&
         t.size(0) <= std::numeric_limits<int32_t>::max();
}

#ifdef KVCORE_WITH_CUDA
// The pinned error record's mapped device address, looked up once per device.
DeviceErrorRecord* device_record(const c10::Device& dev) {
  static std::atomic<DeviceErrorRecord*> cache[64] = {};
  const int i = dev.index();
  if (i >= 0 && i < 64) {
    DeviceErrorRecord* d = cache[i].load(std::memory_order_relaxed);
    if (d != nullptr) return d;
  }
  DeviceErrorRecord* d = nullptr;
  if (cuda_error_record(i, &d) == nullptr) return nullptr;
  if (i >= 0 && i < 64) cache[i].store(d, std::memory_order_relaxed);
  return d;
}
#endif

// A slot check of kvcore.send (src: its slots, with the padding mask) or kvcore.recv (dst:
// its slots, with repeats). CPU: the verdict now (0, or a RefusalKind with the message in
// last_error); CUDA: 0 once the check kernel is launched on the current stream (a refusal is
// recorded on the device); -1: bad arguments (last_error).
int64_t p2p_check(const std::optional<at::Tensor>& src, int64_t src_n, const std::optional<at::Tensor>& dst, int64_t dst_n,
                  const std::optional<at::Tensor>& bitmap, const at::Tensor& flag, const std::optional<at::Tensor>& report, int64_t magic,
                  int64_t mode, int64_t epoch, const std::optional<at::Tensor>& mask, int64_t op, int64_t call, int64_t peer) {
  try {
    const at::Tensor& any = src ? *src : *dst;
    if (!src && !dst) return fail("kvcore p2p_check: src or dst slots are required", -1);
    const c10::Device dev = any.device();
    const int64_t T = any.size(0);
    if ((src && !slots_ok(*src, dev)) || (dst && !slots_ok(*dst, dev)) || (src && dst && src->size(0) != dst->size(0)) ||
        !flag_ok(flag, dev) || (report && !ctl_ok(*report, dev)) ||
        (mask && (!mask->is_contiguous() || mask->device() != dev || mask->numel() * mask->element_size() < T)) ||
        (bitmap && !dev.is_cpu() &&
         (!bitmap->is_contiguous() || bitmap->device() != dev || bitmap->scalar_type() != at::kInt || bitmap->numel() < (dst_n + 31) / 32)))
      return fail("kvcore p2p_check: bad arguments (slots, flag, report, mask or bitmap)", -1);
    if (dev.is_cpu()) {
      HostVerdict v = host_check(src ? src->data_ptr<int64_t>() : nullptr, src_n, dst ? dst->data_ptr<int64_t>() : nullptr, dst_n, T,
                                 bitmap.has_value(), false, mask ? static_cast<uint8_t*>(mask->data_ptr()) : nullptr);
      *flag.data_ptr<int>() = static_cast<int>(v.kind);
      if (report) {
        int64_t* r = reinterpret_cast<int64_t*>(report->data_ptr());
        const int64_t f[kCtlFields] = {magic, mode, epoch, T, v.kind, v.index, v.value, v.num_slots};
        std::memcpy(r, f, sizeof(f));
      }
      if (v.kind) g_last_error = host_message(op, v.kind, v, peer);
      return v.kind;
    }
#ifdef KVCORE_WITH_CUDA
    CheckArgs a{};
    a.src = src ? src->data_ptr<int64_t>() : nullptr;
    a.src_n = src_n;
    a.dst = dst ? dst->data_ptr<int64_t>() : nullptr;
    a.dst_n = dst_n;
    a.T = static_cast<uint32_t>(T);
    a.bitmap = bitmap ? reinterpret_cast<uint32_t*>(bitmap->data_ptr<int>()) : nullptr;
    a.flag = flag.data_ptr<int>();
    a.report = report ? reinterpret_cast<int64_t*>(report->data_ptr()) : nullptr;
    a.magic = magic;
    a.mode = mode;
    a.epoch = epoch;
    a.mask = mask ? static_cast<uint8_t*>(mask->data_ptr()) : nullptr;
    a.record = device_record(dev);
    a.call = call;
    a.op = op;
    a.peer = peer;
    if (T == 0) {
      // nothing to check: the flag and the report still say so (an empty kernel would do the same)
      a.T = 0;
    }
    const char* err = cuda_slots_check(a, c10::cuda::getCurrentCUDAStream(dev.index()).stream());
    if (err != nullptr) return fail(cat("kvcore p2p_check (CUDA): ", err), -1);
    return 0;
#else
    return fail("kvcore p2p_check: this build of the op library has no CUDA implementation", -1);
#endif
  } catch (const std::exception& e) {
    return fail(cat("kvcore p2p_check: ", e.what()), -1);
  }
}

constexpr int64_t kOwnRefusal = 100;

// The receiver's gate for a transfer's chunks (see GateArgs). CPU: 0 land, a RefusalKind
// (message in last_error), kOwnRefusal (this side's slots were refused: its own check said
// why); CUDA: 0 once launched; -1: bad arguments.
int64_t p2p_gate(const at::Tensor& drec, const at::Tensor& prefix, const at::Tensor& own_flag, int64_t magic, int64_t epoch, int64_t tokens,
                 const at::Tensor& slots, const at::Tensor& eff, const at::Tensor& gate, int64_t call, int64_t peer) {
  try {
    const c10::Device dev = slots.device();
    const int64_t T = slots.size(0);
    if (!slots_ok(slots, dev) || !slots_ok(eff, dev) || eff.size(0) != T || !ctl_ok(drec, dev) || !ctl_ok(prefix, dev, kCtlFields * 8 + T) ||
        !flag_ok(own_flag, dev) || !flag_ok(gate, dev) || T != tokens)
      return fail("kvcore p2p_gate: bad arguments", -1);
    const uint8_t* mask = static_cast<const uint8_t*>(prefix.data_ptr()) + kCtlFields * 8;
    if (dev.is_cpu()) {
      const int64_t* d = ctl_ptr(drec);
      const int64_t* p = ctl_ptr(prefix);
      const int64_t v = gate_verdict(d, p, *own_flag.data_ptr<int>(), magic, epoch, tokens);
      *gate.data_ptr<int>() = static_cast<int>(v);
      const int64_t* s = slots.data_ptr<int64_t>();
      int64_t* e = eff.data_ptr<int64_t>();
      for (int64_t t = 0; t < T; ++t) e[t] = (v == 0 && mask[t]) ? s[t] : -1;
      if (v > 0) {
        DeviceErrorRecord r{};
        gate_record(r, v, d, p, tokens);
        r.gather = kOpRecv;
        r.peer = peer;
        g_last_error = describe_record(r, true);
        return v;
      }
      return v < 0 ? kOwnRefusal : 0;
    }
#ifdef KVCORE_WITH_CUDA
    GateArgs a{};
    a.drec = ctl_ptr(drec);
    a.prefix = ctl_ptr(prefix);
    a.mask = mask;
    a.own_flag = own_flag.data_ptr<int>();
    a.magic = magic;
    a.epoch = epoch;
    a.tokens = tokens;
    a.slots = slots.data_ptr<int64_t>();
    a.eff = eff.data_ptr<int64_t>();
    a.T = static_cast<uint32_t>(T);
    a.gate = gate.data_ptr<int>();
    a.record = device_record(dev);
    a.call = call;
    a.peer = peer;
    const char* err = cuda_p2p_gate(a, c10::cuda::getCurrentCUDAStream(dev.index()).stream());
    if (err != nullptr) return fail(cat("kvcore p2p_gate (CUDA): ", err), -1);
    return 0;
#else
    return fail("kvcore p2p_gate: this build of the op library has no CUDA implementation", -1);
#endif
  } catch (const std::exception& e) {
    return fail(cat("kvcore p2p_gate: ", e.what()), -1);
  }
}

// The sender's reading of the receiver's answers (see VerdictArgs). CPU: 0 or a RefusalKind
// (message in last_error); CUDA: 0 once launched; -1: bad arguments.
int64_t p2p_verdict(const at::Tensor& r0, const at::Tensor& v, int64_t magic, int64_t epoch, int64_t tokens,
                    const std::optional<at::Tensor>& flag, int64_t call, int64_t peer) {
  try {
    const c10::Device dev = r0.device();
    if (!ctl_ok(r0, dev) || !ctl_ok(v, dev) || (flag && !flag_ok(*flag, dev))) return fail("kvcore p2p_verdict: bad arguments", -1);
    if (dev.is_cpu()) {
      const int64_t k = sender_verdict(ctl_ptr(r0), ctl_ptr(v), magic, epoch, tokens);
      if (flag) *flag->data_ptr<int>() = static_cast<int>(k);
      if (k != 0) {
        DeviceErrorRecord r{};
        verdict_record(r, k, ctl_ptr(r0), ctl_ptr(v), tokens);
        r.gather = kOpSend;
        r.peer = peer;
        g_last_error = describe_record(r, true);
      }
      return k;
    }
#ifdef KVCORE_WITH_CUDA
    VerdictArgs a{};
    a.r0 = ctl_ptr(r0);
    a.v = ctl_ptr(v);
    a.magic = magic;
    a.epoch = epoch;
    a.tokens = tokens;
    a.flag = flag ? flag->data_ptr<int>() : nullptr;
    a.record = device_record(dev);
    a.call = call;
    a.peer = peer;
    const char* err = cuda_p2p_verdict(a, c10::cuda::getCurrentCUDAStream(dev.index()).stream());
    if (err != nullptr) return fail(cat("kvcore p2p_verdict (CUDA): ", err), -1);
    return 0;
#else
    return fail("kvcore p2p_verdict: this build of the op library has no CUDA implementation", -1);
#endif
  } catch (const std::exception& e) {
    return fail(cat("kvcore p2p_verdict: ", e.what()), -1);
  }
}

}  // namespace

void bind(pybind11::module_& m) {
  namespace py = pybind11;
  py::class_<CopyPlan>(m, "CopyPlan")
      .def(py::init<const at::Tensor&, const at::Tensor&, const at::Tensor&, const at::Tensor&, const at::Tensor&, int64_t, int64_t, int64_t,
                    int64_t, int64_t, int64_t, int64_t, bool, const std::vector<at::Tensor>&, const std::vector<std::string>&,
                    const at::Tensor&, const at::Tensor&>(),
           py::arg("src_ptrs"), py::arg("src_geom"), py::arg("dst_ptrs"), py::arg("dst_geom"), py::arg("plane_rows"),
           py::arg("src_block_size"), py::arg("src_num_slots"), py::arg("dst_block_size"), py::arg("dst_num_slots"), py::arg("base_align"),
           py::arg("src_probe"), py::arg("dst_probe"), py::arg("shared"), py::arg("storages"), py::arg("labels"), py::arg("snapshot"),
           py::arg("device_probe"))
      .def("ok", &CopyPlan::ok)
      .def("error", &CopyPlan::error)
      .def("run", &CopyPlan::run, py::call_guard<py::gil_scoped_release>(),
           "run(src_slots, dst_slots, validate) -> int (0 ok; 1 refused; 3 stale storage; 4 an earlier device refusal)");
  m.def("copy_last_error", []() { return g_last_error; });
  m.def("p2p_check", &p2p_check, py::call_guard<py::gil_scoped_release>(), py::arg("src"), py::arg("src_n"), py::arg("dst"),
        py::arg("dst_n"), py::arg("bitmap"), py::arg("flag"), py::arg("report"), py::arg("magic"), py::arg("mode"), py::arg("epoch"),
        py::arg("mask"), py::arg("op"), py::arg("call"), py::arg("peer"));
  m.def("p2p_gate", &p2p_gate, py::call_guard<py::gil_scoped_release>());
  m.def("p2p_verdict", &p2p_verdict, py::call_guard<py::gil_scoped_release>());
}

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
  m.def("copy_abi_version() -> int", []() -> int64_t { return 2; });
}

TORCH_LIBRARY_IMPL(kvcore, CPU, m) { m.impl("copy_rows", &kvcore::copy::copy_rows_impl); }

#ifdef KVCORE_WITH_CUDA
TORCH_LIBRARY_IMPL(kvcore, CUDA, m) { m.impl("copy_rows", &kvcore::copy::copy_rows_impl); }
#endif
