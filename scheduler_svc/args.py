"""The scheduler's command-line flags (``pagedkv scheduler`` and ``pagedkv serve``) and their checks against the first
executor's description."""

from __future__ import annotations

import argparse
import os

from pagedkv import fleet_salt, logs, security, tool_calls, trusted_hop
from pagedkv.bounds import MIN_PROMPT_BYTES, PROMPT_BYTES_PER_TOKEN
from pagedkv.tenancy import API_KEY_ENV, MAX_INT
from scheduler_svc import fit, kv_events_config
from scheduler_svc.cluster import parse_address, read_executors_file
from scheduler_svc.grammar_gate import DEFAULT_COMPILES_PER_TENANT
from scheduler_svc.policy import SCHEDULING_POLICIES, Mode
from scheduler_svc.queue_bounds import DEFAULT_MAX_QUEUED_REQUESTS, DEFAULT_MAX_QUEUED_TOTAL
from scheduler_svc.retention import DEFAULT_MAX_SHARE, DEFAULT_MAX_TTL_S
from scheduler_svc.template_pool import TemplateLimits
from scheduler_svc.validation import DEFAULT_MAX_LOGPROBS

MAX_MODEL_NAME_CHARS = 256


def add_args(p: argparse.ArgumentParser) -> None:
    p.add_argument("--executor", action="append", default=[], metavar="HOST:PORT",
                   help="an executor to drive; repeat for several. A DNS name that resolves to several addresses "
                   "means one executor each, re-resolved every --resolve-interval seconds")
    p.add_argument("--executors-file", default="", metavar="PATH",
                   help="file of executor HOST:PORT lines (# comments), re-read every --resolve-interval seconds "
                   "and on SIGHUP: executors join and leave at run time")
    p.add_argument("--resolve-interval", type=float, default=10.0,
                   help="seconds between re-resolving executor names and re-reading the executors file")
    p.add_argument("--drain-timeout", type=float, default=30.0,
                   help="seconds a draining executor (SIGTERM, or no longer listed) may finish its running "
                   "requests before they move to other executors")
    p.add_argument("--unplaced-timeout", type=float, default=30.0,
                   help="seconds a request waits when no executor is up before it ends with an error")
    p.add_argument("--shutdown-timeout", type=float, default=30.0,
                   help="on SIGTERM: seconds in-flight streams get to finish (new requests get UNAVAILABLE)")
    p.add_argument("--host", default="127.0.0.1")
    p.add_argument("--port", type=int, default=50051)
    p.add_argument("--max-num-seqs", type=int, default=256, help="most requests running at once")
    p.add_argument("--max-num-batched-tokens", type=int, default=2048,
                   help="most tokens computed in one step (prefills are chunked to fit)")
    p.add_argument("--target-tpot-ms", type=float, default=0.0, metavar="MS",
                   help="a step that carries decode rows takes only the prefill tokens the executor's measured step "
                   "times say fit in MS beside them (at least a page's worth), so prefills stop stretching the time "
                   "per output token; steps without decode rows take the full --max-num-batched-tokens "
                   "(0: off, every step may take it)")
    p.add_argument("--target-ttft-ms", type=float, default=0.0, metavar="MS",
                   help="with --target-tpot-ms: a step takes the full --max-num-batched-tokens once a request still "
                   "without its first token has waited MS (0: never)")
    p.add_argument("--max-model-len", type=int, default=0,
                   help="longest prompt + output in tokens (default: the model's max_position_embeddings, "
                   "capped to what the executor's page pool holds)")
    p.add_argument("--enable-prefix-caching", action=argparse.BooleanOptionalAction, default=True,
                   help="share and reuse the KV pages of common prompt prefixes (per tenant)")
    p.add_argument("--kv-retention-max-ttl", type=int, default=DEFAULT_MAX_TTL_S, metavar="SECONDS",
                   help="longest time a request's KV may stay retained after it ends (GenerateRequest.retain_kv.ttl_s, "
                   "the Responses API's stored conversations; default: %(default)s s)")
    p.add_argument("--kv-retention-max-share", type=float, default=DEFAULT_MAX_SHARE, metavar="FRACTION",
                   help="most of a tenant's page quota (of the pool without one) its retained KV may hold; its oldest "
                   "retentions make room for a new one; 0: keep none (default: %(default)s)")
    p.add_argument("--preemption-mode", choices=[m.value for m in Mode], default="auto",
                   help="when KV pages run out: auto = per victim, swap to the host tier or recompute, whichever "
                   "the executor's measured copy bandwidth and prefill cost make cheaper")
    p.add_argument("--hot-steps", type=int, default=64,
                   help="a request scheduled within this many steps is hot: not a victim while another exists")
    p.add_argument("--cold-steps", type=int, default=512,
                   help="a request not scheduled for this many steps is cold: the first victim")
    p.add_argument("--swap-in-max-wait", type=int, default=64,
                   help="steps a swapped-out request yields to new prefills before it goes ahead of them")
    p.add_argument("--tenants-file", default="",
                   help="TOML file of tenants (format: docs/tenants.md): hashed API keys, weights, page quotas, "
                   "reserved pages, request limits, page budgets (default: single-tenant, no keys). Reloaded on "
                   "SIGHUP: a stream opened "
                   "with a key the reload revokes or removes ends with UNAUTHENTICATED")
    p.add_argument("--api-key", default=os.environ.get(API_KEY_ENV, ""), metavar="KEY",
                   help="one API key every caller must send (gRPC 'authorization: Bearer KEY' metadata, HTTP "
                   "'Authorization: Bearer KEY' through the gateway), as vLLM's --api-key, for a server without a "
                   f"tenants file; refused together with --tenants-file (default: ${API_KEY_ENV}; none: no key asked)")
    p.add_argument(trusted_hop.HOP_SECRET_FLAG, default="", metavar="PATH",
                   help="file holding the trusted-hop secret: a caller presenting it as metadata "
                   f"'{trusted_hop.HOP_HEADER}: <secret>' (the Dynamo sidecar, a gateway in front of this scheduler) "
                   f"may name a request's tenant ({trusted_hop.TENANT_HEADER}, or GIE's "
                   f"{trusted_hop.FAIRNESS_ID_HEADER}) instead of sending its API key, and its GIE objective "
                   f"({trusted_hop.OBJECTIVE_HEADER}, see --objective); the tenant's quotas, budgets, fairness and "
                   "prefix-cache namespace apply as with its key. From anyone else those headers are refused "
                   f"(PERMISSION_DENIED). Default: ${trusted_hop.HOP_SECRET_ENV} (the secret itself); none: no hop "
                   "is trusted")
    p.add_argument("--objective", action="append", default=[], metavar="NAME=PRIORITY",
                   help=f"a GIE objective a trusted hop may name ({trusted_hop.OBJECTIVE_HEADER}: NAME) and the "
                   "priority its requests get (lower is more important, as a request's priority; [-1000, 1000]); "
                   "repeat for each. An objective not listed is refused with INVALID_ARGUMENT naming it")
    p.add_argument(fleet_salt.FLEET_SECRET_FLAG, default="", metavar="PATH",
                   help="file holding the fleet secret (at least 16 bytes) the scheduler and the edge gateway share: "
                   "each tenant's KV events carry a salt derived from it (HMAC of the tenant), the one the edge sets "
                   "as Dynamo's nvext.cache_salt, so a fleet router keeps tenants apart and none can guess another's "
                   f"salt. Needed for KV events with a tenants file. Default: ${fleet_salt.FLEET_SECRET_ENV} (the "
                   "secret itself)")
    p.add_argument("--kv-events-rpc", action="store_true",
                   help="serve the KV event stream (pages stored, removed, cleared; the union over the executors) "
                   "as the gRPC service pagedkv.kvevents.v1.KvEvents on this port, for pagedkv dynamo-worker: only "
                   "the executor secret's or the trusted hop's bearer, or an admin tenant, may watch it (it carries "
                   "every tenant's prompt tokens)")
    p.add_argument("--max-queued-requests", type=int, default=DEFAULT_MAX_QUEUED_REQUESTS, metavar="N",
                   help="requests of one tenant that may wait to start (its max_queued_requests in the tenants "
                   "file overrides); past it a new request gets RESOURCE_EXHAUSTED 'queue full: ...' (default "
                   "%(default)s; 0: no limit)")
    p.add_argument("--max-queued-total", type=int, default=DEFAULT_MAX_QUEUED_TOTAL, metavar="N",
                   help="requests of all tenants together that may wait to start on this scheduler; past it a new "
                   "request gets RESOURCE_EXHAUSTED 'queue full: ...' (default %(default)s; 0: no limit)")
    p.add_argument("--max-compiles-per-tenant", type=int, default=DEFAULT_COMPILES_PER_TENANT, metavar="N",
                   help="structured outputs: constraint compiles of one tenant asked of the executors at once; its "
                   "other constrained requests wait their turn, counted as queued (default: %(default)s)")
    p.add_argument("--fairness", action=argparse.BooleanOptionalAction, default=True,
                   help="admit across tenants by weighted service (VTC); --no-fairness: arrival order")
    p.add_argument("--scheduling-policy", choices=SCHEDULING_POLICIES, default="fcfs",
                   help="order of a tenant's own waiting requests, as vLLM's flag: fcfs = arrival order; priority = "
                   "the lowest priority value first (a request's priority, the OpenAI body's priority, a trusted "
                   "hop's --objective; ties by arrival), and a waiting request that could not start takes the seat "
                   "or pages of its tenant's less important running requests (swapped or recomputed, whichever is "
                   "cheaper). Across tenants the fair share decides either way; a tenant asks for at most its "
                   "tenants-file max_priority. Under fcfs (vLLM's default too) a priority orders only preemption "
                   "victims")
    p.add_argument("--sliding-window", type=int, default=0, metavar="N",
                   help="serve every request with attention over the sink plus its last N tokens; pages wholly "
                   "outside are freed at once (0: full attention; a tenant's sliding_window overrides)")
    p.add_argument("--sink-tokens", type=int, default=0, metavar="S",
                   help="attention-sink tokens kept at the start of a windowed request")
    p.add_argument("--tokenizer", default="", help="tokenizer directory (default: the executor's model directory)")
    p.add_argument("--served-model-name", action="extend", nargs="+", default=[], metavar="NAME",
                   help="the name(s) the model is served under, as vLLM's: --served-model-name a b (or the flag "
                   "repeated); the first is ModelInfo's model and the one answers report, all are in ModelInfo's "
                   "served_model_names and so in the gateway's /v1/models, and a request naming another model gets "
                   "404 model_not_found there (default: the executor's --model as given: a built-in name, or the "
                   "directory)")
    p.add_argument("--chat-template", default="", metavar="FILE|TEMPLATE",
                   help="the chat template for chat requests, as vLLM's: a Jinja file, or the template itself; for "
                   "a checkpoint without one, or instead of its own. Checked at start-up: a missing file or a "
                   "template that does not compile stops it (default: the checkpoint's, from its "
                   "tokenizer_config.json or chat_template.jinja)")
    p.add_argument("--trust-request-chat-template", action="store_true",
                   help="render a chat request's own chat_template (a Jinja template: code, run in the sandbox "
                   "transformers uses, in a worker process bounded by --chat-template-timeout and "
                   "--chat-template-memory, its text by --max-prompt-bytes); off by default, as in vLLM: such a "
                   "request is refused, and one naming one of the model's templates is taken")
    p.add_argument("--chat-template-timeout", type=float, default=TemplateLimits().timeout_s, metavar="SECONDS",
                   help="seconds a request's own chat template may take to render; past it its worker process is "
                   "killed and the request gets INVALID_ARGUMENT naming its chat_template and this flag (default "
                   "%(default)s)")
    p.add_argument("--chat-template-workers", type=int, default=TemplateLimits().workers, metavar="N",
                   help="worker processes that render requests' own chat templates, started as needed; one tenant "
                   "renders at most half of them at once (at least one), its further requests wait for its own "
                   "(default %(default)s)")
    p.add_argument("--chat-template-memory", type=int, default=TemplateLimits().memory_bytes >> 20, metavar="MIB",
                   help="address space of a chat template worker in MiB (RLIMIT_AS); a render that needs more gets "
                   "INVALID_ARGUMENT naming this flag (default %(default)s)")
    p.add_argument("--tool-call-parser", default=tool_calls.AUTO, choices=tool_calls.PARSER_CHOICES,
                   metavar="PARSER",
                   help="how a chat request with tools and tool_choice auto (the default with tools) has its output "
                   f"read into tool calls: {', '.join(tool_calls.PARSERS)} (Hermes/Qwen <tool_call>{{...}}</tool_call>;"
                   " Llama 3.x JSON {\"name\", \"parameters\"} after <|python_tag|>; Mistral [TOOL_CALLS][...]); "
                   "auto: the one the chat template's markup names (said at start-up: the tool_call_parser log "
                   "line), tool_choice auto refused with 400 naming this flag when it names none; none: tool_choice "
                   "auto refused. Required, named and none choices need no parser (the grammar writes the calls) "
                   "(default %(default)s)")
    p.add_argument("--connect-timeout", type=float, default=120.0, help="seconds to wait for the executor")
    p.add_argument("--step-timeout", type=float, default=300.0,
                   help="seconds an executor may take for one step before it is considered failed")
    p.add_argument("--async-scheduling", action=argparse.BooleanOptionalAction, default=True,
                   help="build and send each step's plan while the executor still runs the one before (just before "
                   "that one should end, so requests arriving meanwhile are in it), so it never waits for the "
                   "scheduler (a sample that ends a request wastes the one token computed ahead)")
    p.add_argument("--check-integrity", action="store_true",
                   help="check page accounting after every step (always checked when idle)")
    p.add_argument("--max-prompt-bytes", type=int, default=0, metavar="N",
                   help="longest prompt text (Generate) or Tokenize text in UTF-8 bytes, refused with "
                   "INVALID_ARGUMENT before it is tokenized (default: "
                   f"{PROMPT_BYTES_PER_TOKEN} bytes per token of max_model_len, at least {MIN_PROMPT_BYTES}). "
                   "A request message larger than this (or a full context of token ids, if more) plus a "
                   "continuation's token ids (a full context for each of 16 forks, 5 bytes an id) and 64 KiB is "
                   "refused by gRPC with RESOURCE_EXHAUSTED before it is read")
    p.add_argument("--max-logprobs", type=int, default=DEFAULT_MAX_LOGPROBS, metavar="N",
                   help="most top_logprobs and prompt_logprobs a request may ask for (the OpenAI API's completions "
                   "logprobs, chat top_logprobs, vLLM's prompt_logprobs): more is refused with INVALID_ARGUMENT "
                   "(HTTP 400) naming the field and this limit (default: %(default)s, as vLLM)")
    p.add_argument("--metrics-port", type=int, default=0, help="Prometheus metrics HTTP port (0: off)")
    p.add_argument("--metrics-host", default="", metavar="HOST",
                   help="address /metrics listens on (default: --host); e.g. an internal interface while the "
                   "API is public (/metrics has no authentication; it shows tenant ids, never keys)")
    p.add_argument("--log-prompts", action="store_true",
                   help="put each request's prompt (text, or token ids) in its request_admitted log line; off by "
                   "default: logs carry request ids, tenants and token counts, never prompt text")
    p.add_argument("--log-format", choices=["auto", "json", "console"], default="auto",
                   help="auto: readable on a terminal, JSON lines otherwise (services, containers)")
    logs.add_log_level_arg(p)
    p.add_argument("--log-stats-interval", type=float, default=10.0, metavar="SECONDS",
                   help="every SECONDS, one INFO line of the scheduler's stats, as vLLM's: prompt and generation "
                   "tok/s, requests running, waiting and swapped, KV cache usage %%, prefix cache hit rate; only "
                   "after activity (0: off; default %(default)s)")
    add_kv_events_args(p)
    add_tls_args(p)


