"""``pagedkv serve`` starts its executor and scheduler at once (issue 17, item 4).

First the supervisor's ``start_together`` with small stand-in children (a slow "executor", a "scheduler" that
may exit while it waits): every child starts at once, one that exits before the children ahead of it are ready
starts again once they are, one that exits after that fails the start, and a failing first child fails it at
once. Then a real ``pagedkv serve``: the scheduler starts before the executor is ready, the scheduler process
loads no torch (its imports and tokenizer: the tokenizers library alone), and the served model answers.
"""

from __future__ import annotations

import asyncio
import json
import os
import signal
import subprocess
import sys
import textwrap
import time
from pathlib import Path

import pytest

from pagedkv.cli import free_port
from pagedkv.client import Client
from tests.conftest import ROOT, wait_until

pytestmark = pytest.mark.e2e

# argv: name, notes file, crash: "never" | "first" (exit 3 at once on the first start only) | "always".
CHILD = textwrap.dedent("""
    import os, signal, sys, time
    name, notes, crash = sys.argv[1], sys.argv[2], sys.argv[3]
    def note(what):
        with open(notes, "a") as f:
            f.write(f"{time.monotonic():.4f} {name} {os.getpid()} {what}\\n")
    signal.signal(signal.SIGTERM, lambda *_: (note("exit"), sys.exit(0)))
    note("start")
    marker = notes + "." + name + ".crashed"
    if crash == "always" or (crash == "first" and not os.path.exists(marker)):
        open(marker, "w").close()
        time.sleep(0.2)
        note("crash")
        sys.exit(3)
    while True:
        time.sleep(0.01)
""")

# argv: a JSON config {"notes", "child", "children": [{name, crash, ready_after, ready_timeout, after_ready,
# after_exit}]}. A child is ready ``ready_after`` seconds after its latest start, and (so that the order of events is
# set by causes, not by clocks) only once the supervisor has seen the child named ``after_ready`` ready, and the
# child named ``after_exit`` exit during start-up.
RUNNER = textwrap.dedent("""
    import json, sys, time
    from pagedkv import logs
    from pagedkv.supervised_child import ChildSpec
    from pagedkv.supervisor import Supervisor
    cfg = json.loads(sys.argv[1])
    seen_ready, seen_exit = set(), set()
    def started_for(name):
        try:
            starts = [float(l.split()[0]) for l in open(cfg["notes"]) if l.split()[1:2] == [name] and "start" in l]
        except FileNotFoundError:
            return None
        return time.monotonic() - starts[-1] if starts else None
    def ready(c):
        for other in sup.children:
            if other.proc is None:  # (the supervisor saw it exit during start-up)
                seen_exit.add(other.name)
        up = started_for(c["name"])
        ok = (up is not None and up >= c.get("ready_after", 0) and c.get("after_ready", "") in seen_ready | {""}
              and c.get("after_exit", "") in seen_exit | {""})
        if ok:
            seen_ready.add(c["name"])
        return ok
    specs = [ChildSpec(c["name"], [sys.executable, cfg["child"], c["name"], cfg["notes"], c.get("crash", "never")],
                       ready=lambda c=c: ready(c), ready_timeout=c.get("ready_timeout", 20),
                       stop_timeout=10) for c in cfg["children"]]
    sup = Supervisor(specs, logs.configure("serve", json=True), start_together=True, backoff_start=0.1)
    sys.exit(sup.run(lambda: print("ready", flush=True)))
""")


class Together:
    """A Supervisor(start_together=True) in a process of its own, over stand-in children that note what they do."""

    def __init__(self, tmp_path: Path, children: list[dict]) -> None:
        (tmp_path / "child.py").write_text(CHILD)
        (tmp_path / "runner.py").write_text(RUNNER)
        self.notes, self.out, self.err = tmp_path / "notes", tmp_path / "out", tmp_path / "err"
        config = {"children": children, "notes": str(self.notes), "child": str(tmp_path / "child.py")}
        with open(self.out, "w") as out, open(self.err, "w") as err:
            self.proc = subprocess.Popen([sys.executable, str(tmp_path / "runner.py"), json.dumps(config)],
                                         cwd=ROOT, stdout=out, stderr=err)
        STARTED.append(self)

    def saw(self, name: str, what: str) -> list[float]:
        rows = [line.split() for line in self.notes.read_text().splitlines()] if self.notes.exists() else []
        return [float(t) for t, n, _, w in rows if n == name and w == what]

    def pids(self) -> set[int]:
        rows = [line.split() for line in self.notes.read_text().splitlines()] if self.notes.exists() else []
        return {int(pid) for _, _, pid, _ in rows}

    def ready(self) -> bool:
        return "ready" in self.out.read_text()

    def finish(self, timeout: float = 30) -> tuple[int, list[dict]]:
        code = self.proc.wait(timeout=timeout)
        return code, [json.loads(line) for line in self.err.read_text().splitlines() if line.startswith("{")]

    def kill_all(self) -> None:
        if self.proc.poll() is None:
            self.proc.kill()
            self.proc.wait()
        for pid in self.pids():
            try:
                os.kill(pid, signal.SIGKILL)
            except OSError:
                pass


