"""Async Python client of the public API."""

from __future__ import annotations

import asyncio
from collections.abc import AsyncIterator, Mapping, Sequence
from dataclasses import dataclass, field

import grpc
from grpc_health.v1 import health_pb2, health_pb2_grpc

from pagedkv.api.v1 import api_pb2 as api
from pagedkv.api.v1 import api_pb2_grpc as api_grpc
from pagedkv.grpc_common import CHANNEL_OPTIONS, KEEPALIVE_OPTIONS
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


def accumulate(out: Completion, msg: api.GenerateResponse) -> None:
    out.request_id = msg.request_id
    out.text += msg.text
    out.token_ids.extend(msg.token_ids)
    out.logprobs.extend(msg.logprobs)
    if msg.finish_reason:
        out.finish_reason = FINISH_NAMES[msg.finish_reason]
        out.stop_reason = msg.stop_reason
        out.prompt_tokens = msg.usage.prompt_tokens
        out.completion_tokens = msg.usage.completion_tokens
        out.cached_tokens = msg.usage.cached_tokens


Message = Mapping[str, str] | tuple[str, str]  # {"role": ..., "content": ...} or (role, content)


def chat_of(messages: Sequence[Message], add_generation_prompt: bool | None = None) -> api.Chat:
    chat = api.Chat(messages=[api.ChatMessage(role=m["role"], content=m["content"]) if isinstance(m, Mapping)
                              else api.ChatMessage(role=m[0], content=m[1]) for m in messages])
    if add_generation_prompt is not None:
        chat.add_generation_prompt = add_generation_prompt
    return chat


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
    host. Without ``tls_ca`` the channel is plaintext."""

    def __init__(self, address: str, metadata: Sequence[tuple[str, str]] = (), api_key: str = "",
                 tls_ca: str = "", tls_server_name: str = "") -> None:
        if api_key:
            metadata = (*metadata, ("authorization", f"Bearer {api_key}"))
        self.address = address
        self.metadata = tuple(metadata)
        options = [*CHANNEL_OPTIONS, *KEEPALIVE_OPTIONS, ("grpc.lb_policy_name", "round_robin")]
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
                      priority: int = 0, page_budget: int = 0) -> api.GenerateRequest:
        """The prompt is text, token ids, or chat ``messages`` (rendered by the model's chat template).
        temperature, top_p and top_k left as None take the checkpoint's defaults (ModelInfo's
        sampling_defaults); temperature 0 is greedy."""
        sampling = api.SamplingParams(max_tokens=max_tokens, n=n,
                                      stop=list(stop), stop_token_ids=list(stop_token_ids), ignore_eos=ignore_eos,
                                      logprobs=logprobs, include_stop_str_in_output=include_stop_str_in_output)
        for name, value in (("temperature", temperature), ("top_p", top_p), ("top_k", top_k), ("seed", seed)):
            if value is not None:
                setattr(sampling, name, value)
        req = api.GenerateRequest(sampling=sampling, request_id=request_id, priority=priority,
                                  page_budget=page_budget)
        if (prompt is None) == (messages is None):
            raise ValueError("give a prompt (text or token ids) or messages, not both")
        if messages is not None:
            req.chat.CopyFrom(chat_of(messages, add_generation_prompt))
        elif isinstance(prompt, str):
            req.text = prompt
        else:
            req.token_ids.ids.extend(prompt)
        return req

    async def generate(self, prompt: str | Sequence[int] | None = None,
                       **params) -> AsyncIterator[api.GenerateResponse]:
        """Streams GenerateResponse messages; raises grpc.aio.AioRpcError on errors."""
        call = self.stub.Generate(self.build_request(prompt, **params), metadata=self.metadata)
        async for msg in call:
            yield msg

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

    async def model_info(self, reset_peak: bool = False) -> api.ModelInfoResponse:
        return await self.stub.ModelInfo(api.ModelInfoRequest(reset_peak=reset_peak), metadata=self.metadata)

    async def tokenize(self, text: str = "", add_special_tokens: bool = False, *,
                       messages: Sequence[Message] | None = None,
                       add_generation_prompt: bool | None = None) -> list[int]:
        """Token ids of ``text``, or of the prompt the chat template renders from ``messages``."""
        req = api.TokenizeRequest(text=text, add_special_tokens=add_special_tokens)
        if messages is not None:
            req.chat.CopyFrom(chat_of(messages, add_generation_prompt))
        r = await self.stub.Tokenize(req, metadata=self.metadata)
        return list(r.token_ids)
