"""How long ``pagedkv serve`` takes to serve again after its executor is SIGKILLed (issue 46, F9: the client's resume
window, ResumePolicy.window_s, must outlast it).

One ``pagedkv serve`` (tiny-llama unless ``--model``, ``--threads 1``); ``--kills`` (3) times in a row: a one-token
request, then ``kill -9`` of the executor, and from 0.5 s later (the scheduler has seen the death) one-token requests
(each with resuming off) until one completes. The time from the kill to that completion is the restart as a new
request sees it: the supervisor's backoff (1 s, doubling while the executor keeps dying within a minute, up to 30 s) +
the executor's start + the scheduler's reconnect. Meanwhile requests are refused UNAVAILABLE "no executor is up"
(counted; one the scheduler got before it saw the death would be held instead, up to --unplaced-timeout).

    python bench/executor_restart.py [--kills 3] [--model PATH]
"""

from __future__ import annotations

import argparse
import asyncio
import os
import signal
import sys
import time
from pathlib import Path

import grpc

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))

from pagedkv.client import Client  # noqa: E402
from pagedkv.local_server import LocalServer  # noqa: E402


def executor_pid(server: LocalServer) -> int | None:
    for pid in server.child_pids():
        try:
            argv = Path(f"/proc/{pid}/cmdline").read_bytes().split(b"\0")
        except OSError:
            continue
        if b"executor" in argv:
            return pid
    return None


async def one_token(address: str) -> None:
    async with Client(address, resume=None) as client:
        await client.complete("hi", max_tokens=1, temperature=0)


def restart_seconds(server: LocalServer) -> tuple[float, int]:
    """(seconds from the kill until a request completes, refusals meanwhile)."""
    asyncio.run(one_token(server.address))
    pid = executor_pid(server)
    assert pid is not None, server.log()
    killed = time.monotonic()
    os.kill(pid, signal.SIGKILL)
    time.sleep(0.5)
    refused = 0
    while True:
        try:
            asyncio.run(one_token(server.address))
            return time.monotonic() - killed, refused
        except grpc.aio.AioRpcError as err:
            if err.code() != grpc.StatusCode.UNAVAILABLE:
                raise
            refused += 1
            time.sleep(0.05)


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--kills", type=int, default=3)
    p.add_argument("--model", default="")
    args = p.parse_args()
    server = LocalServer("--num-pages", "256", "--threads", "1", *(["--model", args.model] if args.model else []),
                         timeout=600)
    try:
        print("| kill | serving again after (s) | requests refused meanwhile |\n|---|---|---|")
        for k in range(1, args.kills + 1):
            seconds, refused = restart_seconds(server)
            print(f"| {k} | {seconds:.2f} | {refused} |", flush=True)
    finally:
        server.stop()


if __name__ == "__main__":
    main()
