"""The ``pagedkv`` command: serve | scheduler | executor | gateway | dynamo-worker | generate | adapters | bench |
hash-key | health | gen-certs: the parser of every subcommand, and each run (serve's in ``pagedkv.serve_command``)."""

from __future__ import annotations

import argparse
import asyncio
import os
import socket
import sys

from pagedkv.serve_command import SERVE_DESCRIPTION, serve


def free_port(host: str = "127.0.0.1", avoid=()) -> int:
    """A port free on ``host`` now, none of ``avoid`` (ports chosen for others that may not be bound yet)."""
    while True:
        with socket.socket() as s:
            s.bind((host, 0))
            port = s.getsockname()[1]
        if port not in avoid:
            return port


def _run_async(coro) -> None:
    import uvloop

    uvloop.run(coro)


# ---- generate ----------------------------------------------------------------------------------
async def _generate(args) -> int:
    import grpc

    from pagedkv.client import Client
    from pagedkv.port_check import unreachable
    from pagedkv.resume_policy import resume_policy

    if why := unreachable(args.address):  # at once, not after the resume policy's wait for a server
        print(f"error: no server at {args.address} ({why}); start one with `pagedkv serve`, or pass --address "
              "HOST:PORT", file=sys.stderr, flush=True)
        return 1
    async with Client(args.address, api_key=args.api_key, tls_ca=args.tls_ca,
                      tls_server_name=args.tls_server_name, resume=resume_policy(args)) as client:
        try:
            if args.system and not args.chat:
                print("error: --system needs --chat", file=sys.stderr)
                return 2
            messages = [("system", args.system)] if args.system else []
            prompt = dict(messages=[*messages, ("user", args.prompt)]) if args.chat else dict(prompt=args.prompt)
            async for msg in client.generate(
                **prompt, max_tokens=args.max_tokens, temperature=args.temperature, top_p=args.top_p,
                top_k=args.top_k, seed=args.seed, stop=args.stop or [], ignore_eos=args.ignore_eos,
                adapter=args.adapter,
            ):
                sys.stdout.write(msg.text)
                sys.stdout.flush()
                if msg.finish_reason:
                    u = msg.usage
                    sys.stdout.write("\n")
                    sys.stdout.flush()
                    print(f"[finish={_finish_name(msg.finish_reason)} "
                          f"prompt_tokens={u.prompt_tokens} completion_tokens={u.completion_tokens}]",
                          file=sys.stderr)
        except grpc.aio.AioRpcError as err:
            print(f"\nerror: {err.code().name}: {err.details()}", file=sys.stderr)
            return 1
    return 0


def health(args) -> int:
    """Exit 0 when the server at --address answers SERVING, or with --http when GET URL answers 200 (the
    gateway's /health), for container health checks."""
    if args.http:
        from pagedkv.gateway.cli import check_http

        ok, said = check_http(args.http, args.tls_ca, args.tls_server_name, args.timeout)
        print(said, file=sys.stdout if ok else sys.stderr)
        return 0 if ok else 1
    import grpc
    from grpc_health.v1 import health_pb2, health_pb2_grpc

    from pagedkv.security import channel_credentials, server_name_options

    if args.tls_ca:
        channel = grpc.secure_channel(args.address, channel_credentials(args.tls_ca),
                                      options=server_name_options(args.tls_server_name))
    else:
        channel = grpc.insecure_channel(args.address)
    with channel:
        try:
            r = health_pb2_grpc.HealthStub(channel).Check(health_pb2.HealthCheckRequest(), timeout=args.timeout)
        except grpc.RpcError as err:
            print(f"{args.address}: {err.code().name}: {err.details()}", file=sys.stderr)
            return 1
    status = health_pb2.HealthCheckResponse.ServingStatus.Name(r.status)
    print(f"{args.address}: {status}")
    return 0 if r.status == health_pb2.HealthCheckResponse.SERVING else 1


def _finish_name(value: int) -> str:
    from pagedkv.client import FINISH_NAMES

    return FINISH_NAMES.get(value) or str(value)


