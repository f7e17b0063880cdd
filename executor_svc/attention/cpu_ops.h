// The CPU kernel library's ops as C++ functions (namespace pagedkv_cpu), for its sources to call one another
// without the dispatcher: executor_svc/model/cpu_decode.cpp runs a decode step's layers with them. Each is also
// registered as torch.ops.pagedkv_cpu.<name>, with the contract its own source states.
#pragma once

#include <ATen/ATen.h>
#include <c10/util/Optional.h>

#include <cstdint>
#include <tuple>
#include <vector>

namespace pagedkv_cpu {

// executor_svc/attention/paged_attention_cpu.cpp
at::Tensor paged_attention(at::Tensor q, at::Tensor k_cache, at::Tensor v_cache, at::Tensor tables, at::Tensor q_rows,
                           at::Tensor q_pos, at::Tensor sinks, at::Tensor windows, int64_t model_window, double scale);
at::Tensor paged_attention_after(at::Tensor q, at::Tensor k_cache, at::Tensor v_cache, at::Tensor tables,
                                 at::Tensor q_pos, int64_t start, at::Tensor prior_out, at::Tensor prior_lse,
                                 double scale);
std::vector<int64_t> paged_attention_shared_dims();
bool paged_attention_shared_available(const at::Tensor& q);
std::tuple<at::Tensor, at::Tensor> paged_attention_shared(at::Tensor q, at::Tensor k_cache, at::Tensor v_cache,
                                                          at::Tensor pages, double scale);
at::Tensor paged_attention_cascade(at::Tensor q, at::Tensor k_cache, at::Tensor v_cache, at::Tensor tables,
                                   at::Tensor q_pos, at::Tensor pages, double scale);

// executor_svc/model/cpu_ops.cpp
at::Tensor rms_norm(at::Tensor x, at::Tensor w, double eps);
at::Tensor add_rms_norm(at::Tensor x, at::Tensor a, at::Tensor w, double eps);
at::Tensor rotary_write(at::Tensor q, at::Tensor k, at::Tensor v, at::Tensor cos, at::Tensor sin, at::Tensor k_cache,
                        at::Tensor v_cache, at::Tensor slot_pages, at::Tensor slot_offsets);
at::Tensor silu_mul(at::Tensor gate_up);

// executor_svc/model/cpu_gemm.cpp
bool linear_f32_available();
at::Tensor linear_f32(at::Tensor x, at::Tensor packed, int64_t n, c10::optional<at::Tensor> bias);
at::Tensor linear_int4(at::Tensor x, at::Tensor packed, at::Tensor zeros, at::Tensor scales, int64_t n,
                       c10::optional<at::Tensor> bias);

}  // namespace pagedkv_cpu
