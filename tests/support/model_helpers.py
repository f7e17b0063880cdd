"""Tiny checkpoints and greedy decoding through the executor's own runner, shared by the model tests
(test_model_config.py, test_model_families.py, test_weights_4bit.py); the transformers side is in
tests/support/hf_reference.py."""

from __future__ import annotations

import json
from pathlib import Path

import torch

from executor_svc.model_config import ModelConfig
from tests.support.fake_executor import samples
from tests.support.hf_reference import hf_greedy, random_prompts

SMALL = dict(hidden_size=64, intermediate_size=128, num_layers=2, num_heads=4, num_kv_heads=2)
VOCAB = 259


def paged_greedy(path: Path, prompts: list[list[int]], max_new: int, block_size: int = 16,
                 stop_ids: tuple[int, ...] | None = None, kv_dtype: str = "auto") -> list[list[int]]:
    """Greedy decoding through the executor's own ModelRunner and paged KV (torch backend, fp32), all prompts
    in one batch; a request stops after a token in stop_ids (default: the config's eos ids, which Describe
    hands the scheduler), as transformers' generate stops."""
    from executor_svc.attention.torch_backend import TorchPagedAttention
    from executor_svc.kv_quant import parse_kv_dtype
    from executor_svc.model import load_model
    from executor_svc.pages import DevicePagePool
    from executor_svc.runner import ModelRunner
    from pagedkv.executor.v1 import executor_pb2 as pb

    cfg = ModelConfig.from_dir(path)
    stop_ids = cfg.eos_token_ids if stop_ids is None else stop_ids
    cpu = torch.device("cpu")
    model = load_model(cfg, cpu, torch.float32)
    attention = TorchPagedAttention(cfg.num_heads, cfg.num_kv_heads, cfg.head_dim, model.scale)
    pages_each = [-(-(len(p) + max_new) // block_size) for p in prompts]
    kv = parse_kv_dtype(kv_dtype, torch.float32)
    pool = DevicePagePool(cfg, sum(pages_each) + 1, block_size, torch.float32, cpu, kv)
    runner = ModelRunner(model, pool, attention, cpu)
    free = iter(range(1, pool.num_pages))
    outs: dict[str, list[int]] = {}
    plan = pb.StepPlan(step_id=0)
    for i, (prompt, n) in enumerate(zip(prompts, pages_each)):
        plan.new_requests.add(request_id=str(i), token_ids=prompt, num_scheduled_tokens=len(prompt),
                              page_ids=[next(free) for _ in range(n)])
        outs[str(i)] = []
    live = set(outs)
    for step in range(max_new):
        if step:
            plan = pb.StepPlan(step_id=step)
            for rid in sorted(live):
                plan.continuing.add(request_id=rid, num_scheduled_tokens=1)
        result = runner.step(plan)
        assert not result.error, result.error
        for rid, token, _ in samples(plan, result):
            outs[rid].append(token)
            if token in stop_ids:
                live.discard(rid)
        if not live:
            break
    return [outs[str(i)] for i in range(len(prompts))]


def assert_greedy_equal(path: Path, max_new: int = 12, **kw) -> None:
    prompts = random_prompts(7, [5, 20, 37], VOCAB)
    want = hf_greedy(path, prompts, [max_new] * len(prompts))
    got = paged_greedy(path, prompts, max_new, **kw)
    assert got == want


def with_config(src: Path, dst: Path, arch_dir_changes: dict, drop: tuple[str, ...] = ()) -> Path:
    """A copy of a checkpoint directory with config.json fields changed (weights are linked, not copied)."""
    dst.mkdir()
    for f in src.iterdir():
        (dst / f.name).symlink_to(f)
    cfg = json.loads((src / "config.json").read_text())
    for k in drop:
        cfg.pop(k, None)
    cfg.update(arch_dir_changes)
    (dst / "config.json").unlink()
    (dst / "config.json").write_text(json.dumps(cfg))
    return dst
