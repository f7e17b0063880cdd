"""The flags vLLM users type (#48, point 5), in one process: --api-key's single tenant, --chat-template's loading
and checks, hub ids resolved from a Hugging Face cache the test builds (offline), --threads auto, --log-level's
default and the stats line's fields. The served behaviour is tests/e2e/test_vllm_flags.py's."""

from __future__ import annotations

import argparse
import hashlib

import pytest
from prometheus_client import REGISTRY

from executor_svc import threads
from pagedkv import hub_models, logs
from pagedkv.tenancy import DEFAULT_TENANT, InvalidTenant, Tenants, Unauthenticated
from scheduler_svc import metrics, stats_log
from scheduler_svc.chat_template_arg import load_chat_template
from tests.support.chat_template import TEMPLATE

pytestmark = pytest.mark.unit


# ---- --api-key ---------------------------------------------------------------------------------------------
def test_api_key_is_asked_of_every_caller_of_a_single_tenant_server():
    tenants = Tenants.from_flags("", "s3cret", 100)
    assert tenants.keyed and not tenants.multi
    for metadata, reason in (((), "missing"), ((("authorization", "Bearer nope"),), "unknown"),
                             ((("authorization", "Basic s3cret"),), "malformed")):
        with pytest.raises(Unauthenticated) as err:
            tenants.caller(metadata)
        assert err.value.reason == reason
    tenant, digest = tenants.caller((("authorization", "Bearer s3cret"),))
    assert tenant.id == DEFAULT_TENANT and digest == hashlib.sha256(b"s3cret").digest()
    assert tenants.sees_cluster(tenant)  # the only caller sees everything, as without a key


def test_no_api_key_asks_for_none():
    tenants = Tenants.from_flags("", "", 100)
    assert not tenants.keyed and tenants.caller(())[0].id == DEFAULT_TENANT


def test_api_key_with_a_tenants_file_is_refused_naming_both(tmp_path):
    path = tmp_path / "tenants.toml"
    path.write_text('[tenants.a]\nkeys = []\n')
    with pytest.raises(InvalidTenant, match=r"--api-key .*--tenants-file .*tenants.toml"):
        Tenants.from_flags(str(path), "s3cret", 100)


# ---- --chat-template ---------------------------------------------------------------------------------------
def test_chat_template_from_a_file_or_inline(tmp_path):
    path = tmp_path / "t.jinja"
    path.write_text(TEMPLATE)
    assert load_chat_template(str(path)) == TEMPLATE
    assert load_chat_template(TEMPLATE) == TEMPLATE
    assert load_chat_template("") is None


@pytest.mark.parametrize("value,why", [("/no/such/template.jinja", "no such file"),
                                       ("{% for m in messages %}{{ m }}", "does not compile")])
def test_a_bad_chat_template_is_one_line_naming_the_flag(value, why):
    with pytest.raises(ValueError) as err:
        load_chat_template(value)
    assert str(err.value).startswith("--chat-template ") and why in str(err.value) and "\n" not in str(err.value)


# ---- --model ORG/NAME --------------------------------------------------------------------------------------
def fake_hub_cache(root, repo_id: str, files: dict[str, str]) -> None:
    """The layout huggingface_hub writes: models--ORG--NAME/snapshots/<revision>/... and refs/main."""
    folder = root / f"models--{repo_id.replace('/', '--')}"
    revision = "0123456789abcdef0123456789abcdef01234567"
    snapshot = folder / "snapshots" / revision
    snapshot.mkdir(parents=True)
    for name, text in files.items():
        (snapshot / name).write_text(text)
    (folder / "refs").mkdir()
    (folder / "refs" / "main").write_text(revision)


@pytest.fixture
def offline_hub(tmp_path, monkeypatch):
    from huggingface_hub import constants

    monkeypatch.setattr(constants, "HF_HUB_CACHE", str(tmp_path / "hub"))
    monkeypatch.setattr(constants, "HF_HUB_OFFLINE", True)
    return tmp_path / "hub"


def test_hub_id_found_in_the_cache_offline(offline_hub):
    fake_hub_cache(offline_hub, "acme/tiny", {"config.json": "{}", "tokenizer.json": "{}"})
    path = hub_models.resolve_hub_model("acme/tiny")
    assert (path / "config.json").is_file() and path.parent.parent.name == "models--acme--tiny"


