"""From the recorded streams to numbers: definitions as vLLM's ``benchmark_serving``.

* TTFT: arrival of the first message carrying a token − send.
* E2E latency: end of the stream − send.
* TPOT: (E2E − TTFT) / (output tokens − 1), per request with more than one output token.
* ITL: the gaps between consecutive messages carrying tokens, over all requests. The server streams one
  message per step per request, so a message normally carries one token; when one carries k > 1 tokens
  (they arrived together), it adds *one* gap, not k (the tokens_per_message fields say how often that
  happened). The first token is not an ITL sample (it is TTFT).
* Throughput: tokens and requests of *completed* requests (finish reason stop or length, no error) over the
  duration (start of the run to the end of the last stream).
* Goodput: completed requests whose TTFT <= ``--slo-ttft-ms`` and TPOT <= ``--slo-tpot-ms`` (a request with
  one output token has no TPOT and meets that part), per second of duration.

Percentiles interpolate linearly between order statistics (numpy's default).
"""

from __future__ import annotations

import math
import statistics
from collections import Counter
from collections.abc import Iterable, Sequence
from typing import Any

from pagedkv.loadgen.runner import RequestResult
from pagedkv.loadgen.scrape import page_utilization

PERCENTILES = (50, 90, 99)

# Every field of the JSON ``pagedkv bench --out`` writes. "*" stands for a key that varies (a tenant name,
# a status code, a metric name); "[]" for the items of a list. A test checks the JSON against this.
STAT_FIELDS = {
    "count": "number of samples",
    "mean": "mean (ms)", "p50": "median (ms)", "p90": "90th percentile (ms)", "p99": "99th percentile (ms)",
    "min": "smallest sample (ms)", "max": "largest sample (ms)",
}
_STATS = ("ttft_ms", "tpot_ms", "itl_ms", "e2e_latency_ms", "queue_wait_ms")
FIELD_DOCS: dict[str, str] = {
    "version": "format version of this file (1)",
    "config": "the options of the run",
    "config.address": "scheduler address", "config.num_prompts": "requests planned",
    "config.input_len": "input length distribution (see --input-len)",
    "config.output_len": "output length distribution: max_tokens asked (see --output-len)",
    "config.request_rate": "mean arrivals per second (null: all at once)",
    "config.arrival": "poisson or burst", "config.burst_size": "requests per burst (burst arrivals)",
    "config.max_concurrency": "most requests in flight (0: no cap)",
    "config.shared_prefix_fraction": "share of requests given a shared prefix",
    "config.num_shared_prefixes": "distinct shared prefixes", "config.shared_prefix_len": "tokens per shared prefix",
    "config.tenants": "tenant mix: name and weight per API key (keys are not written)",
    "config.tenants[]": "one tenant", "config.tenants[].name": "label of the tenant",
    "config.tenants[].weight": "share of requests (relative)",
    "config.ignore_eos": "requests ask the server to ignore EOS (output length = max_tokens)",
    "config.temperature": "sampling temperature (0: greedy)", "config.seed": "seed of the workload and samplers",
    "config.token_id_range": "[lo, hi) of the random prompt ids", "config.bos": "ids put first in every prompt",
    "config.slo_ttft_ms": "TTFT SLO for goodput (null: none)",
    "config.slo_tpot_ms": "TPOT SLO for goodput (null: none)",
    "config.metrics_url": "Prometheus endpoint scraped (null: none)",
    "server": "what ModelInfo said before the run",
    "server.model": "model name", "server.max_model_len": "longest prompt + output",
    "server.block_size": "tokens per KV page", "server.num_pages": "device KV pages",
    "server.vocab_size": "vocabulary size", "server.prefix_caching": "prefix caching on",
    "workload": "what was planned",
    "workload.requests_with_shared_prefix": "requests planned with a shared prefix",
    "workload.requests_fitted": "requests shortened to fit max_model_len",
    "workload.planned_input_tokens": "prompt tokens of all planned requests",
    "workload.planned_output_tokens": "max_tokens of all planned requests",
    "workload.requests_per_tenant": "planned requests by tenant", "workload.requests_per_tenant.*": "count",
    "duration_s": "start of the run to the end of the last stream (s)",
    "requests": "planned requests", "completed": "requests that finished with stop or length and no error",
    "failed": "requests that ended with a gRPC error or finish reason abort",
    "errors": "gRPC errors by status code", "errors.*": "count",
    "finish_reasons": "finish reasons of the streams that ended normally", "finish_reasons.*": "count",
    "short_outputs": "completed requests with fewer output tokens than max_tokens (EOS, a stop, a limit)",
    "usage_mismatches": "completed requests whose streamed token count differs from usage.completion_tokens",
    "total_input_tokens": "prompt tokens of completed requests",
    "total_output_tokens": "output tokens streamed to completed requests",
    "cached_prompt_tokens": "prompt tokens the server served from its prefix cache (usage.cached_tokens)",
    "request_throughput": "completed requests / duration (req/s)",
    "input_token_throughput": "total_input_tokens / duration (tok/s)",
    "output_token_throughput": "total_output_tokens / duration (tok/s)",
    "total_token_throughput": "(input + output tokens) / duration (tok/s)",
    "goodput": "requests meeting the SLOs (all null without an SLO)",
    "goodput.requests_meeting_slo": "completed requests meeting every SLO given",
    "goodput.request_goodput": "requests_meeting_slo / duration (req/s)",
    "goodput.share": "requests_meeting_slo / completed",
    "tokens_per_message": "output tokens per stream message that carried tokens",
    "tokens_per_message.mean": "mean", "tokens_per_message.max": "most in one message",
    "tokens_per_message.multi_token_messages": "messages carrying more than one token",
    "per_tenant": "the same measures by tenant", "per_tenant.*": "one tenant",
    "per_tenant.*.requests": "planned", "per_tenant.*.completed": "completed", "per_tenant.*.failed": "failed",
    "per_tenant.*.output_token_throughput": "its output tokens / run duration (tok/s)",
    "kv_metrics": "scheduler gauges sampled during the run (null without --metrics-url)",
    "kv_metrics.url": "endpoint", "kv_metrics.interval_s": "seconds between scrapes",
    "kv_metrics.scrapes": "successful scrapes", "kv_metrics.scrape_errors": "failed scrapes",
    "kv_metrics.last_error": "the last scrape error ('' for none)",
    "kv_metrics.peak_pages_used": "most pages used in a sample (null: gauge absent)",
    "kv_metrics.mean_page_utilization": "mean over samples of pages used / (used + free) (null: gauges absent)",
    "kv_metrics.mean_kv_slot_utilization": "mean of pagedkv_kv_slot_utilization (token slots holding KV / slots "
                                           "in used pages) over samples with pages in use (null: gauge absent)",
    "kv_metrics.samples": "the samples", "kv_metrics.samples[]": "one scrape",
    "kv_metrics.samples[].t_s": "seconds since the start of the run",
    "kv_metrics.samples[].values": "gauge values by metric name", "kv_metrics.samples[].values.*": "value",
    "plots": "paths of the PNG files written",
    "per_request": "one record per planned request", "per_request[]": "one request",
    "per_request[].index": "position in the plan", "per_request[].tenant": "tenant name",
    "per_request[].prefix": "shared prefix index (-1: none)", "per_request[].prompt_tokens": "prompt tokens sent",
    "per_request[].max_tokens": "max_tokens asked", "per_request[].send_s": "send time since the start (s)",
    "per_request[].queue_wait_ms": "planned time to send (concurrency cap) (ms)",
    "per_request[].ttft_ms": "TTFT (ms; null: no token)", "per_request[].tpot_ms": "TPOT (ms; null: < 2 tokens)",
    "per_request[].e2e_latency_ms": "send to end of stream (ms)",
    "per_request[].output_tokens": "token ids streamed", "per_request[].messages": "messages carrying tokens",
    "per_request[].cached_tokens": "prompt tokens from the prefix cache",
    "per_request[].finish_reason": "stop, length, abort (null: error)",
    "per_request[].error": "gRPC status code name (null: none)", "per_request[].error_detail": "its message",
}
for _name in _STATS:
    FIELD_DOCS[_name] = {"ttft_ms": "time to first token", "tpot_ms": "time per output token after the first",
                         "itl_ms": "gaps between messages carrying tokens",
                         "e2e_latency_ms": "send to end of stream",
                         "queue_wait_ms": "planned send time to actual send (concurrency cap)"}[_name]
    for _k, _doc in STAT_FIELDS.items():
        FIELD_DOCS[f"{_name}.{_k}"] = _doc
