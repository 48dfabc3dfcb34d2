// kvcore native transfer kernels: op schemas, argument validation, the prepared plan
// (kvcore's direct entry) and the CPU implementation.
//
// gather:  paged cache (through plane base addresses + byte strides) -> staging buffers
// scatter: staging buffers -> paged cache
// The CPU kernel walks rows (plane, layer, token); each contiguous run (a whole row of a
// plane where the layout keeps it contiguous on both sides, e.g. NHD; one head's run for
// HND or interleaved staging) is one copy (copy_run: a 16-byte vector loop). A head split
// into chunks (its elements not one run: a column-major [HS, BS] head, VNNI tiles) moves
// the block's tokens that follow each other in the slot mapping together, per head one
// register-tiled transpose of chunk-sized items (kvcore_tile.h), the next head's rows
// prefetched. Bytes move unchanged, so every dtype (fp8, NaN payloads, -0) is bit-exact. A transfer below the per-thread byte grain stays on the calling thread: on
// a busy host, waking a pool thread costs more than moving a few MB.
//
// Nothing here throws across the ABI: a refused call returns a non-zero code and the
// reason is in last_error(). Codes: 1 refused, 2 a staging buffer carries torch's
// negative/conjugate bit (the Python layer resolves it and calls again), 3 a cache
// storage was freed, resized or replaced since detection, 4 an earlier CUDA call was
// refused on the device (its error is reported now; this call did nothing).
#include <ATen/Parallel.h>
#include <torch/extension.h>

#include <algorithm>
#include <atomic>
#include <cstdio>
#include <cstring>
#include <mutex>
#include <vector>

#include "kvcore_ops.h"
#include "kvcore_copy.h"
#include "kvcore_tile.h"

#ifdef KVCORE_WITH_CUDA
#include <c10/cuda/CUDAStream.h>
#endif

