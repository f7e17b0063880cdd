// The writes of 8-bit KV pages (FP8 E4M3, INT8: executor_svc/kv_quant.py) on the CPU, one call a layer's K or V,
// bit for bit what the pool's torch writes compute (QuantizedCache.write, ChannelScaledCache.write: those stay the
// reference, and the path where this library is not built). In torch a decode step's writes take ~10 ops a layer
// for K and for V (INT8 K: unique, scatter_reduce, frexp, pow, round, index_put, ...); here one pass over the rows.
//
// write_q8: a bfloat16 scale per (token, KV head) (FP8 K and V, INT8 V). For each row x[t, h] (widened to float32
// exactly as x.float()):
//   amax  = max |x| over D (float32; NaN where the row has a NaN, as torch.amax)
//   scale = bfloat16(amax / qmax) (float32 division; round to nearest even; qmax 448 for E4M3, 127 for INT8),
//           replaced by 1 where it is not > 0 (an all-zero row, and a NaN amax)
//   y     = x / float(scale) (float32 division)
//   INT8: round half to even, clamped to [-127, 127]; NaN -> 0 (torch's float -> int8 conversion of NaN here)
//   FP8:  clamped to [-448, 448] (NaN stays NaN, its sign kept), then torch's float8_e4m3fn conversion
//         (c10::Float8_e4m3fn: round to nearest even, NaN -> 0x7f with the NaN's sign bit)
// and data[pages[t], offsets[t], h] = the bytes, scale[pages[t], offsets[t], h] = scale.
//
// write_int8_channels: INT8 K with a power-of-two scale per (page, KV head, channel) kept as an exponent byte e
// (the scale 2^(e - 127); 0: nothing written). For each page the call writes to, with its tokens' rows:
//   amax[h, d] = max(0, |x[t, h, d]| over the page's tokens) (NaN where one is NaN, as scatter_reduce's amax)
//   need       = ceil(log2(amax / 127)) + 127 clamped to [1, 254], as torch takes it from frexp of the float32
//                quotient (0 where amax is not > 0; 127 where the quotient is inf, or 0: amax a subnormal below
//                127 x 2^-150, a case where frexp's exponent 0 says nothing of the size)
//   old        = exp[page] (0 when one of the page's tokens is at offset 0: a fresh page), new = max(old, need)
//   where a channel grew from a nonzero old (any of the page's channels): ALL block rows of the page (also rows not
//   written yet, and the rows about to be written) become round(float(byte) * 2^(old - new)), clamped
//   exp[page] = new; then each token's row: round(x / 2^(new - 127)) clamped to [-127, 127] (NaN -> 0).
// The powers of two are float32 values exactly as torch.pow(2.0, k) gives them (exact: 2^-150 and below are 0).
//
// Duplicate slots (the same (page, offset) twice in one call; a plan never has them): the last row in order is
// the one stored, as torch's index_put does when it runs serially; INT8 K's amax counts every row, as the torch
// path's scatter_reduce does. Page ids must be in [0, pages) and offsets in [0, block) (torch would wrap negative
// ones). Tensors: data uint8 [pages, block, kv_heads, D], D contiguous, other strides free (a view of the pool's
// bytes); scale bfloat16 [pages, block, kv_heads], any strides; exp uint8 [pages, kv_heads, D], D contiguous; pages,
// offsets int64 [T], any stride; x [T, kv_heads, D] float32, bfloat16 or float16, any strides.
//
// Written with GCC's generic vectors, 16 lanes (no intrinsics): registered on every CPU, unlike the AVX2 attention
// ops. Work is spread over torch's intra-op threads: (token, head) rows for write_q8, pages for write_int8_channels;
// a decode's writes (a few thousand elements) stay on the calling thread.

#include <ATen/ATen.h>
#include <ATen/Parallel.h>
#include <c10/util/BFloat16.h>
#include <c10/util/Half.h>
#include <torch/library.h>

#include <algorithm>
#include <cmath>
#include <cstdint>
#include <cstring>
#include <limits>
#include <numeric>
#include <utility>
#include <vector>

