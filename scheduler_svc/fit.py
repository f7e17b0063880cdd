"""Whether a request fits: the one rule, for the API (``shape``: a new request's page budget, window and longest
length, or the field that cannot be), and for placement, ``Scheduler.add`` and tenant reloads (``misfit``: why a
shaped request can never run on one executor). The start-up argument checks use its page arithmetic.

A request fits an executor when it can ever hold the pages it needs there:

- without a window, prompt + output up to its ``max_len``: max_model_len, lower when its tenant's capacity
  (its quota, less the pages other tenants reserve on that pool) holds fewer tokens;
- with a sliding window and no page budget, its sink and window pages plus a prefill chunk
  (``window_page_limit``); the least it can run with is ``window_pages``;
- with a page budget, the budget itself, which must be within the tenant's capacity;
- and n <= max_num_seqs (a parent holds n seats until it forks), and within its tenant's concurrency limit.

Each condition is written once (the ``*over_*`` and ``_window_fits`` predicates); the API's refusals and the
scheduler's aborts word them differently (a field to fix, or what the executor can hold), both here.
"""

from __future__ import annotations

from dataclasses import dataclass

from pagedkv.tenancy import Tenant
from scheduler_svc.config import SchedulerConfig
from scheduler_svc.request import Request


@dataclass(frozen=True, slots=True)
class FitLimits:
    """What one executor's pool lets one request of a tenant hold, and the settings that shape a request: computed
    once per request and executor (``TenantLimits.fit_limits``; the API takes the largest executor's)."""

    tenant: str
    capacity: int  # the most pages one request of the tenant can get there (its quota, less others' reserves)
    block_size: int
    max_model_len: int
    max_batched_tokens: int
    max_num_seqs: int
    sliding_window: int = 0  # the server's (a tenant's own overrides)
    sink_tokens: int = 0
    model_window: int = 0  # the model's own window (every layer attends to at most its last N tokens)


def limits_for(tenant: str, capacity: int, block_size: int, config: SchedulerConfig) -> FitLimits:
    """The fit limits of a pool of ``block_size`` pages where the tenant's capacity is ``capacity`` pages."""
    c = config
    return FitLimits(tenant, capacity, block_size, c.max_model_len, c.max_num_batched_tokens, c.max_num_seqs,
                     c.sliding_window, c.sink_tokens, c.model_window)


@dataclass(frozen=True, slots=True)
class Shape:
    """A new request's shape: its page budget, attention window (sink, window; 0: full attention) and longest
    prompt + output, with what sets that length (for the messages of the prompt and sampling checks)."""

    page_budget: int
    sink: int
    window: int
    max_len: int
    max_len_name: str


class FitError(ValueError):
    """The request can never run: the message names the field and the limit."""


