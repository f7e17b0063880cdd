// Decode attention read straight from 8-bit pages (FP8 E4M3 or INT8, executor_svc/kv_quant.py), on the CPU: no
// full-precision copy of the pages is made; each key and value row is widened to float32 in registers (FP8 through
// float16 and vcvtph2ps, 32 bytes at a time with AVX-512BW, its 2^8 folded into the row scale; INT8 by sign
// extension; head sizes that are not 32/64/128/256 one element at a time, FP8 through a 256-entry table) and scaled
// as it is used (#50 item 2).
//
// One task per (decode row, KV head), spread over torch's intra-op threads: the task scores the query heads of
// that KV head against each visible key (read through the page table), takes the softmax in float32 and sums the
// dequantized values the same way. Visible keys of a decode with context length c (the new token included):
//
//   [lo, min(sink, s))  ++  [s, c),   s = max(lo, c - window)   when the row has a window (> 0)
//   [lo, c)                                                  otherwise
//   lo = max(0, c - model_window) with a model-wide sliding window, else 0
//
// the positions TorchPagedAttention's decode mask leaves visible (decode_visible, its reference path).
//
// Scales, as the pool keeps them: FP8 K and V, INT8 V: one bfloat16 per (page, slot, KV head); INT8 K: one
// exponent byte per (page, KV head, channel), the scale 2^(e - 127).
//
// The exact tail (optional arguments k_exact, v_exact, exact_slots; all three or none): a slab page is a page whose
// K and V are also held in bfloat16 (the exact tail of a request, executor_svc/kv_tail.py), read from there instead
// of the 8-bit bytes. The slab: k_exact, v_exact [slots, block, kv_heads, D] bfloat16, D contiguous (other strides
// free: views of a larger buffer, e.g. slab[:, layer, 0]); exact_slots [pages] int32, the slab slot of each page id
// of the pool, or -1 (any negative) for a page without one. A key at position t of page pg = table[t / block] with
// s = exact_slots[pg] >= 0 is float(k_exact[s, t % block, h]) and its value float(v_exact[s, t % block, h]), as they
// are: no row scale, no channel exponents (INT8 K: the plain scaled query), no FP8 unit; the rows as the model wrote
// them to the pool (FP8 keys in the rotated basis the pages hold, kv_quant.key_rotation). bfloat16 widens to
// float32 exactly (its bits are the float's top half), in registers. Whether a page is read from the slab is
// decided once a run of keys of one page (the K loop and the V loop both go a page's run at a time); other pages
// are read as without a slab, bit for bit. The dequantizers take the same (exact, exact_slots) pair: a slab page's
// rows come out as float(exact[s]).

#include <ATen/ATen.h>
#include <ATen/Parallel.h>
#include <torch/library.h>

#include <algorithm>
#include <cmath>
#include <cstdint>
#include <cstring>
#include <limits>
#include <type_traits>
#include <vector>

#include "cpu_math.h"

// Built only where the vector instructions it is written with exist (x86 with AVX2, FMA and F16C: every x86
// server since 2013); elsewhere the op is not registered and the torch backend gathers 8-bit pages as before.
#if defined(__AVX2__) && defined(__FMA__) && defined(__F16C__)
#include <immintrin.h>

