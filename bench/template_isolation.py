"""A bystander tenant's latency while another tenant sends chat templates of its own that loop or blow up (#46 F5),
through real processes on loopback: an executor and a scheduler (``--trust-request-chat-template``, two tenants)
over a small random model with a chat template, both run from ``--root`` (default: this checkout; give an older
checkout's copy for the before figures).

Phases, each ``--attack-s`` seconds while the bystander starts a one-token chat (the model's template) every
``--every-s`` s (each waits at most ``--bystander-timeout`` s):

- idle: no attacker;
- loop: the attacker sends ``{% for a in range(N) %}{% for b in range(N) %}{% endfor %}{% endfor %}``
  (``--loop-n`` N, 30,000: about 9e8 iterations, ~20-40 s of one core in process; N = 99,999 is the finding's
  minutes-long one), one after another;
- big string: the attacker sends ``{{ 'x'*10**7 }}``, one after another.

Before each phase one bystander chat is awaited with no time limit (work an earlier phase left behind drains).

The table: the bystander's latency (p50, p90, max), its requests that timed out, the attacker's requests and how
long each took to be refused, and the scheduler's peak RSS (VmHWM) after the phase.

    python bench/template_isolation.py                                   # after (this checkout)
    git archive <commit> | tar -x -C /tmp/before && python bench/template_isolation.py --root /tmp/before
"""

from __future__ import annotations

import argparse
import asyncio
import json
import os
import subprocess
import sys
import tempfile
import threading
import time
from collections import deque
from pathlib import Path

from common import ROOT, percentile, print_table, write_report

from pagedkv.cli import free_port
from pagedkv.local_server import TEST_EXECUTOR_SECRET
from pagedkv.security import EXECUTOR_SECRET_ENV
from pagedkv.tenancy import hash_key

ATTACKER, BYSTANDER = "bench-attacker", "bench-bystander"
TEMPLATE = ("{{ bos_token }}{% for m in messages %}<|{{ m['role'] }}|>{{ m['content'] }}\n{% endfor %}"
            "{% if add_generation_prompt %}<|assistant|>{% endif %}")
BIG_STRING = "{{ 'x'*10**7 }}"


def loop_template(n: int) -> str:
    return f"{{% for a in range({n}) %}}{{% for b in range({n}) %}}{{% endfor %}}{{% endfor %}}"


class RootProcess:
    """``pagedkv <role>`` run from ``root`` (its sources first on the path); waits for ``<role>_ready``."""

    def __init__(self, root: Path, role: str, *args: str) -> None:
        self.port = free_port()
        cmd = [sys.executable, "-m", "pagedkv", role, "--port", str(self.port), "--log-format", "json", *args]
        env = {**os.environ, "PYTHONPATH": str(root), EXECUTOR_SECRET_ENV: TEST_EXECUTOR_SECRET}
        self.proc = subprocess.Popen(cmd, cwd=root, env=env, stdout=subprocess.PIPE, stderr=subprocess.STDOUT,
                                     text=True, start_new_session=True)
        self.lines: deque[str] = deque(maxlen=2000)
        self.ready = threading.Event()
        threading.Thread(target=self._pump, args=(role,), daemon=True).start()
        if not self.ready.wait(600) or self.proc.poll() is not None:
            self.stop()
            raise RuntimeError(f"{role} not ready:\n" + "\n".join(self.lines))

    def _pump(self, role: str) -> None:
        assert self.proc.stdout is not None
        for line in self.proc.stdout:
            self.lines.append(line.rstrip())
            if f'"{role}_ready"' in line:
                self.ready.set()
        self.ready.set()

    @property
    def address(self) -> str:
        return f"127.0.0.1:{self.port}"

    def peak_rss_mb(self) -> float:
        with open(f"/proc/{self.proc.pid}/status") as f:
            return next(int(line.split()[1]) for line in f if line.startswith("VmHWM:")) / 1024

    def stop(self) -> None:
        if self.proc.poll() is None:
            self.proc.terminate()
            try:
                self.proc.wait(60)
            except subprocess.TimeoutExpired:
                self.proc.kill()
                self.proc.wait()


def build_model(tmp: Path) -> Path:
    from transformers import AutoTokenizer

    from pagedkv.tools.random_model import build_random_model

    path = build_random_model(tmp / "model", seed=3, hidden_size=64, intermediate_size=128, num_layers=2,
                              num_heads=4, num_kv_heads=2)
    tok = AutoTokenizer.from_pretrained(str(path))
    tok.chat_template = TEMPLATE
    tok.save_pretrained(str(path))
    return path


async def bystander(address: str, stop: asyncio.Event, every_s: float, timeout_s: float) -> tuple[list[float], int]:
    """One-token chats started every ``every_s`` until ``stop``: their latencies and how many timed out."""
    from pagedkv.client import Client

    latencies, timeouts = [], 0
    async with Client(address, api_key=BYSTANDER, resume=None) as c:
        async def one() -> None:
            nonlocal timeouts
            t0 = time.perf_counter()
            try:
                await asyncio.wait_for(c.complete(messages=[("user", "hi")], max_tokens=1), timeout_s)
                latencies.append(time.perf_counter() - t0)
            except asyncio.TimeoutError:
                timeouts += 1
        tasks = []
        while not stop.is_set():
            tasks.append(asyncio.create_task(one()))
            await asyncio.sleep(every_s)
        await asyncio.gather(*tasks)
    return latencies, timeouts