def add_kv_events_args(p: argparse.ArgumentParser) -> None:
    """The KV event stream for fleet routers (Dynamo, llm-d), in vLLM's format and with vLLM's config keys."""
    p.add_argument(kv_events_config.CONFIG_FLAG, default="", metavar="JSON",
                   help="publish the scheduler's KV events (pages stored, removed, cleared) on ZMQ in vLLM's wire "
                   "format, with vLLM's KVEventsConfig keys: enable_kv_cache_events, publisher (zmq, null), "
                   f"endpoint (default {kv_events_config.DEFAULT_ENDPOINT}), replay_endpoint, buffer_steps, hwm, "
                   "max_queue_size, topic (default kv@<host>@<served model name>); e.g. "
                   "'{\"enable_kv_cache_events\": true, \"replay_endpoint\": \"tcp://127.0.0.1:5558\"}'. The "
                   "events carry every tenant's prompt tokens: an endpoint beyond loopback needs CURVE keys")
    p.add_argument(kv_events_config.CURVE_SECRET_FLAG, default="", metavar="PATH",
                   help="the KV event publisher's CURVE keypair, a ZMQ certificate with its secret key "
                   "(zmq.auth.create_certificates writes NAME.key_secret): events are encrypted and only "
                   f"subscribers whose public key is in {kv_events_config.CURVE_CLIENTS_FLAG} are let in")
    p.add_argument(kv_events_config.CURVE_CLIENTS_FLAG, default="", metavar="DIR",
                   help="directory of the public keys (ZMQ certificates, *.key) of the subscribers allowed to "
                   "read the KV events")


