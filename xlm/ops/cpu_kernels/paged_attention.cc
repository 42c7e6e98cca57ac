// Ragged paged attention for XLA:CPU, called from jitted programs through XLA's FFI.
//
//   q f32 [T, Hq, D], kv_cache [2, num_blocks, block_size, Hkv, row] (keys, values; f32,
//   bf16, f8e4m3fn, f8e5m2 with row = D, or int8 rows with their scale, row = D + 4),
//   block_tables s32 [R, max_blocks], seq_lens s32 [R], query_start_loc s32 [R + 1],
//   num_seqs s32 [1]  ->  out f32 [T, Hq, D]
//
// Request r < num_seqs owns query rows query_start_loc[r] .. query_start_loc[r + 1]; they
// are the last q_len of its seq_lens[r] context tokens, whose pages are block_tables[r].
// Row i at context position p attends causally to keys 0..p (and, with a sliding window
// w, only those > p - w), scores scaled by sm_scale and soft-capped (cap * tanh(s / cap))
// when soft_cap > 0. Rows past the real requests (padding) are zero.
//
// The plain-XLA version of this (xlm.ops.paged_attention.ragged_paged_attention) runs as
// a while loop of ~20 small instructions per tile of 64 context tokens per layer, each a
// separately dispatched thunk on XLA:CPU, plus gathers that copy every tile of K and V.
// Here one call per layer reads each page in place:
// - a work item is (request, KV head, tile of up to kRowTile query rows): the tile's rows
//   and the query heads sharing the KV head (the GQA group) are scored together against
//   each page of keys, so a decode row reads its context once per KV head and a prefill
//   tile reads it once per kRowTile rows;
// - per page, the scores of the tile's rows go through an online softmax (running max,
//   sum and the accumulated values, rescaled once per page);
// - items are claimed from an atomic counter by the calling thread and tasks on XLA's
//   intra-op pool (the FFI's ThreadPool context) when the step has enough work.

#include <algorithm>
#include <atomic>
#include <cmath>
#include <cstdint>
#include <cstring>
#include <memory>
#include <string>
#include <thread>
#include <vector>

#include "column_split.h"
#include "ffi_shapes.h"
#include "xla/ffi/api/ffi.h"

#if defined(__AVX2__) && defined(__FMA__)
#include <immintrin.h>
#define XLM_ATTN_AVX2 1
#else
#define XLM_ATTN_AVX2 0
#endif

namespace ffi = xla::ffi;

