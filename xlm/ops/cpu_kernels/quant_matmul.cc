// Weight-only int8 and int4 matmuls for XLA:CPU, called from jitted programs through XLA's
// FFI.
//
//   y[r, j] = sum_g scale[g, j] * sum_{i in group g} x[r, i] * w[i, j]
//   x f32 [m, k], w s8 [k, n], scale f32 [G, n] (groups of k / G rows), y f32 [m, n].
//
// The int4 variant (XlmInt4Matmul) takes w as u8 [k / 2, n], two codes in [0, 15] per byte:
// w[2i, j] in the low nibble of byte [i, j], w[2i + 1, j] in the high one (groups have an
// even number of rows). Each byte is read once and its two codes are unpacked in
// registers (mask, shift, convert); the loops are the int8 ones, two rows of w at a time.
// It also takes the groups' minimums, min f32 [G, n] (W = code * scale + min): the GEMM
// path folds them into its widened tile, the decode path adds each group's input sum times
// them as it stores the group's first block (sums over x computed once per call): adding
// them in XLA cost more than the kernel itself at one row.
//
// The q8 variant (XlmQ8Matmul, w8a8) takes x already quantized: int8 codes xq [m, k] with a
// float32 scale per row and group of w, xscale [m, G] (G groups of 32: llama.cpp's Q8_0 x
// Q8_0; G = 1: per token). Each group's products are summed exactly in int32 (AVX2:
// maddubs + madd on four rows of w interleaved in registers; a portable loop otherwise or
// when asked, `scalar`), then scaled by xscale * scale into y.
// XlmQ8Linear is the same matmul from float32 x [m, k]: the kernel quantizes each row and
// group itself (xlm.ops.cpu_kernels.quantize_activations' rule, bit for bit: scale = amax /
// 127, or 1 where amax is 0; codes = round-half-even(x / scale) clipped to +-127) before the
// columns are split, so that a w8a8 projection in a step is one call rather than an XLA
// quantization fusion and a call (SmolLM2 w8a8: ~180 of each a decode step).
// Its weights may come in strips (xlm.quantization.q8_kernel_strips, the loader's layout for
// w8a8 on CPU): w s8 [n / 32, k / 4, 32, 4], element [s, b, c, r] = w[4b + r, 32s + c],
// and scale f32 [n / 32, G, 32]. Each 32-column strip is then one sequential stream (the
// rows of a group's 4-row blocks already interleaved as maddubs takes them), so that a
// layer's small projections stream closer to the read bandwidth and split evenly over
// threads by whole strips, where the [k, n] tiles read each of a group's 32 rows 16 bytes
// at a time. On the 2-core dev CPU, one row, 2 threads, per call in a dependent chain
// (benchmarks/q8_decode.py, RESULTS.md session 11): SmolLM2's 576 x 3072 317 -> 171 us,
// 1536 x 576 132 -> 79 us, 576 x 960 96 -> 50 us, 576 x 576 65 -> 37 us; its LM head's
// shape 2.5 ms in bands -> 2.0 ms. Strips serve every row count: one row sums a strip's 32
// columns in registers (q8_strip_row), more rows take the 16-column tiles (q8_tile) over
// each half strip (level with the [k, n] paths at 32-256 rows).
// The weight-only int8 kernel (XlmInt8Matmul) takes the same strips (the loader's layout
// for `--quantization int8` on CPU): below kPackedMinRows rows, passes over each strip in
// order (int8_strip_pass: float lanes of 4 columns x 4 rows per 16 bytes, the 4 rows added
// at each group's end); from there on, its GEMM packs its tiles out of the strips. Per call,
// one row, 2 threads (benchmarks/q8_decode.py, session 16): the tied LM head 951 -> 748 us,
// 1536 x 576 59 -> 40 us, 576 x 576 23 -> 18 us against [k, n]'s decode tiles.
//
// XLA converts the whole int8 matrix to float before its dot, which at decode (m of 1 to
// 8) costs several times the float32 dot itself. Here the int8 bytes are read once and
// widened in registers (AVX2 + FMA; a portable loop elsewhere):
// - fewer than kPackedMinRows rows (decode): blocks of kKb rows of w are swept across the
//   columns in tiles of 64 columns x up to 4 rows of x whose sums stay in registers; each
//   block adds its sums, times the group's scale, into y. w is read as kKb sequential
//   streams, and x and the y being summed stay in cache. With AVX-512 the int8 tiles
//   widen 16 bytes per vpmovsxbd and convert (decode_tile512; AVX2 takes two of each).
// - more rows: a GEMM blocked over columns (kPackedPanelCols), k (kKc rows) and tiles of
//   kBufCols columns; each tile of w is widened and multiplied by its scale once into an
//   L1 buffer and reused by every row of x: AVX-512 up to 12 rows x 32 columns of sums in
//   registers, AVX2 6 x 16 (one tile over SVec; rows in near-equal groups, as the float
//   kernel's packed path).
//   SmolLM2 int8, a decode step of 64 rows: 520-576 -> 594-763 tok/s with the 12 x 32
//   tiles (benchmarks/cpu_decode.py, session 16, alternating; noisy machine).
// Known cost: when a row of w is a multiple of 4 KiB (n = 4096, 16384, 49152...), the kKb
// rows of a decode block share one L1 set and evict each other between the passes that
// reuse them (column sub-tiles, blocks of 4 rows of x): 1.3-1.5x slower at 2 to 8 rows.
// Copying the block, walking it in zig-zag or smaller blocks did not pay here; a tiled
// weight layout ([n / 64][k][64]) would avoid it (not tried). The q8 variant's one-row
// path reads such weights in bands of 4 rows instead (q8_bands).
// The columns are split into chunks that the calling thread and tasks on XLA's intra-op
// thread pool (the FFI's ThreadPool context) claim from an atomic counter.

#include <algorithm>
#include <atomic>
#include <chrono>
#include <cmath>
#include <cstdint>
#include <cstring>
#include <memory>
#include <string>
#include <thread>
#include <vector>

#include "column_split.h"
#include "ffi_shapes.h"
#include "row_groups.h"
#include "xla/ffi/api/ffi.h"

#if defined(__AVX2__) && defined(__FMA__)
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

// Fully unrolled loops over the register tile, so that GCC keeps the accumulator arrays
// in registers (rolled, it stores them to the stack on every iteration).
#define XLM_PRAGMA(x) _Pragma(#x)
#if defined(__clang__)
#define XLM_UNROLL XLM_PRAGMA(clang loop unroll(full))
#elif defined(__GNUC__)
#define XLM_UNROLL XLM_PRAGMA(GCC unroll 16)
#else
#define XLM_UNROLL
#endif

