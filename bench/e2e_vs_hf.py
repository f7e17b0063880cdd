"""End-to-end throughput: pagedkv over gRPC vs Hugging Face ``generate`` in static batches.

The same requests (random prompts of 16-512 tokens, outputs of 16-256 tokens, fixed seed) go

* through a ``pagedkv serve`` started by this script, all at once (``asyncio.gather``), and
* through ``AutoModelForCausalLM.generate`` in the bench process, in static, left-padded batches of 16 in
  workload order -- the way a user without a server would run them.

Both sides generate exactly the requested number of tokens (EOS is ignored). An HF batch runs to the
longest output in the batch; only the tokens each request asked for count as useful output. The two
systems run one after the other, never at the same time, with torch's default thread count.

    python bench/e2e_vs_hf.py              # 64 requests, writes bench/results/e2e_vs_hf.json
    python bench/e2e_vs_hf.py --quick      # smoke run
    python bench/e2e_vs_hf.py --random-model 1b --device cuda --dtype float16   # on a GPU (target >= 5x)
"""

from __future__ import annotations

import argparse
import asyncio
import json
import sys
import time
from dataclasses import asdict, dataclass
from pathlib import Path
from typing import Any

import common
import torch
from common import (
    ROOT,
    Machine,
    Request,
    Server,
    StreamResult,
    check_lengths,
    is_contended,
    latency_summary,
    make_workload,
    timed_streams,
    wait_idle,
    warm_up,
    write_report,
)
from e2e_vs_hf_generate import HF_PLACEMENT, run_hf

from pagedkv.models import resolve_model


# ---- pagedkv -----------------------------------------------------------------------------------
async def _run_pagedkv_async(address: str, reqs: list[Request]) -> tuple[float, list[StreamResult], dict]:
    from pagedkv.client import Client

    async with Client(address) as client:
        await warm_up(client)
        return await timed_streams(client, reqs)


def run_pagedkv(args: argparse.Namespace, model: str, reqs: list[Request]) -> dict[str, Any]:
    serve_args = ["--model", model, "--dtype", args.dtype, "--device", args.device,
                  "--attention-backend", args.attention_backend, "--block-size", str(args.block_size),
                  "--max-num-seqs", str(args.max_num_seqs),
                  "--max-num-batched-tokens", str(args.max_num_batched_tokens), *args.serve_arg]
    t_start = time.perf_counter()
    server = Server(serve_args)
    startup = time.perf_counter() - t_start
    try:
        wait_idle(args.wait_idle)
        wall, results, cpu = asyncio.run(_run_pagedkv_async(server.address, reqs))
    except BaseException:
        print(server.log(), file=sys.stderr)
        raise
    finally:
        server.stop()
    check_lengths(reqs, results, "pagedkv request")
    out_tokens = sum(res.tokens for res in results)
    ttfts = [res.ttft_s for res in results]
    lat = [res.latency_s for res in results]
    return {
        "system": "pagedkv",
        "requests": len(reqs),
        "output_tokens": out_tokens,
        "useful_output_tokens": out_tokens,
        "prompt_tokens": sum(len(r.prompt) for r in reqs),
        "wall_s": wall,
        "tokens_per_s": out_tokens / wall,
        "requests_per_s": len(reqs) / wall,
        **latency_summary(ttfts, lat),
        "server_startup_s": startup,
        "cpu": cpu,
        "server_args": serve_args,
    }


# ---- main --------------------------------------------------------------------------------------
@dataclass(slots=True)
class Config(Machine):
    model: str
    model_dir: str
    seed: int
    num_requests: int
    batch_size: int
    prompt_range: tuple[int, int]
    output_range: tuple[int, int]
    dtype: str = "float32"
    device: str = "cpu"
    attention_backend: str = "auto"
    block_size: int = 16
    max_num_seqs: int = 256
    max_num_batched_tokens: int = 2048
    quick: bool = False
    transformers_version: str = ""
    order: str = "pagedkv then hf"


def print_table(rows: list[dict[str, Any]], hf_tps: float) -> None:
    header = ("system", "requests", "output tokens", "wall s", "tokens/s", "ratio vs HF")
    body = [(r["system"], str(r["requests"]), str(r["output_tokens"]), f"{r['wall_s']:.2f}",
             f"{r['tokens_per_s']:.1f}", f"{r['tokens_per_s'] / hf_tps:.2f}x") for r in rows]
    common.print_table(header, body)


