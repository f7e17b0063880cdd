"""Honour or refuse: every config field of the supported families is handled (compared with transformers here
where it changes the math), refused at start-up with its name and value, or irrelevant to inference math;
generation_config.json's eos ids stop generation where transformers stops. In-process, tiny fp32 models."""

from __future__ import annotations

import dataclasses
import json
import shutil
from pathlib import Path

import pytest
import torch

from executor_svc.config_fields import FIELDS, FOREIGN_MATH, HANDLED, IRRELEVANT, REFUSED
from executor_svc.model_config import ModelConfig
from pagedkv.tools.random_model import build_random_model
from tests.support.hf_reference import hf_greedy, random_prompts
from tests.support.model_helpers import SMALL, VOCAB, assert_greedy_equal, paged_greedy, with_config

pytestmark = pytest.mark.unit

torch.set_num_threads(1)


# ---- every field classified --------------------------------------------------------------------------


def family_config_fields() -> dict[str, set[str]]:
    from transformers import (
        Gemma2Config,
        Gemma3Config,
        Gemma3TextConfig,
        GemmaConfig,
        LlamaConfig,
        MistralConfig,
        MixtralConfig,
        Phi3Config,
        Qwen2Config,
        Qwen2MoeConfig,
        Qwen3Config,
        Qwen3MoeConfig,
    )

    out = {}
    for cls in (LlamaConfig, MistralConfig, Qwen2Config, Qwen3Config, Phi3Config, GemmaConfig, Gemma2Config,
                Gemma3TextConfig, Gemma3Config, MixtralConfig, Qwen2MoeConfig, Qwen3MoeConfig):
        keys = set(cls().to_dict())
        if cls in (Qwen2Config, Qwen3Config, Qwen2MoeConfig, Qwen3MoeConfig):
            keys |= set(cls(use_sliding_window=True).to_dict())
        if dataclasses.is_dataclass(cls):  # transformers 5 declares the fields (ClassVars are not fields)
            keys |= {f.name for f in dataclasses.fields(cls)}
        out[cls.__name__] = keys
    return out


def test_every_field_of_the_supported_families_is_classified():
    """A field transformers adds to the supported families' config classes fails here until it is put in FIELDS
    (handled, refused or irrelevant, with the reason)."""
    unclassified = {name: sorted(k for k in keys if k not in FIELDS) for name, keys in family_config_fields().items()}
    assert unclassified == {name: [] for name in unclassified}, unclassified
    assert {kind for kind, _ in FIELDS.values()} == {HANDLED, REFUSED, IRRELEVANT}
    assert all(note for _, note in FIELDS.values())


def test_every_refused_field_has_a_refusal_test():
    refused = {name for name, (kind, _) in FIELDS.items() if kind == REFUSED}
    tested = {case[0] for case in REFUSALS}
    assert refused <= tested, refused - tested
    assert set(FOREIGN_MATH) & tested  # the foreign set is exercised too


# ---- refusals at start-up ------------------------------------------------------------------------------


@pytest.fixture(scope="module")
def llama_dir(tmp_path_factory) -> Path:
    return build_random_model(tmp_path_factory.mktemp("llama"), seed=3, **SMALL)


@pytest.fixture(scope="module")
def qwen2_dir(tmp_path_factory) -> Path:
    return build_random_model(tmp_path_factory.mktemp("qwen2"), arch="qwen2", seed=4, **SMALL)


# (field named in the error, base model, config changes, value text the message shows)
REFUSALS = [
    ("hidden_act", "llama", {"hidden_act": "gelu_new"}, "'gelu_new'"),
    ("hidden_act", "llama", {"hidden_act": "xielu"}, "'xielu'"),
    ("rope_type", "llama", {"rope_scaling": {"type": "dynamic", "factor": 2.0}}, "'dynamic'"),
    ("rope_type", "llama", {"rope_scaling": {"rope_type": "longrope", "short_factor": [1.0] * 8,
                                             "long_factor": [2.0] * 8, "original_max_position_embeddings": 512}},
     "'longrope'"),
    ("partial_rotary_factor", "llama", {"partial_rotary_factor": 0.5}, "0.5"),
    ("quantization_config", "llama", {"quantization_config": {"quant_method": "bitsandbytes", "load_in_4bit": True}},
     "'bitsandbytes'"),
    # Gemma's fields in a family that does not read them
    ("attn_logit_softcapping", "llama", {"attn_logit_softcapping": 50.0}, "50.0"),
    ("final_logit_softcapping", "llama", {"final_logit_softcapping": 30.0}, "30.0"),
    ("query_pre_attn_scalar", "qwen2", {"query_pre_attn_scalar": 24}, "24"),
    ("num_local_experts", "llama", {"num_local_experts": 8}, "8"),
    ("model_type", "llama", {"model_type": "cohere"}, "'cohere'"),
    ("query_pre_attn_scalar", "gemma", {"query_pre_attn_scalar": 24}, "gemma2, gemma3_text"),  # Gemma 1 lacks it
    ("architectures", "llama", {"architectures": ["LlamaForSequenceClassification"]}, "LlamaForSequenceClassif"),
    # a layer type no family here implements; a window layer in a family without per-layer types
    ("layer_types", "qwen2", {"layer_types": ["full_attention", "chunked_attention"], "use_sliding_window": True,
                              "sliding_window": 32}, "chunked_attention"),
    ("layer_types", "llama", {"layer_types": ["full_attention", "sliding_attention"]}, "sliding_attention"),
    # Gemma 3 as an embedding model: attention over the whole text, both ways
    ("use_bidirectional_attention", "gemma3", {"use_bidirectional_attention": True}, "True"),
]


