"""The scheduler-wide tenant ledger across a cluster's executors in one process (as test_cluster_unit.py: real
Cluster, Engine and Scheduler objects drive FakeExecutors through a stand-in for the gRPC client): quotas and
concurrency limits hold for the sum over executors, fractions are of the executors that serve, an executor that is
down leaves the ledger until it is up again, and a reload counts an executor never up."""

from __future__ import annotations

import asyncio

import pytest

from scheduler_svc import engine as engine_mod

# (the boxes fixture: tests/conftest.py)
from tests.support.fake_cluster import Box, FakeClient, collect, new_cluster, until, up_cluster
from tests.support.fake_executor import make_request

pytestmark = pytest.mark.unit


# ---- tenant limits across executors (the scheduler-wide tenant ledger) -----------------------------------
def _ledger_tenants():
    from pagedkv.tenancy import Tenant, Tenants

    return Tenants([Tenant("noisy", page_quota=20, max_concurrent_requests=4), Tenant("quiet")])


def _watch_limits(c, monkeypatch, samples: list) -> None:
    """After every step of any executor: the noisy tenant's pages and running sequences over all executors."""
    async def step(self, plan):
        result = await FakeClient.__dict__["_real_step"](self, plan)
        pages = seats = 0
        for e in c.engines.values():
            if e.scheduler is not None:
                pages += e.scheduler.kv.pool.used_by["noisy"]
                seats += sum(r.n for r in e.scheduler.queues.running if r.tenant == "noisy")
        samples.append((pages, seats))
        return result
    monkeypatch.setattr(FakeClient, "_real_step", FakeClient.step, raising=False)
    monkeypatch.setattr(FakeClient, "step", step)


def test_tenant_quota_and_concurrency_hold_for_the_sum_over_three_executors(boxes, monkeypatch):
    """A tenant limited to 4 concurrent requests and 20 pages floods a 3-executor cluster: sampled after every
    step of every executor, it never holds more than 20 pages or runs more than 4 requests in total (per
    executor limits would allow 3x both), and every request still finishes."""
    samples: list[tuple[int, int]] = []

    async def scenario():
        boxes.update({"a:1": Box(64), "b:1": Box(64), "c:1": Box(64)})
        c = new_cluster(tenants=_ledger_tenants())
        _watch_limits(c, monkeypatch, samples)
        c.start()
        c.set_addresses({"a:1", "b:1", "c:1"})
        await until(lambda: all(e.state is engine_mod.State.UP for e in c.engines.values()) and len(c.engines) == 3)
        for box in boxes.values():
            box.delay = 0.001
        flood = [make_request(i, 40, 30, tenant="noisy") for i in range(24)]
        quiet = [make_request(100 + i, 20, 10, tenant="quiet") for i in range(6)]
        for req in flood + quiet:
            c.add_request(req)
        results = await asyncio.wait_for(asyncio.gather(*(collect(r) for r in flood + quiet)), 30)
        placed = {a: e.info().num_placed for a, e in c.engines.items()}
        for e in c.engines.values():
            e.check_integrity()
        await c.stop()
        return results, placed
    results, placed = asyncio.run(scenario())
    assert all(error is None for _, error in results)
    assert [len(tokens) for tokens, _ in results] == [30] * 24 + [10] * 6
    assert sum(1 for n in placed.values() if n) == 3, placed  # the flood spread over the executors
    assert samples and max(p for p, _ in samples) <= 20 and max(s for _, s in samples) <= 4
    assert max(s for _, s in samples) == 4  # the limit was reached (the test would pass with a tenant held to 1)


