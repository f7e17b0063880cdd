"""Multi-LoRA (#52) under memory pressure, through ``pagedkv serve`` on loopback: greedy ids equal HF PEFT's for
three random adapters at ranks 8, 16 and 64 (other target modules each) and transformers' for the base model.

- tiny-llama, with a KV pool too small for what the twelve requests (three per adapter and three of the base model)
  grow to: once with ``--preemption-mode swap`` (a host tier), once with ``recompute``. Each group's prompts share a
  two-page prefix (the same tokens in every group), and its followers are sent once its lead streams, so that they
  hit the lead's cached pages, which only that adapter (or the base model) may hit. Each group's last follower has
  priority 1, so that the victims (scheduler_svc/policy.py: the highest priority value first, then the newest) are
  of every group, not only the newest adapter's. ModelInfo shows that requests were preempted (by the mode asked
  for) and that prompt tokens came from the cache, and that the four leads were running together before any
  follower was sent: then steps held rows of all three adapters and of the base model (the scheduler plans every
  running request into each step, scheduler_svc/scheduler.py). How many ran at once later depends on timing
  (8 to 12 seen): printed, not asserted. Each lead's
  ``cached_tokens`` is 0 (no other group's pages are hit, though every group's prefix is the same tokens) and each
  follower's is its group's prefix. Which requests were preempted is not observable (no per-request count or log
  line): run by hand with a print in Scheduler._preempt, both modes preempted requests of all four groups.
- SmolLM2 (the built-in ``smollm2-135m-instruct``, 30 layers), three adapters at ranks 8, 16 and 64: one prompt
  under the base model and each adapter (PEFT's ids differ for each), three more each under one adapter; ModelInfo
  shows all seven running at once, so one step mixed the base model and all three adapters.
"""

from __future__ import annotations

import asyncio

import pytest
import torch

from pagedkv.client import Client, Completion, accumulate
from tests.conftest import Server
from tests.support.hf_reference import random_prompts
from tests.support.lora_helpers import make_adapter, one_torch_thread, peft_greedy, peft_reference

pytestmark = pytest.mark.e2e

ALL = ["q_proj", "k_proj", "v_proj", "o_proj", "gate_proj", "up_proj", "down_proj"]
SPECS = {"r8": (8, ["q_proj", "v_proj"]), "r16": (16, ["k_proj", "o_proj", "gate_proj", "down_proj"]),
         "r64": (64, ALL)}
GROUPS = ("", "r8", "r16", "r64")  # "": the base model
PREFIX = 32  # two full pages of tiny-llama's 16 tokens, shared by each group's prompts
N = 40  # tokens generated: a request grows from 3 pages (its 40-token prompt) to 5
PAGES = 24  # the twelve requests admitted take 4 * 2 + 12 = 20 pages, and would grow to 4 * 2 + 12 * 3 = 44


def _adapters(model_dir, root, base=None) -> dict:
    return {name: make_adapter(model_dir, root / name, r, targets, seed=60 + i, base=base)
            for i, (name, (r, targets)) in enumerate(SPECS.items())}


@pytest.fixture(scope="module")
def tiny(tiny_llama_dir, tmp_path_factory):
    (prefix,) = random_prompts(71, [PREFIX], 259)
    suffixes = random_prompts(72, [9] * 12, 259)  # (each [1] + 8 ids; the 1 dropped)
    prompts = {g: [prefix + suffixes[3 * i + k][1:] for k in range(3)] for i, g in enumerate(GROUPS)}
    with one_torch_thread():
        adapters = _adapters(tiny_llama_dir, tmp_path_factory.mktemp("lora-preempt"))
        peft = peft_reference(tiny_llama_dir, adapters)
        want = {g: [peft_greedy(peft, g or None, p, N) for p in ps] for g, ps in prompts.items()}
    assert len({tuple(w[0]) for w in want.values()}) == 4, "the adapters change the greedy ids"
    return adapters, prompts, want, _pages_besides_kv(adapters)


def _pages_besides_kv(adapters: dict) -> int:
    """The pages of --num-pages that are not the scheduler's KV pages (ModelInfo.num_pages) when serving
    ``adapters``: an executor may keep the adapters' weights in pages of its pool (executor_svc/lora/pages.py)."""
    probe = Server("--num-pages", "1024", "--threads", "1", "--lora-modules", *_modules(adapters))
    try:
        return 1024 - asyncio.run(_info(probe.address)).num_pages
    finally:
        assert probe.stop() == 0, probe.log()


def _modules(adapters: dict) -> list[str]:
    return [f"{name}={path}" for name, path in adapters.items()]


async def _info(address: str):
    async with Client(address) as client:
        return await client.model_info()


async def _stream(client: Client, prompt: list[int], adapter: str, n: int, started: asyncio.Event,
                  priority: int = 0) -> Completion:
    out = Completion()
    async for msg in client.generate(prompt, max_tokens=n, temperature=0, ignore_eos=True, adapter=adapter,
                                     priority=priority):
        accumulate(out, msg)
        started.set()
    return out


async def _watch(client: Client, stop: asyncio.Event, seen: dict) -> None:
    """The most requests ModelInfo showed running at once, while ``stop`` is not set."""
    while not stop.is_set():
        seen["running"] = max(seen["running"], (await client.model_info()).num_running)
        await asyncio.sleep(0.005)


