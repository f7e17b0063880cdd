"""Issue 46's F4 against the gateway, over loopback: echo + logprobs=20 + prompt_logprobs=20 + n=16 over 4 prompts of
2,000 characters (an 8 KB request), non-streamed, while a bystander starts a one-token completion every 0.2 s on a
connection of its own. Executor + scheduler (tiny-llama, CPU) from this checkout; each gateway a fresh process
(naming tokens with tiny-llama's tokenizer, as pagedkv serve's does) from a checkout and with flags of its own, so one
command gives the before and the after figures:

- the answer: its status (a 400's param), its bytes, seconds until it was all read;
- the gateway's RSS before the request and its peak while it was answered (sampled every 50 ms);
- the bystander's latency with nothing else running (p50) and while the request was answered (p50, max: the
  longest a tenant waited behind it).

    git worktree add /tmp/f4-before <the commit before the budget>
    python bench/response_budget.py --before /tmp/f4-before          # -> bench/results/response_budget.json
"""

from __future__ import annotations

import argparse
import http.client
import json
import os
import threading
import time
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path

from common import RESULTS, ROOT, percentile, print_table, wait_idle, write_report
from gateway_attacks import GatewayProcess, RssPeak, completion, completion_latencies

from pagedkv.local_server import ServiceProcess

MODEL = "tiny-llama"


def finding(prompts: int, chars: int, n: int) -> dict:
    return {"model": MODEL, "prompt": [chr(97 + i % 26) * chars for i in range(prompts)], "echo": True,
            "logprobs": 20, "prompt_logprobs": 20, "n": n}


def send(port: int, body: dict, out: dict) -> None:
    conn = http.client.HTTPConnection("127.0.0.1", port, timeout=900)
    t0 = time.perf_counter()
    try:
        conn.request("POST", "/v1/completions", json.dumps(body), {"content-type": "application/json"})
        r = conn.getresponse()
        out["head_s"] = time.perf_counter() - t0  # (the status line: once the answer is encoded)
        data = r.read()
        out.update(status=r.status, bytes=len(data), seconds=time.perf_counter() - t0, request_bytes=len(
            json.dumps(body)))
        if r.status != 200:
            error = json.loads(data)["error"]
            out.update(param=error["param"], message=error["message"])
    except (OSError, http.client.HTTPException) as err:
        out.update(status=None, error=str(err), seconds=time.perf_counter() - t0)
    finally:
        conn.close()


def live(port: int) -> float | None:
    """Seconds for GET /health/live (the gateway alone: its event loop), on a connection of its own."""
    conn = http.client.HTTPConnection("127.0.0.1", port, timeout=120)
    t0 = time.perf_counter()
    try:
        conn.request("GET", "/health/live")
        ok = conn.getresponse().status == 200
    except (OSError, http.client.HTTPException):
        return None
    finally:
        conn.close()
    return time.perf_counter() - t0 if ok else None


def probe_loop(port: int, done: threading.Event, out: list, interval: float = 0.05) -> None:
    while not done.is_set():
        out.append(live(port))
        time.sleep(interval)


def attack(gateway: GatewayProcess, body: dict, interval: float = 0.2) -> dict:
    """The request, with the bystander's completions started every ``interval`` s until it is answered, and the
    gateway's /health/live asked in a loop (one at a time, every 50 ms)."""
    out: dict = {}
    peak = RssPeak(gateway)
    rss0 = gateway.rss_mb()
    t0 = time.perf_counter()
    thread = threading.Thread(target=send, args=(gateway.port, body, out), daemon=True)
    done, probes = threading.Event(), []
    prober = threading.Thread(target=probe_loop, args=(gateway.port, done, probes), daemon=True)
    thread.start()
    prober.start()
    with ThreadPoolExecutor(max_workers=256) as pool:
        futures, starts = [], []
        while thread.is_alive():
            starts.append(time.perf_counter() - t0)
            futures.append(pool.submit(completion, gateway.port))
            time.sleep(interval)
        latencies = [f.result() for f in futures]
    done.set()
    prober.join(120)
    answered = [r for r in probes if r is not None]
    out.update(live_p50_ms=percentile(answered, 50) * 1e3, live_max_ms=max(answered, default=float("nan")) * 1e3)
    during = [r for r in latencies if r is not None]
    out["bystander_timeline"] = [(round(s, 3), None if r is None else round(r * 1e3, 1))
                                 for s, r in zip(starts, latencies)]  # (sent at s, its latency in ms)
    return {**out, "rss_before_mb": rss0, "rss_peak_mb": peak.stop(), "bystander_p50_ms": percentile(during, 50) * 1e3,
            "bystander_max_ms": max(during, default=float("nan")) * 1e3, "bystander_completions": len(during),
            "bystander_failed": len(futures) - len(during)}


