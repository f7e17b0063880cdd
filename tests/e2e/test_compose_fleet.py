"""docker-compose.yml's fleet profile (#47): validated by Debian's docker-compose, every command parsed by the
parser of the program that runs it (pagedkv's subcommands; Dynamo's frontend with its own argument group, strictly:
the frontend itself ignores an unknown flag), and the wiring checked across services: addresses, ports, secrets,
the tenants file, discovery, namespace and planes, the published ports, the stop order and grace periods. The
init service's command runs here and its tenants file loads in the scheduler's own loader."""

from __future__ import annotations

import json
import re
import subprocess
import sys

import pytest
import yaml

from pagedkv.cli import build_parser
from tests.e2e.test_compose import COMPOSE, _seconds, compose_config, docker_compose_binary
from tests.support import procs

pytestmark = pytest.mark.e2e

FLEET = ["fleet-secrets", "fleet-scheduler-1", "fleet-scheduler-2", "fleet-sidecar-1", "fleet-sidecar-2",
         "dynamo-frontend", "fleet-edge"]
PAIRS = [("fleet-scheduler-1", "fleet-sidecar-1"), ("fleet-scheduler-2", "fleet-sidecar-2")]


def _flag(command: list[str], flag: str) -> str:
    assert flag in command, (flag, command)
    return str(command[command.index(flag) + 1])


@pytest.fixture(scope="module")
def fleet() -> dict[str, dict]:
    cfg = compose_config(docker_compose_binary(), "fleet")
    return cfg["services"]


def _parsed(svc: dict):
    """The service's command as its program parses it (the sidecar's entrypoint ends in `pagedkv "$@"`)."""
    return build_parser().parse_args([str(c) for c in svc["command"]])


def test_the_fleet_profile_has_its_services_from_the_dynamo_image(fleet):
    assert set(FLEET) <= set(fleet)
    for name in FLEET:
        svc = fleet[name]
        assert svc["profiles"] == ["fleet"], name
        assert svc["image"] == "pagedkv:dynamo" and svc["build"]["args"]["EXTRAS"] == "dynamo", name
    # without the profile none of them is there
    default = yaml.safe_load(COMPOSE.read_text())["services"]
    assert all(default[n]["profiles"] == ["fleet"] for n in FLEET)


def test_every_pagedkv_command_parses(fleet):
    roles = {}
    for name in FLEET:
        if name in ("dynamo-frontend", "fleet-secrets"):
            continue
        roles[name] = _parsed(fleet[name]).command
    assert roles == {"fleet-scheduler-1": "serve", "fleet-scheduler-2": "serve", "fleet-sidecar-1": "dynamo-worker",
                     "fleet-sidecar-2": "dynamo-worker", "fleet-edge": "gateway"}


def test_the_frontend_command_parses_in_dynamos_own_parser(fleet):
    pytest.importorskip("dynamo.frontend.main", reason="NVIDIA Dynamo is not installed (make install-dynamo)")
    import argparse

    from dynamo.frontend.frontend_args import FrontendArgGroup

    svc = fleet["dynamo-frontend"]
    assert svc["entrypoint"] == ["python", "-m", "dynamo.frontend"]
    p = argparse.ArgumentParser(allow_abbrev=False)
    FrontendArgGroup().add_arguments(p)
    args = p.parse_args([str(c) for c in svc["command"]])  # strict: Dynamo's own main ignores unknown flags
    assert args.router_mode == "kv" and args.migration_limit >= 1
    # the router settings bench/fleet.py measured, as deploy/fleet_local.py runs them
    sys.path.insert(0, str(procs.ROOT / "deploy"))
    from fleet_local import ROUTER_ARGS

    assert ROUTER_ARGS == ["--router-prefill-load-scale", "4"] and args.prefill_load_scale == 4.0
    with pytest.raises(SystemExit):
        p.parse_args(["--router-mod", "kv"])  # (the parser does refuse a misspelt or shortened flag)


