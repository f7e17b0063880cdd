"""Links that stay up when idle, a dead executor noticed within the documented bound, and a reconnect that
keeps the prefix cache (issue 13, finding 5).

- The ping policy: client and server keepalive options agree, and grpc knows every option name (it ignores
  a misspelt one silently; that is how the executor once kept the 5-minute default and sent GOAWAY
  too_many_pings after ~30 s of idle).
- The scheduler sends one x-pagedkv-session per executor link, the same on every reconnect.
- A lost Run stream keeps the published pages, except those that unconfirmed page operations were filling;
  the same executor id keeps the cache on reconnect, another id forgets it (in one process, FakeExecutors
  check that every read finds the KV that was written).
- Real processes on loopback (slow, ~1 min in all; they share one module so the idle clock runs while the
  other tests do):
  (a) an executor link and a public client link idle >= IDLE_S, then a repeated prompt hits the prefix cache
      as before the idle, with no executor_failed, no reconnect, no channel state change;
  (b) a SIGSTOPped executor is noticed within DEAD_PEER_BOUND_S (measured); its request waits, and finishes
      unchanged once SIGCONT lets the executor rejoin, and the rejoined executor still hits the cache;
  (c) the TCP connection between scheduler and executor is cut (a proxy resets it) mid-stream: the scheduler
      reconnects to the same executor, the cut request finishes unchanged, and the cache still hits.
"""

from __future__ import annotations

import asyncio
import os
import signal
import socket
import struct
import threading
import time

import grpc
import pytest

from pagedkv import grpc_common
from pagedkv.client import Client, Completion, accumulate
from pagedkv.executor.v1 import executor_pb2 as pb
from pagedkv.executor.v1 import executor_pb2_grpc as pb_grpc
from pagedkv.wire import PAGES_HEADER, SESSION_HEADER
from scheduler_svc.executor_client import SERVICE, ExecutorClient
from tests.support import procs

pytestmark = pytest.mark.e2e

# (a): a server that takes the pings for abuse (the misspelt option; no keepalive_permit_without_calls) sends
# GOAWAY too_many_pings at the (MAX_PING_STRIKES + 1)th or + 2nd ping of the idle: measured with the misspelt
# option, 30 s on the public link, 41 s on the executor link. One more ping interval is slack.
IDLE_S = (grpc_common.MAX_PING_STRIKES + 3) * grpc_common.PING_INTERVAL_MS / 1000  # 50 s
SLACK_S = 6.0  # (b): a loaded 2-core CI machine answers late


# ---- the session header --------------------------------------------------------------------------
class RecordingExecutor(pb_grpc.ExecutorServicer):
    def __init__(self) -> None:
        self.sessions: list[str] = []

    async def Describe(self, request, context):  # noqa: N802
        return pb.DescribeResponse(executor_id="x")

    async def Run(self, request_iterator, context):  # noqa: N802
        session = dict(context.invocation_metadata()).get(SESSION_HEADER, "")
        kept = bool(self.sessions) and session == self.sessions[-1]
        self.sessions.append(session)
        await context.send_initial_metadata(((PAGES_HEADER, "kept" if kept else "fresh"),))
        async for plan in request_iterator:
            yield pb.StepResult(step_id=plan.step_id)


def test_one_session_per_link_the_same_on_every_reconnect():
    async def scenario():
        server = grpc_common.new_server()
        recorder = RecordingExecutor()
        pb_grpc.add_ExecutorServicer_to_server(recorder, server)
        health = grpc_common.add_health_and_reflection(server, [SERVICE])
        await grpc_common.set_serving(health, [SERVICE], True)
        port = grpc_common.bind(server, "127.0.0.1", 0)
        await server.start()
        first, second = ExecutorClient(f"127.0.0.1:{port}", 5.0), ExecutorClient(f"127.0.0.1:{port}", 5.0)
        kept = []
        try:
            for client in (first, first, second):  # first reconnects once; second is another scheduler
                await client.connect(5.0)
                kept.append(client.pages_kept)
                assert (await client.step(pb.StepPlan(step_id=1))).step_id == 1
                client.drop()
        finally:
            await first.close()
            await second.close()
            await server.stop(0)
        return recorder.sessions, kept
    (a, a_again, b), kept = asyncio.run(scenario())
    assert len(a) == 32 and a == a_again and b != a
    assert kept == [False, True, False]  # the executor's answer (x-pagedkv-pages), as the engine reads it


# ---- real processes --------------------------------------------------------------------------------
def prompt_of(seed: int, n: int = 70) -> list[int]:
    return [1] + [(seed * 31 + i * 37) % 250 + 3 for i in range(n - 1)]


async def _complete(client: Client, prompt, max_tokens: int = 8, on_token=None) -> Completion:
    out = Completion()
    async for msg in client.generate(prompt, max_tokens=max_tokens, ignore_eos=True, temperature=0):
        accumulate(out, msg)
        if on_token is not None and msg.token_ids:
            on_token(len(out.token_ids))
    return out


