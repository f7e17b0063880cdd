"""Model families through the executor's own runner (tests/support/model_helpers.py), token-exact or within the
stated tolerance against transformers (eager, fp32) on small random checkpoints: 4-bit weights (Phi-3's fused
projections, Qwen3, Gemma 2, every MoE expert), more family fields (tied heads, MQA, per-layer windows), Gemma 2's
final soft-capping in the log-probabilities and its soft-capped attention over 8-bit KV pages, Gemma 2's local and
global layers under a request's page-budget window, and the executor's start-up (config, weights, backend, pools)
for the new families. The greedy runs through the Scheduler, the refusals and released config files:
test_model_families.py."""

from __future__ import annotations

from pathlib import Path

import pytest
import torch

from executor_svc.model_config import ModelConfig
from pagedkv.tools.random_model import build_random_model
from tests.support.fake_executor import samples
from tests.support.hf_reference import hf_greedy, random_prompts
from tests.support.inprocess import InProcessServer
from tests.support.model_helpers import SMALL, VOCAB

pytestmark = pytest.mark.e2e  # in-process, but real model runs against transformers: over the unit budget

torch.set_num_threads(1)


@pytest.mark.parametrize("arch,kw,linears", [
    ("phi3", dict(method="awq", group_size=32), 4 * 2),
    ("phi3", dict(method="gptq", group_size=64, desc_act=True, sym=False), 4 * 2),
    ("qwen3", dict(method="gptq", group_size=32, desc_act=False, sym=True), 4 * 2),
    ("gemma2", dict(method="awq", group_size=32), 4 * 2),
    ("mixtral", dict(method="gptq", group_size=32, desc_act=True, sym=True), (2 + 2 * 4) * 2),  # 4 experts
    ("qwen2_moe", dict(method="awq", group_size=64), (2 + 2 * 4 + 2) * 2),  # + the shared expert
], ids=["phi3-awq", "phi3-gptq-desc_act", "qwen3-gptq", "gemma2-awq", "mixtral-gptq", "qwen2_moe-awq"])
def test_four_bit_weights_equal_to_transformers_on_the_dequantized_weights(arch, kw, linears, tmp_path,
                                                                           monkeypatch):
    """Phi-3's fused qkv_proj and gate_up_proj quantized whole (as AutoAWQ/AutoGPTQ store them), Qwen3's and
    Gemma 2's linears, and every MoE expert (routers stay float, as the tools leave them) load 4-bit; the int4
    kernel in fp32 equals transformers on the dequantized float weights."""
    from executor_svc.model import load_model, quant
    from pagedkv.tools.quantize import quantize_checkpoint
    from tests.support.model_helpers import paged_greedy

    # float32 math over the dequantized weights: our 4-bit product on an AVX-512 CPU, else torch's kernel in fp32
    monkeypatch.setattr(quant, "CPU_KERNEL_DTYPE", None)
    extra = dict(tie_word_embeddings=False, sliding_window=12) if arch == "gemma2" else {}
    src = build_random_model(tmp_path / "src", arch=arch, seed=12, hidden_size=128, intermediate_size=256,
                             num_layers=2, num_heads=4, num_kv_heads=2, **extra)
    q = quantize_checkpoint(src, tmp_path / "q", reference_dir=tmp_path / "ref", **kw)
    model = load_model(ModelConfig.from_dir(q), torch.device("cpu"), torch.float32)
    assert set(model.linear_kinds) <= {"int4-cpu", "int4-cpu (unfused: different input orders)"}, model.linear_kinds
    assert sum(model.linear_kinds.values()) == linears  # qkv, o and every MLP/expert linear: all 4-bit
    prompts = random_prompts(5, [4, 19, 40], VOCAB)
    want = hf_greedy(tmp_path / "ref", prompts, [10] * len(prompts))
    assert paged_greedy(q, prompts, 10) == want


WINDOWS_ON = {"use_sliding_window": True, "sliding_window": 12}


