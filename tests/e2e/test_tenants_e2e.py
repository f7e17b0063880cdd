"""Tenants through real processes on loopback: API keys, page budgets and windows, quotas, fairness."""

from __future__ import annotations

import asyncio
import random

import grpc
import pytest

from pagedkv.api.v1 import api_pb2 as api
from pagedkv.client import Client
from pagedkv.tenancy import hash_key
from tests.conftest import Server, wait_until
from tests.support.hf_reference import hf_windowed_greedy

pytestmark = pytest.mark.e2e

BS = 16

TENANTS = f"""
[tenants.alpha]
keys = ["{hash_key('key-alpha')}"]
revoked_keys = ["{hash_key('key-alpha-old')}"]
page_quota = 48
max_concurrent_requests = 4

[tenants.beta]
keys = ["{hash_key('key-beta')}"]
reserved_pages = 40

[tenants.budget]
keys = ["{hash_key('key-budget')}"]
page_budget = 6          # window policy: sink = first page, window (6 - 1 - 1) x 16 = 64 tokens

[tenants.stopper]
keys = ["{hash_key('key-stopper')}"]
page_budget = 4
overflow = "stop"

[tenants.slide]
keys = ["{hash_key('key-slide')}"]
sliding_window = 40
sink_tokens = 4

[tenants.ops]                  # sees the cluster's figures in ModelInfo (tenants see only their own)
keys = ["{hash_key('key-ops')}"]
admin = true

[tenants.plain]
keys = ["{hash_key('key-plain')}"]
structured_outputs = false

[tenants.grammar]
keys = ["{hash_key('key-grammar')}"]
max_constraint_bytes = 100
max_constrained_requests = 1
"""


@pytest.fixture(scope="module")
def server(model_cache, tmp_path_factory):
    path = tmp_path_factory.mktemp("tenants") / "tenants.toml"
    path.write_text(TENANTS)
    s = Server("--num-pages", "128", "--max-num-batched-tokens", "512", "--check-integrity",
               "--tenants-file", str(path), "--threads", "1")  # one torch thread: 2 fight the others for 2 cores
    yield s
    s.stop()


def prompt_of(seed: int, n: int) -> list[int]:
    rng = random.Random(seed)
    return [1] + [rng.randrange(3, 259) for _ in range(n - 1)]


async def _call(address: str, key: str | None, metadata=()):
    async with Client(address, metadata=metadata, api_key=key or "") as client:
        return await client.complete("hello", max_tokens=2, temperature=0)


def test_no_wrong_or_revoked_key_is_unauthenticated(server):
    ok = asyncio.run(_call(server.address, "key-alpha"))
    assert len(ok.token_ids) == 2
    for key, metadata, words in ((None, (), "missing API key"), ("nope", (), "unknown API key"),
                                 ("key-alpha-old", (), "revoked"), (None, (("authorization", "Basic x"),), "Bearer")):
        with pytest.raises(grpc.aio.AioRpcError) as err:
            asyncio.run(_call(server.address, key, metadata))
        assert err.value.code() == grpc.StatusCode.UNAUTHENTICATED and words in err.value.details()

    async def info_without_key():
        async with Client(server.address) as client:
            return await client.model_info()

    with pytest.raises(grpc.aio.AioRpcError) as err:
        asyncio.run(info_without_key())
    assert err.value.code() == grpc.StatusCode.UNAUTHENTICATED


async def _complete_with_info(address: str, key: str, prompt, **params):
    async with Client(address, api_key=key) as client:
        await client.model_info(reset_peak=True)
        out = await client.complete(prompt, temperature=0, **params)  # (greedy: compared with transformers')
        info = await client.model_info()
    return out, info


def test_window_budget_matches_dense_reference_and_holds_its_budget(server, tiny_llama_dir):
    prompt = prompt_of(5, 100)
    out, info = asyncio.run(_complete_with_info(server.address, "key-budget", prompt, max_tokens=60, ignore_eos=True))
    assert out.token_ids == hf_windowed_greedy(tiny_llama_dir, prompt, 60, sink=BS, window=64)
    assert info.tenant.id == "budget" and info.tenant.page_budget == 6
    assert info.tenant.peak_used_pages <= 6 and info.tenant.budget_hits == 1
    assert info.tenant.used_pages == 0


