"""Adapters paged through device slots (#52): an executor with two slots and --lora-root holds a start-up adapter
and two loaded at run time in host memory; plans page them in (StepPlan.adapter_loads) and each request's greedy ids
equal PEFT's, whichever slot its adapter went to and whatever was there before. The executor refuses a load into a
slot a running request uses, an adapter it does not hold, and run-time paths outside --lora-root (symlinks too),
files past their size bound, ranks above the slots', and unloading a start-up adapter."""

from __future__ import annotations

import os

import pytest

from executor_svc.lora.store import AdapterError
from pagedkv.executor.v1 import executor_pb2 as pb
from pagedkv.tools.random_model import build_random_model
from tests.support.fake_executor import samples
from tests.support.hf_reference import random_prompts
from tests.support.lora_helpers import make_adapter, peft_greedy, peft_reference, slot_runner
from tests.support.model_helpers import SMALL, VOCAB

pytestmark = pytest.mark.unit

SPECS = {"boot": (8, ["q_proj", "v_proj"]), "rt-a": (16, ["q_proj", "k_proj", "o_proj", "down_proj"]),
         "rt-b": (32, ["gate_proj", "up_proj", "down_proj", "v_proj"])}


@pytest.fixture(scope="module")
def served(tmp_path_factory):
    root = tmp_path_factory.mktemp("slots")
    base = build_random_model(root / "base", seed=5, **SMALL)
    (root / "lora").mkdir()
    adapters = {name: make_adapter(base, root / "lora" / name, r, targets, seed=40 + i)
                for i, (name, (r, targets)) in enumerate(SPECS.items())}
    return base, root, adapters


@pytest.fixture(scope="module")
def reference(served):
    base, _, adapters = served
    return peft_reference(base, adapters)


def _runner(served, slots=2, max_rank=32):
    base, root, adapters = served
    runner, store = slot_runner(base, {"boot": adapters["boot"]}, root / "lora", slots, max_rank)
    return runner, store


def _run(runner, step_id: int, reqs: list[tuple[str, list[int], str]], loads=(), forget=()) -> dict[str, list[int]]:
    """Greedy 6 ids for each (id, prompt, adapter) started together in one plan with ``loads``."""
    plan = pb.StepPlan(step_id=step_id, forget=list(forget))
    plan.adapter_loads.extend(pb.AdapterLoad(name=n, slot=s) for n, s in loads)
    page = 1
    for rid, prompt, adapter in reqs:
        plan.new_requests.add(request_id=rid, token_ids=prompt, num_scheduled_tokens=len(prompt),
                              page_ids=[page, page + 1], adapter=adapter)
        page += 2
    outs = {rid: [] for rid, _, _ in reqs}
    for step in range(6):
        if step:
            plan = pb.StepPlan(step_id=step_id + step, decodes=list(outs))
        result = runner.step(plan)
        assert not result.error, result.error
        for rid, token, _ in samples(plan, result):
            outs[rid].append(token)
    return outs


def test_adapters_paged_through_two_slots_give_pefts_ids(served, reference):
    runner, store = _runner(served)
    assert store.add("rt-a", "rt-a").slot == -1 and store.add("rt-b", str(served[1] / "lora" / "rt-b")).runtime
    p = random_prompts(3, [9, 12, 7], VOCAB)
    # rt-a into the empty slot 1, beside boot in slot 0
    got = _run(runner, 0, [("1", p[0], "boot"), ("2", p[1], "rt-a"), ("3", p[2], "")], loads=[("rt-a", 1)])
    assert got == {"1": peft_greedy(reference, "boot", p[0], 6), "2": peft_greedy(reference, "rt-a", p[1], 6),
                   "3": peft_greedy(reference, None, p[2], 6)}
    # rt-b replaces boot in slot 0 once its request is forgotten; rt-a stays in slot 1
    got = _run(runner, 10, [("4", p[0], "rt-b"), ("5", p[2], "rt-a")], loads=[("rt-b", 0)], forget=["1", "2", "3"])
    assert got == {"4": peft_greedy(reference, "rt-b", p[0], 6), "5": peft_greedy(reference, "rt-a", p[2], 6)}
    assert [(a.name, a.slot) for a in store.describe()] == [("boot", -1), ("rt-a", 1), ("rt-b", 0)]
    # boot back, into slot 1 over rt-a (its rank-8 weights leave no trace of rt-a's rank 16)
    got = _run(runner, 20, [("6", p[1], "boot")], loads=[("boot", 1)], forget=["4", "5"])
    assert got == {"6": peft_greedy(reference, "boot", p[1], 6)}


