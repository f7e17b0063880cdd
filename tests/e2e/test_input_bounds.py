"""Input is bounded before any work: prompt text beyond --max-prompt-bytes is refused before it is tokenized,
and a request message beyond the server's gRPC limit is refused by gRPC itself from its length prefix (not
buffered, not parsed), while the other streams keep streaming."""

from __future__ import annotations

import asyncio
import time

import grpc
import pytest

from pagedkv.api.v1 import api_pb2 as api
from pagedkv.bounds import MIN_PROMPT_BYTES, max_request_bytes
from pagedkv.client import Client
from tests.support import procs

pytestmark = pytest.mark.e2e

MAX_LEN = 256
LIMIT = MIN_PROMPT_BYTES  # the default for a short context: 16 bytes/token x 256 is below the floor
GENERATE = "/pagedkv.api.v1.Generation/Generate"


@pytest.fixture(scope="module")
def pair(model_cache):
    executor = procs.executor("--num-pages", "64")
    try:
        scheduler = procs.scheduler(executor.address, args=("--max-model-len", str(MAX_LEN)))
    except Exception:
        executor.stop()
        raise
    yield scheduler
    scheduler.stop()
    executor.stop()


def rss_mib(pid: int) -> float:
    with open(f"/proc/{pid}/status") as f:
        kib = next(int(line.split()[1]) for line in f if line.startswith("VmRSS:"))
    return kib / 1024


async def _refused(call) -> grpc.aio.AioRpcError:
    with pytest.raises(grpc.aio.AioRpcError) as err:
        await call
    return err.value


