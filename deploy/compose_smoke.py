"""The client side of deploy/compose-smoke.sh: streams and probes against the compose stack from the host, over its
published loopback ports and its CA (gRPC to the scheduler on 127.0.0.1:50051, HTTPS to the gateway on :8000).

Subcommands (each prints one JSON line, and exits 1 when the check fails):
  chat       one chat completion through the gateway with the ``openai`` SDK
  executors  the scheduler's executors (ModelInfo): address, state, requests placed and running
  streams    N greedy streams (gRPC, or half of them through the gateway's SSE), each to exactly --max-tokens
             tokens (--grpc-max-tokens for the gRPC ones: longer, so that they outlast the gateway's); once every
             stream has its first tokens, writes --ready-file (the executors holding them) so the script can disturb
             the stack (kill, stop, scale); --reference first runs the same requests undisturbed and checks that the
             disturbed ones gave the same token ids.
"""

from __future__ import annotations

import argparse
import asyncio
import json
import ssl
import sys
import time
from pathlib import Path

SCHEDULER = "127.0.0.1:50051"
GATEWAY = "https://127.0.0.1:8000/v1"
PROMPTS = ["The history of the printing press", "How do bees make honey?", "Write a short story about a lighthouse",
           "Explain how a compiler works", "The rules of chess, briefly", "Describe a walk in the mountains",
           "What is a prime number?", "A recipe for bread"]


def _client(ca: str):
    from pagedkv.client import Client

    return Client(SCHEDULER, tls_ca=ca, resume=None)  # no resume: what the server delivered, as it delivered it


def _openai(ca: str):
    import openai

    http = openai.DefaultHttpxClient(verify=ssl.create_default_context(cafile=ca))
    return openai.OpenAI(base_url=GATEWAY, api_key="none", http_client=http, max_retries=0, timeout=600)


def chat(args: argparse.Namespace) -> int:
    client = _openai(args.ca)
    model = client.models.list().data[0].id
    r = client.chat.completions.create(model=model, max_tokens=24, temperature=0,
                                       messages=[{"role": "user", "content": "What is the capital of France?"}])
    text = r.choices[0].message.content or ""
    print(json.dumps({"model": model, "text": text, "completion_tokens": r.usage.completion_tokens}))
    return 0 if text.strip() and r.usage.completion_tokens > 0 else 1


async def _executors(ca: str) -> list[dict]:
    async with _client(ca) as client:
        info = await client.model_info()
    return [{"address": e.address, "state": e.state, "placed": e.num_placed, "running": e.num_running}
            for e in info.executors]


def executors(args: argparse.Namespace) -> int:
    print(json.dumps(asyncio.run(_executors(args.ca))))
    return 0


async def _grpc_stream(client, prompt: str, max_tokens: int, started: asyncio.Event) -> dict:
    ids: list[int] = []
    finish = None
    async for msg in client.generate(prompt, max_tokens=max_tokens, temperature=0.0, ignore_eos=True):
        ids.extend(msg.token_ids)
        if ids:
            started.set()
        if msg.finish_reason:
            finish = msg.finish_reason
    from pagedkv.client import FINISH_NAMES

    return {"via": "grpc", "token_ids": ids, "finish": FINISH_NAMES.get(finish) if finish else None}


async def _sse_stream(ca: str, prompt: str, max_tokens: int, started: asyncio.Event) -> dict:
    import openai

    http = openai.DefaultAsyncHttpxClient(verify=ssl.create_default_context(cafile=ca))
    async with openai.AsyncOpenAI(base_url=GATEWAY, api_key="none", http_client=http, max_retries=0,
                                  timeout=600) as client:
        model = (await client.models.list()).data[0].id
        stream = await client.completions.create(model=model, prompt=prompt, max_tokens=max_tokens, temperature=0,
                                                 stream=True, stream_options={"include_usage": True},
                                                 extra_body={"ignore_eos": True})
        text, finish, tokens = "", None, 0
        async for chunk in stream:
            for choice in chunk.choices:
                text += choice.text
                finish = choice.finish_reason or finish
                if text:
                    started.set()
            if chunk.usage:
                tokens = chunk.usage.completion_tokens
    return {"via": "gateway", "text": text, "completion_tokens": tokens, "finish": finish}