STARTED: list[Together] = []


@pytest.fixture(autouse=True)
def _no_stray_children():
    yield
    while STARTED:
        STARTED.pop().kill_all()


def test_every_child_starts_at_once_and_serve_is_ready_when_all_are(tmp_path):
    # The executor is ready only once the scheduler is: a supervisor that started the scheduler after the executor
    # was ready would never start it, and the start would fail (with the executor's ready_timeout).
    run = Together(tmp_path, [{"name": "executor", "after_ready": "scheduler", "ready_timeout": 20},
                              {"name": "scheduler"}])
    assert wait_until(lambda: run.ready() or run.proc.poll() is not None, 30), run.err.read_text()
    assert run.ready(), "the scheduler waited for the executor to be ready"
    assert len(run.saw("executor", "start")) == len(run.saw("scheduler", "start")) == 1
    run.proc.send_signal(signal.SIGTERM)
    code, logs = run.finish()
    assert code == 0, logs
    ready = [e["child"] for e in logs if e["event"] == "child_ready"]
    assert ready == ["scheduler", "executor"], "the scheduler is ready first: it does not wait here"
    assert [e["child"] for e in logs if e["event"] == "child_stopped"] == ["scheduler", "executor"]


def test_a_child_that_exits_while_the_ones_ahead_start_starts_again_once_they_are_ready(tmp_path):
    run = Together(tmp_path, [{"name": "executor", "ready_after": 1.5, "after_exit": "scheduler"},
                              {"name": "scheduler", "crash": "first", "ready_after": 0.5}])
    assert wait_until(lambda: run.ready() or run.proc.poll() is not None, 60), run.err.read_text()
    (exec_start,) = run.saw("executor", "start")
    first, second = run.saw("scheduler", "start")
    assert run.saw("scheduler", "crash") and second >= exec_start + 1.5, "restarted before the executor was ready"
    run.proc.send_signal(signal.SIGTERM)
    code, logs = run.finish()
    assert code == 0, logs
    (exited,) = [e for e in logs if e["event"] == "child_exited"]
    assert exited["child"] == "scheduler" and exited["restart_when"] == "executor ready", exited
    assert not any(e["event"] == "serve_start_failed" for e in logs)


def test_a_ready_timeout_counts_from_when_the_children_ahead_are_ready(tmp_path):
    # the scheduler is ready right after the executor, 2 s after its start: past its 1.5 s, unless they count from
    # the executor's readiness (the margin left is the supervisor's poll, 0.1 s, against 1.5 s)
    run = Together(tmp_path, [{"name": "executor", "ready_after": 2.0},
                              {"name": "scheduler", "after_ready": "executor", "ready_timeout": 1.5}])
    assert wait_until(lambda: run.ready() or run.proc.poll() is not None, 60), run.err.read_text()
    run.proc.send_signal(signal.SIGTERM)
    code, logs = run.finish()
    assert code == 0 and not any(e["event"] == "serve_start_failed" for e in logs), logs


def test_a_child_that_exits_once_the_ones_ahead_are_ready_fails_the_start(tmp_path):
    run = Together(tmp_path, [{"name": "executor", "after_exit": "scheduler"},
                              {"name": "scheduler", "crash": "always", "ready_after": 0.5}])
    code, logs = run.finish()
    assert code == 1 and not run.ready()
    assert len(run.saw("scheduler", "start")) == 2, "one start before the executor was ready, one after"
    (failed,) = [e for e in logs if e["event"] == "serve_start_failed"]
    assert "scheduler exited with code 3 during start-up" in failed["error"]
    assert run.saw("executor", "exit"), "the executor is stopped"