def _dynamo_worker(args) -> int:
    from pagedkv import logs

    json_logs = logs.wants_json(args.log_format)
    if json_logs or (json_logs is None and not sys.stderr.isatty()):
        os.environ.setdefault("DYN_LOGGING_JSONL", "1")  # Dynamo's own lines as JSON too (read at its import)
    try:
        from pagedkv.dynamo_worker import main as dynamo_worker
    except ImportError as err:
        print(f"error: pagedkv dynamo-worker needs NVIDIA Dynamo (pagedkv[dynamo]: make install-dynamo): {err}",
              file=sys.stderr, flush=True)
        return 1
    try:
        return dynamo_worker(args)
    except (ValueError, OSError) as err:  # a bad --model, an unreadable secret file, a scheduler that never served
        print(f"error: {err}", file=sys.stderr, flush=True)
        return 1


# ---- main --------------------------------------------------------------------------------------
def build_parser() -> argparse.ArgumentParser:
    from executor_svc import args as executor_args
    from pagedkv import dynamo_args
    from pagedkv.resume_policy import add_resume_args
    from pagedkv.security import add_tls_client_args
    from pagedkv.serve_args import add_args as add_serve_args
    from scheduler_svc import args as scheduler_args

    parser = argparse.ArgumentParser(prog="pagedkv", description="LLM serving with PagedAttention over gRPC")
    sub = parser.add_subparsers(dest="command", required=True)
    p = sub.add_parser("serve", help="start one scheduler and one executor serving a model on this machine",
                       description=SERVE_DESCRIPTION)
    p.set_defaults(forwarded=add_serve_args(p))
    from pagedkv.gateway.cli import add_serve_args as add_gateway_serve_args

    add_gateway_serve_args(p)  # --http-port
    p = sub.add_parser("scheduler", help="run the scheduler service alone (public API, KV page owner)")
    scheduler_args.add_args(p)
    p = sub.add_parser("executor", help="run the executor service alone (model + page pools)")
    executor_args.add_args(p)
    p = sub.add_parser("generate", help="stream one completion from a running server to stdout")
    p.add_argument("prompt")
    p.add_argument("--address", default=os.environ.get("PAGEDKV_ADDRESS", "127.0.0.1:50051"),
                   help="scheduler HOST:PORT; several comma-separated, or dns:///NAME:PORT, for round robin")
    p.add_argument("--max-tokens", type=int, default=64)
    p.add_argument("--temperature", type=float, default=None,
                   help="0: greedy (default: the model's: its generation_config.json temperature, else 1, sampled, "
                   "as OpenAI and vLLM; ModelInfo's sampling_defaults shows it)")
    p.add_argument("--top-p", type=float, default=None,
                   help="default: the model's (its generation_config.json, else 1)")
    p.add_argument("--top-k", type=int, default=None,
                   help="default: the model's (its generation_config.json, else 0: no top-k filter)")
    p.add_argument("--chat", action="store_true",
                   help="send the prompt as a user message through the model's chat template")
    p.add_argument("--system", default="", help="with --chat: a system message before the prompt")
    p.add_argument("--seed", type=int, default=None,
                   help="sampling seed, for repeatable sampled output (default: none: a fresh draw each time)")
    p.add_argument("--stop", action="append", help="stop string (repeatable; default: none)")
    p.add_argument("--ignore-eos", action="store_true")
    p.add_argument("--adapter", default="", metavar="NAME",
                   help="the LoRA adapter that generates (one the server's --lora-modules loaded; ModelInfo lists "
                   "those your tenant may use); default: the base model")
    p.add_argument("--api-key", default=os.environ.get("PAGEDKV_API_KEY", ""),
                   help="the server's API key: its --api-key, or a tenant's key from its tenants file (default: "
                   "$PAGEDKV_API_KEY)")
    add_resume_args(p)
    add_tls_client_args(p)
    p = sub.add_parser("adapters", help="list, load or unload LoRA adapters on a running server (its tenant's own, "
                       "loaded at run time)")
    from pagedkv.adapters_command import add_args as add_adapters_args

    add_adapters_args(p)
    p = sub.add_parser("bench", help="load generator: synthetic requests against a running server, latency and "
                       "throughput report")
    from pagedkv.loadgen.command import add_args as add_bench_args

    add_bench_args(p)
    p = sub.add_parser("hash-key", help="print the sha256:<hex> form of an API key for a tenants file")
    p.add_argument("key")
    p = sub.add_parser("health", help="check a server's grpc health (exit 0 when SERVING), or a gateway's /health")
    p.add_argument("--address", default=os.environ.get("PAGEDKV_ADDRESS", "127.0.0.1:50051"))
    p.add_argument("--http", default="", metavar="URL",
                   help="check an HTTP endpoint instead (pagedkv gateway: https://HOST:PORT/health): exit 0 on 200")
    p.add_argument("--timeout", type=float, default=3.0, help="seconds to wait for the answer")
    add_tls_client_args(p)
    p = sub.add_parser("gateway", help="OpenAI-compatible HTTP front (/v1/completions, /v1/chat/completions, "
                       "/v1/models; SSE streaming) of a running scheduler")
    from pagedkv.gateway.cli import add_args as add_gateway_args

    add_gateway_args(p)
    p = sub.add_parser("dynamo-worker", help="a sidecar that makes a running scheduler an NVIDIA Dynamo backend "
                       "(needs pagedkv[dynamo]: make install-dynamo)", description=dynamo_args.DESCRIPTION)
    dynamo_args.add_args(p)
    p = sub.add_parser("gen-certs", help="write a CA, a server certificate and key (and an executor secret) for TLS")
    from pagedkv.certs import add_args as add_certs_args

    add_certs_args(p)
    from pagedkv.help_format import apply as apply_help_format

    return apply_help_format(parser)  # every option's default stated; serve's common options first


