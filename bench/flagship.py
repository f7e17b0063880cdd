"""The seeds' flagship end to end (#50 item 3): SmolLM2 with 4-bit weights (a GPTQ group-32 asymmetric copy that
pagedkv.tools.quantize makes, calibrated on 32 x 512 tokens of the text below, from token 60,000 on: disjoint from
the 4,096 the perplexity reads; the head stays float, as GPTQ's default) + FP8 KV + Share-Prefix, against float32
weights + float32 KV, against pagedkv with bfloat16 weights + FP8 KV (its linears on the CPU's AMX units, where
it has them) and against vLLM's CPU build (bfloat16 weights, with each KV dtype it offers on CPU: bfloat16 and
fp8), every server given the same KV budget in bytes.

1. Quality, in process (bench/kv_quant.py's harness: the executor's own model, page pool and torch backend):
   perplexity on CPython's pydoc_data text (4 x 1,024 tokens, 128-token chunked prefills), top-1 agreement and
   mean KL against float32 weights + float32 KV, for each combination of weights (fp32, 4-bit) and KV (fp32, fp8).
2. KV bytes per token (scales included) and the concurrency that fits the budget: requests of the workload's
   shape (a shared prefix held once, each request's own prompt and output) whose KV the budget holds.
3. Serving, one client for all (vLLM's ``vllm bench serve``, bench/peers_http.py): a shared-prefix Poisson load
   (a 1,024-token prefix common to every prompt, 256 tokens of its own, 128 out, ``--rate`` requests/s), the
   servers side by side, ``--rounds`` alternating rounds after a throw-away run each, medians: output tok/s,
   TTFT and TPOT p99, and the most requests running at once (each server's own gauge, scraped every 0.25 s).
   pagedkv's pool is ``--num-pages`` (16-token pages) and vLLM's ``--num-gpu-blocks-override`` (32-token blocks:
   its CPU attention takes no less), each the budget divided by that configuration's bytes per page.

    python bench/flagship.py                     # -> bench/results/flagship.json
    python bench/flagship.py --kv-budget-mib 256 --rate 1.5 --rounds 3
    python bench/flagship.py --quality-only      # 1. and 2. (no servers)
"""

from __future__ import annotations

import argparse
import math
import os
import re
import statistics
import sys
import threading
import time
import urllib.request
from pathlib import Path
from typing import Any

import torch
import torch.nn.functional as F

ROOT = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(ROOT))

from common import print_table, write_report  # noqa: E402
from e2e_peers import model_dir  # noqa: E402
from kv_quant import Harness, fixed_text_tokens  # noqa: E402

from executor_svc.kv_quant import parse_kv_dtype  # noqa: E402
from executor_svc.model import load_model  # noqa: E402
from executor_svc.model_config import ModelConfig  # noqa: E402

MODEL = "smollm2-135m-instruct"
BLOCK = 16  # pagedkv's page (the seeds' default)
VLLM_BLOCK = 32  # vLLM's CPU attention takes multiples of 32 only
PREFIX, OWN, OUT = 1024, 256, 128  # the workload's shape: shared prefix, each prompt's own tokens, output
CALIB_FROM = 60_000  # the calibration text's first token (the perplexity reads the first 4,096)
QUALITY = (("fp32", "float32"), ("fp32", "fp8_e4m3"), ("4-bit", "float32"), ("4-bit", "fp8_e4m3"))


def gptq_copy(src: Path) -> Path:
    """The calibrated GPTQ copy of ``src``, built once into pagedkv's model cache."""
    from pagedkv.models import build_atomically, cache_dir
    from pagedkv.tools.quantize import quantize_checkpoint

    out = cache_dir() / f"{MODEL}-gptq4-g32-asym-calib-v1"
    if not (out / "config.json").exists():
        data = fixed_text_tokens(src)
        calib = [data[CALIB_FROM + i * 512:CALIB_FROM + (i + 1) * 512] for i in range(32)]
        build_atomically(out, lambda d: quantize_checkpoint(src, d, method="gptq", group_size=32, sym=False,
                                                            calibration=calib))
    return out


