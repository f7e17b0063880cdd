"""deploy/k8s: rendered with kustomize (kubectl kustomize, offline), every object validated against the
Kubernetes OpenAPI schemas that kubernetes-validate ships (strict: unknown fields fail; no network), the
ServiceMonitors structurally (a CRD: its schema is not in that set), and everything checked against the code:
every flag parses in the parser of its subcommand, ports and Service names agree, mounted files exist in the
Secrets, grace periods cover the drain timeouts, the HPA's metrics are the scheduler's. Then the base's
executor, scheduler and gateway run as local processes with their manifest args (hosts, ports and mount paths
mapped to loopback and a temporary directory) and their probe commands are run as the kubelet would."""

from __future__ import annotations

import os
import shutil
import ssl
import subprocess
import sys
import urllib.request
from pathlib import Path

import pytest
import yaml

from pagedkv.cli import build_parser, free_port
from tests.support import procs

pytestmark = pytest.mark.e2e

K8S = procs.ROOT / "deploy" / "k8s"
K8S_VERSION = "1.33.0"  # the oldest minor the manifests target (lifecycle.preStop.sleep needs 1.30+)
KUSTOMIZATIONS = ["base", "overlays/gpu"]
DRAIN_FLAG = {"executor": "--drain-timeout", "scheduler": "--shutdown-timeout", "gateway": "--shutdown-timeout"}
GRACE_MARGIN = 5  # seconds past preStop + drain before the kubelet's SIGKILL
TENANT_KEY = "key-k8s"


def kubectl() -> str:
    found = shutil.which("kubectl")
    if not found:
        pytest.skip("kubectl (with its built-in kustomize) is not installed: apt-get install kubectl")
    return found


def render(path: Path) -> list[dict]:
    r = subprocess.run([kubectl(), "kustomize", str(path)], capture_output=True, text=True, timeout=120)
    assert r.returncode == 0, r.stderr
    return [d for d in yaml.safe_load_all(r.stdout) if d]


@pytest.fixture(scope="module")
def secrets_dir(tmp_path_factory) -> Path:
    """deploy/k8s/secrets with the files its README says to make."""
    from pagedkv.tenancy import hash_key

    out = tmp_path_factory.mktemp("k8s") / "secrets"
    shutil.copytree(K8S / "secrets", out)
    r = subprocess.run([sys.executable, "-m", "pagedkv", "gen-certs", "--out", str(out / "certs"), "--executor-secret",
                        "--hosts", "pagedkv-scheduler,pagedkv-executors,pagedkv-gateway"], cwd=procs.ROOT,
                       capture_output=True, text=True, timeout=120)
    assert r.returncode == 0, r.stderr
    (out / "tenants.toml").write_text(f'[tenants.team]\nkeys = ["{hash_key(TENANT_KEY)}"]\nadmin = true\n')
    return out


@pytest.fixture(scope="module")
def rendered(secrets_dir) -> dict[str, list[dict]]:
    out = {name: render(K8S / name) for name in KUSTOMIZATIONS}
    out["secrets"] = render(secrets_dir)
    return out


def by_kind(docs: list[dict], kind: str) -> dict[str, dict]:
    return {d["metadata"]["name"]: d for d in docs if d["kind"] == kind}


def flag(args: list[str], name: str) -> str:
    assert name in args, (name, args)
    return args[args.index(name) + 1]


def containers(deployment: dict) -> list[dict]:
    return deployment["spec"]["template"]["spec"]["containers"]


def role_of(deployment: dict) -> str:
    return deployment["spec"]["template"]["metadata"]["labels"]["app.kubernetes.io/component"]


# ---- schemas -----------------------------------------------------------------------------------
@pytest.mark.parametrize("name", [*KUSTOMIZATIONS, "secrets"])
def test_every_object_validates_against_the_kubernetes_schemas(rendered, name):
    import kubernetes_validate

    docs = rendered[name]
    assert docs
    for doc in docs:
        if doc["apiVersion"].startswith("monitoring.coreos.com/"):
            check_service_monitor(doc, docs)
            continue
        try:
            kubernetes_validate.validate(doc, K8S_VERSION, strict=True)
        except kubernetes_validate.ValidationError as err:
            pytest.fail(f"{name}: {doc['kind']}/{doc['metadata']['name']}: {err.message} at "
                        f"{'.'.join(map(str, err.path))}")