namespace pagedkv_q8 {
namespace {

struct Fp8Table {
  float v[256];
  Fp8Table() {
    for (int b = 0; b < 256; ++b) {
      const int e = (b >> 3) & 15, m = b & 7;
      float x;
      if (e == 15 && m == 7) {
        x = std::numeric_limits<float>::quiet_NaN();
      } else if (e == 0) {
        x = std::ldexp(static_cast<float>(m), -9);  // subnormal: m / 8 * 2^-6
      } else {
        x = std::ldexp(1.0f + m / 8.0f, e - 7);
      }
      v[b] = (b & 128) ? -x : x;
    }
  }
};
const Fp8Table kFp8;

inline float bf16(uint16_t bits) {
  const uint32_t u = static_cast<uint32_t>(bits) << 16;
  float f;
  std::memcpy(&f, &u, sizeof f);
  return f;
}

// 16 lanes of GCC's generic vectors (AVX-512: one register; AVX2: two).
typedef float v16f __attribute__((vector_size(64)));
typedef uint32_t v16u __attribute__((vector_size(64)));
typedef int32_t v16i __attribute__((vector_size(64)));

// 16 bytes -> 16 lanes of 32 bits, zero- or sign-extended (GCC's __builtin_convertvector from 8-bit lanes moves
// one byte at a time: ~50 instructions where vpmovzxbd is one).
#if defined(__AVX512F__)
inline v16i widen_i8(const uint8_t* p) {
  return (v16i)_mm512_cvtepi8_epi32(_mm_loadu_si128(reinterpret_cast<const __m128i*>(p)));
}
#elif defined(__AVX2__)
template <typename V, typename Fn>
inline V widen_halves(const uint8_t* p, Fn fn) {
  const __m256i lo = fn(_mm_loadl_epi64(reinterpret_cast<const __m128i*>(p)));
  const __m256i hi = fn(_mm_loadl_epi64(reinterpret_cast<const __m128i*>(p + 8)));
  V v;
  std::memcpy(&v, &lo, 32);
  std::memcpy(reinterpret_cast<char*>(&v) + 32, &hi, 32);
  return v;
}
inline v16i widen_i8(const uint8_t* p) {
  return widen_halves<v16i>(p, [](__m128i x) { return _mm256_cvtepi8_epi32(x); });
}
#endif

inline v16f int8_to_float(const uint8_t* p) { return __builtin_convertvector(widen_i8(p), v16f); }

// 16 E4M3 bytes -> float32, exactly: each byte sign-extended to 16 bits and shifted left by 7 puts the sign in bit
// 15 and the exponent and mantissa in bits 13..7, a float16 once bit 14 (the sign's copy) is cleared (E4M3's exponent
// bias is 7, float16's 15: the float16 is the value / 2^8, subnormals included); widened by vcvtph2ps (which reads
// float16 subnormals whatever MXCSR's DAZ says), times 2^8; 0x7f / 0xff become NaN. 6 operations.
inline __m256i fp8_as_half(const uint8_t* p) {
  const __m256i s = _mm256_cvtepi8_epi16(_mm_loadu_si128(reinterpret_cast<const __m128i*>(p)));
  const __m256i h = _mm256_and_si256(_mm256_slli_epi16(s, 7), _mm256_set1_epi16(static_cast<short>(0xbf80)));
  const __m256i em = _mm256_and_si256(h, _mm256_set1_epi16(0x3f80));
  return _mm256_blendv_epi8(h, _mm256_set1_epi16(0x7e00), _mm256_cmpeq_epi16(em, _mm256_set1_epi16(0x3f80)));
}
// The same / 2^8 (the float16's own value): decode folds the 2^8 into the row scales (kFp8Unit), exactly.
inline v16f fp8_to_float_unit(const uint8_t* p) {
  const __m256i h = fp8_as_half(p);
#if defined(__AVX512F__)
  return (v16f)_mm512_cvtph_ps(h);
#else
  const __m256 lo = _mm256_cvtph_ps(_mm256_castsi256_si128(h)), hi = _mm256_cvtph_ps(_mm256_extracti128_si256(h, 1));
  v16f v;
  std::memcpy(&v, &lo, 32);
  std::memcpy(reinterpret_cast<char*>(&v) + 32, &hi, 32);
  return v;
#endif
}
inline v16f fp8_to_float(const uint8_t* p) { return fp8_to_float_unit(p) * 256.0f; }
constexpr float kFp8Unit = 256.0f;

#if defined(__AVX512BW__)
// 32 E4M3 bytes -> two vectors of their values / 2^8, as fp8_as_half in 512-bit registers (half the integer
// operations a byte): NaN where the byte's low seven bits are all set.
inline void fp8x32_to_float_unit(const uint8_t* p, v16f& lo, v16f& hi) {
  const __m256i raw = _mm256_loadu_si256(reinterpret_cast<const __m256i*>(p));
  const __mmask32 nan = _mm256_cmpeq_epi8_mask(_mm256_and_si256(raw, _mm256_set1_epi8(0x7f)), _mm256_set1_epi8(0x7f));
  const __m512i h = _mm512_and_si512(_mm512_slli_epi16(_mm512_cvtepi8_epi16(raw), 7),
                                     _mm512_set1_epi16(static_cast<short>(0xbf80)));
  const __m512i f = _mm512_mask_mov_epi16(h, nan, _mm512_set1_epi16(0x7e00));
  lo = (v16f)_mm512_cvtph_ps(_mm512_castsi512_si256(f));
  hi = (v16f)_mm512_cvtph_ps(_mm512_extracti64x4_epi64(f, 1));
}
#endif

// A row of DIM 8-bit elements -> DIM / 16 vectors: INT8 as integers, FP8 as its values / 2^8 (kFp8Unit).
template <int DIM>
inline void widen_row(const uint8_t* r, bool fp8, v16f* out) {
  if (!fp8) {
    for (int v = 0; v < DIM / 16; ++v) out[v] = int8_to_float(r + 16 * v);
    return;
  }
#if defined(__AVX512BW__)
  if constexpr (DIM % 32 == 0) {
    for (int v = 0; v < DIM / 16; v += 2) fp8x32_to_float_unit(r + 16 * v, out[v], out[v + 1]);
    return;
  }
#endif
  for (int v = 0; v < DIM / 16; ++v) out[v] = fp8_to_float_unit(r + 16 * v);
}

// 16 bfloat16 -> float32, exactly: each zero-extended to 32 bits and shifted into the float's top half.
inline v16f bf16_to_float(const uint16_t* p) {
#if defined(__AVX512F__)
  const __m256i x = _mm256_loadu_si256(reinterpret_cast<const __m256i*>(p));
  return (v16f)_mm512_castsi512_ps(_mm512_slli_epi32(_mm512_cvtepu16_epi32(x), 16));
#else
  const __m256i lo = _mm256_slli_epi32(_mm256_cvtepu16_epi32(_mm_loadu_si128(reinterpret_cast<const __m128i*>(p))), 16);
  const __m256i hi =
      _mm256_slli_epi32(_mm256_cvtepu16_epi32(_mm_loadu_si128(reinterpret_cast<const __m128i*>(p + 8))), 16);
  v16f v;
  std::memcpy(&v, &lo, 32);
  std::memcpy(reinterpret_cast<char*>(&v) + 32, &hi, 32);
  return v;
#endif
}

// A slab row of DIM bfloat16 elements -> DIM / 16 vectors (their values: no scale).
template <int DIM>
inline void widen_bf16_row(const uint16_t* r, v16f* out) {
  for (int v = 0; v < DIM / 16; ++v) out[v] = bf16_to_float(r + 16 * v);
}

// out[k] = the sum of a[k]'s lanes, for 16 vectors at once: four levels, each adding pairs of vectors after two
// shuffles (45 operations, against ~25 for one vector's sum alone); out's lanes in a's order.
inline v16f reduce16(const v16f* a) {
  v16f b[8], c[4], d[2];
  for (int i = 0; i < 8; ++i)
    b[i] = __builtin_shufflevector(a[i], a[i + 8], 0, 1, 2, 3, 4, 5, 6, 7, 16, 17, 18, 19, 20, 21, 22, 23) +
           __builtin_shufflevector(a[i], a[i + 8], 8, 9, 10, 11, 12, 13, 14, 15, 24, 25, 26, 27, 28, 29, 30, 31);
  for (int i = 0; i < 4; ++i)
    c[i] = __builtin_shufflevector(b[i], b[i + 4], 0, 1, 2, 3, 16, 17, 18, 19, 8, 9, 10, 11, 24, 25, 26, 27) +
           __builtin_shufflevector(b[i], b[i + 4], 4, 5, 6, 7, 20, 21, 22, 23, 12, 13, 14, 15, 28, 29, 30, 31);
  for (int i = 0; i < 2; ++i)
    d[i] = __builtin_shufflevector(c[i], c[i + 2], 0, 1, 16, 17, 4, 5, 20, 21, 8, 9, 24, 25, 12, 13, 28, 29) +
           __builtin_shufflevector(c[i], c[i + 2], 2, 3, 18, 19, 6, 7, 22, 23, 10, 11, 26, 27, 14, 15, 30, 31);
  return __builtin_shufflevector(d[0], d[1], 0, 16, 2, 18, 4, 20, 6, 22, 8, 24, 10, 26, 12, 28, 14, 30) +
         __builtin_shufflevector(d[0], d[1], 1, 17, 3, 19, 5, 21, 7, 23, 9, 25, 11, 27, 13, 29, 15, 31);
}


constexpr int64_t kMaxGroup = 16;  // query heads a KV head at most (GQA group)

inline v16f vload(const float* p) {
  v16f v;
  std::memcpy(&v, p, sizeof v);
  return v;
}

inline void vstore(float* p, v16f v) { std::memcpy(p, &v, sizeof v); }

// The head sizes without a vector path (decode<0>): a row of D 8-bit elements -> float32 (before scaling), a dot
// product, y += w * x.
inline void widen(const uint8_t* __restrict row, bool fp8, int64_t dim, float* __restrict out) {
  if (fp8) {
    for (int64_t d = 0; d < dim; ++d) out[d] = kFp8.v[row[d]];
  } else {
    const int8_t* r = reinterpret_cast<const int8_t*>(row);
    for (int64_t d = 0; d < dim; ++d) out[d] = static_cast<float>(r[d]);
  }
}

// A slab row of dim bfloat16 elements -> float32 (exact).
inline void widen_bf16(const uint16_t* __restrict row, int64_t dim, float* __restrict out) {
  for (int64_t d = 0; d < dim; ++d) out[d] = bf16(row[d]);
}

inline float dot(const float* __restrict a, const float* __restrict b, int64_t dim) {
  float s = 0.f;
  for (int64_t d = 0; d < dim; ++d) s += a[d] * b[d];
  return s;
}

inline void axpy(float w, const float* __restrict x, float* __restrict y, int64_t dim) {
  for (int64_t d = 0; d < dim; ++d) y[d] += w * x[d];
}

// 2^(e - 127) for an exponent byte (0: nothing written yet, and 0 data: any scale; 0 here).
inline float exp2_byte(uint8_t e) {
  const uint32_t bits = static_cast<uint32_t>(e) << 23;
  float f;
  std::memcpy(&f, &bits, sizeof f);
  return f;
}

struct Pool {  // one layer's K or V: data bytes, and where a (page, slot, head) row and its scale are
  const uint8_t* data;
  int64_t page, slot, head;  // strides of data, in bytes
  const uint16_t* scale;     // bf16 per (page, slot, head), or nullptr (INT8 K: exponents instead)
  int64_t s_page, s_slot, s_head;
  const uint8_t* exp;        // INT8 K: exponent bytes per (page, head, channel)
  int64_t e_page, e_head;

