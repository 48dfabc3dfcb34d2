// kvcore CPU kernels: moving a tile of small items between two 2-D grids, transposed.
//
// A plane whose head is not one contiguous run (n_chunks > 1: a column-major [HS, BS] K
// block, VNNI tiles [BS/16, HS/2, 16, 2], 16-byte chunks [HS/x, BS, x]) keeps, for a run of
// consecutive tokens of one block, the items of one chunk index side by side across the
// tokens (token stride == chunk bytes), while the staged row keeps one token's chunks side
// by side. Moving such a run is a transpose of an [n_chunks, tokens] grid of S-byte items,
// S = chunk_bytes; done item by item it costs one call per item (2 bytes for a bf16
// column-major K). Here it is done in 16-byte register tiles of (16/S) x (16/S) items:
// 16/S loads, log2(16/S) rounds of interleaves, 16/S stores (SSE2, the x86-64 baseline; a
// scalar tile elsewhere). Nothing here knows a format: the caller passes strides.
#pragma once
#include <cstdint>
#include <cstring>

#if defined(__SSE2__)
#include <emmintrin.h>
#endif
#if defined(__x86_64__) && defined(__GNUC__)
#include <immintrin.h>
#define KVCORE_TILE_AVX2 1
#endif

namespace kvcore {
namespace tile {

// One S-byte item (a fixed-size memcpy compiles to one move).
template <int S>
static inline void item(char* __restrict d, const char* __restrict s) {
  std::memcpy(d, s, S);
}

constexpr int bitrev(int i, int bits) {
  int r = 0;
  for (int b = 0; b < bits; ++b) r |= ((i >> b) & 1) << (bits - 1 - b);
  return r;
}
constexpr int log2i(int v) { return v <= 1 ? 0 : 1 + log2i(v / 2); }

#if defined(__SSE2__)
template <int W>
static inline __m128i unpack_lo(__m128i a, __m128i b) {
  if constexpr (W == 1) return _mm_unpacklo_epi8(a, b);
  else if constexpr (W == 2) return _mm_unpacklo_epi16(a, b);
  else if constexpr (W == 4) return _mm_unpacklo_epi32(a, b);
  else return _mm_unpacklo_epi64(a, b);
}
template <int W>
static inline __m128i unpack_hi(__m128i a, __m128i b) {
  if constexpr (W == 1) return _mm_unpackhi_epi8(a, b);
  else if constexpr (W == 2) return _mm_unpackhi_epi16(a, b);
  else if constexpr (W == 4) return _mm_unpackhi_epi32(a, b);
  else return _mm_unpackhi_epi64(a, b);
}

// Interleave rounds: round w pairs registers (2i, 2i+1) at w-byte granularity; after the
// last round register i holds column bitrev(i).
template <int W, int V>
static inline void rounds(__m128i* x) {
  if constexpr (W < 16) {
    __m128i y[V];
    for (int i = 0; i < V / 2; ++i) {
      y[i] = unpack_lo<W>(x[2 * i], x[2 * i + 1]);
      y[i + V / 2] = unpack_hi<W>(x[2 * i], x[2 * i + 1]);
    }
    for (int i = 0; i < V; ++i) x[i] = y[i];
    rounds<W * 2, V>(x);
  }
}
#endif

// A V x V tile (V = 16 / S): src row r (16 bytes at src + r * ss) becomes column r of dst
// (item r of the 16 bytes at dst + c * ds, for every c).
template <int S>
static inline void tile16(char* __restrict dst, int64_t ds, const char* __restrict src, int64_t ss) {
  constexpr int V = 16 / S;
#if defined(__SSE2__)
  __m128i x[V];
  for (int r = 0; r < V; ++r) x[r] = _mm_loadu_si128(reinterpret_cast<const __m128i*>(src + r * ss));
  rounds<S, V>(x);
  for (int i = 0; i < V; ++i) _mm_storeu_si128(reinterpret_cast<__m128i*>(dst + bitrev(i, log2i(V)) * ds), x[i]);
#else
  for (int c = 0; c < V; ++c)
    for (int r = 0; r < V; ++r) item<S>(dst + c * ds + r * S, src + r * ss + c * S);
#endif
}

// dst item (c, r) = src item (r, c) for r < R, c < C: src rows are ss bytes apart and hold C
// items side by side; dst rows are ds bytes apart and hold R items side by side.
//
// The side whose rows lie farther apart (the staged rows, a token's whole record apart) is
// finished V rows at a time: rows that far apart share few cache sets, so revisiting them for
// every 16 bytes would evict them between visits; the compact side (a block's chunk rows, a
// few KiB) stays in L1 while it is read or written 16 bytes per row at a time.
template <int S>
static inline void transpose(char* __restrict dst, int64_t ds, const char* __restrict src, int64_t ss, int64_t R, int64_t C) {
  constexpr int V = 16 / S;
  const int64_t R0 = R - R % V, C0 = C - C % V;
  if (ds > ss) {  // dst rows far apart: dst rows outermost
    for (int64_t c0 = 0; c0 < C0; c0 += V) {
      for (int64_t r0 = 0; r0 < R0; r0 += V) tile16<S>(dst + c0 * ds + r0 * S, ds, src + r0 * ss + c0 * S, ss);
      for (int64_t c = c0; c < c0 + V; ++c)
        for (int64_t r = R0; r < R; ++r) item<S>(dst + c * ds + r * S, src + r * ss + c * S);
    }
    for (int64_t c = C0; c < C; ++c)
      for (int64_t r = 0; r < R; ++r) item<S>(dst + c * ds + r * S, src + r * ss + c * S);
  } else {  // src rows far apart (or alike): src rows outermost
    for (int64_t r0 = 0; r0 < R0; r0 += V) {
      for (int64_t c0 = 0; c0 < C0; c0 += V) tile16<S>(dst + c0 * ds + r0 * S, ds, src + r0 * ss + c0 * S, ss);
      for (int64_t r = r0; r < r0 + V; ++r)
        for (int64_t c = C0; c < C; ++c) item<S>(dst + c * ds + r * S, src + r * ss + c * S);
    }
    for (int64_t r = R0; r < R; ++r)
      for (int64_t c = 0; c < C; ++c) item<S>(dst + c * ds + r * S, src + r * ss + c * S);
  }
}

#if defined(KVCORE_TILE_AVX2)
// AVX2 (chosen at run time): two V x V tiles per register pass, rows r0..r0+V-1 in the low
// 128-bit lane and r0+V..r0+2V-1 in the high lane (the interleaves work per lane), so a
// column of dst gets 2V items (32 bytes) in one store.
template <int W>
__attribute__((target("avx2"))) static inline __m256i unpack_lo256(__m256i a, __m256i b) {
  if constexpr (W == 1) return _mm256_unpacklo_epi8(a, b);
  else if constexpr (W == 2) return _mm256_unpacklo_epi16(a, b);
  else if constexpr (W == 4) return _mm256_unpacklo_epi32(a, b);
  else return _mm256_unpacklo_epi64(a, b);
}
template <int W>
__attribute__((target("avx2"))) static inline __m256i unpack_hi256(__m256i a, __m256i b) {
  if constexpr (W == 1) return _mm256_unpackhi_epi8(a, b);
  else if constexpr (W == 2) return _mm256_unpackhi_epi16(a, b);
  else if constexpr (W == 4) return _mm256_unpackhi_epi32(a, b);
  else return _mm256_unpackhi_epi64(a, b);
}
template <int W, int V>
__attribute__((target("avx2"))) static inline void rounds256(__m256i* x) {
  if constexpr (W < 16) {
    __m256i y[V];
    for (int i = 0; i < V / 2; ++i) {
      y[i] = unpack_lo256<W>(x[2 * i], x[2 * i + 1]);
      y[i + V / 2] = unpack_hi256<W>(x[2 * i], x[2 * i + 1]);
    }
    for (int i = 0; i < V; ++i) x[i] = y[i];
    rounds256<W * 2, V>(x);
  }
}
template <int S>
__attribute__((target("avx2"))) static inline void tile32(char* __restrict dst, int64_t ds, const char* __restrict src, int64_t ss) {
  constexpr int V = 16 / S;
  __m256i x[V];
  for (int r = 0; r < V; ++r)
    x[r] = _mm256_inserti128_si256(_mm256_castsi128_si256(_mm_loadu_si128(reinterpret_cast<const __m128i*>(src + r * ss))),
                                   _mm_loadu_si128(reinterpret_cast<const __m128i*>(src + (r + V) * ss)), 1);
  rounds256<S, V>(x);
  for (int i = 0; i < V; ++i) _mm256_storeu_si256(reinterpret_cast<__m256i*>(dst + bitrev(i, log2i(V)) * ds), x[i]);
}

// transpose<S> with the 2V-row tiles where 2V rows remain.
template <int S>
__attribute__((target("avx2"))) void transpose_avx2(char* __restrict dst, int64_t ds, const char* __restrict src, int64_t ss, int64_t R,
                                                    int64_t C) {
  constexpr int V = 16 / S;
  const int64_t R0 = R - R % V, R1 = R - R % (2 * V), C0 = C - C % V;
  if (ds > ss) {
    for (int64_t c0 = 0; c0 < C0; c0 += V) {
      for (int64_t r0 = 0; r0 < R1; r0 += 2 * V) tile32<S>(dst + c0 * ds + r0 * S, ds, src + r0 * ss + c0 * S, ss);
      if (R1 < R0) tile16<S>(dst + c0 * ds + R1 * S, ds, src + R1 * ss + c0 * S, ss);
      for (int64_t c = c0; c < c0 + V; ++c)
        for (int64_t r = R0; r < R; ++r) item<S>(dst + c * ds + r * S, src + r * ss + c * S);
    }
    for (int64_t c = C0; c < C; ++c)
      for (int64_t r = 0; r < R; ++r) item<S>(dst + c * ds + r * S, src + r * ss + c * S);
  } else {
    for (int64_t r0 = 0; r0 < R0; r0 += (r0 < R1 ? 2 * V : V)) {
      const bool wide = r0 < R1;
      for (int64_t c0 = 0; c0 < C0; c0 += V) {
        if (wide) tile32<S>(dst + c0 * ds + r0 * S, ds, src + r0 * ss + c0 * S, ss);
        else tile16<S>(dst + c0 * ds + r0 * S, ds, src + r0 * ss + c0 * S, ss);
      }
      for (int64_t r = r0; r < r0 + (wide ? 2 * V : V); ++r)
        for (int64_t c = C0; c < C; ++c) item<S>(dst + c * ds + r * S, src + r * ss + c * S);
    }
    for (int64_t r = R0; r < R; ++r)
      for (int64_t c = 0; c < C; ++c) item<S>(dst + c * ds + r * S, src + r * ss + c * S);
  }
}

static inline bool has_avx2() {
  static const bool yes = __builtin_cpu_supports("avx2");
  return yes;
}
#endif

// Prefetch (into L2) `rows` rows of `bytes` bytes, `stride` bytes apart, for reading or (kWrite)
// writing.
template <bool kWrite>
static inline void prefetch_rows(const char* p, int64_t rows, int64_t stride, int64_t bytes) {
  for (int64_t r = 0; r < rows; ++r, p += stride) {
    const uintptr_t end = reinterpret_cast<uintptr_t>(p) + static_cast<uintptr_t>(bytes);
    for (uintptr_t a = reinterpret_cast<uintptr_t>(p) & ~uintptr_t{63}; a < end; a += 64)
      __builtin_prefetch(reinterpret_cast<const char*>(a), kWrite ? 1 : 0, 2);
  }
}

// Items of any other size: row by row of src (each src row is C * S contiguous bytes).
static inline void transpose_any(char* __restrict dst, int64_t ds, const char* __restrict src, int64_t ss, int64_t R, int64_t C,
                                 int64_t S) {
  for (int64_t r = 0; r < R; ++r)
    for (int64_t c = 0; c < C; ++c) std::memcpy(dst + c * ds + r * S, src + r * ss + c * S, static_cast<size_t>(S));
}

// The transpose for S-byte items, S chosen at run time.
static inline void transpose_items(char* __restrict dst, int64_t ds, const char* __restrict src, int64_t ss, int64_t R, int64_t C,
                                   int64_t S) {
#if defined(KVCORE_TILE_AVX2)
  if (has_avx2()) {
    switch (S) {
      case 1: transpose_avx2<1>(dst, ds, src, ss, R, C); return;
      case 2: transpose_avx2<2>(dst, ds, src, ss, R, C); return;
      case 4: transpose_avx2<4>(dst, ds, src, ss, R, C); return;
      case 8: transpose_avx2<8>(dst, ds, src, ss, R, C); return;
      default: break;
    }
  }
#endif
  switch (S) {
    case 1: transpose<1>(dst, ds, src, ss, R, C); return;
    case 2: transpose<2>(dst, ds, src, ss, R, C); return;
    case 4: transpose<4>(dst, ds, src, ss, R, C); return;
    case 8: transpose<8>(dst, ds, src, ss, R, C); return;
    case 16:
      for (int64_t r = 0; r < R; ++r)
        for (int64_t c = 0; c < C; ++c) item<16>(dst + c * ds + r * 16, src + r * ss + c * 16);
      return;
    default: transpose_any(dst, ds, src, ss, R, C, S); return;
  }
}

#if defined(KVCORE_TILE_AVX2)
// Pairs (C = 2) with dense rows: a grid of R rows of two S-byte items each, 2 * R * S bytes
// side by side (a chunk's sub-runs of a token pair in a VNNI-style tile: [R, 2] items), and
// two rows of R items, `ds` bytes apart. Gather splits the pairs (even items to row 0, odd
// items to row 1): per 16-byte lane one byte shuffle puts a lane's first items before its
// second items, then 64-bit and 128-bit permutes gather each row's halves. Scatter interleaves
// the two rows (unpack lo/hi per lane, then a 128-bit permute puts the lanes in order).
template <int S>
__attribute__((target("avx2"))) static inline __m256i pair_mask() {
  alignas(32) char m[32];
  for (int lane = 0; lane < 2; ++lane)
    for (int x = 0; x < 16; ++x) {
      const int half = x / 8, y = x % 8;
      m[lane * 16 + x] = static_cast<char>((y / S) * 2 * S + half * S + y % S);
    }
  return _mm256_load_si256(reinterpret_cast<const __m256i*>(m));
}
// dst rows d, d + ds get R items each; src: [R, 2] items, dense. R * S % 16 == 0.
template <int S>
__attribute__((target("avx2"))) static inline void split_pairs(char* __restrict d, int64_t ds, const char* __restrict src, int64_t R,
                                                               __m256i m) {
  const int64_t n = 2 * R * S;  // source bytes
  int64_t k = 0;
  for (; k + 64 <= n; k += 64) {
    __m256i a = _mm256_loadu_si256(reinterpret_cast<const __m256i*>(src + k));
    __m256i b = _mm256_loadu_si256(reinterpret_cast<const __m256i*>(src + k + 32));
    a = _mm256_permute4x64_epi64(_mm256_shuffle_epi8(a, m), 0xD8);  // [row0 16B | row1 16B]
    b = _mm256_permute4x64_epi64(_mm256_shuffle_epi8(b, m), 0xD8);
    _mm256_storeu_si256(reinterpret_cast<__m256i*>(d + k / 2), _mm256_permute2x128_si256(a, b, 0x20));
    _mm256_storeu_si256(reinterpret_cast<__m256i*>(d + ds + k / 2), _mm256_permute2x128_si256(a, b, 0x31));
  }
  if (k < n) {  // 32 source bytes left
    __m256i a = _mm256_loadu_si256(reinterpret_cast<const __m256i*>(src + k));
    a = _mm256_permute4x64_epi64(_mm256_shuffle_epi8(a, m), 0xD8);
    _mm_storeu_si128(reinterpret_cast<__m128i*>(d + k / 2), _mm256_castsi256_si128(a));
    _mm_storeu_si128(reinterpret_cast<__m128i*>(d + ds + k / 2), _mm256_extracti128_si256(a, 1));
  }
}

// dst: [R, 2] items, dense; src rows s, s + ss hold R items each. R * S % 16 == 0.
template <int S>
__attribute__((target("avx2"))) static inline void join_pairs(char* __restrict dst, const char* __restrict s, int64_t ss, int64_t R) {
  const int64_t n = R * S;  // bytes per source row
  int64_t k = 0;
  for (; k + 32 <= n; k += 32) {
    const __m256i x0 = _mm256_loadu_si256(reinterpret_cast<const __m256i*>(s + k));
    const __m256i x1 = _mm256_loadu_si256(reinterpret_cast<const __m256i*>(s + ss + k));
    const __m256i lo = unpack_lo256<S>(x0, x1), hi = unpack_hi256<S>(x0, x1);
    _mm256_storeu_si256(reinterpret_cast<__m256i*>(dst + 2 * k), _mm256_permute2x128_si256(lo, hi, 0x20));
    _mm256_storeu_si256(reinterpret_cast<__m256i*>(dst + 2 * k + 32), _mm256_permute2x128_si256(lo, hi, 0x31));
  }
  if (k < n) {  // 16 bytes per row left
    const __m128i x0 = _mm_loadu_si128(reinterpret_cast<const __m128i*>(s + k));
    const __m128i x1 = _mm_loadu_si128(reinterpret_cast<const __m128i*>(s + ss + k));
    _mm_storeu_si128(reinterpret_cast<__m128i*>(dst + 2 * k), unpack_lo<S>(x0, x1));
    _mm_storeu_si128(reinterpret_cast<__m128i*>(dst + 2 * k + 16), unpack_hi<S>(x0, x1));
  }
}

template <bool kGather, int S>
__attribute__((target("avx2"))) void pairs_avx2(char* cache, int64_t gs, int64_t bs, char* st, int64_t ds, int64_t ng, int64_t nb,
                                                int64_t R) {
  const __m256i m = pair_mask<S>();
  for (int64_t g = 0; g < ng; ++g)
    for (int64_t b = 0; b < nb; ++b) {
      char* c = cache + g * gs + b * bs;
      char* r = st + 2 * g * ds + b * R * S;
      if (kGather) split_pairs<S>(r, ds, c, R, m);
      else join_pairs<S>(c, r, ds, R);
    }
}
#endif

// A batch of small transposes between a cache-side grid and staged rows (bytes):
//   cache item (g, b, r, c) at cache + g * gs + b * bs + r * rs + c * S
//   staged item (g, b, r, c) at st + (g * C + c) * ds + (b * R + r) * S
// for g < ng groups of C tokens (c: a token, its items side by side across the group's
// tokens), b < nb batches of R rows (a head's chunks, or a chunk's sub-runs). Gather moves
// cache -> staged, scatter staged -> cache. Per (g, b) one [R, C] <-> [C, R] transpose; pairs
// of tokens over dense rows (C == 2, rs == 2 * S: VNNI-style tiles) take the pair kernels.
template <bool kGather>
static inline void grid_move(char* cache, int64_t gs, int64_t bs, int64_t rs, char* st, int64_t ds, int64_t ng, int64_t nb, int64_t R,
                             int64_t C, int64_t S) {
#if defined(KVCORE_TILE_AVX2)
  if (C == 2 && rs == 2 * S && (R * S) % 16 == 0 && has_avx2()) {
    switch (S) {
      case 1: pairs_avx2<kGather, 1>(cache, gs, bs, st, ds, ng, nb, R); return;
      case 2: pairs_avx2<kGather, 2>(cache, gs, bs, st, ds, ng, nb, R); return;
      case 4: pairs_avx2<kGather, 4>(cache, gs, bs, st, ds, ng, nb, R); return;
      default: break;
    }
  }
#endif
  for (int64_t g = 0; g < ng; ++g)
    for (int64_t b = 0; b < nb; ++b) {
      char* c = cache + g * gs + b * bs;
      char* r = st + g * C * ds + b * R * S;
      if (kGather) transpose_items(r, ds, c, rs, R, C, S);
      else transpose_items(c, rs, r, ds, C, R, S);
    }
}

}  // namespace tile
}  // namespace kvcore