for _name in ("ttft_ms", "e2e_latency_ms"):
    FIELD_DOCS[f"per_tenant.*.{_name}"] = f"{_name} of the tenant's completed requests"
    for _k, _doc in STAT_FIELDS.items():
        FIELD_DOCS[f"per_tenant.*.{_name}.{_k}"] = _doc


def percentile(values: Sequence[float], q: float) -> float:
    xs = sorted(values)
    pos = (len(xs) - 1) * q / 100.0
    lo = int(pos)
    hi = min(lo + 1, len(xs) - 1)
    return xs[lo] + (xs[hi] - xs[lo]) * (pos - lo)


def stats_ms(seconds: Iterable[float]) -> dict[str, float | int | None]:
    """count, mean, p50/p90/p99, min, max in milliseconds (None for each without samples)."""
    xs = [s * 1e3 for s in seconds]
    if not xs:
        return {"count": 0, **{k: None for k in STAT_FIELDS if k != "count"}}
    out: dict[str, float | int | None] = {"count": len(xs), "mean": statistics.fmean(xs)}
    for q in PERCENTILES:
        out[f"p{q}"] = percentile(xs, q)
    out["min"], out["max"] = min(xs), max(xs)
    return out


def tpot_s(r: RequestResult) -> float | None:
    if r.ttft_s is None or r.e2e_s is None or r.output_tokens < 2:
        return None
    return (r.e2e_s - r.ttft_s) / (r.output_tokens - 1)


