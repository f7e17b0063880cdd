// Paged attention on the CPU that reads K/V where they lie in the page pool (no gather copy).
//
// Built at run time by executor_svc/attention/cpu_kernel.py (torch.utils.cpp_extension, cached under
// ~/.cache/pagedkv). One task per (query token, KV head), spread over torch's intra-op threads: the task
// scores the query heads of that KV head against each visible key (read through the page table), takes
// the softmax in fp32 and sums the values the same way. In a decode step a layer's K/V come from DRAM (the
// weights of the layers between two calls evict them), so each task prefetches the next one's rows while it
// computes (Prefetcher; bench/NOTES.md "Session 13"). Visible keys of a query at position p of a request
// with context table row r:
//
//   [lo, min(sink, p + 1))  ++  [max(lo, p + 1 - window_r), p + 1)   when the request has a window (> 0)
//   [lo, p + 1)                                                     otherwise
//   lo = max(0, p + 1 - model_window) with a model-wide sliding window, else 0
//
// the same positions TorchPagedAttention's masks leave visible (its reference path).

#include <ATen/ATen.h>
#include <ATen/Dispatch.h>
#include <ATen/Parallel.h>
#include <torch/library.h>

#include <algorithm>
#include <cmath>
#include <cstdint>
#include <cstring>
#include <limits>
#include <tuple>
#include <type_traits>
#include <utility>
#include <vector>
#if defined(__AVX512F__)
#include <immintrin.h>
#endif

#include "cpu_math.h"
#include "cpu_ops.h"

namespace {

template <typename T>
inline float to_f(T x) { return static_cast<float>(x); }

// q . k over DIM channels (0: dim, known at run time).
typedef float f32x8 __attribute__((vector_size(32)));

template <int DIM, typename scalar_t>
inline float dot(const float* q, const scalar_t* k, int64_t dim) {
  if constexpr (DIM > 0 && DIM % 8 == 0 && std::is_same_v<scalar_t, float>) {
    f32x8 acc = {};
    for (int d = 0; d < DIM; d += 8) {
      f32x8 a, b;
      std::memcpy(&a, q + d, sizeof a);
      std::memcpy(&b, k + d, sizeof b);
      acc += a * b;
    }
    const f32x8 swapped = __builtin_shufflevector(acc, acc, 4, 5, 6, 7, 0, 1, 2, 3);
    acc += swapped;
    acc += __builtin_shufflevector(acc, acc, 2, 3, 0, 1, 6, 7, 4, 5);
    acc += __builtin_shufflevector(acc, acc, 1, 0, 3, 2, 5, 4, 7, 6);
    return acc[0];
  } else {
    float sum = 0.f;
#pragma omp simd reduction(+ : sum)
    for (int64_t d = 0; d < dim; ++d) sum += q[d] * to_f(k[d]);
    return sum;
  }
}

struct Range {
  int64_t begin, end;
};

constexpr int64_t kRunTokens = 32;  // queries of one run a task at most (attend)
constexpr int64_t kRunScores = 1 << 18;  // and its scores at most (1 MiB: in L2 with the keys' parts)
constexpr int64_t kCascadeQueries = 4;  // queries a block at most (attend_cascade)

// Software prefetch of the next task's K and V rows (all its heads), a few lines at a time from the current
// task's inner loops: in a decode step the pages come from DRAM (the layer's weights stream through the caches
// between two calls), and the hardware prefetchers stop at every page (one 4 KiB page or less of a page's rows).
struct Prefetcher {
  const char* k = nullptr;
  const char* v = nullptr;
  const int64_t* k_off = nullptr;  // row offsets in floats from k / v
  const int64_t* v_off = nullptr;
  int64_t rows = 0, row_lines = 0;
  // Spread evenly over the calls (Bresenham): each call adds `step` (2 x rows: K's rows, then V's) to `credit`,
  // and a whole row is fetched per `calls` of credit. step 0: nothing to fetch.
  int64_t step = 0, calls = 1, credit = 0, row = 0;

