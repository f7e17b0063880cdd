"""A Generate request's way in, as one ordered pipeline (``Intake.take``). Each stage is one module, entered once:

1. bounds (pagedkv/bounds.check_generate): its id, priority, n, bad words' sizes and adapter name's length, which
   need no model: before any work is done for it;
2. adapter (adapters.select): the LoRA adapter it selects, one served that its tenant may use (else NOT_FOUND, the
   same for both), which roots its prefix-cache chain (prefix_cache.request_root);
3. chat render and tokens (prompts.Prompts.prepare, on the tokenizer thread; a request's own chat template in a
   worker): its prompt's ids, its tool use, its bad words' token sequences, its prompt's text;
4. fit (fit.fit_request): its page budget, attention window and longest length on the largest executor, and the
   seats its n sequences take;
5. sampling (validation.check_generation): the prompt's ids and the sampling against the context the fit left;
6. constraint (constraints.check_constraint): its structured output, or its tool choice's, in the executor's form;
7. continuation (continuation.resume): the forks it resumes, their detokenizers replayed.

Each refusal is an InvalidRequest (or fit.FitError, chat.NoChatTemplate, adapters.AdapterNotFound, KeyError for a
request id in use) that names the field. GenerationService.Generate (api.py) keeps authentication, the status codes,
the queue bounds, the constraint's compile and the stream loop."""

from __future__ import annotations

import time
import uuid
from collections.abc import Callable
from dataclasses import dataclass, replace

from pagedkv.api.v1 import api_pb2 as api
from pagedkv.bounds import check_generate
from pagedkv.tenancy import Tenant
from pagedkv.trusted_hop import OBJECTIVE_HEADER
from scheduler_svc import adapters, continuation, fit
from scheduler_svc.cluster import Cluster
from scheduler_svc.constraints import check_constraint
from scheduler_svc.detokenizer import IncrementalDetokenizer
from scheduler_svc.prefix_cache import request_root
from scheduler_svc.prompts import PromptIds, Prompts
from scheduler_svc.request import Request
from scheduler_svc.retention_api import check_retain_kv
from scheduler_svc.validation import Limits, check_generation


@dataclass(slots=True)
class Admitted:
    """A request that came through: what runs, and what its stream's first message says of the prompt."""

    req: Request  # the request (with a continuation, the parent of the forks it resumes: it never runs)
    seqs: list[Request]  # what runs: the request, or the forks a continuation resumes
    resume: continuation.Resume | None  # the forks resumed and the tokens their client had (None: a new request)
    prompt: PromptIds  # its prompt's ids, tool use and text


class Intake:
    """The stages of a Generate request's way in, against the cluster's model and the server's limits."""

    def __init__(self, cluster: Cluster, tokenizer, limits: Limits, prompts: Prompts) -> None:
        self.cluster, self.tokenizer, self.limits, self.prompts = cluster, tokenizer, limits, prompts

    async def take(self, request: api.GenerateRequest, tenant: Tenant, hop_priority: int | None, received: float,
                   taken: Callable[[str], bool]) -> Admitted:
        """``request`` of ``tenant`` through every stage; ``hop_priority``: a trusted hop's (its GIE objective's),
        instead of the request's own; ``received``: when it arrived (perf_counter); ``taken``: whether a client
        request id is in use by a live request of the tenant (KeyError if so, checked again after each wait)."""
        priority = request.priority if hop_priority is None else hop_priority
        check_generate(request, tenant, priority, OBJECTIVE_HEADER if hop_priority is not None else "")
        adapter = adapters.select(request.adapter, self.cluster.adapters, tenant)
        prompt = await self.prompts.prepare(request, tenant.id)
        tokenized = time.perf_counter()
        cluster, ids = self.cluster, prompt.ids
        lim = cluster.fit_limits(tenant.id)  # (the largest executor's)
        shape = fit.fit_request(tenant, len(ids), request.page_budget, request.sampling.n, lim,
                                self.limits.max_model_len)
        limits = self.limits
        if shape.max_len < limits.max_model_len:  # (the tenant's pages hold fewer tokens)
            limits = replace(limits, max_model_len=shape.max_len, max_len_name=shape.max_len_name)
        eos = cluster.reference.eos_token_ids
        sampling = check_generation(request.sampling, ids, limits, eos, prompt.bad_words_ids)
        sampling.constraint = check_constraint(request.sampling, sampling, eos, prompt.tools.constraint,
                                               f"prompt.chat.tool_choice ({prompt.tools.fmt})", tenant)
        client_id = request.request_id or uuid.uuid4().hex
        if taken(client_id):
            raise KeyError(client_id)
        sink, window = shape.sink, shape.window
        detok = IncrementalDetokenizer(self.tokenizer, ids, sampling.stop, sampling.include_stop_str_in_output)
        arrival = cluster.next_arrival()
        # NOTE: the scheduler and executor know a request by an internal id that is never reused (a client
        # may reuse its id as soon as its stream ends, while the old request is still being reaped).
        # NOTE: an adapter's KV is its own, and a windowed request's depends on its window: their pages are cached
        # under other hashes (a root of their own).
        root = request_root(tenant.id, adapter.cache_key if adapter else "", (sink, window) if window else None)
        req = Request(request_id=f"q{arrival}", prompt_ids=ids, sampling=sampling, arrival=arrival,
                      detokenizer=detok, n=max(1, request.sampling.n), tenant=tenant.id,
                      adapter=adapter.key if adapter else "",
                      hash_root=root, client_id=client_id, priority=priority, page_budget=shape.page_budget,
                      overflow=tenant.overflow, sink_tokens=sink, window_tokens=window,
                      retain=check_retain_kv(request, limits.max_retain_ttl_s))
        req.trace.arrived(received, tokenized)
        if not request.HasField("continuation"):
            return Admitted(req, [req], None, prompt)
        stop_ids = set(sampling.stop_token_ids) | (set() if sampling.ignore_eos else set(eos))
        budget = shape.page_budget if tenant.overflow == "stop" else 0
        resume, seqs = await continuation.resume(request.continuation, req, limits, stop_ids, budget, lim.block_size,
                                                 self.tokenizer, self.prompts.run)
        if taken(client_id):  # (taken while the replay ran)
            raise KeyError(client_id)
        return Admitted(req, seqs, resume, prompt)
