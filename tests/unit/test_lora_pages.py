"""LoRA adapters' weights in pages of the KV pool (#52, executor_svc/lora/pages.py): the pages an adapter takes from
its bytes and page_bytes; the stacked tensors are views of the pool's last pages (the same storage, each adapter's
rows inside its own pages) for a float and an 8-bit KV pool, and a wipe keeps them; start-up (startup.build)
reports the KV pages only in Describe's num_device_pages and each adapter's pages, plans cannot reach the adapters'
pages, and the forward over a mixed batch still gives PEFT's logits; adapters that leave too few KV pages are
refused naming --lora-modules, the pages they need and the pool's size."""

from __future__ import annotations

import argparse
from pathlib import Path

import pytest
import torch

from executor_svc.attention.metadata import DECODE_SLACK
from executor_svc.batch import build_batch
from executor_svc.kv_quant import parse_kv_dtype
from executor_svc.lora.adapter import TARGETS, LoraAdapter, module_shapes
from executor_svc.lora.batch import lora_batch, step_row_slots
from executor_svc.lora.pages import MIN_KV_PAGES, plan_pages
from executor_svc.lora.stack import LoraStack, region_bytes
from executor_svc.model_config import ModelConfig
from executor_svc.pages import DevicePagePool
from executor_svc.plan_check import PlanError
from pagedkv.executor.v1 import executor_pb2 as pb
from pagedkv.tools.random_model import build_random_model
from tests.support.hf_reference import random_prompts
from tests.support.lora_helpers import make_adapter, peft_logits, peft_reference
from tests.support.model_helpers import SMALL, VOCAB

pytestmark = pytest.mark.unit

SPECS = {"a": (4, ["q_proj", "v_proj"]), "b": (8, list(TARGETS))}  # name -> (rank, targets)
PAGE = 8192  # SMALL's fp32 page: 2 layers x K, V x 16 tokens x 2 kv heads x 16 dims x 4 bytes
EACH = 8  # pages of one adapter: both padded to rank 8 on all 7 modules, 2 layers x 1024 x 8 x 4 bytes = 64 KiB


@pytest.fixture(scope="module")
def served(tmp_path_factory) -> tuple[Path, dict[str, Path]]:
    root = tmp_path_factory.mktemp("lora-pages")
    base = build_random_model(root / "base", seed=3, **SMALL)
    return base, {n: make_adapter(base, root / n, r, t, seed=30 + i) for i, (n, (r, t)) in enumerate(SPECS.items())}


def _fake(cfg: ModelConfig, name: str, rank: int, targets: list[str], seed: int) -> LoraAdapter:
    g, shapes = torch.Generator().manual_seed(seed), module_shapes(cfg)
    weights = {(layer, m): (torch.randn(rank, shapes[m][0], generator=g), torch.randn(shapes[m][1], rank, generator=g))
               for layer in range(cfg.num_layers) for m in targets}
    return LoraAdapter(name, Path(name), rank, 2.0, tuple(t for t in TARGETS if t in targets), weights)


def _build(base: Path, adapters: dict[str, Path], num_pages: int):
    from executor_svc.args import add_args
    from executor_svc.startup import build
    from pagedkv import logs

    parser = argparse.ArgumentParser()
    add_args(parser)
    args = parser.parse_args(["--model", str(base), "--device", "cpu", "--num-pages", str(num_pages), "--threads",
                              "1", "--swap-space", "0", "--lora-modules", *(f"{n}={p}" for n, p in adapters.items())])
    return build(args, logs.configure("executor-test"))