def itl_s(r: RequestResult) -> list[float]:
    return [b - a for a, b in zip(r.delivery_s, r.delivery_s[1:])]


def meets_slo(r: RequestResult, slo_ttft_ms: float | None, slo_tpot_ms: float | None) -> bool:
    if slo_ttft_ms is not None and (r.ttft_s is None or r.ttft_s * 1e3 > slo_ttft_ms):
        return False
    tpot = tpot_s(r)
    return slo_tpot_ms is None or tpot is None or tpot * 1e3 <= slo_tpot_ms


def _ms(x: float | None) -> float | None:
    return None if x is None else x * 1e3


def request_record(r: RequestResult) -> dict[str, Any]:
    return {"index": r.index, "tenant": r.tenant, "prefix": r.prefix, "prompt_tokens": r.prompt_tokens,
            "max_tokens": r.max_tokens, "send_s": r.send_s, "queue_wait_ms": r.queue_wait_s * 1e3,
            "ttft_ms": _ms(r.ttft_s), "tpot_ms": _ms(tpot_s(r)), "e2e_latency_ms": _ms(r.e2e_s),
            "output_tokens": r.output_tokens, "messages": len(r.delivery_s), "cached_tokens": r.cached_tokens,
            "finish_reason": r.finish_reason, "error": r.error, "error_detail": r.error_detail}


def kv_summary(url: str, interval_s: float, samples: list[dict], errors: int, last_error: str) -> dict[str, Any]:
    used = [s["values"]["pagedkv_pages_used"] for s in samples if "pagedkv_pages_used" in s["values"]]
    util = [u for u in (page_utilization(s["values"]) for s in samples) if u is not None]
    slots = [s["values"]["pagedkv_kv_slot_utilization"] for s in samples
             if "pagedkv_kv_slot_utilization" in s["values"] and s["values"].get("pagedkv_pages_used", 1) > 0]
    return {"url": url, "interval_s": interval_s, "scrapes": len(samples), "scrape_errors": errors,
            "last_error": last_error, "peak_pages_used": max(used) if used else None,
            "mean_page_utilization": statistics.fmean(util) if util else None,
            "mean_kv_slot_utilization": statistics.fmean(slots) if slots else None, "samples": samples}


