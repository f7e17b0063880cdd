"""The public gRPC API (pagedkv.api.v1.Generation)."""

from __future__ import annotations

import asyncio
import time
import uuid
from concurrent.futures import ThreadPoolExecutor
from dataclasses import replace

import grpc

from pagedkv.api.v1 import api_pb2 as api
from pagedkv.api.v1 import api_pb2_grpc as api_grpc
from scheduler_svc import metrics
from scheduler_svc.cluster import Cluster
from scheduler_svc.detokenizer import IncrementalDetokenizer
from scheduler_svc.prefix_cache import tenant_root
from scheduler_svc.request import Finish, Output, Request
from scheduler_svc.tenancy import Tenant, Unauthenticated
from scheduler_svc.validation import (
    InvalidRequest,
    Limits,
    check_chat,
    check_priority,
    check_prompt_ids,
    check_request_id,
    check_sampling,
    check_text_bytes,
)

METHODS = "/pagedkv.api.v1.Generation/"  # the full gRPC method names, as logs and interceptors give them

FINISH_REASONS = {
    Finish.STOP: api.FINISH_REASON_STOP,
    Finish.LENGTH: api.FINISH_REASON_LENGTH,
    Finish.ABORT: api.FINISH_REASON_ABORT,
}


class NoChatTemplate(Exception):
    """The model has no chat template: a chat prompt cannot be rendered (FAILED_PRECONDITION)."""


