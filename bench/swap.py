"""Swap vs recompute: one overload trace under the three preemption policies, in one run.

The workload asks for more KV than the device pool holds: ``--num-requests`` requests (64) arrive together
(``asyncio.gather``), each a distinct random prompt of 64-384 tokens (BOS, then random ids, fixed seed)
asking for 64-256 output tokens (EOS ignored, greedy). At full length they need several times the
``--num-pages`` device pages (96 of 16 tokens), so the scheduler must preempt; the host tier is twice the
device pool (``--num-host-pages 2*P``). The prompts share no prefix, so every token the executor computes
beyond an unconstrained run (prompt tokens + one per decode step) is recomputation after a preemption.

Each policy gets a fresh ``pagedkv serve`` with the same flags except ``--preemption-mode`` (and the host tier):

* ``recompute``: no host tier (``--num-host-pages 0``): a victim's pages are dropped and its prompt and
  output so far are prefilled again (prefix caching, on by default, may still find its pages on the device);
* ``swap``: a victim's pages are copied to the host tier and copied back before it runs again;
* ``auto``: per victim, whichever the executor's start-up measurements (page copy bandwidth, prefill time
  per token: its ``executor_built`` log line) say costs less.

Per policy the bench reports wall time, output tokens/s, requests/s, latency and TTFT p50/p99 (per request,
from the moment all were sent), and from ``ModelInfo`` deltas over the workload: preemptions by kind, pages
swapped out / in, bytes moved, prefix pages spilled to the host tier and served back from it, tokens the
executor computed and the recomputed share of them. After each run every device page, host page and swap
slot must be free again (no leaks). Greedy outputs must be the same under all three policies, request by
request; any difference fails the bench (exit code 1). With ``--repeat N`` the policies run round-robin N
times (each on a fresh server) and the table shows each metric's median over the uncontended trials.

With CUDA the bench also measures page DMA with the executor's own pools and mover: 512 scattered 2 MiB
pages (a Llama-8B-like page: 32 layers, 8 KV heads x 128, fp16, 16 tokens) swapped out and in, against one
contiguous pinned copy of the same bytes (target: paged >= 90% of contiguous, each way).

    python bench/swap.py            # 64 requests, 96 device pages -> bench/results/swap.json
    python bench/swap.py --quick    # smoke run: 16 requests, 32 device pages, shorter prompts and outputs
"""

from __future__ import annotations

import argparse
import json
import sys
from dataclasses import asdict
from pathlib import Path
from typing import Any

import torch
from common import ROOT, Request, is_contended, make_workload, pages_for, write_report
from swap_dma import page_dma, print_dma
from swap_policy import run_policy
from swap_report import POLICIES, Config, compare_outputs, executor_line, print_policies, ratios, summarize

from pagedkv.models import resolve_model

PROMPT_RANGE, OUTPUT_RANGE = (64, 384), (64, 256)
QUICK_PROMPT_RANGE, QUICK_OUTPUT_RANGE = (32, 128), (32, 96)
DMA_TARGET = 0.9


def page_demand(reqs: list[Request], block_size: int) -> dict[str, int]:
    """Pages the requests need at full length (KV of prompt + max_tokens - 1 tokens), all at once and
    for the largest one."""
    full = [pages_for(len(r.prompt) + r.max_tokens - 1, block_size) for r in reqs]
    return {"all_requests_pages": sum(full), "largest_request_pages": max(full)}


def parse_args(argv: list[str] | None = None) -> argparse.Namespace:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--model", default="tiny-llama", help="built-in name or a local HF directory")
    p.add_argument("--num-requests", type=int, default=64)
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--out", type=Path, default=ROOT / "bench" / "results" / "swap.json")
    p.add_argument("--block-size", type=int, default=16)
    p.add_argument("--num-pages", type=int, default=96, help="device KV pages per server")
    p.add_argument("--num-host-pages", type=int, default=0, help="host tier pages (0: twice --num-pages)")
    p.add_argument("--max-num-seqs", type=int, default=64)
    p.add_argument("--max-num-batched-tokens", type=int, default=512)
    p.add_argument("--repeat", type=int, default=1,
                   help="trials per policy, round-robin, each on a fresh server; medians are reported")
    p.add_argument("--prefix-caching", action=argparse.BooleanOptionalAction, default=True,
                   help="the servers' prefix caching (on: the server default; a recompute victim's pages may then "
                        "come back from the host tier as prefix spill hits instead of being recomputed)")
    p.add_argument("--check-integrity", action="store_true", help="servers check page accounting every step")
    p.add_argument("--dma-pages", type=int, default=512, help="pages in the CUDA page-DMA measurement (0: skip)")
    p.add_argument("--wait-idle", type=float, default=600.0,
                   help="before each policy's workload, wait up to this many seconds for other processes to "
                        "leave the CPUs")
    p.add_argument("--quick", action="store_true",
                   help="smoke run: 16 requests, 32 device pages, prompts 32-128 and outputs 32-96 tokens")
    p.add_argument("--dma-only", action="store_true",
                   help="only the page DMA measurement (needs CUDA; what bench/gpu_check.sh runs)")
    return p.parse_args(argv)


