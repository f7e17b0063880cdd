"""``pagedkv gateway``: its flags, and the process (uvicorn with the HTTP bounds of guards.py); ``pagedkv serve
--http-port`` starts it as a child; ``pagedkv health --http`` checks it (``check_http``)."""

from __future__ import annotations

import argparse
import asyncio
import logging
import os
import sys
from dataclasses import replace

from pagedkv import logs
from pagedkv.bounds import MIN_PROMPT_BYTES, PROMPT_BYTES_PER_TOKEN
from pagedkv.gateway.app import DEFAULT_MAX_STREAMS, Gateway, create_app
from pagedkv.gateway.guards import (
    DEFAULT_BODY_TIMEOUT_S,
    DEFAULT_HEADER_TIMEOUT_S,
    DEFAULT_MAX_HEADER_BYTES,
    bounded_protocol,
)
from pagedkv.gateway.logprobs import TokenNames
from pagedkv.gateway.response_budget import DEFAULT_MAX_RESPONSE_BYTES, MIN_MAX_RESPONSE_BYTES
from pagedkv.gateway.responses_routes import Responses
from pagedkv.gateway.responses_store import (
    ResponsesStore,
    add_responses_args,
    check_responses_args,
    responses_child_args,
    responses_dir,
)
from pagedkv.gateway.upstream import Upstream
from pagedkv.resume_policy import add_resume_args, resume_policy

DEFAULT_PORT = 8000
# NOTE: uvicorn's default is 5 s, the same as httpx's (the openai SDK's) pool expiry: a request sent on a
# connection the server was closing that instant failed with a read error (1 of 256 streams in bench/gateway.py).
DEFAULT_KEEP_ALIVE_S = 75.0


def check_http(url: str, tls_ca: str = "", tls_server_name: str = "", timeout: float = 3.0) -> tuple[bool, str]:
    """``pagedkv health --http URL``: (True, what it said) when GET URL answers 200 (the gateway's /health:
    it and its scheduler serve). https URLs are verified against ``tls_ca`` (else the system's CAs)."""
    import http.client
    import ssl
    from urllib.parse import urlsplit

    parts = urlsplit(url)
    if parts.scheme not in ("http", "https") or not parts.hostname:
        raise ValueError(f"--http {url!r}: give an http:// or https:// URL, e.g. https://127.0.0.1:8000/health")
    if parts.scheme == "https":
        ctx = ssl.create_default_context(cafile=tls_ca or None)
        conn = http.client.HTTPSConnection(parts.hostname, parts.port or 443, timeout=timeout, context=ctx)
        if tls_server_name:  # verify the certificate against this name instead of the URL's host
            conn = _named_https(parts.hostname, parts.port or 443, timeout, ctx, tls_server_name)
    else:
        conn = http.client.HTTPConnection(parts.hostname, parts.port or 80, timeout=timeout)
    try:
        conn.request("GET", parts.path or "/")
        r = conn.getresponse()
        body = r.read(4096).decode("utf-8", "replace")
    except (OSError, http.client.HTTPException) as err:
        return False, f"{url}: {err}"
    finally:
        conn.close()
    return r.status == 200, f"{url}: {r.status} {body.strip()}"


def _named_https(host: str, port: int, timeout: float, ctx, server_name: str):
    import http.client
    import socket

    class Conn(http.client.HTTPSConnection):
        def connect(self) -> None:
            sock = socket.create_connection((host, port), timeout)
            self.sock = ctx.wrap_socket(sock, server_hostname=server_name)

    return Conn(host, port, timeout=timeout, context=ctx)