def test_request_lowers_its_budget_never_raises_it(server, tiny_llama_dir):
    prompt = prompt_of(6, 70)
    out, info = asyncio.run(_complete_with_info(server.address, "key-budget", prompt, max_tokens=40,
                                                ignore_eos=True, page_budget=4))
    assert out.token_ids == hf_windowed_greedy(tiny_llama_dir, prompt, 40, sink=BS, window=32)
    assert info.tenant.peak_used_pages <= 4
    for budget, words in ((7, "must be <= 6"), (2, "needs at least 3"), (-1, "must be >= 0")):
        with pytest.raises(grpc.aio.AioRpcError) as err:
            asyncio.run(_complete_with_info(server.address, "key-budget", prompt, max_tokens=4, page_budget=budget))
        assert err.value.code() == grpc.StatusCode.INVALID_ARGUMENT and "page_budget" in err.value.details()
        assert words in err.value.details()


def test_stop_policy_finishes_with_length_and_says_why(server):
    prompt = prompt_of(7, 40)  # 4 pages of 16 hold 64 tokens: 40 prompt + 24 outputs, the 25th sampled from them
    out, info = asyncio.run(_complete_with_info(server.address, "key-stopper", prompt, max_tokens=100, ignore_eos=True))
    assert out.finish_reason == "length" and len(out.token_ids) == 25
    assert "page_budget" in out.stop_reason and info.tenant.budget_hits == 1
    with pytest.raises(grpc.aio.AioRpcError) as err:  # a prompt longer than the budget cannot even start
        asyncio.run(_complete_with_info(server.address, "key-stopper", prompt_of(8, 80), max_tokens=4))
    assert err.value.code() == grpc.StatusCode.INVALID_ARGUMENT and "4 pages" in err.value.details()


def test_tenant_sliding_window_matches_dense_reference(server, tiny_llama_dir):
    prompt = prompt_of(9, 90)
    out, info = asyncio.run(_complete_with_info(server.address, "key-slide", prompt, max_tokens=50, ignore_eos=True))
    assert out.token_ids == hf_windowed_greedy(tiny_llama_dir, prompt, 50, sink=4, window=40)
    assert info.tenant.sliding_window == 40 and info.tenant.peak_used_pages <= 1 + 5 + 1


async def _all_queued(client: Client, tasks: list[asyncio.Task], timeout: float = 120.0, seats: int = 0) -> None:
    """Until the scheduler has every one of ``tasks``' requests of the client's tenant (running, waiting, swapped,
    or already answered), some of them wait, and at least ``seats`` run (ModelInfo). A request that finished, or
    one swapped out under the quota, counts: a loaded machine may run the first ones to the end, or swap them,
    before the last arrives."""
    t = None
    for _ in range(int(timeout / 0.01)):
        t = (await client.model_info()).tenant
        done = sum(task.done() for task in tasks)
        if t.num_running + t.num_waiting + t.num_swapped + done == len(tasks) and t.num_waiting \
                and t.num_running >= seats:
            return
        await asyncio.sleep(0.01)
    raise AssertionError(f"the tenant's {len(tasks)} requests were never all queued ({done} answered): {t}")


def test_quota_holds_while_the_other_tenant_gets_its_reserve_at_once(server):
    """alpha floods (quota 48 pages, 4 requests at a time); beta, with 40 reserved pages, is served at once."""

    async def scenario():
        async with Client(server.address, api_key="key-alpha") as alpha, \
                Client(server.address, api_key="key-beta") as beta:
            await alpha.model_info(reset_peak=True)
            flood = [asyncio.create_task(alpha.complete(prompt_of(100 + i, 200), max_tokens=80, ignore_eos=True))
                     for i in range(12)]
            await _all_queued(alpha, flood)
            b = await beta.complete(prompt_of(99, 300), max_tokens=8, ignore_eos=True)
            mid = await alpha.model_info()
            await asyncio.gather(*flood)
            end = await alpha.model_info()
            async with Client(server.address, api_key="key-ops") as ops:
                cluster = await ops.model_info()
            return b, mid, end, cluster

    b, mid, end, cluster = asyncio.run(scenario())
    assert len(b.token_ids) == 8
    assert mid.tenant.num_waiting > 0, "alpha's flood was meant to be still queued when beta finished"
    assert end.tenant.peak_used_pages <= 48 and end.tenant.used_pages == 0
    assert cluster.num_used_pages == 0 and cluster.num_running == 0


