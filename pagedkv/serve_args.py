"""``pagedkv serve``'s flags, taken from the scheduler's and the executor's own ``add_args``, and the two child
command lines built from them.

Every flag of either service is a flag of serve and goes on to that service's command line, unless serve sets it
itself (``SET_BY_SERVE``: where the two children meet, their ports, the per-run secret). A flag both services
declare (``--log-format``) is declared once and goes to both; the two definitions must agree. So a flag added to
a service's ``add_args`` reaches ``pagedkv serve`` with no edit here, and a test checks that every one does.

A child's command line carries only what differs from the flag's default: the child's default is the same one.
"""

from __future__ import annotations

import argparse
import sys
from dataclasses import dataclass, field

from pagedkv.tenancy import API_KEY_ENV

EXECUTOR_HOST = "127.0.0.1"  # serve's executor answers only its own scheduler, on this machine
EXECUTOR_DRAIN_TIMEOUT = 30.0  # serve's executor: seconds it waits for its scheduler to detach on SIGTERM

# What serve decides for each child instead of forwarding the flag, and why.
SET_BY_SERVE = {
    "scheduler": {
        "--executor": "serve's own executor, at 127.0.0.1:--executor-port",
        "--executors-file": "one executor, serve's own",
        "--resolve-interval": "no names or file to re-read",
        "--drain-timeout": "serve stops its executor only after the scheduler",
        "--host": "serve's --host",
        "--port": "serve's --port",
        "--metrics-port": "serve's --metrics-port",
        "--metrics-host": "serve's --metrics-host",
        "--executor-secret-file": "a fresh secret per run",
        "--executor-tls-ca": "the executor listens on loopback only, behind the per-run secret",
        "--executor-tls-server-name": "no executor TLS",
    },
    "executor": {
        "--host": "127.0.0.1 only",
        "--port": "serve's --executor-port",
        "--drain-timeout": f"{EXECUTOR_DRAIN_TIMEOUT:g} s (its scheduler detaches first)",
        "--metrics-port": "serve's --metrics-port + 1",
        "--metrics-host": "serve's --metrics-host",
        "--executor-secret-file": "a fresh secret per run",
        "--insecure": "never: serve's executor always has a secret",
        "--tls-cert": "the executor listens on loopback only (serve's --tls-cert is the public API's)",
        "--tls-key": "as --tls-cert",
    },
}
# Secrets serve passes to a child in its environment, not on its command line (where ps shows them): flag -> variable
# (the child's default for the flag).
BY_ENV = {"--api-key": API_KEY_ENV}
GROUP_TITLES = {
    "scheduler": "scheduler (public API, admission, KV page accounting; passed to pagedkv scheduler)",
    "executor": f"executor (model, page pools; passed to pagedkv executor, which listens on {EXECUTOR_HOST} only "
                "with a fresh secret per run)",
}
_KINDS = {None: "store", "store": "store", "store_true": "store_true", "append": "append", "extend": "extend",
          argparse.BooleanOptionalAction: "boolean"}


@dataclass
class Forwarded:
    """One service flag that serve takes and passes on."""

    flag: str
    dest: str
    kind: str  # store | store_true | append | extend (nargs "+": several values after one flag) | boolean
    default: object
    definition: dict  # add_argument's keywords without help (two services' definitions of one flag must match)
    services: list[str] = field(default_factory=list)
    action: argparse.Action | None = None

    def argv(self, value) -> list[str]:
        """This flag's part of a child's command line for ``value`` (nothing when it is the default, or when it
        goes in the child's environment: BY_ENV)."""
        if value == self.default or self.flag in BY_ENV:
            return []
        if self.kind == "store_true":
            return [self.flag]
        if self.kind == "boolean":
            return [self.flag if value else "--no-" + self.flag[2:]]
        if self.kind in ("append", "extend"):  # (extend: each --flag=v adds one value)
            return [f"{self.flag}={v}" for v in value]
        return [f"{self.flag}={value}"]  # '=': a value that starts with '-' is not read as a flag


class _ServiceFlags:
    """Stands in for the parser a service's ``add_args`` fills: each flag goes into serve's group for that
    service unless serve sets it itself, and is recorded for the child's command line."""

    def __init__(self, service: str, container, forwarded: dict[str, Forwarded]) -> None:
        self._service, self._container, self._forwarded = service, container, forwarded

    def add_argument(self, *names: str, **kwargs) -> None:
        flag = names[0]
        if flag in SET_BY_SERVE[self._service]:
            return
        kind = _KINDS.get(kwargs.get("action"))
        if kind is None or ("nargs" in kwargs and (kind, kwargs["nargs"]) != ("extend", "+")):
            raise TypeError(f"pagedkv serve cannot pass {flag} on ({kwargs}): add its kind to serve_args")
        definition = {k: v for k, v in kwargs.items() if k != "help"}
        if flag in self._forwarded:  # declared by the other service too: one flag of serve, passed to both
            known = self._forwarded[flag]
            if known.definition != definition:
                raise TypeError(f"{flag} means different things to the {known.services[0]} ({known.definition}) "
                                f"and the {self._service} ({definition}): serve must set it itself")
            known.services.append(self._service)
            known.action.help = f"{known.action.help or ''} (passed to both children)".lstrip()
            return
        action = self._container.add_argument(*names, **kwargs)
        self._forwarded[flag] = Forwarded(flag, action.dest, kind, action.default, definition, [self._service],
                                          action)

    def add_mutually_exclusive_group(self, **kwargs) -> _ServiceFlags:
        return _ServiceFlags(self._service, self._container.add_mutually_exclusive_group(**kwargs), self._forwarded)


