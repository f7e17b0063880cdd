"""`pagedkv bench` against processes and sockets: one run against real processes on loopback whose JSON must
hold every documented field with sane values, the plots, and the metrics scraper against an HTTP endpoint.
(The workload generators and the latency definitions: tests/unit/test_loadgen.py.)"""

from __future__ import annotations

import json
import subprocess
import sys

import pytest

from pagedkv.cli import free_port
from pagedkv.cli import main as cli_main
from pagedkv.loadgen.report import FIELD_DOCS, undocumented_fields
from pagedkv.loadgen.scrape import MetricsScraper, parse_gauges
from pagedkv.tenancy import hash_key
from tests.conftest import ROOT
from tests.support.loadgen_results import request_result

pytestmark = pytest.mark.e2e


# ---- metrics scraping -----------------------------------------------------------------------------
def test_scraper_keeps_the_kv_gauges_of_a_prometheus_endpoint():
    import asyncio
    import time

    from prometheus_client import CollectorRegistry, Gauge, start_http_server

    reg = CollectorRegistry()
    Gauge("pagedkv_pages_used", "u", registry=reg).set(30)
    Gauge("pagedkv_pages_free", "f", registry=reg).set(98)
    Gauge("pagedkv_kv_slot_utilization", "s", registry=reg).set(0.97)
    Gauge("pagedkv_tenant_pages_used", "t", ["tenant"], registry=reg).labels("a").set(5)
    Gauge("other_metric", "o", registry=reg).set(1)
    port = free_port()
    server, thread = start_http_server(port, addr="127.0.0.1", registry=reg)
    try:
        scraper = MetricsScraper(f"http://127.0.0.1:{port}/metrics", interval_s=0.05)

        async def run():
            stop = asyncio.Event()
            task = asyncio.create_task(scraper.run(time.perf_counter(), stop))
            for _ in range(200):  # (3 scrapes take ~0.15 s; 10 s only catches a hang)
                if len(scraper.samples) >= 3:
                    break
                await asyncio.sleep(0.05)
            stop.set()
            await task

        asyncio.run(run())
    finally:
        server.shutdown()
    assert len(scraper.samples) >= 3 and scraper.errors == 0
    assert scraper.samples[-1]["values"] == {"pagedkv_pages_used": 30.0, "pagedkv_pages_free": 98.0,
                                             "pagedkv_kv_slot_utilization": 0.97}
    bad = MetricsScraper(f"http://127.0.0.1:{free_port()}/metrics")
    asyncio.run(bad.scrape_once(0.0))
    assert bad.errors == 1 and bad.samples == [] and bad.last_error
    assert parse_gauges("# TYPE x gauge\nx 1\n") == {}

# ---- one real run --------------------------------------------------------------------------------
TENANTS = f"""
[tenants.alpha]
keys = ["{hash_key('bench-alpha')}"]

[tenants.beta]
keys = ["{hash_key('bench-beta')}"]
"""


def _spawn(*args: str) -> subprocess.Popen:
    return subprocess.Popen([sys.executable, "-m", "pagedkv", *args, "--log-format", "json"], cwd=ROOT,
                            stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL)


