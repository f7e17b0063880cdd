"""A pagedkv fleet behind NVIDIA Dynamo on this machine, without containers: every process on loopback, free ports.

    python deploy/fleet_local.py --model tiny-llama --schedulers 2          # runs until Ctrl-C
    python deploy/fleet_local.py --check                                     # one chat completion, then stops

What it starts (each process in a session of its own, its output in <workdir>/logs/NAME.log):

- N ``pagedkv serve`` (a scheduler and its executor each) with a tenants file, the trusted-hop and fleet secrets
  and ``--kv-events-rpc`` (the KV event stream its sidecar relays);
- one ``pagedkv dynamo-worker`` per scheduler (its sidecar: registers the scheduler with Dynamo, relays its KV
  events and load, asserts the tenant the edge signed);
- Dynamo's frontend (``python -m dynamo.frontend --router-mode kv|round-robin``), with file discovery in
  <workdir>/discovery, the TCP request plane and ZMQ events: no etcd, no NATS;
- the edge gateway (``pagedkv gateway --edge-upstream``) in front of the frontend: it checks API keys, sets each
  tenant's salt and signed assertion. Clients talk to it only.

The secrets (trusted hop, fleet) and the tenants file are generated into <workdir> (a fresh temporary folder
unless ``--workdir``), mode 0600; the tenants' API keys are in <workdir>/keys.json. ``ops`` is an admin tenant,
the sidecars' (it lets them read their scheduler's page load). Stopping (Ctrl-C, SIGTERM, ``Fleet.stop``) sends
SIGTERM to every process, the edge first and the schedulers last, and SIGKILLs a process group that is still
there after ``--stop-timeout`` seconds.

Importable: ``with Fleet(FleetConfig(...)) as fleet: fleet.edge_url, fleet.keys`` (bench/fleet.py uses it).
Needs Dynamo in the venv: ``make install-dynamo``.
"""

from __future__ import annotations

import argparse
import json
import os
import secrets
import signal
import sys
import tempfile
import time
from dataclasses import dataclass, field
from pathlib import Path

import httpx

ROOT = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(ROOT))

from fleet_proc import Proc  # noqa: E402  (deploy/, beside this file)

from pagedkv.cli import free_port  # noqa: E402
from pagedkv.tenancy import hash_key  # noqa: E402

PLAIN_CHAT_TEMPLATE = ROOT / "deploy" / "chat-template-plain.jinja"
# Dynamo's KV router with a prefill term 4x its default: a prefix hit then outweighs about three running requests on
# the holder, and repeats stay with it (bench/fleet.py, bench/NOTES.md session 21: hits 0.93-0.97x one scheduler's
# against 0.77-0.79x with Dynamo's defaults, on tiny-llama and SmolLM2). The compose profile and k8s component
# run the same.
ROUTER_ARGS = ["--router-prefill-load-scale", "4"]
OPS_TENANT = "ops"


def dynamo_env(discovery: Path) -> dict[str, str]:
    """Every Dynamo process's environment: file discovery in ``discovery``, TCP requests, ZMQ events, few threads,
    no hub."""
    return {**os.environ, "DYN_DISCOVERY_BACKEND": "file", "DYN_FILE_KV": str(discovery), "DYN_REQUEST_PLANE": "tcp",
            "DYN_EVENT_PLANE": "zmq", "TOKIO_WORKER_THREADS": "2", "DYN_COMPUTE_THREADS": "1",
            "HF_HUB_OFFLINE": "1"}


def write_secrets(workdir: Path, tenants: int) -> dict[str, str]:
    """Generates into ``workdir`` (each file 0600): tenants.toml (ops, an admin tenant, and tenant-0 ..
    tenant-(N-1), one API key each, stored hashed), hop.secret, fleet.secret, keys.json (tenant -> key) and
    ops.key (the sidecars' key alone). Returns the keys."""
    keys = {OPS_TENANT: "pk-" + secrets.token_urlsafe(24)}
    keys |= {f"tenant-{i}": "pk-" + secrets.token_urlsafe(24) for i in range(tenants)}
    toml = "".join(f'[tenants."{t}"]\nkeys = ["{hash_key(k)}"]\n' + ("admin = true\n" if t == OPS_TENANT else "")
                   + "\n" for t, k in keys.items())
    for name, text in (("tenants.toml", toml), ("hop.secret", secrets.token_hex(32)),
                       ("fleet.secret", secrets.token_hex(32)), ("keys.json", json.dumps(keys, indent=2)),
                       ("ops.key", keys[OPS_TENANT])):
        path = workdir / name
        path.write_text(text)
        path.chmod(0o600)
    return keys


