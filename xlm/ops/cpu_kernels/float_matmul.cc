// Weight-streaming float matmul for steps of few rows (decode), for XLA:CPU through its FFI.
//
//   y[r, j] = sum_i x[r, i] * w[i, j]      (w [k, n], xlm's kernel layout)
//   y[r, j] = sum_i x[r, i] * w[j, i]      (`transposed`: w [n, k], an embedding table
//                                           used as the LM head)
//   x f32 [m, k], w f32 / f16 / bf16, y f32 [m, n], products summed in float32.
//
// At a few rows a matmul is a read of w: each weight is read once, sequentially, and
// widened in registers (f16 by F16C's vcvtph2ps, bf16 by a 16-bit shift), with enough
// independent accumulators to keep the FMA units fed while the loads stream.
// - [k, n]: blocks of kKb rows of w swept across the chunk's columns in tiles of 64
//   columns x up to 4 rows of x, sums in registers over the block, added into y (which
//   stays in L1/L2). w is read as kKb sequential streams, each prefetched ahead.
// - [n, k] (the loader's layout for float projections on CPU, and an embedding table used
//   as the LM head): each output is a dot product along a contiguous row of w, kNkStreams
//   rows of w at a time against up to 2 rows of x, then horizontal sums. The rows are one
//   from each part of the thread's chunk, so that a core reads kNkStreams long sequential
//   streams at once: a core has more misses in flight over several streams, and adjacent
//   rows are short streams at k of a few hundred.
//   - AVX2: 4 streams, 8 floats a load; chunks of 4 per thread. On the 2-core AVX2 dev CPU
//     of session 13 one stream read ~9 GB/s on one core, 4 far-apart ones ~12; at one
//     row, per call in a dependent chain, SmolLM2's 576 x 3072 (as [3072, 576]) 557 ->
//     339 us in float32 (XLA's dot on [576, 3072]: 424), 578 -> 197 us in bfloat16.
//   - AVX-512: 2 streams, 32 weights (2 vectors) a row an iteration, and one chunk per
//     thread (each thread's half of the outputs in one piece: long streams, no switch
//     between chunks). On the Zen 5 dev VM of sessions 15-18 (benchmarks/ab_trees.py,
//     alternating trees, medians of 8; RESULTS.md, session 18): one request float32 73.6
//     -> 79.8 tok/s, bfloat16 115.9 -> 130.0 (a quiet retake: 126.2 -> 130.8); batch 8
//     230.8 -> 257.0 and 322.9 -> 376.8 (retake 323.1 -> 364.4).
//     Ad hoc, 2 chunks a thread measured between 1 and 4, and 4 streams in 512-bit
//     vectors level with the AVX2 way.
// The columns (outputs) are split into chunks claimed by the calling thread and XLA's
// intra-op pool (column_split.h). `scalar` runs the portable loops (also where the library
// is built without AVX2 + FMA + F16C).

#include <algorithm>
#include <cstdint>
#include <cstring>
#include <string>

#include "column_split.h"
#include "ffi_shapes.h"
#include "row_groups.h"
#include "xla/ffi/api/ffi.h"

#if defined(__AVX2__) && defined(__FMA__) && defined(__F16C__)
#include <immintrin.h>
#define XLM_HAVE_AVX2 1
#else
#define XLM_HAVE_AVX2 0
#endif
#if XLM_HAVE_AVX2 && defined(__AVX512F__)
#define XLM_HAVE_AVX512 1
#else
#define XLM_HAVE_AVX512 0
#endif

namespace ffi = xla::ffi;

#define XLM_PRAGMA(x) _Pragma(#x)
#if defined(__clang__)
#define XLM_UNROLL XLM_PRAGMA(clang loop unroll(full))
#elif defined(__GNUC__)
#define XLM_UNROLL XLM_PRAGMA(GCC unroll 16)
#else
#define XLM_UNROLL
#endif