RANDOM_MODELS = {
    "1b": dict(hidden_size=2048, intermediate_size=5632, num_layers=22, num_heads=32, num_kv_heads=4,
               max_position_embeddings=2048, initializer_range=0.02),
}


def random_model_dir(size: str) -> Path:
    """The random Llama of ``size`` (RANDOM_MODELS), built on first use into the pagedkv cache."""
    from pagedkv.models import build_atomically, cache_dir
    from pagedkv.tools.random_model import build_random_model

    path = cache_dir() / f"random-llama-{size}-v1"
    if not (path / "config.json").exists():
        print(f"building the random {size} Llama into {path} (once) ...", flush=True)
        build_atomically(path, lambda d: build_random_model(d, arch="llama", seed=20261129, **RANDOM_MODELS[size]))
    return path


def parse_args(argv: list[str] | None = None) -> argparse.Namespace:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--model", default="tiny-llama", help="built-in name or a local HF directory")
    p.add_argument("--random-model", choices=sorted(RANDOM_MODELS), default=None,
                   help="instead of --model: a random Llama of this size, built once (fixed seed) and saved as "
                        "an HF directory in the pagedkv cache (1b: TinyLlama-1.1B's shape, 22 layers, hidden 2048, "
                        "32/4 heads of 64)")
    p.add_argument("--device", default="cpu", help="cpu | cuda: where both systems run")
    p.add_argument("--dtype", default="float32", choices=["float32", "float16", "bfloat16"],
                   help="weights and KV of both systems")
    p.add_argument("--attention-backend", default="auto", choices=["auto", "torch", "cuda"],
                   help="pagedkv's paged attention (auto: cuda on a GPU with CuPy)")
    p.add_argument("--serve-arg", action="append", default=[], metavar="FLAG",
                   help="extra flag for pagedkv serve, e.g. --serve-arg=--kv-cache-gb=16 (repeatable)")
    p.add_argument("--target", type=float, default=None, help="target ratio (default: 2 on CPU, 5 on CUDA)")
    p.add_argument("--num-requests", type=int, default=64)
    p.add_argument("--batch-size", type=int, default=16, help="HF static batch size")
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--out", type=Path, default=ROOT / "bench" / "results" / "e2e_vs_hf.json")
    p.add_argument("--block-size", type=int, default=16)
    p.add_argument("--max-num-seqs", type=int, default=256)
    p.add_argument("--max-num-batched-tokens", type=int, default=2048)
    p.add_argument("--hf-attn", choices=["auto", "default", "eager", "sdpa"], default="auto",
                   help="auto: probe eager and sdpa on a small batch and use the faster")
    p.add_argument("--order", choices=["pagedkv-first", "hf-first"], default="pagedkv-first")
    p.add_argument("--wait-idle", type=float, default=600.0,
                   help="before each system, wait up to this many seconds for other processes to leave "
                        "the CPUs")
    p.add_argument("--repeat", type=int, default=1,
                   help="independent trials per system (pagedkv on a fresh server each time); "
                        "the median is kept")
    p.add_argument("--quick", action="store_true", help="smoke run: 16 requests, shorter prompts and outputs")
    return p.parse_args(argv)


