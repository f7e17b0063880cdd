"""``pagedkv serve`` supervises its children (pagedkv/supervisor.py): the supervisor alone, with small stand-in
children (fast): SIGHUP forwarding, shutdown order and bounds, a second signal, restarts with backoff, death signal,
a failed start. Through a real ``pagedkv serve``: test_serve_supervision.py.
"""

from __future__ import annotations

import json
import os
import signal
import subprocess
import sys
import textwrap
import time
from pathlib import Path

import pytest

from tests.conftest import ROOT, wait_until
from tests.support.supervision import gone as _gone

pytestmark = pytest.mark.e2e

# ---- stand-in children -------------------------------------------------------------------------
# argv: name, notes file, drain seconds (on the first SIGTERM), crash-after seconds (<0: never).
FAKE_CHILD = textwrap.dedent("""
    import os, signal, sys, time
    name, notes, drain, crash_after = sys.argv[1], sys.argv[2], float(sys.argv[3]), float(sys.argv[4])
    def note(what):
        with open(notes, "a") as f:
            f.write(f"{time.monotonic():.4f} {name} {os.getpid()} {what}\\n")
    ends = None
    def on_term(*_):
        global ends
        if ends is not None:
            note("term-now")
            sys.exit(0)
        note("term")
        ends = time.monotonic() + drain
    signal.signal(signal.SIGTERM, on_term)
    signal.signal(signal.SIGHUP, lambda *_: note("hup"))
    note("start")
    started = time.monotonic()
    while ends is None or time.monotonic() < ends:
        if 0 <= crash_after <= time.monotonic() - started:
            note("crash")
            sys.exit(3)
        time.sleep(0.01)
    note("exit")
""")

# argv: a JSON config: {"children": [{name, drain, crash_after, stop_timeout}], "reload", backoff settings}.
RUNNER = textwrap.dedent("""
    import json, sys
    from pagedkv import logs
    from pagedkv.supervised_child import ChildSpec
    from pagedkv.supervisor import Supervisor
    cfg = json.loads(sys.argv[1])
    notes = cfg["notes"]
    def started(name):
        try:
            return any(line.split()[1:2] == [name] for line in open(notes))
        except FileNotFoundError:
            return False
    specs = [ChildSpec(c["name"], c.get("cmd") or [sys.executable, cfg["child"], c["name"], notes,
                                                   str(c.get("drain", 0)), str(c.get("crash_after", -1))],
                       ready=lambda n=c["name"]: started(n), ready_timeout=20, stop_timeout=c.get("stop_timeout", 20))
             for c in cfg["children"]]
    sup = Supervisor(specs, logs.configure("serve", json=True), reload=cfg.get("reload", ""),
                     **cfg.get("backoff", {}))
    sys.exit(sup.run(lambda: print("ready", flush=True)))
""")


class Runner:
    """A Supervisor in a process of its own, driving stand-in children that note what happens to them. Output
    goes to files (a surviving child holding a pipe open would hang the test instead of failing it)."""

    def __init__(self, tmp_path: Path, children: list[dict], wait_ready: bool = True, **cfg) -> None:
        (tmp_path / "child.py").write_text(FAKE_CHILD)
        (tmp_path / "runner.py").write_text(RUNNER)
        self.notes, self.out, self.err = tmp_path / "notes", tmp_path / "out", tmp_path / "err"
        config = {"children": children, "notes": str(self.notes), "child": str(tmp_path / "child.py"), **cfg}
        with open(self.out, "w") as out, open(self.err, "w") as err:
            self.proc = subprocess.Popen([sys.executable, str(tmp_path / "runner.py"), json.dumps(config)],
                                         cwd=ROOT, stdout=out, stderr=err)
        RUNNERS.append(self)
        if wait_ready:
            assert wait_until(lambda: "ready" in self.out.read_text() or self.proc.poll() is not None, 30)
            assert "ready" in self.out.read_text(), self.err.read_text()

    def events(self) -> list[tuple[float, str, int, str]]:
        if not self.notes.exists():
            return []
        rows = [line.split() for line in self.notes.read_text().splitlines()]
        return [(float(t), name, int(pid), what) for t, name, pid, what in rows]

    def saw(self, name: str, what: str) -> list[tuple[float, int]]:
        return [(t, pid) for t, n, pid, w in self.events() if n == name and w == what]

    def finish(self, timeout: float = 30) -> tuple[int, list[dict]]:
        code = self.proc.wait(timeout=timeout)
        return code, [json.loads(line) for line in self.err.read_text().splitlines() if line.startswith("{")]

    def kill_all(self) -> None:
        if self.proc.poll() is None:
            self.proc.kill()
            self.proc.wait()
        for pid in {pid for _, _, pid, _ in self.events()}:
            if not _gone(pid):
                os.kill(pid, signal.SIGKILL)