namespace {

struct Problem {
  const float* x;
  const int8_t* w;     // int8: w [k, n]; null for int4
  const uint8_t* w4;   // int4: packed w [k / 2, n]; null for int8
  const float* scale;
  float* y;
  int64_t m, k, n, groups, group_size;
  const float* minimum = nullptr;  // int4: [G, n]
  const float* xsum = nullptr;     // int4: [m, G], each row's sum over each group of x
  const int8_t* xq = nullptr;      // q8: x's int8 codes [m, k] (x is null)
  const float* xscale = nullptr;   // q8: x's scales [m, G], one per row and group of w
  bool scalar = false;             // q8: the portable loops even where AVX2 is built
  bool bands = true;               // q8: bands at one row of x (false: tiles; tests, A/B)
  bool strips = false;             // q8: w and scale in 32-column strips (see the top)
};

constexpr int64_t kStripCols = 32;  // columns of one strip of a q8 weight in strips
constexpr int64_t kStripRows = 4;   // rows of one block of a strip (interleaved bytes)

// w[i, j] and scale[g, j] of a q8 problem in either layout (the portable loops).
inline int32_t q8_w_at(const Problem& p, int64_t i, int64_t j) {
  if (!p.strips) return p.w[i * p.n + j];
  return p.w[(j / kStripCols) * p.k * kStripCols + (i / kStripRows) * kStripRows * kStripCols +
             (j % kStripCols) * kStripRows + i % kStripRows];
}
inline float q8_scale_at(const Problem& p, int64_t g, int64_t j) {
  if (!p.strips) return p.scale[g * p.n + j];
  return p.scale[(j / kStripCols) * p.groups * kStripCols + g * kStripCols + j % kStripCols];
}

constexpr int64_t kTileCols = 64;         // columns of one decode tile (a cache line of w)
constexpr int64_t kKb = 16;               // rows of w per decode block
constexpr int64_t kPrefetchBytes = 256;   // how far ahead along a row of w to prefetch
constexpr int64_t kPackedMinRows = 16;    // from this many rows of x on, the packed GEMM
constexpr int64_t kKc = 256;              // rows of w per packed block
// Columns per packed tile: two vectors of sums per row of x (kKc x 32 floats, 32 KiB, with
// AVX-512; x 16, 16 KiB, with AVX2).
#if XLM_HAVE_AVX512
constexpr int kBufCols = 32;
#else
constexpr int kBufCols = 16;
#endif
constexpr int64_t kPackedPanelCols = 1024;  // columns whose y stays in L2 across k blocks

#if XLM_HAVE_AVX2

constexpr int kVecRegs = 16;  // ymm registers of AVX2

inline __m256 widen8(const int8_t* p) {
  __m128i bytes = _mm_loadl_epi64(reinterpret_cast<const __m128i*>(p));
  return _mm256_cvtepi32_ps(_mm256_cvtepi8_epi32(bytes));
}

// The first `cols` (1..7) bytes at p, zero-padded; never reads past p + cols.
inline __m256 widen_partial(const int8_t* p, int cols) {
  int64_t bits = 0;
  std::memcpy(&bits, p, cols);
  return _mm256_cvtepi32_ps(_mm256_cvtepi8_epi32(_mm_cvtsi64_si128(bits)));
}

// The 8 (or the first `cols`, zero-padded) packed bytes at p as 32-bit lanes.
inline __m256i bytes8(const uint8_t* p) {
  return _mm256_cvtepu8_epi32(_mm_loadl_epi64(reinterpret_cast<const __m128i*>(p)));
}
inline __m256i bytes_partial(const uint8_t* p, int cols) {
  int64_t bits = 0;
  std::memcpy(&bits, p, cols);
  return _mm256_cvtepu8_epi32(_mm_cvtsi64_si128(bits));
}
// The low-nibble (even row) and high-nibble (odd row) codes of 8 packed bytes, as floats.
inline __m256 low_codes(__m256i b) {
  return _mm256_cvtepi32_ps(_mm256_and_si256(b, _mm256_set1_epi32(15)));
}
inline __m256 high_codes(__m256i b) { return _mm256_cvtepi32_ps(_mm256_srli_epi32(b, 4)); }

inline __m256i lane_mask(int cols) {
  return _mm256_cmpgt_epi32(_mm256_set1_epi32(cols), _mm256_setr_epi32(0, 1, 2, 3, 4, 5, 6, 7));
}

// y[r0 : r0 + MR, j0 : j0 + 8 * NV] (+)= scale[g] * (x @ w) over the rows [i0, i1) of w,
// all in group g; with kTail the last vector holds only `tail` (1..7) columns.
template <int MR, int NV, bool kTail, bool kInt4>
void decode_tile(const Problem& p, int64_t r0, int64_t j0, int tail, int64_t i0, int64_t i1,
                 bool first) {
  const int64_t k = p.k, n = p.n;
  const float* x = p.x + r0 * k;
  __m256 acc[MR][NV];
  XLM_UNROLL
  for (int r = 0; r < MR; ++r)
    XLM_UNROLL
    for (int v = 0; v < NV; ++v) acc[r][v] = _mm256_setzero_ps();
  if constexpr (kInt4) {
    // One packed row holds rows i and i + 1 of w (i0 and i1 are even).
    const uint8_t* wr = p.w4 + (i0 / 2) * n + j0;
    for (int64_t i = i0; i < i1; i += 2, wr += n) {
      _mm_prefetch(reinterpret_cast<const char*>(wr + kPrefetchBytes), _MM_HINT_T0);
      __m256 a0[MR], a1[MR];
      XLM_UNROLL
      for (int r = 0; r < MR; ++r) {
        a0[r] = _mm256_broadcast_ss(x + r * k + i);
        a1[r] = _mm256_broadcast_ss(x + r * k + i + 1);
      }
      XLM_UNROLL
      for (int v = 0; v < NV; ++v) {
        const __m256i b =
            (kTail && v == NV - 1) ? bytes_partial(wr + 8 * v, tail) : bytes8(wr + 8 * v);
        const __m256 lo = low_codes(b), hi = high_codes(b);
        XLM_UNROLL
        for (int r = 0; r < MR; ++r) {
          acc[r][v] = _mm256_fmadd_ps(a0[r], lo, acc[r][v]);
          acc[r][v] = _mm256_fmadd_ps(a1[r], hi, acc[r][v]);
        }
      }
    }
  } else {
    const int8_t* wr = p.w + i0 * n + j0;
    for (int64_t i = i0; i < i1; ++i, wr += n) {
      // The same row a few tiles on; the hardware prefetchers lose track of kKb streams.
      _mm_prefetch(reinterpret_cast<const char*>(wr + kPrefetchBytes), _MM_HINT_T0);
      __m256 a[MR];
      XLM_UNROLL
      for (int r = 0; r < MR; ++r) a[r] = _mm256_broadcast_ss(x + r * k + i);
      XLM_UNROLL
      for (int v = 0; v < NV; ++v) {
        __m256 b =
            (kTail && v == NV - 1) ? widen_partial(wr + 8 * v, tail) : widen8(wr + 8 * v);
        XLM_UNROLL
        for (int r = 0; r < MR; ++r) acc[r][v] = _mm256_fmadd_ps(a[r], b, acc[r][v]);
      }
    }
  }
  const __m256i mask = lane_mask(kTail ? tail : 8);
  const int64_t g = i0 / p.group_size;
  const float* s = p.scale + g * n + j0;
  // The group's minimums times its input sums, once per group: with its first block.
  const float* mn = (p.minimum != nullptr && i0 % p.group_size == 0) ? p.minimum + g * n + j0
                                                                       : nullptr;
  XLM_UNROLL
  for (int v = 0; v < NV; ++v) {
    const bool partial = kTail && v == NV - 1;
    __m256 sv = partial ? _mm256_maskload_ps(s + 8 * v, mask) : _mm256_loadu_ps(s + 8 * v);
    __m256 mv = _mm256_setzero_ps();
    if (mn != nullptr) {
      mv = partial ? _mm256_maskload_ps(mn + 8 * v, mask) : _mm256_loadu_ps(mn + 8 * v);
    }
    XLM_UNROLL
    for (int r = 0; r < MR; ++r) {
      float* yp = p.y + (r0 + r) * n + j0 + 8 * v;
      __m256 base = _mm256_setzero_ps();
      if (!first) base = partial ? _mm256_maskload_ps(yp, mask) : _mm256_loadu_ps(yp);
      if (mn != nullptr) {
        base = _mm256_fmadd_ps(_mm256_broadcast_ss(p.xsum + (r0 + r) * p.groups + g), mv, base);
      }
      const __m256 out = _mm256_fmadd_ps(acc[r][v], sv, base);
      if (partial) {
        _mm256_maskstore_ps(yp, mask, out);
      } else {
        _mm256_storeu_ps(yp, out);
      }
    }
  }
}

#if XLM_HAVE_AVX512
// decode_tile for int8 w with 16-lane vectors (whole vectors only): each 16 bytes of w
// widened by one vpmovsxbd and one convert where the 8-lane loop takes two of each.
template <int MR, int NV>
void decode_tile512(const Problem& p, int64_t r0, int64_t j0, int64_t i0, int64_t i1,
                    bool first) {
  const int64_t k = p.k, n = p.n;
  const float* x = p.x + r0 * k;
  __m512 acc[MR][NV];
  XLM_UNROLL
  for (int r = 0; r < MR; ++r)
    XLM_UNROLL
    for (int v = 0; v < NV; ++v) acc[r][v] = _mm512_setzero_ps();
  const int8_t* wr = p.w + i0 * n + j0;
  for (int64_t i = i0; i < i1; ++i, wr += n) {
    _mm_prefetch(reinterpret_cast<const char*>(wr + kPrefetchBytes), _MM_HINT_T0);
    __m512 a[MR];
    XLM_UNROLL
    for (int r = 0; r < MR; ++r) a[r] = _mm512_set1_ps(x[r * k + i]);
    XLM_UNROLL
    for (int v = 0; v < NV; ++v) {
      const __m512 b = _mm512_cvtepi32_ps(
          _mm512_cvtepi8_epi32(_mm_loadu_si128(reinterpret_cast<const __m128i*>(wr + 16 * v))));
      XLM_UNROLL
      for (int r = 0; r < MR; ++r) acc[r][v] = _mm512_fmadd_ps(a[r], b, acc[r][v]);
    }
  }
  const float* s = p.scale + (i0 / p.group_size) * n + j0;
  XLM_UNROLL
  for (int v = 0; v < NV; ++v) {
    const __m512 sv = _mm512_loadu_ps(s + 16 * v);
    XLM_UNROLL
    for (int r = 0; r < MR; ++r) {
      float* yp = p.y + (r0 + r) * n + j0 + 16 * v;
      const __m512 base = first ? _mm512_setzero_ps() : _mm512_loadu_ps(yp);
      _mm512_storeu_ps(yp, _mm512_fmadd_ps(acc[r][v], sv, base));
    }
  }
}
#endif

// Columns [t0, t1) (at most one 64-column tile) of rows [r0, r0 + MR), rows [i0, i1) of w.
template <int MR, bool kInt4>
void decode_rows(const Problem& p, int64_t r0, int64_t t0, int64_t t1, int64_t i0, int64_t i1,
                 bool first) {
  // As many 8-column vectors (dividing the 64-column tile) as leave room in the register
  // file for MR * NV accumulators, MR broadcasts of x (int4: 2 MR, two rows of w at a
  // time) and the widened w (int4: the bytes and their two codes).
  constexpr int kFit = kInt4 ? (kVecRegs - 3 - 2 * MR) / MR : (kVecRegs - 2 - MR) / MR;
  constexpr int NV = kFit >= 8 ? 8 : kFit >= 4 ? 4 : kFit >= 2 ? 2 : 1;
  int64_t j = t0;
#if XLM_HAVE_AVX512
  if constexpr (!kInt4) {
    for (; j + 64 <= t1; j += 64) decode_tile512<MR, 4>(p, r0, j, i0, i1, first);
    for (; j + 16 <= t1; j += 16) decode_tile512<MR, 1>(p, r0, j, i0, i1, first);
  }
#endif
  for (; j + 8 * NV <= t1; j += 8 * NV) {
    decode_tile<MR, NV, false, kInt4>(p, r0, j, 8, i0, i1, first);
  }
  for (; j + 8 <= t1; j += 8) decode_tile<MR, 1, false, kInt4>(p, r0, j, 8, i0, i1, first);
  if (j < t1) {
    decode_tile<MR, 1, true, kInt4>(p, r0, j, static_cast<int>(t1 - j), i0, i1, first);
  }
}

template <bool kInt4>
void decode_block(const Problem& p, int64_t rows, int64_t r0, int64_t t0, int64_t t1,
                  int64_t i0, int64_t i1, bool first) {
  switch (rows) {
    case 1: return decode_rows<1, kInt4>(p, r0, t0, t1, i0, i1, first);
    case 2: return decode_rows<2, kInt4>(p, r0, t0, t1, i0, i1, first);
    case 3: return decode_rows<3, kInt4>(p, r0, t0, t1, i0, i1, first);
    case 4: return decode_rows<4, kInt4>(p, r0, t0, t1, i0, i1, first);
    default: return;
  }
}

void decode_columns(const Problem& p, int64_t c0, int64_t c1) {
  // Blocks of kKb rows of w, each swept across the chunk's columns: w is read as kKb
  // sequential streams (one per row) rather than one 64-byte line per row of a column
  // strip, which for wide w meant a new page, and a TLB miss, per line.
  for (int64_t i0 = 0, i1 = 0; i0 < p.k; i0 = i1) {
    // A block never straddles two groups: it ends at the group's end.
    i1 = std::min(i0 + kKb, (i0 / p.group_size + 1) * p.group_size);
    for (int64_t t0 = c0; t0 < c1; t0 += kTileCols) {
      const int64_t t1 = std::min(c1, t0 + kTileCols);
      for (int64_t r = 0; r < p.m; r += 4) {
        const int64_t rows = std::min<int64_t>(4, p.m - r);
        if (p.w4 != nullptr) {
          decode_block<true>(p, rows, r, t0, t1, i0, i1, i0 == 0);
        } else {
          decode_block<false>(p, rows, r, t0, t1, i0, i1, i0 == 0);
        }
      }
    }
  }
}

// ---- weight-only int8 in strips, fewer than kPackedMinRows rows of x ----
// A pass over a strip (or, with AVX2, half of one) reads its 4-row blocks in order, one
// sequential stream: each vector of the pass widens kLanes bytes of a block (kLanes / 4
// columns x their 4 rows, interleaved) and multiplies them by the 4 inputs of those rows
// repeated in each 128-bit lane, 8 vectors of sums per row of x. At a group's end the 4
// rows' products of each column are added (`column_sums`) and scaled into y.
#if XLM_HAVE_AVX512
using SVec = __m512;
constexpr int kLanes = 16;
constexpr int kStripMR = 3;  // rows of x per pass: 24 sums, 3 inputs, w (32 registers)
inline SVec swiden(const int8_t* p) {
  return _mm512_cvtepi32_ps(
      _mm512_cvtepi8_epi32(_mm_loadu_si128(reinterpret_cast<const __m128i*>(p))));
}
inline SVec sinputs(const float* x) { return _mm512_broadcast_f32x4(_mm_loadu_ps(x)); }
inline SVec sfmadd(SVec a, SVec b, SVec c) { return _mm512_fmadd_ps(a, b, c); }
inline SVec szero() { return _mm512_setzero_ps(); }
inline SVec sload(const float* p) { return _mm512_loadu_ps(p); }
inline void sstore(float* p, SVec v) { _mm512_storeu_ps(p, v); }
inline SVec sadd(SVec a, SVec b) { return _mm512_add_ps(a, b); }
inline SVec smul(SVec a, SVec b) { return _mm512_mul_ps(a, b); }
inline SVec sunpacklo(SVec a, SVec b) { return _mm512_unpacklo_ps(a, b); }
inline SVec sunpackhi(SVec a, SVec b) { return _mm512_unpackhi_ps(a, b); }
inline SVec sunpacklo64(SVec a, SVec b) {
  return _mm512_castpd_ps(_mm512_unpacklo_pd(_mm512_castps_pd(a), _mm512_castps_pd(b)));
}
inline SVec sunpackhi64(SVec a, SVec b) {
  return _mm512_castpd_ps(_mm512_unpackhi_pd(_mm512_castps_pd(a), _mm512_castps_pd(b)));
}
// Lane q = 4 l + e of column_sums' result holds column 4 e + l: back in column order.
inline SVec in_column_order(SVec v) {
  return _mm512_permutexvar_ps(
      _mm512_setr_epi32(0, 4, 8, 12, 1, 5, 9, 13, 2, 6, 10, 14, 3, 7, 11, 15), v);
}
#else
using SVec = __m256;
constexpr int kLanes = 8;
constexpr int kStripMR = 1;  // 8 sums, the inputs, w (16 registers)
inline SVec swiden(const int8_t* p) { return widen8(p); }
inline SVec sinputs(const float* x) {
  return _mm256_broadcast_ps(reinterpret_cast<const __m128*>(x));
}
inline SVec sfmadd(SVec a, SVec b, SVec c) { return _mm256_fmadd_ps(a, b, c); }
inline SVec szero() { return _mm256_setzero_ps(); }
inline SVec sload(const float* p) { return _mm256_loadu_ps(p); }
inline void sstore(float* p, SVec v) { _mm256_storeu_ps(p, v); }
inline SVec sadd(SVec a, SVec b) { return _mm256_add_ps(a, b); }
inline SVec smul(SVec a, SVec b) { return _mm256_mul_ps(a, b); }
inline SVec sunpacklo(SVec a, SVec b) { return _mm256_unpacklo_ps(a, b); }
inline SVec sunpackhi(SVec a, SVec b) { return _mm256_unpackhi_ps(a, b); }
inline SVec sunpacklo64(SVec a, SVec b) {
  return _mm256_castpd_ps(_mm256_unpacklo_pd(_mm256_castps_pd(a), _mm256_castps_pd(b)));
}
inline SVec sunpackhi64(SVec a, SVec b) {
  return _mm256_castpd_ps(_mm256_unpackhi_pd(_mm256_castps_pd(a), _mm256_castps_pd(b)));
}
// Lane q = 4 l + e of column_sums' result holds column 2 e + l: back in column order.
inline SVec in_column_order(SVec v) {
  return _mm256_permutevar8x32_ps(v, _mm256_setr_epi32(0, 4, 1, 5, 2, 6, 3, 7));
}
#endif
constexpr int64_t kPassCols = 2 * kLanes;  // columns of one pass: 8 vectors of kLanes / 4

// Four vectors of sums (128-bit lane l of a[e]: one column's 4 rows) -> one vector whose
// lane 4 l + e is the sum of a[e]'s lane l: a 4 x 4 transpose within each 128-bit lane,
// added up (unpacks work within 128-bit lanes at every width).
inline SVec column_sums(const SVec* a) {
  const SVec s0 = sadd(sunpacklo(a[0], a[1]), sunpackhi(a[0], a[1]));
  const SVec s1 = sadd(sunpacklo(a[2], a[3]), sunpackhi(a[2], a[3]));
  return sadd(sunpacklo64(s0, s1), sunpackhi64(s0, s1));
}

// y[r0 : r0 + MR, j0 : j0 + kPassCols] = x[r0 : r0 + MR] @ the strip's columns from j0
// (a strip's column 0, or 16 with AVX2), group by group.
template <int MR>
void int8_strip_pass(const Problem& p, int64_t r0, int64_t j0) {
  const int64_t off = j0 % kStripCols, gs = p.group_size;
  const int8_t* wp = p.w + (j0 / kStripCols) * p.k * kStripCols + off * kStripRows;
  const float* sp = p.scale + (j0 / kStripCols) * p.groups * kStripCols + off;
  for (int64_t g = 0; g < p.groups; ++g, sp += kStripCols) {
    SVec acc[MR][8];
    XLM_UNROLL
    for (int r = 0; r < MR; ++r)
      XLM_UNROLL
      for (int v = 0; v < 8; ++v) acc[r][v] = szero();
    const float* x = p.x + r0 * p.k + g * gs;
    for (int64_t i = 0; i < gs; i += kStripRows, wp += kStripRows * kStripCols) {
      _mm_prefetch(reinterpret_cast<const char*>(wp + 1024), _MM_HINT_T0);
      _mm_prefetch(reinterpret_cast<const char*>(wp + 1024 + 64), _MM_HINT_T0);
      SVec a[MR];
      XLM_UNROLL
      for (int r = 0; r < MR; ++r) a[r] = sinputs(x + r * p.k + i);
      XLM_UNROLL
      for (int v = 0; v < 8; ++v) {
        const SVec b = swiden(wp + kLanes * v);
        XLM_UNROLL
        for (int r = 0; r < MR; ++r) acc[r][v] = sfmadd(a[r], b, acc[r][v]);
      }
    }
    XLM_UNROLL
    for (int h = 0; h < 2; ++h) {
      const SVec scale = sload(sp + kLanes * h);
      XLM_UNROLL
      for (int r = 0; r < MR; ++r) {
        float* yp = p.y + (r0 + r) * p.n + j0 + kLanes * h;
        const SVec sums = smul(in_column_order(column_sums(acc[r] + 4 * h)), scale);
        sstore(yp, g == 0 ? sums : sadd(sload(yp), sums));
      }
    }
  }
}

// Weight-only int8 in strips at fewer than kPackedMinRows rows of x: columns [c0, c1)
// (whole strips) pass by pass, kStripMR rows of x at a time (the passes after a strip's
// first read it from L1/L2).
void int8_strip_columns(const Problem& p, int64_t c0, int64_t c1) {
  for (int64_t j = c0; j < c1; j += kPassCols) {
    int64_t r = 0;
    for (; r + kStripMR <= p.m; r += kStripMR) int8_strip_pass<kStripMR>(p, r, j);
#if XLM_HAVE_AVX512
    if (p.m - r == 2) int8_strip_pass<2>(p, r, j);
#endif
    if (p.m - r == 1) int8_strip_pass<1>(p, r, j);
  }
}

// out[r * kBufCols + c] = w[row + r, j + c] * its scale for r < 4, c < 16, w in strips (row a
// multiple of 4, j at a strip's column 0 or 16): the block's 4 rows x 16 columns, [column]
// [row] bytes, turned into 4 rows of 16 bytes (a byte shuffle per 4 columns, then a 4 x 4
// transpose of 32-bit words), widened and scaled.
inline void unpack_strip_block(const Problem& p, int64_t row, int64_t j, float* out) {
  const int64_t strip = j / kStripCols, off = j % kStripCols;
  const int8_t* b = p.w + strip * p.k * kStripCols + row * kStripCols + off * kStripRows;
  const float* s = p.scale + (strip * p.groups + row / p.group_size) * kStripCols + off;
  const __m128i rows_first = _mm_setr_epi8(0, 4, 8, 12, 1, 5, 9, 13, 2, 6, 10, 14, 3, 7, 11, 15);
  __m128i q[4];
  XLM_UNROLL
  for (int v = 0; v < 4; ++v) {
    const __m128i bytes = _mm_loadu_si128(reinterpret_cast<const __m128i*>(b + 16 * v));
    q[v] = _mm_shuffle_epi8(bytes, rows_first);  // [row][4 columns]
  }
  const __m128i lo01 = _mm_unpacklo_epi32(q[0], q[1]), hi01 = _mm_unpackhi_epi32(q[0], q[1]);
  const __m128i lo23 = _mm_unpacklo_epi32(q[2], q[3]), hi23 = _mm_unpackhi_epi32(q[2], q[3]);
  const __m128i rows[4] = {_mm_unpacklo_epi64(lo01, lo23), _mm_unpackhi_epi64(lo01, lo23),
                           _mm_unpacklo_epi64(hi01, hi23), _mm_unpackhi_epi64(hi01, hi23)};
  const __m256 sv0 = _mm256_loadu_ps(s), sv1 = _mm256_loadu_ps(s + 8);
  XLM_UNROLL
  for (int r = 0; r < 4; ++r) {
    const __m256 w0 = _mm256_cvtepi32_ps(_mm256_cvtepi8_epi32(rows[r]));
    const __m256 w1 = _mm256_cvtepi32_ps(_mm256_cvtepi8_epi32(_mm_srli_si128(rows[r], 8)));
    _mm256_storeu_ps(out + r * kBufCols, _mm256_mul_ps(w0, sv0));
    _mm256_storeu_ps(out + r * kBufCols + 8, _mm256_mul_ps(w1, sv1));
  }
}

// buf[i][0:kBufCols] = w[kc0 + i, j0 : j0 + cols] * scale[group of the row], zero-padded.
void pack_tile(const Problem& p, int64_t kc0, int64_t kc, int64_t j0, int cols, float* buf) {
  const int64_t n = p.n, gs = p.group_size;
  if (p.w4 != nullptr) {  // rows in pairs (kc0 and kc are even), one packed row each
    for (int64_t i = 0; i < kc; i += 2) {
      const int64_t row = kc0 + i;
      const uint8_t* wr = p.w4 + (row / 2) * n + j0;
      const float* s = p.scale + (row / gs) * n + j0;  // rows 2i and 2i + 1: one group
      const float* mn = p.minimum + (row / gs) * n + j0;
      float* b0 = buf + i * kBufCols;
      float* b1 = b0 + kBufCols;
      if (cols == kBufCols) {
        XLM_UNROLL
        for (int v = 0; v < kBufCols / 8; ++v) {
          const __m256i b = bytes8(wr + 8 * v);
          const __m256 sv = _mm256_loadu_ps(s + 8 * v), mv = _mm256_loadu_ps(mn + 8 * v);
          _mm256_storeu_ps(b0 + 8 * v, _mm256_fmadd_ps(low_codes(b), sv, mv));
          _mm256_storeu_ps(b1 + 8 * v, _mm256_fmadd_ps(high_codes(b), sv, mv));
        }
      } else {
        for (int c = 0; c < kBufCols; ++c) {
          b0[c] = c < cols ? static_cast<float>(wr[c] & 15) * s[c] + mn[c] : 0.0f;
          b1[c] = c < cols ? static_cast<float>(wr[c] >> 4) * s[c] + mn[c] : 0.0f;
        }
      }
    }
    return;
  }
  if (p.strips) {  // j0 at a strip's column 0 (or 16 with AVX2), kc0 and kc multiples of 4
    for (int64_t i = 0; i < kc; i += kStripRows) {
      for (int h = 0; h < kBufCols; h += 16) {
        unpack_strip_block(p, kc0 + i, j0 + h, buf + i * kBufCols + h);
      }
    }
    return;
  }
  for (int64_t i = 0; i < kc; ++i) {
    const int64_t row = kc0 + i;
    const int8_t* wr = p.w + row * n + j0;
    const float* s = p.scale + (row / gs) * n + j0;
    float* b = buf + i * kBufCols;
    if (cols == kBufCols) {
      XLM_UNROLL
      for (int v = 0; v < kBufCols / 8; ++v) {
        _mm256_storeu_ps(b + 8 * v, _mm256_mul_ps(widen8(wr + 8 * v), _mm256_loadu_ps(s + 8 * v)));
      }
    } else {
      for (int c = 0; c < kBufCols; ++c) {
        b[c] = c < cols ? static_cast<float>(wr[c]) * s[c] : 0.0f;
      }
    }
  }
}

// y[r0 : r0 + MR, j0 : j0 + cols] (+)= x[r0 : r0 + MR, kc0 : kc0 + kc] @ buf[:, 0:kBufCols]:
// 2 vectors of sums per row (kBufCols = 2 kLanes), up to kPackedMR rows (AVX-512: 24 of
// the 32 zmm registers; AVX2: 12 of 16), in the strip pass's SVec layer.
#if XLM_HAVE_AVX512
constexpr int kPackedMR = 12;
using SMask = __mmask16;
inline SMask smask(int lanes) {  // the first `lanes` (0..16) lanes
  return lanes >= 16 ? 0xFFFF : static_cast<SMask>((1u << lanes) - 1);
}
inline SVec sbroadcast(const float* x) { return _mm512_set1_ps(*x); }
inline SVec smaskload(const float* p, SMask m) { return _mm512_maskz_loadu_ps(m, p); }
inline void smaskstore(float* p, SMask m, SVec v) { _mm512_mask_storeu_ps(p, m, v); }
#else
constexpr int kPackedMR = 6;
using SMask = __m256i;
inline SMask smask(int lanes) { return lane_mask(lanes); }
inline SVec sbroadcast(const float* x) { return _mm256_broadcast_ss(x); }
inline SVec smaskload(const float* p, SMask m) { return _mm256_maskload_ps(p, m); }
inline void smaskstore(float* p, SMask m, SVec v) { _mm256_maskstore_ps(p, m, v); }
#endif
static_assert(kBufCols == 2 * kLanes, "a packed tile's row is two vectors");

template <int MR>
void packed_tile(const Problem& p, int64_t r0, int64_t kc0, int64_t kc, const float* buf,
                 int64_t j0, int cols, bool first) {
  const int64_t k = p.k, n = p.n;
  SVec acc[MR][2];
  XLM_UNROLL
  for (int r = 0; r < MR; ++r) acc[r][0] = acc[r][1] = szero();
  const float* x = p.x + r0 * k + kc0;
  for (int64_t i = 0; i < kc; ++i) {
    const SVec b0 = sload(buf + i * kBufCols);
    const SVec b1 = sload(buf + i * kBufCols + kLanes);
    XLM_UNROLL
    for (int r = 0; r < MR; ++r) {
      const SVec a = sbroadcast(x + r * k + i);
      acc[r][0] = sfmadd(a, b0, acc[r][0]);
      acc[r][1] = sfmadd(a, b1, acc[r][1]);
    }
  }
  const SMask mask0 = smask(std::min(cols, kLanes));
  const SMask mask1 = smask(std::max(cols - kLanes, 0));
  XLM_UNROLL
  for (int r = 0; r < MR; ++r) {
    float* yp = p.y + (r0 + r) * n + j0;
    if (cols == kBufCols) {
      if (!first) {
        acc[r][0] = sadd(acc[r][0], sload(yp));
        acc[r][1] = sadd(acc[r][1], sload(yp + kLanes));
      }
      sstore(yp, acc[r][0]);
      sstore(yp + kLanes, acc[r][1]);
    } else {
      if (!first) {
        acc[r][0] = sadd(acc[r][0], smaskload(yp, mask0));
        acc[r][1] = sadd(acc[r][1], smaskload(yp + kLanes, mask1));
      }
      smaskstore(yp, mask0, acc[r][0]);
      smaskstore(yp + kLanes, mask1, acc[r][1]);
    }
  }
}

// Rows in near-equal groups of at most kPackedMR (row_groups.h), as the float kernel's.
void packed_rows(const Problem& p, int64_t kc0, int64_t kc, const float* buf, int64_t j0,
                 int cols) {
  xlm::ForRowGroups<kPackedMR>(p.m, [&](int64_t r, auto mr) {
    packed_tile<decltype(mr)::value>(p, r, kc0, kc, buf, j0, cols, kc0 == 0);
  });
}

void packed_panel(const Problem& p, int64_t c0, int64_t c1) {
  alignas(64) float buf[kKc * kBufCols];
  // k blocks outside: x[:, kc block] (m x kKc floats) stays in cache across the tiles.
  for (int64_t kc0 = 0; kc0 < p.k; kc0 += kKc) {
    const int64_t kc = std::min(kKc, p.k - kc0);
    for (int64_t t = c0; t < c1; t += kBufCols) {
      const int tile = static_cast<int>(std::min<int64_t>(kBufCols, c1 - t));
      pack_tile(p, kc0, kc, t, tile, buf);
      packed_rows(p, kc0, kc, buf, t, tile);
    }
  }
}

void packed_columns(const Problem& p, int64_t c0, int64_t c1) {
  // Panels of columns, so that the rows of y they sum into stay in L2 across k blocks.
  for (int64_t j = c0; j < c1; j += kPackedPanelCols) {
    packed_panel(p, j, std::min(c1, j + kPackedPanelCols));
  }
}

#endif  // XLM_HAVE_AVX2

// Row i of w at columns [c0, c0 + width) as floats (int4: unpacked).
[[maybe_unused]] void widen_row(const Problem& p, int64_t i, int64_t c0, int64_t width,
                                float* out) {
  if (p.w4 != nullptr) {
    const uint8_t* wr = p.w4 + (i / 2) * p.n + c0;
    const int shift = (i % 2) * 4;
    for (int64_t j = 0; j < width; ++j) out[j] = static_cast<float>((wr[j] >> shift) & 15);
  } else if (p.strips) {
    for (int64_t j = 0; j < width; ++j) out[j] = static_cast<float>(q8_w_at(p, i, c0 + j));
  } else {
    const int8_t* wr = p.w + i * p.n + c0;
    for (int64_t j = 0; j < width; ++j) out[j] = static_cast<float>(wr[j]);
  }
}

// Portable path (no AVX2/FMA): the compiler vectorises the inner loop over columns.
[[maybe_unused]] void generic_columns(const Problem& p, int64_t c0, int64_t c1) {
  const int64_t width = c1 - c0;
  std::unique_ptr<float[]> acc(new float[width]);
  std::unique_ptr<float[]> row(new float[width]);
  for (int64_t r = 0; r < p.m; ++r) {
    float* yr = p.y + r * p.n + c0;
    std::fill(yr, yr + width, 0.0f);
    for (int64_t g = 0; g < p.groups; ++g) {
      std::fill(acc.get(), acc.get() + width, 0.0f);
      for (int64_t i = g * p.group_size; i < (g + 1) * p.group_size; ++i) {
        const float xi = p.x[r * p.k + i];
        widen_row(p, i, c0, width, row.get());
        for (int64_t j = 0; j < width; ++j) acc[j] += xi * row[j];
      }
      for (int64_t j = 0; j < width; ++j) yr[j] += acc[j] * q8_scale_at(p, g, c0 + j);
      if (p.minimum != nullptr) {
        const float* mn = p.minimum + g * p.n + c0;
        const float xs = p.xsum[r * p.groups + g];
        for (int64_t j = 0; j < width; ++j) yr[j] += xs * mn[j];
      }
    }
  }
}

// q8 (int8 x int8, Q8_0-style): y[r, j] = sum_g xscale[r, g] * scale[g, j] *
// sum_{i in group g} xq[r, i] * w[i, j], each group's sum exact in int32.
void q8_columns_scalar(const Problem& p, int64_t c0, int64_t c1) {
  const int64_t width = c1 - c0, gs = p.group_size;
  std::unique_ptr<int32_t[]> acc(new int32_t[width]);
  for (int64_t r = 0; r < p.m; ++r) {
    float* yr = p.y + r * p.n + c0;
    std::fill(yr, yr + width, 0.0f);
    for (int64_t g = 0; g < p.groups; ++g) {
      std::fill(acc.get(), acc.get() + width, 0);
      for (int64_t i = g * gs; i < (g + 1) * gs; ++i) {
        const int32_t xi = p.xq[r * p.k + i];
        if (p.strips) {
          for (int64_t j = 0; j < width; ++j) acc[j] += xi * q8_w_at(p, i, c0 + j);
        } else {
          const int8_t* wr = p.w + i * p.n + c0;
          for (int64_t j = 0; j < width; ++j) acc[j] += xi * static_cast<int32_t>(wr[j]);
        }
      }
      const float xs = p.xscale[r * p.groups + g];
      for (int64_t j = 0; j < width; ++j) {
        yr[j] += static_cast<float>(acc[j]) * (q8_scale_at(p, g, c0 + j) * xs);
      }
    }
  }
}

#if XLM_HAVE_AVX2

constexpr int64_t kQ8Cols = 16;  // columns of one q8 tile: two vectors of 8 int32 sums

// y[r0 : r0 + MR, j0 : j0 + 16] (+)= one group's int32 sums times its two scales. Four rows
// of w at a time are interleaved into [column][4 rows] bytes, so that maddubs + madd sum
// 4 products per column into its int32 lane; maddubs multiplies unsigned by signed bytes,
// so it gets |w| and x with w's sign (w = -128 reads as 128: still exact).
// kStrips: w and scale in strips, j0 at a strip's column 0 or 16 (its half's 64 bytes of
// each 128-byte block are the two vectors, already interleaved).
template <int MR, bool kStrips = false>
void q8_tile(const Problem& p, int64_t r0, int64_t g, int64_t j0, bool first) {
  const int64_t k = p.k, n = p.n, gs = p.group_size;
  const __m256i ones = _mm256_set1_epi16(1);
  __m256i acc[MR][2];
  XLM_UNROLL
  for (int r = 0; r < MR; ++r) acc[r][0] = acc[r][1] = _mm256_setzero_si256();
  const int64_t strip = j0 / kStripCols, half = j0 % kStripCols;
  const int8_t* wr = kStrips ? p.w + strip * k * kStripCols + g * gs * kStripCols + half * kStripRows
                             : p.w + g * gs * n + j0;
  const int64_t step = kStrips ? kStripRows * kStripCols : 4 * n;
  const int8_t* xr = p.xq + r0 * k + g * gs;
  for (int64_t i = 0; i < gs; i += 4, wr += step) {
    __m256i w0, w1;  // columns 0-7 and 8-15, 4 rows each
    if constexpr (kStrips) {
      _mm_prefetch(reinterpret_cast<const char*>(wr + 4 * step), _MM_HINT_T0);
      w0 = _mm256_loadu_si256(reinterpret_cast<const __m256i*>(wr));
      w1 = _mm256_loadu_si256(reinterpret_cast<const __m256i*>(wr + 32));
    } else {
      _mm_prefetch(reinterpret_cast<const char*>(wr + kPrefetchBytes), _MM_HINT_T0);
      const __m128i a0 = _mm_loadu_si128(reinterpret_cast<const __m128i*>(wr));
      const __m128i a1 = _mm_loadu_si128(reinterpret_cast<const __m128i*>(wr + n));
      const __m128i a2 = _mm_loadu_si128(reinterpret_cast<const __m128i*>(wr + 2 * n));
      const __m128i a3 = _mm_loadu_si128(reinterpret_cast<const __m128i*>(wr + 3 * n));
      const __m128i lo01 = _mm_unpacklo_epi8(a0, a1), hi01 = _mm_unpackhi_epi8(a0, a1);
      const __m128i lo23 = _mm_unpacklo_epi8(a2, a3), hi23 = _mm_unpackhi_epi8(a2, a3);
      w0 = _mm256_set_m128i(_mm_unpackhi_epi16(lo01, lo23), _mm_unpacklo_epi16(lo01, lo23));
      w1 = _mm256_set_m128i(_mm_unpackhi_epi16(hi01, hi23), _mm_unpacklo_epi16(hi01, hi23));
    }
    const __m256i u0 = _mm256_abs_epi8(w0), u1 = _mm256_abs_epi8(w1);
    XLM_UNROLL
    for (int r = 0; r < MR; ++r) {
      int32_t four;
      std::memcpy(&four, xr + r * k + i, 4);
      const __m256i xv = _mm256_set1_epi32(four);
      const __m256i p0 = _mm256_maddubs_epi16(u0, _mm256_sign_epi8(xv, w0));
      const __m256i p1 = _mm256_maddubs_epi16(u1, _mm256_sign_epi8(xv, w1));
      acc[r][0] = _mm256_add_epi32(acc[r][0], _mm256_madd_epi16(p0, ones));
      acc[r][1] = _mm256_add_epi32(acc[r][1], _mm256_madd_epi16(p1, ones));
    }
  }
  const float* s = kStrips ? p.scale + strip * p.groups * kStripCols + g * kStripCols + half
                          : p.scale + g * n + j0;
  const __m256 s0 = _mm256_loadu_ps(s), s1 = _mm256_loadu_ps(s + 8);
  XLM_UNROLL
  for (int r = 0; r < MR; ++r) {
    const __m256 xs = _mm256_broadcast_ss(p.xscale + (r0 + r) * p.groups + g);
    float* yp = p.y + (r0 + r) * n + j0;
    __m256 y0 = first ? _mm256_setzero_ps() : _mm256_loadu_ps(yp);
    __m256 y1 = first ? _mm256_setzero_ps() : _mm256_loadu_ps(yp + 8);
    y0 = _mm256_fmadd_ps(_mm256_cvtepi32_ps(acc[r][0]), _mm256_mul_ps(s0, xs), y0);
    y1 = _mm256_fmadd_ps(_mm256_cvtepi32_ps(acc[r][1]), _mm256_mul_ps(s1, xs), y1);
    _mm256_storeu_ps(yp, y0);
    _mm256_storeu_ps(yp + 8, y1);
  }
}

// q8_tile over rows [r0, r0 + min(4, m - r0)) of x, group g, columns [j0, j0 + 16).
template <bool kStrips>
void q8_tile_rows(const Problem& p, int64_t r0, int64_t g, int64_t j0) {
  switch (std::min<int64_t>(4, p.m - r0)) {
    case 1: q8_tile<1, kStrips>(p, r0, g, j0, g == 0); break;
    case 2: q8_tile<2, kStrips>(p, r0, g, j0, g == 0); break;
    case 3: q8_tile<3, kStrips>(p, r0, g, j0, g == 0); break;
    default: q8_tile<4, kStrips>(p, r0, g, j0, g == 0); break;
  }
}

constexpr int64_t kQ8BandCols = 32;    // columns of one step of a q8 band
constexpr int64_t kQ8BandMinCols = 2048;  // columns of a chunk from which bands are used

// 32 bytes of 4 rows of w from p (rows n apart), interleaved with 256-bit unpacks into 4
// vectors of 8 columns x 4 rows for maddubs + madd. 256-bit unpacks work within 128-bit
// lanes, so the vectors hold the columns {0-3, 16-19}, {4-7, 20-23}, {8-11, 24-27} and
// {12-15, 28-31} (lane order; `to_column_order` puts 4 such vectors back).
inline void load_band4(const int8_t* p, int64_t n, __m256i w[4]) {
  const __m256i a0 = _mm256_loadu_si256(reinterpret_cast<const __m256i*>(p));
  const __m256i a1 = _mm256_loadu_si256(reinterpret_cast<const __m256i*>(p + n));
  const __m256i a2 = _mm256_loadu_si256(reinterpret_cast<const __m256i*>(p + 2 * n));
  const __m256i a3 = _mm256_loadu_si256(reinterpret_cast<const __m256i*>(p + 3 * n));
  const __m256i lo01 = _mm256_unpacklo_epi8(a0, a1), hi01 = _mm256_unpackhi_epi8(a0, a1);
  const __m256i lo23 = _mm256_unpacklo_epi8(a2, a3), hi23 = _mm256_unpackhi_epi8(a2, a3);
  w[0] = _mm256_unpacklo_epi16(lo01, lo23);
  w[1] = _mm256_unpackhi_epi16(lo01, lo23);
  w[2] = _mm256_unpacklo_epi16(hi01, hi23);
  w[3] = _mm256_unpackhi_epi16(hi01, hi23);
}

inline void to_column_order(__m256 v[4]) {
  const __m256 c0 = _mm256_permute2f128_ps(v[0], v[1], 0x20);
  const __m256 c1 = _mm256_permute2f128_ps(v[2], v[3], 0x20);
  const __m256 c2 = _mm256_permute2f128_ps(v[0], v[1], 0x31);
  const __m256 c3 = _mm256_permute2f128_ps(v[2], v[3], 0x31);
  v[0] = c0, v[1] = c1, v[2] = c2, v[3] = c3;
}

// Row 0 of x over the columns [c0, c0 + width) (a multiple of 32). Each group of w is
// read 4 rows at a time, each band of 4 rows swept across the columns: 4 sequential
// streams, where q8_tile's column tiles read group_size rows at once (and rows of a 4 KiB
// multiple put them all in one L1 set). The group's int32 sums are kept per column in an
// L1 buffer (`acc`, [width], lane order) and scaled into y at its end as q8_tile does: the
// same sums and float steps, so the same results.
void q8_bands(const Problem& p, int64_t c0, int64_t width, int32_t* acc) {
  const int64_t n = p.n, gs = p.group_size;
  const __m256i ones = _mm256_set1_epi16(1);
  for (int64_t g = 0; g < p.groups; ++g) {
    std::fill(acc, acc + width, 0);
    for (int64_t i = g * gs; i < (g + 1) * gs; i += 4) {
      int32_t four;
      std::memcpy(&four, p.xq + i, 4);
      const __m256i xv = _mm256_set1_epi32(four);
      const int8_t* wr = p.w + i * n + c0;
      for (int64_t j = 0; j < width; j += kQ8BandCols) {
        __m256i w[4];
        load_band4(wr + j, n, w);
        XLM_UNROLL
        for (int v = 0; v < 4; ++v) {
          __m256i* a = reinterpret_cast<__m256i*>(acc + j + 8 * v);
          const __m256i prod = _mm256_maddubs_epi16(_mm256_abs_epi8(w[v]), _mm256_sign_epi8(xv, w[v]));
          _mm256_storeu_si256(a, _mm256_add_epi32(_mm256_loadu_si256(a), _mm256_madd_epi16(prod, ones)));
        }
      }
    }
    const float* s = p.scale + g * n + c0;
    const __m256 xs = _mm256_broadcast_ss(p.xscale + g);
    float* yr = p.y + c0;
    for (int64_t j = 0; j < width; j += kQ8BandCols) {
      __m256 sums[4];
      XLM_UNROLL
      for (int v = 0; v < 4; ++v) {
        sums[v] = _mm256_cvtepi32_ps(
            _mm256_loadu_si256(reinterpret_cast<const __m256i*>(acc + j + 8 * v)));
      }
      to_column_order(sums);
      XLM_UNROLL
      for (int v = 0; v < 4; ++v) {
        const __m256 y = g == 0 ? _mm256_setzero_ps() : _mm256_loadu_ps(yr + j + 8 * v);
        const __m256 scale = _mm256_mul_ps(_mm256_loadu_ps(s + j + 8 * v), xs);
        _mm256_storeu_ps(yr + j + 8 * v, _mm256_fmadd_ps(sums[v], scale, y));
      }
    }
  }
}

// One row of x (one request's decode step), over a chunk of at least kQ8BandMinCols
// columns: bands over its whole 32-column steps; returns where the rest begins. On the
// 2-core dev CPU, per call in a dependent chain (benchmarks/q8_decode.py, RESULTS.md):
// SmolLM2's tied LM head (576 x 49152) 4.5-6.0 -> 2.0-2.2 ms on 2 threads, 9.8-11.6 ->
// 2.7-2.8 ms on one; 576 x 3072 on one thread 288-407 -> 223-290 us. Narrower chunks (the
// layers' weights split over 2 threads, 128-384 columns) were level or slower than the
// tiles, 1536 x 576 on one thread too (268 vs 233 us), and more rows of x re-read w per
// row (4 rows: 1.3x slower in a 30-layer chain).
int64_t q8_decode_bands(const Problem& p, int64_t c0, int64_t c1) {
  const int64_t width = (c1 - c0) / kQ8BandCols * kQ8BandCols;
  if (p.m != 1 || c1 - c0 < kQ8BandMinCols) return c0;
  std::unique_ptr<int32_t[]> acc(new int32_t[width]);
  q8_bands(p, c0, width, acc.get());
  return c0 + width;
}

// Row 0 of x over the strip at column j0 (weights in strips): the strip's blocks read in
// order, one sequential stream, each group's int32 sums and the strip's 32 float sums in
// registers. The float steps are q8_tile's (y = sums * (scale * xscale) + y per group,
// from 0), so the results are the same.
void q8_strip_row(const Problem& p, int64_t j0) {
  const int64_t strip = j0 / kStripCols, gs = p.group_size;
  const int8_t* wp = p.w + strip * p.k * kStripCols;
  const float* sp = p.scale + strip * p.groups * kStripCols;
  const __m256i ones = _mm256_set1_epi16(1);
  __m256 y[4];
  XLM_UNROLL
  for (int v = 0; v < 4; ++v) y[v] = _mm256_setzero_ps();
  for (int64_t g = 0; g < p.groups; ++g, sp += kStripCols) {
    __m256i acc[4];
    XLM_UNROLL
    for (int v = 0; v < 4; ++v) acc[v] = _mm256_setzero_si256();
    const int8_t* xr = p.xq + g * gs;
    for (int64_t i = 0; i < gs; i += kStripRows, wp += kStripRows * kStripCols) {
      _mm_prefetch(reinterpret_cast<const char*>(wp + 1024), _MM_HINT_T0);
      _mm_prefetch(reinterpret_cast<const char*>(wp + 1024 + 64), _MM_HINT_T0);
      int32_t four;
      std::memcpy(&four, xr + i, 4);
      const __m256i xv = _mm256_set1_epi32(four);
      XLM_UNROLL
      for (int v = 0; v < 4; ++v) {
        const __m256i w = _mm256_loadu_si256(reinterpret_cast<const __m256i*>(wp + 32 * v));
        const __m256i prod = _mm256_maddubs_epi16(_mm256_abs_epi8(w), _mm256_sign_epi8(xv, w));
        acc[v] = _mm256_add_epi32(acc[v], _mm256_madd_epi16(prod, ones));
      }
    }
    const __m256 xs = _mm256_broadcast_ss(p.xscale + g);
    XLM_UNROLL
    for (int v = 0; v < 4; ++v) {
      const __m256 scale = _mm256_mul_ps(_mm256_loadu_ps(sp + 8 * v), xs);
      y[v] = _mm256_fmadd_ps(_mm256_cvtepi32_ps(acc[v]), scale, y[v]);
    }
  }
  XLM_UNROLL
  for (int v = 0; v < 4; ++v) _mm256_storeu_ps(p.y + j0 + 8 * v, y[v]);
}

// Weights in strips, columns [c0, c1) whole strips: strip by strip (each one stream), one
// row of x in registers, more rows in 16-column tiles of up to 4 rows over each half.
void q8_strip_columns(const Problem& p, int64_t c0, int64_t c1) {
  for (int64_t j = c0; j < c1; j += kStripCols) {
    if (p.m == 1) {
      q8_strip_row(p, j);
      continue;
    }
    for (int64_t h = j; h < j + kStripCols; h += kQ8Cols) {
      for (int64_t r = 0; r < p.m; r += 4) {
        for (int64_t g = 0; g < p.groups; ++g) q8_tile_rows<true>(p, r, g, h);
      }
    }
  }
}

// Groups outside (w read as group_size sequential streams, as decode_columns), 16-column
// tiles of up to 4 rows of x inside; columns past the last whole tile take the portable
// loops.
void q8_columns_avx2(const Problem& p, int64_t c0, int64_t c1) {
  if (p.strips) return q8_strip_columns(p, c0, c1);
  if (p.bands) c0 = q8_decode_bands(p, c0, c1);
  const int64_t whole = c0 + (c1 - c0) / kQ8Cols * kQ8Cols;
  for (int64_t g = 0; g < p.groups; ++g) {
    for (int64_t j = c0; j < whole; j += kQ8Cols) {
      for (int64_t r = 0; r < p.m; r += 4) q8_tile_rows<false>(p, r, g, j);
    }
  }
  if (whole < c1) q8_columns_scalar(p, whole, c1);
}

#endif  // XLM_HAVE_AVX2

void q8_columns(const Problem& p, int64_t c0, int64_t c1) {
#if XLM_HAVE_AVX2
  if (!p.scalar && p.group_size % 4 == 0) return q8_columns_avx2(p, c0, c1);
#endif
  q8_columns_scalar(p, c0, c1);
}

void compute_columns(const Problem& p, int64_t c0, int64_t c1) {
  if (p.xq != nullptr) return q8_columns(p, c0, c1);
#if XLM_HAVE_AVX2
  if (p.m >= kPackedMinRows) {
    packed_columns(p, c0, c1);
  } else if (p.strips) {
    int8_strip_columns(p, c0, c1);
  } else {
    decode_columns(p, c0, c1);
  }
#else
  generic_columns(p, c0, c1);
#endif
}

// Below this many multiply-adds (~10 us on one core) a second thread costs more than it
// saves: waking a parked pool thread took ~4 us here, and the Schedule call ~1 us
// (column_split.h's kMinParallelWork). When the other cores are busy with other
// processes, a pool thread can be descheduled holding a chunk; after such a wait, calls
// run on the caller alone for a while (2 ms, doubling while the waits go on, at most
// 100 ms: column_split.h's SplitBackoff).
constexpr int64_t kStripChunksPerWorker = 1;  // below kPackedMinRows rows (RunMatmul)
constexpr int64_t kTallRows = 1024;  // from this many rows, chunks of about a page of w
constexpr int64_t kPageTiles = 4096 / kTileCols;


// x [m, k] -> codes xq [m, k] and scales xs [m, groups]: per row and group, scale = amax /
// 127 (1 where amax is 0) and code = round-half-even(x / scale) clipped to [-127, 127], the
// float32 steps of quantize_activations (division, not a reciprocal: bit for bit).
// `simd` false: the portable loops only (tests; the same codes).
void quantize_rows(const float* x, int64_t m, int64_t k, int64_t groups, int8_t* xq,
                   float* xs, bool simd) {
  const int64_t gs = k / groups;
  for (int64_t r = 0; r < m; ++r) {
    for (int64_t g = 0; g < groups; ++g) {
      const float* xr = x + r * k + g * gs;
      int8_t* qr = xq + r * k + g * gs;
      int64_t i = 0;
      float amax = 0.0f;
#if XLM_HAVE_AVX2
      const int64_t vec_end = simd ? gs : 0;
      const __m256 sign = _mm256_set1_ps(-0.0f);
      __m256 vmax = _mm256_setzero_ps();
      for (; i + 8 <= vec_end; i += 8) {
        vmax = _mm256_max_ps(vmax, _mm256_andnot_ps(sign, _mm256_loadu_ps(xr + i)));
      }
      alignas(32) float lanes[8];
      _mm256_store_ps(lanes, vmax);
      for (float v : lanes) amax = std::max(amax, v);
#else
      (void)simd;
#endif
      for (; i < gs; ++i) amax = std::max(amax, std::fabs(xr[i]));
      const float scale = amax > 0.0f ? amax / 127.0f : 1.0f;
      xs[r * groups + g] = scale;
      i = 0;
#if XLM_HAVE_AVX2
      // 32 codes at a time: divide, round, clip, then narrow int32 -> int8 (the two packs
      // interleave the 128-bit lanes; the permutation puts the 8 dwords back in order).
      const __m256 vs = _mm256_set1_ps(scale), hi = _mm256_set1_ps(127.0f);
      const __m256 lo = _mm256_set1_ps(-127.0f);
      const __m256i order = _mm256_setr_epi32(0, 4, 1, 5, 2, 6, 3, 7);
      for (; i + 32 <= vec_end; i += 32) {
        __m256i q[4];
        XLM_UNROLL
        for (int v = 0; v < 4; ++v) {
          __m256 t = _mm256_div_ps(_mm256_loadu_ps(xr + i + 8 * v), vs);
          t = _mm256_round_ps(t, _MM_FROUND_TO_NEAREST_INT | _MM_FROUND_NO_EXC);
          q[v] = _mm256_cvtps_epi32(_mm256_min_ps(_mm256_max_ps(t, lo), hi));
        }
        const __m256i packed = _mm256_packs_epi16(_mm256_packs_epi32(q[0], q[1]),
                                                  _mm256_packs_epi32(q[2], q[3]));
        _mm256_storeu_si256(reinterpret_cast<__m256i*>(qr + i),
                            _mm256_permutevar8x32_epi32(packed, order));
      }
#endif
      for (; i < gs; ++i) {
        const float t = std::nearbyint(xr[i] / scale);
        qr[i] = static_cast<int8_t>(std::min(127.0f, std::max(-127.0f, t)));
      }
    }
  }
}

using xlm::shape_str;

// Checks the shapes (w: `rows_per_byte_row` rows of the logical [k, n] per stored row)
// and fills p's sizes and pointers but w's; `name` prefixes the errors.
ffi::Error MakeProblem(const char* name, ffi::Buffer<ffi::F32>& x,
                       const ffi::AnyBuffer::Dimensions& wd, int64_t rows_per_byte_row,
                       ffi::Buffer<ffi::F32>& scale, ffi::ResultBuffer<ffi::F32>& y,
                       Problem* p) {
  const auto xd = x.dimensions(), sd = scale.dimensions();
  const auto yd = y->dimensions();
  // Built only on failure.
  auto shapes = [&] {
    return "x " + shape_str(xd) + ", w " + shape_str(wd) + ", scale " + shape_str(sd) +
           ", y " + shape_str(yd);
  };
  auto prefix = [name] { return std::string(name) + ": "; };
  if (xd.size() != 2 || wd.size() != 2 || sd.size() != 2 || yd.size() != 2) {
    return ffi::Error::InvalidArgument(prefix() + "x, w, scale and y must be 2-D; got " + shapes());
  }
  const int64_t m = xd[0], k = xd[1], n = wd[1], groups = sd[0];
  if (wd[0] * rows_per_byte_row != k) {
    return ffi::Error::InvalidArgument(
        prefix() + (rows_per_byte_row == 1 ? "x [m, k] and w [k, n] disagree on k; got "
                                         : "x [m, k] and w [k / 2, n] disagree on k; got ") +
        shapes());
  }
  if (sd[1] != n || groups < 1 || k % groups != 0 || (k / groups) % rows_per_byte_row != 0) {
    return ffi::Error::InvalidArgument(
        prefix() + "scale must be [G, n] with G >= 1 dividing k (int4: into even groups); got " +
        shapes());
  }
  if (yd[0] != m || yd[1] != n) {
    return ffi::Error::InvalidArgument(prefix() + "y must be [m, n]; got " + shapes());
  }
  *p = Problem{x.typed_data(), nullptr, nullptr, scale.typed_data(), y->typed_data(),
               m,             k,       n,       groups,             k / groups};
  return ffi::Error::Success();
}

ffi::Error RunMatmul(ffi::ThreadPool& pool, const Problem& p, int64_t max_workers);
ffi::Error MakeQ8Problem(const char* name, const ffi::AnyBuffer::Dimensions& xd,
                         const ffi::AnyBuffer::Dimensions* xsd, ffi::Buffer<ffi::S8>& w,
                         ffi::Buffer<ffi::F32>& scale, ffi::ResultBuffer<ffi::F32>& y,
                         Problem* p);

ffi::Error Int8MatmulImpl(ffi::ThreadPool pool, ffi::Buffer<ffi::F32> x, ffi::Buffer<ffi::S8> w,
                          ffi::Buffer<ffi::F32> scale, ffi::ResultBuffer<ffi::F32> y,
                          int64_t max_workers) {
  Problem p;
  if (w.dimensions().size() == 4) {  // in strips: the q8 kernel's layout and checks
    ffi::Error error = MakeQ8Problem("xlm_int8_matmul", x.dimensions(), nullptr, w, scale, y, &p);
    if (error.failure()) return error;
    p.x = x.typed_data();
    return RunMatmul(pool, p, max_workers);
  }
  ffi::Error error = MakeProblem("xlm_int8_matmul", x, w.dimensions(), 1, scale, y, &p);
  if (error.failure()) return error;
  p.w = w.typed_data();
  return RunMatmul(pool, p, max_workers);
}

ffi::Error Int4MatmulImpl(ffi::ThreadPool pool, ffi::Buffer<ffi::F32> x, ffi::Buffer<ffi::U8> w,
                          ffi::Buffer<ffi::F32> scale, ffi::Buffer<ffi::F32> minimum,
                          ffi::ResultBuffer<ffi::F32> y, int64_t max_workers) {
  Problem p;
  ffi::Error error = MakeProblem("xlm_int4_matmul", x, w.dimensions(), 2, scale, y, &p);
  if (error.failure()) return error;
  const auto md = minimum.dimensions(), sd = scale.dimensions();
  if (md.size() != 2 || md[0] != sd[0] || md[1] != sd[1]) {
    return ffi::Error::InvalidArgument("xlm_int4_matmul: minimum must be shaped like scale " +
                                       shape_str(sd) + "; got " + shape_str(md));
  }
  p.w4 = w.typed_data();
  p.minimum = minimum.typed_data();
  // Each row's sum over each group of x, for the minimums' term (m * k adds).
  std::unique_ptr<float[]> xsum(new float[std::max<int64_t>(1, p.m * p.groups)]);
  for (int64_t r = 0; r < p.m; ++r) {
    for (int64_t g = 0; g < p.groups; ++g) {
      const float* xr = p.x + r * p.k + g * p.group_size;
      float sum = 0.0f;
      for (int64_t i = 0; i < p.group_size; ++i) sum += xr[i];
      xsum[r * p.groups + g] = sum;
    }
  }
  p.xsum = xsum.get();
  return RunMatmul(pool, p, max_workers);
}

// Checks a q8 problem's shapes (x [m, k] of either kind; xscale [m, G] when given) and
// fills p's sizes and w, scale, y. The error strings are built only on failure (a decode
// step makes ~180 of these calls).
ffi::Error MakeQ8Problem(const char* name, const ffi::AnyBuffer::Dimensions& xd,
                         const ffi::AnyBuffer::Dimensions* xsd, ffi::Buffer<ffi::S8>& w,
                         ffi::Buffer<ffi::F32>& scale, ffi::ResultBuffer<ffi::F32>& y,
                         Problem* p) {
  const auto wd = w.dimensions(), sd = scale.dimensions(), yd = y->dimensions();
  auto shapes = [&] {
    return std::string(xsd ? "xq " : "x ") + shape_str(xd) +
           (xsd ? ", xscale " + shape_str(*xsd) : std::string()) + ", w " + shape_str(wd) +
           ", scale " + shape_str(sd) + ", y " + shape_str(yd);
  };
  const bool strips = wd.size() == 4;
  if (xd.size() != 2 || (xsd && xsd->size() != 2) || yd.size() != 2 ||
      wd.size() != (strips ? 4 : 2) || sd.size() != (strips ? 3 : 2)) {
    return ffi::Error::InvalidArgument(
        std::string(name) + ": x" + (xsd ? "q, xscale" : "") +
        " and y must be 2-D and w, scale 2-D or in strips (4-D, 3-D); got " + shapes());
  }
  const int64_t m = xd[0], k = xd[1];
  const int64_t n = strips ? wd[0] * kStripCols : wd[1];
  const int64_t groups = strips ? sd[1] : sd[0];
  const bool w_ok = strips ? wd[1] * kStripRows == k && wd[2] == kStripCols &&
                                 wd[3] == kStripRows && sd[0] == wd[0] && sd[2] == kStripCols
                           : wd[0] == k && sd[1] == n;
  if (!w_ok || groups < 1 || k % groups != 0 || (xsd && ((*xsd)[0] != m || (*xsd)[1] != groups)) ||
      yd[0] != m || yd[1] != n || (strips && (k / groups) % kStripRows != 0)) {
    return ffi::Error::InvalidArgument(
        std::string(name) + ": want x" + (xsd ? "q [m, k], xscale [m, G]" : " [m, k]") +
        ", w [k, n] and scale [G, n] (G dividing k), or in strips w [n / 32, k / 4, 32, 4] "
        "and scale [n / 32, G, 32] (groups of a multiple of 4 rows), y [m, n]; got " +
        shapes());
  }
  *p = Problem{nullptr, w.typed_data(), nullptr, scale.typed_data(), y->typed_data(),
               m,       k,            n,       groups,             k / groups};
  p->strips = strips;
  return ffi::Error::Success();
}

ffi::Error Q8MatmulImpl(ffi::ThreadPool pool, ffi::Buffer<ffi::S8> xq,
                        ffi::Buffer<ffi::F32> xscale, ffi::Buffer<ffi::S8> w,
                        ffi::Buffer<ffi::F32> scale, ffi::ResultBuffer<ffi::F32> y,
                        int64_t max_workers, int64_t scalar, int64_t bands) {
  const auto xsd = xscale.dimensions();
  Problem p;
  ffi::Error error = MakeQ8Problem("xlm_q8_matmul", xq.dimensions(), &xsd, w, scale, y, &p);
  if (error.failure()) return error;
  p.xq = xq.typed_data();
  p.xscale = xscale.typed_data();
  p.scalar = scalar != 0;
  p.bands = bands != 0;
  return RunMatmul(pool, p, max_workers);
}

ffi::Error Q8LinearImpl(ffi::ThreadPool pool, ffi::Buffer<ffi::F32> x, ffi::Buffer<ffi::S8> w,
                        ffi::Buffer<ffi::F32> scale, ffi::ResultBuffer<ffi::F32> y,
                        int64_t max_workers, int64_t scalar, int64_t bands) {
  Problem p;
  ffi::Error error = MakeQ8Problem("xlm_q8_linear", x.dimensions(), nullptr, w, scale, y, &p);
  if (error.failure()) return error;
  // Quantized on the calling thread before the columns are split (m * k steps; each
  // worker reads all of it). Heap buffers: a call is reentrant on any thread.
  std::unique_ptr<int8_t[]> xq(new int8_t[std::max<int64_t>(1, p.m * p.k)]);
  std::unique_ptr<float[]> xs(new float[std::max<int64_t>(1, p.m * p.groups)]);
  quantize_rows(x.typed_data(), p.m, p.k, p.groups, xq.get(), xs.get(), scalar == 0);
  p.xq = xq.get();
  p.xscale = xs.get();
  p.scalar = scalar != 0;
  p.bands = bands != 0;
  return RunMatmul(pool, p, max_workers);
}

ffi::Error RunMatmul(ffi::ThreadPool& pool, const Problem& p, int64_t max_workers) {
  const int64_t m = p.m, k = p.k, n = p.n;
  if (m == 0 || n == 0) return ffi::Error::Success();
  if (k == 0) {
    std::fill(p.y, p.y + m * n, 0.0f);
    return ffi::Error::Success();
  }

  // A few chunks per worker, so that a thread that starts late (a parked pool thread
  // started ~40 us after Schedule here, a spinning one ~0.3 us) or runs slowly hands its
  // share over. For tall w, chunks about a page of columns wide (a multiple of the
  // workers): every row of a chunk is a page walk, and with 4096 rows narrow chunks cost
  // more in TLB misses than the balancing gains (measured).
  // Strips: chunks of whole strips, each contiguous (no page walk to bound); below the
  // GEMM's rows one chunk a worker, a thread's share one sequential stream (one request,
  // alternating trees on the Zen 5 dev VM: int8 +5%, +8%, +10% in three runs; w8a8 and
  // batch 8 level; RESULTS.md, session 18), as the float kernel does.
  xlm::RunColumns(
      pool, n, p.strips ? kStripCols : kTileCols, m, m * k * n, max_workers,
      [&p](int64_t c0, int64_t c1) { compute_columns(p, c0, c1); },
      k >= kTallRows && !p.strips ? kPageTiles : 0,
      p.strips && m < kPackedMinRows ? kStripChunksPerWorker : xlm::kDefaultChunksPerWorker);
  return ffi::Error::Success();
}

}  // namespace

