"""TTFT of turn N of a 10-turn stored conversation with its KV retained against without, on an idle server and under
background churn (#48 point 3). One ``pagedkv serve`` (the built-in SmolLM2, a small page pool) and two ``pagedkv
gateway``s in front of its scheduler: one with ``--responses-kv-ttl 600`` (each stored turn asks the scheduler to
retain its KV: GenerateRequest.retain_kv) and one with ``--responses-kv-ttl 0`` (the pages go back to the prefix
cache's free list). Each arm runs the same conversation through ``POST /v1/responses`` with the ``openai`` SDK
(streamed, greedy, each turn naming the previous by ``previous_response_id``), the arms' turns interleaved, each arm
as a tenant of its own (so the prompts are byte for byte the same, and so are the greedy answers, yet neither arm
hits the other's pages: a different prompt changes when the first text arrives by tens of ms). Two
phases, each with conversations of its own (its own instructions): ``idle`` (nothing else runs) and ``churn`` (a
background thread, a third tenant, sends prompts of random token ids nobody repeats through /v1/completions,
enough to cycle the free pages many times over between two turns). TTFT: from sending a turn to its first
``response.output_text.delta``; ``cached``: the answer's usage.input_tokens_details.cached_tokens.
(bench/responses_turns.py is the sibling that cycles the pool between turns, with nothing running beside a turn.)

    python bench/responses_kv.py            # -> bench/results/responses_kv.json
    python bench/responses_kv.py --quick    # 4 turns
"""

from __future__ import annotations

import argparse
import dataclasses
import random
import statistics
import tempfile
import threading
import time
from pathlib import Path

import httpx
import openai
from common import RESULTS, Machine, print_table, wait_idle, write_report
from responses_turns import MODEL, QUESTIONS, turn

from pagedkv.local_server import LocalServer, ServiceProcess
from pagedkv.tenancy import hash_key

INSTRUCTIONS = ("Session {phase}. You are a patient geography tutor. Answer each question in two or three sentences, "
                "naming the country, its capital and one river or mountain range, and nothing else.")


class Churn(threading.Thread):
    """Prompts of ``tokens`` random token ids, one after another until stopped: each takes free pages, evicting the
    least recently freed (a turn's, when it was not retained)."""

    def __init__(self, base: str, tokens: int, seed: int, cycle: int) -> None:
        super().__init__(daemon=True)
        self.base, self.tokens, self.rng = base, tokens, random.Random(seed)
        self.cycle = cycle  # prompts that take as many pages as the pool has
        self.stopping = threading.Event()
        self.sent = 0

    def run(self) -> None:
        with httpx.Client(timeout=300, headers={"Authorization": "Bearer key-churn"}) as http:
            while not self.stopping.is_set():
                prompt = [self.rng.randrange(100, 49000) for _ in range(self.tokens)]
                r = http.post(f"{self.base}/completions", json={"model": MODEL, "prompt": prompt, "max_tokens": 1})
                r.raise_for_status()
                self.sent += 1