namespace {

constexpr int64_t kRowTile = 8;            // query rows of one work item
constexpr int64_t kMaxGroupRows = 64;      // rows x GQA group scored together (stack arrays)
constexpr int64_t kMaxPage = 256;          // block_size bound for the score buffer
constexpr int64_t kMinParallelWork = 1 << 16;  // multiply-adds below which one thread runs
constexpr int64_t kTransposeMinRows = 8;  // (row, head) pairs from which a page is transposed
constexpr float kNegInf = -INFINITY;

#if XLM_ATTN_AVX2
// exp of 8 floats (Cephes' expf polynomial; relative error ~1e-7 over the float range).
inline __m256 exp8(__m256 x) {
  x = _mm256_min_ps(_mm256_max_ps(x, _mm256_set1_ps(-87.3f)), _mm256_set1_ps(88.3f));
  const __m256 n = _mm256_round_ps(_mm256_mul_ps(x, _mm256_set1_ps(1.44269504088896341f)),
                                   _MM_FROUND_TO_NEAREST_INT | _MM_FROUND_NO_EXC);
  __m256 r = _mm256_fnmadd_ps(n, _mm256_set1_ps(0.693359375f), x);
  r = _mm256_fnmadd_ps(n, _mm256_set1_ps(-2.12194440e-4f), r);
  __m256 poly = _mm256_set1_ps(1.9875691500e-4f);
  poly = _mm256_fmadd_ps(poly, r, _mm256_set1_ps(1.3981999507e-3f));
  poly = _mm256_fmadd_ps(poly, r, _mm256_set1_ps(8.3334519073e-3f));
  poly = _mm256_fmadd_ps(poly, r, _mm256_set1_ps(4.1665795894e-2f));
  poly = _mm256_fmadd_ps(poly, r, _mm256_set1_ps(1.6666665459e-1f));
  poly = _mm256_fmadd_ps(poly, r, _mm256_set1_ps(5.0000001201e-1f));
  poly = _mm256_fmadd_ps(poly, _mm256_mul_ps(r, r), _mm256_add_ps(r, _mm256_set1_ps(1.0f)));
  const __m256i bits = _mm256_slli_epi32(
      _mm256_add_epi32(_mm256_cvtps_epi32(n), _mm256_set1_epi32(127)), 23);
  return _mm256_mul_ps(poly, _mm256_castsi256_ps(bits));
}
#endif

// The cache's element type. A float32 cache is read in place; the others are widened row
// by row into float scratch as each page is read: bfloat16, float8 (e4m3fn, e5m2) and
// int8 rows of head_dim codes followed by the row's float32 scale (4 bytes; the layout of
// pallas_kernels.ragged_paged_attention.kv_quant).
enum class CacheType { kF32, kBF16, kF8E4M3FN, kF8E5M2, kInt8Rows };

struct Problem {
  const float* q;
  const void* cache;
  CacheType cache_type;
  int64_t row_width;  // elements of one cached (token, kv head) row
  int64_t elem_bytes;
  const int32_t* block_tables;
  const int32_t* seq_lens;
  const int32_t* qsl;
  float* out;
  int64_t num_tokens, num_q_heads, num_kv_heads, head_dim;
  int64_t num_blocks, block_size, max_blocks;
  float sm_scale;
  int64_t sliding_window;  // 0: none
  float soft_cap;          // 0: none
};

struct Item {
  int32_t req, kv_head, row0, row1;  // rows are token indices
};

inline int64_t round8(int64_t x) { return (x + 7) & ~int64_t{7}; }

// q . k over d floats (row-major keys: decode items, whose few rows would not repay a
// transpose of the page).
inline float dot(const float* a, const float* b, int64_t d) {
  int64_t i = 0;
  float out = 0.0f;
#if XLM_ATTN_AVX2
  __m256 acc0 = _mm256_setzero_ps(), acc1 = _mm256_setzero_ps();
  for (; i + 16 <= d; i += 16) {
    acc0 = _mm256_fmadd_ps(_mm256_loadu_ps(a + i), _mm256_loadu_ps(b + i), acc0);
    acc1 = _mm256_fmadd_ps(_mm256_loadu_ps(a + i + 8), _mm256_loadu_ps(b + i + 8), acc1);
  }
  for (; i + 8 <= d; i += 8) {
    acc0 = _mm256_fmadd_ps(_mm256_loadu_ps(a + i), _mm256_loadu_ps(b + i), acc0);
  }
  acc0 = _mm256_add_ps(acc0, acc1);
  __m128 h = _mm_add_ps(_mm256_castps256_ps128(acc0), _mm256_extractf128_ps(acc0, 1));
  h = _mm_add_ps(h, _mm_movehl_ps(h, h));
  h = _mm_add_ss(h, _mm_movehdup_ps(h));
  out = _mm_cvtss_f32(h);
#endif
  for (; i < d; ++i) out += a[i] * b[i];
  return out;
}

// s[0:cp] = q . kt[:, 0:cp] for a page's keys transposed to kt [d][stride] (cp a multiple
// of 8): vectorized over keys, so no horizontal sums.
inline void scores_of(const float* q, const float* kt, int64_t stride, int64_t cp, int64_t d,
                      float* s) {
#if XLM_ATTN_AVX2
  int64_t j = 0;
  for (; j + 32 <= cp; j += 32) {
    __m256 a0 = _mm256_setzero_ps(), a1 = a0, a2 = a0, a3 = a0;
    for (int64_t x = 0; x < d; ++x) {
      const __m256 qx = _mm256_set1_ps(q[x]);
      const float* row = kt + x * stride + j;
      a0 = _mm256_fmadd_ps(qx, _mm256_loadu_ps(row), a0);
      a1 = _mm256_fmadd_ps(qx, _mm256_loadu_ps(row + 8), a1);
      a2 = _mm256_fmadd_ps(qx, _mm256_loadu_ps(row + 16), a2);
      a3 = _mm256_fmadd_ps(qx, _mm256_loadu_ps(row + 24), a3);
    }
    _mm256_storeu_ps(s + j, a0);
    _mm256_storeu_ps(s + j + 8, a1);
    _mm256_storeu_ps(s + j + 16, a2);
    _mm256_storeu_ps(s + j + 24, a3);
  }
  for (; j + 16 <= cp; j += 16) {
    __m256 a0 = _mm256_setzero_ps(), a1 = a0;
    for (int64_t x = 0; x < d; ++x) {
      const __m256 qx = _mm256_set1_ps(q[x]);
      a0 = _mm256_fmadd_ps(qx, _mm256_loadu_ps(kt + x * stride + j), a0);
      a1 = _mm256_fmadd_ps(qx, _mm256_loadu_ps(kt + x * stride + j + 8), a1);
    }
    _mm256_storeu_ps(s + j, a0);
    _mm256_storeu_ps(s + j + 8, a1);
  }
  for (; j < cp; j += 8) {
    __m256 a0 = _mm256_setzero_ps();
    for (int64_t x = 0; x < d; ++x) {
      a0 = _mm256_fmadd_ps(_mm256_set1_ps(q[x]), _mm256_loadu_ps(kt + x * stride + j), a0);
    }
    _mm256_storeu_ps(s + j, a0);
  }
#else
  for (int64_t j = 0; j < cp; ++j) s[j] = 0.0f;
  for (int64_t x = 0; x < d; ++x) {
    for (int64_t j = 0; j < cp; ++j) s[j] += q[x] * kt[x * stride + j];
  }
#endif
}

// e[j] = exp(s[j] - m) for j in [lo, hi) (a multiple-of-8 span padded around them is
// computed too and then zeroed); returns the sum over [lo, hi).
inline float exps_of(float* s, int64_t lo, int64_t hi, float m) {
  float sum = 0.0f;
#if XLM_ATTN_AVX2
  const int64_t j0 = lo & ~int64_t{7};
  const __m256 vm = _mm256_set1_ps(m);
  for (int64_t j = j0; j < hi; j += 8) {
    _mm256_storeu_ps(s + j, exp8(_mm256_sub_ps(_mm256_loadu_ps(s + j), vm)));
  }
  for (int64_t j = lo; j < hi; ++j) sum += s[j];
#else
  for (int64_t j = lo; j < hi; ++j) {
    s[j] = std::exp(s[j] - m);
    sum += s[j];
  }
#endif
  return sum;
}

// acc[0:d] = acc * c + sum_{j in [lo, hi)} e[j] * v[j * stride : + d]
inline void accumulate(float* acc, float c, const float* e, const float* v, int64_t stride,
                       int64_t lo, int64_t hi, int64_t d) {
  int64_t x = 0;
#if XLM_ATTN_AVX2
  const __m256 vc = _mm256_set1_ps(c);
  for (; x + 32 <= d; x += 32) {
    __m256 a0 = _mm256_mul_ps(_mm256_loadu_ps(acc + x), vc);
    __m256 a1 = _mm256_mul_ps(_mm256_loadu_ps(acc + x + 8), vc);
    __m256 a2 = _mm256_mul_ps(_mm256_loadu_ps(acc + x + 16), vc);
    __m256 a3 = _mm256_mul_ps(_mm256_loadu_ps(acc + x + 24), vc);
    for (int64_t j = lo; j < hi; ++j) {
      const __m256 ej = _mm256_set1_ps(e[j]);
      const float* row = v + j * stride + x;
      a0 = _mm256_fmadd_ps(ej, _mm256_loadu_ps(row), a0);
      a1 = _mm256_fmadd_ps(ej, _mm256_loadu_ps(row + 8), a1);
      a2 = _mm256_fmadd_ps(ej, _mm256_loadu_ps(row + 16), a2);
      a3 = _mm256_fmadd_ps(ej, _mm256_loadu_ps(row + 24), a3);
    }
    _mm256_storeu_ps(acc + x, a0);
    _mm256_storeu_ps(acc + x + 8, a1);
    _mm256_storeu_ps(acc + x + 16, a2);
    _mm256_storeu_ps(acc + x + 24, a3);
  }
  for (; x + 8 <= d; x += 8) {
    __m256 a0 = _mm256_mul_ps(_mm256_loadu_ps(acc + x), vc);
    for (int64_t j = lo; j < hi; ++j) {
      a0 = _mm256_fmadd_ps(_mm256_set1_ps(e[j]), _mm256_loadu_ps(v + j * stride + x), a0);
    }
    _mm256_storeu_ps(acc + x, a0);
  }
#endif
  for (; x < d; ++x) {
    float a = acc[x] * c;
    for (int64_t j = lo; j < hi; ++j) a += e[j] * v[j * stride + x];
    acc[x] = a;
  }
}

// float value of each 8-bit float code.
struct F8Table {
  float v[256];
  explicit F8Table(bool e4m3fn) {
    for (int c = 0; c < 256; ++c) {
      const int sign = c >> 7;
      float x;
      if (e4m3fn) {  // 4 exponent bits (bias 7), 3 mantissa bits; no infinity
        const int e = (c >> 3) & 15, m = c & 7;
        if (e == 15 && m == 7) {
          x = NAN;
        } else if (e == 0) {
          x = std::ldexp(m / 8.0f, -6);
        } else {
          x = std::ldexp(1.0f + m / 8.0f, e - 7);
        }
      } else {  // e5m2: 5 exponent bits (bias 15), 2 mantissa bits, IEEE-style
        const int e = (c >> 2) & 31, m = c & 3;
        if (e == 31) {
          x = m ? NAN : INFINITY;
        } else if (e == 0) {
          x = std::ldexp(m / 4.0f, -14);
        } else {
          x = std::ldexp(1.0f + m / 4.0f, e - 15);
        }
      }
      v[c] = sign ? -x : x;
    }
  }
};

// Rows j in [k0, k1) of a page (row j at src + j * stride elements) as float32 into
// dst + j * d.
void widen_rows(const Problem& p, const uint8_t* src, int64_t stride_bytes, int64_t k0,
                int64_t k1, int64_t d, float* dst) {
  static const F8Table e4m3(true), e5m2(false);
  for (int64_t j = k0; j < k1; ++j) {
    const uint8_t* row = src + j * stride_bytes;
    float* out = dst + j * d;
    switch (p.cache_type) {
      case CacheType::kBF16:
        for (int64_t x = 0; x < d; ++x) {
          uint16_t h;
          std::memcpy(&h, row + 2 * x, 2);
          const uint32_t bits = static_cast<uint32_t>(h) << 16;
          std::memcpy(out + x, &bits, 4);
        }
        break;
      case CacheType::kF8E4M3FN:
        for (int64_t x = 0; x < d; ++x) out[x] = e4m3.v[row[x]];
        break;
      case CacheType::kF8E5M2:
        for (int64_t x = 0; x < d; ++x) out[x] = e5m2.v[row[x]];
        break;
      case CacheType::kInt8Rows: {
        float scale;
        std::memcpy(&scale, row + d, 4);
        const int8_t* codes = reinterpret_cast<const int8_t*>(row);
        for (int64_t x = 0; x < d; ++x) out[x] = codes[x] * scale;
        break;
      }
      case CacheType::kF32:
        std::memcpy(out, row, d * 4);
        break;
    }
  }
}

// One work item: rows row0..row1 of request `req`, the query heads of KV head `kv_head`.
void attend(const Problem& p, const Item& it, std::vector<float>& scratch) {
  const int64_t d = p.head_dim, group = p.num_q_heads / p.num_kv_heads;
  const int64_t rows = it.row1 - it.row0, n = rows * group;  // (row, head) pairs
  const int64_t q_start = p.qsl[it.req], q_len = p.qsl[it.req + 1] - q_start;
  const int64_t ctx_start = static_cast<int64_t>(p.seq_lens[it.req]) - q_len;
  const int64_t kstride = round8(p.block_size);
  const bool in_place = p.cache_type == CacheType::kF32;
  // scratch: queries [n, d], acc [n, d], keys transposed [d, kstride], scores [kstride],
  // and for a cache read through widening, one page of keys and of values [block_size, d]
  const int64_t widened = in_place ? 0 : 2 * p.block_size * d;
  scratch.resize(static_cast<size_t>(2 * n * d + d * kstride + kstride + widened));
  float* queries = scratch.data();
  float* acc = queries + n * d;
  float* kt = acc + n * d;
  float* s = kt + d * kstride;
  float* kbuf = s + kstride;
  float* vbuf = kbuf + p.block_size * d;
  float m[kMaxGroupRows], l[kMaxGroupRows];
  int64_t pos[kMaxGroupRows];
  for (int64_t r = 0; r < rows; ++r) {
    const int64_t t = it.row0 + r;
    for (int64_t g = 0; g < group; ++g) {
      const int64_t i = r * group + g;
      const float* src = p.q + (t * p.num_q_heads + it.kv_head * group + g) * d;
      for (int64_t x = 0; x < d; ++x) queries[i * d + x] = src[x] * p.sm_scale;
      std::fill(acc + i * d, acc + (i + 1) * d, 0.0f);
      m[i] = kNegInf;
      l[i] = 0.0f;
      pos[i] = ctx_start + (t - q_start);
    }
  }
  const int64_t last = pos[n - 1];  // rows ascend: the tile's last row sees the most keys
  int64_t first = 0;
  if (p.sliding_window > 0) first = std::max<int64_t>(0, pos[0] - p.sliding_window + 1);
  // Strides of the stored cache, in elements.
  const int64_t stored_token = p.num_kv_heads * p.row_width;
  const int64_t stored_block = p.block_size * stored_token;
  const int64_t stored_values = p.num_blocks * stored_block;
  // Strides of the float rows the loops read: the cache itself, or the widened page.
  const int64_t token_stride = in_place ? stored_token : d;
  const int32_t* pages = p.block_tables + it.req * p.max_blocks;
  for (int64_t page = first / p.block_size; page * p.block_size <= last; ++page) {
    const int64_t block = pages[page];
    if (block < 0 || block >= p.num_blocks) continue;  // never produced by the runner
    const int64_t page_start = page * p.block_size;
    // Keys page_start + [k0, k1) are read; their K transposed once for all n rows.
    const int64_t k0 = std::max(first, page_start) - page_start;
    const int64_t k1 = std::min(last + 1, page_start + p.block_size) - page_start;
    const float* keys;
    const float* values;
    const int64_t first_elem = block * stored_block + it.kv_head * p.row_width;
    if (in_place) {
      keys = static_cast<const float*>(p.cache) + first_elem;
      values = keys + stored_values;
    } else {
      const uint8_t* base = static_cast<const uint8_t*>(p.cache);
      const int64_t row_bytes = stored_token * p.elem_bytes;
      widen_rows(p, base + first_elem * p.elem_bytes, row_bytes, k0, k1, d, kbuf);
      widen_rows(p, base + (first_elem + stored_values) * p.elem_bytes, row_bytes, k0, k1, d,
                 vbuf);
      keys = kbuf;
      values = vbuf;
    }
    const int64_t cp = round8(k1);
    const bool transposed = n >= kTransposeMinRows;
    for (int64_t j = 0; transposed && j < cp; ++j) {
      if (j >= k0 && j < k1) {
        const float* row = keys + j * token_stride;
        for (int64_t x = 0; x < d; ++x) kt[x * kstride + j] = row[x];
      } else {
        for (int64_t x = 0; x < d; ++x) kt[x * kstride + j] = 0.0f;
      }
    }
    for (int64_t i = 0; i < n; ++i) {
      // Keys this (row, head) sees in the page: j <= pos[i] and j > pos[i] - window.
      const int64_t hi = std::min(k1, pos[i] + 1 - page_start);
      const int64_t lo = p.sliding_window > 0
                             ? std::max(k0, pos[i] - p.sliding_window + 1 - page_start)
                             : k0;
      if (hi <= lo) continue;
      if (transposed) {
        scores_of(queries + i * d, kt, kstride, cp, d, s);
      } else {
        for (int64_t j = lo; j < hi; ++j) s[j] = dot(queries + i * d, keys + j * token_stride, d);
      }
      float page_max = kNegInf;
      for (int64_t j = lo; j < hi; ++j) {
        if (p.soft_cap > 0.0f) s[j] = p.soft_cap * std::tanh(s[j] / p.soft_cap);
        page_max = std::max(page_max, s[j]);
      }
      const float m_new = std::max(m[i], page_max);
      const float correction = std::exp(m[i] - m_new);  // 0 on the first page (m = -inf)
      const float sum = exps_of(s, lo, hi, m_new);
      accumulate(acc + i * d, correction, s, values, token_stride, lo, hi, d);
      l[i] = l[i] * correction + sum;
      m[i] = m_new;
    }
  }
  for (int64_t r = 0; r < rows; ++r) {
    const int64_t t = it.row0 + r;
    for (int64_t g = 0; g < group; ++g) {
      const int64_t i = r * group + g;
      float* dst = p.out + (t * p.num_q_heads + it.kv_head * group + g) * d;
      const float inv = l[i] > 0.0f ? 1.0f / l[i] : 0.0f;
      for (int64_t x = 0; x < d; ++x) dst[x] = acc[i * d + x] * inv;
    }
  }
}

struct Job {
  Problem p;
  std::vector<Item> items;
  std::atomic<int64_t> next{0};
  std::atomic<int64_t> done{0};

