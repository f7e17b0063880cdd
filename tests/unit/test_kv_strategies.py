"""bench/kv_strategies.py on a tiny trace: the strategies rank as the seeds say, Share-Prefix stores shared
system prompts once, the window drops pages, and the real page pool's accounting holds every step."""

from __future__ import annotations

import sys

import pytest

from tests.conftest import ROOT

pytestmark = pytest.mark.unit

sys.path.insert(0, str(ROOT / "bench"))
import kv_strategies as ks  # noqa: E402

TINY = ks.TraceConfig(num_requests=60, seed=3, max_model_len=256, prompt_mean=40, output_mean=40, sigma=0.8,
                      shared_fraction=0.5, num_prefixes=2, prefix_len=64, vocab_size=1000)
BUDGET = 8 * 256  # contiguous holds 8 requests


@pytest.fixture(scope="module")
def trace():
    return ks.make_trace(TINY)


def test_trace_is_seeded_and_capped(trace):
    assert trace == ks.make_trace(TINY)
    assert all(len(r.prompt) + r.output_len <= 256 and r.output_len >= 1 for r in trace)
    assert sum(r.prefix >= 0 for r in trace) == 30


def test_utilization_ranks_paged_over_bucketing_over_contiguous(trace):
    contiguous = ks.run_reserving(trace, "c", "contiguous", lambda _: 256, BUDGET).summary()
    bucketing = ks.run_reserving(trace, "b", "bucketing", ks.bucket_of((64, 128, 256)), BUDGET).summary()
    paged = ks.run_paged(trace, "p", "paged", ks.PagedConfig(16), BUDGET, check_integrity=True,
                         vocab_size=1000).summary()
    assert paged["utilization"] > bucketing["utilization"] > contiguous["utilization"]
    assert paged["utilization"] > 0.9 and contiguous["utilization"] < 0.6
    assert contiguous["max_concurrency"] == 8
    assert paged["mean_saturated_concurrency"] > bucketing["mean_saturated_concurrency"] > 8 - 0.5


def test_share_prefix_stores_the_shared_pages_once(trace):
    ample = 64 * 256  # everyone fits: pages in use are the requests' own needs
    plain = ks.run_paged(trace, "p", "paged", ks.PagedConfig(16), ample, check_integrity=True, vocab_size=1000)
    shared = ks.run_paged(trace, "s", "paged+share-prefix", ks.PagedConfig(16, prefix_caching=True), ample,
                          check_integrity=True, vocab_size=1000)
    assert shared.prefix_tokens_reused >= 20 * 64 - 2 * 64  # all but the first of each prefix hit its 4 pages
    assert shared.summary()["mean_allocated_slots"] < 0.9 * plain.summary()["mean_allocated_slots"]
    assert shared.peak_allocated_slots < plain.peak_allocated_slots
    assert shared.summary()["logical_tokens_per_slot"] > 1.0 >= plain.summary()["logical_tokens_per_slot"]
    assert plain.prefix_tokens_reused == 0


def test_sliding_window_frees_pages_outside_the_window():
    long_trace = ks.make_trace(ks.TraceConfig(num_requests=12, seed=1, max_model_len=512, prompt_mean=150,
                                              output_mean=250, sigma=0.3, shared_fraction=0.0, vocab_size=1000))
    full = ks.run_paged(long_trace, "p", "paged", ks.PagedConfig(16), 64 * 512, vocab_size=1000)
    window = ks.run_paged(long_trace, "w", "paged+sliding-window", ks.PagedConfig(16, window=64, sink=16,
                          prefill_chunk=64), 64 * 512, check_integrity=True, vocab_size=1000)
    assert window.peak_allocated_slots < 0.6 * full.peak_allocated_slots
    assert window.summary()["utilization"] > 0.9
