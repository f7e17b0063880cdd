"""The fleet (#47, "Measure"): KV-aware routing over two pagedkv schedulers through NVIDIA Dynamo, against Dynamo's
round robin, pagedkv's client round robin and one scheduler, on the same multi-tenant prefix-heavy Poisson load,
in one run; and what the Dynamo hop costs at batch 1.

The load: ``--tenants`` (4) tenants x ``--prompts-per-tenant`` (8) system prompts of ``--system-tokens`` (512)
tokens, each request one of them (tenant and prompt uniform) plus a short user suffix (8-24 words), ``--requests``
(256) arriving as a Poisson process at ``--rate`` per second, ``--max-tokens`` (32) each, greedy, EOS ignored. Every
tenant sends with its own API key, so each has its own prefix namespace in pagedkv and its own salt in Dynamo's
router. Arms (each on fresh processes, from empty caches):

- ``dynamo-kv``: the edge gateway -> Dynamo's frontend ``--router-mode kv`` -> a sidecar -> one of two schedulers
  (deploy/fleet_local.py), each ``--num-pages`` pages;
- ``dynamo-kv-tuned`` (with ``--frontend-arg``): the same with those router settings, e.g.
  ``--router-prefill-load-scale 4`` (a prefix hit outweighs more of the other worker's lighter load);
- ``dynamo-rr``: the same with ``--router-mode round-robin``;
- ``client-rr``: pagedkv.client straight to the two schedulers (gRPC round robin over ``a,b``; one client per
  tenant), each ``--num-pages`` pages;
- ``single``: one scheduler with twice the pages (the fleet's KV memory in one pool): the hit ratio of perfect
  routing, the reference of the target.

No host tier anywhere (``--swap-space 0``): the capacity each arm has is the pages it is given. Per arm: cached ÷
prompt tokens (pagedkv's usage), TTFT p50/p99 (from each request's own send), output tok/s (all output tokens ÷
from the first send to the last answer), and on Dynamo's paths the share of repeats sent to the worker that
served the same system prompt's previous request (``nvext.worker_id``: routing, as against eviction).

The hop: in the dynamo-kv fleet before its load, ``--hop-requests`` sequential requests (batch 1, distinct short
prompts, ``--hop-max-tokens`` tokens), alternating through the edge and Dynamo, through Dynamo's frontend alone,
and straight to a scheduler's own gateway (``pagedkv serve --http-port``); TTFT and TPOT medians, and their ratios
to the direct gateway's.

Targets (docs/design.md): dynamo-kv's hit ratio >= 0.9 x single's; its TTFT p99 <= dynamo-rr's; the hop <= 1.1x on TPOT.

    python bench/fleet.py --model tiny-llama                      # -> bench/results/fleet.json, fleet.png
    python bench/fleet.py --model smollm2-135m-instruct --requests 128 --rate 0.5
    python bench/fleet.py --frontend-arg=--router-prefill-load-scale=4    # and a tuned KV router beside
    python bench/fleet.py --quick                                 # smoke run
"""

from __future__ import annotations

import argparse
import asyncio
import json
import random
import statistics
import sys
import tempfile
import time
from dataclasses import asdict, dataclass, field
from pathlib import Path
from typing import Any

import httpx
from common import RESULTS, ROOT, CpuWatch, Machine, Server, percentile, print_table, wait_idle, write_report

sys.path.insert(0, str(ROOT / "deploy"))
from fleet_local import OPS_TENANT, Fleet, FleetConfig, write_secrets  # noqa: E402

from pagedkv.client import Client  # noqa: E402
from pagedkv.models import resolve_model  # noqa: E402

ARMS = ("dynamo-kv", "dynamo-kv-tuned", "dynamo-rr", "client-rr", "single")
DEFAULT_ARMS = ("dynamo-kv", "dynamo-rr", "client-rr", "single")  # (-tuned as well with --frontend-arg)
WORDS = ("river stone cloud garden lamp market winter signal copper harbor violet engine paper forest tower "
         "summer bridge candle orbit meadow silver thunder basket mirror canyon lantern velvet anchor").split()