async def _pressure(address: str, prompts: dict, n: int):
    """Each group's lead first; its two followers once it streams (its prefix pages are cached then)."""
    async with Client(address) as client:
        stop, seen = asyncio.Event(), {"running": 0}
        watcher = asyncio.create_task(_watch(client, stop, seen))
        started = {g: asyncio.Event() for g in prompts}
        leads = {g: asyncio.create_task(_stream(client, ps[0], g, n, started[g])) for g, ps in prompts.items()}
        await asyncio.gather(*(e.wait() for e in started.values()))
        leads_running = (await client.model_info()).num_running  # (the leads alone: no follower is sent yet)
        followers = {g: [asyncio.create_task(_stream(client, p, g, n, asyncio.Event(), priority=k))
                         for k, p in enumerate(ps[1:])] for g, ps in prompts.items()}
        outs = {g: [await leads[g], *[await t for t in followers[g]]] for g in prompts}
        stop.set()
        await watcher
        return outs, await client.model_info(), seen["running"], leads_running


@pytest.mark.parametrize("mode", ["swap", "recompute"])
def test_greedy_ids_equal_pefts_under_preemption_and_prefix_hits(tiny, mode, start_server):
    adapters, prompts, want, besides_kv = tiny
    tier = ("--num-host-pages", "48") if mode == "swap" else ("--swap-space", "0")
    server = start_server("--num-pages", str(PAGES + besides_kv), "--preemption-mode", mode, *tier, "--check-integrity",
                          "--threads", "1", "--lora-modules", *_modules(adapters))
    outs, info, most_running, leads_running = asyncio.run(_pressure(server.address, prompts, N))
    print(f"\n{mode}: {info.num_preemptions} preemptions (swap {info.num_swap_preemptions}, recompute "
          f"{info.num_recompute_preemptions}), {info.num_cached_prompt_tokens} cached prompt tokens, at most "
          f"{most_running} running, cached per request "
          f"{ {g or 'base': [o.cached_tokens for o in os] for g, os in outs.items()} }")
    for g in GROUPS:
        for k, (out, ids) in enumerate(zip(outs[g], want[g])):
            assert out.token_ids == ids, f"{g or 'base'} prompt {k} ({mode})"
    kind = info.num_swap_preemptions if mode == "swap" else info.num_recompute_preemptions
    assert info.num_pages == PAGES
    assert info.num_preemptions > 0 and kind == info.num_preemptions, "the pool was meant to be too small"
    # the four leads (one per group) were running together, so their steps mixed the base model and all three
    # adapters (the pool holds the four and their growth: none is preempted before the followers come)
    assert leads_running == len(GROUPS), "every group's lead ran in the same steps"
    for g in GROUPS:
        assert all(o.cached_tokens == 0 for o in outs[g][:1]), f"{g or 'base'}: no other group's page is hit"
        assert all(o.cached_tokens >= PREFIX for o in outs[g][1:]), f"{g or 'base'}: its followers hit its prefix"
    assert info.num_cached_prompt_tokens >= 8 * PREFIX
    assert info.num_used_pages == 0 and info.num_used_host_pages == 0 and info.num_swapped == 0


SMOL = "smollm2-135m-instruct"
SMOL_N = 8
SMOL_PROMPTS = ["The capital of France is", "def add(a, b):\n    return", "Once upon a time,", "Water boils at"]
# the first prompt under the base model and each adapter, each other one under one adapter: seven rows in one batch
SMOL_REQUESTS = [(g, 0) for g in GROUPS] + [("r8", 1), ("r16", 2), ("r64", 3)]


@pytest.fixture(scope="module")
def smol(smollm2_dir, tmp_path_factory):
    """PEFT's greedy ids, and the server serving the three adapters."""
    from transformers import AutoModelForCausalLM, AutoTokenizer

    with one_torch_thread():
        base = AutoModelForCausalLM.from_pretrained(str(smollm2_dir), dtype=torch.float32, attn_implementation="eager")
        adapters = _adapters(smollm2_dir, tmp_path_factory.mktemp("lora-smol"), base)
        peft = peft_reference(smollm2_dir, adapters, base=base)
        tokenizer = AutoTokenizer.from_pretrained(str(smollm2_dir))
        prompts = [tokenizer(p)["input_ids"] for p in SMOL_PROMPTS]
        want = [peft_greedy(peft, g or None, prompts[k], SMOL_N) for g, k in SMOL_REQUESTS]
    server = Server("--model", SMOL, "--num-pages", "512", "--check-integrity", "--threads", "1",
                    "--lora-modules", *_modules(adapters))
    yield server, prompts, want
    assert server.stop() == 0, server.log()


async def _batch(address: str, prompts: list[list[int]], n: int):
    async with Client(address) as client:
        stop, seen = asyncio.Event(), {"running": 0}
        watcher = asyncio.create_task(_watch(client, stop, seen))
        outs = await asyncio.gather(*(_stream(client, prompts[k], g, n, asyncio.Event()) for g, k in SMOL_REQUESTS))
        stop.set()
        await watcher
        return outs, seen["running"]


def test_smollm2_greedy_ids_equal_pefts_for_three_adapters_in_one_batch(smol):
    server, prompts, want = smol
    assert len({tuple(w) for w in want[:4]}) == 4, "each adapter changes the first prompt's greedy ids"
    outs, most_running = asyncio.run(_batch(server.address, prompts, SMOL_N))
    for (g, k), out, ids in zip(SMOL_REQUESTS, outs, want):
        assert out.token_ids == ids, f"{g or 'base'}: prompt {k} ({SMOL_PROMPTS[k]!r})"
    assert most_running == len(SMOL_REQUESTS), "the base model's and the three adapters' rows ran in one step"