  // NOTE: a call costs an add and a compare; the inner loops take a copy (local(): registers, where a pointer's
  // fields stayed in memory) and hand it back. A division per line cost 40% of a hot decode call.
  __attribute__((always_inline)) inline void issue() {
    credit += step;
    while (credit >= calls && row < 2 * rows) {
      credit -= calls;
      const char* base = row < rows ? k + k_off[row] * sizeof(float) : v + v_off[row - rows] * sizeof(float);
      for (int64_t line = 0; line < row_lines; ++line) __builtin_prefetch(base + line * 64, 0, 1);
      ++row;
    }
  }
};

#if defined(__AVX512F__)
#define PAGEDKV_SIMD 1
constexpr int kLanes = 16, kRegisters = 32;
#elif defined(__AVX2__) && defined(__FMA__)
#define PAGEDKV_SIMD 1
constexpr int kLanes = 8, kRegisters = 16;
#endif

#if defined(PAGEDKV_SIMD)
// Register-blocked inner loops for float32 pages at head_dim DIM (a multiple of the vector width: 32-256), on
// whatever vectors -march=native gives (AVX-512: 16 lanes, 32 registers; AVX2: 8 lanes, 16 registers), written
// with GCC's vector types. NR query rows of one KV head at a time. Scores: each key row is loaded once for the NR
// rows (GQA: the query heads that share it), the horizontal sums of kLanes dots done together (fold_tree). Values: the NR output rows stay in
// registers across all keys (one FMA per vector of channels per row per key), instead of a load and a store of
// the accumulator per key. Each row's arithmetic is the same whatever NR, so a row's result does not depend on
// the rows beside it.
typedef float vfloat __attribute__((vector_size(kLanes * sizeof(float))));

inline vfloat vload(const float* p) {
  vfloat v;
  std::memcpy(&v, p, sizeof v);
  return v;
}

// Horizontal sums of kLanes vectors at once: out[l] = the sum of v[l]'s lanes. log2(kLanes) levels; each adds
// pairs of vectors after two shuffles, halving the lanes each original vector spreads over (~3 operations a sum
// against ~2 x kLanes for one vector's sum alone). Each sum's order of additions is fixed (a tree over its lanes),
// whatever the other vectors hold.
constexpr int lo_lane(int half, int lane) {
  const int group = lane / half, base = (group / 2) * 2 * half + lane % half;
  return group % 2 ? kLanes + base : base;
}

template <int HALF, size_t... L>
__attribute__((always_inline)) inline vfloat fold(vfloat a, vfloat b, std::index_sequence<L...>) {
  return __builtin_shufflevector(a, b, lo_lane(HALF, L)...) + __builtin_shufflevector(a, b, (lo_lane(HALF, L) + HALF)...);
}

// The sum of kLanes vectors' lanes for vectors I, I + S, ... (N of them), depth first (few live registers): at
// the root (N = kLanes, I = 0, S = 1) lane l holds vector l's sum.
template <int N, int I, int S, typename Dot>
__attribute__((always_inline)) inline vfloat fold_tree(const Dot& dot) {
  if constexpr (N == 1) {
    return dot(I);
  } else {
    return fold<S>(fold_tree<N / 2, I, 2 * S>(dot), fold_tree<N / 2, I + S, 2 * S>(dot),
                   std::make_index_sequence<kLanes>{});
  }
}

// Scores of NR query rows against the keys, kLanes keys at a time: their kLanes dot products of a row summed
// together (fold_tree).
template <int DIM, int NR>
inline void scores_simd(const float* q, const float* kh, const int64_t* k_off, int64_t visible, float* scores,
                        int64_t stride, Prefetcher& pf_out) {
  constexpr int C = DIM / kLanes;
  Prefetcher pf = pf_out;
  vfloat qv[NR][C];
  for (int r = 0; r < NR; ++r)
    for (int c = 0; c < C; ++c) qv[r][c] = vload(q + r * DIM + c * kLanes);
  for (int64_t j0 = 0; j0 < visible; j0 += kLanes) {
    const int64_t keys = std::min<int64_t>(kLanes, visible - j0);
    const float* key[kLanes];
    for (int l = 0; l < kLanes; ++l) key[l] = kh + k_off[j0 + std::min<int64_t>(l, keys - 1)];  // (tail: repeats)
    pf.issue();
    for (int r = 0; r < NR; ++r) {
      const vfloat sums = fold_tree<kLanes, 0, 1>([&](int l) __attribute__((always_inline)) {
        vfloat acc = qv[r][0] * vload(key[l]);
        for (int c = 1; c < C; ++c) acc += qv[r][c] * vload(key[l] + c * kLanes);
        return acc;
      });
      if (keys == kLanes)  // (a copy of a known size: one store, where a variable one is a call to memcpy)
        std::memcpy(scores + r * stride + j0, &sums, sizeof sums);
      else
        std::memcpy(scores + r * stride + j0, &sums, keys * sizeof(float));
    }
  }
  pf_out = pf;
}

template <int DIM, int NR>
inline void values_simd(const float* weights, int64_t stride, const float* vh, const int64_t* v_off,
                        int64_t visible, const float* denom, float* out, Prefetcher& pf_out) {
  constexpr int C = DIM / kLanes;
  Prefetcher pf = pf_out;
  vfloat acc[NR][C] = {};
  for (int64_t j = 0; j < visible; ++j) {
    pf.issue();
    const float* val = vh + v_off[j];
    vfloat vv[C];
    for (int c = 0; c < C; ++c) vv[c] = vload(val + c * kLanes);
    for (int r = 0; r < NR; ++r) {
      const float w = weights[r * stride + j];
      for (int c = 0; c < C; ++c) acc[r][c] += w * vv[c];
    }
  }
  for (int r = 0; r < NR; ++r) {
    const float inv = 1.f / denom[r];
    for (int c = 0; c < C; ++c) {
      const vfloat o = acc[r][c] * inv;
      std::memcpy(out + r * DIM + c * kLanes, &o, sizeof o);
    }
  }
  pf_out = pf;
}

// The rows of one KV head in blocks that keep q (or the accumulators) and a key in registers: DIM / kLanes
// registers a row, half the registers for the rows (AVX-512: 8 rows at 32, 4 at 64, 2 at 128, 1 at 256; AVX2: 2
// at 32, 1 above).
template <int DIM>
constexpr int64_t kRowBlock = kRegisters >= 32 ? std::max(1, std::min(8, kRegisters / 2 / (DIM / kLanes))) : 4;

#define PAGEDKV_ROW_BLOCK_CASES(F)                                                    \
  switch (std::min<int64_t>(kRowBlock<DIM>, rows - r0)) {                              \
    case 1: F(1); break;                                                               \
    case 2: if constexpr (kRowBlock<DIM> >= 2) { F(2); } break;                        \
    case 3: if constexpr (kRowBlock<DIM> >= 3) { F(3); } break;                        \
    case 4: if constexpr (kRowBlock<DIM> >= 4) { F(4); } break;                        \
    case 5: if constexpr (kRowBlock<DIM> >= 5) { F(5); } break;                        \
    case 6: if constexpr (kRowBlock<DIM> >= 6) { F(6); } break;                        \
    case 7: if constexpr (kRowBlock<DIM> >= 7) { F(7); } break;                        \
    default: if constexpr (kRowBlock<DIM> >= 8) { F(8); } break;                       \
  }

template <int DIM>
inline void scores_rows_simd(const float* q, const float* kh, const int64_t* k_off, int64_t visible,
                             float* scores, int64_t rows, Prefetcher& pf) {
  for (int64_t r0 = 0; r0 < rows; r0 += kRowBlock<DIM>) {
    const float* qr = q + r0 * DIM;
    float* sr = scores + r0 * visible;
#define PAGEDKV_SCORES(NR) scores_simd<DIM, NR>(qr, kh, k_off, visible, sr, visible, pf)
    PAGEDKV_ROW_BLOCK_CASES(PAGEDKV_SCORES)
#undef PAGEDKV_SCORES
  }
}

template <int DIM>
inline void values_rows_simd(const float* weights, const float* vh, const int64_t* v_off, int64_t visible,
                             const float* denom, float* out, int64_t rows, Prefetcher& pf) {
  for (int64_t r0 = 0; r0 < rows; r0 += kRowBlock<DIM>) {
    const float* wr = weights + r0 * visible;
    float* o = out + r0 * DIM;
#define PAGEDKV_VALUES(NR) values_simd<DIM, NR>(wr, visible, vh, v_off, visible, denom + r0, o, pf)
    PAGEDKV_ROW_BLOCK_CASES(PAGEDKV_VALUES)
#undef PAGEDKV_VALUES
  }
}

// Queries that share keys (attend's runs: a prefill chunk's tokens; attend_cascade's blocks: decodes over a shared
// prefix) take them kRunKeys at a time (32 KiB of K at DIM 64), each part in L1 across all of their rows, where a
// lone query's loops take each row block over all of its keys. The same arithmetic for each row: each score is one
// fold_tree lane's (whatever keys are beside it), and each value sum the same additions in the same order, its
// running sums kept in ``acc`` between parts (a float stored and loaded is the same float), then scaled by
// 1 / denominator as values_simd does. Scores and weights: row r's key j at [r * stride + j].
template <int DIM>
constexpr int64_t kRunKeys = std::max<int64_t>(kLanes, 8192 / DIM);

// Software prefetch of one head's rows (DIM floats each) at offsets[0, n) from ``base``: the next part's keys, and
// a cascade's queries' own keys, whose pages are scattered (the hardware prefetchers stop at each page).
template <int DIM>
inline void prefetch_rows(const float* base, const int64_t* offsets, int64_t n) {
  for (int64_t j = 0; j < n; ++j)
    for (int64_t line = 0; line < DIM * static_cast<int64_t>(sizeof(float)); line += 64)
      __builtin_prefetch(reinterpret_cast<const char*>(base + offsets[j]) + line, 0, 1);
}

template <int DIM, int NR>
inline void values_part_simd(const float* weights, int64_t stride, const float* vh, const int64_t* v_off,
                             int64_t keys, float* acc_io, bool first) {
  constexpr int C = DIM / kLanes;
  vfloat acc[NR][C] = {};
  if (!first)
    for (int r = 0; r < NR; ++r)
      for (int c = 0; c < C; ++c) acc[r][c] = vload(acc_io + r * DIM + c * kLanes);
  for (int64_t j = 0; j < keys; ++j) {
    const float* val = vh + v_off[j];
    vfloat vv[C];
    for (int c = 0; c < C; ++c) vv[c] = vload(val + c * kLanes);
    for (int r = 0; r < NR; ++r) {
      const float w = weights[r * stride + j];
      for (int c = 0; c < C; ++c) acc[r][c] += w * vv[c];
    }
  }
  for (int r = 0; r < NR; ++r)
    for (int c = 0; c < C; ++c) std::memcpy(acc_io + r * DIM + c * kLanes, &acc[r][c], sizeof(vfloat));
}

// Scores of `rows` query rows (q: DIM floats each) against `keys` keys.
template <int DIM>
inline void scores_run_simd(const float* q, const float* kh, const int64_t* k_off, int64_t keys, float* scores,
                            int64_t stride, int64_t rows) {
  Prefetcher none;
  for (int64_t j0 = 0; j0 < keys; j0 += kRunKeys<DIM>) {
    const int64_t part = std::min(kRunKeys<DIM>, keys - j0);
    prefetch_rows<DIM>(kh, k_off + j0 + part, std::min(kRunKeys<DIM>, keys - j0 - part));
    for (int64_t r0 = 0; r0 < rows; r0 += kRowBlock<DIM>) {
      const float* qr = q + r0 * DIM;
      float* sr = scores + r0 * stride + j0;
#define PAGEDKV_SCORES(NR) scores_simd<DIM, NR>(qr, kh, k_off + j0, part, sr, stride, none)
      PAGEDKV_ROW_BLOCK_CASES(PAGEDKV_SCORES)
#undef PAGEDKV_SCORES
    }
  }
}

// The value sums of `rows` rows over `keys` keys into their running sums ``acc`` (begun here when `first`).
template <int DIM>
inline void values_run_simd(const float* weights, int64_t stride, const float* vh, const int64_t* v_off, int64_t keys,
                            float* acc, int64_t rows, bool first) {
  for (int64_t j0 = 0; j0 < keys; j0 += kRunKeys<DIM>) {
    const int64_t part = std::min(kRunKeys<DIM>, keys - j0);
    prefetch_rows<DIM>(vh, v_off + j0 + part, std::min(kRunKeys<DIM>, keys - j0 - part));
    for (int64_t r0 = 0; r0 < rows; r0 += kRowBlock<DIM>) {
      const float* wr = weights + r0 * stride + j0;
      const bool begin = first && j0 == 0;
#define PAGEDKV_VALUES(NR) values_part_simd<DIM, NR>(wr, stride, vh, v_off + j0, part, acc + r0 * DIM, begin)
      PAGEDKV_ROW_BLOCK_CASES(PAGEDKV_VALUES)
#undef PAGEDKV_VALUES
    }
  }
}

// out row r = acc row r / denom[r] (values_simd's last step).
template <int DIM>
inline void normalize_rows(const float* acc, const float* denom, float* out, int64_t rows) {
  for (int64_t r = 0; r < rows; ++r) {
    const float inv = 1.f / denom[r];
    for (int d = 0; d < DIM; ++d) out[r * DIM + d] = acc[r * DIM + d] * inv;
  }
}
#else
// Without vectors (no AVX2/FMA, no AVX-512) the fast path is never taken (kFast is false); these only name it.
template <int DIM>
inline void scores_rows_simd(const float*, const float*, const int64_t*, int64_t, float*, int64_t, Prefetcher&) {}
template <int DIM>
inline void values_rows_simd(const float*, const float*, const int64_t*, int64_t, const float*, float*, int64_t,
                             Prefetcher&) {}
template <int DIM>
inline void scores_run_simd(const float*, const float*, const int64_t*, int64_t, float*, int64_t, int64_t) {}
template <int DIM>
inline void values_run_simd(const float*, int64_t, const float*, const int64_t*, int64_t, float*, int64_t, bool) {}
template <int DIM>
inline void normalize_rows(const float*, const float*, float*, int64_t) {}
#endif

// The largest of x[0, n) (GCC runs std::max's loop one lane at a time, a chain of dependent maxss).
inline float max_of(const float* x, int64_t n) {
  float mx = -std::numeric_limits<float>::infinity();
  int64_t j = 0;
#if defined(PAGEDKV_SIMD)
  vfloat m = mx - vfloat{};
  for (; j + kLanes <= n; j += kLanes) {
    const vfloat v = vload(x + j);
    m = v > m ? v : m;
  }
  for (int l = 0; l < kLanes; ++l) mx = std::max(mx, m[l]);
#endif
  for (; j < n; ++j) mx = std::max(mx, x[j]);
  return mx;
}

// On AVX-512, a loop's vectors 512 bits wide where GCC would take 256 (its default there; exp_row: ~5% of a long
// prefill's attention).
#if defined(__AVX512F__)
#define PAGEDKV_WIDE __attribute__((target("prefer-vector-width=512")))
#else
#define PAGEDKV_WIDE
#endif

// A row's softmax numerators in place, e^(s - max) over its n scores; returns their sum, the max in *max_out. One
// copy of the loop (noinline) for every caller, so that its vectorized sum adds in the same order wherever a row
// is computed (a decode, a prefill chunk's run, a cascade's block, a shared prefix's chunk).
#if defined(__AVX512F__)
// e^x of 16 lanes, x <= 0 (a score minus its row's max): exp_clamped's range reduction and polynomial in
// AVX-512 instructions, 2^n by vscalefps (no integer detour), clamped below at -87.
__attribute__((always_inline)) inline __m512 exp16(__m512 x) {
  x = _mm512_max_ps(x, _mm512_set1_ps(-87.f));
  const __m512 n = _mm512_roundscale_ps(_mm512_mul_ps(x, _mm512_set1_ps(1.44269504088896341f)),
                                        _MM_FROUND_TO_NEAREST_INT | _MM_FROUND_NO_EXC);
  __m512 r = _mm512_fnmadd_ps(n, _mm512_set1_ps(0.693359375f), x);
  r = _mm512_fmadd_ps(n, _mm512_set1_ps(2.12194440e-4f), r);
  __m512 p = _mm512_fmadd_ps(_mm512_set1_ps(1.9875691500e-4f), r, _mm512_set1_ps(1.3981999507e-3f));
  p = _mm512_fmadd_ps(p, r, _mm512_set1_ps(8.3334519073e-3f));
  p = _mm512_fmadd_ps(p, r, _mm512_set1_ps(4.1665795894e-2f));
  p = _mm512_fmadd_ps(p, r, _mm512_set1_ps(1.6666665459e-1f));
  p = _mm512_fmadd_ps(p, r, _mm512_set1_ps(5.0000001201e-1f));
  const __m512 y = _mm512_add_ps(_mm512_fmadd_ps(p, _mm512_mul_ps(r, r), r), _mm512_set1_ps(1.f));
  return _mm512_scalef_ps(y, n);
}

__attribute__((noinline)) float exp_row(float* sr, int64_t n, float* max_out) {
  const float mx = max_of(sr, n);
  const __m512 vmx = _mm512_set1_ps(mx);
  __m512 acc0 = _mm512_setzero_ps(), acc1 = _mm512_setzero_ps();
  int64_t j = 0;
  for (; j + 32 <= n; j += 32) {
    const __m512 a = exp16(_mm512_sub_ps(_mm512_loadu_ps(sr + j), vmx));
    const __m512 b = exp16(_mm512_sub_ps(_mm512_loadu_ps(sr + j + 16), vmx));
    _mm512_storeu_ps(sr + j, a);
    _mm512_storeu_ps(sr + j + 16, b);
    acc0 = _mm512_add_ps(acc0, a);
    acc1 = _mm512_add_ps(acc1, b);
  }
  for (; j < n; j += 16) {
    const __mmask16 m = n - j >= 16 ? __mmask16(0xffff) : __mmask16((1u << (n - j)) - 1);
    const __m512 a = exp16(_mm512_sub_ps(_mm512_mask_loadu_ps(vmx, m, sr + j), vmx));
    _mm512_mask_storeu_ps(sr + j, m, a);
    acc0 = _mm512_mask_add_ps(acc0, m, acc0, a);
  }
  *max_out = mx;
  return _mm512_reduce_add_ps(_mm512_add_ps(acc0, acc1));
}
#else
PAGEDKV_WIDE __attribute__((noinline)) float exp_row(float* sr, int64_t n, float* max_out) {
  const float mx = max_of(sr, n);
  float sum = 0.f;
#pragma omp simd reduction(+ : sum)
  for (int64_t j = 0; j < n; ++j) {
    sr[j] = pagedkv_cpu::exp_clamped(sr[j] - mx);
    sum += sr[j];
  }
  *max_out = mx;
  return sum;
}
#endif

// Calls fn(key pointer offset, position) for each visible position, page by page (no division per key).
// A page id outside the pool is an error (as index_select's), never a read out of bounds.
template <typename Fn>
inline void for_each_key(const int64_t* table, int64_t num_pages, int64_t block_size, int64_t page_stride,
                         int64_t token_stride, const Range* ranges, int n_ranges, Fn fn) {
  for (int r = 0; r < n_ranges; ++r) {
    int64_t pos = ranges[r].begin;
    const int64_t end = ranges[r].end;
    while (pos < end) {
      const int64_t page = pos / block_size;
      const int64_t page_end = std::min(end, (page + 1) * block_size);
      const int64_t id = table[page];
      TORCH_CHECK(id >= 0 && id < num_pages, "paged_attention_cpu: page id ", id, " outside the pool of ",
                  num_pages, " pages");
      int64_t offset = id * page_stride + (pos - page * block_size) * token_stride;
      for (; pos < page_end; ++pos, offset += token_stride) fn(offset, pos);
    }
  }
}

// DIM: head_dim known at compile time (straight-line dot products), or 0: q's.
template <typename scalar_t, int DIM>
void attend(const at::Tensor& q, const at::Tensor& k_cache, const at::Tensor& v_cache,
            const at::Tensor& tables, const at::Tensor& q_rows, const at::Tensor& q_pos,
            const at::Tensor& sinks, const at::Tensor& windows, int64_t model_window, double scale,
            int64_t start, const at::Tensor& prior_out, const at::Tensor& prior_lse, at::Tensor& out) {
  const int64_t n = q.size(0), heads = q.size(1), dim = DIM > 0 ? DIM : q.size(2);
  const int64_t num_pages = std::min(k_cache.size(0), v_cache.size(0));
  const int64_t block_size = k_cache.size(1), kv_heads = k_cache.size(2);
  const int64_t group = heads / kv_heads;
  const int64_t width = tables.size(1);
  const scalar_t* qp = q.data_ptr<scalar_t>();
  const scalar_t* kp = k_cache.data_ptr<scalar_t>();
  const scalar_t* vp = v_cache.data_ptr<scalar_t>();
  scalar_t* op = out.data_ptr<scalar_t>();
  const int64_t k_page = k_cache.stride(0), k_tok = k_cache.stride(1), k_head = k_cache.stride(2);
  const int64_t v_page = v_cache.stride(0), v_tok = v_cache.stride(1), v_head = v_cache.stride(2);
  const int64_t* tp = tables.data_ptr<int64_t>();
  const int64_t* rows = q_rows.numel() ? q_rows.data_ptr<int64_t>() : nullptr;
  const int64_t* pos_p = q_pos.data_ptr<int64_t>();
  const int64_t* sink_p = sinks.numel() ? sinks.data_ptr<int64_t>() : nullptr;
  const int64_t* win_p = windows.numel() ? windows.data_ptr<int64_t>() : nullptr;
  const float fscale = static_cast<float>(scale);
  const scalar_t* prior_p = prior_out.numel() ? prior_out.data_ptr<scalar_t>() : nullptr;
  const float* prior_lse_p = prior_p ? prior_lse.data_ptr<float>() : nullptr;
#if defined(PAGEDKV_SIMD)
  constexpr bool kFast = std::is_same_v<scalar_t, float> && DIM >= 32 && DIM % kLanes == 0;
#else
  constexpr bool kFast = false;
#endif
  // Runs: consecutive queries on one table row at consecutive positions (a prefill chunk's tokens), taken by one
  // task (kRunTokens at most, fewer where there would be under ~4 tasks a thread or over kRunScores scores; on the
  // fast path, without a window of their request's or a prior). Their keys are one range but for its ends, read
  // once for the run (scores_run_simd, values_run_simd). Each query's arithmetic is a lone query's: scores outside
  // its own keys are computed but left out of its softmax, and its values' sums run over those keys at weight 0,
  // which adds nothing. So a token's result does not depend on whether it is computed in a prefill chunk (of any
  // length, starting anywhere) or in a decode, nor on the queries beside it (tests/unit/test_attention_rows_exact.py).
  // NOTE: the softmax of every path is exp_row's one loop; the scores and sums are the same inline loops.
  std::vector<int64_t> run_first;  // run k: queries [run_first[k], run_first[k + 1])
  run_first.reserve(n + 1);
  const bool may_run = kFast && rows && !prior_p;
  int64_t run_tokens = 1;  // (a run's length does not change its queries' results: made for speed alone)
  if (may_run) {
    int64_t keys = 1;
    for (int64_t i = 0; i < n; ++i) keys = std::max(keys, pos_p[i] + 1);
    const int64_t want = (4 * static_cast<int64_t>(at::get_num_threads()) + kv_heads - 1) / kv_heads;  // runs
    run_tokens = std::clamp<int64_t>(std::min(n / want, kRunScores / (group * keys)), 1, kRunTokens);
  }
  int64_t longest = 1;
  for (int64_t i = 0; i < n;) {
    int64_t j = i + 1;
    if (may_run && (!win_p || rows[i] < 0 || rows[i] >= tables.size(0) || win_p[rows[i]] <= 0))
      while (j < n && j - i < run_tokens && rows[j] == rows[i] && pos_p[j] == pos_p[j - 1] + 1) ++j;
    run_first.push_back(i);
    longest = std::max(longest, j - i);
    i = j;
  }
  run_first.push_back(n);
  const int64_t runs = static_cast<int64_t>(run_first.size()) - 1;
  // NOTE: with enough queries one task takes all KV heads of a query, reading each key's heads (one
  // contiguous row) together; with few (a small batch), or runs, one task per (query, KV head) keeps threads busy
  // (and a run's scores small).
  const int64_t per_task = runs >= 4 * at::get_num_threads() && longest == 1 ? kv_heads : 1;
  const int64_t blocks = kv_heads / per_task;
  const int64_t heads_per_task = per_task * group;  // query heads of one task's query
  // With runs, the tasks alternate between the first runs and the last (0, R - 1, 1, R - 2, ...): a thread's
  // contiguous share of the tasks then holds its share of the work (a prompt's later tokens see more keys).
  auto run_of = [&](int64_t k) { return longest == 1 ? k : (k % 2 ? runs - 1 - k / 2 : k / 2); };

  // Where each visible key's row of a task starts in the K and V views (offsets from head 0's): returns their
  // number.
  auto lo_of = [&](int64_t p) { return std::max<int64_t>(start, model_window > 0 ? p + 1 - model_window : 0); };
  // A run's keys: from its first query's first to its last query's last (one range: a run has no window of its own).
  auto key_rows = [&](int64_t task, std::vector<int64_t>& k_off, std::vector<int64_t>& v_off) -> int64_t {
    const int64_t run = run_of(task / blocks), i = run_first[run + 1] - 1;
    const int64_t row = rows ? rows[i] : i;
    TORCH_CHECK(row >= 0 && row < tables.size(0), "paged_attention_cpu: table row ", row, " of ", tables.size(0));
    const int64_t p = pos_p[i], p_first = pos_p[run_first[run]];
    TORCH_CHECK(p_first >= 0 && p < width * block_size, "paged_attention_cpu: query position ",
                p_first < 0 ? p_first : p, " outside its page table of ", width, " pages");
    const int64_t* table = tp + row * width;
    const int64_t lo = lo_of(p_first);
    Range ranges[2];
    int n_ranges = 0;
    const int64_t w = win_p ? win_p[row] : 0;
    if (w > 0) {
      const int64_t sink_end = std::min(sink_p[row], p + 1);
      const int64_t tail = std::max(lo, p + 1 - w);
      if (sink_end >= tail) {  // the sink reaches the window: one run
        ranges[n_ranges++] = {lo, p + 1};
      } else {
        if (sink_end > lo) ranges[n_ranges++] = {lo, sink_end};
        ranges[n_ranges++] = {tail, p + 1};
      }
    } else {
      ranges[n_ranges++] = {lo, p + 1};
    }
    int64_t visible = 0;
    for (int r = 0; r < n_ranges; ++r) visible += ranges[r].end - ranges[r].begin;
    k_off.resize(visible);
    v_off.resize(visible);
    int64_t idx = 0;
    for_each_key(table, num_pages, block_size, k_page, k_tok, ranges, n_ranges,
                 [&](int64_t off, int64_t) { k_off[idx++] = off; });
    idx = 0;
    for_each_key(table, num_pages, block_size, v_page, v_tok, ranges, n_ranges,
                 [&](int64_t off, int64_t) { v_off[idx++] = off; });
    return visible;
  };

  at::parallel_for(0, runs * blocks, 1, [&](int64_t first, int64_t last) {
    const pagedkv_cpu::FlushDenormals ftz;
    std::vector<float> qf, acc, denom, maxes, scores, outs;
    std::vector<int64_t> k_off, v_off, k_next, v_next;
    int64_t visible_next = first < last ? key_rows(first, k_next, v_next) : 0;
    for (int64_t task = first; task < last; ++task) {
      const int64_t run = run_of(task / blocks), h0 = (task % blocks) * per_task;
      const int64_t i = run_first[run], tokens = run_first[run + 1] - i;  // queries i .. i + tokens - 1
      const int64_t rows_per_task = tokens * heads_per_task;  // query vectors: [KV head][token][its query heads]
      std::swap(k_off, k_next);
      std::swap(v_off, v_next);
      const int64_t visible = visible_next;  // (the run's last query's)
      visible_next = task + 1 < last ? key_rows(task + 1, k_next, v_next) : 0;
      scores.resize(rows_per_task * visible);
      qf.resize(rows_per_task * dim);
      denom.resize(rows_per_task);
      maxes.resize(rows_per_task);

      for (int64_t hh = 0; hh < per_task; ++hh)
        for (int64_t t = 0; t < tokens; ++t) {
          const scalar_t* qi = qp + ((i + t) * heads + (h0 + hh) * group) * dim;
          float* dst = qf.data() + (hh * tokens + t) * group * dim;
          for (int64_t j = 0; j < group * dim; ++j) dst[j] = to_f(qi[j]) * fscale;
        }

      const scalar_t* kh = kp + h0 * k_head;
      Prefetcher pf;
      if (kFast && tokens == 1 && visible_next > 0) {  // the next task's heads: its own h0 (a run's keys: in cache)
        const int64_t next_h0 = ((task + 1) % blocks) * per_task;
        pf.k = reinterpret_cast<const char*>(kp + next_h0 * k_head);
        pf.v = reinterpret_cast<const char*>(vp + next_h0 * v_head);
        pf.k_off = k_next.data();
        pf.v_off = v_next.data();
        pf.rows = visible_next;
        pf.row_lines = ((per_task - 1) * k_head + dim) * static_cast<int64_t>(sizeof(float)) / 64 + 1;
        pf.step = 2 * visible_next;
        pf.calls = per_task * (visible + visible / 16 + 1);  // values' keys and scores' key blocks (16 keys: AVX-512)
      }
      const int64_t q_rows_hh = tokens * group;  // query vectors of one KV head
      if constexpr (kFast) {
        for (int64_t hh = 0; hh < per_task; ++hh) {
          const float* qh = qf.data() + hh * q_rows_hh * DIM;
          const float* kr = reinterpret_cast<const float*>(kh + hh * k_head);
          float* sh = scores.data() + hh * q_rows_hh * visible;
          if (tokens > 1)
            scores_run_simd<DIM>(qh, kr, k_off.data(), visible, sh, visible, q_rows_hh);
          else
            scores_rows_simd<DIM>(qh, kr, k_off.data(), visible, sh, q_rows_hh, pf);
        }
      } else {
      for (int64_t j = 0; j < visible; ++j) {
        for (int64_t hh = 0, r = 0; hh < per_task; ++hh) {
          const scalar_t* key = kh + k_off[j] + hh * k_head;
          for (int64_t g = 0; g < group; ++g, ++r) {
            scores[r * visible + j] = dot<DIM>(qf.data() + r * dim, key, dim);
          }
        }
      }
      }
      const int64_t run_lo = lo_of(pos_p[i]);
      for (int64_t r = 0; r < rows_per_task; ++r) {
        // this query's keys: [lo, p] of the run's [run_lo, last position] (all of them for a lone query)
        const int64_t p = pos_p[i + r / group % tokens], skip = tokens > 1 ? lo_of(p) - run_lo : 0;
        const int64_t own = tokens > 1 ? p + 1 - lo_of(p) : visible;
        float* all = scores.data() + r * visible;
        std::fill(all, all + skip, 0.f);  // (keys of earlier queries of the run only: under a sliding window)
        float* sr = all + skip;
        denom[r] = exp_row(sr, own, &maxes[r]);
        std::fill(sr + own, all + visible, 0.f);  // (keys of later queries of the run only)
      }

      scalar_t* oi = op + (i * heads + h0 * group) * dim;
      const scalar_t* vh = vp + h0 * v_head;
      // With a prior (the keys before ``start``, attended elsewhere: their normalized output and log-sum-exp),
      // the two softmaxes are merged: out = (1 - w) x this part + w x prior, w = 1 / (1 + e^(lse - prior_lse)).
      // (A task with a prior has one query.)
      auto merge_prior = [&]() {
        if (!prior_p) return;
        const int64_t base = i * heads + h0 * group;
        for (int64_t r = 0; r < rows_per_task; ++r) {
          const scalar_t* pr = prior_p + (base + r) * dim;
          scalar_t* o = oi + r * dim;
          if (visible == 0) {  // nothing after start: the prior alone
            for (int64_t d = 0; d < dim; ++d) o[d] = pr[d];
            continue;
          }
          const float lse = maxes[r] + std::log(denom[r]);
          const float w = 1.f / (1.f + pagedkv_cpu::exp_clamped(lse - prior_lse_p[base + r]));
          for (int64_t d = 0; d < dim; ++d) o[d] = static_cast<scalar_t>((1.f - w) * to_f(o[d]) + w * to_f(pr[d]));
        }
      };
      if constexpr (kFast) {
        if (tokens == 1) {  // (its rows are contiguous in out)
          for (int64_t hh = 0; hh < per_task; ++hh)
            values_rows_simd<DIM>(scores.data() + hh * q_rows_hh * visible,
                                  reinterpret_cast<const float*>(vh + hh * v_head), v_off.data(), visible,
                                  denom.data() + hh * q_rows_hh, reinterpret_cast<float*>(oi) + hh * q_rows_hh * DIM,
                                  q_rows_hh, pf);
          merge_prior();
          continue;
        }
        // a run: [KV head][token][query head] here, copied to out's [token][head]
        outs.resize(rows_per_task * DIM);
        acc.resize(rows_per_task * DIM);
        values_run_simd<DIM>(scores.data(), visible, reinterpret_cast<const float*>(vh), v_off.data(), visible,
                             acc.data(), rows_per_task, true);  // (per_task is 1: one KV head)
        normalize_rows<DIM>(acc.data(), denom.data(), outs.data(), rows_per_task);
        for (int64_t hh = 0; hh < per_task; ++hh)
          for (int64_t t = 0; t < tokens; ++t)
            std::memcpy(op + ((i + t) * heads + (h0 + hh) * group) * dim,
                        outs.data() + (hh * tokens + t) * group * DIM, group * DIM * sizeof(float));
        continue;
      }
      acc.assign(rows_per_task * dim, 0.f);
      for (int64_t j = 0; j < visible; ++j) {
        for (int64_t hh = 0, r = 0; hh < per_task; ++hh) {
          const scalar_t* val = vh + v_off[j] + hh * v_head;
          for (int64_t g = 0; g < group; ++g, ++r) {
            const float weight = scores[r * visible + j];
            float* a = acc.data() + r * dim;
#pragma omp simd
            for (int64_t d = 0; d < dim; ++d) a[d] += weight * to_f(val[d]);
          }
        }
      }

      for (int64_t r = 0; r < rows_per_task; ++r) {
        const float inv = 1.f / denom[r];
        for (int64_t d = 0; d < dim; ++d) oi[r * dim + d] = static_cast<scalar_t>(acc[r * dim + d] * inv);
      }
      merge_prior();
    }
  });
}

template <typename scalar_t, typename... Args>
void attend_any_dim(const at::Tensor& q, Args&&... args) {
  switch (q.size(2)) {  // the common head sizes get straight-line dot products
    case 32: return attend<scalar_t, 32>(q, args...);
    case 64: return attend<scalar_t, 64>(q, args...);
    case 128: return attend<scalar_t, 128>(q, args...);
    case 256: return attend<scalar_t, 256>(q, args...);
    default: return attend<scalar_t, 0>(q, args...);
  }
}

void check(bool ok, const char* what) { TORCH_CHECK(ok, "paged_attention_cpu: ", what); }

}  // namespace

