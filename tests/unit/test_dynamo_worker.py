"""pagedkv dynamo-worker's engine against a stand-in Context and a stand-in scheduler stream (Dynamo's docs, "writing
unified backends", step 7): chunks, cancel, the errors Dynamo gets, tenant assertions; and the KV relay's calls on
Dynamo's publisher. Skipped without Dynamo (make install-dynamo)."""

from __future__ import annotations

import argparse
import asyncio
from pathlib import Path

import grpc
import pytest

pytest.importorskip("dynamo.common.backend", reason="NVIDIA Dynamo is not installed (make install-dynamo)")

from dynamo.llm.exceptions import Disconnected, EngineShutdown, InvalidArgument  # noqa: E402

from pagedkv.api.v1 import api_pb2 as api  # noqa: E402
from pagedkv.dynamo_errors import dynamo_error  # noqa: E402
from pagedkv.dynamo_kv_relay import AllCleared, KvRelay, RemovedPages, StoredPages  # noqa: E402
from pagedkv.dynamo_tenancy import Tenancy  # noqa: E402
from pagedkv.dynamo_worker import PagedkvEngine, has_chat_template  # noqa: E402
from pagedkv.fleet_salt import make_assertion  # noqa: E402
from pagedkv.trusted_hop import HOP_HEADER, TENANT_HEADER  # noqa: E402

pytestmark = pytest.mark.unit

FLEET = b"fleet-secret-0123456789"
HOP = "hop-secret-0123456789"


class FakeContext:
    def __init__(self, rid: str = "req-1", metadata: dict | None = None) -> None:
        self._id = rid
        self.metadata = metadata or {}
        self.stop = asyncio.get_running_loop().create_future()

    def id(self) -> str:
        return self._id

    def is_stopped(self) -> bool:
        return self.stop.done()

    def async_killed_or_stopped(self):
        return self.stop


class FakeClient:
    """Client.stream's stand-in: yields ``messages`` (then raises ``error``), or waits forever after them; records
    the request, its metadata and whether the stream was closed."""

    def __init__(self, messages=(), error: Exception | None = None, hang: bool = False) -> None:
        self.messages, self.error, self.hang = list(messages), error, hang
        self.requests: list[tuple[api.GenerateRequest, tuple]] = []
        self.closed = False

    def stream(self, request, metadata):
        self.requests.append((request, tuple(metadata)))

        async def gen():
            try:
                for msg in self.messages:
                    yield msg
                if self.error is not None:
                    raise self.error
                if self.hang:
                    await asyncio.Event().wait()
            finally:
                self.closed = True

        return gen()


def engine_with(client: FakeClient, tenancy: Tenancy | None = None) -> PagedkvEngine:
    engine = PagedkvEngine(argparse.Namespace(), Path("/nonexistent"))
    engine.client = client
    engine.tenancy = tenancy or Tenancy((), b"", "", False)
    engine._decode = lambda token: f"<{token}>"
    return engine


def rpc_error(code: grpc.StatusCode, details: str) -> grpc.aio.AioRpcError:
    return grpc.aio.AioRpcError(code, grpc.aio.Metadata(), grpc.aio.Metadata(), details)


REQUEST = {"token_ids": [1, 5, 6], "sampling_options": {"seed": 7, "temperature": 0.8},
           "output_options": {"logprobs": 0}, "stop_conditions": {"max_tokens": 3}}


async def collect(engine, request, context) -> list[dict]:
    return [chunk async for chunk in engine.generate(request, context)]


def test_a_stream_becomes_dynamo_chunks_with_usage():
    async def main():
        client = FakeClient([
            api.GenerateResponse(token_ids=[10], logprobs=[-0.1], seed=7),
            api.GenerateResponse(token_ids=[11, 2], logprobs=[-0.2, -0.3], finish_reason=api.FINISH_REASON_STOP,
                                 usage=api.Usage(prompt_tokens=3, completion_tokens=3, cached_tokens=0)),
        ])
        chunks = await collect(engine_with(client), REQUEST, FakeContext())
        req, _ = client.requests[0]
        assert req.request_id == "req-1" and list(req.token_ids.ids) == [1, 5, 6] and req.sampling.seed == 7
        return chunks, client

    chunks, client = asyncio.run(main())
    assert chunks == [
        {"token_ids": [10], "index": 0, "log_probs": [pytest.approx(-0.1)]},
        {"token_ids": [11, 2], "index": 0, "log_probs": [pytest.approx(-0.2), pytest.approx(-0.3)],
         "finish_reason": "stop", "completion_usage": {"prompt_tokens": 3, "completion_tokens": 3, "total_tokens": 6,
                                                       "prompt_tokens_details": {"cached_tokens": 0}}}]
    assert client.closed


