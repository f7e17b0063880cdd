"""Security round 3 (issue #46), F1-F3, as a tenant would attack, with a bystander tenant: real processes on loopback
(tiny-llama), two tenants by API key, the executor's grammar budgets set for this small model.

- F1: grammars whose matcher grows its per-step cost without bound (the finding's 51-byte ambiguous EBNF, and the
  6-byte regex ``(x*)*y`` with ``y`` biased away) end with INVALID_ARGUMENT naming the budget's flag, at the first
  step past it; the bystander's requests all complete meanwhile, and the matchers' CPU is charged to the attacker.
- F2: a constraint whose compile passes the executor's CPU limit is refused, its worker killed; the bystander's
  constraints (json_object, a regex, a fresh schema) compile meanwhile and are never refused for another tenant's
  (the memory of refused constraints is per tenant); max_constrained_requests holds before anything compiles.
- F3: an executor restarted mid-stream holds none of the grammars: the requests it gets back wait until it has
  compiled theirs (never on its step loop) and every output still follows its constraint.

What the bystander's latency was during each attack, against its idle figure, is printed (``-s``) and measured by
``bench/grammar_attacks.py``; no test asserts a wall-clock ratio.
"""

from __future__ import annotations

import asyncio
import json
import os
import re
import signal
import statistics
import time

import grpc
import pytest

from pagedkv.api.v1 import api_pb2 as api
from pagedkv.client import Client, Completion, accumulate
from pagedkv.local_server import LocalServer
from pagedkv.tenancy import hash_key

pytestmark = pytest.mark.e2e

AMBIGUOUS = 'root ::= a{500,}\na ::= "x" | "x" "x" | "xx" | "x" a'  # the finding's 51 bytes
Y = ord("y") + 3  # tiny-llama: byte b is token b + 3
SLOW_SCHEMA = json.dumps({"type": "object", "properties": {  # ~62 KB: ~1.3 s of CPU to compile here
    f"p{i}": {"type": "string", "pattern": "^[a-z]{3,9}-[0-9]{2,5}(x|y|z){1,4}$"} for i in range(800)}})
TENANTS = f"""
[tenants.attacker]
keys = ["{hash_key('key-attacker')}"]

[tenants.bystander]
keys = ["{hash_key('key-bystander')}"]

[tenants.limited]
keys = ["{hash_key('key-limited')}"]
max_constrained_requests = 1
"""


@pytest.fixture(scope="module")
def server(model_cache, tmp_path_factory):
    path = tmp_path_factory.mktemp("tenants") / "tenants.toml"
    path.write_text(TENANTS)
    s = LocalServer("--model", "tiny-llama", "--num-pages", "256", "--tenants-file", str(path), "--threads", "1",
                    "--log-format", "json", "--unplaced-timeout", "60",
                    "--grammar-compile-timeout", "0.3", "--grammar-step-budget-ms", "5",
                    "--grammar-tenant-step-budget-ms", "10")
    yield s
    s.stop()


async def _bystander(address: str, n: int, gap: float = 0.1) -> list[float]:
    """n 8-token greedy requests of the bystander, one after another: their latencies."""
    out = []
    async with Client(address, api_key="key-bystander") as client:
        for i in range(n):
            t = time.perf_counter()
            c = await client.complete([1, 72, 105, 33 + i], max_tokens=8, temperature=0, ignore_eos=True)
            assert len(c.token_ids) == 8
            out.append(time.perf_counter() - t)
            await asyncio.sleep(gap)
    return out


async def _attack(address: str, key: str = "key-attacker", **params) -> tuple[int, grpc.aio.AioRpcError | None]:
    tokens = 0
    async with Client(address, api_key=key, resume=None) as client:  # (no retry of a full queue)
        try:
            async for msg in client.generate("attack", **params):
                tokens += len(msg.token_ids)
        except grpc.aio.AioRpcError as err:
            return tokens, err
    return tokens, None


async def _tenant_info(address: str, key: str) -> api.TenantInfo:
    async with Client(address, api_key=key) as client:
        return (await client.model_info()).tenant


def test_unbounded_matchers_end_at_their_budget_and_the_bystander_goes_on(server):
    async def run():
        idle = await _bystander(server.address, 5)
        attacks = [asyncio.create_task(_attack(server.address, max_tokens=1500, temperature=0,
                                               constraint=api.Constraint(grammar=AMBIGUOUS))),
                   asyncio.create_task(_attack(server.address, max_tokens=1500, temperature=0, logit_bias={Y: -100.0},
                                               constraint=api.Constraint(regex="(x*)*y")))]
        during = await _bystander(server.address, 8)
        return idle, during, await asyncio.gather(*attacks)

    idle, during, attacks = asyncio.run(run())
    for tokens, err in attacks:
        assert err is not None and err.code() == grpc.StatusCode.INVALID_ARGUMENT, (tokens, err)
        assert re.search(r"sampling.constraint: its (tenant's )?grammar('s)? matchers? took [\d.]+ ms of CPU in one "
                         r"step; the limit is (5|10) ms \(--grammar-(tenant-)?step-budget-ms\)", err.details()), err
        assert 20 < tokens < 1500, tokens  # (ended where its matcher passed the budget, not at max_tokens)
    attacker = asyncio.run(_tenant_info(server.address, "key-attacker"))
    bystander = asyncio.run(_tenant_info(server.address, "key-bystander"))
    assert attacker.grammar_cpu_seconds > 0.01 and bystander.grammar_cpu_seconds == 0.0
    print(f"\nbystander p50 idle {statistics.median(idle) * 1e3:.1f} ms, during the F1 attack "
          f"{statistics.median(during) * 1e3:.1f} ms; attacker tokens {[t for t, _ in attacks]}, its matchers' CPU "
          f"{attacker.grammar_cpu_seconds * 1e3:.0f} ms")