namespace kvcore {
namespace {

enum Code : int64_t { kOk = 0, kRefused = 1, kNegConj = 2, kStale = 3, kPending = 4, kPageable = 5 };

thread_local std::string g_last_error;

int64_t fail(std::string msg, int64_t code = kRefused) {
  g_last_error = std::move(msg);
  return code;
}

// Bytes per thread of a CPU transfer (set_cpu_grain): below twice this one thread moves
// everything, on the calling thread. Measured on a 2-core VM (scripts/cpu_grain.py): with
// its cores busy (load average 6) waking the pool's second thread cost 1-20 ms per call
// (at 8 MB two threads took 35x one thread's time); idle, a second thread paid from tens
// of MB on. 8 MiB keeps an offload step's few tokens on one thread and splits a 256-token
// chunk of every layer (18-34 MB).
std::atomic<int64_t> g_cpu_grain{int64_t{8} << 20};

std::string hex(uintptr_t v) {
  char b[32];
  std::snprintf(b, sizeof(b), "0x%llx", static_cast<unsigned long long>(v));
  return b;
}

// -- plane records --------------------------------------------------------------------------

std::string decode_planes(const at::Tensor& planes, std::vector<PlaneDesc>& out, const char* op) {
  if (!planes.defined() || !planes.device().is_cpu() || planes.scalar_type() != at::kLong || planes.dim() != 2 ||
      planes.size(1) != kPlaneFields || !planes.is_contiguous())
    return cat("kvcore.", op, ": planes must be a contiguous CPU int64 [P, 18] tensor of plane records (kvcore_ops.h), got ",
               planes.defined() ? cat(planes.scalar_type(), " of shape ", planes.sizes(), " on ", planes.device()) : "None");
  const int64_t P = planes.size(0);
  if (P < 1 || P > kMaxPlanes) return cat("kvcore.", op, ": a record has 1..", kMaxPlanes, " planes, got ", P);
  const int64_t* f = planes.data_ptr<int64_t>();
  out.assign(static_cast<size_t>(P), PlaneDesc{});
  for (int64_t k = 0; k < P; ++k) {
    const int64_t* r = f + k * kPlaneFields;
    PlaneDesc& d = out[k];
    d.block = r[kBlock];
    d.token = r[kToken];
    d.head = r[kHead];
    d.chunk = r[kChunk];
    d.chunk_bytes = r[kChunkBytes];
    d.n_chunks = r[kNChunks];
    d.token_group = r[kTokenGroup];
    d.token_group_stride = r[kTokenGroupStride];
    d.num_heads = r[kNumHeads];
    d.head_bytes = r[kHeadBytes];
    d.buffer = r[kBuffer];
    d.kv_index = r[kKvIndex];
    d.st_offset = r[kStOffset];
    d.st_head = r[kStHead];
    d.base_align = r[kBaseAlign];
    d.sub = r[kSub];
    d.n_sub = r[kNSub];
    for (int i = 0; i < kPlaneFields; ++i)
      if (i != kKvIndex && r[i] < 0) return cat("kvcore.", op, ": plane ", k, " has a negative field ", i, " (", r[i], ")");
    if (d.kv_index < -1) return cat("kvcore.", op, ": plane ", k, " has K/V index ", d.kv_index, " (>= 0, or -1 for its own buffer)");
    if (d.chunk_bytes < 1 || d.n_chunks < 1 || d.n_sub < 1 || d.num_heads < 1 || d.chunk_bytes * d.n_chunks * d.n_sub != d.head_bytes)
      return cat("kvcore.", op, ": plane ", k, " has chunk_bytes ", d.chunk_bytes, " x n_chunks ", d.n_chunks, " x n_sub ", d.n_sub,
                 " != head_bytes ", d.head_bytes, " or no heads (", d.num_heads, ")");
    if (d.num_heads > 1 && d.st_head < d.head_bytes)
      return cat("kvcore.", op, ": plane ", k, " stages its heads ", d.st_head, " bytes apart but a head holds ", d.head_bytes,
                 " bytes: staged heads would overlap");
  }
  return std::string();
}

// Planes staged into one row of one buffer must not share a byte (a gather would depend on
// their order). `row_bytes[b]`: the row width of buffer b (or -1 when unknown).
std::string check_staged_rows_disjoint(const std::vector<PlaneDesc>& pl, const char* op) {
  const size_t P = pl.size();
  for (size_t a = 0; a < P; ++a)
    for (size_t b = a + 1; b < P; ++b) {
      if (pl[a].buffer != pl[b].buffer || pl[a].kv_index != pl[b].kv_index) continue;
      const int64_t end = std::max(pl[a].st_offset + (pl[a].num_heads - 1) * pl[a].st_head + pl[a].head_bytes,
                                   pl[b].st_offset + (pl[b].num_heads - 1) * pl[b].st_head + pl[b].head_bytes);
      if (end > (int64_t{1} << 26)) return cat("kvcore.", op, ": staged rows of more than 64 MiB are not supported");
      std::vector<uint8_t> mark(static_cast<size_t>(end), 0);
      for (const PlaneDesc* d : {&pl[a], &pl[b]})
        for (int64_t h = 0; h < d->num_heads; ++h) {
          const int64_t o = d->st_offset + h * d->st_head;
          for (int64_t i = 0; i < d->head_bytes; ++i) {
            if (mark[o + i] && d == &pl[b])
              return cat("kvcore.", op, ": planes ", a, " and ", b, " are staged onto the same bytes of one row (byte ", o + i,
                         "); each plane needs its own bytes of the staged row");
            mark[o + i] = 1;
          }
        }
    }
  return std::string();
}

// -- staging buffers ------------------------------------------------------------------------

struct BufExpect {
  int64_t kv_size;  // -1: a plane's own buffer [NL, T, row]
  int64_t row_bytes;
  c10::ScalarType dtype;
};

// Byte extent [lo, hi) of a strided tensor (strides >= 0), or lo == hi when it is empty.
void extent_of(const at::Tensor& t, uintptr_t& lo, uintptr_t& hi) {
  lo = hi = reinterpret_cast<uintptr_t>(t.data_ptr());
  if (t.numel() == 0) return;
  const int64_t esz = static_cast<int64_t>(t.element_size());
  int64_t last = 0;
  for (int64_t d = 0; d < t.dim(); ++d) last += (t.size(d) - 1) * t.stride(d);
  hi = lo + static_cast<uintptr_t>(last * esz + esz);
}

// True when no two elements of t share a byte: sorted by stride, every axis steps over
// everything inside it (a sufficient test; rare interleavings that pass it are refused).
bool non_overlapping(const at::Tensor& t) {
  if (t.numel() <= 1) return true;
  std::vector<std::pair<int64_t, int64_t>> ax;  // (stride, size)
  for (int64_t d = 0; d < t.dim(); ++d)
    if (t.size(d) > 1) ax.emplace_back(t.stride(d), t.size(d));
  std::sort(ax.begin(), ax.end());
  int64_t extent = 1;  // elements spanned by the axes inside
  for (const auto& a : ax) {
    if (a.first < extent) return false;
    extent = a.first * (a.second - 1) + extent;
  }
  return true;
}

// Checks the buffers (shape, dtype, device, strides, overlap) and resolves every plane's
// staging address. `expect`: per buffer (the plan's), or empty (the raw op: inferred).
// `cache_extents`: sorted, merged byte ranges the cache's planes address (may be empty).
int64_t resolve_staging(std::vector<PlaneDesc>& pl, at::TensorList staging, const std::vector<BufExpect>& expect, int64_t NL,
                        int64_t T, bool single, const c10::Device& dev, const std::vector<std::pair<uintptr_t, uintptr_t>>& cache_extents,
                        const char* op, std::vector<char>* host_plane) {
  const int64_t B = static_cast<int64_t>(staging.size());
  const char* what = std::strcmp(op, "gather") == 0 ? "out" : "src";
  if (!expect.empty() && B != static_cast<int64_t>(expect.size()))
    return fail(cat("kvcore.", op, ": expected ", expect.size(), " staging buffer(s), got ", B));
  std::vector<std::pair<uintptr_t, uintptr_t>> ext(static_cast<size_t>(B));
  host_plane->assign(pl.size(), 0);
  for (int64_t b = 0; b < B; ++b) {
    const at::Tensor& s = staging[b];
    if (!s.defined()) return fail(cat("kvcore.", op, ": staging buffer ", b, " is None"));
    if (s.layout() != c10::kStrided) return fail(cat("kvcore.", op, ": ", what, " is not a dense (strided) tensor"));
    if (s.is_neg() || s.is_conj())
      return fail(cat("kvcore.", op, ": ", what, " carries torch's ", s.is_neg() ? "negative" : "conjugate", " bit"), kNegConj);
    if (!expect.empty() && s.scalar_type() != expect[b].dtype)
      return fail(cat("kvcore.", op, ": ", what, " is ", s.scalar_type(), " but the layout stages ", expect[b].dtype,
                      " (the bytes move unchanged, so the dtypes must match)"));
    if (dev.is_cpu()) {
      if (!s.device().is_cpu()) return fail(cat("kvcore.", op, ": ", what, " is on ", s.device(), " but the cache is on the CPU"));
    } else if (!(s.device() == dev || s.device().is_cpu())) {
      return fail(cat("kvcore.", op, ": ", what, " is on ", s.device(), " but the cache is on ", dev, "; use a buffer on ", dev,
                      " or in pinned host memory"));
    }
    if (s.numel() && s.stride(-1) != 1)
      return fail(cat("kvcore.", op, ": ", what, "'s last dimension must be contiguous (stride 1), got strides ", s.strides()));
    for (int64_t d = 0; d < s.dim(); ++d)
      if (s.stride(d) < 0) return fail(cat("kvcore.", op, ": ", what, " has a negative stride ", s.strides()));
    if (!non_overlapping(s))
      return fail(cat("kvcore.", op, ": ", what, " (shape ", s.sizes(), ", strides ", s.strides(),
                      ") has rows that share memory (a stride smaller than what it steps over); ",
                      "rows would overwrite each other: pass a buffer whose rows are distinct memory"));
    extent_of(s, ext[b].first, ext[b].second);
    const uintptr_t lo = ext[b].first, hi = ext[b].second;
    if (lo != hi && !cache_extents.empty()) {
      auto it = std::upper_bound(cache_extents.begin(), cache_extents.end(), std::make_pair(lo, UINTPTR_MAX));
      bool hit = false;
      if (it != cache_extents.begin() && std::prev(it)->second > lo) hit = true;
      if (it != cache_extents.end() && it->first < hi) hit = true;
      if (hit)
        return fail(cat("kvcore.", op, ": ", what, " (bytes ", hex(lo), "..", hex(hi),
                        ") shares memory with the KV cache it ", std::strcmp(op, "gather") == 0 ? "reads" : "writes",
                        "; stage into a buffer of its own"));
    }
    for (int64_t c = 0; c < b; ++c)
      if (lo != hi && ext[c].first != ext[c].second && lo < ext[c].second && ext[c].first < hi)
        return fail(cat("kvcore.", op, ": staging buffers ", c, " and ", b, " share memory; each plane's buffer needs its own memory"));
  }
  const int64_t layer_dims = single ? 0 : 1;
  for (size_t k = 0; k < pl.size(); ++k) {
    PlaneDesc& d = pl[k];
    if (d.buffer >= B) return fail(cat("kvcore.", op, ": plane ", k, " stages into buffer ", d.buffer, " but ", B, " were given"));
    const at::Tensor& s = staging[d.buffer];
    const bool kv = d.kv_index >= 0;
    const int64_t want_dim = (kv ? 1 : 0) + layer_dims + 2;
    if (!expect.empty() && (expect[d.buffer].kv_size >= 0) != kv)
      return fail(cat("kvcore.", op, ": plane ", k, " and buffer ", d.buffer, " disagree on the K/V axis"));
    if (s.dim() != want_dim || (kv && s.size(0) <= d.kv_index) || (kv && !expect.empty() && s.size(0) != expect[d.buffer].kv_size) ||
        (!single && s.size(kv ? 1 : 0) != NL) || s.size(want_dim - 2) != T) {
      std::string want = kv ? cat("[kv_size=", expect.empty() ? d.kv_index + 1 : expect[d.buffer].kv_size, ", ") : std::string("[");
      if (!single) want += cat("NL=", NL, ", ");
      want += cat("T=", T, ", row]");
      return fail(cat("kvcore.", op, ": ", what, " has shape ", s.sizes(), ", expected ", want));
    }
    const int64_t esz = static_cast<int64_t>(s.element_size());
    const int64_t row = s.size(-1) * esz;
    if (!expect.empty() && row != expect[d.buffer].row_bytes)
      return fail(cat("kvcore.", op, ": a staging row of ", what, " holds ", row, " bytes but the layout stages ", expect[d.buffer].row_bytes,
                      " bytes per token"));
    if (d.st_offset + (d.num_heads - 1) * d.st_head + d.head_bytes > row)
      return fail(cat("kvcore.", op, ": a staging row holds ", row, " bytes but plane ", k, " needs ",
                      d.st_offset + (d.num_heads - 1) * d.st_head + d.head_bytes));
    char* base = static_cast<char*>(s.data_ptr());
    int64_t dim = 0;
    if (kv) base += d.kv_index * s.stride(dim++) * esz;
    d.st_layer = single ? 0 : s.stride(dim++) * esz;
    d.st_tok = s.stride(dim) * esz;
    d.st_base = base + d.st_offset;
    (*host_plane)[k] = s.device().is_cpu() && !dev.is_cpu();
  }
  return kOk;
}

// -- slots ----------------------------------------------------------------------------------

std::string check_slots_arg(const at::Tensor& slots, const c10::Device& dev, const char* op) {
  if (!slots.defined() || slots.scalar_type() != at::kLong || slots.dim() != 1 || !slots.is_contiguous())
    return cat("kvcore.", op, ": slots must be a contiguous int64 [T] tensor, got ",
               slots.defined() ? cat(slots.scalar_type(), " of shape ", slots.sizes()) : "None");
  if (slots.device() != dev)
    return cat("kvcore.", op, ": slot_mapping is on ", slots.device(), " but the cache is on ", dev, "; pass it on ", dev);
  if (slots.size(0) > std::numeric_limits<int32_t>::max()) return cat("kvcore.", op, ": at most 2^31 - 1 slots per call");
  return std::string();
}

// Synchronous validation (CPU): every slot in range, and for a scatter no slot twice.
std::string validate_slots(const int64_t* slot, int64_t T, int64_t skip, int64_t num_slots, bool scatter) {
  for (int64_t t = skip; t < T; ++t)
    if (slot[t] >= num_slots)
      return cat("slot_mapping[", t, "] = ", slot[t], " is out of range: this cache has ", num_slots, " slots per layer (valid 0..",
                 num_slots - 1, "; negative slots are padding and are skipped)");
  if (scatter && T - skip > 1) {
    std::vector<int64_t> v;
    v.reserve(static_cast<size_t>(T - skip));
    for (int64_t t = skip; t < T; ++t)
      if (slot[t] >= 0) v.push_back(slot[t]);
    std::sort(v.begin(), v.end());
    for (size_t i = 1; i < v.size(); ++i)
      if (v[i] == v[i - 1]) return cat("slot ", v[i], " appears more than once in slot_mapping; a scatter would write it twice");
  }
  return std::string();
}

// -- the CPU kernel -------------------------------------------------------------------------

// Copy a run of bytes with plain 16-byte vector loads and stores. glibc's memcpy sends
// runs of a few KiB (a 2 KiB NHD row) to `rep movsb`, which on the AMD EPYC development
// machines ran a per-row gather at about half the speed of a contiguous copy; a simple
// vector loop streams at copy speed. Short or odd runs still go to memcpy.
static inline void copy_run(char* __restrict dst, const char* __restrict src, int64_t n) {
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

// How a plane whose head is not one run (chunks, sub-runs of chunks) moves a run of a block's
// consecutive tokens, per head: its items (chunk_bytes each) as a grid of rows x tokens. The
// rows are the head's runs in staged order: the chunks (n_sub == 1), or per chunk its sub-runs
// (a batch per chunk), or both as one row level when the chunks continue the sub-runs. The
// run is moved in segments (segment()), each for every head before the next segment: a
// partial token group, or whole groups up to about kSegBytes of a head, or (no token groups)
// the whole run. Nothing here knows a format: only strides.
struct HeadGrid {
  static constexpr int64_t kSegBytes = 4096;  // a segment's bytes of one head (whole groups)
  bool tile = false;  // a row's items of consecutive tokens (of a group) are side by side
  int64_t G = 0;      // tokens per group (0: the block's tokens are one group)
  int64_t gs = 0;     // bytes between groups
  int64_t seg_groups = 1;  // whole groups per segment
  int64_t nb = 1, bs = 0, R = 1, rs = 0, S = 1;  // batches x rows of S-byte items

  static HeadGrid of(const PlaneDesc& p, int64_t block_size) {
    HeadGrid g;
    g.S = p.chunk_bytes;
    g.tile = p.token == p.chunk_bytes;
    if (p.token_group && p.token_group < block_size) {
      g.G = p.token_group;
      g.gs = p.token_group_stride;
      g.seg_groups = std::max<int64_t>(1, kSegBytes / (g.G * p.head_bytes));
    }
    if (p.n_sub == 1) {
      g.R = p.n_chunks;
      g.rs = p.chunk;
    } else if (p.n_chunks == 1 || p.chunk == p.n_sub * p.sub) {
      g.R = p.n_chunks * p.n_sub;
      g.rs = p.sub;
    } else {
      g.nb = p.n_chunks;
      g.bs = p.chunk;
      g.R = p.n_sub;
      g.rs = p.sub;
    }
    return g;
  }

  // The segment of a run that starts at token offset o with `left` tokens: ng groups of C
  // tokens (ng > 1 only for whole groups). Returns its tokens (ng * C).
  int64_t segment(int64_t o, int64_t left, int64_t& C, int64_t& ng) const {
    C = left;
    ng = 1;
    if (G) {
      const int64_t in = o % G;
      if (in == 0 && left >= G) {
        C = G;
        ng = std::min(left / G, seg_groups);
      } else {
        C = std::min(left, G - in);
      }
    }
    return ng * C;
  }

  // Move one segment of one head: `head` is the head's bytes in the block (token offset 0),
  // `st` the segment's first staged head; one batch of small transposes.
  template <bool kGather>
  void move(const PlaneDesc& p, char* head, int64_t o, int64_t C, int64_t ng, char* st) const {
    tile::grid_move<kGather>(head + p.token_offset(o), gs, bs, rs, st, p.st_tok, ng, nb, R, C, S);
  }

  // Prefetch (into L2) what move() touches for the same arguments: per batch its bounding
  // byte range when the rows are dense enough, else each row's range; the staged rows.
  template <bool kGather>
  void prefetch(const PlaneDesc& p, const char* head, int64_t o, int64_t n, const char* st) const {
    if (n < 1) return;
    const int64_t first = p.token_offset(o), last = p.token_offset(o + n - 1);
    const int64_t region = last - first + (R - 1) * rs + S;
    if (region <= 2 * R * n * S + 128) {
      tile::prefetch_rows<!kGather>(head + first, nb, bs, region);
    } else {
      for (int64_t b = 0; b < nb; ++b) tile::prefetch_rows<!kGather>(head + b * bs + first, R, rs, last - first + S);
    }
    tile::prefetch_rows<kGather>(st, n, p.st_tok, p.head_bytes);
  }
};

template <bool kGather>
void cpu_move(const std::vector<PlaneDesc>& pl, const int64_t* base, int64_t NL, const int64_t* slot, int64_t T, int64_t skip,
              int64_t block_size, int64_t num_slots) {
  const int64_t P = static_cast<int64_t>(pl.size());
  if (T == 0 || NL == 0) return;
  // planes with one address pattern for the token share one offset per token: each slot is
  // split into (block, offset) once per call, not once per plane and layer; -1 = skip
  std::vector<int64_t> cls(static_cast<size_t>(P));
  int64_t ncls = 0;
  for (int64_t k = 0; k < P; ++k) {
    cls[k] = -1;
    for (int64_t q = 0; q < k; ++q)
      if (pl[q].block == pl[k].block && pl[q].token == pl[k].token && pl[q].token_group == pl[k].token_group &&
          pl[q].token_group_stride == pl[k].token_group_stride) {
        cls[k] = cls[q];
        break;
      }
    if (cls[k] < 0) cls[k] = ncls++;
  }
  std::vector<int64_t> tok_off(static_cast<size_t>(ncls * T));
  int64_t nvalid = 0;
  for (int64_t k = 0, done = 0; k < P && done < ncls; ++k) {
    if (cls[k] != done) continue;
    int64_t* o = tok_off.data() + done * T;
    const PlaneDesc& p = pl[k];
    for (int64_t t = 0; t < T; ++t) {
      const int64_t sv = slot[t];
      const bool ok = t >= skip && sv >= 0 && sv < num_slots;
      o[t] = ok ? (sv / block_size) * p.block + p.token_offset(sv % block_size) : -1;
      if (done == 0) nvalid += ok;
    }
    ++done;
  }
  if (nvalid == 0) return;
  int64_t bytes = 0;
  for (const PlaneDesc& p : pl) bytes += NL * nvalid * p.row_bytes();
  const int64_t* offs = tok_off.data();
  const int64_t* cl = cls.data();
  std::vector<HeadGrid> grids(static_cast<size_t>(P));
  for (int64_t k = 0; k < P; ++k) grids[k] = HeadGrid::of(pl[k], block_size);
  constexpr int64_t kAhead = 4;  // rows prefetched ahead (the next block's address is known here, not to the hardware)
  const int64_t rows = P * NL * T;
  auto body = [&](int64_t begin, int64_t end) {
    int64_t kl = begin / T, t = begin % T;
    // per-plane values change only every T rows
    int64_t k = kl / NL, l = kl - k * NL;
    const PlaneDesc* p = &pl[k];
    const int64_t* ko = offs + cl[k] * T;
    char* pbase = reinterpret_cast<char*>(base[l * P + k]);
    char* srow = p->st_base + l * p->st_layer;
    bool contig = p->row_contiguous();
    int64_t row_bytes = p->row_bytes();
    bool merge = contig && p->st_tok == row_bytes;
    for (int64_t r = begin; r < end; ++r, ++t) {
      if (t == T) {
        t = 0;
        ++kl;
        k = kl / NL;
        l = kl - k * NL;
        p = &pl[k];
        ko = offs + cl[k] * T;
        pbase = reinterpret_cast<char*>(base[l * P + k]);
        srow = p->st_base + l * p->st_layer;
        contig = p->row_contiguous();
        row_bytes = p->row_bytes();
        merge = contig && p->st_tok == row_bytes;
      }
      const int64_t off = ko[t];
      if (t + kAhead < T && ko[t + kAhead] >= 0) {
        const char* nx = pbase + ko[t + kAhead];
        if (contig) {
          for (int64_t i = 0; i < row_bytes; i += 64) __builtin_prefetch(nx + i, kGather ? 0 : 1);
        } else if (p->head_contiguous()) {
          for (int64_t h = 0; h < p->num_heads; ++h)
            for (int64_t i = 0; i < p->head_bytes; i += 64) __builtin_prefetch(nx + h * p->head + i, kGather ? 0 : 1);
        }
      }
      if (off < 0) continue;
      char* cache = pbase + off;
      char* row = srow + t * p->st_tok;
      if (contig) {
        // consecutive tokens whose rows are adjacent on both sides (a block's tokens when
        // rows are packed: NHD, MLA, a plane of scales) move as one run
        int64_t n = 1;
        if (merge) {
          const int64_t lim = std::min(T - t, end - r);
          while (n < lim && ko[t + n] == off + n * row_bytes) ++n;
        }
        if (kGather) copy_run(row, cache, n * row_bytes);
        else copy_run(cache, row, n * row_bytes);
        r += n - 1;
        t += n - 1;
      } else if (p->head_contiguous()) {
        for (int64_t h = 0; h < p->num_heads; ++h) {
          if (kGather) copy_run(row + h * p->st_head, cache + h * p->head, p->head_bytes);
          else copy_run(cache + h * p->head, row + h * p->st_head, p->head_bytes);
        }
      } else if (p->n_sub == 1) {
        // a head in chunks (its elements not one run): where a chunk's items of consecutive
        // tokens sit side by side (token stride == chunk bytes: a column-major [HS, BS] head,
        // VNNI tiles, 16-byte chunks across tokens), the block's tokens that follow in the
        // slot mapping move together, per head one [n_chunks, n] <-> [n, n_chunks] transpose
        int64_t n = 1;
        if (p->token == p->chunk_bytes) {
          const int64_t lim = std::min(T - t, end - r);
          while (n < lim && ko[t + n] == off + n * p->token) ++n;
        }
        const int64_t span = (n - 1) * p->token + p->chunk_bytes;  // bytes of one chunk row of the run
        for (int64_t h = 0; h < p->num_heads; ++h) {
          char* a = cache + h * p->head;
          char* b = row + h * p->st_head;
          // the next head's rows (or the next run's first head, as long as this one), both
          // sides, while this head moves: a head's chunk rows start a new stream per page
          const char* na = nullptr;
          const char* nb = nullptr;
          int64_t nn = n;
          if (h + 1 < p->num_heads) {
            na = a + p->head;
            nb = b + p->st_head;
          } else if (t + n < T && ko[t + n] >= 0) {
            na = pbase + ko[t + n];
            nb = srow + (t + n) * p->st_tok;
            nn = std::min(n, T - t - n);
          }
          if (na != nullptr) {
            tile::prefetch_rows<!kGather>(na, p->n_chunks, p->chunk, nn == n ? span : (nn - 1) * p->token + p->chunk_bytes);
            tile::prefetch_rows<kGather>(nb, nn, p->st_tok, p->head_bytes);
          }
          if (kGather) tile::transpose_items(b, p->st_tok, a, p->chunk, p->n_chunks, n, p->chunk_bytes);
          else tile::transpose_items(a, p->chunk, b, p->st_tok, n, p->n_chunks, p->chunk_bytes);
        }
        r += n - 1;
        t += n - 1;
      } else {
        // a head of chunks of strided sub-runs (n_sub > 1: vLLM CPU's AMX V tile): where a
        // sub-run's items of consecutive tokens sit side by side (token stride == chunk
        // bytes), the tokens that follow each other in the slot mapping inside one block move
        // together, in segments (HeadGrid::segment), per segment and head a batch of small
        // transposes (HeadGrid::move); otherwise one token at a time
        const HeadGrid& g = grids[k];
        const int64_t o0 = slot[t] % block_size;
        int64_t n = 1;
        if (g.tile) {
          const int64_t lim = std::min({T - t, end - r, block_size - o0});
          while (n < lim && slot[t + n] == slot[t] + n && ko[t + n] >= 0) ++n;
        }
        char* blk = cache - p->token_offset(o0);
        for (int64_t i = 0; i < n;) {
          int64_t C, ng;
          const int64_t m = g.segment(o0 + i, n - i, C, ng);
          char* srun = row + i * p->st_tok;
          for (int64_t h = 0; h < p->num_heads; ++h) {
            char* a = blk + h * p->head;
            char* b = srun + h * p->st_head;
            // what comes next, both sides, while this head moves (as many tokens as this
            // segment): the next head, else the next segment's (or the next run's) first head
            if (h + 1 < p->num_heads) {
              g.prefetch<kGather>(*p, a + p->head, o0 + i, m, b + p->st_head);
            } else if (i + m < n) {
              g.prefetch<kGather>(*p, blk, o0 + i + m, std::min(m, n - i - m), srun + m * p->st_tok);
            } else if (t + n < T && ko[t + n] >= 0) {
              const int64_t o1 = slot[t + n] % block_size;
              const int64_t nn = std::min({m, T - t - n, block_size - o1});
              g.prefetch<kGather>(*p, pbase + ko[t + n] - p->token_offset(o1), o1, nn, srow + (t + n) * p->st_tok);
            }
            g.move<kGather>(*p, a, o0 + i, C, ng, b);
          }
          i += m;
        }
        r += n - 1;
        t += n - 1;
      }
    }
  };
  // threads: one per g_cpu_grain bytes, at most the pool; one thread runs inline (no pool wake-up)
  const int64_t grain = std::max<int64_t>(1, g_cpu_grain.load(std::memory_order_relaxed));
  const int64_t want = std::min<int64_t>(at::get_num_threads(), std::max<int64_t>(1, bytes / grain));
  if (want <= 1 || rows < 2) {
    body(0, rows);
    return;
  }
  // split the rows so that every thread moves about the same number of bytes (planes of
  // 16-byte scales beside 1 KiB value rows would otherwise leave one thread the scales)
  const int64_t seg_rows = NL * T;
  int64_t total = 0;
  for (const PlaneDesc& p : pl) total += seg_rows * p.row_bytes();
  std::vector<int64_t> cut(static_cast<size_t>(want + 1), rows);
  cut[0] = 0;
  for (int64_t i = 1; i < want; ++i) {
    const int64_t target = static_cast<int64_t>(static_cast<double>(total) * static_cast<double>(i) / static_cast<double>(want));
    int64_t acc = 0;
    for (int64_t k = 0; k < P; ++k) {
      const int64_t rb = pl[k].row_bytes(), seg = seg_rows * rb;
      if (acc + seg >= target) {
        cut[i] = std::min(rows, k * seg_rows + (target - acc + rb - 1) / rb);
        break;
      }
      acc += seg;
    }
    cut[i] = std::max(cut[i], cut[i - 1]);
  }
  at::parallel_for(0, want, 1, [&](int64_t b, int64_t e) {
    for (int64_t i = b; i < e; ++i)
      if (cut[i] < cut[i + 1]) body(cut[i], cut[i + 1]);
  });
}

// -- the CUDA path --------------------------------------------------------------------------

#ifdef KVCORE_WITH_CUDA
int64_t g_unroll = 4;       // loads in flight per thread, device staging
int64_t g_unroll_host = 8;  // ... pinned host staging
std::atomic<bool> g_pdl{true};
#endif

}  // namespace

namespace {
std::string range_text(const char* what, int64_t index, int64_t value, int64_t num_slots, const char* whose) {
  return cat(what, "[", index, "] = ", value, " is out of range: ", whose, " has ", num_slots, " slots per layer (valid 0..", num_slots - 1,
             "; negative slots are padding and are skipped)");
}
}  // namespace

std::string TensorGuard::init(const std::vector<at::Tensor>& tensors, const std::vector<std::string>& labels, const at::Tensor& snapshot,
                              const std::string& who) {
  who_ = who;
  rows_.clear();
  const int64_t n = static_cast<int64_t>(tensors.size());
  if (static_cast<int64_t>(labels.size()) != n || !snapshot.defined() || snapshot.dim() != 2 || snapshot.size(0) != n ||
      !(snapshot.size(1) == 2 || (snapshot.size(1) >= 4 && snapshot.size(1) % 2 == 0)))
    return cat(who, "one label and one snapshot row (ptr, nbytes[, storage_offset, ndim, sizes, strides]) per guarded tensor");
  const at::Tensor snap = snapshot.to(at::kCPU).to(at::kLong).contiguous();
  const int64_t cols = snap.size(1), dmax = cols >= 4 ? (cols - 4) / 2 : 0;
  const int64_t* x = snap.data_ptr<int64_t>();
  for (int64_t i = 0; i < n; ++i) {
    const int64_t* r = x + i * cols;
    Row row;
    row.tensor = tensors[i];
    if (!row.tensor.defined()) return cat(who, "guarded tensor ", i, " is undefined");
    row.impl = row.tensor.storage().unsafeGetStorageImpl();
    row.ptr = static_cast<uintptr_t>(r[0]);
    row.nbytes = r[1];
    row.offset = cols >= 4 ? r[2] : -1;
    row.ndim = cols >= 4 ? r[3] : -1;
    if (row.ndim > dmax) return cat(who, "guarded tensor ", i, " has ", row.ndim, " dims but its snapshot row holds ", dmax);
    for (int64_t d = 0; d < row.ndim; ++d) {
      row.sizes.push_back(r[4 + d]);
      row.strides.push_back(r[4 + dmax + d]);
    }
    row.label = labels[i];
    rows_.push_back(std::move(row));
  }
  return std::string();
}

std::string TensorGuard::check() const {
  // Per call, on the host, for every guarded tensor: read the TensorImpl's fields directly
  // (no dim wrapping, no Storage copies), the cheap comparisons first; the message is built
  // only for the refused row.
  for (const Row& r : rows_) {
    const c10::TensorImpl* ti = r.tensor.unsafeGetTensorImpl();
    const c10::StorageImpl* si = ti->unsafe_storage().unsafeGetStorageImpl();
    const uintptr_t ptr = reinterpret_cast<uintptr_t>(si->data());
    const int64_t nb = static_cast<int64_t>(si->nbytes());
    if (si != r.impl || ptr != r.ptr || nb != r.nbytes)
      return cat(who_, "the storage of ", r.label, " was ", nb == 0 ? "freed" : (si != r.impl ? "replaced" : "reallocated or resized"),
                 " after the layout was detected (", r.nbytes, " bytes at ", hex(r.ptr), ", now ", nb, " bytes at ", hex(ptr),
                 "); nothing was moved. Detect the cache again");
    if (r.ndim < 0) continue;
    const c10::IntArrayRef sz = ti->sizes(), sd = ti->strides();
    const size_t nd = static_cast<size_t>(r.ndim);
    const bool same = sz.size() == nd && ti->storage_offset() == r.offset &&
                      (nd == 0 || (std::memcmp(sz.data(), r.sizes.data(), nd * sizeof(int64_t)) == 0 &&
                                   std::memcmp(sd.data(), r.strides.data(), nd * sizeof(int64_t)) == 0));
    if (!same) {
      const at::Tensor& t = r.tensor;
      return cat(who_, r.label, " changed shape, strides or offset in place after the layout was detected (was shape ",
                 c10::IntArrayRef(r.sizes), " stride ", c10::IntArrayRef(r.strides), " offset ", r.offset, ", now shape ", t.sizes(),
                 " stride ", t.strides(), " offset ", t.storage_offset(), "); nothing was moved. Detect the cache again");
    }
  }
  return std::string();
}

std::string describe_record(const DeviceErrorRecord& r, bool now) {
  const int64_t op = r.gather;
  std::string what;
  std::string opname;
  if (op == kOpGather || op == kOpScatter) {
    opname = op == kOpGather ? "kvcore.gather" : "kvcore.scatter";
    what = r.kind == kSlotRange ? range_text("slot_mapping", r.index, r.value, r.num_slots, "this cache")
                                : cat("slot ", r.value, " appears more than once in slot_mapping; a scatter would write it twice");
  } else if (op == kOpCopy) {
    opname = "kvcore.copy";
    if (r.kind == kSlotRange)
      what = range_text("src_slots", r.index, r.value, r.num_slots, "the source");
    else if (r.kind == kDstRange)
      what = range_text("dst_slots", r.index, r.value, r.num_slots, "the destination");
    else if (r.kind == kSlotRepeat)
      what = cat("destination slot ", r.value, " appears more than once in dst_slots; overlapping destination slots would be written twice");
    else
      what = cat("the source and destination share memory and slot ", r.value,
                 " is both read and written; copy within one cache needs disjoint source and destination slots");
  } else if (op == kOpSend) {
    opname = cat("kvcore.send to rank ", r.peer);
    if (r.kind == kSlotRange) {
      what = range_text("slots", r.index, r.value, r.num_slots, "this cache") + "; the receiver wrote nothing and raises too";
    } else if (r.kind == kPeerRefused) {
      what = cat("the receiver (rank ", r.peer, ") refused and wrote nothing: ",
                 r.detail == kSlotRepeat ? cat("destination slot ", r.value, " appears more than once in its slots")
                                         : range_text("its slots", r.index, r.value, r.num_slots, "its cache"));
    } else if (r.kind == kPeerUnexpected) {
      what = cat("the receiver (rank ", r.peer, ") was called with ", r.tokens,
                 " token rows or another geometry than this channel agreed on (", r.value,
                 " rows), so it did not take this transfer; both sides raise, nothing was written");
    } else {
      what = cat("a control message from rank ", r.peer,
                 " is not kvcore's: both sides must call kvcore.send / kvcore.recv in the same order; destroy and re-create the "
                 "process group");
    }
  } else {
    opname = cat("kvcore.recv from rank ", r.peer);
    if (r.kind == kDstRange) {
      what = range_text("slots", r.index, r.value, r.num_slots, "this cache") + "; the sender is told and raises too";
    } else if (r.kind == kSlotRepeat) {
      what = cat("destination slot ", r.value, " appears more than once in slots; it would be written twice (the sender is told and "
                 "raises too)");
    } else if (r.kind == kSenderSlots) {
      what = cat("the sender refused and sent nothing: ", range_text("its slots", r.index, r.value, r.num_slots, "its cache"));
    } else if (r.kind == kSenderChanged) {
      what = r.detail ? cat("the sender refused its own arguments (its kvcore.send raised) and nothing was written")
                      : cat("the sender sent ", r.tokens, " token rows or another geometry than this channel agreed on (", r.value,
                            " rows): the two calls do not match (kvcore.send on rank ", r.peer,
                            " names the difference); both sides raise, nothing was written");
    } else {
      what = cat("a control message from rank ", r.peer,
                 " is not kvcore's: both sides must call kvcore.send / kvcore.recv in the same order; destroy and re-create the "
                 "process group");
    }
  }
  std::string s = now ? cat(opname, " was refused and wrote nothing: ", what)
                      : cat("an earlier ", opname, " (call #", r.call, ") was refused on the device and wrote nothing: ", what);
  if (r.dropped) s += cat(" (", r.dropped, " later refused call(s) were not recorded)");
  return s;
}

#ifdef KVCORE_WITH_CUDA
// The pending device-side refusal, once ("" when none).
std::string take_device_error() {
  DeviceErrorRecord* r = cuda_error_record(-1, nullptr);
  if (r == nullptr || r->seq == r->ack) return std::string();
  const int64_t seq = r->seq;
  DeviceErrorRecord copy{};
  copy.kind = r->kind;
  copy.index = r->index;
  copy.value = r->value;
  copy.num_slots = r->num_slots;
  copy.call = r->call;
  copy.gather = r->gather;
  copy.dropped = r->dropped;
  copy.peer = r->peer;
  copy.detail = r->detail;
  copy.tokens = r->tokens;
  r->dropped = 0;
  r->ack = seq;
  return describe_record(copy);
}
#else
std::string take_device_error() { return std::string(); }
#endif

int64_t cpu_grain_bytes() { return g_cpu_grain.load(std::memory_order_relaxed); }

bool pdl_enabled() {
#ifdef KVCORE_WITH_CUDA
  return g_pdl.load(std::memory_order_relaxed);
#else
  return false;
#endif
}

namespace {

int64_t to_cuda_transfer_and_run(bool gather, const std::vector<PlaneDesc>& pl, const at::Tensor& ptrs, const at::Tensor& slots,
                                 int64_t NL, int64_t block_size, int64_t num_slots, int64_t skip, int validate, int* flag,
                                 uint32_t* bitmap, int64_t call, DeviceErrorRecord* dev_rec, const std::vector<char>& host_plane,
                                 const char* op, int gated = 0) {
  bool any_host = false;
  for (char h : host_plane) any_host = any_host || h;
#ifdef KVCORE_WITH_CUDA
  CudaTransfer a{};
  a.ptrs = ptrs.data_ptr<int64_t>();
  a.slots = slots.data_ptr<int64_t>();
  a.P = static_cast<int64_t>(pl.size());
  for (size_t k = 0; k < pl.size(); ++k) {
    a.plane[k] = pl[k];
    {
      // pinned host staging is read or written in place, through its mapped device address
      void* d = host_plane[k] ? cuda_host_device_ptr(pl[k].st_base) : nullptr;
      if (d != nullptr) {
        a.plane[k].st_base = static_cast<char*>(d);
      } else if (host_plane[k]) {
        return fail(cat("kvcore.", op, " (CUDA): a host staging buffer must be pinned (torch.empty(..., pin_memory=True)) so the ",
                        "kernel can reach it directly"),
                    kPageable);
      }
    }
  }
  a.num_slots = num_slots;
  a.T = slots.size(0);
  a.NL = NL;
  a.block_size = block_size;
  a.skip = skip;
  a.unroll = any_host ? g_unroll_host : g_unroll;
  a.device = slots.device().index();
  a.stream = c10::cuda::getCurrentCUDAStream(slots.device().index()).stream();
  a.validate = validate ? 1 : 0;
  a.gated = (!validate && gated && flag != nullptr) ? 1 : 0;
  a.flag = flag;
  a.bitmap = bitmap;
  a.call = call;
  a.pdl = g_pdl.load(std::memory_order_relaxed);
  if (validate) {
    if (dev_rec == nullptr) return fail(cat("kvcore.", op, " (CUDA): no pinned error record for device validation"));
    a.record = dev_rec;
  }
  const char* err = cuda_transfer(gather, a);
  if (err != nullptr) return fail(cat("kvcore.", op, " (CUDA): ", err));
  return kOk;
#else
  (void)gather, (void)pl, (void)ptrs, (void)slots, (void)NL, (void)block_size, (void)num_slots, (void)skip, (void)validate, (void)flag,
      (void)bitmap, (void)call, (void)any_host, (void)dev_rec, (void)gated;
  return fail(cat("kvcore.", op, ": this build of the op library has no CUDA implementation"));
#endif
}

// -- the raw ops (torch.ops.kvcore.gather / scatter) ---------------------------------------

int64_t raw_transfer(bool gather, const at::Tensor& ptrs, const at::Tensor& planes, const at::Tensor& slots, at::TensorList staging,
                     int64_t block_size, int64_t num_slots) {
  const char* op = gather ? "gather" : "scatter";
  std::vector<PlaneDesc> pl;
  std::string e = decode_planes(planes, pl, op);
  if (!e.empty()) return fail(e);
  const int64_t P = static_cast<int64_t>(pl.size());
  if (!ptrs.defined() || ptrs.scalar_type() != at::kLong || ptrs.dim() != 2 || ptrs.size(1) != P || !ptrs.is_contiguous())
    return fail(cat("kvcore.", op, ": ptrs must be a contiguous int64 [num_layers, ", P, "] tensor of plane base addresses, got ",
                    ptrs.defined() ? cat(ptrs.scalar_type(), " of shape ", ptrs.sizes()) : "None"));
  if (block_size < 1 || num_slots < 0)
    return fail(cat("kvcore.", op, ": block_size must be >= 1 and num_slots >= 0, got ", block_size, ", ", num_slots));
  const c10::Device dev = ptrs.device();
  e = check_slots_arg(slots, dev, op);
  if (!e.empty()) return fail(e);
  e = check_staged_rows_disjoint(pl, op);
  if (!e.empty()) return fail(e);
  const int64_t NL = ptrs.size(0), T = slots.size(0);
  if (!dev.is_cpu() && NL > 65535) return fail(cat("kvcore.", op, " (CUDA): at most 65535 layers per launch, got ", NL));
  std::vector<char> host_plane;
  int64_t rc = resolve_staging(pl, staging, {}, NL, T, false, dev, {}, op, &host_plane);
  if (rc != kOk) return rc;
  if (T == 0 || NL == 0) return kOk;
  if (dev.is_cpu()) {
    if (gather) cpu_move<true>(pl, ptrs.data_ptr<int64_t>(), NL, slots.data_ptr<int64_t>(), T, 0, block_size, num_slots);
    else cpu_move<false>(pl, ptrs.data_ptr<int64_t>(), NL, slots.data_ptr<int64_t>(), T, 0, block_size, num_slots);
    return kOk;
  }
  return to_cuda_transfer_and_run(gather, pl, ptrs, slots, NL, block_size, num_slots, 0, 0, nullptr, nullptr, 0, nullptr, host_plane, op);
}

int64_t raw_gather(const at::Tensor& ptrs, const at::Tensor& planes, const at::Tensor& slots, at::TensorList staging, int64_t block_size,
                   int64_t num_slots) {
  return raw_transfer(true, ptrs, planes, slots, staging, block_size, num_slots);
}

int64_t raw_scatter(const at::Tensor& ptrs, const at::Tensor& planes, const at::Tensor& slots, at::TensorList staging, int64_t block_size,
                    int64_t num_slots) {
  return raw_transfer(false, ptrs, planes, slots, staging, block_size, num_slots);
}

}  // namespace

// -- the prepared plan (kvcore's direct entry) ----------------------------------------------
//
// Built once per (stride table, staging shape family) by kvcore.kernels.native; holds the
// plane records, the plane base addresses (on the cache's device), the cache's storages
// with their (pointer, size) at detection, the byte ranges the cache addresses, and (CUDA)
// the device validation flags and duplicate bitmap. run() re-checks every storage, checks
// the slots and staging buffers, validates slot values (CPU: here; CUDA: on the device)
// and moves the bytes, without the dispatcher and with the GIL released.
class NativePlan {
 public:
  NativePlan(const at::Tensor& host_ptrs, const at::Tensor& planes, const at::Tensor& buffers, const std::vector<at::Tensor>& dtypes,
             int64_t block_size, int64_t num_slots, const std::vector<at::Tensor>& storages, const std::vector<std::string>& labels,
             const at::Tensor& snapshot, const at::Tensor& extents, const at::Tensor& device_probe, bool single)
      : block_size_(block_size), num_slots_(num_slots), single_(single), device_(c10::kCPU) {
    try {
      error_ = init(host_ptrs, planes, buffers, dtypes, storages, labels, snapshot, extents, device_probe);
    } catch (const std::exception& e) {
      error_ = cat("kvcore: preparing the native plan failed: ", e.what());
    }
  }

