"""A burst of requests with a common prefix, served by the real executor: the followers ride the first request's
prefill (scheduler_svc/rides.py), their suffixes computed in the step that computes the prefix, reading pages
written in that same step; every output equals transformers' greedy output for its prompt alone."""

from __future__ import annotations

import asyncio
import random

import pytest

from pagedkv.client import Client
from tests.support import procs
from tests.support.hf_reference import hf_greedy

pytestmark = pytest.mark.e2e

VOCAB = 259


@pytest.mark.parametrize("block_size", [8, 16])
def test_a_shared_prefix_burst_rides_one_prefill_and_matches_transformers(start_server, tiny_llama_dir, block_size):
    rng = random.Random(block_size)
    prefix = [1] + [rng.randrange(3, VOCAB) for _ in range(5 * block_size + 3)]
    prompts = [prefix + [3 + i] + [rng.randrange(3, VOCAB) for _ in range(rng.randint(0, 20))] for i in range(8)]
    expected = hf_greedy(tiny_llama_dir, prompts, [10] * len(prompts))
    server = start_server("--block-size", str(block_size), "--num-pages", "512", "--max-num-batched-tokens", "2048",
                          "--check-integrity", "--log-format", "json", "--log-level", "debug")
    blocker = [1] + [rng.randrange(3, VOCAB) for _ in range(1799)]

    async def burst():
        async with Client(server.address) as client:
            # (a long prefill first, so that the burst arrives while the executor is busy: together)
            busy = asyncio.create_task(client.complete(blocker, max_tokens=2, ignore_eos=True))
            while not (await client.model_info()).num_running:
                await asyncio.sleep(0.001)
            outs = await asyncio.gather(*(client.complete(p, max_tokens=10, temperature=0) for p in prompts))
            await busy
            return outs
    outs = asyncio.run(burst())
    for i, (out, ref) in enumerate(zip(outs, expected)):
        assert out.token_ids == ref, f"request {i} differs from transformers"
    assert procs.wait_for(lambda: sum(e.get("event") == "request_first_token" for e in server.events) == 9, 10)
    steps = sorted(e["chunks"][0][0] for e in server.events if e.get("event") == "request_first_token")[1:]
    owner_step = steps[0]  # (each request's first chunk's step)
    # The prefix computed once: the first request's plan; the others' first chunks went in that plan or the next
    # (planned before its result), sharing its pages. Waiting for them to be confirmed would be a step later.
    assert all(step <= owner_step + 1 for step in steps), steps
    assert sum(o.cached_tokens for o in outs) == 7 * (len(prefix) // block_size) * block_size
