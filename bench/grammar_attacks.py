"""Issue 46's grammar probes (F1, F2) against `pagedkv serve` with two tenants, and the matchers' cost at 256 rows.

A bystander tenant sends an 8-token greedy request every ``--gap`` seconds throughout; its latency p50/p90 is taken
idle, then while each attack runs (the server's defaults, or the flags after ``--``):

- F1: the attacker streams two constrained requests whose matcher grows its per-step cost without bound: the
  finding's 51-byte ambiguous EBNF and the 6-byte regex ``(x*)*y`` with ``y`` biased away (max_tokens 1,500 each).
  Reported: how each ended (tokens, the error), the bystander's latency, the attacker's and bystander's grammar CPU.
- F2: the attacker sends two ~62 KB schemas whose compile is slow; meanwhile the bystander sends json_object, a
  regex and a fresh schema: how long each took and whether it was refused (the finding: all refused past 5 s, and
  json_object refused for everyone after); compile CPU per tenant (TenantInfo.grammar_cpu_seconds).

Then, in this process, the matchers' work of a step at 256 constrained rows (SmolLM2's 49k vocabulary, a JSON
schema, random allowed tokens): the loop that ran on the step before (fill each row, then accept each token) against
StepGrammar's jobs on the matcher threads (start, wait), both per step.

``--root DIR`` runs the servers from another checkout (a `git worktree` of an earlier commit: the before figures).

    python bench/grammar_attacks.py                               # -> bench/results/grammar_attacks.json
    python bench/grammar_attacks.py --root ../before --skip-rows --out bench/results/grammar_attacks_before.json
"""

from __future__ import annotations

import argparse
import asyncio
import json
import os
import statistics
import subprocess
import sys
import threading
import time
from pathlib import Path

from common import RESULTS, ROOT, percentile, print_table, write_report

from pagedkv.api.v1 import api_pb2 as api
from pagedkv.cli import free_port
from pagedkv.client import Client, Completion, accumulate
from pagedkv.tenancy import hash_key

AMBIGUOUS = 'root ::= a{500,}\na ::= "x" | "x" "x" | "xx" | "x" a'
SLOW_SCHEMA = json.dumps({"type": "object", "properties": {
    f"p{i}": {"type": "string", "pattern": "^[a-z]{3,9}-[0-9]{2,5}(x|y|z){1,4}$"} for i in range(800)}})
ATTACK_S = 60.0  # an attack still running then is cancelled (--attack-s)
THREADS = 2  # matcher threads of the 256-row measurement (the executor's --grammar-threads default)
TENANTS = f"""
[tenants.attacker]
keys = ["{hash_key('key-attacker')}"]

[tenants.bystander]
keys = ["{hash_key('key-bystander')}"]
"""


class Serve:
    """``pagedkv serve`` from ``root`` (its sources first on the path), ready when it says so."""

    def __init__(self, root: Path, *args: str) -> None:
        self.port = free_port()
        cmd = [sys.executable, "-m", "pagedkv", "serve", "--port", str(self.port), "--log-format", "console", *args]
        self.proc = subprocess.Popen(cmd, cwd=root, env={**os.environ, "PYTHONPATH": str(root)},
                                     stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True,
                                     start_new_session=True)
        self.lines: list[str] = []
        self.ready = threading.Event()
        threading.Thread(target=self._pump, daemon=True).start()
        if not self.ready.wait(600) or self.proc.poll() is not None:
            self.stop()
            raise RuntimeError("serve not ready:\n" + "\n".join(self.lines[-40:]))

    def _pump(self) -> None:
        for line in self.proc.stdout:
            self.lines.append(line.rstrip())
            if "pagedkv ready" in line:
                self.ready.set()
        self.ready.set()

    @property
    def address(self) -> str:
        return f"127.0.0.1:{self.port}"

    def stop(self) -> None:
        if self.proc.poll() is None:
            os.killpg(self.proc.pid, 2)
            try:
                self.proc.wait(30)
            except subprocess.TimeoutExpired:
                os.killpg(self.proc.pid, 9)
                self.proc.wait()


async def bystander(address: str, stop: asyncio.Event, gap: float, least: int) -> list[float]:
    """8-token greedy requests one after another, ``gap`` apart, until ``stop`` (at least ``least``): latencies."""
    out = []
    async with Client(address, api_key="key-bystander") as client:
        while not stop.is_set() or len(out) < least:
            t = time.perf_counter()
            await client.complete([1, 72, 105, 33 + len(out) % 50], max_tokens=8, temperature=0, ignore_eos=True)
            out.append(time.perf_counter() - t)
            await asyncio.sleep(gap)
    return out


def _why(err: Exception) -> str:
    return err.details() if hasattr(err, "details") else str(err)