  bool ok() const { return error_.empty(); }
  std::string error() const { return error_; }
  int64_t num_planes() const { return static_cast<int64_t>(planes_.size()); }

  int64_t run(bool gather, const at::Tensor& slots, const std::vector<at::Tensor>& staging, int64_t skip, int64_t validate) {
    try {
      return run_impl(gather, slots, staging, skip, validate);
    } catch (const std::exception& e) {
      return fail(cat("kvcore.", gather ? "gather" : "scatter", ": ", e.what()));
    }
  }

  int64_t run1(bool gather, const at::Tensor& slots, const at::Tensor& staging, int64_t skip, int64_t validate) {
    try {
      return run_impl(gather, slots, at::TensorList(&staging, 1), skip, validate);
    } catch (const std::exception& e) {
      return fail(cat("kvcore.", gather ? "gather" : "scatter", ": ", e.what()));
    }
  }

  // A transfer gated by `gate` (int32, one element, on the plan's device): an earlier kernel
  // on the current stream sets it, and nothing is stored unless it is 0 (CPU: read here); an
  // empty gate: no gate. Slot values are not checked (the gate's kernel did); slots out of
  // range are skipped. Part of a point-to-point transfer (kvcore/distributed.py): an earlier
  // call's pending device refusal is left for the caller to report, not returned here.
  int64_t run_gated(bool gather, const at::Tensor& slots, const std::vector<at::Tensor>& staging, const at::Tensor& gate) {
    try {
      const bool gated = gate.defined() && gate.numel() > 0;
      if (gated && (gate.scalar_type() != at::kInt || gate.device() != device_))
        return fail(cat("kvcore.", gather ? "gather" : "scatter", ": the gate must be an int32 tensor on ", device_));
      if (gated && device_.is_cpu() && *gate.data_ptr<int>() != 0) return kOk;
      return run_impl(gather, slots, staging, 0, 0, (gated && !device_.is_cpu()) ? gate.data_ptr<int>() : nullptr, false);
    } catch (const std::exception& e) {
      return fail(cat("kvcore.", gather ? "gather" : "scatter", ": ", e.what()));
    }
  }

