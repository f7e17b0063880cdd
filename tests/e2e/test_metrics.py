"""Prometheus metrics after a known workload, through real processes: pages used rise and return to zero,
prefix-cache hits are counted once per hit, latency histograms count each request, and the executor
exports its own step metrics."""

from __future__ import annotations

import asyncio
import random
import re
import time
import urllib.request

import pytest

from pagedkv.cli import free_port
from pagedkv.client import Client, Completion, accumulate
from tests.support import procs

pytestmark = pytest.mark.e2e


def scrape(port: int) -> dict[str, float]:
    text = urllib.request.urlopen(f"http://127.0.0.1:{port}/metrics", timeout=10).read().decode()
    out = {}
    for line in text.splitlines():
        m = re.match(r"^([a-zA-Z_:][\w:]*(?:\{[^}]*\})?) (\S+)$", line)
        if m:
            out[m.group(1)] = float(m.group(2))
    return out


def test_metrics_follow_a_known_workload(model_cache):
    sched_metrics, exec_metrics = free_port(), free_port()
    ex = procs.executor("--num-pages", "64", "--metrics-port", str(exec_metrics))
    sched = procs.scheduler(ex.address, args=("--metrics-port", str(sched_metrics)))
    try:
        rng = random.Random(3)
        prefix = [1] + [rng.randrange(3, 259) for _ in range(63)]  # 4 full pages
        m0 = scrape(sched_metrics)
        assert m0["pagedkv_pages_used"] == 0 and m0["pagedkv_pages_capacity"] == 64

        async def workload():
            async with Client(sched.address) as client:
                first = Completion()
                async for msg in client.generate(prefix + [5], max_tokens=48, ignore_eos=True):
                    accumulate(first, msg)
                second = await client.complete(prefix + [6], max_tokens=8, ignore_eos=True)
                third = await client.complete(prefix + [7], max_tokens=8, ignore_eos=True)
                return first, second, third
        started = time.perf_counter()
        first, second, third = asyncio.run(workload())
        wall = time.perf_counter() - started
        assert len(first.token_ids) == 48
        assert procs.wait_for(lambda: scrape(sched_metrics)["pagedkv_pages_used"] == 0, 10)
        m = scrape(sched_metrics)
        assert first.cached_tokens == 0 and second.cached_tokens == third.cached_tokens == 64
        assert m["pagedkv_prefix_cache_hit_tokens_total"] - m0.get("pagedkv_prefix_cache_hit_tokens_total", 0) == 128
        assert m["pagedkv_prefix_cache_query_tokens_total"] == 3 * 65
        assert m['pagedkv_requests_finished_total{reason="length"}'] == 3
        assert m['pagedkv_time_to_first_token_seconds_count{tenant="default"}'] == 3
        assert m['pagedkv_request_latency_seconds_count{tenant="default"}'] == 3
        # measured from each request's arrival: within what the client waited in all (a timestamp clobbered by
        # another field once measured them from the clock's origin, hours)
        ttft = m['pagedkv_time_to_first_token_seconds_sum{tenant="default"}']
        e2e = m['pagedkv_request_latency_seconds_sum{tenant="default"}']
        assert 0 < ttft < e2e <= wall
        # one gap per token after the first, but for the messages a stream that fell behind coalesced (Outbox)
        gaps = m["pagedkv_inter_token_latency_seconds_count"] + m.get("pagedkv_stream_messages_coalesced_total", 0)
        assert gaps == (48 - 1) + 2 * (8 - 1)
        assert m["pagedkv_generated_tokens_total"] == 64
        assert m['pagedkv_executors{state="up"}'] == 1 and m["pagedkv_requests_running"] == 0
        assert 0 <= m["pagedkv_kv_slot_utilization"] <= 1
        assert m['pagedkv_step_seconds_count{part="plan"}'] == m['pagedkv_step_seconds_count{part="rpc"}'] > 0
        e = scrape(exec_metrics)
        assert e["pagedkv_executor_tokens_total"] == m["pagedkv_prompt_tokens_total"] - 128 + 64 - 3
        assert e['pagedkv_executor_steps_total{outcome="ok"}'] > 0 and e["pagedkv_executor_device_pages"] == 64
        admitted = [ev for ev in sched.events if ev.get("event") == "request_admitted"]
        assert len(admitted) == 3 and all(ev["tenant"] == "default" and ev["request_id"] for ev in admitted)
        assert not any("prompt" in ev for ev in admitted)  # no prompt in the logs unless --log-prompts

        async def held() -> float:  # pages rise while a request runs (one that cannot end before it is cancelled)
            async with Client(sched.address) as client:
                async for _ in client.generate(prefix + [8], max_tokens=950, ignore_eos=True):
                    return scrape(sched_metrics)["pagedkv_pages_used"]
        assert asyncio.run(held()) >= 5  # the shared prefix's 4 pages and one of its own ...
        assert procs.wait_for(lambda: scrape(sched_metrics)["pagedkv_pages_used"] == 0, 10)  # ... and come back
    finally:
        sched.kill()
        ex.kill()
