"""Prefix cache and Share-Prefix at the scheduler level, with a stand-in executor (exact page accounting)."""

from __future__ import annotations

import random

import pytest

from scheduler_svc.prefix_cache import page_hash, tenant_root
from tests.support.driven import Driven
from tests.support.fake_executor import drive, make_request
from tests.support.scheduler_helpers import PREFIX_BS as BS
from tests.support.scheduler_helpers import new_prefix_scheduler as new_scheduler

pytestmark = pytest.mark.unit


def test_hash_chain_is_salted_by_tenant_and_tags_extra_keys():
    a, b = tenant_root("a"), tenant_root("b")
    toks = list(range(16))
    assert page_hash(a, toks) == page_hash(a, toks)
    assert page_hash(a, toks) != page_hash(b, toks)
    assert page_hash(a, toks, (("lora", "x"),)) != page_hash(a, toks, (("salt", "x"),))
    assert page_hash(a, toks, (("a", "bc"),)) != page_hash(a, toks, (("ab", "c"),))
    assert page_hash(page_hash(a, toks), toks) != page_hash(a, toks)  # the chain carries the parent


def run_one(s: Driven, i: int, prompt: list[int], tenant: str = "default", max_tokens: int = 4):
    req = make_request(i, 0, max_tokens, prompt=prompt, tenant=tenant)
    s.add(req)
    before = s.counters.computed_tokens
    drive(s)
    return req, s.counters.computed_tokens - before


def test_same_tenant_hits_other_tenant_misses():
    s = new_scheduler()
    prompt = [7 + (i % 200) for i in range(100)]  # 6 full pages + 4 tokens
    cold, cold_computed = run_one(s, 0, prompt, "t1")
    assert cold.num_cached_tokens == 0 and cold_computed == 100 + 3
    warm, warm_computed = run_one(s, 1, prompt, "t1")
    assert warm.num_cached_tokens == 96 and warm_computed == 4 + 3  # only the suffix, then decodes
    assert warm.output_ids == cold.output_ids
    other, other_computed = run_one(s, 2, prompt, "t2")
    assert other.num_cached_tokens == 0 and other_computed == 100 + 3


def test_last_prompt_token_is_never_served_from_cache():
    s = new_scheduler()
    prompt = [9] * 64  # exactly 4 pages
    run_one(s, 0, prompt)
    again, computed = run_one(s, 1, prompt, max_tokens=1)
    assert again.num_cached_tokens == 48 and computed == 16  # the last page is recomputed


@pytest.mark.parametrize("tail,hit_pages", [(0, 6), (1, 6), (2, 5), (3, 4)])
def test_an_executors_exact_tail_is_never_served_from_cache(tail, hit_pages):
    """With an exact tail of N pages (executor_svc/kv_tail.py) the prompt's last N pages are computed by the request
    itself: the executor reads them exactly only where the request wrote them."""
    s = new_scheduler(tail=tail)
    prompt = [7 + (i % 200) for i in range(100)]  # 6 full pages + 4 tokens
    cold, _ = run_one(s, 0, prompt)
    warm, computed = run_one(s, 1, prompt)
    assert warm.num_cached_tokens == hit_pages * BS and computed == 100 - hit_pages * BS + 3
    assert warm.output_ids == cold.output_ids


def test_caching_off_never_hits():
    s = new_scheduler(caching=False)
    prompt = [11] * 80
    run_one(s, 0, prompt)
    again, computed = run_one(s, 1, prompt)
    assert again.num_cached_tokens == 0 and computed == 80 + 3 and s.pool.num_cached == 0


def test_evicted_page_is_never_found_by_a_stale_hash():
    s = new_scheduler(num_pages=12)
    prompt = [13] * 64
    first, _ = run_one(s, 0, prompt)
    hashes = list(first.page_hashes[:4])
    assert [s.pool.lookup(h) for h in hashes] != [None] * 4
    run_one(s, 1, [17 + (i % 100) for i in range(170)], max_tokens=22)  # takes every page: evicts the cache
    assert [s.pool.lookup(h) for h in hashes] == [None] * 4
    again, computed = run_one(s, 2, prompt)
    assert again.num_cached_tokens == 0 and computed == 64 + 3
    s.check_integrity()


def test_freed_pages_stay_findable_and_suffix_is_evicted_first():
    s = new_scheduler(num_pages=14)
    prompt = [21 + i % 50 for i in range(160)]  # 10 pages
    run_one(s, 0, prompt, max_tokens=1)
    assert s.pool.num_used == 0 and s.pool.num_cached == 10  # free, but not evicted
    run_one(s, 1, [99] * 96, max_tokens=1)  # 6 pages: the 4 never used, then the prompt's last two
    again, _ = run_one(s, 2, prompt, max_tokens=1)
    assert again.num_cached_tokens == 8 * BS


def test_100_requests_share_a_2000_token_prefix():
    """Prefix pages stored once, prefilled once; peak pages == prefix pages + sum of suffix pages."""
    rng = random.Random(0)
    prefix = [rng.randrange(3, 259) for _ in range(2000)]
    s = new_scheduler(num_pages=600, budget=4096)
    suffix_lens = [rng.randint(1, 24) for _ in range(100)]
    reqs = []
    for i, n in enumerate(suffix_lens):
        suffix = [3 + i] + [rng.randrange(3, 259) for _ in range(n - 1)]
        req = make_request(i, 0, 2 if i == 0 else 1, prompt=prefix + suffix)
        reqs.append(req)
        s.add(req)
    drive(s)
    prefix_pages = 2000 // BS
    # Request 0 computes the whole prefix and is one decode ahead when the other 99 prefill their suffix.
    suffix_pages = s.pool.pages_for(2000 + suffix_lens[0] + 1) - prefix_pages + sum(
        s.pool.pages_for(2000 + n) - prefix_pages for n in suffix_lens[1:])
    assert s.counters.peak_used_pages == prefix_pages + suffix_pages
    assert s.counters.computed_tokens == 2000 + sum(suffix_lens) + 1
    assert all(r.num_cached_tokens == 2000 for r in reqs[1:])
    assert s.pool.num_used == 0


def test_executor_failure_forgets_the_prefix_cache():
    s = new_scheduler()
    prompt = [40 + i % 90 for i in range(80)]
    run_one(s, 0, prompt)
    assert s.pool.num_cached > 0
    s.fail_all("executor gone")
    again, computed = run_one(s, 1, prompt)
    assert again.num_cached_tokens == 0 and computed == 80 + 3
