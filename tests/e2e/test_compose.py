"""docker-compose.yml: validated by Debian's docker-compose, and its services' commands run as local
processes on loopback with the compose environment (the certs init service first, its volume a temporary
directory), so the wiring, TLS and the executor secret included, is exercised where no Docker engine runs."""

from __future__ import annotations

import asyncio
import os
import re
import shutil
import subprocess
import sys
import urllib.request
from pathlib import Path

import pytest
import yaml

from pagedkv import security
from pagedkv.cli import free_port
from pagedkv.client import Client
from tests.support import procs

pytestmark = pytest.mark.e2e

COMPOSE = procs.ROOT / "docker-compose.yml"
COMPOSE_GPU = procs.ROOT / "docker-compose.gpu.yml"  # the override for GPU executors
ALIAS = "executors"
CERTS = "/certs"  # the certs volume's mount point


def reflected_services(address: str, ca: str) -> list[str]:
    import grpc
    from grpc_reflection.v1alpha.proto_reflection_descriptor_database import ProtoReflectionDescriptorDatabase

    with grpc.secure_channel(address, security.channel_credentials(ca)) as channel:
        return list(ProtoReflectionDescriptorDatabase(channel).get_services())


def _flag(command: list[str], flag: str) -> str:
    assert flag in command, (flag, command)
    return command[command.index(flag) + 1]


@pytest.fixture(scope="module")
def docker_compose() -> str:
    return docker_compose_binary()


def docker_compose_binary() -> str:
    """Debian's docker-compose (Compose v1), installed here when missing (CI runs as root on Debian)."""
    found = shutil.which("docker-compose")
    if found:
        return found
    if os.geteuid() != 0 or not shutil.which("apt-get"):
        pytest.skip("docker-compose is not installed and apt-get needs root: apt-get install docker-compose")
    env = {**os.environ, "DEBIAN_FRONTEND": "noninteractive"}
    r = subprocess.run(["apt-get", "install", "-y", "-q", "--no-install-recommends", "docker-compose"],
                       capture_output=True, text=True, env=env, timeout=600)
    if r.returncode:
        subprocess.run(["apt-get", "update", "-q"], capture_output=True, env=env, timeout=600)
        r = subprocess.run(["apt-get", "install", "-y", "-q", "--no-install-recommends", "docker-compose"],
                           capture_output=True, text=True, env=env, timeout=600)
    assert r.returncode == 0, r.stderr[-2000:]
    return shutil.which("docker-compose")


def compose_config(binary: str, profiles: str, files: tuple[Path, ...] = (COMPOSE,)) -> dict:
    env = {**os.environ, "COMPOSE_PROFILES": profiles}
    env.pop("COMPOSE_FILE", None)
    r = subprocess.run([binary, *(a for f in files for a in ("-f", str(f))), "config"], capture_output=True,
                       text=True, cwd=procs.ROOT, env=env, timeout=120)
    assert r.returncode == 0, r.stderr
    return yaml.safe_load(r.stdout)


@pytest.mark.parametrize("profiles,files", [("", (COMPOSE,)), ("http,metrics", (COMPOSE,)),
                                            ("http", (COMPOSE, COMPOSE_GPU))], ids=["cpu", "cpu+http+metrics", "gpu"])
