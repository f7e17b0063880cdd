"""The public gRPC API (pagedkv.api.v1.Generation)."""

from __future__ import annotations

import time
from dataclasses import dataclass

import grpc

from pagedkv.api.v1 import api_pb2 as api
from pagedkv.api.v1 import api_pb2_grpc as api_grpc
from pagedkv.bounds import InvalidRequest
from pagedkv.tenancy import Tenant, Unauthenticated
from scheduler_svc import fit, metrics, ttft_trace
from scheduler_svc.adapter_api import AdapterRpc
from scheduler_svc.adapters import HINT, AdapterNotFound, usable
from scheduler_svc.chat import NoChatTemplate
from scheduler_svc.cluster import Cluster
from scheduler_svc.constraints import check_constrained_requests
from scheduler_svc.intake import Intake
from scheduler_svc.logprobs import PromptLogprobs
from scheduler_svc.model_info import add_cluster_counts, tenant_info
from scheduler_svc.outputs import Ending, final
from scheduler_svc.prompts import Prompts
from scheduler_svc.queue_bounds import QueueBounds, QueueFull
from scheduler_svc.request import Finish, Output, Request
from scheduler_svc.responses import prompt_message, response
from scheduler_svc.retention_api import ReleaseKvRpc
from scheduler_svc.trusted_hop import Caller, HopRefused, TrustedHops
from scheduler_svc.validation import Limits

METHODS = "/pagedkv.api.v1.Generation/"  # the full gRPC method names, as logs and interceptors give them


@dataclass(slots=True)
class LiveStream:
    """One open Generate stream: its request, and the key it was opened with (checked again on a reload)."""

    req: Request
    key: bytes  # SHA-256 of the API key (b"" on a single-tenant server, or for a tenant a trusted hop asserted)
    revoked: str = ""  # set when a reload ended the stream: why its key no longer holds
    asserted: bool = False  # its tenant was asserted by a trusted hop (a reload checks the tenant, not a key)


