"""Multi-LoRA against HF PEFT: three adapters made and saved by PEFT (ranks 8, 16 and 64, different target modules,
one with use_rslora) over a tiny random Llama, served together beside the base model. One forward over a flat batch
mixing all of them gives each row PEFT's logits for its adapter (fp32, atol 1e-4), on the fused CPU ops' path and on
torch's; greedy decoding through the runner, every request in one batch, gives PEFT's ``generate`` ids. A step
without adapter rows keeps the one-call decode; a step with them takes the layer loop."""

from __future__ import annotations

from pathlib import Path

import pytest
import torch

from executor_svc.attention.metadata import DECODE_SLACK
from executor_svc.batch import build_batch
from executor_svc.lora.batch import lora_batch, step_row_slots
from pagedkv.executor.v1 import executor_pb2 as pb
from pagedkv.tools.random_model import build_random_model
from tests.support.fake_executor import samples
from tests.support.hf_reference import random_prompts
from tests.support.lora_helpers import lora_runner, make_adapter, peft_greedy, peft_logits, peft_reference
from tests.support.model_helpers import SMALL, VOCAB

pytestmark = pytest.mark.unit

ATOL = 1e-4  # fp32 logits: ours and PEFT's differ only by summation order
SPECS = {  # name -> (rank, target modules, use_rslora)
    "r8-attn": (8, ["q_proj", "v_proj"], False),
    "r16-rslora": (16, ["q_proj", "k_proj", "o_proj", "down_proj"], True),
    "r64-all": (64, ["q_proj", "k_proj", "v_proj", "o_proj", "gate_proj", "up_proj", "down_proj"], False),
}
ROWS = [None, "r8-attn", "r16-rslora", "r64-all", "r8-attn", None]  # the requests' adapters (None: base), mixed


@pytest.fixture(scope="module")
def served(tmp_path_factory) -> tuple[Path, dict[str, Path]]:
    root = tmp_path_factory.mktemp("lora")
    base = build_random_model(root / "base", seed=3, **SMALL)
    adapters = {name: make_adapter(base, root / name, r, targets, seed=10 + i, rslora=rslora)
                for i, (name, (r, targets, rslora)) in enumerate(SPECS.items())}
    return base, adapters


@pytest.fixture(scope="module")
def reference(served):
    return peft_reference(*served)