def pages_for(num_tokens: int, block_size: int) -> int:
    """Pages that hold num_tokens tokens."""
    return -(-num_tokens // block_size)


def window_pages(sink: int, window: int, block_size: int) -> int:
    """The fewest pages a windowed request runs with: its sink's pages, its window's, plus two (the window
    starts and ends mid-page)."""
    return pages_for(sink, block_size) + pages_for(window, block_size) + 2


def window_page_limit(capacity: int, sink: int, window: int, block_size: int, max_batched_tokens: int) -> int:
    """Pages a windowed request without a budget may hold: its sink and window, plus a prefill chunk, within
    its tenant's capacity (0: the window alone does not fit)."""
    least = window_pages(sink, window, block_size)
    if least > capacity:
        return 0
    return min(capacity, least + pages_for(max_batched_tokens, block_size))


def max_len(capacity: int, block_size: int, max_model_len: int, windowed: bool) -> int:
    """Longest prompt + output a request can reach: max_model_len, lower when its tenant's capacity holds
    fewer tokens (a request with a window holds a bounded number of pages at any length)."""
    return max_model_len if windowed else min(max_model_len, capacity * block_size)


def attention_window(tenant: Tenant, sliding_window: int, sink_tokens: int, budget: int,
                     block_size: int, model_window: int = 0) -> tuple[int, int]:
    """(sink tokens, window tokens) of a request: the tenant's (else the server's) sliding window, the model's
    own window (every layer attends to at most its last model_window tokens: the same mask, so the same
    output; its pages behind are freed), and for a page budget with the 'window' policy the first page(s) as
    sink plus as many recent tokens as the budget holds; the narrower window wins. (0, 0): full attention."""
    sliding = tenant.sliding_window or sliding_window
    sink = tenant.sink_tokens or sink_tokens
    windows = [w for w in (sliding, model_window) if w]
    if budget and tenant.overflow == "window":
        sink = sink or block_size  # the first page is the attention sink
        windows.append((budget - pages_for(sink, block_size) - 1) * block_size)
    if not windows:
        return 0, 0
    return sink, min(windows)


def bounds(req: Request, limits: FitLimits) -> tuple[int, int]:
    """(max_len, page limit) of a shaped request on one executor: its longest prompt + output there, and the pages a
    windowed request without a budget may hold there (0: none set)."""
    window = req.window_tokens
    longest = max_len(limits.capacity, limits.block_size, limits.max_model_len, bool(window))
    if not window or req.page_budget:
        return longest, 0
    return longest, window_page_limit(limits.capacity, req.sink_tokens, window, limits.block_size,
                                      limits.max_batched_tokens)


# ---- the conditions ----------------------------------------------------------------------------
def _over_seats(n: int, limits: FitLimits) -> bool:
    return n > limits.max_num_seqs


def over_concurrency(n: int, tenant: Tenant) -> bool:
    """Whether n sequences are more than the tenant may ever run at once (a reload may lower its limit)."""
    return bool(tenant.max_concurrent_requests) and n > tenant.max_concurrent_requests


def _over_capacity(page_budget: int, limits: FitLimits) -> bool:
    return page_budget > limits.capacity


def _window_fits(sink: int, window: int, limits: FitLimits) -> bool:
    return bool(window_page_limit(limits.capacity, sink, window, limits.block_size, limits.max_batched_tokens))


# ---- a new request (the API) -------------------------------------------------------------------
def shape(tenant: Tenant, prompt_len: int, asked_budget: int, limits: FitLimits, max_model_len: int) -> Shape:
    """The shape of a new request of ``tenant`` on the pool ``limits`` describes (the largest executor's), with
    ``max_model_len`` the server's; FitError names the field that cannot be."""
    budget = _page_budget(tenant, asked_budget, prompt_len, limits)
    bs = limits.block_size
    sink, window = attention_window(tenant, limits.sliding_window, limits.sink_tokens, budget, bs, limits.model_window)
    if window and not budget and limits.model_window and not _window_fits(sink, window, limits):
        # the model's window does not fit what this tenant may hold: the request holds its whole context
        # instead (its length capped to the tenant's pages below), as with a model without a window
        sink, window = attention_window(tenant, limits.sliding_window, limits.sink_tokens, budget, bs)
    if window and not budget and not _window_fits(sink, window, limits):
        raise FitError(f"sliding window: sink {sink} + window {window} tokens do not fit the {limits.capacity} pages "
                       f"tenant {tenant.id} can hold")
    longest = max_len(limits.capacity, bs, max_model_len, bool(window))
    name = "max_model_len" if longest == max_model_len else (
        f"the {limits.capacity} pages tenant {tenant.id} can hold (tokens)")
    return Shape(budget, sink, window, longest, name)


def _page_budget(tenant: Tenant, asked: int, prompt_len: int, limits: FitLimits) -> int:
    """The request's page budget: the tenant's, or lower if the request asks."""
    if asked < 0:
        raise FitError(f"page_budget: {asked}; must be >= 0 (0: the tenant's default)")
    if tenant.page_budget and asked > tenant.page_budget:
        raise FitError(f"page_budget: {asked} pages; must be <= {tenant.page_budget} (tenant {tenant.id}'s budget; a "
                       "request may lower it, never raise it)")
    budget = asked or tenant.page_budget
    if not budget:
        return 0
    if _over_capacity(budget, limits):
        raise FitError(f"page_budget: {budget} pages; tenant {tenant.id} can hold at most {limits.capacity} (its "
                       "quota, less other tenants' reserved pages)")
    bs = limits.block_size
    if tenant.overflow == "stop":
        need = pages_for(prompt_len, bs)
        if need > budget:
            raise FitError(f"prompt: {prompt_len} tokens need {need} pages; the page budget is {budget} pages "
                           "(overflow policy 'stop')")
    else:
        least = pages_for(tenant.sink_tokens or limits.sink_tokens or bs, bs) + 2  # the sink's pages plus two
        if budget < least:
            raise FitError(f"page_budget: {budget} pages; the 'window' policy needs at least {least} (the attention "
                           "sink's pages plus two)")
    return budget


def check_n(n: int, tenant: Tenant, limits: FitLimits) -> None:
    """A request's n sequences must fit the seats of one executor and its tenant's concurrency limit."""
    if _over_seats(n, limits):
        raise FitError(f"sampling.n: {n}; must be <= max_num_seqs={limits.max_num_seqs}")
    if over_concurrency(n, tenant):
        raise FitError(f"sampling.n: {n}; must be <= {tenant.max_concurrent_requests} (tenant {tenant.id}'s "
                       "max_concurrent_requests)")


def fit_request(tenant: Tenant, prompt_len: int, asked_budget: int, n: int, limits: FitLimits,
                max_model_len: int) -> Shape:
    """The fit stage of a new request's way in (scheduler_svc/intake.py): its shape (``shape``) and its ``n``
    sequences' seats (``check_n``; 0 means 1)."""
    out = shape(tenant, prompt_len, asked_budget, limits, max_model_len)
    check_n(max(1, n), tenant, limits)
    return out


# ---- a shaped request on one executor (placement, add, reloads) --------------------------------
def misfit(req: Request, limits: FitLimits) -> str:
    """Why a shaped request (its prompt and output so far) can never run on the executor ``limits`` describes ('' if
    it can)."""
    tenant, capacity = limits.tenant, limits.capacity
    n, page_budget, sink, window = req.n, req.page_budget, req.sink_tokens, req.window_tokens
    if _over_seats(n, limits):
        return f"n={n} is above max_num_seqs={limits.max_num_seqs}"
    if _over_capacity(page_budget, limits):
        return f"its page budget of {page_budget} pages is above the {capacity} pages tenant {tenant} can hold"
    if window and not page_budget:
        if not _window_fits(sink, window, limits):
            return (f"sink {sink} + window {window} tokens need {window_pages(sink, window, limits.block_size)} "
                    f"pages; tenant {tenant} can hold {capacity}")
        return ""
    if req.num_tokens >= max_len(capacity, limits.block_size, limits.max_model_len, bool(window)):
        return (f"{req.num_tokens} tokens (prompt and output so far) do not fit what tenant {tenant} can hold "
                f"({capacity} pages)")
    return ""


def reload_misfit(req: Request, limits: FitLimits, tenant: Tenant) -> str:
    """Why a live request no longer fits after its tenant's limits changed (a reload, or the executors that serve):
    a quota lowered below what it holds or needs, or below its page budget, or n above the concurrency limit ('' if
    it fits)."""
    if misfit(req, limits):  # (a budget above the capacity: it could never grow)
        return f"tenant {req.tenant}'s new limits hold {limits.capacity} pages; this request needs more"
    if over_concurrency(req.n, tenant):  # (a parent not yet forked: it could never be admitted again)
        return (f"tenant {req.tenant}'s new limits allow {tenant.max_concurrent_requests} concurrent sequences; this "
                f"request asked for n={req.n}")
    return ""