namespace {

enum class WType { kF32, kF16, kBF16 };

struct FloatProblem {
  const float* x;
  const void* w;
  float* y;
  int64_t m, k, n;
  WType type;
  bool transposed;
};

constexpr int64_t kTileCols = 64;     // columns of one tile of [k, n]
constexpr int64_t kKb = 16;           // rows of w per block of [k, n]
// Bytes ahead along a row of w to prefetch: 256 read 2-10% faster than 512 at one row of
// [k, n] (single thread, CPU time, alternating in one process; 1024 bytes, and blocks of 4
// or 32 rows of w instead of kKb's 16, were slower), level on [n, k].
constexpr int64_t kPrefetchAhead = 256;
// Above this many rows of x each weight is used often enough to widen it once into a
// float32 tile (a GEMM's packing) rather than in registers at every use.
constexpr int64_t kStreamMaxRows = 8;
// The [n, k] streaming path's streams per thread and chunks per worker (see the top).
constexpr int kNkStreams = XLM_HAVE_AVX512 ? 2 : 4;
constexpr int64_t kNkChunksPerWorker = XLM_HAVE_AVX512 ? 1 : 4;
constexpr int64_t kPackK = 128;   // rows of w per packed [k, n] tile (x 64 columns: 32 KiB)
// Columns of the packed path's register tile (2 vectors), the unit its chunks split in.
constexpr int64_t kPackedChunkCols = XLM_HAVE_AVX512 ? 32 : 16;

// ---- portable loops ----

float half_to_float(uint16_t h) {
  const uint32_t sign = static_cast<uint32_t>(h & 0x8000) << 16;
  uint32_t exponent = (h >> 10) & 0x1f, mantissa = h & 0x3ff, bits;
  if (exponent == 0x1f) {
    bits = sign | 0x7f800000u | (mantissa << 13);
  } else if (exponent != 0) {
    bits = sign | ((exponent + 112) << 23) | (mantissa << 13);
  } else if (mantissa == 0) {
    bits = sign;
  } else {  // subnormal: normalize
    exponent = 113;
    while ((mantissa & 0x400) == 0) {
      mantissa <<= 1;
      --exponent;
    }
    bits = sign | (exponent << 23) | ((mantissa & 0x3ff) << 13);
  }
  float f;
  std::memcpy(&f, &bits, 4);
  return f;
}

inline float load_scalar(const FloatProblem& p, int64_t index) {
  switch (p.type) {
    case WType::kF32: return static_cast<const float*>(p.w)[index];
    case WType::kF16: return half_to_float(static_cast<const uint16_t*>(p.w)[index]);
    default: {
      const uint32_t bits = static_cast<uint32_t>(static_cast<const uint16_t*>(p.w)[index]) << 16;
      float f;
      std::memcpy(&f, &bits, 4);
      return f;
    }
  }
}

void scalar_columns(const FloatProblem& p, int64_t c0, int64_t c1) {
  for (int64_t r = 0; r < p.m; ++r) {
    const float* x = p.x + r * p.k;
    for (int64_t j = c0; j < c1; ++j) {
      float sum = 0.0f;
      for (int64_t i = 0; i < p.k; ++i) {
        sum += x[i] * load_scalar(p, p.transposed ? j * p.k + i : i * p.n + j);
      }
      p.y[r * p.n + j] = sum;
    }
  }
}

#if XLM_HAVE_AVX2

constexpr int kVecRegs = 16;

template <WType T>
struct Elem;
template <>
struct Elem<WType::kF32> {
  using type = float;
};
template <>
struct Elem<WType::kF16> {
  using type = uint16_t;
};
template <>
struct Elem<WType::kBF16> {
  using type = uint16_t;
};

// 8 weights at p, widened to float32.
template <WType T>
inline __m256 load8(const typename Elem<T>::type* p) {
  if constexpr (T == WType::kF32) {
    return _mm256_loadu_ps(p);
  } else if constexpr (T == WType::kF16) {
    return _mm256_cvtph_ps(_mm_loadu_si128(reinterpret_cast<const __m128i*>(p)));
  } else {
    const __m256i wide = _mm256_cvtepu16_epi32(_mm_loadu_si128(reinterpret_cast<const __m128i*>(p)));
    return _mm256_castsi256_ps(_mm256_slli_epi32(wide, 16));
  }
}

// The first `cols` (1..7) weights at p, zero-padded; never reads past p + cols.
template <WType T>
inline __m256 load_partial(const typename Elem<T>::type* p, int cols) {
  typename Elem<T>::type buf[8] = {};
  std::memcpy(buf, p, cols * sizeof(buf[0]));
  return load8<T>(buf);
}

template <WType T>
inline float widen_one(typename Elem<T>::type v) {
  if constexpr (T == WType::kF32) {
    return v;
  } else if constexpr (T == WType::kF16) {
    return _cvtsh_ss(v);
  } else {
    const uint32_t bits = static_cast<uint32_t>(v) << 16;
    float f;
    std::memcpy(&f, &bits, 4);
    return f;
  }
}

inline __m256i lane_mask(int cols) {
  return _mm256_cmpgt_epi32(_mm256_set1_epi32(cols), _mm256_setr_epi32(0, 1, 2, 3, 4, 5, 6, 7));
}

// y[r0 : r0 + MR, j0 : j0 + 8 NV] (+)= x[r0 : r0 + MR, i0 : i1] @ w[i0 : i1, j0 : ...];
// with kTail the last vector holds `tail` (1..7) columns.
template <WType T, int MR, int NV, bool kTail>
void kn_tile(const FloatProblem& p, int64_t r0, int64_t j0, int tail, int64_t i0, int64_t i1,
             bool first) {
  using E = typename Elem<T>::type;
  const int64_t k = p.k, n = p.n;
  const float* x = p.x + r0 * k;
  __m256 acc[MR][NV];
  XLM_UNROLL
  for (int r = 0; r < MR; ++r)
    XLM_UNROLL
    for (int v = 0; v < NV; ++v) acc[r][v] = _mm256_setzero_ps();
  const E* wr = static_cast<const E*>(p.w) + i0 * n + j0;
  for (int64_t i = i0; i < i1; ++i, wr += n) {
    _mm_prefetch(reinterpret_cast<const char*>(wr) + kPrefetchAhead, _MM_HINT_T0);
    __m256 a[MR];
    XLM_UNROLL
    for (int r = 0; r < MR; ++r) a[r] = _mm256_broadcast_ss(x + r * k + i);
    XLM_UNROLL
    for (int v = 0; v < NV; ++v) {
      const __m256 b = (kTail && v == NV - 1) ? load_partial<T>(wr + 8 * v, tail)
                                              : load8<T>(wr + 8 * v);
      XLM_UNROLL
      for (int r = 0; r < MR; ++r) acc[r][v] = _mm256_fmadd_ps(a[r], b, acc[r][v]);
    }
  }
  const __m256i mask = lane_mask(kTail ? tail : 8);
  XLM_UNROLL
  for (int v = 0; v < NV; ++v) {
    const bool partial = kTail && v == NV - 1;
    XLM_UNROLL
    for (int r = 0; r < MR; ++r) {
      float* yp = p.y + (r0 + r) * n + j0 + 8 * v;
      __m256 out = acc[r][v];
      if (!first) out = _mm256_add_ps(out, partial ? _mm256_maskload_ps(yp, mask) : _mm256_loadu_ps(yp));
      if (partial) {
        _mm256_maskstore_ps(yp, mask, out);
      } else {
        _mm256_storeu_ps(yp, out);
      }
    }
  }
}

template <WType T, int MR>
void kn_rows(const FloatProblem& p, int64_t r0, int64_t t0, int64_t t1, int64_t i0, int64_t i1,
             bool first) {
  // Accumulators, MR broadcasts of x and the widened w in the 16 registers.
  constexpr int kFit = (kVecRegs - 2 - MR) / MR;
  constexpr int NV = kFit >= 8 ? 8 : kFit >= 4 ? 4 : kFit >= 2 ? 2 : 1;
  int64_t j = t0;
  for (; j + 8 * NV <= t1; j += 8 * NV) kn_tile<T, MR, NV, false>(p, r0, j, 8, i0, i1, first);
  for (; j + 8 <= t1; j += 8) kn_tile<T, MR, 1, false>(p, r0, j, 8, i0, i1, first);
  if (j < t1) kn_tile<T, MR, 1, true>(p, r0, j, static_cast<int>(t1 - j), i0, i1, first);
}

template <WType T>
void kn_columns(const FloatProblem& p, int64_t c0, int64_t c1) {
  for (int64_t i0 = 0; i0 < p.k; i0 += kKb) {
    const int64_t i1 = std::min(p.k, i0 + kKb);
    for (int64_t t0 = c0; t0 < c1; t0 += kTileCols) {
      const int64_t t1 = std::min(c1, t0 + kTileCols);
      for (int64_t r = 0; r < p.m; r += 4) {
        switch (std::min<int64_t>(4, p.m - r)) {
          case 1: kn_rows<T, 1>(p, r, t0, t1, i0, i1, i0 == 0); break;
          case 2: kn_rows<T, 2>(p, r, t0, t1, i0, i1, i0 == 0); break;
          case 3: kn_rows<T, 3>(p, r, t0, t1, i0, i1, i0 == 0); break;
          default: kn_rows<T, 4>(p, r, t0, t1, i0, i1, i0 == 0); break;
        }
      }
    }
  }
}

// The next packed tile's weights, fetched into L2 a line at a time while the current
// tile's products run (a weight comes from DRAM once per step; fetched only when packed,
// the read and the products took turns instead of overlapping): `rows` runs of
// `row_bytes` bytes, `stride` bytes apart, from `p`.
struct Prefetcher {
  const char* p = nullptr;
  int64_t stride = 0, row_bytes = 0, rows = 0, offset = 0;