// q [N, heads, D] contiguous; k_cache / v_cache [pages, block_size, kv_heads, D] (D contiguous, any other
// strides); tables [R, W] int64; q_rows [N] (empty: query i uses row i); q_pos [N] the position of each
// query; sinks / windows [R] (empty: no request has a window). Returns [N, heads, D].
// The arguments' checks; returns the output, empty.
static at::Tensor paged_attention_checked(const at::Tensor& q, const at::Tensor& k_cache, const at::Tensor& v_cache,
                                          const at::Tensor& tables, const at::Tensor& q_rows, const at::Tensor& q_pos,
                                   const at::Tensor& sinks, const at::Tensor& windows) {
  check(q.dim() == 3 && q.is_contiguous(), "q must be a contiguous [N, heads, head_dim]");
  check(k_cache.dim() == 4 && v_cache.dim() == 4, "caches must be [pages, block_size, kv_heads, head_dim]");
  check(k_cache.stride(3) == 1 && v_cache.stride(3) == 1, "head_dim must be contiguous in the caches");
  check(k_cache.scalar_type() == q.scalar_type() && v_cache.scalar_type() == q.scalar_type(),
        "caches must have q's dtype");
  check(k_cache.size(3) == q.size(2) && q.size(1) % k_cache.size(2) == 0, "head shapes disagree");
  check(tables.scalar_type() == at::kLong && tables.dim() == 2 && tables.is_contiguous(), "tables");
  check(q_pos.scalar_type() == at::kLong && q_pos.numel() == q.size(0) && q_pos.is_contiguous(), "q_pos");
  check(q_rows.numel() == 0 || (q_rows.scalar_type() == at::kLong && q_rows.numel() == q.size(0) &&
                                q_rows.is_contiguous()), "q_rows");
  check(windows.numel() == 0 || (windows.scalar_type() == at::kLong && sinks.scalar_type() == at::kLong &&
                                 windows.numel() == tables.size(0) && sinks.numel() == tables.size(0) &&
                                 windows.is_contiguous() && sinks.is_contiguous()), "sinks/windows");
  return at::empty_like(q);
}