@pytest.mark.parametrize("field,base,changes,shown", REFUSALS, ids=[f"{c[0]}-{i}" for i, c in enumerate(REFUSALS)])
def test_unimplemented_fields_stop_start_up(field, base, changes, shown, llama_dir, qwen2_dir, tmp_path):
    src = {"llama": llama_dir, "qwen2": qwen2_dir}.get(base) or build_random_model(
        tmp_path / "src", arch=base, seed=4, **SMALL)
    path = with_config(src, tmp_path / "m", changes)
    with pytest.raises(ValueError) as err:
        ModelConfig.from_dir(path)
    assert field in str(err.value) and shown in str(err.value), str(err.value)


def test_the_cli_prints_the_refusal_and_exits_1(llama_dir, tmp_path, capsys):
    from pagedkv.cli import main

    path = with_config(llama_dir, tmp_path / "m", {"hidden_act": "gelu_new"})
    code = main(["executor", "--model", str(path), "--device", "cpu", "--insecure", "--threads", "1",
                 "--num-pages", "8", "--port", "0"])
    err = capsys.readouterr().err
    assert code == 1
    assert "error: " in err and "hidden_act = 'gelu_new'" in err, err


def test_accepted_configs(llama_dir, qwen2_dir, tmp_path):
    """What is served: Qwen2 with use_sliding_window whose window reaches no layer (as transformers computes
    layer_types); unknown fields (transformers ignores them too) are listed; refused fields set to "off"."""
    q = ModelConfig.from_dir(with_config(qwen2_dir, tmp_path / "q", {
        "use_sliding_window": True, "sliding_window": 32, "max_window_layers": 2, "layer_types": None}))
    assert q.sliding_window is None and q.attention_bias and not q.o_proj_bias
    m = ModelConfig.from_dir(with_config(llama_dir, tmp_path / "l", {
        "my_fine_tuner_version": "1.2", "quantization_config": None, "attn_logit_softcapping": None,
        "pretraining_tp": 2, "partial_rotary_factor": 1.0, "rope_scaling": {"rope_type": "llama3", "factor": 8.0,
        "low_freq_factor": 1.0, "high_freq_factor": 4.0, "original_max_position_embeddings": 256}}))
    assert m.unknown_fields == ("my_fine_tuner_version",)
    assert m.family == "llama" and not m.attention_bias and not m.mlp_bias


def test_bad_generation_config_and_eos_ids_are_refused(llama_dir, tmp_path):
    path = with_config(llama_dir, tmp_path / "a", {})
    (path / "generation_config.json").unlink()
    (path / "generation_config.json").write_text("{not json")
    with pytest.raises(ValueError, match="generation_config.json is unreadable"):
        ModelConfig.from_dir(path)
    (path / "generation_config.json").write_text(json.dumps({"eos_token_id": [2, VOCAB + 5]}))
    with pytest.raises(ValueError, match=f"eos_token_id {VOCAB + 5} is outside the vocabulary"):
        ModelConfig.from_dir(path)
    (path / "generation_config.json").write_text(json.dumps({"eos_token_id": "</s>"}))
    with pytest.raises(ValueError, match="eos_token_id = '</s>'"):
        ModelConfig.from_dir(path)


def test_tensors_the_config_asks_for_must_be_there(tmp_path):
    """mlp_bias true in config.json over a checkpoint saved without MLP biases: refused by name, not run
    without them."""
    from executor_svc.model import load_model

    src = build_random_model(tmp_path / "src", seed=5, **SMALL)
    path = with_config(src, tmp_path / "m", {"mlp_bias": True})
    with pytest.raises(ValueError, match=r"missing tensors \['model.layers.0.mlp.gate_proj.bias'"):
        load_model(ModelConfig.from_dir(path), torch.device("cpu"), torch.float32)


# ---- handled fields: greedy-token-equal to transformers (eager, fp32) ------------------------------------


@pytest.mark.parametrize("overrides", [
    {"hidden_act": "gelu_pytorch_tanh"},
    {"hidden_act": "gelu"},
    {"hidden_act": "relu"},
    {"mlp_bias": True},
    {"attention_bias": True, "mlp_bias": True},
    {"head_dim": 32, "rms_norm_eps": 0.05},
], ids=lambda o: "-".join(f"{k}={v}" for k, v in o.items()))
def test_llama_fields_greedy_equal_to_transformers(overrides, tmp_path):
    path = build_random_model(tmp_path / "m", seed=11, config_overrides=overrides, **SMALL)
    cfg = ModelConfig.from_dir(path)
    for key, value in overrides.items():
        assert getattr(cfg, {"head_dim": "head_dim", "rms_norm_eps": "rms_norm_eps"}.get(key, key)) == value
    assert_greedy_equal(path)