def _plan(prompts: list[list[int]], adapters: list[str | None], block_size: int = 16) -> pb.StepPlan:
    plan = pb.StepPlan(step_id=0)
    page = 1
    for i, (prompt, adapter) in enumerate(zip(prompts, adapters)):
        n = -(-(len(prompt) + 16) // block_size)
        plan.new_requests.add(request_id=str(i), token_ids=prompt, num_scheduled_tokens=len(prompt),
                              page_ids=list(range(page, page + n)), adapter=adapter or "")
        page += n
    return plan


@pytest.mark.parametrize("fused", [True, False], ids=["fused-ops", "torch-ops"])
def test_mixed_batch_logits_match_peft(served, reference, fused):
    base, adapters = served
    runner = lora_runner(base, adapters, fused=fused)
    prompts = random_prompts(5, [7, 12, 5, 9, 11, 6], VOCAB)
    scheduled = runner.mirror.apply(_plan(prompts, ROWS))
    ids, pos, meta, _ = build_batch(scheduled, runner.block_size, runner.device, lambda: DECODE_SLACK, None)
    lora = lora_batch(runner.lora, step_row_slots([(i.count, i.state.adapter) for i in scheduled]), runner.device)
    logits = runner.model.forward(ids, pos, meta, runner.pool, runner.attention, torch.arange(len(ids)), lora)
    at, worst, moved = 0, {}, {}
    for prompt, adapter in zip(prompts, ROWS):
        ours = logits[at:at + len(prompt)]
        want = peft_logits(reference, adapter, prompt)
        worst[adapter] = max(worst.get(adapter, 0.0), float((ours - want).abs().max()))
        moved[adapter] = float((want - peft_logits(reference, None, prompt)).abs().max())
        at += len(prompt)
    print("max |ours - PEFT| per adapter:", worst, "max |adapter - base| in PEFT:", moved)
    assert all(d <= ATOL for d in worst.values()), worst
    assert all(moved[a] > 0.5 for a in SPECS)  # each adapter changes the logits well past the tolerance


def _greedy(runner, prompts: list[list[int]], adapters: list[str | None], steps: int) -> list[list[int]]:
    outs: dict[str, list[int]] = {str(i): [] for i in range(len(prompts))}
    plan = _plan(prompts, adapters)
    for step in range(steps):
        if step:
            plan = pb.StepPlan(step_id=step)
            for rid in outs:
                plan.continuing.add(request_id=rid, num_scheduled_tokens=1)
        result = runner.step(plan)
        assert not result.error, result.error
        for rid, token, _ in samples(plan, result):
            outs[rid].append(token)
    return [outs[str(i)] for i in range(len(prompts))]


def test_mixed_batch_greedy_matches_peft_generate(served, reference):
    base, adapters = served
    prompts = random_prompts(9, [6, 14, 8, 20, 5, 10], VOCAB)
    got = _greedy(lora_runner(base, adapters), prompts, ROWS, 8)
    want = [peft_greedy(reference, adapter, prompt, 8) for prompt, adapter in zip(prompts, ROWS)]
    print("greedy ids, ours vs PEFT:", list(zip(ROWS, got, want)))
    assert got == want
    # the adapters matter: the same prompt under each gives other ids than the base model's
    same = [peft_greedy(reference, a, prompts[0], 8) for a in [None, *SPECS]]
    assert len({tuple(s) for s in same}) == len(same)


def test_steps_without_adapter_rows_keep_the_one_call_decode(served):
    base, adapters = served
    runner = lora_runner(base, adapters)
    model = runner.model
    if model.step_path(runner.attention, runner.pool).stack is None:
        pytest.skip("no one-call decode here (the CPU kernel library did not load)")
    calls = []
    real = model.decode_stack

    def spy(*args):
        stack = real(*args)
        calls.append(stack is not None)
        return stack

    model.decode_stack = spy
    prompts = random_prompts(3, [6, 9], VOCAB)
    base_only = _greedy(runner, prompts, [None, None], 3)
    assert calls == [False, True, True]  # the two decode steps ran in one call each (the prefill cannot)
    plain = lora_runner(base, {})
    assert _greedy(plain, prompts, [None, None], 3) == base_only
    calls.clear()
    runner.reset()
    _greedy(runner, prompts, [None, "r64-all"], 3)
    assert calls == []  # a step with an adapter row never asks for the one-call decode


def test_describe_lists_the_adapters_in_load_order(served):
    """Start-up as the executor does it (flags parsed, startup.build): Describe names each adapter with its rank,
    the bytes of its A/B weights and the pool's pages it holds (all padded to rank 64 over the 7 modules: 64 pages of
    8 KiB each), in --lora-modules order; the KV pages are the pool's others, and the runner serves them."""
    import argparse

    from executor_svc.args import add_args
    from executor_svc.startup import build
    from pagedkv import logs

    base, adapters = served
    parser = argparse.ArgumentParser()
    add_args(parser)
    args = parser.parse_args(["--model", str(base), "--device", "cpu", "--num-pages", "208", "--threads", "1",
                              "--swap-space", "0", "--lora-modules", *(f"{n}={p}" for n, p in adapters.items())])
    runner, describe = build(args, logs.configure("executor-test"))
    assert [(a.name, a.rank) for a in describe.adapters] == [(n, spec[0]) for n, spec in SPECS.items()]
    assert runner.mirror.adapters == {"r8-attn": 1, "r16-rslora": 2, "r64-all": 3}
    assert [a.num_pages for a in describe.adapters] == [64, 64, 64] and describe.page_bytes == 8192
    assert describe.num_device_pages == runner.num_pages == 208 - 3 * 64
    hidden, inter, kv = SMALL["hidden_size"], SMALL["intermediate_size"], 32
    fan = {"q_proj": (hidden, hidden), "k_proj": (hidden, kv), "v_proj": (hidden, kv), "o_proj": (hidden, hidden),
           "gate_proj": (hidden, inter), "up_proj": (hidden, inter), "down_proj": (inter, hidden)}
    for a, (r, targets, _) in zip(describe.adapters, SPECS.values()):
        assert a.num_bytes == SMALL["num_layers"] * sum(r * (fan[t][0] + fan[t][1]) for t in targets) * 4, a.name