 private:
  std::string init(const at::Tensor& host_ptrs, const at::Tensor& planes, const at::Tensor& buffers, const std::vector<at::Tensor>& dtypes,
                   const std::vector<at::Tensor>& storages, const std::vector<std::string>& labels, const at::Tensor& snapshot,
                   const at::Tensor& extents, const at::Tensor& device_probe) {
    const char* op = "plan";
    std::string e = decode_planes(planes, planes_, op);
    if (!e.empty()) return e;
    const int64_t P = static_cast<int64_t>(planes_.size());
    if (!host_ptrs.defined() || !host_ptrs.device().is_cpu() || host_ptrs.scalar_type() != at::kLong || host_ptrs.dim() != 2 ||
        host_ptrs.size(1) != P || !host_ptrs.is_contiguous())
      return "kvcore.plan: ptrs must be a contiguous CPU int64 [NL, P] tensor";
    NL_ = host_ptrs.size(0);
    if (single_ && NL_ != 1) return "kvcore.plan: a single-layer plan has one layer";
    if (block_size_ < 1 || num_slots_ < 0) return "kvcore.plan: block_size must be >= 1 and num_slots >= 0";
    if (!buffers.defined() || buffers.scalar_type() != at::kLong || buffers.dim() != 2 || buffers.size(1) != 2 ||
        buffers.size(0) != static_cast<int64_t>(dtypes.size()))
      return "kvcore.plan: buffers must be int64 [B, 2] (kv_size or -1, row_bytes), one dtype per buffer";
    const at::Tensor bufc = buffers.contiguous();
    for (int64_t b = 0; b < bufc.size(0); ++b)
      expect_.push_back(BufExpect{bufc[b][0].item<int64_t>(), bufc[b][1].item<int64_t>(), dtypes[b].scalar_type()});
    for (size_t k = 0; k < planes_.size(); ++k) {
      const PlaneDesc& d = planes_[k];
      if (d.buffer >= static_cast<int64_t>(expect_.size())) return cat("kvcore.plan: plane ", k, " stages into a missing buffer");
      const BufExpect& x = expect_[d.buffer];
      if ((x.kv_size >= 0) != (d.kv_index >= 0) || (x.kv_size >= 0 && d.kv_index >= x.kv_size))
        return cat("kvcore.plan: plane ", k, " has K/V index ", d.kv_index, " in a buffer of kv_size ", x.kv_size);
      if (d.st_offset + (d.num_heads - 1) * d.st_head + d.head_bytes > x.row_bytes)
        return cat("kvcore.plan: plane ", k, " does not fit its staged row of ", x.row_bytes, " bytes");
    }
    e = check_staged_rows_disjoint(planes_, op);
    if (!e.empty()) return e;
    e = guard_.init(storages, labels, snapshot, "");
    if (!e.empty()) return cat("kvcore.plan: ", e);
    if (extents.defined() && extents.numel()) {
      const at::Tensor ex = extents.to(at::kLong).contiguous();
      const int64_t* x = ex.data_ptr<int64_t>();
      std::vector<std::pair<uintptr_t, uintptr_t>> v;
      for (int64_t i = 0; i < ex.size(0); ++i) v.emplace_back(static_cast<uintptr_t>(x[2 * i]), static_cast<uintptr_t>(x[2 * i + 1]));
      std::sort(v.begin(), v.end());
      for (const auto& r : v) {
        if (!extents_.empty() && r.first <= extents_.back().second) extents_.back().second = std::max(extents_.back().second, r.second);
        else extents_.push_back(r);
      }
    }
    device_ = device_probe.device();
    host_ptrs_ = host_ptrs.clone();
    if (device_.is_cpu()) {
      ptrs_ = host_ptrs_;
      return std::string();
    }
#ifdef KVCORE_WITH_CUDA
    if (!device_.is_cuda()) return cat("kvcore.plan: the native op serves CPU and CUDA caches, not ", device_);
    if (NL_ > 65535) return cat("kvcore.plan (CUDA): at most 65535 layers per launch, got ", NL_);
    ptrs_ = host_ptrs_.to(device_);
    // the pinned error record is allocated here, not in a call that may be captured in a graph
    if (cuda_error_record(device_.index(), &dev_rec_) == nullptr || dev_rec_ == nullptr)
      return "kvcore.plan (CUDA): could not allocate the pinned error record for device validation";
    flags_ = at::zeros({128}, at::TensorOptions().dtype(at::kInt).device(device_));
    bitmap_ = at::zeros({std::max<int64_t>(1, (num_slots_ + 31) / 32)}, at::TensorOptions().dtype(at::kInt).device(device_));
    return std::string();
#else
    return cat("kvcore.plan: this build of the op library has no CUDA implementation (cache on ", device_, ")");
#endif
  }

