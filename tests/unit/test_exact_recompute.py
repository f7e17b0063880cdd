"""Recovery is exact for sampled streams (issue #46, F7). A seeded temperature-0.8 stream whose request is recomputed
goes on with the tokens and the log-probabilities of its undisturbed run, bit for bit: after its executor is lost
(migration: the prompt and the tokens so far computed again as one prefill, or in chunks, on a fresh executor) and
after its scheduler is lost (a resume: the request sent again with the tokens delivered, as the client's
``continuation``). The draw of a token depends only on (seed, draw number), so this holds when a token's logits do
not depend on how it was computed: on the CPU path a prefill chunk's tokens are attended by the decode kernel's own
per-row arithmetic, a decode cascade's rows too, and the linears and row-wise ops are batch-independent
(executor_svc/attention/torch_backend.py). Before, a recomputed token went through SDPA and its log-probabilities
differed in the last bits (tiny-llama ~5e-6; SmolLM2 ~1e-4, and 1 of 16 streams took another token).

The planner and the executor's runner are driven in this process, one plan at a time (tests/support/driven.py)."""

from __future__ import annotations

import math

import pytest
import torch

from executor_svc.attention import cpu_kernel
from pagedkv.executor.v1 import executor_pb2 as pb

pytestmark = [pytest.mark.unit, pytest.mark.skipif(cpu_kernel.unavailable_reason() is not None,
                                                   reason="no CPU kernel library here")]

NUM_PAGES, BLOCK = 160, 16
Stream = list[tuple[int, float]]  # (token id, log-probability) of each sampled token


@pytest.fixture(scope="module")
def model(tiny_llama_dir):
    from executor_svc.attention import cascade
    from executor_svc.model import load_model
    from executor_svc.model_config import ModelConfig

    cfg = ModelConfig.from_dir(tiny_llama_dir)
    if not cascade.shared_in_kernel(cpu_kernel.load(), torch.empty(0, cfg.head_dim)):
        pytest.skip("no vector path of the CPU kernel for this head size here")
    return cfg, load_model(cfg, torch.device("cpu"), torch.float32)


class Server:
    """One planner and one executor (a fresh pool: whatever ran before is gone)."""

    def __init__(self, model, budget: int) -> None:
        from executor_svc.attention.torch_backend import TorchPagedAttention
        from executor_svc.kv_quant import parse_kv_dtype
        from executor_svc.pages import DevicePagePool
        from executor_svc.runner import ModelRunner
        from scheduler_svc.pages import PagePool
        from scheduler_svc.scheduler import SchedulerConfig
        from tests.support.driven import driven

        cfg, weights = model
        pool = DevicePagePool(cfg, NUM_PAGES, BLOCK, torch.float32, torch.device("cpu"),
                              parse_kv_dtype("auto", torch.float32))
        attention = TorchPagedAttention(cfg.num_heads, cfg.num_kv_heads, cfg.head_dim, weights.scale)
        self.runner = ModelRunner(weights, pool, attention, torch.device("cpu"))
        config = SchedulerConfig(max_num_seqs=16, max_num_batched_tokens=budget, max_model_len=1024, watermark=0.0)
        self.planner = driven(PagePool(NUM_PAGES, BLOCK), config, list(cfg.eos_token_ids))

    def step(self, streams: dict[str, Stream]) -> bool:
        """One step; each sampled token goes to its request's stream (by the id it had first). False: nothing left."""
        from tests.support.fake_executor import samples

        plan, _ = self.planner.schedule()
        if plan is None:
            assert not self.planner.has_work
            return False
        result = self.runner.step(plan)
        assert not result.error, result.error
        for rid, token, logprob in samples(plan, result):
            streams[rid.split("/")[0]].append((token, logprob))
        self.planner.process(result)
        return True


def sampled_request(i: int, prompt: list[int], max_tokens: int):
    from scheduler_svc.detokenizer import IncrementalDetokenizer
    from scheduler_svc.prefix_cache import tenant_root
    from scheduler_svc.request import Request, Sampling
    from tests.support.fake_executor import NullTokenizer

    return Request(request_id=f"r{i}", prompt_ids=list(prompt), arrival=i, tenant="default",
                   sampling=Sampling(max_tokens=max_tokens, temperature=0.8, seed=1000 + i, ignore_eos=True,
                                     logprobs=True),
                   detokenizer=IncrementalDetokenizer(NullTokenizer(), [], [], False), hash_root=tenant_root("default"))


def run(model, prompts: list[list[int]], max_tokens: int, budget: int = 512, breaks: dict[int, str] | None = None,
        budget_after: int | None = None) -> dict[str, Stream]:
    """Every stream of the prompts' requests; ``breaks``: at step k, "migrate" (the executor is lost: its requests
    go to a fresh one, as Cluster.relocate places them) or "resume" (the scheduler is lost too: each request is sent
    again with the tokens delivered, as the client's continuation makes it: scheduler_svc/continuation.py resume)."""
    from scheduler_svc.request import fork

    server = Server(model, budget)
    reqs = [sampled_request(i, p, max_tokens) for i, p in enumerate(prompts)]
    for req in reqs:
        server.planner.add(req)
    streams: dict[str, Stream] = {r.request_id: [] for r in reqs}
    step = 0
    while True:
        how = (breaks or {}).get(step)
        if how is not None:
            moved, _ = server.planner.evacuate()
            assert moved, f"step {step}: nothing left to move"
            server = Server(model, budget_after or budget)
            for req in moved:
                if how == "resume":  # (what the client received: every token its stream got)
                    req = fork(req, 0, req.detokenizer.fresh(), [t for t, _ in streams[req.request_id]])
                server.planner.add(req, front=how == "migrate")
        if not server.step(streams):
            return streams
        step += 1