def test_a_tenant_quota_given_as_a_fraction_is_of_every_executor_together(boxes, tmp_path):
    """page_quota = 0.25 on two executors of 64 pages is 32 pages in total; it follows an executor that joins."""
    path = tmp_path / "tenants.toml"
    path.write_text('[tenants.noisy]\npage_quota = 0.25\n[tenants.quiet]\n')

    async def scenario():
        from pagedkv.tenancy import Tenants

        boxes.update({"a:1": Box(64), "b:1": Box(64), "c:1": Box(128)})
        c = new_cluster(tenants=Tenants.load(path, 64))
        c.start()
        c.set_addresses({"a:1", "b:1"})
        await until(lambda: len([e for e in c.engines.values() if e.state is engine_mod.State.UP]) == 2)
        two = c.tenants.get("noisy").page_quota
        c.set_addresses({"a:1", "b:1", "c:1"})
        await until(lambda: c.engines["c:1"].state is engine_mod.State.UP)
        three = c.tenants.get("noisy").page_quota
        await c.stop()
        return two, three
    assert asyncio.run(scenario()) == (32, 64)


# ---- an executor that is down serves no tenant: the ledger's members are the executors that serve ----------
def _tenants(tmp_path, text: str, num_pages: int):
    from pagedkv.tenancy import Tenants

    path = tmp_path / "tenants.toml"
    path.write_text(text)
    return Tenants.load(path, num_pages)


async def _take_down(c, boxes, address: str) -> None:
    boxes[address].alive = False
    c.engines[address].client.drop()  # (its Run stream ends, as a real executor's does when it dies)
    await until(lambda: c.engines[address].state is engine_mod.State.DOWN)


async def _bring_up(c, boxes, address: str) -> None:
    boxes[address].alive = True
    await until(lambda: c.engines[address].state is engine_mod.State.UP)


def _caller(key: str):
    from tests.support.fake_grpc import Context

    class Caller(Context):
        def invocation_metadata(self):
            return (("authorization", f"Bearer {key}"),)
    return Caller()


def _service(c):
    import structlog

    from scheduler_svc.api import GenerationService
    from scheduler_svc.validation import Limits
    from tests.support.fake_executor import NullTokenizer

    return GenerationService(c, NullTokenizer(), Limits(max_model_len=2048, vocab_size=300), {},
                             structlog.get_logger())


def test_a_down_executor_leaves_the_tenant_ledger_until_it_is_up_again(boxes, tmp_path):
    """page_quota = 0.25 of two 64-page executors is 32 pages; while one is down the quota is of the one that
    serves (16), and it is 32 again once the lost one is back. The survivor serves meanwhile."""
    tenants = _tenants(tmp_path, '[tenants.noisy]\npage_quota = 0.25\n[tenants.quiet]\n', 64)

    async def scenario():
        boxes.update({"a:1": Box(64), "b:1": Box(64)})
        c = await up_cluster({"a:1", "b:1"}, tenants=tenants)
        quotas, members = [c.tenants.get("noisy").page_quota], [len(c.ledger.members)]
        await _take_down(c, boxes, "b:1")
        quotas.append(c.tenants.get("noisy").page_quota)
        members.append(len(c.ledger.members))
        req = make_request(1, 20, 10, tenant="noisy")
        c.add_request(req)
        tokens, error = await asyncio.wait_for(collect(req), 5)
        await _bring_up(c, boxes, "b:1")
        quotas.append(c.tenants.get("noisy").page_quota)
        members.append(len(c.ledger.members))
        await c.stop()
        return quotas, members, (len(tokens), error)
    assert asyncio.run(scenario()) == ([32, 16, 32], [2, 1, 2], (10, None))