def test_compose_file_is_valid(docker_compose, profiles, files):
    cfg = compose_config(docker_compose, profiles, files)
    services = cfg["services"]
    executors = {n: s for n, s in services.items() if s.get("command", [None])[0] == "executor"}
    assert set(executors) == {"executor-1", "executor-2"}
    gpu = COMPOSE_GPU in files
    for name, svc in executors.items():
        assert ALIAS in svc["networks"]["default"]["aliases"], name
        assert _flag(svc["command"], "--device") == ("cuda" if gpu else "cpu"), name
        if gpu:  # one GPU each, from the CUDA build
            devices = svc["deploy"]["resources"]["reservations"]["devices"]
            assert devices[0]["capabilities"] == ["gpu"] and devices[0]["driver"] == "nvidia"
            assert svc["image"] == "pagedkv:cuda" and svc["build"]["args"]["EXTRAS"] == "cuda"
        else:
            assert "deploy" not in svc and svc["image"] == "pagedkv:latest", name
    if gpu:
        assert {tuple(s["deploy"]["resources"]["reservations"]["devices"][0]["device_ids"])
                for s in executors.values()} == {("0",), ("1",)}
    _check_stop_order(services)
    for name, svc in services.items():  # (the fleet profile's: tests/e2e/test_compose_fleet.py)
        if svc.get("image", "").startswith("pagedkv:") and name != "certs" and "fleet" not in svc.get("profiles", []):
            assert "pagedkv" in svc["healthcheck"]["test"] and "health" in svc["healthcheck"]["test"], name
            assert _flag(svc["healthcheck"]["test"], "--tls-ca") == f"{CERTS}/ca.pem", name
            assert any(":/models" in str(v) or "'/models'" in str(v) for v in svc["volumes"]), name
            assert f"certs:{CERTS}:ro" in svc["volumes"], name  # read-only: only the init service writes
            assert svc["depends_on"]["certs"]["condition"] == "service_completed_successfully", name
    scheduler = services["scheduler"]["command"]
    assert scheduler[scheduler.index("--executor") + 1] == f"{ALIAS}:50061"
    _check_links(services)


def _seconds(duration: str) -> float:
    """A compose duration ("75s", "1m30s") in seconds."""
    parts = re.fullmatch(r"(?:(\d+)m)?(?:(\d+)s)?", str(duration))
    assert parts and duration, duration
    return int(parts.group(1) or 0) * 60 + int(parts.group(2) or 0)


def _check_stop_order(services: dict) -> None:
    """`stop`/`down` let in-flight streams finish: compose stops a service before those it depends on, so the
    gateway stops first, then the scheduler (it drains while every executor still runs), then the executors; every
    grace period covers the drain or shutdown timeout its service really runs with (parsed by pagedkv's own parser,
    defaults included), so docker never SIGKILLs a drain; an executor waits for the scheduler's drain to end."""
    from pagedkv.cli import build_parser

    parser = build_parser()
    executors = {n: s for n, s in services.items() if s.get("command", [None])[0] == "executor"}
    assert set(executors) <= set(services["scheduler"]["depends_on"]), services["scheduler"]["depends_on"]
    parsed = {n: parser.parse_args([str(c) for c in s["command"]]) for n, s in services.items()
              if s.get("command", [None])[0] in ("scheduler", "executor", "gateway")}
    scheduler = parsed["scheduler"]
    assert _seconds(services["scheduler"]["stop_grace_period"]) >= scheduler.shutdown_timeout + 10
    for name in executors:
        assert parsed[name].drain_timeout > scheduler.drain_timeout, name  # the scheduler moves requests first
        assert _seconds(services[name]["stop_grace_period"]) >= parsed[name].drain_timeout + 10, name
    if "gateway" in services:
        assert "scheduler" in services["gateway"]["depends_on"]
        assert _seconds(services["gateway"]["stop_grace_period"]) >= parsed["gateway"].shutdown_timeout + 10


def _check_links(services: dict) -> None:
    """TLS on every port, the executor secret on both ends, certificates from the init service, and the
    scheduler published on loopback only."""
    certs = services["certs"]
    assert certs["command"][0] == "gen-certs" and "--executor-secret" in certs["command"]
    assert _flag(certs["command"], "--out") == CERTS and certs["restart"] == "no"
    assert {"scheduler", ALIAS} <= set(_flag(certs["command"], "--hosts").split(","))
    for name, svc in services.items():
        command = svc.get("command", [None])
        if command[0] not in ("scheduler", "executor"):
            continue
        assert _flag(command, "--tls-cert") == f"{CERTS}/server.pem", name
        assert _flag(command, "--tls-key") == f"{CERTS}/server.key", name
        assert _flag(command, "--executor-secret-file") == f"{CERTS}/executor.secret", name
        assert "--insecure" not in command, name
    scheduler = services["scheduler"]
    assert _flag(scheduler["command"], "--executor-tls-ca") == f"{CERTS}/ca.pem"
    assert _flag(scheduler["command"], "--executor-tls-server-name") == ALIAS
    ports = scheduler["ports"]
    assert len(ports) == 1
    port = ports[0] if isinstance(ports[0], dict) else dict(zip(("host_ip", "published", "target"),
                                                                 ports[0].split(":")))  # compose v1: short form
    assert port["host_ip"] == "127.0.0.1" and str(port["published"]) == "50051"