  const uint8_t* row(int64_t p, int64_t o, int64_t h) const { return data + p * page + o * slot + h * head; }
  float row_scale(int64_t p, int64_t o, int64_t h) const { return bf16(scale[p * s_page + o * s_slot + h * s_head]); }
};

Pool pool_of(const at::Tensor& data, const at::Tensor& scale) {
  Pool p{};
  p.data = static_cast<const uint8_t*>(data.data_ptr());
  p.page = data.stride(0), p.slot = data.stride(1), p.head = data.stride(2);
  if (scale.scalar_type() == at::kBFloat16) {
    p.scale = static_cast<const uint16_t*>(scale.data_ptr());
    p.s_page = scale.stride(0), p.s_slot = scale.stride(1), p.s_head = scale.stride(2);
  } else {  // uint8 exponents [pages, heads, dim]
    p.exp = static_cast<const uint8_t*>(scale.data_ptr());
    p.e_page = scale.stride(0), p.e_head = scale.stride(1);
  }
  return p;
}

struct Slab {  // one layer's bfloat16 K or V rows of the exact tail: [slots, block, kv_heads, D], D contiguous
  const uint16_t* data = nullptr;
  int64_t slot = 0, pos = 0, head = 0;  // strides, in elements

  const uint16_t* row(int64_t s, int64_t o, int64_t h) const { return data + s * slot + o * pos + h * head; }
};

struct Exact {  // the exact tail: the slab's K and V, and each page's slot in it (none: no slab)
  Slab k, v;
  const int32_t* slots = nullptr;  // [pages], -1: the page is read from its 8-bit bytes
  int64_t count = 0;               // the slab's slots

