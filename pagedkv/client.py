"""Async Python client of the public API, with streams that survive their scheduler.

A Generate stream that breaks before every fork's last message (the scheduler was killed or shut down, the
connection dropped, a queue was full) is resumed (``pagedkv.resumable_stream``): the request goes again with a
continuation (the token ids received, per fork, and the seed the first message carried), to whatever scheduler the
channel reaches (another address of a round-robin target, or the same one once it is back), and the stream goes on
where it broke. The caller sees one
stream: no token lost or repeated, and greedy or seeded forks give exactly the tokens of an undisturbed run (draw i
of a fork depends only on its seed and i). ``ResumePolicy`` bounds the retries; errors that cannot succeed (refused
input, authentication, permissions, a request too large, a missing chat template...) are never retried.
"""

from __future__ import annotations

import asyncio
import contextlib
from collections.abc import AsyncIterator, Mapping, Sequence
from dataclasses import dataclass, field
from typing import Any

import grpc
from grpc_health.v1 import health_pb2, health_pb2_grpc

from pagedkv.api.v1 import api_pb2 as api
from pagedkv.api.v1 import api_pb2_grpc as api_grpc
from pagedkv.chat_request import Message, chat_of
from pagedkv.grpc_common import CHANNEL_OPTIONS, KEEPALIVE_OPTIONS
from pagedkv.resumable_stream import resumable_generate
from pagedkv.resume_policy import DEFAULT_RESUME, ResumePolicy
from pagedkv.security import open_channel

FINISH_NAMES = {
    api.FINISH_REASON_UNSPECIFIED: None,
    api.FINISH_REASON_STOP: "stop",
    api.FINISH_REASON_LENGTH: "length",
    api.FINISH_REASON_ABORT: "abort",
}


@dataclass(slots=True)
class Completion:
    request_id: str = ""
    text: str = ""
    token_ids: list[int] = field(default_factory=list)
    logprobs: list[float] = field(default_factory=list)
    finish_reason: str | None = None
    stop_reason: str = ""
    prompt_tokens: int = 0
    completion_tokens: int = 0
    cached_tokens: int = 0
    top_logprobs: list[api.TopLogprobs] = field(default_factory=list)  # per token, with sampling.top_logprobs
    prompt: api.Prompt = field(default_factory=api.Prompt)  # what the stream said of the prompt (echo, prompt_logprobs)


def accumulate(out: Completion, msg: api.GenerateResponse) -> None:
    out.request_id = msg.request_id
    out.text += msg.text
    out.token_ids.extend(msg.token_ids)
    out.logprobs.extend(msg.logprobs)
    out.top_logprobs.extend(msg.top_logprobs)
    out.prompt.MergeFrom(msg.prompt)
    if msg.finish_reason:
        out.finish_reason = FINISH_NAMES[msg.finish_reason]
        out.stop_reason = msg.stop_reason
        out.prompt_tokens = msg.usage.prompt_tokens
        out.completion_tokens = msg.usage.completion_tokens
        out.cached_tokens = msg.usage.cached_tokens


# A scheduler that is back (restarted, or a new one at the address) is dialled again within a second: grpc's default
# reconnect backoff grows to 2 minutes, which a resume would wait out.
RECONNECT_OPTIONS = [("grpc.initial_reconnect_backoff_ms", 100), ("grpc.max_reconnect_backoff_ms", 1000)]


def channel_target(address: str) -> str:
    """A gRPC target. Several schedulers, client-side round robin: ``dns:///name:port`` (a DNS name with
    several addresses), or a comma-separated list ``10.0.0.1:50051,10.0.0.2:50051`` (becomes ``ipv4:…``)."""
    if "," in address and ":///" not in address and not address.startswith(("ipv4:", "ipv6:")):
        hosts = [a.rpartition(":")[0] for a in address.split(",")]
        if not all(h.replace(".", "").isdigit() and h.count(".") == 3 for h in hosts):
            raise ValueError(f"address {address!r}: a comma-separated list takes IPv4 addresses only; for host "
                             "names use a DNS name that resolves to all of them (dns:///NAME:PORT)")
        return "ipv4:" + address
    return address