def test_the_validator_really_validates():
    import kubernetes_validate

    doc = next(d for d in render(K8S / "base") if d["kind"] == "Deployment")
    kubernetes_validate.validate(doc, K8S_VERSION, strict=True)
    doc["spec"]["template"]["spec"]["containers"][0]["argz"] = ["typo"]  # a misspelt field
    with pytest.raises(kubernetes_validate.ValidationError):
        kubernetes_validate.validate(doc, K8S_VERSION, strict=True)


def check_service_monitor(doc: dict, docs: list[dict]) -> None:
    """A CRD (Prometheus Operator): its well-known fields by hand, and that it selects Services that exist and
    names their ports."""
    assert doc["apiVersion"] == "monitoring.coreos.com/v1" and doc["kind"] == "ServiceMonitor"
    spec = doc["spec"]
    assert set(spec) <= {"selector", "endpoints", "namespaceSelector", "jobLabel"}, set(spec)
    services = [s for s in by_kind(docs, "Service").values() if selects(spec["selector"], s["metadata"]["labels"])]
    assert services, f"ServiceMonitor {doc['metadata']['name']} selects no Service"
    for endpoint in spec["endpoints"]:
        assert set(endpoint) <= {"port", "path", "scheme", "interval", "tlsConfig"}, set(endpoint)
        assert endpoint.get("scheme", "http") in ("http", "https")
        for svc in services:
            assert endpoint["port"] in [p["name"] for p in svc["spec"]["ports"]], (svc["metadata"]["name"], endpoint)
        if "tlsConfig" in endpoint:
            ca = endpoint["tlsConfig"]["ca"]["secret"]
            assert (ca["name"], ca["key"]) == ("pagedkv-tls", "ca.pem")
            assert endpoint["tlsConfig"]["serverName"] in {s["metadata"]["name"] for s in services}


def selects(selector: dict, labels: dict) -> bool:
    ok = all(labels.get(k) == v for k, v in selector.get("matchLabels", {}).items())
    for e in selector.get("matchExpressions", []):
        assert e["operator"] == "In"
        ok = ok and labels.get(e["key"]) in e["values"]
    return ok


# ---- against the code --------------------------------------------------------------------------
def parse(args: list[str]):
    try:
        return build_parser().parse_args(args)
    except SystemExit as err:
        pytest.fail(f"pagedkv {' '.join(args)}: the parser refuses it (exit {err.code})")


@pytest.mark.parametrize("name", KUSTOMIZATIONS)
def test_flags_ports_probes_and_names_agree_with_the_code(rendered, name):
    docs = rendered[name]
    deployments, services = by_kind(docs, "Deployment"), by_kind(docs, "Service")
    secret_keys = {n: set(s["data"]) for n, s in by_kind(rendered["secrets"], "Secret").items()}
    assert {role_of(d) for d in deployments.values()} == {"executor", "scheduler", "gateway"}
    for dep in deployments.values():
        (c,) = containers(dep)
        role, args = role_of(dep), c["args"]
        assert args[0] == role and c["image"].startswith("pagedkv")
        parsed = parse(args)
        ports = {p["name"]: p["containerPort"] for p in c["ports"]}
        assert parsed.port == ports["https" if role == "gateway" else "grpc"]
        if role != "gateway":
            assert parsed.metrics_port == ports["metrics"]
        check_mounted_files(dep, c, args, secret_keys)
        for kind in ("startupProbe", "readinessProbe", "livenessProbe"):
            probe = c.get(kind)
            if probe is None:
                continue
            if "exec" in probe:
                command = probe["exec"]["command"]
                assert command[:2] == ["pagedkv", "health"], command
                health = parse(command[1:])
                assert health.address == f"127.0.0.1:{parsed.port}" and health.tls_ca == parsed.tls_cert.replace(
                    "server.pem", "ca.pem")
                check_mounted_files(dep, c, command, secret_keys)
            else:
                assert probe["httpGet"]["port"] in ports and probe["httpGet"]["path"] in ("/health", "/health/live")
                assert probe["httpGet"]["scheme"] == ("HTTPS" if parsed.tls_cert else "HTTP")
        check_grace(dep, c, role, parsed)
    for svc in services.values():
        pods = [d for d in deployments.values()
                if selects({"matchLabels": svc["spec"]["selector"]}, d["spec"]["template"]["metadata"]["labels"])]
        assert len(pods) == 1, svc["metadata"]["name"]
        names = {p["name"] for p in containers(pods[0])[0]["ports"]}
        assert {p["targetPort"] for p in svc["spec"]["ports"]} <= names, svc["metadata"]["name"]
    # who talks to whom: the names the processes dial are the Services, on their ports
    scheduler = parse(containers(deployments["pagedkv-scheduler"])[0]["args"])
    gateway = parse(containers(deployments["pagedkv-gateway"])[0]["args"])
    (executor_target,) = scheduler.executor
    host, port = executor_target.rsplit(":", 1)
    assert services[host]["spec"]["clusterIP"] == "None" and int(port) in service_ports(services[host], "grpc")
    assert scheduler.executor_tls_server_name == host
    host, port = gateway.address.removeprefix("dns:///").rsplit(":", 1)
    assert int(port) in service_ports(services[host], "grpc") and gateway.tls_server_name == host
    for pdb in by_kind(docs, "PodDisruptionBudget").values():
        assert any(selects(pdb["spec"]["selector"], d["spec"]["template"]["metadata"]["labels"])
                   for d in deployments.values())


