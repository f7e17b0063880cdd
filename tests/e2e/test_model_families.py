"""Model families beyond Llama: Qwen3 (an RMSNorm over each q/k head before rope, explicit head_dim), Phi-3
(fused qkv_proj and gate_up_proj, a window on every layer), Gemma 2 and Gemma 3 text (alternating local and
global layers, (1 + w) sandwich norms, scaled embeddings, query_pre_attn_scalar, soft-capping), Mixtral,
Qwen2-MoE and Qwen3-MoE (top-k routed experts, Qwen2-MoE's gated shared expert), Qwen2 with per-layer
windows, next to Llama, Qwen2 and Mistral. Each is greedy
token-exact against transformers (eager, fp32) on a small random checkpoint at block size 16, served by the
real Scheduler and ModelRunner in one process (tests/support/inprocess.py) through a prefix-cache hit and a
preemption, both counted so the test cannot pass without them. What is not implemented is refused by name."""

from __future__ import annotations

import json
from pathlib import Path

import pytest
import torch

from executor_svc.model_config import ModelConfig
from pagedkv.tools.random_model import build_random_model
from tests.support.fake_executor import samples
from tests.support.hf_reference import hf_greedy, random_prompts
from tests.support.inprocess import InProcessServer
from tests.support.model_helpers import SMALL, VOCAB, with_config

pytestmark = pytest.mark.e2e  # in-process (InProcessServer), but about 11 s here: over the unit budget

torch.set_num_threads(1)

MAX_NEW = 24
GEMMA3_ROPE = {"sliding_attention": {"rope_type": "default", "rope_theta": 10000.0},
               "full_attention": {"rope_type": "linear", "factor": 4.0, "rope_theta": 1000000.0}}
# id -> (arch, build_random_model keywords, what ModelConfig must read from config.json)
FAMILIES = {
    "llama": ("llama", {}, {"family": "llama", "head_dim": 16}),
    "qwen2": ("qwen2", {}, {"family": "qwen2", "attention_bias": True, "o_proj_bias": False}),
    # Qwen2.5 with its window on the layers from max_window_layers up (layer 1 of 2)
    "qwen2-windows": ("qwen2", {"config_overrides": {"use_sliding_window": True, "sliding_window": 12,
                                                    "max_window_layers": 1}},
                      {"family": "qwen2", "layer_windows": (0, 12), "sliding_window": None}),
    "mistral": ("mistral", {"sliding_window": 24}, {"family": "mistral", "sliding_window": 24}),
    # head_dim 32 while hidden_size / heads is 16; q/k/v/o biases
    "qwen3": ("qwen3", {"config_overrides": {"head_dim": 32, "attention_bias": True}},
              {"family": "qwen3", "qk_norm": True, "head_dim": 32, "attention_bias": True, "o_proj_bias": True}),
    "phi3": ("phi3", {"sliding_window": 24, "config_overrides": {"hidden_act": "gelu_pytorch_tanh"}},
             {"family": "phi3", "fused_projections": True, "sliding_window": 24, "head_dim": 16,
              "hidden_act": "gelu_pytorch_tanh"}),
    # (1 + w) norms, embeddings x sqrt(hidden), q/k/v/o biases, head_dim 32 != hidden / heads
    "gemma": ("gemma", {"tie_word_embeddings": False, "config_overrides": {"attention_bias": True, "head_dim": 32}},
              {"family": "gemma", "gemma": True, "sandwich_norms": False, "attention_bias": True, "o_proj_bias": True,
               "head_dim": 32, "attn_scale": 32 ** -0.5, "hidden_act": "gelu_pytorch_tanh"}),
    # local (window 12) then global layer; caps small enough that tanh bends; scale 24 ** -0.5, not 16 ** -0.5.
    # Untied: with tied embeddings scaled by sqrt(hidden) a random model only repeats its input token.
    "gemma2": ("gemma2", {"sliding_window": 12, "tie_word_embeddings": False, "config_overrides": {
        "attn_logit_softcapping": 3.0, "final_logit_softcapping": 5.0, "query_pre_attn_scalar": 24}},
        {"family": "gemma2", "gemma": True, "sandwich_norms": True, "layer_windows": (12, 0), "attn_softcap": 3.0,
         "final_softcap": 5.0,
         "attn_scale": 24 ** -0.5, "hidden_act": "gelu_pytorch_tanh", "sliding_window": None}),
    # q/k (1 + w) norms; a rope table per layer type (linear scaling on the global one, as Gemma 3 4B+)
    "gemma3": ("gemma3", {"sliding_window": 12, "tie_word_embeddings": False, "config_overrides": {
        "layer_types": ["sliding_attention", "full_attention"], "rope_parameters": GEMMA3_ROPE,
        "query_pre_attn_scalar": 24}},
        {"family": "gemma3_text", "gemma": True, "qk_norm": True, "layer_windows": (12, 0),
         "layer_types": ("sliding_attention", "full_attention"), "attn_softcap": None}),
    # Gemma 3 4B+ are multimodal checkpoints: their language model served text-only, the vision tower not loaded
    "gemma3-multimodal": ("gemma3_multimodal", {"sliding_window": 12, "tie_word_embeddings": False,
                                                "config_overrides": {"layer_types": ["sliding_attention",
                                                                                     "full_attention"]}},
                          {"family": "gemma3_text", "language_model_only": True, "layer_windows": (12, 0),
                           "architecture": "Gemma3ForConditionalGeneration", "tie_word_embeddings": False}),
    # 4 experts, top-2, renormalized; a window on every layer (seed 41 ends one prompt at eos after 3 tokens)
    "mixtral": ("mixtral", {"sliding_window": 24, "seed": 42}, {"family": "mixtral", "sliding_window": 24}),
    # shared expert with its sigmoid gate; layer 1 a dense MLP (mlp_only_layers); top-2 not renormalized
    "qwen2_moe": ("qwen2_moe", {"config_overrides": {"mlp_only_layers": [1], "norm_topk_prob": False}},
                  {"family": "qwen2_moe", "attention_bias": True}),
    "qwen3_moe": ("qwen3_moe", {"config_overrides": {"norm_topk_prob": True, "num_experts_per_tok": 3}},
                  {"family": "qwen3_moe", "qk_norm": True}),
}
MOE_SPECS = {  # id -> what ModelConfig.moe must hold (num_experts, top_k, normalize, shared_size, sparse_layers)
    "mixtral": (4, 2, True, 0, (True, True)),
    "qwen2_moe": (4, 2, False, 128, (True, False)),
    "qwen3_moe": (4, 3, True, 0, (True, True)),
}