namespace pagedkv_cpu {

at::Tensor paged_attention(at::Tensor q, at::Tensor k_cache, at::Tensor v_cache, at::Tensor tables,
                              at::Tensor q_rows, at::Tensor q_pos, at::Tensor sinks, at::Tensor windows,
                              int64_t model_window, double scale) {
  auto out = paged_attention_checked(q, k_cache, v_cache, tables, q_rows, q_pos, sinks, windows);
  const at::Tensor none = at::empty({0}, q.options());
  AT_DISPATCH_FLOATING_TYPES_AND2(at::kHalf, at::kBFloat16, q.scalar_type(), "paged_attention_cpu", [&] {
    attend_any_dim<scalar_t>(q, k_cache, v_cache, tables, q_rows, q_pos, sinks, windows, model_window, scale,
                             int64_t{0}, none, none, out);
  });
  return out;
}

}  // namespace pagedkv_cpu

// The cascade's second half (executor_svc/attention/torch_backend.py, "shared prefix"): each query attends to its
// keys at positions >= start (no windows), and the result is merged with ``prior_out`` [N, heads, D] (q's dtype,
// contiguous) and ``prior_lse`` [N, heads] (float32, contiguous): the same queries' attention over the keys before
// start, normalized, and its log-sum-exp of the scaled scores. Query i uses table row i. Returns [N, heads, D].
namespace pagedkv_cpu {

at::Tensor paged_attention_after(at::Tensor q, at::Tensor k_cache, at::Tensor v_cache, at::Tensor tables,
                                 at::Tensor q_pos, int64_t start, at::Tensor prior_out, at::Tensor prior_lse,
                                 double scale) {
  check(start >= 0, "start must be >= 0");
  check(prior_out.sizes() == q.sizes() && prior_out.scalar_type() == q.scalar_type() && prior_out.is_contiguous(),
        "prior_out must be a contiguous tensor like q");
  check(prior_lse.dim() == 2 && prior_lse.size(0) == q.size(0) && prior_lse.size(1) == q.size(1) &&
        prior_lse.scalar_type() == at::kFloat && prior_lse.is_contiguous(), "prior_lse must be float32 [N, heads]");
  check(tables.dim() == 2 && tables.size(0) == q.size(0), "tables must have a row per query");
  const at::Tensor none = at::empty({0}, q_pos.options());
  auto out = paged_attention_checked(q, k_cache, v_cache, tables, none, q_pos, none, none);
  AT_DISPATCH_FLOATING_TYPES_AND2(at::kHalf, at::kBFloat16, q.scalar_type(), "paged_attention_after", [&] {
    attend_any_dim<scalar_t>(q, k_cache, v_cache, tables, none, q_pos, none, none, int64_t{0}, scale, start,
                             prior_out, prior_lse, out);
  });
  return out;
}

}  // namespace pagedkv_cpu