def test_text_over_the_byte_limit_is_refused_before_tokenizing(pair):
    async def scenario():
        async with Client(pair.address) as client:
            errors = {
                "ascii": await _refused(client.complete("x" * (LIMIT + 1), max_tokens=1)),
                # fewer characters than the limit, more bytes: the limit is in UTF-8 bytes
                "multibyte": await _refused(client.complete("€" * (LIMIT // 3 + 1), max_tokens=1)),
                "tokenize": await _refused(client.stub.Tokenize(api.TokenizeRequest(text="y" * (LIMIT + 1)))),
                # at the limit the text is tokenized, and the token count is what is refused
                "at_limit": await _refused(client.complete("z" * LIMIT, max_tokens=1)),
            }
            tokenized = await client.stub.Tokenize(api.TokenizeRequest(text="w" * LIMIT))
            ok = await client.complete("still serving", max_tokens=3, ignore_eos=True)
            return errors, tokenized, ok

    errors, tokenized, ok = asyncio.run(scenario())
    for name in ("ascii", "multibyte", "tokenize"):
        err = errors[name]
        assert err.code() == grpc.StatusCode.INVALID_ARGUMENT, (name, err)
        field = "text" if name == "tokenize" else "prompt.text"
        assert err.details().startswith(f"{field}: ") and f"at most {LIMIT}" in err.details(), err.details()
        assert "--max-prompt-bytes" in err.details()
    assert f"{LIMIT // 3 * 3 + 3} bytes" in errors["multibyte"].details()
    assert errors["at_limit"].code() == grpc.StatusCode.INVALID_ARGUMENT
    assert f"max_model_len={MAX_LEN}" in errors["at_limit"].details()
    assert len(tokenized.token_ids) == LIMIT + 1  # byte-level tokenizer: one token a byte, and BOS as Generate adds
    assert ok.completion_tokens == 3


async def _stream_gaps(address: str, started: asyncio.Event) -> tuple[int, list[float]]:
    """A greedy stream of 200 tokens: how many arrived, and the gaps between messages."""
    gaps, count, last = [], 0, None
    async with Client(address) as client:
        async for msg in client.generate([1, 30, 31, 32], max_tokens=200, ignore_eos=True):
            now = time.perf_counter()
            if last is not None:
                gaps.append(now - last)
            last = now
            count += len(msg.token_ids)
            if count >= 10:
                started.set()
    return count, gaps


async def _send_raw(channel: grpc.aio.Channel, payload: bytes) -> tuple[grpc.aio.AioRpcError | None, float]:
    call = channel.unary_stream(GENERATE)  # no serializer: the bytes go as they are
    t0 = time.perf_counter()
    try:
        async for _ in call(payload, timeout=60):
            pass
    except grpc.aio.AioRpcError as err:
        return err, time.perf_counter() - t0
    return None, time.perf_counter() - t0


def test_huge_requests_are_refused_by_grpc_while_other_streams_stream(pair):
    """5 MB and 50 MB Generate requests (serialized beforehand, so the client's own encoding is not timed) end
    RESOURCE_EXHAUSTED at once; the scheduler's memory does not grow; a concurrent stream keeps streaming.

    NOTE: gRPC decides from the length prefix within ~1 ms of the first bytes (a GRPC_TRACE=http,api trace
    shows the server's CANCEL then), but grpcio 1.85 writes the RST_STREAM/trailers from an EventEngine
    callback ~100 ms later, for a 300 KiB message as for a 500 MB one, with the aio or the sync server alike:
    the client sees the status after ~0.1-0.2 s on an idle machine."""
    payloads = {mb: api.GenerateRequest(text="a" * (mb << 20)).SerializeToString() for mb in (5, 50)}
    pid = pair.proc.pid

    async def scenario():
        started = asyncio.Event()
        async with Client(pair.address) as client:  # a warm-up, so that RSS is measured after it
            await client.complete([1, 30, 31, 32], max_tokens=4, ignore_eos=True)
        alone = await _stream_gaps(pair.address, asyncio.Event())
        stream = asyncio.create_task(_stream_gaps(pair.address, started))
        await asyncio.wait_for(started.wait(), 60)
        before = rss_mib(pid)
        results = {}
        async with grpc.aio.insecure_channel(pair.address, options=[
                ("grpc.max_send_message_length", 128 << 20)]) as channel:
            for mb, payload in payloads.items():
                results[mb] = await _send_raw(channel, payload)
        after = rss_mib(pid)
        count, gaps = await stream
        return alone, results, before, after, count, gaps

    alone, results, before, after, count, gaps = asyncio.run(scenario())
    figures = {f"{mb} MB": f"{err.code().name if err else 'ACCEPTED'} in {secs * 1000:.1f} ms"
               for mb, (err, secs) in results.items()}
    print(f"\nrefusals: {figures}; scheduler RSS {before:.1f} -> {after:.1f} MiB; concurrent stream: {count} "
          f"tokens, max gap {max(gaps) * 1000:.1f} ms (alone: {max(alone[1]) * 1000:.1f} ms)")
    limit = max_request_bytes(LIMIT, MAX_LEN)  # (a new request's, plus room for a continuation)
    for mb, (err, secs) in results.items():
        assert err is not None and err.code() == grpc.StatusCode.RESOURCE_EXHAUSTED, (mb, err)
        assert f"vs. {limit})" in err.details(), err.details()  # gRPC's words: "larger than max (N vs. LIMIT)"
        assert secs < 5.0, f"{mb} MB took {secs:.2f}s to refuse"  # ~0.1-0.2 s idle: see the docstring
    assert after - before < 50, f"scheduler RSS grew {after - before:.1f} MiB"
    assert count == 200, "the concurrent stream did not complete"
    assert max(gaps) < 5.0, f"the concurrent stream stalled {max(gaps):.2f}s"


def test_serve_passes_the_prompt_limit_and_metrics_host_on(model_cache):
    """``pagedkv serve --max-prompt-bytes N --metrics-host H``: the scheduler refuses text over N bytes, and both
    children's /metrics listen on H only."""
    import urllib.request

    from pagedkv.cli import free_port
    from tests.conftest import Server
    from tests.support.procs import METRICS_HOST, can_bind

    host = METRICS_HOST if can_bind(METRICS_HOST) else "127.0.0.1"
    metrics_port = free_port(host)
    server = Server("--num-pages", "32", "--max-model-len", "256", "--max-prompt-bytes", "1000",
                    "--metrics-port", str(metrics_port), "--metrics-host", host)
    try:
        async def scenario():
            async with Client(server.address) as client:
                err = await _refused(client.complete("q" * 1001, max_tokens=1))
                ok = await client.complete("p" * 100, max_tokens=2, ignore_eos=True)
                return err, ok

        err, ok = asyncio.run(scenario())
        pages = [urllib.request.urlopen(f"http://{host}:{port}/metrics", timeout=10).read().decode()
                 for port in (metrics_port, metrics_port + 1)]
    finally:
        server.stop()
    assert err.code() == grpc.StatusCode.INVALID_ARGUMENT and "at most 1000" in err.details(), err.details()
    assert ok.completion_tokens == 2
    assert "pagedkv_requests_running" in pages[0] and "pagedkv_executor" in pages[1]