async def _streams(args: argparse.Namespace) -> tuple[bool, dict]:
    prompts = PROMPTS[:args.count]
    gateway = set(range(args.count // 2)) if args.via == "both" else set()
    grpc_tokens = args.grpc_max_tokens or args.max_tokens
    wanted = [args.max_tokens if i in gateway else grpc_tokens for i in range(len(prompts))]
    reference = None
    async with _client(args.ca) as client:
        if args.reference:  # the same requests, undisturbed, one at a time
            reference = [await _grpc_stream(client, p, n, asyncio.Event()) for p, n in zip(prompts, wanted)]
        started = [asyncio.Event() for _ in prompts]
        t0 = time.monotonic()
        tasks = [asyncio.ensure_future(_sse_stream(args.ca, p, n, s) if i in gateway else _grpc_stream(client, p, n, s))
                 for i, (p, n, s) in enumerate(zip(prompts, wanted, started))]
        waits = asyncio.gather(*(s.wait() for s in started))
        done, _ = await asyncio.wait([waits, *tasks], timeout=300, return_when=asyncio.FIRST_COMPLETED)
        if waits in done:
            running = [e for e in await _executors(args.ca) if e["running"] > 0]
            if args.ready_file:
                Path(args.ready_file).write_text(json.dumps(running) + "\n")
        else:
            waits.cancel()
        results = await asyncio.gather(*tasks, return_exceptions=True)
        seconds = time.monotonic() - t0
    out: list[dict] = []
    ok = True
    for i, r in enumerate(results):
        if isinstance(r, BaseException):
            out.append({"error": f"{type(r).__name__}: {getattr(r, 'details', lambda: '')() or r}"})
            ok = False
            continue
        n = len(r["token_ids"]) if "token_ids" in r else r["completion_tokens"]
        good = r["finish"] == "length" and n == wanted[i]
        if reference is not None:
            good = good and r["token_ids"] == reference[i]["token_ids"]
        ok = ok and good
        out.append({"via": r["via"], "tokens": n, "finish": r["finish"], "ok": good,
                    **({"same_as_undisturbed": r["token_ids"] == reference[i]["token_ids"]} if reference else {})})
    return ok, {"streams": out, "seconds": round(seconds, 1)}


def streams(args: argparse.Namespace) -> int:
    """Prints the JSON summary, then one line for the table."""
    ok, summary = asyncio.run(_streams(args))
    print(json.dumps(summary))
    results = summary["streams"]
    whole = sum(bool(r.get("ok")) for r in results)
    grpc_tokens = args.grpc_max_tokens or args.max_tokens
    lengths = f"{grpc_tokens}"
    if args.via == "both" and grpc_tokens != args.max_tokens:
        lengths = f"{args.max_tokens} (gateway) and {grpc_tokens} (gRPC)"
    line = f"{whole}/{len(results)} streams of {lengths} tokens complete in {summary['seconds']} s"
    if args.via == "both":
        line += f" ({sum(r.get('via') == 'gateway' for r in results)} via the gateway)"
    if args.reference:
        line += f", identical to the undisturbed run: {sum(bool(r.get('same_as_undisturbed')) for r in results)}"
    errors = [r["error"] for r in results if "error" in r]
    print(line + (f"; first error: {errors[0][:80]}" if errors else ""))
    return 0 if ok else 1


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--ca", required=True, help="the stack's CA certificate (from the certs volume)")
    sub = p.add_subparsers(dest="command", required=True)
    sub.add_parser("chat")
    sub.add_parser("executors")
    s = sub.add_parser("streams")
    s.add_argument("--count", type=int, default=1, choices=range(1, len(PROMPTS) + 1), metavar="N")
    s.add_argument("--max-tokens", type=int, default=64)
    s.add_argument("--grpc-max-tokens", type=int, default=0, help="the gRPC streams' length [--max-tokens]")
    s.add_argument("--via", choices=["grpc", "both"], default="grpc",
                   help="both: the first half of the streams through the gateway (SSE), the rest gRPC")
    s.add_argument("--ready-file", default="", help="written once every stream has its first tokens")
    s.add_argument("--reference", action="store_true",
                   help="run each request undisturbed first; the streams must give the same token ids (gRPC only)")
    args = p.parse_args(argv)
    if args.command == "streams" and args.reference and args.via != "grpc":
        p.error("--reference compares token ids: gRPC streams only")
    return {"chat": chat, "executors": executors, "streams": streams}[args.command](args)


if __name__ == "__main__":
    sys.exit(main())
