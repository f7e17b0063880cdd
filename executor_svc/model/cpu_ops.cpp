// Fused decoder-layer ops for float32 and bfloat16 models on the CPU: each replaces a run of small torch ops (and
// their dispatch, one tensor each) with one pass over its rows. Built into the same library as the paged attention
// kernel (executor_svc/attention/cpu_kernel.py), as torch.ops.pagedkv_cpu.*; executor_svc/model/llama.py uses
// them for float32 and bfloat16 models on the CPU and keeps its torch ops everywhere else (and as the reference).
//
// The arithmetic is transformers' (LlamaRMSNorm, rotate_half rotary, SiLU) in float32, with its sums in
// another order: results agree to a few ulp. In bfloat16 it is done in float32 and rounded to bfloat16 where
// torch's bfloat16 ops round (each op's result: the residual add, the norm's x * r and its product with the
// weight, each rotary product and their sum, silu and its product with up), so the steps match the torch path's.
//
//   rms_norm(x, w, eps)                  w * (x * rsqrt(mean(x^2) + eps)), row by row
//   add_rms_norm(x, a, w, eps)           x += a in place (the residual stream), then rms_norm(x, w, eps)
//   rotary_write(q, k, v, cos, sin, k_cache, v_cache, slot_pages, slot_offsets) -> q rotated
//                                        q and k rotated (x * cos + rotate_half(x) * sin): q into a new
//                                        contiguous tensor, k straight into its slot (k_cache[page, offset]), v
//                                        copied into its slot, as write_cache stores them
//   silu_mul(gate_up)                    silu(gate) * up, gate and up the halves of each row

#include <ATen/ATen.h>
#include <ATen/Parallel.h>
#include <torch/library.h>

#include <algorithm>
#include <cmath>
#include <cstdint>
#include <cstring>
#include <limits>

#include "cpu_math.h"
#include "cpu_ops.h"

namespace {

void check(bool ok, const char* what) { TORCH_CHECK(ok, "pagedkv_cpu ops: ", what); }

// Element access for the two storage types, the arithmetic in float32 either way. Io<T>::round(v): v as T holds it
// (float: v itself; bfloat16: rounded to nearest even, as c10::BFloat16 and torch's bfloat16 ops round).
template <typename T>
struct Io;

template <>
struct Io<float> {
  static inline float load(const float* p, int64_t i) { return p[i]; }
  static inline void store(float* p, int64_t i, float v) { p[i] = v; }
  static inline float round(float v) { return v; }
};

template <>
struct Io<at::BFloat16> {
  static inline uint16_t bits(float v) {
    uint32_t u;
    std::memcpy(&u, &v, sizeof u);
    return static_cast<uint16_t>((u + 0x7FFFu + ((u >> 16) & 1u)) >> 16);
  }
  static inline float widen(uint16_t h) {
    const uint32_t u = static_cast<uint32_t>(h) << 16;
    float f;
    std::memcpy(&f, &u, sizeof f);
    return f;
  }
  static inline float load(const at::BFloat16* p, int64_t i) { return widen(p[i].x); }
  static inline void store(at::BFloat16* p, int64_t i, float v) { p[i].x = bits(v); }
  static inline float round(float v) { return widen(bits(v)); }
};

// silu(g) * u over one row of d.
template <typename T>
inline void silu_mul_row(const T* g, const T* u, T* o, int64_t d) {
  using io = Io<T>;
#pragma omp simd
  for (int64_t i = 0; i < d; ++i) {
    const float x = io::load(g, i);
    io::store(o, i, io::round(x / (1.f + pagedkv_cpu::exp_clamped(-x))) * io::load(u, i));
  }
}

// One row: w * (x * rsqrt(mean(x^2) + eps)).
template <typename T>
inline void norm_row(const T* x, const T* w, T* out, int64_t d, float eps) {
  using io = Io<T>;
  float sum = 0.f;
#pragma omp simd reduction(+ : sum)
  for (int64_t i = 0; i < d; ++i) sum += io::load(x, i) * io::load(x, i);
  const float r = 1.f / std::sqrt(sum / static_cast<float>(d) + eps);
#pragma omp simd
  for (int64_t i = 0; i < d; ++i) io::store(out, i, io::load(w, i) * io::round(io::load(x, i) * r));
}

// float32 or bfloat16: the storage type these ops take.
bool supported(at::ScalarType t) { return t == at::kFloat || t == at::kBFloat16; }

void check_rows(const at::Tensor& x, const at::Tensor& w) {
  check(x.dim() == 2 && supported(x.scalar_type()) && x.stride(1) == 1,
        "x must be a float32 or bfloat16 [rows, d]");
  check(w.dim() == 1 && w.scalar_type() == x.scalar_type() && w.is_contiguous() && w.size(0) == x.size(1),
        "weight must be a [d] of x's dtype");
}

// fn.template operator()<T>() with T the storage type of ``t`` (float or at::BFloat16).
template <typename Fn>
auto dispatch(const at::Tensor& t, Fn&& fn) {
  if (t.scalar_type() == at::kBFloat16) return fn(at::BFloat16{});
  return fn(float{});
}

// Rows are spread over threads only when there are enough of them to pay for the fork.
constexpr int64_t kRowGrain = 16;

}  // namespace