@pytest.mark.parametrize("arch,kw,windows", [
    ("qwen3", dict(tie_word_embeddings=True, num_kv_heads=1), ()),  # as Qwen3-0.6B/1.7B/4B: tied head
    ("phi3", dict(tie_word_embeddings=False, config_overrides={"rms_norm_eps": 0.05}), ()),  # no window
    # windows from max_window_layers up (Qwen3), on the even layers below it (Qwen2-MoE's own rule)
    ("qwen3", dict(tie_word_embeddings=False, config_overrides=dict(WINDOWS_ON, max_window_layers=1)), (0, 12)),
    ("qwen2_moe", dict(tie_word_embeddings=False, config_overrides=dict(WINDOWS_ON, max_window_layers=2)), (12, 0)),
], ids=["qwen3-tied-mqa", "phi3-no-window-eps", "qwen3-windows", "qwen2_moe-windows"])
def test_more_family_fields_greedy_equal_to_transformers(arch, kw, windows, tmp_path):
    from tests.support.model_helpers import assert_greedy_equal

    path = build_random_model(tmp_path / "m", arch=arch, seed=21, **dict(SMALL, **kw))
    cfg = ModelConfig.from_dir(path)
    assert cfg.tie_word_embeddings == kw["tie_word_embeddings"] and cfg.sliding_window is None
    assert cfg.layer_windows == windows
    assert_greedy_equal(path, max_new=24 if windows else 12)


