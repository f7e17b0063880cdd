"""The host tier's prefix-spill scenario against a running server (test_swap_e2e.py, and on 8-bit pages
test_kv_quant_e2e.py)."""

from __future__ import annotations

import random

from pagedkv.client import Client

BS = 16


def prompt_of(seed: int, n: int) -> list[int]:
    rng = random.Random(seed)
    return [1] + [rng.randrange(3, 259) for _ in range(n - 1)]


async def spill_scenario(address: str):
    """A 300-token prompt, three other long prompts that push its pages out of the 40-page device pool,
    then the first prompt again (with another last token)."""
    prefix = prompt_of(1, 299)
    async with Client(address) as client:
        first = await client.complete(prefix + [5], max_tokens=8, ignore_eos=True, temperature=0)
        for seed in (2, 3, 4):
            await client.complete(prompt_of(seed, 300), max_tokens=8, ignore_eos=True, temperature=0)
        before = await client.model_info()
        again = await client.complete(prefix + [6], max_tokens=8, ignore_eos=True, temperature=0)
        after = await client.model_info()
    return first, again, after.num_computed_tokens - before.num_computed_tokens, after