namespace pagedkv_cpu {

at::Tensor rms_norm(at::Tensor x, at::Tensor w, double eps) {
  check_rows(x, w);
  auto out = at::empty({x.size(0), x.size(1)}, x.options());
  dispatch(x, [&](auto zero) {
    using T = decltype(zero);
    const int64_t d = x.size(1), xs = x.stride(0);
    const T* xp = x.data_ptr<T>();
    const T* wp = w.data_ptr<T>();
    T* op = out.data_ptr<T>();
    at::parallel_for(0, x.size(0), kRowGrain, [&](int64_t b, int64_t e) {
      const pagedkv_cpu::FlushDenormals ftz;
      for (int64_t r = b; r < e; ++r) norm_row(xp + r * xs, wp, op + r * d, d, static_cast<float>(eps));
    });
  });
  return out;
}

at::Tensor add_rms_norm(at::Tensor x, at::Tensor a, at::Tensor w, double eps) {
  check_rows(x, w);
  check(x.is_contiguous(), "x must be contiguous (it is updated in place)");
  check(a.dim() == 2 && a.scalar_type() == x.scalar_type() && a.stride(1) == 1 && a.size(0) == x.size(0) &&
        a.size(1) == x.size(1), "a must be a tensor of x's shape and dtype");
  auto out = at::empty_like(x);
  dispatch(x, [&](auto zero) {
    using T = decltype(zero);
    using io = Io<T>;
    const int64_t d = x.size(1), as = a.stride(0);
    T* xp = x.data_ptr<T>();
    const T* ap = a.data_ptr<T>();
    const T* wp = w.data_ptr<T>();
    T* op = out.data_ptr<T>();
    at::parallel_for(0, x.size(0), kRowGrain, [&](int64_t b, int64_t e) {
      const pagedkv_cpu::FlushDenormals ftz;
      for (int64_t r = b; r < e; ++r) {
        T* xr = xp + r * d;
        const T* ar = ap + r * as;
#pragma omp simd
        for (int64_t i = 0; i < d; ++i) io::store(xr, i, io::load(xr, i) + io::load(ar, i));
        norm_row(xr, wp, op + r * d, d, static_cast<float>(eps));
      }
    });
  });
  return out;
}

// Row r of x [rows, heads, dim] (dim contiguous, any row/head strides) rotated by cos/sin [rows, dim] into out
// [heads, dim] (contiguous heads). NOTE: no fused multiply-add here: each product rounded, then the sum, as
// torch's q * cos + rotate_half(q) * sin, so that pages hold the same bits whichever path wrote them.
#pragma GCC push_options
#pragma GCC optimize("fp-contract=off")
template <typename T>
inline void rotate(const T* x, int64_t row_stride, int64_t head_stride, int64_t heads, const T* cos,
                   const T* sin, int64_t dim, int64_t r, T* out) {
  using io = Io<T>;
  const int64_t half = dim / 2;
  const T* c = cos + r * dim;
  const T* s = sin + r * dim;
  for (int64_t h = 0; h < heads; ++h) {
    const T* p = x + r * row_stride + h * head_stride;
    T* o = out + h * dim;
#pragma omp simd
    for (int64_t i = 0; i < half; ++i) {
      const float lo = io::load(p, i), hi = io::load(p, i + half);
      io::store(o, i, io::round(lo * io::load(c, i)) + io::round((-hi) * io::load(s, i)));
      io::store(o, i + half, io::round(hi * io::load(c, i + half)) + io::round(lo * io::load(s, i + half)));
    }
  }
}
#pragma GCC pop_options

at::Tensor rotary_write(at::Tensor q, at::Tensor k, at::Tensor v, at::Tensor cos, at::Tensor sin,
                        at::Tensor k_cache, at::Tensor v_cache, at::Tensor slot_pages, at::Tensor slot_offsets) {
  check(supported(q.scalar_type()), "q must be float32 or bfloat16");
  for (const auto* t : {&q, &k, &v})
    check(t->dim() == 3 && t->scalar_type() == q.scalar_type() && t->stride(2) == 1, "q, k, v must be "
          "[rows, heads, dim] of one dtype with dim contiguous");
  const int64_t n = q.size(0), dim = q.size(2);
  check(k.size(0) == n && v.size(0) == n && k.size(2) == dim && v.size(2) == dim && dim % 2 == 0,
        "q, k, v shapes disagree");
  check(cos.scalar_type() == q.scalar_type() && sin.scalar_type() == q.scalar_type() && cos.is_contiguous() &&
        sin.is_contiguous() && cos.numel() == n * dim && sin.numel() == n * dim, "cos/sin must be [rows, dim]");
  check(k_cache.dim() == 4 && v_cache.dim() == 4 && k_cache.scalar_type() == q.scalar_type() &&
        v_cache.scalar_type() == q.scalar_type() && k_cache.stride(3) == 1 && v_cache.stride(3) == 1 &&
        k_cache.stride(2) == dim && v_cache.stride(2) == dim && k_cache.size(2) == k.size(1) &&
        v_cache.size(2) == v.size(1) && k_cache.size(3) == dim, "caches must be [pages, block, kv_heads, dim] of q's dtype");
  check(slot_pages.scalar_type() == at::kLong && slot_offsets.scalar_type() == at::kLong &&
        slot_pages.is_contiguous() && slot_offsets.is_contiguous() && slot_pages.numel() == n &&
        slot_offsets.numel() == n, "slots must be int64 [rows]");
  const int64_t heads = q.size(1), kv_heads = k.size(1);
  const int64_t num_pages = std::min(k_cache.size(0), v_cache.size(0)), block = k_cache.size(1);
  auto q_out = at::empty({n, heads, dim}, q.options());
  const int64_t* pages = slot_pages.data_ptr<int64_t>();
  const int64_t* offsets = slot_offsets.data_ptr<int64_t>();
  for (int64_t r = 0; r < n; ++r)  // (checked before any write: a bad slot changes nothing)
    TORCH_CHECK(pages[r] >= 0 && pages[r] < num_pages && offsets[r] >= 0 && offsets[r] < block,
                "pagedkv_cpu ops: slot (", pages[r], ", ", offsets[r], ") outside the pool of ", num_pages,
                " pages of ", block);
  dispatch(q, [&](auto zero) {
    using T = decltype(zero);
    const T* qp = q.data_ptr<T>();
    const T* kp = k.data_ptr<T>();
    const T* vp = v.data_ptr<T>();
    const T* cp = cos.data_ptr<T>();
    const T* sp = sin.data_ptr<T>();
    T* qo = q_out.data_ptr<T>();
    T* kc = k_cache.data_ptr<T>();
    T* vc = v_cache.data_ptr<T>();
    at::parallel_for(0, n, kRowGrain, [&](int64_t b, int64_t e) {
      const pagedkv_cpu::FlushDenormals ftz;
      for (int64_t r = b; r < e; ++r) {
        rotate(qp, q.stride(0), q.stride(1), heads, cp, sp, dim, r, qo + r * heads * dim);
        rotate(kp, k.stride(0), k.stride(1), kv_heads, cp, sp, dim, r,
               kc + pages[r] * k_cache.stride(0) + offsets[r] * k_cache.stride(1));
        T* vd = vc + pages[r] * v_cache.stride(0) + offsets[r] * v_cache.stride(1);
        for (int64_t h = 0; h < kv_heads; ++h)
          std::memcpy(vd + h * dim, vp + r * v.stride(0) + h * v.stride(1), dim * sizeof(T));
      }
    });
  });
  return q_out;
}

at::Tensor silu_mul(at::Tensor gate_up) {
  check(gate_up.dim() == 2 && supported(gate_up.scalar_type()) && gate_up.stride(1) == 1 &&
        gate_up.size(1) % 2 == 0, "gate_up must be a float32 or bfloat16 [rows, 2 x intermediate]");
  const int64_t n = gate_up.size(0), d = gate_up.size(1) / 2, gs = gate_up.stride(0);
  auto out = at::empty({n, d}, gate_up.options());
  dispatch(gate_up, [&](auto zero) {
    using T = decltype(zero);
    const T* gp = gate_up.data_ptr<T>();
    T* op = out.data_ptr<T>();
    at::parallel_for(0, n, kRowGrain, [&](int64_t b, int64_t e) {
      const pagedkv_cpu::FlushDenormals ftz;
      for (int64_t r = b; r < e; ++r) {
        const T* g = gp + r * gs;
        silu_mul_row(g, g + d, op + r * d, d);
      }
    });
  });
  return out;
}

}  // namespace pagedkv_cpu

