"""One step between the planner (scheduler.py) and the wire (step_stream.py), as plain data: what the planner
decided, and a plan on its way to the executor and back."""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any

from scheduler_svc.request import Request

Scheduled = tuple[Request, int, bool]  # (request, tokens it computes, whether the step samples its next token)


@dataclass(slots=True)
class PageOps:
    """A plan's page operations; the executor runs swap-outs, then zeroes, then swap-ins, then copies, then the
    forward."""

    swap_out: list[tuple[int, int]] = field(default_factory=list)  # (device, host)
    swap_in: list[tuple[int, int]] = field(default_factory=list)  # (host, device)
    copy: list[tuple[int, int]] = field(default_factory=list)  # (device, device), copy-on-write
    host_release: list[int] = field(default_factory=list)  # host references to drop once the plan ran
    zero: list[int] = field(default_factory=list)  # device pages a retention ended with (retention.py)

    def __bool__(self) -> bool:
        return bool(self.swap_out or self.swap_in or self.copy or self.host_release or self.zero)


@dataclass(slots=True)
class Step:
    """The planner's decision for one step. Its requests' in-flight counts already include it (the next step may be
    planned before its result is read)."""

    step_id: int
    scheduled: list[Scheduled]
    ops: PageOps
    forget: list[str]  # request ids the executor drops first
    resend: bool = False  # nothing planned: the page operations of a rejected plan go again, alone (the wire's)
    rides: bool = False  # a request admitted shares pages a plan not yet answered computes (rides.py)
    adapter_loads: list[tuple[str, int]] = field(default_factory=list)  # (adapter, slot) paged in before the forward


@dataclass(slots=True)
class InFlight:
    """One plan sent and not yet answered: its requests (tokens each, whether it samples), its page operations,
    whether it is a resend of page operations alone, and when it was planned and sent."""

    step_id: int
    scheduled: list[Scheduled]
    ops: PageOps
    resending: bool = False
    forget: list[str] = field(default_factory=list)  # the request ids it told the executor to drop
    rows: list[Request] = field(default_factory=list)  # its requests in plan order (StepResult.sampled_rows)
    plan_seconds: float = 0.0  # planning and encoding it
    sent_at: float = 0.0  # perf_counter when it went out (0: not on a stream)
    traced: list[Request] | tuple = ()  # requests it computes a prefill chunk for (ttft_trace.py)
    features: Any = None  # its cost features (plan_clock.step_features): when it should end
    rides: bool = False  # Step.rides: rejected, it voids its followers' shared pages (engine.py)
