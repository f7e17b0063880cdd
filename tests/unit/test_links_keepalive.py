"""Links that stay up, in one process (issue 13, finding 5): client and server keepalive options agree and grpc
knows every option name; a lost Run stream keeps the published pages, except those that unconfirmed page
operations were filling; the same executor id keeps the cache on reconnect, another id forgets it (FakeExecutors
check that every read finds the KV that was written). The real links: tests/e2e/test_links_keepalive.py."""

from __future__ import annotations

import asyncio
from pathlib import Path

import pytest

from pagedkv import grpc_common
from scheduler_svc import engine as engine_mod
from scheduler_svc.pages import PagePool
from scheduler_svc.policy import Mode, PreemptionConfig, PreemptionCosts
from scheduler_svc.scheduler import SchedulerConfig
from tests.support.driven import Driven, driven
from tests.support.fake_cluster import Box, collect, new_cluster, until  # the boxes fixture: tests/conftest.py
from tests.support.fake_executor import FakeExecutor, drive, make_request

pytestmark = pytest.mark.unit


def option(options, name):
    return dict(options)[name]


# ---- the policy ----------------------------------------------------------------------------------
def test_every_keepalive_option_name_is_one_grpc_knows():
    """grpc takes any string as an option and ignores those it does not know: check each name against the
    ones compiled into grpc core."""
    from grpc._cython import cygrpc

    core = Path(cygrpc.__file__).read_bytes()
    for name, _ in [*grpc_common.KEEPALIVE_OPTIONS, *grpc_common.SERVER_KEEPALIVE_OPTIONS]:
        assert name.encode() + b"\0" in core, f"grpc core has no option {name!r}: it would be ignored"


def test_clients_ping_no_faster_than_servers_accept():
    client, server = grpc_common.KEEPALIVE_OPTIONS, grpc_common.SERVER_KEEPALIVE_OPTIONS
    interval = option(client, "grpc.keepalive_time_ms")
    assert interval >= 2 * option(server, "grpc.http2.min_ping_interval_without_data_ms"), "timer slack"
    # clients ping with no call in flight; servers must not apply the 2-hour rule for idle connections
    assert option(client, "grpc.keepalive_permit_without_calls") == 1
    assert option(server, "grpc.keepalive_permit_without_calls") == 1
    assert option(client, "grpc.http2.max_pings_without_data") == 0  # else pings stop on a quiet stream
    assert option(server, "grpc.http2.max_ping_strikes") > 0  # a client pinging too fast is still cut off
    timeout = option(client, "grpc.keepalive_timeout_ms")
    # grpc sends one ping at a time: an unanswered flow-control ping must not hold the keepalive back longer
    assert option(client, "grpc.http2.ping_timeout_ms") <= timeout
    bound = (interval + timeout) / 1000
    assert bound == grpc_common.DEAD_PEER_BOUND_S

# ---- the prefix cache across a lost stream (one process) ------------------------------------------
BS = 4


def swap_scheduler() -> Driven:
    cfg = SchedulerConfig(max_num_seqs=8, max_num_batched_tokens=64, max_model_len=64, watermark=0,
                          preemption=PreemptionConfig(mode=Mode.SWAP))
    return driven(PagePool(10, BS), cfg, [2], host_pool=PagePool(20, BS, min_pages=0),
                     costs=PreemptionCosts(page_bytes=65536, swap_bytes_per_second=4e9,
                                           prefill_seconds_per_token=70e-6))


def findable(s: Driven, hashes) -> list[str]:
    return ["device" if s.pool.lookup(h) is not None else "host" if s.host.lookup(h) is not None else "-"
            for h in hashes]


