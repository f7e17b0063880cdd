"""Scheduler process: find the executors, connect to them, then serve the public API."""

from __future__ import annotations

import asyncio
import os
import signal

from pagedkv import fleet_salt, grpc_common, logs, runtime, security, tool_calls, trusted_hop
from pagedkv.api.v1 import api_pb2 as api
from pagedkv.api.v1 import api_pb2_grpc as api_grpc
from pagedkv.bounds import MAX_PROMPT_BYTES, default_max_prompt_bytes, max_request_bytes
from pagedkv.grpc_guard import DecodeGuard
from pagedkv.tenancy import DEFAULT_TENANT, InvalidTenant, Tenant, Tenants
from scheduler_svc import fit, kv_events_config, kv_events_zmq, metrics
from scheduler_svc.api import GenerationService
from scheduler_svc.args import check_args, model_window, targets
from scheduler_svc.chat_template_arg import load_chat_template, use_chat_template
from scheduler_svc.cluster import Cluster, resolve
from scheduler_svc.executor_client import ExecutorClient, ExecutorLink, ExecutorUnavailable
from scheduler_svc.kv_events import KvEventLog, missing_secret_problem
from scheduler_svc.kv_events_rpc import InternalCallers, add_kv_events
from scheduler_svc.pages import tier_pools
from scheduler_svc.policy import Mode, PreemptionConfig, PreemptionCosts
from scheduler_svc.queue_bounds import QueueBounds
from scheduler_svc.scheduler import Scheduler, SchedulerConfig
from scheduler_svc.stats_log import log_stats
from scheduler_svc.template_pool import TemplateLimits, TemplatePool
from scheduler_svc.tenant_ledger import TenantLedger
from scheduler_svc.tokenizer import load_tokenizer
from scheduler_svc.trusted_hop import TrustedHops
from scheduler_svc.validation import Limits, SamplingDefaults

SERVICE = api.DESCRIPTOR.services_by_name["Generation"].full_name


def _executor_link(args, log) -> ExecutorLink:
    """The secret and TLS settings of every executor connection, checked before any executor is tried."""
    secret = security.load_executor_secret(args.executor_secret_file)
    if args.executor_tls_ca:
        security.channel_credentials(args.executor_tls_ca, "--executor-tls-ca")  # readable and PEM, now
    elif args.executor_tls_server_name:
        raise ValueError("--executor-tls-server-name needs --executor-tls-ca (it names the certificate to verify)")
    if not secret:
        log.warning("executor_secret_missing", hint=f"executors refuse this scheduler unless they run with --insecure; "
                    f"give {security.SECRET_FILE_FLAG} (or ${security.EXECUTOR_SECRET_ENV}) with their secret")
    return ExecutorLink(secret, args.executor_tls_ca, args.executor_tls_server_name)


def _warn_plaintext_executors(addresses: set[str], link: ExecutorLink, log) -> None:
    remote = sorted(a for a in addresses if not security.is_loopback(a.rpartition(":")[0]))
    if remote and not link.tls_ca:
        log.warning("insecure_executor_link", executors=remote,
                    risk="plaintext gRPC to executors beyond loopback: the executor secret, prompts' token ids and "
                    "outputs cross the network in clear",
                    hint="give the executors --tls-cert/--tls-key and this scheduler --executor-tls-ca")


class _Stopped(Exception):
    pass


async def _unless_stopped(coro, stop: asyncio.Event):
    """coro's result, unless ``stop`` is set first (then coro is cancelled and _Stopped raised)."""
    task = asyncio.ensure_future(coro)
    waiter = asyncio.ensure_future(stop.wait())
    await asyncio.wait({task, waiter}, return_when=asyncio.FIRST_COMPLETED)
    waiter.cancel()
    if task.done():
        return task.result()
    task.cancel()
    raise _Stopped


async def _resolve_until(targets: list[str], timeout: float, log) -> set[str]:
    """The executors' addresses; a DNS name may not resolve yet (its containers are starting): retry."""
    deadline = asyncio.get_running_loop().time() + timeout
    while True:
        try:
            found = await asyncio.to_thread(resolve, targets)
            if found:
                return found
        except OSError as err:
            if asyncio.get_running_loop().time() >= deadline:
                raise ValueError(f"--executor {' '.join(targets)}: cannot resolve within {timeout:.0f}s: "
                                 f"{err}") from err
            log.info("executors_not_resolved_yet", targets=targets, error=str(err))
        await asyncio.sleep(1.0)


