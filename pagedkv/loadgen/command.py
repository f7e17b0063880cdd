"""``pagedkv bench``: options, the run, and what it prints and writes."""

from __future__ import annotations

import argparse
import asyncio
import json
import math
import os
import sys
from pathlib import Path
from typing import Any

import grpc

from pagedkv.client import Client
from pagedkv.loadgen.plots import write_plots
from pagedkv.loadgen.report import FIELD_DOCS, format_table, kv_summary, request_record, summarize
from pagedkv.loadgen.runner import Progress, SamplingOptions, run_requests
from pagedkv.loadgen.scrape import MetricsScraper
from pagedkv.loadgen.workload import (
    ARRIVALS,
    LengthDist,
    PlannedRequest,
    SharedPrefixes,
    Tenant,
    TokenSpace,
    WorkloadError,
    WorkloadSpec,
    check_arrivals,
    default_token_space,
    make_workload,
)
from pagedkv.security import add_tls_client_args

DESCRIPTION = """\
Load generator: sends synthetic requests (token-id prompts, EOS ignored so outputs are as long as asked)
to a running scheduler over gRPC and reports throughput, TTFT / TPOT / ITL / end-to-end latency
percentiles, goodput under an SLO and errors by gRPC status; writes JSON (--out) and PNG plots.
Lengths: N | fixed:N | uniform:LO:HI | lognormal:MEAN:SIGMA[:MAX] (ShareGPT-like; the defaults use
the ShareGPT means from the PagedAttention paper, 161 input / 338 output tokens)."""

EPILOG = """\
examples:
  pagedkv bench --num-prompts 200 --request-rate 4 --out run.json
  pagedkv bench --request-rate inf --max-concurrency 16 --input-len uniform:32:512 --output-len 128
  pagedkv bench --shared-prefix-fraction 0.8 --num-shared-prefixes 4 --shared-prefix-len 1024
  pagedkv bench --tenant a=KEY_A:3 --tenant b=KEY_B:1 --slo-ttft-ms 500 --slo-tpot-ms 50
  pagedkv bench --metrics-url http://127.0.0.1:9400/metrics --out run.json   # + KV utilization plot
JSON fields: pagedkv bench --describe-json"""


def _rate(text: str) -> float:
    value = float(text)
    if math.isnan(value) or value <= 0:
        raise argparse.ArgumentTypeError(f"{text}: must be > 0 (inf: all requests at once)")
    return value


def add_args(p: argparse.ArgumentParser) -> None:
    p.description, p.epilog = DESCRIPTION, EPILOG
    p.formatter_class = argparse.RawDescriptionHelpFormatter
    p.add_argument("--address", default=os.environ.get("PAGEDKV_ADDRESS", "127.0.0.1:50051"))
    p.add_argument("--api-key", default=os.environ.get("PAGEDKV_API_KEY", ""),
                   help="API key for every request (default: $PAGEDKV_API_KEY); --tenant replaces it with a mix")
    add_tls_client_args(p)
    p.add_argument("--tenant", action="append", default=[], metavar="[NAME=]KEY[:WEIGHT]",
                   help="a tenant of a multi-tenant mix (repeatable): each request takes one key, chosen "
                        "with probability proportional to WEIGHT (default 1)")
    p.add_argument("--num-prompts", type=int, default=100, help="requests to send (default 100)")
    p.add_argument("--request-rate", type=_rate, default=math.inf,
                   help="mean arrivals per second; inf (default): all at once")
    p.add_argument("--arrival", choices=ARRIVALS, default="poisson",
                   help="poisson: exponential gaps; burst: --burst-size requests together every "
                        "burst-size/rate seconds")
    p.add_argument("--burst-size", type=int, default=8)
    p.add_argument("--max-concurrency", type=int, default=0, help="most requests in flight (0: no cap)")
    p.add_argument("--input-len", default="lognormal:161:1.0:1024",
                   help="prompt tokens per request, BOS included; a request given a shared prefix has the prefix "
                        "+ INPUT_LEN - 1 tokens (default lognormal:161:1.0:1024)")
    p.add_argument("--output-len", default="lognormal:338:1.0:1024",
                   help="max_tokens per request (default lognormal:338:1.0:1024)")
    p.add_argument("--shared-prefix-fraction", type=float, default=0.0,
                   help="share of requests that start with one of the shared prefixes (0: none)")
    p.add_argument("--num-shared-prefixes", type=int, default=1, help="K distinct shared prefixes")
    p.add_argument("--shared-prefix-len", type=int, default=0, help="tokens per shared prefix, BOS included")
    p.add_argument("--token-id-range", default="auto", metavar="LO:HI",
                   help="prompt ids uniform in [LO, HI) (auto: [3, 0.9 * vocab_size), avoiding special tokens)")
    p.add_argument("--no-bos", action="store_true",
                   help="do not start prompts with the BOS the server's tokenizer adds to text prompts")
    p.add_argument("--ignore-eos", action=argparse.BooleanOptionalAction, default=True,
                   help="ask the server to ignore EOS, so each output is max_tokens long (default: on)")
    p.add_argument("--temperature", type=float, default=0.0, help="0: greedy (default)")
    p.add_argument("--seed", type=int, default=0, help="seed of the workload (prompts and lengths do not depend on "
                   "the rate or the tenant mix); request i samples with seed + i")
    p.add_argument("--slo-ttft-ms", type=float, default=None,
                   help="TTFT SLO for goodput, in ms (default: none; with neither SLO goodput is not computed)")
    p.add_argument("--slo-tpot-ms", type=float, default=None,
                   help="TPOT SLO for goodput, in ms (default: none)")
    p.add_argument("--metrics-url", default="",
                   help="scheduler's Prometheus endpoint (pagedkv scheduler --metrics-port), e.g. "
                        "http://127.0.0.1:9400/metrics: KV gauges are sampled during the run")
    p.add_argument("--metrics-interval", type=float, default=0.5, help="seconds between scrapes (default 0.5)")
    p.add_argument("--out", type=Path, default=None, help="write the JSON report here (default: none: stdout only)")
    p.add_argument("--plots", type=Path, default=None, metavar="PREFIX",
                   help="write PREFIX_latency_cdf.png (and PREFIX_kv.png); default: --out without .json")
    p.add_argument("--no-plots", action="store_true")
    p.add_argument("--no-progress", action="store_true", help="no progress bar (also off when stderr is not a tty)")
    p.add_argument("--ready-timeout", type=float, default=60.0, help="seconds to wait for the server to serve")
    p.add_argument("--describe-json", action="store_true", help="print the fields of the JSON report and exit")


