"""pagedkv against its two peers on one machine: Hugging Face ``generate`` in static batches, and transformers'
own continuous batching over a paged cache (``init_continuous_batching``, ``paged|sdpa`` attention).

Three workloads, the same requests for every system (fixed seed, EOS ignored, greedy):

* ``uniform``: 64 x (128 prompt -> 64 output) -- the case static batching is built for (HF: one batch of 64);
* ``mixed``: ``--mixed-requests`` (128) requests with log-normal prompt (median 96, 8-1024) and output (median 64,
  4-512) lengths (HF static: batches of 16 in arrival order, each run to its longest output);
* ``batch1``: one request, 512 -> 128.

Two models: the built-in tiny-llama and a ~40M random Llama (12 layers, hidden 512; built once into the pagedkv
cache). Every (model, workload, system) runs in a fresh subprocess, after the machine went idle, so peak RSS is
its own (pagedkv: the scheduler's and the executor's peaks, added) and one run's memory does not linger into the
next. Per run: output tokens/s, TTFT p50/p99 (HF static: when its batch's first token was sampled; HF paged: the
first token's timestamp), peak RSS, and the 1-minute load average before and after (a quiet-machine check).

    python bench/e2e_peers.py                       # -> bench/results/e2e_peers.json
    python bench/e2e_peers.py --quick               # tiny-llama only, 32 mixed requests
    python bench/e2e_peers.py --pagedkv-root DIR    # pagedkv from another checkout (before/after tables)

Against vLLM's CPU build (and llama.cpp's server for 4-bit), with ``--systems pagedkv,vllm[,llamacpp]``: the server
systems are all driven over HTTP by one client, vLLM's ``vllm bench serve`` (bench/peers_http.py: pagedkv through
its gateway, ``pagedkv serve --http-port``), on the workloads uniform, mixed, batch1, shared (a 1,024-token
prefix), poisson (4 req/s) and concurrency8, in ``--rounds`` alternating rounds (medians reported); HF systems in the
same call run as above::

    python bench/e2e_peers.py --systems pagedkv,vllm --models tiny-llama,smollm2-135m-instruct --rounds 3
    python bench/e2e_peers.py --systems pagedkv,vllm --models smollm2-135m-instruct --dtype bfloat16
    python bench/e2e_peers.py --systems pagedkv,llamacpp --models smollm2-135m-instruct --four-bit \
        --workloads batch1,concurrency8,uniform
"""

from __future__ import annotations

import argparse
import json
import math
import os
import random
import subprocess
import sys
from pathlib import Path
from typing import Any

from common import Request, percentile, print_table, wait_idle, write_report

# (_hf_model: bench/uniform_inprocess.py imports it, and workload, from here)
from e2e_peers_runs import _hf_model, run_hf_paged, run_hf_static, run_pagedkv  # noqa: F401

ROOT = Path(__file__).resolve().parent.parent
SYSTEMS = ("pagedkv", "hf_static", "hf_paged")
HTTP_PEERS = ("vllm", "llamacpp")  # with one of these, pagedkv too is measured over HTTP (bench/peers_http.py)
WORKLOADS = ("uniform", "mixed", "batch1")
MODEL_40M = dict(hidden_size=512, intermediate_size=1376, num_layers=12, num_heads=8, num_kv_heads=4,
                 max_position_embeddings=2048)
VOCAB = 259


# ---- workloads ----------------------------------------------------------------------------------
def _lognormal(rng: random.Random, median: float, sigma: float, lo: int, hi: int) -> int:
    return max(lo, min(hi, int(round(math.exp(rng.gauss(math.log(median), sigma))))))


def workload(name: str, mixed_requests: int, seed: int = 0) -> list[Request]:
    rng = random.Random(f"{name}:{seed}")

    def prompt(n: int) -> list[int]:
        return [1] + [rng.randrange(3, VOCAB) for _ in range(n - 1)]
    if name == "uniform":
        return [Request(i, prompt(128), 64) for i in range(64)]
    if name == "batch1":
        return [Request(0, prompt(512), 128)]
    return [Request(i, prompt(_lognormal(rng, 96, 1.0, 8, 1024)), _lognormal(rng, 64, 0.9, 4, 512))
            for i in range(mixed_requests)]


def model_dir(name: str) -> Path:
    from pagedkv.models import build_atomically, cache_dir, resolve_model
    from pagedkv.tools.random_model import build_random_model

    if name != "random-40m":
        return resolve_model(name)
    path = cache_dir() / "random-llama-40m-v1"
    if not (path / "config.json").exists():
        build_atomically(path, lambda d: build_random_model(d, arch="llama", seed=20261130, **MODEL_40M))
    return path


