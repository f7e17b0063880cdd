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
//
// 4-bit weights (AWQ/GPTQ, executor_svc/model/quant.py) go through the same product: w = (q - zero) x scale, each
// weight dequantized to float32 exactly as Int4Weight.dequantize does (the integer difference, then one rounded
// product by the fp16 scale), then the same FMA chain over k. So a 4-bit linear's result is bit for bit
// linear_f32's over the dequantized weights, whatever the number of rows. Few rows (<= 8) dequantize in registers
// as they go (the weights are read once, 4 bits each); more dequantize a panel into a buffer once per block of
// rows, then run the float32 block. Packed per panel of 32 columns, k-major: byte j of input k holds column j
// (low nibble) and column j + 16 (high); zeros int8 and scales fp16 per (panel, group, column).
//
//   linear_int4(x [M, K], packed [P, K, 16] uint8, zeros [P, G, 32] int8, scales [P, G, 32] fp16, N, b?) -> [M, N]

#include <ATen/ATen.h>
#include <ATen/Parallel.h>
#include <torch/library.h>

#include <algorithm>
#include <cstdint>
#include <vector>

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
// R rows' accumulators (columns 0-15 in lo, 16-31 in hi) + bias (after the chain), stored to y's first `cols` columns.
template <int R>
__attribute__((always_inline)) inline void store_rows(__m512* lo, __m512* hi, const float* bias, float* y, int64_t ldy,
                                                      int64_t cols) {
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
  store_rows<R>(lo, hi, bias, y, ldy, cols);
}

template <int R>
inline void tail(int64_t left, const float* x, int64_t lda, const float* panel, int64_t k_len, const float* bias,
                 float* y, int64_t ldy, int64_t cols) {
  if constexpr (R > 0) {
    if (left == R) return rows_panel<R>(x, lda, panel, k_len, bias, y, ldy, cols);
    tail<R - 1>(left, x, lda, panel, k_len, bias, y, ldy, cols);
  }
}

// One group's zero points and scales of a panel, as float-ready vectors (columns 0-15, 16-31).
struct GroupQuant {
  __m512i z0, z1;
  __m512 s0, s1;
  GroupQuant(const int8_t* zeros, const uint16_t* scales) {
    z0 = _mm512_cvtepi8_epi32(_mm_loadu_si128(reinterpret_cast<const __m128i*>(zeros)));
    z1 = _mm512_cvtepi8_epi32(_mm_loadu_si128(reinterpret_cast<const __m128i*>(zeros + 16)));
    s0 = _mm512_cvtph_ps(_mm256_loadu_si256(reinterpret_cast<const __m256i*>(scales)));
    s1 = _mm512_cvtph_ps(_mm256_loadu_si256(reinterpret_cast<const __m256i*>(scales + 16)));
  }
  // Input k's 32 weights (16 bytes) dequantized: (q - zero) as float, times the scale (rounded, no FMA).
  __attribute__((always_inline)) inline void weights(const uint8_t* bytes, __m512& w0, __m512& w1) const {
    const __m512i b = _mm512_cvtepu8_epi32(_mm_loadu_si128(reinterpret_cast<const __m128i*>(bytes)));
    const __m512i lo = _mm512_sub_epi32(_mm512_and_si512(b, _mm512_set1_epi32(0xF)), z0);
    const __m512i hi = _mm512_sub_epi32(_mm512_srli_epi32(b, 4), z1);
    w0 = _mm512_mul_ps(_mm512_cvtepi32_ps(lo), s0);
    w1 = _mm512_mul_ps(_mm512_cvtepi32_ps(hi), s1);
  }
};

// A panel of 4-bit weights dequantized into float32 [K][32] (the layout rows_panel reads).
inline void dequantize_panel(const uint8_t* packed, const int8_t* zeros, const uint16_t* scales, int64_t k_len,
                             int64_t group, float* out) {
  for (int64_t k0 = 0, g = 0; k0 < k_len; k0 += group, ++g) {
    const GroupQuant gq(zeros + g * kPanel, scales + g * kPanel);
    const int64_t k1 = std::min(k_len, k0 + group);
    for (int64_t k = k0; k < k1; ++k) {
      __m512 w0, w1;
      gq.weights(packed + k * (kPanel / 2), w0, w1);
      _mm512_storeu_ps(out + k * kPanel, w0);
      _mm512_storeu_ps(out + k * kPanel + 16, w1);
    }
  }
}

// Rows [0, R) of x against one 4-bit panel, dequantizing each input's weights in registers: the arithmetic of
// rows_panel over dequantize_panel's weights (the same products and FMAs, in the same order).
template <int R>
inline void int4_rows_panel(const float* x, int64_t lda, const uint8_t* packed, const int8_t* zeros,
                            const uint16_t* scales, int64_t k_len, int64_t group, const float* bias, float* y,
                            int64_t ldy, int64_t cols) {
  __m512 lo[R], hi[R];
  for (int i = 0; i < R; ++i) {
    lo[i] = _mm512_setzero_ps();
    hi[i] = _mm512_setzero_ps();
  }
  for (int64_t k0 = 0, g = 0; k0 < k_len; k0 += group, ++g) {
    const GroupQuant gq(zeros + g * kPanel, scales + g * kPanel);
    const int64_t k1 = std::min(k_len, k0 + group);
    for (int64_t k = k0; k < k1; ++k) {
      _mm_prefetch(reinterpret_cast<const char*>(packed + (k + 16) * (kPanel / 2)), _MM_HINT_T0);
      __m512 w0, w1;
      gq.weights(packed + k * (kPanel / 2), w0, w1);
      for (int i = 0; i < R; ++i) {
        const __m512 a = _mm512_set1_ps(x[i * lda + k]);
        lo[i] = _mm512_fmadd_ps(a, w0, lo[i]);
        hi[i] = _mm512_fmadd_ps(a, w1, hi[i]);
      }
    }
  }
  store_rows<R>(lo, hi, bias, y, ldy, cols);
}
#endif

