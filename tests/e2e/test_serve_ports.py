"""`pagedkv serve` with a port it cannot have (#48): it fails at once, naming the flag, the address and the process
that holds the port, and never says ready. Before, `serve --http-port P` with P taken printed "ready ... HTTP on
P" (the gateway's probe connected to the stranger) and then restarted the gateway for ever."""

from __future__ import annotations

import socket
import subprocess
import sys
import time

import pytest

from pagedkv.cli import free_port
from tests.conftest import ROOT

pytestmark = pytest.mark.e2e

HOLDER = "import socket, sys, time; s = socket.socket(); s.bind(('127.0.0.1', int(sys.argv[1]))); s.listen(); " \
         "print('listening', flush=True); time.sleep(120)"


@pytest.fixture
def held_port():
    """A port held (listening) by another process, whose command line names it a holder."""
    port = free_port()
    holder = subprocess.Popen([sys.executable, "-c", HOLDER, str(port), "port-holder"], stdout=subprocess.PIPE,
                              text=True)
    assert holder.stdout is not None and holder.stdout.readline().strip() == "listening"
    yield port, holder.pid
    holder.kill()
    holder.wait()


def _serve(*args: str) -> subprocess.CompletedProcess:
    return subprocess.run([sys.executable, "-m", "pagedkv", "serve", "--threads", "1", "--num-pages", "64", *args],
                          cwd=ROOT, capture_output=True, text=True, timeout=60)


@pytest.mark.parametrize("flag", ["--http-port", "--port", "--metrics-port"])
def test_a_port_in_use_fails_serve_at_once_naming_the_flag_and_the_holder(held_port, flag):
    port, holder = held_port
    ports = {"--port": free_port(), "--http-port": 0, "--metrics-port": 0, flag: port}
    args = [a for f, p in ports.items() if p for a in (f, str(p))]
    r = _serve(*args)
    out = r.stdout + r.stderr
    assert r.returncode == 1, out
    assert "pagedkv ready" not in out and "Traceback" not in out, out
    errors = [line for line in r.stderr.splitlines() if line.startswith("error: ")]
    assert len(errors) == 1, out
    assert errors[0].startswith(f"error: {flag} {port}: 127.0.0.1:{port} is already in use by pid {holder} "
                                f"({sys.executable} -c import socket"), errors
    assert "child_started" not in out, out  # nothing was started


def test_a_metrics_port_whose_next_port_is_in_use_names_the_executors_port(held_port):
    port, holder = held_port
    r = _serve("--port", str(free_port()), "--metrics-port", str(port - 1))
    assert r.returncode == 1, r.stderr
    assert f"--metrics-port (+1, the executor's) {port}: 127.0.0.1:{port} is already in use by pid {holder}" \
        in r.stderr, r.stderr


def test_ready_waits_for_the_childs_own_listener_not_a_strangers(held_port):
    """A child whose probe is fooled by a stranger on its port (the port was taken after serve's check) is not ready
    until it listens there itself: here never, so the start fails once its ready_timeout is spent."""
    from pagedkv.serve_probes import ListeningProbe
    from pagedkv.supervised_child import ChildSpec
    from pagedkv.supervisor import Supervisor

    port, _ = held_port
    log = RecordingLog()
    probe = ListeningProbe(f"127.0.0.1:{port}")
    assert probe()  # the stranger answers
    child = ChildSpec("gateway", [sys.executable, "-c", "import time; time.sleep(60)"], probe, ready_timeout=2,
                      stop_timeout=5, ports=(port,))
    said: list[str] = []
    started = time.monotonic()
    code = Supervisor([child], log, start_together=True).run(lambda: said.append("ready"))
    assert code == 1 and said == [], log.events
    assert time.monotonic() - started < 30
    assert any(e == "serve_start_failed" and "not ready after 2s" in f.get("error", "") for e, f in log.events)


class RecordingLog:
    def __init__(self) -> None:
        self.events: list[tuple[str, dict]] = []

    def __getattr__(self, level: str):
        return lambda event, **fields: self.events.append((event, fields))


def test_the_check_frees_the_port_it_tried():
    """The check binds and closes: the port stays free for the child (SO_REUSEADDR, as the servers bind)."""
    from pagedkv.port_check import check_port

    port = free_port()
    check_port("--port", "127.0.0.1", port)
    with socket.socket() as s:
        s.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
        s.bind(("127.0.0.1", port))