def add_tls_args(p: argparse.ArgumentParser) -> None:
    """The public port's TLS, and how the scheduler authenticates to (and verifies) its executors."""
    security.add_tls_server_args(p)
    security.add_secret_arg(p, "scheduler")
    p.add_argument("--executor-tls-ca", default="", metavar="PATH",
                   help="connect to executors with TLS, trusting the CA certificate(s) in PATH (the executors' "
                   "--tls-cert must be signed by it; default: plaintext)")
    p.add_argument("--executor-tls-server-name", default="", metavar="NAME",
                   help="check every executor's certificate against NAME instead of its address (executors "
                   "reached by IP, e.g. a DNS name resolved to several containers: their certificate names NAME)")


def model_window(args, describe) -> int:
    """The model's own window (every layer attends to at most its last N tokens), when the scheduler frees
    pages by it: when its pages (with --sink-tokens) fit the executor's pool; 0 otherwise (then requests hold
    their whole context, capped to the pool, as for a model without a window)."""
    window = describe.model_sliding_window
    if window and fit.window_pages(args.sink_tokens, window, describe.block_size) <= describe.num_device_pages:
        return window
    return 0


def check_args(args, describe, log) -> int:
    bad_name = next((n for n in args.served_model_name if not 0 < len(n) <= MAX_MODEL_NAME_CHARS), None)
    if bad_name is not None:
        raise ValueError(f"--served-model-name {bad_name[:32]!r}: each name must have 1 to {MAX_MODEL_NAME_CHARS} "
                         "characters")
    for name in ("max_num_seqs", "max_num_batched_tokens", "max_compiles_per_tenant"):
        if getattr(args, name) < 1:
            raise ValueError(f"--{name.replace('_', '-')} must be >= 1, got {getattr(args, name)}")
    for name in ("sliding_window", "sink_tokens", "max_logprobs"):
        if getattr(args, name) < 0:
            raise ValueError(f"--{name.replace('_', '-')} must be >= 0, got {getattr(args, name)}")
    for name in ("target_tpot_ms", "target_ttft_ms"):
        value = getattr(args, name)
        if not 0.0 <= value <= 3_600_000:  # (NaN too)
            raise ValueError(f"--{name.replace('_', '-')} must be in [0, 3600000] ms (0: off), got {value}")
    if args.target_ttft_ms and not args.target_tpot_ms:
        raise ValueError("--target-ttft-ms needs --target-tpot-ms (it says when a step may exceed that target)")
    if args.kv_retention_max_ttl < 1 or not 0.0 <= args.kv_retention_max_share <= 1.0:
        raise ValueError(f"--kv-retention-max-ttl {args.kv_retention_max_ttl} must be >= 1 s and "
                         f"--kv-retention-max-share {args.kv_retention_max_share} in [0, 1]")
    for name in ("max_queued_requests", "max_queued_total"):
        if not 0 <= getattr(args, name) <= MAX_INT:
            raise ValueError(f"--{name.replace('_', '-')} must be in [0, {MAX_INT}] (0: no limit), got "
                             f"{getattr(args, name)}")
    max_len = args.max_model_len or describe.max_position_embeddings
    pool_tokens = describe.num_device_pages * describe.block_size
    if args.sliding_window:
        window_pages = fit.window_pages(args.sink_tokens, args.sliding_window, describe.block_size)
        if window_pages > describe.num_device_pages:
            raise ValueError(f"--sliding-window {args.sliding_window} + --sink-tokens {args.sink_tokens} need "
                             f"{window_pages} pages; the executor has {describe.num_device_pages}")
    if args.sliding_window or model_window(args, describe):
        # every request holds only its sink + window: contexts may exceed the pool
        if not 1 < max_len <= describe.max_position_embeddings:
            raise ValueError(f"--max-model-len {max_len}: must be in [2, {describe.max_position_embeddings}]")
        return max_len
    if not args.max_model_len and max_len > pool_tokens:
        log.warning("max_model_len_capped", model_max=max_len, pool_tokens=pool_tokens,
                    hint="give the executor more pages to serve the model's full context")
        max_len = pool_tokens
    if not 1 < max_len <= describe.max_position_embeddings:
        raise ValueError(f"--max-model-len {max_len}: must be in [2, {describe.max_position_embeddings}] "
                         "(the model's max_position_embeddings)")
    pages_needed = fit.pages_for(max_len, describe.block_size)
    if pages_needed > describe.num_device_pages:
        raise ValueError(
            f"--max-model-len {max_len} needs {pages_needed} pages of {describe.block_size} tokens but the "
            f"executor has {describe.num_device_pages} (at most --max-model-len "
            f"{describe.num_device_pages * describe.block_size} fits); lower --max-model-len or give the executor "
            "more pages (--num-pages, --kv-cache-gb)")
    return max_len


def targets(args) -> list[str]:
    targets = list(args.executor)
    if args.executors_file:
        targets += read_executors_file(args.executors_file)
    if not targets:
        raise ValueError("no executor: give --executor HOST:PORT (repeatable) or --executors-file")
    for t in args.executor:
        parse_address(t)
    return targets
