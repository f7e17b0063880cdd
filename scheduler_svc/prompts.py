"""The scheduler's tokenizer work, on its one thread (``Prompts``): a request's prompt as token ids (text, token ids
or a chat rendered by its template), cut to its last truncate_prompt_tokens; Tokenize's and Detokenize's answers;
the bad words' token sequences; all of a Generate request's at once (``prepare``: the chat render and tokens stages of
its way in, scheduler_svc/intake.py). Every input is bounded before the tokenizer or a template sees it. A request's own
chat template (--trust-request-chat-template) renders in a worker process (template_pool.TemplatePool: time, memory
and output bounds, and a bound per tenant), never on the tokenizer thread every tenant shares; only its text is
tokenized there. The model's own templates render on the thread (they are the operator's, and known).

One rule says whether special tokens (BOS) are added (``adds_special_tokens``), for Generate and Tokenize alike."""

from __future__ import annotations

import asyncio
from collections.abc import Callable
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass
from typing import TypeVar

from pagedkv.api.v1 import api_pb2 as api
from pagedkv.bounds import InvalidRequest, check_text_bytes
from scheduler_svc import chat as chats
from scheduler_svc.template_pool import TemplatePool
from scheduler_svc.validation import Limits, bad_words_token_ids

T = TypeVar("T")


def adds_special_tokens(kind: str, requested: bool | None = None) -> bool:
    """Whether the tokenizer adds its special tokens (BOS, as its post-processor says) to a prompt of ``kind``
    (text, chat): text yes unless the caller asks otherwise (Tokenize's add_special_tokens; transformers' and vLLM's
    default), chat never (the template writes them, as transformers' apply_chat_template does)."""
    if kind == "chat":
        return False
    return True if requested is None else requested


def truncated(ids: list[int], keep: int, max_model_len: int) -> list[int]:
    """The last ``keep`` prompt tokens (vLLM's truncate_prompt_tokens; 0: the prompt as it is), taken before the
    prompt's length is checked; ``keep`` in [1, max_model_len]."""
    if keep == 0:
        return ids
    if not 1 <= keep <= max_model_len:
        raise InvalidRequest(f"truncate_prompt_tokens: {keep}; must be in [1, max_model_len={max_model_len}] (the "
                             "prompt tokens kept: the last ones), or 0 for the whole prompt")
    return ids[-keep:]


@dataclass(slots=True)
class PromptIds:
    """What the tokenizer makes of a Generate request (``Prompts.prepare``)."""

    ids: list[int]  # the prompt's, only its last truncate_prompt_tokens when that is set
    tools: chats.ToolUse  # how its output is read into tool calls, and its constraint (a chat with tools)
    bad_words_ids: list[list[int]]  # sampling.bad_words, tokenized (bad_words_token_ids)
    text: str  # the prompt's text, as the first message gives it (responses.prompt_message)