async def attack(address: str, **params) -> dict:
    """One attacking request, given up (cancelled) after ATTACK_S: how it ended."""
    got = {"tokens": 0}
    t = time.perf_counter()

    async def run() -> str:
        async with Client(address, api_key="key-attacker", resume=None) as client:
            try:
                async for msg in client.generate("attack", **params):
                    got["tokens"] += len(msg.token_ids)
                return ""
            except Exception as err:  # noqa: BLE001 -- what the attacker got, reported
                return _why(err)

    try:
        error = await asyncio.wait_for(run(), ATTACK_S)
    except asyncio.TimeoutError:
        error = f"still running after {ATTACK_S:g} s (cancelled)"
    return {"tokens": got["tokens"], "seconds": round(time.perf_counter() - t, 2), "error": error[:160]}


async def constrained(address: str, c: api.Constraint) -> dict:
    t = time.perf_counter()
    async with Client(address, api_key="key-bystander", resume=None) as client:
        try:
            out = Completion()
            async for msg in client.generate("b", max_tokens=40, temperature=0, constraint=c):
                accumulate(out, msg)
            error = ""
        except Exception as err:  # noqa: BLE001
            error = _why(err)
    return {"seconds": round(time.perf_counter() - t, 2), "refused": error[:160]}


async def grammar_cpu(address: str, key: str) -> float:
    async with Client(address, api_key=key) as client:
        tenant = (await client.model_info()).tenant
    return getattr(tenant, "grammar_cpu_seconds", 0.0)  # (an older server has no such figure: 0)


def summary(lat: list[float]) -> dict:
    return {"n": len(lat), "p50_ms": round(statistics.median(lat) * 1e3, 1),
            "p90_ms": round(percentile(lat, 90) * 1e3, 1)}


async def probes(address: str, gap: float) -> dict:
    stop = asyncio.Event()
    stop.set()
    idle = await bystander(address, stop, gap, 10)
    # F1
    stop = asyncio.Event()
    by = asyncio.create_task(bystander(address, stop, gap, 5))
    f1 = await asyncio.gather(attack(address, max_tokens=1500, temperature=0, constraint=api.Constraint(
        grammar=AMBIGUOUS)), attack(address, max_tokens=1500, temperature=0, logit_bias={ord("y") + 3: -100.0},
                                    constraint=api.Constraint(regex="(x*)*y")))
    stop.set()
    during_f1 = await by
    cpu_f1 = {k: round(await grammar_cpu(address, f"key-{k}"), 3) for k in ("attacker", "bystander")}
    # F2
    stop = asyncio.Event()
    by = asyncio.create_task(bystander(address, stop, gap, 5))
    slow = [asyncio.create_task(attack(address, max_tokens=4, constraint=api.Constraint(
        json_schema=SLOW_SCHEMA.replace("p0", f"q{i}")))) for i in range(2)]
    await asyncio.sleep(0.2)
    mine = [await constrained(address, c) for c in (
        api.Constraint(json_object=True), api.Constraint(regex="[0-9]{3}"),
        api.Constraint(json_schema=json.dumps({"type": "object", "properties": {"fresh": {"type": "integer"}}})))]
    f2 = await asyncio.gather(*slow)
    stop.set()
    during_f2 = await by
    after = await constrained(address, api.Constraint(json_object=True))
    cpu_f2 = {k: round(await grammar_cpu(address, f"key-{k}"), 3) for k in ("attacker", "bystander")}
    return {"idle": summary(idle), "f1": {"attacks": f1, "bystander": summary(during_f1), "grammar_cpu_s": cpu_f1},
            "f2": {"attacks": f2, "bystander": summary(during_f2), "bystander_constraints": mine,
                   "json_object_after": after, "grammar_cpu_s": cpu_f2}}