def attention_window(tenant: Tenant, config, budget: int, block_size: int) -> tuple[int, int]:
    """(sink tokens, window tokens) of a request: the tenant's (else the server's) sliding window, and for a
    page budget with the 'window' policy the first page(s) as sink plus as many recent tokens as the budget
    holds; the narrower window wins. (0, 0): full attention."""
    sliding = tenant.sliding_window or config.sliding_window
    sink = tenant.sink_tokens or config.sink_tokens
    windows = [sliding] if sliding else []
    if budget and tenant.overflow == "window":
        sink = sink or block_size  # the first page is the attention sink
        windows.append((budget - -(-sink // block_size) - 1) * block_size)
    if not windows:
        return 0, 0
    return sink, min(windows)


def window_min_budget(tenant: Tenant, config, block_size: int) -> int:
    sink = tenant.sink_tokens or config.sink_tokens or block_size
    return -(-sink // block_size) + 2


def tenant_info(schedulers: list, tenant: Tenant) -> api.TenantInfo:
    """A tenant's settings and, added up over the executors, its usage."""
    t = tenant.id
    info = api.TenantInfo(
        id=t, weight=tenant.weight, page_quota=tenant.page_quota, reserved_pages=tenant.reserved_pages,
        max_concurrent_requests=tenant.max_concurrent_requests, page_budget=tenant.page_budget,
        overflow=tenant.overflow, sliding_window=tenant.sliding_window, sink_tokens=tenant.sink_tokens)
    for s in schedulers:
        st = s.stats(t)
        info.used_pages += s.pool.used_by[t]
        info.peak_used_pages += st.peak_used_pages
        info.num_running += sum(1 for r in s.running if r.tenant == t)
        info.num_waiting += s.waiting.tenant_len(t)
        info.num_swapped += sum(1 for r in s.swapped if r.tenant == t)
        info.service = max(info.service, s.waiting.service(t))
        info.budget_hits += st.budget_hits
        info.fair_share_preemptions += st.fair_share_preemptions
        info.fair_share_pages += s.fair_shares().get(t, 0.0)
    return info


def add_cluster_counts(info: api.ModelInfoResponse, schedulers: list, live: set[int]) -> None:
    """Adds every executor's counts to ``info`` (free and cached pages: those up or draining)."""
    for s in schedulers:
        pool = dict(num_free_pages=s.pool.num_free, num_cached_pages=s.pool.num_cached) if id(s) in live else {}
        host = s.host if id(s) in live else None
        add = dict(
            **pool, num_used_pages=s.pool.num_used,
            num_running=len(s.running), num_waiting=len(s.waiting), num_preemptions=s.num_preemptions,
            peak_used_pages=s.peak_used_pages, num_computed_tokens=s.num_computed_tokens,
            num_cached_prompt_tokens=s.kv.num_cached_prompt_tokens,
            num_used_host_pages=host.num_used if host is not None else 0, num_swapped=len(s.swapped),
            num_swap_preemptions=s.num_swap_preemptions, num_recompute_preemptions=s.num_recompute_preemptions,
            num_pages_swapped_out=s.kv.swaps.pages_out, num_pages_swapped_in=s.kv.swaps.pages_in,
            num_swap_bytes=(s.kv.swaps.pages_out + s.kv.swaps.pages_in) * s.policy.costs.page_bytes,
            num_spilled_pages=s.kv.swaps.spilled, num_spill_hits=s.kv.swaps.spill_hits)
        for name, value in add.items():
            setattr(info, name, getattr(info, name) + value)


class GenerationService(api_grpc.GenerationServicer):
    def __init__(self, engine: Cluster, tokenizer, limits: Limits, model_info: dict, log,
                 log_prompts: bool = False) -> None:
        self.engine = engine
        self.tokenizer = tokenizer
        self.limits = limits
        self.model_info = model_info
        self.log = log
        self.live: set[str] = set()  # client request ids with an open stream
        self.closing = False  # shutting down: no new requests
        self.log_prompts = log_prompts  # prompt text (or ids) in the request_admitted line: off unless asked
        # NOTE: tokenizing runs off the event loop (other streams keep streaming), one text at a time: a fast
        # tokenizer is not safe to call from several threads at once, and each text is bounded in bytes.
        self._tokenizer_thread = ThreadPoolExecutor(max_workers=1, thread_name_prefix="tokenize")

    async def _tenant(self, context, method: str) -> Tenant:
        """The caller's tenant; otherwise the call ends UNAUTHENTICATED and the refusal is logged (never the
        key: the reason says only missing, malformed, unknown or revoked)."""
        try:
            return self.engine.scheduler.tenants.authenticate(context.invocation_metadata())
        except Unauthenticated as err:
            metrics.AUTH_FAILURES.labels(err.reason).inc()
            self.log.warning("auth_failed", peer=context.peer(), method=method, reason=err.reason)
            await context.abort(grpc.StatusCode.UNAUTHENTICATED, str(err))

    async def _tokenize(self, text: str, add_special_tokens: bool, tokens: bool = False):
        """Token ids of ``text`` (and with ``tokens``, their strings), computed on the tokenizer thread."""
        def run():
            ids = self.tokenizer(text, add_special_tokens=add_special_tokens)["input_ids"]
            return (ids, self.tokenizer.convert_ids_to_tokens(ids)) if tokens else ids
        return await asyncio.get_running_loop().run_in_executor(self._tokenizer_thread, run)

    async def _chat_ids(self, chat: api.Chat, field: str, tokens: bool = False):
        """Token ids (and with ``tokens``, their strings) of the prompt the model's chat template renders from
        ``chat``; the messages are bounded before the template runs, on the tokenizer thread."""
        messages = check_chat(chat, field, self.limits.prompt_bytes)
        if not getattr(self.tokenizer, "chat_template", None):
            raise NoChatTemplate(f"{field}: the model has no chat template (no chat_template in its "
                                 "tokenizer_config.json); send text or token_ids")
        generation_prompt = chat.add_generation_prompt if chat.HasField("add_generation_prompt") else True

        def run():
            try:
                text = self.tokenizer.apply_chat_template(messages, tokenize=False,
                                                          add_generation_prompt=generation_prompt)
            except Exception as err:  # noqa: BLE001 -- a template's raise_exception, or any error it hits
                raise InvalidRequest(f"{field}: the model's chat template refused the messages: {err}") from None
            ids = self.tokenizer(text, add_special_tokens=False)["input_ids"]  # the template writes them
            return (ids, self.tokenizer.convert_ids_to_tokens(ids)) if tokens else ids
        return await asyncio.get_running_loop().run_in_executor(self._tokenizer_thread, run)

    async def _prompt_ids(self, request: api.GenerateRequest) -> list[int]:
        which = request.WhichOneof("prompt")
        if which == "chat":
            return await self._chat_ids(request.chat, "prompt.chat")
        if which == "text":
            if not request.text:
                raise InvalidRequest("prompt.text: must not be empty")
            check_text_bytes(request.text, "prompt.text", self.limits.prompt_bytes)  # before any tokenizing
            return await self._tokenize(request.text, add_special_tokens=True)
        if which == "token_ids":
            return list(request.token_ids.ids)
        raise InvalidRequest("prompt: must not be empty (set text, token_ids or chat)")

    def _page_budget(self, request: api.GenerateRequest, tenant: Tenant, prompt_len: int) -> int:
        """The request's page budget: the tenant's, or lower if the request asks."""
        asked = request.page_budget
        if asked < 0:
            raise InvalidRequest(f"page_budget: {asked}; must be >= 0 (0: the tenant's default)")
        if tenant.page_budget and asked > tenant.page_budget:
            raise InvalidRequest(f"page_budget: {asked} pages; must be <= {tenant.page_budget} (tenant "
                                 f"{tenant.id}'s budget; a request may lower it, never raise it)")
        budget = asked or tenant.page_budget
        if not budget:
            return 0
        capacity = self.engine.scheduler.tenant_capacity(tenant.id)
        if budget > capacity:
            raise InvalidRequest(f"page_budget: {budget} pages; tenant {tenant.id} can hold at most {capacity} "
                                 "(its quota, less other tenants' reserved pages)")
        bs = self.engine.scheduler.pool.block_size
        if tenant.overflow == "stop":
            need = -(-prompt_len // bs)
            if need > budget:
                raise InvalidRequest(f"prompt: {prompt_len} tokens need {need} pages; the page budget is "
                                     f"{budget} pages (overflow policy 'stop')")
        else:
            least = window_min_budget(tenant, self.engine.scheduler.config, bs)
            if budget < least:
                raise InvalidRequest(f"page_budget: {budget} pages; the 'window' policy needs at least {least} "
                                     f"(the attention sink's pages plus two)")
        return budget

    def _build_request(self, request: api.GenerateRequest, tenant: Tenant, ids: list[int]) -> Request:
        scheduler = self.engine.scheduler
        budget = self._page_budget(request, tenant, len(ids))
        sink, window = attention_window(tenant, scheduler.config, budget, scheduler.pool.block_size)
        limits = self.limits
        if window and not budget and not scheduler.window_page_limit(tenant.id, sink, window):
            raise InvalidRequest(f"sliding window: sink {sink} + window {window} tokens do not fit the "
                                 f"{scheduler.tenant_capacity(tenant.id)} pages tenant {tenant.id} can hold")
        if not window:
            capacity = scheduler.tenant_capacity(tenant.id)
            if capacity * scheduler.pool.block_size < limits.max_model_len:
                limits = replace(limits, max_model_len=capacity * scheduler.pool.block_size,
                                 max_len_name=f"the {capacity} pages tenant {tenant.id} can hold (tokens)")
        check_prompt_ids(ids, limits)
        check_request_id(request.request_id)
        check_priority(request.priority)
        sampling = check_sampling(request.sampling, len(ids), limits)
        n = max(1, request.sampling.n)
        if n > self.engine.scheduler.config.max_num_seqs:
            limit = self.engine.scheduler.config.max_num_seqs
            raise InvalidRequest(f"sampling.n: {n}; must be <= max_num_seqs={limit}")
        if tenant.max_concurrent_requests and n > tenant.max_concurrent_requests:
            raise InvalidRequest(f"sampling.n: {n}; must be <= {tenant.max_concurrent_requests} (tenant {tenant.id}'s "
                                 "max_concurrent_requests)")
        client_id = request.request_id or uuid.uuid4().hex
        if client_id in self.live:
            raise KeyError(client_id)
        detok = IncrementalDetokenizer(self.tokenizer, ids, sampling.stop, sampling.include_stop_str_in_output)
        arrival = self.engine.next_arrival()
        # NOTE: the scheduler and executor know a request by an internal id that is never reused (a client
        # may reuse its id as soon as its stream ends, while the old request is still being reaped).
        # NOTE: a windowed request's KV depends on its window, so its pages are cached under other hashes.
        root = tenant_root(tenant.id) if not window else tenant_root(f"{tenant.id}\x00window:{sink}:{window}")
        return Request(request_id=f"q{arrival}", prompt_ids=ids, sampling=sampling, arrival=arrival,
                       detokenizer=detok, n=n, tenant=tenant.id, hash_root=root, client_id=client_id,
                       priority=request.priority, page_budget=budget, overflow=tenant.overflow,
                       sink_tokens=sink, window_tokens=window)

    async def Generate(self, request, context):  # noqa: N802
        received = time.perf_counter()
        tenant = await self._tenant(context, METHODS + "Generate")
        try:
            req = self._build_request(request, tenant, await self._prompt_ids(request))
        except InvalidRequest as err:
            await context.abort(grpc.StatusCode.INVALID_ARGUMENT, str(err))
        except NoChatTemplate as err:
            await context.abort(grpc.StatusCode.FAILED_PRECONDITION, str(err))
        except KeyError as err:
            await context.abort(grpc.StatusCode.ALREADY_EXISTS,
                                f"request_id: {err.args[0]!r} is already in use by a live request")
        if self.closing:
            await context.abort(grpc.StatusCode.UNAVAILABLE, "the scheduler is shutting down; retry on another "
                                "scheduler (or this one once it is back)")
        if not self.engine.available:
            await context.abort(grpc.StatusCode.UNAVAILABLE, "no executor is up (none connected, or all "
                                "failed or draining); retry later")
        log = self.log.bind(request_id=req.client_id, internal_id=req.request_id, tenant=req.tenant)
        extra = {"prompt": request.text or list(req.prompt_ids)} if self.log_prompts else {}
        log.info("request_admitted", prompt_tokens=len(req.prompt_ids), max_tokens=req.sampling.max_tokens, n=req.n,
                 **extra)
        self.live.add(req.client_id)
        self.engine.add_request(req)
        finished = 0
        last_token_at = 0.0
        try:
            while finished < req.n:
                out: Output = await req.queue.get()
                if out.token_ids:
                    now = time.perf_counter()
                    if last_token_at:
                        metrics.ITL_SECONDS.observe(now - last_token_at)
                    else:
                        metrics.TTFT_SECONDS.labels(req.tenant).observe(now - received)
                    last_token_at = now
                if out.error:
                    log.warning("request_failed", error=out.error)
                    await context.abort(grpc.StatusCode.UNAVAILABLE, out.error)
                msg = api.GenerateResponse(request_id=req.client_id, text=out.text, token_ids=out.token_ids,
                                           logprobs=out.logprobs, index=out.index)
                if out.finish is not None:
                    finished += 1
                    msg.finish_reason = FINISH_REASONS[out.finish]
                    msg.stop_reason = out.stop_reason
                    msg.usage.CopyFrom(api.Usage(prompt_tokens=out.prompt_tokens,
                                                 completion_tokens=out.completion_tokens,
                                                 cached_tokens=out.cached_tokens))
                    log.info("request_finished", index=out.index, reason=out.finish.value,
                             completion_tokens=out.completion_tokens, cached_tokens=out.cached_tokens,
                             preemptions=req.num_preemptions)
                yield msg
            metrics.E2E_SECONDS.labels(req.tenant).observe(time.perf_counter() - received)
        finally:
            self.live.discard(req.client_id)
            if finished < req.n:  # the client went away (or we are shutting down): free its pages
                self.engine.abort(req.request_id)
                log.info("request_cancelled", forks_finished=finished)

    async def ModelInfo(self, request, context):  # noqa: N802
        """The model's facts and the pools' sizes for everyone; the caller's own figures in ``tenant``; the
        cluster-wide counts and the executors only for a caller who may see them (tenancy: admin, or the one
        tenant of a single-tenant server) -- for the others they stay 0 / empty."""
        tenant = await self._tenant(context, METHODS + "ModelInfo")
        schedulers = self.engine.schedulers()
        sees_cluster = self.engine.scheduler.tenants.sees_cluster(tenant)
        info = api.ModelInfoResponse(**self.model_info, prefix_caching=self.engine.scheduler.kv.caching,
                                     cluster_view=sees_cluster)
        live = {id(s) for s in self.engine.schedulers(live=True)}
        for s in schedulers:  # capacity: the pools of the executors up or draining
            if id(s) in live:
                info.num_pages += s.pool.num_pages
                info.num_host_pages += s.host.num_pages if s.host is not None else 0
        if sees_cluster:
            info.executors.extend(self.engine.executor_infos())
            add_cluster_counts(info, schedulers, live)
            info.num_waiting += len(self.engine.unplaced)
        info.tenant.CopyFrom(tenant_info(schedulers, tenant))
        if request.reset_peak:
            for s in schedulers:
                s.stats(tenant.id).peak_used_pages = s.pool.used_by[tenant.id]
                if sees_cluster:
                    s.peak_used_pages = s.pool.num_used
        return info

    async def Tokenize(self, request, context):  # noqa: N802
        await self._tenant(context, METHODS + "Tokenize")
        try:
            if request.HasField("chat"):
                if request.text:
                    raise InvalidRequest("text: must be empty when chat is set (send one of them)")
                ids, tokens = await self._chat_ids(request.chat, "chat", tokens=True)
            else:
                check_text_bytes(request.text, "text", self.limits.prompt_bytes)
                ids, tokens = await self._tokenize(request.text, request.add_special_tokens, tokens=True)
        except InvalidRequest as err:
            await context.abort(grpc.StatusCode.INVALID_ARGUMENT, str(err))
        except NoChatTemplate as err:
            await context.abort(grpc.StatusCode.FAILED_PRECONDITION, str(err))
        return api.TokenizeResponse(token_ids=ids, tokens=tokens)
