"""Tenants' own LoRA adapters under a memory squeeze (#52): a tenant's adapters and KV together never exceed its page
quota, and another tenant's pages and speed are untouched by them.

One ``pagedkv serve`` (``--lora-root`` the bench's adapters, ``--max-loras`` 2, ``--max-lora-rank`` the adapters'
rank) with a tenants file: tenant ``t`` has ``page_quota`` = ``--quota-slots`` device slots' pages plus
``--quota-kv`` KV pages and ``max_adapters`` 4; tenant ``u`` has no quota. ``t`` loads 4 adapters at run time
(LoadAdapter). Two phases, the same prompts (``--prompts`` of ``--input-len`` random tokens, ``--output-len`` out,
greedy, every request at once through pagedkv's gRPC client):

- ``u alone``: u's base-model requests;
- ``u beside t``: u's requests again, with t's as many requests spread over its 4 adapters (more adapters than
  slots: they take turns, paged in from host memory).

Each phase starts a new peak window (ModelInfo ``reset_peak``) and reads each tenant's ``peak_used_pages`` after:
pages its requests held and, for t, its own adapters in device slots, the most at once on any step (the scheduler
records it every step). The row to read: t's peak against its quota, u's peak and output tok/s beside t against
alone, and the slots' page-ins.

    python bench/lora_squeeze.py                  # SmolLM2-135M-Instruct, rank 16 -> bench/results/lora_squeeze.json
    python bench/lora_squeeze.py --quick              # tiny-llama, 8 prompts: a smoke
"""

from __future__ import annotations

import argparse
import asyncio
import os
import sys
import tempfile
import time
from pathlib import Path
from typing import Any

ROOT = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(ROOT))

import peers_http  # noqa: E402
from common import print_table, write_report  # noqa: E402
from e2e_peers import model_dir  # noqa: E402
from lora import make_adapters  # noqa: E402

T_KEY, U_KEY = "bench-t", "bench-u"


def _get_with_key(url: str, timeout: float = 5.0) -> str:
    """peers_http's readiness probe with u's key (the server has a tenants file: /v1/models needs one)."""
    import urllib.request

    req = urllib.request.Request(url, headers={"Authorization": f"Bearer {U_KEY}"})
    with urllib.request.urlopen(req, timeout=timeout) as r:  # noqa: S310 - loopback only
        return r.read().decode()


def tenants_file(quota: int) -> str:
    from pagedkv.tenancy import hash_key

    return (f'[tenants.t]\nkeys = ["{hash_key(T_KEY)}"]\npage_quota = {quota}\nmax_adapters = 4\n\n'
            f'[tenants.u]\nkeys = ["{hash_key(U_KEY)}"]\n')