def main(argv: list[str] | None = None) -> int:
    args = build_parser().parse_args(argv)
    if args.command == "serve":
        return serve(args)
    if args.command == "generate":
        try:
            return asyncio.run(_generate(args))
        except ValueError as err:  # an unreadable --tls-ca, a bad --address list or --resume-*
            print(f"error: {err}", file=sys.stderr, flush=True)
            return 1
    if args.command == "adapters":
        from pagedkv.adapters_command import run as adapters

        return asyncio.run(adapters(args))
    if args.command == "health":
        try:
            return health(args)
        except ValueError as err:  # an unreadable --tls-ca
            print(f"error: {err}", file=sys.stderr, flush=True)
            return 1
    if args.command == "gen-certs":
        from pagedkv.certs import main as gen_certs

        try:
            return gen_certs(args)
        except (ValueError, OSError) as err:
            print(f"error: {err}", file=sys.stderr, flush=True)
            return 1
    if args.command == "dynamo-worker":
        return _dynamo_worker(args)
    if args.command == "gateway":
        from pagedkv.gateway.cli import main as gateway

        return gateway(args)
    if args.command == "bench":
        from pagedkv.loadgen.command import main as bench

        return bench(args)
    if args.command == "hash-key":
        from pagedkv.tenancy import hash_key

        print(hash_key(args.key))
        return 0
    if args.command == "executor":
        from executor_svc.server import serve as run
    else:
        from scheduler_svc.server import serve as run
    from pagedkv.proc_tree import StartInterrupted

    try:
        _run_async(run(args))
    except StartInterrupted as err:  # its temporary folders are gone; it ends by the signal, as it would have
        err.die()
    except (ValueError, FileNotFoundError, OSError) as err:
        return _service_failed(err)
    except Exception as err:  # noqa: BLE001 - start-up failures of other kinds
        from pagedkv.model_fetch import ModelFetchError
        from scheduler_svc.executor_client import ExecutorUnavailable

        if isinstance(err, (ExecutorUnavailable, ModelFetchError)):
            return _service_failed(err)
        raise
    return 0


def _service_failed(err: BaseException) -> int:
    """One line on stderr; under ``pagedkv serve`` also in the file it named, for its own last line."""
    from pagedkv.supervised_child import START_ERROR_FILE_ENV

    print(f"error: {err}", file=sys.stderr, flush=True)
    if os.environ.get(START_ERROR_FILE_ENV):
        try:
            with open(os.environ[START_ERROR_FILE_ENV], "w") as f:
                f.write(f"{err}\n")
        except OSError:
            pass
    return 1
