// Float32 linears on AVX-512 CPUs: y = x @ W.T (+ b), over a weight packed once at load into panels of 32 output
// columns, each panel k-major ([panels][K][32], zero-padded): one product reads each weight once, in order.
// Built into the CPU kernel library (executor_svc/attention/cpu_kernel.py) as torch.ops.pagedkv_cpu.*; used by
// executor_svc/model/cpu_linear.py.
//
// Every output is one chain of fused multiply-adds over k = 0 .. K-1 from zero (then + b): its bits do not depend
// on the number of rows in the product nor on where its row falls in it, so a request's tokens do not depend on
// what it is batched with (tests/unit/test_cpu_linear.py). The rows are taken 8 at a time against a panel (16
// accumulators: 8 rows x 2 vectors of 16), a thread takes whole panels, and rows come in blocks that stay in L2
// across the thread's panels. On SmolLM2's shapes, two Zen 4 cores (bench/linear_f32.py; bench/NOTES.md, session
// 17): 1-8 rows read the weights at ~31 GB/s where oneDNN's product read them at 19-26, 32 rows compute 189
// GFLOP/s (oneDNN 164), 512-2,048 rows ~219 (oneDNN ~221).
//
//   linear_f32_available()               whether this build has the kernel (AVX-512F at compile time)
//   pack_linear_f32(W [N, K])            -> [ceil(N / 32), K, 32]
//   linear_f32(x [M, K], packed, N, b?)  -> [M, N]

#include <ATen/ATen.h>
#include <ATen/Parallel.h>
#include <torch/library.h>

#include <algorithm>
#include <cstdint>

#include "cpu_math.h"
#include "cpu_ops.h"

#if defined(__AVX512F__)
#include <immintrin.h>
#endif

namespace {

constexpr int64_t kPanel = 32;    // output columns a panel: two vectors of 16
constexpr int64_t kRowBlock = 192;  // rows a block: 192 x K floats stay in L2 across a thread's panels

void check(bool ok, const char* what) { TORCH_CHECK(ok, "pagedkv_cpu linear_f32: ", what); }

}  // namespace

namespace pagedkv_cpu {

bool linear_f32_available() {
#if defined(__AVX512F__)
  return true;
#else
  return false;
#endif
}

}  // namespace pagedkv_cpu

namespace {

at::Tensor pack_linear_f32(at::Tensor w) {
  check(w.dim() == 2 && w.scalar_type() == at::kFloat, "weight must be float32 [N, K]");
  const int64_t n = w.size(0), k = w.size(1), panels = (n + kPanel - 1) / kPanel;
  auto padded = at::zeros({panels * kPanel, k}, w.options());
  padded.narrow(0, 0, n).copy_(w);
  return padded.view({panels, kPanel, k}).transpose(1, 2).contiguous();
}

#if defined(__AVX512F__)
// Rows [0, R) of x (stride lda) against one panel (K x 32) into y (stride ldy), its first `cols` columns.
template <int R>
inline void rows_panel(const float* x, int64_t lda, const float* panel, int64_t k_len, const float* bias, float* y,
                       int64_t ldy, int64_t cols) {
  __m512 lo[R], hi[R];
  for (int i = 0; i < R; ++i) {
    lo[i] = _mm512_setzero_ps();
    hi[i] = _mm512_setzero_ps();
  }
  for (int64_t k = 0; k < k_len; ++k) {
    const float* p = panel + k * kPanel;
    _mm_prefetch(reinterpret_cast<const char*>(p + 8 * kPanel), _MM_HINT_T0);
    _mm_prefetch(reinterpret_cast<const char*>(p + 8 * kPanel + 16), _MM_HINT_T0);
    const __m512 w0 = _mm512_loadu_ps(p), w1 = _mm512_loadu_ps(p + 16);
    for (int i = 0; i < R; ++i) {
      const __m512 a = _mm512_set1_ps(x[i * lda + k]);
      lo[i] = _mm512_fmadd_ps(a, w0, lo[i]);
      hi[i] = _mm512_fmadd_ps(a, w1, hi[i]);
    }
  }
  const __mmask16 m0 = cols >= 16 ? 0xFFFF : static_cast<__mmask16>((1u << cols) - 1);
  const __mmask16 m1 = cols >= 32 ? 0xFFFF : cols <= 16 ? 0 : static_cast<__mmask16>((1u << (cols - 16)) - 1);
  if (bias != nullptr) {
    const __m512 b0 = _mm512_maskz_loadu_ps(m0, bias), b1 = _mm512_maskz_loadu_ps(m1, bias + 16);
    for (int i = 0; i < R; ++i) {
      lo[i] = _mm512_add_ps(lo[i], b0);
      hi[i] = _mm512_add_ps(hi[i], b1);
    }
  }
  for (int i = 0; i < R; ++i) {
    _mm512_mask_storeu_ps(y + i * ldy, m0, lo[i]);
    _mm512_mask_storeu_ps(y + i * ldy + 16, m1, hi[i]);
  }
}

template <int R>
inline void tail(int64_t left, const float* x, int64_t lda, const float* panel, int64_t k_len, const float* bias,
                 float* y, int64_t ldy, int64_t cols) {
  if constexpr (R > 0) {
    if (left == R) return rows_panel<R>(x, lda, panel, k_len, bias, y, ldy, cols);
    tail<R - 1>(left, x, lda, panel, k_len, bias, y, ldy, cols);
  }
}
#endif

}  // namespace

