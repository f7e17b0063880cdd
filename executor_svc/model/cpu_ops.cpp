// Fused decoder-layer ops for float32 models on the CPU: each replaces a run of small torch ops (and their
// dispatch, one tensor each) with one pass over its rows. Built into the same library as the paged attention
// kernel (executor_svc/attention/cpu_kernel.py), as torch.ops.pagedkv_cpu.*; executor_svc/model/llama.py uses
// them for float32 models on the CPU and keeps its torch ops everywhere else (and as the reference).
//
// The arithmetic is transformers' (LlamaRMSNorm, rotate_half rotary, SiLU) in float32, with its sums in
// another order: results agree to a few ulp.
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

namespace {

void check(bool ok, const char* what) { TORCH_CHECK(ok, "pagedkv_cpu ops: ", what); }

// silu(g) * u over one row of d.
inline void silu_mul_row(const float* g, const float* u, float* o, int64_t d) {
#pragma omp simd
  for (int64_t i = 0; i < d; ++i) o[i] = g[i] / (1.f + pagedkv_cpu::exp_clamped(-g[i])) * u[i];
}

// One row: w * (x * rsqrt(mean(x^2) + eps)).
inline void norm_row(const float* x, const float* w, float* out, int64_t d, float eps) {
  float sum = 0.f;
#pragma omp simd reduction(+ : sum)
  for (int64_t i = 0; i < d; ++i) sum += x[i] * x[i];
  const float r = 1.f / std::sqrt(sum / static_cast<float>(d) + eps);
#pragma omp simd
  for (int64_t i = 0; i < d; ++i) out[i] = w[i] * (x[i] * r);
}

void check_rows(const at::Tensor& x, const at::Tensor& w) {
  check(x.dim() == 2 && x.scalar_type() == at::kFloat && x.stride(1) == 1, "x must be a float32 [rows, d]");
  check(w.dim() == 1 && w.scalar_type() == at::kFloat && w.is_contiguous() && w.size(0) == x.size(1),
        "weight must be a float32 [d]");
}

// Rows are spread over threads only when there are enough of them to pay for the fork.
constexpr int64_t kRowGrain = 16;

at::Tensor rms_norm(at::Tensor x, at::Tensor w, double eps) {
  check_rows(x, w);
  auto out = at::empty({x.size(0), x.size(1)}, x.options());
  const int64_t d = x.size(1), xs = x.stride(0);
  const float* xp = x.data_ptr<float>();
  const float* wp = w.data_ptr<float>();
  float* op = out.data_ptr<float>();
  at::parallel_for(0, x.size(0), kRowGrain, [&](int64_t b, int64_t e) {
    const pagedkv_cpu::FlushDenormals ftz;
    for (int64_t r = b; r < e; ++r) norm_row(xp + r * xs, wp, op + r * d, d, static_cast<float>(eps));
  });
  return out;
}

at::Tensor add_rms_norm(at::Tensor x, at::Tensor a, at::Tensor w, double eps) {
  check_rows(x, w);
  check(x.is_contiguous(), "x must be contiguous (it is updated in place)");
  check(a.dim() == 2 && a.scalar_type() == at::kFloat && a.stride(1) == 1 && a.size(0) == x.size(0) &&
        a.size(1) == x.size(1), "a must be a float32 tensor of x's shape");
  auto out = at::empty_like(x);
  const int64_t d = x.size(1), as = a.stride(0);
  float* xp = x.data_ptr<float>();
  const float* ap = a.data_ptr<float>();
  const float* wp = w.data_ptr<float>();
  float* op = out.data_ptr<float>();
  at::parallel_for(0, x.size(0), kRowGrain, [&](int64_t b, int64_t e) {
    const pagedkv_cpu::FlushDenormals ftz;
    for (int64_t r = b; r < e; ++r) {
      float* xr = xp + r * d;
      const float* ar = ap + r * as;
#pragma omp simd
      for (int64_t i = 0; i < d; ++i) xr[i] += ar[i];
      norm_row(xr, wp, op + r * d, d, static_cast<float>(eps));
    }
  });
  return out;
}

// Row r of x [rows, heads, dim] (dim contiguous, any row/head strides) rotated by cos/sin [rows, dim] into out
// [heads, dim] (contiguous heads). NOTE: no fused multiply-add here: each product rounded, then the sum, as
// torch's q * cos + rotate_half(q) * sin, so that pages hold the same bits whichever path wrote them.
#pragma GCC push_options
#pragma GCC optimize("fp-contract=off")
inline void rotate(const float* x, int64_t row_stride, int64_t head_stride, int64_t heads, const float* cos,
                   const float* sin, int64_t dim, int64_t r, float* out) {
  const int64_t half = dim / 2;
  const float* c = cos + r * dim;
  const float* s = sin + r * dim;
  for (int64_t h = 0; h < heads; ++h) {
    const float* p = x + r * row_stride + h * head_stride;
    float* o = out + h * dim;
#pragma omp simd
    for (int64_t i = 0; i < half; ++i) {
      const float lo = p[i], hi = p[i + half];
      o[i] = lo * c[i] + (-hi) * s[i];
      o[i + half] = hi * c[i + half] + lo * s[i + half];
    }
  }
}
#pragma GCC pop_options

at::Tensor rotary_write(at::Tensor q, at::Tensor k, at::Tensor v, at::Tensor cos, at::Tensor sin,
                        at::Tensor k_cache, at::Tensor v_cache, at::Tensor slot_pages, at::Tensor slot_offsets) {
  for (const auto* t : {&q, &k, &v})
    check(t->dim() == 3 && t->scalar_type() == at::kFloat && t->stride(2) == 1, "q, k, v must be float32 "
          "[rows, heads, dim] with dim contiguous");
  const int64_t n = q.size(0), dim = q.size(2);
  check(k.size(0) == n && v.size(0) == n && k.size(2) == dim && v.size(2) == dim && dim % 2 == 0,
        "q, k, v shapes disagree");
  check(cos.scalar_type() == at::kFloat && sin.scalar_type() == at::kFloat && cos.is_contiguous() &&
        sin.is_contiguous() && cos.numel() == n * dim && sin.numel() == n * dim, "cos/sin must be [rows, dim]");
  check(k_cache.dim() == 4 && v_cache.dim() == 4 && k_cache.scalar_type() == at::kFloat &&
        v_cache.scalar_type() == at::kFloat && k_cache.stride(3) == 1 && v_cache.stride(3) == 1 &&
        k_cache.stride(2) == dim && v_cache.stride(2) == dim && k_cache.size(2) == k.size(1) &&
        v_cache.size(2) == v.size(1) && k_cache.size(3) == dim, "caches must be float32 [pages, block, kv_heads, dim]");
  check(slot_pages.scalar_type() == at::kLong && slot_offsets.scalar_type() == at::kLong &&
        slot_pages.is_contiguous() && slot_offsets.is_contiguous() && slot_pages.numel() == n &&
        slot_offsets.numel() == n, "slots must be int64 [rows]");
  const int64_t heads = q.size(1), kv_heads = k.size(1);
  const int64_t num_pages = std::min(k_cache.size(0), v_cache.size(0)), block = k_cache.size(1);
  auto q_out = at::empty({n, heads, dim}, q.options());
  const float* qp = q.data_ptr<float>();
  const float* kp = k.data_ptr<float>();
  const float* vp = v.data_ptr<float>();
  const float* cp = cos.data_ptr<float>();
  const float* sp = sin.data_ptr<float>();
  float* qo = q_out.data_ptr<float>();
  float* kc = k_cache.data_ptr<float>();
  float* vc = v_cache.data_ptr<float>();
  const int64_t* pages = slot_pages.data_ptr<int64_t>();
  const int64_t* offsets = slot_offsets.data_ptr<int64_t>();
  for (int64_t r = 0; r < n; ++r)  // (checked before any write: a bad slot changes nothing)
    TORCH_CHECK(pages[r] >= 0 && pages[r] < num_pages && offsets[r] >= 0 && offsets[r] < block,
                "pagedkv_cpu ops: slot (", pages[r], ", ", offsets[r], ") outside the pool of ", num_pages,
                " pages of ", block);
  at::parallel_for(0, n, kRowGrain, [&](int64_t b, int64_t e) {
    const pagedkv_cpu::FlushDenormals ftz;
    for (int64_t r = b; r < e; ++r) {
      rotate(qp, q.stride(0), q.stride(1), heads, cp, sp, dim, r, qo + r * heads * dim);
      rotate(kp, k.stride(0), k.stride(1), kv_heads, cp, sp, dim, r,
             kc + pages[r] * k_cache.stride(0) + offsets[r] * k_cache.stride(1));
      float* vd = vc + pages[r] * v_cache.stride(0) + offsets[r] * v_cache.stride(1);
      for (int64_t h = 0; h < kv_heads; ++h)
        std::memcpy(vd + h * dim, vp + r * v.stride(0) + h * v.stride(1), dim * sizeof(float));
    }
  });
  return q_out;
}

at::Tensor silu_mul(at::Tensor gate_up) {
  check(gate_up.dim() == 2 && gate_up.scalar_type() == at::kFloat && gate_up.stride(1) == 1 &&
        gate_up.size(1) % 2 == 0, "gate_up must be a float32 [rows, 2 x intermediate]");
  const int64_t n = gate_up.size(0), d = gate_up.size(1) / 2, gs = gate_up.stride(0);
  auto out = at::empty({n, d}, gate_up.options());
  const float* gp = gate_up.data_ptr<float>();
  float* op = out.data_ptr<float>();
  at::parallel_for(0, n, kRowGrain, [&](int64_t b, int64_t e) {
    const pagedkv_cpu::FlushDenormals ftz;
    for (int64_t r = b; r < e; ++r) {
      const float* g = gp + r * gs;
      silu_mul_row(g, g + d, op + r * d, d);
    }
  });
  return out;
}

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
  m.impl("rms_norm", &rms_norm);
  m.impl("add_rms_norm", &add_rms_norm);
  m.impl("rotary_write", &rotary_write);
  m.impl("silu_mul", &silu_mul);
  m.impl("grammar_mask", &grammar_mask);
}