def add_args(p: argparse.ArgumentParser) -> None:
    from pagedkv.security import add_tls_client_args, add_tls_server_args

    p.add_argument("--address", default=os.environ.get("PAGEDKV_ADDRESS", "127.0.0.1:50051"),
                   help="scheduler HOST:PORT; several comma-separated, or dns:///NAME:PORT, for round robin")
    p.add_argument("--host", default="127.0.0.1", help="HTTP listen address")
    p.add_argument("--port", type=int, default=DEFAULT_PORT, help="HTTP port")
    p.add_argument("--served-model-name", action="extend", nargs="+", default=[], metavar="NAME",
                   help="the model name(s) clients send, as vLLM's: --served-model-name a b (or the flag repeated); "
                   "the first is the one answers report, /v1/models lists them all, and another name gets 404 "
                   "model_not_found (default: the scheduler's, its ModelInfo.served_model_names)")
    p.add_argument("--tokenizer", default="", metavar="DIR",
                   help="the model's tokenizer directory, or a built-in model's name (as the executor's --model): "
                   "logprobs name tokens by their text, as vLLM does (default: token_id:N; the gateway then loads "
                   "no tokenizer). pagedkv serve --http-port passes the scheduler's --tokenizer, else --model")
    p.add_argument("--max-body-bytes", type=int, default=0, metavar="N",
                   help="longest request body, refused with 413 before it is parsed (default: the scheduler's "
                   "request limit, learned from its max_model_len: --max-prompt-bytes, or a full context of token "
                   "ids at 5 bytes each, whichever is more, plus 64 KiB; several prompts in one body share it)")
    p.add_argument("--max-prompt-bytes", type=int, default=0, metavar="N",
                   help="longest prompt text, or chat contents together, in UTF-8 bytes, refused with 400 before "
                   "it is sent; set it to the scheduler's --max-prompt-bytes when that is set (default: the "
                   f"scheduler's default, {PROMPT_BYTES_PER_TOKEN} bytes per token of its max_model_len, at least "
                   f"{MIN_PROMPT_BYTES})")
    _add_response_bytes(p)
    p.add_argument("--max-streams", type=int, default=DEFAULT_MAX_STREAMS, metavar="N",
                   help="streams answered at once, each prompt's n forks counted (32 prompts x n=16 are 512): a "
                   "request past it gets 429 with Retry-After, one that alone is over it 400 (default: %(default)s)")
    p.add_argument("--max-header-bytes", type=int, default=DEFAULT_MAX_HEADER_BYTES, metavar="N",
                   help="longest request head (request line and headers, in all): past it the answer is 431 and "
                   "the connection closes (default: %(default)s)")
    p.add_argument("--header-timeout", type=float, default=DEFAULT_HEADER_TIMEOUT_S, metavar="S",
                   help="seconds a client has to send a request's head, from the connection opening or the next "
                   "request's first byte: past it, 408 and the connection closes (slow clients hold no connection "
                   "longer; default: %(default)s)")
    p.add_argument("--body-timeout", type=float, default=DEFAULT_BODY_TIMEOUT_S, metavar="S",
                   help="seconds a client has to send a request's body once its head is in: past it, 408 and the "
                   "connection closes (default: %(default)s)")
    p.add_argument("--keep-alive-timeout", type=float, default=DEFAULT_KEEP_ALIVE_S, metavar="S",
                   help="seconds an idle HTTP/1.1 connection stays open; longer than clients' and load balancers' "
                   "own idle timeouts, so that they close first (a server closing first races a client reusing it)")
    p.add_argument("--shutdown-timeout", type=float, default=30.0,
                   help="on SIGTERM: seconds in-flight requests get to finish (new connections are refused)")
    add_resume_args(p, note=" (A full queue before anything was sent is the HTTP client's 429 with Retry-After.)")
    p.add_argument("--log-format", choices=["auto", "json", "console"], default="auto",
                   help="auto: readable on a terminal, JSON lines otherwise")
    logs.add_log_level_arg(p)
    add_tls_server_args(p)  # HTTPS on the HTTP side
    add_tls_client_args(p)  # trust the scheduler's certificate
    add_responses_args(p)
    _add_fleet_args(p)


