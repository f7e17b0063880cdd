"""Decodes over 8-bit pages read in place on the CPU (#50 item 2): ``paged_attention_q8`` in the CPU kernel library
(paged_attention_q8_cpu.cpp) widens each FP8 or INT8 row to float32 in registers and scales it as it is used, so a
step never makes a full-precision copy of the pages, as the gather path does (torch_backend.gather_pages: every
visible page of every layer dequantized into a float32 tensor, then SDPA). Same visible positions, same
dequantized values (the pool's own scales), float32 arithmetic (a 16-bit model's queries widened, its output
rounded back); tests/unit/test_attention_q8_kernel.py holds it to the gather path.

Decodes that share a prompt prefix (``cascade.shared_prefix``: rows whose tables begin with the same pages, wholly
before every query; no windows) attend it as a cascade, as float32 pages do: the prefix's pages dequantized once a
layer and scored for every row and query head at once by the products kernel (``paged_attention_shared``), then
each row's own keys after it read in place (``paged_attention_q8_after``, which also gives its log-sum-exp), the two
softmaxes merged by their log-sum-exps. The prefix is then read once a step instead of once a row: from
``CASCADE_MIN_ROWS`` rows, where that pays (bench/NOTES.md, session 29).

With an exact tail (executor_svc/kv_tail.py) the kernels read the pages that have a slab slot from the slab, in
bfloat16, instead of their 8-bit bytes (``exact_slots``); the cascade's prefix gather does the same."""

from __future__ import annotations

import torch

from executor_svc.attention import cascade, cpu_kernel
from executor_svc.attention.metadata import DecodeGroup
from executor_svc.kv_quant import ChannelScaledCache, QuantizedCache

_EMPTY = torch.empty(0, dtype=torch.long)


MAX_GROUP = 16  # query heads a KV head at most (the kernel's kMaxGroup; MQA models with more gather)
# Decode rows from which a shared prefix goes as a cascade (besides cascade.shared_prefix's own thresholds): below,
# dequantizing the prefix's pages costs more than the rows save (bench/q8_cascade.py, SmolLM2's heads over a
# 1,024-token prefix + 256 own, two runs: FP8 0.88-1.05x at 8 rows, 1.0-1.26x at 12, 1.3-1.4x at 16, 1.6-1.8x from
# 24; INT8 0.70x at 8, 0.88x at 12, 1.07x at 16, 1.27x at 24).
CASCADE_MIN_ROWS = 12
CASCADE_MIN_ROWS_INT8 = 16
MODEL_DTYPES = (torch.float32, torch.bfloat16, torch.float16)


def kernel_for(q: torch.Tensor, k_cache: object, reference: bool = False, heads: int = 0):
    """The kernel library when decodes over these 8-bit pages can be read in place (a model on the CPU, at most
    MAX_GROUP query heads a KV head; ``heads``: the model's, 0 when not known yet), else None. A bfloat16 or float16
    model's queries are widened to float32 for the call and its output rounded back (``decode``)."""
    if reference or not isinstance(k_cache, (QuantizedCache, ChannelScaledCache)):
        return None
    if q.device.type != "cpu" or q.dtype not in MODEL_DTYPES or heads > MAX_GROUP * k_cache.data.shape[2]:
        return None
    kernel = cpu_kernel.load()
    return kernel if kernel is not None and hasattr(kernel, "paged_attention_q8") else None


def decode(kernel, q: torch.Tensor, k_cache: QuantizedCache | ChannelScaledCache, v_cache: QuantizedCache,
           group: DecodeGroup, window: int | None, scale: float) -> torch.Tensor:
    """q [B, heads, D] (the group's rows) -> [B, heads, D] in q's dtype (the kernel's arithmetic is float32)."""
    k_scale = k_cache.exp if isinstance(k_cache, ChannelScaledCache) else k_cache.scale
    fp8, qf = k_cache.data.dtype == torch.float8_e4m3fn, q.float().contiguous()
    exact = () if k_cache.exact_tail is None else (k_cache.exact_tail.data, v_cache.exact_tail.data,
                                                   k_cache.exact_tail.slots)  # (the pages read from the slab)
    if group.shared_pages is None:
        group.shared_pages = cascade.shared_prefix(group, k_cache.data.shape[1], window)
    min_rows = CASCADE_MIN_ROWS_INT8 if isinstance(k_cache, ChannelScaledCache) else CASCADE_MIN_ROWS
    if (group.shared_pages.numel() and q.shape[0] >= min_rows and hasattr(kernel, "paged_attention_q8_after")
            and cascade.shared_in_kernel(kernel, qf)):
        pages = group.shared_pages
        prior, prior_lse = kernel.paged_attention_shared(qf, k_cache.gather(pages, torch.float32),
                                                         v_cache.gather(pages, torch.float32),
                                                         torch.arange(pages.numel()), scale)
        out, lse = kernel.paged_attention_q8_after(qf, k_cache.data.view(torch.uint8), k_scale,
                                                   v_cache.data.view(torch.uint8), v_cache.scale, group.page_tables,
                                                   group.ctx_lens, pages.numel() * k_cache.data.shape[1], fp8, scale,
                                                   *exact)
        out.lerp_(prior, torch.sigmoid(prior_lse - lse).unsqueeze(-1))  # (the prefix's share of each softmax)
    else:
        windows = _EMPTY if group.windows is None else group.windows
        sinks = _EMPTY if group.windows is None else group.sinks
        out = kernel.paged_attention_q8(qf, k_cache.data.view(torch.uint8), k_scale, v_cache.data.view(torch.uint8),
                                        v_cache.scale, group.page_tables, group.ctx_lens, sinks, windows,
                                        window or 0, fp8, scale, *exact)
    return out if q.dtype == torch.float32 else out.to(q.dtype)
