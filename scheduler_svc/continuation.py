"""A continuation: a request that resumes streams its client already received part of (resume after a scheduler's
death or a migration, no token lost), the last stage of a Generate request's way in (scheduler_svc/intake.py).
``check_continuation`` says which forks go on and with which tokens; ``resume`` checks them and builds those forks,
each a sequence of its own whose detokenizer has replayed what its client received."""

from __future__ import annotations

from collections.abc import Awaitable, Callable, Collection

from pagedkv.api.v1 import api_pb2 as api
from pagedkv.bounds import InvalidRequest
from scheduler_svc import request as requests
from scheduler_svc.detokenizer import IncrementalDetokenizer
from scheduler_svc.fit import pages_for
from scheduler_svc.request import Request, Sampling
from scheduler_svc.validation import Limits

Resume = list[tuple[int, list[int]]]  # (fork index, token ids its client received), unfinished forks in order


def check_continuation(c: api.Continuation, n: int, prompt_len: int, sampling: Sampling, limits: Limits,
                       stop_ids: Collection[int], budget_pages: int = 0,
                       block_size: int = 1) -> list[tuple[int, list[int]]]:
    """The forks a continuation resumes, as (fork index, token ids received), unfinished ones only, in fork order.
    One entry per fork; each fork's draw_offset is the number of its ids (draws are numbered by output position);
    every id in the vocabulary; an unfinished fork holds none of what would have ended it: max_tokens reached
    (``sampling``: checked against the context, max_model_len lowered by the tenant's capacity, as any request's), a
    stop token (``stop_ids``: sampling.stop_token_ids, and EOS unless ignore_eos), more pages than ``budget_pages``
    (a page budget with the 'stop' policy; 0: none). Stop strings are found when the ids are replayed through the
    detokenizer (the API)."""
    if len(c.forks) != n:
        raise InvalidRequest(f"continuation.forks: {len(c.forks)} entries; must be one per fork: {n} (sampling.n)")
    resumed = []
    for i, fork in enumerate(c.forks):
        field, ids = f"continuation.forks[{i}]", list(fork.token_ids)
        if fork.draw_offset != len(ids):
            raise InvalidRequest(f"{field}.draw_offset: {fork.draw_offset}; must equal the number of token_ids "
                                 f"received ({len(ids)}): draws are numbered by output position")
        bad = next((t for t in ids if not 0 <= t < limits.vocab_size), None)
        if bad is not None:
            raise InvalidRequest(f"{field}.token_ids: id {bad} outside the vocabulary [0, {limits.vocab_size})")
        if fork.finished:
            continue
        ended = f"a fork that reached it has finished: set {field}.finished"
        # (prompt + max_tokens <= max_model_len: check_sampling)
        if len(ids) >= sampling.max_tokens:
            raise InvalidRequest(f"{field}.token_ids: {len(ids)} tokens; an unfinished fork has fewer than "
                                 f"sampling.max_tokens={sampling.max_tokens} ({ended})")
        at = next((j for j, t in enumerate(ids) if t in stop_ids), None)
        if at is not None:
            raise InvalidRequest(f"{field}.token_ids: id {ids[at]} at position {at} is a stop token "
                                 f"(sampling.stop_token_ids, or EOS without ignore_eos): the fork ended there "
                                 f"(set {field}.finished)")
        if budget_pages and pages_for(prompt_len + len(ids), block_size) > budget_pages:
            raise InvalidRequest(f"{field}.token_ids: prompt ({prompt_len}) + {len(ids)} tokens need "
                                 f"{pages_for(prompt_len + len(ids), block_size)} pages; the page budget is "
                                 f"{budget_pages} pages (overflow policy 'stop'; {ended})")
        resumed.append((i, ids))
    if not resumed:
        raise InvalidRequest("continuation.forks: every fork finished; nothing is left to resume")
    return resumed


async def resume(c: api.Continuation, req: Request, limits: Limits, stop_ids: Collection[int], budget_pages: int,
                 block_size: int, tokenizer, run: Callable[[Callable], Awaitable]) -> tuple[Resume, list[Request]]:
    """The forks ``c`` resumes (``check_continuation``) and their sequences (request.fork), each starting with the
    tokens its client received: its sampler continues at that draw, and its detokenizer has replayed them (``run``:
    on the tokenizer thread, a context's worth of decodes), so that its text goes on exactly. A fork whose text
    already holds a stop string has finished: refused."""
    s = req.sampling
    resumed = check_continuation(c, req.n, len(req.prompt_ids), s, limits, stop_ids, budget_pages, block_size)

    def replay() -> list[IncrementalDetokenizer]:
        primed = []
        for index, ids in resumed:
            detok = IncrementalDetokenizer(tokenizer, req.prompt_ids, s.stop, s.include_stop_str_in_output)
            detok.replay(ids)
            if detok.stopped_by is not None:
                field = f"continuation.forks[{index}]"
                raise InvalidRequest(f"{field}.token_ids: their text holds the stop string {detok.stopped_by!r}: "
                                     f"the fork ended there (set {field}.finished)")
            primed.append(detok)
        return primed
    primed = await run(replay)
    return resumed, [requests.fork(req, index, detok, ids) for (index, ids), detok in zip(resumed, primed)]
