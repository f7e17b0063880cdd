"""How long ``pagedkv serve`` takes to start: to its ready line, and to a first successful Generate.

Starts ``pagedkv serve`` (tiny-llama by default) ``--runs`` times per checkout and times, from the moment the
process is spawned: the executor's and the scheduler's ``*_ready`` log lines, serve's ``pagedkv ready`` line, and
the end of a first 4-token Generate sent as soon as the ready line appears; and how much of the machine other
processes used meanwhile (a start that shared the CPUs is slower for reasons of its own). Each start is stopped
(SIGINT) before the next begins. With ``--checkout before=/path/to/older/checkout`` the checkouts take turns,
run by run (so that load from other processes falls on both alike); each runs with its own sources on PYTHONPATH
and this Python. Prints median/min/max per checkout and writes every start's figures as JSON under
bench/results/.

    python bench/startup.py --checkout before=/tmp/startup_before            # before vs this checkout
    python bench/startup.py --runs 5 -- --threads 1                           # flags after -- go to serve
"""

from __future__ import annotations

import argparse
import asyncio
import json
import os
import signal
import statistics
import subprocess
import sys
import threading
import time
from dataclasses import asdict, dataclass, field
from pathlib import Path

from common import RESULTS, ROOT, CpuWatch, format_table, write_report

from pagedkv.cli import free_port
from pagedkv.client import Client

READY_LINE = "pagedkv ready"
CHILD_EVENTS = ("executor_ready", "scheduler_ready")
PROMPT = "Hello"
STOP_TIMEOUT = 60.0  # seconds a stopped serve may take before it and its children are SIGKILLed


@dataclass(slots=True)
class Start:
    """One start of ``pagedkv serve``: seconds from spawn to each milestone (NaN when not reached)."""

    checkout: str
    run: int
    executor_ready_s: float = float("nan")
    scheduler_ready_s: float = float("nan")
    ready_s: float = float("nan")
    first_generate_s: float = float("nan")
    stop_s: float = float("nan")
    exit_code: int | None = None
    load_avg_1m: float = 0.0
    cpu: dict[str, float] = field(default_factory=dict)
    error: str = ""


class ServeProcess:
    """``pagedkv serve`` from one checkout, its merged output read line by line and timed."""

    def __init__(self, checkout: Path, port: int, serve_args: list[str]) -> None:
        env = {**os.environ, "PYTHONPATH": str(checkout)}  # its own sources, ahead of this venv's editable install
        cmd = [sys.executable, "-m", "pagedkv", "serve", "--port", str(port), "--log-format", "json", *serve_args]
        self.t0 = time.perf_counter()
        self.proc = subprocess.Popen(cmd, cwd=checkout, env=env, stdout=subprocess.PIPE, stderr=subprocess.STDOUT,
                                     text=True, start_new_session=True)
        self.seen: dict[str, float] = {}
        self.lines: list[str] = []
        self.ready = threading.Event()  # the ready line, or the end of the output
        threading.Thread(target=self._pump, daemon=True).start()

    def _pump(self) -> None:
        assert self.proc.stdout is not None
        for line in self.proc.stdout:
            now = time.perf_counter() - self.t0
            self.lines.append(line.rstrip())
            if READY_LINE in line:
                self.seen.setdefault("ready", now)
                self.ready.set()
            elif line.startswith("{"):
                try:
                    event = json.loads(line).get("event")
                except ValueError:
                    continue
                if event in CHILD_EVENTS:
                    self.seen.setdefault(event, now)
        self.ready.set()

    def stop(self) -> float:
        """SIGINT (a user's Ctrl-C); SIGKILL to serve's process group and its children's after STOP_TIMEOUT."""
        t = time.perf_counter()
        if self.proc.poll() is None:
            children = _children(self.proc.pid)
            self.proc.send_signal(signal.SIGINT)
            try:
                self.proc.wait(timeout=STOP_TIMEOUT)
            except subprocess.TimeoutExpired:
                for pid in [self.proc.pid, *children]:
                    try:
                        os.killpg(pid, signal.SIGKILL)
                    except OSError:
                        pass
                self.proc.wait()
        return time.perf_counter() - t


def _children(pid: int) -> list[int]:
    pids: list[int] = []
    for task in Path(f"/proc/{pid}/task").glob("*"):
        try:
            pids += [int(p) for p in (task / "children").read_text().split()]
        except OSError:
            pass
    return pids


async def _first_generate(address: str, timeout: float) -> None:
    async with Client(address) as client:
        out = await asyncio.wait_for(client.complete(PROMPT, max_tokens=4, ignore_eos=True), timeout)
    if len(out.token_ids) != 4:
        raise RuntimeError(f"first Generate returned {len(out.token_ids)} tokens, expected 4")