def test_a_client_that_goes_away_closes_the_stream():
    async def main():
        client = FakeClient([api.GenerateResponse(token_ids=[10])], hang=True)
        context = FakeContext()
        engine = engine_with(client)
        chunks = []

        async def consume():
            async for chunk in engine.generate(REQUEST, context):
                chunks.append(chunk)
                context.stop.set_result(True)  # the frontend's client disconnected after the first token

        await asyncio.wait_for(consume(), 10)
        return chunks, client, engine

    chunks, client, engine = asyncio.run(main())
    assert chunks == [{"token_ids": [10], "index": 0, "log_probs": []}] and client.closed
    assert engine._aborted == {}


def test_abort_closes_the_stream():
    async def main():
        client = FakeClient(hang=True)
        engine = engine_with(client)
        context = FakeContext("req-9")
        task = asyncio.create_task(collect(engine, REQUEST, context))
        while not client.requests:
            await asyncio.sleep(0)
        await engine.abort(context)
        return await asyncio.wait_for(task, 10), client

    chunks, client = asyncio.run(main())
    assert chunks == [] and client.closed


@pytest.mark.parametrize(("code", "details", "raised"), [
    (grpc.StatusCode.RESOURCE_EXHAUSTED, "queue full: tenant default has 64 waiting", Disconnected),
    (grpc.StatusCode.RESOURCE_EXHAUSTED, "message larger than max", InvalidArgument),
    (grpc.StatusCode.INVALID_ARGUMENT, "sampling.top_logprobs: 50 > max_logprobs 20", InvalidArgument),
    (grpc.StatusCode.PERMISSION_DENIED, "x-pagedkv-tenant: only a trusted hop may send it", InvalidArgument),
    (grpc.StatusCode.UNAVAILABLE, "shutting down", EngineShutdown),
])
def test_scheduler_errors_become_dynamos(code, details, raised):
    async def main():
        client = FakeClient(error=rpc_error(code, details))
        with pytest.raises(raised) as err:
            await collect(engine_with(client), REQUEST, FakeContext())
        return err

    err = asyncio.run(main())
    assert details in str(err.value)
    assert isinstance(dynamo_error(rpc_error(code, details)), raised)


def test_a_field_that_cannot_map_is_invalid_argument_naming_it():
    async def main():
        client = FakeClient()
        with pytest.raises(InvalidArgument, match="sampling_options.use_beam_search"):
            await collect(engine_with(client), {"token_ids": [1], "sampling_options": {"use_beam_search": True}},
                          FakeContext())
        return client

    assert asyncio.run(main()).requests == []  # refused before the scheduler saw it


def test_a_signed_tenant_is_asserted_to_the_scheduler_as_a_trusted_hop():
    tenancy = Tenancy((("authorization", "Bearer k"),), FLEET, HOP, require_tenant=False)
    token = make_assertion(FLEET, "alpha")
    assert tenancy.metadata({"pagedkv-tenant": token}) == (
        ("authorization", "Bearer k"), (HOP_HEADER, HOP), (TENANT_HEADER, "alpha"))
    assert tenancy.metadata({}) == (("authorization", "Bearer k"),)
    with pytest.raises(InvalidArgument, match="x-dynamo-meta-pagedkv-tenant: bad MAC"):
        tenancy.metadata({"pagedkv-tenant": make_assertion(b"another-fleet-secret-xx", "alpha")})
    with pytest.raises(InvalidArgument, match="x-dynamo-meta-pagedkv-tenant: malformed"):
        tenancy.metadata({"pagedkv-tenant": "alpha"})
    with pytest.raises(InvalidArgument, match="x-dynamo-meta-pagedkv-tenant: missing"):
        Tenancy((), FLEET, HOP, require_tenant=True).metadata({})
    with pytest.raises(InvalidArgument, match="no fleet secret"):
        Tenancy((), b"", "", require_tenant=False).metadata({"pagedkv-tenant": token})