def test_pages_per_adapter_from_bytes_and_page_bytes(served):
    cfg = ModelConfig.from_dir(served[0])
    one = [_fake(cfg, "r8", 8, list(TARGETS), 1)]
    assert region_bytes(one, cfg, torch.float32) == one[0].num_bytes(torch.float32) == EACH * PAGE
    assert region_bytes(one, cfg, torch.bfloat16) == EACH * PAGE // 2
    held = plan_pages(one, cfg, torch.bfloat16, 100, PAGE)
    assert (held.first, held.each, held.spare, held.per_adapter()) == (96, EACH // 2, 0, [EACH // 2])
    small = [_fake(cfg, "r1", 1, ["q_proj"], 2)]  # 2 layers x (64 + 64) x 4 bytes: 1 KiB, still a whole page
    assert small[0].num_bytes(torch.float32) == 1024 and plan_pages(small, cfg, torch.float32, 10, PAGE).each == 1
    # padding to the largest rank is memory held: a rank-1 adapter beside a rank-8 one holds as many pages as it
    mixed = plan_pages(small + one, cfg, torch.float32, 100, PAGE)
    assert mixed.per_adapter() == [EACH, EACH] and mixed.first == 100 - 2 * EACH
    for page in (8196, 5000, 4099 * 4):  # page_bytes not a multiple of 16: every region still starts aligned
        held = plan_pages(small + one, cfg, torch.float32, 1000, page)
        assert held.each >= -(-EACH * PAGE // page) and held.each * page % 16 == 0 and held.first * page % 16 == 0
        assert sum(held.per_adapter()) == held.total == 1000 - held.first


@pytest.mark.parametrize("dtype, kv", [(torch.float32, "auto"), (torch.float32, "int8"),
                                       (torch.bfloat16, "fp8_e4m3"), (torch.bfloat16, "auto")])
def test_stacked_tensors_are_views_of_the_pools_last_pages(served, dtype, kv):
    cfg = ModelConfig.from_dir(served[0])
    adapters = [_fake(cfg, "x", 4, ["q_proj", "down_proj"], 3), _fake(cfg, "y", 8, ["k_proj", "up_proj"], 4)]
    pool = DevicePagePool(cfg, 200, 16, dtype, torch.device("cpu"), parse_kv_dtype(kv, dtype))
    held = plan_pages(adapters, cfg, dtype, 199, pool.page_bytes)  # (the pool's last page: a scratch page)
    stack = LoraStack(adapters, cfg, torch.device("cpu"), dtype, memory=held.carve(pool, dtype))
    assert pool.held == range(held.first, 199) and stack.held_bytes() == 2 * held.each * pool.page_bytes
    base = pool.pages.data_ptr()
    for k in range(2):  # each adapter's rows of every stacked tensor lie in its own pages
        lo = base + (held.first + k * held.each) * pool.page_bytes
        for lin in (lin for here in stack.layers for lin in here.values()):
            for t in (lin.shrink, *lin.expand):
                assert t.untyped_storage().data_ptr() == pool.pages.untyped_storage().data_ptr()
                row = t[k]
                end = sum((s - 1) * st for s, st in zip(row.shape, row.stride())) + 1
                last = row.data_ptr() + end * row.element_size()
                assert lo <= row.data_ptr() and last <= lo + held.each * pool.page_bytes
    r, lin = stack.rank, stack.layers[1]["qkv"]  # the weights were copied in
    assert lin.slices == ((0, 64), (64, 32))
    assert torch.equal(lin.shrink[0, :, :4], adapters[0].weights[1, "q_proj"][0].t().to(dtype))
    assert torch.equal(lin.expand[1][1], adapters[1].weights[1, "k_proj"][1].t().to(dtype))
    before = [t.clone() for here in stack.layers for lin in here.values() for t in (lin.shrink, *lin.expand)]
    pool.pages[:held.first] = 1
    pool.pages[199] = 1
    pool.wipe()  # a new Run stream: the KV pages and the scratch page are zeroed, the adapters' are kept
    assert not pool.pages[:held.first].any() and not pool.pages[199].any()
    after = [t for here in stack.layers for lin in here.values() for t in (lin.shrink, *lin.expand)]
    assert all(torch.equal(a, b) for a, b in zip(before, after)) and any(t.any() for t in after)
    assert r == 8 and not stack.layers[0]["qkv"].shrink[0, :, 4:].any()  # zeros past rank 4


def _plan(prompts: list[list[int]], adapters: list[str | None]) -> pb.StepPlan:
    plan, page = pb.StepPlan(step_id=0), 0
    for i, (prompt, adapter) in enumerate(zip(prompts, adapters)):
        n = -(-(len(prompt) + 16) // 16)
        plan.new_requests.add(request_id=str(i), token_ids=prompt, num_scheduled_tokens=len(prompt),
                              page_ids=list(range(page, page + n)), adapter=adapter or "")
        page += n
    return plan


def test_describe_counts_kv_pages_only_and_the_forward_matches_peft(served):
    base, adapters = served
    runner, describe = _build(base, adapters, 40)
    assert describe.page_bytes == PAGE and [(a.name, a.num_pages) for a in describe.adapters] == [("a", EACH),
                                                                                                 ("b", EACH)]
    assert describe.num_device_pages == runner.num_pages == runner.mirror.num_pages == 40 - 2 * EACH
    assert runner.pool.held == range(24, 40) and runner.pool.num_pages == 40  # (no scratch page: CPU, eager)
    assert runner.lora.memory.untyped_storage().data_ptr() == runner.pool.pages.untyped_storage().data_ptr()
    reach = pb.StepPlan(step_id=0)
    reach.new_requests.add(request_id="x", token_ids=[1, 5], num_scheduled_tokens=2, page_ids=[24])
    with pytest.raises(PlanError, match=r"page id 24 outside \[0, 24\)"):  # a plan cannot reach an adapter's page
        runner.mirror.apply(reach)
    rows = [None, "a", "b", "a", None]
    prompts = random_prompts(9, [7, 12, 5, 9, 6], VOCAB)
    scheduled = runner.mirror.apply(_plan(prompts, rows))
    ids, pos, meta, _ = build_batch(scheduled, runner.block_size, runner.device, lambda: DECODE_SLACK, None)
    lora = lora_batch(runner.lora, step_row_slots([(i.count, i.state.adapter) for i in scheduled]), runner.device)
    logits = runner.model.forward(ids, pos, meta, runner.pool, runner.attention, torch.arange(len(ids)), lora)
    reference, at = peft_reference(base, adapters), 0
    for prompt, adapter in zip(prompts, rows):
        assert (logits[at:at + len(prompt)] - peft_logits(reference, adapter, prompt)).abs().max() <= 1e-4, adapter
        at += len(prompt)


def test_adapters_leaving_too_few_kv_pages_are_refused(served):
    base, adapters = served
    too_few = 2 * EACH + MIN_KV_PAGES - 1
    with pytest.raises(ValueError) as err:
        _build(base, adapters, too_few)
    msg = str(err.value)
    assert msg.startswith("--lora-modules / --max-loras: the 2 adapter slots need 16 pages of the KV pool "
                          "(8 each of 8192 bytes")
    assert f"the pool has {too_few} pages (--num-pages {too_few})" in msg and "15 would be left" in msg
    assert f"at least {2 * EACH + MIN_KV_PAGES} pages" in msg
    _, describe = _build(base, adapters, too_few + 1)
    assert describe.num_device_pages == MIN_KV_PAGES
