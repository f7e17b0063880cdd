"""deploy/k8s's fleet (#47: components/fleet through overlays/fleet, and secrets/fleet): rendered with kustomize
offline, every object validated against the Kubernetes schemas (strict), and checked against the code as
test_k8s.py checks the base: every pagedkv command parses in its subcommand's parser and Dynamo's frontend in
Dynamo's own argument group (strictly: its main ignores unknown flags), addresses, ports and Service names agree,
Dynamo's discovery, planes and namespace agree between the frontend and the sidecars, every mounted file and
secret key exists in the Secrets that deploy/fleet_local.py --write-secrets and gen-certs make, grace periods cover
the shutdown timeouts, and the NetworkPolicies select pods that exist and name ports they have."""

from __future__ import annotations

import shutil
import subprocess
import sys
from pathlib import Path

import pytest

from tests.e2e.test_k8s import GRACE_MARGIN, K8S, K8S_VERSION, by_kind, containers, flag, parse, render, selects
from tests.support import procs

pytestmark = pytest.mark.e2e

FLEET = K8S / "overlays" / "fleet"


@pytest.fixture(scope="module")
def secrets_dir(tmp_path_factory) -> Path:
    """deploy/k8s/secrets/fleet with the files its kustomization says to make."""
    out = tmp_path_factory.mktemp("k8s-fleet") / "fleet"
    shutil.copytree(K8S / "secrets" / "fleet", out)
    for cmd in ([str(procs.ROOT / "deploy" / "fleet_local.py"), "--write-secrets", str(out), "--tenants", "2"],
                ["-m", "pagedkv", "gen-certs", "--out", str(out / "certs"), "--hosts", "pagedkv-edge"]):
        r = subprocess.run([sys.executable, *cmd], cwd=procs.ROOT, capture_output=True, text=True, timeout=120)
        assert r.returncode == 0, r.stderr
    return out


@pytest.fixture(scope="module")
def docs() -> list[dict]:
    return render(FLEET)


@pytest.fixture(scope="module")
def secret_docs(secrets_dir) -> list[dict]:
    return render(secrets_dir)


def test_every_object_validates_against_the_kubernetes_schemas(docs, secret_docs):
    import kubernetes_validate

    kinds = sorted(d["kind"] for d in docs)
    assert kinds == ["Deployment"] * 4 + ["NetworkPolicy"] * 3 + ["Service"] * 4, kinds
    for doc in [*docs, *secret_docs]:
        try:
            kubernetes_validate.validate(doc, K8S_VERSION, strict=True)
        except kubernetes_validate.ValidationError as err:
            pytest.fail(f"{doc['kind']}/{doc['metadata']['name']}: {err.message} at {'.'.join(map(str, err.path))}")
    for dep in by_kind(docs, "Deployment").values():
        images = {c["image"] for c in containers(dep)}
        assert images <= {"pagedkv:dynamo", "quay.io/coreos/etcd:v3.5.21"}, images  # the image with Dynamo
        assert dep["spec"]["template"]["spec"]["securityContext"]["runAsNonRoot"]


def env_of(c: dict) -> dict[str, str]:
    return {e["name"]: e.get("value", e.get("valueFrom")) for e in c.get("env", [])}


def port_of(c: dict, name: str) -> int:
    (port,) = [p["containerPort"] for p in c["ports"] if p["name"] == name]
    return port


def frontend_args(c: dict):
    pytest.importorskip("dynamo.frontend.main", reason="NVIDIA Dynamo is not installed (make install-dynamo)")
    import argparse

    from dynamo.frontend.frontend_args import FrontendArgGroup

    p = argparse.ArgumentParser(allow_abbrev=False)
    FrontendArgGroup().add_arguments(p)
    return p.parse_args(c["args"])


