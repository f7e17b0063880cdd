"""The shape of the code, checked from the tree (#30): one owner per piece of state, no import cycle, small files.

- **Reach-ins** (scheduler_svc/): an attribute of an object whose class is defined in another module of
  scheduler_svc, read or written where the object is a parameter (or ``self.<attr>``) annotated with that class,
  when the attribute is the class's data (assigned on ``self`` in its methods) or underscored. Methods and
  properties are the class's interface; records (dataclasses, enums, NamedTuples, Protocols) are values whose
  fields are their interface. Besides those, any underscored attribute of an object that is not ``self`` or
  ``cls``.
- **Import cycles** inside scheduler_svc/, TYPE_CHECKING imports included.
- **The dependency order**: no module under pagedkv/gateway/ imports scheduler_svc or executor_svc, anywhere in
  the module (function-level and TYPE_CHECKING imports included): what the gateway shares with the scheduler
  lives in pagedkv/ (bounds.py, tenancy.py).
- **File size**: no Python file over 360 lines (#51: the packages, tests, bench/ and deploy/; generated protobuf
  stubs aside); a warning names those over 340, so that the next squeeze shows before the cap.
- **Class size**: no class in scheduler_svc/ with more than 30 methods.
- **The planner** (``Scheduler``): at most 25 methods, none of them a one-line forward (a body that only calls,
  or returns, a method or attribute of one of its own attributes, passing its parameters on unchanged).

The scans are tests/support/arch_scan.py's and arch_reach_ins.py's. ``python tests/unit/test_architecture.py
[ROOT]`` prints the counts for a checkout (the figures of #30's closing note).
"""

from __future__ import annotations

import sys
import tempfile
import warnings
from pathlib import Path

import pytest

if __package__ in (None, ""):  # run as a script: the checkout's root on the path, for tests.support
    sys.path.insert(0, str(Path(__file__).resolve().parents[2]))

from tests.support.arch_reach_ins import reach_ins  # noqa: E402
from tests.support.arch_scan import (  # noqa: E402
    MAX_LINES,
    ROOT,
    class_methods,
    forbidden_imports,
    import_cycles,
    long_files,
    planner_methods,
)

pytestmark = pytest.mark.unit

WARN_LINES = 340  # (#51: files past this are named in a warning, so the next squeeze shows before the cap)
MAX_PLANNER_METHODS = 25
MAX_CLASS_METHODS = 30
GATEWAY = "pagedkv/gateway"
SERVICES = ("scheduler_svc", "executor_svc")  # what the gateway may not import


# ---- the tests -------------------------------------------------------------------------------------
def test_no_reach_ins_in_the_scheduler_service():
    assert reach_ins() == []


def test_no_import_cycle_in_the_scheduler_service():
    assert import_cycles() == []


def test_the_gateway_imports_neither_service():
    assert forbidden_imports(ROOT, GATEWAY, SERVICES) == []


def test_no_file_over_the_cap():
    assert long_files() == []


def test_files_near_the_cap_are_named_in_a_warning():
    near = long_files(limit=WARN_LINES)
    assert set(long_files()) <= set(near)
    if near:
        warnings.warn(f"{len(near)} files over {WARN_LINES} lines (the cap is {MAX_LINES}): "
                      + ", ".join(f"{p} {n}" for n, p in near), stacklevel=1)


def test_no_class_in_the_scheduler_service_over_30_methods():
    assert [(n, name) for n, name in class_methods() if n > MAX_CLASS_METHODS] == []


def test_the_planner_is_small_and_forwards_nothing():
    methods, forwards = planner_methods()
    assert len(methods) <= MAX_PLANNER_METHODS, methods
    assert forwards == []