def test_the_services_agree(fleet):
    front = fleet["dynamo-frontend"]
    edge = _parsed(fleet["fleet-edge"])
    env_keys = ("DYN_DISCOVERY_BACKEND", "DYN_FILE_KV", "DYN_REQUEST_PLANE", "DYN_EVENT_PLANE", "DYN_NAMESPACE")
    front_cmd = [str(c) for c in front["command"]]
    # the frontend: file discovery on the shared volume, the planes and namespace its sidecars use
    assert _flag(front_cmd, "--discovery-backend") == front["environment"]["DYN_DISCOVERY_BACKEND"] == "file"
    assert _flag(front_cmd, "--request-plane") == front["environment"]["DYN_REQUEST_PLANE"] == "tcp"
    assert _flag(front_cmd, "--event-plane") == front["environment"]["DYN_EVENT_PLANE"] == "zmq"
    discovery = front["environment"]["DYN_FILE_KV"]
    assert f"fleet-discovery:{discovery}:rw" in front["volumes"]
    assert "ports" not in front  # it checks no key: only the edge reaches it, inside the compose network
    assert not any(":/models" in v for v in front["volumes"])
    # the edge: relays to the frontend's port, checks keys against the schedulers' tenants file
    assert edge.edge_upstream == f"http://dynamo-frontend:{_flag(front_cmd, '--http-port')}"
    for sched_name, sidecar_name in PAIRS:
        sched, sidecar = _parsed(fleet[sched_name]), _parsed(fleet[sidecar_name])
        env = fleet[sidecar_name]["environment"]
        assert {k: env[k] for k in env_keys} == {k: front["environment"][k] for k in env_keys}, sidecar_name
        assert f"fleet-discovery:{discovery}:rw" in fleet[sidecar_name]["volumes"]
        assert sidecar.discovery_backend == "file" and sidecar.request_plane == "tcp" and sidecar.event_plane == "zmq"
        assert sidecar.namespace == _flag(front_cmd, "--namespace") == env["DYN_NAMESPACE"]
        # the sidecar reaches its own scheduler, over TLS checked against a name the certificate carries
        assert sidecar.address == f"{sched_name}:{sched.port}", sidecar_name
        hosts = _flag(fleet["certs"]["command"], "--hosts").split(",")
        assert sched.tls_cert and sidecar.tls_ca and sidecar.tls_server_name in hosts
        assert sidecar.model == sched.model
        # its model's files reach the frontend from its system port (no shared models volume), where its health is
        system = env["DYN_SYSTEM_PORT"]
        assert f"http://127.0.0.1:{system}/health" in " ".join(fleet[sidecar_name]["healthcheck"]["test"])
        assert fleet[sidecar_name]["depends_on"][sched_name]["condition"] == "service_healthy"
        # the scheduler serves its KV events; the tenant the edge signs is checked with the fleet secret and
        # asserted with the scheduler's hop secret
        assert sched.kv_events_rpc
        assert sidecar.trusted_hop_secret_file == sched.trusted_hop_secret_file
        assert sidecar.fleet_secret_file == sched.fleet_secret_file == edge.fleet_secret_file
        assert sched.tenants_file == edge.tenants_file
        assert sidecar.require_tenant  # a request that did not come through the edge is refused
        assert sched.shutdown_timeout + 10 <= _seconds(fleet[sched_name]["stop_grace_period"])
    # the sidecars' key: the one the init service writes (ops.key), read by the entrypoint
    entry = fleet["fleet-sidecar-1"]["entrypoint"]
    assert entry[:2] == ["/bin/sh", "-c"] and re.search(r"cat /fleet/ops\.key\)\"? exec pagedkv ", entry[2]), entry
    # the edge is published on loopback (PAGEDKV_PUBLISH_HOST) and stops first, within its grace period
    (port,) = yaml.safe_load(COMPOSE.read_text())["services"]["fleet-edge"]["ports"]
    assert port.startswith("${PAGEDKV_PUBLISH_HOST:-127.0.0.1}:") and port.endswith(f":{edge.port}")
    assert {"dynamo-frontend", "fleet-sidecar-1", "fleet-sidecar-2"} <= set(fleet["fleet-edge"]["depends_on"])
    assert edge.shutdown_timeout + 10 <= _seconds(fleet["fleet-edge"]["stop_grace_period"])
    # only the init service writes the fleet volume
    for name in FLEET:
        mounts = [v for v in fleet[name]["volumes"] if v.startswith("fleet:")]
        want = {"fleet-secrets": ["fleet:/fleet:rw"], "dynamo-frontend": []}.get(name, ["fleet:/fleet:ro"])
        assert mounts == want, (name, mounts)