@pytest.mark.parametrize("family_id", list(FAMILIES))
def test_greedy_equal_to_transformers_through_a_prefix_hit_and_a_preemption(family_id, tmp_path):
    """Wave 1 computes a 40-token prompt; wave 2 brings a prompt sharing its first 36 tokens (two full pages
    come from the prefix cache) and two others into a 9-page pool, too small for all three to finish without
    a recompute preemption. Every output equals transformers' one-prompt-at-a-time greedy decoding."""
    arch, kw, reads = FAMILIES[family_id]
    path = build_random_model(tmp_path / arch, arch=arch, **dict(dict(SMALL, seed=41), **kw))
    cfg = ModelConfig.from_dir(path)
    assert {k: getattr(cfg, k) for k in reads} == reads
    if family_id in MOE_SPECS:
        m = cfg.moe
        assert (m.num_experts, m.top_k, m.normalize, m.shared_size, m.sparse_layers) == MOE_SPECS[family_id]
    assert cfg.unknown_fields == ()
    base = random_prompts(5, [40], VOCAB)[0]
    second = [base[:36] + random_prompts(6, [9], VOCAB)[0][1:]] + random_prompts(7, [23, 30], VOCAB)
    want = hf_greedy(path, [base] + second, [MAX_NEW] * 4)

    server = InProcessServer(path, num_pages=9)
    first = server.generate([base], [MAX_NEW])
    rest = server.generate(second, [MAX_NEW] * 3)
    assert [r.output_ids for r in first + rest] == want
    assert rest[0].num_cached_tokens == 32  # the prefix hit: two full pages of wave 1
    assert server.scheduler.counters.recompute_preemptions >= 1  # the preemption
    assert any(r.num_preemptions for r in rest)