class GenerationService(ReleaseKvRpc, AdapterRpc, api_grpc.GenerationServicer):
    def __init__(self, cluster: Cluster, tokenizer, limits: Limits, model_info: dict, log,
                 log_prompts: bool = False, queue_bounds: QueueBounds | None = None,
                 trust_request_templates: bool = False, tool_call_parser: str = "",
                 hops: TrustedHops | None = None) -> None:
        self.cluster = cluster
        self.hops = hops if hops is not None else TrustedHops()  # who may name a request's tenant (trusted_hop.py)
        self.tokenizer = tokenizer
        self.limits = limits
        # the tokenizer's work (prompts, chat templates), on its own thread
        self.prompts = Prompts(tokenizer, limits, trust_request_templates, tool_call_parser)
        self.intake = Intake(cluster, tokenizer, limits, self.prompts)  # a Generate request's way in
        self.model_info = model_info
        self.log = log
        self.queue_bounds = queue_bounds if queue_bounds is not None else QueueBounds()
        # NOTE: keyed by (tenant, client request id): one tenant's ids are no oracle for another's, nor squatted.
        self.live: dict[tuple[str, str], LiveStream] = {}  # the open streams
        self.closing = False  # shutting down: no new requests
        self.log_prompts = log_prompts  # prompt text (or ids) in the request_admitted line: off unless asked

    async def _caller(self, context, method: str) -> Caller:
        """The caller's tenant (its key's, or the one a trusted hop asserts) and its key's hash; otherwise the call
        ends UNAUTHENTICATED (a key refused), PERMISSION_DENIED (a tenant named by one that may not) or INVALID_ARGUMENT
        (a hop's headers disagree), logged (never a key or secret: only the reason, e.g. missing, revoked)."""
        try:
            return self.hops.caller(self.cluster.tenants, context.invocation_metadata())
        except Unauthenticated as err:
            metrics.AUTH_FAILURES.labels(err.reason).inc()
            self.log.warning("auth_failed", peer=context.peer(), method=method, reason=err.reason)
            await context.abort(grpc.StatusCode.UNAUTHENTICATED, str(err))
        except HopRefused as err:
            metrics.HOP_REFUSALS.labels(err.reason).inc()
            self.log.warning("trusted_hop_refused", peer=context.peer(), method=method, reason=err.reason)
            code = grpc.StatusCode.INVALID_ARGUMENT if err.invalid else grpc.StatusCode.PERMISSION_DENIED
            await context.abort(code, str(err))

    async def _tenant(self, context, method: str) -> Tenant:
        return (await self._caller(context, method)).tenant

    def end_revoked_streams(self) -> int:
        """After a reload of the tenants file: ends every open stream whose key no longer authenticates as its
        tenant (revoked, gone from the file, or another tenant's) with UNAUTHENTICATED; returns how many."""
        tenants, problems = self.cluster.tenants, {}
        ended = 0
        for (tenant_id, _), stream in self.live.items():
            if stream.revoked:
                continue
            if stream.asserted:  # (no key: the tenant a trusted hop named must still be in the file)
                problem = "" if tenants.named(tenant_id) else f"tenant {tenant_id} no longer in the tenants file"
            else:
                if (tenant_id, stream.key) not in problems:
                    problems[tenant_id, stream.key] = tenants.key_problem(tenant_id, stream.key)
                problem = problems[tenant_id, stream.key]
            if problem:
                stream.revoked = f"{problem}: the tenants file was reloaded and this stream ended"
                stream.req.outbox.put_nowait(final(stream.req, Finish.ABORT, error=stream.revoked, ending=Ending.CUT))
                ended += 1
        return ended

    async def Generate(self, request, context):  # noqa: N802
        received = time.perf_counter()
        caller = await self._caller(context, METHODS + "Generate")
        tenant = caller.tenant
        if self.closing:
            await context.abort(grpc.StatusCode.UNAVAILABLE, "the scheduler is shutting down; retry on another "
                                "scheduler (or this one once it is back)")
        if not self.cluster.available:
            await context.abort(grpc.StatusCode.UNAVAILABLE, "no executor is up (none connected, or all "
                                "failed or draining); retry later")
        try:  # (after those: a retry during an outage costs no tokenizing)
            took = await self.intake.take(request, tenant, caller.priority, received,
                                          lambda client_id: (tenant.id, client_id) in self.live)
            req, seqs, resume = took.req, took.seqs, took.resume
            forks = req.n if resume is None else len(seqs)  # the last messages to send
            prompt_received = request.continuation.prompt_received  # (not `received`: that is the arrival time)
            if req.sampling.prompt_logprobs is not None and len(req.prompt_ids) > 1 and not prompt_received:
                seqs[0].prompt_logprobs = PromptLogprobs(len(req.prompt_ids), req.sampling.prompt_logprobs)
            prompt = prompt_message(req.prompt_ids, request.sampling, prompt_received, took.prompt.text)
            tools = took.prompt.tools
            prompt.tool_call_format = tools.fmt
        except (InvalidRequest, fit.FitError) as err:
            await context.abort(grpc.StatusCode.INVALID_ARGUMENT, str(err))
        except AdapterNotFound as err:
            await context.abort(grpc.StatusCode.NOT_FOUND, str(err))
        except NoChatTemplate as err:
            await context.abort(grpc.StatusCode.FAILED_PRECONDITION, str(err))
        except KeyError as err:
            await context.abort(grpc.StatusCode.ALREADY_EXISTS,
                                f"request_id: {err.args[0]!r} is already in use by a live request")
        try:
            self.queue_bounds.check(tenant, *self.cluster.queued(tenant.id))  # (the compile phase counts as queued)
            if req.sampling.constraint is not None and tenant.max_constrained_requests:
                check_constrained_requests(tenant, self.cluster.compiling(tenant.id) + sum(
                    1 for (tid, _), live in self.live.items() if tid == tenant.id and live.req.sampling.constraint))
        except QueueFull as err:
            metrics.QUEUE_FULL.labels(err.bound).inc()
            self.log.info("request_refused", request_id=req.client_id, tenant=req.tenant, reason="queue_full",
                          bound=err.bound)
            await context.abort(grpc.StatusCode.RESOURCE_EXHAUSTED, str(err))
        if req.sampling.constraint is not None:  # compiled on the executors before it is placed (after its bounds)
            try:
                await self.cluster.compile_constraint(tenant.id, req.sampling.constraint,
                                                      "prompt.chat.tools" if tools.constraint is not None else "")
                if (tenant.id, req.client_id) in self.live:  # (taken while it compiled)
                    raise KeyError(req.client_id)
            except InvalidRequest as err:
                await context.abort(grpc.StatusCode.INVALID_ARGUMENT, str(err))
            except KeyError as err:
                await context.abort(grpc.StatusCode.ALREADY_EXISTS,
                                    f"request_id: {err.args[0]!r} is already in use by a live request")
        if req.adapter and not self.cluster.adapters.has(req.adapter):  # (unloaded while it was taken in)
            await context.abort(grpc.StatusCode.NOT_FOUND, f"adapter: {request.adapter!r} is not served; {HINT}")
        log = self.log.bind(request_id=req.client_id, internal_id=req.request_id, tenant=req.tenant)
        extra = {"prompt": request.text or list(req.prompt_ids)} if self.log_prompts else {}
        if caller.asserted or caller.priority is not None:  # (who vouched for the tenant, or set the priority)
            extra["trusted_hop"] = {"tenant": caller.asserted, "priority": req.priority}
        if resume is not None:
            extra["resumed"] = {index: len(ids) for index, ids in resume}  # fork -> tokens the client had
            metrics.RESUMED_REQUESTS.inc()
        if req.adapter:
            extra["adapter"] = req.adapter
        log.debug("request_admitted", prompt_tokens=len(req.prompt_ids), max_tokens=req.sampling.max_tokens,
                  n=req.n, **extra)
        live_key = (tenant.id, req.client_id)
        stream = self.live[live_key] = LiveStream(req, caller.key, asserted=caller.asserted)
        req.trace.enqueued(time.perf_counter())
        for i, seq in enumerate(seqs):
            self.cluster.add_request(seq, count_prompt=i == 0)
        finished = 0
        last_token_at = first_token_s = 0.0
        seed: int | None = req.sampling.seed  # (on the first message)
        try:
            while finished < forks:
                out: Output = await req.outbox.get()  # (what waited for this stream, in one message: Outbox)
                if out.token_ids:
                    now = time.perf_counter()
                    if last_token_at:
                        metrics.ITL_SECONDS.observe(now - last_token_at)
                    else:
                        if resume is None:  # (a resumed stream's first token is no time to first token)
                            metrics.TTFT_SECONDS.labels(req.tenant).observe(now - received)
                            ttft_trace.report(req.trace, now, log)
                        first_token_s = now - received
                    last_token_at = now
                if out.error:
                    if stream.revoked:
                        log.warning("request_revoked", error=out.error)
                        await context.abort(grpc.StatusCode.UNAUTHENTICATED, out.error)
                    log.warning("request_failed", error=out.error)
                    await context.abort(getattr(grpc.StatusCode, out.error_code or "UNAVAILABLE"), out.error)
                msg = response(req.client_id, out)
                if seed is not None:  # (the first message: the seed and the prompt)
                    msg.seed, seed = seed, None
                    msg.prompt.MergeFrom(prompt)
                if out.finish is not None:
                    finished += 1
                    seq = req if resume is None else next((f for f in seqs if f.index == out.index), req)
                    log.debug("request_finished", index=out.index, reason=out.finish.value,
                              completion_tokens=out.completion_tokens, cached_tokens=out.cached_tokens,
                              preemptions=seq.num_preemptions, queued_at_step=seq.queued_at_step,
                              admitted_at_step=seq.admitted_at_step, ttft_s=round(first_token_s, 4))
                yield msg
            metrics.E2E_SECONDS.labels(req.tenant).observe(time.perf_counter() - received)
        finally:
            if self.live.get(live_key) is stream:
                del self.live[live_key]
            if finished < forks:  # the client went away (or we are shutting down): free its pages
                self.cluster.abort(req.group)
                log.debug("request_cancelled", forks_finished=finished)

    async def ModelInfo(self, request, context):  # noqa: N802
        """The model's facts and the pools' sizes for everyone; the caller's own figures in ``tenant`` and the LoRA
        adapters it may use (``adapters``); the cluster-wide counts, the executors and the figures of ``tenant`` that
        depend on other tenants (fair share) only for a caller who may see them (tenancy: admin, or the one tenant of
        a single-tenant server) -- for the others they stay 0 / empty, so that nothing here changes with what another
        tenant does."""
        tenant = await self._tenant(context, METHODS + "ModelInfo")
        cluster = self.cluster
        snapshots, live = cluster.reports.snapshots_with_liveness()
        sees_cluster = cluster.tenants.sees_cluster(tenant)
        caching = snapshots[0].prefix_caching if snapshots else True
        info = api.ModelInfoResponse(**self.model_info, prefix_caching=caching, cluster_view=sees_cluster,
                                     adapters=usable(cluster.adapters, tenant, cluster.reports.adapter_slots()))
        for i, snap in enumerate(snapshots):  # capacity: the pools of the executors up or draining
            if i in live:
                info.num_pages += snap.pool.num_pages
                info.num_host_pages += snap.host.num_pages
        if sees_cluster:
            info.executors.extend(cluster.reports.executor_infos())
            add_cluster_counts(info, snapshots, live)
            info.num_waiting += cluster.reports.num_unplaced
        info.tenant.CopyFrom(tenant_info(snapshots, tenant, live, self.queue_bounds.for_tenant(tenant), sees_cluster))
        if request.reset_peak:
            cluster.reports.reset_peak(tenant.id, sees_cluster)
        return info

    async def Tokenize(self, request, context):  # noqa: N802
        tenant = await self._tenant(context, METHODS + "Tokenize")
        try:
            if request.HasField("chat"):
                if request.text:
                    raise InvalidRequest("text: must be empty when chat is set (send one of them)")
                if request.HasField("add_special_tokens") and request.add_special_tokens:
                    raise InvalidRequest("add_special_tokens: true is not supported with chat (the chat template "
                                         "places the special tokens); leave it unset or false")
                ids, tokens = await self.prompts.chat_ids(request.chat, "chat", tokens=True, tenant=tenant.id)
            else:
                special = request.add_special_tokens if request.HasField("add_special_tokens") else None
                ids, tokens = await self.prompts.text_ids(request.text, "text", special, tokens=True)
        except InvalidRequest as err:
            await context.abort(grpc.StatusCode.INVALID_ARGUMENT, str(err))
        except NoChatTemplate as err:
            await context.abort(grpc.StatusCode.FAILED_PRECONDITION, str(err))
        return api.TokenizeResponse(token_ids=ids, tokens=tokens)

    async def Detokenize(self, request, context):  # noqa: N802
        await self._tenant(context, METHODS + "Detokenize")
        try:
            text = await self.prompts.detokenize(list(request.token_ids))
        except InvalidRequest as err:
            await context.abort(grpc.StatusCode.INVALID_ARGUMENT, str(err))
        return api.DetokenizeResponse(text=text)
