"""`pagedkv bench`: the seeded workload generators, the latency definitions, the metrics scraper, and one
run against real processes on loopback whose JSON must hold every documented field with sane values."""

from __future__ import annotations

import math
import random
import statistics

import pytest

from pagedkv.loadgen.report import summarize
from pagedkv.loadgen.workload import (
    LengthDist,
    SharedPrefixes,
    Tenant,
    TokenSpace,
    WorkloadError,
    WorkloadSpec,
    arrival_times,
    make_workload,
)
from tests.support.loadgen_results import request_result

pytestmark = pytest.mark.unit


# ---- lengths -----------------------------------------------------------------------------------
def test_length_specs_parse_and_sample_within_their_ranges():
    rng = random.Random(0)
    assert LengthDist.parse("7", "--input-len").sample(rng) == 7
    assert LengthDist.parse("fixed:9", "--input-len").sample(rng) == 9
    u = LengthDist.parse("uniform:4:12", "--output-len")
    xs = [u.sample(rng) for _ in range(20000)]
    assert min(xs) == 4 and max(xs) == 12
    assert abs(statistics.fmean(xs) - 8) < 0.1


def test_lognormal_has_the_asked_mean_and_spread_and_respects_its_cap():
    rng = random.Random(1)
    d = LengthDist.parse("lognormal:161:1.0", "--input-len")
    xs = [d.sample(rng) for _ in range(40000)]
    assert abs(statistics.fmean(xs) - 161) / 161 < 0.04
    logs = [math.log(x) for x in xs]
    assert abs(statistics.stdev(logs) - 1.0) < 0.05  # sigma of the log
    assert statistics.median(xs) < statistics.fmean(xs)  # right-skewed, like ShareGPT
    capped = LengthDist.parse("lognormal:161:1.0:300", "--input-len")
    ys = [capped.sample(rng) for _ in range(5000)]
    assert max(ys) == 300 and min(ys) >= 1


@pytest.mark.parametrize("spec, words", [
    ("uniform:10:5", "HI must be"), ("uniform:0:5", ">= 1"), ("lognormal:100:9", "SIGMA"),
    ("lognormal:0.5:1", "MEAN"), ("normal:3:4", "expected N"), ("fixed:x", "numbers expected"), ("2.5", "expected N"),
    ("fixed:0", ">= 1"),
])
def test_bad_length_specs_name_the_option_and_the_limit(spec, words):
    with pytest.raises(WorkloadError, match="--input-len") as err:
        LengthDist.parse(spec, "--input-len")
    assert words in str(err.value)


# ---- arrivals ----------------------------------------------------------------------------------
def test_poisson_arrivals_are_seeded_with_exponential_gaps_at_the_rate():
    times = arrival_times(20000, 4.0, random.Random(3))
    assert times == arrival_times(20000, 4.0, random.Random(3))
    assert times[0] == 0.0 and all(b >= a for a, b in zip(times, times[1:]))
    gaps = [b - a for a, b in zip(times, times[1:])]
    assert abs(statistics.fmean(gaps) - 0.25) < 0.01
    assert abs(statistics.stdev(gaps) - 0.25) < 0.015  # exponential: sd == mean


def test_burst_and_infinite_rate_arrivals():
    assert arrival_times(5, math.inf, random.Random(0)) == [0.0] * 5
    t = arrival_times(7, 2.0, random.Random(0), "burst", burst_size=3)
    assert t == [0.0, 0.0, 0.0, 1.5, 1.5, 1.5, 3.0]  # 3 every 3/2 s: mean rate 2/s


@pytest.mark.parametrize("kwargs, option", [
    ({"num": 0, "rate": 1.0}, "--num-prompts"), ({"num": 3, "rate": 0.0}, "--request-rate"),
    ({"num": 3, "rate": math.nan}, "--request-rate"), ({"num": 3, "rate": 1.0, "kind": "gamma"}, "--arrival"),
    ({"num": 3, "rate": 1.0, "kind": "burst", "burst_size": 0}, "--burst-size"),
])
def test_bad_arrival_options_are_refused_by_name(kwargs, option):
    with pytest.raises(WorkloadError, match=option):
        arrival_times(rng=random.Random(0), **kwargs)


# ---- the whole workload ------------------------------------------------------------------------------
def _spec(**kw) -> WorkloadSpec:
    base = dict(num_prompts=200, input_len=LengthDist.parse("uniform:20:60", "-"),
                output_len=LengthDist.parse("uniform:5:15", "-"), request_rate=10.0, seed=5)
    base.update(kw)
    return WorkloadSpec(**base)


def test_shared_prefix_mix_is_exact_and_prompts_start_as_planned():
    tokens = TokenSpace(3, 250, bos=(1,))
    spec = _spec(shared=SharedPrefixes(fraction=0.3, count=3, length=48))
    plan = make_workload(spec, tokens, max_model_len=2048)
    assert plan == make_workload(spec, tokens, max_model_len=2048)  # seeded
    shared = [r for r in plan if r.prefix >= 0]
    assert len(shared) == 60
    assert {r.prefix for r in shared} == {0, 1, 2}
    prefixes = {r.prefix: r.prompt[:48] for r in shared}
    assert len({tuple(p) for p in prefixes.values()}) == 3
    for r in plan:
        assert r.prompt[0] == 1 and all(3 <= t < 250 for t in r.prompt[1:])
        assert 5 <= r.max_tokens <= 15 and not r.fitted
        if r.prefix >= 0:
            assert r.prompt[:48] == prefixes[r.prefix] and 48 + 19 <= len(r.prompt) <= 48 + 59
        else:
            assert 20 <= len(r.prompt) <= 60
    unshared_starts = {tuple(r.prompt[:16]) for r in plan if r.prefix < 0}
    assert len(unshared_starts) == 140  # no accidental common first page