namespace pagedkv_kv_write {
namespace {

constexpr float kFp8Max = 448.0f;
constexpr float kInt8Max = 127.0f;
constexpr int64_t kWorkPerTask = 32768;  // elements a task at least: a decode's writes (~6K elements) on one thread

// 16 lanes of GCC's generic vectors (AVX-512: one register; AVX2: two; elsewhere what the target has). Every row is
// processed 16 elements at a time, its last chunk from a zero-padded copy: one implementation for every head size.
typedef float v16f __attribute__((vector_size(64)));
typedef uint32_t v16u __attribute__((vector_size(64)));
typedef int32_t v16i __attribute__((vector_size(64)));
typedef uint8_t v16b __attribute__((vector_size(16)));
typedef int8_t v16c __attribute__((vector_size(16)));
constexpr int64_t kLanes = 16;

inline int64_t padded(int64_t dim) { return (dim + kLanes - 1) / kLanes * kLanes; }

template <typename To, typename From>
inline To bitcast(const From& f) {
  static_assert(sizeof(To) == sizeof(From), "bitcast between types of one size");
  To t;
  std::memcpy(&t, &f, sizeof t);
  return t;
}

inline v16f vload(const float* p) {
  v16f v;
  std::memcpy(&v, p, sizeof v);
  return v;
}

inline v16f splat(float f) { return v16f{} + f; }
inline v16u splat_u(uint32_t u) { return v16u{} + u; }

// c10::Float8_e4m3fn's conversion (torch's float -> float8_e4m3fn cast, detail::fp8e4m3fn_from_fp32_value) on 16
// lanes, its branches as selects: checked against c10's on all 2^32 float bit patterns when written (and the op
// against torch's cast in tests/unit/test_kv_write_kernel.py: E4M3 midpoints, every binade, NaN).
inline v16b fp8_e4m3_bytes(v16f f) {
  const v16u u = bitcast<v16u>(f);
  const v16u sign = u & 0x80000000u;
  const v16u a = u ^ sign;
  // below 2^-6 (subnormals): the float sum with 2^14 rounds the value onto E4M3's subnormal grid
  const v16u den = bitcast<v16u>(bitcast<v16f>(a) + bitcast<float>(141u << 23)) - (141u << 23);
  // normals: exponent rebiased, mantissa rounded to nearest even, a carry into 0x7f saturates to 0x7e
  v16u nor = (a + (static_cast<uint32_t>(7 - 127) << 23) + 0x7FFFFu + ((a >> 20) & 1u)) >> 20;
  nor = nor == splat_u(0x7f) ? splat_u(0x7e) : nor;
  const v16u big = a > splat_u(0x7F800000u) ? splat_u(0x7f) : splat_u(0x7e);  // NaN; overflow and inf saturate
  const v16u r = a >= splat_u(1087u << 20) ? big : (a < splat_u(121u << 23) ? den : nor);
  return __builtin_convertvector((r & 0xffu) | (sign >> 24), v16b);
}

// FP8 bytes of y / scale: clamped to [-448, 448] (NaN kept, with its sign), then the E4M3 conversion.
inline v16b fp8_lanes(v16f y, float scale) {
  v16f v = y / scale;
  v = v < splat(-kFp8Max) ? splat(-kFp8Max) : v;
  v = v > splat(kFp8Max) ? splat(kFp8Max) : v;
  return fp8_e4m3_bytes(v);
}

// INT8 bytes of y: rounded half to even, clamped to [-127, 127], NaN -> 0 (torch's float -> int8 conversion of
// NaN). Clamping first and rounding then gives the same integers; for |c| <= 127 the sum with 1.5 x 2^23 rounds c to
// the nearest integer, ties to even, exactly (as std::nearbyint in the default rounding mode).
inline v16c int8_lanes(v16f y) {
  v16f c = y < splat(-kInt8Max) ? splat(-kInt8Max) : y;
  c = c > splat(kInt8Max) ? splat(kInt8Max) : c;
  v16f r = (c + 12582912.0f) - 12582912.0f;
  r = c == c ? r : v16f{};
  return __builtin_convertvector(__builtin_convertvector(r, v16i), v16c);
}

// Stores a row's bytes: dim of them, 16 a chunk (the last chunk's lanes past dim dropped).
template <typename Chunk>
inline void store_row(uint8_t* out, int64_t dim, Chunk chunk) {
  for (int64_t d = 0; d < dim; d += kLanes) {
    const auto bytes = chunk(d);
    std::memcpy(out + d, &bytes, static_cast<size_t>(std::min<int64_t>(kLanes, dim - d)));
  }
}

// 2^k as float32 for k in [-255, 255] (torch.pow(2.0, k): exact, underflowing to 0 below 2^-149 and 2^-150 itself
// rounding to 0, overflowing to inf at 2^128).
struct Pow2 {
  float v[511];
  Pow2() {
    for (int k = -255; k <= 255; ++k) v[k + 255] = std::ldexp(1.0f, k);
  }
  float operator()(int k) const { return v[k + 255]; }
};
const Pow2 kPow2;

// Row x[t, h] (any strides) widened to float32 as x.float() does (exact for bfloat16 and float16) into out[0, dim);
// out's padding past dim is left as it is (zero).
template <typename T>
inline void load_row(const T* x, int64_t stride_d, int64_t dim, float* out) {
  if (stride_d == 1) {
    for (int64_t d = 0; d < dim; ++d) out[d] = static_cast<float>(x[d]);
  } else {
    for (int64_t d = 0; d < dim; ++d) out[d] = static_cast<float>(x[d * stride_d]);
  }
}

// x's element type: float32, bfloat16 or float16.
template <typename Fn>
void by_input(const at::Tensor& x, const char* op, Fn fn) {
  switch (x.scalar_type()) {
    case at::kFloat: fn(static_cast<const float*>(x.data_ptr())); break;
    case at::kBFloat16: fn(static_cast<const c10::BFloat16*>(x.data_ptr())); break;
    case at::kHalf: fn(static_cast<const c10::Half*>(x.data_ptr())); break;
    default: TORCH_CHECK(false, op, ": x must be float32, bfloat16 or float16, not ", x.scalar_type());
  }
}

// The arguments both ops take, checked (data, pages, offsets, x); the page ids and offsets in range.
void check_common(const char* op, const at::Tensor& data, const at::Tensor& pages, const at::Tensor& offsets,
                  const at::Tensor& x) {
  TORCH_CHECK(data.device().is_cpu() && pages.device().is_cpu() && offsets.device().is_cpu() && x.device().is_cpu(),
              op, ": all tensors must be on the CPU");
  TORCH_CHECK(data.scalar_type() == at::kByte && data.dim() == 4 && data.stride(3) == 1, op,
              ": data must be uint8 [pages, block, kv_heads, D] with D contiguous, not ", data.scalar_type(), " ",
              data.sizes(), " with strides ", data.strides());
  TORCH_CHECK(pages.scalar_type() == at::kLong && pages.dim() == 1, op, ": pages must be an int64 vector, not ",
              pages.scalar_type(), " ", pages.sizes());
  TORCH_CHECK(offsets.scalar_type() == at::kLong && offsets.dim() == 1 && offsets.numel() == pages.numel(), op,
              ": offsets must be an int64 vector as long as pages (", pages.numel(), "), not ", offsets.scalar_type(),
              " ", offsets.sizes());
  TORCH_CHECK(x.dim() == 3 && x.size(0) == pages.numel() && x.size(1) == data.size(2) && x.size(2) == data.size(3),
              op, ": x must be [T, kv_heads, D] = [", pages.numel(), ", ", data.size(2), ", ", data.size(3),
              "] (one row a slot), not ", x.sizes());
  const int64_t n = pages.numel(), num_pages = data.size(0), block = data.size(1);
  const int64_t* pg = pages.data_ptr<int64_t>();
  const int64_t* of = offsets.data_ptr<int64_t>();
  const int64_t ps = pages.stride(0), os = offsets.stride(0);
  for (int64_t t = 0; t < n; ++t) {
    TORCH_CHECK(pg[t * ps] >= 0 && pg[t * ps] < num_pages, op, ": page id ", pg[t * ps], " (row ", t,
                ") outside the pool of ", num_pages, " pages");
    TORCH_CHECK(of[t * os] >= 0 && of[t * os] < block, op, ": offset ", of[t * os], " (row ", t,
                ") outside the page's ", block, " slots");
  }
}

struct Slots {  // the rows' (page, offset), read through their strides
  const int64_t* pg;
  const int64_t* of;
  int64_t ps, os;
  int64_t page(int64_t t) const { return pg[t * ps]; }
  int64_t offset(int64_t t) const { return of[t * os]; }
};

Slots slots_of(const at::Tensor& pages, const at::Tensor& offsets) {
  return {pages.data_ptr<int64_t>(), offsets.data_ptr<int64_t>(), pages.stride(0), offsets.stride(0)};
}

// Which rows are stored: all but those whose slot a later row of the call writes again (empty: all of them).
std::vector<uint8_t> overwritten_rows(const Slots& s, int64_t n, int64_t block) {
  std::vector<uint8_t> skip;
  if (n < 2) return skip;
  std::vector<std::pair<int64_t, int64_t>> keys(n);
  for (int64_t t = 0; t < n; ++t) keys[t] = {s.page(t) * block + s.offset(t), t};
  std::sort(keys.begin(), keys.end());
  for (int64_t i = 0; i + 1 < n; ++i) {
    if (keys[i].first == keys[i + 1].first) {
      if (skip.empty()) skip.assign(n, 0);
      skip[keys[i].second] = 1;
    }
  }
  return skip;
}

}  // namespace

// data uint8 [pages, block, kv_heads, D] (FP8 E4M3 or INT8 bytes), scale bfloat16 [pages, block, kv_heads], pages and
// offsets int64 [T], x [T, kv_heads, D]; fp8: E4M3 bytes (else INT8). QuantizedCache.write, bit for bit.
void write_q8(at::Tensor data, at::Tensor scale, at::Tensor pages, at::Tensor offsets, at::Tensor x, bool fp8) {
  const char* op = "write_q8";
  check_common(op, data, pages, offsets, x);
  TORCH_CHECK(scale.device().is_cpu() && scale.scalar_type() == at::kBFloat16 && scale.dim() == 3 &&
                  scale.size(0) == data.size(0) && scale.size(1) == data.size(1) && scale.size(2) == data.size(2),
              op, ": scale must be bfloat16 [pages, block, kv_heads] = [", data.size(0), ", ", data.size(1), ", ",
              data.size(2), "], not ", scale.scalar_type(), " ", scale.sizes());
  const int64_t n = pages.numel(), heads = data.size(2), dim = data.size(3);
  if (n == 0 || heads == 0 || dim == 0) return;
  const Slots s = slots_of(pages, offsets);
  const std::vector<uint8_t> skip = overwritten_rows(s, n, data.size(1));
  uint8_t* dp = data.data_ptr<uint8_t>();
  const int64_t d_page = data.stride(0), d_slot = data.stride(1), d_head = data.stride(2);
  uint16_t* sp = reinterpret_cast<uint16_t*>(scale.data_ptr<at::BFloat16>());
  const int64_t s_page = scale.stride(0), s_slot = scale.stride(1), s_head = scale.stride(2);
  const int64_t x_t = x.stride(0), x_h = x.stride(1), x_d = x.stride(2);
  const float qmax = fp8 ? kFp8Max : kInt8Max;
  const int64_t dim_p = padded(dim);
  by_input(x, op, [&](auto xp) {
    at::parallel_for(0, n * heads, std::max<int64_t>(1, kWorkPerTask / dim), [&](int64_t begin, int64_t end) {
      std::vector<float> row(dim_p, 0.f);  // (its padding stays 0)
      const float* y = row.data();
      for (int64_t r = begin; r < end; ++r) {
        const int64_t t = r / heads, h = r % heads;
        if (!skip.empty() && skip[t]) continue;
        load_row(xp + t * x_t + h * x_h, x_d, dim, row.data());
        v16f m = v16f{};
        v16i nan = v16i{};
        for (int64_t d = 0; d < dim_p; d += kLanes) {
          const v16f a = bitcast<v16f>(bitcast<v16u>(vload(y + d)) & 0x7fffffffu);
          nan |= a != a;
          m = a > m ? a : m;
        }
        float amax = 0.f;
        bool any_nan = false;
        for (int l = 0; l < kLanes; ++l) {
          amax = m[l] > amax ? m[l] : amax;
          any_nan |= nan[l] != 0;
        }
        if (any_nan) amax = std::numeric_limits<float>::quiet_NaN();  // (torch.amax: NaN)
        c10::BFloat16 sc(amax / qmax);  // round to nearest even
        float scf = static_cast<float>(sc);
        if (!(scf > 0.f)) {  // an all-zero row (or NaN): any scale, 1
          sc = c10::BFloat16(1.0f);
          scf = 1.0f;
        }
        const int64_t page = s.page(t), off = s.offset(t);
        uint8_t* out = dp + page * d_page + off * d_slot + h * d_head;
        if (fp8) {
          store_row(out, dim, [&](int64_t d) { return fp8_lanes(vload(y + d), scf); });
        } else {
          store_row(out, dim, [&](int64_t d) { return int8_lanes(vload(y + d) / scf); });
        }
        sp[page * s_page + off * s_slot + h * s_head] = sc.x;
      }
    });
  });
}

// data int8 bytes (as uint8) [pages, block, kv_heads, D], exp uint8 [pages, kv_heads, D], pages and offsets int64
// [T], x [T, kv_heads, D]. ChannelScaledCache.write, bit for bit.
void write_int8_channels(at::Tensor data, at::Tensor exp, at::Tensor pages, at::Tensor offsets, at::Tensor x) {
  const char* op = "write_int8_channels";
  check_common(op, data, pages, offsets, x);
  TORCH_CHECK(exp.device().is_cpu() && exp.scalar_type() == at::kByte && exp.dim() == 3 && exp.stride(2) == 1 &&
                  exp.size(0) == data.size(0) && exp.size(1) == data.size(2) && exp.size(2) == data.size(3),
              op, ": exp must be uint8 [pages, kv_heads, D] = [", data.size(0), ", ", data.size(2), ", ", data.size(3),
              "] with D contiguous, not ", exp.scalar_type(), " ", exp.sizes(), " with strides ", exp.strides());
  const int64_t n = pages.numel(), block = data.size(1), heads = data.size(2), dim = data.size(3);
  if (n == 0 || heads == 0 || dim == 0) return;
  const Slots s = slots_of(pages, offsets);
  // the rows grouped by page, each page's rows in call order
  std::vector<int64_t> order(n);
  std::iota(order.begin(), order.end(), 0);
  std::stable_sort(order.begin(), order.end(), [&](int64_t a, int64_t b) { return s.page(a) < s.page(b); });
  std::vector<int64_t> starts{0};
  for (int64_t i = 1; i < n; ++i)
    if (s.page(order[i]) != s.page(order[i - 1])) starts.push_back(i);
  starts.push_back(n);
  const int64_t groups = static_cast<int64_t>(starts.size()) - 1;
  uint8_t* dp = data.data_ptr<uint8_t>();
  const int64_t d_page = data.stride(0), d_slot = data.stride(1), d_head = data.stride(2);
  uint8_t* ep = exp.data_ptr<uint8_t>();
  const int64_t e_page = exp.stride(0), e_head = exp.stride(1);
  const int64_t x_t = x.stride(0), x_h = x.stride(1), x_d = x.stride(2);
  const int64_t dim_p = padded(dim), hd = heads * dim_p;  // (per-channel arrays: each head's D padded)
  // a task: pages worth ~kWorkPerTask elements (the rows written, and a little for a requantization now and then)
  const int64_t grain = std::max<int64_t>(1, kWorkPerTask / ((n / groups + 2) * heads * dim));
  by_input(x, op, [&](auto xp) {
    at::parallel_for(0, groups, grain, [&](int64_t begin, int64_t end) {
      // (the padding lanes: amax 0, exponents 0, shift and divisor 1; never stored)
      std::vector<float> amax(hd), row(dim_p, 0.f), shift(hd, 1.f), divisor(hd, 1.f);
      std::vector<int32_t> nan(hd), old_e(hd, 0), new_e(hd, 0);
      std::vector<int64_t> last(block);
      for (int64_t g = begin; g < end; ++g) {
        const int64_t first = starts[g], stop = starts[g + 1], page = s.page(order[first]);
        bool fresh = false;  // a token at offset 0: the previous owner's exponents do not count
        std::fill(amax.begin(), amax.end(), 0.f);
        std::fill(nan.begin(), nan.end(), 0);
        for (int64_t i = first; i < stop; ++i) {  // amax: max(0, |x|) over the page's rows, NaN flagged
          const int64_t t = order[i];
          fresh |= s.offset(t) == 0;
          for (int64_t h = 0; h < heads; ++h) {
            load_row(xp + t * x_t + h * x_h, x_d, dim, row.data());
            for (int64_t d = 0; d < dim_p; d += kLanes) {
              float* mp = amax.data() + h * dim_p + d;
              const v16f a = bitcast<v16f>(bitcast<v16u>(vload(row.data() + d)) & 0x7fffffffu);
              const v16f m = vload(mp);
              const v16f mx = a > m ? a : m;
              std::memcpy(mp, &mx, sizeof mx);
              v16i bad;
              std::memcpy(&bad, nan.data() + h * dim_p + d, sizeof bad);
              bad |= a != a;
              std::memcpy(nan.data() + h * dim_p + d, &bad, sizeof bad);
            }
          }
        }
        const uint8_t* e = ep + page * e_page;
        for (int64_t h = 0; h < heads; ++h)
          for (int64_t d = 0; d < dim; ++d) old_e[h * dim_p + d] = fresh ? 0 : e[h * e_head + d];
        v16i grew = v16i{};
        for (int64_t c = 0; c < hd; c += kLanes) {
          // need = ceil(log2(q)) + 127, q = amax / 127 (float32), as torch takes it from frexp(q) = (mant, ex):
          // ex - (mant == 0.5) + 127 clamped to [1, 254]. From q's bits (E, M): a normal q gives E + 1 - (M == 0);
          // a subnormal one at most 1; q == 0 (amax a subnormal that the division rounds to 0) and q = inf give
          // frexp's exponent 0 there, so 127. Not > 0 (0, and NaN): 0.
          const v16f a = vload(amax.data() + c);
          const v16u qb = bitcast<v16u>(a / kInt8Max);
          const v16i E = bitcast<v16i>((qb >> 23) & 0xffu), M = bitcast<v16i>(qb & 0x7fffffu);
          v16i need = E + 1 - ((M == 0) & 1);
          need = E == 0 ? (M == 0 ? v16i{} + 127 : v16i{} + 1) : need;
          need = E == 255 ? v16i{} + 127 : need;
          need = need < 1 ? v16i{} + 1 : (need > 254 ? v16i{} + 254 : need);
          v16i bad;
          std::memcpy(&bad, nan.data() + c, sizeof bad);
          need = (a > 0.f) & (bad == 0) ? need : v16i{};
          v16i old;
          std::memcpy(&old, old_e.data() + c, sizeof old);
          const v16i nw = need > old ? need : old;
          grew |= (nw > old) & (old > 0);
          std::memcpy(new_e.data() + c, &nw, sizeof nw);
        }
        bool grown = false;
        for (int l = 0; l < kLanes; ++l) grown |= grew[l] != 0;
        if (grown) {  // every row of the page (as torch: data[rows] whole) to the larger scales
          for (int64_t c = 0; c < hd; ++c) shift[c] = kPow2(old_e[c] - new_e[c]);
          for (int64_t o = 0; o < block; ++o) {
            for (int64_t h = 0; h < heads; ++h) {
              uint8_t* r = dp + page * d_page + o * d_slot + h * d_head;
              for (int64_t d = 0; d < dim; ++d) row[d] = static_cast<float>(static_cast<int8_t>(r[d]));
              const float* sh = shift.data() + h * dim_p;
              store_row(r, dim, [&](int64_t d) { return int8_lanes(vload(row.data() + d) * vload(sh + d)); });
            }
          }
        }
        uint8_t* ew = ep + page * e_page;
        for (int64_t h = 0; h < heads; ++h)
          for (int64_t d = 0; d < dim; ++d) ew[h * e_head + d] = static_cast<uint8_t>(new_e[h * dim_p + d]);
        for (int64_t h = 0; h < heads; ++h)  // the scale 2^(new - 127), the rows' divisor
          for (int64_t d = 0; d < dim; ++d) divisor[h * dim_p + d] = kPow2(new_e[h * dim_p + d] - 127);
        for (int64_t i = first; i < stop; ++i) last[s.offset(order[i])] = order[i];  // duplicates: the last row
        for (int64_t i = first; i < stop; ++i) {
          const int64_t t = order[i], off = s.offset(t);
          if (last[off] != t) continue;
          for (int64_t h = 0; h < heads; ++h) {
            load_row(xp + t * x_t + h * x_h, x_d, dim, row.data());
            uint8_t* out = dp + page * d_page + off * d_slot + h * d_head;
            const float* dv = divisor.data() + h * dim_p;
            store_row(out, dim, [&](int64_t d) { return int8_lanes(vload(row.data() + d) / vload(dv + d)); });
          }
        }
      }
    });
  });
}

}  // namespace pagedkv_kv_write

TORCH_LIBRARY_FRAGMENT(pagedkv_cpu, m) {
  m.def("write_q8(Tensor(a!) data, Tensor(b!) scale, Tensor pages, Tensor offsets, Tensor x, bool fp8) -> ()");
  m.def("write_int8_channels(Tensor(a!) data, Tensor(b!) exp, Tensor pages, Tensor offsets, Tensor x) -> ()");
}

TORCH_LIBRARY_IMPL(pagedkv_cpu, CPU, m) {
  m.impl("write_q8", &pagedkv_kv_write::write_q8);
  m.impl("write_int8_channels", &pagedkv_kv_write::write_int8_channels);
}