def _paged_first_logprobs(path: Path, prompts: list[list[int]], kv_dtype: str = "auto") -> list[tuple[int, float]]:
    """(greedy token, its log-probability) after each prompt, from one prefill step of the executor's runner."""
    from executor_svc.attention.torch_backend import TorchPagedAttention
    from executor_svc.kv_quant import parse_kv_dtype
    from executor_svc.model import load_model
    from executor_svc.pages import DevicePagePool
    from executor_svc.runner import ModelRunner
    from pagedkv.executor.v1 import executor_pb2 as pb

    cfg = ModelConfig.from_dir(path)
    cpu = torch.device("cpu")
    model = load_model(cfg, cpu, torch.float32)
    attention = TorchPagedAttention(cfg.num_heads, cfg.num_kv_heads, cfg.head_dim, model.scale)
    pool = DevicePagePool(cfg, 16, 16, torch.float32, cpu, parse_kv_dtype(kv_dtype, torch.float32))
    runner = ModelRunner(model, pool, attention, cpu)
    plan = pb.StepPlan(step_id=0)
    free = iter(range(1, 16))
    for i, prompt in enumerate(prompts):
        plan.new_requests.add(request_id=str(i), token_ids=prompt, num_scheduled_tokens=len(prompt),
                              page_ids=[next(free) for _ in range(-(-len(prompt) // 16))],
                              sampling=pb.SamplingParams(logprobs=True))
    result = runner.step(plan)
    assert not result.error, result.error
    by_id = {rid: (token, lp) for rid, token, lp in samples(plan, result)}
    return [by_id[str(i)] for i in range(len(prompts))]


def test_gemma2_final_softcapping_shapes_the_logprobs(tmp_path):
    """cap * tanh(logits / cap) keeps the order of the logits, so greedy tokens cannot show it; the
    log-probabilities can. They equal transformers' (which caps), and differ from the uncapped ones."""
    from transformers import AutoModelForCausalLM

    path = build_random_model(tmp_path / "m", arch="gemma2", seed=8, sliding_window=12, tie_word_embeddings=False,
                              config_overrides={"final_logit_softcapping": 2.0, "attn_logit_softcapping": 3.0},
                              **SMALL)
    prompts = random_prompts(9, [7, 30], VOCAB)
    hf = AutoModelForCausalLM.from_pretrained(str(path), attn_implementation="eager", dtype=torch.float32).eval()

    def hf_first(capped: bool) -> list[tuple[int, float]]:
        hf.config.final_logit_softcapping = 2.0 if capped else None
        with torch.inference_mode():
            lps = [torch.log_softmax(hf(torch.tensor([p])).logits[0, -1], -1) for p in prompts]
        return [(int(lp.argmax()), float(lp.max())) for lp in lps]

    want, uncapped = hf_first(True), hf_first(False)
    got = _paged_first_logprobs(path, prompts)
    assert [t for t, _ in got] == [t for t, _ in want] == [t for t, _ in uncapped]  # same tokens
    assert [lp for _, lp in got] == pytest.approx([lp for _, lp in want], abs=1e-4)
    assert all(abs(g - u) > 1e-2 for (_, g), (_, u) in zip(got, uncapped))


@pytest.mark.parametrize("kv_dtype", ["fp8_e4m3", "int8"])
def test_gemma2_soft_capped_attention_reads_8bit_kv_pages(kv_dtype, tmp_path):
    """The model's own soft-capped attention reads quantized pages through the cache's gather: close to the
    float pages' answer (8-bit KV is not exact)."""
    path = build_random_model(tmp_path / "m", arch="gemma2", seed=8, sliding_window=12, tie_word_embeddings=False,
                              config_overrides={"attn_logit_softcapping": 3.0}, **SMALL)
    prompts = random_prompts(9, [7, 30], VOCAB)
    exact = _paged_first_logprobs(path, prompts)
    quant = _paged_first_logprobs(path, prompts, kv_dtype)
    assert [lp for _, lp in quant] == pytest.approx([lp for _, lp in exact], abs=0.05)


def _hf_gemma_sink_window_greedy(path: Path, prompt: list[int], max_new: int, sink: int, window: int,
                                 model_window: int) -> list[int]:
    """Greedy decoding by transformers (eager, fp32, from scratch each step) with the request's sink + window
    mask on every layer and the model's own window on top of it on the local layers."""
    from transformers import AutoModelForCausalLM

    model = AutoModelForCausalLM.from_pretrained(str(path), attn_implementation="eager", dtype=torch.float32).eval()
    ids = list(prompt)
    with torch.inference_mode():
        for _ in range(max_new):
            i = torch.arange(len(ids)).view(-1, 1)
            j = torch.arange(len(ids)).view(1, -1)
            full = (j <= i) & ((j < sink) | (j > i - window))
            allowed = {"full_attention": full, "sliding_attention": full & (j > i - model_window)}
            masks = {name: torch.zeros(1, 1, len(ids), len(ids)).masked_fill(~a, torch.finfo(torch.float32).min)
                     for name, a in allowed.items()}
            ids.append(int(model(torch.tensor([ids]), attention_mask=masks).logits[0, -1].argmax()))
    return ids[len(prompt):]


def test_gemma2_per_layer_windows_under_a_page_budget_window(tmp_path):
    """A request past its page budget keeps a sink page and its last 48 tokens (the scheduler drops the pages
    between); Gemma 2's local layers keep their own 12-token window inside that, its global layers read the
    whole sink + window, both through the soft-capped attention. Equal to transformers under the same masks."""
    from tests.support.fake_executor import drive, make_request

    path = build_random_model(tmp_path / "m", arch="gemma2", seed=41, sliding_window=12, tie_word_embeddings=False,
                              config_overrides={"attn_logit_softcapping": 3.0}, **SMALL)
    prompt = random_prompts(11, [60], VOCAB)[0]
    server = InProcessServer(path, num_pages=24)
    req = make_request(0, 0, 40, prompt=list(prompt), page_budget=5, sink_tokens=16, window_tokens=48)
    server.scheduler.add(req)
    held = []

    def step(plan):
        held.append(sum(p != -1 for p in req.page_table))
        return server.step(plan)

    drive(server.scheduler, executor=type("Ex", (), {"step": staticmethod(step)})())
    assert req.output_ids == _hf_gemma_sink_window_greedy(path, prompt, 40, sink=16, window=48, model_window=12)
    assert len(req.output_ids) == 40 and max(held) <= 5  # the pages past the budget were dropped


@pytest.mark.parametrize("arch", ["gemma2", "qwen2_moe"])
def test_the_executor_builds_and_runs_the_new_families(arch, tmp_path):
    """The executor's own start-up (config, weights, backend choice, pools, the cost probe's forward) and one
    greedy request through its runner equal transformers."""
    import argparse

    from executor_svc.args import add_args
    from executor_svc.startup import build
    from pagedkv import logs
    from pagedkv.executor.v1 import executor_pb2 as pb

    kw = dict(sliding_window=12, tie_word_embeddings=False) if arch == "gemma2" else {}
    path = build_random_model(tmp_path / "m", arch=arch, seed=42, **SMALL, **kw)
    parser = argparse.ArgumentParser()
    add_args(parser)
    args = parser.parse_args(["--model", str(path), "--device", "cpu", "--num-pages", "8", "--threads", "1"])
    runner, describe = build(args, logs.configure("executor-test"))
    assert (describe.num_layers, describe.attention_backend, list(describe.eos_token_ids)) == (2, "torch", [2])
    prompt = random_prompts(3, [20], VOCAB)[0]
    plan = pb.StepPlan(step_id=1)
    plan.new_requests.add(request_id="a", token_ids=prompt, num_scheduled_tokens=len(prompt), page_ids=[1, 2, 3])
    out = []
    for step in range(8):
        if step:
            plan = pb.StepPlan(step_id=step + 1)
            plan.continuing.add(request_id="a", num_scheduled_tokens=1)
        result = runner.step(plan)
        assert not result.error, result.error
        out.append(result.sampled_token_ids[0])
    assert out == hf_greedy(path, [prompt], [8])[0]