XLA_FFI_DEFINE_HANDLER_SYMBOL(XlmInt8Matmul, Int8MatmulImpl,
                              ffi::Ffi::Bind()
                                  .Ctx<ffi::ThreadPool>()
                                  .Arg<ffi::Buffer<ffi::F32>>()  // x [m, k]
                                  .Arg<ffi::Buffer<ffi::S8>>()   // w [k, n] or in strips
                                  .Arg<ffi::Buffer<ffi::F32>>()  // scale [G, n] or in strips
                                  .Ret<ffi::Buffer<ffi::F32>>()  // y [m, n]
                                  .Attr<int64_t>("max_workers")  // threads to use; 0: all
);

XLA_FFI_DEFINE_HANDLER_SYMBOL(XlmInt4Matmul, Int4MatmulImpl,
                              ffi::Ffi::Bind()
                                  .Ctx<ffi::ThreadPool>()
                                  .Arg<ffi::Buffer<ffi::F32>>()  // x [m, k]
                                  .Arg<ffi::Buffer<ffi::U8>>()   // w [k / 2, n], 2 codes/byte
                                  .Arg<ffi::Buffer<ffi::F32>>()  // scale [G, n]
                                  .Arg<ffi::Buffer<ffi::F32>>()  // minimum [G, n]
                                  .Ret<ffi::Buffer<ffi::F32>>()  // y [m, n]
                                  .Attr<int64_t>("max_workers")  // threads to use; 0: all
);