def rows_256(steps: int) -> dict:
    """The matchers' work of one step at 256 rows: the old loop (fill each, accept each) against StepGrammar."""
    import random

    import torch
    import xgrammar as xgr
    from transformers import AutoTokenizer

    from executor_svc.grammar import Key
    from executor_svc.grammar_jobs import GrammarState, Matchers
    from pagedkv.models import resolve_model

    path = resolve_model("smollm2-135m-instruct")
    vocab = json.loads((path / "config.json").read_text())["vocab_size"]
    info = xgr.TokenizerInfo.from_huggingface(AutoTokenizer.from_pretrained(path), vocab_size=vocab)
    schema = {"type": "object", "properties": {"name": {"type": "string"}, "age": {"type": "integer"},
                                               "tags": {"type": "array", "items": {"type": "string"}}},
              "required": ["name", "age", "tags"]}
    compiled = xgr.GrammarCompiler(info, max_threads=1).compile_json_schema(json.dumps(schema), any_whitespace=False)
    words = (vocab + 31) // 32
    rng = random.Random(0)

    def pick(bits: torch.Tensor) -> int:
        allowed = ((bits.view(torch.uint8).unsqueeze(-1) >> torch.arange(8, dtype=torch.uint8)) & 1).view(-1)
        ids = allowed[:vocab].nonzero().view(-1)
        return int(ids[rng.randrange(len(ids))])

    old_ms, new_ms, new_wait_ms = [], [], []
    matchers = [xgr.GrammarMatcher(compiled) for _ in range(256)]
    bitmask = torch.empty(256, words, dtype=torch.int32)

    def fresh() -> GrammarState:
        return GrammarState(Key("t", "json_schema", "", False), compiled, (), words)

    states = [fresh() for _ in range(256)]
    pool = Matchers(threads=THREADS)
    for _ in range(steps):
        for m in matchers:  # (a row that ended starts again: 256 live rows every step)
            if m.is_terminated():
                m.reset()
        t0 = time.perf_counter()
        for j, m in enumerate(matchers):
            m.fill_next_token_bitmask(bitmask, j)
        t1 = time.perf_counter()
        picked = [pick(bitmask[j]) for j in range(256)]
        t2 = time.perf_counter()
        for m, tok in zip(matchers, picked):
            m.accept_token(tok)
        old_ms.append((t1 - t0 + time.perf_counter() - t2) * 1e3)
        states = [fresh() if st.terminated else st for st in states]
        t0 = time.perf_counter()
        step = pool.step()
        step.start(states)
        mask, failed = step.wait()
        new_ms.append((time.perf_counter() - t0) * 1e3)
        new_wait_ms.append(step.wait_s * 1e3)
        assert not failed, failed
        for st, row in zip((states[i] for i in mask.rows), range(len(mask.rows))):
            st.pending.append(pick(mask.bitmask[row]))
    return {"rows": 256, "steps": steps, "old_loop_ms": round(statistics.median(old_ms), 3),
            "jobs_ms": round(statistics.median(new_ms), 3), "jobs_wait_ms": round(statistics.median(new_wait_ms), 3)}


def main() -> None:
    global ATTACK_S  # noqa: PLW0603 -- the one setting the probes share
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--root", type=Path, default=ROOT, help="the checkout whose server runs (default: this one)")
    p.add_argument("--model", default="tiny-llama")
    p.add_argument("--gap", type=float, default=0.5, help="seconds between the bystander's requests")
    p.add_argument("--steps", type=int, default=40, help="steps of the 256-row measurement")
    p.add_argument("--attack-s", type=float, default=60.0, help="an attack still running then is cancelled")
    p.add_argument("--skip-rows", action="store_true", help="no 256-row measurement (an older checkout has no jobs)")
    p.add_argument("--out", type=Path, default=RESULTS / "grammar_attacks.json")
    args, extra = p.parse_known_args()
    extra = [a for a in extra if a != "--"]
    ATTACK_S = args.attack_s
    tenants = Path(RESULTS) / "grammar_attacks_tenants.toml"
    tenants.parent.mkdir(parents=True, exist_ok=True)
    tenants.write_text(TENANTS)
    serve = Serve(args.root.resolve(), "--model", args.model, "--tenants-file", str(tenants), *extra)
    try:
        report = asyncio.run(probes(serve.address, args.gap))
    finally:
        serve.stop()
        tenants.unlink()
    report["rows_256"] = None if args.skip_rows else rows_256(args.steps)
    report.update(root=str(args.root), model=args.model, flags=extra)
    idle = report["idle"]["p50_ms"]
    rows = [["idle", f"{idle}", f"{report['idle']['p90_ms']}", "", ""]]
    for name in ("f1", "f2"):
        r = report[name]
        rows.append([name, f"{r['bystander']['p50_ms']}", f"{r['bystander']['p90_ms']}",
                     f"{r['bystander']['p50_ms'] / idle:.2f}x",
                     "; ".join(f"{a['tokens']} tok, {a['seconds']} s: {a['error'][:60] or 'completed'}"
                               for a in r["attacks"])])
    print_table(["phase", "bystander p50 ms", "p90 ms", "p50 / idle", "attacks"], rows)
    print_table(["bystander constraint during F2", "seconds", "refused"],
                [[n, str(c["seconds"]), c["refused"][:70] or "no"] for n, c in zip(
                    ("json_object", "regex [0-9]{3}", "fresh schema"), report["f2"]["bystander_constraints"])]
                + [["json_object after", str(report["f2"]["json_object_after"]["seconds"]),
                    report["f2"]["json_object_after"]["refused"][:70] or "no"]])
    print_table(["grammar CPU s", "attacker", "bystander"],
                [[k, str(report[k]["grammar_cpu_s"]["attacker"]), str(report[k]["grammar_cpu_s"]["bystander"])]
                 for k in ("f1", "f2")])
    if report["rows_256"]:
        r = report["rows_256"]
        print_table(["256 rows, one step", "ms"], [["old loop (fill + accept, on the step)", str(r["old_loop_ms"])],
                                                   ["jobs on the matcher threads (start + wait)", str(r["jobs_ms"])]])
    write_report(args.out, report)


if __name__ == "__main__":
    main()
