"""The command line: `pagedkv serve` and its children, start-up errors. (Services started one by one, reflection and
`pagedkv generate`: tests/test_compose.py, which runs the compose file's commands.)"""

from __future__ import annotations

import subprocess
import sys

import pytest

from pagedkv.cli import free_port
from tests.conftest import ROOT

pytestmark = pytest.mark.e2e


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


def test_a_model_cache_that_cannot_be_written_fails_the_start_with_one_line(tmp_path):
    """The executor builds tiny-llama into an empty cache while every file it writes is capped at 256 KiB (as a
    full disk cuts a write short: RLIMIT_FSIZE, with SIGXFSZ ignored, fails the write with EFBIG). Before, the
    start ended in a SafetensorError traceback; now one line names the directory and what to do, and nothing
    half-written is left in the cache."""
    import os
    import resource
    import signal

    cache = tmp_path / "cache"

    def small_files() -> None:
        signal.signal(signal.SIGXFSZ, signal.SIG_IGN)
        resource.setrlimit(resource.RLIMIT_FSIZE, (256 << 10, 256 << 10))

    r = subprocess.run([sys.executable, "-m", "pagedkv", "executor", "--model", "tiny-llama", "--insecure", "--port",
                        "0", "--threads", "1"], cwd=ROOT, capture_output=True, text=True, timeout=300,
                       env={**os.environ, "PAGEDKV_CACHE_DIR": str(cache)}, preexec_fn=small_files)
    assert r.returncode == 1, r.stderr
    assert "Traceback" not in r.stderr, r.stderr
    errors = [line for line in r.stderr.splitlines() if line.startswith("error: ")]
    assert len(errors) == 1, r.stderr
    assert errors[0].startswith(f"error: tiny-llama: cannot write the model to its cache {cache}: "), errors
    assert errors[0].endswith("free space there, or point $PAGEDKV_CACHE_DIR at a writable directory"), errors
    assert [p.name for p in cache.iterdir()] == []


def test_serve_ctrl_c_stops_both_children(start_server):
    server = start_server("--num-pages", "64")
    children = subprocess.run(["pgrep", "-P", str(server.proc.pid)], capture_output=True, text=True).stdout.split()
    assert len(children) == 2, children  # executor and scheduler
    assert server.stop() == 0
    for pid in children:
        assert subprocess.run(["kill", "-0", pid], capture_output=True).returncode != 0, f"child {pid} still runs"