def test_a_first_child_that_exits_fails_the_start_at_once(tmp_path):
    run = Together(tmp_path, [{"name": "executor", "crash": "always", "ready_after": 5}, {"name": "scheduler"}])
    t0 = time.monotonic()
    code, logs = run.finish()
    took = time.monotonic() - t0
    print(f"\nstart-up failed {took:.2f} s after it began (the executor would be ready after 5 s)")
    assert code == 1 and took < 10
    (failed,) = [e for e in logs if e["event"] == "serve_start_failed"]
    assert "executor exited with code 3 during start-up" in failed["error"]
    assert run.saw("scheduler", "exit"), "the scheduler, started alongside, is stopped"


# ---- a real pagedkv serve ----------------------------------------------------------------------
def _events(lines: list[str]) -> list[dict]:
    out = []
    for line in lines:
        if line.startswith("{"):
            try:
                out.append(json.loads(line))
            except ValueError:
                pass
    return out


def _maps(pid: int) -> str:
    return Path(f"/proc/{pid}/maps").read_text()


@pytest.mark.skipif(not sys.platform.startswith("linux"), reason="reads /proc")
def test_serve_starts_both_at_once_and_the_scheduler_loads_no_torch(tmp_path):
    port = free_port()
    log = tmp_path / "serve.log"
    with open(log, "w") as out:
        proc = subprocess.Popen([sys.executable, "-m", "pagedkv", "serve", "--port", str(port), "--log-format", "json",
                                 "--num-pages", "64", "--threads", "1"], cwd=ROOT, stdout=out,
                                stderr=subprocess.STDOUT, text=True, start_new_session=True)
    try:
        assert wait_until(lambda: "pagedkv ready" in log.read_text() or proc.poll() is not None, 180), log.read_text()
        assert proc.poll() is None, log.read_text()
        events = _events(log.read_text().splitlines())
        started = {e["child"]: e for e in events if e["event"] == "child_started"}
        order = [(e["event"], e.get("child")) for e in events if e["event"] in ("child_started", "child_ready")]
        assert order.index(("child_started", "scheduler")) < order.index(("child_ready", "executor")), order
        scheduler, executor = started["scheduler"]["pid"], started["executor"]["pid"]
        assert "libtorch" in _maps(executor), "the check must see torch where it is loaded"
        assert "libtorch" not in _maps(scheduler), "the scheduler loaded torch"
        assert not any(e["event"] == "tokenizer_transformers" for e in events), "tiny-llama needs no transformers"

        async def generate():
            async with Client(f"127.0.0.1:{port}") as client:
                return await client.complete("Hello", max_tokens=4, ignore_eos=True)

        out = asyncio.run(generate())
        assert len(out.token_ids) == 4 and out.text
    finally:
        if proc.poll() is None:
            proc.send_signal(signal.SIGINT)
        assert proc.wait(timeout=60) == 0, log.read_text()[-3000:]


def test_the_scheduler_command_imports_no_torch_or_transformers(tiny_llama_dir):
    """What ``pagedkv scheduler`` imports up to serving: the CLI, the service, the tokenizer, used once."""
    code = textwrap.dedent("""
        import sys
        from pagedkv.cli import build_parser
        build_parser().parse_args(["scheduler", "--executor", "127.0.0.1:1"])
        import scheduler_svc.server
        from scheduler_svc.detokenizer import IncrementalDetokenizer
        from scheduler_svc.tokenizer import load_tokenizer
        tok = load_tokenizer(sys.argv[1])
        prompt = tok("Hi", add_special_tokens=True)["input_ids"]
        detok = IncrementalDetokenizer(tok, prompt, [], False)
        for i in tok(" there", add_special_tokens=False)["input_ids"]:
            detok.add(i)
        detok.flush()
        assert prompt[0] == 1 and detok.take(final=True) == " there", detok.text
        print(" ".join(m for m in ("torch", "transformers") if m in sys.modules))
    """)
    r = subprocess.run([sys.executable, "-c", code, str(tiny_llama_dir)], cwd=ROOT, capture_output=True, text=True,
                       timeout=120)
    assert r.returncode == 0, r.stderr
    assert r.stdout.strip() == "", f"the scheduler imported {r.stdout.strip()}"
