"""RequestResults made up for the load generator's report tests."""

from __future__ import annotations

from pagedkv.loadgen.runner import RequestResult


def request_result(i: int, ttft: float, deliveries: list[tuple[float, int]], e2e: float, **kw) -> RequestResult:
    r = RequestResult(i, "default", -1, prompt_tokens=10, max_tokens=sum(k for _, k in deliveries))
    r.ttft_s, r.e2e_s = ttft, e2e
    r.delivery_s = [t for t, _ in deliveries]
    r.delivery_tokens = [k for _, k in deliveries]
    r.output_tokens = r.usage_completion_tokens = sum(r.delivery_tokens)
    r.finish_reason = "length"
    for k, v in kw.items():
        setattr(r, k, v)
    return r