  void one() {
    if (rows <= 0) return;
    _mm_prefetch(p + offset, _MM_HINT_T1);
    if ((offset += 64) >= row_bytes) {
      offset = 0;
      p += stride;
      --rows;
    }
  }
};

// A packed tile of w: buf [i1 - i0, kTileCols] float32, w's columns [t0, t0 + cols) at
// rows [i0, i1) of the [k, n] matrix it stands for; `first`: y is written, not added to.
struct Packed {
  const float* buf;
  int64_t t0, cols, i0, i1;
  bool first;
  Prefetcher* next;
};

#if XLM_HAVE_AVX512
using Vec = __m512;
constexpr int kLanes = 16;
constexpr int64_t kMaxMR = 12;  // rows x 2 vectors of sums: 24 of the 32 registers
inline Vec vload(const float* p) { return _mm512_load_ps(p); }
inline Vec vset1(float v) { return _mm512_set1_ps(v); }
inline Vec vfmadd(Vec a, Vec b, Vec c) { return _mm512_fmadd_ps(a, b, c); }
inline Vec vzero() { return _mm512_setzero_ps(); }
// y[0 : valid] (+)= v.
inline void vstore_y(float* y, Vec v, int64_t valid, bool first) {
  const __mmask16 mask = static_cast<__mmask16>((1u << valid) - 1);
  if (!first) v = _mm512_add_ps(v, _mm512_maskz_loadu_ps(mask, y));
  _mm512_mask_storeu_ps(y, mask, v);
}
#else
using Vec = __m256;
constexpr int kLanes = 8;
constexpr int64_t kMaxMR = 6;  // rows x 2 vectors of sums: 12 of the 16 registers
inline Vec vload(const float* p) { return _mm256_load_ps(p); }
inline Vec vset1(float v) { return _mm256_set1_ps(v); }
inline Vec vfmadd(Vec a, Vec b, Vec c) { return _mm256_fmadd_ps(a, b, c); }
inline Vec vzero() { return _mm256_setzero_ps(); }
inline void vstore_y(float* y, Vec v, int64_t valid, bool first) {
  if (valid == 8) {
    if (!first) v = _mm256_add_ps(v, _mm256_loadu_ps(y));
    _mm256_storeu_ps(y, v);
  } else {
    const __m256i mask = lane_mask(static_cast<int>(valid));
    if (!first) v = _mm256_add_ps(v, _mm256_maskload_ps(y, mask));
    _mm256_maskstore_ps(y, mask, v);
  }
}
#endif

// y[r0 : r0 + MR, t0 + 2 kLanes s : + 2 kLanes] (+)= x[r0 : r0 + MR, i0 : i1] @ the packed
// tile's 2 vectors of columns at s, MR x 2 vectors of sums in registers; one line of the
// next tile prefetched every other row of w.
template <int MR>
void packed_tile(const FloatProblem& p, const Packed& t, int64_t r0, int s) {
  const int64_t k = p.k, n = p.n;
  const float* x = p.x + r0 * k + t.i0;
  const float* b = t.buf + 2 * kLanes * s;
  Vec acc[MR][2];
  XLM_UNROLL
  for (int r = 0; r < MR; ++r) acc[r][0] = acc[r][1] = vzero();
  for (int64_t i = 0; i < t.i1 - t.i0; ++i, b += kTileCols) {
    if (i & 1) t.next->one();
    const Vec b0 = vload(b), b1 = vload(b + kLanes);
    XLM_UNROLL
    for (int r = 0; r < MR; ++r) {
      const Vec a = vset1(x[r * k + i]);
      acc[r][0] = vfmadd(a, b0, acc[r][0]);
      acc[r][1] = vfmadd(a, b1, acc[r][1]);
    }
  }
  XLM_UNROLL
  for (int v = 0; v < 2; ++v) {
    const int64_t valid = std::min<int64_t>(kLanes, t.cols - 2 * kLanes * s - kLanes * v);
    if (valid <= 0) break;
    XLM_UNROLL
    for (int r = 0; r < MR; ++r) {
      vstore_y(p.y + (r0 + r) * n + t.t0 + 2 * kLanes * s + kLanes * v, acc[r][v], valid,
               t.first);
    }
  }
}

template <int MR>
void packed_rows(const FloatProblem& p, const Packed& t, int64_t r0) {
  for (int s = 0; 2 * kLanes * s < t.cols; ++s) packed_tile<MR>(p, t, r0, s);
}

// The 8 x 8 block in r[0..8) transposed in place.
inline void transpose8(__m256 r[8]) {
  __m256 t[8], u[8];
  for (int c = 0; c < 8; c += 2) {
    t[c] = _mm256_unpacklo_ps(r[c], r[c + 1]);
    t[c + 1] = _mm256_unpackhi_ps(r[c], r[c + 1]);
  }
  for (int c = 0; c < 8; c += 4) {
    u[c] = _mm256_shuffle_ps(t[c], t[c + 2], 0x44);
    u[c + 1] = _mm256_shuffle_ps(t[c], t[c + 2], 0xEE);
    u[c + 2] = _mm256_shuffle_ps(t[c + 1], t[c + 3], 0x44);
    u[c + 3] = _mm256_shuffle_ps(t[c + 1], t[c + 3], 0xEE);
  }
  for (int c = 0; c < 4; ++c) {
    r[c] = _mm256_permute2f128_ps(u[c], u[c + 4], 0x20);
    r[c + 4] = _mm256_permute2f128_ps(u[c], u[c + 4], 0x31);
  }
}

// buf [i1 - i0 rounded up to 8, kTileCols] = w's columns [t0, t0 + cols) at rows [i0, i1)
// of the [k, n] matrix it stands for, widened to float32, zero past `cols` (and past i1).
template <WType T, bool kTransposed>
void pack_tile(const FloatProblem& p, float* buf, int64_t t0, int64_t cols, int64_t i0,
               int64_t i1) {
  using E = typename Elem<T>::type;
  const E* w = static_cast<const E*>(p.w);
  if constexpr (!kTransposed) {
    for (int64_t i = i0; i < i1; ++i) {
      const E* src = w + i * p.n + t0;
      float* dst = buf + (i - i0) * kTileCols;
      for (int64_t j = 0; j < kTileCols; j += 8) {
        const int64_t valid = std::min<int64_t>(8, cols - j);
        _mm256_store_ps(dst + j, valid == 8  ? load8<T>(src + j)
                                 : valid > 0 ? load_partial<T>(src + j, static_cast<int>(valid))
                                             : _mm256_setzero_ps());
      }
    }
  } else {  // rows of w [n, k] are columns here: 8 x 8 blocks widened and transposed
    for (int64_t j = 0; j < kTileCols; j += 8) {
      for (int64_t i = i0; i < i1; i += 8) {
        const int valid_i = static_cast<int>(std::min<int64_t>(8, i1 - i));
        __m256 r[8];
        for (int c = 0; c < 8; ++c) {
          const E* src = w + (t0 + j + c) * p.k + i;
          // 8 rows read side by side in short runs: their next block, ahead of time.
          _mm_prefetch(reinterpret_cast<const char*>(src + kPackK), _MM_HINT_T0);
          r[c] = j + c >= cols  ? _mm256_setzero_ps()
                 : valid_i == 8 ? load8<T>(src)
                                : load_partial<T>(src, valid_i);
        }
        transpose8(r);
        for (int c = 0; c < 8; ++c) _mm256_store_ps(buf + (i - i0 + c) * kTileCols + j, r[c]);
      }
    }
  }
}

// The weights of the packed tile of columns [t0, t0 + cols) and rows [i0, i1) of the
// [k, n] matrix w stands for.
template <WType T, bool kTransposed>
Prefetcher tile_source(const FloatProblem& p, int64_t t0, int64_t cols, int64_t i0, int64_t i1) {
  const int64_t size = sizeof(typename Elem<T>::type);
  const char* w = static_cast<const char*>(p.w);
  if constexpr (kTransposed) {  // rows t0.. of w [n, k], (i1 - i0) elements each
    return {w + (t0 * p.k + i0) * size, p.k * size, (i1 - i0) * size, cols};
  } else {  // rows i0.. of w [k, n], cols elements each
    return {w + (i0 * p.n + t0) * size, p.n * size, cols * size, i1 - i0};
  }
}

// Many rows of x: each [kPackK, 64] tile of w widened once into a float32 buffer (a
// GEMM's packing; transposed from w [n, k]), then every row of x against it, in groups of
// up to kMaxMR rows x 2 vectors of columns (AVX-512: 12 rows x 32 columns, 24 registers
// of sums; AVX2: 6 x 16, 12), while the next tile's weights are prefetched; a tile's sums
// in y stay in cache across its blocks of k.
template <WType T, bool kTransposed>
void packed_columns(const FloatProblem& p, int64_t c0, int64_t c1) {
  alignas(64) float buf[kPackK * kTileCols];
  Prefetcher next;
  for (int64_t t0 = c0; t0 < c1; t0 += kTileCols) {
    const int64_t cols = std::min(kTileCols, c1 - t0);
    for (int64_t i0 = 0; i0 < p.k; i0 += kPackK) {
      const int64_t i1 = std::min(p.k, i0 + kPackK);
      pack_tile<T, kTransposed>(p, buf, t0, cols, i0, i1);
      if (i1 < p.k) {
        next = tile_source<T, kTransposed>(p, t0, cols, i1, std::min(p.k, i1 + kPackK));
      } else if (t0 + kTileCols < c1) {
        const int64_t t1 = t0 + kTileCols;
        next = tile_source<T, kTransposed>(p, t1, std::min(kTileCols, c1 - t1), 0,
                                           std::min(p.k, kPackK));
      } else {
        next = Prefetcher{};
      }
      const Packed t{buf, t0, cols, i0, i1, i0 == 0, &next};
      // Rows in near-equal groups of at most kMaxMR (row_groups.h).
      xlm::ForRowGroups<kMaxMR>(p.m, [&](int64_t r, auto mr) {
        packed_rows<decltype(mr)::value>(p, t, r);
      });
    }
  }
}

inline float hsum(__m256 v) {
  __m128 s = _mm_add_ps(_mm256_castps256_ps128(v), _mm256_extractf128_ps(v, 1));
  s = _mm_add_ps(s, _mm_movehl_ps(s, s));
  s = _mm_add_ss(s, _mm_movehdup_ps(s));
  return _mm_cvtss_f32(s);
}

// y[r0 : r0 + MR, j0 + c * js] = x[r0 : r0 + MR] . w[j0 + c * js] for c < NJ (rows of w
// `js` rows apart, the first at `w`).
template <WType T, int MR, int NJ>
void nk_tile(const FloatProblem& p, const typename Elem<T>::type* w, int64_t r0, int64_t j0,
             int64_t js = 1) {
  const int64_t k = p.k;
  const float* x = p.x + r0 * k;
  __m256 acc[MR][NJ];
  XLM_UNROLL
  for (int r = 0; r < MR; ++r)
    XLM_UNROLL
    for (int c = 0; c < NJ; ++c) acc[r][c] = _mm256_setzero_ps();
  int64_t i = 0;
  for (; i + 8 <= k; i += 8) {
    __m256 a[MR];
    XLM_UNROLL
    for (int r = 0; r < MR; ++r) a[r] = _mm256_loadu_ps(x + r * k + i);
    XLM_UNROLL
    for (int c = 0; c < NJ; ++c) {
      _mm_prefetch(reinterpret_cast<const char*>(w + c * js * k + i) + kPrefetchAhead, _MM_HINT_T0);
      const __m256 b = load8<T>(w + c * js * k + i);
      XLM_UNROLL
      for (int r = 0; r < MR; ++r) acc[r][c] = _mm256_fmadd_ps(a[r], b, acc[r][c]);
    }
  }
  XLM_UNROLL
  for (int r = 0; r < MR; ++r) {
    XLM_UNROLL
    for (int c = 0; c < NJ; ++c) {
      float sum = hsum(acc[r][c]);
      for (int64_t t = i; t < k; ++t) sum += x[r * k + t] * widen_one<T>(w[c * js * k + t]);
      p.y[(r0 + r) * p.n + j0 + c * js] = sum;
    }
  }
}

#if XLM_HAVE_AVX512
// 16 weights at p, widened to float32.
template <WType T>
inline __m512 load16(const typename Elem<T>::type* p) {
  if constexpr (T == WType::kF32) {
    return _mm512_loadu_ps(p);
  } else if constexpr (T == WType::kF16) {
    return _mm512_cvtph_ps(_mm256_loadu_si256(reinterpret_cast<const __m256i*>(p)));
  } else {
    const __m512i wide =
        _mm512_cvtepu16_epi32(_mm256_loadu_si256(reinterpret_cast<const __m256i*>(p)));
    return _mm512_castsi512_ps(_mm512_slli_epi32(wide, 16));
  }
}

// nk_tile in 512-bit vectors: each row of w read 32 weights (2 vectors) an iteration.
template <WType T, int MR, int NJ>
void nk_tile512(const FloatProblem& p, const typename Elem<T>::type* w, int64_t r0, int64_t j0,
                int64_t js = 1) {
  using E = typename Elem<T>::type;
  constexpr int64_t kLineElems = 64 / sizeof(E);
  const int64_t k = p.k;
  const float* x = p.x + r0 * k;
  __m512 acc[MR][NJ][2];
  XLM_UNROLL
  for (int r = 0; r < MR; ++r)
    XLM_UNROLL
    for (int c = 0; c < NJ; ++c) acc[r][c][0] = acc[r][c][1] = _mm512_setzero_ps();
  int64_t i = 0;
  for (; i + 32 <= k; i += 32) {
    __m512 a[MR][2];
    XLM_UNROLL
    for (int r = 0; r < MR; ++r) {
      a[r][0] = _mm512_loadu_ps(x + r * k + i);
      a[r][1] = _mm512_loadu_ps(x + r * k + i + 16);
    }
    XLM_UNROLL
    for (int c = 0; c < NJ; ++c) {
      const E* wc = w + c * js * k + i;
      XLM_UNROLL
      for (int64_t e = 0; e < 32; e += kLineElems) {
        _mm_prefetch(reinterpret_cast<const char*>(wc + e) + kPrefetchAhead, _MM_HINT_T0);
      }
      const __m512 b0 = load16<T>(wc), b1 = load16<T>(wc + 16);
      XLM_UNROLL
      for (int r = 0; r < MR; ++r) {
        acc[r][c][0] = _mm512_fmadd_ps(a[r][0], b0, acc[r][c][0]);
        acc[r][c][1] = _mm512_fmadd_ps(a[r][1], b1, acc[r][c][1]);
      }
    }
  }
  for (; i + 16 <= k; i += 16) {
    XLM_UNROLL
    for (int c = 0; c < NJ; ++c) {
      const __m512 b = load16<T>(w + c * js * k + i);
      XLM_UNROLL
      for (int r = 0; r < MR; ++r) {
        acc[r][c][0] = _mm512_fmadd_ps(_mm512_loadu_ps(x + r * k + i), b, acc[r][c][0]);
      }
    }
  }
  XLM_UNROLL
  for (int r = 0; r < MR; ++r) {
    XLM_UNROLL
    for (int c = 0; c < NJ; ++c) {
      float sum = _mm512_reduce_add_ps(_mm512_add_ps(acc[r][c][0], acc[r][c][1]));
      for (int64_t t = i; t < k; ++t) sum += x[r * k + t] * widen_one<T>(w[c * js * k + t]);
      p.y[(r0 + r) * p.n + j0 + c * js] = sum;
    }
  }
}
#endif

template <WType T, int MR, int NJ>
inline void nk_stream_tile(const FloatProblem& p, const typename Elem<T>::type* w, int64_t r0,
                           int64_t j0, int64_t js = 1) {
#if XLM_HAVE_AVX512
  nk_tile512<T, MR, NJ>(p, w, r0, j0, js);
#else
  nk_tile<T, MR, NJ>(p, w, r0, j0, js);
#endif
}

// Outputs [j0, j1) of rows [r0, r1) of x against rows of w starting at `w` (row j0): the
// chunk's rows of w in kNkStreams parts, a tile taking one row of each, so that a core
// reads kNkStreams long sequential streams at once (see the top).
template <WType T, int MR>
void nk_rows(const FloatProblem& p, const typename Elem<T>::type* w, int64_t r0, int64_t r1,
             int64_t j0, int64_t j1) {
  const int64_t part = (j1 - j0) / kNkStreams;
  for (int64_t r = r0; r + MR <= r1; r += MR) {
    for (int64_t j = j0; j < j0 + part; ++j) {
      nk_stream_tile<T, MR, kNkStreams>(p, w + (j - j0) * p.k, r, j, part);
    }
    for (int64_t j = j0 + kNkStreams * part; j < j1; ++j) {
      nk_stream_tile<T, MR, 1>(p, w + (j - j0) * p.k, r, j);
    }
  }
}

template <WType T>
void nk_columns(const FloatProblem& p, int64_t c0, int64_t c1) {
  using E = typename Elem<T>::type;
  const E* w = static_cast<const E*>(p.w);
  nk_rows<T, 2>(p, w + c0 * p.k, 0, p.m & ~int64_t{1}, c0, c1);
  if (p.m & 1) nk_rows<T, 1>(p, w + c0 * p.k, p.m - 1, p.m, c0, c1);
}

template <WType T>
void avx2_columns(const FloatProblem& p, int64_t c0, int64_t c1) {
  if (p.m > kStreamMaxRows) {
    return p.transposed ? packed_columns<T, true>(p, c0, c1) : packed_columns<T, false>(p, c0, c1);
  }
  if (p.transposed) return nk_columns<T>(p, c0, c1);
  kn_columns<T>(p, c0, c1);
}

#endif  // XLM_HAVE_AVX2

using xlm::shape_str;

ffi::Error FloatMatmulImpl(ffi::ThreadPool pool, ffi::Buffer<ffi::F32> x, ffi::AnyBuffer w,
                           ffi::ResultBuffer<ffi::F32> y, int64_t max_workers, int64_t scalar,
                           int64_t transposed) {
  const auto xd = x.dimensions(), wd = w.dimensions(), yd = y->dimensions();
  auto shapes = [&] {
    return "x " + shape_str(xd) + ", w " + shape_str(wd) + ", y " + shape_str(yd);
  };
  if (xd.size() != 2 || wd.size() != 2 || yd.size() != 2) {
    return ffi::Error::InvalidArgument("xlm_float_matmul: x, w and y must be 2-D; got " + shapes());
  }
  const int64_t m = xd[0], k = xd[1], n = transposed ? wd[0] : wd[1];
  if ((transposed ? wd[1] : wd[0]) != k || yd[0] != m || yd[1] != n) {
    return ffi::Error::InvalidArgument(
        std::string("xlm_float_matmul: want x [m, k], w ") +
        (transposed ? "[n, k]" : "[k, n]") + ", y [m, n]; got " + shapes());
  }
  WType type;
  switch (w.element_type()) {
    case ffi::DataType::F32: type = WType::kF32; break;
    case ffi::DataType::F16: type = WType::kF16; break;
    case ffi::DataType::BF16: type = WType::kBF16; break;
    default:
      return ffi::Error::InvalidArgument("xlm_float_matmul: w must be f32, f16 or bf16");
  }
  const FloatProblem p{x.typed_data(), w.untyped_data(), y->typed_data(), m, k, n, type,
                       transposed != 0};
  if (m == 0 || n == 0) return ffi::Error::Success();
  if (k == 0) {
    std::fill(p.y, p.y + m * n, 0.0f);
    return ffi::Error::Success();
  }
  auto compute = [p, scalar](int64_t c0, int64_t c1) {
#if XLM_HAVE_AVX2
    if (!scalar) {
      switch (p.type) {
        case WType::kF32: return avx2_columns<WType::kF32>(p, c0, c1);
        case WType::kF16: return avx2_columns<WType::kF16>(p, c0, c1);
        default: return avx2_columns<WType::kBF16>(p, c0, c1);
      }
    }
#endif
    scalar_columns(p, c0, c1);
  };
  // [k, n] at 1-8 rows: chunks of whole 64-column tiles; [n, k] at 1-8 rows: multiples of 4
  // outputs; many rows: of the register tile's width (AVX-512 32, else 16), which balances
  // 2 threads on 576 columns (9 tiles of 64 split 6 / 4 at best) and, unlike 16 under
  // AVX-512, leaves no chunk a half-empty register tile (576 columns: 8 chunks of 64 + 16
  // columns ran at 0.8x the GFLOP/s of 1536 columns' 192-column chunks; now 6 of 96).
  const int64_t tile = m > kStreamMaxRows ? kPackedChunkCols : transposed ? 16 : kTileCols;
  const int64_t chunks_per_worker = m <= kStreamMaxRows && transposed
                                        ? kNkChunksPerWorker
                                        : xlm::kDefaultChunksPerWorker;
  xlm::RunColumns(pool, n, tile, m, m * k * n, max_workers, compute, 0, chunks_per_worker);
  return ffi::Error::Success();
}

}  // namespace

XLA_FFI_DEFINE_HANDLER_SYMBOL(XlmFloatMatmul, FloatMatmulImpl,
                              ffi::Ffi::Bind()
                                  .Ctx<ffi::ThreadPool>()
                                  .Arg<ffi::Buffer<ffi::F32>>()  // x [m, k]
                                  .Arg<ffi::AnyBuffer>()         // w [k, n] ([n, k]) f32/f16/bf16
                                  .Ret<ffi::Buffer<ffi::F32>>()  // y [m, n]
                                  .Attr<int64_t>("max_workers")  // threads to use; 0: all
                                  .Attr<int64_t>("scalar")       // 1: the portable loops
                                  .Attr<int64_t>("transposed")   // 1: w is [n, k]
);

// The widest vectors this build's loops use (every source is built with the same flags):
// 512 (AVX-512), 256 (AVX2 + FMA + F16C), 0 (the portable loops only).
extern "C" int xlm_cpu_kernels_vector_bits() {
  return XLM_HAVE_AVX512 ? 512 : XLM_HAVE_AVX2 ? 256 : 0;
}
