"""Template workers for TemplatePool in one process (the unit tier starts no process): ``InlineWorker`` renders
as the worker process does (template_worker.reply), ``HeldWorker`` answers only when its test lets it."""

from __future__ import annotations

import asyncio

from scheduler_svc.template_pool import TemplateLimits, TemplatePool, WorkerGone
from scheduler_svc.template_worker import reply


class InlineWorker:
    """Renders in this process what a worker process would answer."""

    started: list[InlineWorker] = []  # every worker made, in order (reset by ``pool``)

    def __init__(self) -> None:
        self.stopped = False
        self.gone = asyncio.Event()  # set by stop: a process would be killed mid-job
        self.jobs = 0

    @classmethod
    async def start(cls, limits: TemplateLimits) -> InlineWorker:
        worker = cls()
        cls.started.append(worker)
        return worker

    async def answer(self, job: dict) -> dict:
        return reply(job)

    async def render(self, job: dict, max_reply_bytes: int) -> dict:
        if self.stopped:
            raise WorkerGone("stopped")
        self.jobs += 1
        return await self.answer(job)

    async def stop(self) -> None:
        self.stopped = True
        self.gone.set()


class HeldWorker(InlineWorker):
    """Answers a job whose template is ``HOLD`` only once ``release`` is set (a template that loops); others at
    once. ``rendering`` is set while it holds one."""

    HOLD = "{# hold #}"
    release: asyncio.Event
    rendering: asyncio.Event

    async def answer(self, job: dict) -> dict:
        if job["template"] == self.HOLD:
            HeldWorker.rendering.set()
            waits = {asyncio.ensure_future(HeldWorker.release.wait()), asyncio.ensure_future(self.gone.wait())}
            await asyncio.wait(waits, return_when=asyncio.FIRST_COMPLETED)
            for w in waits:
                w.cancel()
            if self.stopped:
                raise WorkerGone("exit code -9")
        return reply(job)


class OutOfMemoryWorker(InlineWorker):
    """Answers every job as a worker process whose render hit its RLIMIT_AS does."""

    async def answer(self, job: dict) -> dict:
        return {"error": "out of memory", "limit": "memory"}


def pool(worker: type[InlineWorker] = InlineWorker, **limits) -> TemplatePool:
    """A TemplatePool of ``worker``s (inside a running loop: HeldWorker's events are made there)."""
    worker.started = []
    if worker is HeldWorker:
        HeldWorker.release, HeldWorker.rendering = asyncio.Event(), asyncio.Event()
    return TemplatePool(TemplateLimits(**limits), start_worker=worker.start)