def conversation(arms: dict, phase: str, turns: int, max_tokens: int, churn: Churn | None) -> dict[str, list]:
    rows, previous = {name: [] for name in arms}, dict.fromkeys(arms)
    for n in range(turns):
        for name, client in arms.items():
            question = QUESTIONS[n % len(QUESTIONS)]
            sent_before = churn.sent if churn is not None else 0
            row = turn(client, INSTRUCTIONS.format(phase=phase), question, previous[name], max_tokens)
            row["churn_prompts_during"] = (churn.sent - sent_before) if churn is not None else 0
            rows[name].append(row)
            previous[name] = row["id"]
        if churn is not None:  # at least enough churn between two turns to cycle the free pages
            target = churn.sent + churn.cycle
            while churn.sent < target and churn.is_alive():
                time.sleep(0.05)
    return rows


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--turns", type=int, default=10)
    p.add_argument("--num-pages", type=int, default=256, help="the executor's KV pages (16 tokens each)")
    p.add_argument("--churn-tokens", type=int, default=480, help="tokens of each background prompt")
    p.add_argument("--max-output-tokens", type=int, default=24)
    p.add_argument("--ttl", type=int, default=600, help="the retaining arm's --responses-kv-ttl")
    p.add_argument("--wait-idle", type=float, default=60.0, help="seconds to wait for a quiet machine first")
    p.add_argument("--phases", default="idle,churn", help="which phases to run, in order")
    p.add_argument("--not-retained-first", action="store_true", help="each turn: the arm without retention first")
    p.add_argument("--quick", action="store_true")
    p.add_argument("--out", default=str(RESULTS / "responses_kv.json"))
    args = p.parse_args()
    if args.quick:
        args.turns = 4
    waited = wait_idle(args.wait_idle)
    tenants = Path(tempfile.mkdtemp()) / "tenants.toml"
    tenants.write_text("".join(f'[tenants.{t}]\nkeys = ["{hash_key("key-" + t)}"]\n'
                               for t in ("with", "without", "churn")))
    server = LocalServer("--model", MODEL, "--max-model-len", "2048", "--num-pages", str(args.num_pages),
                         "--tenants-file", str(tenants))
    gateways, arms, results = [], {}, {}
    try:
        order = (("retained", args.ttl), ("not retained", 0))
        for name, ttl in order[::-1] if args.not_retained_first else order:
            gw = ServiceProcess("gateway", "--address", server.address, "--responses-dir", "memory",
                                "--responses-kv-ttl", str(ttl))
            gateways.append(gw)
            key = "key-with" if name == "retained" else "key-without"
            arms[name] = openai.OpenAI(base_url=f"http://127.0.0.1:{gw.port}/v1", api_key=key, max_retries=0)
        for client in arms.values():  # (warm: the gateways' first requests, the template, the kernels)
            client.responses.create(model=MODEL, input="Hi.", store=False, max_output_tokens=4, temperature=0.0)
        for phase in args.phases.split(","):
            churn = None
            if phase == "churn":
                churn = Churn(f"http://127.0.0.1:{gateways[0].port}/v1", args.churn_tokens, 7,
                              -(-args.num_pages * 16 // args.churn_tokens) + 1)
                churn.start()
            try:
                results[phase] = conversation(arms, phase, args.turns, args.max_output_tokens, churn)
            finally:
                if churn is not None:
                    churn.stopping.set()
                    churn.join(timeout=120)
    finally:
        for gw in gateways:
            gw.stop()
        server.stop()
    summary = {}
    for phase, rows in results.items():
        table = []
        for n in range(args.turns):
            a, b = rows["retained"][n], rows["not retained"][n]
            table.append([str(n + 1), str(a["input_tokens"]), f"{a['ttft_s'] * 1e3:.0f}", f"{b['ttft_s'] * 1e3:.0f}",
                          str(a["cached_tokens"]), str(b["cached_tokens"]), f"{b['ttft_s'] / a['ttft_s']:.2f}"])
        print(f"\n{phase}:")
        print_table(["turn", "prompt tok", "TTFT ms with", "TTFT ms without", "cached with", "cached without",
                     "without/with"], table)
        later = range(1, args.turns)
        summary[phase] = {name: statistics.median(rows[name][n]["ttft_s"] for n in later) for name in rows}
        print(f"median TTFT of turns 2..{args.turns}: "
              + ", ".join(f"{k} {v * 1e3:.0f} ms" for k, v in summary[phase].items()))
    write_report(args.out, {"bench": "responses_kv", "model": MODEL, "machine": dataclasses.asdict(Machine()),
                            "waited_for_idle_s": waited, "args": vars(args), "phases": results,
                            "median_ttft_s_turns_2_on": summary})


if __name__ == "__main__":
    main()
