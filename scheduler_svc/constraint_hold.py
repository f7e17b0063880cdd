"""Constrained requests placed on an executor that has not confirmed their grammar, held until it does.

Nothing compiles on an executor's step loop, so a constrained request reaches a planner only once its executor holds
the grammar (``GrammarGate.ready``). The API has every executor compile before a request is placed, so this is the
rare path: an executor that joined or restarted since (a request migrated to it, or resumed), or a confirmation
older than ``grammar_gate.TRUST_S``. Such a request is held here while that executor is asked; then it goes to the
planner, ends with the executor's refusal (INVALID_ARGUMENT), or, when the executor cannot be asked or is no longer
the same, is placed again (``EngineHooks.relocate``).
"""

from __future__ import annotations

import asyncio

from scheduler_svc.grammar_gate import GrammarGate
from scheduler_svc.outputs import Ending, deliver, final
from scheduler_svc.request import Finish, Request

CHECK_ATTEMPTS = 3  # an executor that cannot be asked is asked again after RETRY_S, then the request placed again
RETRY_S = 0.5


class ConstraintHold:
    def __init__(self, engine, gate: GrammarGate) -> None:
        self._engine = engine  # the Engine whose executor is asked (its address, executor id, hooks, add_request)
        self._gate = gate
        self._held: dict[int, tuple[Request, asyncio.Task]] = {}  # by id(request)

    def __len__(self) -> int:
        return len(self._held)

    def holds(self, req: Request, front: bool) -> bool:
        """Whether ``req`` must wait for its executor's grammar (then it is held, and asked for)."""
        c = req.sampling.constraint
        engine = self._engine
        if c is None or self._gate.ready(engine.address, engine.executor_id, c):
            return False
        self._held[id(req)] = (req, asyncio.ensure_future(self._check(req, front, engine.executor_id)))
        engine.log.info("request_held_for_grammar", request_id=req.client_id, internal_id=req.request_id,
                        held=len(self._held))
        return True

    async def _check(self, req: Request, front: bool, executor_id: str) -> None:
        engine = self._engine
        error = None
        try:
            for attempt in range(CHECK_ATTEMPTS):
                try:
                    error = await self._gate.check(req.tenant, engine.client, executor_id, req.sampling.constraint)
                    break
                except Exception:  # noqa: BLE001 -- it cannot be asked now (down, restarting): again, then elsewhere
                    if attempt + 1 == CHECK_ATTEMPTS or not engine.accepts or engine.executor_id != executor_id:
                        break
                    await asyncio.sleep(RETRY_S)
        finally:
            self._held.pop(id(req), None)
        if req.aborted:  # (its client went away meanwhile)
            return
        if error:
            deliver([(req, final(req, Finish.ABORT, error=error, error_code="INVALID_ARGUMENT",
                                 ending=Ending.UNPLACED))])
        elif error is None or not engine.accepts or engine.executor_id != executor_id:
            engine.hooks.relocate([req], engine)
        else:
            engine.add_request(req, front)

    def abort(self, group: str) -> None:
        for req, _ in self._held.values():
            if req.group == group:
                req.aborted = True

    def stop(self) -> None:
        for _, task in self._held.values():
            task.cancel()
        self._held.clear()