def test_qwen3_needs_its_head_norms_and_phi3_its_fused_tensors(tmp_path):
    """A Llama checkpoint relabelled Qwen3 lacks q_norm/k_norm; relabelled Phi-3 it lacks qkv_proj and
    gate_up_proj: both are refused by tensor name, never run without them."""
    from executor_svc.model import load_model

    src = build_random_model(tmp_path / "src", seed=5, **SMALL)
    cases = {"qwen3": "model.layers.0.self_attn.q_norm.weight", "phi3": "model.layers.0.self_attn.qkv_proj.weight"}
    for family, tensor in cases.items():
        arch = {"qwen3": "Qwen3ForCausalLM", "phi3": "Phi3ForCausalLM"}[family]
        path = with_config(src, tmp_path / family, {"model_type": family, "architectures": [arch], "head_dim": 16})
        with pytest.raises(ValueError, match=r"missing tensors \[.*" + tensor.replace(".", r"\.")):
            load_model(ModelConfig.from_dir(path), torch.device("cpu"), torch.float32)


@pytest.fixture(scope="module")
def phi3_dir(tmp_path_factory) -> Path:
    return build_random_model(tmp_path_factory.mktemp("phi3"), arch="phi3", seed=4, **SMALL)


@pytest.fixture(scope="module")
def qwen3_dir(tmp_path_factory) -> Path:
    return build_random_model(tmp_path_factory.mktemp("qwen3"), arch="qwen3", seed=4, **SMALL)


LONGROPE = {"rope_type": "longrope", "rope_theta": 10000.0, "short_factor": [1.0] * 8, "long_factor": [2.0] * 8}

# (base, config changes, dropped fields, text the error must show: the field and its value)
REFUSALS = [
    # Phi-3-mini-128k style: longrope tables change with the sequence length
    ("phi3", {"rope_scaling": LONGROPE, "original_max_position_embeddings": 512}, ("rope_parameters",),
     ["rope_type", "'longrope'"]),
    # Phi-4-mini style: rotary embedding over part of each head
    ("phi3", {"rope_parameters": {"rope_type": "default", "rope_theta": 10000.0, "partial_rotary_factor": 0.75}},
     (), ["partial_rotary_factor", "0.75"]),
    ("phi3", {"architectures": ["Phi3ForSequenceClassification"]}, (), ["architectures", "Phi3ForSequence"]),
    ("qwen3", {"rope_parameters": {"rope_type": "dynamic", "factor": 2.0, "rope_theta": 1e6}}, (),
     ["rope_type", "'dynamic'"]),
    # Gemma: an activation, a rope table of one layer type, an attention type, a multimodal checkpoint
    ("gemma2", {"hidden_activation": "gelu_new"}, (), ["hidden_activation = 'gelu_new'"]),
    ("gemma3", {"rope_parameters": {"full_attention": {"rope_type": "dynamic", "factor": 2.0, "rope_theta": 1e6},
                                    "sliding_attention": {"rope_type": "default", "rope_theta": 1e4}}}, (),
     ["rope_parameters['full_attention'].rope_type", "'dynamic'"]),
    ("gemma3", {"layer_types": ["sliding_attention", "chunked_attention"]}, (), ["layer_types", "chunked_attention"]),
    # a flat config under the multimodal model_type; a multimodal checkpoint of another class
    ("gemma3", {"model_type": "gemma3", "architectures": ["Gemma3ForConditionalGeneration"]}, (),
     ["model_type 'gemma3' needs text_config"]),
    ("gemma3_multimodal", {"architectures": ["PaliGemmaForConditionalGeneration"]}, (),
     ["architectures", "Gemma3ForConditionalGeneration"]),
    ("gemma3_multimodal", {"text_config": {"model_type": "gemma2"}}, (), ["text_config.model_type = 'gemma2'"]),
    # MoE: another family's fields, a top-k past the experts
    ("mixtral", {"shared_expert_intermediate_size": 64}, (), ["shared_expert_intermediate_size = 64", "qwen2_moe"]),
    ("mixtral", {"num_experts_per_tok": 5}, (), ["num_experts_per_tok = 5", "[1, 4]"]),
    ("qwen3", {"num_experts": 4}, (), ["num_experts = 4", "mixtral"]),
    ("qwen2", {"attn_logit_softcapping": 50.0}, (), ["attn_logit_softcapping = 50.0", "gemma2"]),
]


@pytest.fixture(scope="module")
def gemma2_dir(tmp_path_factory) -> Path:
    return build_random_model(tmp_path_factory.mktemp("gemma2"), arch="gemma2", seed=4, **SMALL)


