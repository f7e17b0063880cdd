"""Many executors behind one scheduler, through real processes on loopback: placement by prefix hit,
migration when an executor is killed (kill -9) or drains (SIGTERM), executors joining at run time, no
executor left, and two schedulers behind client-side round robin with a graceful scheduler shutdown.

One cluster (two executors and a scheduler reading an executors file) serves the tests in order, so the
processes start once; each test leaves it with two executors up."""

from __future__ import annotations

import asyncio
import random
import signal

import grpc
import pytest

from pagedkv.client import Client, Completion, accumulate
from tests.support import procs

pytestmark = pytest.mark.e2e

MAX_TOKENS = 40


def prompt_of(seed: int, n: int) -> list[int]:
    rng = random.Random(seed)
    return [1] + [rng.randrange(3, 259) for _ in range(n - 1)]


def workload(count: int, seed: int = 0) -> list[tuple[list[int], dict]]:
    """Greedy and seeded-sampling requests of mixed prompt lengths."""
    out = []
    for i in range(count):
        params = dict(max_tokens=MAX_TOKENS, ignore_eos=True, temperature=0.0)
        if i % 2:
            params.update(temperature=0.9, top_p=0.95, seed=1000 + i)
        out.append((prompt_of(seed * 100 + i, 12 + (i * 7) % 50), params))
    return out


async def run(address: str, reqs, during=None) -> list[Completion]:
    """All requests at once; ``during(streamed)`` runs once the streams have produced tokens."""
    streamed = {"tokens": 0}

    async def one(client: Client, prompt, params) -> Completion:
        out = Completion()
        async for msg in client.generate(prompt, **params):
            accumulate(out, msg)
            streamed["tokens"] += len(msg.token_ids)
        return out

    async with Client(address) as client:
        tasks = [asyncio.create_task(one(client, p, kw)) for p, kw in reqs]
        if during is not None:
            await during(streamed)
        return await asyncio.gather(*tasks)


def info(address: str):
    async def get():
        async with Client(address) as client:
            return await client.model_info()
    return asyncio.run(get())


def executors(address: str) -> dict[str, object]:
    return {e.address: e for e in info(address).executors}


def wait_states(address: str, want: dict[str, str], timeout: float = 60.0) -> None:
    ok = procs.wait_for(lambda: {a: e.state for a, e in executors(address).items() if a in want} == want, timeout)
    assert ok, executors(address)


class Cluster:
    def __init__(self, tmp_path) -> None:
        self.file = tmp_path / "executors.txt"
        self.execs = [procs.executor("--num-pages", "96"), procs.executor("--num-pages", "96")]
        self.write()
        self.sched = procs.scheduler(args=("--executors-file", str(self.file), "--resolve-interval", "0.3",
                                           "--drain-timeout", "0.001", "--unplaced-timeout", "60", "--check-integrity"))
        self.address = self.sched.address
        wait_states(self.address, {e.address: "up" for e in self.execs})

    def write(self) -> None:
        self.file.write_text("".join(f"{e.address}\n" for e in self.execs))

    def restart(self, i: int) -> None:
        """A new executor process on the same port: it re-registers with empty pools."""
        self.execs[i] = procs.executor("--num-pages", "96", port=self.execs[i].port)
        wait_states(self.address, {self.execs[i].address: "up"})

    def stop(self) -> None:
        for p in (self.sched, *self.execs):
            p.kill()


@pytest.fixture(scope="module")
def cluster(tmp_path_factory, model_cache):
    c = Cluster(tmp_path_factory.mktemp("cluster"))
    yield c
    c.stop()


@pytest.fixture(scope="module")
def reference(cluster):
    """The workload's outputs on the undisturbed cluster."""
    return asyncio.run(run(cluster.address, workload(32)))


