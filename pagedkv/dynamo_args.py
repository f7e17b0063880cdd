"""``pagedkv dynamo-worker``'s flags (no Dynamo import here: ``pagedkv --help`` works without the extra)."""

from __future__ import annotations

import argparse
import os

from pagedkv.fleet_salt import FLEET_SECRET_ENV, FLEET_SECRET_FLAG
from pagedkv.trusted_hop import HOP_SECRET_ENV, HOP_SECRET_FLAG

DESCRIPTION = """A sidecar beside a pagedkv scheduler that makes it an NVIDIA Dynamo backend (Dynamo 1.6, its unified
backend API; install it with `make install-dynamo`). It registers the scheduler's model with Dynamo's discovery
(block size, pages and the longest length from the scheduler's ModelInfo; the tokenizer, config and chat template
from --model's directory, which Dynamo's frontend reads), takes Dynamo's pre-tokenized requests and streams them
through pagedkv's client (a stream its scheduler breaks, killed or restarted, is resumed exactly), relays the
scheduler's KV events (its --kv-events-rpc stream) to Dynamo's KV router, with each tenant's salt, and pushes its
page load. A request field
pagedkv cannot honour is refused (HTTP 400) naming it. A full scheduler queue is answered with Dynamo's
Disconnected, which its frontend migrates to another worker (--migration-limit >= 1); while the scheduler is not
SERVING (draining, restarting) this worker is taken out of Dynamo's discovery (a request that reaches it meanwhile
goes back to Dynamo, which tries another worker) and put back when it serves again.
A request the edge gateway signed a tenant for (header x-dynamo-meta-pagedkv-tenant) runs as that tenant: the
signature is checked with the fleet secret and the tenant asserted to the scheduler as a trusted hop."""


def add_args(p: argparse.ArgumentParser) -> None:
    p.add_argument("--address", default=os.environ.get("PAGEDKV_ADDRESS", "127.0.0.1:50051"),
                   help="the scheduler's HOST:PORT (default: $PAGEDKV_ADDRESS, else %(default)s)")
    p.add_argument("--model", required=True,
                   help="the model the scheduler serves: a built-in name (tiny-llama, smollm2-135m-instruct) or a "
                   "local Hugging Face directory; Dynamo's frontend reads its tokenizer, config and chat template")
    p.add_argument("--served-model-name", default="",
                   help="the name clients ask for (default: the scheduler's, from ModelInfo)")
    p.add_argument("--chat-template", default="", metavar="PATH",
                   help="a Jinja chat template for Dynamo's frontend when the model has none (Dynamo needs one to "
                   "register a model; without either, chat requests are answered with an error saying so and "
                   "only completions are served)")
    p.add_argument("--api-key", default=os.environ.get("PAGEDKV_API_KEY", ""),
                   help="the API key this worker calls the scheduler with (a scheduler with a tenants file): its "
                   "tenant is every request's unless the edge gateway asserted one; an admin tenant's key lets the "
                   "worker read the cluster's page load (default: $PAGEDKV_API_KEY)")
    p.add_argument(HOP_SECRET_FLAG, default="", metavar="PATH",
                   help="the scheduler's trusted-hop secret (the same file as its own flag), needed to assert a "
                   f"tenant the edge gateway signed (default: ${HOP_SECRET_ENV})")
    p.add_argument(FLEET_SECRET_FLAG, default="", metavar="PATH",
                   help="the fleet secret the edge gateway signs tenant assertions with "
                   f"(x-dynamo-meta-pagedkv-tenant); default: ${FLEET_SECRET_ENV}; none: a request carrying an "
                   "assertion is refused")
    p.add_argument("--require-tenant", action="store_true",
                   help="refuse a request that carries no tenant assertion (when clients can reach Dynamo's frontend "
                   "other than through the edge gateway)")
    p.add_argument("--load-interval", type=float, default=0.25, metavar="S",
                   help="how often the scheduler's page load is read; it is pushed to Dynamo's router when it "
                   "changed (default: %(default)s)")
    p.add_argument("--health-interval", type=float, default=0.5, metavar="S",
                   help="how often the scheduler's health is checked; while it is not SERVING this worker is out of "
                   "Dynamo's discovery (default: %(default)s)")
    p.add_argument("--connect-timeout", type=float, default=300.0, metavar="S",
                   help="how long to wait at start for the scheduler to serve (default: %(default)s)")
    p.add_argument("--no-kv-events", action="store_true",
                   help="publish neither KV events nor page load (Dynamo's router then routes by its own guesses)")
    g = p.add_argument_group("Dynamo")
    g.add_argument("--namespace", default=os.environ.get("DYN_NAMESPACE", "dynamo"),
                   help="Dynamo namespace (default: $DYN_NAMESPACE, else %(default)s); the frontend's --namespace")
    g.add_argument("--component", default="backend", help="Dynamo component (default: %(default)s)")
    g.add_argument("--endpoint", default="generate", help="Dynamo endpoint (default: %(default)s)")
    g.add_argument("--discovery-backend", default=os.environ.get("DYN_DISCOVERY_BACKEND", "etcd"),
                   choices=["etcd", "file", "kubernetes", "mem"],
                   help="Dynamo discovery (default: $DYN_DISCOVERY_BACKEND, else %(default)s; file: a directory "
                   "shared with the frontend, $DYN_FILE_KV)")
    g.add_argument("--request-plane", default=os.environ.get("DYN_REQUEST_PLANE", "tcp"), choices=["tcp", "nats"],
                   help="Dynamo request plane (default: $DYN_REQUEST_PLANE, else %(default)s)")
    g.add_argument("--event-plane", default=os.environ.get("DYN_EVENT_PLANE") or None, choices=["zmq", "nats"],
                   help="Dynamo event plane for KV events (default: $DYN_EVENT_PLANE, else Dynamo's choice)")
    p.add_argument("--log-format", choices=["json", "console", "auto"], default="auto",
                   help="json lines (a service), console, or auto: console on a terminal, json otherwise")
    from pagedkv.security import add_tls_client_args

    add_tls_client_args(p)
