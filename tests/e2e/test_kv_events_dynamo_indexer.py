"""pagedkv's ZMQ KV events read unchanged by NVIDIA Dynamo's own consumer: its standalone KV indexer
(``python -m dynamo.indexer``, Dynamo 1.6.1's Rust decoder of vLLM's wire format) subscribed to a scheduler's
--kv-events-config endpoint, with its replay socket: a prompt's pages are matched, then found no more once evicted.
Skipped without Dynamo (make install-dynamo)."""

from __future__ import annotations

import asyncio
import json
import subprocess
import sys
import urllib.request

import pytest

from pagedkv.cli import free_port
from pagedkv.client import Client
from pagedkv.local_server import ROOT
from tests.conftest import wait_until

pytestmark = pytest.mark.e2e
pytest.importorskip("dynamo.llm", reason="NVIDIA Dynamo is not installed (make install-dynamo)")

MODEL = "tiny-llama"
WORKER = 1


def post(port: int, path: str, body: dict) -> dict:
    request = urllib.request.Request(f"http://127.0.0.1:{port}{path}", data=json.dumps(body).encode(),
                                     headers={"content-type": "application/json"})
    with urllib.request.urlopen(request, timeout=10) as answer:
        return json.loads(answer.read())


def matched(port: int, tokens: list[int]) -> int:
    """The tokens of ``tokens``' prefix the indexer finds on the worker (0: none)."""
    scores = post(port, "/query", {"model_name": MODEL, "token_ids": tokens})["scores"]
    return scores.get(str(WORKER), {}).get("0", 0)


def answers(port: int) -> bool:
    try:
        with urllib.request.urlopen(f"http://127.0.0.1:{port}/workers", timeout=2):
            return True
    except OSError:
        return False


@pytest.fixture
def indexer():
    port = free_port()
    proc = subprocess.Popen([sys.executable, "-m", "dynamo.indexer", "--block-size", "16", "--port", str(port),
                             "--threads", "1"], stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True, cwd=ROOT)
    try:
        assert wait_until(lambda: answers(port) or proc.poll() is not None, timeout=60) and proc.poll() is None, \
            proc.stdout.read() if proc.poll() is not None else "the indexer did not answer"
        yield port
    finally:
        proc.terminate()
        try:
            proc.wait(timeout=10)
        except subprocess.TimeoutExpired:
            proc.kill()
            proc.wait()


def test_dynamo_indexer_reads_pagedkv_events(start_server, indexer) -> None:
    endpoint, replay_endpoint = f"tcp://127.0.0.1:{free_port()}", f"tcp://127.0.0.1:{free_port()}"
    cfg = {"enable_kv_cache_events": True, "endpoint": endpoint, "replay_endpoint": replay_endpoint}
    # 8 pages of 16 tokens: a prompt of 120 tokens takes them all, evicting what the first prompt left cached
    server = start_server("--kv-events-config", json.dumps(cfg), "--num-pages", "8")
    assert post(indexer, "/register", {"instance_id": WORKER, "endpoint": endpoint, "replay_endpoint": replay_endpoint,
                                       "model_name": MODEL, "block_size": 16}) == {"status": "ok"}
    first = [3 + (i * 7) % 250 for i in range(40)]
    other = [200 - i % 190 for i in range(120)]

    async def complete(tokens: list[int]) -> None:
        async with Client(server.address) as client:
            await client.complete(tokens, max_tokens=1, ignore_eos=True)

    asyncio.run(complete(first))
    # (the first batches, sent before the indexer's connection was up, come back through the replay socket)
    assert wait_until(lambda: matched(indexer, first) == 32, timeout=30), matched(indexer, first)
    asyncio.run(complete(other))
    assert wait_until(lambda: matched(indexer, other) == 112, timeout=30), matched(indexer, other)
    assert matched(indexer, first) == 0  # its pages were handed out again: BlockRemoved reached Dynamo