def test_requests_are_fitted_to_max_model_len():
    spec = _spec(input_len=LengthDist.parse("lognormal:100:1.5", "-"), output_len=LengthDist.parse("200", "-"))
    plan = make_workload(spec, TokenSpace(3, 250, bos=(1,)), max_model_len=256)
    for r in plan:
        assert len(r.prompt) < 256 and len(r.prompt) + r.max_tokens <= 256 and r.max_tokens >= 1
    assert any(r.fitted for r in plan) and not all(r.fitted for r in plan)
    with pytest.raises(WorkloadError, match="--shared-prefix-len"):
        make_workload(_spec(shared=SharedPrefixes(0.5, 1, 256)), TokenSpace(3, 250), max_model_len=256)
    with pytest.raises(WorkloadError, match="--shared-prefix-fraction"):
        make_workload(_spec(shared=SharedPrefixes(1.5, 1, 16)), TokenSpace(3, 250), max_model_len=256)


def test_tenant_mix_follows_the_weights():
    tenants = (Tenant.parse("a=key-a:3", 0), Tenant.parse("key-b", 1))
    assert tenants[1] == Tenant("tenant1", "key-b", 1.0)
    plan = make_workload(_spec(num_prompts=4000, tenants=tenants), TokenSpace(3, 250), max_model_len=2048)
    share_a = sum(r.tenant == "a" for r in plan) / len(plan)
    assert abs(share_a - 0.75) < 0.03
    with pytest.raises(WorkloadError, match="weight"):
        Tenant.parse("x=k:0", 0)


# ---- definitions -----------------------------------------------------------------------------------
def test_ttft_tpot_itl_and_goodput_follow_the_vllm_definitions():
    fast = request_result(0, 0.1, [(0.1, 1), (0.2, 1), (0.3, 1), (0.4, 1), (0.5, 1)], 0.5)  # TPOT 100 ms
    # a message with 3 tokens adds one ITL gap (0.4 s), not three
    slow = request_result(1, 0.5, [(0.5, 1), (0.9, 3)], 0.9)  # TPOT (0.9 - 0.5) / 3 = 133 ms
    failed = request_result(2, 0.2, [(0.2, 1)], 0.3, error="RESOURCE_EXHAUSTED", finish_reason=None)
    rep = summarize([fast, slow, failed], duration_s=2.0, slo_ttft_ms=300, slo_tpot_ms=120)
    assert (rep["completed"], rep["failed"], rep["errors"]) == (2, 1, {"RESOURCE_EXHAUSTED": 1})
    assert rep["ttft_ms"]["count"] == 2 and rep["ttft_ms"]["mean"] == pytest.approx(300)
    assert rep["tpot_ms"]["p50"] == pytest.approx((100 + 400 / 3) / 2)
    assert rep["itl_ms"]["count"] == 5 and rep["itl_ms"]["max"] == pytest.approx(400)
    assert rep["tokens_per_message"] == {"mean": 9 / 7, "max": 3, "multi_token_messages": 1}
    assert rep["total_output_tokens"] == 9 and rep["output_token_throughput"] == pytest.approx(4.5)
    assert rep["goodput"]["requests_meeting_slo"] == 1  # slow misses both SLOs
    assert rep["goodput"]["request_goodput"] == pytest.approx(0.5)
    none = summarize([fast], 1.0, None, None)["goodput"]
    assert none == {"requests_meeting_slo": None, "request_goodput": None, "share": None}


def test_prompts_do_not_depend_on_the_rate_or_the_tenant_mix():
    tokens = TokenSpace(3, 250, bos=(1,))
    slow, fast = (make_workload(_spec(request_rate=r), tokens, 2048) for r in (1.0, math.inf))
    mixed = make_workload(_spec(tenants=(Tenant("a", "k1"), Tenant("b", "k2"))), tokens, 2048)
    assert [r.prompt for r in slow] == [r.prompt for r in fast] == [r.prompt for r in mixed]
    assert [r.max_tokens for r in slow] == [r.max_tokens for r in mixed]
    assert [r.send_at_s for r in fast] == [0.0] * 200 and slow[-1].send_at_s > 100


def test_progress_bar_draws_on_a_terminal_only():
    import io

    from pagedkv.loadgen.runner import Progress

    out = io.StringIO()
    bar = Progress(4, enabled=True, stream=out)
    bar.done, bar.inflight, bar.errors = 2, 1, 1
    bar.update(force=True)
    bar.close()
    assert "\r[###############---------------] 2/4 done, 1 in flight, 1 errors" in out.getvalue()
    quiet = io.StringIO()
    Progress(4, enabled=False, stream=quiet).close()
    assert quiet.getvalue() == ""