def test_the_tenant_reaches_the_stream_metadata():
    async def main():
        client = FakeClient([api.GenerateResponse(finish_reason=api.FINISH_REASON_LENGTH)])
        engine = engine_with(client, Tenancy((), FLEET, HOP, False))
        await collect(engine, REQUEST, FakeContext(metadata={"pagedkv-tenant": make_assertion(FLEET, "beta")}))
        return client

    _, metadata = asyncio.run(main()).requests[0]
    assert (TENANT_HEADER, "beta") in metadata and (HOP_HEADER, HOP) in metadata


def test_chat_template_detection(tmp_path):
    assert not has_chat_template(tmp_path)
    (tmp_path / "tokenizer_config.json").write_text('{"chat_template": "{{ messages }}"}')
    assert has_chat_template(tmp_path)


# ---- the KV relay --------------------------------------------------------------------------------------------
class FakePublisher:
    def __init__(self) -> None:
        self.calls: list[tuple] = []
        self.held: set[int] = set()
        self.lora: dict[int, str | None] = {}  # block hash -> the lora_name it was stored with

    def publish_stored(self, token_ids, num_block_tokens, block_hashes, parent_hash=None, cache_salt=None,
                       lora_name=None):
        self.calls.append(("stored", tuple(block_hashes), parent_hash, tuple(token_ids), tuple(num_block_tokens),
                           cache_salt))
        self.held |= set(block_hashes)
        self.lora.update(dict.fromkeys(block_hashes, lora_name))

    def publish_removed(self, block_hashes):
        self.calls.append(("removed", tuple(sorted(block_hashes))))
        self.held -= set(block_hashes)


class Log:
    def __getattr__(self, name):
        return lambda *a, **k: None


def relay() -> tuple[KvRelay, FakePublisher]:
    pub = FakePublisher()
    return KvRelay(pub, 2, Log()), pub


def test_relay_stores_with_salt_parent_and_tokens():
    r, pub = relay()
    r.apply_batch(0, [AllCleared(), StoredPages((11, 12), None, (1, 2, 3, 4), "GPU", "saltA")], False)
    r.apply_batch(1, [StoredPages((13,), 12, (5, 6), "GPU", "saltA")], False)
    assert pub.calls == [("stored", (11, 12), None, (1, 2, 3, 4), (2, 2), "saltA"),
                         ("stored", (13,), 12, (5, 6), (2,), "saltA")]
    r.apply_batch(2, [StoredPages((14,), None, (7, 8), "GPU", "")], False)
    assert pub.calls[-1][-1] is None  # the default tenant's pages: unsalted


def test_relay_removes_a_page_only_when_no_medium_holds_it():
    r, pub = relay()
    r.apply_batch(0, [StoredPages((11, 12), None, (1, 2, 3, 4), "GPU", "")], False)
    # spilled to the host tier, then dropped from the device: still findable, so nothing is said
    r.apply_batch(1, [StoredPages((12,), 11, (3, 4), "CPU", ""), RemovedPages((12,), "GPU")], False)
    assert pub.held == {11, 12} and len(pub.calls) == 1
    r.apply_batch(2, [RemovedPages((11, 12), "GPU")], False)
    assert pub.calls[-1] == ("removed", (11,)) and pub.held == {12}
    r.apply_batch(3, [RemovedPages((12,), "CPU")], False)
    assert pub.held == set()


def test_relay_stores_only_the_new_pages_of_an_event_in_runs():
    r, pub = relay()
    r.apply_batch(0, [StoredPages((12,), 11, (3, 4), "GPU", "")], False)
    r.apply_batch(1, [StoredPages((11, 12, 13), None, (1, 2, 3, 4, 5, 6), "GPU", "")], False)
    assert pub.calls[1:] == [("stored", (11,), None, (1, 2), (2,), None), ("stored", (13,), 12, (5, 6), (2,), None)]


def test_cleared_removes_everything_announced():
    r, pub = relay()
    r.apply_batch(0, [StoredPages((11, 12), None, (1, 2, 3, 4), "GPU", "")], False)
    r.apply_batch(1, [AllCleared()], False)
    assert pub.calls[-1] == ("removed", (11, 12)) and pub.held == set() and r.held == {}