def _check_args(args: argparse.Namespace) -> None:
    for name in ("slo_ttft_ms", "slo_tpot_ms"):
        v = getattr(args, name)
        if v is not None and not (math.isfinite(v) and v > 0):
            raise WorkloadError(f"--{name.replace('_', '-')}: {v}; must be > 0")
    if args.max_concurrency < 0:
        raise WorkloadError(f"--max-concurrency: {args.max_concurrency}; must be >= 0 (0: no cap)")
    if not (math.isfinite(args.metrics_interval) and args.metrics_interval > 0):
        raise WorkloadError(f"--metrics-interval: {args.metrics_interval}; must be > 0")
    if not (math.isfinite(args.temperature) and args.temperature >= 0):
        raise WorkloadError(f"--temperature: {args.temperature}; must be >= 0")


def _tenants(args: argparse.Namespace) -> tuple[Tenant, ...]:
    if args.tenant:
        tenants = tuple(Tenant.parse(s, i) for i, s in enumerate(args.tenant))
        names = [t.name for t in tenants]
        if len(set(names)) != len(names):
            raise WorkloadError(f"--tenant: names {names} must be distinct")
        return tenants
    return ()


def _token_space(spec: str, vocab_size: int, bos: tuple[int, ...]) -> TokenSpace:
    if spec == "auto":
        return default_token_space(vocab_size, bos)
    lo, sep, hi = spec.partition(":")
    try:
        space = TokenSpace(int(lo), int(hi), bos)
    except ValueError:
        raise WorkloadError(f"--token-id-range: {spec!r}; expected LO:HI or auto") from None
    space.validate(vocab_size)
    return space


async def _probe(address: str, keys: dict[str, str], timeout: float,
                 tls: dict[str, str] | None = None) -> tuple[Any, tuple[int, ...]]:
    """ModelInfo and the BOS of text prompts, asked with the first key the server accepts."""
    last: grpc.aio.AioRpcError | None = None
    for key in dict.fromkeys(keys.values()):
        async with Client(address, api_key=key, **(tls or {})) as client:
            await client.wait_ready(timeout)
            try:
                info = await client.model_info()
                bos = tuple(await client.tokenize("", add_special_tokens=True))
                return info, bos
            except grpc.aio.AioRpcError as err:
                last = err
    assert last is not None
    raise last


def _config(args: argparse.Namespace, tenants: tuple[Tenant, ...], space: TokenSpace) -> dict[str, Any]:
    return {"address": args.address, "num_prompts": args.num_prompts, "input_len": args.input_len,
            "output_len": args.output_len,
            "request_rate": None if math.isinf(args.request_rate) else args.request_rate,
            "arrival": args.arrival, "burst_size": args.burst_size, "max_concurrency": args.max_concurrency,
            "shared_prefix_fraction": args.shared_prefix_fraction, "num_shared_prefixes": args.num_shared_prefixes,
            "shared_prefix_len": args.shared_prefix_len,
            "tenants": [{"name": t.name, "weight": t.weight} for t in tenants],
            "ignore_eos": args.ignore_eos, "temperature": args.temperature, "seed": args.seed,
            "token_id_range": [space.lo, space.hi], "bos": list(space.bos),
            "slo_ttft_ms": args.slo_ttft_ms, "slo_tpot_ms": args.slo_tpot_ms, "metrics_url": args.metrics_url or None}


