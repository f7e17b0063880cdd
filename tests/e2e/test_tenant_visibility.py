"""What each caller may see: a tenant sees the model's facts and its own figures in ModelInfo, never another
tenant's activity or the executors; an admin tenant sees the cluster. Failed authentication is logged without
the key. /metrics (scheduler and executor) listens on --metrics-host, apart from the API, and never shows a key."""

from __future__ import annotations

import asyncio
import urllib.request

import grpc
import pytest

from pagedkv.api.v1 import api_pb2 as api
from pagedkv.cli import free_port
from pagedkv.client import Client
from pagedkv.tenancy import hash_key
from tests.support import procs
from tests.support.procs import METRICS_HOST, can_bind
from tests.support.tenant_visibility import TENANTS, WRONG_KEY

pytestmark = pytest.mark.e2e

CLUSTER_FIELDS = ("num_free_pages", "num_used_pages", "num_cached_pages", "num_running", "num_waiting",
                  "num_preemptions", "peak_used_pages", "num_computed_tokens", "num_cached_prompt_tokens",
                  "num_used_host_pages", "num_swapped", "num_pages_swapped_out", "num_pages_swapped_in")


@pytest.fixture(scope="module")
def cluster(model_cache, tmp_path_factory):
    if not can_bind(METRICS_HOST):
        pytest.skip(f"cannot bind {METRICS_HOST} here")
    path = tmp_path_factory.mktemp("tenants") / "tenants.toml"
    path.write_text(TENANTS)
    exec_metrics, sched_metrics = free_port(METRICS_HOST), free_port(METRICS_HOST)
    executor = procs.executor("--num-pages", "64", "--metrics-port", str(exec_metrics), "--metrics-host", METRICS_HOST)
    try:
        scheduler = procs.scheduler(executor.address, args=(
            "--tenants-file", str(path), "--metrics-port", str(sched_metrics), "--metrics-host", METRICS_HOST))
    except Exception:
        executor.stop()
        raise
    yield executor, scheduler, exec_metrics, sched_metrics
    scheduler.stop()
    executor.stop()


async def _info(address: str, key: str, reset_peak: bool = False) -> api.ModelInfoResponse:
    async with Client(address, api_key=key) as client:
        return await client.model_info(reset_peak=reset_peak)


def _cluster_view(info: api.ModelInfoResponse) -> dict:
    return {name: getattr(info, name) for name in CLUSTER_FIELDS} | {"executors": len(info.executors)}


def test_a_tenant_sees_its_own_figures_and_an_admin_the_cluster(cluster):
    executor, scheduler, _, _ = cluster
    prompt = [1] + [(7 * i) % 250 + 3 for i in range(80)]

    async def scenario():
        beta_before = await _info(scheduler.address, "key-beta")
        ops_before = await _info(scheduler.address, "key-ops")
        async with Client(scheduler.address, api_key="key-alpha") as alpha:
            first = await alpha.complete(prompt, max_tokens=4, ignore_eos=True)
            again = await alpha.complete(prompt, max_tokens=4, ignore_eos=True)  # a prefix-cache hit
            ops_hit = await _info(scheduler.address, "key-ops")
            held = alpha.generate(prompt[:40], max_tokens=400, ignore_eos=True)
            await held.__anext__()  # alpha now holds pages and runs a request
            for _ in range(100):  # (its pages grow a page every 16 tokens: the admin's view read between two of
                during = {k: await _info(scheduler.address, k) for k in ("key-alpha", "key-beta", "key-ops")}
                later = await _info(scheduler.address, "key-alpha")  # alpha's that agree holds alpha's pages then)
                if later.tenant.used_pages == during["key-alpha"].tenant.used_pages:
                    break
            await held.aclose()
        await _info(scheduler.address, "key-beta", reset_peak=True)  # a tenant resets its own peak only
        ops_after = await _info(scheduler.address, "key-ops")
        return beta_before, ops_before, first, again, ops_hit, during, ops_after

    beta_before, ops_before, first, again, ops_hit, during, ops_after = asyncio.run(scenario())
    assert first.cached_tokens == 0 and again.cached_tokens > 0
    alpha, beta, ops = during["key-alpha"], during["key-beta"], during["key-ops"]
    zero = {name: 0 for name in CLUSTER_FIELDS} | {"executors": 0}
    for view in (beta_before, beta, alpha):  # no tenant sees cluster figures, its own activity included
        assert _cluster_view(view) == zero, _cluster_view(view)
        assert view.model == "tiny-llama" and view.block_size == 16 and view.vocab_size == 259
        assert view.max_model_len > 0 and view.num_pages == 64 and view.dtype and not view.cluster_view
    assert beta.tenant.id == "beta" and beta.tenant.used_pages == 0 and beta.tenant.num_running == 0
    assert alpha.tenant.id == "alpha" and alpha.tenant.used_pages > 0 and alpha.tenant.num_running == 1
    # the admin sees the cluster: alpha's cache hit, its pages, the executor
    assert ops.tenant.id == "ops" and ops.tenant.used_pages == 0 and ops.cluster_view
    assert ops_hit.num_cached_prompt_tokens - ops_before.num_cached_prompt_tokens == again.cached_tokens
    assert ops.num_used_pages == alpha.tenant.used_pages and ops.num_running == 1
    assert [(e.address, e.state) for e in ops.executors] == [(executor.address, "up")]
    assert ops_after.peak_used_pages >= alpha.tenant.used_pages, "beta's reset_peak reset the cluster's peak"