def test_placement_follows_the_prefix_cache(cluster):
    """Each long prompt's follow-up (same prefix, another ending) goes to the executor that cached it,
    although the least-loaded rule alone would alternate."""
    async def scenario():
        async with Client(cluster.address) as client:
            placed = []
            for seed in (1, 2, 3):
                prefix = prompt_of(seed, 160)
                before = await client.model_info()
                await client.complete(prefix + [5], max_tokens=4, ignore_eos=True)
                mid = await client.model_info()
                again = await client.complete(prefix + [6], max_tokens=4, ignore_eos=True)
                after = await client.model_info()
                first = [b.address for a, b in zip(before.executors, mid.executors) if b.num_placed > a.num_placed]
                second = [b.address for a, b in zip(mid.executors, after.executors) if b.num_placed > a.num_placed]
                placed.append((first, second, again.cached_tokens))
            return placed
    placed = asyncio.run(scenario())
    for first, second, cached in placed:
        assert len(first) == 1 and second == first and cached == 160 // 16 * 16
    assert len({p[0][0] for p in placed}) == 2  # without the hits, placement spreads over both


def test_kill9_migrates_every_stream(cluster, reference):
    """kill -9 one of two executors while 32 streams are mid-generation: every stream completes with the
    tokens an undisturbed run gives (greedy and seeded), none lost or repeated; the survivor leaks no page."""
    victim = cluster.execs[1]

    async def kill_midway(streamed):
        while streamed["tokens"] < 32 * 8:
            await asyncio.sleep(0.01)
        victim.kill()

    outs = asyncio.run(run(cluster.address, workload(32), kill_midway))
    assert [o.token_ids for o in outs] == [r.token_ids for r in reference]
    assert all(len(o.token_ids) == MAX_TOKENS and o.finish_reason for o in outs)
    ex = executors(cluster.address)
    assert ex[victim.address].state == "down" and ex[victim.address].num_migrated_out > 0
    survivor = ex[cluster.execs[0].address]
    assert procs.wait_for(lambda: executors(cluster.address)[survivor.address].num_used_pages == 0, 10)
    assert cluster.sched.saw("requests_migrating", cause="failure")
    cluster.restart(1)


def test_sigterm_executor_drains_without_failing_a_stream(cluster, reference):
    """SIGTERM mid-stream: the victim's requests move to the other executor with no stream failed. (The cluster's
    --drain-timeout is 1 ms, so that they move whatever the machine's speed: with a longer one, a fast machine
    finishes them on the victim and nothing migrates; tests/unit/test_cluster_unit.py covers requests that finish
    while draining.)"""
    victim = cluster.execs[0]

    async def term_midway(streamed):
        while streamed["tokens"] < 32 * 4:
            await asyncio.sleep(0.01)
        victim.signal(signal.SIGTERM)

    outs = asyncio.run(run(cluster.address, workload(32), term_midway))
    assert [o.token_ids for o in outs] == [r.token_ids for r in reference]
    assert victim.wait(30) == 0
    assert victim.saw("executor_stopped", drained=True)
    assert cluster.sched.saw("executor_drained", executor=victim.address)
    assert cluster.sched.saw("requests_migrating", cause="drain")
    assert procs.wait_for(lambda: executors(cluster.address)[cluster.execs[1].address].num_used_pages == 0, 10)
    cluster.restart(0)
    # the process that came back at that address holds no pages: no prefix hit may point into it
    again = asyncio.run(run(cluster.address, workload(32)))
    assert [o.token_ids for o in again] == [r.token_ids for r in reference]


def test_executor_joining_at_run_time_gets_work(cluster):
    joined = procs.executor("--num-pages", "96")
    cluster.execs.append(joined)
    cluster.write()
    wait_states(cluster.address, {joined.address: "up"})
    asyncio.run(run(cluster.address, workload(12, seed=5)))
    assert executors(cluster.address)[joined.address].num_placed > 0
    # and leaving: dropped from the file, it is drained and forgotten; the executor itself keeps running
    cluster.execs.pop()
    cluster.write()
    assert procs.wait_for(lambda: joined.address not in executors(cluster.address), 30)
    asyncio.run(run(cluster.address, workload(4, seed=6)))
    joined.kill()


