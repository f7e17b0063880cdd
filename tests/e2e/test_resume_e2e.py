"""Streams outlive their scheduler (issue 29, item 4): a real ``pagedkv serve`` on loopback whose scheduler is
SIGKILLed three times mid-stream and restarted by serve's supervisor each time (one executor serves one scheduler at
a time, so the restarted scheduler takes it over).

- Through ``pagedkv.client.Client`` (what ``pagedkv generate`` uses; one such process runs alongside): 32 greedy, 16
  seeded and 4 unseeded sampled streams on tiny-llama. Every stream completes with no error, and each greedy and
  seeded one is exactly the undisturbed run's (token ids, text, usage); each unseeded one is exactly what an
  undisturbed run with the seed its first message carried gives.
- Through the OpenAI-compatible gateway (serve's ``--http-port``, the official ``openai`` SDK with its retries off):
  completions and chat, streamed and not, greedy and seeded: each HTTP client sees one uninterrupted answer, the
  undisturbed one.

The largest gap a stream saw across a kill is printed (p50 / max over the streams), not asserted: it is serve's
restart backoff (1 s, 2 s, 4 s) plus the scheduler's start and the recompute (bench/resume.py measures it).
"""

from __future__ import annotations

import asyncio
import os
import random
import signal
import statistics
import sys
import time

import grpc
import openai
import pytest

from pagedkv.client import Client, Completion, accumulate
from pagedkv.local_server import LocalServer
from tests.conftest import ROOT, wait_until

pytestmark = pytest.mark.e2e

SEED = 29
MAX_TOKENS = 128
GREEDY, SEEDED, UNSEEDED = 32, 16, 4
KILL_AT = (0.15, 0.4, 0.65)  # of the tokens the run streams in all: each kill once this much has arrived
BOUND_S = 240.0  # a hang fails the test instead of the suite


def prompt_of(i: int) -> list[int]:
    """Mixed lengths; every fourth prompt starts with the same page (prefix-cache hits after a resume too)."""
    rng = random.Random(SEED * 1000 + i)
    start = [1] + random.Random(SEED).choices(range(3, 259), k=15) if i % 4 == 0 else [1]
    return start + [rng.randrange(3, 259) for _ in range(6 + (i * 7) % 40)]


def workload() -> list[tuple[list[int], dict]]:
    reqs = []
    for i in range(GREEDY + SEEDED + UNSEEDED):
        params = dict(max_tokens=MAX_TOKENS, ignore_eos=True, temperature=0.0)
        if i >= GREEDY:
            params.update(temperature=0.9, top_p=0.95)
        if GREEDY <= i < GREEDY + SEEDED:
            params["seed"] = 1000 + i
        reqs.append((prompt_of(i), params))
    return reqs


async def kill_scheduler_during(server: LocalServer, received, total: int, tasks) -> list[int]:
    """SIGKILLs serve's scheduler each time ``received()`` (tokens the clients have) passes a KILL_AT share of
    ``total``: the first kill hits the first scheduler, each later one the scheduler serve restarted (tokens only
    arrive again once a new one serves). Stops early once every one of ``tasks`` (the streams) ended."""
    killed = []
    for share in KILL_AT:
        while received() < share * total:
            if all(t.done() for t in tasks):
                return killed
            await asyncio.sleep(0.01)
        # the scheduler serving now: serve may be between a death and a restart (a supervisor that found one
        # unresponsive under load restarts it), so wait for a live one, bounded by the test's own BOUND_S
        while (pid := server.scheduler_pid()) is None or pid in killed:
            if all(t.done() for t in tasks):
                return killed
            await asyncio.sleep(0.01)
        os.kill(pid, signal.SIGKILL)
        killed.append(pid)
    return killed


def gaps(stamps: list[list[float]]) -> tuple[float, float]:
    """p50 and max over the streams of each stream's largest gap between two messages that carried tokens."""
    worst = [max(b - a for a, b in zip(s, s[1:])) for s in stamps if len(s) > 1]
    return statistics.median(worst), max(worst)


@pytest.fixture(scope="module")
def server(model_cache):
    s = LocalServer("--num-pages", "1024", "--threads", "1", timeout=300)
    yield s
    s.stop()


class Run:
    """One pass of the workload through one Client: every stream's completion, token timestamps, first seed."""

    def __init__(self, n: int) -> None:
        self.outs = [Completion() for _ in range(n)]
        self.stamps: list[list[float]] = [[] for _ in range(n)]
        self.seeds: list[int | None] = [None] * n
        self.errors: list[tuple[int, str, str]] = []

    def received(self) -> int:
        return sum(len(o.token_ids) for o in self.outs)

    async def stream(self, client: Client, i: int, prompt, params) -> None:
        try:
            async for msg in client.generate(prompt, **params):
                if msg.HasField("seed") and self.seeds[i] is None:
                    self.seeds[i] = msg.seed
                if msg.token_ids:
                    self.stamps[i].append(time.monotonic())
                accumulate(self.outs[i], msg)
        except grpc.aio.AioRpcError as err:
            self.errors.append((i, err.code().name, err.details() or ""))


