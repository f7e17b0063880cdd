"""The command line: `pagedkv serve` and its children, start-up errors. (Services started one by one, reflection and
`pagedkv generate`: tests/test_compose.py, which runs the compose file's commands.)"""

from __future__ import annotations

import subprocess
import sys

import pytest

from pagedkv.cli import free_port
from tests.conftest import ROOT


def _spawn(*args: str) -> subprocess.Popen:
    return subprocess.Popen([sys.executable, "-m", "pagedkv", *args, "--log-format", "json"], cwd=ROOT,
                            stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True)


def reflected_services(address: str) -> list[str]:
    import grpc
    from grpc_reflection.v1alpha.proto_reflection_descriptor_database import ProtoReflectionDescriptorDatabase

    with grpc.insecure_channel(address) as channel:
        return list(ProtoReflectionDescriptorDatabase(channel).get_services())


def test_scheduler_without_executor_fails_clearly():
    r = subprocess.run([sys.executable, "-m", "pagedkv", "scheduler", "--executor", f"127.0.0.1:{free_port()}",
                        "--connect-timeout", "2"], cwd=ROOT, capture_output=True, text=True, timeout=120)
    assert r.returncode == 1 and "not reachable" in r.stderr


@pytest.mark.parametrize("flag", ["--step-timeout", "--connect-timeout"])
def test_scheduler_refuses_a_timeout_that_is_not_positive(flag):
    r = subprocess.run([sys.executable, "-m", "pagedkv", "scheduler", "--executor", f"127.0.0.1:{free_port()}", flag,
                        "0"], cwd=ROOT, capture_output=True, text=True, timeout=120)
    assert r.returncode != 0 and f"{flag} must be > 0, got 0.0" in r.stderr, r.stderr


def test_serve_ctrl_c_stops_both_children(start_server):
    server = start_server("--num-pages", "64")
    children = subprocess.run(["pgrep", "-P", str(server.proc.pid)], capture_output=True, text=True).stdout.split()
    assert len(children) == 2, children  # executor and scheduler
    assert server.stop() == 0
    for pid in children:
        assert subprocess.run(["kill", "-0", pid], capture_output=True).returncode != 0, f"child {pid} still runs"
