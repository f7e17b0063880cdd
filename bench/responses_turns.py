"""TTFT of turn N of a stored conversation, with its KV retained against without (#48): one ``pagedkv serve`` (the
built-in SmolLM2, a small page pool) and two ``pagedkv gateway``s in front of its scheduler, one with
``--responses-kv-ttl 600`` (each stored turn asks the scheduler to retain its KV) and one with ``--responses-kv-ttl
0`` (the pages go back to the prefix cache's free list, as any request's). Each arm runs its own ``--turns``-turn
conversation through ``POST /v1/responses`` (streamed, greedy, each turn naming the previous by
``previous_response_id``), the arms' turns interleaved; after every turn ``--pressure`` token-id prompts nobody
repeats go through /v1/completions, enough to cycle the free pages, as other tenants' traffic would. TTFT is the
time from sending the turn to its first ``response.output_text.delta``; the answer's ``cached_tokens`` says how
much of the prompt the cache served.

    python bench/responses_turns.py            # -> bench/results/responses_turns.json
    python bench/responses_turns.py --quick    # 4 turns, a smaller pool
"""

from __future__ import annotations

import argparse
import dataclasses
import random
import statistics
import time

import httpx
import openai
from common import RESULTS, Machine, print_table, wait_idle, write_report

from pagedkv.local_server import LocalServer, ServiceProcess

MODEL = "smollm2-135m-instruct"
INSTRUCTIONS = ("You are a patient geography tutor. Answer each question in two or three sentences, naming the "
                "country, its capital and one river or mountain range, and nothing else.")
QUESTIONS = ["Tell me about France.", "And Italy?", "What about Spain?", "Now Portugal.", "And Germany?",
             "What about Austria?", "Tell me about Poland.", "And Norway?", "What about Greece?", "And Egypt?",
             "Tell me about Peru.", "And Japan?"]


def pressure(base: str, rng: random.Random, count: int, tokens: int) -> None:
    """``count`` prompts of ``tokens`` random token ids (none repeats a page): they take free pages, evicting the
    least recently freed (a turn's, when it was not retained)."""
    with httpx.Client(timeout=300) as http:
        for _ in range(count):
            prompt = [rng.randrange(100, 49000) for _ in range(tokens)]
            r = http.post(f"{base}/completions", json={"model": MODEL, "prompt": prompt, "max_tokens": 1})
            r.raise_for_status()


def turn(client: openai.OpenAI, instructions: str, question: str, previous: str | None, max_tokens: int) -> dict:
    """One streamed /v1/responses turn: its TTFT (first text delta) and usage (bench/responses_kv.py's too)."""
    sent = time.perf_counter()
    ttft, final = None, None
    extra = {"previous_response_id": previous} if previous else {}
    for event in client.responses.create(model=MODEL, instructions=instructions, input=question, stream=True,
                                         temperature=0.0, max_output_tokens=max_tokens, **extra):
        if event.type == "response.output_text.delta" and ttft is None:
            ttft = time.perf_counter() - sent
        if event.type in ("response.completed", "response.incomplete"):
            final = event.response
    assert final is not None and ttft is not None
    usage = final.usage
    return {"id": final.id, "ttft_s": ttft, "input_tokens": usage.input_tokens,
            "cached_tokens": usage.input_tokens_details.cached_tokens, "output_tokens": usage.output_tokens}


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--turns", type=int, default=10)
    p.add_argument("--num-pages", type=int, default=256, help="the executor's KV pages (16 tokens each)")
    p.add_argument("--pressure", type=int, default=0, help="prompts after each turn (0: enough to cycle the pool)")
    p.add_argument("--pressure-tokens", type=int, default=480)
    p.add_argument("--max-output-tokens", type=int, default=48)
    p.add_argument("--ttl", type=int, default=600, help="the retaining arm's --responses-kv-ttl")
    p.add_argument("--quick", action="store_true")
    p.add_argument("--out", default=str(RESULTS / "responses_turns.json"))
    args = p.parse_args()
    if args.quick:
        args.turns, args.num_pages = 4, 160
    count = args.pressure or -(-args.num_pages * 16 // args.pressure_tokens) + 1
    waited = wait_idle(60)
    server = LocalServer("--model", MODEL, "--max-model-len", "2048", "--num-pages", str(args.num_pages))
    arms = {}
    try:
        for name, ttl in (("retained", args.ttl), ("not retained", 0)):
            gw = ServiceProcess("gateway", "--address", server.address, "--responses-dir", "memory",
                                "--responses-kv-ttl", str(ttl))
            arms[name] = (gw, openai.OpenAI(base_url=f"http://127.0.0.1:{gw.port}/v1", api_key="x", max_retries=0))
        for _, client in arms.values():  # (warm: the gateways' first requests, the template, the kernels)
            client.responses.create(model=MODEL, input="Hi.", store=False, max_output_tokens=4, temperature=0.0)
        rng, rows, previous = random.Random(7), {name: [] for name in arms}, dict.fromkeys(arms)
        base = f"http://127.0.0.1:{arms['retained'][0].port}/v1"
        for n in range(args.turns):
            for name, (_, client) in arms.items():
                question = QUESTIONS[n % len(QUESTIONS)] + ("" if name == "retained" else " ")  # (own prefixes)
                rows[name].append(turn(client, INSTRUCTIONS, question, previous[name], args.max_output_tokens))
                previous[name] = rows[name][-1]["id"]
                pressure(base, rng, count, args.pressure_tokens)
    finally:
        for gw, _ in arms.values():
            gw.stop()
        server.stop()
    table = []
    for n in range(args.turns):
        a, b = rows["retained"][n], rows["not retained"][n]
        table.append([str(n + 1), str(a["input_tokens"]), f"{a['ttft_s'] * 1e3:.0f}", str(a["cached_tokens"]),
                      f"{b['ttft_s'] * 1e3:.0f}", str(b["cached_tokens"]), f"{b['ttft_s'] / a['ttft_s']:.2f}"])
    print_table(["turn", "prompt tok", "TTFT ms retained", "cached", "TTFT ms not", "cached", "not/retained"], table)
    later = range(1, args.turns)
    summary = {name: statistics.median(rows[name][n]["ttft_s"] for n in later) for name in rows} if later else {}
    print(f"median TTFT of turns 2..{args.turns}: " + ", ".join(f"{k} {v * 1e3:.0f} ms" for k, v in summary.items()))
    write_report(args.out, {"bench": "responses_turns", "machine": dataclasses.asdict(Machine()),
                            "waited_for_idle_s": waited,
                            "args": vars(args), "pressure_prompts_per_turn": count, "turns": rows,
                            "median_ttft_s_turns_2_on": summary})


if __name__ == "__main__":
    main()