def test_slow_compiles_are_stopped_and_never_poison_another_tenants_constraints(server):
    bystander_constraints = [api.Constraint(json_object=True), api.Constraint(regex="[0-9]{3}"),
                             api.Constraint(json_schema=json.dumps({"type": "object", "properties": {
                                 "fresh": {"type": "integer"}}, "required": ["fresh"]}))]

    async def bystander_constrained() -> list[Completion]:
        outs = []
        async with Client(server.address, api_key="key-bystander") as client:
            for c in bystander_constraints:
                out = Completion()
                async for msg in client.generate("b", max_tokens=40, temperature=0, constraint=c):
                    accumulate(out, msg)
                outs.append(out)
        return outs

    async def run():
        slow = [asyncio.create_task(_attack(server.address, max_tokens=4, constraint=api.Constraint(
            json_schema=SLOW_SCHEMA.replace("p0", f"q{i}")))) for i in range(2)]
        outs = await bystander_constrained()
        attacked = await asyncio.gather(*slow)
        same = await _attack(server.address, key="key-bystander", max_tokens=4,
                             constraint=api.Constraint(json_schema=SLOW_SCHEMA.replace("p0", "q0")))
        return outs, attacked, same

    outs, attacked, same = asyncio.run(run())
    for _, err in attacked:
        assert err is not None and err.code() == grpc.StatusCode.INVALID_ARGUMENT
        assert "compiling it takes more than the executor's limit of 0.3 s of CPU (--grammar-compile-timeout)" in \
            err.details()
    assert json.loads(outs[0].text) is not None and re.fullmatch("[0-9]{3}", outs[1].text)
    assert isinstance(json.loads(outs[2].text)["fresh"], int)
    # The same slow schema from the bystander is compiled (and refused) in its own scope, on its own account.
    assert same[1] is not None and "--grammar-compile-timeout" in same[1].details()
    attacker = asyncio.run(_tenant_info(server.address, "key-attacker"))
    assert attacker.grammar_cpu_seconds >= 0.5  # (two compiles stopped at 0.3 s each, charged to it)


def test_max_constrained_requests_holds_before_anything_compiles(server):
    """A constrained request past its tenant's max_constrained_requests is refused before its constraint is
    compiled: a slow schema sent then costs the tenant no compile."""
    async def run():
        streamed = asyncio.Event()
        async with Client(server.address, api_key="key-limited") as client:
            async def first():
                async for msg in client.generate("a", max_tokens=300, temperature=0,
                                                 constraint=api.Constraint(regex="[a-z]{300}")):
                    if msg.token_ids:
                        streamed.set()

            running = asyncio.create_task(first())
            await streamed.wait()
            before = (await client.model_info()).tenant.grammar_cpu_seconds
            second = await _attack(server.address, key="key-limited", max_tokens=4,
                                   constraint=api.Constraint(json_schema=SLOW_SCHEMA.replace("p1", "r1")))
            after = (await client.model_info()).tenant.grammar_cpu_seconds
            await running
            return second, after - before

    (_, err), charged = asyncio.run(run())
    assert err is not None and err.code() == grpc.StatusCode.RESOURCE_EXHAUSTED, err
    assert "max_constrained_requests is 1" in err.details()
    assert charged < 0.3  # (its matcher's CPU meanwhile, not a compile stopped at 0.3 s)


def test_an_executor_restarted_mid_stream_compiles_before_the_requests_come_back(server):
    schema = {"type": "object", "properties": {"name": {"type": "string", "maxLength": 8},
                                               "n": {"type": "integer", "minimum": 0, "maximum": 99}},
              "required": ["name", "n"], "additionalProperties": False}
    regex = "[a-z]{3}-[0-9]{2,4}"
    reqs = [api.Constraint(json_schema=json.dumps(schema), strict=True), api.Constraint(regex=regex)] * 3

    async def run():
        async with Client(server.address, api_key="key-bystander") as client:
            streamed = {"tokens": 0}

            async def one(i, c):
                out = Completion()
                async for msg in client.generate(f"r{i}", max_tokens=120, temperature=1.0, seed=i, constraint=c):
                    accumulate(out, msg)
                    streamed["tokens"] += len(msg.token_ids)
                return out

            tasks = [asyncio.create_task(one(i, c)) for i, c in enumerate(reqs)]
            while streamed["tokens"] < 6:
                await asyncio.sleep(0.005)
            os.kill(server.child_pid("executor"), signal.SIGKILL)
            return await asyncio.gather(*tasks)

    outs = asyncio.run(run())
    for c, out in zip(reqs, outs):
        assert out.finish_reason == "stop", out
        if c.regex:
            assert re.fullmatch(regex, out.text), out.text
        else:
            value = json.loads(out.text)
            assert set(value) == {"name", "n"} and 0 <= value["n"] <= 99
    assert server.saw("request_held_for_grammar")
