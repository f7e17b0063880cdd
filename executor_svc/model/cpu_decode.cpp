// A decode step's decoder layers in one call, for float32 Llama-style models on the CPU (executor_svc/model/llama.py
// decides when it applies: every linear through our float32 or 4-bit product or torch's int4 matmul, SiLU MLPs,
// one rotary table, no per-layer windows, q/k norms or score soft-capping; a decode-only step in one group, read in
// place; its shared prefix, if any, attended by paged_attention_cascade).
//
// It runs the same ops in the same order as llama.py's fused Python loop (LlamaModel._forward_fused), calling
// them as C++ functions (cpu_ops.h) and ATen's, instead of through Python: each row's bits are the loop's
// (tests/unit/test_decode_layers.py compares the two). What it saves is the Python and dispatch around them, ~50-130
// us a layer (SmolLM2: ~985 ops dispatched a float32 step, ~2,400 a 4-bit one; bench/NOTES.md, session 18).
//
//   decode_layers(x, weights, k_caches, v_caches, tables, q_pos, shared_pages, cos, sin, slot_pages, slot_offsets,
//                 num_heads, num_kv_heads, intermediate_size, model_window, eps, scale)
//     x [rows, hidden] float32: the embedded tokens, the residual stream after the last layer on return (in place)
//     weights: kPerLayer a layer: the input norm, the post-attention norm, then four linears (qkv, o, gate_up, down)
//              of kPerLinear each: (weight, aux, aux2, perm, bias), a tensor with no element standing for none:
//                float32 weight: pack_linear_f32's panels (aux, aux2, perm none)
//                uint8 weight with int8 aux: our 4-bit product's panels (linear_int4), aux its zeros, aux2 its
//                float16 scales
//                any other: torch's int4 "tinygemm" pack for the CPU (_weight_int4pack_mm_for_cpu), aux its
//                [groups, N, 2] scale and offset table in the dtype the product runs in
//              perm: an int32 order of the inputs (desc_act) or none; rows go in as Int4Linear (quant.py) sends them
//     k_caches / v_caches: one [pages, block, kv_heads, head_dim] a layer; the step's K/V are written into them
//     shared_pages: the pages every row's table begins with, attended as a cascade (torch_backend.py: the loop's
//                   paged_attention_cascade), or none (paged_attention alone)
//     the rest as paged_attention (one query a row, row i using table row i) and rotary_write take them

#include <ATen/ATen.h>
#include <torch/library.h>

#include <cstdint>

#include "cpu_ops.h"

namespace {

constexpr int64_t kPerLinear = 5;
constexpr int64_t kPerLayer = 2 + 4 * kPerLinear;

void check(bool ok, const char* what) { TORCH_CHECK(ok, "pagedkv_cpu decode_layers: ", what); }

inline c10::optional<at::Tensor> bias_of(const at::Tensor& b) {
  return b.numel() ? c10::optional<at::Tensor>(b) : c10::nullopt;
}

// One linear (kPerLinear tensors at l) over x [rows, K] -> [rows, n], as llama.py calls it: PackedLinear (our float32
// product) or Int4Linear (inputs reordered; our 4-bit product, or torch's: cast to its dtype, the result cast back,
// + bias).
at::Tensor linear(const at::Tensor* l, const at::Tensor& x, int64_t n) {
  if (l[0].scalar_type() == at::kFloat) return pagedkv_cpu::linear_f32(x, l[0], n, bias_of(l[4]));
  const at::Tensor xi = l[3].numel() ? x.index_select(1, l[3]) : x;
  if (l[1].scalar_type() == at::kChar) return pagedkv_cpu::linear_int4(xi, l[0], l[1], l[2], n, bias_of(l[4]));
  const at::Tensor& table = l[1];
  check(table.dim() == 3 && table.size(1) == n && table.size(2) == 2, "an int4 linear's table must be [groups, N, 2]");
  at::Tensor y = at::_weight_int4pack_mm_for_cpu(xi.to(table.scalar_type()).contiguous(), l[0],
                                                 x.size(1) / table.size(0), table).to(at::kFloat);
  return l[4].numel() ? y + l[4] : y;
}

}  // namespace

