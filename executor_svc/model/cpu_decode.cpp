// A decode step's decoder layers in one call, for float32 Llama-style models on the CPU (executor_svc/model/llama.py
// decides when it applies: every linear through our float32 product, SiLU MLPs, one rotary table, no per-layer
// windows, q/k norms or score soft-capping; a decode-only step in one group, read in place, without a cascade).
//
// It runs the same ops in the same order as llama.py's fused Python loop (LlamaModel._forward_fused), calling
// them as C++ functions (cpu_ops.h) instead of through Python and the dispatcher: each row's bits are the loop's
// (tests/unit/test_decode_layers.py compares the two). What it saves is the ~130 us of Python and dispatch a layer
// (SmolLM2 at batch 1: ~985 ops dispatched a step, ~4 ms of a ~27 ms step; bench/NOTES.md, session 18).
//
//   decode_layers(x, weights, k_caches, v_caches, tables, q_pos, cos, sin, slot_pages, slot_offsets,
//                 num_heads, num_kv_heads, model_window, eps, scale)
//     x [rows, hidden] float32: the embedded tokens, the residual stream after the last layer on return (in place)
//     weights: kPerLayer a layer: input norm, qkv (packed), its bias, o, its bias, post-attention norm, gate_up,
//              its bias, down, its bias (a bias with no element: none); packed as pack_linear_f32 packs them
//     k_caches / v_caches: one [pages, block, kv_heads, head_dim] a layer; the step's K/V are written into them
//     the rest as paged_attention (one query a row, row i using table row i) and rotary_write take them

#include <ATen/ATen.h>
#include <torch/library.h>

#include <cstdint>

#include "cpu_ops.h"

namespace {

constexpr int64_t kPerLayer = 10;

void check(bool ok, const char* what) { TORCH_CHECK(ok, "pagedkv_cpu decode_layers: ", what); }

inline c10::optional<at::Tensor> bias_of(const at::Tensor& b) {
  return b.numel() ? c10::optional<at::Tensor>(b) : c10::nullopt;
}

}  // namespace

namespace pagedkv_cpu {

void decode_layers(at::Tensor x, at::TensorList weights, at::TensorList k_caches, at::TensorList v_caches,
                   at::Tensor tables, at::Tensor q_pos, at::Tensor cos, at::Tensor sin, at::Tensor slot_pages,
                   at::Tensor slot_offsets, int64_t num_heads, int64_t num_kv_heads, int64_t model_window, double eps,
                   double scale) {
  const int64_t layers = static_cast<int64_t>(k_caches.size());
  check(layers > 0 && static_cast<int64_t>(v_caches.size()) == layers &&
        static_cast<int64_t>(weights.size()) == kPerLayer * layers,
        "weights must hold 10 tensors a layer, and k_caches / v_caches one a layer");
  check(x.dim() == 2 && x.scalar_type() == at::kFloat && x.is_contiguous(), "x must be contiguous float32 [rows, hidden]");
  check(num_heads > 0 && num_kv_heads > 0 && k_caches[0].dim() == 4, "heads, or caches not [pages, block, kv_heads, dim]");
  const int64_t n = x.size(0), hidden = x.size(1), dim = k_caches[0].size(3);
  const int64_t q_size = num_heads * dim, kv_size = num_kv_heads * dim;
  const at::Tensor none = at::empty({0}, q_pos.options());
  at::Tensor h = rms_norm(x, weights[0], eps);
  for (int64_t i = 0; i < layers; ++i) {
    const at::Tensor* w = weights.data() + i * kPerLayer;
    check(w[8].dim() == 3, "down must be packed [panels, intermediate, 32]");
    const at::Tensor qkv = linear_f32(h, w[1], q_size + 2 * kv_size, bias_of(w[2]));
    const at::Tensor q = qkv.narrow(1, 0, q_size).view({n, num_heads, dim});
    const at::Tensor k = qkv.narrow(1, q_size, kv_size).view({n, num_kv_heads, dim});
    const at::Tensor v = qkv.narrow(1, q_size + kv_size, kv_size).view({n, num_kv_heads, dim});
    const at::Tensor qr = rotary_write(q, k, v, cos, sin, k_caches[i], v_caches[i], slot_pages, slot_offsets);
    const at::Tensor a = paged_attention(qr, k_caches[i], v_caches[i], tables, none, q_pos, none, none, model_window,
                                         scale);
    const at::Tensor o = linear_f32(a.view({n, q_size}), w[3], hidden, bias_of(w[4]));
    h = add_rms_norm(x, o, w[5], eps);  // x += o
    const at::Tensor gate_up = linear_f32(h, w[6], 2 * w[8].size(1), bias_of(w[7]));
    const at::Tensor m = linear_f32(silu_mul(gate_up), w[8], hidden, bias_of(w[9]));
    if (i + 1 < layers) {
      h = add_rms_norm(x, m, weights[(i + 1) * kPerLayer], eps);  // x += m
    } else {
      x.add_(m);
    }
  }
}

}  // namespace pagedkv_cpu

TORCH_LIBRARY_FRAGMENT(pagedkv_cpu, m) {
  m.def("decode_layers(Tensor(a!) x, Tensor[] weights, Tensor(b!)[] k_caches, Tensor(c!)[] v_caches, Tensor tables, "
        "Tensor q_pos, Tensor cos, Tensor sin, Tensor slot_pages, Tensor slot_offsets, int num_heads, "
        "int num_kv_heads, int model_window, float eps, float scale) -> ()");
}

TORCH_LIBRARY_IMPL(pagedkv_cpu, CPU, m) { m.impl("decode_layers", &pagedkv_cpu::decode_layers); }
