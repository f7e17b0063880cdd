"""Whether a request fits: the one rule, used by the API, placement, ``Scheduler.add``, tenant reloads and the
start-up argument checks.

A request fits an executor when it can ever hold the pages it needs there:

- without a window, prompt + output up to its ``max_len``: max_model_len, lower when its tenant's capacity
  (its quota, less the pages other tenants reserve on that pool) holds fewer tokens;
- with a sliding window and no page budget, its sink and window pages plus a prefill chunk
  (``window_page_limit``); the least it can run with is ``window_pages``;
- with a page budget, the budget itself, which must be within the tenant's capacity;
- and n <= max_num_seqs (a parent holds n seats until it forks).
"""

from __future__ import annotations

from scheduler_svc.tenancy import Tenant


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


def window_min_budget(tenant: Tenant, sink_tokens: int, block_size: int) -> int:
    """The smallest page budget the 'window' overflow policy works with: the sink's pages plus two."""
    sink = tenant.sink_tokens or sink_tokens or block_size
    return pages_for(sink, block_size) + 2


def fit_error(*, tenant: str, num_tokens: int, n: int, page_budget: int, sink: int, window: int, capacity: int,
              block_size: int, max_model_len: int, max_batched_tokens: int, max_num_seqs: int) -> str:
    """Why a request can never run on a pool where its tenant's capacity is ``capacity`` pages ('' if it
    can)."""
    if n > max_num_seqs:
        return f"n={n} is above max_num_seqs={max_num_seqs}"
    if page_budget > capacity:
        return f"its page budget of {page_budget} pages is above the {capacity} pages tenant {tenant} can hold"
    if window and not page_budget:
        if not window_page_limit(capacity, sink, window, block_size, max_batched_tokens):
            return (f"sink {sink} + window {window} tokens need {window_pages(sink, window, block_size)} pages; "
                    f"tenant {tenant} can hold {capacity}")
        return ""
    if num_tokens >= max_len(capacity, block_size, max_model_len, bool(window)):
        return (f"{num_tokens} tokens (prompt and output so far) do not fit what tenant {tenant} can hold "
                f"({capacity} pages)")
    return ""
