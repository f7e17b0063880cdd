"""Tenants: a noisy neighbour under four scheduling set-ups, and long context with and without a sliding window.

Part 1, noisy neighbour. Two tenants share a server; a tenants file (written to a temporary directory, one per
configuration) gives them the API keys ``key-flood`` and ``key-quiet`` (stored hashed). Tenant A ("flood")
sends ``--flood-requests`` requests (32) at once, each a ``--flood-prompt``-token prompt (32) asking for
``--flood-tokens`` output tokens (256): decode-heavy. ``--quiet-delay`` seconds later (0.5: the flood is
admitted and queued) tenant B ("quiet") starts sending ``--quiet-requests`` requests (40) on a fixed schedule,
one every ``--quiet-interval-ms`` (50 ms), each an asyncio task started at its slot whether or not the earlier
ones finished: prompts of 200-300 tokens, 8 output tokens each. Every prompt is BOS then random ids in
[3, vocab) from a seeded ``random.Random``, distinct per request, so the prefix cache finds nothing; EOS is
ignored, decoding is greedy. Four configurations, each on a fresh ``pagedkv serve`` (``--max-num-seqs 16``,
``--num-pages 256``, ``--max-num-batched-tokens 512``) with the same trace:

* ``fcfs``: ``--no-fairness``, no limits: admission in arrival order;
* ``fair``: fairness on (VTC: the waiting tenant with the least weighted service is admitted first, and a
  tenant above its fair share of pages gives pages back), no limits;
* ``fair+quota``: fairness, and A held to ``page_quota = 0.5`` (of the pool) and ``max_concurrent_requests`` =
  half of ``--max-num-seqs``;
* ``fair+quota+budget``: as ``fair+quota``, plus A's ``page_budget = 8`` pages with ``overflow = "window"``:
  past 8 pages a request keeps its first page (the attention sink) and its most recent tokens, (8 - 2) x 16 =
  96 of them, so A's 288-token requests run windowed and never hold more than 8 pages each.

``--executors N`` runs each noisy-neighbour server as a scheduler driving N executor processes (``--num-pages``
each, one torch thread each): A's quota (a fraction is of all N pools) and its concurrency limit are the
scheduler's, summed over the executors, so they must hold in total; A's peak pages are then the sum of its
per-executor peaks (an upper bound on what it held at once). ``--configs`` runs a subset, e.g. the 3-executor
check of the tenant ledger::

    python bench/tenants.py --only noisy --executors 3 --configs fair+quota --flood-concurrency 4

Before the first configuration's flood, B's trace runs alone on that server: the "B alone" baseline (the same
prompt lengths and schedule, other random ids, so the loaded run cannot reuse its prefix pages).

A's flood is cancelled as soon as B's last request has finished (``--full-flood`` lets it run to the end), to
keep the run short: A's tokens/s is then the tokens it received until the cancellation over the time from its
first send to the cancellation; its latency percentiles cover only the requests that finished and its TTFT
percentiles only those that got a first token (the table says how many finished and started).

Per configuration and tenant the bench reports TTFT p50/p99 (from each request's own send to its first token),
end-to-end latency p50/p99, output tokens/s over the tenant's own span (its first send to its last token, or to
the cancellation), peak KV pages held (``TenantInfo.peak_used_pages``, reset with ``reset_peak`` just before
the trace), budget hits and fair-share preemptions (deltas over the trace), and B's p99 TTFT over B alone; and
per server its preemptions, peak pages, the most requests A had running at once (``ModelInfo`` polled every
``--poll-ms``, 50 ms), and whether every page was free again afterwards.

Part 2, long context with and without a sliding window. ``--long-requests`` requests (8) arrive together on a
single-tenant server with ``--long-num-pages`` pages (96 of 16 tokens: 1,536 tokens of KV), each a
``--long-prompt``-token prompt (600) asking for ``--long-tokens`` output tokens (900). Without a window one
request at full length needs 94 of the 96 pages, so they run about one at a time and preempt each other; with
``--sliding-window 256 --sink-tokens 16`` a request attends to its first 16 tokens plus its last 256 and holds
about (256 + 16) / 16 + 2 = 19 pages, so several run at once. The server caps ``max_model_len`` to the pool
(1,536 tokens) in both runs -- the cap does not look at the window -- so prompt + output must stay within it,
and both runs serve the same requests. Per run: wall time, output tokens/s, the most requests running at once
(``ModelInfo.num_running`` polled every ``--poll-ms``), peak pages, preemptions by kind, tokens computed
(recomputation after preemptions shows here), TTFT and latency p50/p99. The window changes what the model
attends to, so outputs are not compared between the two runs.

Servers start together up front (start-up is ~12 s each on 2 CPUs, mostly imports; an idle server uses well
under 1% of a CPU) and each is measured alone while the others wait; ``--start one-by-one`` starts each just
before its run instead. Before each measured trace the bench waits (up to ``--wait-idle`` s) for the CPUs to go
idle, and warns when other processes used them during a trace (see ``cpu`` in the JSON). Exit code 1 when a
quiet or long request failed or came back short, or pages were still held after a run.

    python bench/tenants.py            # both parts -> bench/results/tenants.json
    python bench/tenants.py --quick    # smoke run (~2 minutes): fewer requests, shorter outputs
    python bench/tenants.py --only long
"""

