"""The tier machinery itself (tests/support/tiers.py, tests/README.md): the guard is on while a unit test runs
(a socket, a process, a gRPC channel are refused; a compiler is not), and the collection check names modules
without a tier or in the wrong folder."""

from __future__ import annotations

import shutil
import socket
import subprocess
from pathlib import Path

import grpc
import pytest

from tests.support import tiers
from tests.support.tiers import GUARD, TierViolation, check_tiers

pytestmark = pytest.mark.unit


def _refused(call) -> str:
    """What the guard refused when ``call`` ran, taken back so that this test itself does not fail for it."""
    with pytest.raises(TierViolation) as err:
        call()
    assert GUARD.violations, "refused but not recorded"
    GUARD.violations.clear()
    return str(err.value)


def test_a_unit_test_opens_no_socket():
    with socket.socket() as s:
        assert "bind" in _refused(lambda: s.bind(("127.0.0.1", 0)))
        assert "connect" in _refused(lambda: s.connect(("127.0.0.1", 9)))


def test_a_unit_test_starts_no_process():
    assert "started a process: true" in _refused(lambda: subprocess.run(["true"]))
    assert "os.system" in _refused(lambda: __import__("os").system("true"))


def test_a_unit_test_makes_no_grpc_channel_or_server():
    assert "insecure_channel" in _refused(lambda: grpc.insecure_channel("127.0.0.1:1"))
    assert "grpc.server" in _refused(lambda: grpc.server(None))


@pytest.mark.skipif(shutil.which("c++") is None, reason="no c++ here")
def test_a_compiler_may_run():
    assert subprocess.run(["c++", "--version"], capture_output=True).returncode == 0
    assert not GUARD.violations


def test_a_caught_violation_still_fails_the_test():
    item = type("Item", (), {"nodeid": "tests/unit/test_x.py::test_y"})()
    this = GUARD.active
    with pytest.raises(TierViolation, match="test_y opened a socket"):
        with GUARD.run(item):
            try:
                socket.socket().bind(("127.0.0.1", 0))
            except TierViolation:
                pass  # the code under test swallowed it
    assert GUARD.active is None
    GUARD.active = this  # (on again for the rest of this test)


class _Module:
    def __init__(self, rel: str, *marks: str) -> None:
        self.path = tiers.TESTS / rel
        self.own_markers = [getattr(pytest.mark, m).mark for m in marks]


class _Item:
    def __init__(self, module: _Module, *marks: str) -> None:
        self.module, self.name = module, "test_x"
        self.marks = {m.name for m in module.own_markers} | set(marks)

    def getparent(self, cls):
        return self.module

    def get_closest_marker(self, name):
        return getattr(pytest.mark, name).mark if name in self.marks else None


@pytest.mark.parametrize("rel,marks,item_marks,why", [
    ("unit/test_new.py", (), (), "no tier marker"),
    ("unit/test_new.py", ("unit", "e2e"), (), "two tier markers"),
    ("test_new.py", ("unit",), (), "not under a tier folder"),
    ("e2e/test_new.py", ("unit",), (), "sits in tests/e2e/"),
    ("adversarial/test_new.py", ("gpu",), (), "sits in tests/adversarial/"),
    ("e2e/test_new.py", ("e2e",), ("unit",), "test_x is marked unit"),
])
def test_the_collection_check_names_what_is_wrong(rel, marks, item_marks, why):
    with pytest.raises(pytest.UsageError, match=why) as err:
        check_tiers([_Item(_Module(rel, *marks), *item_marks)])
    assert f"tests/{rel}" in str(err.value)


def test_the_collection_check_passes_each_folder_its_tiers():
    ok = [("unit/test_a.py", "unit"), ("unit/scheduler/test_b.py", "unit"), ("e2e/test_c.py", "e2e"),
          ("gpu/test_d.py", "gpu"), ("adversarial/test_e.py", "unit"), ("adversarial/test_f.py", "e2e")]
    check_tiers([_Item(_Module(rel, tier), "slow") for rel, tier in ok])
    assert Path(tiers.TESTS / "conftest.py").exists()
