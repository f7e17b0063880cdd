"""deploy/fleet_local.py: the fleet on loopback without containers (two ``pagedkv serve`` with their Dynamo sidecars,
Dynamo's frontend, the edge gateway), started, used and stopped as its users do. Skipped without Dynamo
(``make install-dynamo``)."""

from __future__ import annotations

import json
import os
import subprocess
import sys

import httpx
import pytest

pytest.importorskip("dynamo.frontend", reason="NVIDIA Dynamo is not installed (make install-dynamo)")

from tests.support import procs  # noqa: E402

sys.path.insert(0, str(procs.ROOT / "deploy"))
from fleet_local import OPS_TENANT, Fleet, FleetConfig, check_chat  # noqa: E402

pytestmark = pytest.mark.e2e


@pytest.fixture(scope="module")
def fleet(model_cache):
    f = Fleet(FleetConfig(model="tiny-llama", schedulers=2, tenants=2,
                          serve_args=["--threads", "1", "--num-pages", "128"]))
    f.start()
    yield f
    f.stop()


def test_it_serves_chat_through_the_edge_with_each_tenants_key(fleet):
    assert set(fleet.keys) == {OPS_TENANT, "tenant-0", "tenant-1"}
    assert len(fleet.scheduler_addresses) == 2
    assert check_chat(fleet)  # the openai SDK, tenant-0's key, the plain chat template (tiny-llama has none)
    keys = json.loads((fleet.workdir / "keys.json").read_text())
    assert keys == fleet.keys
    for name in ("tenants.toml", "hop.secret", "fleet.secret", "keys.json", "ops.key"):
        assert (fleet.workdir / name).stat().st_mode & 0o077 == 0, name


def test_a_tenants_repeat_hits_and_only_the_edge_is_a_door(fleet):
    body = {"model": fleet.served_model, "prompt": "fleet_local: " + " ".join(f"w{i}" for i in range(60)),
            "max_tokens": 2, "temperature": 0}
    with httpx.Client(timeout=120) as http:
        def edge(key: str) -> httpx.Response:
            return http.post(f"{fleet.edge_url}/v1/completions", json=body, headers={"authorization": f"Bearer {key}"})

        first, again = edge(fleet.keys["tenant-0"]), edge(fleet.keys["tenant-0"])
        assert first.status_code == again.status_code == 200, (first.text, again.text)
        assert again.json()["usage"]["prompt_tokens_details"]["cached_tokens"] > 0, again.json()
        assert edge("not-a-key").status_code == 401
        # straight to Dynamo's frontend: its sidecars refuse a request the edge did not sign (--require-tenant)
        direct = http.post(f"{fleet.frontend_url}/v1/completions", json=body)
        assert direct.status_code == 400 and "x-dynamo-meta-pagedkv-tenant" in direct.text, direct.text


def test_stop_ends_every_process_group(fleet):
    """SIGTERM in order: every process exits 0 (the schedulers drain), and none of their process groups is left."""
    groups = [p.proc.pid for p in fleet.procs]
    assert len(groups) == 6
    codes = fleet.stop()
    assert codes == {"edge-gateway": 0, "frontend": 0, "dynamo-worker-0": 0, "dynamo-worker-1": 0, "scheduler-0": 0,
                     "scheduler-1": 0}, (codes, fleet.logs())
    for pgid in groups:
        with pytest.raises(ProcessLookupError):
            os.killpg(pgid, 0)


def test_the_check_command_starts_serves_and_stops():
    """The launcher as a command: --check starts it, sends one chat completion and stops everything, each exit
    code 0, its temporary folder removed."""
    r = subprocess.run([sys.executable, str(procs.ROOT / "deploy" / "fleet_local.py"), "--check", "--schedulers", "1",
                        "--tenants", "1"], capture_output=True, text=True, timeout=600, cwd=procs.ROOT)
    assert r.returncode == 0, r.stdout[-3000:] + r.stderr[-3000:]
    lines = [json.loads(line) for line in r.stdout.splitlines() if line.startswith("{") and line.endswith("}")]
    assert any("chat" in x for x in lines), r.stdout
    stopped = next(x["stopped"] for x in lines if "stopped" in x)
    assert set(stopped) == {"edge-gateway", "frontend", "dynamo-worker-0", "scheduler-0"}
    assert all(code == 0 for code in stopped.values()), stopped
    started = json.loads(r.stdout[r.stdout.index("{"):r.stdout.index("}\n") + 1])
    workdir = os.path.dirname(started["keys"])
    assert not os.path.exists(workdir)  # its temporary folder (secrets, keys) went with it