namespace pagedkv_cpu {

at::Tensor linear_f32(at::Tensor x, at::Tensor packed, int64_t n, c10::optional<at::Tensor> bias) {
  check(linear_f32_available(), "this build has no AVX-512 kernel");
  check(x.dim() == 2 && x.scalar_type() == at::kFloat, "x must be float32 [M, K]");
  check(packed.dim() == 3 && packed.scalar_type() == at::kFloat && packed.is_contiguous() &&
        packed.size(2) == kPanel && packed.size(1) == x.size(1) && packed.size(0) * kPanel >= n &&
        (packed.size(0) - 1) * kPanel < n, "packed must be pack_linear_f32's [ceil(N / 32), K, 32] for this N and K");
  const bool has_bias = bias.has_value() && bias->defined();
  if (has_bias) {
    check(bias->dim() == 1 && bias->size(0) == n && bias->scalar_type() == at::kFloat && bias->is_contiguous(),
          "bias must be contiguous float32 [N]");
  }
  auto xc = x.contiguous();
  const int64_t m = xc.size(0), k = xc.size(1), panels = packed.size(0);
  auto y = at::empty({m, n}, xc.options());
  if (m == 0) return y;
#if defined(__AVX512F__)
  const float* xp = xc.data_ptr<float>();
  const float* wp = packed.data_ptr<float>();
  const float* bp = has_bias ? bias->data_ptr<float>() : nullptr;
  float* yp = y.data_ptr<float>();
  at::parallel_for(0, panels, 1, [&](int64_t p0, int64_t p1) {
    const pagedkv_cpu::FlushDenormals ftz;
    for (int64_t r0 = 0; r0 < m; r0 += kRowBlock) {
      const int64_t r1 = std::min(m, r0 + kRowBlock);
      for (int64_t p = p0; p < p1; ++p) {
        const float* panel = wp + p * k * kPanel;
        const int64_t col = p * kPanel, cols = std::min(kPanel, n - col);
        const float* b = bp == nullptr ? nullptr : bp + col;
        int64_t r = r0;
        for (; r + 8 <= r1; r += 8) rows_panel<8>(xp + r * k, k, panel, k, b, yp + r * n + col, n, cols);
        tail<7>(r1 - r, xp + r * k, k, panel, k, b, yp + r * n + col, n, cols);
      }
    }
  });
#endif
  return y;
}

}  // namespace pagedkv_cpu

TORCH_LIBRARY_FRAGMENT(pagedkv_cpu, m) {
  m.def("linear_f32_available() -> bool", &pagedkv_cpu::linear_f32_available);  // (no tensor to dispatch on)
  m.def("pack_linear_f32(Tensor weight) -> Tensor");
  m.def("linear_f32(Tensor x, Tensor packed, int n, Tensor? bias) -> Tensor");
}

TORCH_LIBRARY_IMPL(pagedkv_cpu, CPU, m) {
  m.impl("pack_linear_f32", &pack_linear_f32);
  m.impl("linear_f32", &pagedkv_cpu::linear_f32);
}