class Prompts:
    """Tokenizing and chat templates, off the event loop (other streams keep streaming) and one at a time: a fast
    tokenizer is not safe to call from several threads at once, and each input is bounded before it gets there."""

    def __init__(self, tokenizer, limits: Limits, trust_request_templates: bool = False,
                 tool_call_parser: str = "") -> None:
        self.tokenizer, self.limits = tokenizer, limits
        self.trust_request_templates = trust_request_templates  # --trust-request-chat-template
        self.tool_call_parser = tool_call_parser  # --tool-call-parser ("": the template's markup says)
        self._thread = ThreadPoolExecutor(max_workers=1, thread_name_prefix="tokenize")
        self._templates: TemplatePool | None = None  # requests' own templates' workers (default limits unless set)

    def use_template_pool(self, pool: TemplatePool) -> None:
        """Requests' own templates render in ``pool`` (the scheduler's, with its --chat-template-* limits)."""
        self._templates = pool

    def _template_pool(self) -> TemplatePool:
        if self._templates is None:
            self._templates = TemplatePool()
        return self._templates

    async def close(self) -> None:
        """Ends the template workers (the scheduler's shutdown)."""
        if self._templates is not None:
            await self._templates.close()

    def _special_tokens(self) -> dict[str, str]:
        """The model's named special tokens, as the template sees them (bos_token, eos_token, ...)."""
        named = getattr(self.tokenizer, "special_tokens_map", None) or {}
        return {k: v for k, v in named.items() if isinstance(v, str)}

    async def run(self, fn: Callable[[], T]) -> T:
        """``fn()`` on the tokenizer thread."""
        return await asyncio.get_running_loop().run_in_executor(self._thread, fn)

    def _ids(self, text: str, add_special_tokens: bool) -> list[int]:
        return self.tokenizer(text, add_special_tokens=add_special_tokens)["input_ids"]

    async def text_ids(self, text: str, field: str, add_special_tokens: bool | None = None,
                       tokens: bool = False):
        """Token ids of ``text`` (and with ``tokens``, their strings); the text bounded first."""
        check_text_bytes(text, field, self.limits.prompt_bytes)
        special = adds_special_tokens("text", add_special_tokens)

        def encode():
            ids = self._ids(text, special)
            return (ids, self.tokenizer.convert_ids_to_tokens(ids)) if tokens else ids
        return await self.run(encode)

    async def chat_ids(self, chat: api.Chat, field: str, tokens: bool = False, tenant: str = ""):
        """Token ids (and with ``tokens``, their strings) of the prompt the chat template renders from ``chat``;
        the request is checked (chat.check_chat) before the template runs. A request's own template renders in a
        worker, counted against ``tenant``'s renders at once."""
        prompt = chats.check_chat(chat, field, self.limits.prompt_bytes, getattr(self.tokenizer, "chat_template", None),
                                  self.trust_request_templates)
        text = None
        if prompt.request_template:
            job = chats.render_job(prompt, self._special_tokens(), self.limits.prompt_bytes)
            text = await self._template_pool().render(job, tenant, field)

        def render():
            rendered = text if text is not None else chats.render(self.tokenizer, prompt, field)
            ids = self._ids(rendered, adds_special_tokens("chat"))
            return (ids, self.tokenizer.convert_ids_to_tokens(ids)) if tokens else ids
        return await self.run(render)

    def tool_use(self, request: api.GenerateRequest) -> chats.ToolUse:
        """How a Generate request's output is read into tool calls, and its constraint (a chat with tools; its
        prompt checked first: ``ids``)."""
        if request.WhichOneof("prompt") != "chat":
            return chats.ToolUse()
        return chats.tool_use(request.chat, "prompt.chat", getattr(self.tokenizer, "chat_template", None),
                              self.tool_call_parser)

    async def ids(self, request: api.GenerateRequest, tenant: str = "") -> list[int]:
        """A Generate request's prompt as token ids, only its last truncate_prompt_tokens when that is set;
        ``tenant``: whose request it is (a bound on its own templates' renders at once)."""
        which = request.WhichOneof("prompt")
        if which == "chat":
            ids = await self.chat_ids(request.chat, "prompt.chat", tenant=tenant)
        elif which == "text":
            if not request.text:
                raise InvalidRequest("prompt.text: must not be empty")
            ids = await self.text_ids(request.text, "prompt.text")
        elif which == "token_ids":
            ids = list(request.token_ids.ids)
        else:
            raise InvalidRequest("prompt: must not be empty (set text, token_ids or chat)")
        return truncated(ids, request.truncate_prompt_tokens, self.limits.max_model_len)

    async def prepare(self, request: api.GenerateRequest, tenant: str = "") -> PromptIds:
        """A Generate request's prompt as token ids (``ids``; ``tenant``: whose request it is), its tool use, its bad
        words' token sequences (sampling.bad_words, bounded before: pagedkv/bounds.check_generate) and its text: a
        text prompt as given (unless truncate_prompt_tokens cut it), else, for sampling.echo, its ids decoded."""
        ids = await self.ids(request, tenant)
        tools = self.tool_use(request)
        words = list(request.sampling.bad_words)
        bad = await self.run(lambda: bad_words_token_ids(words, lambda text: self._ids(text, False))) if words else []
        lim = self.limits
        if not request.sampling.echo or (request.WhichOneof("prompt") == "text" and not request.truncate_prompt_tokens):
            text = request.text
        elif len(ids) < lim.max_model_len and all(0 <= t < lim.vocab_size for t in ids):
            text = await self.run(lambda: self.tokenizer.decode(ids))
        else:  # (no work for what the sampling stage refuses: validation.check_prompt_ids)
            text = ""
        return PromptIds(ids, tools, bad, text)

    async def detokenize(self, ids: list[int]) -> str:
        """The text of ``ids``, special tokens kept (vLLM's /detokenize): at most max_model_len ids, each in the
        vocabulary."""
        limits = self.limits
        if len(ids) > limits.max_model_len:
            raise InvalidRequest(f"token_ids: {len(ids)} ids; at most max_model_len={limits.max_model_len}")
        bad = next((t for t in ids if not 0 <= t < limits.vocab_size), None)
        if bad is not None:
            raise InvalidRequest(f"token_ids: id {bad} outside the vocabulary [0, {limits.vocab_size})")
        return await self.run(lambda: self.tokenizer.decode(ids, skip_special_tokens=False))