# ---- 1. quality ---------------------------------------------------------------------------------------
def quality(dirs: dict[str, Path], num_seqs: int, seq_len: int = 1024, chunk: int = 128) -> list[dict]:
    """Perplexity, top-1 agreement and mean KL of each (weights, KV) against fp32 weights + fp32 KV."""
    data = fixed_text_tokens(dirs["fp32"])
    seqs = [data[i * seq_len:(i + 1) * seq_len] for i in range(num_seqs)]
    pages = list(range(seq_len // BLOCK))
    models = {w: (lambda cfg: (load_model(cfg, torch.device("cpu"), torch.float32), cfg))(ModelConfig.from_dir(d))
              for w, d in dirs.items()}
    sums = {c: dict(nll=0.0, agree=0, kl=0.0) for c in QUALITY}
    tokens = 0
    for s in seqs:
        target = torch.tensor(s)[1:]
        tokens += target.numel()
        ref = ref_logp = None
        for weights, kv in QUALITY:  # (fp32/fp32 first: the reference)
            model, cfg = models[weights]
            h = Harness(model, cfg, kv, len(pages))
            with torch.inference_mode():
                lg = torch.cat([h.prefill(s[i:i + chunk], i, pages) for i in range(0, seq_len, chunk)])[:-1]
            logp = F.log_softmax(lg.float(), -1)
            if ref is None:
                ref, ref_logp = lg.argmax(-1), logp
            acc = sums[(weights, kv)]
            acc["nll"] -= float(logp.gather(-1, target.unsqueeze(-1)).sum())
            acc["agree"] += int((lg.argmax(-1) == ref).sum())
            acc["kl"] += float((ref_logp.exp() * (ref_logp - logp)).sum())
    base = math.exp(sums[QUALITY[0]]["nll"] / tokens)
    return [dict(weights=w, kv=kv, perplexity=math.exp(a["nll"] / tokens),
                 ppl_vs_fp32=math.exp(a["nll"] / tokens) / base - 1, top1_agreement=a["agree"] / tokens,
                 mean_kl=a["kl"] / tokens, tokens=tokens) for (w, kv), a in sums.items()]


# ---- 2. bytes and concurrency ---------------------------------------------------------------------------
def systems(cfg: ModelConfig, dirs: dict[str, Path], budget: int) -> dict[str, dict[str, Any]]:
    """Each served configuration: its weights, KV dtype, bytes per token and the pages the budget buys."""
    def pagedkv_bpt(kv: str) -> int:
        return math.ceil(parse_kv_dtype(kv, torch.float32).bytes_per_token(cfg.num_layers, cfg.num_kv_heads,
                                                                           cfg.head_dim))

    elems = 2 * cfg.num_layers * cfg.num_kv_heads * cfg.head_dim  # K and V, every layer (vLLM: no per-token scales)
    out = {
        "pagedkv fp32": dict(weights="fp32", kv="float32", dir=dirs["fp32"], bytes_per_token=pagedkv_bpt("float32")),
        "pagedkv flagship": dict(weights="GPTQ 4-bit g32", kv="fp8_e4m3", dir=dirs["4-bit"],
                                 bytes_per_token=pagedkv_bpt("fp8_e4m3")),
        "pagedkv bf16 + fp8 KV": dict(weights="bf16", kv="fp8_e4m3", dir=dirs["fp32"], dtype="bfloat16",
                                      bytes_per_token=pagedkv_bpt("fp8_e4m3")),
        "vllm bf16": dict(weights="bf16", kv="bf16 (auto)", dir=dirs["fp32"], bytes_per_token=2 * elems),
        "vllm bf16 + fp8 KV": dict(weights="bf16", kv="fp8 (e4m3)", dir=dirs["fp32"], bytes_per_token=elems),
    }
    for name, s in out.items():
        block = BLOCK if name.startswith("pagedkv") else VLLM_BLOCK
        s["pages"] = budget // (block * s["bytes_per_token"])
        tokens = s["pages"] * block
        s["kv_tokens"] = tokens
        s["concurrency_fits"] = max(0, (tokens - PREFIX) // (OWN + OUT))  # (the prefix held once: Share-Prefix)
    return out


# ---- 3. serving --------------------------------------------------------------------------------------------
class PeakRunning:
    """The most requests a server reports running, scraped from its Prometheus text while a run lasts."""

    def __init__(self, url: str, metric: str) -> None:
        self.url, self.pattern, self.peak = url, re.compile(rf"^{re.escape(metric)}(?:{{[^}}]*}})?\s+(\S+)", re.M), 0.0
        self._stop = threading.Event()
        self._thread = threading.Thread(target=self._run, daemon=True)

    def _run(self) -> None:
        while not self._stop.wait(0.25):
            try:
                with urllib.request.urlopen(self.url, timeout=2.0) as r:  # noqa: S310 - loopback only
                    text = r.read().decode()
            except OSError:
                continue
            self.peak = max([self.peak, *(float(v) for v in self.pattern.findall(text))])

    def __enter__(self) -> PeakRunning:
        self._thread.start()
        return self

    def __exit__(self, *exc) -> None:
        self._stop.set()
        self._thread.join()


def make_servers(table: dict[str, dict[str, Any]], extra: tuple[str, ...] = ()) -> dict[str, tuple[Any, str, str]]:
    """name -> (HttpServer, metrics URL, running gauge)."""
    import peers_http

    from pagedkv.cli import free_port

    out = {}
    for name, s in table.items():
        if name.startswith("pagedkv"):
            mport = free_port()
            srv = peers_http.make_server("pagedkv", MODEL, s["dir"], free_port(), dtype=s.get("dtype", "float32"),
                                         pagedkv_args=(
                "--kv-cache-dtype", s["kv"], "--num-pages", str(s["pages"]), "--metrics-port", str(mport), *extra))
            out[name] = (srv, f"http://127.0.0.1:{mport}/metrics", "pagedkv_requests_running")
        else:
            port = free_port()
            kv = ["--kv-cache-dtype", "fp8"] if "fp8" in s["kv"] else []
            srv = peers_http.HttpServer("vllm", port, MODEL, [
                "bash", str(peers_http.PEERS / "vllm-cpu.sh"), "serve", str(s["dir"]), str(port),
                "--served-model-name", MODEL, "--dtype", "bfloat16", "--block-size", str(VLLM_BLOCK),
                "--num-gpu-blocks-override", str(s["pages"]), *kv])
            out[name] = (srv, f"http://127.0.0.1:{port}/metrics", "vllm:num_requests_running")
    return out


def serve_runs(table: dict[str, dict[str, Any]], prompts: int, rate: float, rounds: int, tokenizer: Path,
               extra: tuple[str, ...] = ()) -> dict[str, list[dict]]:
    import peers_http

    if why := peers_http.missing_peer("vllm"):
        print(f"vLLM skipped: {why}", flush=True)
        table = {k: v for k, v in table.items() if not k.startswith("vllm")}
    wl = peers_http.HttpWorkload("shared-prefix poisson", prompts, OWN, OUT, prefix_len=PREFIX, rate=rate)
    servers = make_servers(table, extra)
    runs: dict[str, list[dict]] = {name: [] for name in servers}
    try:
        for name, (srv, _, _) in servers.items():
            srv.start()
            print(f"  {name} ready in {srv.startup_s:.1f} s", flush=True)
        order = list(servers)
        for name in order:  # a throw-away run each, prompts of its own
            peers_http.bench(servers[name][0], wl.warm_up(), tokenizer, 10_000 + order.index(name))
        for r in range(rounds):
            for name in (order if r % 2 == 0 else order[::-1]):
                srv, url, metric = servers[name]
                with PeakRunning(url, metric) as peak:
                    res = peers_http.bench(srv, wl, tokenizer, 1 + r)  # (the same prompts for all in a round)
                res["peak_running"] = peak.peak
                runs[name].append(res)
                print(f"  round {r + 1} {name}: " + (f"error {res['error']}" if "error" in res else
                      f"{res['output_throughput']:.1f} tok/s, TTFT p99 {res['p99_ttft_ms']:.0f} ms, TPOT p99 "
                      f"{res['p99_tpot_ms']:.1f} ms, peak running {peak.peak:.0f}, load {res['load_1m'][0]:.2f}"),
                      flush=True)
    finally:
        for srv, _, _ in servers.values():
            srv.stop()
    return runs


def medians(runs: list[dict]) -> dict[str, float]:
    ok = [r for r in runs if "error" not in r]
    keys = ("output_throughput", "p99_ttft_ms", "p50_ttft_ms", "p99_tpot_ms", "mean_tpot_ms", "peak_running")
    return {k: statistics.median(r[k] for r in ok) for k in keys} | {"runs": len(ok)} if ok else {"runs": 0}


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--kv-budget-mib", type=float, default=128.0, help="every server's KV budget (default 128 MiB)")
    ap.add_argument("--rate", type=float, default=2.0, help="requests/s of the Poisson load (default 2)")
    ap.add_argument("--prompts", type=int, default=32, help="requests per run (default 32)")
    ap.add_argument("--rounds", type=int, default=2)
    ap.add_argument("--quality-seqs", type=int, default=4, help="1,024-token sequences for 1. (default 4)")
    ap.add_argument("--quality-only", action="store_true", help="1. and 2. only")
    ap.add_argument("--threads", type=int, default=2, help="torch threads for 1.")
    ap.add_argument("--pagedkv-args", default="", metavar="FLAGS", help="more `pagedkv serve` flags, one string")
    ap.add_argument("--systems", default="", help="a comma-separated subset of the systems (default: all)")
    ap.add_argument("--out", type=Path, default=ROOT / "bench" / "results" / "flagship.json")
    args = ap.parse_args(argv)
    torch.set_num_threads(args.threads)
    fp32 = model_dir(MODEL)
    dirs = {"fp32": fp32, "4-bit": gptq_copy(fp32)}
    budget = int(args.kv_budget_mib * 2**20)
    table = systems(ModelConfig.from_dir(fp32), dirs, budget)
    if args.systems:
        table = {k: v for k, v in table.items() if k in args.systems.split(",")}
    report: dict[str, Any] = {"config": {k: str(v) for k, v in vars(args).items()}, "cpus": os.cpu_count(),
                              "workload": dict(prefix=PREFIX, own=OWN, out=OUT), "budget_bytes": budget}
    t0 = time.perf_counter()
    report["quality"] = quality(dirs, args.quality_seqs)
    print(f"quality in {time.perf_counter() - t0:.0f} s", flush=True)
    print_table(("weights", "KV", "perplexity", "vs fp32", "top-1 agree", "mean KL"), [
        (q["weights"], q["kv"], f"{q['perplexity']:.3f}", f"{q['ppl_vs_fp32']:+.3%}", f"{q['top1_agreement']:.2%}",
         f"{q['mean_kl']:.1e}") for q in report["quality"]])
    runs = {} if args.quality_only else serve_runs(table, args.prompts, args.rate, args.rounds, fp32,
                                                                  tuple(args.pagedkv_args.split()))
    report["systems"] = {k: {**{kk: str(vv) if isinstance(vv, Path) else vv for kk, vv in v.items()},
                             "runs": runs.get(k, []), "median": medians(runs.get(k, []))} for k, v in table.items()}
    vllm = [s["median"] for k, s in report["systems"].items() if k.startswith("vllm") and s["median"]["runs"]]
    ref = max((m["output_throughput"] for m in vllm), default=None)  # vLLM's best configuration here
    rows = []
    for name, s in report["systems"].items():
        m = s["median"]
        tps = m.get("output_throughput")
        rows.append((name, s["weights"], s["kv"], f"{s['bytes_per_token']:,}", f"{s['kv_tokens']:,}",
                     str(s["concurrency_fits"]), f"{m['peak_running']:.0f}" if m["runs"] else "-",
                     f"{tps:.1f}" if tps else "-", f"{tps / ref:.2f}x" if tps and ref else "-",
                     f"{m['p99_ttft_ms']:.0f}" if m["runs"] else "-", f"{m['p99_tpot_ms']:.1f}" if m["runs"] else "-"))
    print()
    print(f"KV budget {args.kv_budget_mib:g} MiB; {args.prompts} requests at {args.rate:g}/s, {PREFIX} shared + {OWN} "
          f"own -> {OUT}; medians of {args.rounds} rounds")
    print_table(("system", "weights", "KV", "KV B/token", "KV tokens", "fits", "peak running", "out tok/s",
                 "vs vLLM best", "TTFT p99 ms", "TPOT p99 ms"), rows)
    write_report(args.out, report)
    return 0


if __name__ == "__main__":
    sys.exit(main())
