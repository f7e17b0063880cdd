"""Multi-LoRA refusals: every adapter this executor would not serve as PEFT runs it is refused at start-up
(executor_svc/lora/adapter.py) with a ValueError naming the adapter, the file, the field or tensor and the limit;
bad --lora-modules values at parsing; and a plan's NewRequest naming an adapter not served, by the plan check."""

from __future__ import annotations

import argparse
from pathlib import Path

import pytest
import torch
from safetensors.torch import load_file, save_file

from executor_svc.lora.adapter import IGNORED
from executor_svc.lora.names import lora_module_arg
from executor_svc.lora.stack import load_adapters
from executor_svc.model_config import ModelConfig
from pagedkv.executor.v1 import executor_pb2 as pb
from pagedkv.tools.quantize import quantize_checkpoint
from pagedkv.tools.random_model import build_random_model
from tests.support.lora_helpers import edit_config, lora_runner, make_adapter
from tests.support.model_helpers import SMALL

pytestmark = pytest.mark.unit


@pytest.fixture(scope="module")
def base(tmp_path_factory) -> Path:
    return build_random_model(tmp_path_factory.mktemp("base"), seed=3, **SMALL)


@pytest.fixture(scope="module")
def adapter(base, tmp_path_factory) -> Path:
    return make_adapter(base, tmp_path_factory.mktemp("a") / "r8", 8, ["q_proj", "v_proj", "down_proj"], seed=1)


def _load(base: Path, path: Path, max_rank: int = 64):
    return load_adapters([("ad1", path)], ModelConfig.from_dir(base), max_rank)


def _refused(base: Path, path: Path, *words: str, max_rank: int = 64) -> None:
    with pytest.raises(ValueError) as err:
        _load(base, path, max_rank)
    message = str(err.value)
    for w in ("'ad1'", *words):
        assert w in message, message


CONFIG_REFUSALS = [  # (changes to adapter_config.json, words the refusal must hold)
    ({"use_dora": True}, ["use_dora", "adapter_config.json"]),
    ({"modules_to_save": ["lm_head"]}, ["modules_to_save", "lm_head"]),
    ({"rank_pattern": {"q_proj": 4}}, ["rank_pattern"]),
    ({"alpha_pattern": {"q_proj": 4}}, ["alpha_pattern"]),
    ({"layers_to_transform": [0]}, ["layers_to_transform"]),
    ({"layers_pattern": "layers"}, ["layers_pattern"]),
    ({"bias": "all"}, ["bias", "'all'", "'none'"]),
    ({"lora_bias": True}, ["lora_bias"]),
    ({"fan_in_fan_out": True}, ["fan_in_fan_out"]),
    ({"use_qalora": True}, ["use_qalora"]),
    ({"a_future_peft_field": "on"}, ["a_future_peft_field"]),
    ({"target_modules": ["q_proj", "lm_head"]}, ["target_modules", "lm_head", "gate_proj"]),
    ({"target_modules": ".*\\.q_proj"}, ["target_modules", "regular expression"]),
    ({"target_modules": "all-linear"}, ["target_modules", "'all-linear'"]),
    ({"peft_type": "LOHA"}, ["peft_type", "'LOHA'"]),
    ({"lora_alpha": "eight"}, ["lora_alpha"]),
]


@pytest.mark.parametrize("changes,words", CONFIG_REFUSALS, ids=[next(iter(c)) + str(i)
                                                                  for i, (c, _) in enumerate(CONFIG_REFUSALS)])
def test_config_fields_not_implemented_are_refused(base, adapter, tmp_path, changes, words):
    _refused(base, edit_config(adapter, tmp_path / "edited", **changes), *words)


def test_rank_above_the_limit_is_refused(base, adapter):
    _refused(base, adapter, "r = 8", "[1, 4]", "--max-lora-rank", max_rank=4)
    assert _load(base, adapter, max_rank=8)[0].rank == 8  # (at the limit: served)


def test_ignored_fields_are_accepted_and_listed_with_why(base, adapter, tmp_path):
    edited = edit_config(adapter, tmp_path / "edited", lora_dropout=0.1, task_type="CAUSAL_LM", inference_mode=False,
                         revision="main", init_lora_weights="gaussian")
    assert _load(base, edited)[0].rank == 8
    assert all(why for why in IGNORED.values())


def test_missing_files_are_refused(base, adapter, tmp_path):
    _refused(base, tmp_path / "nowhere", "adapter_config.json", "missing")
    only_bin = tmp_path / "bin"
    only_bin.mkdir()
    (only_bin / "adapter_config.json").write_bytes((adapter / "adapter_config.json").read_bytes())
    (only_bin / "adapter_model.bin").write_bytes(b"not read")
    _refused(base, only_bin, "adapter_model.safetensors", "adapter_model.bin", "safetensors is required")