def test_no_executor_left_then_one_comes_back(cluster):
    """With every executor gone, a new request gets UNAVAILABLE at once; a stream that was running waits
    (up to --unplaced-timeout) and completes on the executor that comes back."""
    reqs = workload(1, seed=7)
    [expected] = asyncio.run(run(cluster.address, reqs))

    async def scenario():
        async with Client(cluster.address) as client:
            streamed = {"tokens": 0}
            out = Completion()

            async def stream():
                async for msg in client.generate(reqs[0][0], **reqs[0][1]):
                    out.token_ids.extend(msg.token_ids)
                    streamed["tokens"] += len(msg.token_ids)
            task = asyncio.create_task(stream())
            while streamed["tokens"] < 5:
                await asyncio.sleep(0.01)
            for e in cluster.execs:
                e.kill()
            while any(e.state == "up" for e in (await client.model_info()).executors):
                await asyncio.sleep(0.05)
            async with Client(cluster.address, resume=None) as plain:  # (the refusal itself, not waited out)
                with pytest.raises(grpc.aio.AioRpcError) as err:
                    await plain.complete([1, 2, 3], max_tokens=2)
            assert err.value.code() == grpc.StatusCode.UNAVAILABLE and "no executor is up" in err.value.details()
            await asyncio.to_thread(cluster.restart, 0)
            await task
            return out
    out = asyncio.run(scenario())
    assert out.token_ids == expected.token_ids


def test_two_schedulers_round_robin_and_graceful_scheduler_shutdown(model_cache):
    """Two schedulers, each with its own executor, behind one client-side round-robin target; SIGTERM
    one: its in-flight streams finish, new requests to it get UNAVAILABLE, it exits 0."""
    e1, e2 = procs.executor("--num-pages", "64"), procs.executor("--num-pages", "64")
    s1 = procs.scheduler(e1.address, args=("--shutdown-timeout", "60"))
    s2 = procs.scheduler(e2.address)
    try:
        async def spread() -> tuple[int, list[int]]:
            """Rounds of 8 requests until both schedulers got some: round robin spreads over the subchannels that
            are connected, and the second may connect after the first round (20 rounds only catch a hang)."""
            async with Client(f"{s1.address},{s2.address}") as client:
                await client.wait_ready()
                rounds = 0
                while rounds < 20:
                    rounds += 1
                    await asyncio.gather(*(client.complete(p, **kw) for p, kw in workload(8, seed=8)))
                    placed = []
                    for s in (s1, s2):
                        async with Client(s.address) as one:
                            placed.append(sum(e.num_placed for e in (await one.model_info()).executors))
                    if min(placed) > 0:
                        break
                    await asyncio.sleep(0.2)
            return rounds, placed
        rounds, placed = asyncio.run(spread())
        assert sum(placed) == 8 * rounds and min(placed) > 0  # round robin over the two

        async def scenario():
            # (resume=None: the draining scheduler's refusal itself, not a resume on it once it is back)
            async with Client(s1.address, resume=None) as client:
                long = [asyncio.create_task(client.complete(prompt_of(i, 20), max_tokens=150, ignore_eos=True))
                        for i in range(4)]
                while (await client.model_info()).num_running < 4:
                    await asyncio.sleep(0.02)
                s1.signal(signal.SIGTERM)
                while not s1.saw("scheduler_draining"):
                    await asyncio.sleep(0.02)
                with pytest.raises(grpc.aio.AioRpcError) as err:
                    await client.complete([1, 2, 3], max_tokens=2)
                return await asyncio.gather(*long), err.value
        outs, err = asyncio.run(scenario())
        assert err.code() == grpc.StatusCode.UNAVAILABLE
        assert all(len(o.token_ids) == 150 and o.finish_reason == "length" for o in outs)
        assert s1.wait(30) == 0
    finally:
        for p in (s1, s2, e1, e2):
            p.kill()
