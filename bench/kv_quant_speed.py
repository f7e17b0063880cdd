"""kv_quant.py parts 4 and 5: decode speed per KV dtype, on the CPU through the whole model (``Harness``), and on the
GPU for one layer's paged decode attention through the torch backend."""

from __future__ import annotations

import time
from pathlib import Path
from types import SimpleNamespace

import torch
from kv_quant_harness import KV_DTYPES, Harness

from executor_svc.attention.metadata import AttentionMetadata, DecodeGroup
from executor_svc.attention.torch_backend import TorchPagedAttention
from executor_svc.kv_quant import parse_kv_dtype
from executor_svc.model import load_model
from executor_svc.model_config import ModelConfig
from executor_svc.pages import DevicePagePool


# ---- 4. CPU decode throughput ----------------------------------------------------------------------------
def decode_speed(model_dir: Path, batch: int, ctx: int, steps: int, kv_dtypes: tuple[str, ...] = KV_DTYPES) -> dict:
    cfg = ModelConfig.from_dir(model_dir)
    model = load_model(cfg, torch.device("cpu"), torch.float32)
    per_seq = -(-(ctx + steps) // 16)
    tables = [list(range(i * per_seq, (i + 1) * per_seq)) for i in range(batch)]
    out = {}
    for name in kv_dtypes:
        h = Harness(model, cfg, name, batch * per_seq)
        g = torch.Generator().manual_seed(0)
        for t in tables:  # fill the context (not timed)
            h.prefill(torch.randint(3, 259, (ctx,), generator=g).tolist(), 0, t)
        best = float("inf")
        for _ in range(2):
            lens = [ctx + 1] * batch
            t0 = time.perf_counter()
            for _ in range(steps):
                h.decode([5] * batch, lens, tables)
                lens = [c + 1 for c in lens]
            best = min(best, time.perf_counter() - t0)
        out[name] = dict(tokens_per_s=batch * steps / best, ms_per_step=1000 * best / steps)
    return out


# ---- 5. GPU: the torch backend's decode attention over 8-bit pages (the CUDA kernels do not read them yet) ----
def attention_decode(device: str, batch: int = 64, ctx: int = 4096, heads: int = 32, kv_heads: int = 8,
                     dim: int = 128, repeats: int = 5) -> dict:
    """One layer's paged decode (torch backend: gather + dequantize + SDPA), fp16 model, per KV dtype:
    time per call and the pool bytes it reads (data and scales of the visible pages) per second."""
    dev = torch.device(device)
    block = 16
    n_pages = -(-ctx // block)
    cfg = SimpleNamespace(num_layers=1, num_kv_heads=kv_heads, head_dim=dim)
    attn = TorchPagedAttention(heads, kv_heads, dim, dim ** -0.5)
    tables = torch.arange(batch * n_pages, device=dev).view(batch, n_pages)
    q = torch.randn(batch, heads, dim, device=dev, dtype=torch.float16)
    out = {}
    for name in ("float16", "fp8_e4m3", "int8"):
        pool = DevicePagePool(cfg, batch * n_pages, block, torch.float16, dev, parse_kv_dtype(name, torch.float16))
        kc, vc = pool.layer(0)
        g = torch.Generator(device=dev).manual_seed(0)
        x = torch.randn(batch * n_pages * block, kv_heads, dim, device=dev, generator=g, dtype=torch.float16)
        slots = torch.arange(x.shape[0], device=dev)
        meta = AttentionMetadata(slots // block, slots % block, [], [])
        attn.write_cache(kc, vc, x, x, meta)
        group = DecodeGroup(torch.arange(batch, device=dev), tables, torch.full((batch,), ctx, device=dev))
        meta = AttentionMetadata(slots[:batch], slots[:batch], [group], [])

        attn.forward(q, kc, vc, meta)  # warm-up
        best = float("inf")
        for _ in range(repeats):
            if dev.type == "cuda":
                torch.cuda.synchronize()
            t0 = time.perf_counter()
            attn.forward(q, kc, vc, meta)
            if dev.type == "cuda":
                torch.cuda.synchronize()
            best = min(best, time.perf_counter() - t0)
        read = batch * n_pages * pool.page_bytes
        out[name] = dict(ms=best * 1e3, gb_per_s=read / best / 1e9, tokens_per_s=batch / best, pool_bytes_read=read)
    base = out["float16"]["tokens_per_s"]
    for r in out.values():
        r["vs_fp16"] = r["tokens_per_s"] / base
    return out