  int64_t run_impl(bool gather, const at::Tensor& slots, at::TensorList staging, int64_t skip, int64_t validate,
                   int* gate = nullptr, bool pending_check = true) {
    const char* op = gather ? "gather" : "scatter";
    if (!error_.empty()) return fail(error_);
#ifdef KVCORE_WITH_CUDA
    if (device_.is_cuda() && pending_check) {
      std::string pending = take_device_error();
      if (!pending.empty()) return fail(pending, kPending);
    }
#endif
    std::string e = guard_.check();
    if (!e.empty()) return fail(cat("kvcore.", op, ": ", e), kStale);
    e = check_slots_arg(slots, device_, op);
    if (!e.empty()) return fail(e);
    const int64_t T = slots.size(0);
    if (skip < 0 || skip > T) return fail(cat("kvcore.", op, ": skip_prefix must be between 0 and the number of tokens (", T, "), got ", skip));
    std::vector<PlaneDesc> pl = planes_;
    std::vector<char> host_plane;
    int64_t rc = resolve_staging(pl, staging, expect_, NL_, T, single_, device_, extents_, op, &host_plane);
    if (rc != kOk) return rc;
    if (T == 0) return kOk;
    if (device_.is_cpu()) {
      const int64_t* sl = slots.data_ptr<int64_t>();
      if (validate) {
        e = validate_slots(sl, T, skip, num_slots_, !gather);
        if (!e.empty()) return fail(e);
      }
      if (gather) cpu_move<true>(pl, ptrs_.data_ptr<int64_t>(), NL_, sl, T, skip, block_size_, num_slots_);
      else cpu_move<false>(pl, ptrs_.data_ptr<int64_t>(), NL_, sl, T, skip, block_size_, num_slots_);
      return kOk;
    }
#ifdef KVCORE_WITH_CUDA
    int* flag = nullptr;
    int64_t call = 0;
    void* stream = c10::cuda::getCurrentCUDAStream(device_.index()).stream();
    if (validate) {
      const int capturing = cuda_stream_capturing(stream);
      if (capturing < 0) return fail(cat("kvcore.", op, " (CUDA): cudaStreamIsCapturing failed"));
      if (capturing && validate == 2)
        return fail(cat("kvcore.", op, ": validate='sync' waits for the GPU and cannot be captured in a CUDA graph; use 'device' or 'none'"));
      call = ++calls_;
      // eager calls take flags 0..63 in turn; each captured call gets its own (64..127), so a
      // replayed graph never shares its flag with an eager call in flight
      const int64_t idx = capturing ? 64 + (captures_++ % 64) : (call % 64);
      flag = flags_.data_ptr<int>() + idx;
    }
    if (gate != nullptr && !validate) flag = gate;
    rc = to_cuda_transfer_and_run(gather, pl, ptrs_, slots, NL_, block_size_, num_slots_, skip, validate ? 1 : 0, flag,
                                  gather ? nullptr : reinterpret_cast<uint32_t*>(bitmap_.data_ptr<int>()), call, dev_rec_, host_plane, op,
                                  gate != nullptr ? 1 : 0);
    if (rc != kOk) return rc;
    if (validate == 2) {
      const char* err = cuda_stream_sync(stream);
      if (err != nullptr) return fail(cat("kvcore.", op, " (CUDA): ", err));
      int verdict = 0;
      err = cuda_read_flag(flag, &verdict);
      if (err != nullptr) return fail(cat("kvcore.", op, " (CUDA): ", err));
      if (verdict != 0) {
        std::string msg = take_device_error();
        const std::string prefix = "an earlier ";
        if (msg.rfind(prefix, 0) == 0) msg = "this " + msg.substr(prefix.size());
        return fail(msg.empty() ? cat("kvcore.", op, ": refused on the device (slot out of range or repeated); nothing was written") : msg);
      }
    }
    return kOk;
#else
    return fail(cat("kvcore.", op, ": this build of the op library has no CUDA implementation"));
#endif
  }