def _add_fleet_args(p: argparse.ArgumentParser) -> None:
    from pagedkv import fleet_salt, trusted_hop

    g = p.add_argument_group("fleet (Dynamo, llm-d / GIE)")
    g.add_argument("--edge-upstream", default="", metavar="URL",
                   help="edge mode: authenticate and relay /v1/completions, /v1/chat/completions and /v1/models to "
                   "a fleet router's OpenAI frontend at URL (Dynamo's, which checks no key) instead of a scheduler: "
                   "the key is checked against --tenants-file, every client header but content-type, accept and "
                   f"x-request-id is dropped (x-dynamo-meta-*, GIE's, pagedkv's), nvext.cache_salt is set to the "
                   f"tenant's salt and {fleet_salt.TENANT_META_HEADER} to its signed assertion (both under "
                   f"{fleet_salt.FLEET_SECRET_FLAG}); answers stream through. --tls-ca verifies an https URL")
    g.add_argument("--tenants-file", default="", metavar="PATH",
                   help="with --edge-upstream: the schedulers' tenants file, whose keys the edge checks (reloaded on "
                   "SIGHUP)")
    g.add_argument(fleet_salt.FLEET_SECRET_FLAG, default="", metavar="PATH",
                   help=f"with --edge-upstream: file holding the fleet secret shared with every scheduler and Dynamo "
                   f"sidecar (default: ${fleet_salt.FLEET_SECRET_ENV}, the secret itself)")
    g.add_argument("--tenant-assertion-ttl", type=float, default=fleet_salt.DEFAULT_ASSERTION_TTL_S, metavar="S",
                   help="with --edge-upstream: seconds a request's signed tenant assertion holds (a request Dynamo "
                   "migrates to another worker later than that is refused by its sidecar; default: %(default)s)")
    g.add_argument("--trust-gie-headers", action="store_true",
                   help=f"this gateway's clients are the Gateway API Inference Extension (Envoy and its endpoint "
                   f"picker): pass {trusted_hop.FAIRNESS_ID_HEADER} (the tenant) and {trusted_hop.OBJECTIVE_HEADER} "
                   f"(the scheduler's --objective) to the scheduler as a trusted hop ({trusted_hop.HOP_SECRET_FLAG}); "
                   "the tenant named needs no key. Without it those headers are dropped, never read")
    g.add_argument(trusted_hop.HOP_SECRET_FLAG, default="", metavar="PATH",
                   help=f"with --trust-gie-headers: file holding the scheduler's trusted-hop secret (default: "
                   f"${trusted_hop.HOP_SECRET_ENV}, the secret itself)")


def _fleet_app(args, upstream_close, log):
    """The edge app with --edge-upstream, else None; the trusted-hop secret GIE's headers go with ('' without
    --trust-gie-headers). ValueError names a flag that is missing or given in the wrong mode."""
    from pagedkv import fleet_salt, trusted_hop
    from pagedkv.gateway.edge import Edge, create_edge_app

    if args.edge_upstream:
        if args.trust_gie_headers:
            raise ValueError("--trust-gie-headers: not with --edge-upstream (the edge drops GIE's headers: the fleet "
                             "router behind it routes)")
        edge = Edge(args.edge_upstream, args.tenants_file, fleet_salt.load_fleet_secret(args.fleet_secret_file), log,
                    args.tls_ca, args.max_body_bytes, args.max_response_bytes, args.tenant_assertion_ttl,
                    args.max_streams)
        return create_edge_app(edge, on_shutdown=(upstream_close,)), ""
    for flag, value in (("--tenants-file", args.tenants_file), (fleet_salt.FLEET_SECRET_FLAG, args.fleet_secret_file)):
        if value:
            raise ValueError(f"{flag}: only with --edge-upstream (otherwise the scheduler checks keys itself)")
    if args.trusted_hop_secret_file and not args.trust_gie_headers:
        raise ValueError(f"{trusted_hop.HOP_SECRET_FLAG}: only with --trust-gie-headers (the gateway asserts a "
                         "tenant only from GIE's headers)")
    if not args.trust_gie_headers:
        return None, ""
    secret = trusted_hop.load_hop_secret(args.trusted_hop_secret_file)
    if not secret:
        raise ValueError(f"--trust-gie-headers needs {trusted_hop.HOP_SECRET_FLAG} (or ${trusted_hop.HOP_SECRET_ENV}):"
                         " the scheduler accepts GIE's headers only from a trusted hop")
    return None, secret


def _add_response_bytes(p: argparse.ArgumentParser, whose: str = "") -> None:
    p.add_argument("--max-response-bytes", type=int, default=DEFAULT_MAX_RESPONSE_BYTES, metavar="N",
                   help=f"{whose}the most bytes one answer may take, bounded from what the request asks before "
                   "anything is sent: prompts x n, max_tokens, echo, logprobs / top_logprobs and prompt_logprobs "
                   "(each token with its alternatives, at the tokenizer's longest token); a request over it is "
                   "refused with 400 naming what drives it. It bounds the memory a non-streamed answer takes here "
                   "(built and encoded whole: several times its size) and a stream's total (its CPU here, the "
                   "scheduler's work); vLLM has no such bound (default: %(default)s = 32 MiB; at least "
                   f"{MIN_MAX_RESPONSE_BYTES})")