@pytest.fixture(scope="module")
def gemma3_dir(tmp_path_factory) -> Path:
    return build_random_model(tmp_path_factory.mktemp("gemma3"), arch="gemma3", seed=4, **SMALL)


@pytest.fixture(scope="module")
def gemma3_multimodal_dir(tmp_path_factory) -> Path:
    return build_random_model(tmp_path_factory.mktemp("gemma3mm"), arch="gemma3_multimodal", seed=4, **SMALL)


@pytest.fixture(scope="module")
def mixtral_dir(tmp_path_factory) -> Path:
    return build_random_model(tmp_path_factory.mktemp("mixtral"), arch="mixtral", seed=4, **SMALL)


@pytest.mark.parametrize("base,changes,drop,shown", REFUSALS, ids=[f"{c[0]}-{i}" for i, c in enumerate(REFUSALS)])
def test_unimplemented_fields_stop_start_up(base, changes, drop, shown, request, tmp_path):
    src = request.getfixturevalue(f"{base}_dir") if base != "qwen2" else build_random_model(
        tmp_path / "src", arch="qwen2", seed=4, **SMALL)
    path = with_config(src, tmp_path / "m", changes, drop=drop)
    with pytest.raises(ValueError) as err:
        ModelConfig.from_dir(path)
    assert all(text in str(err.value) for text in shown), str(err.value)


def test_qwen3_window_on_no_layer_and_phi3_defaults_are_served(phi3_dir, qwen3_dir, tmp_path):
    """use_sliding_window whose window reaches no layer, and Phi-3's own config.json fields (dropouts,
    original_max_position_embeddings, default rope with partial_rotary_factor 1) are accepted."""
    q = ModelConfig.from_dir(with_config(qwen3_dir, tmp_path / "q", {
        "use_sliding_window": True, "sliding_window": 32, "max_window_layers": 2, "layer_types": None}))
    assert q.sliding_window is None and q.qk_norm
    raw = json.loads((phi3_dir / "config.json").read_text())
    assert {"resid_pdrop", "embd_pdrop", "original_max_position_embeddings"} <= set(raw)
    p = ModelConfig.from_dir(with_config(phi3_dir, tmp_path / "p", {"resid_pdrop": 0.1, "embd_pdrop": 0.1}))
    assert p.fused_projections and p.unknown_fields == ()


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


def test_gemma_legacy_gelu_runs_the_tanh_approximation(tmp_path):
    """Gemma 1's released config.json says hidden_act "gelu" (and hidden_activation "gelu_pytorch_tanh"):
    transformers runs the tanh approximation, and so does pagedkv."""
    src = build_random_model(tmp_path / "src", arch="gemma", seed=4, **SMALL)
    path = with_config(src, tmp_path / "m", {"hidden_act": "gelu", "hidden_activation": "gelu_pytorch_tanh"})
    cfg = ModelConfig.from_dir(path)
    assert cfg.hidden_act == "gelu_pytorch_tanh" and cfg.gemma and not cfg.sandwich_norms


