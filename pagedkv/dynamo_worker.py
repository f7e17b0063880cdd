"""``pagedkv dynamo-worker``: a pagedkv scheduler as an NVIDIA Dynamo backend (Dynamo 1.6's unified backend API,
``dynamo.common.backend``). One worker per scheduler; the scheduler keeps its executors and its page accounting.

- Registration: the scheduler's ModelInfo (block size, pages, max model length, served names); ``--model``'s
  directory gives Dynamo's frontend the tokenizer, config and chat template.
- Requests: Dynamo's pre-tokenized request mapped by ``pagedkv.dynamo_request`` (refusals name the field), streamed
  through ``pagedkv.client.Client``, so a stream the scheduler breaks (killed, restarted) resumes exactly.
- Cancel: a client that goes away (``abort`` / the context stopped) closes the stream, which aborts the request.
- Overload: the scheduler's ``RESOURCE_EXHAUSTED "queue full: ..."`` is raised as Dynamo's ``Disconnected``: its
  frontend migrates such a request to another worker (``--migration-limit`` >= 1) and keeps this one in rotation
  (``pagedkv.dynamo_errors``: each scheduler error's Dynamo exception, and what Dynamo 1.6.1 was measured to do).
- Unready: while the scheduler is not SERVING (draining at shutdown, restarting) the worker unregisters its endpoint
  instance from Dynamo's discovery, and registers it again once the scheduler serves; a request that reaches it
  meanwhile is raised as ``Disconnected`` at once (migrated), not held until the scheduler is back. A stream the
  scheduler ends with UNAVAILABLE after the client gave up resuming is raised as ``EngineShutdown`` (migrated; the
  router takes the worker out).
- KV events: the scheduler's ``KvEvents/Watch`` stream relayed to Dynamo's ``KvEventPublisher`` (``KvRelay``);
  page load pushed as ``ComponentSnapshot`` when it changes.
- Tenants: an assertion the edge gateway signed (``context.metadata['pagedkv-tenant']``) is checked with the fleet
  secret and the tenant asserted to the scheduler as a trusted hop (``x-pagedkv-hop`` + ``x-pagedkv-tenant``):
  ``pagedkv.dynamo_tenancy``.
"""

from __future__ import annotations

import argparse
import asyncio
import contextlib
import json
import os
import tempfile
from collections.abc import AsyncIterator
from pathlib import Path
from typing import Any

import grpc
import structlog
from dynamo._core import Context
from dynamo.common.backend import EngineConfig, LLMEngine, LlmRegistration, WorkerConfig
from dynamo.common.backend.publisher import ComponentSnapshot, KvEventSource, PushSource
from dynamo.common.backend.run import run
from dynamo.llm.exceptions import Disconnected, InvalidArgument
from grpc_health.v1 import health_pb2, health_pb2_grpc

from pagedkv import logs, trusted_hop
from pagedkv.api.v1 import api_pb2 as api
from pagedkv.client import Client
from pagedkv.dynamo_args import add_args
from pagedkv.dynamo_errors import SIDECAR_RESUME, dynamo_error
from pagedkv.dynamo_kv_relay import KvRelay, watch_events
from pagedkv.dynamo_request import (
    Refused,
    chunk_of,
    generate_request,
    prompt_logprobs_of,
)
from pagedkv.dynamo_tenancy import Tenancy

log = structlog.get_logger(service="dynamo-worker")

NO_TEMPLATE = ("{{ raise_exception('model %s has no chat template: start pagedkv dynamo-worker with "
               "--chat-template PATH to serve chat') }}")


def has_chat_template(model_dir: Path) -> bool:
    if (model_dir / "chat_template.jinja").is_file() or (model_dir / "chat_template.json").is_file():
        return True
    try:
        config = json.loads((model_dir / "tokenizer_config.json").read_text(encoding="utf-8"))
    except (OSError, ValueError):
        return False
    return bool(config.get("chat_template"))