def run_config(root: Path, scheduler: str, flags: list[str], body: dict) -> dict:
    gateway = GatewayProcess(root, scheduler, "--tokenizer", MODEL, *flags)
    try:
        send(gateway.port, {"model": MODEL, "prompt": "hi", "max_tokens": 1, "logprobs": 1}, {})  # the tokenizer
        idle = completion_latencies(gateway.port, 3.0)
        return {"gateway_root": str(root), "flags": flags, "idle_p50_ms": percentile(idle, 50) * 1e3,
                **attack(gateway, body)}
    finally:
        gateway.stop()


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--before", default="", metavar="DIR", help="a checkout from before the budget (its gateway)")
    p.add_argument("--allowed-bytes", type=int, default=1 << 30,
                   help="the after gateway run again with --max-response-bytes this (the answer allowed)")
    p.add_argument("--prompts", type=int, default=4)
    p.add_argument("--chars", type=int, default=2000)
    p.add_argument("--n", type=int, default=16)
    p.add_argument("--max-wait-idle", type=float, default=0.0)
    p.add_argument("--out", default=str(RESULTS / "response_budget.json"))
    args = p.parse_args()
    wait_idle(args.max_wait_idle)
    body = finding(args.prompts, args.chars, args.n)
    configs = [("after (default)", ROOT, []),
               (f"after, --max-response-bytes {args.allowed_bytes}", ROOT,
                ["--max-response-bytes", str(args.allowed_bytes)])]
    if args.before:
        configs.insert(0, ("before", Path(args.before).resolve(), []))
    executor = ServiceProcess("executor", "--num-pages", "2048", "--threads", "1")
    procs: list = [executor]
    report: dict = {"request": {k: v for k, v in body.items() if k != "prompt"} | {
        "prompts": args.prompts, "chars": args.chars}, "configs": {}}
    try:
        scheduler = ServiceProcess("scheduler", "--executor", executor.address)
        procs.append(scheduler)
        for name, root, flags in configs:
            report["configs"][name] = run_config(root, scheduler.address, flags, body)
    finally:
        for proc in reversed(procs):
            proc.stop()
    report["machine"] = {"cpus": os.cpu_count(), "load_avg_1m": os.getloadavg()[0]}
    def ms(v: float) -> str:
        return "-" if v != v else f"{v:.0f}"  # (NaN: none answered while it ran)

    rows = []
    for name, r in report["configs"].items():
        answer = f"{r['status']}" + (f" ({r['param']})" if r.get("param") else "")
        rows.append([name, answer, f"{r.get('bytes', 0):,}", f"{r['seconds']:.2f}",
                     f"{r['rss_before_mb']:.0f} -> {r['rss_peak_mb']:.0f}",
                     ms(r["idle_p50_ms"]), f"{ms(r['bystander_p50_ms'])} / {ms(r['bystander_max_ms'])}",
                     f"{ms(r['live_p50_ms'])} / {ms(r['live_max_ms'])}"])
    print(f"request: {args.prompts} prompts x {args.chars} chars, echo, logprobs=20, prompt_logprobs=20, n={args.n} "
          f"({len(json.dumps(body)):,} bytes)")
    print_table(["gateway", "status", "answer bytes", "answer s", "RSS MB before -> peak", "bystander idle p50 ms",
                 "bystander during p50 / max ms", "/health/live during p50 / max ms"], rows)
    write_report(args.out, report)


if __name__ == "__main__":
    main()