RUNNERS: list[Runner] = []


@pytest.fixture(autouse=True)
def _no_stray_children():
    yield
    while RUNNERS:
        RUNNERS.pop().kill_all()


def test_sighup_goes_to_the_scheduler_and_shutdown_drains_it_before_the_executor(tmp_path):
    run = Runner(tmp_path, [{"name": "executor"}, {"name": "scheduler", "drain": 1.5}], reload="scheduler")
    run.proc.send_signal(signal.SIGHUP)
    assert wait_until(lambda: run.saw("scheduler", "hup"), 60)
    time.sleep(0.3)
    assert run.proc.poll() is None, "a SIGHUP must not stop the supervisor"
    assert not run.saw("executor", "hup") and len(run.saw("scheduler", "start")) == 1
    for name in ("executor", "scheduler"):  # each leads a process group of its own: Ctrl-C reaches serve only
        pid = run.saw(name, "start")[0][1]
        assert os.getpgid(pid) == pid != os.getpgid(run.proc.pid)
    run.proc.send_signal(signal.SIGTERM)
    code, logs = run.finish()
    assert code == 0, logs
    (sched_term, _), = run.saw("scheduler", "term")
    (sched_exit, _), = run.saw("scheduler", "exit")
    (exec_term, _), = run.saw("executor", "term")
    assert sched_exit - sched_term >= 1.4, "the scheduler's drain was cut short"
    assert exec_term >= sched_exit, "the executor was stopped before the scheduler finished draining"
    assert run.saw("executor", "exit") and not any(e["event"] == "child_killed" for e in logs)
    assert [e["child"] for e in logs if e["event"] == "child_stopped"] == ["scheduler", "executor"]


def test_second_signal_stops_at_once(tmp_path):
    run = Runner(tmp_path, [{"name": "executor"}, {"name": "scheduler", "drain": 60, "stop_timeout": 90}],
                 reload="scheduler")
    run.proc.send_signal(signal.SIGINT)
    assert wait_until(lambda: run.saw("scheduler", "term"), 60)
    t0 = time.monotonic()
    run.proc.send_signal(signal.SIGINT)
    code, logs = run.finish(timeout=20)
    took = time.monotonic() - t0
    print(f"\nstopped {took:.2f} s after the second Ctrl-C (the drain would take 60 s)")
    assert took < 8, "a second Ctrl-C must stop within seconds, not after the drain"
    assert run.saw("scheduler", "term-now"), "the scheduler gets its own stop-now signal"
    assert code == 0 and run.saw("executor", "exit"), logs