namespace {

#if defined(PAGEDKV_SIMD)
// The cascade's first half as matrix products (paged_attention_shared below). A task takes one KV head, one block
// of query vectors (kSharedRowBlock at most) and a group of the shared keys' chunks (kSharedChunk keys each). For
// each chunk: its K transposed into panels of kKeyBlock keys ([DIM][kKeyBlock] each, contiguous; zeros after the
// last key), the scores S = Q K^T (qk_block: kQkRows rows x kQkVectors vectors of keys in registers, one broadcast
// of q per row and channel; a panel stays in L1 across the block's rows), their softmax within the chunk, the
// values' sums O = P V (pv_block: rows x DIM / kLanes vectors in registers, one broadcast of p per row and key;
// kKeyBlock keys' values at a time, in L1 across the rows), merged into the task's running part by the two maxima.
// The groups' parts, where there are several, are merged at the end.
constexpr int kQkVectors = kRegisters >= 32 ? 4 : 2;
constexpr int kQkRows = kRegisters >= 32 ? 6 : 4;
constexpr int64_t kSharedChunk = 256;  // keys a chunk (its K panels 64 KiB at DIM 64)
constexpr int64_t kQkL1Rows = 8 * kQkRows;  // query vectors beside a key panel in L1 (12 KiB of q at DIM 64)
constexpr int64_t kSharedRowBlock = 128;  // query vectors a block at most (scores 128 KiB at a 256-key chunk)

template <int DIM, int MR>
__attribute__((always_inline)) inline void qk_block(const float* q, const float* kt, int64_t kp, float* s,
                                                    int64_t s_stride) {
  vfloat acc[MR][kQkVectors] = {};
  for (int d = 0; d < DIM; ++d) {
    vfloat kv[kQkVectors];
    for (int v = 0; v < kQkVectors; ++v) kv[v] = vload(kt + d * kp + v * kLanes);
    for (int r = 0; r < MR; ++r) {
      const float qs = q[r * DIM + d];
      for (int v = 0; v < kQkVectors; ++v) acc[r][v] += qs * kv[v];
    }
  }
  for (int r = 0; r < MR; ++r)
    for (int v = 0; v < kQkVectors; ++v) std::memcpy(s + r * s_stride + v * kLanes, &acc[r][v], sizeof(vfloat));
}

template <int DIM>
constexpr int kPvRows = std::max(1, std::min(8, (kRegisters - 1) / (DIM / kLanes + 1)));

template <int DIM, int MR>
__attribute__((always_inline)) inline void pv_block(const float* p, int64_t p_stride, const float* vh,
                                                    const int64_t* v_off, int64_t keys, float* o, bool add) {
  constexpr int C = DIM / kLanes;
  vfloat acc[MR][C] = {};
  if (add)
    for (int r = 0; r < MR; ++r)
      for (int c = 0; c < C; ++c) acc[r][c] = vload(o + r * DIM + c * kLanes);
  for (int64_t j = 0; j < keys; ++j) {
    const float* val = vh + v_off[j];
    float w[MR];
    for (int r = 0; r < MR; ++r) w[r] = p[r * p_stride + j];
    for (int c = 0; c < C; ++c) {
      const vfloat vv = vload(val + c * kLanes);
      for (int r = 0; r < MR; ++r) acc[r][c] += w[r] * vv;
    }
  }
  for (int r = 0; r < MR; ++r)
    for (int c = 0; c < C; ++c) std::memcpy(o + r * DIM + c * kLanes, &acc[r][c], sizeof(vfloat));
}

template <int DIM>
void attend_shared(const at::Tensor& q, const at::Tensor& k_cache, const at::Tensor& v_cache, const at::Tensor& pages,
                   double scale, at::Tensor& out, at::Tensor& lse) {
  const int64_t n = q.size(0), heads = q.size(1), kv_heads = k_cache.size(2), group = heads / kv_heads;
  const int64_t block_size = k_cache.size(1), num_pages = std::min(k_cache.size(0), v_cache.size(0));
  const int64_t length = pages.numel() * block_size, m = n * group;  // keys; query vectors a KV head
  const int64_t chunks = (length + kSharedChunk - 1) / kSharedChunk;
  const float* qp = q.data_ptr<float>();
  const float* kp = k_cache.data_ptr<float>();
  const float* vp = v_cache.data_ptr<float>();
  const int64_t* page_p = pages.data_ptr<int64_t>();
  for (int64_t i = 0; i < pages.numel(); ++i)
    TORCH_CHECK(page_p[i] >= 0 && page_p[i] < num_pages, "paged_attention_shared: page id ", page_p[i],
                " outside the pool of ", num_pages, " pages");
  const int64_t k_page = k_cache.stride(0), k_tok = k_cache.stride(1), k_head = k_cache.stride(2);
  const int64_t v_page = v_cache.stride(0), v_tok = v_cache.stride(1), v_head = v_cache.stride(2);
  const float fscale = static_cast<float>(scale);
  // Tasks: (KV head, block of query vectors, group of chunks). A task runs its chunks in order, merging each into
  // its rows' running part (online softmax); the groups split the chunks only where there are too few blocks of
  // rows to keep the threads busy (a decode step: a few dozen query vectors), so the parts stay the size of the
  // output times the groups, and the groups x blocks x KV heads about 4 tasks a thread.
  const int64_t blocks = (m + kSharedRowBlock - 1) / kSharedRowBlock;
  const int64_t block_rows = (m + blocks - 1) / blocks;  // (balanced: 96 query vectors are 48 + 48, not 64 + 32)
  const int64_t want = 8 * static_cast<int64_t>(at::get_num_threads());
  const int64_t groups = std::max<int64_t>(1, std::min(chunks, (want + kv_heads * blocks - 1) / (kv_heads * blocks)));
  // each (group, KV head, query vector): its unnormalized sums, running max and denominator
  at::Tensor parts = at::empty({groups * kv_heads * m * (DIM + 2)}, q.options());
  float* part_o = parts.data_ptr<float>();
  float* part_max = part_o + groups * kv_heads * m * DIM;
  float* part_sum = part_max + groups * kv_heads * m;

  at::parallel_for(0, kv_heads * blocks * groups, 1, [&](int64_t first, int64_t last) {
    const pagedkv_cpu::FlushDenormals ftz;
    constexpr int64_t kKeyBlock = kQkVectors * kLanes;
    constexpr int64_t kPanelKeys = (kSharedChunk + kKeyBlock - 1) / kKeyBlock * kKeyBlock;
    static thread_local std::vector<float> kt, qf, s, oc;  // (bounded: one chunk, one block of rows)
    static thread_local std::vector<int64_t> v_off;
    kt.resize(DIM * kPanelKeys);
    qf.resize(kSharedRowBlock * DIM);
    s.resize(kSharedRowBlock * kPanelKeys);
    oc.resize(kSharedRowBlock * DIM);
    for (int64_t task = first; task < last; ++task) {
      const int64_t h = task / (blocks * groups), b = task / groups % blocks, g = task % groups;
      const int64_t r0 = b * block_rows, rows = std::min(block_rows, m - r0);
      const int64_t base = (g * kv_heads + h) * m + r0;  // this task's rows in the parts
      float* run_o = part_o + base * DIM;
      float* run_max = part_max + base;
      float* run_sum = part_sum + base;
      std::fill(run_o, run_o + rows * DIM, 0.f);
      std::fill(run_max, run_max + rows, -std::numeric_limits<float>::infinity());
      std::fill(run_sum, run_sum + rows, 0.f);
      for (int64_t r = 0; r < rows; ++r) {  // query vector r0 + r: row (r0 + r) / group, head h x group + its rest
        const float* src = qp + (((r0 + r) / group) * heads + h * group + (r0 + r) % group) * DIM;
        for (int d = 0; d < DIM; ++d) qf[r * DIM + d] = src[d] * fscale;
      }
      for (int64_t c = g * chunks / groups; c < (g + 1) * chunks / groups; ++c) {
        const int64_t k0 = c * kSharedChunk, keys = std::min(kSharedChunk, length - k0);
        const int64_t kpad = (keys + kKeyBlock - 1) / kKeyBlock * kKeyBlock;
        std::fill(kt.begin(), kt.begin() + DIM * kpad, 0.f);
        v_off.resize(keys);
        for (int64_t j = 0; j < keys; ++j) {
          const int64_t pos = k0 + j, page = page_p[pos / block_size], tok = pos % block_size;
          const float* key = kp + page * k_page + tok * k_tok + h * k_head;
          float* panel = kt.data() + (j / kKeyBlock) * DIM * kKeyBlock + j % kKeyBlock;
          for (int d = 0; d < DIM; ++d) panel[d * kKeyBlock] = key[d];
          v_off[j] = page * v_page + tok * v_tok;
        }
        // a panel of keys (kKeyBlock x DIM, 16 KiB at DIM 64) stays in L1 across kQkL1Rows query vectors
        for (int64_t a0 = 0; a0 < rows; a0 += kQkL1Rows)
        for (int64_t j0 = 0; j0 < kpad; j0 += kKeyBlock) {
          const float* panel = kt.data() + j0 * DIM;
          for (int64_t a = a0; a < std::min(rows, a0 + kQkL1Rows); a += kQkRows) {
            const float* qa = qf.data() + a * DIM;
            float* sa = s.data() + a * kpad + j0;
            switch (std::min<int64_t>(kQkRows, std::min(rows, a0 + kQkL1Rows) - a)) {
              case 1: qk_block<DIM, 1>(qa, panel, kKeyBlock, sa, kpad); break;
              case 2: qk_block<DIM, 2>(qa, panel, kKeyBlock, sa, kpad); break;
              case 3: qk_block<DIM, 3>(qa, panel, kKeyBlock, sa, kpad); break;
              case 4: qk_block<DIM, 4>(qa, panel, kKeyBlock, sa, kpad); break;
              case 5: if constexpr (kQkRows >= 5) qk_block<DIM, 5>(qa, panel, kKeyBlock, sa, kpad); break;
              default: if constexpr (kQkRows >= 6) qk_block<DIM, 6>(qa, panel, kKeyBlock, sa, kpad); break;
            }
          }
        }
        float chunk_max[kSharedRowBlock], chunk_sum[kSharedRowBlock];
        for (int64_t r = 0; r < rows; ++r) {
          chunk_sum[r] = exp_row(s.data() + r * kpad, keys, &chunk_max[r]);
        }
        const float* vh = vp + h * v_head;
        for (int64_t j0 = 0; j0 < keys; j0 += kKeyBlock) {  // (the block's values stay in L1 across the rows)
          const int64_t n_keys = std::min(kKeyBlock, keys - j0);
          for (int64_t a = 0; a < rows; a += kPvRows<DIM>) {
            const float* pa = s.data() + a * kpad + j0;
            float* o = oc.data() + a * DIM;
            const int64_t* vo = v_off.data() + j0;
            switch (std::min<int64_t>(kPvRows<DIM>, rows - a)) {
#define PAGEDKV_PV(NR) \
  case NR: if constexpr (kPvRows<DIM> >= NR) pv_block<DIM, NR>(pa, kpad, vh, vo, n_keys, o, j0 > 0); break;
              PAGEDKV_PV(1) PAGEDKV_PV(2) PAGEDKV_PV(3) PAGEDKV_PV(4) PAGEDKV_PV(5) PAGEDKV_PV(6) PAGEDKV_PV(7)
              default: if constexpr (kPvRows<DIM> >= 8) pv_block<DIM, 8>(pa, kpad, vh, vo, n_keys, o, j0 > 0); break;
#undef PAGEDKV_PV
            }
          }
        }
        for (int64_t r = 0; r < rows; ++r) {  // the chunk into the running part, by the two maxima
          const float mx = std::max(run_max[r], chunk_max[r]);
          const float keep = pagedkv_cpu::exp_clamped(run_max[r] - mx), add = pagedkv_cpu::exp_clamped(chunk_max[r] - mx);
          run_max[r] = mx;
          run_sum[r] = run_sum[r] * keep + chunk_sum[r] * add;
          float* ro = run_o + r * DIM;
          const float* co = oc.data() + r * DIM;
#pragma omp simd
          for (int d = 0; d < DIM; ++d) ro[d] = ro[d] * keep + co[d] * add;
        }
      }
    }
  });

  // The groups' parts merged by their maxima: out = sum_g e^(max_g - M) O_g / sum_g e^(max_g - M) sum_g.
  float* op = out.data_ptr<float>();
  float* lp = lse.data_ptr<float>();
  at::parallel_for(0, n * heads, 64, [&](int64_t first, int64_t last) {
    for (int64_t qi = first; qi < last; ++qi) {
      const int64_t i = qi / heads, hd = qi % heads, h = hd / group, row = i * group + hd % group;
      float mx = -std::numeric_limits<float>::infinity();
      for (int64_t g = 0; g < groups; ++g) mx = std::max(mx, part_max[(g * kv_heads + h) * m + row]);
      float denom = 0.f, acc[DIM] = {};
      for (int64_t g = 0; g < groups; ++g) {
        const int64_t at = (g * kv_heads + h) * m + row;
        const float w = pagedkv_cpu::exp_clamped(part_max[at] - mx);
        denom += w * part_sum[at];
        const float* po = part_o + at * DIM;
#pragma omp simd
        for (int d = 0; d < DIM; ++d) acc[d] += w * po[d];
      }
      const float inv = 1.f / denom;
      float* o = op + qi * DIM;
#pragma omp simd
      for (int d = 0; d < DIM; ++d) o[d] = acc[d] * inv;
      lp[qi] = mx + std::log(denom);
    }
  });
}

// The cascade exactly (paged_attention_cascade below): each query attends to its keys [0, p] through its table as
// paged_attention attends it alone, bit for bit (the same scores, softmax and sums in the same order), but the
// shared pages' keys are scored and summed for a block of queries at once (scores_run_simd, values_run_simd: each
// part of those keys read once for the block's rows) instead of once for every query. A task: one KV head and a
// block of queries; then each query's own keys after the shared ones, its softmax over all of them, its value sums
// going on from the shared keys' into its own. Small blocks (kCascadeQueries) and software prefetch of the keys
// that come next (their pages are scattered) bring it to the products' cascade (paged_attention_shared, then
// paged_attention_after: a row's bits not the kernel's) within ~5% a call (bench/shared_prefix_step.py).
template <int DIM>
void attend_cascade(const at::Tensor& q, const at::Tensor& k_cache, const at::Tensor& v_cache,
                    const at::Tensor& tables, const at::Tensor& q_pos, const at::Tensor& pages, double scale,
                    at::Tensor& out) {
  const int64_t n = q.size(0), heads = q.size(1), kv_heads = k_cache.size(2), group = heads / kv_heads;
  const int64_t block_size = k_cache.size(1), num_pages = std::min(k_cache.size(0), v_cache.size(0));
  const int64_t width = tables.size(1), shared_pages = pages.numel(), shared = shared_pages * block_size;
  const float* qp = q.data_ptr<float>();
  const float* kp = k_cache.data_ptr<float>();
  const float* vp = v_cache.data_ptr<float>();
  float* op = out.data_ptr<float>();
  const int64_t* tp = tables.data_ptr<int64_t>();
  const int64_t* pos_p = q_pos.data_ptr<int64_t>();
  const int64_t* page_p = pages.data_ptr<int64_t>();
  const int64_t k_page = k_cache.stride(0), k_tok = k_cache.stride(1), k_head = k_cache.stride(2);
  const int64_t v_page = v_cache.stride(0), v_tok = v_cache.stride(1), v_head = v_cache.stride(2);
  const float fscale = static_cast<float>(scale);
  for (int64_t i = 0; i < n; ++i) {
    TORCH_CHECK(pos_p[i] >= shared && pos_p[i] < width * block_size, "paged_attention_cascade: query position ",
                pos_p[i], " not after the ", shared, " shared keys or outside its page table of ", width, " pages");
    TORCH_CHECK(std::equal(page_p, page_p + shared_pages, tp + i * width),
                "paged_attention_cascade: table row ", i, " does not begin with the shared pages");
  }
  const Range all{0, shared};
  std::vector<int64_t> k_shared(shared), v_shared(shared);
  int64_t idx = 0;
  for_each_key(page_p, num_pages, block_size, k_page, k_tok, &all, 1,
               [&](int64_t off, int64_t) { k_shared[idx++] = off; });
  idx = 0;
  for_each_key(page_p, num_pages, block_size, v_page, v_tok, &all, 1,
               [&](int64_t off, int64_t) { v_shared[idx++] = off; });
  // queries a block: at most kCascadeQueries, fewer where there would be under ~4 tasks a thread
  const int64_t want = 4 * static_cast<int64_t>(at::get_num_threads());
  const int64_t per_block = std::max<int64_t>(1, std::min<int64_t>(kCascadeQueries, n * kv_heads / want));
  const int64_t blocks = (n + per_block - 1) / per_block;

  at::parallel_for(0, kv_heads * blocks, 1, [&](int64_t first, int64_t last) {
    const pagedkv_cpu::FlushDenormals ftz;
    std::vector<float> qf, scores, denom, acc;
    std::vector<int64_t> k_own, v_own, own_at;
    for (int64_t task = first; task < last; ++task) {
      const int64_t h = task / blocks, i0 = task % blocks * per_block, count = std::min(per_block, n - i0);
      const int64_t rows = count * group;  // [query][its query heads of KV head h]
      int64_t stride = 0;  // (the block's most keys)
      for (int64_t t = 0; t < count; ++t) stride = std::max(stride, pos_p[i0 + t] + 1);
      qf.resize(rows * DIM);
      scores.resize(rows * stride);
      denom.resize(rows);
      acc.resize(rows * DIM);
      for (int64_t t = 0; t < count; ++t) {
        const float* src = qp + ((i0 + t) * heads + h * group) * DIM;
        for (int64_t j = 0; j < group * DIM; ++j) qf[t * group * DIM + j] = src[j] * fscale;
      }
      const float* kh = kp + h * k_head;
      const float* vh = vp + h * v_head;
      // each query's own keys [shared, p] (offsets from head 0's): their K rows fetched while the shared keys are
      // scored, their V rows while the shared keys' values are summed
      own_at.assign(1, 0);
      k_own.clear();
      v_own.clear();
      for (int64_t t = 0; t < count; ++t) {
        const Range mine{shared, pos_p[i0 + t] + 1};
        const int64_t* table = tp + (i0 + t) * width;
        for_each_key(table, num_pages, block_size, k_page, k_tok, &mine, 1,
                     [&](int64_t off, int64_t) { k_own.push_back(off); });
        for_each_key(table, num_pages, block_size, v_page, v_tok, &mine, 1,
                     [&](int64_t off, int64_t) { v_own.push_back(off); });
        own_at.push_back(static_cast<int64_t>(k_own.size()));
      }
      prefetch_rows<DIM>(kh, k_own.data(), static_cast<int64_t>(k_own.size()));
      scores_run_simd<DIM>(qf.data(), kh, k_shared.data(), shared, scores.data(), stride, rows);
      for (int64_t t = 0; t < count; ++t) {  // each query's own keys: scores, then its softmax over all of its keys
        const int64_t visible = pos_p[i0 + t] + 1, own = own_at[t + 1] - own_at[t];
        float* st = scores.data() + t * group * stride;
        scores_run_simd<DIM>(qf.data() + t * group * DIM, kh, k_own.data() + own_at[t], own, st + shared, stride,
                             group);
        float mx;
        for (int64_t g = 0; g < group; ++g) denom[t * group + g] = exp_row(st + g * stride, visible, &mx);
      }
      prefetch_rows<DIM>(vh, v_own.data(), static_cast<int64_t>(v_own.size()));
      values_run_simd<DIM>(scores.data(), stride, vh, v_shared.data(), shared, acc.data(), rows, true);
      for (int64_t t = 0; t < count; ++t) {
        values_run_simd<DIM>(scores.data() + t * group * stride + shared, stride, vh, v_own.data() + own_at[t],
                             own_at[t + 1] - own_at[t], acc.data() + t * group * DIM, group, false);
        normalize_rows<DIM>(acc.data() + t * group * DIM, denom.data() + t * group,
                            op + ((i0 + t) * heads + h * group) * DIM, group);
      }
    }
  });
}

#endif

}  // namespace