def main(argv: list[str] | None = None) -> int:
    args = parse_args(argv)
    import transformers

    transformers.utils.logging.disable_progress_bar()

    prompt_range, output_range = (16, 512), (16, 256)
    if args.quick:
        args.num_requests = min(args.num_requests, 16)
        prompt_range, output_range = (16, 128), (16, 64)
    HF_PLACEMENT.update(device=args.device, dtype=getattr(torch, args.dtype))
    target = args.target if args.target is not None else (5.0 if args.device.startswith("cuda") else 2.0)
    if args.random_model:
        model_dir = random_model_dir(args.random_model)
        args.model = f"random-llama-{args.random_model}"
    else:
        model_dir = resolve_model(args.model)
    vocab = json.loads((model_dir / "config.json").read_text())["vocab_size"]
    reqs = make_workload(args.num_requests, args.seed, vocab, prompt_range, output_range)
    cfg = Config(model=args.model, model_dir=str(model_dir), seed=args.seed, num_requests=args.num_requests,
                 batch_size=args.batch_size, prompt_range=prompt_range, output_range=output_range,
                 dtype=args.dtype, device=args.device, attention_backend=args.attention_backend,
                 block_size=args.block_size, max_num_seqs=args.max_num_seqs,
                 max_num_batched_tokens=args.max_num_batched_tokens, quick=args.quick,
                 transformers_version=transformers.__version__,
                 order=args.order.replace("-first", " first"))
    print(f"workload: {len(reqs)} requests, {sum(len(r.prompt) for r in reqs)} prompt tokens, "
          f"{sum(r.max_tokens for r in reqs)} output tokens (seed {args.seed}); "
          f"{cfg.nproc} CPUs, torch {cfg.torch_version} ({cfg.torch_threads} threads)", flush=True)

    # pass the resolved directory so the server and HF load the very same files
    steps = [("pagedkv", lambda: run_pagedkv(args, str(model_dir), reqs)),
             ("hf", lambda: run_hf(args, model_dir, reqs))]
    if args.order == "hf-first":
        steps.reverse()
    trials: dict[str, list[dict[str, Any]]] = {"pagedkv": [], "hf": []}
    for trial in range(args.repeat):
        for name, fn in steps:
            label = f" (trial {trial + 1}/{args.repeat})" if args.repeat > 1 else ""
            print(f"running {name}{label} ...", flush=True)
            res = fn()
            trials[name].append(res)
            print(f"  {name}: {res['wall_s']:.2f}s, {res['tokens_per_s']:.1f} tokens/s", flush=True)
            share = res["cpu"].get("foreign_share", 0.0)
            if is_contended(res):
                print(f"  WARNING: other processes used {share:.0%} of the machine's CPU during the {name} "
                      "run; its figures are not trustworthy", flush=True)
    # with several trials, each system is represented by its median trial (by wall time) among the trials
    # that no other process competed with (all trials if every one was contended)
    results: dict[str, dict[str, Any]] = {}
    for name, runs in trials.items():
        clean = [r for r in runs if not is_contended(r)] or runs
        median = sorted(clean, key=lambda r: r["wall_s"])[(len(clean) - 1) // 2]
        results[name] = {**median, "trial_walls_s": [r["wall_s"] for r in runs],
                         "trial_contended": [is_contended(r) for r in runs]}

    pk, hf = results["pagedkv"], results["hf"]
    ratio = pk["tokens_per_s"] / hf["tokens_per_s"]
    print()
    print_table([pk, hf], hf["tokens_per_s"])
    print()
    print(f"HF: static batches of {args.batch_size}, attn_implementation={hf['attn_implementation']} "
          f"(HF default: {hf['attn_default']}; probe {hf['attn_probe_s'] or 'skipped'}), "
          f"{hf['computed_output_tokens']} tokens computed incl. padding rows "
          f"({hf['computed_tokens_per_s']:.1f}/s)")
    print(f"pagedkv: {pk['requests_per_s']:.2f} req/s, TTFT mean {pk['ttft_mean_s']:.2f}s "
          f"p50 {pk['ttft_p50_s']:.2f}s p99 {pk['ttft_p99_s']:.2f}s")
    if args.repeat > 1:
        for name in ("pagedkv", "hf"):
            walls = ", ".join(f"{w:.2f}" for w in results[name]["trial_walls_s"])
            print(f"{name} trial walls (s): {walls}; the median uncontended trial is reported")
    print(f"ratio pagedkv / HF: {ratio:.2f}x (target >= {target:g}x: {'met' if ratio >= target else 'NOT met'})")

    contended = is_contended(pk) or is_contended(hf)
    report = {"contended": contended, "repeat": args.repeat, "config": asdict(cfg), "pagedkv": pk, "hf": hf,
              "ratio_tokens_per_s": ratio,
              "target_ratio": target, "target_met": ratio >= target,
              "workload": [{"prompt_len": len(r.prompt), "max_tokens": r.max_tokens} for r in reqs]}
    if contended:
        print("WARNING: other processes competed for the CPUs during a reported run (see 'cpu' in "
              "the JSON); rerun on an idle machine")
    write_report(args.out, report)
    return 0


if __name__ == "__main__":
    sys.exit(main())