constexpr int64_t kInt4DirectRows = 8;  // up to this many rows dequantize in registers; more, into a buffer

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

at::Tensor linear_int4(at::Tensor x, at::Tensor packed, at::Tensor zeros, at::Tensor scales, int64_t n,
                       c10::optional<at::Tensor> bias) {
  check(linear_f32_available(), "this build has no AVX-512 kernel");
  check(x.dim() == 2 && x.scalar_type() == at::kFloat, "x must be float32 [M, K]");
  const int64_t k = x.size(1);
  check(packed.dim() == 3 && packed.scalar_type() == at::kByte && packed.is_contiguous() &&
        packed.size(2) == kPanel / 2 && packed.size(1) == k && packed.size(0) * kPanel >= n &&
        (packed.size(0) - 1) * kPanel < n, "packed must be uint8 [ceil(N / 32), K, 16] for this N and K");
  check(zeros.dim() == 3 && zeros.scalar_type() == at::kChar && zeros.is_contiguous() &&
        zeros.size(0) == packed.size(0) && zeros.size(2) == kPanel && zeros.size(1) > 0 && k % zeros.size(1) == 0,
        "zeros must be int8 [panels, groups, 32], K a whole number of groups");
  check(scales.sizes() == zeros.sizes() && scales.scalar_type() == at::kHalf && scales.is_contiguous(),
        "scales must be float16 like zeros");
  const bool has_bias = bias.has_value() && bias->defined();
  if (has_bias) {
    check(bias->dim() == 1 && bias->size(0) == n && bias->scalar_type() == at::kFloat && bias->is_contiguous(),
          "bias must be contiguous float32 [N]");
  }
  auto xc = x.contiguous();
  const int64_t m = xc.size(0), panels = packed.size(0), groups = zeros.size(1), group = k / groups;
  auto y = at::empty({m, n}, xc.options());
  if (m == 0) return y;
#if defined(__AVX512F__)
  const float* xp = xc.data_ptr<float>();
  const uint8_t* wp = packed.data_ptr<uint8_t>();
  const int8_t* zp = zeros.data_ptr<int8_t>();
  const uint16_t* sp = reinterpret_cast<const uint16_t*>(scales.data_ptr<at::Half>());
  const float* bp = has_bias ? bias->data_ptr<float>() : nullptr;
  float* yp = y.data_ptr<float>();
  at::parallel_for(0, panels, 1, [&](int64_t p0, int64_t p1) {
    const pagedkv_cpu::FlushDenormals ftz;
    std::vector<float> buffer(m > kInt4DirectRows ? k * kPanel : 0);
    for (int64_t r0 = 0; r0 < m; r0 += kRowBlock) {
      const int64_t r1 = std::min(m, r0 + kRowBlock);
      for (int64_t p = p0; p < p1; ++p) {
        const uint8_t* panel = wp + p * k * (kPanel / 2);
        const int8_t* pz = zp + p * groups * kPanel;
        const uint16_t* ps = sp + p * groups * kPanel;
        const int64_t col = p * kPanel, cols = std::min(kPanel, n - col);
        const float* b = bp == nullptr ? nullptr : bp + col;
        float* out = yp + r0 * n + col;
        const float* xr = xp + r0 * k;
        switch (m <= kInt4DirectRows ? m : 0) {
          case 1: int4_rows_panel<1>(xr, k, panel, pz, ps, k, group, b, out, n, cols); continue;
          case 2: int4_rows_panel<2>(xr, k, panel, pz, ps, k, group, b, out, n, cols); continue;
          case 3: int4_rows_panel<3>(xr, k, panel, pz, ps, k, group, b, out, n, cols); continue;
          case 4: int4_rows_panel<4>(xr, k, panel, pz, ps, k, group, b, out, n, cols); continue;
          case 5: int4_rows_panel<5>(xr, k, panel, pz, ps, k, group, b, out, n, cols); continue;
          case 6: int4_rows_panel<6>(xr, k, panel, pz, ps, k, group, b, out, n, cols); continue;
          case 7: int4_rows_panel<7>(xr, k, panel, pz, ps, k, group, b, out, n, cols); continue;
          case 8: int4_rows_panel<8>(xr, k, panel, pz, ps, k, group, b, out, n, cols); continue;
          default: break;
        }
        dequantize_panel(panel, pz, ps, k, group, buffer.data());
        int64_t r = r0;
        for (; r + 8 <= r1; r += 8) rows_panel<8>(xp + r * k, k, buffer.data(), k, b, yp + r * n + col, n, cols);
        tail<7>(r1 - r, xp + r * k, k, buffer.data(), k, b, yp + r * n + col, n, cols);
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
  m.def("linear_int4(Tensor x, Tensor packed, Tensor zeros, Tensor scales, int n, Tensor? bias) -> Tensor");
}

TORCH_LIBRARY_IMPL(pagedkv_cpu, CPU, m) {
  m.impl("pack_linear_f32", &pack_linear_f32);
  m.impl("linear_f32", &pagedkv_cpu::linear_f32);
  m.impl("linear_int4", &pagedkv_cpu::linear_int4);
}