namespace pagedkv_cpu {

// The head sizes paged_attention_shared takes on this CPU (none without AVX2 or AVX-512).
std::vector<int64_t> paged_attention_shared_dims() {
#if defined(PAGEDKV_SIMD)
  return {32, 64, 128, 256};
#else
  return {};
#endif
}

bool paged_attention_shared_available(const at::Tensor& q) {
  const std::vector<int64_t> dims = paged_attention_shared_dims();
  return q.dim() == 3 && q.scalar_type() == at::kFloat && std::find(dims.begin(), dims.end(), q.size(2)) != dims.end();
}

// The cascade's first half (executor_svc/attention/torch_backend.py, "shared prefix"), as matrix products: every
// query of q [N, heads, D] (float32, contiguous; D 32, 64, 128 or 256) attends to all keys of ``pages`` (int64
// page ids, in order: keys 0 .. pages x block_size - 1; no mask). Returns its output [N, heads, D] (normalized) and
// the log-sum-exp of its scaled scores [N, heads] (float32): paged_attention_after's prior_out and prior_lse.
std::tuple<at::Tensor, at::Tensor> paged_attention_shared(at::Tensor q, at::Tensor k_cache, at::Tensor v_cache,
                                                          at::Tensor pages, double scale) {
  check(paged_attention_shared_available(q), "paged_attention_shared takes float32 q with head_dim 32, 64, 128 or 256 "
        "on an AVX2 or AVX-512 CPU");
  check(q.is_contiguous(), "q must be a contiguous [N, heads, head_dim]");
  check(k_cache.dim() == 4 && v_cache.dim() == 4 && k_cache.scalar_type() == at::kFloat &&
        v_cache.scalar_type() == at::kFloat, "caches must be float32 [pages, block_size, kv_heads, head_dim]");
  check(k_cache.stride(3) == 1 && v_cache.stride(3) == 1, "head_dim must be contiguous in the caches");
  check(k_cache.size(3) == q.size(2) && k_cache.size(2) == v_cache.size(2) && k_cache.size(1) == v_cache.size(1) &&
        q.size(1) % k_cache.size(2) == 0, "head shapes disagree");
  check(pages.scalar_type() == at::kLong && pages.dim() == 1 && pages.numel() > 0 && pages.is_contiguous(),
        "pages must be a non-empty contiguous int64 vector");
  at::Tensor out = at::empty_like(q), lse = at::empty({q.size(0), q.size(1)}, q.options());
#if defined(PAGEDKV_SIMD)
  switch (q.size(2)) {
    case 32: attend_shared<32>(q, k_cache, v_cache, pages, scale, out, lse); break;
    case 64: attend_shared<64>(q, k_cache, v_cache, pages, scale, out, lse); break;
    case 128: attend_shared<128>(q, k_cache, v_cache, pages, scale, out, lse); break;
    default: attend_shared<256>(q, k_cache, v_cache, pages, scale, out, lse); break;
  }
#endif
  return {out, lse};
}

// The cascade, exactly (executor_svc/attention/torch_backend.py, "shared prefix"): query i of q [N, heads, D]
// (float32, contiguous; D 32, 64, 128 or 256) attends to its keys [0, q_pos[i]] through table row i, whose first
// pages are ``pages`` (every row's: keys 0 .. pages x block_size - 1, all before each query); no windows. Each row
// is bit for bit paged_attention's; the shared keys are read once for a block of queries (attend_cascade).
at::Tensor paged_attention_cascade(at::Tensor q, at::Tensor k_cache, at::Tensor v_cache, at::Tensor tables,
                                   at::Tensor q_pos, at::Tensor pages, double scale) {
  check(paged_attention_shared_available(q), "paged_attention_cascade takes float32 q with head_dim 32, 64, 128 or "
        "256 on an AVX2 or AVX-512 CPU");
  check(pages.scalar_type() == at::kLong && pages.dim() == 1 && pages.numel() > 0 && pages.is_contiguous(),
        "pages must be a non-empty contiguous int64 vector");
  check(tables.dim() == 2 && tables.size(0) == q.size(0) && tables.size(1) >= pages.numel(),
        "tables must have a row per query, each at least as long as pages");
  const at::Tensor none = at::empty({0}, q_pos.options());
  auto out = paged_attention_checked(q, k_cache, v_cache, tables, none, q_pos, none, none);
#if defined(PAGEDKV_SIMD)
  switch (q.size(2)) {
    case 32: attend_cascade<32>(q, k_cache, v_cache, tables, q_pos, pages, scale, out); break;
    case 64: attend_cascade<64>(q, k_cache, v_cache, tables, q_pos, pages, scale, out); break;
    case 128: attend_cascade<128>(q, k_cache, v_cache, tables, q_pos, pages, scale, out); break;
    default: attend_cascade<256>(q, k_cache, v_cache, tables, q_pos, pages, scale, out); break;
  }
#endif
  return out;
}

}  // namespace pagedkv_cpu