@dataclass(slots=True)
class FleetConfig:
    model: str = "tiny-llama"
    schedulers: int = 2
    router_mode: str = "kv"  # Dynamo's --router-mode: kv, round-robin, ...
    tenants: int = 4  # generated tenants tenant-0 .. tenant-(N-1), besides ops
    serve_args: list[str] = field(default_factory=lambda: ["--threads", "1"])  # more flags for every pagedkv serve
    frontend_args: list[str] = field(default_factory=lambda: list(ROUTER_ARGS))  # more flags for Dynamo's frontend
    chat_template: str = ""  # for a model without one (default: deploy/chat-template-plain.jinja)
    edge_port: int = 0  # 0: a free one
    scheduler_http: bool = False  # also serve each scheduler's own gateway (pagedkv serve --http-port)
    require_tenant: bool = True  # sidecars refuse a request the edge did not sign (clients must use the edge)
    migration_limit: int = 3
    namespace: str = "dynamo"
    workdir: str = ""  # default: a fresh temporary folder, removed by stop() when it made it
    ready_timeout: float = 600.0
    stop_timeout: float = 30.0


class Fleet:
    """Starts the fleet in ``start()`` (or ``with``), waits until the edge serves the model; ``stop()`` ends it."""

    def __init__(self, config: FleetConfig) -> None:
        self.config = config
        self.procs: list[Proc] = []
        self.scheduler_addresses: list[str] = []
        self.scheduler_http_urls: list[str] = []
        self.keys: dict[str, str] = {}  # tenant -> API key
        self.frontend_url = ""
        self.edge_url = ""
        self.served_model = ""
        self._tmp: tempfile.TemporaryDirectory | None = None
        self.workdir = Path()

    # ---- set-up ----------------------------------------------------------------------------------------------
    def __enter__(self) -> Fleet:
        self.start()
        return self

    def __exit__(self, *exc) -> None:
        self.stop()

    def _chat_template(self) -> str:
        if self.config.chat_template:
            return self.config.chat_template
        from pagedkv.dynamo_worker import has_chat_template  # imports Dynamo (make install-dynamo)
        from pagedkv.models import resolve_model

        return "" if has_chat_template(resolve_model(self.config.model)) else str(PLAIN_CHAT_TEMPLATE)

    def start(self) -> None:
        c = self.config
        if c.workdir:
            self.workdir = Path(c.workdir)
            self.workdir.mkdir(parents=True, exist_ok=True)
        else:
            self._tmp = tempfile.TemporaryDirectory(prefix="pagedkv-fleet-")
            self.workdir = Path(self._tmp.name)
        logs, discovery = self.workdir / "logs", self.workdir / "discovery"
        logs.mkdir(exist_ok=True)
        discovery.mkdir(exist_ok=True)
        self.keys = write_secrets(self.workdir, self.config.tenants)
        w = self.workdir
        try:
            template = self._chat_template()
            ports: list[int] = []

            def port() -> int:
                ports.append(free_port(avoid=ports))
                return ports[-1]

            for i in range(c.schedulers):
                sched_port = port()
                http = ["--http-port", str(port())] if c.scheduler_http else []
                self.procs.append(Proc(f"scheduler-{i}", [
                    sys.executable, "-m", "pagedkv", "serve", "--host", "127.0.0.1", "--port", str(sched_port),
                    "--model", c.model, "--log-format", "json", "--tenants-file", str(w / "tenants.toml"),
                    "--trusted-hop-secret-file", str(w / "hop.secret"), "--fleet-secret-file", str(w / "fleet.secret"),
                    "--kv-events-rpc", *http, *c.serve_args], dict(os.environ), logs))
                self.scheduler_addresses.append(f"127.0.0.1:{sched_port}")
                if http:
                    self.scheduler_http_urls.append(f"http://127.0.0.1:{http[1]}")
            env = dynamo_env(discovery)
            frontend_port = port()
            self.frontend_url = f"http://127.0.0.1:{frontend_port}"
            self.procs.append(Proc("frontend", [
                sys.executable, "-m", "dynamo.frontend", "--http-host", "127.0.0.1", "--http-port", str(frontend_port),
                "--router-mode", c.router_mode, "--discovery-backend", "file", "--request-plane", "tcp",
                "--event-plane", "zmq", "--namespace", c.namespace, "--migration-limit", str(c.migration_limit),
                *c.frontend_args], env, logs))
            for i, address in enumerate(self.scheduler_addresses):
                self.procs.append(Proc(f"dynamo-worker-{i}", [
                    sys.executable, "-m", "pagedkv", "dynamo-worker", "--model", c.model, "--address", address,
                    "--api-key", self.keys[OPS_TENANT], "--trusted-hop-secret-file", str(w / "hop.secret"),
                    "--fleet-secret-file", str(w / "fleet.secret"), "--discovery-backend", "file",
                    "--request-plane", "tcp", "--event-plane", "zmq", "--namespace", c.namespace,
                    "--log-format", "json", *(["--chat-template", template] if template else []),
                    *(["--require-tenant"] if c.require_tenant else [])], env, logs))
            edge_port = c.edge_port or port()
            self.edge_url = f"http://127.0.0.1:{edge_port}"
            self.procs.append(Proc("edge-gateway", [
                sys.executable, "-m", "pagedkv", "gateway", "--host", "127.0.0.1", "--port", str(edge_port),
                "--log-format", "json", "--edge-upstream", self.frontend_url, "--tenants-file", str(w / "tenants.toml"),
                "--fleet-secret-file", str(w / "fleet.secret")], dict(os.environ), logs))
            self._wait_ready()
        except BaseException:
            self.stop()
            raise

    def _registered(self, http: httpx.Client) -> bool:
        for p in self.procs:
            if not p.alive():
                raise RuntimeError(f"{p.name} exited with {p.proc.returncode}:\n{p.tail()}")
        started = sum("dynamo_worker_start" in p.tail(400) for p in self.procs if p.name.startswith("dynamo-worker"))
        if started < self.config.schedulers:
            return False
        try:
            models = http.get(f"{self.frontend_url}/v1/models").json()["data"]
            edge = http.get(f"{self.edge_url}/health").status_code
        except (httpx.HTTPError, ValueError, KeyError):
            return False
        instances = self.workdir / "discovery" / "v1" / "instances"
        registered = sum(1 for f in instances.rglob("*") if f.is_file()) if instances.is_dir() else 0
        if not models or edge != 200 or registered < self.config.schedulers:
            return False
        self.served_model = models[0]["id"]
        return True

    def _wait_ready(self) -> None:
        deadline = time.monotonic() + self.config.ready_timeout
        with httpx.Client(timeout=5) as http:
            while not self._registered(http):
                if time.monotonic() > deadline:
                    raise RuntimeError(f"the fleet was not ready after {self.config.ready_timeout:.0f} s:\n"
                                       + "\n".join(p.tail() for p in self.procs))
                time.sleep(0.5)

    # ---- tear-down ---------------------------------------------------------------------------------------------
    def stop(self) -> dict[str, int]:
        """SIGTERM to the edge, then the frontend and sidecars, then the schedulers (each waited for up to
        stop_timeout s, then its process group SIGKILLed); returns each process's exit code."""
        codes: dict[str, int] = {}
        order = (("edge-gateway",), ("frontend", "dynamo-worker"), ("scheduler",))
        for names in order:
            group = [p for p in self.procs if p.name.startswith(names)]
            for p in group:
                p.signal(signal.SIGTERM)
            deadline = time.monotonic() + self.config.stop_timeout
            for p in group:
                codes[p.name] = p.wait_or_kill(deadline - time.monotonic())
        self.procs = []
        if self._tmp is not None:
            self._tmp.cleanup()
            self._tmp = None
        return codes

    def logs(self, lines: int = 40) -> str:
        return "\n".join(p.tail(lines) for p in self.procs)


