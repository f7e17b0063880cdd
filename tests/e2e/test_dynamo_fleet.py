"""Two pagedkv schedulers behind NVIDIA Dynamo's real frontend and KV router (#47's "done when"), all real processes
on loopback: ``python -m dynamo.frontend --router-mode kv`` (file discovery, TCP request plane, ZMQ events), two
``pagedkv serve --model tiny-llama``, each with a ``pagedkv dynamo-worker`` sidecar, and the edge gateway
(``pagedkv gateway --edge-upstream``) that signs tenants in front of the frontend. No etcd, no NATS.

Which worker served a request, and how much of its prompt the router believed that worker held, come from
Dynamo's own answer (``nvext.extra_fields: ["worker_id", "timing"]``: ``worker_id.decode_worker_id`` and
``timing.kv_hit_rate``); how much pagedkv served from its cache, from ``usage.prompt_tokens_details.cached_tokens``.

Skipped only when Dynamo is not importable (``make install-dynamo``)."""

from __future__ import annotations

import json
import os
import signal
import sys

import httpx
import pytest

pytest.importorskip("dynamo.frontend", reason="NVIDIA Dynamo is not installed (make install-dynamo)")

from pagedkv.cli import free_port  # noqa: E402
from tests.conftest import wait_until  # noqa: E402
from tests.support.dynamo_fleet import (  # noqa: E402
    ALPHA_KEY,
    BETA_KEY,
    FLEET_SECRET,
    LOOPBACK,
    MODEL,
    NUM_PAGES,
    OPS_KEY,
    TIGHT_KEY,
    Fleet,
    Process,
    cached,
    document,
    dynamo_env,
    kill_the_busy_scheduler,
    router_event_errors,
    router_hit,
    wait_for_the_router,
    worker_of,
)

pytestmark = pytest.mark.e2e


@pytest.fixture(scope="module")
def fleet(model_cache, tmp_path_factory):
    f = Fleet(tmp_path_factory.mktemp("fleet"))
    yield f
    codes = f.close()
    assert all(code == 0 for code in codes.values()), codes  # each drained and stopped on SIGTERM


def test_repeats_go_to_the_scheduler_that_holds_them(fleet):
    prompts = [document(i) for i in range(6)]
    first = [fleet.complete(p, via="edge", key=ALPHA_KEY) for p in prompts]
    wait_for_the_router(fleet)
    again = [fleet.complete(p, via="edge", key=ALPHA_KEY) for p in prompts]
    same = sum(worker_of(a) == worker_of(b) for a, b in zip(first, again))
    hits = sum(cached(b) > 0 for b in again)
    assert same >= 0.9 * len(prompts) and hits >= 0.9 * len(prompts), (
        [(worker_of(a), worker_of(b), cached(b), router_hit(b)) for a, b in zip(first, again)], fleet.logs())
    # the router knew: it expected the repeat's prefix on its worker (from the scheduler's KV events)
    assert all(router_hit(b) > 0 for b in again), [router_hit(b) for b in again]
    assert all(cached(a) == 0 for a in first)


def test_another_tenants_identical_prompt_gets_no_cached_tokens(fleet):
    prompt = document(40)
    alpha = fleet.complete(prompt, via="edge", key=ALPHA_KEY)
    wait_for_the_router(fleet)
    alpha_again = fleet.complete(prompt, via="edge", key=ALPHA_KEY)
    beta = fleet.complete(prompt, via="edge", key=BETA_KEY)
    assert cached(alpha) == 0 and cached(alpha_again) > 0, (alpha, alpha_again)  # the same tenant hits...
    assert router_hit(alpha_again) > 0, alpha_again
    assert cached(beta) == 0, beta  # ...the other does not, in pagedkv
    assert router_hit(beta) == 0, beta  # nor in the router: alpha's pages carry alpha's salt