namespace {

// Structured outputs (executor_svc/grammar_mask.py): dst[rows[i]] = src[rows[i]] with every token that row i of
// ``bitmask`` refuses at -inf (xgrammar's packing: token t allowed when bit t % 32 of word t // 32 is set); the
// other rows of dst untouched. One pass over each constrained row; a word of 32 allowed tokens is copied whole.
// src may be dst. Returns uint8 [R]: 1 where no allowed token of the row is above -inf.
at::Tensor grammar_mask(at::Tensor src, at::Tensor dst, at::Tensor rows, at::Tensor bitmask) {
  check(src.dim() == 2 && src.scalar_type() == at::kFloat && src.stride(1) == 1, "src must be float32 [B, V]");
  check(dst.sizes() == src.sizes() && dst.scalar_type() == at::kFloat && dst.stride(1) == 1,
        "dst must be float32 [B, V] like src");
  check(rows.dim() == 1 && rows.scalar_type() == at::kLong, "rows must be int64 [R]");
  check(bitmask.dim() == 2 && bitmask.scalar_type() == at::kInt && bitmask.is_contiguous() &&
        bitmask.size(0) == rows.size(0), "bitmask must be contiguous int32 [R, words]");
  const int64_t n = rows.size(0), vocab = src.size(1), words = bitmask.size(1);
  check(words * 32 >= vocab, "bitmask has fewer bits than the vocabulary");
  auto empty = at::zeros({n}, at::kByte);
  const int64_t* rp = rows.data_ptr<int64_t>();
  for (int64_t i = 0; i < n; ++i) check(rp[i] >= 0 && rp[i] < src.size(0), "row out of range");
  const uint32_t* bp = reinterpret_cast<const uint32_t*>(bitmask.data_ptr<int32_t>());
  uint8_t* ep = empty.data_ptr<uint8_t>();
  const float ninf = -std::numeric_limits<float>::infinity();
  at::parallel_for(0, n, 1, [&](int64_t b, int64_t e) {
    for (int64_t i = b; i < e; ++i) {
      const float* s = src.data_ptr<float>() + rp[i] * src.stride(0);
      float* d = dst.data_ptr<float>() + rp[i] * dst.stride(0);
      const uint32_t* bits = bp + i * words;
      bool any = false;
      for (int64_t w = 0; w * 32 < vocab; ++w) {
        const int64_t lo = w * 32, hi = std::min<int64_t>(lo + 32, vocab);
        const uint32_t m = bits[w];
        if (m == 0) {
          for (int64_t t = lo; t < hi; ++t) d[t] = ninf;
        } else if (m == 0xffffffffu) {
          for (int64_t t = lo; t < hi; ++t) {
            d[t] = s[t];
            any |= s[t] > ninf;
          }
        } else {
          for (int64_t t = lo; t < hi; ++t) {
            const bool ok = (m >> (t - lo)) & 1u;
            const float v = ok ? s[t] : ninf;
            d[t] = v;
            any |= v > ninf;
          }
        }
      }
      ep[i] = any ? 0 : 1;
    }
  });
  return empty;
}

}  // namespace

TORCH_LIBRARY_FRAGMENT(pagedkv_cpu, m) {
  m.def("rms_norm(Tensor x, Tensor weight, float eps) -> Tensor");
  m.def("add_rms_norm(Tensor(a!) x, Tensor a, Tensor weight, float eps) -> Tensor");
  m.def("rotary_write(Tensor q, Tensor k, Tensor v, Tensor cos, Tensor sin, Tensor(a!) k_cache, "
        "Tensor(b!) v_cache, Tensor slot_pages, Tensor slot_offsets) -> Tensor");
  m.def("silu_mul(Tensor gate_up) -> Tensor");
  m.def("grammar_mask(Tensor src, Tensor(a!) dst, Tensor rows, Tensor bitmask) -> Tensor");
}

TORCH_LIBRARY_IMPL(pagedkv_cpu, CPU, m) {
  m.impl("rms_norm", &pagedkv_cpu::rms_norm);
  m.impl("add_rms_norm", &pagedkv_cpu::add_rms_norm);
  m.impl("rotary_write", &pagedkv_cpu::rotary_write);
  m.impl("silu_mul", &pagedkv_cpu::silu_mul);
  m.impl("grammar_mask", &grammar_mask);
}