class Client:
    """``async with Client("127.0.0.1:50051") as c: async for chunk in c.generate("Hi"): ...``

    ``tls_ca``: connect with TLS, trusting the CA certificate(s) in that PEM file (the server's ``--tls-cert``
    is signed by it); ``tls_server_name``: the name the certificate must carry when it is not the address's
    host. Without ``tls_ca`` the channel is plaintext.

    ``resume``: how a Generate stream that broke is resumed (see the module doc; None: never, every error is
    raised as it comes)."""

    def __init__(self, address: str, metadata: Sequence[tuple[str, str]] = (), api_key: str = "",
                 tls_ca: str = "", tls_server_name: str = "", resume: ResumePolicy | None = DEFAULT_RESUME) -> None:
        if api_key:
            metadata = (*metadata, ("authorization", f"Bearer {api_key}"))
        self.address = address
        self.metadata = tuple(metadata)
        self.resume = resume
        options = [*CHANNEL_OPTIONS, *KEEPALIVE_OPTIONS, ("grpc.lb_policy_name", "round_robin"), *RECONNECT_OPTIONS]
        self.channel = open_channel(channel_target(address), options, tls_ca, tls_server_name)
        self.stub = api_grpc.GenerationStub(self.channel)

    async def __aenter__(self) -> Client:
        return self

    async def __aexit__(self, *exc) -> None:
        await self.close()

    async def close(self) -> None:
        await self.channel.close()

    async def wait_ready(self, timeout: float = 60.0) -> None:
        """Waits until the server's health check says SERVING."""
        stub = health_pb2_grpc.HealthStub(self.channel)
        deadline = asyncio.get_running_loop().time() + timeout
        last = ""
        while True:
            try:
                r = await stub.Check(health_pb2.HealthCheckRequest(service=""), timeout=2.0)
                if r.status == health_pb2.HealthCheckResponse.SERVING:
                    return
                last = health_pb2.HealthCheckResponse.ServingStatus.Name(r.status)
            except grpc.aio.AioRpcError as err:
                last = f"{err.code().name}: {err.details()}"  # e.g. refused, or a TLS handshake that failed
            if asyncio.get_running_loop().time() > deadline:
                raise TimeoutError(f"{self.address} not serving after {timeout:.0f}s (last: {last})")
            await asyncio.sleep(0.1)

    @staticmethod
    def build_request(prompt: str | Sequence[int] | None = None, *, messages: Sequence[Message] | None = None,
                      add_generation_prompt: bool | None = None, max_tokens: int = 0,
                      temperature: float | None = None, top_p: float | None = None, top_k: int | None = None,
                      seed: int | None = None, stop: Sequence[str] = (),
                      stop_token_ids: Sequence[int] = (), ignore_eos: bool = False, logprobs: bool = False,
                      include_stop_str_in_output: bool = False, request_id: str = "", n: int = 1,
                      priority: int = 0, page_budget: int = 0, presence_penalty: float = 0.0,
                      frequency_penalty: float = 0.0, repetition_penalty: float | None = None,
                      min_p: float | None = None,
                      min_tokens: int = 0, logit_bias: Mapping[int, float] | None = None,
                      allowed_token_ids: Sequence[int] = (), bad_words: Sequence[str] = (), top_logprobs: int = 0,
                      prompt_logprobs: int | None = None, echo: bool = False,
                      chat_template: str = "", chat_template_kwargs: Mapping[str, Any] | None = None,
                      continue_final_message: bool = False, truncate_prompt_tokens: int = 0,
                      constraint: api.Constraint | None = None, tools: Sequence[Mapping[str, Any]] = (),
                      tool_choice: str | None = None, parallel_tool_calls: bool | None = None,
                      retain_kv: tuple[str, int] | None = None, adapter: str = "") -> api.GenerateRequest:
        """The prompt is text, token ids, or chat ``messages`` (rendered by the model's chat template, or by
        ``chat_template``; chat_of says what a message may hold).
        temperature, top_p, top_k, repetition_penalty and min_p left as None take the model's defaults (its
        generation_config.json, else OpenAI's and vLLM's: temperature 1, sampled; ModelInfo's sampling_defaults
        shows them); temperature 0 is greedy. The logits controls, top_logprobs, prompt_logprobs (None: none) and
        echo: api.proto's SamplingParams; ``constraint``: structured outputs (api.proto's Constraint); ``tools``,
        ``tool_choice`` and ``parallel_tool_calls``: a chat's tools (chat_request.chat_of); ``retain_kv``: (key, ttl_s),
        keep the request's KV findable for the tenant's follow-ups (api.proto's RetainKv; ``release_kv`` ends it);
        ``adapter``: the LoRA adapter that generates (ModelInfo's ``adapters``; "": the base model)."""
        sampling = api.SamplingParams(max_tokens=max_tokens, n=n,
                                      stop=list(stop), stop_token_ids=list(stop_token_ids), ignore_eos=ignore_eos,
                                      logprobs=logprobs, include_stop_str_in_output=include_stop_str_in_output,
                                      presence_penalty=presence_penalty, frequency_penalty=frequency_penalty,
                                      min_tokens=min_tokens, logit_bias=dict(logit_bias or {}),
                                      allowed_token_ids=list(allowed_token_ids), bad_words=list(bad_words),
                                      top_logprobs=top_logprobs, echo=echo)
        if constraint is not None:
            sampling.constraint.CopyFrom(constraint)
        for name, value in (("temperature", temperature), ("top_p", top_p), ("top_k", top_k), ("seed", seed),
                            ("repetition_penalty", repetition_penalty), ("min_p", min_p),
                            ("prompt_logprobs", prompt_logprobs)):
            if value is not None:
                setattr(sampling, name, value)
        req = api.GenerateRequest(sampling=sampling, request_id=request_id, priority=priority,
                                  page_budget=page_budget, truncate_prompt_tokens=truncate_prompt_tokens,
                                  adapter=adapter)
        if retain_kv is not None:
            req.retain_kv.key, req.retain_kv.ttl_s = retain_kv
        if (prompt is None) == (messages is None):
            raise ValueError("give a prompt (text or token ids) or messages, not both")
        if messages is not None:
            req.chat.CopyFrom(chat_of(messages, add_generation_prompt, chat_template=chat_template,
                                      chat_template_kwargs=chat_template_kwargs,
                                      continue_final_message=continue_final_message, tools=tools,
                                      tool_choice=tool_choice, parallel_tool_calls=parallel_tool_calls))
        elif isinstance(prompt, str):
            req.text = prompt
        else:
            req.token_ids.ids.extend(prompt)
        return req

    async def generate(self, prompt: str | Sequence[int] | None = None,
                       **params) -> AsyncIterator[api.GenerateResponse]:
        """Streams GenerateResponse messages (resumed after a break, as ``resume`` says); raises
        grpc.aio.AioRpcError on errors."""
        async with contextlib.aclosing(self.stream(self.build_request(prompt, **params))) as stream:
            async for msg in stream:
                yield msg

    def stream(self, request: api.GenerateRequest, metadata: Sequence[tuple[str, str]] | None = None,
               ) -> AsyncIterator[api.GenerateResponse]:
        """Generate's messages for a request built by the caller (``metadata``: instead of the client's own)."""
        return resumable_generate(self.stub, request, self.metadata if metadata is None else metadata, self.resume,
                                  self.channel.channel_ready)

    async def complete(self, prompt: str | Sequence[int] | None = None, **params) -> Completion:
        """Runs one request to the end and gathers its stream."""
        out = Completion()
        async for msg in self.generate(prompt, **params):
            accumulate(out, msg)
        return out

    async def complete_n(self, prompt: str | Sequence[int] | None, n: int, **params) -> list[Completion]:
        """Parallel sampling: n forks of one prompt, gathered by fork index."""
        outs = [Completion() for _ in range(n)]
        async for msg in self.generate(prompt, n=n, **params):
            accumulate(outs[msg.index], msg)
        return outs

    async def release_kv(self, key: str) -> int:
        """Ends the retention of a request's KV (``retain_kv``): the pages it gave back. NOT_FOUND: none under key."""
        return (await self.stub.ReleaseKv(api.ReleaseKvRequest(key=key), metadata=self.metadata)).pages_released

    async def model_info(self, reset_peak: bool = False, timeout: float | None = None) -> api.ModelInfoResponse:
        return await self.stub.ModelInfo(api.ModelInfoRequest(reset_peak=reset_peak), metadata=self.metadata,
                                         timeout=timeout)

    async def load_adapter(self, name: str, path: str, public: bool = False,
                           timeout: float | None = None) -> api.AdapterInfo:
        """Loads a LoRA adapter at run time (a PEFT directory under the executors' --lora-root), owned by this
        client's tenant (``public``: an admin tenant's, for every tenant); requests select it by ``adapter=name``."""
        req = api.LoadAdapterRequest(name=name, path=path, public=public)
        return await self.stub.LoadAdapter(req, metadata=self.metadata, timeout=timeout)

    async def unload_adapter(self, name: str, timeout: float | None = None) -> None:
        """Unloads an adapter loaded at run time. FAILED_PRECONDITION while requests use it: retry when they end."""
        await self.stub.UnloadAdapter(api.UnloadAdapterRequest(name=name), metadata=self.metadata, timeout=timeout)

    async def tokenize(self, text: str = "", add_special_tokens: bool | None = None, *,
                       messages: Sequence[Message] | None = None, add_generation_prompt: bool | None = None,
                       **chat_options) -> list[int]:
        """Token ids of ``text`` (with BOS unless ``add_special_tokens`` is False: as Generate tokenizes it), or of
        the prompt the chat template renders from ``messages`` (``chat_options``: chat_of's)."""
        req = api.TokenizeRequest(text=text)
        if add_special_tokens is not None:
            req.add_special_tokens = add_special_tokens
        if messages is not None:
            req.chat.CopyFrom(chat_of(messages, add_generation_prompt, **chat_options))
        r = await self.stub.Tokenize(req, metadata=self.metadata)
        return list(r.token_ids)

    async def detokenize(self, token_ids: Sequence[int]) -> str:
        """The text of ``token_ids``, special tokens kept (at most max_model_len of them)."""
        r = await self.stub.Detokenize(api.DetokenizeRequest(token_ids=list(token_ids)), metadata=self.metadata)
        return r.text
