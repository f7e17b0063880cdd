"""Prompt text is tokenized off the event loop, and text beyond the byte limit never reaches the tokenizer (in
one process; the bounds through real processes: tests/e2e/test_input_bounds.py)."""

from __future__ import annotations

import asyncio

import pytest

from pagedkv.api.v1 import api_pb2 as api

pytestmark = pytest.mark.unit

MAX_LEN = 256


class _WaitingTokenizer:
    """Records the thread it runs on, and returns only once the event loop has run on while it waited (``loop_ran``,
    set from the loop): a tokenizer that ran on the loop thread would wait out its 30 s bound instead."""

    def __init__(self) -> None:
        import threading

        self.threads: list[int] = []
        self.loop_ran = threading.Event()
        self.saw_loop_run: list[bool] = []

    def __call__(self, text: str, add_special_tokens: bool = True) -> dict:
        import threading

        self.threads.append(threading.get_ident())
        self.saw_loop_run.append(self.loop_ran.wait(30))
        return {"input_ids": [1] + list(text.encode())}


def test_tokenizing_runs_off_the_event_loop_and_only_within_the_limit():
    """While one prompt is tokenized the event loop keeps running (other streams keep streaming); text over
    the limit never reaches the tokenizer."""
    import threading

    from pagedkv.bounds import InvalidRequest
    from scheduler_svc.api import GenerationService
    from scheduler_svc.validation import Limits

    tokenizer = _WaitingTokenizer()
    service = GenerationService(None, tokenizer, Limits(max_model_len=MAX_LEN, vocab_size=259, max_prompt_bytes=100),
                                {}, None)

    async def scenario():
        ticks = 0

        async def ticker():  # another stream's work on the loop: the tokenizer returns once it has run 10 times
            nonlocal ticks
            while True:
                await asyncio.sleep(0 if ticks < 10 else 0.01)
                ticks += 1
                if ticks == 10:
                    tokenizer.loop_ran.set()

        task = asyncio.create_task(ticker())
        ids = await service.prompts.ids(api.GenerateRequest(text="hello"))
        task.cancel()
        with pytest.raises(InvalidRequest, match="prompt.text: at least 101 bytes of UTF-8; at most 100 "):
            await service.prompts.ids(api.GenerateRequest(text="x" * 101))
        return ids, threading.get_ident()

    ids, loop_thread = asyncio.run(scenario())
    assert ids == [1, *b"hello"]
    assert len(tokenizer.threads) == 1 and tokenizer.threads[0] != loop_thread
    assert tokenizer.saw_loop_run == [True], "the event loop did not run while the prompt was tokenized"
