"""The fleet (#47, "Measure"): KV-aware routing over two pagedkv schedulers through NVIDIA Dynamo, against Dynamo's
round robin, pagedkv's client round robin and one scheduler, on the same multi-tenant prefix-heavy Poisson load,
in one run; and what the Dynamo hop costs at batch 1.

The load: ``--tenants`` (4) tenants x ``--prompts-per-tenant`` (8) system prompts of ``--system-tokens`` (512)
tokens, each request one of them (tenant and prompt uniform) plus a short user suffix (8-24 words), ``--requests``
(256) arriving as a Poisson process at ``--rate`` per second, ``--max-tokens`` (32) each, greedy, EOS ignored. Every
tenant sends with its own API key, so each has its own prefix namespace in pagedkv and its own salt in Dynamo's
router. Arms (each on fresh processes, from empty caches):

- ``dynamo-kv``: the edge gateway -> Dynamo's frontend ``--router-mode kv`` -> a sidecar -> one of two schedulers
  (deploy/fleet_local.py), each ``--num-pages`` pages;
- ``dynamo-kv-tuned`` (with ``--frontend-arg``): the same with those router settings, e.g.
  ``--router-prefill-load-scale 4`` (a prefix hit outweighs more of the other worker's lighter load);
- ``dynamo-rr``: the same with ``--router-mode round-robin``;
- ``client-rr``: pagedkv.client straight to the two schedulers (gRPC round robin over ``a,b``; one client per
  tenant), each ``--num-pages`` pages;
- ``single``: one scheduler with twice the pages (the fleet's KV memory in one pool): the hit ratio of perfect
  routing, the reference of the target.

No host tier anywhere (``--swap-space 0``): the capacity each arm has is the pages it is given. Per arm: cached ÷
prompt tokens (pagedkv's usage), TTFT p50/p99 (from each request's own send), output tok/s (all output tokens ÷
from the first send to the last answer), and on Dynamo's paths the share of repeats sent to the worker that
served the same system prompt's previous request (``nvext.worker_id``: routing, as against eviction).

The hop: in the dynamo-kv fleet before its load, ``--hop-requests`` sequential requests (batch 1, distinct short
prompts, ``--hop-max-tokens`` tokens), alternating through the edge and Dynamo, through Dynamo's frontend alone,
and straight to a scheduler's own gateway (``pagedkv serve --http-port``); TTFT and TPOT medians, and their ratios
to the direct gateway's.

Targets (docs/design.md): dynamo-kv's hit ratio >= 0.9 x single's; its TTFT p99 <= dynamo-rr's; the hop <= 1.1x on TPOT.

    python bench/fleet.py --model tiny-llama                      # -> bench/results/fleet.json, fleet.png
    python bench/fleet.py --model smollm2-135m-instruct --requests 128 --rate 0.5
    python bench/fleet.py --frontend-arg=--router-prefill-load-scale=4    # and a tuned KV router beside
    python bench/fleet.py --quick                                 # smoke run
"""

from __future__ import annotations

import argparse
import asyncio
from dataclasses import asdict
from pathlib import Path
from typing import Any

from common import RESULTS, wait_idle, write_report
from fleet_arms import dynamo_arm, pagedkv_arm
from fleet_load import ARMS, DEFAULT_ARMS, Config, make_load, system_prompts
from fleet_report import plot, print_report, verdicts


async def main_async(cfg: Config, out: Path, idle_wait: float) -> dict[str, Any]:
    systems = system_prompts(cfg)
    jobs = make_load(cfg, systems)
    results: dict[str, dict[str, Any]] = {}
    for arm in cfg.arms:
        wait_idle(idle_wait)
        print(f"== {arm}", flush=True)
        runner = dynamo_arm if arm.startswith("dynamo") else pagedkv_arm
        results[arm] = await runner(cfg, arm, jobs)
        r = results[arm]
        print(f"   hit {r['hit_ratio']:.3f}, TTFT p50 {r['ttft_p50_s']:.3f} s p99 {r['ttft_p99_s']:.3f} s, "
              f"{r['output_tok_s']:.1f} tok/s, errors {r['errors']} {r['first_errors']}", flush=True)
    report = {"config": asdict(cfg), "results": results,
              "verdicts": {arm: verdicts(results, arm) for arm in results if arm.startswith("dynamo-kv")}}
    print_report(results, cfg)
    write_report(out, report)
    plot(results, out.with_suffix(".png"))
    return report


def parse_args(argv: list[str] | None = None) -> tuple[Config, Path, float]:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    d = Config()
    p.add_argument("--model", default=d.model)
    for name in ("requests", "tenants", "prompts_per_tenant", "system_tokens", "max_tokens", "num_pages", "threads",
                 "hop_requests", "hop_max_tokens", "seed"):
        p.add_argument("--" + name.replace("_", "-"), type=int, default=getattr(d, name))
    p.add_argument("--rate", type=float, default=d.rate, help="requests per second (Poisson)")
    p.add_argument("--arms", default="", help="comma-separated, of " + ", ".join(ARMS) + " (default: "
                   + ", ".join(DEFAULT_ARMS) + ", and dynamo-kv-tuned after dynamo-kv with --frontend-arg)")
    p.add_argument("--frontend-arg", action="append", default=[], metavar="ARG",
                   help="a flag for the dynamo-kv-tuned arm's frontend (repeat), e.g. "
                   "--frontend-arg=--router-prefill-load-scale=4")
    p.add_argument("--quick", action="store_true", help="smoke run: 24 requests, 2 tenants x 2 prompts, 3 hop rounds")
    p.add_argument("--out", default="", help="JSON path (default: bench/results/fleet[_MODEL][_quick].json)")
    a = p.parse_args(argv)
    arms = [x for x in a.arms.split(",") if x] or [
        x for x in ARMS if x in DEFAULT_ARMS or (x == "dynamo-kv-tuned" and a.frontend_arg)]
    if unknown := [x for x in arms if x not in ARMS]:
        p.error(f"--arms: unknown {unknown}; choose from {', '.join(ARMS)}")
    cfg = Config(model=a.model, requests=a.requests, tenants=a.tenants, prompts_per_tenant=a.prompts_per_tenant,
                 system_tokens=a.system_tokens, max_tokens=a.max_tokens, rate=a.rate, num_pages=a.num_pages,
                 threads=a.threads, hop_requests=a.hop_requests, hop_max_tokens=a.hop_max_tokens, seed=a.seed,
                 arms=arms, frontend_args=a.frontend_arg)
    if a.quick:
        cfg.requests, cfg.tenants, cfg.prompts_per_tenant, cfg.hop_requests = 24, 2, 2, 3
    name = "fleet" + ("" if cfg.model == "tiny-llama" else "_" + Path(cfg.model).name.split("-")[0]) + \
        ("_quick" if a.quick else "")
    return cfg, Path(a.out) if a.out else RESULTS / f"{name}.json", 0.0 if a.quick else 120.0


def main() -> None:
    cfg, out, idle_wait = parse_args()
    asyncio.run(main_async(cfg, out, idle_wait))


if __name__ == "__main__":
    main()