# config.json of released checkpoints (as published; only the fields, no weights: ModelConfig reads no tensors)
RELEASED = {
    "gemma-2-2b-it": {
        "architectures": ["Gemma2ForCausalLM"], "attention_bias": False, "attention_dropout": 0.0,
        "attn_logit_softcapping": 50.0, "bos_token_id": 2, "cache_implementation": "hybrid", "eos_token_id": [1, 107],
        "final_logit_softcapping": 30.0, "head_dim": 256, "hidden_act": "gelu_pytorch_tanh",
        "hidden_activation": "gelu_pytorch_tanh", "hidden_size": 2304, "initializer_range": 0.02,
        "intermediate_size": 9216, "max_position_embeddings": 8192, "model_type": "gemma2", "num_attention_heads": 8,
        "num_hidden_layers": 26, "num_key_value_heads": 4, "pad_token_id": 0, "query_pre_attn_scalar": 256,
        "rms_norm_eps": 1e-06, "rope_theta": 10000.0, "sliding_window": 4096, "torch_dtype": "float32",
        "transformers_version": "4.42.4", "use_cache": True, "vocab_size": 256000},
    "gemma-3-1b-it": {
        "architectures": ["Gemma3ForCausalLM"], "attention_bias": False, "attention_dropout": 0.0,
        "attn_logit_softcapping": None, "bos_token_id": 2, "cache_implementation": "hybrid", "eos_token_id": [1, 106],
        "final_logit_softcapping": None, "head_dim": 256, "hidden_activation": "gelu_pytorch_tanh",
        "hidden_size": 1152, "initializer_range": 0.02, "intermediate_size": 6912, "max_position_embeddings": 32768,
        "model_type": "gemma3_text", "num_attention_heads": 4, "num_hidden_layers": 26, "num_key_value_heads": 1,
        "pad_token_id": 0, "query_pre_attn_scalar": 256, "rms_norm_eps": 1e-06, "rope_local_base_freq": 10000,
        "rope_scaling": None, "rope_theta": 1000000, "sliding_window": 512, "sliding_window_pattern": 6,
        "torch_dtype": "bfloat16", "transformers_version": "4.50.0.dev0", "use_cache": True, "vocab_size": 262144},
    "gemma-3-4b-it": {
        "architectures": ["Gemma3ForConditionalGeneration"], "boi_token_index": 255999, "eoi_token_index": 256000,
        "eos_token_id": [1, 106], "image_token_index": 262144, "initializer_range": 0.02, "mm_tokens_per_image": 256,
        "model_type": "gemma3", "text_config": {
            "hidden_size": 2560, "intermediate_size": 10240, "model_type": "gemma3_text", "num_hidden_layers": 34,
            "rope_scaling": {"factor": 8.0, "rope_type": "linear"}, "sliding_window": 1024},
        "torch_dtype": "bfloat16", "transformers_version": "4.50.0.dev0", "vision_config": {
            "hidden_size": 1152, "image_size": 896, "intermediate_size": 4304, "model_type": "siglip_vision_model",
            "num_attention_heads": 16, "num_hidden_layers": 27, "patch_size": 14, "vision_use_head": False}},
    "gemma-7b": {
        "architectures": ["GemmaForCausalLM"], "attention_bias": False, "attention_dropout": 0.0, "bos_token_id": 2,
        "eos_token_id": 1, "head_dim": 256, "hidden_act": "gelu", "hidden_activation": None, "hidden_size": 3072,
        "initializer_range": 0.02, "intermediate_size": 24576, "max_position_embeddings": 8192,
        "model_type": "gemma", "num_attention_heads": 16, "num_hidden_layers": 28, "num_key_value_heads": 16,
        "pad_token_id": 0, "rms_norm_eps": 1e-06, "rope_scaling": None, "rope_theta": 10000.0,
        "torch_dtype": "bfloat16", "transformers_version": "4.38.0.dev0", "use_cache": True, "vocab_size": 256000},
    "Mixtral-8x7B-Instruct-v0.1": {
        "architectures": ["MixtralForCausalLM"], "attention_dropout": 0.0, "bos_token_id": 1, "eos_token_id": 2,
        "hidden_act": "silu", "hidden_size": 4096, "initializer_range": 0.02, "intermediate_size": 14336,
        "max_position_embeddings": 32768, "model_type": "mixtral", "num_attention_heads": 32,
        "num_experts_per_tok": 2, "num_hidden_layers": 32, "num_key_value_heads": 8, "num_local_experts": 8,
        "output_router_logits": False, "rms_norm_eps": 1e-05, "rope_theta": 1000000.0, "router_aux_loss_coef": 0.02,
        "sliding_window": None, "tie_word_embeddings": False, "torch_dtype": "bfloat16",
        "transformers_version": "4.36.0.dev0", "use_cache": True, "vocab_size": 32000},
    "Qwen1.5-MoE-A2.7B": {
        "architectures": ["Qwen2MoeForCausalLM"], "attention_dropout": 0.0, "bos_token_id": 151643,
        "eos_token_id": 151643, "hidden_act": "silu", "hidden_size": 2048, "initializer_range": 0.02,
        "intermediate_size": 5632, "max_position_embeddings": 8192, "max_window_layers": 21,
        "model_type": "qwen2_moe", "num_attention_heads": 16, "num_hidden_layers": 24, "num_key_value_heads": 16,
        "rms_norm_eps": 1e-06, "rope_theta": 1000000.0, "sliding_window": 32768, "tie_word_embeddings": False,
        "torch_dtype": "bfloat16", "transformers_version": "4.36.0.dev0", "use_cache": True,
        "use_sliding_window": False, "vocab_size": 151936, "decoder_sparse_step": 1, "moe_intermediate_size": 1408,
        "shared_expert_intermediate_size": 5632, "num_experts_per_tok": 4, "num_experts": 60, "norm_topk_prob": False,
        "output_router_logits": False, "router_aux_loss_coef": 0.001},
    "Qwen3-30B-A3B": {
        "architectures": ["Qwen3MoeForCausalLM"], "attention_bias": False, "attention_dropout": 0.0,
        "bos_token_id": 151643, "decoder_sparse_step": 1, "eos_token_id": 151645, "head_dim": 128,
        "hidden_act": "silu", "hidden_size": 2048, "initializer_range": 0.02, "intermediate_size": 6144,
        "max_position_embeddings": 40960, "max_window_layers": 48, "mlp_only_layers": [], "model_type": "qwen3_moe",
        "moe_intermediate_size": 768, "norm_topk_prob": True, "num_attention_heads": 32, "num_experts": 128,
        "num_experts_per_tok": 8, "num_hidden_layers": 48, "num_key_value_heads": 4, "output_router_logits": False,
        "rms_norm_eps": 1e-06, "rope_scaling": None, "rope_theta": 1000000.0, "router_aux_loss_coef": 0.001,
        "sliding_window": None, "tie_word_embeddings": False, "torch_dtype": "bfloat16",
        "transformers_version": "4.51.0", "use_cache": True, "use_sliding_window": False, "vocab_size": 151936},
}
GEMMA3_1B_WINDOWS = tuple(0 if (i + 1) % 6 == 0 else 512 for i in range(26))
# name -> (what ModelConfig reads, (num_experts, top_k, normalize, expert_size, shared_size) or None, unknown fields)
RELEASED_READS = {
    "gemma-2-2b-it": ({"family": "gemma2", "layer_windows": (4096, 0) * 13, "attn_softcap": 50.0,
                       "final_softcap": 30.0, "attn_scale": 256 ** -0.5, "eos_token_ids": (1, 107),
                       "tie_word_embeddings": True, "hidden_act": "gelu_pytorch_tanh"}, None, ()),
    "gemma-3-1b-it": ({"family": "gemma3_text", "layer_windows": GEMMA3_1B_WINDOWS, "attn_softcap": None,
                       "qk_norm": True, "num_kv_heads": 1, "eos_token_ids": (1, 106)}, None, ()),
    "gemma-3-4b-it": ({"family": "gemma3_text", "architecture": "Gemma3ForConditionalGeneration",
                       "language_model_only": True, "tie_word_embeddings": True, "eos_token_ids": (1, 106),
                       "layer_windows": tuple(0 if (i + 1) % 6 == 0 else 1024 for i in range(34)),
                       "attn_scale": 256 ** -0.5, "num_kv_heads": 4}, None, ()),
    "gemma-7b": ({"family": "gemma", "hidden_act": "gelu_pytorch_tanh", "sandwich_norms": False,
                  "attn_scale": 256 ** -0.5}, None, ()),
    "Mixtral-8x7B-Instruct-v0.1": ({"family": "mixtral", "sliding_window": None}, (8, 2, True, 14336, 0), ()),
    "Qwen1.5-MoE-A2.7B": ({"family": "qwen2_moe", "layer_windows": (), "attention_bias": True},
                          (60, 4, False, 1408, 5632), ()),
    "Qwen3-30B-A3B": ({"family": "qwen3_moe", "qk_norm": True, "head_dim": 128, "sliding_window": None},
                      (128, 8, True, 768, 0), ()),
}


@pytest.mark.parametrize("name", list(RELEASED))
def test_released_config_files_are_read_not_refused(name, tmp_path):
    """Every field of these released config.json files is served or known irrelevant; nothing is refused."""
    (tmp_path / "config.json").write_text(json.dumps(RELEASED[name]))
    cfg = ModelConfig.from_dir(tmp_path)
    reads, moe, unknown = RELEASED_READS[name]
    assert {k: getattr(cfg, k) for k in reads} == reads
    assert cfg.unknown_fields == unknown
    if moe is None:
        assert cfg.moe is None
    else:
        m = cfg.moe
        assert (m.num_experts, m.top_k, m.normalize, m.expert_size, m.shared_size) == moe
        assert all(m.sparse_layers) and len(m.sparse_layers) == cfg.num_layers


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