def test_the_plan_is_refused_when_a_load_would_pull_weights_from_under_a_running_request(served):
    runner, store = _runner(served)
    store.add("rt-a", "rt-a")
    p = random_prompts(4, [9], VOCAB)[0]
    plan = pb.StepPlan(step_id=0)
    plan.new_requests.add(request_id="r", token_ids=p, num_scheduled_tokens=len(p), page_ids=[1, 2], adapter="boot")
    assert not runner.step(plan).error
    bad = pb.StepPlan(step_id=1, decodes=["r"])
    bad.adapter_loads.add(name="rt-a", slot=0)
    result = runner.step(bad)
    assert "adapter_loads: slot 0 holds 'boot', which request r still runs with" in result.error
    assert runner.lora.names[0] == "boot"
    for load, why in [(pb.AdapterLoad(name="nope", slot=1), "adapter 'nope' is not loaded on this executor"),
                      (pb.AdapterLoad(name="rt-a", slot=2), "slot 2 outside [0, 2)")]:
        plan = pb.StepPlan(step_id=2, decodes=["r"], adapter_loads=[load])
        assert why in runner.step(plan).error
    # a new request naming an adapter in no slot (held, not paged in) is refused, naming the way in
    plan = pb.StepPlan(step_id=3)
    plan.new_requests.add(request_id="s", token_ids=p, num_scheduled_tokens=len(p), page_ids=[3, 4], adapter="rt-a")
    assert "StepPlan.adapter_loads pages one in" in runner.step(plan).error


def test_run_time_loads_are_bounded_and_kept_inside_the_root(served, tmp_path):
    base, root, adapters = served
    runner, store = _runner(served, max_rank=16)
    os.symlink(adapters["rt-a"], root / "lora" / "link-in")
    outside = tmp_path / "outside"
    outside.mkdir()
    os.symlink(outside, root / "lora" / "link-out")
    cases = [("x", "../base", "PERMISSION_DENIED", "outside the executor's --lora-root"),
             ("x", "/etc", "PERMISSION_DENIED", "outside the executor's --lora-root"),
             ("x", "link-out", "PERMISSION_DENIED", "after symlinks are resolved"),
             ("x", "", "INVALID_ARGUMENT", "path: must be 1 to 4096 characters"),
             ("x", "missing", "INVALID_ARGUMENT", "is not a directory under --lora-root"),
             ("bad name", "rt-a", "INVALID_ARGUMENT", "name: 'bad name' must be 1 to"),
             ("boot", "rt-a", "ALREADY_EXISTS", "adapter 'boot' is already loaded"),
             ("big", "rt-b", "INVALID_ARGUMENT", "r = 32 is outside [1, 16] (--max-lora-rank)")]
    for name, path, code, why in cases:
        with pytest.raises(AdapterError) as err:
            store.add(name, path)
        assert (err.value.code, why in str(err.value)) == (code, True), (name, path, str(err.value))
    assert store.add("via-link", "link-in").rank == 16  # a symlink that stays inside is fine
    fat = root / "lora" / "fat"
    fat.mkdir()
    (fat / "adapter_config.json").write_text(" " * (65 << 10))
    (fat / "adapter_model.safetensors").write_bytes(b"")
    with pytest.raises(AdapterError, match="adapter_config.json is 66560 bytes, more than the 65536"):
        store.add("fat", "fat")
    with pytest.raises(AdapterError, match="was loaded at start-up"):
        store.remove("boot")
    store.remove("via-link")
    assert not store.held("via-link")
    with pytest.raises(AdapterError, match="is not loaded"):
        store.remove("via-link")


def test_no_root_no_run_time_loads(served):
    base, _, adapters = served
    runner, store = slot_runner(base, {"boot": adapters["boot"]}, None, 1)
    with pytest.raises(AdapterError, match="start it with --lora-root DIR") as err:
        store.add("rt-a", str(adapters["rt-a"]))
    assert err.value.code == "FAILED_PRECONDITION"
    # slots shaped for the start-up adapter alone: rank 8 on q and v
    assert runner.lora.shape.rank == 8 and set(runner.lora.shape.targets[0]) == {"q_proj", "v_proj"}
