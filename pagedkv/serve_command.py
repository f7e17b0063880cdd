"""``pagedkv serve``: its flags checked and its ports free before anything starts, then the executor, the scheduler
and (``--http-port``) the gateway started together and supervised (``pagedkv.supervisor``) until Ctrl-C or SIGTERM.
Each child's command line, environment and flags come from ``pagedkv.serve_args``; ``pagedkv.cli`` dispatches
here."""

from __future__ import annotations

import os
import sys

from pagedkv.serve_args import EXECUTOR_DRAIN_TIMEOUT, EXECUTOR_HOST

STOP_MARGIN = 10.0  # seconds past a child's own drain bound before serve SIGKILLs it

SERVE_DESCRIPTION = """Start an executor and a scheduler on this machine, both at once (the scheduler connects when
the executor is up; one that gave up waiting, --connect-timeout, starts again then), and supervise them. A crashed
child is restarted (after 1 s, doubling to 30 s; back to 1 s once it stayed up a minute); while the executor is down its
requests wait (up to --unplaced-timeout) and then continue where they were, and new ones are refused with
UNAVAILABLE (retry); a crashed scheduler breaks its
client streams (UNAVAILABLE) and comes back empty: pagedkv's Client, `pagedkv generate` and the gateway resume them
there, with no token lost or repeated. SIGHUP is passed to the scheduler
(it reloads --tenants-file). Ctrl-C or SIGTERM: the scheduler finishes in-flight streams (up to
--shutdown-timeout), then the executor stops; a second Ctrl-C stops at once. The children never outlive serve,
even a SIGKILLed one (Linux: parent-death signal)."""


def serve(args) -> int:
    from pagedkv.cli import free_port
    from pagedkv.port_check import PortUnavailable, check_ports
    from pagedkv.serve_args import check_flags, child_commands

    try:  # before any child starts: flags the scheduler would refuse (--api-key with --tenants-file, a bad template)
        check_flags(args)
    except (ValueError, OSError) as err:
        print(f"error: {err}", file=sys.stderr, flush=True)
        return 2
    try:  # before any child starts: a port taken fails serve at once, naming who holds it
        check_ports(serve_ports(args))
    except PortUnavailable as err:
        print(f"error: {err}", file=sys.stderr, flush=True)
        return 1
    # (not a port the scheduler, its metrics or the gateway will take: they start at the same time)
    taken = {args.port, getattr(args, "http_port", 0)}
    if getattr(args, "metrics_port", 0):
        taken |= {args.metrics_port, args.metrics_port + 1}
    exec_port = args.executor_port or free_port(EXECUTOR_HOST, avoid=taken)
    exec_cmd, sched_cmd = child_commands(args, args.forwarded, exec_port)
    return _supervise(args, exec_port, exec_cmd, sched_cmd)


def serve_ports(args) -> list[tuple[str, str, int]]:
    """(flag, host, port) of each port serve's children will bind (0: one they choose)."""
    metrics_host = getattr(args, "metrics_host", "") or args.host
    metrics = getattr(args, "metrics_port", 0)
    return [("--port", args.host, args.port), ("--http-port", args.host, getattr(args, "http_port", 0)),
            ("--metrics-port", metrics_host, metrics), ("--metrics-port (+1, the executor's)", metrics_host,
                                                        metrics + 1 if metrics else 0),
            ("--executor-port", EXECUTOR_HOST, args.executor_port)]


def _supervise(args, exec_port: int, exec_cmd: list[str], sched_cmd: list[str]) -> int:
    """Runs the two children under pagedkv.supervisor (signals, restarts, ordered shutdown)."""
    from pagedkv import logs
    from pagedkv.gateway.cli import serve_child_command
    from pagedkv.serve_args import child_env
    from pagedkv.serve_probes import HealthProbe, ListeningProbe, executor_secret_file
    from pagedkv.supervised_child import ChildSpec
    from pagedkv.supervisor import Supervisor

    log = logs.configure("serve", json=logs.wants_json(args.log_format), level=args.log_level)
    env = dict(os.environ)
    env.pop("PAGEDKV_EXECUTOR_SECRET", None)  # this run's own secret, from the file, is the one that counts
    env.update(child_env(args, args.forwarded))  # (--api-key: in the scheduler's environment, not its argv)
    exec_address, sched_address = f"{EXECUTOR_HOST}:{exec_port}", f"{args.host}:{args.port}"
    with executor_secret_file() as secret:
        exec_cmd += ["--executor-secret-file", secret]
        sched_cmd += ["--executor-secret-file", secret]
        # With TLS on the public API, serve (which holds no CA) waits for the scheduler's port to listen: the
        # scheduler starts listening just before it reports SERVING.
        probes = HealthProbe(exec_address), (ListeningProbe if args.tls_cert else HealthProbe)(sched_address)
        children = [
            ChildSpec("executor", exec_cmd, probes[0], ready_timeout=600, close=probes[0].close,
                      stop_timeout=EXECUTOR_DRAIN_TIMEOUT + STOP_MARGIN, ports=(exec_port,)),
            ChildSpec("scheduler", sched_cmd, probes[1], ready_timeout=300, close=probes[1].close,
                      stop_timeout=args.shutdown_timeout + STOP_MARGIN, ports=(args.port,)),
        ]
        try:
            gateway = serve_child_command(args)  # --http-port: the OpenAI-compatible HTTP front, stopped first
        except ValueError as err:
            print(f"error: {err}", file=sys.stderr, flush=True)
            return 2
        if gateway:
            http = ListeningProbe(f"{'127.0.0.1' if args.host in ('0.0.0.0', '::') else args.host}:{args.http_port}")
            children.append(ChildSpec("gateway", gateway, http, ready_timeout=60, ports=(args.http_port,),
                                      stop_timeout=args.shutdown_timeout + STOP_MARGIN))
        supervisor = Supervisor(children, log, reload="scheduler", env=env, start_together=True)
        return supervisor.run(lambda: print(
            f"pagedkv ready: model {args.model} at {sched_address} (executor {exec_address})"
            + (f"; HTTP (OpenAI API) on {args.host}:{args.http_port}" if gateway else "") + "; Ctrl-C stops",
            flush=True))
