"""Constraint compiles in worker processes that can be killed, taken fairly across tenants.

Each compile runs first in a ``grammar_worker`` child process under a CPU limit (the compile's own CPU, never the time
it waited for a worker) and a memory limit that the kernel enforces: a constraint that would compile for minutes or
take gigabytes ends its worker, which is replaced, and is refused. One that compiled within them is compiled again
in the executor (grammar.py: cheaper than moving the compiled grammar, see grammar_worker.py). Workers take compiles
from a queue per scope (the tenant's tag, ``Constraint.scope``) in turn, at most ``per_scope`` of one scope at a
time, so one tenant's slow compiles hold at most that many workers and the others' compiles go on.

``CompilePool(workers=0)`` compiles on threads of this process instead (no kill, the limit checked once the compile
returns): for tests of the tier that starts no process, and for an executor that cannot start one.
"""

from __future__ import annotations

import json
import os
import select
import signal
import subprocess
import sys
import threading
import time
from collections import OrderedDict, deque
from concurrent.futures import Future
from dataclasses import dataclass, field
from pathlib import Path

from executor_svc.grammar import CompileLimit, ConstraintError, Key, build_grammar
from executor_svc.grammar_worker import read_frame, write_frame

ROOT = Path(__file__).resolve().parent.parent
READY_TIMEOUT_S = 120.0  # a worker's start-up (imports, the vocabulary): generous, it is off every request's path
WALL_SLACK = 10.0  # a compile's wall-clock backstop: its CPU limit x this + 10 s (a worker niced, starved of CPU)
POLL_S = 0.02  # how often a compile's CPU is looked at
CLOCK_TICKS = os.sysconf("SC_CLK_TCK")


@dataclass(eq=False)
class CompileJob:
    key: Key
    # -> (the CompiledGrammar from a thread of this process; None from a worker process, which proves only that it
    # compiles within the limits: grammar_worker.py; and the CPU seconds its compile took)
    future: Future = field(default_factory=Future)


class FairQueue:
    """Compile jobs by scope, taken in turn: the scope after the last one served first, none past ``per_scope``
    running."""

    def __init__(self, per_scope: int) -> None:
        self.per_scope = max(1, per_scope)
        self._queues: OrderedDict[str, deque[CompileJob]] = OrderedDict()
        self._running: dict[str, int] = {}
        self._cond = threading.Condition()
        self.closed = False

    def put(self, job: CompileJob) -> None:
        with self._cond:
            self._queues.setdefault(job.key.scope, deque()).append(job)
            self._cond.notify()

    def take(self) -> CompileJob | None:
        """The next job (blocks); None once closed."""
        with self._cond:
            while not self.closed:
                for scope, jobs in self._queues.items():
                    if self._running.get(scope, 0) < self.per_scope:
                        job = jobs.popleft()
                        if jobs:
                            self._queues.move_to_end(scope)
                        else:
                            del self._queues[scope]
                        self._running[scope] = self._running.get(scope, 0) + 1
                        return job
                self._cond.wait()
            return None

    def done(self, job: CompileJob) -> None:
        with self._cond:
            left = self._running[job.key.scope] - 1
            if left:
                self._running[job.key.scope] = left
            else:
                del self._running[job.key.scope]
            self._cond.notify_all()

    def close(self) -> list[CompileJob]:
        """Stops taking; returns the jobs still queued."""
        with self._cond:
            self.closed = True
            left = [job for jobs in self._queues.values() for job in jobs]
            self._queues.clear()
            self._cond.notify_all()
            return left


def _cpu_seconds(pid: int) -> float:
    """A process's CPU so far (user + system), from /proc."""
    try:
        with open(f"/proc/{pid}/stat", encoding="ascii") as f:
            fields = f.read().rpartition(")")[2].split()
    except OSError:
        return 0.0
    return (int(fields[11]) + int(fields[12])) / CLOCK_TICKS


def _watch(proc: subprocess.Popen, limit: float) -> bool:
    """Waits for the worker's answer to the compile just sent; kills it once the compile has used more than ``limit``
    of CPU (or, starved of CPU, ``limit`` x WALL_SLACK + 10 s of wall time). Returns whether an answer came."""
    started, cpu0 = time.monotonic(), _cpu_seconds(proc.pid)
    while not select.select([proc.stdout], [], [], POLL_S)[0]:
        if _cpu_seconds(proc.pid) - cpu0 > limit or time.monotonic() - started > limit * WALL_SLACK + 10.0:
            proc.kill()
            return False
        if proc.poll() is not None:
            return False
    return True