@dataclass(slots=True, kw_only=True)
class Config(Machine):
    model: str = "tiny-llama"
    requests: int = 256
    tenants: int = 4
    prompts_per_tenant: int = 8
    system_tokens: int = 512
    max_tokens: int = 32
    rate: float = 4.0
    num_pages: int = 640
    threads: int = 1
    hop_requests: int = 12
    hop_max_tokens: int = 64
    seed: int = 0
    arms: list[str] = field(default_factory=lambda: list(DEFAULT_ARMS))
    frontend_args: list[str] = field(default_factory=list)  # Dynamo's router settings of the dynamo-kv-tuned arm


@dataclass(frozen=True, slots=True)
class Job:
    index: int
    tenant: str
    system: int  # which of the tenant's system prompts
    prompt: str
    at: float  # seconds after the load's start


@dataclass(slots=True)
class Answer:
    index: int
    ttft_s: float = float("nan")
    end_s: float = float("nan")
    prompt_tokens: int = 0
    cached_tokens: int = 0
    completion_tokens: int = 0
    worker: int | None = None  # Dynamo's worker (nvext.worker_id), on Dynamo's paths
    error: str = ""


# ---- the load ----------------------------------------------------------------------------------------------
def system_prompts(cfg: Config) -> dict[str, list[str]]:
    """Each tenant's system prompts, ``system_tokens`` tokens each by the model's tokenizer (first page distinct)."""
    from tokenizers import Tokenizer

    tok = Tokenizer.from_file(str(resolve_model(cfg.model) / "tokenizer.json"))
    rng = random.Random(cfg.seed)
    out: dict[str, list[str]] = {}
    for t in range(cfg.tenants):
        out[f"tenant-{t}"] = []
        for p in range(cfg.prompts_per_tenant):
            text = f"System {t}.{p}: you are assistant {p} of team {t}. " + " ".join(
                rng.choice(WORDS) for _ in range(cfg.system_tokens * 2))
            ids = tok.encode(text, add_special_tokens=False).ids[:cfg.system_tokens - 1]
            out[f"tenant-{t}"].append(tok.decode(ids, skip_special_tokens=False))
    return out


def make_load(cfg: Config, systems: dict[str, list[str]]) -> list[Job]:
    rng = random.Random(cfg.seed + 1)
    at, jobs = 0.0, []
    for i in range(cfg.requests):
        tenant = f"tenant-{rng.randrange(cfg.tenants)}"
        system = rng.randrange(cfg.prompts_per_tenant)
        suffix = " ".join(rng.choice(WORDS) for _ in range(rng.randint(8, 24)))
        jobs.append(Job(i, tenant, system, f"{systems[tenant][system]}\nUser {i}: {suffix}\nAnswer:", at))
        at += rng.expovariate(cfg.rate)
    return jobs


# ---- two ways to send a request ------------------------------------------------------------------------------
async def send_http(http: httpx.AsyncClient, url: str, key: str, model: str, prompt: str, max_tokens: int,
                    t0: float, index: int) -> Answer:
    """A streamed /v1/completions (an edge, Dynamo's frontend or a pagedkv gateway); times from ``t0``."""
    out = Answer(index)
    body = {"model": model, "prompt": prompt, "max_tokens": max_tokens, "temperature": 0, "ignore_eos": True,
            "stream": True, "stream_options": {"include_usage": True}, "nvext": {"extra_fields": ["worker_id"]}}
    headers = {"authorization": f"Bearer {key}"} if key else {}
    try:
        async with http.stream("POST", f"{url}/v1/completions", json=body, headers=headers) as r:
            if r.status_code != 200:
                out.error = f"HTTP {r.status_code}: {(await r.aread())[:300]!r}"
                return out
            async for line in r.aiter_lines():
                if not line.startswith("data: ") or line == "data: [DONE]":
                    continue
                event = json.loads(line[6:])
                if "error" in event:
                    out.error = str(event["error"])[:300]
                    return out
                if any(c.get("text") for c in event.get("choices") or []):
                    now = time.perf_counter() - t0
                    if out.ttft_s != out.ttft_s:
                        out.ttft_s = now
                    out.end_s = now
                worker = ((event.get("nvext") or {}).get("worker_id") or {}).get("decode_worker_id")
                if worker is not None:
                    out.worker = worker
                usage = event.get("usage")
                if usage:
                    out.prompt_tokens = usage.get("prompt_tokens", 0)
                    out.completion_tokens = usage.get("completion_tokens", 0)
                    out.cached_tokens = (usage.get("prompt_tokens_details") or {}).get("cached_tokens") or 0
    except httpx.HTTPError as err:
        out.error = f"{type(err).__name__}: {err}"
    return out