def child(args: argparse.Namespace) -> int:
    reqs = workload(args.workload, args.mixed_requests)
    path = model_dir(args.model)
    if args.run == "pagedkv":
        out = run_pagedkv(path, reqs, args.pagedkv_args.split())
    elif args.run == "hf_static":
        out = run_hf_static(path, reqs, 64 if args.workload == "uniform" else 16)
    else:
        out = run_hf_paged(path, reqs)
    tokens = sum(r.max_tokens for r in reqs)
    out.update(tokens=tokens, tokens_per_s=tokens / out["wall_s"], ttft_p50_s=percentile(out["ttfts_s"], 50),
               ttft_p99_s=percentile(out["ttfts_s"], 99))
    Path(args.json).write_text(json.dumps(out))
    return 0


# ---- the orchestra -------------------------------------------------------------------------------
def run_one(args: argparse.Namespace, model: str, wl: str, system: str) -> dict[str, Any]:
    import tempfile

    wait_idle(args.wait_idle)
    load_before = os.getloadavg()[0]
    root = Path(args.pagedkv_root).resolve() if (system == "pagedkv" and args.pagedkv_root) else ROOT
    env = dict(os.environ, PYTHONPATH=str(root)) if root != ROOT else None
    with tempfile.NamedTemporaryFile(suffix=".json") as f:
        cmd = [sys.executable, str(ROOT / "bench" / "e2e_peers.py"), "--run", system, "--model", model,
               "--workload", wl, "--mixed-requests", str(args.mixed_requests), "--json", f.name,
               f"--pagedkv-args={args.pagedkv_args}"]
        proc = subprocess.run(cmd, cwd=root, env=env, capture_output=True, text=True)
        if proc.returncode:
            print(proc.stdout[-2000:], proc.stderr[-4000:], file=sys.stderr)
            return {"error": proc.stderr.strip().splitlines()[-1] if proc.stderr.strip() else f"exit {proc.returncode}"}
        out = json.loads(Path(f.name).read_text())
    out["load_1m"] = (load_before, os.getloadavg()[0])
    print(f"  {model} {wl} {system}: {out['tokens_per_s']:.1f} tok/s, TTFT p50 {out['ttft_p50_s']:.3f}s p99 "
          f"{out['ttft_p99_s']:.3f}s, peak RSS {out['peak_rss_mib']:.0f} MiB, load {load_before:.2f}", flush=True)
    return out


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--models", default="tiny-llama,random-40m")
    p.add_argument("--workloads", default=",".join(WORKLOADS))
    p.add_argument("--systems", default=",".join(SYSTEMS))
    p.add_argument("--mixed-requests", type=int, default=128)
    p.add_argument("--pagedkv-root", default="", metavar="DIR", help="run pagedkv from this checkout")
    p.add_argument("--pagedkv-args", default="", metavar="FLAGS",
                   help="more `pagedkv serve` flags, e.g. '--threads 1 --no-async-scheduling'")
    p.add_argument("--pagedkv-args-b", default="", metavar="FLAGS",
                   help="HTTP peers: also run this checkout as pagedkv_b with these flags after --pagedkv-args "
                   "(an A/B of settings in the same rounds)")
    p.add_argument("--wait-idle", type=float, default=120.0)
    p.add_argument("--quick", action="store_true")
    p.add_argument("--out", default=str(ROOT / "bench" / "results" / "e2e_peers.json"))
    p.add_argument("--run", choices=SYSTEMS, help=argparse.SUPPRESS)
    p.add_argument("--model", help=argparse.SUPPRESS)
    p.add_argument("--workload", help=argparse.SUPPRESS)
    p.add_argument("--json", help=argparse.SUPPRESS)
    p.add_argument("--rounds", type=int, default=2, help="HTTP peers: alternating rounds (medians reported)")
    p.add_argument("--dtype", default="float32", choices=["float32", "bfloat16"],
                   help="HTTP peers: the weights' dtype on both servers (float32: the headline)")
    p.add_argument("--four-bit", action="store_true",
                   help="HTTP peers: pagedkv serves a GPTQ 4-bit group-32 copy (quantize_checkpoint) and llama.cpp "
                   "the Q4_1 GGUF of the built-in model (its tied head 8-bit: q8_0)")
    p.add_argument("--four-bit-head", action="store_true",
                   help="with --four-bit: pagedkv's copy has a 4-bit head too (GPTQ's lm_head; the embedding stays "
                   "float), where its default copy keeps the float32 head")
    args = p.parse_args(argv)
    if args.run:
        return child(args)
    if args.quick:
        args.models, args.mixed_requests = "tiny-llama", 32
    systems = [s.replace("-", "_") for s in args.systems.split(",")]
    if any(s in HTTP_PEERS for s in systems):
        return http_main(args, systems)
    results: dict[str, dict[str, dict[str, Any]]] = {}
    for model in args.models.split(","):
        for wl in args.workloads.split(","):
            print(f"{model} / {wl} ...", flush=True)
            results.setdefault(model, {})[wl] = {s: run_one(args, model, wl, s) for s in systems}
    header = ("model", "workload", "system", "tok/s", "vs HF static", "vs HF paged", "TTFT p50 (s)", "TTFT p99 (s)",
              "peak RSS (MiB)", "load 1m")
    rows = []
    for model, wls in results.items():
        for wl, runs in wls.items():
            for system, r in runs.items():
                if "error" in r:
                    rows.append((model, wl, system, "error", r["error"][:40], "", "", "", "", ""))
                    continue

                def ratio(peer: str, r=r, runs=runs) -> str:
                    ref = runs.get(peer, {}).get("tokens_per_s")
                    return f"{r['tokens_per_s'] / ref:.2f}x" if ref else "-"
                rows.append((model, wl, system, f"{r['tokens_per_s']:.1f}", ratio("hf_static"), ratio("hf_paged"),
                             f"{r['ttft_p50_s']:.3f}", f"{r['ttft_p99_s']:.3f}", f"{r['peak_rss_mib']:.0f}",
                             f"{r['load_1m'][0]:.2f}/{r['load_1m'][1]:.2f}"))
    print()
    print_table(header, rows)
    write_report(args.out, {"config": vars(args), "cpus": os.cpu_count(), "results": results})
    return 0


