"""8-bit KV pages through real processes (`pagedkv serve --kv-cache-dtype ...`): the flag passes through,
ModelInfo reports the format, and the page-moving paths (prefix caching and its spill to the host tier,
n > 1 copy-on-write forks, swap preemption) work on quantized pools with the integrity check on."""

from __future__ import annotations

import asyncio
import os
import random
import subprocess
import sys

import pytest

from pagedkv.client import Client
from tests.conftest import ROOT, Server
from tests.support.swap_scenarios import BS, prompt_of, spill_scenario

pytestmark = pytest.mark.e2e


@pytest.fixture(scope="module")
def fp8_server(model_cache):
    s = Server("--num-pages", "40", "--num-host-pages", "80", "--check-integrity", "--kv-cache-dtype", "fp8_e4m3",
               "--threads", "1")
    yield s
    s.stop()


def test_model_info_reports_the_kv_format(fp8_server):
    async def scenario():
        async with Client(fp8_server.address) as client:
            return await client.model_info()
    info = asyncio.run(scenario())
    # tiny-llama: 4 layers x K,V x 4 KV heads x (32 one-byte elements + a 2-byte scale)
    assert info.kv_dtype == "fp8_e4m3" and info.kv_bytes_per_token == 4 * 2 * 4 * (32 + 2) == 1088
    assert [(e.kv_dtype, e.kv_bytes_per_token) for e in info.executors] == [("fp8_e4m3", 1088)]
    assert info.dtype == "float32"


def test_prefix_spill_and_hits_on_fp8_pages(fp8_server):
    first, again, computed, info = asyncio.run(spill_scenario(fp8_server.address))
    # the 18 full pages were spilled; 17 came back from the host: FP8's exact tail (2 pages, the default) keeps the
    # prompt's last full page from being a hit (executor_svc/kv_tail.py)
    assert info.num_spilled_pages >= 18 and info.num_spill_hits == 17
    assert again.cached_tokens == 17 * BS
    assert computed == 300 - 17 * BS + 7
    assert len(first.token_ids) == len(again.token_ids) == 8
    assert info.num_used_pages == 0 and info.num_used_host_pages == 0


def test_parallel_sampling_forks_match_separate_seeds_on_fp8_pages(fp8_server):
    rng = random.Random(3)
    prompt = [1] + [rng.randrange(3, 259) for _ in range(40)]  # the forks share a partial last page (CoW)
    params = dict(max_tokens=12, temperature=1.0, top_p=0.9, ignore_eos=True)

    async def scenario():
        async with Client(fp8_server.address) as client:
            forks = await client.complete_n(prompt, n=4, seed=77, **params)
            separate = [await client.complete(prompt, seed=77 + i, **params) for i in range(4)]
            return forks, separate

    forks, separate = asyncio.run(scenario())
    assert [f.token_ids for f in forks] == [s.token_ids for s in separate]
    assert len({tuple(f.token_ids) for f in forks}) == 4


@pytest.mark.parametrize("kv,extra", [("int8", ()), ("fp8_e4m3", ("--kv-exact-tail-slots", "64")),
                                      ("fp8_e4m3", ("--kv-exact-tail-pages", "0"))], ids=["int8", "fp8", "fp8-no-tail"])
def test_swap_preemption_on_8_bit_pages(start_server, kv, extra):
    """FP8 with its exact tail (the default): the tail's copies go to the host with their pages and come back."""
    server = start_server("--num-pages", "14", "--num-host-pages", "28", "--preemption-mode", "swap",
                          "--max-num-seqs", "6", "--swap-in-max-wait", "8", "--check-integrity",
                          "--kv-cache-dtype", kv, "--threads", "1", *extra)
    long_prompt = prompt_of(7, 40)

    async def scenario():
        async with Client(server.address) as client:
            # (warm: "alone" and the long request both read the prompt's first page from the prefix cache. With
            # FP8's exact tail a cold prefill reads it exactly, a warm one in 8 bits: executor_svc/kv_tail.py)
            await client.complete(long_prompt, max_tokens=1, ignore_eos=True, temperature=0)
            alone = await client.complete(long_prompt, max_tokens=60, ignore_eos=True, temperature=0)
            long_task = asyncio.create_task(client.complete(long_prompt, max_tokens=60, ignore_eos=True,
                                                            priority=1, temperature=0))

            async def short_stream(k: int):
                i = 0
                while not long_task.done() and i < 100:
                    await client.complete(prompt_of(1000 + 50 * k + i, 20), max_tokens=24, ignore_eos=True)
                    i += 1

            await asyncio.gather(*[short_stream(k) for k in range(5)])
            return alone, await long_task, await client.model_info()

    alone, out, info = asyncio.run(scenario())
    assert info.kv_dtype == kv
    assert info.num_swap_preemptions > 0, "the pool was meant to be too small for the long request"
    assert info.num_swap_bytes == (info.num_pages_swapped_out + info.num_pages_swapped_in) * 16 * 1088
    assert out.token_ids == alone.token_ids  # swapped out and back in: the same greedy continuation
    assert info.num_used_pages == 0 and info.num_used_host_pages == 0 and info.num_swapped == 0


def test_executor_refuses_four_bit_kv_at_start_up():
    name = "int4"  # fp4 and nf4: the same parse (tests/unit/test_kv_quant.py)
    env = {**os.environ, "PAGEDKV_EXECUTOR_SECRET": "kv-quant-test-secret"}
    out = subprocess.run([sys.executable, "-m", "pagedkv", "executor", "--port", "0", "--log-format", "console",
                          "--kv-cache-dtype", name, "--num-pages", "16"], cwd=ROOT, env=env, capture_output=True,
                         text=True, timeout=120)
    assert out.returncode != 0
    assert f"--kv-cache-dtype {name}" in out.stderr and "poor kernel support" in out.stderr


@pytest.mark.parametrize("args,message", [
    (("--kv-exact-tail-pages", "2"), "an exact tail is for 8-bit KV pages"),
    (("--kv-cache-dtype", "fp8_e4m3", "--kv-exact-tail-pages", "5"), "--kv-exact-tail-pages must be in [0, 4]"),
    (("--kv-cache-dtype", "fp8_e4m3", "--kv-exact-tail-slots", "0"), "--kv-exact-tail-slots must be >= 1"),
    (("--kv-cache-dtype", "int8", "--kv-exact-tail-slots", "64"), "there is no exact tail here"),
])
def test_executor_refuses_an_exact_tail_it_cannot_serve(args, message):
    env = {**os.environ, "PAGEDKV_EXECUTOR_SECRET": "kv-quant-test-secret"}
    out = subprocess.run([sys.executable, "-m", "pagedkv", "executor", "--port", "0", "--log-format", "console",
                          "--num-pages", "16", *args], cwd=ROOT, env=env, capture_output=True, text=True, timeout=120)
    assert out.returncode != 0
    assert message in out.stderr