async def send_grpc(client: Client, prompt: str, max_tokens: int, t0: float, index: int) -> Answer:
    out = Answer(index)
    try:
        async for msg in client.generate(prompt, max_tokens=max_tokens, ignore_eos=True, temperature=0):
            if msg.token_ids:
                now = time.perf_counter() - t0
                if out.ttft_s != out.ttft_s:
                    out.ttft_s = now
                out.end_s = now
            if msg.finish_reason:
                out.prompt_tokens = msg.usage.prompt_tokens
                out.cached_tokens = msg.usage.cached_tokens
                out.completion_tokens = msg.usage.completion_tokens
    except Exception as err:  # noqa: BLE001 - counted and shown, the run goes on
        out.error = f"{type(err).__name__}: {err}"
    return out


# ---- one arm's load ------------------------------------------------------------------------------------------
async def run_load(jobs: list[Job], send) -> tuple[list[Answer], float, dict[str, float]]:
    """Sends each job at its time; ``send(job, t_sent)`` answers it. Returns answers (TTFT from each job's own
    send), the wall time from the first send to the last answer, and the CPU watch."""
    watch = CpuWatch()
    start = time.perf_counter()
    last = start

    async def one(job: Job) -> Answer:
        nonlocal last
        await asyncio.sleep(max(0.0, start + job.at - time.perf_counter()))
        answer = await send(job, time.perf_counter())
        last = max(last, time.perf_counter())
        return answer

    answers = await asyncio.gather(*(one(j) for j in jobs))
    return list(answers), last - start, watch.stop()


def affinity(jobs: list[Job], answers: list[Answer]) -> float:
    """Of the requests whose system prompt came before (in arrival order), the share Dynamo sent to the worker
    that served that prompt's previous request (NaN where no worker was reported: not a Dynamo path)."""
    last: dict[tuple[str, int], int] = {}
    same = repeats = 0
    for job, answer in zip(jobs, answers, strict=True):
        if answer.worker is None:
            continue
        key = (job.tenant, job.system)
        if key in last:
            repeats += 1
            same += last[key] == answer.worker
        last[key] = answer.worker
    return same / repeats if repeats else float("nan")


def summarize(arm: str, jobs: list[Job], answers: list[Answer], wall: float, cpu: dict[str, float]) -> dict[str, Any]:
    ok = [a for a in answers if not a.error]
    ttfts = [a.ttft_s for a in ok if a.ttft_s == a.ttft_s]
    prompt = sum(a.prompt_tokens for a in ok)
    return {"arm": arm, "requests": len(answers), "errors": len(answers) - len(ok),
            "first_errors": [a.error for a in answers if a.error][:3],
            "prompt_tokens": prompt, "cached_tokens": sum(a.cached_tokens for a in ok),
            "hit_ratio": sum(a.cached_tokens for a in ok) / prompt if prompt else float("nan"),
            "ttft_p50_s": percentile(ttfts, 50), "ttft_p99_s": percentile(ttfts, 99),
            "output_tokens": sum(a.completion_tokens for a in ok),
            "output_tok_s": sum(a.completion_tokens for a in ok) / wall if wall > 0 else float("nan"),
            "wall_s": wall, "same_worker_repeats": affinity(jobs, answers), "cpu": cpu}


async def warm(send_one, tenants: list[str]) -> None:
    """One short untimed request per tenant (nothing shared with the load), so first-step costs are paid."""
    for i, tenant in enumerate(tenants):
        answer = await send_one(tenant, f"warm-up {i}: hello", 4)
        if answer.error:
            raise RuntimeError(f"warm-up failed: {answer.error}")


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