def complete(address: str, prompt, max_tokens: int = 8) -> Completion:
    async def run():
        async with Client(address) as client:
            return await _complete(client, prompt, max_tokens)
    return asyncio.run(run())


def complete_cut(address: str, prompt, max_tokens: int, cut) -> Completion:
    """One stream; ``cut()`` runs (in a thread) once it has produced 5 tokens."""
    async def run():
        async with Client(address) as client:
            fired = asyncio.Event()
            task = asyncio.create_task(_complete(client, prompt, max_tokens,
                                                 lambda n: n >= 5 and fired.set()))
            await asyncio.wait({task, asyncio.create_task(fired.wait())}, return_when=asyncio.FIRST_COMPLETED)
            assert not task.done(), "the stream ended before it could be cut: make it longer"
            await asyncio.to_thread(cut)
            return await task
    return asyncio.run(run())


def count(proc, event: str) -> int:
    return sum(1 for e in list(proc.events) if e.get("event") == event)


class IdleClient:
    """A pagedkv.client.Client on its own event loop thread, opened now and left idle, recording every state
    change of its channel (a GOAWAY or a reconnect shows as one)."""

    def __init__(self, address: str) -> None:
        self.loop = asyncio.new_event_loop()
        self.thread = threading.Thread(target=self.loop.run_forever, daemon=True)
        self.thread.start()
        self.states: list[grpc.ChannelConnectivity] = []
        self.client: Client = self.call(self._open(address))
        self.watch = asyncio.run_coroutine_threadsafe(self._watch(), self.loop)

    def call(self, coro, timeout: float = 120.0):
        return asyncio.run_coroutine_threadsafe(coro, self.loop).result(timeout)

    async def _open(self, address: str) -> Client:
        client = Client(address)
        await client.model_info()  # connected, READY
        return client

    async def _watch(self) -> None:
        channel = self.client.channel
        state = channel.get_state()
        while True:
            await channel.wait_for_state_change(state)
            state = channel.get_state()
            self.states.append(state)

    def close(self) -> None:
        self.watch.cancel()
        self.call(self.client.close())
        self.loop.call_soon_threadsafe(self.loop.stop)
        self.thread.join(10)


class IdleLink:
    """(a)'s processes, started with the module: the hit before the idle, then nothing on either link."""

    def __init__(self) -> None:
        self.prompt = prompt_of(1)
        self.executor = procs.executor("--num-pages", "64")
        try:
            self.scheduler = procs.scheduler(self.executor.address)
            self.reference = complete(self.scheduler.address, self.prompt)
            self.hit = complete(self.scheduler.address, self.prompt)
            self.client = IdleClient(self.scheduler.address)
        except BaseException:
            self.stop()
            raise
        self.idle_since = time.monotonic()

    def stop(self) -> None:
        if getattr(self, "client", None) is not None:
            self.client.close()
        if getattr(self, "scheduler", None) is not None:
            self.scheduler.stop()
        self.executor.stop()


@pytest.fixture(scope="module")
def idle_link():
    """Started by the first process test, checked by the last (the idle runs meanwhile)."""
    link = IdleLink()
    yield link
    link.stop()


class CuttingProxy:
    """TCP forwarding from a local port to ``target``; ``cut()`` resets every connection it carries."""

    def __init__(self, target: str) -> None:
        host, _, port = target.rpartition(":")
        self.target = (host, int(port))
        self.sock = socket.create_server(("127.0.0.1", 0))
        self.address = f"127.0.0.1:{self.sock.getsockname()[1]}"
        self.lock = threading.Lock()
        self.conns: list[tuple[socket.socket, socket.socket]] = []
        self.num_connections = 0
        threading.Thread(target=self._accept, daemon=True).start()

    def _accept(self) -> None:
        while True:
            try:
                down, _ = self.sock.accept()
                up = socket.create_connection(self.target)
            except OSError:
                return
            with self.lock:
                self.conns.append((down, up))
                self.num_connections += 1
            for a, b in ((down, up), (up, down)):
                threading.Thread(target=self._pump, args=(a, b), daemon=True).start()

    @staticmethod
    def _pump(src: socket.socket, dst: socket.socket) -> None:
        try:
            while data := src.recv(1 << 16):
                dst.sendall(data)
        except OSError:
            pass
        for s in (src, dst):
            try:
                s.shutdown(socket.SHUT_RDWR)
            except OSError:
                pass

    def cut(self) -> None:
        with self.lock:
            conns, self.conns = self.conns, []
        for pair in conns:
            for s in pair:
                s.setsockopt(socket.SOL_SOCKET, socket.SO_LINGER, struct.pack("ii", 1, 0))  # RST
                try:
                    s.shutdown(socket.SHUT_RDWR)
                except OSError:
                    pass
                s.close()

    def close(self) -> None:
        self.sock.close()
        self.cut()


