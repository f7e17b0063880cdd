"""The host tier through real processes on loopback: prefix spill, the swap-in bound, start-up limits."""

from __future__ import annotations

import asyncio
import subprocess
import sys

from pagedkv.client import Client
from tests.conftest import ROOT
from tests.swap_scenarios import BS, prompt_of, spill_scenario


def test_evicted_prefix_comes_back_from_the_host_tier(start_server):
    with_tier = start_server("--num-pages", "40", "--num-host-pages", "80", "--check-integrity")
    without = start_server("--num-pages", "40", "--swap-space", "0", "--check-integrity")
    first, again, computed, info = asyncio.run(spill_scenario(with_tier.address))
    first0, again0, computed0, info0 = asyncio.run(spill_scenario(without.address))
    assert info0.num_host_pages == 0 and info0.num_spill_hits == 0 and again0.cached_tokens == 0
    assert info.num_spilled_pages >= 18 and info.num_spill_hits == 18  # 299 tokens: 18 full pages
    assert again.cached_tokens == 18 * BS
    assert computed == 300 - 18 * BS + 7 < computed0 == 300 + 7  # only the suffix is prefilled
    assert (first.token_ids, again.token_ids) == (first0.token_ids, again0.token_ids)
    assert info.num_used_pages == 0 and info.num_used_host_pages == 0


def test_swapped_request_finishes_under_a_steady_stream(start_server):
    """A low-priority long request is the victim whenever pages run out; it is swapped out, and although
    new prefills go first, it comes back after --swap-in-max-wait steps and finishes while the stream of
    short requests is still going."""
    server = start_server("--num-pages", "14", "--num-host-pages", "28", "--preemption-mode", "swap",
                          "--max-num-seqs", "6", "--swap-in-max-wait", "8", "--check-integrity")
    long_prompt = prompt_of(7, 40)

    async def scenario():
        async with Client(server.address) as client:
            done = {"short": 0}
            long_task = asyncio.create_task(client.complete(long_prompt, max_tokens=120, ignore_eos=True, priority=1))

            async def short_stream(k: int):
                i = 0
                while not long_task.done() and i < 400:
                    await client.complete(prompt_of(1000 + 50 * k + i, 20), max_tokens=24, ignore_eos=True)
                    done["short"] += 1
                    i += 1

            await asyncio.gather(*[short_stream(k) for k in range(5)])
            out = await long_task
            info = await client.model_info()
            return out, done["short"], info

    out, shorts, info = asyncio.run(scenario())
    assert len(out.token_ids) == 120
    assert info.num_swap_preemptions > 0, "the pool was meant to be too small for the long request"
    assert shorts < 5 * 400, "the long request finished only after the stream ended"
    assert info.num_used_pages == 0 and info.num_used_host_pages == 0 and info.num_swapped == 0


def run_executor(*args: str) -> subprocess.CompletedProcess:
    return subprocess.run([sys.executable, "-m", "pagedkv", "executor", "--port", "0", "--log-format", "console",
                           *args], cwd=ROOT, capture_output=True, text=True, timeout=120)


def test_swap_space_above_twice_the_device_kv_is_refused(tiny_llama_dir):
    # tiny-llama pages are 64 KiB: 16 pages = 1 MiB of device KV
    big = run_executor("--num-pages", "16", "--swap-space", "1")
    assert big.returncode != 0
    assert "--swap-space 1 GiB" in big.stderr and "above 2x the device KV cache" in big.stderr
    assert "at most 32 pages" in big.stderr
    pages = run_executor("--num-pages", "16", "--num-host-pages", "33")
    assert pages.returncode != 0 and "--num-host-pages 33" in pages.stderr and "at most 32 pages" in pages.stderr
    negative = run_executor("--num-pages", "16", "--num-host-pages", "-1")
    assert negative.returncode != 0 and "--num-host-pages -1: must be >= 0" in negative.stderr