def add_args(p: argparse.ArgumentParser) -> dict[str, Forwarded]:
    """serve's own flags, then every flag of the scheduler and of the executor that serve passes on. Returns the
    passed-on flags by name (``child_commands`` needs them; so does the test that every one arrives)."""
    from executor_svc import args as executor_args
    from scheduler_svc import args as scheduler_args

    p.add_argument("--host", default="127.0.0.1",
                   help=f"address of the public API (the executor listens on {EXECUTOR_HOST})")
    p.add_argument("--port", type=int, default=50051, help="public API port of the scheduler")
    p.add_argument("--executor-port", type=int, default=0, help=f"executor port on {EXECUTOR_HOST} (0: a free one)")
    p.add_argument("--metrics-port", type=int, default=0, metavar="P",
                   help="Prometheus metrics: the scheduler's on port P, the executor's on P+1 (0: off)")
    p.add_argument("--metrics-host", default="", metavar="HOST",
                   help="address both /metrics listen on (default: --host), e.g. an internal interface")
    forwarded: dict[str, Forwarded] = {}
    scheduler_args.add_args(_ServiceFlags("scheduler", p.add_argument_group(GROUP_TITLES["scheduler"]), forwarded))
    executor_args.add_args(_ServiceFlags("executor", p.add_argument_group(GROUP_TITLES["executor"]), forwarded))
    return forwarded


def check_flags(args: argparse.Namespace) -> None:
    """What the children would refuse at start-up (ValueError or OSError naming the flag), refused before any child
    starts: --api-key with --tenants-file, a --chat-template that is missing or does not compile, a hub --model that
    is not in the cache and cannot be downloaded (one that can be is downloaded now: the fetch, before the start),
    and a gateway asking a longer KV retention than the scheduler grants (every stored response would be refused)."""
    from pathlib import Path

    from pagedkv.hub_models import is_repo_id, resolve_hub_model
    from pagedkv.tenancy import Tenants
    from scheduler_svc.chat_template_arg import load_chat_template

    if args.api_key and args.tenants_file:
        Tenants.from_flags(args.tenants_file, args.api_key, 0)
    load_chat_template(args.chat_template)
    if getattr(args, "http_port", 0) and args.responses_kv_ttl > args.kv_retention_max_ttl:
        raise ValueError(f"--responses-kv-ttl {args.responses_kv_ttl}: the scheduler retains KV for at most "
                         f"--kv-retention-max-ttl {args.kv_retention_max_ttl} s; lower the first or raise the second")
    if is_repo_id(args.model) and not Path(args.model).expanduser().exists():
        resolve_hub_model(args.model)


def child_env(args: argparse.Namespace, forwarded: dict[str, Forwarded]) -> dict[str, str]:
    """What the children's environment carries for serve's flags (BY_ENV): each such flag's value, also when it
    came from that variable (an empty value removes the variable)."""
    return {variable: getattr(args, forwarded[flag].dest) or "" for flag, variable in BY_ENV.items()
            if flag in forwarded}


def child_commands(args: argparse.Namespace, forwarded: dict[str, Forwarded],
                   exec_port: int) -> tuple[list[str], list[str]]:
    """The executor's and the scheduler's command lines (without the secret file, which ``serve`` adds)."""
    common = [sys.executable, "-m", "pagedkv"]
    exec_cmd = [*common, "executor", "--host", EXECUTOR_HOST, "--port", str(exec_port),
                "--drain-timeout", str(EXECUTOR_DRAIN_TIMEOUT)]
    sched_cmd = [*common, "scheduler", "--executor", f"{EXECUTOR_HOST}:{exec_port}", "--host", args.host,
                 "--port", str(args.port)]
    if args.metrics_port:
        metrics_host = args.metrics_host or args.host
        exec_cmd += ["--metrics-port", str(args.metrics_port + 1), "--metrics-host", metrics_host]
        sched_cmd += ["--metrics-port", str(args.metrics_port), "--metrics-host", metrics_host]
    commands = {"executor": exec_cmd, "scheduler": sched_cmd}
    for f in forwarded.values():
        for service in f.services:
            commands[service] += f.argv(getattr(args, f.dest))
    if getattr(args, "cuda_graph_max_batch", None) is None:  # (graphs for every decode batch the scheduler plans)
        exec_cmd += [f"--cuda-graph-max-batch={args.max_num_seqs}"]
    return exec_cmd, sched_cmd