def _server_class():
    import uvicorn

    class Server(uvicorn.Server):
        def handle_exit(self, sig, frame) -> None:
            """SIGTERM or Ctrl-C: stop accepting, let in-flight requests finish (--shutdown-timeout), exit 0
            (uvicorn would raise the signal again once drained, so the process would die of it); a second
            signal stops at once."""
            if self.should_exit:
                self.force_exit = True
            self.should_exit = True

        async def shutdown(self, sockets=None) -> None:
            # NOTE: an idle keep-alive connection is dropped at once. uvicorn closes it, which over TLS sends
            # close_notify and waits up to 30 s (asyncio's ssl_shutdown_timeout) for a client that is not reading:
            # every HTTPS shutdown with an idle client in its pool took the whole --shutdown-timeout.
            for connection in list(self.server_state.connections):
                cycle = getattr(connection, "cycle", None)
                if cycle is None or cycle.response_complete:
                    connection.transport.abort()
            await super().shutdown(sockets)

    return Server


def add_serve_args(p: argparse.ArgumentParser) -> None:
    """``pagedkv serve --http-port P``: the gateway as a third child of serve."""
    p.add_argument("--http-port", type=int, default=0, metavar="P",
                   help="also serve the OpenAI-compatible HTTP API (pagedkv gateway) on --host:P (0: off), naming "
                   "tokens in logprobs by their text with the model's tokenizer (--tokenizer, else --model); with "
                   "--tls-cert it serves HTTPS with the same certificate and verifies the scheduler with "
                   "$PAGEDKV_TLS_CA (the CA that signed --tls-cert)")
    _add_response_bytes(p, "with --http-port, the gateway's: ")
    add_responses_args(p, "with --http-port, the gateway's: ")


def serve_child_command(args) -> list[str] | None:
    """serve's gateway child (None without --http-port): it dials serve's scheduler on loopback, and names tokens in
    logprobs with the scheduler's tokenizer (its --tokenizer, else the executor's --model)."""
    if not args.http_port:
        return None
    host = "127.0.0.1" if args.host in ("0.0.0.0", "::", "") else args.host
    cmd = [sys.executable, "-m", "pagedkv", "gateway", "--address", f"{host}:{args.port}", "--host", args.host,
           "--port", str(args.http_port), "--shutdown-timeout", str(args.shutdown_timeout),
           "--log-format", args.log_format]
    if getattr(args, "log_level", ""):  # (serve's, for all its children)
        cmd += ["--log-level", args.log_level]
    tokenizer = getattr(args, "tokenizer", "") or getattr(args, "model", "")
    if tokenizer:
        cmd += ["--tokenizer", tokenizer]
    if getattr(args, "max_prompt_bytes", 0):  # the scheduler's, so that the gateway refuses what it would
        cmd += ["--max-prompt-bytes", str(args.max_prompt_bytes)]
    response_bytes = getattr(args, "max_response_bytes", DEFAULT_MAX_RESPONSE_BYTES)
    if response_bytes < MIN_MAX_RESPONSE_BYTES:
        raise ValueError(f"--max-response-bytes {response_bytes}: at least {MIN_MAX_RESPONSE_BYTES}")
    if response_bytes != DEFAULT_MAX_RESPONSE_BYTES:
        cmd += ["--max-response-bytes", str(response_bytes)]
    cmd += responses_child_args(args)
    if args.tls_cert:
        ca = os.environ.get("PAGEDKV_TLS_CA", "")
        if not ca:
            raise ValueError("--http-port with --tls-cert: set $PAGEDKV_TLS_CA to the CA certificate that signed "
                             "--tls-cert (pagedkv gen-certs writes it as ca.pem), so the gateway can verify the "
                             "scheduler")
        cmd += ["--tls-cert", args.tls_cert, "--tls-key", args.tls_key, "--tls-ca", ca]
    return cmd


