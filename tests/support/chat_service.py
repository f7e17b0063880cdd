"""A GenerationService over a cluster of one FakeExecutor with a byte tokenizer saved with (and without) a chat
template, as the scheduler's chat tests drive it (tests/unit/test_chat.py, tests/unit/test_chat_tools.py)."""

from __future__ import annotations

import asyncio
import threading

from pagedkv.api.v1 import api_pb2 as api
from pagedkv.client import Client
from pagedkv.tools.random_model import build_byte_tokenizer
from scheduler_svc import cluster as cluster_mod
from scheduler_svc import engine as engine_mod
from scheduler_svc.api import GenerationService
from scheduler_svc.validation import Limits
from tests.support.chat_template import TEMPLATE
from tests.support.fake_cluster import Box, FakeClient, new_cluster
from tests.support.fake_grpc import Context

LIMIT = 200  # --max-prompt-bytes


def chat_tokenizers(tmp_path_factory):
    """(with a chat template, without one), each saved and loaded back as a checkpoint's would be."""
    from transformers import AutoTokenizer

    plain_dir = tmp_path_factory.mktemp("plain")
    build_byte_tokenizer(plain_dir)
    chat_dir = tmp_path_factory.mktemp("chat")
    tok = AutoTokenizer.from_pretrained(str(plain_dir))
    tok.chat_template = TEMPLATE
    tok.save_pretrained(str(chat_dir))
    return AutoTokenizer.from_pretrained(str(chat_dir)), AutoTokenizer.from_pretrained(str(plain_dir))


class Spy:
    """Wraps a tokenizer; records the threads apply_chat_template ran on."""

    def __init__(self, tokenizer) -> None:
        self._tok = tokenizer
        self.template_threads: list[str] = []

    def __getattr__(self, name):
        return getattr(self._tok, name)

    def __call__(self, *a, **kw):
        return self._tok(*a, **kw)

    def apply_chat_template(self, *a, **kw):
        self.template_threads.append(threading.current_thread().name)
        return self._tok.apply_chat_template(*a, **kw)


def run_service(tokenizer, scenario, monkeypatch, limit: int = LIMIT):
    """Runs ``scenario(service)`` against a GenerationService on one FakeExecutor."""
    monkeypatch.setattr(cluster_mod, "ExecutorClient", FakeClient)
    monkeypatch.setattr(engine_mod, "RECONNECT_POLL", 0.05)
    FakeClient.boxes = {"a:1": Box(64)}

    async def main():
        c = new_cluster()
        c.start()
        c.set_addresses({"a:1"})
        await asyncio.wait_for(c.any_up.wait(), 5)
        import structlog
        service = GenerationService(c, tokenizer, Limits(max_model_len=512, vocab_size=300, max_prompt_bytes=limit),
                                    {}, structlog.get_logger())
        try:
            return await scenario(service)
        finally:
            await c.stop()
    return asyncio.run(main())


async def generate(service, request) -> list[api.GenerateResponse]:
    return [m async for m in service.Generate(request, Context())]


def chat_request(messages, add_generation_prompt=None, max_tokens=3) -> api.GenerateRequest:
    req = Client.build_request(messages=messages, add_generation_prompt=add_generation_prompt, max_tokens=max_tokens)
    assert req.WhichOneof("prompt") == "chat"
    return req