def test_every_published_port_is_loopback_and_prometheus_scrapes_each_service():
    """Read as written (no docker-compose needed): each service publishes on PAGEDKV_PUBLISH_HOST, loopback by
    default; Prometheus scrapes the scheduler, the executors and the gateway, the gateway over verified HTTPS."""
    services = yaml.safe_load(COMPOSE.read_text())["services"]
    published = {n: s["ports"] for n, s in services.items() if s.get("ports")}
    assert {"scheduler", "gateway", "prometheus"} <= set(published)
    for name, ports in published.items():
        for port in ports:
            assert str(port).startswith("${PAGEDKV_PUBLISH_HOST:-127.0.0.1}:"), (name, port)
    scrape = {j["job_name"]: j for j in yaml.safe_load((procs.ROOT / "deploy/prometheus.yml").read_text())[
        "scrape_configs"]}
    assert set(scrape) == {"pagedkv-scheduler", "pagedkv-executor", "pagedkv-gateway"}
    gateway = scrape["pagedkv-gateway"]
    assert gateway["scheme"] == "https" and gateway["tls_config"]["ca_file"] == f"{CERTS}/ca.pem"
    assert not gateway["tls_config"].get("insecure_skip_verify")
    assert gateway["dns_sd_configs"][0]["port"] == int(_flag(services["gateway"]["command"], "--port"))
    assert f"certs:{CERTS}:ro" in services["prometheus"]["volumes"]


def _services(profile: str = "") -> dict[str, dict]:
    """docker-compose.yml's pagedkv services active with no profile or ``profile`` (merge keys resolved by
    PyYAML)."""
    cfg = yaml.safe_load(COMPOSE.read_text())
    return {n: s for n, s in cfg["services"].items()
            if s.get("image") == "pagedkv:latest" and (not s.get("profiles") or profile in s["profiles"])}


def _expand(value: str) -> str:
    return re.sub(r"\$\{(\w+):-([^}]*)\}", lambda m: os.environ.get(m.group(1), m.group(2)), value)


def _local(command: list[str], ports: dict[str, int], aliases: dict[str, list[str]], certs: Path) -> list[str]:
    """A service's command for loopback: 0.0.0.0 -> 127.0.0.1, each port a free one, an alias -> the
    addresses of the services behind it (one --executor each), /certs -> a local directory."""
    out: list[str] = []
    it = iter(_expand(str(c)).replace(CERTS, str(certs)) for c in command)
    for arg in it:
        if arg in ("--port", "--metrics-port"):
            out += [arg, str(ports[arg])]
            next(it)
        elif arg == "--host":
            out += [arg, "127.0.0.1"]
            next(it)
        elif arg == "--executor":
            host, _, _port = next(it).rpartition(":")
            for address in aliases[host]:
                out += ["--executor", address]
        else:
            out.append(arg)
    return out


