"""A bounded chaos run (issue 13, the adversarial suite): one scheduler, three executor processes, up to 3 x 40
greedy streams while executors are SIGKILLed (and restarted on the same port), SIGSTOPped (some past the step timeout,
so the scheduler gives up on them and they come back) and SIGCONTed, at random from a fixed seed, for at most
60 s and a bounded number of faults.

Every stream must give exactly the tokens of an undisturbed run of the same requests, or end with a documented
error (UNAVAILABLE "no executor …"); after quiescence no executor holds a page (ModelInfo). The figures
(streams, faults by kind, differences, errors, time) are printed for the suite's report.
"""

from __future__ import annotations

import asyncio
import random
import signal
import time

import grpc
import pytest

from pagedkv.client import Client, Completion, accumulate
from tests.support import procs

pytestmark = pytest.mark.e2e

SEED = 13
STREAMS = 40
MAX_TOKENS = 48
CHAOS_SECONDS = 60.0
MAX_FAULTS = 24
MIN_FAULTS = 4
ROUNDS = 3  # ~7 s each under faults; 3 took 8-9 faults, each kind at least once (the first three are one of each)
STEP_TIMEOUT = 4.0  # a SIGSTOP longer than this fails the executor over (its requests move, then it returns)
DOCUMENTED_ERRORS = ("no executor is up", "no executor that can hold this request")


PREFIX = [1] + random.Random(SEED).choices(range(3, 259), k=31)


def prompt_of(i: int) -> list[int]:
    """Mixed lengths; every third prompt starts with the same two pages (prefix-cache hits, shared pages)."""
    rng = random.Random(SEED * 1000 + i)
    start = PREFIX if i % 3 == 0 else [1]
    return start + [rng.randrange(3, 259) for _ in range(8 + (i * 11) % 60)]


REQUESTS = [(prompt_of(i), dict(max_tokens=MAX_TOKENS, ignore_eos=True, temperature=0)) for i in range(STREAMS)]


def enough(faults: dict[str, int]) -> bool:
    return all(faults.values()) and sum(faults.values()) >= MIN_FAULTS


class Chaos:
    def __init__(self, tmp_path) -> None:
        self.file = tmp_path / "executors.txt"
        self.stopped: set[int] = set()
        # the four processes start side by side (the scheduler waits for the first executor); wait_up, for all
        self.execs = []
        self.sched = None
        try:
            for _ in range(3):
                self.execs.append(procs.executor("--num-pages", "64", wait=False))
            self.file.write_text("".join(f"{e.address}\n" for e in self.execs))
            self.sched = procs.scheduler(args=("--executors-file", str(self.file), "--resolve-interval", "0.3",
                                               "--unplaced-timeout", "120", "--step-timeout", str(STEP_TIMEOUT),
                                               "--check-integrity"))
            self.address = self.sched.address
            for e in self.execs:
                e.wait_ready()  # one that died at start-up raises with its log
            self.wait_up(range(3))
        except BaseException:
            self.stop()
            raise

    def executors(self) -> dict:
        async def get():
            async with Client(self.address) as client:
                return await client.model_info()
        return {e.address: e for e in asyncio.run(get()).executors}

    def wait_up(self, which, timeout: float = 120.0) -> None:
        want = {self.execs[i].address for i in which}
        ok = procs.wait_for(lambda: all(self.executors().get(a) is not None and self.executors()[a].state == "up"
                                        for a in want), timeout, interval=0.2)
        assert ok, self.executors()

    def restart(self, i: int) -> None:
        """A new executor process on the same port (empty pools, another executor id)."""
        self.execs[i] = procs.executor("--num-pages", "64", port=self.execs[i].port, wait=False)

    def stop(self) -> None:
        for e in self.execs:
            e.signal(signal.SIGCONT)
        for p in (self.sched, *self.execs):
            if p is not None:
                p.kill()


@pytest.fixture(scope="module")
def chaos(tmp_path_factory, model_cache):
    c = Chaos(tmp_path_factory.mktemp("chaos"))
    yield c
    c.stop()


async def serve_all(address: str) -> tuple[list[Completion | None], list[tuple[grpc.StatusCode, str]]]:
    errors: list[tuple[grpc.StatusCode, str]] = []

    async def one(client: Client, prompt, params) -> Completion | None:
        out = Completion()
        try:
            async for msg in client.generate(prompt, **params):
                accumulate(out, msg)
        except grpc.aio.AioRpcError as err:
            errors.append((err.code(), err.details() or ""))
            return None
        return out

    async with Client(address) as client:
        return list(await asyncio.gather(*(one(client, p, kw) for p, kw in REQUESTS))), errors


