"""Requests' own chat templates (--trust-request-chat-template), rendered off the scheduler: ``TemplatePool`` hands
each to a worker process (template_worker.py), with a time limit, a memory limit and an output bound, and at most
``per_tenant`` of one tenant's at once.

The model's templates render in process, on the tokenizer thread (prompts.py): they are the operator's and known. A
request's own template is code a client wrote; in process, one that loops for minutes or writes 10 MB held up every
tenant's prompts behind it (issue #46 F5). Here it runs in a worker:

- time: ``timeout_s`` (--chat-template-timeout) of wall-clock time from the job's hand-over; past it the worker is
  killed (a new one starts when next needed) and the request gets INVALID_ARGUMENT naming its chat_template field and
  the flag. The worker's RLIMIT_CPU ends it even if the scheduler does not;
- memory: RLIMIT_AS of ``memory_bytes`` (--chat-template-memory) in the worker;
- output: the rendered text at most --max-prompt-bytes (a rendered chat is a prompt), counted as it is produced;
- tenants: a tenant renders at most ``per_tenant`` templates at once (half the workers, at least one), so the others
  always find a worker; its further requests wait for its own renders to end (each ends within the time limit), as
  they would for a worker: they delay that tenant alone. (A refusal, RESOURCE_EXHAUSTED, would also turn away a
  tenant's burst of ordinary requests that each render in a millisecond.) NOTE: the tenant is what the caller of
  Prompts.ids / chat_ids passes; a caller that passes none counts every request as tenant "", one bound for all.

Workers start on first use, are reused while they answer, and are all killed by ``close`` (the scheduler's shutdown);
a scheduler that dies takes them with it (template_worker.py).
"""

from __future__ import annotations

import asyncio
import contextlib
import json
import os
import subprocess
import sys
from collections.abc import Awaitable, Callable
from dataclasses import dataclass
from pathlib import Path
from typing import Protocol

import structlog

from pagedkv.bounds import InvalidRequest
from scheduler_svc.template_worker import FRAME_HEADER, frame

ROOT = Path(__file__).resolve().parent.parent  # the directory holding scheduler_svc: the worker runs this code
WORKER_START_TIMEOUT = 60.0  # seconds a new worker may take to import jinja2 and say it is ready
ESCAPED_BYTES = 6  # a character's most bytes in the reply's JSON (a control character as \\u0000)
START_RETRY_PAUSES_S = (0.0, 0.25)  # before each retry of a worker start that failed
ENV_KEPT = ("PATH", "LANG", "LC_ALL", "LC_CTYPE", "PYTHONHOME", "PYTHONPATH", "PYTHONHASHSEED")  # no secrets