def test_a_reserve_larger_than_the_survivors_pool_is_cut_to_it_and_no_capacity_goes_negative(boxes, tmp_path):
    """quiet reserves 48 pages of a 64 + 32 page cluster. With the 64-page executor down the 32 pages that serve
    cannot keep 48 free: the reserve is cut to 32 (before, the file's 48 stayed and noisy's capacity was -16).
    noisy can hold nothing now and the API refuses its request with the limit named; quiet is served. Once the
    executor is back, the reserve is 48 again."""
    from pagedkv.tenancy import hash_key
    from tests.support.fake_grpc import Aborted

    tenants = _tenants(tmp_path, f'[tenants.noisy]\nkeys = ["{hash_key("n")}"]\n'
                                 f'[tenants.quiet]\nkeys = ["{hash_key("q")}"]\nreserved_pages = 48\n', 64)

    async def generate(service, key: str):
        from pagedkv.client import Client

        req = Client.build_request([5] * 20, max_tokens=4, request_id=key)
        try:
            return [m async for m in service.Generate(req, _caller(key))][-1].usage.completion_tokens
        except Aborted as err:
            return err.code.name, err.details

    async def scenario():
        boxes.update({"a:1": Box(64), "b:1": Box(32)})
        c = await up_cluster({"a:1", "b:1"}, tenants=tenants)
        service = _service(c)
        await _take_down(c, boxes, "a:1")
        survivor = c.engines["b:1"].scheduler
        down = (c.tenants.get("quiet").reserved_pages,
                {t: survivor.fit_limits(t).capacity for t in ("noisy", "quiet")},
                await generate(service, "n"), await generate(service, "q"))
        await _bring_up(c, boxes, "a:1")
        up = (c.tenants.get("quiet").reserved_pages, c.fit_limits("noisy").capacity, await generate(service, "n"))
        await c.stop()
        return down, up
    (reserve, capacities, noisy, quiet), up = asyncio.run(scenario())
    assert reserve == 32 and capacities == {"noisy": 0, "quiet": 32}
    assert noisy[0] == "INVALID_ARGUMENT" and "the 0 pages tenant noisy can hold" in noisy[1], noisy
    assert quiet == 4
    assert up == (48, 32, 4)  # (a's part of the reserve: 48 * 64 / 96 = 32 of its 64 pages)


def test_live_requests_get_their_limits_again_when_an_executor_goes_down_and_comes_back(boxes, tmp_path):
    """noisy's quota is 0.25 of the pages that serve: 32 of two 64-page executors, 16 with one. A request
    running on the survivor holds max_len 512 tokens (32 pages), 256 while the other is down, 512 again after
    (it then finishes all its 400 tokens, which 256 would cut short); a request already longer than 256 tokens
    when the other goes down ends with the error a reload gives."""
    tenants = _tenants(tmp_path, '[tenants.noisy]\npage_quota = 0.25\n', 64)

    def home_and_other(c, req) -> tuple[str, str]:
        home = next(a for a, e in c.engines.items() if req.request_id in e.scheduler.queues.requests)
        return home, next(a for a in c.engines if a != home)

    async def scenario():
        boxes.update({"a:1": Box(64), "b:1": Box(64)})
        c = await up_cluster({"a:1", "b:1"}, tenants=tenants)
        small = make_request(1, 20, 400, tenant="noisy")
        c.add_request(small)
        home, other = home_and_other(c, small)
        boxes[home].delay = 0.01  # (it must not reach 256 tokens while the other is down)
        task = asyncio.create_task(collect(small))
        await until(lambda: len(small.output_ids) >= 2)
        max_lens = [small.max_len]
        await _take_down(c, boxes, other)
        max_lens.append(small.max_len)
        await _bring_up(c, boxes, other)
        max_lens.append(small.max_len)
        boxes[home].delay = 0.0
        tokens, error = await asyncio.wait_for(task, 10)

        big = make_request(2, 300, 400, tenant="noisy")  # 300 tokens: 19 pages, more than 16
        c.add_request(big)
        home, other = home_and_other(c, big)
        boxes[home].delay = 0.01
        task = asyncio.create_task(collect(big))
        await until(lambda: len(big.output_ids) >= 1)
        await _take_down(c, boxes, other)
        ended = big.finish is not None  # (at once: not when it next grows)
        c.abort(big.group)
        big_tokens, big_error = await asyncio.wait_for(task, 5)
        await c.stop()
        return max_lens, (len(tokens), error), ended, big_error, len(big_tokens)
    max_lens, small, ended, big_error, big_tokens = asyncio.run(scenario())
    assert max_lens == [512, 256, 512] and small == (400, None)
    assert ended and big_error == "tenant noisy's new limits hold 16 pages; this request needs more"
    assert 1 <= big_tokens < 400


