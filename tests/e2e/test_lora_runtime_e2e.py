"""Run-time LoRA adapters through real processes on loopback (#52): ``pagedkv serve --http-port --lora-root DIR
--max-loras 1`` serving tiny-llama with one device slot, and a tenants file in which alice and bob may each own
adapters and ops is an admin.

- alice loads "mine" (PEFT's adapter A) and bob loads his own "mine" (adapter B): each sees and gets only his own;
  requests of both take turns in the one slot (paged in from host memory, the least recently used out), and every
  greedy id equals PEFT's for the caller's adapter;
- over HTTP, vLLM's POST /v1/load_lora_adapter and /v1/unload_lora_adapter do the same, and /v1/models follows;
- refusals: a path outside --lora-root (PERMISSION_DENIED), a tenant past its max_adapters (RESOURCE_EXHAUSTED),
  one with none (PERMISSION_DENIED), a public load by a non-admin, an unload while a stream uses the adapter
  (FAILED_PRECONDITION; it works once the stream ends, and the name is NOT_FOUND after)."""

from __future__ import annotations

import asyncio

import grpc
import httpx
import pytest

from pagedkv.cli import free_port
from pagedkv.client import Client
from pagedkv.tenancy import hash_key
from tests.conftest import Server
from tests.support.hf_reference import random_prompts
from tests.support.lora_helpers import make_adapter, one_torch_thread, peft_greedy, peft_reference

pytestmark = pytest.mark.e2e

ALICE, BOB, CAROL, OPS = "key-alice", "key-bob", "key-carol", "key-ops"
TENANTS = f"""
[tenants.alice]
keys = ["{hash_key(ALICE)}"]
max_adapters = 1

[tenants.bob]
keys = ["{hash_key(BOB)}"]
max_adapters = 2

[tenants.carol]
keys = ["{hash_key(CAROL)}"]

[tenants.ops]
keys = ["{hash_key(OPS)}"]
admin = true
"""
SPECS = {"A": (8, ["q_proj", "v_proj"]), "B": (16, ["q_proj", "k_proj", "o_proj", "gate_proj", "down_proj"]),
         "C": (4, ["up_proj", "v_proj"])}
N = 10


@pytest.fixture(scope="module")
def stack(tiny_llama_dir, tmp_path_factory):
    root = tmp_path_factory.mktemp("lora-runtime")
    (root / "lora").mkdir()
    adapters = {name: make_adapter(tiny_llama_dir, root / "lora" / name, r, targets, seed=60 + i)
                for i, (name, (r, targets)) in enumerate(SPECS.items())}
    tenants = root / "tenants.toml"
    tenants.write_text(TENANTS)
    http, metrics = free_port(), free_port()
    server = Server("--http-port", str(http), "--metrics-port", str(metrics), "--num-pages", "160",
                    "--tenants-file", str(tenants), "--threads", "1", "--lora-root", str(root / "lora"),
                    "--max-loras", "1", "--max-lora-rank", "16")
    server.metrics = f"http://127.0.0.1:{metrics}/metrics"
    yield server, f"http://127.0.0.1:{http}/v1", peft_reference(tiny_llama_dir, adapters), root
    assert server.stop() == 0, server.log()


async def _greedy(address: str, key: str, prompt: list[int], adapter: str) -> list[int]:
    async with Client(address, api_key=key) as client:
        out = await client.complete(prompt, max_tokens=N, temperature=0, ignore_eos=True, adapter=adapter)
        return list(out.token_ids)


async def _code(call) -> grpc.StatusCode | None:
    try:
        await call
    except grpc.aio.AioRpcError as err:
        return err.code()
    return None


