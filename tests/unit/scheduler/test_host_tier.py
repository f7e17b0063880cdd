"""HostTier (host_tier.py) through KVManager, without a planner: what a swap-out and a swap-in take from each pool,
what they cost beforehand, and the copies they record for the next plan."""

from __future__ import annotations

import pytest

from scheduler_svc.detokenizer import IncrementalDetokenizer
from scheduler_svc.kv_manager import KVManager
from scheduler_svc.pages import tier_pools
from scheduler_svc.prefix_cache import tenant_root
from scheduler_svc.request import Request, Sampling
from scheduler_svc.snapshot import Counters
from tests.support.fake_executor import NullTokenizer

pytestmark = pytest.mark.unit

BS = 2


def request(tokens: list[int]) -> Request:
    return Request(request_id="r", prompt_ids=list(tokens), sampling=Sampling(max_tokens=4), arrival=0,
                   detokenizer=IncrementalDetokenizer(NullTokenizer(), tokens, [], False), tenant="default",
                   hash_root=tenant_root("default"))


def computed(kv: KVManager, tokens: list[int]) -> Request:
    """A request admitted with its prefix-cache hits, every token computed and confirmed (its full pages published)."""
    req = request(tokens)
    hits = kv.find_hits(req)
    kv.admit(req, hits, len(tokens) - len(hits) * BS)
    req.num_computed = len(tokens)
    kv.publish(req)
    return req


def test_no_host_pages_no_tier():
    assert KVManager(tier_pools(4, BS, 0)[0]).host_tier is None


def test_swap_out_and_back_in_copies_each_page_once():
    counters = Counters()
    pool, host = tier_pools(8, BS, 8)
    kv = KVManager(pool, host=host, counters=counters)
    tier = kv.host_tier
    req = computed(kv, [1, 2, 3, 4, 5])  # two full pages and one partly filled
    kv.take_ops()
    assert tier.swap_out_cost(req) == 3
    device = list(req.page_table)
    kv.swap_out(req)
    ops = kv.take_ops()
    assert [src for src, _ in ops.swap_out] == device and req.page_table == []
    assert req.host_table == [dst for _, dst in ops.swap_out] and req.num_computed == 5
    assert pool.num_used == 0 and host.num_used == 3 and counters.pages_swapped_out == 3

    # the two full pages are still cached on the device (free but findable): only the last is copied back (each of
    # the three takes a free page)
    assert tier.pages_to_swap_in(req, 1) == 3
    host_table = list(req.host_table)
    kv.swap_in(req, 1)
    ops = kv.take_ops()
    assert req.page_table[:2] == device[:2] and req.host_table == []
    assert ops.swap_in == [(host_table[2], req.page_table[2])] and ops.host_release == [host_table[2]]
    assert counters.pages_swapped_in == 1 and host.num_used == 1  # held until the plan that reads it ran
    kv.confirm(ops)
    assert host.num_used == 0


def test_a_host_copy_already_cached_is_shared_not_copied():
    pool, host = tier_pools(8, BS, 8)
    kv = KVManager(pool, host=host)
    tier = kv.host_tier
    first = computed(kv, [1, 2, 3, 4, 5])
    kv.swap_out(first)
    kv.take_ops()
    second = computed(kv, [1, 2, 3, 4, 5])  # its two full pages: hits on the device pages first left cached
    assert tier.swap_out_cost(second) == 1  # (the partly filled page has no hash: copied)
    last = second.page_table[2]
    kv.swap_out(second)
    ops = kv.take_ops()
    assert ops.swap_out == [(last, second.host_table[2])] and second.host_table[:2] == first.host_table[:2]
    assert [host.refcount(hp) for hp in first.host_table] == [2, 2, 1]


def test_nothing_computed_cannot_swap():
    pool, host = tier_pools(4, BS, 4)
    kv = KVManager(pool, host=host)
    req = request([1, 2, 3])
    kv.admit(req, [], 3)
    assert kv.host_tier.swap_out_cost(req) is None