def http_main(args: argparse.Namespace, systems: list[str]) -> int:
    """The server systems over HTTP, one client (bench/peers_http.py); HF systems in this call as usual."""
    import peers_http

    servers = [s for s in systems if s in peers_http.SERVER_SYSTEMS]
    before = Path(args.pagedkv_root).resolve() if args.pagedkv_root else None
    if before is not None and "pagedkv" in servers:
        servers.insert(servers.index("pagedkv") + 1, "pagedkv_before")
    if args.pagedkv_args_b and "pagedkv" in servers:
        servers.insert(servers.index("pagedkv") + 1, "pagedkv_b")
    hf = [s for s in systems if s in SYSTEMS and s != "pagedkv"]
    workloads = ("uniform,mixed,batch1,shared,poisson" if args.workloads == ",".join(WORKLOADS)
                 else args.workloads).split(",")
    report: dict[str, Any] = {"config": vars(args), "cpus": os.cpu_count(), "client": "vllm bench serve",
                              "models": {}}
    rows = []
    for model in args.models.split(","):
        path = model_dir(model)
        extra, gguf = tuple(args.pagedkv_args.split()), None
        if args.four_bit:
            path, gguf = four_bit_copy(model, path, args.four_bit_head), peers_http.gguf_of(model)
        print(f"{model} ({path}): {', '.join(servers)} over HTTP, {args.rounds} rounds of {', '.join(workloads)}",
              flush=True)
        got = peers_http.measure_servers(servers, model, path, workloads, args.rounds, dtype=args.dtype,
                                         pagedkv_args=extra, gguf=gguf, before=before,
                                         pagedkv_args_b=tuple(args.pagedkv_args_b.split()),
                                         log=lambda m: print(m, flush=True))
        got["hf"] = {wl: {s: run_one(args, model, wl, s) for s in hf} for wl in workloads if wl in WORKLOADS}
        report["models"][model] = got
        for wl, by_system in got["median"].items():
            ref = by_system.get("vllm") or by_system.get("llamacpp")
            for s, r in by_system.items():
                vs = f"{r['output_throughput'] / ref['output_throughput']:.2f}x" if ref else "-"  # (pagedkv ÷ peer)
                good = f"{r['goodput']:.2f}" if "goodput" in r else "-"
                if "goodput" in r and ref and ref.get("goodput") and s.startswith("pagedkv"):
                    good += f" ({r['goodput'] / ref['goodput']:.2f}x)"
                rows.append((model, wl, s, f"{r['output_throughput']:.1f}", vs if s.startswith("pagedkv") else "",
                             f"{r.get('mean_ttft_ms', float('nan')):.0f}", f"{r['p50_ttft_ms']:.0f}",
                             f"{r['p99_ttft_ms']:.0f}", f"{r['mean_tpot_ms']:.1f}", good, f"{r['load_1m']:.2f}",
                             str(r["runs"])))
    print()
    print_table(("model", "workload", "system", "out tok/s", "pagedkv / peer", "TTFT mean ms", "TTFT p50 ms",
                 "TTFT p99 ms", "TPOT mean ms", "goodput req/s (vs peer)", "load 1m", "runs"), rows)
    write_report(args.out, report)
    return 0


def four_bit_copy(model: str, path: Path, lm_head: bool = False) -> Path:
    """A GPTQ 4-bit group-32 copy of the model (pagedkv.tools.quantize.quantize_checkpoint), built once; with
    ``lm_head`` the head is 4-bit too (GPTQ's lm_head), the embedding float."""
    from pagedkv.models import build_atomically, cache_dir
    from pagedkv.tools.quantize import quantize_checkpoint

    out = cache_dir() / f"{model}-gptq4-g32{'-head' if lm_head else ''}-v1"
    if not (out / "config.json").exists():
        build_atomically(out, lambda d: quantize_checkpoint(path, d, method="gptq", group_size=32, lm_head=lm_head))
    return out


if __name__ == "__main__":
    sys.exit(main())