NEIGHBOURS = f"""
[tenants.flood]
keys = ["{hash_key('key-flood')}"]
{{limits}}

[tenants.quiet]
keys = ["{hash_key('key-quiet')}"]
"""
FLOOD, QUIET = 24, 3  # flood: 24 requests at once on 8 seats; quiet: then 3, one after another


async def _noisy_neighbour(address: str, seats: int) -> None:
    """flood sends FLOOD requests (32-token prompts, 100 tokens out) at once; once the scheduler holds all of them
    and ``seats`` of them run (ModelInfo), quiet sends QUIET requests (600-token prompts, 4 tokens out) one after
    another. (Had quiet come while seats were free, flood requests would rightly be admitted in its step.)"""
    async with Client(address, api_key="key-flood") as flood, Client(address, api_key="key-quiet") as quiet:
        tasks = [asyncio.create_task(flood.complete(prompt_of(2000 + i, 32), max_tokens=100, ignore_eos=True,
                                                    request_id=f"flood-{i}")) for i in range(FLOOD)]
        await _all_queued(flood, tasks, seats=seats)
        for k in range(QUIET):
            await quiet.complete(prompt_of(3000 + k, 600), max_tokens=4, ignore_eos=True, request_id=f"quiet-{k}")
        await asyncio.gather(*tasks)


def _admissions(server: Server) -> dict[str, tuple[int, int]]:
    """(queued_at_step, admitted_at_step) of each finished request, from the scheduler's request_finished events."""
    names = {f"flood-{i}" for i in range(FLOOD)} | {f"quiet-{k}" for k in range(QUIET)}

    def finished() -> dict[str, tuple[int, int]]:
        return {e["request_id"]: (e["queued_at_step"], e["admitted_at_step"]) for e in list(server.events)
                if e.get("event") == "request_finished" and e.get("request_id") in names}

    assert wait_until(lambda: len(finished()) == len(names), 30), server.log()
    return finished()


def _overtaken(steps: dict[str, tuple[int, int]], quiet: str) -> tuple[int, int, int]:
    """(flood requests still waiting when ``quiet`` was queued, those of them admitted in a plan before its own,
    those admitted before it or in its plan). The order within one plan is not recorded: a seat freed in quiet's
    plan beside quiet's own goes to flood under any policy."""
    queued, admitted = steps[quiet]
    waiting = [a for name, (_, a) in steps.items() if name.startswith("flood") and a > queued]
    return len(waiting), sum(a < admitted for a in waiting), sum(a <= admitted for a in waiting)


def test_noisy_neighbour_fairness_admits_the_quiet_tenant_first(tmp_path, start_servers):
    """'flood' sends 24 long requests at once to a server that runs 8 at most; 'quiet' then sends short ones, one
    at a time. Checked on the admission order the scheduler records (step ids), not on the clock:

    - fairness (VTC) and flood held to 4 requests at a time: each quiet request is admitted in the first plan
      built after it arrived, or the one after (async scheduling);
    - fairness alone: quiet, back from idle, starts at flood's weighted service and below its share of the seats,
      so a flood request gives its seat up and quiet is admitted in the next plan or the one after, ahead of every
      flood request still waiting (later quiet requests wait until flood's service catches up with theirs: VTC);
    - --no-fairness, no limit: first come, first served, so every flood request waiting when quiet arrived goes
      first. The timings (TTFT p50/p99 against quiet alone) are bench/tenants.py's."""
    files = {name: tmp_path / f"{name}.toml" for name in ("limit", "fair", "fcfs")}
    files["limit"].write_text(NEIGHBOURS.format(limits="max_concurrent_requests = 4\npage_quota = 0.5"))
    files["fair"].write_text(NEIGHBOURS.format(limits=""))
    files["fcfs"].write_text(NEIGHBOURS.format(limits=""))
    common = ("--num-pages", "512", "--max-num-seqs", "8", "--max-num-batched-tokens", "1024", "--threads", "1",
              "--log-format", "json")
    servers = start_servers(*[(*common, "--tenants-file", str(path), *(("--no-fairness",) if name == "fcfs" else ()))
                              for name, path in files.items()])
    steps = {}
    for name, server in zip(files, servers):
        asyncio.run(_noisy_neighbour(server.address, seats=4 if name == "limit" else 8))
        steps[name] = _admissions(server)
        server.stop()
    quiet = [f"quiet-{k}" for k in range(QUIET)]
    waits = {name: [s[q][1] - s[q][0] for q in quiet] for name, s in steps.items()}
    overtaken = {name: [_overtaken(s, q) for q in quiet] for name, s in steps.items()}
    print(f"\nquiet's steps queued {waits}; (flood waiting, of them admitted first) {overtaken}")
    assert all(0 < w <= 2 for w in waits["limit"]), waits
    waiting, before, _ = overtaken["fair"][0]
    assert waiting >= 8 and before == 0 and 0 < waits["fair"][0] <= 2, (overtaken, waits)  # (16 were waiting)
    waiting, _, first = overtaken["fcfs"][0]
    assert waiting >= 8 and first == waiting and waits["fcfs"][0] >= 100, (overtaken, waits)  # all went first