def test_hub_id_missing_offline_says_it_needs_the_network(offline_hub):
    with pytest.raises(hub_models.HubModelError) as err:
        hub_models.resolve_hub_model("acme/absent")
    message = str(err.value)
    assert "\n" not in message and "HF_HUB_OFFLINE" in message and "needs the network" in message
    assert str(offline_hub / "models--acme--absent" / "snapshots") in message


def test_repo_ids_and_paths():
    assert hub_models.is_repo_id("HuggingFaceTB/SmolLM2-135M-Instruct")
    for name in ("tiny-llama", "/abs/dir", "./rel/dir", "a/b/c", "../x", "a/..", "~/models"):
        assert not hub_models.is_repo_id(name), name


# ---- --threads, --log-level, the stats line ----------------------------------------------------------------
def test_threads_auto_is_every_usable_cpu_capped_by_a_cgroup_quota(monkeypatch, tmp_path):
    monkeypatch.setattr(threads, "cgroup_cpus", lambda: None)
    monkeypatch.setattr(threads.os, "sched_getaffinity", lambda _pid: set(range(16)))
    assert threads.torch_threads("auto") == 16
    for quota, want in ((2.0, 2), (0.5, 1), (2.5, 2), (64.0, 16)):
        monkeypatch.setattr(threads, "cgroup_cpus", lambda q=quota: q)
        assert threads.torch_threads("auto") == want
    assert threads.torch_threads("0") == 0 and threads.torch_threads("3") == 3
    with pytest.raises(argparse.ArgumentTypeError, match="auto"):
        threads.threads_arg("-1")


def test_cgroup_quota_files(tmp_path):
    v2, v1 = tmp_path / "cpu.max", tmp_path / "v1"
    v1.mkdir()
    assert threads.cgroup_cpus(v2, v1) is None  # neither
    v2.write_text("max 100000\n")
    assert threads.cgroup_cpus(v2, v1) is None  # v2, no quota
    v2.write_text("250000 100000\n")
    assert threads.cgroup_cpus(v2, v1) == 2.5
    v2.unlink()
    (v1 / "cpu.cfs_quota_us").write_text("-1\n")
    (v1 / "cpu.cfs_period_us").write_text("100000\n")
    assert threads.cgroup_cpus(v2, v1) is None  # v1, no quota
    (v1 / "cpu.cfs_quota_us").write_text("200000\n")
    assert threads.cgroup_cpus(v2, v1) == 2.0


def test_threads_default_from_the_environment(monkeypatch):
    monkeypatch.delenv(threads.ENV, raising=False)
    assert threads.default_threads() == "auto"
    monkeypatch.setenv(threads.ENV, "1")
    assert threads.default_threads() == "1"
    monkeypatch.setenv(threads.ENV, "many")
    with pytest.raises(SystemExit, match="PAGEDKV_THREADS"):
        threads.default_threads()


def test_log_level_default_from_the_environment(monkeypatch):
    monkeypatch.setenv(logs.LEVEL_ENV, "WARNING")
    assert logs.default_level() == "warning"
    monkeypatch.setenv(logs.LEVEL_ENV, "loud")
    assert logs.default_level() == "info"
    monkeypatch.delenv(logs.LEVEL_ENV)
    assert logs.default_level() == "info"


def test_stats_fields_over_an_interval():
    before = stats_log.Reading.now()
    metrics.PROMPT_TOKENS.inc(300)
    metrics.GENERATED_TOKENS.inc(50)
    metrics.PREFIX_QUERY_TOKENS.inc(200)
    metrics.PREFIX_HIT_TOKENS.inc(50)
    metrics.RUNNING.set(3)
    metrics.KV_CACHE_USAGE.set(0.25)
    after = stats_log.Reading(before.at + 10, {k: REGISTRY.get_sample_value(v) for k, v in stats_log.COUNTERS.items()})
    fields = stats_log.stats_fields(before, after)
    assert fields["prompt_tok_s"] == 30.0 and fields["generation_tok_s"] == 5.0
    assert fields["running"] == 3 and fields["kv_usage_pct"] == 25.0 and fields["prefix_hit_rate_pct"] == 25.0
    assert stats_log.active(fields)
    metrics.RUNNING.set(0)
    assert not stats_log.active(stats_log.stats_fields(after, after))