namespace pagedkv_cpu {

void decode_layers(at::Tensor x, at::TensorList weights, at::TensorList k_caches, at::TensorList v_caches,
                   at::Tensor tables, at::Tensor q_pos, at::Tensor shared_pages, at::Tensor cos, at::Tensor sin, at::Tensor slot_pages,
                   at::Tensor slot_offsets, int64_t num_heads, int64_t num_kv_heads, int64_t intermediate_size,
                   int64_t model_window, double eps, double scale) {
  const int64_t layers = static_cast<int64_t>(k_caches.size());
  check(layers > 0 && static_cast<int64_t>(v_caches.size()) == layers &&
        static_cast<int64_t>(weights.size()) == kPerLayer * layers,
        "weights must hold 22 tensors a layer, and k_caches / v_caches one a layer");
  check(x.dim() == 2 && x.scalar_type() == at::kFloat && x.is_contiguous(), "x must be contiguous float32 [rows, hidden]");
  check(num_heads > 0 && num_kv_heads > 0 && k_caches[0].dim() == 4, "heads, or caches not [pages, block, kv_heads, dim]");
  const int64_t n = x.size(0), hidden = x.size(1), dim = k_caches[0].size(3);
  const int64_t q_size = num_heads * dim, kv_size = num_kv_heads * dim;
  const at::Tensor none = at::empty({0}, q_pos.options());
  const int64_t shared = shared_pages.numel() * k_caches[0].size(1);  // keys before each row's own
  check(shared == 0 || model_window == 0, "a shared prefix is attended without a model-wide window");
  at::Tensor h = rms_norm(x, weights[0], eps);
  for (int64_t i = 0; i < layers; ++i) {
    const at::Tensor* w = weights.data() + i * kPerLayer;
    const at::Tensor* qkv_w = w + 2;  // then o, gate_up, down: kPerLinear tensors each
    const at::Tensor qkv = linear(qkv_w, h, q_size + 2 * kv_size);
    const at::Tensor q = qkv.narrow(1, 0, q_size).view({n, num_heads, dim});
    const at::Tensor k = qkv.narrow(1, q_size, kv_size).view({n, num_kv_heads, dim});
    const at::Tensor v = qkv.narrow(1, q_size + kv_size, kv_size).view({n, num_kv_heads, dim});
    const at::Tensor qr = rotary_write(q, k, v, cos, sin, k_caches[i], v_caches[i], slot_pages, slot_offsets);
    at::Tensor a;
    if (shared_pages.numel()) {
      a = paged_attention_cascade(qr, k_caches[i], v_caches[i], tables, q_pos, shared_pages, scale);
    } else {
      a = paged_attention(qr, k_caches[i], v_caches[i], tables, none, q_pos, none, none, model_window, scale);
    }
    const at::Tensor o = linear(qkv_w + kPerLinear, a.view({n, q_size}), hidden);
    h = add_rms_norm(x, o, w[1], eps);  // x += o
    const at::Tensor gate_up = linear(qkv_w + 2 * kPerLinear, h, 2 * intermediate_size);
    const at::Tensor m = linear(qkv_w + 3 * kPerLinear, silu_mul(gate_up), hidden);
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
        "Tensor q_pos, Tensor shared_pages, Tensor cos, Tensor sin, Tensor slot_pages, Tensor slot_offsets, int num_heads, "
        "int num_kv_heads, int intermediate_size, int model_window, float eps, float scale) -> ()");
}

TORCH_LIBRARY_IMPL(pagedkv_cpu, CPU, m) { m.impl("decode_layers", &pagedkv_cpu::decode_layers); }