def service_ports(svc: dict, name: str) -> list[int]:
    return [p["port"] for p in svc["spec"]["ports"] if p["name"] == name]


def check_mounted_files(dep: dict, c: dict, args: list[str], secret_keys: dict[str, set[str]]) -> None:
    """Every absolute path an argument names lies in a mounted Secret that has that key (or a writable volume)."""
    volumes = {v["name"]: v for v in dep["spec"]["template"]["spec"]["volumes"]}
    for arg in args:
        if not arg.startswith("/"):
            continue
        mount = next((m for m in c["volumeMounts"] if arg.startswith(m["mountPath"] + "/")), None)
        assert mount is not None, f"{arg}: no volume mounted there"
        volume, key = volumes[mount["name"]], arg[len(mount["mountPath"]) + 1:]
        sources = [s["secret"]["name"] for s in volume["projected"]["sources"]] if "projected" in volume else (
            [volume["secret"]["secretName"]] if "secret" in volume else [])
        if sources:
            assert any(key in secret_keys[s] for s in sources), f"{arg}: no Secret of {sources} has {key!r}"


def check_grace(dep: dict, c: dict, role: str, parsed) -> None:
    """The kubelet's SIGKILL comes after preStop plus the process's own drain bound, and liveness never kills
    a pod that is draining (NOT_SERVING) within that time."""
    spec = dep["spec"]["template"]["spec"]
    grace = spec["terminationGracePeriodSeconds"]
    pre_stop = c.get("lifecycle", {}).get("preStop", {}).get("sleep", {}).get("seconds", 0)
    drain = getattr(parsed, DRAIN_FLAG[role].lstrip("-").replace("-", "_"))
    assert DRAIN_FLAG[role] in c["args"], (role, "set the drain bound explicitly")
    assert grace >= pre_stop + drain + GRACE_MARGIN, (role, grace, pre_stop, drain)
    live = c["livenessProbe"]
    assert live["periodSeconds"] * live["failureThreshold"] > grace, role


def test_hpa_scales_the_executors_on_the_schedulers_metrics(rendered):
    from prometheus_client import REGISTRY

    import scheduler_svc.metrics  # noqa: F401 - registers the series

    (hpa,) = by_kind(rendered["overlays/gpu"], "HorizontalPodAutoscaler").values()
    assert hpa["spec"]["scaleTargetRef"] == {"apiVersion": "apps/v1", "kind": "Deployment", "name": "pagedkv-executor"}
    rules = yaml.safe_load((K8S / "components" / "autoscaling" / "adapter-rules.yaml").read_text())["external"]
    exposed = {r["name"]["as"]: r for r in rules}
    assert {m["external"]["metric"]["name"] for m in hpa["spec"]["metrics"]} == set(exposed)
    known = {s.name for metric in REGISTRY.collect() for s in metric.samples}
    for rule in rules:
        series = [w for w in rule["metricsQuery"].replace("(", " ").split() if w.startswith("pagedkv_")]
        for s in series:
            assert s.split("{")[0] in known, f"{s}: no such series in scheduler_svc/metrics.py"


