"""Async scheduling through real processes: with the next plan built while the executor runs the last one, every
client gets exactly what it gets with one plan at a time (greedy tokens, text, finish and stop reasons), through
stop strings, stop tokens, max_tokens, page budgets, n > 1 forks and preemption (a pool too small for the load),
with the page accounting checked after every step (--check-integrity)."""

from __future__ import annotations

import asyncio

import pytest

from pagedkv.client import Client
from tests.support.swap_scenarios import prompt_of

pytestmark = pytest.mark.e2e

SMALL_POOL = ("--num-pages", "24", "--num-host-pages", "48", "--max-num-seqs", "12", "--check-integrity")


def _requests(stops: dict[int, dict]) -> list[tuple[list[int], dict]]:
    reqs = []
    for i in range(16):
        params = dict(max_tokens=24 + (i * 7) % 40, ignore_eos=i % 3 != 0, temperature=0)
        if i % 5 == 4:
            params["page_budget"] = 3  # past it: attention over the sink and a window (pages dropped)
        params.update(stops.get(i, {}))
        reqs.append((prompt_of(500 + i, 20 + (i * 13) % 50), params))
    return reqs


async def _run(address: str, stops: dict[int, dict]):
    async with Client(address) as client:
        singles = [client.complete(p, **kw) for p, kw in _requests(stops)]
        forks = [client.complete_n(prompt_of(900 + k, 30), 2, max_tokens=30, temperature=0.9, seed=11 + k,
                                   ignore_eos=True) for k in range(3)]
        outs = await asyncio.gather(*singles, *forks)
        info = await client.model_info()
    flat = []
    for o in outs:
        for c in (o if isinstance(o, list) else [o]):
            flat.append((c.token_ids, c.text, c.finish_reason, c.stop_reason))
    return flat, info


def test_async_scheduling_streams_what_one_plan_at_a_time_streams(start_server):
    sync = start_server(*SMALL_POOL, "--no-async-scheduling")
    overlap = start_server(*SMALL_POOL)  # the default
    plain, _ = asyncio.run(_run(sync.address, {}))
    # Stop strings and stop tokens from the middle of what the requests say without them: they end there.
    stops: dict[int, dict] = {}
    for i in (1, 2, 6, 7, 11):
        text = plain[i][1]
        if len(text) >= 12:
            stops[i] = {"stop": [text[len(text) // 2: len(text) // 2 + 3]]}
    for i in (4, 8):
        tokens = plain[i][0]
        stops[i] = {"stop_token_ids": [tokens[len(tokens) // 2]]}
    stops[2] = {**stops.get(2, {}), "include_stop_str_in_output": True}
    expected, info_sync = asyncio.run(_run(sync.address, stops))
    got, info = asyncio.run(_run(overlap.address, stops))
    assert len(stops) >= 5
    assert sum(1 for _, _, finish, _ in expected if finish == "stop") >= 5, "the stops were meant to end requests"
    for i, (want, have) in enumerate(zip(expected, got)):
        assert have == want, f"request {i}: async scheduling streamed something else"
    assert info.num_swap_preemptions + info.num_recompute_preemptions > 0, "the pool was meant to be too small"
    assert info.num_used_pages == 0 and info.num_used_host_pages == 0
    assert info_sync.num_used_pages == 0