  void run() {
    std::vector<float> scratch;
    const int64_t count = static_cast<int64_t>(items.size());
    for (;;) {
      const int64_t c = next.fetch_add(1, std::memory_order_relaxed);
      if (c >= count) return;
      attend(p, items[c], scratch);
      done.fetch_add(1, std::memory_order_release);
    }
  }
};

inline void cpu_relax() {
#if defined(__x86_64__) || defined(__i386__)
  __builtin_ia32_pause();
#endif
}

using xlm::shape_str;

ffi::Error PagedAttentionImpl(ffi::ThreadPool pool, ffi::Buffer<ffi::F32> q,
                              ffi::AnyBuffer cache, ffi::Buffer<ffi::S32> block_tables,
                              ffi::Buffer<ffi::S32> seq_lens, ffi::Buffer<ffi::S32> qsl,
                              ffi::Buffer<ffi::S32> num_seqs, ffi::ResultBuffer<ffi::F32> out,
                              float sm_scale, int64_t sliding_window, float soft_cap,
                              int64_t max_workers) {
  const auto qd = q.dimensions(), cd = cache.dimensions(), bd = block_tables.dimensions();
  auto shapes = [&] {
    return "q " + shape_str(qd) + ", kv_cache " + shape_str(cd) + ", block_tables " +
           shape_str(bd);
  };
  CacheType type;
  int64_t elem_bytes = 1, extra = 0;  // extra: elements after head_dim in a row
  switch (cache.element_type()) {
    case ffi::DataType::F32:
      type = CacheType::kF32;
      elem_bytes = 4;
      break;
    case ffi::DataType::BF16:
      type = CacheType::kBF16;
      elem_bytes = 2;
      break;
    case ffi::DataType::F8E4M3FN:
      type = CacheType::kF8E4M3FN;
      break;
    case ffi::DataType::F8E5M2:
      type = CacheType::kF8E5M2;
      break;
    case ffi::DataType::S8:
      type = CacheType::kInt8Rows;
      extra = 4;  // the row's float32 scale
      break;
    default:
      return ffi::Error::InvalidArgument(
          "xlm_paged_attention: kv_cache must be float32, bfloat16, float8_e4m3fn, "
          "float8_e5m2 or int8 (rows with their scale); got " + shapes());
  }
  if (qd.size() != 3 || cd.size() != 5 || bd.size() != 2 || cd[0] != 2 ||
      cd[4] != qd[2] + extra || cd[3] < 1 || qd[1] % cd[3] != 0) {
    return ffi::Error::InvalidArgument("xlm_paged_attention: bad shapes: " + shapes());
  }
  const int64_t num_reqs = bd[0];
  if (seq_lens.element_count() != static_cast<size_t>(num_reqs) ||
      qsl.element_count() != static_cast<size_t>(num_reqs + 1) || num_seqs.element_count() != 1) {
    return ffi::Error::InvalidArgument(
        "xlm_paged_attention: seq_lens [R], query_start_loc [R + 1] and num_seqs [1] must "
        "match block_tables [R, max_blocks]; got " + shapes());
  }
  Problem p{q.typed_data(), cache.untyped_data(), type, cd[4], elem_bytes,
            block_tables.typed_data(), seq_lens.typed_data(), qsl.typed_data(),
            out->typed_data(), qd[0], qd[1], cd[3], qd[2], cd[1], cd[2], bd[1], sm_scale,
            sliding_window, soft_cap};
  const int64_t group = p.num_q_heads / p.num_kv_heads;
  if (p.block_size > kMaxPage) {
    return ffi::Error::InvalidArgument("xlm_paged_attention: block_size above 256: " + shapes());
  }
  const int64_t row_tile = std::max<int64_t>(1, std::min(kRowTile, kMaxGroupRows / group));
  if (group > kMaxGroupRows) {
    return ffi::Error::InvalidArgument("xlm_paged_attention: more than 64 query heads per KV "
                                       "head: " + shapes());
  }
  const int64_t reqs = std::clamp<int64_t>(num_seqs.typed_data()[0], 0, num_reqs);
  const int64_t real_tokens = std::clamp<int64_t>(p.qsl[reqs], 0, p.num_tokens);
  // Padding rows (and any row no request owns) are zero.
  std::fill(p.out + real_tokens * p.num_q_heads * p.head_dim,
            p.out + p.num_tokens * p.num_q_heads * p.head_dim, 0.0f);
  auto job = std::make_shared<Job>();
  job->p = p;
  int64_t work = 0;
  for (int64_t r = 0; r < reqs; ++r) {
    const int64_t start = p.qsl[r], end = std::min<int64_t>(p.qsl[r + 1], real_tokens);
    const int64_t ctx = p.seq_lens[r];
    if (end <= start || ctx <= 0 || ctx > p.max_blocks * p.block_size || end - start > ctx) {
      // Malformed rows (never produced by the runner) stay zero rather than read out of range.
      if (end > start) {
        std::fill(p.out + start * p.num_q_heads * p.head_dim,
                  p.out + end * p.num_q_heads * p.head_dim, 0.0f);
      }
      continue;
    }
    for (int64_t row = start; row < end; row += row_tile) {
      const int64_t row_end = std::min(end, row + row_tile);
      for (int64_t h = 0; h < p.num_kv_heads; ++h) {
        job->items.push_back({static_cast<int32_t>(r), static_cast<int32_t>(h),
                              static_cast<int32_t>(row), static_cast<int32_t>(row_end)});
      }
      work += (row_end - row) * ctx * p.num_q_heads * p.head_dim * 2;
    }
  }
  const int64_t count = static_cast<int64_t>(job->items.size());
  int64_t threads = std::max<int64_t>(1, pool.num_threads());
  if (max_workers > 0) threads = std::min(threads, max_workers);
  const int64_t workers = work < kMinParallelWork ? 1 : std::min(threads, count);
  std::unique_ptr<xlm::HelperLease> lease;
  if (workers > 1) lease = xlm::StartHelpers(pool, workers - 1, job, p.num_tokens, work);
  job->run();
  for (int spins = 0; job->done.load(std::memory_order_acquire) < count; ++spins) {
    if (spins < 4096) {
      cpu_relax();
    } else {
      std::this_thread::yield();
    }
  }
  return ffi::Error::Success();
}

}  // namespace

XLA_FFI_DEFINE_HANDLER_SYMBOL(XlmPagedAttention, PagedAttentionImpl,
                              ffi::Ffi::Bind()
                                  .Ctx<ffi::ThreadPool>()
                                  .Arg<ffi::Buffer<ffi::F32>>()  // q [T, Hq, D]
                                  .Arg<ffi::AnyBuffer>()  // kv_cache [2, NB, BS, Hkv, row]
                                  .Arg<ffi::Buffer<ffi::S32>>()  // block_tables [R, MB]
                                  .Arg<ffi::Buffer<ffi::S32>>()  // seq_lens [R]
                                  .Arg<ffi::Buffer<ffi::S32>>()  // query_start_loc [R + 1]
                                  .Arg<ffi::Buffer<ffi::S32>>()  // num_seqs [1]
                                  .Ret<ffi::Buffer<ffi::F32>>()  // out [T, Hq, D]
                                  .Attr<float>("sm_scale")
                                  .Attr<int64_t>("sliding_window")  // 0: none
                                  .Attr<float>("soft_cap")          // 0: none
                                  .Attr<int64_t>("max_workers")     // threads; 0: all
);
