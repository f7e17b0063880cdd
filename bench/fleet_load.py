"""fleet.py's load and its clients: the run's configuration, the tenants' system prompts and the Poisson arrivals,
the two ways a request is sent (streamed HTTP completions, pagedkv.client over gRPC), the timed load and its
summary (hit ratio, TTFT, tok/s, Dynamo's worker affinity)."""

from __future__ import annotations

import asyncio
import json
import random
import time
from dataclasses import dataclass, field
from typing import Any

import httpx
from common import CpuWatch, Machine, percentile

from pagedkv.client import Client
from pagedkv.models import resolve_model

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