  int32_t slot(int64_t page) const { return slots != nullptr ? slots[page] : -1; }
};

template <int DIM>
void decode(const at::Tensor& q, const Pool& K, const Pool& V, const Exact& X, bool fp8, const at::Tensor& tables,
            const at::Tensor& ctx_lens, const at::Tensor& sinks, const at::Tensor& windows, int64_t model_window,
            int64_t block, int64_t kv_heads, double scale, at::Tensor& out, int64_t start = 0,
            float* lse = nullptr) {
  const int64_t batch = q.size(0), heads = q.size(1), dim = q.size(2), per_kv = heads / kv_heads;
  const int64_t width = tables.size(1);
  const float* qp = q.data_ptr<float>();
  float* op = out.data_ptr<float>();
  const int64_t* tp = tables.data_ptr<int64_t>();
  const int64_t* cp = ctx_lens.data_ptr<int64_t>();
  const int64_t* sp = sinks.numel() ? sinks.data_ptr<int64_t>() : nullptr;
  const int64_t* wp = windows.numel() ? windows.data_ptr<int64_t>() : nullptr;
  const bool int8_k = K.scale == nullptr;
  const float unit = fp8 ? kFp8Unit : 1.f;  // (the vector paths widen FP8 to its values / 2^8)
  at::parallel_for(0, batch * kv_heads, 1, [&](int64_t begin, int64_t end) {
    pagedkv_cpu::FlushDenormals flush;
    std::vector<float> qs(per_kv * dim), qc(per_kv * dim), row(dim), acc(per_kv * dim), scores;
    for (int64_t task = begin; task < end; ++task) {
      const int64_t b = task / kv_heads, h = task % kv_heads;
      const int64_t c = cp[b];
      const int64_t lo = std::max(start, model_window > 0 ? std::max<int64_t>(0, c - model_window) : 0);
      const int64_t w = wp ? wp[b] : 0;
      const int64_t s2 = w > 0 ? std::max(lo, c - w) : lo;  // the window's start
      const int64_t s1 = w > 0 ? std::min(sp[b], s2) : lo;  // the sink's end: [lo, s1) ++ [s2, c)
      const int64_t n1 = std::max<int64_t>(0, s1 - lo), n = n1 + std::max<int64_t>(0, c - s2);
      const int64_t* table = tp + b * width;
      for (int64_t g = 0; g < per_kv; ++g)
        for (int64_t d = 0; d < dim; ++d) qs[g * dim + d] = qp[(b * heads + h * per_kv + g) * dim + d] * scale;
      scores.assign(per_kv * std::max<int64_t>(n, 1), 0.f);
      // scores, a run of keys of one page at a time (at most 16: one reduce16 per query head)
      int64_t i = 0;
      while (i < n) {
        const int64_t t0 = i < n1 ? lo + i : s2 + (i - n1);
        const int64_t end = i < n1 ? n1 : n;  // this range's end (in i)
        const int64_t pg = table[t0 / block], o0 = t0 % block;
        const int64_t len = std::min<int64_t>({16, block - o0, end - i});
        const int32_t es = X.slot(pg);  // >= 0: a slab page, its rows read from the slab (unscaled)
        const float* qg = qs.data();
        if (int8_k && es < 0) {  // the page's channel scales folded into the queries
          const uint8_t* e = K.exp + pg * K.e_page + h * K.e_head;
          for (int64_t g = 0; g < per_kv; ++g)
            for (int64_t d = 0; d < dim; ++d) qc[g * dim + d] = qs[g * dim + d] * exp2_byte(e[d]);
          qg = qc.data();
        }
        if constexpr (DIM > 0) {
          alignas(64) v16f part[kMaxGroup][16];
          alignas(64) float ks[16];
          auto rows = [&](auto exact) {  // the run's keys: 8-bit and scaled, or a slab page's bfloat16 as they are
            for (int64_t j = 0; j < len; ++j) {
              v16f k[DIM / 16];
              if constexpr (decltype(exact)::value) {
                widen_bf16_row<DIM>(X.k.row(es, o0 + j, h), k);
              } else {
                widen_row<DIM>(K.row(pg, o0 + j, h), fp8, k);
              }
              for (int64_t g = 0; g < per_kv; ++g) {
                const float* qq = qg + g * DIM;
                v16f a = vload(qq) * k[0];
                for (int v = 1; v < DIM / 16; ++v) a += vload(qq + 16 * v) * k[v];
                part[g][j] = a;
              }
              if constexpr (decltype(exact)::value) {
                ks[j] = 1.f;
              } else {
                ks[j] = int8_k ? 1.f : K.row_scale(pg, o0 + j, h) * unit;
              }
            }
          };
          if (es >= 0) {  // (one branch a run: each kind of run its own loop)
            rows(std::true_type{});
          } else {
            rows(std::false_type{});
          }
          for (int64_t j = len; j < 16; ++j) {
            for (int64_t g = 0; g < per_kv; ++g) part[g][j] = v16f{};
            ks[j] = 0.f;
          }
          const v16f kv = vload(ks);
          for (int64_t g = 0; g < per_kv; ++g) {
            const v16f sc = reduce16(part[g]) * kv;
            for (int64_t j = 0; j < len; ++j) scores[g * n + i + j] = sc[j];
          }
        } else {
          for (int64_t j = 0; j < len; ++j) {
            float ksj = 1.f;
            if (es >= 0) {
              widen_bf16(X.k.row(es, o0 + j, h), dim, row.data());
            } else {
              widen(K.row(pg, o0 + j, h), fp8, dim, row.data());
              ksj = int8_k ? 1.f : K.row_scale(pg, o0 + j, h);
            }
            for (int64_t g = 0; g < per_kv; ++g) scores[g * n + i + j] = ksj * dot(qg + g * dim, row.data(), dim);
          }
        }
        i += len;
      }
      std::vector<float> denom(per_kv, 0.f), maxes(per_kv, -std::numeric_limits<float>::infinity());
      for (int64_t g = 0; g < per_kv; ++g) {  // softmax, in place
        float* sg = scores.data() + g * n;
        float mx = -std::numeric_limits<float>::infinity();
        for (int64_t i = 0; i < n; ++i) mx = std::max(mx, sg[i]);
        float sum = 0.f;
#pragma omp simd reduction(+ : sum)
        for (int64_t i = 0; i < n; ++i) {
          sg[i] = pagedkv_cpu::exp_clamped(sg[i] - mx);
          sum += sg[i];
        }
        denom[g] = sum;
        maxes[g] = mx;
      }
      std::fill(acc.begin(), acc.end(), 0.f);
      // values, a run of keys of one page at a time
      for (int64_t i0 = 0; i0 < n;) {
        const int64_t t0 = i0 < n1 ? lo + i0 : s2 + (i0 - n1);
        const int64_t end = i0 < n1 ? n1 : n;
        const int64_t pg = table[t0 / block], o0 = t0 % block;
        const int64_t len = std::min<int64_t>(block - o0, end - i0);
        const int32_t es = X.slot(pg);  // >= 0: a slab page
        if constexpr (DIM > 0) {
          constexpr int VN = DIM / 16;
          constexpr int GB = VN >= 16 ? 1 : 16 / VN;  // query heads whose sums stay in registers
          auto rows = [&](auto exact) {  // the run's values: 8-bit and scaled, or a slab page's bfloat16 as they are
            for (int64_t g0 = 0; g0 < per_kv; g0 += GB) {
              v16f a[GB][VN];
              for (int gg = 0; gg < GB; ++gg)
                for (int v = 0; v < VN; ++v)
                  a[gg][v] = g0 + gg < per_kv ? vload(acc.data() + (g0 + gg) * DIM + 16 * v) : v16f{};
              for (int64_t j = 0; j < len; ++j) {
                float vs = 1.f;
                v16f x[VN];
                if constexpr (decltype(exact)::value) {
                  widen_bf16_row<DIM>(X.v.row(es, o0 + j, h), x);
                } else {
                  vs = V.row_scale(pg, o0 + j, h) * unit;
                  widen_row<DIM>(V.row(pg, o0 + j, h), fp8, x);
                }
                for (int gg = 0; gg < GB; ++gg) {
                  const float w = g0 + gg < per_kv ? scores[(g0 + gg) * n + i0 + j] * vs : 0.f;
                  for (int v = 0; v < VN; ++v) a[gg][v] += w * x[v];
                }
              }
              for (int gg = 0; gg < GB && g0 + gg < per_kv; ++gg)
                for (int v = 0; v < VN; ++v) vstore(acc.data() + (g0 + gg) * DIM + 16 * v, a[gg][v]);
            }
          };
          if (es >= 0) {  // (one branch a run)
            rows(std::true_type{});
          } else {
            rows(std::false_type{});
          }
        } else {
          for (int64_t j = 0; j < len; ++j) {
            float vs = 1.f;
            if (es >= 0) {
              widen_bf16(X.v.row(es, o0 + j, h), dim, row.data());
            } else {
              vs = V.row_scale(pg, o0 + j, h);
              widen(V.row(pg, o0 + j, h), fp8, dim, row.data());
            }
            for (int64_t g = 0; g < per_kv; ++g) axpy(scores[g * n + i0 + j] * vs, row.data(), acc.data() + g * dim, dim);
          }
        }
        i0 += len;
      }
      for (int64_t g = 0; g < per_kv; ++g) {
        float* o = op + (b * heads + h * per_kv + g) * dim;
        const float inv = denom[g] > 0.f ? 1.f / denom[g] : 0.f;
        for (int64_t d = 0; d < dim; ++d) o[d] = acc[g * dim + d] * inv;
        if (lse != nullptr)  // (no key: -inf, a share of nothing in the merge)
          lse[b * heads + h * per_kv + g] = denom[g] > 0.f ? maxes[g] + std::log(denom[g])
                                                           : -std::numeric_limits<float>::infinity();
      }
    }
  });
}

void check(bool ok, const char* what, const char* op = "paged_attention_q8") { TORCH_CHECK(ok, op, ": ", what); }

bool given(const c10::optional<at::Tensor>& t) { return t.has_value() && t->defined(); }

// A slab (k_exact, v_exact, a dequantizer's exact) for the pool ``data``, checked: bfloat16 [slots, block,
// kv_heads, D] with the pool's block, kv_heads and D, D contiguous.
Slab slab_of(const char* op, const char* name, const at::Tensor& x, const at::Tensor& data) {
  TORCH_CHECK(x.scalar_type() == at::kBFloat16 && x.dim() == 4 && x.size(1) == data.size(1) &&
                  x.size(2) == data.size(2) && x.size(3) == data.size(3) && x.stride(3) == 1,
              op, ": ", name, " must be bfloat16 [slots, block, kv_heads, D] with D contiguous and the pool's block, "
              "kv_heads and D (", data.size(1), ", ", data.size(2), ", ", data.size(3), "), not ", x.scalar_type(),
              " ", x.sizes(), " with strides ", x.strides());
  Slab s;
  s.data = static_cast<const uint16_t*>(x.data_ptr());
  s.slot = x.stride(0), s.pos = x.stride(1), s.head = x.stride(2);
  return s;
}

// exact_slots for the pool ``data``, checked: a contiguous int32 vector of one slot per page of the pool.
const int32_t* slots_of(const char* op, const at::Tensor& slots, const at::Tensor& data) {
  TORCH_CHECK(slots.scalar_type() == at::kInt && slots.dim() == 1 && slots.is_contiguous() &&
                  slots.numel() == data.size(0),
              op, ": exact_slots must be a contiguous int32 vector of one slot per page of the pool (", data.size(0),
              " pages), not ", slots.scalar_type(), " ", slots.sizes());
  return slots.data_ptr<int32_t>();
}

// A page about to be read: its slab slot, if any, inside the slab (as the page ids: never a read out of bounds).
inline void check_slot(const char* op, const Exact& X, int64_t page) {
  if (X.slots != nullptr)
    TORCH_CHECK(X.slots[page] < X.count, op, ": page ", page, " has exact slot ", X.slots[page],
                " outside the slab of ", X.count, " slots");
}

// The attention ops' exact tail: all three arguments or none (then no slab: every page from its 8-bit bytes).
Exact exact_of(const at::Tensor& k_data, const c10::optional<at::Tensor>& k_exact,
               const c10::optional<at::Tensor>& v_exact, const c10::optional<at::Tensor>& exact_slots) {
  const int n = given(k_exact) + given(v_exact) + given(exact_slots);
  check(n == 0 || n == 3, "k_exact, v_exact and exact_slots must be given together (or none of them)");
  Exact X;
  if (n == 0) return X;
  X.k = slab_of("paged_attention_q8", "k_exact", *k_exact, k_data);
  X.v = slab_of("paged_attention_q8", "v_exact", *v_exact, k_data);
  check(v_exact->size(0) == k_exact->size(0), "k_exact and v_exact must have the same slots");
  X.slots = slots_of("paged_attention_q8", *exact_slots, k_data);
  X.count = k_exact->size(0);
  return X;
}

// A dequantizer's exact tail: exact and exact_slots, both or neither.
Exact exact_pages_of(const char* op, const at::Tensor& data, const c10::optional<at::Tensor>& exact,
                     const c10::optional<at::Tensor>& exact_slots) {
  check(given(exact) == given(exact_slots), "exact and exact_slots must be given together (or neither)", op);
  Exact X;
  if (!given(exact)) return X;
  X.k = slab_of(op, "exact", *exact, data);
  X.slots = slots_of(op, *exact_slots, data);
  X.count = exact->size(0);
  return X;
}

// The attention ops' arguments, checked; returns their exact tail (none without its three arguments).
Exact check_args(const at::Tensor& q, const at::Tensor& k_data, const at::Tensor& k_scale, const at::Tensor& v_data,
                 const at::Tensor& v_scale, const at::Tensor& tables, const at::Tensor& ctx_lens,
                 const at::Tensor& sinks, const at::Tensor& windows, bool fp8,
                 const c10::optional<at::Tensor>& k_exact, const c10::optional<at::Tensor>& v_exact,
                 const c10::optional<at::Tensor>& exact_slots) {
  check(q.dim() == 3 && q.scalar_type() == at::kFloat && q.is_contiguous(), "q must be contiguous float32 [B, H, D]");
  check(k_data.dim() == 4 && v_data.dim() == 4 && k_data.scalar_type() == at::kByte &&
            v_data.scalar_type() == at::kByte && k_data.stride(3) == 1 && v_data.stride(3) == 1,
        "k_data and v_data must be uint8 [pages, block, kv_heads, D] with D contiguous");
  check(k_data.size(3) == q.size(2) && v_data.sizes() == k_data.sizes(), "head_dim and pool shapes must agree");
  const int64_t kv_heads = k_data.size(2);
  check(kv_heads > 0 && q.size(1) % kv_heads == 0, "heads must be a multiple of kv_heads");
  check(q.size(1) / kv_heads <= kMaxGroup, "at most 16 query heads a KV head");
  check(v_scale.scalar_type() == at::kBFloat16 && v_scale.dim() == 3, "v_scale must be bfloat16 [pages, block, H]");
  check((k_scale.scalar_type() == at::kBFloat16 && k_scale.dim() == 3) ||
            (!fp8 && k_scale.scalar_type() == at::kByte && k_scale.dim() == 3 && k_scale.stride(2) == 1),
        "k_scale must be bfloat16 [pages, block, H] or (INT8) uint8 exponents [pages, H, D]");
  check(tables.scalar_type() == at::kLong && tables.dim() == 2 && tables.is_contiguous() &&
            tables.size(0) == q.size(0), "tables must be contiguous int64 [B, W]");
  check(ctx_lens.scalar_type() == at::kLong && ctx_lens.is_contiguous() && ctx_lens.numel() == q.size(0),
        "ctx_lens must be contiguous int64 [B]");
  check(windows.numel() == 0 || (windows.numel() == q.size(0) && sinks.numel() == q.size(0) &&
                                 windows.scalar_type() == at::kLong && sinks.scalar_type() == at::kLong &&
                                 windows.is_contiguous() && sinks.is_contiguous()),
        "sinks and windows must be contiguous int64 [B], or both empty");
  const Exact X = exact_of(k_data, k_exact, v_exact, exact_slots);
  const int64_t block = k_data.size(1);
  const int64_t* cl = ctx_lens.data_ptr<int64_t>();
  const int64_t num_pages = std::min(k_data.size(0), v_data.size(0));
  const int64_t* tp = tables.data_ptr<int64_t>();
  for (int64_t b = 0; b < q.size(0); ++b) {
    check(cl[b] >= 1 && cl[b] <= tables.size(1) * block, "a context length outside its table");
    for (int64_t j = 0; j < (cl[b] + block - 1) / block; ++j) {  // (as index_select: never a read out of bounds)
      const int64_t id = tp[b * tables.size(1) + j];
      TORCH_CHECK(id >= 0 && id < num_pages, "paged_attention_q8: page id ", id, " outside the pool of ", num_pages,
                  " pages");
      check_slot("paged_attention_q8", X, id);
    }
  }
  return X;
}

struct PageIds {  // a dequantizer's page ids, and its exact tail
  const int64_t* ids;
  Exact X;
};

// The arguments both dequantizers take, checked: data uint8 [pages, block, kv_heads, D] with D contiguous; page_ids
// a contiguous int64 vector of its pages (as index_select: never a read out of bounds); the exact tail (exact,
// exact_slots: both or neither), each page's slot inside the slab.
PageIds checked_page_ids(const char* op, const at::Tensor& data, const at::Tensor& page_ids,
                         const c10::optional<at::Tensor>& exact, const c10::optional<at::Tensor>& exact_slots) {
  check(data.dim() == 4 && data.scalar_type() == at::kByte && data.stride(3) == 1,
        "data must be uint8 [pages, block, kv_heads, D] with D contiguous", op);
  check(page_ids.scalar_type() == at::kLong && page_ids.dim() == 1 && page_ids.is_contiguous(),
        "page_ids must be a contiguous int64 vector", op);
  PageIds p{page_ids.data_ptr<int64_t>(), exact_pages_of(op, data, exact, exact_slots)};
  for (int64_t i = 0; i < page_ids.numel(); ++i) {
    TORCH_CHECK(p.ids[i] >= 0 && p.ids[i] < data.size(0), op, ": page id ", p.ids[i], " outside the pool of ",
                data.size(0), " pages");
    check_slot(op, p.X, p.ids[i]);
  }
  return p;
}

// Runs decode<D> for q's head size (0: the scalar path).
template <typename Run>
void by_dim(int64_t dim, Run run) {
  switch (dim) {
    case 32: run(std::integral_constant<int, 32>{}); break;
    case 64: run(std::integral_constant<int, 64>{}); break;
    case 128: run(std::integral_constant<int, 128>{}); break;
    case 256: run(std::integral_constant<int, 256>{}); break;
    default: run(std::integral_constant<int, 0>{}); break;
  }
}

}  // namespace

// Whole pages of an 8-bit pool with a bfloat16 scale per (page, slot, KV head), dequantized: data [pages, block,
// kv_heads, D] uint8 (FP8 E4M3 or INT8 bytes, D contiguous), scale [pages, block, kv_heads] bfloat16, page_ids [n]
// int64 -> [n, block, kv_heads, D] float32, each element float(byte) x float(scale): what QuantizedCache.gather
// computes in torch (kv_quant.py), bit for bit, with the bytes widened in registers. With the exact tail (exact
// [slots, block, kv_heads, D] bfloat16, D contiguous, and exact_slots [pages] int32, -1: none; both or neither): a
// slab page (whose K and V are also held in bfloat16, the exact tail of a request, executor_svc/kv_tail.py; s =
// exact_slots[page_ids[i]] >= 0) comes out as float(exact[s]), its rows as the slab holds them.
at::Tensor dequantize_pages_q8(at::Tensor data, at::Tensor scale, at::Tensor page_ids, bool fp8,
                               const c10::optional<at::Tensor>& exact,
                               const c10::optional<at::Tensor>& exact_slots) {
  const char* name = "dequantize_pages_q8";
  const PageIds pages = checked_page_ids(name, data, page_ids, exact, exact_slots);
  const int64_t* ids = pages.ids;
  const Exact& X = pages.X;
  check(scale.scalar_type() == at::kBFloat16 && scale.dim() == 3 && scale.size(0) == data.size(0) &&
            scale.size(1) == data.size(1) && scale.size(2) == data.size(2),
        "scale must be bfloat16 [pages, block, kv_heads]", name);
  const int64_t n = page_ids.numel(), block = data.size(1), heads = data.size(2), dim = data.size(3);
  auto out = at::empty({n, block, heads, dim}, data.options().dtype(at::kFloat));
  const Pool P = pool_of(data, scale);
  float* op = out.data_ptr<float>();
  at::parallel_for(0, n * block * heads, 64, [&](int64_t begin, int64_t end) {
    std::vector<float> row(dim);
    for (int64_t r = begin; r < end; ++r) {
      const int64_t i = r / (block * heads), o = r / heads % block, h = r % heads;
      float* dst = op + r * dim;
      if (const int32_t s = X.slot(ids[i]); s >= 0) {  // a slab page
        widen_bf16(X.k.row(s, o, h), dim, dst);
        continue;
      }
      const uint8_t* src = P.row(ids[i], o, h);
      const float sc = P.row_scale(ids[i], o, h);
      int64_t d = 0;
      for (; d + 16 <= dim; d += 16) vstore(dst + d, (fp8 ? fp8_to_float(src + d) : int8_to_float(src + d)) * sc);
      if (d < dim) {
        widen(src + d, fp8, dim - d, row.data());
        for (int64_t j = 0; j < dim - d; ++j) dst[d + j] = row[j] * sc;
      }
    }
  });
  return out;
}

// Whole pages of INT8 keys with an exponent byte per (page, KV head, channel), dequantized: data [pages, block,
// kv_heads, D] int8 bytes (as uint8), exp [pages, kv_heads, D] uint8, page_ids [n] int64 -> [n, block, kv_heads, D]
// float32, each element float(byte) x 2^(e - 127): ChannelScaledCache.gather's torch arithmetic, bit for bit. With
// the exact tail (exact, exact_slots: as dequantize_pages_q8's): a slab page comes out as float(exact[s]), no
// exponent applied.
at::Tensor dequantize_pages_int8_channels(at::Tensor data, at::Tensor exp, at::Tensor page_ids,
                                          const c10::optional<at::Tensor>& exact,
                                          const c10::optional<at::Tensor>& exact_slots) {
  const char* name = "dequantize_pages_int8_channels";
  const PageIds pages = checked_page_ids(name, data, page_ids, exact, exact_slots);
  const int64_t* ids = pages.ids;
  const Exact& X = pages.X;
  check(exp.scalar_type() == at::kByte && exp.dim() == 3 && exp.stride(2) == 1 && exp.size(0) == data.size(0) &&
            exp.size(1) == data.size(2) && exp.size(2) == data.size(3),
        "exp must be uint8 [pages, kv_heads, D] with D contiguous", name);
  const int64_t n = page_ids.numel(), block = data.size(1), heads = data.size(2), dim = data.size(3);
  auto out = at::empty({n, block, heads, dim}, data.options().dtype(at::kFloat));
  const Pool P = pool_of(data, exp);
  float* op = out.data_ptr<float>();
  at::parallel_for(0, n * heads, 1, [&](int64_t begin, int64_t end) {
    std::vector<float> scale(dim);
    for (int64_t t = begin; t < end; ++t) {
      const int64_t i = t / heads, h = t % heads;
      if (const int32_t s = X.slot(ids[i]); s >= 0) {  // a slab page
        for (int64_t o = 0; o < block; ++o) widen_bf16(X.k.row(s, o, h), dim, op + ((i * block + o) * heads + h) * dim);
        continue;
      }
      const uint8_t* e = P.exp + ids[i] * P.e_page + h * P.e_head;
      for (int64_t d = 0; d < dim; ++d)  // 2^(e - 127) exactly, the subnormal 2^-127 of e = 0 included
        scale[d] = e[d] ? exp2_byte(e[d]) : std::ldexp(1.0f, -127);
      for (int64_t o = 0; o < block; ++o) {
        const int8_t* src = reinterpret_cast<const int8_t*>(P.row(ids[i], o, h));
        float* dst = op + ((i * block + o) * heads + h) * dim;
        for (int64_t d = 0; d < dim; ++d) dst[d] = static_cast<float>(src[d]) * scale[d];
      }
    }
  });
  return out;
}

// q [B, heads, D] float32; k_data, v_data [pages, block, kv_heads, D] 8-bit (uint8 views of FP8 or INT8 bytes,
// D contiguous); k_scale [pages, block, kv_heads] bfloat16, or (INT8 K) [pages, kv_heads, D] uint8 exponents;
// v_scale [pages, block, kv_heads] bfloat16; tables [B, W] and ctx_lens [B] int64; sinks, windows [B] int64 or
// empty; fp8: the data bytes are E4M3 (else INT8). Returns [B, heads, D] float32.
// The exact tail, optional (all three or none): k_exact, v_exact [slots, block, kv_heads, D] bfloat16 (D
// contiguous, other strides free) and exact_slots [pages] int32 (one per page of the pool; -1: none). A slab page
// (s = exact_slots[page] >= 0: a page whose K and V are also held in bfloat16, the exact tail of a request,
// executor_svc/kv_tail.py) is read from there instead of the 8-bit bytes: its keys float(k_exact[s, offset, h]) and
// values float(v_exact[s, offset, h]), unscaled; the visible positions and the rest are unchanged. Every slot a row
// reads is checked against the slab's size.
at::Tensor paged_attention_q8(at::Tensor q, at::Tensor k_data, at::Tensor k_scale, at::Tensor v_data,
                              at::Tensor v_scale, at::Tensor tables, at::Tensor ctx_lens, at::Tensor sinks,
                              at::Tensor windows, int64_t model_window, bool fp8, double scale,
                              const c10::optional<at::Tensor>& k_exact, const c10::optional<at::Tensor>& v_exact,
                              const c10::optional<at::Tensor>& exact_slots) {
  const Exact X = check_args(q, k_data, k_scale, v_data, v_scale, tables, ctx_lens, sinks, windows, fp8, k_exact,
                             v_exact, exact_slots);
  auto out = at::empty_like(q);
  const Pool K = pool_of(k_data, k_scale), V = pool_of(v_data, v_scale);
  by_dim(q.size(2), [&](auto dim) {
    decode<decltype(dim)::value>(q, K, V, X, fp8, tables, ctx_lens, sinks, windows, model_window, k_data.size(1),
                                 k_data.size(2), scale, out);
  });
  return out;
}

// The second half of a cascade over 8-bit pages (q8_decode.py): each row attends its keys from position ``start``
// on (the ones after a shared prefix attended apart; no windows), as paged_attention_q8 attends them (slab pages,
// with the exact tail's three optional arguments, as there). Returns its output [B, heads, D] and the log-sum-exp
// of its scaled scores [B, heads] (float32; -inf for a row with no key there), to merge with the prefix's.
std::tuple<at::Tensor, at::Tensor> paged_attention_q8_after(at::Tensor q, at::Tensor k_data, at::Tensor k_scale,
                                                            at::Tensor v_data, at::Tensor v_scale, at::Tensor tables,
                                                            at::Tensor ctx_lens, int64_t start, bool fp8,
                                                            double scale, const c10::optional<at::Tensor>& k_exact,
                                                            const c10::optional<at::Tensor>& v_exact,
                                                            const c10::optional<at::Tensor>& exact_slots) {
  const at::Tensor none = at::empty({0}, ctx_lens.options());
  const Exact X = check_args(q, k_data, k_scale, v_data, v_scale, tables, ctx_lens, none, none, fp8, k_exact, v_exact,
                             exact_slots);
  check(start >= 0, "start must be >= 0");
  auto out = at::empty_like(q);
  auto lse = at::empty({q.size(0), q.size(1)}, q.options());
  const Pool K = pool_of(k_data, k_scale), V = pool_of(v_data, v_scale);
  by_dim(q.size(2), [&](auto dim) {
    decode<decltype(dim)::value>(q, K, V, X, fp8, tables, ctx_lens, none, none, 0, k_data.size(1), k_data.size(2),
                                 scale, out, start, lse.data_ptr<float>());
  });
  return {out, lse};
}
}  // namespace pagedkv_q8