def test_qwen2_with_a_window_on_no_layer_equal_to_transformers(tmp_path):
    path = build_random_model(tmp_path / "m", arch="qwen2", seed=12, sliding_window=16, config_overrides={
        "use_sliding_window": True, "max_window_layers": SMALL["num_layers"], "hidden_act": "gelu_pytorch_tanh"},
        **SMALL)
    assert_greedy_equal(path, max_new=24)


# ---- generation_config.json eos ids ------------------------------------------------------------------------


def test_generation_config_eos_stops_where_transformers_stops(tmp_path):
    """config.json says eos 2; generation_config.json lists 2 and an end-of-turn id X that greedy decoding
    reaches mid-way. transformers stops at X; so does pagedkv, because X reaches Describe's eos_token_ids."""
    path = build_random_model(tmp_path / "m", seed=13, **SMALL)
    prompts = random_prompts(3, [6, 19], VOCAB)
    free_run = paged_greedy(path, prompts, 16, stop_ids=())
    seq = free_run[0]
    x = next(t for i, t in enumerate(seq) if i >= 3 and t not in seq[:i] and t != 2)
    stop_at = seq.index(x) + 1
    shutil.copy(path / "generation_config.json", tmp_path / "orig.json")
    gen = json.loads((path / "generation_config.json").read_text())
    gen["eos_token_id"] = [2, x]
    (path / "generation_config.json").write_text(json.dumps(gen))
    assert json.loads((path / "config.json").read_text())["eos_token_id"] == 2

    cfg = ModelConfig.from_dir(path)
    assert cfg.eos_token_ids == (2, x)
    want = hf_greedy(path, prompts, [16, 16])
    assert want[0] == seq[:stop_at] and len(want[0]) < 16  # transformers stops at X
    got = paged_greedy(path, prompts, 16)
    assert got == want

    import argparse

    from executor_svc.args import add_args
    from executor_svc.startup import build
    from pagedkv import logs

    parser = argparse.ArgumentParser()
    add_args(parser)
    args = parser.parse_args(["--model", str(path), "--device", "cpu", "--num-pages", "8", "--threads", "1"])
    _, describe = build(args, logs.configure("executor-test"))
    assert list(describe.eos_token_ids) == [2, x]


def test_generation_config_eos_union_and_written_by_the_builder(tmp_path):
    path = build_random_model(tmp_path / "m", seed=14, generation_eos=[7, 2, 9], **SMALL)
    assert json.loads((path / "generation_config.json").read_text())["eos_token_id"] == [7, 2, 9]
    cfg = ModelConfig.from_dir(path)
    assert cfg.eos_token_ids == (2, 7, 9)
    (path / "generation_config.json").unlink()
    assert ModelConfig.from_dir(path).eos_token_ids == (2,)


ROPES = {
    "linear": {"rope_type": "linear", "factor": 4.0, "rope_theta": 10000.0},
    "llama3": {"rope_type": "llama3", "factor": 8.0, "low_freq_factor": 1.0, "high_freq_factor": 4.0,
               "original_max_position_embeddings": 32, "rope_theta": 500000.0},
    "yarn": {"rope_type": "yarn", "factor": 4.0, "original_max_position_embeddings": 32, "rope_theta": 10000.0},
}


@pytest.mark.parametrize("arch,overrides", [
    ("llama", {"rope_parameters": ROPES["linear"]}),
    ("llama", {"rope_parameters": ROPES["llama3"]}),
    ("llama", {"rope_parameters": ROPES["yarn"], "max_position_embeddings": 128}),
    ("llama", {"tie_word_embeddings": True}),
    ("qwen2", {"tie_word_embeddings": False, "hidden_act": "gelu"}),
    ("mistral", {"sliding_window": 8, "num_key_value_heads": 1}),
], ids=["rope-linear", "rope-llama3", "rope-yarn", "llama-tied", "qwen2-untied-gelu", "mistral-window8-mqa"])
def test_more_handled_fields_greedy_equal_to_transformers(arch, overrides, tmp_path):
    overrides = dict(overrides)
    kw = dict(SMALL, num_kv_heads=overrides.pop("num_key_value_heads", SMALL["num_kv_heads"]))
    for name in ("tie_word_embeddings", "sliding_window", "max_position_embeddings"):
        if name in overrides:
            kw[name] = overrides.pop(name)
    path = build_random_model(tmp_path / "m", arch=arch, seed=21, config_overrides=overrides, **kw)
    cfg = json.loads((path / "config.json").read_text())
    for name, value in overrides.items():
        assert cfg[name] == value or name == "rope_parameters" and cfg[name]["rope_type"] == value["rope_type"]
    assert_greedy_equal(path)
