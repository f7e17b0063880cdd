"""fleet.py's arms: Dynamo's (an edge, Dynamo's frontend with its router, two schedulers: deploy/fleet_local.py), with
the batch-1 hop measured in the dynamo-kv fleet, and pagedkv's own (client round robin over two schedulers, or one
scheduler with both pools)."""

from __future__ import annotations

import asyncio
import statistics
import sys
import tempfile
import time
from pathlib import Path
from typing import Any

import httpx
from common import ROOT, Server
from fleet_load import WORDS, Answer, Config, Job, run_load, send_grpc, send_http, summarize, warm

sys.path.insert(0, str(ROOT / "deploy"))
from fleet_local import OPS_TENANT, Fleet, FleetConfig, write_secrets  # noqa: E402

from pagedkv.client import Client  # noqa: E402


def serve_args(cfg: Config, pages: int) -> list[str]:
    return ["--model", cfg.model, "--threads", str(cfg.threads), "--num-pages", str(pages), "--swap-space", "0",
            "--log-format", "json"]


async def dynamo_arm(cfg: Config, arm: str, jobs: list[Job]) -> dict[str, Any]:
    mode = "kv" if arm.startswith("dynamo-kv") else "round-robin"
    hop = arm == "dynamo-kv" and cfg.hop_requests > 0
    fleet = Fleet(FleetConfig(model=cfg.model, schedulers=2, router_mode=mode, tenants=cfg.tenants,
                              serve_args=serve_args(cfg, cfg.num_pages)[2:],
                              frontend_args=cfg.frontend_args if arm == "dynamo-kv-tuned" else [],
                              scheduler_http=hop, require_tenant=not hop))
    await asyncio.to_thread(fleet.start)
    try:
        limits = httpx.Limits(max_connections=cfg.requests + 16, max_keepalive_connections=cfg.requests + 16)
        async with httpx.AsyncClient(timeout=httpx.Timeout(900, connect=30), limits=limits) as http:
            model = fleet.served_model

            async def one(tenant: str, prompt: str, max_tokens: int) -> Answer:
                return await send_http(http, fleet.edge_url, fleet.keys[tenant], model, prompt, max_tokens,
                                       time.perf_counter(), 0)

            await warm(one, sorted(t for t in fleet.keys if t != OPS_TENANT))
            hop_result = await measure_hop(cfg, http, fleet) if hop else None

            async def send(job: Job, sent: float) -> Answer:
                return await send_http(http, fleet.edge_url, fleet.keys[job.tenant], model, job.prompt,
                                       cfg.max_tokens, sent, job.index)

            answers, wall, cpu = await run_load(jobs, send)
        result = summarize(arm, jobs, answers, wall, cpu)
        if hop_result:
            result["hop"] = hop_result
        return result
    except BaseException:
        print(fleet.logs(), file=sys.stderr)
        raise
    finally:
        await asyncio.to_thread(fleet.stop)


async def measure_hop(cfg: Config, http: httpx.AsyncClient, fleet: Fleet) -> dict[str, Any]:
    """Batch 1: one request at a time, rounds of (edge -> Dynamo, Dynamo's frontend, a scheduler's own gateway),
    each with a prompt of its own (no cache hit), the order rotated each round."""
    tenant = "tenant-0"
    paths = {"edge+dynamo": (fleet.edge_url, fleet.keys[tenant]),
             "dynamo-frontend": (fleet.frontend_url, ""),
             "direct-gateway": (fleet.scheduler_http_urls[0], fleet.keys[tenant])}
    rows: dict[str, list[tuple[float, float]]] = {p: [] for p in paths}
    names = list(paths)
    for r in range(cfg.hop_requests):
        for k in range(len(names)):
            name = names[(r + k) % len(names)]
            url, key = paths[name]
            prompt = f"hop {r} {name}: " + " ".join(WORDS[(r * 7 + j) % len(WORDS)] for j in range(40))
            t0 = time.perf_counter()
            a = await send_http(http, url, key, fleet.served_model, prompt, cfg.hop_max_tokens, t0, r)
            if a.error:
                raise RuntimeError(f"hop request via {name}: {a.error}")
            if a.completion_tokens > 1:
                rows[name].append((a.ttft_s, (a.end_s - a.ttft_s) / (a.completion_tokens - 1)))
    out: dict[str, Any] = {}
    for name, xs in rows.items():
        out[name] = {"ttft_p50_s": statistics.median(x[0] for x in xs),
                     "tpot_p50_s": statistics.median(x[1] for x in xs), "n": len(xs)}
    base = out["direct-gateway"]
    for name in ("edge+dynamo", "dynamo-frontend"):
        out[name]["ttft_ratio"] = out[name]["ttft_p50_s"] / base["ttft_p50_s"]
        out[name]["tpot_ratio"] = out[name]["tpot_p50_s"] / base["tpot_p50_s"]
    return out


async def pagedkv_arm(cfg: Config, arm: str, jobs: list[Job]) -> dict[str, Any]:
    with tempfile.TemporaryDirectory(prefix="pagedkv-bench-fleet-") as tmp:
        keys = write_secrets(Path(tmp), cfg.tenants)
        n, pages = (2, cfg.num_pages) if arm == "client-rr" else (1, 2 * cfg.num_pages)
        servers = await asyncio.gather(*(asyncio.to_thread(
            Server, [*serve_args(cfg, pages), "--tenants-file", f"{tmp}/tenants.toml"]) for _ in range(n)))
        try:
            address = ",".join(s.address for s in servers)
            clients = {t: Client(address, api_key=k) for t, k in keys.items() if t != OPS_TENANT}

            async def one(tenant: str, prompt: str, max_tokens: int) -> Answer:
                return await send_grpc(clients[tenant], prompt, max_tokens, time.perf_counter(), 0)

            for _ in range(n):
                await warm(one, sorted(clients))

            async def send(job: Job, sent: float) -> Answer:
                return await send_grpc(clients[job.tenant], job.prompt, cfg.max_tokens, sent, job.index)

            answers, wall, cpu = await run_load(jobs, send)
            for c in clients.values():
                await c.close()
            return summarize(arm, jobs, answers, wall, cpu)
        finally:
            for s in servers:
                s.stop()