from __future__ import annotations

import argparse
import json
import random
import sys
import tempfile
from dataclasses import asdict
from pathlib import Path
from typing import Any

from common import is_contended, pages_for
from tenants_client import CONFIGS, LONG_RUNS, make_requests
from tenants_long import long_part, report_long
from tenants_noisy import noisy_part, report_noisy
from tenants_report import Config, _json_safe
from tenants_servers import ClusterSpec, Servers, long_server_args, noisy_server_args, tenants_toml

from pagedkv.models import resolve_model

ROOT = Path(__file__).resolve().parent.parent


def parse_args(argv: list[str] | None = None) -> argparse.Namespace:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--model", default="tiny-llama", help="built-in name or a local HF directory")
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--out", type=Path, default=ROOT / "bench" / "results" / "tenants.json")
    p.add_argument("--only", choices=["both", "noisy", "long"], default="both", help="which part to run")
    p.add_argument("--block-size", type=int, default=16)
    p.add_argument("--max-num-seqs", type=int, default=16)
    p.add_argument("--max-num-batched-tokens", type=int, default=512)
    p.add_argument("--check-integrity", action="store_true", help="servers check page accounting every step")
    g = p.add_argument_group("part 1: noisy neighbour")
    g.add_argument("--num-pages", type=int, default=256,
                   help="device KV pages of the noisy-neighbour servers (of each executor with --executors)")
    g.add_argument("--executors", type=int, default=1,
                   help="executors per noisy-neighbour server: N > 1 runs a scheduler driving N `pagedkv executor` "
                   "processes (one torch thread each); A's quota and concurrency limit are the scheduler's, summed "
                   "over them, and a quota fraction is of all N pools")
    g.add_argument("--configs", default=",".join(CONFIGS),
                   help=f"comma-separated subset of {', '.join(CONFIGS)} (B alone runs on the first one's server)")
    g.add_argument("--flood-requests", type=int, default=32)
    g.add_argument("--flood-prompt", type=int, default=32, help="prompt tokens of each flood request")
    g.add_argument("--flood-tokens", type=int, default=256, help="output tokens of each flood request")
    g.add_argument("--quiet-requests", type=int, default=40)
    g.add_argument("--quiet-prompt", type=int, nargs=2, default=(200, 300), metavar=("MIN", "MAX"),
                   help="prompt length range of the quiet requests")
    g.add_argument("--quiet-tokens", type=int, default=8, help="output tokens of each quiet request")
    g.add_argument("--quiet-interval-ms", type=float, default=50.0, help="one quiet request every this often")
    g.add_argument("--quiet-delay", type=float, default=0.5, help="seconds from the flood to the first quiet request")
    g.add_argument("--flood-quota", type=float, default=0.5,
                   help="flood's page_quota: a fraction of the pool (<= 1) or a number of pages")
    g.add_argument("--flood-concurrency", type=int, default=0,
                   help="flood's max_concurrent_requests in the quota configurations (0: half of --max-num-seqs)")
    g.add_argument("--flood-page-budget", type=int, default=8, help="flood's page_budget (pages per request) "
                   "in fair+quota+budget, overflow 'window'")
    g.add_argument("--full-flood", action="store_true",
                   help="let the flood finish instead of cancelling it when the quiet tenant is done")
    g = p.add_argument_group("part 2: long context")
    g.add_argument("--long-num-pages", type=int, default=96, help="device KV pages of the long-context servers")
    g.add_argument("--long-requests", type=int, default=8)
    g.add_argument("--long-prompt", type=int, default=600)
    g.add_argument("--long-tokens", type=int, default=900)
    g.add_argument("--window", type=int, default=256, help="--sliding-window of the windowed run")
    g.add_argument("--sink", type=int, default=16, help="--sink-tokens of the windowed run")
    p.add_argument("--poll-ms", type=float, default=50.0, help="ModelInfo polling period during a trace")
    p.add_argument("--start", choices=["together", "one-by-one"], default="together",
                   help="start all servers up front (idle while the others are measured) or each before its run")
    p.add_argument("--wait-idle", type=float, default=600.0,
                   help="before each measured trace, wait up to this many seconds for other processes to leave "
                        "the CPUs")
    p.add_argument("--quick", action="store_true",
                   help="smoke run: flood 24 x 128 tokens, 20 quiet requests; long: 4 requests of 600 + 400 tokens")
    return p.parse_args(argv)