@pytest.mark.parametrize("ran", [False, True], ids=["plan-lost", "result-lost"])
def test_a_lost_stream_forgets_only_the_pages_its_unconfirmed_spills_wrote(ran):
    """A plan that spills cached pages to the host is lost (never ran, or ran and its result was lost): those
    host copies are not findable afterwards; every page confirmed before stays findable, and a request that
    hits them after the reconnect reads the right KV (the executor kept its pages)."""
    s, ex = swap_scheduler(), FakeExecutor(BS)
    prefix = list(range(30, 58))  # 7 pages
    first = make_request(0, 0, 2, prompt=prefix + [3])
    s.add(first)
    drive(s, executor=ex)
    assert findable(s, first.page_hashes[:7]) == ["device"] * 7
    s.add(make_request(1, 0, 2, prompt=[101] * 33))  # 9 pages: evicts (spills) some of the prefix
    plan, _ = s.schedule()
    spilled = {c.src for c in plan.page_ops.swap_out}
    assert spilled, "the plan spills nothing: the test does not test anything"
    if ran:
        ex.step(plan)
    moved, ended = s.evacuate(keep_cache=True)
    assert [r.request_id for r in moved] == ["r1"] and not ended
    where = findable(s, first.page_hashes[:7])
    assert "host" not in where and 0 < where.count("device") == 7 - len(spilled)
    lead = where.index("-")
    s.check_integrity()
    again = make_request(2, 0, 2, prompt=prefix + [4])
    s.add(again)
    drive(s, executor=ex)  # the FakeExecutor fails a step that reads KV nobody wrote
    assert again.num_cached_tokens == lead * BS


def test_a_lost_stream_forgets_the_device_pages_its_unconfirmed_swap_ins_wrote():
    s, ex = swap_scheduler(), FakeExecutor(BS)
    prefix = list(range(30, 58))
    first = make_request(0, 0, 2, prompt=prefix + [3])
    s.add(first)
    drive(s, executor=ex)
    for i in (1, 2):  # push the prefix out of the device tier, into the host tier (confirmed)
        s.add(make_request(i, 0, 2, prompt=[100 + i] * 33))
        drive(s, executor=ex)
    assert findable(s, first.page_hashes[:7]) == ["host"] * 7
    s.add(make_request(3, 0, 2, prompt=prefix + [4]))
    plan, _ = s.schedule()  # brings the prefix back: the device copies are findable from this plan on
    assert len(plan.page_ops.swap_in) == 7 and findable(s, first.page_hashes[:7]) == ["device"] * 7
    s.evacuate(keep_cache=True)  # ... but it was lost
    assert findable(s, first.page_hashes[:7]) == ["host"] * 7
    s.check_integrity()
    again = make_request(4, 0, 2, prompt=prefix + [5])
    s.add(again)
    drive(s, executor=ex)
    assert again.num_cached_tokens == 28 and s.counters.spill_hits == 14


def test_evacuate_without_keep_cache_forgets_everything():
    s, ex = swap_scheduler(), FakeExecutor(BS)
    first = make_request(0, 0, 2, prompt=list(range(30, 58)) + [3])
    s.add(first)
    drive(s, executor=ex)
    s.evacuate()
    assert findable(s, first.page_hashes[:7]) == ["-"] * 7


@pytest.mark.parametrize("how", ["same", "restarted", "wiped"])
def test_a_reconnect_keeps_the_cache_only_for_the_same_executor_and_session(boxes, how):
    """The Run stream drops (idle); the engine reconnects to the same address. Same executor, pages kept: the
    repeated prompt hits (and the FakeExecutor checks the KV it reads). Another executor id (a restarted
    process), or the same one answering that it zeroed its pages (x-pagedkv-pages: fresh): no hit."""
    async def scenario():
        boxes["a:1"] = Box(64)
        c = new_cluster()
        c.start()
        c.set_addresses({"a:1"})
        await asyncio.wait_for(c.any_up.wait(), 2)
        engine = c.engines["a:1"]
        prompt = list(range(3, 67))
        first = make_request(1, 0, 4, prompt=prompt)
        c.add_request(first)
        assert (await collect(first))[1] is None
        old_id, old_call = engine.info().executor_id, engine.client.call
        if how == "restarted":
            boxes["a:1"].restart()
        elif how == "wiped":  # another scheduler's session attached meanwhile: same process, zeroed pages
            boxes["a:1"].executor = FakeExecutor(16)
            engine.client.pages_kept = False
        old_call.cancel()  # the stream ends: noticed while idle
        await until(lambda: engine.state is engine_mod.State.UP and engine.client.call is not old_call)
        again = make_request(2, 0, 4, prompt=prompt + [9])
        c.add_request(again)
        out = await asyncio.wait_for(collect(again), 3)
        await c.stop()
        return out, again.num_cached_tokens, engine.info().executor_id != old_id
    (tokens, error), cached, new_id = asyncio.run(scenario())
    assert error is None and len(tokens) == 4 and new_id == (how == "restarted")
    assert cached == (64 if how == "same" else 0)
