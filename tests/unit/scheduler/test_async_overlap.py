"""Async scheduling at the scheduler level: building each plan while the one before it is unanswered changes
nothing a client sees. The same requests run one plan at a time and overlapped, against a FakeExecutor whose
'samples' depend only on the request and the position (so recompute reproduces them): every request ends with
the same tokens, text, finish and stop reason, through EOS, stop tokens, stop strings, max_tokens, page budgets
(window and stop policies), n > 1 forks, shared prefixes (cache hits, host-tier spills) and preemption (swap and
recompute) in small pools; page accounting is checked after every step (drive)."""

from __future__ import annotations

import random
import zlib

import pytest

import tests.support.fake_executor as fx
from pagedkv.tenancy import Tenant, Tenants
from scheduler_svc.detokenizer import IncrementalDetokenizer
from scheduler_svc.policy import Mode
from scheduler_svc.prefix_cache import tenant_root
from scheduler_svc.request import Request, Sampling
from tests.support.fake_executor import NullTokenizer, drive
from tests.support.scheduler_helpers import BS, assert_empty, new_scheduler

pytestmark = pytest.mark.unit


def varied(request_id: str, position: int) -> int:
    return 2 + zlib.crc32(f"{request_id}@{position}".encode()) % 40  # 2 is EOS


def _requests(seed: int, shared: bool = False) -> list[Request]:
    rng = random.Random(seed)
    base = [rng.randrange(3, 200) for _ in range(12)]  # with ``shared``: a prefix many prompts start with
    reqs = []
    for i in range(18):
        budget = rng.choice([0, 0, 4, 5])
        # (as the API allows: a budgeted prompt fits its budget less a page)
        prompt = [rng.randrange(3, 200) for _ in range(rng.randint(2, (budget - 1) * BS - 1 if budget else 30))]
        if shared and not budget and rng.random() < 0.6:
            prompt = base[:rng.randint(4, 12)] + prompt[:rng.randint(1, 8)]
        stop = [rng.choice(["ab", "qz", "k", "mno"])] if i % 4 == 1 else []
        sampling = Sampling(max_tokens=rng.randint(1, 40), stop=stop, ignore_eos=i % 3 != 0,
                            stop_token_ids=[rng.randrange(3, 42)] if i % 5 == 2 else [])
        tenant = "stop" if budget and i % 2 else "default"
        window = (budget - 2) * BS if budget and tenant == "default" else 0
        reqs.append(Request(
            request_id=f"r{i}", prompt_ids=prompt, sampling=sampling, arrival=i, tenant=tenant,
            detokenizer=IncrementalDetokenizer(NullTokenizer(), prompt, stop, False), n=rng.choice([1, 1, 1, 2]),
            hash_root=tenant_root(tenant) if not window else tenant_root(f"{tenant}\x00window"), page_budget=budget,
            overflow="stop" if tenant == "stop" else "window", sink_tokens=BS if window else 0, window_tokens=window))
    return reqs


def _run(seed: int, overlap: bool, shared: bool = False, **sched) -> dict:
    s = new_scheduler(tenants=Tenants([Tenant("default"), Tenant("stop", overflow="stop")]), **sched)
    outputs: dict[tuple[str, int], list] = {}
    reqs = _requests(seed, shared)
    for r in reqs:
        s.add(r)

    original = s.process

    def see(group: str, out) -> None:  # per stream: every token and all the text, in order, then the finish
        seen = outputs.setdefault((group, out.index), [[], "", None, ""])
        seen[0] += out.token_ids
        seen[1] += out.text
        if out.finish is not None:
            assert seen[2] is None, "a second final"
            seen[2], seen[3] = out.finish, out.stop_reason

    def process(result):
        outs = original(result)
        for r in reqs:  # the tokens process streamed (forks share their parent's stream), then the finals
            while not r.outbox.empty():
                see(r.group, r.outbox.get_nowait())
        for req, out in outs:
            see(req.group, out)
        return outs
    s.process = process
    drive(s, overlap=overlap)
    assert_empty(s)
    return outputs


@pytest.mark.parametrize("seed", range(6))
@pytest.mark.parametrize("mode", [Mode.SWAP, Mode.RECOMPUTE])
@pytest.mark.parametrize("shared", [False, True], ids=["own_prompts", "shared_prefixes"])
def test_overlapped_plans_stream_what_one_plan_at_a_time_streams(seed, mode, shared, monkeypatch):
    """(shared prefixes: prefix-cache hits, pages spilled to a small host tier and found there)"""
    monkeypatch.setattr(fx, "SAMPLE", varied)
    kw = dict(pages=14, host_pages=10 if shared else 24, mode=mode, budget=16, seqs=6, shared=shared)
    one_at_a_time = _run(seed, overlap=False, **kw)
    overlapped = _run(seed, overlap=True, **kw)
    assert overlapped.keys() == one_at_a_time.keys()
    for key, want in one_at_a_time.items():
        assert overlapped[key] == want, f"{key}: overlapped plans streamed something else"
        assert want[2] is not None, f"{key}: no final"
    assert sum(len(w[0]) for w in one_at_a_time.values()) > 2 * len(one_at_a_time), "few tokens were streamed"
    finishes = {w[2] for w in one_at_a_time.values()}
    assert len(finishes) >= 2, "the scenario was meant to end requests in more than one way"
