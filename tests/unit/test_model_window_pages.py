"""The model's own sliding window frees pages: Describe.model_sliding_window tells the scheduler how far back
any layer of the model reads (0 when some layer reads the whole context: Gemma's global layers, Qwen2's full
layers below max_window_layers), and every request gets it as its attention window, so its pages behind the
window go back to the pool while outputs stay equal to transformers."""

from __future__ import annotations

import argparse

import pytest
import torch

from executor_svc.model_config import ModelConfig
from pagedkv.executor.v1 import executor_pb2 as pb
from pagedkv.tenancy import Tenant
from pagedkv.tools.random_model import build_random_model
from scheduler_svc import fit
from scheduler_svc.args import model_window
from tests.support.hf_reference import hf_greedy, random_prompts
from tests.support.inprocess import InProcessServer
from tests.support.model_helpers import SMALL, VOCAB

pytestmark = pytest.mark.unit  # in-process (InProcessServer starts no process)
torch.set_num_threads(1)


@pytest.mark.parametrize("arch, kw, window", [
    ("mistral", {"sliding_window": 24}, 24),
    ("llama", {}, 0),
    ("gemma2", {"sliding_window": 12, "tie_word_embeddings": False}, 0),  # a global layer reads everything
    ("qwen2", {"config_overrides": {"use_sliding_window": True, "sliding_window": 12, "max_window_layers": 1}}, 0),
])
def test_the_model_window_is_every_layers_widest_or_none(arch, kw, window, tmp_path):
    path = build_random_model(tmp_path / arch, arch=arch, **dict(dict(SMALL, seed=41), **kw))
    assert ModelConfig.from_dir(path).model_window == window


def test_pages_behind_the_model_window_are_freed_and_outputs_stay_equal_to_transformers(tmp_path):
    path = build_random_model(tmp_path / "mistral", arch="mistral", **dict(SMALL, seed=1, sliding_window=24))
    window = ModelConfig.from_dir(path).model_window
    prompts = random_prompts(5, [90, 120], VOCAB)
    want = hf_greedy(path, prompts, [40, 40])
    assert [len(w) for w in want] == [40, 40]  # (no early eos: the pools fill up)
    full = InProcessServer(path, num_pages=64, block_size=8)
    assert [r.output_ids for r in full.generate(prompts, [40, 40])] == want
    windowed = InProcessServer(path, num_pages=64, block_size=8)
    assert [r.output_ids for r in windowed.generate(prompts, [40, 40], window=window)] == want
    limit = fit.window_page_limit(64, 0, window, 8, 64)  # what one windowed request may hold
    assert full.scheduler.counters.peak_used_pages == 17 + 20  # 130 and 160 tokens of 8-token pages
    assert windowed.scheduler.counters.peak_used_pages <= 2 * limit < 17 + 20


def test_requests_get_the_model_window_only_when_its_pages_fit():
    args = argparse.Namespace(sink_tokens=0)
    describe = pb.DescribeResponse(model_sliding_window=4096, block_size=16, num_device_pages=100)
    assert model_window(args, describe) == 0  # 258 pages: requests hold their whole context, capped to the pool
    describe.num_device_pages = 300
    assert model_window(args, describe) == 4096
    quiet = Tenant("t")
    assert fit.attention_window(quiet, 0, 0, 0, 16, model_window=4096) == (0, 4096)
    assert fit.attention_window(Tenant("t", sliding_window=256, sink_tokens=4), 0, 0, 0, 16, 4096) == (4, 256)