def test_a_snapshot_replaces_the_view():
    r, pub = relay()
    r.apply_batch(0, [StoredPages((11, 12), None, (1, 2, 3, 4), "GPU", ""),
                      StoredPages((21,), None, (9, 9), "GPU", "")], False)
    # reconnected after a restart: the scheduler holds 11 and a new 31, not 12 or 21
    r.apply_batch(0, [StoredPages((11,), None, (1, 2), "GPU", ""), StoredPages((31,), None, (7, 7), "CPU", "s")], True)
    assert pub.held == {11, 31} and set(r.held) == {11, 31} and r.seq == 0
    assert ("removed", (12, 21)) in pub.calls and pub.calls[-1] == ("stored", (31,), None, (7, 7), (2,), "s")


def test_the_page_load_is_pushed_when_it_changes():
    infos = [api.ModelInfoResponse(cluster_view=True, num_pages=100, num_used_pages=used) for used in (0, 0, 7, 7, 9)]

    class Client:
        async def model_info(self):
            if not infos:
                engine.client = None  # ends the loop
                return api.ModelInfoResponse(cluster_view=True, num_pages=100, num_used_pages=9)
            return infos.pop(0)

    class Snapshots:
        def __init__(self) -> None:
            self.pushed = []

        def publish(self, rank, snap) -> None:
            self.pushed.append((rank, snap.kv_used_blocks, snap.kv_total_blocks, snap.gpu_cache_usage))

    engine = PagedkvEngine(argparse.Namespace(load_interval=0), Path("/nonexistent"))
    engine.client, engine._snapshots = Client(), Snapshots()
    asyncio.run(engine._push_load())
    assert engine._snapshots.pushed == [(0, 0, 100, 0.0), (0, 7, 100, 0.07), (0, 9, 100, 0.09)]


def test_no_load_is_pushed_without_the_cluster_view():
    class Client:
        async def model_info(self):
            return api.ModelInfoResponse(cluster_view=False, num_pages=100)

    engine = PagedkvEngine(argparse.Namespace(load_interval=0), Path("/nonexistent"))
    engine.client, engine._snapshots = Client(), None  # (a push would fail on None)
    asyncio.run(asyncio.wait_for(engine._push_load(), 10))


def worker_args(model: Path, **kw) -> argparse.Namespace:
    from pagedkv.dynamo_args import add_args

    p = argparse.ArgumentParser()
    add_args(p)
    return p.parse_args(["--model", str(model), "--discovery-backend", "file",
                         *[x for k, v in kw.items() for x in (f"--{k.replace('_', '-')}", v)]])


def test_a_model_without_a_chat_template_registers_for_completions_only(tmp_path):
    (tmp_path / "config.json").write_text("{}")
    engine, config = PagedkvEngine.from_namespace(worker_args(tmp_path))
    try:
        assert config.endpoint_types == "completions" and config.model_name == str(tmp_path.resolve())
        template = Path(config.custom_jinja_template).read_text()
        assert "raise_exception" in template and "--chat-template" in template  # chat answers why, if reached
    finally:
        asyncio.run(engine.cleanup())
    assert not Path(config.custom_jinja_template).exists()  # cleanup removes it
    (tmp_path / "chat.jinja").write_text("{{ messages }}")
    _, config = PagedkvEngine.from_namespace(worker_args(tmp_path, chat_template=str(tmp_path / "chat.jinja")))
    assert config.endpoint_types == "chat,completions" and config.custom_jinja_template == str(tmp_path / "chat.jinja")
    (tmp_path / "chat_template.jinja").write_text("{{ messages }}")
    _, config = PagedkvEngine.from_namespace(worker_args(tmp_path))
    assert config.endpoint_types == "chat,completions" and config.custom_jinja_template is None


def test_a_request_while_the_scheduler_is_not_serving_goes_back_to_dynamo_at_once():
    async def main():
        client = FakeClient([api.GenerateResponse(finish_reason=api.FINISH_REASON_LENGTH)])
        engine = engine_with(client)
        engine.args = argparse.Namespace(address="127.0.0.1:1")
        engine.serving = False
        with pytest.raises(Disconnected, match="not serving"):
            await collect(engine, REQUEST, FakeContext())
        return client

    assert asyncio.run(main()).requests == []