def one_start(label: str, checkout: Path, run: int, serve_args: list[str], timeout: float) -> Start:
    result = Start(label, run, load_avg_1m=os.getloadavg()[0])
    watch = CpuWatch()
    port = free_port()
    serve = ServeProcess(checkout, port, serve_args)
    try:
        if not serve.ready.wait(timeout) or "ready" not in serve.seen:
            raise RuntimeError(f"no ready line within {timeout:.0f}s (exit code {serve.proc.poll()})")
        asyncio.run(_first_generate(f"127.0.0.1:{port}", timeout))
        result.first_generate_s = time.perf_counter() - serve.t0
    except Exception as err:  # noqa: BLE001 - recorded with the run, the other runs go on
        result.error = f"{type(err).__name__}: {err}\n" + "\n".join(serve.lines[-20:])
    finally:
        result.cpu = watch.stop()
        result.stop_s = serve.stop()
        result.exit_code = serve.proc.returncode
    result.ready_s = serve.seen.get("ready", float("nan"))
    result.executor_ready_s = serve.seen.get("executor_ready", float("nan"))
    result.scheduler_ready_s = serve.seen.get("scheduler_ready", float("nan"))
    return result


def summary(starts: list[Start], name: str) -> tuple[float, float, float]:
    values = [getattr(s, name) for s in starts if not s.error]
    if not values:
        return float("nan"), float("nan"), float("nan")
    return statistics.median(values), min(values), max(values)


def report_rows(labels: list[str], starts: list[Start]) -> list[list[str]]:
    rows = []
    for label in labels:
        mine = [s for s in starts if s.checkout == label]
        ok = [s for s in mine if not s.error]
        row = [label, f"{len(ok)}/{len(mine)}"]
        for name in ("executor_ready_s", "scheduler_ready_s", "ready_s", "first_generate_s"):
            med, lo, hi = summary(mine, name)
            row.append(f"{med:.2f} ({lo:.2f}-{hi:.2f})")
        row.append(f"{statistics.fmean(s.load_avg_1m for s in mine):.1f}")
        row.append(f"{statistics.median(s.cpu.get('foreign_share', 0.0) for s in mine):.0%}")
        rows.append(row)
    return rows


def main() -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0],
                                formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--runs", type=int, default=5, help="starts per checkout")
    p.add_argument("--checkout", action="append", default=[], metavar="LABEL=PATH",
                   help="another checkout to time too (e.g. before=/tmp/startup_before); this one is 'after'")
    p.add_argument("--label", default="after", help="this checkout's label")
    p.add_argument("--timeout", type=float, default=180.0, help="seconds one start may take to be ready")
    p.add_argument("--out", default=str(RESULTS / "startup.json"))
    p.add_argument("serve_args", nargs="*", help="flags for pagedkv serve (after --)")
    args = p.parse_args()
    if args.runs < 1:
        p.error(f"--runs must be >= 1, got {args.runs}")
    checkouts: dict[str, Path] = {}
    for item in args.checkout:
        label, sep, path = item.partition("=")
        if not sep or not (Path(path) / "pagedkv" / "cli.py").is_file():
            p.error(f"--checkout {item!r}: expected LABEL=PATH to a pagedkv checkout")
        checkouts[label] = Path(path).resolve()
    checkouts[args.label] = ROOT
    labels = list(checkouts)
    from pagedkv.models import resolve_model

    resolve_model("tiny-llama")  # built once, outside the timed starts
    starts: list[Start] = []
    for run in range(args.runs):
        order = labels if run % 2 == 0 else labels[::-1]  # take turns: drift falls on every checkout alike
        for label in order:
            s = one_start(label, checkouts[label], run, args.serve_args, args.timeout)
            starts.append(s)
            status = f"error: {s.error.splitlines()[0]}" if s.error else (
                f"executor {s.executor_ready_s:.2f}s, scheduler {s.scheduler_ready_s:.2f}s, ready {s.ready_s:.2f}s, "
                f"first Generate {s.first_generate_s:.2f}s")
            print(f"  run {run} {label:>8}: {status} (load {s.load_avg_1m:.1f}, CPU used by others "
                  f"{s.cpu.get('foreign_share', 0.0):.0%}, exit {s.exit_code})", flush=True)
    header = ["checkout", "ok", "executor_ready s", "scheduler_ready s", "ready s", "first Generate s", "load 1m",
              "CPU used by others"]
    print(f"\npagedkv serve {' '.join(args.serve_args) or '(defaults: tiny-llama)'}: seconds from spawn, "
          f"median (min-max) of {args.runs} starts")
    print(format_table(header, report_rows(labels, starts)))
    report = {"bench": "startup", "runs": args.runs, "serve_args": args.serve_args, "nproc": os.cpu_count(),
              "checkouts": {k: str(v) for k, v in checkouts.items()},
              "summary": {label: {name: dict(zip(("median", "min", "max"),
                                                 summary([s for s in starts if s.checkout == label], name)))
                                  for name in ("executor_ready_s", "scheduler_ready_s", "ready_s",
                                               "first_generate_s")}
                          for label in labels},
              "starts": [asdict(s) for s in starts]}
    write_report(args.out, report)
    return 0 if all(not s.error for s in starts) else 1


if __name__ == "__main__":
    raise SystemExit(main())
