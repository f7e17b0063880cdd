"""Page DMA for swap.py (CUDA): scattered pages through the executor's own pools and mover, out to the host tier
and back, against one contiguous pinned copy of the same bytes."""

from __future__ import annotations

import statistics
import time
from pathlib import Path
from typing import Any

import torch

DMA_TARGET = 0.9


# ---- page DMA (CUDA) ----------------------------------------------------------------------------
def dma_model_config(num_layers: int = 32, num_kv_heads: int = 8, head_dim: int = 128) -> Any:
    """A Llama-8B-like shape for the page pools (only the KV geometry matters here)."""
    from executor_svc.model_config import ModelConfig

    return ModelConfig(path=Path("<synthetic>"), architecture="LlamaForCausalLM", hf_config=None, vocab_size=32000,
                       hidden_size=4096, intermediate_size=14336, num_layers=num_layers, num_heads=32,
                       num_kv_heads=num_kv_heads, head_dim=head_dim, rms_norm_eps=1e-5,
                       max_position_embeddings=8192, tie_word_embeddings=False, attention_bias=False,
                       sliding_window=None, eos_token_ids=(2,))


def page_dma(device: str | torch.device = "cuda", num_pages: int = 512, num_layers: int = 32, num_kv_heads: int = 8,
             head_dim: int = 128, block_size: int = 16, dtype: torch.dtype = torch.float16,
             repeats: int = 5) -> dict[str, Any]:
    """Page DMA through the executor's ``DevicePagePool`` / ``HostPagePool`` / ``PageMover``: ``num_pages``
    scattered pages (host ids in reverse order, so no two copies merge into a run) out to the host and back,
    against one contiguous copy of the same bytes between the same (pinned, on CUDA) buffers. Median of
    ``repeats`` timed runs after a warm-up; the round trip is checked to preserve every page's contents."""
    from executor_svc.pages import DevicePagePool, HostPagePool, PageMover

    dev = torch.device(device)
    cfg = dma_model_config(num_layers, num_kv_heads, head_dim)
    pool = DevicePagePool(cfg, num_pages, block_size, dtype, dev)
    host = HostPagePool(pool, num_pages)
    mover = PageMover(pool, host)
    ids = list(range(num_pages))
    pairs_out = list(zip(ids, ids[::-1], strict=True))  # device i -> host n-1-i
    pairs_in = [(h, d) for d, h in pairs_out]
    nbytes = num_pages * pool.page_bytes
    dflat, hflat = pool.pages.view(-1), host.pages.view(-1)

    def sync() -> None:
        mover.synchronize()
        if dev.type == "cuda":
            torch.cuda.synchronize(dev)

    def timed(fn) -> dict[str, float]:
        fn()  # warm-up
        sync()
        times = []
        for _ in range(repeats):
            t0 = time.perf_counter()
            fn()
            sync()
            times.append(time.perf_counter() - t0)
        med = statistics.median(times)
        return {"median_s": med, "best_s": min(times), "gb_per_s": nbytes / med / 1e9,
                "best_gb_per_s": nbytes / min(times) / 1e9, "pages_per_s": num_pages / med}

    # correctness: the round trip through the host tier brings every page back to its own slot
    pool.pages.copy_(torch.randn(pool.pages.shape, dtype=torch.float32).to(dtype))
    reference = pool.pages.clone()
    mover.run(pairs_out, [])
    pool.pages.zero_()
    mover.run([], pairs_in)
    sync()
    round_trip_ok = bool(torch.equal(pool.pages, reference))
    del reference

    non_blocking = dev.type == "cuda"
    res = {
        "paged_out": timed(lambda: mover.run(pairs_out, [])),
        "paged_in": timed(lambda: mover.run([], pairs_in)),
        "contiguous_out": timed(lambda: hflat.copy_(dflat, non_blocking=non_blocking)),
        "contiguous_in": timed(lambda: dflat.copy_(hflat, non_blocking=non_blocking)),
    }
    ratio_out = res["paged_out"]["gb_per_s"] / res["contiguous_out"]["gb_per_s"]
    ratio_in = res["paged_in"]["gb_per_s"] / res["contiguous_in"]["gb_per_s"]
    out = {"device": str(dev), "num_pages": num_pages, "page_bytes": pool.page_bytes, "bytes": nbytes,
           "dtype": str(dtype).removeprefix("torch."), "shape": list(pool.pages.shape[1:]),
           "host_pinned": bool(host.pages.is_pinned()) if dev.type == "cuda" else False,
           "round_trip_ok": round_trip_ok, "repeats": repeats, **res,
           "ratio_out": ratio_out, "ratio_in": ratio_in, "target_ratio": DMA_TARGET,
           "target_met": round_trip_ok and min(ratio_out, ratio_in) >= DMA_TARGET}
    return out


def print_dma(d: dict[str, Any]) -> None:
    mib = d["page_bytes"] / (1 << 20)
    print(f"page DMA ({d['device']}, {d['num_pages']} scattered pages of {mib:.3g} MiB, "
          f"{d['bytes'] / 1e6:,.1f} MB, median of {d['repeats']}):")
    for way, label in (("out", "device -> host"), ("in", "host -> device")):
        print(f"  {label}: paged {d[f'paged_{way}']['gb_per_s']:.2f} GB/s "
              f"({d[f'paged_{way}']['pages_per_s']:,.0f} pages/s), contiguous "
              f"{d[f'contiguous_{way}']['gb_per_s']:.2f} GB/s, ratio {d[f'ratio_{way}']:.2%}")
    print(f"  round trip intact: {d['round_trip_ok']}; target paged >= {DMA_TARGET:.0%} of contiguous: "
          f"{'met' if d['target_met'] else 'NOT met'}")
