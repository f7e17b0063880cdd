"""Decode attention over 8-bit pages with a shared prompt prefix: the cascade (q8_decode.py: the prefix dequantized
once and scored for every row by the products kernel, each row's own keys in place) against every row reading the
prefix in place itself (paged_attention_q8 alone), and float32 pages' own cascade beside them.

One layer of SmolLM2's attention shape (9 query heads over 3 KV heads, head size 64) by default: ``--rows`` decode
rows over a ``--prefix``-token prefix they share plus ``--own`` tokens each; fresh random K/V written through the
pool's quantizers; medians of ``--reps`` alternated calls. Prints the table and writes bench/results/q8_cascade.json.

    python bench/q8_cascade.py
    python bench/q8_cascade.py --rows 8,32,64 --prefix 1024 --own 256
"""

from __future__ import annotations

import argparse
import statistics
import sys
import time
from pathlib import Path
from types import SimpleNamespace

ROOT = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(ROOT))

from common import print_table, write_report  # noqa: E402

BLOCK = 16


def build(kv: str, model_dtype, rows: int, prefix: int, own: int, heads: int, kv_heads: int, dim: int, seed: int):
    import torch

    from executor_svc.attention.metadata import DecodeGroup
    from executor_svc.kv_quant import parse_kv_dtype
    from executor_svc.pages import DevicePagePool

    g = torch.Generator().manual_seed(seed)
    p_pages, o_pages = prefix // BLOCK, -(-own // BLOCK)
    num_pages = p_pages + rows * o_pages + 1
    cfg = SimpleNamespace(num_layers=1, num_kv_heads=kv_heads, head_dim=dim)
    fmt = None if kv == "float32" else parse_kv_dtype(kv, model_dtype)
    pool = DevicePagePool(cfg, num_pages, BLOCK, model_dtype, torch.device("cpu"), fmt)
    k_cache, v_cache = pool.layer(0)
    tables = torch.zeros(rows, p_pages + o_pages, dtype=torch.long)
    tables[:, :p_pages] = torch.arange(1, p_pages + 1)
    tables[:, p_pages:] = torch.arange(p_pages + 1, num_pages).view(rows, o_pages)
    tokens = [(int(tables[0, t // BLOCK]), t % BLOCK) for t in range(prefix)]
    tokens += [(int(tables[r, p_pages + t // BLOCK]), t % BLOCK) for r in range(rows) for t in range(own)]
    pages = torch.tensor([p for p, _ in tokens])
    offsets = torch.tensor([o for _, o in tokens])
    k = torch.randn(len(tokens), kv_heads, dim, generator=g)
    k[..., :2] *= 8
    v = torch.randn(len(tokens), kv_heads, dim, generator=g)
    if fmt is None:
        k_cache[pages, offsets], v_cache[pages, offsets] = k, v
    else:
        k_cache.write(pages, offsets, k.to(model_dtype))
        v_cache.write(pages, offsets, v.to(model_dtype))
    q = torch.randn(rows, heads, dim, generator=g).to(model_dtype)
    ctx = torch.full((rows,), prefix + own, dtype=torch.long)
    return q, k_cache, v_cache, lambda: DecodeGroup(torch.arange(rows), tables, ctx)


def main() -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--rows", default="8,32,64")
    p.add_argument("--prefix", type=int, default=1024)
    p.add_argument("--own", type=int, default=256)
    p.add_argument("--kv", default="fp8_e4m3,int8")
    p.add_argument("--heads", default="9,3,64", help="query heads, KV heads, head size")
    p.add_argument("--reps", type=int, default=15)
    p.add_argument("--threads", type=int, default=2)
    p.add_argument("--out", default=str(ROOT / "bench" / "results" / "q8_cascade.json"))
    args = p.parse_args()
    import torch

    from executor_svc.attention import cpu_kernel, q8_decode

    torch.set_num_threads(args.threads)
    kernel = cpu_kernel.load()
    if kernel is None or not hasattr(kernel, "paged_attention_q8_after"):
        raise SystemExit("the CPU kernel library (with paged_attention_q8_after) is not built here")
    heads, kv_heads, dim = (int(x) for x in args.heads.split(","))
    table, report = [], {"args": vars(args), "rows": []}
    for rows in (int(r) for r in args.rows.split(",")):
        f32 = float32_cascade(kernel, rows, args, heads, kv_heads, dim)
        for kv in args.kv.split(","):
            plain, cascade, err = q8_times(kernel, q8_decode, kv, rows, args, heads, kv_heads, dim)
            report["rows"].append({"rows": rows, "kv": kv, "plain_ms": plain * 1e3, "cascade_ms": cascade * 1e3,
                                   "speedup": plain / cascade, "float32_cascade_ms": f32 * 1e3, "max_abs_diff": err})
            table.append((str(rows), kv, f"{plain * 1e3:.2f}", f"{cascade * 1e3:.2f}", f"{plain / cascade:.2f}x",
                          f"{f32 * 1e3:.2f}", f"{err:.1e}"))
    print(f"\none layer, {heads}/{kv_heads} heads of {dim}, prefix {args.prefix} + {args.own} own tokens a row, "
          f"{args.threads} threads")
    print_table(("rows", "KV", "in place ms", "cascade ms", "speedup", "float32 cascade ms", "max |diff|"), table)
    write_report(args.out, report)
    return 0


def float32_cascade(kernel, rows: int, args, heads: int, kv_heads: int, dim: int) -> float:
    """Seconds of float32 pages' own cascade (paged_attention_cascade) at the same shape, median."""
    import torch

    q, k, v, group = build("float32", torch.float32, rows, args.prefix, args.own, heads, kv_heads, dim, 0)
    g, shared = group(), torch.arange(1, args.prefix // BLOCK + 1)
    return statistics.median(timed(lambda: kernel.paged_attention_cascade(
        q, k, v, g.page_tables, g.query_positions(), shared, dim ** -0.5), args.reps))


def q8_times(kernel, q8_decode, kv: str, rows: int, args, heads: int, kv_heads: int, dim: int):
    """Seconds without and with the cascade (medians of alternated calls), and their outputs' largest difference."""
    import torch

    q, k_cache, v_cache, group = build(kv, torch.float32, rows, args.prefix, args.own, heads, kv_heads, dim, 1)

    def cascade():
        return q8_decode.decode(kernel, q, k_cache, v_cache, group(), None, dim ** -0.5)

    def plain():
        g = group()
        g.shared_pages = torch.empty(0, dtype=torch.long)  # (no cascade: every row reads the prefix)
        return q8_decode.decode(kernel, q, k_cache, v_cache, g, None, dim ** -0.5)
    err = (cascade() - plain()).abs().max().item()
    times: dict[str, list[float]] = {"cascade": [], "plain": []}
    for rep in range(args.reps):
        for name, fn in (("cascade", cascade), ("plain", plain))[:: 1 if rep % 2 == 0 else -1]:
            times[name] += timed(fn, 1)
    return statistics.median(times["plain"]), statistics.median(times["cascade"]), err


def timed(fn, reps: int) -> list[float]:
    out = []
    for _ in range(reps):
        start = time.perf_counter()
        fn()
        out.append(time.perf_counter() - start)
    return out


if __name__ == "__main__":
    sys.exit(main())