async def run_all(address: str, reqs, during=None) -> Run:
    run = Run(len(reqs))
    async with Client(address) as client:
        tasks = [asyncio.create_task(run.stream(client, i, p, kw)) for i, (p, kw) in enumerate(reqs)]
        if during is not None:
            await during(run, tasks)
        await asyncio.gather(*tasks)
    return run


def test_streams_survive_three_scheduler_kills(server):
    reqs = workload()
    t0 = time.monotonic()
    reference = asyncio.run(asyncio.wait_for(run_all(server.address, reqs), BOUND_S))
    assert not reference.errors and all(len(o.token_ids) == MAX_TOKENS for o in reference.outs)
    cli_prompt, cli_max = "Resume me, exactly:", 256
    expected_cli = asyncio.run(_complete(server.address, cli_prompt, max_tokens=cli_max, ignore_eos=True,
                                         temperature=0.0)).text
    t_ref = time.monotonic() - t0
    restarts = server.lifecycle["child_restarted"]

    killed: list[int] = []
    cli_out: list[bytes] = []

    async def scenario() -> Run:
        # `pagedkv generate` resumes by default too: it streams alongside (the workload starts once its text does)
        cli = await asyncio.create_subprocess_exec(
            sys.executable, "-m", "pagedkv", "generate", cli_prompt, "--address", server.address, "--max-tokens",
            str(cli_max), "--temperature", "0", "--ignore-eos", cwd=ROOT, stdout=asyncio.subprocess.PIPE,
            stderr=asyncio.subprocess.PIPE)

        async def read_cli() -> None:
            while chunk := await cli.stdout.read(64):
                cli_out.append(chunk)
        reader = asyncio.create_task(read_cli())
        while not cli_out and not reader.done():
            await asyncio.sleep(0.01)

        async def during(run: Run, tasks) -> None:
            killed.extend(await kill_scheduler_during(server, run.received, MAX_TOKENS * len(reqs), tasks))

        run = await run_all(server.address, reqs, during)
        await reader
        stderr = await cli.stderr.read()
        assert await cli.wait() == 0, stderr.decode()
        return run

    t1 = time.monotonic()
    run = asyncio.run(asyncio.wait_for(scenario(), BOUND_S))
    t_chaos = time.monotonic() - t1
    assert not run.errors, run.errors[:3]  # (was: every stream in flight, UNAVAILABLE "Stream removed")

    exact = range(GREEDY + SEEDED)
    differ = [i for i in exact if (run.outs[i].token_ids, run.outs[i].text) != (reference.outs[i].token_ids,
                                                                                 reference.outs[i].text)]
    usage = [i for i in exact if (run.outs[i].prompt_tokens, run.outs[i].completion_tokens, run.outs[i].finish_reason)
             != (reference.outs[i].prompt_tokens, MAX_TOKENS, "length")]
    # the unseeded ones: exactly what their seed (the server's choice, from the first message) gives
    unseeded = list(range(GREEDY + SEEDED, len(reqs)))
    assert all(run.seeds[i] is not None for i in unseeded), run.seeds
    again = [(p, {**kw, "seed": run.seeds[i]}) for i, (p, kw) in enumerate(reqs) if i in unseeded]
    replay = asyncio.run(asyncio.wait_for(run_all(server.address, again), BOUND_S))
    unseeded_differ = [i for i, o in zip(unseeded, replay.outs) if o.token_ids != run.outs[i].token_ids]
    p50, worst = gaps(run.stamps)
    print(f"\nresume: {len(reqs)} streams ({GREEDY} greedy, {SEEDED} seeded, {UNSEEDED} unseeded), scheduler "
          f"SIGKILLed {len(killed)} times; {len(differ)} differ, {len(run.errors)} errors; largest gap per stream "
          f"p50 {p50:.2f} s, max {worst:.2f} s (undisturbed max {gaps(reference.stamps)[1]:.3f} s); "
          f"undisturbed {t_ref:.1f} s, with kills {t_chaos:.1f} s")
    assert len(set(killed)) == 3 and server.lifecycle["child_restarted"] >= restarts + 3
    assert not differ and not usage and not unseeded_differ, (differ, usage, unseeded_differ)
    assert b"".join(cli_out).decode() == expected_cli + "\n"

    async def used() -> int:
        async with Client(server.address) as client:
            info = await client.model_info()
            return info.num_used_pages + info.num_running + info.num_waiting
    assert wait_until(lambda: asyncio.run(used()) == 0, 30), "pages or requests left after the run"


async def _complete(address: str, prompt, **params) -> Completion:
    async with Client(address) as client:
        return await client.complete(prompt, **params)


# ---- through the gateway ------------------------------------------------------------------------------------------
GATEWAY_MAX_TOKENS = 200