class _Worker:
    """One worker process and the thread that feeds it."""

    def __init__(self, pool: CompilePool, index: int) -> None:
        self.pool = pool
        self.proc: subprocess.Popen | None = None
        self.thread = threading.Thread(target=self._loop, name=f"grammar-compile-{index}", daemon=True)
        self.thread.start()

    def _spawn(self) -> subprocess.Popen:
        env = {**os.environ, "PYTHONPATH": os.pathsep.join(filter(None, [str(ROOT), os.environ.get("PYTHONPATH")]))}
        proc = subprocess.Popen([sys.executable, "-m", "executor_svc.grammar_worker"], stdin=subprocess.PIPE,
                                stdout=subprocess.PIPE, env=env, cwd=ROOT)
        killer = threading.Timer(READY_TIMEOUT_S, proc.kill)
        killer.start()
        try:
            write_frame(proc.stdin, json.dumps({"tokenizer_info": self.pool.tokenizer_info,
                                                "memory_mb": self.pool.memory_mb}).encode())
            ready = read_frame(proc.stdout)
        except OSError:
            ready = None
        finally:
            killer.cancel()
        if ready is None:
            proc.kill()
            proc.wait()
            raise ConstraintError("sampling.constraint: this executor's grammar compile worker did not start "
                                  f"(exit code {proc.returncode}; see the executor's log)")
        self.pool.started += 1
        return proc

    def _loop(self) -> None:
        pool = self.pool
        pool.warm.wait()  # (no process until the first compile is asked for: most executors never compile)
        while True:
            if not pool.queue.closed and (self.proc is None or self.proc.poll() is not None):
                try:  # (a worker a limit ended is replaced before the next compile, not by it)
                    self.proc = self._spawn()
                except ConstraintError:
                    self.proc = None  # (tried again for the next compile)
            if (job := pool.queue.take()) is None:
                break
            try:
                job.future.set_result(self._compile(job.key))
            except ConstraintError as err:
                job.future.set_exception(err)
            except Exception as err:  # noqa: BLE001 -- a broken pipe, a worker that would not start
                job.future.set_exception(ConstraintError(f"sampling.constraint: the compile failed ({err})"))
            finally:
                pool.queue.done(job)
        self.stop()

    def _compile(self, key: Key) -> tuple[None, float]:
        if self.proc is None or self.proc.poll() is not None:
            self.proc = self._spawn()
        proc, limit = self.proc, self.pool.timeout_s
        answer = None
        try:
            write_frame(proc.stdin, json.dumps({"kind": key.kind, "text": key.text, "strict": key.strict,
                                                "timeout_s": limit}).encode())
            if _watch(proc, limit):
                header = read_frame(proc.stdout)
                answer = json.loads(header) if header is not None else None
        except OSError:
            pass
        if answer is None:  # the worker died: a limit, or a crash
            proc.kill()
            code = proc.wait()
            self.proc = None
            self.pool.killed += 1
            if code in (-signal.SIGXCPU, -signal.SIGKILL):
                raise CompileLimit(key, "cpu", limit, limit)
            raise CompileLimit(key, "memory", 0.0, self.pool.memory_mb)
        if answer["error"] == "memory":
            raise CompileLimit(key, "memory", answer["cpu_s"], self.pool.memory_mb)
        if answer["error"]:
            raise ConstraintError(answer["error"])
        if answer["cpu_s"] > limit:
            raise CompileLimit(key, "cpu", answer["cpu_s"], limit)
        return None, answer["cpu_s"]

    def stop(self) -> None:
        proc, self.proc = self.proc, None
        if proc is not None and proc.poll() is None:
            proc.kill()
            proc.wait()


class CompilePool:
    """``workers`` compile processes (0: threads of this process) for one vocabulary (``tokenizer_info``: xgrammar's
    serialized TokenizerInfo; ``compiler``: this process's GrammarCompiler, used with ``workers=0``), each compile
    within ``timeout_s`` of CPU and ``memory_mb`` more memory, ``per_scope`` at a time per scope."""

    def __init__(self, tokenizer_info: str, timeout_s: float, memory_mb: int, workers: int = 2, per_scope: int = 1,
                 compiler=None) -> None:
        self.tokenizer_info = tokenizer_info
        self.timeout_s = timeout_s
        self.memory_mb = memory_mb
        self.compiler = compiler
        self.queue = FairQueue(per_scope)
        self.warm = threading.Event()  # set at the first compile: the workers start then, all at once
        self.started = 0  # worker processes started
        self.killed = 0  # ended by a limit (or a crash) mid-compile
        if workers > 0:
            self._workers = [_Worker(self, i) for i in range(workers)]
        else:
            self._workers = []
            self._threads = [threading.Thread(target=self._in_process, name=f"grammar-compile-{i}", daemon=True)
                             for i in range(2)]
            for t in self._threads:
                t.start()

    def submit(self, key: Key) -> Future:
        self.warm.set()
        job = CompileJob(key)
        if self.queue.closed:
            job.future.set_exception(ConstraintError("sampling.constraint: this executor is shutting down"))
        else:
            self.queue.put(job)
        return job.future

    def _in_process(self) -> None:
        while (job := self.queue.take()) is not None:
            try:
                started = time.thread_time()
                compiled = self.compiler.compile_grammar(build_grammar(job.key.kind, job.key.text, job.key.strict))
                cpu = time.thread_time() - started
                if cpu > self.timeout_s:
                    raise CompileLimit(job.key, "cpu", cpu, self.timeout_s)
                job.future.set_result((compiled, cpu))
            except ConstraintError as err:
                job.future.set_exception(err)
            except Exception as err:  # noqa: BLE001 -- xgrammar's errors
                job.future.set_exception(ConstraintError(f"sampling.constraint: the compile failed ({err})"))
            finally:
                self.queue.done(job)

    def close(self) -> None:
        self.warm.set()
        for job in self.queue.close():
            job.future.set_exception(ConstraintError("sampling.constraint: this executor is shutting down"))
        for worker in self._workers:
            worker.stop()
