"""docker-compose.yml: validated by Debian's docker-compose, and its services' commands run as local
processes on loopback with the compose environment, so the wiring is exercised where no Docker engine runs."""

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

from pagedkv.cli import free_port
from pagedkv.client import Client
from tests import procs
from tests.test_cli import reflected_services

COMPOSE = procs.ROOT / "docker-compose.yml"
ALIAS = "executors"


@pytest.fixture(scope="module")
def docker_compose() -> str:
    """Debian's docker-compose, installed here when missing (CI runs as root on Debian)."""
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


def compose_config(binary: str, profiles: str) -> dict:
    r = subprocess.run([binary, "-f", str(COMPOSE), "config"], capture_output=True, text=True, cwd=procs.ROOT,
                       env={**os.environ, "COMPOSE_PROFILES": profiles}, timeout=120)
    assert r.returncode == 0, r.stderr
    return yaml.safe_load(r.stdout)


@pytest.mark.parametrize("profiles", ["cpu", "gpu", "cpu,metrics"])
def test_compose_file_is_valid(docker_compose, profiles):
    cfg = compose_config(docker_compose, profiles)
    services = cfg["services"]
    executors = {n: s for n, s in services.items() if s.get("command", [None])[0] == "executor"}
    assert len(executors) >= 2
    for name, svc in executors.items():
        assert ALIAS in svc["networks"]["default"]["aliases"], name
        if "gpu" in name:
            devices = svc["deploy"]["resources"]["reservations"]["devices"]
            assert devices[0]["capabilities"] == ["gpu"] and devices[0]["driver"] == "nvidia"
        else:
            assert "--device" in svc["command"] and "cpu" in svc["command"]
    for name, svc in services.items():
        if svc.get("image") == "pagedkv:latest":
            assert "pagedkv" in svc["healthcheck"]["test"] and "health" in svc["healthcheck"]["test"], name
            assert any(":/models" in str(v) or "'/models'" in str(v) for v in svc["volumes"]), name
    scheduler = services["scheduler"]["command"]
    assert scheduler[scheduler.index("--executor") + 1] == f"{ALIAS}:50061"


def _services(profile: str) -> dict[str, dict]:
    """docker-compose.yml's services active under one profile (merge keys resolved by PyYAML)."""
    cfg = yaml.safe_load(COMPOSE.read_text())
    return {n: s for n, s in cfg["services"].items()
            if s.get("image") == "pagedkv:latest" and (not s.get("profiles") or profile in s["profiles"])}


def _expand(value: str) -> str:
    return re.sub(r"\$\{(\w+):-([^}]*)\}", lambda m: os.environ.get(m.group(1), m.group(2)), value)


def _local(command: list[str], ports: dict[str, int], aliases: dict[str, list[str]]) -> list[str]:
    """A service's command for loopback: 0.0.0.0 -> 127.0.0.1, each port a free one, an alias -> the
    addresses of the services behind it (one --executor each)."""
    out: list[str] = []
    it = iter(_expand(str(c)) for c in command)
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


def test_compose_services_run_locally_and_serve(model_cache, tiny_llama_dir):
    services = _services("cpu")
    executors = [n for n, s in services.items() if s["command"][0] == "executor"]
    assert set(services) == {"scheduler", *executors} and len(executors) == 2
    ports = {n: {"--port": free_port(), "--metrics-port": free_port()} for n in services}
    aliases = {ALIAS: [f"127.0.0.1:{ports[n]['--port']}" for n in executors]}
    env = {k: str(v).replace("/models", str(model_cache)) for k, v in services["scheduler"]["environment"].items()}
    started: list[procs.Proc] = []
    try:
        for name in [*executors, "scheduler"]:
            cmd = _local(services[name]["command"], ports[name], aliases)
            role, args = cmd[0], cmd[1:]
            started.append(procs.Proc(role, *[a for a in args if a != "--log-format"], port=ports[name]["--port"],
                                      env=env, wait=False))
        for p in started:
            p.wait_ready(180)
        for name in services:  # the compose health checks, as docker would run them
            test = [_expand(t) for t in services[name]["healthcheck"]["test"][1:]]
            test[test.index("--address") + 1] = f"127.0.0.1:{ports[name]['--port']}"
            r = subprocess.run([sys.executable, "-m", *test], capture_output=True, text=True, timeout=60)
            assert r.returncode == 0 and "SERVING" in r.stdout, (name, r.stdout, r.stderr)
        address = f"127.0.0.1:{ports['scheduler']['--port']}"

        async def generate():
            async with Client(address) as client:
                outs = await asyncio.gather(*(client.complete(f"hello {i}", max_tokens=8, ignore_eos=True)
                                              for i in range(4)))
                ids = await client.tokenize("héllo", add_special_tokens=True)
                one = await client.complete("héllo wörld", max_tokens=24, ignore_eos=True)
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
        assert "pagedkv.api.v1.Generation" in reflected_services(address)
        assert "grpc.health.v1.Health" in reflected_services(address)
        assert "pagedkv.executor.v1.Executor" in reflected_services(f"127.0.0.1:{ports[executors[0]]['--port']}")
        # the CLI client: greedy, so the same text as above, then a newline; bad input named
        r = subprocess.run([sys.executable, "-m", "pagedkv", "generate", "héllo wörld", "--address", address,
                            "--max-tokens", "24", "--ignore-eos"], cwd=procs.ROOT, capture_output=True, timeout=120)
        stdout, stderr = r.stdout.decode("utf-8"), r.stderr.decode("utf-8")  # bytes: keep \r as it is
        assert r.returncode == 0, stderr
        assert stdout == one.text + "\n"
        assert "finish=length" in stderr and "completion_tokens=24" in stderr
        r = subprocess.run([sys.executable, "-m", "pagedkv", "generate", "x", "--address", address,
                            "--temperature", "-1"], cwd=procs.ROOT, capture_output=True, text=True, timeout=120)
        assert r.returncode == 1 and "INVALID_ARGUMENT" in r.stderr and "sampling.temperature" in r.stderr
        scheduler = started[-1]
        assert scheduler.saw("scheduler_ready") and any(e.get("request_id") for e in scheduler.events)
        metrics = urllib.request.urlopen(f"http://127.0.0.1:{ports['scheduler']['--metrics-port']}/metrics",
                                         timeout=10).read().decode()
        assert 'pagedkv_executors{state="up"} 2.0' in metrics
        assert Path(model_cache).exists()
    finally:
        codes = [p.stop(60) for p in reversed(started)]  # what `docker compose down` does: SIGTERM
    assert codes == [0] * len(started), "\n\n".join(p.log()[-3000:] for p in started)