def summarize(results: Sequence[RequestResult], duration_s: float, slo_ttft_ms: float | None,
              slo_tpot_ms: float | None) -> dict[str, Any]:
    """The measured part of the report (everything but config, server, workload, kv_metrics, plots)."""
    done = [r for r in results if r.ok]
    dur = duration_s if duration_s > 0 else math.nan
    inp = sum(r.usage_prompt_tokens or r.prompt_tokens for r in done)
    outp = sum(r.output_tokens for r in done)
    per_msg = [k for r in done for k in r.delivery_tokens]
    has_slo = slo_ttft_ms is not None or slo_tpot_ms is not None
    meeting = sum(1 for r in done if meets_slo(r, slo_ttft_ms, slo_tpot_ms)) if has_slo else None
    tenants: dict[str, list[RequestResult]] = {}
    for r in results:
        tenants.setdefault(r.tenant, []).append(r)
    return {
        "duration_s": duration_s,
        "requests": len(results), "completed": len(done), "failed": len(results) - len(done),
        "errors": dict(Counter(r.error for r in results if r.error)),
        "finish_reasons": dict(Counter(r.finish_reason for r in results if r.finish_reason and not r.error)),
        "short_outputs": sum(1 for r in done if r.output_tokens < r.max_tokens),
        "usage_mismatches": sum(1 for r in done if r.output_tokens != r.usage_completion_tokens),
        "total_input_tokens": inp, "total_output_tokens": outp,
        "cached_prompt_tokens": sum(r.cached_tokens for r in done),
        "request_throughput": len(done) / dur, "input_token_throughput": inp / dur,
        "output_token_throughput": outp / dur, "total_token_throughput": (inp + outp) / dur,
        "goodput": {"requests_meeting_slo": meeting,
                    "request_goodput": None if meeting is None else meeting / dur,
                    "share": None if meeting is None or not done else meeting / len(done)},
        "ttft_ms": stats_ms(r.ttft_s for r in done if r.ttft_s is not None),
        "tpot_ms": stats_ms(t for t in map(tpot_s, done) if t is not None),
        "itl_ms": stats_ms(g for r in done for g in itl_s(r)),
        "e2e_latency_ms": stats_ms(r.e2e_s for r in done if r.e2e_s is not None),
        "queue_wait_ms": stats_ms(r.queue_wait_s for r in results),
        "tokens_per_message": {"mean": statistics.fmean(per_msg) if per_msg else None,
                               "max": max(per_msg) if per_msg else None,
                               "multi_token_messages": sum(1 for k in per_msg if k > 1)},
        "per_tenant": {name: _tenant_summary(rs, dur) for name, rs in sorted(tenants.items())},
    }


def _tenant_summary(rs: list[RequestResult], dur: float) -> dict[str, Any]:
    done = [r for r in rs if r.ok]
    return {"requests": len(rs), "completed": len(done), "failed": len(rs) - len(done),
            "output_token_throughput": sum(r.output_tokens for r in done) / dur,
            "ttft_ms": stats_ms(r.ttft_s for r in done if r.ttft_s is not None),
            "e2e_latency_ms": stats_ms(r.e2e_s for r in done if r.e2e_s is not None)}


def undocumented_fields(report: dict[str, Any]) -> tuple[list[str], list[str]]:
    """(paths in the report that FIELD_DOCS lacks, FIELD_DOCS entries the report lacks)."""
    seen: set[str] = set()

    def walk(obj: Any, path: str) -> None:
        if path:
            seen.add(path)
        if isinstance(obj, dict):
            for k, v in obj.items():
                key = f"{path}.{k}" if path else str(k)
                if key not in FIELD_DOCS:
                    key = f"{path}.*" if f"{path}.*" in FIELD_DOCS else key
                walk(v, key)
        elif isinstance(obj, list):
            for v in obj:
                if isinstance(v, (dict, list)):
                    walk(v, f"{path}[]")

    walk(report, "")
    return sorted(seen - FIELD_DOCS.keys()), sorted(FIELD_DOCS.keys() - seen)