def test_crashed_children_restart_with_backoff_and_others_keep_running(tmp_path):
    backoff = {"backoff_start": 0.2, "backoff_max": 0.8, "stable_after": 1.5}
    run = Runner(tmp_path, [{"name": "steady"}, {"name": "flaky", "crash_after": 0.05},
                            {"name": "slow", "crash_after": 1.6}], backoff=backoff)
    assert wait_until(lambda: len(run.saw("flaky", "start")) >= 6, 30)
    assert wait_until(lambda: len(run.saw("slow", "start")) >= 3, 30)
    run.proc.send_signal(signal.SIGTERM)
    code, logs = run.finish()
    assert code == 0, logs
    assert len(run.saw("steady", "start")) == 1 and run.saw("steady", "exit"), "a crash restarts only that child"

    def restarts(name: str) -> list[tuple[float, float]]:  # (the delay chosen, from the crash to the next start)
        exits = [e for e in logs if e["event"] == "child_exited" and e["child"] == name]
        # (an exit during start-up waits for the children ahead, not a backoff; one while serve stops is not
        # restarted: neither has a delay chosen)
        early = sum("restart_when" in e for e in exits)
        chosen = [e["restart_in_s"] for e in exits if "restart_in_s" in e]
        took = [s[0] - c[0] for c, s in zip(run.saw(name, "crash")[early:], run.saw(name, "start")[1 + early:])]
        return list(zip(chosen, took))

    flaky = restarts("flaky")  # up for a moment each time: the delay doubles to the cap
    assert [d for d, _ in flaky][:5] == [0.2, 0.4, 0.8, 0.8, 0.8], flaky
    slow = restarts("slow")  # up longer than stable_after each time: always back to the start
    assert len(slow) >= 2 and all(d == 0.2 for d, _ in slow), slow
    assert all(took >= delay for delay, took in flaky + slow), "restarted before its backoff"
    exits = [e for e in logs if e["event"] == "child_exited" and e["child"] == "flaky"]
    assert exits[0]["status"] == "exited with code 3"


def test_a_restarted_child_logs_child_ready_once_it_is_ready_again(tmp_path):
    """Before, a restart logged child_restarted and nothing after it: an operator could not tell a child that came
    back from one still starting (or crashing in a loop)."""
    backoff = {"backoff_start": 0.2, "backoff_max": 0.2, "stable_after": 60}
    run = Runner(tmp_path, [{"name": "steady"}, {"name": "flaky", "crash_after": 0.6}], backoff=backoff)
    assert wait_until(lambda: len(run.saw("flaky", "start")) >= 3, 30)
    run.proc.send_signal(signal.SIGTERM)
    code, logs = run.finish()
    assert code == 0, logs
    events = [(e["event"], e["pid"]) for e in logs if e.get("child") == "flaky" and "pid" in e]
    restarts = [pid for event, pid in events if event == "child_restarted"]
    assert len(restarts) >= 2
    for pid in restarts[:-1]:  # (the last one may be stopped before it is looked at)
        assert events.index(("child_ready", pid)) > events.index(("child_restarted", pid)), events
    ready = next(e for e in logs if e["event"] == "child_ready" and e["pid"] == restarts[0])
    assert ready["restarts"] == 1 and ready["seconds"] >= 0
    assert not any(e["event"] == "child_ready" and e["child"] == "steady" for e in logs)  # (never restarted)


def test_children_die_with_a_sigkilled_supervisor(tmp_path):
    run = Runner(tmp_path, [{"name": "executor"}, {"name": "scheduler"}])
    pids = [run.saw(name, "start")[0][1] for name in ("executor", "scheduler")]
    run.proc.kill()
    run.proc.wait()
    assert wait_until(lambda: all(_gone(p) for p in pids), 60), "children outlived their supervisor"
    assert run.saw("executor", "term") and run.saw("scheduler", "term"), "the death signal is SIGTERM"


def test_failed_start_exits_1_and_stops_the_started_children(tmp_path):
    failing = [sys.executable, "-c", "raise SystemExit(2)"]
    run = Runner(tmp_path, [{"name": "executor"}, {"name": "scheduler", "cmd": failing}], wait_ready=False)
    code, logs = run.finish()
    assert code == 1
    failed = [e for e in logs if e["event"] == "serve_start_failed"]
    assert failed and "scheduler exited with code 2 during start-up" in failed[0]["error"], logs
    assert run.saw("executor", "term") and run.saw("executor", "exit"), "the started executor is stopped"