def test_the_scan_sees_reach_ins():
    """The scan itself: a function that takes another module's stateful class and reads its data is found."""
    with tempfile.TemporaryDirectory() as tmp:
        pkg = Path(tmp) / "scheduler_svc"
        pkg.mkdir()
        (pkg / "a.py").write_text("class A:\n    def __init__(self):\n        self.items = []\n")
        (pkg / "b.py").write_text("from scheduler_svc.a import A\n\ndef f(a: A):\n    return a.items, a.count()\n")
        (pkg / "c.py").write_text("from __future__ import annotations\nfrom typing import TYPE_CHECKING\n"
                                  "if TYPE_CHECKING:\n    from scheduler_svc.b import f\n")
        (pkg / "a.py").write_text((pkg / "a.py").read_text() + "from scheduler_svc import c\n")
        (pkg / "b.py").write_text((pkg / "b.py").read_text() + "from scheduler_svc import c\n")
        assert reach_ins(Path(tmp)) == ["scheduler_svc.b:4: a.items (A of scheduler_svc.a)"]
        assert import_cycles(Path(tmp)) == [["scheduler_svc.a", "scheduler_svc.b", "scheduler_svc.c"]]


def test_the_scans_see_a_service_import_and_a_big_class():
    """The scans themselves: the gateway's imports of a service, wherever they are in a module, are found (and a
    pagedkv import is not); a class of 31 methods is named, one of 30 is not."""
    with tempfile.TemporaryDirectory() as tmp:
        gateway = Path(tmp) / GATEWAY
        (gateway / "sub").mkdir(parents=True)
        (gateway / "a.py").write_text("from pagedkv.bounds import MAX_TOOLS\n\ndef f():\n"
                                      "    from scheduler_svc.validation import Limits\n    return Limits\n")
        (gateway / "sub" / "b.py").write_text("from typing import TYPE_CHECKING\nif TYPE_CHECKING:\n"
                                              "    import executor_svc.runner\nimport importlib\n"
                                              "importlib.import_module('scheduler_svc.api')\n")
        assert forbidden_imports(Path(tmp), GATEWAY, SERVICES) == [
            "pagedkv/gateway/a.py:4: scheduler_svc.validation", "pagedkv/gateway/sub/b.py:3: executor_svc.runner",
            "pagedkv/gateway/sub/b.py:5: scheduler_svc.api"]
        pkg = Path(tmp) / "scheduler_svc"
        pkg.mkdir()
        methods = "".join(f"    def m{i}(self):\n        pass\n" for i in range(MAX_CLASS_METHODS))
        (pkg / "c.py").write_text(f"class Fits:\n{methods}\n\nclass Big:\n{methods}    async def more(self):\n"
                                  "        pass\n")
        counts = class_methods(Path(tmp))
        assert counts == [(MAX_CLASS_METHODS + 1, "scheduler_svc.c.Big"), (MAX_CLASS_METHODS, "scheduler_svc.c.Fits")]
        assert [name for n, name in counts if n > MAX_CLASS_METHODS] == ["scheduler_svc.c.Big"]


if __name__ == "__main__":
    paths = [a for a in sys.argv[1:] if not a.startswith("-")]
    root = Path(paths[0]).resolve() if paths else ROOT
    found = reach_ins(root)
    by_module: dict[str, int] = {}
    for f in found:
        by_module[f.split(":")[0]] = by_module.get(f.split(":")[0], 0) + 1
    print(f"reach-ins: {len(found)} {dict(sorted(by_module.items(), key=lambda kv: -kv[1]))}")
    cycles = import_cycles(root)
    print(f"import cycles: {len(cycles)} groups {cycles}")
    methods, forwards = planner_methods(root)
    print(f"Scheduler methods: {len(methods)}, one-line forwards: {len(forwards)} {forwards}")
    print(f"files over {MAX_LINES} lines:", ", ".join(f"{p} {n}" for n, p in long_files(root)))
    print(f"gateway imports of {'/'.join(SERVICES)}:", len(forbidden_imports(root, GATEWAY, SERVICES)))
    print(f"classes over {MAX_CLASS_METHODS} methods:",
          ", ".join(f"{c} {n}" for n, c in class_methods(root) if n > MAX_CLASS_METHODS))
    if "-v" in sys.argv:
        print("\n".join(found))
