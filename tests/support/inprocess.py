"""A whole server in one process, without gRPC: the real Scheduler plans each step, the real ModelRunner runs
it on the executor's paged KV (torch backend, CPU), and the Scheduler takes the result, as the Engine loop does
over the Run stream. Small pools make the Scheduler preempt; shared prompts make it hit its prefix cache."""

from __future__ import annotations

from pathlib import Path

import torch

from pagedkv.executor.v1 import executor_pb2 as pb
from scheduler_svc.pages import PagePool
from scheduler_svc.request import Request
from scheduler_svc.scheduler import SchedulerConfig
from tests.support.driven import driven
from tests.support.fake_executor import drive, make_request


class InProcessServer:
    def __init__(self, path: Path, num_pages: int, block_size: int = 16, max_num_seqs: int = 8,
                 max_num_batched_tokens: int = 64, dtype: torch.dtype = torch.float32) -> None:
        from executor_svc.attention.torch_backend import TorchPagedAttention
        from executor_svc.kv_quant import parse_kv_dtype
        from executor_svc.model import load_model
        from executor_svc.model_config import ModelConfig
        from executor_svc.pages import DevicePagePool
        from executor_svc.runner import ModelRunner

        cpu = torch.device("cpu")
        self.cfg = cfg = ModelConfig.from_dir(path)
        model = load_model(cfg, cpu, dtype)
        attention = TorchPagedAttention(cfg.num_heads, cfg.num_kv_heads, cfg.head_dim, model.scale)
        pool = DevicePagePool(cfg, num_pages, block_size, dtype, cpu, parse_kv_dtype("auto", dtype))
        self.runner = ModelRunner(model, pool, attention, cpu)
        config = SchedulerConfig(max_num_seqs=max_num_seqs, max_num_batched_tokens=max_num_batched_tokens,
                                 max_model_len=cfg.max_position_embeddings, watermark=0.0)
        self.scheduler = driven(PagePool(num_pages, block_size), config, list(cfg.eos_token_ids))
        self.next_id = 0

    def step(self, plan: pb.StepPlan) -> pb.StepResult:
        result = self.runner.step(plan)
        assert not result.error, result.error
        return result

    def generate(self, prompts: list[list[int]], max_tokens: list[int], window: int = 0) -> list[Request]:
        """Adds the prompts (greedy, stopping at the model's eos ids) and runs until all have finished; window:
        each request's attention window (the scheduler frees its pages behind it), as the API sets it."""
        reqs = []
        for prompt, n in zip(prompts, max_tokens):
            reqs.append(make_request(self.next_id, 0, n, prompt=list(prompt), window_tokens=window))
            self.next_id += 1
            self.scheduler.add(reqs[-1])
        drive(self.scheduler, executor=self)
        assert all(r.finish is not None for r in reqs), [r.request_id for r in reqs if r.finish is None]
        return reqs