async def inject_faults(c: Chaos, done: asyncio.Event, faults: dict[str, int]) -> None:
    """Random faults on random executors, never more than two of the three disturbed at once (so streams keep
    moving), until the streams are done, the time is up or MAX_FAULTS were injected."""
    rng = random.Random(SEED)
    deadline = time.monotonic() + CHAOS_SECONDS
    pending: list[tuple[float, str, int]] = []  # (when, action, executor) to undo a fault
    while not done.is_set() and time.monotonic() < deadline:
        await asyncio.sleep(rng.uniform(0.2, 0.8))
        now = time.monotonic()
        for item in [p for p in pending if p[0] <= now]:
            pending.remove(item)
            _, action, i = item
            if action == "cont":
                c.execs[i].signal(signal.SIGCONT)
                c.stopped.discard(i)
            else:
                c.restart(i)
        busy = {i for _, _, i in pending}
        calm = [i for i in range(3) if i not in busy]
        if sum(faults.values()) >= MAX_FAULTS or len(calm) <= 1:
            continue
        i = rng.choice(calm)
        kinds = ["kill", "stop_long", "stop_short"]
        injected = sum(faults.values())
        kind = kinds[injected] if injected < len(kinds) else rng.choice(kinds)  # each kind at least once
        if kind == "kill":
            c.execs[i].kill()
            pending.append((now + rng.uniform(0.5, 3.0), "restart", i))
        else:
            c.execs[i].signal(signal.SIGSTOP)
            c.stopped.add(i)
            pause = rng.uniform(0.3, 2.0) if kind == "stop_short" else rng.uniform(STEP_TIMEOUT + 1, STEP_TIMEOUT + 4)
            pending.append((now + pause, "cont", i))
        faults[kind] += 1
    for _, action, i in pending:  # undo what is left
        if action == "cont":
            c.execs[i].signal(signal.SIGCONT)
            c.stopped.discard(i)
        else:
            c.restart(i)


def test_streams_survive_random_executor_faults(chaos):
    t0 = time.monotonic()
    reference, ref_errors = asyncio.run(serve_all(chaos.address))
    assert not ref_errors and all(r is not None and len(r.token_ids) == MAX_TOKENS for r in reference)
    t_ref = time.monotonic() - t0

    faults = {"kill": 0, "stop_short": 0, "stop_long": 0}

    async def scenario():
        """The workload again and again (ROUNDS at most) while the faults land."""
        done = asyncio.Event()
        injector = asyncio.create_task(inject_faults(chaos, done, faults))
        rounds = []
        try:
            deadline = time.monotonic() + CHAOS_SECONDS
            # ROUNDS rounds, and more until every kind of fault landed at least once and MIN_FAULTS in all (on a
            # fast machine 3 rounds can end before that); the deadline only catches a hang
            while ((len(rounds) < ROUNDS or not enough(faults)) and time.monotonic() < deadline
                   and sum(faults.values()) < MAX_FAULTS):
                rounds.append(await serve_all(chaos.address))
        finally:
            done.set()
            await injector
        return rounds

    t1 = time.monotonic()
    rounds = asyncio.run(scenario())
    t_chaos = time.monotonic() - t1
    outs = [o for round_outs, _ in rounds for o in round_outs]
    errors = [e for _, round_errors in rounds for e in round_errors]
    reference = reference * len(rounds)
    completed = [(o, r) for o, r in zip(outs, reference) if o is not None]
    differ = [i for i, (o, r) in enumerate(zip(outs, reference)) if o is not None and o.token_ids != r.token_ids]
    undocumented = [(code, msg) for code, msg in errors
                    if code is not grpc.StatusCode.UNAVAILABLE or not msg.startswith(DOCUMENTED_ERRORS)]
    chaos.wait_up(range(3))
    quiet = procs.wait_for(lambda: all(e.num_used_pages == 0 for e in chaos.executors().values()), 30, 0.2)
    used = {a: e.num_used_pages for a, e in chaos.executors().items()}
    print(f"\nchaos: {len(outs)} streams ({len(rounds)} rounds), faults {faults} ({sum(faults.values())}), "
          f"{len(completed)} completed, "
          f"{len(differ)} differ, errors {errors}, pages used after {used}, reference {t_ref:.1f}s, "
          f"chaos {t_chaos:.1f}s")
    assert enough(faults), f"too few faults landed while streams ran: {faults}"
    assert not differ, f"streams {differ} differ from the undisturbed run"
    assert not undocumented, f"undocumented errors: {undocumented}"
    assert all(len(o.token_ids) == MAX_TOKENS and o.finish_reason for o, _ in completed)
    assert quiet, f"pages still used after quiescence: {used}"
    assert chaos.sched.proc.poll() is None, "the scheduler died"