def test_bench_against_a_live_server_writes_every_documented_field(tiny_llama_dir, tmp_path, capsys):
    exec_port, sched_port, metrics_port = free_port(), free_port(), free_port()
    (tmp_path / "tenants.toml").write_text(TENANTS)
    procs = [_spawn("executor", "--port", str(exec_port), "--num-pages", "256", "--threads", "1")]
    procs.append(_spawn("scheduler", "--executor", f"127.0.0.1:{exec_port}", "--port", str(sched_port),
                        "--metrics-port", str(metrics_port), "--tenants-file", str(tmp_path / "tenants.toml")))
    out = tmp_path / "run.json"
    try:  # the command runs in this process while the services start (it waits for them to serve)
        code = cli_main(
            ["bench", "--address", f"127.0.0.1:{sched_port}", "--num-prompts", "12", "--request-rate", "30",
             "--input-len", "uniform:8:40", "--output-len", "uniform:3:10", "--seed", "1",
             "--shared-prefix-fraction", "0.5", "--shared-prefix-len", "32", "--max-concurrency", "6",
             "--tenant", "a=bench-alpha:2", "--tenant", "b=bench-beta:1", "--tenant", "intruder=wrong-key:1",
             "--slo-ttft-ms", "60000", "--slo-tpot-ms", "60000", "--ready-timeout", "120",
             "--metrics-url", f"http://127.0.0.1:{metrics_port}/metrics", "--metrics-interval", "0.2",
             "--out", str(out)])
    finally:
        for p in reversed(procs):
            p.terminate()
        for p in procs:
            p.wait(timeout=30)
    printed = capsys.readouterr()
    assert code == 0, printed.out + printed.err
    assert "pagedkv bench" in printed.out and "TTFT" in printed.out
    rep = json.loads(out.read_text())
    assert undocumented_fields(rep) == ([], []), "JSON fields and FIELD_DOCS differ"
    assert set(FIELD_DOCS) >= {"ttft_ms.p99", "itl_ms.p50", "goodput.request_goodput"}

    per_tenant = rep["workload"]["requests_per_tenant"]
    assert sum(per_tenant.values()) == rep["requests"] == 12 and len(per_tenant) == 3
    assert rep["completed"] + rep["failed"] == 12
    assert rep["errors"] == {"UNAUTHENTICATED": per_tenant["intruder"]}  # the unknown key, and nothing else
    assert rep["completed"] == per_tenant["a"] + per_tenant["b"]
    assert rep["finish_reasons"] == {"length": rep["completed"]}
    assert rep["short_outputs"] == 0 and rep["usage_mismatches"] == 0  # ignore_eos: outputs as long as asked
    done = [r for r in rep["per_request"] if r["error"] is None]
    assert rep["total_output_tokens"] == sum(r["max_tokens"] for r in done)
    assert rep["total_input_tokens"] == sum(r["prompt_tokens"] for r in done)
    assert rep["workload"]["requests_with_shared_prefix"] == 6
    for key in ("ttft_ms", "tpot_ms", "itl_ms", "e2e_latency_ms"):  # (a TPOT or ITL may be 0: coalesced tokens)
        s = rep[key]
        assert s["count"] > 0 and 0 <= s["min"] <= s["p50"] <= s["p90"] <= s["p99"] <= s["max"], (key, s)
    assert rep["ttft_ms"]["count"] == rep["e2e_latency_ms"]["count"] == rep["completed"]
    assert all(0 < r["ttft_ms"] <= r["e2e_latency_ms"] for r in done)  # each request's, from its own timestamps
    for key in ("request_throughput", "input_token_throughput", "output_token_throughput"):
        assert rep[key] > 0
    total = rep["input_token_throughput"] + rep["output_token_throughput"]
    assert rep["total_token_throughput"] == pytest.approx(total)
    assert rep["goodput"]["requests_meeting_slo"] == rep["completed"]  # a 60 s SLO is met by all
    assert max(r["send_s"] for r in rep["per_request"]) < rep["duration_s"]
    kv = rep["kv_metrics"]
    assert kv["scrapes"] >= 2 and kv["scrape_errors"] == 0
    # The scheduler's own gauges (whether a 0.2 s scrape caught pages in use is luck; before its first step the
    # scheduler reports 0 used and 0 free). The last scrape comes after every request ended.
    for sample in kv["samples"]:
        v = sample["values"]
        assert {"pagedkv_requests_running", "pagedkv_requests_waiting", "pagedkv_kv_slot_utilization"} <= v.keys()
        assert v["pagedkv_pages_used"] + v["pagedkv_pages_free"] in (0, rep["server"]["num_pages"])
    last = kv["samples"][-1]["values"]
    assert last["pagedkv_pages_free"] == rep["server"]["num_pages"] and last["pagedkv_requests_running"] == 0
    assert 0 <= kv["peak_pages_used"] <= rep["server"]["num_pages"]
    assert rep["plots"] and all(p.endswith(".png") for p in rep["plots"])


def test_plots_are_written_or_skipped_with_a_reason(tmp_path, monkeypatch):
    from pagedkv.loadgen.plots import NO_MATPLOTLIB, write_plots

    results = [request_result(0, 0.1, [(0.1, 1), (0.2, 1)], 0.2), request_result(1, 0.2, [(0.2, 1), (0.25, 2)], 0.3)]
    kv = [{"t_s": 0.0, "values": {"pagedkv_pages_used": 3.0, "pagedkv_pages_free": 5.0}},
          {"t_s": 0.5, "values": {"pagedkv_pages_used": 4.0, "pagedkv_pages_free": 4.0}}]
    pytest.importorskip("matplotlib")
    paths, note = write_plots(tmp_path / "run", results, kv)
    assert note == "" and [p.rsplit("/", 1)[-1] for p in paths] == ["run_latency_cdf.png", "run_kv.png"]
    assert all((tmp_path / p.rsplit("/", 1)[-1]).stat().st_size > 1000 for p in paths)
    monkeypatch.setitem(sys.modules, "matplotlib", None)  # as if it were not installed
    assert write_plots(tmp_path / "again", results, kv) == ([], NO_MATPLOTLIB)
    assert not list(tmp_path.glob("again*"))
