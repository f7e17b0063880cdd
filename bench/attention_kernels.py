"""Paged decode attention on a GPU: the CUDA kernel against the memory system and against dense attention.

For each case (batch x context; 32 query heads / 8 KV heads x 128, fp16, block 16, by default):

* ``paged``: ``paged_decode`` (+ its split-K reduce) over a random page table (pages scattered over a
  2-layer pool, so K/V views are strided across pages as in the executor);
* ``contiguous``: the same kernel over a page table whose pages are in order (one contiguous run per request);
* ``sdpa``: torch's ``scaled_dot_product_attention`` (flash where available) on the equivalent contiguous
  K/V [B, kv_heads, L, D], the query group as rows of its KV head (the same arithmetic);
* ``copy``: one large device-to-device copy in the same run; its bandwidth counts bytes read + written.

Effective bandwidth = bytes of K and V read / time. Targets (docs/design.md): paged >= 85% of the copy bandwidth,
paged <= 1.02x contiguous time. Times: CUDA events around ``--iters`` back-to-back launches after
``--warmup``, median of ``--repeats`` such blocks, launches prepared once (Python checks excluded).
The kernel output is checked against SDPA before timing.

    python bench/attention_kernels.py                  # all cases -> bench/results/attention_kernels.json
    python bench/attention_kernels.py --cases 64x4096  # one case
"""

from __future__ import annotations

import argparse
import statistics
import sys
from pathlib import Path
from typing import Any

import torch

ROOT = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(ROOT))

from common import write_report  # noqa: E402

COPY_TARGET = 0.85
CONTIGUOUS_TARGET = 1.02
MAX_REL_ERR = 1e-2  # fp16/bf16 against SDPA on the same inputs
DEFAULT_CASES = ("64x4096", "1x32768", "256x1024")


def parse_args(argv: list[str] | None = None) -> argparse.Namespace:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--cases", nargs="+", default=list(DEFAULT_CASES), help="BATCHxCONTEXT ...")
    p.add_argument("--heads", type=int, default=32)
    p.add_argument("--kv-heads", type=int, default=8)
    p.add_argument("--head-dim", type=int, default=128, choices=[64, 128])
    p.add_argument("--block-size", type=int, default=16, choices=[8, 16, 32])
    p.add_argument("--dtype", default="float16", choices=["float16", "bfloat16"])
    p.add_argument("--kv-cache-dtype", default="auto", choices=["auto", "fp8_e4m3", "int8"],
                   help="8-bit pages (executor_svc.kv_quant): paged_decode_q8; bandwidth counts the bytes read "
                   "(data and scales); SDPA runs on the dequantized K/V")
    p.add_argument("--partition-tokens", type=int, default=512)
    p.add_argument("--warmup", type=int, default=5)
    p.add_argument("--iters", type=int, default=20, help="launches per timed block")
    p.add_argument("--repeats", type=int, default=7, help="timed blocks; the median is reported")
    p.add_argument("--copy-gib", type=float, default=4.0, help="size of the reference device copy")
    p.add_argument("--out", type=Path, default=ROOT / "bench" / "results" / "attention_kernels.json")
    return p.parse_args(argv)


def time_ms(fn, warmup: int, iters: int, repeats: int) -> float:
    """Median over ``repeats`` of (CUDA-event time of ``iters`` back-to-back calls) / iters, in ms."""
    for _ in range(warmup):
        fn()
    torch.cuda.synchronize()
    times = []
    for _ in range(repeats):
        start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
        start.record()
        for _ in range(iters):
            fn()
        end.record()
        end.synchronize()
        times.append(start.elapsed_time(end) / iters)
    return statistics.median(times)