async def attacker(address: str, template: str, stop: asyncio.Event, timeout_s: float) -> list[tuple[float, str]]:
    """The template sent again as soon as it is answered, until ``stop``: (seconds, outcome) of each."""
    import grpc

    from pagedkv.client import Client

    outcomes = []
    async with Client(address, api_key=ATTACKER, resume=None) as c:
        while not stop.is_set():
            t0 = time.perf_counter()
            try:
                await asyncio.wait_for(c.complete(messages=[("user", "hi")], chat_template=template, max_tokens=1),
                                       timeout_s)
                outcome = "answered"
            except grpc.aio.AioRpcError as err:
                outcome = f"{err.code().name}: {err.details()[:90]}"
            except asyncio.TimeoutError:
                outcome = "no answer"
            outcomes.append((time.perf_counter() - t0, outcome))
    return outcomes


async def settle(address: str) -> float:
    """Seconds until a bystander chat is answered (what an earlier phase left on the tokenizer thread drains)."""
    from pagedkv.client import Client

    t0 = time.perf_counter()
    async with Client(address, api_key=BYSTANDER, resume=None) as c:
        await c.complete(messages=[("user", "hi")], max_tokens=1)
    return time.perf_counter() - t0


async def phase(address: str, template: str | None, args) -> dict:
    settled = await settle(address)
    stop = asyncio.Event()
    by = asyncio.create_task(bystander(address, stop, args.every_s, args.bystander_timeout))
    at = asyncio.create_task(attacker(address, template, stop, args.bystander_timeout)) if template else None
    await asyncio.sleep(args.attack_s)
    stop.set()
    latencies, timeouts = await by
    attacks = await at if at is not None else []
    return {"latencies_s": latencies, "timeouts": timeouts, "attacks": attacks, "settle_s": settled}


def row(name: str, r: dict) -> list[str]:
    ms = [x * 1000 for x in r["latencies_s"]]
    attacks = r["attacks"]
    refused = ", ".join(f"{s:.2f}" for s, _ in attacks[:4]) + (" ..." if len(attacks) > 4 else "")
    return [name, str(len(ms)), f"{percentile(ms, 50):.0f}", f"{percentile(ms, 90):.0f}",
            f"{max(ms, default=float('nan')):.0f}", str(r["timeouts"]), str(len(attacks)), refused or "-",
            f"{r['peak_rss_mb']:.0f}"]


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--root", type=Path, default=ROOT, help="the checkout the executor and scheduler run from")
    p.add_argument("--attack-s", type=float, default=30.0)
    p.add_argument("--every-s", type=float, default=0.25)
    p.add_argument("--bystander-timeout", type=float, default=60.0)
    p.add_argument("--loop-n", type=int, default=30_000)
    p.add_argument("--scheduler-args", default="", help="more scheduler flags, space-separated")
    p.add_argument("--out", type=Path, default=ROOT / "bench" / "results" / "template_isolation.json")
    args = p.parse_args()
    with tempfile.TemporaryDirectory() as tmp:
        model = build_model(Path(tmp))
        tenants = Path(tmp) / "tenants.toml"
        tenants.write_text(f'[tenants.attacker]\nkeys = ["{hash_key(ATTACKER)}"]\n\n'
                           f'[tenants.bystander]\nkeys = ["{hash_key(BYSTANDER)}"]\n')
        executor = RootProcess(args.root, "executor", "--model", str(model), "--num-pages", "64", "--threads", "1")
        try:
            scheduler = RootProcess(args.root, "scheduler", "--executor", executor.address, "--max-model-len", "256",
                                    "--tenants-file", str(tenants), "--trust-request-chat-template",
                                    *args.scheduler_args.split())
            try:
                results = {}
                for name, template in [("idle", None), (f"loop N={args.loop_n}", loop_template(args.loop_n)),
                                       ("'x'*10**7", BIG_STRING)]:
                    results[name] = asyncio.run(phase(scheduler.address, template, args))
                    results[name]["peak_rss_mb"] = scheduler.peak_rss_mb()
                    print(f"{name}: done", flush=True)
            finally:
                scheduler.stop()
        finally:
            executor.stop()
    print(f"root {args.root}; every phase {args.attack_s:g} s, a bystander chat every {args.every_s:g} s")
    print_table(["phase", "bystander reqs", "p50 ms", "p90 ms", "max ms", "timed out", "attacks",
                 "attack answered after (s)", "sched peak RSS MB"], [row(n, r) for n, r in results.items()])
    for name, r in results.items():
        outcomes = sorted({o for _, o in r["attacks"]})
        if outcomes:
            print(f"{name}: {json.dumps(outcomes)}")
    write_report(args.out, {"root": str(args.root), "args": {k: str(v) for k, v in vars(args).items()},
                            "results": results})


if __name__ == "__main__":
    main()