def _workload_summary(plan: list[PlannedRequest]) -> dict[str, Any]:
    per_tenant: dict[str, int] = {}
    for r in plan:
        per_tenant[r.tenant] = per_tenant.get(r.tenant, 0) + 1
    return {"requests_with_shared_prefix": sum(1 for r in plan if r.prefix >= 0),
            "requests_fitted": sum(1 for r in plan if r.fitted),
            "planned_input_tokens": sum(len(r.prompt) for r in plan),
            "planned_output_tokens": sum(r.max_tokens for r in plan),
            "requests_per_tenant": dict(sorted(per_tenant.items()))}


async def _bench(args: argparse.Namespace) -> int:
    _check_args(args)
    tenants = _tenants(args)
    spec = WorkloadSpec(
        num_prompts=args.num_prompts, input_len=LengthDist.parse(args.input_len, "--input-len"),
        output_len=LengthDist.parse(args.output_len, "--output-len"), request_rate=args.request_rate,
        arrival=args.arrival, burst_size=args.burst_size,
        shared=SharedPrefixes(args.shared_prefix_fraction, args.num_shared_prefixes, args.shared_prefix_len),
        tenants=tenants, seed=args.seed)
    spec.shared.validate()
    check_arrivals(spec.num_prompts, spec.request_rate, spec.arrival, spec.burst_size)
    keys = {t.name: t.key for t in tenants} or {"default": args.api_key}
    tls = {"tls_ca": args.tls_ca, "tls_server_name": args.tls_server_name}
    info, bos = await _probe(args.address, keys, args.ready_timeout, tls)
    space = _token_space(args.token_id_range, info.vocab_size, () if args.no_bos else bos)
    plan = make_workload(spec, space, info.max_model_len)
    workload = _workload_summary(plan)
    print(f"pagedkv bench: {len(plan)} requests to {args.address} ({info.model}, max_model_len {info.max_model_len}); "
          f"{workload['planned_input_tokens']} prompt tokens, {workload['planned_output_tokens']} output tokens "
          f"asked; rate {args.request_rate:g}/s ({args.arrival}); {workload['requests_fitted']} fitted to "
          f"max_model_len", flush=True)
    scraper = MetricsScraper(args.metrics_url, args.metrics_interval) if args.metrics_url else None
    progress = Progress(len(plan), enabled=not args.no_progress and sys.stderr.isatty())
    opts = SamplingOptions(ignore_eos=args.ignore_eos, temperature=args.temperature, seed=args.seed)
    results, wall = await run_requests(args.address, plan, keys, opts, args.max_concurrency, progress, scraper,
                                       tls)

    report: dict[str, Any] = {
        "version": 1, "config": _config(args, tenants, space),
        "server": {"model": info.model, "max_model_len": info.max_model_len, "block_size": info.block_size,
                   "num_pages": info.num_pages, "vocab_size": info.vocab_size, "prefix_caching": info.prefix_caching},
        "workload": workload,
        **summarize(results, wall, args.slo_ttft_ms, args.slo_tpot_ms),
        "kv_metrics": None if scraper is None else kv_summary(
            scraper.url, scraper.interval_s, scraper.samples, scraper.errors, scraper.last_error),
        "plots": [],
    }
    prefix = args.plots or (args.out.with_suffix("") if args.out else None)
    if prefix is not None and not args.no_plots:
        report["plots"], note = write_plots(prefix, results, scraper.samples if scraper else None)
        if note:
            print(note, file=sys.stderr)
    report["per_request"] = [request_record(r) for r in results]
    print(format_table(report))
    if scraper is not None and scraper.errors:
        print(f"metrics: {scraper.errors} scrapes of {scraper.url} failed (last: {scraper.last_error})",
              file=sys.stderr)
    for path in report["plots"]:
        print(f"wrote {path}")
    if args.out:
        args.out.parent.mkdir(parents=True, exist_ok=True)
        args.out.write_text(json.dumps(report, indent=2) + "\n")
        print(f"wrote {args.out}")
    return 0 if report["completed"] else 1


def main(args: argparse.Namespace) -> int:
    """Entry point of ``pagedkv bench``: 0 when at least one request completed."""
    if args.describe_json:
        width = max(map(len, FIELD_DOCS))
        for key, doc in FIELD_DOCS.items():
            print(f"{key:<{width}}  {doc}")
        return 0
    try:
        return asyncio.run(_bench(args))
    except WorkloadError as err:
        print(f"error: {err}", file=sys.stderr)
        return 2
    except ValueError as err:  # an unreadable --tls-ca
        print(f"error: {err}", file=sys.stderr)
        return 2
    except (TimeoutError, grpc.aio.AioRpcError) as err:
        if isinstance(err, grpc.aio.AioRpcError):
            print(f"error: {args.address}: {err.code().name}: {err.details()}", file=sys.stderr)
        else:
            print(f"error: {err} (--address, --ready-timeout)", file=sys.stderr)
        return 1
