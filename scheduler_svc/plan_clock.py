"""When to build the next plan with async scheduling: just in time, not as soon as the last one went out (#49).

With async scheduling the next plan waits on the wire when the executor ends a step, so the executor never idles
while the scheduler applies a result and plans. Built as soon as the plan before it went out, it also closes the
door early: a request that arrives while step K runs is planned into K+2, not K+1, and waits out K+1 whole
(bench/NOTES.md "Session 22, #49": 27% of SmolLM2's mean TTFT under Poisson arrivals). ``StepClock`` predicts
when the step in flight ends, from a linear model of this executor's own step times, and the engine builds the
next plan only ``lead`` seconds before that (``wait_to_plan``, from engine.py): arrivals until then join it.

Either way a wrong prediction costs no more than one of the two old modes: too long, and the step's result comes
first, so the next plan is built after it (a synchronous step: the executor idles while the result is applied and
the plan built, as with ``--no-async-scheduling``); too short, and the plan is built early, as before.

The model: step seconds (from when the executor could start it to when its result was read, so the wire's
latency is in it) against 1, the tokens it computes, its rows, and the attention pairs those tokens read (a
prefill chunk's n tokens over c cached: n * (c + n/2); a decode: its context), fitted by least squares with
exponential forgetting (recent steps count most: the machine's load changes). No prediction until it has seen
``MIN_SAMPLES`` steps.
"""

from __future__ import annotations

import time

import numpy as np

from scheduler_svc import metrics
from scheduler_svc.step import InFlight, Scheduled

MIN_SAMPLES = 8  # steps seen before predicting
FORGET = 0.97  # each older step counts this much less (a memory of ~30 steps)
RIDGE = 1e-6  # keeps the solve defined while a feature has not varied yet
SCALE = np.array([1.0, 1e-3, 1e-2, 1e-6])  # features to ~unit size: 1, tokens, rows, attention pairs
EMA = 0.1  # weight of the newest step in the error and overhead averages
MARGIN_ERRORS = 2.0  # the lead covers this many mean absolute errors of the prediction
MIN_LEAD = 5e-4  # seconds


def step_features(scheduled: list[Scheduled]) -> np.ndarray:
    """A step's cost features from its rows (after planning counted them: ``num_computed`` includes ``n``)."""
    tokens = pairs = 0.0
    for req, n, _samples in scheduled:
        tokens += n
        pairs += n * (req.num_computed - (n - 1) / 2)
    return np.array([1.0, tokens, len(scheduled), pairs]) * SCALE


class StepClock:
    """One executor's step times: predicts a step's seconds and says how long to hold the next plan."""

    def __init__(self) -> None:
        self._a = np.zeros((4, 4))
        self._b = np.zeros(4)
        self._coef: np.ndarray | None = None
        self.samples = 0
        self.error = 0.0  # mean absolute error of the prediction, seconds (EMA)
        self.overhead = 0.0  # planning a step and the wire's latency, seconds (EMA)

    def predict(self, features: np.ndarray) -> float | None:
        """Seconds the step with these features should take (None: not enough steps seen yet)."""
        if self._coef is None:
            return None
        return max(0.0, float(features @ self._coef))

    def unit_costs(self) -> tuple[float, float, float, float] | None:
        """Seconds a step costs, per step, per token, per row and per attention pair (None: not enough steps seen
        yet): what slo_budget.py sizes a step's prefill by."""
        if self._coef is None:
            return None
        per_step, per_token, per_row, per_pair = (self._coef * SCALE).tolist()
        return per_step, per_token, per_row, per_pair

    def observe(self, features: np.ndarray, seconds: float, overhead: float) -> None:
        """A step with these features took ``seconds`` (started to result read), ``overhead`` of which were the
        wire and the planning (what the lead must cover besides the prediction's error)."""
        predicted = self.predict(features)
        if predicted is not None:
            self.error += EMA * (abs(seconds - predicted) - self.error)
        self.overhead = overhead if not self.samples else self.overhead + EMA * (overhead - self.overhead)
        self._a = FORGET * self._a + np.outer(features, features)
        self._b = FORGET * self._b + features * seconds
        self.samples += 1
        if self.samples >= MIN_SAMPLES:
            self._coef = np.linalg.solve(self._a + RIDGE * np.eye(4), self._b)

    def observe_step(self, sent: InFlight, result, started: float, read_at: float) -> None:
        """A plan's result (a ``StepResult``) was read at ``read_at``; the executor could start it at ``started``."""
        if not result.error:  # (a rejected plan ran nothing)
            seconds = read_at - started
            self.observe(sent.features, seconds,
                         sent.plan_seconds + max(0.0, seconds - result.timings.total_ms / 1e3))

    @property
    def lead(self) -> float:
        """How long before the predicted end the next plan is built: planning, the wire, and the error."""
        return MIN_LEAD + self.overhead + MARGIN_ERRORS * self.error

    def hold(self, features: np.ndarray, started: float, now: float) -> float:
        """Seconds from ``now`` to build the next plan, for the step in flight that started at ``started``
        (0: now; also while there is no prediction)."""
        predicted = self.predict(features)
        if predicted is None:
            return 0.0
        return max(0.0, started + predicted - self.lead - now)


async def wait_to_plan(clock: StepClock, stream, client, last_read_at: float) -> bool:
    """With one plan in flight (a ``StepStream``), waits until just before it should end, so that requests arriving
    meanwhile join the next plan. True: its result came first (unread: the caller reads it, then plans)."""
    if stream.in_flight != 1 or stream.resending:
        return False
    oldest = stream.oldest
    wait = clock.hold(oldest.features, max(oldest.sent_at, last_read_at), time.perf_counter())
    if wait <= 0:
        return False
    metrics.PLAN_HOLD_SECONDS.observe(wait)
    if not await client.result_within(wait):
        return False
    metrics.PLANNED_AFTER_RESULT.inc()
    return True