async def _phase(address: str, prompts: list[list[int]], out_len: int, t_adapters: list[str]) -> dict[str, Any]:
    """u's requests (and t's, over ``t_adapters``) all at once; each tenant's peak pages, u's tok/s, t's done."""
    from pagedkv.client import Client

    async with Client(address, api_key=T_KEY) as t, Client(address, api_key=U_KEY) as u:
        for c in (t, u):
            await c.model_info(reset_peak=True)

        async def run(client, adapter: str, prompt: list[int]) -> int:
            out = await client.complete(prompt, max_tokens=out_len, temperature=0, ignore_eos=True, adapter=adapter)
            return len(out.token_ids)
        t0 = time.perf_counter()
        u_jobs = asyncio.gather(*(run(u, "", p) for p in prompts))
        t_jobs = asyncio.gather(*(run(t, t_adapters[i % len(t_adapters)], p) for i, p in enumerate(prompts))) \
            if t_adapters else None
        u_tokens = sum(await u_jobs)
        u_seconds = time.perf_counter() - t0
        t_tokens = sum(await t_jobs) if t_jobs is not None else 0
        t_info, u_info = await t.model_info(), await u.model_info()
    return dict(u_tok_s=u_tokens / u_seconds, u_seconds=u_seconds, u_peak_pages=u_info.tenant.peak_used_pages,
                t_peak_pages=t_info.tenant.peak_used_pages, t_tokens=t_tokens,
                page_ins=sum(a.num_page_ins for a in t_info.adapters),
                slot_pages=t_info.adapters[0].num_pages if t_info.adapters else 0)


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0], formatter_class=argparse.RawTextHelpFormatter)
    ap.add_argument("--model", default="smollm2-135m-instruct")
    ap.add_argument("--rank", type=int, default=16)
    ap.add_argument("--prompts", type=int, default=16)
    ap.add_argument("--input-len", type=int, default=128)
    ap.add_argument("--output-len", type=int, default=64)
    ap.add_argument("--num-pages", type=int, default=400, help="the executor's pool: KV pages and the 2 slots")
    ap.add_argument("--quota-kv", type=int, default=40, help="t's quota beyond one slot's pages: KV pages")
    ap.add_argument("--quick", action="store_true", help="tiny-llama, 8 prompts of 32 -> 16: a smoke")
    ap.add_argument("--out", default=str(ROOT / "bench/results/lora_squeeze.json"))
    args = ap.parse_args(argv)
    if args.quick:
        args.model, args.prompts, args.input_len, args.output_len = "tiny-llama", 8, 32, 16
    import random

    from pagedkv.cli import free_port

    base = model_dir(args.model)
    adapters = make_adapters(args.model, base, args.rank, 4)
    root = next(iter(adapters.values())).parent
    rng = random.Random(7)
    prompts = [[rng.randrange(100, 20000 if args.model != "tiny-llama" else 250) for _ in range(args.input_len)]
               for _ in range(args.prompts)]
    slot = slot_pages(base, args.rank, args.num_pages)
    quota = slot + args.quota_kv
    report: dict[str, Any] = {"config": vars(args), "cpus": os.cpu_count(), "quota": quota, "slot_pages": slot}
    with tempfile.TemporaryDirectory() as tmp:
        tenants = Path(tmp) / "tenants.toml"
        tenants.write_text(tenants_file(quota))
        flags = ("--num-pages", str(args.num_pages), "--lora-root", str(root), "--max-loras", "2",
                 "--max-lora-rank", str(args.rank), "--tenants-file", str(tenants), "--threads", str(os.cpu_count()))
        srv = peers_http.make_server("pagedkv", args.model, base, free_port(), pagedkv_args=flags)
        address = f"127.0.0.1:{srv.cmd[srv.cmd.index('--port') + 1]}"
        peers_http._get = _get_with_key
        srv.start(timeout=300)
        try:
            names = asyncio.run(_load(address, adapters))
            report["u alone"] = asyncio.run(_phase(address, prompts, args.output_len, []))
            report["u beside t"] = asyncio.run(_phase(address, prompts, args.output_len, names))
        finally:
            srv.stop()
    alone, beside = report["u alone"], report["u beside t"]
    print_table(("phase", "t peak pages (KV + adapters)", "t quota", "u peak pages", "u out tok/s", "page-ins"),
                [(name, str(r["t_peak_pages"]), str(report["quota"]), str(r["u_peak_pages"]),
                  f"{r['u_tok_s']:.1f}", str(r["page_ins"])) for name, r in (("u alone", alone),
                                                                            ("u beside t", beside))])
    print(f"t within its quota: {beside['t_peak_pages'] <= report['quota']}; u beside t / alone: tok/s "
          f"{beside['u_tok_s'] / alone['u_tok_s']:.2f}, peak pages {beside['u_peak_pages']} vs {alone['u_peak_pages']}")
    write_report(args.out, report)
    return 0


def slot_pages(base: Path, rank: int, num_pages: int) -> int:
    """Pages of one device slot of the server this bench starts (float32, 16-token pages, rank on all seven
    modules), as its executor reckons them (executor_svc/lora/pages.py)."""
    import torch

    from executor_svc.lora.pages import plan_pages
    from executor_svc.lora.stack import slot_shape
    from executor_svc.model_config import ModelConfig
    from executor_svc.pages import page_bytes

    cfg = ModelConfig.from_dir(base)
    return plan_pages(slot_shape([], cfg, rank), cfg, torch.float32, num_pages, page_bytes(cfg, 16, torch.float32),
                      1).each


async def _load(address: str, adapters: dict[str, Path]) -> list[str]:
    from pagedkv.client import Client

    async with Client(address, api_key=T_KEY) as t:
        for name, path in adapters.items():
            await t.load_adapter(name, path.name)
    return list(adapters)


if __name__ == "__main__":
    raise SystemExit(main())