class PagedkvEngine(LLMEngine):
    def __init__(self, args: argparse.Namespace, model_dir: Path) -> None:
        self.args = args
        self.model_dir = model_dir
        self.client: Client | None = None
        self.tenancy: Tenancy | None = None
        self.info = api.ModelInfoResponse()
        self.serving = True  # the scheduler's health as last checked (_watch_health)
        self.block_size = 0
        self.num_pages = 0
        self._aborted: dict[str, asyncio.Event] = {}
        self._tasks: list[asyncio.Task] = []
        self._loop: asyncio.AbstractEventLoop | None = None
        self._snapshots: Any = None
        self._endpoint: Any = None
        self._relay: KvRelay | None = None
        self._tokenizer: Any = None
        self._template_file: str = ""

    # ---- set-up --------------------------------------------------------------------------------------------
    @classmethod
    async def from_args(cls, argv: list[str] | None = None) -> tuple[PagedkvEngine, WorkerConfig]:
        p = argparse.ArgumentParser(prog="pagedkv dynamo-worker")
        add_args(p)
        return await cls.connected(p.parse_args(argv))

    @classmethod
    async def connected(cls, args: argparse.Namespace) -> tuple[PagedkvEngine, WorkerConfig]:
        """The engine, connected to its scheduler, and Dynamo's WorkerConfig (the served name the scheduler's)."""
        engine, config = cls.from_namespace(args)
        await engine.connect()
        config.served_model_name = engine.served_model_name
        return engine, config

    @classmethod
    def from_namespace(cls, args: argparse.Namespace) -> tuple[PagedkvEngine, WorkerConfig]:
        from pagedkv.models import resolve_model

        model_dir = resolve_model(args.model)
        engine = cls(args, model_dir)
        template, endpoint_types = args.chat_template or None, "chat,completions"
        if template is None and not has_chat_template(model_dir):
            fd, engine._template_file = tempfile.mkstemp(prefix="pagedkv-no-chat-template-", suffix=".jinja")
            with os.fdopen(fd, "w") as f:
                f.write(NO_TEMPLATE % model_dir.name)
            template, endpoint_types = engine._template_file, "completions"
        config = WorkerConfig(namespace=args.namespace, component=args.component, endpoint=args.endpoint,
                              model_name=str(model_dir), served_model_name=args.served_model_name or None,
                              endpoint_types=endpoint_types, custom_jinja_template=template,
                              discovery_backend=args.discovery_backend, request_plane=args.request_plane,
                              event_plane=args.event_plane, enable_kv_routing=not args.no_kv_events)
        return engine, config

    async def connect(self) -> None:
        """Reads the secrets and waits for the scheduler (its ModelInfo): before Dynamo's worker starts, so a bad
        flag or a scheduler that never serves ends the command with one line."""
        args = self.args
        self.tenancy = Tenancy.from_args(args)
        self.client = Client(args.address, metadata=self.tenancy.base, tls_ca=args.tls_ca,
                             tls_server_name=args.tls_server_name, resume=SIDECAR_RESUME)
        try:
            await self.client.wait_ready(args.connect_timeout)
            self.info = await self.client.model_info()
        except (TimeoutError, grpc.aio.AioRpcError) as err:
            await self.cleanup()
            said = f"{err.code().name}: {err.details()}" if isinstance(err, grpc.aio.AioRpcError) else str(err)
            raise ConnectionError(f"scheduler {args.address}: {said}") from None
        self.block_size, self.num_pages = self.info.block_size, self.info.num_pages

    @property
    def served_model_name(self) -> str:
        names = list(self.info.served_model_names) or [self.info.model]
        return self.args.served_model_name or names[0]

    async def start(self, worker_id: int) -> EngineConfig:
        self._loop = asyncio.get_running_loop()
        if self.client is None:
            await self.connect()
        info, served = self.info, self.served_model_name
        log.info("dynamo_worker_start", address=self.args.address, model_dir=str(self.model_dir), served=served,
                 block_size=info.block_size, num_pages=info.num_pages, max_model_len=info.max_model_len,
                 worker_id=worker_id)
        self._tasks.append(asyncio.create_task(self._watch_health()))
        names = list(info.served_model_names) or [info.model]
        return EngineConfig(model=str(self.model_dir), served_model_name=served,
                            model_aliases=[n for n in names if n != served],
                            llm=LlmRegistration(context_length=info.max_model_len,
                                                kv_cache_block_size=info.block_size, total_kv_blocks=info.num_pages))

    async def on_endpoint_ready(self, endpoint) -> None:
        self._endpoint = endpoint

    async def cleanup(self) -> None:
        tasks, self._tasks = self._tasks, []
        for task in tasks:
            task.cancel()
        for task in tasks:
            with contextlib.suppress(asyncio.CancelledError, Exception):
                await task
        if self.client is not None:
            client, self.client = self.client, None
            await client.close()
        if self._template_file:
            with contextlib.suppress(OSError):
                os.unlink(self._template_file)
            self._template_file = ""

    # ---- KV events and load ----------------------------------------------------------------------------------
    async def kv_event_sources(self) -> list[KvEventSource]:
        return [PushSource(on_ready=self._on_publisher, dp_rank=0)]

    def _on_publisher(self, publisher) -> None:
        """Dynamo hands over its KvEventPublisher (from any thread): relay the scheduler's Watch stream into it."""
        self._relay = KvRelay(publisher, self.block_size, log)

        def begin() -> None:
            self._tasks.append(asyncio.create_task(self._relay_events()))

        assert self._loop is not None
        self._loop.call_soon_threadsafe(begin)

    async def _relay_events(self) -> None:
        assert self.client is not None and self._relay is not None
        auth = self.tenancy.base if self.tenancy else ()
        hop = trusted_hop.hop_metadata(self.tenancy.hop_secret) if self.tenancy and self.tenancy.hop_secret else ()
        await watch_events(self.client.channel, (*auth, *hop), self._relay, log)

    def component_metrics_dp_ranks(self) -> list[int]:
        return [0]

    def attach_snapshot_publisher(self, publisher: Any) -> None:
        self._snapshots = publisher

        def begin() -> None:
            self._tasks.append(asyncio.create_task(self._push_load()))

        if self._loop is not None:
            self._loop.call_soon_threadsafe(begin)

    async def _push_load(self) -> None:
        """The scheduler's pages used / capacity, pushed when they change (at most every --load-interval s)."""
        last = None
        while self.client is not None:
            try:
                info = await self.client.model_info()
            except grpc.aio.AioRpcError:
                await asyncio.sleep(self.args.load_interval)
                continue
            if not info.cluster_view:
                log.warning("dynamo_load_unavailable", reason="ModelInfo shows this worker's tenant no cluster "
                            "counts: give --api-key an admin tenant's key; no load is pushed")
                return
            now = (info.num_used_pages, info.num_pages)
            if now != last and info.num_pages:
                self._snapshots.publish(0, ComponentSnapshot(
                    kv_used_blocks=now[0], kv_total_blocks=now[1], gpu_cache_usage=now[0] / now[1], dp_rank=0))
                last = now
            await asyncio.sleep(self.args.load_interval)

    # ---- readiness -------------------------------------------------------------------------------------------
    async def _watch_health(self) -> None:
        """Out of Dynamo's discovery while the scheduler is not SERVING, back in once it is."""
        assert self.client is not None
        stub = health_pb2_grpc.HealthStub(self.client.channel)
        registered = True
        while True:
            try:
                r = await stub.Check(health_pb2.HealthCheckRequest(service=""), timeout=2.0)
                serving = r.status == health_pb2.HealthCheckResponse.SERVING
            except grpc.aio.AioRpcError:
                serving = False
            self.serving = serving
            if serving != registered and self._endpoint is not None:
                try:
                    if serving:
                        await self._endpoint.register_endpoint_instance()
                    else:
                        await self._endpoint.unregister_endpoint_instance()
                    registered = serving
                    log.info("dynamo_worker_ready" if serving else "dynamo_worker_unready", address=self.args.address)
                except Exception as err:  # noqa: BLE001 - discovery unreachable: tried again next tick
                    log.warning("dynamo_discovery_update_failed", serving=serving, error=str(err))
            await asyncio.sleep(self.args.health_interval)

    # ---- requests --------------------------------------------------------------------------------------------
    async def abort(self, context: Context) -> None:
        event = self._aborted.get(context.id())
        if event is not None:
            event.set()

    def _decode(self, token_id: int) -> str | None:
        """A top-logprob token's text (Dynamo's chunks carry it); None for a model without tokenizer.json."""
        if self._tokenizer is None:
            from tokenizers import Tokenizer

            path = self.model_dir / "tokenizer.json"
            self._tokenizer = Tokenizer.from_file(str(path)) if path.is_file() else False
        return self._tokenizer.decode([token_id], skip_special_tokens=False) if self._tokenizer else None

    async def generate(self, request: dict, context: Context) -> AsyncIterator[dict]:
        assert self.client is not None and self.tenancy is not None
        request_id = context.id()
        try:
            req = generate_request(request, request_id)
        except Refused as err:
            raise InvalidArgument(str(err)) from None
        metadata = self.tenancy.metadata(context.metadata)
        if not self.serving:  # draining or restarting: Dynamo's frontend tries another worker at once (migration)
            raise Disconnected(f"pagedkv scheduler {self.args.address} is not serving (draining or restarting)")
        want_logprobs = req.sampling.logprobs
        stopped = asyncio.ensure_future(context.async_killed_or_stopped())
        aborted = self._aborted.setdefault(request_id, asyncio.Event())
        abort_wait = asyncio.ensure_future(aborted.wait())
        stream = self.client.stream(req, metadata)
        prompt = api.Prompt()
        try:
            while True:
                step = asyncio.ensure_future(anext(stream))
                done, _ = await asyncio.wait({step, stopped, abort_wait}, return_when=asyncio.FIRST_COMPLETED)
                if step not in done:  # the client went away: closing the stream aborts the request in pagedkv
                    step.cancel()
                    with contextlib.suppress(asyncio.CancelledError, StopAsyncIteration, grpc.aio.AioRpcError):
                        await step
                    log.info("dynamo_request_cancelled", request_id=request_id)
                    return
                try:
                    msg = step.result()
                except StopAsyncIteration:
                    return
                if msg.HasField("prompt"):
                    prompt.MergeFrom(msg.prompt)
                if not msg.token_ids and not msg.finish_reason:
                    continue  # the prompt's own message (prompt log-probabilities): kept for the last chunk
                chunk = chunk_of(msg, want_logprobs, self._decode)
                if msg.finish_reason and prompt.logprobs:
                    chunk["engine_data"] = {"prompt_logprobs": prompt_logprobs_of(prompt, self._decode)}
                yield chunk
        except grpc.aio.AioRpcError as err:
            log.info("dynamo_request_failed", request_id=request_id, code=err.code().name, details=err.details())
            raise dynamo_error(err) from None
        finally:
            for fut in (stopped, abort_wait):
                fut.cancel()
            self._aborted.pop(request_id, None)
            await stream.aclose()


def main(args: argparse.Namespace) -> int:
    """``pagedkv dynamo-worker``: runs until Dynamo's worker stops it (SIGTERM/SIGINT: it drains, then cleans up)."""
    logs.configure("dynamo-worker", json=logs.wants_json(args.log_format))

    async def factory(_argv):
        return await PagedkvEngine.connected(args)

    run(PagedkvEngine, engine_factory=factory)
    return 0