def test_failed_authentication_is_logged_without_the_key(cluster):
    _, scheduler, _, sched_metrics = cluster

    async def attempt(key: str | None, metadata=()):
        async with Client(scheduler.address, api_key=key or "", metadata=metadata) as client:
            with pytest.raises(grpc.aio.AioRpcError) as err:
                await client.complete("hi", max_tokens=1)
            return err.value

    cases = {"unknown": (WRONG_KEY, ()), "revoked": ("key-ops-old", ()), "missing": (None, ()),
             "malformed": (None, (("authorization", f"Basic {WRONG_KEY}"),))}
    for key, metadata in cases.values():
        err = asyncio.run(attempt(key, metadata))
        assert err.code() == grpc.StatusCode.UNAUTHENTICATED
    method = "/pagedkv.api.v1.Generation/Generate"
    for reason in cases:
        assert procs.wait_for(lambda r=reason: scheduler.saw("auth_failed", method=method, reason=r), 10), reason
    line = next(e for e in scheduler.events if e.get("event") == "auth_failed")
    assert line["peer"].startswith("ipv4:127.0.0.1:") and line["level"] == "warning"
    log = scheduler.log()
    assert WRONG_KEY not in log and "key-ops-old" not in log and hash_key("key-ops-old")[7:] not in log
    text = urllib.request.urlopen(f"http://{METRICS_HOST}:{sched_metrics}/metrics", timeout=10).read().decode()
    assert 'pagedkv_auth_failures_total{reason="unknown"}' in text
    assert WRONG_KEY not in text


def _metrics(host: str, port: int) -> str:
    return urllib.request.urlopen(f"http://{host}:{port}/metrics", timeout=10).read().decode()


def test_metrics_listen_on_the_metrics_host_and_show_no_keys(cluster):
    _, scheduler, exec_metrics, sched_metrics = cluster

    async def run_alpha():
        async with Client(scheduler.address, api_key="key-alpha") as client:
            return await client.complete("hello", max_tokens=2, ignore_eos=True)

    assert len(asyncio.run(run_alpha()).token_ids) == 2
    for port in (sched_metrics, exec_metrics):
        assert "pagedkv_" in _metrics(METRICS_HOST, port)
        with pytest.raises(OSError):  # nothing on the API's address
            _metrics("127.0.0.1", port)
    text = _metrics(METRICS_HOST, sched_metrics)
    assert 'tenant="alpha"' in text  # tenant ids are labels (names, not secrets) ...
    for secret in ("key-alpha", "key-beta", "key-ops", hash_key("key-alpha")[7:]):
        assert secret not in text  # ... keys and their hashes never are
    ready = next(e for e in scheduler.events if e.get("event") == "scheduler_ready")
    assert ready["metrics"] == f"{METRICS_HOST}:{sched_metrics}"