@pytest.fixture(scope="module")
def gateway_server(model_cache, tmp_path_factory):
    """tiny-llama's weights with a chat template, behind serve's gateway child (--http-port)."""
    from transformers import AutoTokenizer

    from pagedkv.cli import free_port
    from pagedkv.tools.random_model import build_random_model
    from tests.support.chat_template import TEMPLATE

    path = build_random_model(tmp_path_factory.mktemp("chat-tiny-llama") / "model")
    tok = AutoTokenizer.from_pretrained(str(path))
    tok.chat_template = TEMPLATE
    tok.save_pretrained(str(path))
    http_port = free_port()
    s = LocalServer("--model", str(path), "--num-pages", "512", "--threads", "1", "--http-port", str(http_port),
                    timeout=300)
    s.http_port = http_port
    yield s
    s.stop()


def http_requests() -> list[tuple[str, bool, dict]]:
    """(endpoint, stream, body): completions and chat, streamed and not, greedy and seeded."""
    out = []
    for i in range(8):
        chat, stream, seeded = i % 2 == 1, i % 4 >= 2, i >= 4
        body = dict(max_tokens=GATEWAY_MAX_TOKENS, temperature=0.9 if seeded else 0.0, logprobs=True if chat else 0,
                    extra_body={"ignore_eos": True}, **({"seed": 500 + i} if seeded else {}))
        if chat:
            body["messages"] = [{"role": "user", "content": f"Tell me story number {i}, with ünïcödé."}]
        else:
            body["prompt"] = f"Story {i}: once upon a time, é è ê"
        if stream:
            body["stream_options"] = {"include_usage": True}
        out.append(("chat" if chat else "completions", stream, body))
    return out


async def http_all(base: str, model: str, requests, during=None):
    """Every request through the openai SDK (no retries): (text, token count, finish, usage) each, and the token
    timestamps of the streamed ones."""
    client = openai.AsyncOpenAI(base_url=f"{base}/v1", api_key="x", max_retries=0, timeout=BOUND_S)
    streamed = [0]
    stamps: list[list[float]] = [[] for _ in requests]

    async def one(i: int, endpoint: str, stream: bool, body: dict):
        api = client.chat.completions if endpoint == "chat" else client.completions
        if not stream:
            r = await api.create(model=model, **body)
            c = r.choices[0]
            text = c.message.content if endpoint == "chat" else c.text
            tokens = len(c.logprobs.content) if endpoint == "chat" else len(c.logprobs.tokens)
            return text, tokens, c.finish_reason, r.usage.completion_tokens
        text, tokens, finish, usage = "", 0, None, None
        async for chunk in await api.create(model=model, stream=True, **body):
            if chunk.usage is not None:
                usage = chunk.usage.completion_tokens
            for c in chunk.choices:
                n = (len(c.logprobs.content) if endpoint == "chat" else len(c.logprobs.tokens)) if c.logprobs else 0
                if n:
                    stamps[i].append(time.monotonic())
                tokens += n
                streamed[0] += n
                text += (c.delta.content or "") if endpoint == "chat" else c.text
                finish = c.finish_reason or finish
        return text, tokens, finish, usage

    try:
        tasks = [asyncio.create_task(one(i, *r)) for i, r in enumerate(requests)]
        if during is not None:
            await during(lambda: streamed[0], tasks)
        return await asyncio.gather(*tasks), stamps
    finally:
        await client.close()


def test_the_gateway_resumes_its_upstream_streams(gateway_server):
    base = f"http://127.0.0.1:{gateway_server.http_port}"
    model = openai.OpenAI(base_url=f"{base}/v1", api_key="x", max_retries=0).models.list().data[0].id
    requests = http_requests()
    reference, _ = asyncio.run(asyncio.wait_for(http_all(base, model, requests), BOUND_S))
    assert all(r[1] == GATEWAY_MAX_TOKENS and r[2] == "length" for r in reference), reference
    streamed_total = GATEWAY_MAX_TOKENS * sum(1 for _, stream, _ in requests if stream)
    killed: list[int] = []

    async def during(received, tasks) -> None:
        killed.extend(await kill_scheduler_during(gateway_server, received, streamed_total, tasks))

    t0 = time.monotonic()
    got, stamps = asyncio.run(asyncio.wait_for(http_all(base, model, requests, during), BOUND_S))
    p50, worst = gaps(stamps)
    differ = [i for i, (a, b) in enumerate(zip(got, reference)) if a != b]
    print(f"\ngateway resume: {len(requests)} HTTP requests (4 streamed), scheduler SIGKILLed {len(killed)} times; "
          f"{len(differ)} differ; largest gap per streamed request p50 {p50:.2f} s, max {worst:.2f} s; "
          f"{time.monotonic() - t0:.1f} s")
    # Each kill lands while streams are open (kill_scheduler_during stops once they all ended). tiny-llama's 200
    # tokens can all reach the gateway before the third share is due, so its streams may end after two kills
    # (CI of 7b1bcce: 2 kills, 0 differ, 3.2 s): two restarts mid-stream is what this test needs.
    assert len(set(killed)) >= 2, killed
    assert not differ, [(got[i], reference[i]) for i in differ]