XLA_FFI_DEFINE_HANDLER_SYMBOL(XlmQ8Matmul, Q8MatmulImpl,
                              ffi::Ffi::Bind()
                                  .Ctx<ffi::ThreadPool>()
                                  .Arg<ffi::Buffer<ffi::S8>>()   // xq [m, k]
                                  .Arg<ffi::Buffer<ffi::F32>>()  // xscale [m, G]
                                  .Arg<ffi::Buffer<ffi::S8>>()   // w [k, n] or in strips
                                  .Arg<ffi::Buffer<ffi::F32>>()  // scale [G, n] or in strips
                                  .Ret<ffi::Buffer<ffi::F32>>()  // y [m, n]
                                  .Attr<int64_t>("max_workers")  // threads to use; 0: all
                                  .Attr<int64_t>("scalar")       // 1: the portable loops
                                  .Attr<int64_t>("bands")        // 0: the tiles at one row too
);

XLA_FFI_DEFINE_HANDLER_SYMBOL(XlmQ8Linear, Q8LinearImpl,
                              ffi::Ffi::Bind()
                                  .Ctx<ffi::ThreadPool>()
                                  .Arg<ffi::Buffer<ffi::F32>>()  // x [m, k], quantized here
                                  .Arg<ffi::Buffer<ffi::S8>>()   // w [k, n] or in strips
                                  .Arg<ffi::Buffer<ffi::F32>>()  // scale [G, n] or in strips
                                  .Ret<ffi::Buffer<ffi::F32>>()  // y [m, n]
                                  .Attr<int64_t>("max_workers")  // threads to use; 0: all
                                  .Attr<int64_t>("scalar")       // 1: the portable loops
                                  .Attr<int64_t>("bands")        // 0: the tiles at one row too
);
