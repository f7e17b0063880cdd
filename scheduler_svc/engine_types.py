"""What an engine (engine.py: one executor's loop) and the cluster tell each other: its state, the callbacks it
reaches the cluster through, and its figures."""

from __future__ import annotations

import enum
from collections.abc import Awaitable, Callable
from dataclasses import dataclass
from typing import TYPE_CHECKING

if TYPE_CHECKING:
    from scheduler_svc.request import Request
    from scheduler_svc.scheduler import Scheduler

Engine = object  # (engine.Engine: not imported, engine.py imports this module)


class State(enum.Enum):
    CONNECTING = "connecting"
    UP = "up"
    DRAINING = "draining"
    DOWN = "down"


@dataclass(frozen=True, slots=True)
class EngineHooks:
    """What an engine tells the cluster, and asks of it."""

    make_scheduler: Callable[[object], Scheduler]  # a DescribeResponse -> a planner for that executor (in the ledger)
    check_compatible: Callable[[object], str]  # a DescribeResponse -> why it cannot join, or ''
    up: Callable[[Engine], None]  # the executor is up: requests may be placed here
    down: Callable[[Engine], None]  # it is down (drained, lost or failed) and holds no request: it serves no tenant
    relocate: Callable[[list[Request], Engine], None]  # requests taken from this executor: place elsewhere
    gauges: Callable[[bool], None]  # update the gauges (True: now, not throttled)
    owner_of: Callable[[str], str] = lambda adapter: ""  # the tenant that owns a LoRA adapter ('' : public)
    # loads the run-time LoRA adapters an executor lacks (client, its Describe) -> why it cannot, or ''
    sync_adapters: Callable[[object, object], Awaitable[str]] | None = None


@dataclass(slots=True)
class EngineInfo:
    """An engine's figures: the executor it is connected to (as its Describe said) and its counts."""

    executor_id: str = ""
    kv_dtype: str = ""  # its KV cache format
    kv_bytes_per_token: int = 0
    steps: int = 0  # results applied
    num_placed: int = 0  # requests placed here
    num_migrated_out: int = 0  # requests moved to other executors (failure or drain)