def prompts_of(lengths: list[int], seed: int = 0) -> list[list[int]]:
    g = torch.Generator().manual_seed(seed)
    return [torch.randint(3, 250, (n,), generator=g).tolist() for n in lengths]


def differences(base: dict[str, Stream], other: dict[str, Stream]) -> list[str]:
    out = []
    for rid, want in base.items():
        got = other[rid]
        if got != want:
            at = next((i for i, (a, b) in enumerate(zip(want, got)) if a != b), min(len(want), len(got)))
            detail = f"{want[at]} vs {got[at]}" if at < min(len(want), len(got)) else "length"
            out.append(f"{rid}: from token {at} ({detail})")
    return out


PROMPTS, MAX_TOKENS = prompts_of([23, 61, 40, 90]), 20


@pytest.fixture(scope="module")
def undisturbed(model) -> dict[str, Stream]:
    base = run(model, PROMPTS, MAX_TOKENS)
    assert all(len(s) == MAX_TOKENS for s in base.values())
    assert len({tuple(t for t, _ in s) for s in base.values()}) == len(base), "the seeds must give other streams"
    return base


@pytest.mark.parametrize("breaks,budget_after", [
    ({1: "migrate"}, None),  # right after the prefills: one output token to recompute
    ({4: "migrate", 13: "migrate"}, 24),  # twice, the recompute in chunks of at most 24 tokens
    ({6: "resume"}, None),
    ({3: "resume", 11: "migrate"}, 40),
], ids=["migrate-after-prefill", "migrate-twice-chunked", "resume", "resume-then-migrate"])
def test_a_recomputed_sampled_stream_equals_its_undisturbed_run(model, undisturbed, breaks, budget_after):
    again = run(model, PROMPTS, MAX_TOKENS, breaks=breaks, budget_after=budget_after)
    assert not differences(undisturbed, again)


def test_how_a_prompt_is_chunked_changes_no_bit(model, undisturbed):
    """The undisturbed run itself: its prompts prefilled whole, or in chunks beside other requests' decodes."""
    assert not differences(undisturbed, run(model, PROMPTS, MAX_TOKENS, budget=37))


def test_decodes_attended_as_a_cascade_recompute_exactly(model, monkeypatch):
    """Requests over one cached prefix decode as a cascade (the thresholds lowered so that these few rows take it);
    its rows have the kernel's bits, so a migration, after which they are prefill rows and then decodes beside
    others, changes nothing."""
    from executor_svc.attention import cascade

    monkeypatch.setattr(cascade, "CASCADE_MIN_ROWS", 4)
    monkeypatch.setattr(cascade, "CASCADE_MIN_TOKENS", 32)
    monkeypatch.setattr(cascade, "CASCADE_MIN_WORK", 0)
    cascades = []
    shared_prefix = cascade.shared_prefix

    def spy(*args):
        pages = shared_prefix(*args)
        cascades.append(pages.numel())
        return pages

    monkeypatch.setattr(cascade, "shared_prefix", spy)
    prefix = prompts_of([48], seed=1)[0]
    prompts = [prefix + own for own in prompts_of([5, 19, 9, 30, 12], seed=2)]
    base = run(model, prompts, 12)
    assert any(cascades), "the decodes must have run as a cascade"
    assert not differences(base, run(model, prompts, 12, breaks={6: "migrate"}))


def test_a_prefill_token_has_the_bits_of_the_same_token_decoded(model):
    """The logits of a prompt's last token and of the next token fed alone: the same whether the model reaches them
    in one prefill of prompt + token or in a prefill then a decode step."""
    from executor_svc.batch import build_batch
    from executor_svc.plan_check import RequestMirror

    cfg, weights = model
    prompt = prompts_of([45], seed=3)[0]

    def logits_of(chunks: list[int]) -> torch.Tensor:
        server = Server(model, 512)
        mirror: RequestMirror = server.runner.mirror
        start, last = 0, None
        for n in chunks:
            plan = pb.StepPlan(step_id=start)
            if start == 0:
                plan.new_requests.add(request_id="x", token_ids=prompt, num_computed_tokens=0, num_scheduled_tokens=n,
                                      page_ids=list(range(4)), sampling=pb.SamplingParams(temperature=0.0))
            else:
                plan.continuing.add(request_id="x", num_scheduled_tokens=n)
            scheduled = mirror.apply(plan)
            ids, positions, meta, _ = build_batch(scheduled, BLOCK, torch.device("cpu"), lambda: math.inf, None)
            last = weights.forward(ids, positions, meta, server.runner.pool, server.runner.attention,
                                   torch.arange(ids.numel()))
            for item in scheduled:
                item.state.num_computed = item.start + item.count
            start += n
        return last

    whole = logits_of([45])
    stepped = logits_of([30, 14, 1])
    assert torch.equal(whole[-1], stepped[-1]), "a token decoded alone and in a prefill chunk: the same logits"
    assert torch.equal(whole[30:44], logits_of([30, 14])[-14:])