# ---- report ------------------------------------------------------------------------------------------------
def verdicts(results: dict[str, dict[str, Any]], arm: str = "dynamo-kv") -> dict[str, str]:
    """The targets, for ``arm`` (Dynamo's KV routing with its defaults, or -tuned)."""
    out: dict[str, str] = {}
    kv, single, rr = results.get(arm), results.get("single"), results.get("dynamo-rr")
    if kv and single:
        out["hit"] = "PASS" if kv["hit_ratio"] >= 0.9 * single["hit_ratio"] else "MISS"
    if kv and rr:
        out["ttft"] = "PASS" if kv["ttft_p99_s"] <= rr["ttft_p99_s"] else "MISS"
    if kv and "hop" in kv:
        out["hop"] = "PASS" if kv["hop"]["edge+dynamo"]["tpot_ratio"] <= 1.1 else "MISS"
    return out


def print_report(results: dict[str, dict[str, Any]], cfg: Config) -> None:
    single = results.get("single", {}).get("hit_ratio")
    rr = results.get("dynamo-rr", {}).get("ttft_p99_s")
    rows = []
    for arm, r in results.items():
        v = verdicts(results, arm)
        hit = f"{r['hit_ratio']:.3f}"
        if arm.startswith("dynamo-kv") and single:
            hit += f" ({r['hit_ratio'] / single:.2f}x single, target >= 0.9: {v['hit']})"
        p99 = f"{r['ttft_p99_s'] * 1e3:.0f}"
        if arm.startswith("dynamo-kv") and rr:
            p99 += f" ({r['ttft_p99_s'] / rr:.2f}x dynamo-rr: {v['ttft']})"
        same = r.get("same_worker_repeats", float("nan"))
        rows.append([arm, hit, f"{r['ttft_p50_s'] * 1e3:.0f}", p99, f"{r['output_tok_s']:.1f}",
                     "-" if same != same else f"{same:.2f}", f"{r['errors']}/{r['requests']}",
                     f"{r['cpu'].get('foreign_share', float('nan')):.2f}"])
    print(f"\n{cfg.model}: {cfg.requests} requests, Poisson {cfg.rate}/s, {cfg.tenants} tenants x "
          f"{cfg.prompts_per_tenant} system prompts of {cfg.system_tokens} tokens, {cfg.max_tokens} output tokens; "
          f"{cfg.num_pages} pages a scheduler (single: {2 * cfg.num_pages}), no host tier")
    print_table(["arm", "cached/prompt", "TTFT p50 ms", "TTFT p99 ms", "out tok/s", "repeat same worker", "errors",
                 "foreign CPU"], rows)
    hop = results.get("dynamo-kv", {}).get("hop")
    if hop:
        print(f"\nthe Dynamo hop at batch 1 (medians of {hop['direct-gateway']['n']} requests each, "
              f"{cfg.hop_max_tokens} tokens):")
        rows = []
        for name, h in hop.items():
            ratio = "" if name == "direct-gateway" else f"{h['ttft_ratio']:.2f}x / {h['tpot_ratio']:.2f}x"
            if name == "edge+dynamo":
                ratio += f" (TPOT target <= 1.1x: {verdicts(results)['hop']})"
            rows.append([name, f"{h['ttft_p50_s'] * 1e3:.1f}", f"{h['tpot_p50_s'] * 1e3:.2f}", ratio])
        print_table(["path", "TTFT ms", "TPOT ms", "TTFT / TPOT vs direct"], rows)


def plot(results: dict[str, dict[str, Any]], path: Path) -> None:
    try:
        import matplotlib

        matplotlib.use("Agg")
        import matplotlib.pyplot as plt
    except ImportError:
        print("matplotlib not installed: no PNG")
        return
    arms = list(results)
    fig, axes = plt.subplots(1, 3, figsize=(12, 3.5))
    axes[0].bar(arms, [results[a]["hit_ratio"] for a in arms])
    axes[0].set_title("cached / prompt tokens")
    axes[1].bar(arms, [results[a]["ttft_p99_s"] * 1e3 for a in arms])
    axes[1].set_title("TTFT p99 (ms)")
    axes[2].bar(arms, [results[a]["output_tok_s"] for a in arms])
    axes[2].set_title("output tok/s")
    for ax in axes:
        ax.tick_params(axis="x", labelrotation=30)
    fig.tight_layout()
    fig.savefig(path, dpi=100)
    print(f"wrote {path}")