def test_compose_services_run_locally_and_serve(model_cache, tiny_llama_dir, tmp_path, monkeypatch):
    monkeypatch.setenv("PAGEDKV_MODEL", "tiny-llama")  # (the stack's default is smollm2-135m-instruct)
    services = _services()
    init = services.pop("certs")
    executors = [n for n, s in services.items() if s["command"][0] == "executor"]
    assert set(services) == {"scheduler", *executors} and len(executors) == 2
    certs = tmp_path / "certs"
    r = subprocess.run([sys.executable, "-m", "pagedkv", *_local(init["command"], {}, {}, certs)], cwd=procs.ROOT,
                       capture_output=True, text=True, timeout=120)
    assert r.returncode == 0, r.stderr
    assert ", ," not in r.stdout and "server certificate for scheduler, executors, localhost" in r.stdout, r.stdout
    ca = str(certs / "ca.pem")
    ports = {n: {"--port": free_port(), "--metrics-port": free_port()} for n in services}
    aliases = {ALIAS: [f"127.0.0.1:{ports[n]['--port']}" for n in executors]}
    env = {k: str(v).replace("/models", str(model_cache)) for k, v in services["scheduler"]["environment"].items()}
    env[security.EXECUTOR_SECRET_ENV] = ""  # the secret comes from the certs volume, as in the containers
    started: list[procs.Proc] = []
    try:
        for name in [*executors, "scheduler"]:
            cmd = _local(services[name]["command"], ports[name], aliases, certs)
            role, args = cmd[0], cmd[1:]
            started.append(procs.Proc(role, *[a for a in args if a != "--log-format"], port=ports[name]["--port"],
                                      env=env, wait=False))
        for p in started:
            p.wait_ready(180)
        for name in services:  # the compose health checks, as docker would run them
            test = [_expand(t).replace(CERTS, str(certs)) for t in services[name]["healthcheck"]["test"][1:]]
            test[test.index("--address") + 1] = f"127.0.0.1:{ports[name]['--port']}"
            r = subprocess.run([sys.executable, "-m", *test], capture_output=True, text=True, timeout=60)
            assert r.returncode == 0 and "SERVING" in r.stdout, (name, r.stdout, r.stderr)
        address = f"127.0.0.1:{ports['scheduler']['--port']}"

        async def generate():
            async with Client(address, tls_ca=ca) as client:
                outs = await asyncio.gather(*(client.complete(f"hello {i}", max_tokens=8, ignore_eos=True)
                                              for i in range(4)))
                ids = await client.tokenize("héllo", add_special_tokens=True)
                one = await client.complete("héllo wörld", max_tokens=24, ignore_eos=True, temperature=0)
                return outs, ids, one, await client.model_info()
        outs, ids, one, info = asyncio.run(generate())
        assert all(len(o.token_ids) == 8 for o in outs)
        assert sorted(e.state for e in info.executors) == ["up", "up"] and info.model == "tiny-llama"
        from transformers import AutoTokenizer

        tok = AutoTokenizer.from_pretrained(str(tiny_llama_dir))
        assert ids == tok("héllo")["input_ids"]
        assert one.text == tok.decode(one.token_ids, skip_special_tokens=True)
        assert one.prompt_tokens == len(tok("héllo wörld")["input_ids"])
        # reflection on every server
        assert "pagedkv.api.v1.Generation" in reflected_services(address, ca)
        assert "grpc.health.v1.Health" in reflected_services(address, ca)
        assert "pagedkv.executor.v1.Executor" in reflected_services(f"127.0.0.1:{ports[executors[0]]['--port']}", ca)
        # the CLI client: greedy, so the same text as above, then a newline; bad input named
        r = subprocess.run([sys.executable, "-m", "pagedkv", "generate", "héllo wörld", "--address", address,
                            "--max-tokens", "24", "--ignore-eos", "--temperature", "0", "--tls-ca", ca], cwd=procs.ROOT,
                           capture_output=True, timeout=120)
        stdout, stderr = r.stdout.decode("utf-8"), r.stderr.decode("utf-8")  # bytes: keep \r as it is
        assert r.returncode == 0, stderr
        assert stdout == one.text + "\n"
        assert "finish=length" in stderr and "completion_tokens=24" in stderr
        r = subprocess.run([sys.executable, "-m", "pagedkv", "generate", "x", "--address", address,
                            "--temperature", "-1", "--tls-ca", ca], cwd=procs.ROOT, capture_output=True, text=True,
                           timeout=120)
        assert r.returncode == 1 and "INVALID_ARGUMENT" in r.stderr and "sampling.temperature" in r.stderr
        scheduler = started[-1]
        assert scheduler.saw("scheduler_ready", tls=True, executor_tls=True, executor_secret=True)
        assert any(e.get("request_id") for e in scheduler.events)
        for p in started[:-1]:
            assert p.saw("executor_ready", tls=True, authenticated=True)
        metrics = urllib.request.urlopen(f"http://127.0.0.1:{ports['scheduler']['--metrics-port']}/metrics",
                                         timeout=10).read().decode()
        assert 'pagedkv_executors{state="up"} 2.0' in metrics
        assert Path(model_cache).exists()
    finally:
        codes = [p.stop(60) for p in reversed(started)]  # what `docker compose down` does: SIGTERM
    assert codes == [0] * len(started), "\n\n".join(p.log()[-3000:] for p in started)