def copy_bandwidth(gib: float, args: argparse.Namespace) -> dict[str, float]:
    n = int(gib * (1 << 30))
    buffers = [torch.randint(0, 255, (n,), dtype=torch.uint8, device="cuda")]
    buffers.append(torch.empty_like(buffers[0]))
    ms = time_ms(lambda: buffers[1].copy_(buffers[0]), args.warmup, max(1, args.iters // 4), args.repeats)
    buffers.clear()
    return {"bytes": n, "ms": ms, "gb_per_s": 2 * n / ms / 1e6}  # read + write


def run_case(batch: int, ctx: int, args: argparse.Namespace, copy_gbps: float) -> dict[str, Any]:
    import torch.nn.functional as F

    from executor_svc.attention.cuda_backend import CudaPagedAttention
    from executor_svc.attention.metadata import DecodeGroup

    dtype = getattr(torch, args.dtype)
    bs, hkv, hq, d = args.block_size, args.kv_heads, args.heads, args.head_dim
    pages_per_req = -(-ctx // bs)
    num_pages = batch * pages_per_req
    g = torch.Generator(device="cuda").manual_seed(batch * 100003 + ctx)
    if args.kv_cache_dtype == "auto":
        pool = torch.randn((num_pages, 2, 2, bs, hkv, d), generator=g, device="cuda").to(dtype)
        k_cache, v_cache = pool[:, 0, 0], pool[:, 0, 1]
        read_per_token = 2 * hkv * d * pool.element_size()
    else:  # an 8-bit pool, filled through the torch reference's quantizing write
        from types import SimpleNamespace

        from executor_svc.attention.metadata import AttentionMetadata
        from executor_svc.attention.torch_backend import TorchPagedAttention
        from executor_svc.kv_quant import parse_kv_dtype
        from executor_svc.pages import DevicePagePool

        qpool = DevicePagePool(SimpleNamespace(num_layers=1, num_kv_heads=hkv, head_dim=d), num_pages, bs, dtype,
                               torch.device("cuda"), parse_kv_dtype(args.kv_cache_dtype, dtype))
        k_cache, v_cache = qpool.layer(0)
        writer = TorchPagedAttention(hq, hkv, d, d ** -0.5)
        for start in range(0, num_pages * bs, 1 << 20):
            part = torch.arange(start, min(start + (1 << 20), num_pages * bs), device="cuda")
            kv = torch.randn((2, part.numel(), hkv, d), generator=g, device="cuda").to(dtype)
            writer.write_cache(k_cache, v_cache, kv[0], kv[1], AttentionMetadata(part // bs, part % bs, [], []))
        read_per_token = qpool.page_bytes / bs  # data and scales
    q = torch.randn((batch, hq, d), generator=g, device="cuda").to(dtype)
    ctx_lens = torch.full((batch,), ctx, device="cuda")
    token_idx = torch.arange(batch, device="cuda")
    in_order = torch.arange(num_pages, device="cuda").view(batch, pages_per_req)
    scattered = torch.randperm(num_pages, generator=g, device="cuda").view(batch, pages_per_req)
    attn = CudaPagedAttention(hq, hkv, d, d ** -0.5, partition_tokens=args.partition_tokens)
    out = torch.empty_like(q)

    def prepared(table: torch.Tensor):
        return attn.prepare_decode(q, out, k_cache, v_cache, DecodeGroup(token_idx, table, ctx_lens), None)

    # dense K/V in request order for SDPA: [B, kv_heads, L, D], contiguous
    def dense(cache, table: torch.Tensor) -> torch.Tensor:
        quantized = not isinstance(cache, torch.Tensor)  # an 8-bit view: dequantized rows
        rows = cache.gather(table.reshape(-1), dtype) if quantized else cache[table.reshape(-1)]
        return rows.view(batch, -1, hkv, d)[:, :ctx].transpose(1, 2).contiguous()

    k_dense, v_dense = dense(k_cache, scattered), dense(v_cache, scattered)
    q_rows = q.view(batch, hkv, hq // hkv, d)

    def sdpa() -> torch.Tensor:
        return F.scaled_dot_product_attention(q_rows, k_dense, v_dense, scale=d ** -0.5)

    paged = prepared(scattered)
    paged()
    ref = sdpa().reshape(batch, hq, d).float()
    err = ((out.float() - ref).abs().max() / ref.abs().max()).item()
    contiguous = prepared(in_order)
    times = {name: time_ms(fn, args.warmup, args.iters, args.repeats)
             for name, fn in (("paged", paged), ("contiguous", contiguous), ("sdpa", sdpa))}
    kv_bytes = int(batch * ctx * read_per_token)
    gbps = {name: kv_bytes / ms / 1e6 for name, ms in times.items()}
    # cache write: one layer's K/V of a prefill chunk of 8192 tokens into scattered slots (8-bit: quantized)
    from executor_svc.attention.metadata import AttentionMetadata

    n_new = min(8192, num_pages * bs)
    slots = torch.randperm(num_pages * bs, generator=g, device="cuda")[:n_new].sort().values
    new_kv = torch.randn((2, n_new, hkv, d), generator=g, device="cuda").to(dtype)
    write_meta = AttentionMetadata(slots // bs, slots % bs, [], [])
    write_ms = time_ms(lambda: attn.write_cache(k_cache, v_cache, new_kv[0], new_kv[1], write_meta), args.warmup,
                       args.iters, args.repeats)
    write_bytes = n_new * (read_per_token + 2 * hkv * d * new_kv.element_size())  # pool bytes written + input read
    parts = attn.num_partitions(DecodeGroup(token_idx, scattered, ctx_lens), bs, None)
    return {"batch": batch, "context": ctx, "kv_dtype": args.kv_cache_dtype, "kv_bytes": kv_bytes,
            "tokens_per_s": batch / times["paged"] * 1e3, "partitions": parts, "max_rel_err_vs_sdpa": err,
            "ms": times, "gb_per_s": gbps, "paged_share_of_copy": gbps["paged"] / copy_gbps,
            "paged_over_contiguous": times["paged"] / times["contiguous"],
            "paged_over_sdpa": times["paged"] / times["sdpa"],
            "write": {"tokens": n_new, "ms": write_ms, "gb_per_s": write_bytes / write_ms / 1e6,
                      "tokens_per_s": n_new / write_ms * 1e3}}


def print_table(device: str, copy: dict[str, float], rows: list[dict[str, Any]]) -> None:
    print(f"\npaged decode attention on {device}; device copy {copy['gb_per_s']:.0f} GB/s (read + write)")
    header = ("case", "parts", "paged ms", "GB/s", "% copy", "contig ms", "paged/contig", "sdpa ms", "paged/sdpa",
              "err")
    print(" | ".join(header))
    for r in rows:
        print(" | ".join([
            f"{r['batch']}x{r['context']}", str(r["partitions"]), f"{r['ms']['paged']:.3f}",
            f"{r['gb_per_s']['paged']:.0f}", f"{r['paged_share_of_copy']:.1%}", f"{r['ms']['contiguous']:.3f}",
            f"{r['paged_over_contiguous']:.3f}", f"{r['ms']['sdpa']:.3f}", f"{r['paged_over_sdpa']:.2f}",
            f"{r['max_rel_err_vs_sdpa']:.1e}"]))
    print(f"targets: paged >= {COPY_TARGET:.0%} of copy, paged/contig <= {CONTIGUOUS_TARGET}")


def main(argv: list[str] | None = None) -> int:
    args = parse_args(argv)
    if not torch.cuda.is_available():
        print("attention_kernels: needs a CUDA device (and CuPy); nothing to measure here", file=sys.stderr)
        return 2
    from kernels_cuda.loader import cupy_import_error

    if (err := cupy_import_error()) is not None:
        print(f"attention_kernels: CuPy is not importable ({err})", file=sys.stderr)
        return 2
    cases = []
    for c in args.cases:
        b, _, l_ = c.partition("x")
        cases.append((int(b), int(l_)))
    device = torch.cuda.get_device_name()
    copy = copy_bandwidth(args.copy_gib, args)
    rows = []
    for batch, ctx in cases:
        rows.append(run_case(batch, ctx, args, copy["gb_per_s"]))
        torch.cuda.empty_cache()
        r = rows[-1]
        print(f"{batch}x{ctx}: paged {r['ms']['paged']:.3f} ms ({r['gb_per_s']['paged']:.0f} GB/s, "
              f"{r['paged_share_of_copy']:.1%} of copy), contiguous {r['ms']['contiguous']:.3f} ms, "
              f"sdpa {r['ms']['sdpa']:.3f} ms", flush=True)
    print_table(device, copy, rows)
    main_case = next((r for r in rows if (r["batch"], r["context"]) == (64, 4096)), rows[0])
    report = {"device": device, "torch": torch.__version__, "config": vars(args) | {"out": str(args.out)},
              "copy": copy, "cases": rows,
              "targets": {"share_of_copy": COPY_TARGET, "paged_over_contiguous": CONTIGUOUS_TARGET},
              "targets_met": {"share_of_copy": main_case["paged_share_of_copy"] >= COPY_TARGET,
                              "paged_over_contiguous": main_case["paged_over_contiguous"] <= CONTIGUOUS_TARGET}}
    write_report(args.out, report)
    wrong = [f"{r['batch']}x{r['context']}: {r['max_rel_err_vs_sdpa']:.2e}" for r in rows
             if not r["max_rel_err_vs_sdpa"] <= MAX_REL_ERR]
    if wrong:  # a fast wrong kernel is no result
        print(f"ERROR: paged decode differs from SDPA by more than {MAX_REL_ERR:g} (max |diff| / max |ref|): "
              + ", ".join(wrong), file=sys.stderr)
        return 1
    return 0


if __name__ == "__main__":
    sys.exit(main())