async def main_async(cfg: Config, out: Path, idle_wait: float) -> dict[str, Any]:
    systems = system_prompts(cfg)
    jobs = make_load(cfg, systems)
    results: dict[str, dict[str, Any]] = {}
    for arm in cfg.arms:
        wait_idle(idle_wait)
        print(f"== {arm}", flush=True)
        runner = dynamo_arm if arm.startswith("dynamo") else pagedkv_arm
        results[arm] = await runner(cfg, arm, jobs)
        r = results[arm]
        print(f"   hit {r['hit_ratio']:.3f}, TTFT p50 {r['ttft_p50_s']:.3f} s p99 {r['ttft_p99_s']:.3f} s, "
              f"{r['output_tok_s']:.1f} tok/s, errors {r['errors']} {r['first_errors']}", flush=True)
    report = {"config": asdict(cfg), "results": results,
              "verdicts": {arm: verdicts(results, arm) for arm in results if arm.startswith("dynamo-kv")}}
    print_report(results, cfg)
    write_report(out, report)
    plot(results, out.with_suffix(".png"))
    return report


def parse_args(argv: list[str] | None = None) -> tuple[Config, Path, float]:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    d = Config()
    p.add_argument("--model", default=d.model)
    for name in ("requests", "tenants", "prompts_per_tenant", "system_tokens", "max_tokens", "num_pages", "threads",
                 "hop_requests", "hop_max_tokens", "seed"):
        p.add_argument("--" + name.replace("_", "-"), type=int, default=getattr(d, name))
    p.add_argument("--rate", type=float, default=d.rate, help="requests per second (Poisson)")
    p.add_argument("--arms", default="", help="comma-separated, of " + ", ".join(ARMS) + " (default: "
                   + ", ".join(DEFAULT_ARMS) + ", and dynamo-kv-tuned after dynamo-kv with --frontend-arg)")
    p.add_argument("--frontend-arg", action="append", default=[], metavar="ARG",
                   help="a flag for the dynamo-kv-tuned arm's frontend (repeat), e.g. "
                   "--frontend-arg=--router-prefill-load-scale=4")
    p.add_argument("--quick", action="store_true", help="smoke run: 24 requests, 2 tenants x 2 prompts, 3 hop rounds")
    p.add_argument("--out", default="", help="JSON path (default: bench/results/fleet[_MODEL][_quick].json)")
    a = p.parse_args(argv)
    arms = [x for x in a.arms.split(",") if x] or [
        x for x in ARMS if x in DEFAULT_ARMS or (x == "dynamo-kv-tuned" and a.frontend_arg)]
    if unknown := [x for x in arms if x not in ARMS]:
        p.error(f"--arms: unknown {unknown}; choose from {', '.join(ARMS)}")
    cfg = Config(model=a.model, requests=a.requests, tenants=a.tenants, prompts_per_tenant=a.prompts_per_tenant,
                 system_tokens=a.system_tokens, max_tokens=a.max_tokens, rate=a.rate, num_pages=a.num_pages,
                 threads=a.threads, hop_requests=a.hop_requests, hop_max_tokens=a.hop_max_tokens, seed=a.seed,
                 arms=arms, frontend_args=a.frontend_arg)
    if a.quick:
        cfg.requests, cfg.tenants, cfg.prompts_per_tenant, cfg.hop_requests = 24, 2, 2, 3
    name = "fleet" + ("" if cfg.model == "tiny-llama" else "_" + Path(cfg.model).name.split("-")[0]) + \
        ("_quick" if a.quick else "")
    return cfg, Path(a.out) if a.out else RESULTS / f"{name}.json", 0.0 if a.quick else 120.0


def main() -> None:
    cfg, out, idle_wait = parse_args()
    asyncio.run(main_async(cfg, out, idle_wait))


if __name__ == "__main__":
    main()
