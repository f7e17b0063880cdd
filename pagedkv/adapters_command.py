"""``pagedkv adapters``: the LoRA adapters of a running scheduler, over gRPC with the caller's API key (its tenant
owns what it loads: at most its ``max_adapters`` in the tenants file):

  pagedkv adapters list                        ModelInfo's adapters: those this key's tenant may use
  pagedkv adapters load NAME PATH [--public]   LoadAdapter: prints the AdapterInfo
  pagedkv adapters unload NAME                 UnloadAdapter

Each adapter is printed as one line of api.proto's AdapterInfo fields, ``name=sql rank=16 ...`` (an empty owner:
``owner=(public)``)."""

from __future__ import annotations

import argparse
import os
import sys
from collections.abc import Callable

from pagedkv.api.v1 import api_pb2 as api

ACTIONS = ("list", "load", "unload")
RPC_TIMEOUT_S = {"list": 10.0, "load": 300.0, "unload": 30.0}  # (a load reads the adapter on every executor)


def add_args(p: argparse.ArgumentParser) -> None:
    from pagedkv.security import add_tls_client_args

    p.add_argument("action", choices=ACTIONS, metavar="{list,load,unload}",
                   help="list the adapters this key's tenant may use, load one at run time, or unload one it loaded")
    p.add_argument("name", nargs="?", default="", metavar="NAME",
                   help="load, unload: the adapter's name (1 to 64 characters of A-Z a-z 0-9 . _ -; requests select "
                   "it by it)")
    p.add_argument("path", nargs="?", default="", metavar="PATH",
                   help="load: the PEFT adapter directory, relative to the executors' --lora-root (or absolute, "
                   "inside it)")
    p.add_argument("--public", action="store_true",
                   help="load: a public adapter, which every tenant whose adapters list allows it may use (an admin "
                   "tenant's key only; default: the caller's tenant's own)")
    p.add_argument("--address", default=os.environ.get("PAGEDKV_ADDRESS", "127.0.0.1:50051"),
                   help="scheduler HOST:PORT")
    p.add_argument("--api-key", default=os.environ.get("PAGEDKV_API_KEY", ""),
                   help="the server's API key: its --api-key, or a tenant's key from its tenants file (default: "
                   "$PAGEDKV_API_KEY)")
    add_tls_client_args(p)


def usage_error(args) -> str:
    """Why these arguments are no call ('' when they are one)."""
    wanted = {"list": 0, "load": 2, "unload": 1}[args.action]
    given = sum(1 for v in (args.name, args.path) if v)
    if given != wanted or (wanted == 1 and args.path):
        return {"list": "list takes no NAME or PATH", "load": "load takes NAME and PATH",
                "unload": "unload takes NAME only"}[args.action]
    if args.public and args.action != "load":
        return "--public goes with load"
    return ""


def adapter_line(a: api.AdapterInfo) -> str:
    return (f"name={a.name} rank={a.rank} num_bytes={a.num_bytes} num_pages={a.num_pages} "
            f"owner={a.owner or '(public)'} resident={a.resident} num_page_ins={a.num_page_ins}")


async def call(client, args) -> list[str]:
    """The action's call on ``client`` (a pagedkv.client.Client): the lines it prints."""
    timeout = RPC_TIMEOUT_S[args.action]
    if args.action == "load":
        return [adapter_line(await client.load_adapter(args.name, args.path, args.public, timeout=timeout))]
    if args.action == "unload":
        await client.unload_adapter(args.name, timeout=timeout)
        return [f"unloaded {args.name}"]
    return [adapter_line(a) for a in (await client.model_info(timeout=timeout)).adapters]


def _connect(args):
    from pagedkv.client import Client
    from pagedkv.port_check import unreachable

    if why := unreachable(args.address):
        raise ConnectionError(f"no server at {args.address} ({why}); start one with `pagedkv serve`, or pass "
                              "--address HOST:PORT")
    return Client(args.address, api_key=args.api_key, tls_ca=args.tls_ca, tls_server_name=args.tls_server_name,
                  resume=None)


async def run(args, connect: Callable = _connect) -> int:
    """``pagedkv adapters``: 0 when the call succeeded, 1 when the server refused it or is not there, 2 for a
    command line that is no call. ``connect``: args -> a Client (an async context manager)."""
    import grpc

    if why := usage_error(args):
        print(f"error: pagedkv adapters {args.action}: {why}", file=sys.stderr)
        return 2
    try:
        async with connect(args) as client:
            lines = await call(client, args)
    except (ConnectionError, ValueError) as err:  # no server; an unreadable --tls-ca, a bad --address
        print(f"error: {err}", file=sys.stderr, flush=True)
        return 1
    except grpc.aio.AioRpcError as err:
        print(f"error: {err.code().name}: {err.details()}", file=sys.stderr)
        return 1
    for line in lines:
        print(line)
    if not lines:
        print("no LoRA adapters that this key's tenant may use", file=sys.stderr)
    return 0