@dataclass(frozen=True, slots=True)
class TemplateLimits:
    timeout_s: float = 2.0  # --chat-template-timeout
    workers: int = 4  # --chat-template-workers
    memory_bytes: int = 1 << 30  # --chat-template-memory (MiB on the command line)

    def __post_init__(self) -> None:
        if not 0 < self.timeout_s <= 600:
            raise ValueError(f"--chat-template-timeout {self.timeout_s}: must be in (0, 600] seconds")
        if not 1 <= self.workers <= 256:
            raise ValueError(f"--chat-template-workers {self.workers}: must be in [1, 256]")
        if self.memory_bytes < 128 << 20:
            raise ValueError(f"--chat-template-memory {self.memory_bytes >> 20}: must be at least 128 (MiB)")

    @property
    def per_tenant(self) -> int:
        """Renders one tenant may have at once."""
        return max(1, self.workers // 2)


class WorkerGone(Exception):
    """The worker ended (killed by a limit, or crashed) before it answered."""


class TemplateWorker(Protocol):
    async def render(self, job: dict, max_reply_bytes: int) -> dict:
        """The worker's reply to ``job`` (template_worker.py's); WorkerGone if it ends first."""

    async def stop(self) -> None:
        """Kills the worker and waits for it."""


class PipedChild:
    """A child process and its stdin and stdout, driven by the event loop. It is started by ``subprocess.Popen`` on
    the loop's thread: CPython starts it with vfork and exec, so no copy of this multi-threaded process runs any
    library's fork handlers. (asyncio's subprocess under uvloop forks; under load in CI a worker forked so exited -11
    or -6 within milliseconds, before its Python ran.) The parent-death signal the worker asks for is tied to the
    thread that started it: the loop's, which lives as long as the scheduler."""

    def __init__(self, popen: subprocess.Popen, stdout: asyncio.StreamReader, stdin: asyncio.StreamWriter,
                 stdout_pipe: asyncio.ReadTransport) -> None:
        self.popen, self.stdout, self.stdin, self._stdout_pipe = popen, stdout, stdin, stdout_pipe

    @classmethod
    async def start(cls, args: list[str], env: dict[str, str], cwd: Path) -> PipedChild:
        loop = asyncio.get_running_loop()
        popen = subprocess.Popen(args, stdin=subprocess.PIPE, stdout=subprocess.PIPE, env=env, cwd=cwd)
        try:
            reader = asyncio.StreamReader()
            stdout_pipe, _ = await loop.connect_read_pipe(lambda: asyncio.StreamReaderProtocol(reader), popen.stdout)
            transport, protocol = await loop.connect_write_pipe(asyncio.streams.FlowControlMixin, popen.stdin)
        except BaseException:
            popen.kill()
            popen.wait()
            raise
        return cls(popen, reader, asyncio.StreamWriter(transport, protocol, None, loop), stdout_pipe)

    @property
    def returncode(self) -> int | None:
        return self.popen.poll()

    def kill(self) -> None:
        self.popen.kill()

    async def wait(self) -> int:
        """Its exit code, once it has ended; its pipes closed."""
        while self.popen.poll() is None:
            await asyncio.sleep(0.005)
        self.stdin.close()
        self._stdout_pipe.close()
        return self.popen.returncode


class ProcessWorker:
    """One template_worker.py process, driven over its stdin and stdout."""

    def __init__(self, proc: PipedChild) -> None:
        self.proc = proc

    @classmethod
    async def start(cls, limits: TemplateLimits) -> ProcessWorker:
        env = {k: v for k, v in os.environ.items() if k in ENV_KEPT}
        env["PYTHONPATH"] = os.pathsep.join(p for p in (str(ROOT), env.get("PYTHONPATH", "")) if p)
        env["PYTHONFAULTHANDLER"] = "1"  # a crash before main() also says where, on the scheduler's stderr
        proc = await PipedChild.start(
            [sys.executable, "-m", "scheduler_svc.template_worker", str(limits.memory_bytes), str(limits.timeout_s)],
            env, ROOT)
        worker = cls(proc)
        try:
            ready = await asyncio.wait_for(worker.receive(1 << 10), WORKER_START_TIMEOUT)
        except BaseException:
            await worker.stop()
            raise
        if ready != {"ready": True}:
            await worker.stop()
            raise RuntimeError(f"the chat template worker did not start: {ready}")
        return worker

    async def receive(self, max_bytes: int) -> dict:
        """The next message from the worker, at most ``max_bytes`` of JSON; WorkerGone if it ends first."""
        try:
            size = int.from_bytes(await self.proc.stdout.readexactly(FRAME_HEADER), "big")
            if size > max_bytes:  # (never from our worker: it bounds what it writes)
                raise WorkerGone(f"a reply of {size} bytes")
            return json.loads(await self.proc.stdout.readexactly(size))
        except asyncio.IncompleteReadError:
            raise WorkerGone(f"exit code {await self.proc.wait()}") from None

    async def render(self, job: dict, max_reply_bytes: int) -> dict:
        try:
            self.proc.stdin.write(frame(job))
            await self.proc.stdin.drain()
        except ConnectionError as err:
            raise WorkerGone(str(err)) from None
        return await self.receive(max_reply_bytes)

    async def stop(self) -> None:
        if self.proc.returncode is None:
            with contextlib.suppress(ProcessLookupError):
                self.proc.kill()
        await self.proc.wait()


class TemplatePool:
    """Worker processes for requests' own templates, started as needed, at most ``limits.workers``; at most
    ``limits.per_tenant`` renders of one tenant at once. ``start_worker`` makes a worker (tests pass their own)."""

    def __init__(self, limits: TemplateLimits = TemplateLimits(), log=None,
                 start_worker: Callable[[TemplateLimits], Awaitable[TemplateWorker]] | None = None) -> None:
        self.limits = limits
        self.log = log or structlog.get_logger()
        self._start_worker = start_worker or ProcessWorker.start
        self._free = asyncio.Semaphore(limits.workers)  # (made here: the loop's own on first use)
        self._idle: list[TemplateWorker] = []
        self._busy: set[TemplateWorker] = set()
        self._tenants: dict[str, tuple[asyncio.Semaphore, int]] = {}  # tenant -> (its slots, renders in or waiting)
        self.closed = False
        self.killed = 0  # workers killed at their time limit (or for their memory), since start

    @contextlib.asynccontextmanager
    async def _tenant_slot(self, tenant: str):
        slots, users = self._tenants.get(tenant, (asyncio.Semaphore(self.limits.per_tenant), 0))
        self._tenants[tenant] = (slots, users + 1)
        try:
            async with slots:
                yield
        finally:
            slots, users = self._tenants[tenant]
            if users == 1:
                del self._tenants[tenant]
            else:
                self._tenants[tenant] = (slots, users - 1)

    async def render(self, job: dict, tenant: str, field: str) -> str:
        """The text ``job``'s template renders (template_sandbox.render_job's job); InvalidRequest naming
        ``field``.chat_template and the limit when it passes one, or ``field`` when the template refuses."""
        async with self._tenant_slot(tenant), self._free:
            if self.closed:
                raise InvalidRequest(f"{field}.chat_template: the scheduler is shutting down")
            worker = self._idle.pop() if self._idle else await self._start()
            self._busy.add(worker)
            keep = False
            try:
                reply = await asyncio.wait_for(worker.render(job, job["max_bytes"] * ESCAPED_BYTES + (64 << 10)),
                                               self.limits.timeout_s)
                keep = not self.closed
                if reply.get("limit") == "memory":  # (the worker exits after saying so)
                    keep = False
                    self._killed(tenant, "memory")
            except asyncio.TimeoutError:
                self._killed(tenant, "time")
                raise InvalidRequest(f"{field}.chat_template: rendering took more than {self.limits.timeout_s:g} s; "
                                     f"at most {self.limits.timeout_s:g} s (--chat-template-timeout)") from None
            except WorkerGone as err:
                self._killed(tenant, "ended")
                raise InvalidRequest(f"{field}.chat_template: its render ended without an answer ({err}): over a "
                                     f"limit (time {self.limits.timeout_s:g} s, --chat-template-timeout; memory "
                                     f"{self.limits.memory_bytes >> 20} MiB, --chat-template-memory)") from None
            finally:
                self._busy.discard(worker)
                if keep:
                    self._idle.append(worker)
                else:  # (timed out, ended, out of memory, or the caller went away mid-render)
                    await worker.stop()
        return self._text(reply, job["max_bytes"], field)

    async def _start(self) -> TemplateWorker:
        """A new worker; a start that fails is tried twice more, the last after a pause (then RuntimeError: the
        server's fault, not the request's). NOTE: under load in CI a worker has exited -11 twice in a row within
        milliseconds of its spawn, before Python ran (not reproduced in hundreds of starts here)."""
        failures = (WorkerGone, RuntimeError, OSError, asyncio.TimeoutError)
        for pause in START_RETRY_PAUSES_S:
            try:
                return await self._start_worker(self.limits)
            except failures as err:
                self.log.warning("chat_template_worker_start_failed", error=str(err), hint="trying once more")
            await asyncio.sleep(pause)
        try:
            return await self._start_worker(self.limits)
        except failures as err:
            raise RuntimeError(f"the chat template worker did not start: {err}") from err

    def _killed(self, tenant: str, why: str) -> None:
        self.killed += 1
        self.log.info("chat_template_worker_killed", tenant=tenant, reason=why, timeout_s=self.limits.timeout_s)

    def _text(self, reply: dict, max_bytes: int, field: str) -> str:
        limit = reply.get("limit")
        if limit is None:
            return reply["text"]
        if limit == "output":
            raise InvalidRequest(f"{field}.chat_template: {reply['error']}; at most {max_bytes} bytes of text "
                                 "(--max-prompt-bytes: a rendered chat is a prompt)")
        if limit == "memory":
            raise InvalidRequest(f"{field}.chat_template: rendering needed more than "
                                 f"{self.limits.memory_bytes >> 20} MiB of memory; at most "
                                 f"{self.limits.memory_bytes >> 20} MiB (--chat-template-memory)")
        raise InvalidRequest(f"{field}: the chat template refused the messages: {reply['error']}")

    async def close(self) -> None:
        """Kills every worker, idle or rendering (a render in flight ends with an error); later renders are
        refused."""
        self.closed = True
        workers, self._idle = [*self._idle, *self._busy], []
        await asyncio.gather(*(w.stop() for w in workers), return_exceptions=True)

    @property
    def workers(self) -> int:
        """Worker processes alive now (idle or rendering)."""
        return len(self._idle) + len(self._busy)