def test_server_sliding_window_serves_contexts_longer_than_the_pool(tiny_llama_dir):
    """16 pages hold 256 tokens; with --sliding-window 64 --sink-tokens 4 a 160 + 140 token request runs
    (max_model_len is no longer capped to the pool) and equals dense attention under the same mask."""
    server = Server("--num-pages", "16", "--sliding-window", "64", "--sink-tokens", "4", "--check-integrity",
                    "--max-num-batched-tokens", "128")
    try:
        prompt = prompt_of(11, 160)

        async def run():
            async with Client(server.address) as client:
                await client.model_info(reset_peak=True)
                out = await client.complete(prompt, max_tokens=140, ignore_eos=True, temperature=0)
                return out, await client.model_info()

        out, info = asyncio.run(run())
    finally:
        server.stop()
    assert info.max_model_len == 2048 and info.num_pages == 16
    assert len(out.token_ids) == 140 and info.tenant.peak_used_pages <= 16
    assert out.token_ids == hf_windowed_greedy(tiny_llama_dir, prompt, 140, sink=4, window=64)


def test_structured_output_limits_of_the_tenants_file(server):
    """structured_outputs = false refuses constraints (a tool choice's too: test_tool_calls) and nothing else;
    max_constraint_bytes bounds a constraint's size; max_constrained_requests bounds the constrained requests open at
    once, with the retryable "queue full" refusal, and clears when one ends; ModelInfo shows the tenant its
    settings."""
    async def refused(key: str, **params) -> grpc.aio.AioRpcError:
        async with Client(server.address, api_key=key) as client:
            with pytest.raises(grpc.aio.AioRpcError) as e:
                await client.complete("hello", max_tokens=4, **params)
        return e.value

    err = asyncio.run(refused("key-plain", constraint=api.Constraint(regex="a+")))
    assert err.code() == grpc.StatusCode.INVALID_ARGUMENT and err.details().startswith("sampling.constraint: tenant "
                                                                                       "plain may not constrain")
    err = asyncio.run(refused("key-grammar", constraint=api.Constraint(regex="a" * 101)))
    assert "sampling.constraint.regex: 101 bytes; at most 100 (tenant grammar's max_constraint_bytes)" in err.details()

    async def limited() -> tuple[grpc.aio.AioRpcError, int]:
        async with Client(server.address, api_key="key-grammar") as client, \
                Client(server.address, api_key="key-grammar", resume=None) as once:
            await once.complete("x", max_tokens=2, constraint=api.Constraint(regex="b+"))  # (compiled: kept)
            long = client.generate("hello", max_tokens=1200, min_tokens=1200, temperature=1.0, seed=1,
                                   constraint=api.Constraint(regex="[a-z]+"))  # (open for 1,200 steps)
            first = await anext(long)  # (the first constrained request is open)
            assert first.text or first.token_ids or first.HasField("prompt")
            with pytest.raises(grpc.aio.AioRpcError) as e:  # (``once`` does not retry a full queue)
                await once.complete("x", max_tokens=4, constraint=api.Constraint(regex="b+"))
            assert (await once.complete("plain", max_tokens=2)).token_ids  # (unconstrained: not counted)
            await long.aclose()
            # (the default client retries a full queue: it starts once the cancelled stream has left)
            done = await client.complete("x", max_tokens=4, temperature=1.0, constraint=api.Constraint(regex="b+"))
            info = await client.model_info()
        return e.value, done, info.tenant

    err, done, tenant = asyncio.run(limited())
    assert err.code() == grpc.StatusCode.RESOURCE_EXHAUSTED and err.details().startswith(
        "queue full: tenant grammar has 1 constrained requests open; its max_constrained_requests is 1")
    assert set(done.text) <= {"b"} and done.text
    assert (tenant.structured_outputs, tenant.max_constraint_bytes, tenant.max_constrained_requests) == (True, 100, 1)