def main(argv: list[str] | None = None) -> int:
    args = parse_args(argv)
    args.configs = [c.strip() for c in args.configs.split(",") if c.strip()]
    if not args.configs or set(args.configs) - set(CONFIGS) or args.executors < 1:
        print(f"error: --configs must name some of {', '.join(CONFIGS)}; --executors must be >= 1", file=sys.stderr)
        return 2
    if args.quick:
        args.flood_requests, args.flood_tokens = min(args.flood_requests, 24), min(args.flood_tokens, 128)
        args.quiet_requests = min(args.quiet_requests, 20)
        args.long_requests, args.long_tokens = min(args.long_requests, 4), min(args.long_tokens, 400)
    if args.flood_concurrency <= 0:
        args.flood_concurrency = max(1, args.max_num_seqs // 2)
    run_noisy, run_long = args.only in ("both", "noisy"), args.only in ("both", "long")
    model_dir = resolve_model(args.model)
    config = json.loads((model_dir / "config.json").read_text())
    vocab, model_max = config["vocab_size"], config["max_position_embeddings"]
    bs = args.block_size
    qmin, qmax = args.quiet_prompt
    errors: list[str] = []
    if min(args.flood_requests, args.quiet_requests, args.long_requests, args.flood_prompt, qmin, args.long_prompt,
           args.flood_tokens, args.quiet_tokens, args.long_tokens) < 1 or qmin > qmax:
        errors.append("request counts, prompt lengths and output lengths must be >= 1 (and --quiet-prompt MIN <= MAX)")
    noisy_len = min(model_max, args.num_pages * bs)
    if run_noisy and max(args.flood_prompt + args.flood_tokens, qmax + args.quiet_tokens) > noisy_len:
        errors.append(f"a noisy-neighbour request exceeds max_model_len {noisy_len}")
    if run_noisy and args.flood_page_budget < 3:
        errors.append("--flood-page-budget: the window policy needs at least 3 pages (sink, window, the next)")
    long_len = min(model_max, args.long_num_pages * bs)
    if run_long and args.long_prompt + args.long_tokens > long_len:
        errors.append(f"long requests: prompt {args.long_prompt} + output {args.long_tokens} exceeds max_model_len "
                      f"{long_len} (min of the model's {model_max} and {args.long_num_pages} pages x {bs} tokens; "
                      "the server caps it to the pool with or without a window)")
    if errors:
        for e in errors:
            print(f"error: {e}", file=sys.stderr)
        return 2

    flood_reqs = make_requests([args.flood_prompt] * args.flood_requests, args.flood_tokens, args.seed, vocab)
    lrng = random.Random(args.seed + 1)
    quiet_lens = [lrng.randint(qmin, qmax) for _ in range(args.quiet_requests)]
    quiet_reqs = make_requests(quiet_lens, args.quiet_tokens, args.seed + 2, vocab)
    alone_reqs = make_requests(quiet_lens, args.quiet_tokens, args.seed + 3, vocab)  # same lengths, other ids
    long_reqs = make_requests([args.long_prompt] * args.long_requests, args.long_tokens, args.seed + 4, vocab)
    quota_pages = (int(args.flood_quota * args.num_pages * args.executors) if args.flood_quota <= 1
                   else int(args.flood_quota))
    window_bound = pages_for(args.sink, bs) + pages_for(args.window, bs) + 2  # scheduler_svc.fit.window_pages
    cfg = Config(model=args.model, model_dir=str(model_dir), seed=args.seed, block_size=bs,
                 max_num_seqs=args.max_num_seqs, max_num_batched_tokens=args.max_num_batched_tokens,
                 num_pages=args.num_pages, flood_requests=args.flood_requests, flood_prompt=args.flood_prompt,
                 flood_tokens=args.flood_tokens, quiet_requests=args.quiet_requests, quiet_prompt_range=(qmin, qmax),
                 quiet_tokens=args.quiet_tokens, quiet_interval_ms=args.quiet_interval_ms,
                 quiet_delay_s=args.quiet_delay, flood_quota=args.flood_quota, flood_quota_pages=quota_pages,
                 flood_concurrency=args.flood_concurrency, flood_page_budget=args.flood_page_budget,
                 flood_window_tokens=(args.flood_page_budget - 2) * bs, full_flood=args.full_flood,
                 long_num_pages=args.long_num_pages, long_requests=args.long_requests, long_prompt=args.long_prompt,
                 long_tokens=args.long_tokens, window=args.window, sink=args.sink, window_pages_bound=window_bound,
                 poll_ms=args.poll_ms, only=args.only, start=args.start, quick=args.quick,
                 executors=args.executors, configs=tuple(args.configs))
    if run_noisy:
        print(f"noisy neighbour: A floods {args.flood_requests} x ({args.flood_prompt} + {args.flood_tokens}) tokens "
              f"({pages_for(args.flood_prompt + args.flood_tokens - 1, bs)} pages each at full length); B sends "
              f"{args.quiet_requests} x ({qmin}-{qmax} + {args.quiet_tokens}) tokens, one every "
              f"{args.quiet_interval_ms:g} ms from {args.quiet_delay:g}s; {args.num_pages} pages, "
              f"--max-num-seqs {args.max_num_seqs}; quota configs: A page_quota {args.flood_quota:g} "
              f"({quota_pages} pages), max_concurrent_requests {args.flood_concurrency}; budget: "
              f"{args.flood_page_budget} pages (window {cfg.flood_window_tokens} tokens)", flush=True)
    if run_long:
        print(f"long context: {args.long_requests} x ({args.long_prompt} + {args.long_tokens}) tokens "
              f"({pages_for(args.long_prompt + args.long_tokens - 1, bs)} pages each at full length) on "
              f"{args.long_num_pages} pages; window run --sliding-window {args.window} --sink-tokens {args.sink} "
              f"(about {window_bound} pages a request)", flush=True)
    print(f"{cfg.nproc} CPUs, torch {cfg.torch_version} ({cfg.torch_threads} threads)", flush=True)

    with tempfile.TemporaryDirectory(prefix="pagedkv-tenants-") as tmp:
        specs: dict[str, list[str] | ClusterSpec] = {}
        if run_noisy:
            for c in args.configs:
                path = Path(tmp) / f"{c.replace('+', '_')}.toml"
                path.write_text(tenants_toml(c, args))
                specs[c] = noisy_server_args(args, str(model_dir), c, path)
        if run_long:
            for r in LONG_RUNS:
                specs[r] = long_server_args(args, str(model_dir), r)
        servers = Servers(specs, together=args.start == "together")
        try:
            noisy = noisy_part(args, servers, flood_reqs, quiet_reqs, alone_reqs) if run_noisy else None
            long = long_part(args, servers, long_reqs) if run_long else None
        finally:
            servers.stop_all()
    startup = servers.startup_s

    notes: list[str] = []
    problems: list[str] = []
    all_runs: list[tuple[str, dict[str, Any]]] = []
    if noisy is not None:
        all_runs += [(name, run) for name, run in noisy.items()]
        report_noisy(noisy, cfg, notes, problems)
    if long is not None:
        all_runs += [(f"long {name}", run) for name, run in long.items()]
        report_long(long, cfg, notes, problems)
    for name, run in all_runs:
        if not run["leak_free"]:
            problems.append(f"{name}: pages still held after the run: {run['leaks']}")
    contended = [name for name, run in all_runs if is_contended(run)]
    print()
    for n in notes:
        print(f"NOTE: {n}")
    if contended:
        print(f"WARNING: other processes competed for the CPUs during {', '.join(contended)} (see 'cpu' in the "
              "JSON); rerun on an idle machine")
    for e in problems:
        print(f"ERROR: {e}", file=sys.stderr)

    report = {"contended": bool(contended), "contended_runs": contended, "config": asdict(cfg),
              "server_startup_s": startup, "noisy_neighbour": noisy, "long_context": long,
              "notes": notes, "errors": problems,
              "workload": {"flood": [{"prompt_len": len(r.prompt), "max_tokens": r.max_tokens} for r in flood_reqs],
                           "quiet": [{"prompt_len": len(r.prompt), "max_tokens": r.max_tokens,
                                      "send_s": args.quiet_delay + i * args.quiet_interval_ms / 1000}
                                     for i, r in enumerate(quiet_reqs)],
                           "long": [{"prompt_len": len(r.prompt), "max_tokens": r.max_tokens} for r in long_reqs]}}
    args.out.parent.mkdir(parents=True, exist_ok=True)
    args.out.write_text(json.dumps(_json_safe(report), indent=2) + "\n")
    print(f"wrote {args.out}")
    return 1 if problems else 0


if __name__ == "__main__":
    sys.exit(main())
