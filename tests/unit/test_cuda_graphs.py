"""CUDA graphs for decode (executor_svc.cuda_graphs) on the CPU: bucket choice, padding onto the scratch page,
static-buffer filling and un-padding, through the runner's real graph path with a capture that replays the
eager forward on the static buffers (the GPU test, tests/gpu/test_cuda_graphs_gpu.py, captures for real)."""

from __future__ import annotations

import argparse

import pytest
import torch

from executor_svc.batch import DecodeRow
from executor_svc.cuda_graphs import (
    DecodeGraphs,
    StaticDecodeBatch,
    bucket_for,
    decode_buckets,
    eager_capture,
    graph_blocker,
    width_for,
)
from tests.support.fake_executor import samples
from tests.support.inprocess import InProcessServer

pytestmark = pytest.mark.unit


def test_buckets_are_powers_of_two_up_to_the_largest():
    assert decode_buckets(1) == [1]
    assert decode_buckets(8) == [1, 2, 4, 8]
    assert decode_buckets(100) == [1, 2, 4, 8, 16, 32, 64, 100]
    assert [bucket_for(n, decode_buckets(100)) for n in (1, 2, 3, 5, 64, 65, 100, 101)] == [1, 2, 4, 8, 64, 100,
                                                                                          100, None]
    assert [width_for(p) for p in (1, 2, 3, 4, 5, 17)] == [1, 2, 4, 4, 8, 32]
    with pytest.raises(ValueError, match="cuda-graph-max-batch"):
        decode_buckets(0)


def test_padding_rows_write_and_read_only_the_scratch_page():
    static = StaticDecodeBatch(4, 4, torch.device("cpu"), scratch_page=9, sliding_window=None)
    static.fill([DecodeRow(5, 17, 3, 1, [2, 3], sink=4, window=8), DecodeRow(6, 0, 7, 0, [7])])
    assert static.ids.tolist() == [5, 6, 0, 0]
    assert static.positions.tolist() == [17, 0, 0, 0]
    assert static.slot_pages.tolist() == [3, 7, 9, 9]  # the dummies' slots are on the scratch page
    assert static.slot_offsets.tolist() == [1, 0, 0, 0]
    assert static.ctx_lens.tolist() == [18, 1, 1, 1]  # a dummy attends to its own slot alone
    assert static.page_tables.tolist() == [[2, 3, 0, 0], [7, 0, 0, 0], [9, 0, 0, 0], [9, 0, 0, 0]]
    assert static.sinks.tolist() == [4, 0, 0, 0] and static.windows.tolist() == [8, 0, 0, 0]
    with pytest.raises(ValueError, match="do not fit"):
        static.fill([DecodeRow(1, 80, 3, 0, [1, 2, 3, 4, 5])])


def _graph_server(path, num_pages: int, max_batch: int, captures: list, reference: bool = False) -> InProcessServer:
    """An in-process server whose runner replays decode steps through DecodeGraphs with an eager 'capture' (the
    pool has one page more than the scheduler's: the scratch page)."""
    from executor_svc.kv_quant import parse_kv_dtype
    from executor_svc.pages import DevicePagePool
    from executor_svc.runner import ModelRunner

    server = _server(path, num_pages, reference)
    old = server.runner
    pool = DevicePagePool(server.cfg, num_pages + 1, old.block_size, torch.float32, torch.device("cpu"),
                          parse_kv_dtype("auto", torch.float32))

    def capture(forward):
        captures.append(forward)
        return eager_capture(forward)

    graphs = DecodeGraphs(old.model, pool, old.attention, torch.device("cpu"), max_batch, scratch_page=num_pages,
                          capture=capture)
    server.runner = ModelRunner(old.model, pool, old.attention, torch.device("cpu"), graphs=graphs)
    assert server.runner.num_pages == num_pages
    return server


def _server(path, num_pages: int, reference: bool) -> InProcessServer:
    """reference: attention gathers pages and masks (the torch backend's path on CUDA) instead of the CPU kernel."""
    from executor_svc.attention.torch_backend import TorchPagedAttention

    server = InProcessServer(path, num_pages=num_pages, max_num_seqs=16)
    if reference:
        a = server.runner.attention
        server.runner.attention = TorchPagedAttention(a.num_heads, a.num_kv_heads, a.head_dim, a.scale, reference=True)
    return server


@pytest.mark.parametrize("reference", [False, True], ids=["cpu-kernel", "gather"])
def test_padded_graph_decode_equals_eager_token_for_token(tiny_llama_dir, reference):
    prompts = [[(7 * i + j) % 200 + 3 for j in range(5 + 9 * i)] for i in range(11)]  # 11 requests: bucket 16
    max_tokens = [24 + 3 * i for i in range(11)]
    eager = _server(tiny_llama_dir, 96, reference)
    want = [r.output_ids for r in eager.generate(prompts, max_tokens)]
    captures: list = []
    graphed = _graph_server(tiny_llama_dir, 96, max_batch=16, captures=captures, reference=reference)
    scratch = graphed.runner.pool.pages[96]
    scratch.fill_(float("nan"))  # a real row that read the scratch page would turn NaN
    replays = []
    run = graphed.runner.graphs.run
    graphed.runner.graphs.run = lambda rows: replays.append(len(rows)) or run(rows)
    got = [r.output_ids for r in graphed.generate(prompts, max_tokens)]
    assert got == want
    # decode steps went through the graphs, padded to the buckets: captured once per (bucket, width)
    assert replays and max(replays) == 11 and len(captures) == len(graphed.runner.graphs.graphs)
    assert {b for b, _ in graphed.runner.graphs.graphs} >= {16, 1}
    # the dummies wrote slot 0 of the scratch page, and only it (layer 0: later layers of a dummy that gathers
    # the whole NaN page may turn NaN themselves, which only the dropped dummy rows see)
    assert not scratch[0, :, 0].isnan().any() and scratch[:, :, 1:].isnan().all()


