"""The host tier through real processes on loopback: prefix spill, the swap-in bound, start-up limits."""

from __future__ import annotations

import asyncio
import subprocess
import sys
from concurrent.futures import ThreadPoolExecutor

import pytest

from pagedkv.client import Client
from tests.conftest import ROOT
from tests.support.swap_scenarios import BS, prompt_of, spill_scenario

pytestmark = pytest.mark.e2e

# one torch thread per executor: with torch's default (2 here) the executor, the scheduler and this client fight
# over the 2-core machine and steps slow down several-fold in some runs (the steady-stream scenario: 1.5-3 s with
# one thread; 3-29 s with two)
ONE_THREAD = ("--threads", "1")


def test_evicted_prefix_comes_back_from_the_host_tier(start_servers):
    common = ("--num-pages", "40", "--check-integrity", *ONE_THREAD)
    with_tier, without = start_servers((*common, "--num-host-pages", "80"), (*common, "--swap-space", "0"))
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
                          "--max-num-seqs", "6", "--swap-in-max-wait", "8", "--check-integrity", *ONE_THREAD)
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
    print(f"\nlong request done after {shorts} short ones, {info.num_swap_preemptions} swap preemptions")
    assert len(out.token_ids) == 120
    assert info.num_swap_preemptions > 0, "the pool was meant to be too small for the long request"
    assert shorts < 5 * 400, "the long request finished only after the stream ended"
    assert info.num_used_pages == 0 and info.num_used_host_pages == 0 and info.num_swapped == 0


def run_executors(*arg_lists: tuple[str, ...]) -> list[subprocess.CompletedProcess]:
    """Executors run to the end side by side (each is mostly imports), one per argument list."""
    def run(args: tuple[str, ...]) -> subprocess.CompletedProcess:
        return subprocess.run([sys.executable, "-m", "pagedkv", "executor", "--port", "0", "--log-format", "console",
                               *args], cwd=ROOT, capture_output=True, text=True, timeout=120)

    with ThreadPoolExecutor(len(arg_lists)) as pool:
        return list(pool.map(run, arg_lists))


def test_swap_space_above_twice_the_device_kv_is_refused(tiny_llama_dir):
    # tiny-llama pages are 64 KiB: 16 pages = 1 MiB of device KV
    big, pages, negative = run_executors(("--num-pages", "16", "--swap-space", "1"),
                                         ("--num-pages", "16", "--num-host-pages", "33"),
                                         ("--num-pages", "16", "--num-host-pages", "-1"))
    assert big.returncode != 0
    assert "--swap-space 1 GiB" in big.stderr and "above 2x the device KV cache" in big.stderr
    assert "at most 32 pages" in big.stderr
    assert pages.returncode != 0 and "--num-host-pages 33" in pages.stderr and "at most 32 pages" in pages.stderr
    assert negative.returncode != 0 and "--num-host-pages -1: must be >= 0" in negative.stderr