async def _first_executor(addresses: set[str], timeout: float, step_timeout: float, log,
                          link: ExecutorLink | None = None):
    """The description of the first executor that answers within ``timeout`` (the model the cluster
    serves; later executors must serve the same)."""
    clients = [ExecutorClient(a, step_timeout, link) for a in sorted(addresses)]
    try:
        probes = [asyncio.ensure_future(c.probe(timeout)) for c in clients]
        errors = []
        for done in asyncio.as_completed(probes):
            try:
                return await done
            except ExecutorUnavailable as err:
                errors.append(str(err))
        raise ValueError("no executor answered: " + "; ".join(errors))
    finally:
        for p in probes:
            p.cancel()
        await asyncio.gather(*(c.close() for c in clients), return_exceptions=True)


async def serve(args) -> None:
    log = logs.configure("scheduler", json=logs.wants_json(args.log_format), level=args.log_level)
    preemption = PreemptionConfig(mode=Mode(args.preemption_mode), hot_steps=args.hot_steps,
                                  cold_steps=args.cold_steps, swap_in_max_wait=args.swap_in_max_wait)
    for name in ("drain_timeout", "unplaced_timeout", "shutdown_timeout", "resolve_interval", "step_timeout",
                 "connect_timeout"):
        if getattr(args, name) <= 0:
            raise ValueError(f"--{name.replace('_', '-')} must be > 0, got {getattr(args, name)}")
    if args.log_stats_interval < 0:
        raise ValueError(f"--log-stats-interval must be >= 0 (0: off), got {args.log_stats_interval}")
    if args.api_key and args.tenants_file:  # (Tenants.from_flags says why, before any executor is tried)
        Tenants.from_flags(args.tenants_file, args.api_key, 0)
    chat_template = load_chat_template(args.chat_template)  # (a missing file or a bad template: stop now)
    link = _executor_link(args, log)
    hop_secret = trusted_hop.load_hop_secret(args.trusted_hop_secret_file)
    hops = TrustedHops(hop_secret, trusted_hop.parse_objectives(args.objective))  # (errors before executors are tried)
    fleet_secret = fleet_salt.load_fleet_secret(args.fleet_secret_file)
    kv_zmq = kv_events_config.from_args(args)  # (--kv-events-config and its CURVE keys, before executors are tried)
    credentials = security.server_credentials(args.tls_cert, args.tls_key)
    loop = asyncio.get_running_loop()
    stop = asyncio.Event()  # SIGTERM/SIGINT, also while starting (e.g. waiting for executors)
    for sig in (signal.SIGINT, signal.SIGTERM):
        loop.add_signal_handler(sig, stop.set)
    try:
        addresses = await _unless_stopped(_resolve_until(targets(args), args.connect_timeout, log), stop)
        _warn_plaintext_executors(addresses, link, log)
        describe = await _unless_stopped(_first_executor(addresses, args.connect_timeout, args.step_timeout, log,
                                                         link), stop)
    except _Stopped:
        log.info("scheduler_stopped", during="start-up")
        return
    max_len = check_args(args, describe, log)
    templates = TemplatePool(TemplateLimits(args.chat_template_timeout, args.chat_template_workers,
                                            args.chat_template_memory << 20), log)  # (workers start when used)
    tokenizer = load_tokenizer(args.tokenizer or describe.model_path, log)  # tokenizers alone where that suffices
    use_chat_template(tokenizer, chat_template, log)
    config = SchedulerConfig(max_num_seqs=args.max_num_seqs, max_num_batched_tokens=args.max_num_batched_tokens,
                             max_model_len=max_len, enable_prefix_caching=args.enable_prefix_caching,
                             preemption=preemption, fairness=args.fairness, sliding_window=args.sliding_window,
                             scheduling_policy=args.scheduling_policy, target_tpot_s=args.target_tpot_ms / 1e3,
                             target_ttft_s=args.target_ttft_ms / 1e3,
                             sink_tokens=args.sink_tokens, model_window=model_window(args, describe),
                             kv_retention_max_share=args.kv_retention_max_share,
                             exact_tail_pages=describe.exact_tail_pages)
    # Tenant limits are the scheduler's, over all its executors: page counts are checked (and fractions resolved)
    # against the pages the executors found now will hold, assuming each the size of the first; the cluster
    # resolves them again from the actual pools of the executors that serve as executors join, leave, go down
    # and come back, and cuts a count that does not fit them (tenant_ledger.py, Tenants.resolve).
    expected_pages = describe.num_device_pages * max(1, len(addresses))
    try:
        tenants = Tenants.from_flags(args.tenants_file, args.api_key, expected_pages)
    except InvalidTenant as err:
        raise ValueError(str(err)) from err
    if tenants.multi:
        log.info("tenants_loaded", path=args.tenants_file, tenants=sorted(tenants.by_id), fairness=args.fairness,
                 pages=expected_pages, executors=len(addresses))
    else:
        log.info("single_tenant", api_key=tenants.keyed, hint="no --tenants-file: every caller is tenant 'default', "
                 + ("who must send --api-key's key" if tenants.keyed else "no API key asked"))

    wants_events = args.kv_events_rpc or kv_zmq is not None
    if wants_events and missing_secret_problem(tenants.multi, fleet_secret):
        raise ValueError(missing_secret_problem(tenants.multi, fleet_secret))
    default_window = fit.attention_window(Tenant(DEFAULT_TENANT), args.sliding_window, args.sink_tokens, 0,
                                          describe.block_size, model_window(args, describe))
    events = KvEventLog(describe.block_size, salt_secret=fleet_secret, default_window=default_window,
                        adapters=tuple(a.name for a in describe.adapters if not a.runtime)) if wants_events else None

    def make_scheduler(d, ledger: TenantLedger) -> Scheduler:
        pool, host = tier_pools(d.num_device_pages, d.block_size, d.num_host_pages, events)
        return Scheduler(pool, config, list(d.eos_token_ids), host, PreemptionCosts.of(d), ledger=ledger)

    # NOTE: the cluster owns the tenants: their limits hold for the sum over its executors (tenant_ledger.py)
    cluster = Cluster(describe, make_scheduler, log, step_timeout=args.step_timeout,
                      check_every_step=args.check_integrity, drain_timeout=args.drain_timeout,
                      unplaced_timeout=args.unplaced_timeout, link=link, tenants=tenants,
                      async_scheduling=args.async_scheduling, compiles_per_tenant=args.max_compiles_per_tenant)
    cluster.start()
    cluster.set_addresses(addresses)
    try:
        await _unless_stopped(asyncio.wait_for(cluster.any_up.wait(), args.connect_timeout), stop)
    except asyncio.TimeoutError:
        await cluster.stop()
        raise ValueError(f"no executor came up within --connect-timeout {args.connect_timeout:.0f}s") from None
    except _Stopped:
        await cluster.stop()
        log.info("scheduler_stopped", during="start-up")
        return
    prompt_bytes = args.max_prompt_bytes or default_max_prompt_bytes(max_len)
    if not 0 < prompt_bytes <= MAX_PROMPT_BYTES:
        raise ValueError(f"--max-prompt-bytes {args.max_prompt_bytes}: must be in [1, {MAX_PROMPT_BYTES}]")
    defaults = SamplingDefaults.of(describe)  # the checkpoint's, for fields a request leaves unset
    limits = Limits(max_model_len=max_len, vocab_size=describe.vocab_size, max_prompt_bytes=prompt_bytes,
                    sampling_defaults=defaults, max_logprobs=args.max_logprobs,
                    max_retain_ttl_s=args.kv_retention_max_ttl)
    names = list(dict.fromkeys(args.served_model_name)) or [describe.model]  # (in order, each once)
    publishing = None
    if kv_zmq is not None:  # (its sockets bound now: a port in use stops the start)
        publishing = kv_events_zmq.start_publishing(kv_zmq[0].with_default_topic(names[0]), kv_zmq[1], events, log)
    info = dict(model=names[0], served_model_names=names, max_model_len=max_len, block_size=describe.block_size,
                vocab_size=describe.vocab_size, dtype=describe.dtype, attention_backend=describe.attention_backend,
                kv_dtype=describe.kv_dtype, kv_bytes_per_token=describe.kv_bytes_per_token,
                max_logprobs=min(args.max_logprobs, describe.vocab_size),
                sampling_defaults=api.SamplingDefaults(temperature=defaults.temperature, top_p=defaults.top_p,
                                                       top_k=defaults.top_k,
                                                       repetition_penalty=defaults.repetition_penalty,
                                                       min_p=defaults.min_p))

    def undecodable(method: str, peer: str, reason: str) -> None:
        metrics.UNDECODABLE_REQUESTS.inc()
        log.info("request_undecodable", method=method, peer=peer, error=reason)

    max_request = max_request_bytes(prompt_bytes, max_len)
    server = grpc_common.new_server(max_receive_bytes=max_request, interceptors=[DecodeGuard(undecodable)])
    service = GenerationService(cluster, tokenizer, limits, info, log, log_prompts=args.log_prompts,
                                queue_bounds=QueueBounds(args.max_queued_requests, args.max_queued_total),
                                trust_request_templates=args.trust_request_chat_template,
                                tool_call_parser=args.tool_call_parser, hops=hops)
    service.prompts.use_template_pool(templates)
    api_grpc.add_GenerationServicer_to_server(service, server)
    services = [SERVICE]
    if events is not None:
        services.append(add_kv_events(server, events, InternalCallers(lambda: cluster.tenants, link.secret, hop_secret),
                                      log))
    health = grpc_common.add_health_and_reflection(server, services)
    port = grpc_common.bind(server, args.host, args.port, credentials)
    security.warn_if_exposed(log, "scheduler", args.host, port, tls=credentials is not None)
    if args.metrics_port:
        import prometheus_client

        prometheus_client.start_http_server(args.metrics_port, addr=args.metrics_host or args.host)
    # NOTE: what start-up built is frozen out of the collector, and young collections come less often. Measured
    # in-process at 1,024 running: the p99 of result processing 17-20 ms -> 8 ms (freeze), then -> 1.9 ms and its
    # median 2.08 -> 1.62 ms (threshold) (bench/NOTES.md).
    runtime.settle_gc()
    await server.start()
    await grpc_common.set_serving(health, services, True)
    parser, source = tool_calls.server_parser(args.tool_call_parser, getattr(tokenizer, "chat_template", None))
    log.info("tool_call_parser", parser=parser or tool_calls.NONE, source=source, flag=args.tool_call_parser,
             tool_choice_auto="read with " + parser if parser else "refused: 400 naming --tool-call-parser")
    log.info("scheduler_ready", address=f"{args.host}:{port}", executors=sorted(addresses), pid=os.getpid(),
             tls=credentials is not None, executor_tls=bool(link.tls_ca), executor_secret=bool(link.secret),
             trusted_hop=hops.enabled, objectives=sorted(hops.objectives) or None,
             num_pages=describe.num_device_pages, num_host_pages=describe.num_host_pages,
             block_size=describe.block_size, max_model_len=max_len, prefix_caching=args.enable_prefix_caching,
             adapters=[f"{a.name} (r={a.rank}, {a.num_pages} pages)" for a in describe.adapters] or None,
             preemption_mode=args.preemption_mode, max_prompt_bytes=prompt_bytes, max_request_bytes=max_request,
             metrics=f"{args.metrics_host or args.host}:{args.metrics_port}" if args.metrics_port else "off")

    async def refresh_executors() -> None:
        try:
            found = await asyncio.to_thread(resolve, targets(args))
        except (OSError, ValueError) as err:  # a DNS hiccup must not drop every executor
            log.warning("executors_resolve_failed", error=str(err), hint="the current executors stay")
            return
        cluster.set_addresses(found)

    async def membership() -> None:
        while True:
            await asyncio.sleep(args.resolve_interval)
            await refresh_executors()

    def reload() -> None:
        loop.create_task(refresh_executors())
        if not args.tenants_file:
            return
        try:
            ended = cluster.set_tenants(args.tenants_file)
        except InvalidTenant as err:
            log.error("tenants_reload_failed", error=str(err), hint="the previous tenants stay in force")
            return
        revoked = service.end_revoked_streams()  # (their keys were revoked or removed: UNAUTHENTICATED)
        log.info("tenants_reloaded", path=args.tenants_file, requests_ended=ended, streams_revoked=revoked)

    loop.add_signal_handler(signal.SIGHUP, reload)
    watcher = loop.create_task(membership())
    stats = loop.create_task(log_stats(args.log_stats_interval, log, cluster.reports.update_gauges)) \
        if args.log_stats_interval else None
    await stop.wait()
    # Graceful shutdown: refuse new work, let in-flight streams finish, then end what is left with an error.
    service.closing = True
    await grpc_common.set_serving(health, services, False)
    log.info("scheduler_draining", live_streams=len(service.live), shutdown_timeout_s=args.shutdown_timeout)
    for sig in (signal.SIGINT, signal.SIGTERM):  # a second signal: stop now
        loop.add_signal_handler(sig, service.live.clear)
    deadline = loop.time() + args.shutdown_timeout
    while service.live and loop.time() < deadline:
        await asyncio.sleep(0.05)
    left = len(service.live)
    watcher.cancel()
    if stats is not None:
        stats.cancel()
    await cluster.stop()
    cluster.fail_all("the scheduler shut down before this request finished")
    await server.stop(grace=2.0)
    if publishing is not None:
        await publishing.stop()  # (after the cluster: its last events go out)
    await service.prompts.close()  # (the chat template workers)
    log.info("scheduler_stopped", unfinished_streams=left)