def check_chat(fleet: Fleet) -> str:
    """One chat completion through the edge with the openai SDK, as the first generated tenant."""
    import openai

    tenant = next(t for t in fleet.keys if t != OPS_TENANT)
    client = openai.OpenAI(base_url=f"{fleet.edge_url}/v1", api_key=fleet.keys[tenant], max_retries=0, timeout=300)
    r = client.chat.completions.create(model=fleet.served_model, max_tokens=16, temperature=0,
                                       messages=[{"role": "user", "content": "What is the capital of France?"}])
    if not r.usage or r.usage.completion_tokens < 1:
        raise RuntimeError(f"the edge answered no tokens: {r}")
    return r.choices[0].message.content or ""


def parse_args(argv: list[str] | None = None) -> argparse.Namespace:
    p = argparse.ArgumentParser(prog="deploy/fleet_local.py", description=__doc__.split("\n\n")[0],
                                epilog="See the module docstring (and README, 'Beyond one machine').")
    p.add_argument("--model", default="tiny-llama", help="built-in model name or a local HF directory")
    p.add_argument("--schedulers", type=int, default=2, help="pagedkv serve processes, each with a sidecar")
    p.add_argument("--router-mode", default="kv", help="Dynamo's --router-mode (kv, round-robin, random, ...)")
    p.add_argument("--tenants", type=int, default=4, help="tenants to generate keys for (tenant-0 ...)")
    p.add_argument("--edge-port", type=int, default=0, help="the edge gateway's port on 127.0.0.1 (0: a free one)")
    p.add_argument("--serve-arg", action="append", default=[], metavar="ARG",
                   help="one more argument for every pagedkv serve, e.g. --serve-arg=--num-pages=512 (repeat; "
                   "default: --threads 1)")
    p.add_argument("--frontend-arg", action="append", default=[], metavar="ARG",
                   help="one more argument for Dynamo's frontend (repeat; default: "
                   f"{' '.join(ROUTER_ARGS)}, see bench/NOTES.md session 21)")
    p.add_argument("--chat-template", default="", metavar="PATH",
                   help="chat template for a model without one (default: deploy/chat-template-plain.jinja)")
    p.add_argument("--no-require-tenant", action="store_true",
                   help="let requests reach the schedulers through Dynamo's frontend without the edge (as the "
                   "sidecars' ops tenant); by default the sidecars refuse them")
    p.add_argument("--workdir", default="", help="folder for secrets, keys, discovery and logs (default: a fresh "
                   "temporary one, removed at the end)")
    p.add_argument("--write-secrets", default="", metavar="DIR",
                   help="only write the tenants file, secrets and keys (as the fleet's own) into DIR unless its "
                   "tenants.toml exists, and exit (the compose profile's fleet-secrets service)")
    p.add_argument("--check", action="store_true",
                   help="start, send one chat completion through the edge with the openai SDK, print it, stop")
    args = p.parse_args(argv)
    if args.schedulers < 1:
        p.error("--schedulers: at least 1")
    return args