def test_the_init_service_writes_what_the_others_read(fleet, tmp_path):
    """fleet-secrets' command, run here: the files every other service names exist, the tenants file loads in
    the scheduler's loader, the ops tenant is an admin (its key lets a sidecar read the scheduler's load) and
    keys.json's keys are the tenants'."""
    from pagedkv.tenancy import Tenants, hash_key

    init = fleet["fleet-secrets"]
    assert init["entrypoint"] == ["python", "/deploy/fleet_local.py"] and init["restart"] == "no"
    assert any(str(v).endswith(":/deploy:ro") for v in init["volumes"])
    out = tmp_path / "fleet"
    out.mkdir()
    cmd = [str(c).replace("/fleet", str(out)) for c in init["command"]]
    r = subprocess.run([sys.executable, str(procs.ROOT / "deploy" / "fleet_local.py"), *cmd], capture_output=True,
                       text=True, timeout=120, cwd=procs.ROOT)
    assert r.returncode == 0, r.stderr
    parsed = [vars(_parsed(fleet[n])) for n in FLEET if n not in ("dynamo-frontend", "fleet-secrets")]
    named = {p[a] for p in parsed for a in ("tenants_file", "trusted_hop_secret_file", "fleet_secret_file")
             if p.get(a)}
    assert named == {"/fleet/tenants.toml", "/fleet/hop.secret", "/fleet/fleet.secret"}
    for path in [*named, "/fleet/ops.key", "/fleet/keys.json"]:
        f = out / path.removeprefix("/fleet/")
        assert f.is_file() and f.stat().st_mode & 0o077 == 0, path
    tenants = Tenants.load(out / "tenants.toml", num_pages=1024)
    keys = json.loads((out / "keys.json").read_text())
    assert (out / "ops.key").read_text() == keys["ops"]
    assert len(keys) == 1 + int(_flag([str(c) for c in init["command"]], "--tenants").split(":-")[-1].rstrip("}"))
    assert set(tenants.by_id) == set(keys)
    raw = (out / "tenants.toml").read_text()
    for tenant, key in keys.items():
        assert hash_key(key) in raw, tenant
    assert tenants.by_id["ops"].admin and not any(t.admin for n, t in tenants.by_id.items() if n != "ops")
    # a second run keeps them
    before = (out / "fleet.secret").read_text()
    r = subprocess.run([sys.executable, str(procs.ROOT / "deploy" / "fleet_local.py"), *cmd], capture_output=True,
                       text=True, timeout=120, cwd=procs.ROOT)
    assert r.returncode == 0 and "kept" in r.stdout and (out / "fleet.secret").read_text() == before


def test_the_dynamo_image_installs_the_pinned_dynamo_as_the_makefile_does():
    dockerfile = (procs.ROOT / "Dockerfile").read_text()
    makefile = (procs.ROOT / "Makefile").read_text()
    pins = sorted(set(re.findall(r"ai-dynamo(?:-runtime)?==[\d.]+", makefile)))
    assert pins == sorted(set(re.findall(r"ai-dynamo(?:-runtime)?==[\d.]+", dockerfile))) and len(pins) == 2
    assert re.search(r'case ",\$EXTRAS," in \*,dynamo,\*\) /opt/pagedkv/bin/pip install --no-deps ai-dynamo',
                     dockerfile)
    # the volumes the fleet mounts start owned by the image's user (a new named volume copies the mount point)
    (mkdir,) = re.findall(r"mkdir -p ([^&]+) && chown pagedkv:pagedkv ([^\n\\]+)", dockerfile)
    assert {"/fleet", "/discovery"} <= set(mkdir[0].split()) & set(mkdir[1].split())