TORCH_LIBRARY_FRAGMENT(pagedkv_cpu, m) {
  m.def("paged_attention_q8(Tensor q, Tensor k_data, Tensor k_scale, Tensor v_data, Tensor v_scale, Tensor tables, "
        "Tensor ctx_lens, Tensor sinks, Tensor windows, int model_window, bool fp8, float scale, "
        "Tensor? k_exact=None, Tensor? v_exact=None, Tensor? exact_slots=None) -> Tensor");
  m.def("dequantize_pages_q8(Tensor data, Tensor scale, Tensor page_ids, bool fp8, Tensor? exact=None, "
        "Tensor? exact_slots=None) -> Tensor");
  m.def("dequantize_pages_int8_channels(Tensor data, Tensor exp, Tensor page_ids, Tensor? exact=None, "
        "Tensor? exact_slots=None) -> Tensor");
  m.def("paged_attention_q8_after(Tensor q, Tensor k_data, Tensor k_scale, Tensor v_data, Tensor v_scale, "
        "Tensor tables, Tensor ctx_lens, int start, bool fp8, float scale, Tensor? k_exact=None, "
        "Tensor? v_exact=None, Tensor? exact_slots=None) -> (Tensor, Tensor)");
}

TORCH_LIBRARY_IMPL(pagedkv_cpu, CPU, m) {
  m.impl("paged_attention_q8", &pagedkv_q8::paged_attention_q8);
  m.impl("paged_attention_q8_after", &pagedkv_q8::paged_attention_q8_after);
  m.impl("dequantize_pages_q8", &pagedkv_q8::dequantize_pages_q8);
  m.impl("dequantize_pages_int8_channels", &pagedkv_q8::dequantize_pages_int8_channels);
}

#endif  // AVX2, FMA, F16C