def test_model_info_adds_up_the_fair_shares_of_the_executors_that_serve(boxes, tmp_path):
    """noisy, the only active tenant, is entitled to every page that serves: 128 of two 64-page executors, 64
    with one down. The down executor (which served noisy before) adds nothing to ModelInfo's fair share, as it
    adds nothing to num_pages; before, its snapshot still added 64. (A fair share follows the other tenants'
    activity: only a tenant with the cluster view, here an admin, is shown it.)"""
    from pagedkv.api.v1 import api_pb2 as api
    from pagedkv.tenancy import hash_key

    tenants = _tenants(tmp_path, f'[tenants.noisy]\nkeys = ["{hash_key("n")}"]\nadmin = true\n[tenants.quiet]\n', 64)

    async def model_info(service) -> tuple[float, int]:
        info = await service.ModelInfo(api.ModelInfoRequest(), _caller("n"))
        return round(info.tenant.fair_share_pages, 3), info.num_pages

    async def scenario():
        boxes.update({"a:1": Box(64), "b:1": Box(64)})
        c = await up_cluster({"a:1", "b:1"}, tenants=tenants)
        service = _service(c)
        short, long = make_request(1, 20, 2, tenant="noisy"), make_request(2, 20, 10_000, tenant="noisy")
        c.add_request(long)
        c.add_request(short)
        homes = {a for a, e in c.engines.items()
                 if {long.request_id, short.request_id} & e.scheduler.queues.requests.keys()}
        for box in boxes.values():
            box.delay = 0.005
        assert (await asyncio.wait_for(collect(short), 5))[1] is None
        await until(lambda: len(long.output_ids) >= 1)
        both = await model_info(service)
        other = next(a for a, e in c.engines.items() if long.request_id not in e.scheduler.queues.requests)
        await _take_down(c, boxes, other)
        one = await model_info(service)
        c.abort(long.group)
        await c.stop()
        return len(homes), both, one
    assert asyncio.run(scenario()) == (2, (128.0, 128), (64.0, 64))


def test_a_reload_counts_an_executor_never_up_as_big_as_the_first(boxes, tmp_path):
    """Two 64-page addresses, the second never up: start-up checked the file against 2 x 64 pages, and so does a
    reload (a quota of 100 pages fits 128; before, only the 64 pages that had connected counted and the reload
    refused it). A removed address no longer counts."""
    from pagedkv.tenancy import InvalidTenant

    path = tmp_path / "tenants.toml"
    path.write_text("[tenants.big]\npage_quota = 100\n")

    async def scenario():
        boxes.update({"a:1": Box(64), "b:1": Box(64)})
        boxes["b:1"].alive = False
        c = new_cluster()
        c.reference.num_device_pages = 64  # (the first executor's Describe, as serve gives it)
        c.start()
        c.set_addresses({"a:1", "b:1"})
        await until(lambda: c.engines["a:1"].state is engine_mod.State.UP)
        ended = c.set_tenants(str(path))
        quota = c.tenants.get("big").page_quota  # fitted to the 64 pages that serve
        c.set_addresses({"a:1"})
        await until(lambda: "b:1" not in c.engines or c.engines["b:1"].removed)
        try:
            c.set_tenants(str(path))
            refused = ""
        except InvalidTenant as err:
            refused = str(err)
        await c.stop()
        return ended, quota, refused
    ended, quota, refused = asyncio.run(scenario())
    assert (ended, quota) == (0, 64)
    assert "100 pages; must be in [0, 64]" in refused
