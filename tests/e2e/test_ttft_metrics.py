"""Where the first token's time goes, through a real `pagedkv serve` on tiny-llama (#49): after a few requests, one of
them longer than the chunk budget, the scheduler's /metrics has the TTFT-breakdown histograms with one observation
per request served, and its DEBUG log one request_first_token line per request whose parts add up to its TTFT."""

from __future__ import annotations

import asyncio
import random

import pytest

from pagedkv.cli import free_port
from pagedkv.client import Client
from tests.e2e.test_metrics import scrape
from tests.support import procs

pytestmark = pytest.mark.e2e

HISTOGRAMS = ("pagedkv_request_tokenize_seconds", "pagedkv_request_queue_seconds", "pagedkv_request_prefill_seconds",
              "pagedkv_request_prefill_steps", "pagedkv_request_first_token_send_seconds")


def test_serve_exports_the_ttft_breakdown(model_cache, start_server):
    metrics_port = free_port()
    server = start_server("--metrics-port", str(metrics_port), "--num-pages", "128", "--max-num-batched-tokens", "64",
                          "--log-format", "json", "--log-level", "debug")
    rng = random.Random(5)
    prompts = [[1] + [rng.randrange(3, 250) for _ in range(n - 1)] for n in (150, 9, 17, 33)]

    async def workload():
        async with Client(server.address) as client:
            return await asyncio.gather(*(client.complete(p, max_tokens=4, ignore_eos=True) for p in prompts))
    done = asyncio.run(workload())
    assert [len(c.token_ids) for c in done] == [4] * 4
    assert procs.wait_for(lambda: scrape(metrics_port)["pagedkv_requests_running"] == 0, 10)
    m = scrape(metrics_port)
    served = m['pagedkv_time_to_first_token_seconds_count{tenant="default"}']
    assert served == 4
    for name in HISTOGRAMS:
        assert m[f"{name}_count"] == served, name
    assert m["pagedkv_request_prefill_steps_sum"] >= 3 + 3  # the long prompt's 3 chunks, at least a step each other
    ttft_sum = m['pagedkv_time_to_first_token_seconds_sum{tenant="default"}']
    assert 0 < m["pagedkv_request_prefill_seconds_sum"] <= ttft_sum
    assert procs.wait_for(lambda: sum(e.get("event") == "request_first_token" for e in server.events) == 4, 10)
    lines = [e for e in server.events if e.get("event") == "request_first_token"]
    for e in lines:
        parts = e["tokenize_s"] + e["prepare_s"] + e["queue_s"] + e["prefill_s"] + e["send_s"]
        assert parts == pytest.approx(e["ttft_s"], abs=1e-5)
        assert e["prefill_steps"] >= e["prefill_chunks"] >= 1
    longest = max(lines, key=lambda e: sum(c[1] for c in e["chunks"]))
    assert sum(c[1] for c in longest["chunks"]) == 150 and longest["prefill_chunks"] >= 3  # 150 tokens, 64 a step