def check_bounds(args) -> None:
    for flag, value, lo in (("--max-body-bytes", args.max_body_bytes, 1024),
                            ("--max-prompt-bytes", args.max_prompt_bytes, 1),
                            ("--max-header-bytes", args.max_header_bytes, 1024)):
        if value < 0 or 0 < value < lo:
            raise ValueError(f"{flag} {value}: at least {lo} (or 0 for the default)")
    if args.max_response_bytes < MIN_MAX_RESPONSE_BYTES:
        raise ValueError(f"--max-response-bytes {args.max_response_bytes}: at least {MIN_MAX_RESPONSE_BYTES}")
    if args.max_streams < 1:
        raise ValueError(f"--max-streams {args.max_streams}: at least 1")
    check_responses_args(args)
    for flag, seconds in (("--header-timeout", args.header_timeout), ("--body-timeout", args.body_timeout)):
        if not seconds > 0:
            raise ValueError(f"{flag} {seconds}: must be > 0")


async def serve(args) -> None:
    import uvicorn

    from pagedkv.security import server_credentials, warn_if_exposed

    log = logs.configure("gateway", json=logs.wants_json(args.log_format), level=args.log_level)
    logging.getLogger("uvicorn.error").setLevel(logging.WARNING)  # gateway_ready / gateway_stopped say it
    tls = server_credentials(args.tls_cert, args.tls_key) is not None  # checks the pair now (clear errors)
    check_bounds(args)
    resume = resume_policy(args)
    resume = replace(resume, queue_full_at_start=False) if resume is not None else None  # (as GATEWAY_RESUME)
    upstream = Upstream(args.address, args.tls_ca, args.tls_server_name, tuple(args.served_model_name), resume)
    edge_app, gie_hop_secret = _fleet_app(args, upstream.close, log)
    token_names = TokenNames(args.tokenizer, log) if args.tokenizer and edge_app is None else None
    gateway = Gateway(upstream, log, args.max_body_bytes, args.max_streams, token_names, args.max_prompt_bytes,
                      args.max_response_bytes, gie_hop_secret)  # (loads --tokenizer once the gateway listens)
    store = None if edge_app else ResponsesStore(responses_dir(args.responses_dir), args.responses_max_count,
                                                 args.responses_max_bytes, log)
    responses = () if store is None else Responses(gateway, store, args.responses_kv_ttl).routes()

    async def close() -> None:
        await upstream.close()
        if store is not None:
            await asyncio.to_thread(store.close)  # (the files still being written)

    app = edge_app or create_app(gateway, on_shutdown=(close,), extra_routes=responses)
    protocol = bounded_protocol(log, args.max_header_bytes, args.header_timeout, args.body_timeout)
    config = uvicorn.Config(app, host=args.host, port=args.port, http=protocol, lifespan="on", log_config=None,
                            access_log=False, timeout_graceful_shutdown=args.shutdown_timeout,
                            timeout_keep_alive=args.keep_alive_timeout,
                            ssl_certfile=args.tls_cert or None, ssl_keyfile=args.tls_key or None,
                            server_header=False)
    server = _server_class()(config)
    warn_if_exposed(log, "gateway", args.host, args.port, tls)

    async def announce() -> None:
        while not server.started:
            if server.should_exit:
                return
            await asyncio.sleep(0.02)
        upstream_of = {"edge_upstream": args.edge_upstream} if args.edge_upstream else {
            "scheduler": args.address, "scheduler_tls": bool(args.tls_ca), "trust_gie_headers": bool(gie_hop_secret)}
        log.info("gateway_ready", address=f"{args.host}:{args.port}", tls=tls, **upstream_of,
                 models=list(args.served_model_name) or None)

    ready = asyncio.ensure_future(announce())
    if token_names is not None:
        token_names.start()
    try:
        await server.serve()
    finally:
        ready.cancel()
    if not server.started:
        raise OSError(f"--port {args.port}: cannot listen on {args.host}:{args.port} (in use?)")
    log.info("gateway_stopped")


def main(args) -> int:
    import uvloop

    try:
        uvloop.run(serve(args))
    except (ValueError, OSError) as err:
        print(f"error: {err}", file=sys.stderr, flush=True)
        return 1
    return 0


if __name__ == "__main__":  # python -m pagedkv.gateway.cli (pagedkv gateway is the same)
    parser = argparse.ArgumentParser(prog="pagedkv gateway", description=__doc__.split("\n\n")[0])
    add_args(parser)
    sys.exit(main(parser.parse_args()))