def main(argv: list[str] | None = None) -> int:
    args = parse_args(argv)
    if args.write_secrets:
        out = Path(args.write_secrets)
        if (out / "tenants.toml").exists():
            print(f"{out}/tenants.toml exists: kept")
        else:
            write_secrets(out, args.tenants)
            print(f"wrote {out}/tenants.toml, hop.secret, fleet.secret, keys.json, ops.key")
        return 0
    config = FleetConfig(model=args.model, schedulers=args.schedulers, router_mode=args.router_mode,
                         tenants=args.tenants, serve_args=args.serve_arg or ["--threads", "1"],
                         frontend_args=args.frontend_arg or list(ROUTER_ARGS),
                         chat_template=args.chat_template, edge_port=args.edge_port,
                         require_tenant=not args.no_require_tenant, workdir=args.workdir)
    fleet = Fleet(config)
    signal.signal(signal.SIGTERM, signal.default_int_handler)  # SIGTERM as Ctrl-C: KeyboardInterrupt, then stop()
    print(f"starting {args.schedulers} scheduler(s), their sidecars, Dynamo's frontend ({args.router_mode}) and the "
          "edge gateway ...", flush=True)
    try:
        fleet.start()
        print(json.dumps({"edge": f"{fleet.edge_url}/v1", "model": fleet.served_model, "frontend": fleet.frontend_url,
                          "schedulers": fleet.scheduler_addresses, "keys": str(fleet.workdir / "keys.json"),
                          "logs": str(fleet.workdir / "logs")}, indent=2), flush=True)
        if args.check:
            print(json.dumps({"chat": check_chat(fleet)}), flush=True)
            return 0
        print("serving; Ctrl-C stops", flush=True)
        while not (dead := [p for p in fleet.procs if not p.alive()]):
            time.sleep(1.0)
        print(f"{dead[0].name} exited with {dead[0].proc.returncode}:\n{dead[0].tail()}", file=sys.stderr)
        return 1
    except KeyboardInterrupt:
        return 0
    finally:
        codes = fleet.stop()
        print(json.dumps({"stopped": codes}), flush=True)


if __name__ == "__main__":
    sys.exit(main())