def _with_tensors(adapter: Path, dst: Path, change) -> Path:
    edited = edit_config(adapter, dst)
    tensors = load_file(str(adapter / "adapter_model.safetensors"))
    change(tensors)
    save_file(tensors, str(edited / "adapter_model.safetensors"))
    return edited


def test_unknown_tensor_names_are_refused(base, adapter, tmp_path):
    def add(tensors):
        tensors["base_model.model.model.layers.0.self_attn.q_proj.lora_magnitude_vector"] = torch.ones(64)

    _refused(base, _with_tensors(adapter, tmp_path / "extra", add), "lora_magnitude_vector")

    def untargeted(tensors):  # (k_proj is not in its target_modules)
        tensors["base_model.model.model.layers.0.self_attn.k_proj.lora_A.weight"] = torch.ones(8, 64)

    _refused(base, _with_tensors(adapter, tmp_path / "untargeted", untargeted), "k_proj.lora_A", "target_modules")

    def half(tensors):
        del tensors["base_model.model.model.layers.1.mlp.down_proj.lora_B.weight"]

    _refused(base, _with_tensors(adapter, tmp_path / "half", half), "layer 1", "down_proj", "lora_B")


def test_an_adapter_of_another_base_model_is_refused(base, tmp_path):
    other = build_random_model(tmp_path / "other", seed=4, **{**SMALL, "intermediate_size": 96})
    made = make_adapter(other, tmp_path / "other-r8", 8, ["up_proj"], seed=2)
    _refused(base, made, "base_model.model.model.layers.0.mlp.up_proj.lora_B.weight", "[96, 8]", "[128, 8]",
             "another base model")
    deeper = build_random_model(tmp_path / "deeper", seed=4, **{**SMALL, "num_layers": 3})
    _refused(base, make_adapter(deeper, tmp_path / "deeper-r8", 8, ["q_proj"], seed=2), "layer 2", "2 layers")


def test_phi3_fused_projections_are_refused(tmp_path):
    phi3 = build_random_model(tmp_path / "phi3", arch="phi3", seed=5, **SMALL)
    made = make_adapter(phi3, tmp_path / "phi3-r8", 8, ["o_proj"], seed=2)
    _refused(phi3, made, "qkv_proj", "fused")


def test_mixture_of_experts_mlp_targets_are_refused(tmp_path):
    moe = build_random_model(tmp_path / "mixtral", arch="mixtral", seed=5, **SMALL)
    # attention targets are served; MLP targets would reach the experts
    assert _load(moe, make_adapter(moe, tmp_path / "attn", 8, ["q_proj"], seed=2))[0].targets == ("q_proj",)
    attn = tmp_path / "attn"
    _refused(moe, edit_config(attn, tmp_path / "mlp", target_modules=["q_proj", "gate_proj"]), "mixture-of-experts",
             "gate_proj")


def test_4bit_base_linears_are_refused(base, adapter, tmp_path):
    quantized = quantize_checkpoint(base, tmp_path / "gptq", group_size=32)
    _refused(quantized, adapter, "4-bit", "quantized")


def test_flag_values_are_checked():
    assert lora_module_arg("sql-v1.2_x=/a/b") == ("sql-v1.2_x", Path("/a/b"))
    for bad in ("noequals", "=/a", "name=", "bad name=/a", "a/b=/a", "x" * 129 + "=/a"):
        with pytest.raises(argparse.ArgumentTypeError):
            lora_module_arg(bad)
    assert lora_module_arg("x" * 128 + "=/a")[0] == "x" * 128


def test_duplicate_names_are_refused(base, adapter):
    with pytest.raises(ValueError, match="'twice' is given twice"):
        load_adapters([("twice", adapter), ("twice", adapter)], ModelConfig.from_dir(base), 64)


def test_plan_naming_an_adapter_not_served_is_refused(base, adapter):
    runner = lora_runner(base, {"ad1": adapter})
    plan = pb.StepPlan(step_id=0)
    plan.new_requests.add(request_id="ok", token_ids=[1, 5, 6], num_scheduled_tokens=3, page_ids=[1], adapter="ad1")
    plan.new_requests.add(request_id="bad", token_ids=[1, 5, 6], num_scheduled_tokens=3, page_ids=[2],
                          adapter="ad2")
    result = runner.step(plan)
    assert "request bad: adapter 'ad2' is in no slot of this executor" in result.error
    assert "['ad1']" in result.error
    assert list(result.desynced_request_ids) == ["bad"] and not runner.requests  # the whole plan changed nothing
    plan.new_requests[1].adapter = ""
    result = runner.step(plan)
    assert not result.error and runner.requests["ok"].adapter == 1 and runner.requests["bad"].adapter == 0
    plain = lora_runner(base, {})  # an executor without adapters refuses any name
    plan.new_requests[1].adapter = "ad1"
    assert "(its slots hold none;" in plain.step(plan).error