# ---- the base's processes, locally -------------------------------------------------------------
def local_args(args: list[str], ports: dict[str, int], names: dict[str, str], paths: dict[str, str]) -> list[str]:
    out: list[str] = []
    it = iter(args)
    for a in it:
        if a in ("--port", "--metrics-port"):
            out += [a, str(ports[a])]
            next(it)
        elif a == "--host":
            out += [a, "127.0.0.1"]
            next(it)
        elif a in ("--executor", "--address"):
            target = next(it)
            host = target.removeprefix("dns:///").rsplit(":", 1)[0]
            out += [a, names.get(host, target)]
        elif a == "--log-format":
            next(it)
        else:
            for prefix, local in paths.items():
                if a.startswith(prefix + "/"):
                    a = local + a[len(prefix):]
            out.append(a)
    return out


def test_base_runs_locally_and_its_probes_pass(rendered, secrets_dir, model_cache):
    deployments = {role_of(d): d for d in by_kind(rendered["base"], "Deployment").values()}
    ports = {r: {"--port": free_port(), "--metrics-port": free_port()} for r in deployments}
    names = {"pagedkv-executors": f"127.0.0.1:{ports['executor']['--port']}",
             "pagedkv-scheduler": f"127.0.0.1:{ports['scheduler']['--port']}"}
    tenants = secrets_dir / "tenants"
    tenants.mkdir(exist_ok=True)
    shutil.copy(secrets_dir / "tenants.toml", tenants / "tenants.toml")
    paths = {"/certs": str(secrets_dir / "certs"), "/etc/pagedkv": str(tenants)}
    env = {e["name"]: e["value"] for e in containers(deployments["executor"])[0]["env"]}
    assert env["PAGEDKV_CACHE_DIR"] == "/models"
    env = {"PAGEDKV_CACHE_DIR": str(model_cache), "PAGEDKV_EXECUTOR_SECRET": ""}  # the secret comes from the file
    started: list[procs.Proc] = []
    try:
        for role in ("executor", "scheduler", "gateway"):
            args = local_args(containers(deployments[role])[0]["args"], ports[role], names, paths)
            started.append(procs.Proc(args[0], *args[1:], port=ports[role]["--port"], env=env, wait=False))
        for p in started:
            p.wait_ready(180)
        for role, dep in deployments.items():
            c = containers(dep)[0]
            for kind in ("startupProbe", "readinessProbe", "livenessProbe"):
                probe = c.get(kind)
                if probe is None:
                    continue
                if "exec" in probe:
                    command = local_args(probe["exec"]["command"][1:], {}, {}, paths)
                    command[command.index("--address") + 1] = f"127.0.0.1:{ports[role]['--port']}"
                    r = subprocess.run([sys.executable, "-m", "pagedkv", *command], capture_output=True, text=True,
                                       timeout=60, env={**os.environ, **env})
                    assert r.returncode == 0 and "SERVING" in r.stdout, (role, kind, r.stdout, r.stderr)
                else:
                    get = probe["httpGet"]
                    ctx = ssl.create_default_context(cafile=str(secrets_dir / "certs" / "ca.pem"))
                    url = f"{get['scheme'].lower()}://localhost:{ports[role]['--port']}{get['path']}"
                    with urllib.request.urlopen(url, timeout=10, context=ctx) as r:
                        assert r.status == 200, (role, kind)
        import openai

        ca = ssl.create_default_context(cafile=str(secrets_dir / "certs" / "ca.pem"))
        http = openai.DefaultHttpxClient(verify=ca)
        client = openai.OpenAI(base_url=f"https://localhost:{ports['gateway']['--port']}/v1", api_key=TENANT_KEY,
                               http_client=http, max_retries=0)
        r = client.completions.create(model="tiny-llama", prompt="k8s", max_tokens=4, extra_body={"ignore_eos": True})
        assert r.usage.completion_tokens == 4
        assert started[1].saw("scheduler_ready", tls=True, executor_tls=True, executor_secret=True)
    finally:
        codes = [p.stop(60) for p in reversed(started)]  # SIGTERM, as the kubelet sends
    assert codes == [0] * len(started), "\n\n".join(p.log()[-3000:] for p in started)