def test_tenants_own_adapters_take_turns_in_one_slot_and_match_peft(stack):
    server, _, reference, _ = stack
    prompts = random_prompts(21, [9, 14, 7, 11], 256)

    async def scenario():
        async with Client(server.address, api_key=ALICE) as alice, Client(server.address, api_key=BOB) as bob:
            a = await alice.load_adapter("mine", "A")
            b = await bob.load_adapter("mine", "B")
            assert (a.owner, b.owner, a.rank, b.rank) == ("alice", "bob", 8, 16) and a.num_pages > 0
            # one slot: alice's and bob's requests alternate through it
            jobs = [_greedy(server.address, ALICE if i % 2 == 0 else BOB, p, "mine") for i, p in enumerate(prompts)]
            got = await asyncio.gather(*jobs)
            for key in (BOB, ALICE):  # bob's then alice's: alice's adapter goes in again after bob's
                got.append(await _greedy(server.address, key, prompts[0], "mine"))
            seen = {t: [(x.name, x.owner, x.resident) for x in (await c.model_info()).adapters]
                    for t, c in (("alice", alice), ("bob", bob))}
            carol = await _code(_greedy(server.address, CAROL, prompts[0], "mine"))
            return got, seen, carol, (await alice.model_info()).adapters[0].num_page_ins
    got, seen, carol, page_ins = asyncio.run(scenario())
    with one_torch_thread():
        want = [peft_greedy(reference, "A" if i % 2 == 0 else "B", p, N) for i, p in enumerate(prompts)]
        want += [peft_greedy(reference, name, prompts[0], N) for name in ("B", "A")]
    assert got == want
    assert [s[:2] for s in seen["alice"]] == [("mine", "alice")] and [s[:2] for s in seen["bob"]] == [("mine", "bob")]
    assert carol == grpc.StatusCode.NOT_FOUND  # neither "mine" is hers: as if none existed
    assert page_ins >= 2  # paged in, out for bob's, and in again
    assert "lora_adapter_loaded" in server.log()
    gauges = {line.split(" ")[0]: float(line.split(" ")[1]) for line in httpx.get(server.metrics).text.splitlines()
              if line.startswith("pagedkv_lora_")}
    assert gauges['pagedkv_lora_adapters{state="loaded"}'] == 2 and gauges["pagedkv_lora_page_ins_total"] >= 3
    assert gauges['pagedkv_lora_adapters{state="resident"}'] == gauges['pagedkv_lora_adapters{state="host"}'] == 1
    assert [v for k, v in gauges.items() if k.startswith("pagedkv_lora_slots") and 'state="used"' in k] == [1]


def test_loads_are_bounded_by_the_root_and_the_tenants_file(stack):
    server, _, _, root = stack

    async def scenario():
        async with (Client(server.address, api_key=ALICE) as alice, Client(server.address, api_key=CAROL) as carol,
                    Client(server.address, api_key=BOB) as bob):
            return [await _code(bob.load_adapter("x", str(root))),  # (the directory above --lora-root)
                    await _code(bob.load_adapter("y", "../lora/../..")),
                    await _code(bob.load_adapter("z", "nope")),
                    await _code(alice.load_adapter("second", "C")),  # alice owns 1 already (max_adapters 1)
                    await _code(carol.load_adapter("c", "C")),  # max_adapters 0
                    await _code(bob.load_adapter("pub", "C", public=True)),  # only an admin
                    await _code(bob.load_adapter("mine", "C")),  # bob's own "mine" exists
                    await _code(bob.unload_adapter("nobody"))]
    codes = asyncio.run(scenario())
    s = grpc.StatusCode
    assert codes == [s.PERMISSION_DENIED, s.PERMISSION_DENIED, s.INVALID_ARGUMENT, s.RESOURCE_EXHAUSTED,
                     s.PERMISSION_DENIED, s.PERMISSION_DENIED, s.ALREADY_EXISTS, s.NOT_FOUND], codes


def test_http_load_use_and_unload_refused_while_in_use(stack):
    server, url, reference, _ = stack
    prompt = random_prompts(33, [10], 256)[0]
    ops = {"Authorization": f"Bearer {OPS}"}

    async def scenario():
        async with httpx.AsyncClient(timeout=60) as http:
            r = await http.post(f"{url}/load_lora_adapter", headers=ops,
                                json={"lora_name": "shared", "lora_path": "C", "public": True})
            assert r.status_code == 200 and "added successfully" in r.text, r.text
            models = (await http.get(f"{url}/models", headers={"Authorization": f"Bearer {CAROL}"})).json()
            listed = {m["id"]: m.get("parent") for m in models["data"]}
            assert "shared" in listed and "mine" not in listed, listed  # public (no adapters list: every one)
            async with Client(server.address, api_key=CAROL) as carol:
                stream = carol.generate(prompt, max_tokens=200, temperature=0, ignore_eos=True, adapter="shared")
                first = await stream.__anext__()
                busy = await http.post(f"{url}/unload_lora_adapter", headers=ops, json={"lora_name": "shared"})
                await stream.aclose()
            await asyncio.sleep(0.5)  # (the stream's end reaches the scheduler)
            done = await http.post(f"{url}/unload_lora_adapter", headers=ops, json={"lora_name": "shared"})
            gone = await _code(_greedy(server.address, CAROL, prompt, "shared"))
            return first, busy, done, gone
    first, busy, done, gone = asyncio.run(scenario())
    assert first.token_ids
    assert busy.status_code == 409 and "in use by 1 request" in busy.text, busy.text
    assert done.status_code == 200 and "removed successfully" in done.text, done.text
    assert gone == grpc.StatusCode.NOT_FOUND