def main(argv: list[str] | None = None) -> int:
    args = parse_args(argv)
    if args.dma_only:
        if not torch.cuda.is_available():
            print("page DMA: skipped (no CUDA)")
            return 0
        dma = page_dma("cuda", num_pages=args.dma_pages)
        print_dma(dma)
        write_report(args.out.with_name("swap_dma.json"), dma)
        return 0
    prompt_range, output_range = PROMPT_RANGE, OUTPUT_RANGE
    if args.quick:
        args.num_requests, args.num_pages = min(args.num_requests, 16), min(args.num_pages, 32)
        prompt_range, output_range = QUICK_PROMPT_RANGE, QUICK_OUTPUT_RANGE
    if args.num_host_pages <= 0:
        args.num_host_pages = 2 * args.num_pages
    if args.num_requests < 1 or args.num_pages < 1 or args.repeat < 1:
        print("error: --num-requests, --num-pages and --repeat must be >= 1", file=sys.stderr)
        return 2
    model_dir = resolve_model(args.model)
    config = json.loads((model_dir / "config.json").read_text())
    vocab = config["vocab_size"]
    max_model_len = min(config["max_position_embeddings"], args.num_pages * args.block_size)
    longest = prompt_range[1] + output_range[1]
    if longest > max_model_len:
        print(f"error: prompt {prompt_range[1]} + output {output_range[1]} = {longest} tokens exceeds "
              f"max_model_len {max_model_len} (min of the model's {config['max_position_embeddings']} and "
              f"{args.num_pages} pages x {args.block_size} tokens); raise --num-pages", file=sys.stderr)
        return 2
    reqs = make_workload(args.num_requests, args.seed, vocab, prompt_range, output_range)
    demand = page_demand(reqs, args.block_size)
    cfg = Config(model=args.model, model_dir=str(model_dir), seed=args.seed, num_requests=args.num_requests,
                 prompt_range=prompt_range, output_range=output_range, block_size=args.block_size,
                 num_pages=args.num_pages, num_host_pages=args.num_host_pages, max_num_seqs=args.max_num_seqs,
                 max_num_batched_tokens=args.max_num_batched_tokens, max_model_len=max_model_len,
                 repeat=args.repeat, prefix_caching=args.prefix_caching, quick=args.quick)
    print(f"workload: {len(reqs)} requests, {sum(len(r.prompt) for r in reqs)} prompt tokens, "
          f"{sum(r.max_tokens for r in reqs)} output tokens (seed {args.seed}); at full length they need "
          f"{demand['all_requests_pages']} pages ({demand['all_requests_pages'] / args.num_pages:.1f}x the "
          f"{args.num_pages} device pages of {args.block_size} tokens; host tier {args.num_host_pages} pages); "
          f"{cfg.nproc} CPUs, torch {cfg.torch_version} ({cfg.torch_threads} threads)", flush=True)

    trials: dict[str, list[dict[str, Any]]] = {m: [] for m in POLICIES}
    for trial in range(args.repeat):
        for mode in POLICIES:
            label = f" (trial {trial + 1}/{args.repeat})" if args.repeat > 1 else ""
            print(f"running --preemption-mode {mode}{label} ...", flush=True)
            res = run_policy(args, str(model_dir), mode, reqs)
            trials[mode].append(res)
            print(f"  {mode}: {res['wall_s']:.2f}s, {res['tokens_per_s']:.1f} tokens/s, preemptions "
                  f"{res['swap_preemptions']} swap + {res['recompute_preemptions']} recompute, "
                  f"{res['recomputed_tokens']} tokens recomputed", flush=True)
            if not res["leak_free"]:
                print(f"  ERROR: after the {mode} run the server still holds {res['leaks']}", flush=True)
            if is_contended(res):
                print(f"  WARNING: other processes used {res['cpu']['foreign_share']:.0%} of the machine's CPU "
                      f"during the {mode} run; its timings are not trustworthy", flush=True)
    summary = {m: summarize(trials[m]) for m in POLICIES}
    rat = ratios(summary)
    mismatches = compare_outputs(reqs, trials)

    print()
    print_policies(summary, rat)
    print()
    for mode in POLICIES:
        print(executor_line(mode, summary[mode]["executor"], args.block_size))
    if args.repeat > 1:
        for mode in POLICIES:
            walls = ", ".join(f"{r['wall_s']:.2f}" for r in trials[mode])
            print(f"{mode} trial walls (s): {walls}; medians over trials {summary[mode]['trials_used']}")

    dma: dict[str, Any] | None = None
    if args.dma_pages <= 0:
        print("page DMA: skipped (--dma-pages 0)")
    elif not torch.cuda.is_available():
        print("page DMA: skipped (no CUDA)")
    else:
        dma = page_dma("cuda", num_pages=args.dma_pages)
        torch.cuda.empty_cache()  # the pools died with page_dma's frame
        print_dma(dma)

    notes: list[str] = []
    for mode in POLICIES:
        s = summary[mode]
        if not s["preemptions"]:
            notes.append(f"{mode}: no preemptions; the trace did not overload the pool (lower --num-pages)")
        if mode == "recompute" and s["swap_preemptions"]:
            notes.append(f"recompute: {s['swap_preemptions']} swap preemptions under --preemption-mode recompute")
        if mode == "swap" and s["recompute_preemptions"]:
            notes.append(f"swap: {s['recompute_preemptions']} victims recomputed under --preemption-mode swap "
                         "(host tier full, or a victim larger than it)")
        if mode != "recompute" and s["preemptions"] and not s["swap_preemptions"]:
            notes.append(f"{mode}: no victim was swapped")
        if s["spill_hits"]:
            notes.append(f"{mode}: {s['spill_hits']:g} pages came back from the host tier as prefix spill hits "
                         f"({s['spill_hits'] * args.block_size:g} tokens not recomputed, not counted as prompt "
                         "tokens from cache)" + ("; --no-prefix-caching gives a pure recompute baseline"
                                                 if mode == "recompute" else ""))
    for n in notes:
        print(f"NOTE: {n}")
    leak_free = all(summary[m]["leak_free"] for m in POLICIES)
    if not leak_free:
        print("ERROR: pages, host pages or swap slots still held after a run: "
              + "; ".join(f"{m} trial {i}: {r['leaks']}" for m in POLICIES for i, r in enumerate(trials[m])
                          if not r["leak_free"]), file=sys.stderr)
    contended = any(is_contended(r) for runs in trials.values() for r in runs)
    if contended:
        print("WARNING: other processes competed for the CPUs during a measured run (see 'cpu' in the JSON); "
              "rerun on an idle machine")
    if mismatches:
        first = mismatches[0]
        print(f"ERROR: greedy outputs differ between policies: {len(mismatches)} (policy, trial, request) "
              f"outputs differ from recompute's first trial (first: {first['policy']} trial {first['trial']}, "
              f"request {first['index']} at output position {first['first_diff']})", file=sys.stderr)
    else:
        print(f"outputs: recompute == swap == auto for all {len(reqs)} requests"
              + (f" in all {args.repeat} trials" if args.repeat > 1 else ""))

    report = {"contended": contended, "config": asdict(cfg), "page_demand": demand,
              "policies": summary, "ratios": rat, "leak_free": leak_free,
              "trials": {m: [{k: v for k, v in r.items() if k != "outputs"} for r in runs]
                         for m, runs in trials.items()},
              "outputs_match": not mismatches, "mismatches": mismatches, "notes": notes, "page_dma": dma,
              "workload": [{"prompt_len": len(r.prompt), "max_tokens": r.max_tokens} for r in reqs]}
    write_report(args.out, report)
    return 1 if mismatches or not leak_free else 0


if __name__ == "__main__":
    sys.exit(main())