// torch.ops.pagedkv_cpu.paged_attention: an operator, so the profiler and the dispatcher see it.
TORCH_LIBRARY(pagedkv_cpu, m) {
  m.def("paged_attention(Tensor q, Tensor k_cache, Tensor v_cache, Tensor tables, Tensor q_rows, Tensor q_pos, "
        "Tensor sinks, Tensor windows, int model_window, float scale) -> Tensor");
  m.def("paged_attention_after(Tensor q, Tensor k_cache, Tensor v_cache, Tensor tables, Tensor q_pos, int start, "
        "Tensor prior_out, Tensor prior_lse, float scale) -> Tensor");
  m.def("paged_attention_shared(Tensor q, Tensor k_cache, Tensor v_cache, Tensor pages, float scale) -> "
        "(Tensor, Tensor)");
  m.def("paged_attention_cascade(Tensor q, Tensor k_cache, Tensor v_cache, Tensor tables, Tensor q_pos, Tensor pages, "
        "float scale) -> Tensor");
  m.def("paged_attention_shared_dims() -> int[]", &pagedkv_cpu::paged_attention_shared_dims);  // (no tensor)
}

TORCH_LIBRARY_IMPL(pagedkv_cpu, CPU, m) {
  m.impl("paged_attention", &pagedkv_cpu::paged_attention);
  m.impl("paged_attention_after", &pagedkv_cpu::paged_attention_after);
  m.impl("paged_attention_shared", &pagedkv_cpu::paged_attention_shared);
  m.impl("paged_attention_cascade", &pagedkv_cpu::paged_attention_cascade);
}
