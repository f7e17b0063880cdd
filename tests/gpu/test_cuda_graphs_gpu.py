"""CUDA graphs for decode on a GPU: greedy outputs with captured decode steps equal those of eager steps
(--enforce-eager), token for token, at batch 1, 8 and 64, for the torch and the cuda attention backends.

The real Scheduler plans each step and the real ModelRunner runs it on the GPU (in one process, as
tests/support/inprocess.py does on the CPU). float32 and a random model with a large initializer_range: greedy
choices are far from ties, so the graph's one decode group per step (the eager path groups by length) cannot
flip a token. Skipped without CUDA or structlog (and, for the cuda backend, CuPy).
"""

from __future__ import annotations

import importlib.util

import pytest
import torch

from tests.support.fake_executor import drive, make_request


def _skip_reason() -> str | None:
    if not torch.cuda.is_available():
        return "needs CUDA"
    if importlib.util.find_spec("structlog") is None:  # the executor's modules log with it
        return "needs structlog (carry its wheel: see bench/gpu_check.sh)"
    return None


SKIP = _skip_reason()
pytestmark = [pytest.mark.gpu, pytest.mark.skipif(SKIP is not None, reason=SKIP or "")]
NUM_PAGES = 1024
BLOCK_SIZE = 16


@pytest.fixture(scope="module")
def model_dir(tmp_path_factory):
    from pagedkv.tools.random_model import build_random_model

    return build_random_model(tmp_path_factory.mktemp("llama-graphs"), arch="llama", seed=11, hidden_size=512,
                              intermediate_size=1024, num_layers=4, num_heads=8, num_kv_heads=2)


class _Executor:
    def __init__(self, runner) -> None:
        self.runner = runner

    def step(self, plan):
        result = self.runner.step(plan)
        assert not result.error, result.error
        return result


def _generate(model_dir, backend: str, graphs_on: bool, batch: int, device: str = "cuda",
              capture=None) -> tuple[list[list[int]], object]:
    """Greedy outputs of ``batch`` random prompts (``device``/``capture``: a CPU dry run of this helper)."""
    from executor_svc.attention import BACKENDS
    from executor_svc.cuda_graphs import DecodeGraphs
    from executor_svc.kv_quant import parse_kv_dtype
    from executor_svc.model import load_model
    from executor_svc.model_config import ModelConfig
    from executor_svc.pages import DevicePagePool
    from executor_svc.runner import ModelRunner
    from scheduler_svc.pages import PagePool
    from scheduler_svc.scheduler import SchedulerConfig
    from tests.support.driven import driven

    cuda = torch.device(device)
    cfg = ModelConfig.from_dir(model_dir)
    model = load_model(cfg, cuda, torch.float32)
    attention = BACKENDS[backend](cfg.num_heads, cfg.num_kv_heads, cfg.head_dim, model.scale)
    pool = DevicePagePool(cfg, NUM_PAGES + graphs_on, BLOCK_SIZE, torch.float32, cuda,
                          parse_kv_dtype("auto", torch.float32))
    pool.copier = attention.copy_pages
    graphs = DecodeGraphs(model, pool, attention, cuda, 64, NUM_PAGES, capture) if graphs_on else None
    runner = ModelRunner(model, pool, attention, cuda, graphs=graphs)
    config = SchedulerConfig(max_num_seqs=64, max_num_batched_tokens=1024, max_model_len=cfg.max_position_embeddings,
                             watermark=0.0)
    scheduler = driven(PagePool(NUM_PAGES, BLOCK_SIZE), config, [])
    gen = torch.Generator().manual_seed(batch)
    reqs = []
    for i in range(batch):
        prompt = torch.randint(3, 250, (int(torch.randint(1, 200, (1,), generator=gen)),), generator=gen).tolist()
        reqs.append(make_request(i, 0, 24 + i % 17, prompt=prompt))
        scheduler.add(reqs[-1])
    drive(scheduler, executor=_Executor(runner))
    return [r.output_ids for r in reqs], graphs


@pytest.mark.parametrize("backend", ["torch", "cuda"])
@pytest.mark.parametrize("batch", [1, 8, 64])
def test_graph_decode_equals_eager(model_dir, backend, batch):
    if backend == "cuda":
        from kernels_cuda.loader import cupy_import_error

        if (err := cupy_import_error()) is not None:
            pytest.skip(f"needs CuPy ({err})")
    eager, _ = _generate(model_dir, backend, False, batch)
    graphed, graphs = _generate(model_dir, backend, True, batch)
    assert graphed == eager
    assert graphs.graphs, "no decode step was replayed from a graph"
    assert max(b for b, _ in graphs.graphs) >= min(batch, 64) // 2