@pytest.mark.slow
def test_b_a_stopped_executor_is_noticed_within_the_bound_and_rejoins(idle_link, record_property):
    prompt = prompt_of(2)
    ex = procs.executor("--num-pages", "96")
    sched = None
    stopped = False
    try:
        sched = procs.scheduler(ex.address, args=("--unplaced-timeout", "180"))
        reference = complete(sched.address, prompt, max_tokens=300)
        timing = {}

        def stop_and_measure():
            nonlocal stopped
            ex.signal(signal.SIGSTOP)
            stopped = True
            t0 = time.monotonic()
            assert procs.wait_for(lambda: count(sched, "executor_failed") > 0, 60, 0.02), sched.log()
            timing["detected_s"] = time.monotonic() - t0
            os.kill(ex.proc.pid, signal.SIGCONT)
            stopped = False

        cut = complete_cut(sched.address, prompt, 300, stop_and_measure)
        failed = next(e for e in sched.events if e.get("event") == "executor_failed")
        ups = [e["executor_id"] for e in sched.events if e.get("event") == "executor_up"]
        again = complete(sched.address, prompt)
    finally:
        if stopped:
            os.kill(ex.proc.pid, signal.SIGCONT)
        if sched is not None:
            sched.stop()
        ex.stop()
    detected = timing["detected_s"]
    record_property("dead_executor_detected_s", round(detected, 2))
    print(f"\nSIGSTOPped executor noticed after {detected:.1f} s (bound {grpc_common.DEAD_PEER_BOUND_S:g} s)")
    assert detected <= grpc_common.DEAD_PEER_BOUND_S + SLACK_S, f"noticed after {detected:.1f}s"
    assert failed["requests_moved"] == 1
    assert cut.token_ids == reference.token_ids and cut.finish_reason == "length"  # waited, then recomputed
    assert len(ups) >= 2 and len(set(ups)) == 1, ups  # the same process rejoined
    assert again.cached_tokens == cut.cached_tokens > 0  # and its pages are still the cache's


@pytest.mark.slow
def test_c_a_cut_connection_reconnects_to_the_same_executor_with_the_cache(idle_link):
    warm, long_prompt = prompt_of(3), prompt_of(4, 40)
    ex = procs.executor("--num-pages", "96")
    proxy = CuttingProxy(ex.address)
    sched = None
    try:
        sched = procs.scheduler(proxy.address)
        reference = complete(sched.address, warm)
        hit = complete(sched.address, warm)
        long_reference = complete(sched.address, long_prompt, max_tokens=300)
        cut = complete_cut(sched.address, long_prompt, 300, proxy.cut)
        assert procs.wait_for(lambda: count(sched, "executor_up") >= 2, 60), sched.log()
        again = complete(sched.address, warm)
        attached = count(ex, "scheduler_attached")
        ups = [e for e in sched.events if e.get("event") == "executor_up"]
        failed = [e for e in sched.events if e.get("event") == "executor_failed"]
    finally:
        if sched is not None:
            sched.stop()
        proxy.close()
        ex.stop()
    assert hit.cached_tokens > 0 and proxy.num_connections >= 2 and attached >= 2 and failed
    assert failed[0]["requests_moved"] == 1
    assert len({e["executor_id"] for e in ups}) == 1 and ups[-1]["cached_pages"] > 0
    assert cut.token_ids == long_reference.token_ids and cut.finish_reason == "length"
    assert again.token_ids == reference.token_ids and again.cached_tokens == hit.cached_tokens


@pytest.mark.slow
@pytest.mark.timeout(IDLE_S + 300)
def test_a_idle_links_stay_up_and_keep_the_prefix_cache(idle_link):
    """Last in the module: the other process tests ran during the idle."""
    link = idle_link
    left = IDLE_S - (time.monotonic() - link.idle_since)
    if left > 0:
        time.sleep(left)
    idled = time.monotonic() - link.idle_since
    again = link.client.call(_complete(link.client.client, link.prompt))
    sched, ex = link.scheduler, link.executor
    print(f"\nidle {idled:.0f} s: cached_tokens {link.hit.cached_tokens} before, {again.cached_tokens} after; "
          f"channel states {[s.name for s in link.client.states]}")
    assert idled >= IDLE_S
    assert count(sched, "executor_failed") == 0 and count(sched, "executor_up") == 1, sched.log()
    assert count(ex, "scheduler_attached") == 1 and count(ex, "scheduler_detached") == 0, ex.log()
    assert link.client.states == [], "the public link's channel left READY (GOAWAY or reconnect)"
    assert link.hit.cached_tokens > 0 and again.cached_tokens == link.hit.cached_tokens
    assert again.token_ids == link.reference.token_ids