def test_flags_ports_and_names_agree(docs, secret_docs):
    deps, services = by_kind(docs, "Deployment"), by_kind(docs, "Service")
    (sched_c, sidecar_c) = containers(deps["pagedkv-fleet-scheduler"])
    (front_c,) = containers(deps["dynamo-frontend"])
    (edge_c,) = containers(deps["pagedkv-edge"])
    (etcd_c,) = containers(deps["pagedkv-etcd"])
    sched, sidecar, edge = parse(sched_c["args"]), parse(sidecar_c["args"]), parse(edge_c["args"])
    assert (sched.command, sidecar.command, edge.command) == ("serve", "dynamo-worker", "gateway")
    assert front_c["command"] == ["python", "-m", "dynamo.frontend"]
    front = frontend_args(front_c)
    # the scheduler listens on the pod's loopback only: its sidecar is its one caller
    assert sched.host == "127.0.0.1" and sidecar.address == f"127.0.0.1:{sched.port}"
    assert sidecar.model == sched.model and sched.kv_events_rpc and sidecar.require_tenant
    # Dynamo: etcd discovery, TCP requests, ZMQ events, one namespace, on both sides
    etcd = services["pagedkv-etcd"]
    etcd_url = f"http://pagedkv-etcd:{etcd['spec']['ports'][0]['port']}"
    assert etcd["spec"]["ports"][0]["targetPort"] == "client" and port_of(etcd_c, "client") == 2379
    assert env_of(sidecar_c)["ETCD_ENDPOINTS"] == env_of(front_c)["ETCD_ENDPOINTS"] == etcd_url
    assert flag(etcd_c["command"], "--advertise-client-urls") == etcd_url
    assert sidecar.discovery_backend == front.discovery_backend == "etcd"
    assert sidecar.request_plane == front.request_plane == "tcp"
    assert sidecar.event_plane == front.event_plane == "zmq"
    assert sidecar.namespace == front.namespace
    assert front.router_mode == "kv" and front.migration_limit >= 1
    assert front.prefill_load_scale == 4.0  # as deploy/fleet_local.py's ROUTER_ARGS (bench/NOTES.md, session 21)
    # the sidecar's probes are on Dynamo's system port
    system = int(env_of(sidecar_c)["DYN_SYSTEM_PORT"])
    assert port_of(sidecar_c, "dynamo-system") == system
    for probe in ("readinessProbe", "startupProbe", "livenessProbe"):
        assert sidecar_c[probe]["httpGet"]["port"] == "dynamo-system", probe
    # the edge relays to the frontend's Service, which maps to its --http-port
    front_svc = services["dynamo-frontend"]["spec"]["ports"][0]
    assert edge.edge_upstream == f"http://dynamo-frontend:{front_svc['port']}"
    assert front_svc["targetPort"] == "http" and port_of(front_c, "http") == front.http_port
    assert port_of(edge_c, "https") == edge.port
    assert services["pagedkv-edge"]["spec"]["ports"][0]["targetPort"] == "https"
    # the secrets: one hop secret for scheduler and sidecar, one fleet secret for all three, one tenants file
    assert sidecar.trusted_hop_secret_file == sched.trusted_hop_secret_file
    assert sidecar.fleet_secret_file == sched.fleet_secret_file == edge.fleet_secret_file
    assert sched.tenants_file == edge.tenants_file
    assert env_of(sidecar_c)["PAGEDKV_API_KEY"] == {"secretKeyRef": {"name": "pagedkv-fleet", "key": "ops.key"}}
    keys = {d["metadata"]["name"]: set(d["data"]) for d in secret_docs}
    assert keys == {"pagedkv-fleet": {"hop.secret", "fleet.secret", "ops.key"},
                    "pagedkv-fleet-tenants": {"tenants.toml"}, "pagedkv-edge-tls": {"server.pem", "server.key"}}
    for dep, c, args in ((deps["pagedkv-fleet-scheduler"], sched_c, sched), (deps["pagedkv-fleet-scheduler"],
                         sidecar_c, sidecar), (deps["pagedkv-edge"], edge_c, edge)):
        for path in (getattr(args, a, "") for a in ("tenants_file", "trusted_hop_secret_file", "fleet_secret_file",
                                                    "tls_cert", "tls_key")):
            if path:
                check_mounted(dep, c, path, keys)
    # grace periods cover preStop plus the shutdown timeout
    for dep, c, args in ((deps["pagedkv-fleet-scheduler"], sched_c, sched), (deps["pagedkv-edge"], edge_c, edge)):
        pre_stop = c["lifecycle"]["preStop"]["sleep"]["seconds"]
        grace = dep["spec"]["template"]["spec"]["terminationGracePeriodSeconds"]
        assert grace >= pre_stop + args.shutdown_timeout + GRACE_MARGIN, (dep["metadata"]["name"], grace)
    # the scheduler's probes ask its own port
    for probe in ("startupProbe", "readinessProbe", "livenessProbe"):
        assert flag(sched_c[probe]["exec"]["command"], "--address") == f"127.0.0.1:{sched.port}"


def check_mounted(dep: dict, c: dict, path: str, keys: dict[str, set[str]]) -> None:
    """``path`` lies under one of ``c``'s mounts, whose volume is a Secret holding that file."""
    mounts = [m for m in c["volumeMounts"] if path.startswith(m["mountPath"].rstrip("/") + "/")]
    assert len(mounts) == 1, (path, c["name"])
    volume = next(v for v in dep["spec"]["template"]["spec"]["volumes"] if v["name"] == mounts[0]["name"])
    name = path.removeprefix(mounts[0]["mountPath"].rstrip("/") + "/")
    secret = volume["secret"]
    items = {i["path"]: i["key"] for i in secret.get("items", [])}
    assert (items.get(name) if items else name) in keys[secret["secretName"]], (path, secret)


def test_network_policies_select_the_fleet_and_name_its_ports(docs):
    deps = by_kind(docs, "Deployment")
    labels = {n: d["spec"]["template"]["metadata"]["labels"] for n, d in deps.items()}
    ports = {n: {p["name"] for c in containers(d) for p in c.get("ports", [])} for n, d in deps.items()}
    policies = by_kind(docs, "NetworkPolicy")
    guarded = {}
    for name, pol in policies.items():
        (target,) = [n for n in deps if selects(pol["spec"]["podSelector"], labels[n])]
        guarded[target] = pol
        for rule in pol["spec"]["ingress"]:
            for peer in rule.get("from", []):
                assert [n for n in deps if selects(peer["podSelector"], labels[n])], (name, peer)
            for p in rule.get("ports", []):
                assert p["port"] in ports[target], (name, p)
    # the frontend (no authentication) is reached only from the edge; etcd only from the fleet
    assert set(guarded) == {"dynamo-frontend", "pagedkv-fleet-scheduler", "pagedkv-etcd"}
    (rule,) = guarded["dynamo-frontend"]["spec"]["ingress"]
    assert [selects(p["podSelector"], labels["pagedkv-edge"]) for p in rule["from"]] == [True]
    assert "pagedkv-edge" not in guarded  # the public door
