"""Set-up shared by the scheduler unit tests (tests/unit/scheduler/): schedulers over small page pools, and the
check that everything was given back."""

from __future__ import annotations

from scheduler_svc.pages import PagePool
from scheduler_svc.policy import Mode, PreemptionConfig, PreemptionCosts
from scheduler_svc.scheduler import SchedulerConfig
from tests.support.driven import Driven, driven

BS = 4  # tokens per page: small pages, so that a few tokens fill one and pools run out quickly
# PreemptionCosts that make swap clearly cheaper than recompute (as on the CPU: ~4 GB/s, ~70 us per token)
CHEAP_SWAP = PreemptionCosts(page_bytes=65536, swap_bytes_per_second=4e9, prefill_seconds_per_token=70e-6)
PREFIX_BS = 16  # the prefix-cache and fork tests use the default page size


def new_scheduler(pages=16, host_pages=32, mode=Mode.SWAP, caching=True, budget=64, seqs=8, max_len=64,
                  hot=64, cold=512, max_wait=64, costs=CHEAP_SWAP, tenants=None, fair=True) -> Driven:
    cfg = SchedulerConfig(max_num_seqs=seqs, max_num_batched_tokens=budget, max_model_len=max_len, watermark=0,
                          enable_prefix_caching=caching, fairness=fair,
                          preemption=PreemptionConfig(mode=mode, hot_steps=hot, cold_steps=cold,
                                                      swap_in_max_wait=max_wait))
    host = PagePool(host_pages, BS, min_pages=0) if host_pages else None
    return driven(PagePool(pages, BS), cfg, [2], host_pool=host, costs=costs, tenants=tenants)


def new_prefix_scheduler(num_pages=400, caching=True, budget=4096, seqs=256, max_len=4096, tail=0) -> Driven:
    cfg = SchedulerConfig(max_num_seqs=seqs, max_num_batched_tokens=budget, max_model_len=max_len,
                          enable_prefix_caching=caching, exact_tail_pages=tail)
    return driven(PagePool(num_pages, PREFIX_BS), cfg, [2])


def assert_empty(s: Driven) -> None:
    s.check_integrity()
    assert s.pool.num_used == 0 and not s.requests
    if s.host is not None:
        assert s.host.num_used == 0