  int64_t block_size_, num_slots_;
  bool single_;
  c10::Device device_;
  int64_t NL_ = 0;
  std::string error_;
  std::vector<PlaneDesc> planes_;
  std::vector<BufExpect> expect_;
  at::Tensor host_ptrs_, ptrs_;
  TensorGuard guard_;
  std::vector<std::pair<uintptr_t, uintptr_t>> extents_;
  at::Tensor flags_, bitmap_;
  DeviceErrorRecord* dev_rec_ = nullptr;  // the pinned error record's device address
  std::atomic<int64_t> calls_{0}, captures_{0};
};

}  // namespace kvcore

PYBIND11_MODULE(TORCH_EXTENSION_NAME, m) {
  namespace py = pybind11;
  py::class_<kvcore::NativePlan>(m, "NativePlan")
      .def(py::init<const at::Tensor&, const at::Tensor&, const at::Tensor&, const std::vector<at::Tensor>&, int64_t, int64_t,
                    const std::vector<at::Tensor>&, const std::vector<std::string>&, const at::Tensor&, const at::Tensor&,
                    const at::Tensor&, bool>(),
           py::arg("ptrs"), py::arg("planes"), py::arg("buffers"), py::arg("dtypes"), py::arg("block_size"), py::arg("num_slots"),
           py::arg("storages"), py::arg("labels"), py::arg("snapshot"), py::arg("extents"), py::arg("device_probe"), py::arg("single"))
      .def("ok", &kvcore::NativePlan::ok)
      .def("error", &kvcore::NativePlan::error)
      .def("num_planes", &kvcore::NativePlan::num_planes)
      .def("run", &kvcore::NativePlan::run, py::call_guard<py::gil_scoped_release>(),
           "run(gather, slots, staging: list, skip, validate) -> int (0 ok; 1 refused; 2 neg/conj staging; 3 stale storage; 4 an "
           "earlier device refusal)")
      .def("run1", &kvcore::NativePlan::run1, py::call_guard<py::gil_scoped_release>(), "run with one staging tensor")
      .def("run_gated", &kvcore::NativePlan::run_gated, py::call_guard<py::gil_scoped_release>(),
           "run_gated(gather, slots, staging: list, gate) -> int: stores only when the int32 gate (set by an earlier kernel) is 0");
  kvcore::copy::bind(m);
  m.def("last_error", []() { return kvcore::g_last_error; });
  m.def("take_device_error", []() {
#ifdef KVCORE_WITH_CUDA
    return kvcore::take_device_error();
#else
    return std::string();
#endif
  });
  m.def("set_cpu_grain", [](int64_t bytes) { kvcore::g_cpu_grain.store(std::max<int64_t>(1, bytes)); });
  m.def("cpu_grain", []() { return kvcore::g_cpu_grain.load(); });
  m.def("set_cuda_pdl", [](bool on) {
#ifdef KVCORE_WITH_CUDA
    kvcore::g_pdl.store(on);
#else
    (void)on;
#endif
  });
}

TORCH_LIBRARY(kvcore, m) {
  m.def("gather(Tensor ptrs, Tensor planes, Tensor slots, Tensor(a!)[] staging, int block_size, int num_slots) -> int");
  m.def("scatter(Tensor ptrs, Tensor planes, Tensor slots, Tensor[] staging, int block_size, int num_slots) -> int");
  // the op-library version: bumped whenever the op schemas or semantics change
  m.def("abi_version() -> int", []() -> int64_t { return 5; });
  // gather/scatter return 0, or non-zero with the reason here (the ops never throw)
  m.def("last_error() -> str", []() -> std::string { return kvcore::g_last_error; });
  // CUDA tuning: loads in flight per thread for device / pinned-host staging (4 or 8)
  m.def("set_cuda_unroll(int device, int host) -> ()", [](int64_t device, int64_t host) {
#ifdef KVCORE_WITH_CUDA
    kvcore::g_unroll = device == 8 ? 8 : 4;
    kvcore::g_unroll_host = host == 8 ? 8 : 4;
#else
    (void)device;
    (void)host;
#endif
  });
}

TORCH_LIBRARY_IMPL(kvcore, CPU, m) {
  m.impl("gather", &kvcore::raw_gather);
  m.impl("scatter", &kvcore::raw_scatter);
}

#ifdef KVCORE_WITH_CUDA
TORCH_LIBRARY_IMPL(kvcore, CUDA, m) {
  m.impl("gather", &kvcore::raw_gather);
  m.impl("scatter", &kvcore::raw_scatter);
}
#endif