def test_decode_steps_above_the_largest_bucket_run_eager(tiny_llama_dir):
    prompts = [[i + 3, i + 4, i + 5] for i in range(6)]
    eager = InProcessServer(tiny_llama_dir, num_pages=32, max_num_seqs=16)
    want = [r.output_ids for r in eager.generate(prompts, [6] * 6)]
    graphed = _graph_server(tiny_llama_dir, 32, max_batch=4, captures=[])
    got = [r.output_ids for r in graphed.generate(prompts, [6] * 6)]
    assert got == want
    assert all(b <= 4 for b, _ in graphed.runner.graphs.graphs)


def test_plans_may_not_use_the_scratch_page(tiny_llama_dir):
    from pagedkv.executor.v1 import executor_pb2 as pb

    server = _graph_server(tiny_llama_dir, 8, max_batch=4, captures=[])
    plan = pb.StepPlan(step_id=1)
    plan.new_requests.add(request_id="a", token_ids=[3, 4, 5], num_scheduled_tokens=3, page_ids=[8],
                          sampling=pb.SamplingParams())
    result = server.runner.step(plan)
    assert "page id 8 outside [0, 8)" in result.error


def test_graphs_are_off_where_they_cannot_run(tiny_llama_dir):
    from executor_svc.kv_quant import parse_kv_dtype
    from executor_svc.model import load_model
    from executor_svc.model_config import ModelConfig
    from executor_svc.startup import _graphs_off_reason

    cfg = ModelConfig.from_dir(tiny_llama_dir)
    model = load_model(cfg, torch.device("cpu"), torch.float32)
    args = argparse.Namespace(enforce_eager=False, cuda_graph_max_batch=256)
    plain, q8 = parse_kv_dtype("auto", torch.float32), parse_kv_dtype("int8", torch.float32)
    assert "CUDA device" in _graphs_off_reason(args, torch.device("cpu"), model, plain)
    assert _graphs_off_reason(args, torch.device("cuda"), model, plain) is None
    assert "8-bit" in _graphs_off_reason(args, torch.device("cuda"), model, q8)
    eager = argparse.Namespace(enforce_eager=True, cuda_graph_max_batch=256)
    assert _graphs_off_reason(eager, torch.device("cuda"), model, plain) == "--enforce-eager"
    assert graph_blocker(type("M", (), {})(), None) == "the model has no config"
    with pytest.raises(ValueError, match="--cuda-graph-max-batch must be >= 1"):
        _graphs_off_reason(argparse.Namespace(enforce_eager=False, cuda_graph_max_batch=0),
                           torch.device("cuda"), model, plain)


def test_single_token_prefill_rows_ride_the_graph_without_sampling(tiny_llama_dir):
    """A step of one-token rows where one is a prompt chunk (not its last token): the graph path computes it,
    samples only the finished rows, and agrees with eager step by step."""
    from pagedkv.executor.v1 import executor_pb2 as pb

    def plans() -> list[pb.StepPlan]:
        first = pb.StepPlan(step_id=1)
        first.new_requests.add(request_id="a", token_ids=[3, 9, 4, 7, 5], num_scheduled_tokens=5, page_ids=[0],
                               sampling=pb.SamplingParams())
        second = pb.StepPlan(step_id=2, decodes=["a"])
        second.new_requests.add(request_id="b", token_ids=[8, 6, 2], num_scheduled_tokens=1, page_ids=[1],
                                sampling=pb.SamplingParams())
        third = pb.StepPlan(step_id=3, decodes=["a"])
        third.continuing.add(request_id="b", num_scheduled_tokens=1)
        fourth = pb.StepPlan(step_id=4, decodes=["a"])
        fourth.continuing.add(request_id="b", num_scheduled_tokens=1)
        return [first, second, third, fourth]

    eager = _server(tiny_llama_dir, 8, False).runner
    graphed = _graph_server(tiny_llama_dir, 8, max_batch=4, captures=[]).runner
    for plan in plans():
        want, got = eager.step(plan), graphed.step(plan)
        assert not want.error and not got.error, (want.error, got.error)
        assert [s[:2] for s in samples(plan, got)] == [s[:2] for s in samples(plan, want)]
        assert got.num_computed_tokens == want.num_computed_tokens
    assert [s[0] for s in samples(plan, want)] == ["b", "a"]  # the last step: b's last prompt token finishes it
    assert set(graphed.graphs.graphs) == {(2, 1)}  # steps 2-4 went through the graph of two rows