# ---- the table -------------------------------------------------------------------------------------------
def _fmt(x: float | int | None, spec: str = ".2f") -> str:
    if x is None or (isinstance(x, float) and math.isnan(x)):
        return "-"
    return format(x, spec)


def format_table(rep: dict[str, Any]) -> str:
    cfg, g = rep["config"], rep["goodput"]
    rows = [
        ("Requests completed / failed", f"{rep['completed']} / {rep['failed']}"),
        ("Duration (s)", _fmt(rep["duration_s"])),
        ("Input / output tokens", f"{rep['total_input_tokens']} / {rep['total_output_tokens']}"),
        ("Request throughput (req/s)", _fmt(rep["request_throughput"])),
        ("Input token throughput (tok/s)", _fmt(rep["input_token_throughput"], ".1f")),
        ("Output token throughput (tok/s)", _fmt(rep["output_token_throughput"], ".1f")),
        ("Total token throughput (tok/s)", _fmt(rep["total_token_throughput"], ".1f")),
    ]
    if g["requests_meeting_slo"] is not None:
        slo = ", ".join(f"{k} <= {cfg[f'slo_{k}_ms']:g} ms" for k in ("ttft", "tpot") if cfg[f"slo_{k}_ms"] is not None)
        rows.append((f"Goodput (req/s) [{slo}]", f"{_fmt(g['request_goodput'])} "
                     f"({g['requests_meeting_slo']}/{rep['completed']} requests)"))
    if rep["errors"]:
        rows.append(("Errors", ", ".join(f"{k} {v}" for k, v in sorted(rep["errors"].items()))))
    if rep["short_outputs"]:
        rows.append(("Outputs shorter than asked", str(rep["short_outputs"])))
    kv = rep.get("kv_metrics")
    if kv:
        pct = {k: None if kv[k] is None else 100 * kv[k] for k in ("mean_page_utilization", "mean_kv_slot_utilization")}
        rows.append(("KV pages used: peak / mean share of pool", f"{_fmt(kv['peak_pages_used'], '.0f')} / "
                     f"{_fmt(pct['mean_page_utilization'], '.1f')}% ({kv['scrapes']} scrapes, "
                     f"{kv['scrape_errors']} failed)"))
        rows.append(("pagedkv_kv_slot_utilization (mean)", f"{_fmt(pct['mean_kv_slot_utilization'], '.1f')}%"))
    w = max(len(k) for k, _ in rows)
    head = f"{'latency (ms)':<{w}}  {'mean':>9} {'p50':>9} {'p90':>9} {'p99':>9}"
    lines = [" pagedkv bench ".center(len(head), "="), *(f"{k:<{w}}  {v}" for k, v in rows), "-" * len(head), head]
    for label, key in (("TTFT", "ttft_ms"), ("TPOT", "tpot_ms"), ("ITL", "itl_ms"), ("E2E latency", "e2e_latency_ms")):
        s = rep[key]
        lines.append(f"{label:<{w}}  " + " ".join(f"{_fmt(s[k]):>9}" for k in ("mean", "p50", "p90", "p99")))
    if len(rep["per_tenant"]) > 1:
        lines.append("-" * len(head))
        lines.append(f"{'tenant':<{w}}  {'done':>9} {'failed':>9} {'TTFT p50':>9} {'E2E p99':>9}")
        for name, t in rep["per_tenant"].items():
            lines.append(f"{name:<{w}}  {t['completed']:>9} {t['failed']:>9} {_fmt(t['ttft_ms']['p50']):>9} "
                         f"{_fmt(t['e2e_latency_ms']['p99']):>9}")
    lines.append("=" * len(lines[0]))
    return "\n".join(lines)