def test_evictions_reach_the_router(fleet):
    prompt = document(80)
    holder = worker_of(fleet.complete(prompt, via="edge", key=ALPHA_KEY))
    wait_for_the_router(fleet)
    repeat = fleet.complete(prompt, via="edge", key=ALPHA_KEY)
    assert worker_of(repeat) == holder and router_hit(repeat) > 0 and cached(repeat) > 0, repeat
    # fill the holder's pages with other prompts, straight to its scheduler (NUM_PAGES pages, 7 a prompt)
    server = fleet.server_of[holder]

    async def fill() -> None:
        from pagedkv.client import Client

        async with Client(server.address, api_key=OPS_KEY) as client:
            for i in range(100, 100 + 2 * NUM_PAGES // 6):
                await client.complete(document(i), max_tokens=2, temperature=0)

    import asyncio

    asyncio.run(fill())
    wait_for_the_router(fleet)
    after = fleet.complete(prompt, via="edge", key=ALPHA_KEY)
    assert router_hit(after) == 0 and cached(after) == 0, (after, fleet.logs())
    assert router_event_errors(fleet) == []


def test_a_scheduler_killed_under_a_seeded_stream_leaves_the_text_identical(fleet):
    body = {"model": MODEL, "prompt": document(200), "max_tokens": 400, "temperature": 0.8, "seed": 1234,
            "ignore_eos": True}
    reference = fleet.frontend.post("/v1/completions", json=body)
    assert reference.status_code == 200, reference.text
    want = reference.json()["choices"][0]["text"]

    text, killed = [], None
    with fleet.frontend.stream("POST", "/v1/completions", json={**body, "stream": True}) as r:
        assert r.status_code == 200
        for line in r.iter_lines():
            if not line.startswith("data: ") or line == "data: [DONE]":
                continue
            event = json.loads(line.removeprefix("data: "))
            assert "error" not in event, event
            for choice in event.get("choices", []):
                text.append(choice.get("text") or "")
            if killed is None:  # at the first chunk: the request runs on its scheduler for another ~390 tokens
                killed = kill_the_busy_scheduler(fleet)
    assert killed is not None
    assert "".join(text) == want, fleet.logs()
    # its sidecar left Dynamo's discovery while the scheduler was away, and came back once it served again
    worker = fleet.workers[killed]
    assert wait_until(lambda: [e["event"] for e in worker.events if e.get("event", "").startswith(
        "dynamo_worker_") and e["event"] != "dynamo_worker_start"][-2:] == ["dynamo_worker_unready",
                                                                         "dynamo_worker_ready"], timeout=60), \
        worker.log()
    # the restarted scheduler's events (from a snapshot: Cleared, then its pages) left the router a consistent view
    after = [fleet.complete(document(i), via="edge", key=ALPHA_KEY) for i in range(500, 503)]
    assert all(cached(a) == 0 for a in after) and router_event_errors(fleet) == []


def test_a_full_queue_sends_the_request_to_the_other_worker(fleet):
    """The scheduler's RESOURCE_EXHAUSTED "queue full" comes back to Dynamo as Disconnected, which its frontend
    (--migration-limit 3) migrates: the request is served by the other worker, not failed. Tenant tight may run one
    request and queue one per scheduler; both are taken on the first scheduler. A second frontend, in round-robin
    mode, sends two requests of tight's: one of them, at least, goes to the full scheduler first (the KV router would
    weigh pages against load, and pinning a worker pins its migrations too)."""
    import asyncio

    from pagedkv.client import Client
    from pagedkv.fleet_salt import TENANT_META_HEADER, make_assertion

    full, other = fleet.servers
    sidecar = fleet.workers[0]
    port = free_port()
    rr = Process("round-robin frontend", [
        sys.executable, "-m", "dynamo.frontend", "--http-host", LOOPBACK, "--http-port", str(port), "--router-mode",
        "round-robin", "--discovery-backend", "file", "--request-plane", "tcp", "--event-plane", "zmq",
        "--namespace", "dynamo", "--migration-limit", "3"], dynamo_env(fleet.kv_dir))
    frontend = httpx.Client(base_url=f"http://{LOOPBACK}:{port}", timeout=120)

    def serving() -> bool:
        try:
            return [m["id"] for m in frontend.get("/v1/models").json()["data"]] == [MODEL]
        except (httpx.HTTPError, ValueError, KeyError):
            return False

    def refusals() -> int:
        return sum(e.get("event") == "dynamo_request_failed" and e.get("code") == "RESOURCE_EXHAUSTED"
                   for e in list(sidecar.events))

    def as_tight(i: int) -> dict:
        signed = {TENANT_META_HEADER: make_assertion(FLEET_SECRET.encode(), "tight")}  # (as the edge would)
        r = frontend.post("/v1/completions", headers=signed,
                          json={"model": MODEL, "prompt": document(700 + i), "max_tokens": 4, "temperature": 0})
        assert r.status_code == 200, r.text
        return r.json()

    async def computed(address: str) -> int:
        async with Client(address, api_key=OPS_KEY) as ops:
            return (await ops.model_info()).num_computed_tokens

    async def scenario() -> tuple[list[dict], int]:
        async with Client(full.address, api_key=TIGHT_KEY) as tight, Client(full.address, api_key=OPS_KEY) as ops:
            long = dict(max_tokens=400, ignore_eos=True, temperature=0)
            held = [asyncio.create_task(tight.complete(document(699), **long)) for _ in range(2)]  # runs, waits
            while (info := await ops.model_info()).num_waiting < 1 or info.num_running < 1:
                assert not any(t.done() for t in held), [t.result() for t in held if t.done()]
                await asyncio.sleep(0.02)
            before = await computed(other.address)
            executor = full.child_pid("executor")
            os.kill(executor, signal.SIGSTOP)  # the held requests stay held, however long the frontend takes
            try:
                answers = [await asyncio.to_thread(as_tight, i) for i in range(2)]
            finally:
                os.kill(executor, signal.SIGCONT)
            served_elsewhere = await computed(other.address) - before
            for t in held:
                await t
            return answers, served_elsewhere

    try:
        assert wait_until(serving, timeout=120, interval=0.5), rr.log()
        before = refusals()
        answers, served_elsewhere = asyncio.run(scenario())
    finally:
        frontend.close()
        code = rr.stop()
    assert refusals() > before, sidecar.log()
    assert all(a["choices"][0]["finish_reason"] == "length" for a in answers), answers
    # both were served by the other scheduler (nvext.worker_id would name the worker first chosen)
    assert served_elsewhere >= sum(a["usage"]["prompt_tokens"] for a in answers), (served_elsewhere, answers)
    assert code == 0


def test_a_client_that_goes_away_aborts_the_request_in_pagedkv(fleet):
    body = {"model": MODEL, "prompt": document(400), "max_tokens": 400, "ignore_eos": True, "stream": True}
    chunks, request_id = 0, ""
    with fleet.frontend.stream("POST", "/v1/completions", json=body) as r:
        assert r.status_code == 200
        for line in r.iter_lines():
            if line.startswith("data: {"):
                chunks += 1
                request_id = json.loads(line.removeprefix("data: "))["id"].removeprefix("cmpl-")  # Dynamo's context id
            if chunks == 5:
                break  # (closing the response closes the connection: the client is gone)

    def cancelled() -> bool:  # the scheduler's log: the stream went away before its last message
        return any("request_cancelled" in line and f"request_id={request_id}" in line
                   for s in fleet.servers for line in s.log().splitlines())

    assert wait_until(cancelled, timeout=60), fleet.logs()


def test_what_cannot_map_is_refused_naming_it(fleet):
    for extra, field in (({"n": 2}, "sampling_options.n"), ({"best_of": 3}, "sampling_options.best_of")):
        r = fleet.frontend.post("/v1/completions", json={"model": MODEL, "prompt": "x", "max_tokens": 2, **extra})
        assert r.status_code == 400 and field in r.json()["message"], r.text
    # a tenant assertion a client forged (the frontend passes x-dynamo-meta-* on to the worker): the MAC fails
    forged = {"x-dynamo-meta-pagedkv-tenant": "alpha.9999999999." + "0" * 64}
    r = fleet.frontend.post("/v1/completions", headers=forged, json={"model": MODEL, "prompt": "x", "max_tokens": 2})
    assert r.status_code == 400 and "x-dynamo-meta-pagedkv-tenant: bad MAC" in r.json()["message"], r.text
