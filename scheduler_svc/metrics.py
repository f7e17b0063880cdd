"""Prometheus metrics of the scheduler (a scheduler driving several executors adds theirs up; per-executor
series carry an ``executor`` label).

Tenant ids are labels (they are names from the tenants file, not secrets); API keys never are. /metrics
has no authentication: bind it to an internal interface with ``--metrics-host`` when the API is public."""

from prometheus_client import Counter, Gauge, Histogram

LATENCY_BUCKETS = (0.005, 0.01, 0.025, 0.05, 0.075, 0.1, 0.15, 0.2, 0.3, 0.5, 0.75, 1, 1.5, 2, 3, 5, 7.5, 10, 15,
                   20, 30, 60, 120)
TOKEN_GAP_BUCKETS = (0.001, 0.0025, 0.005, 0.01, 0.02, 0.03, 0.05, 0.075, 0.1, 0.15, 0.2, 0.3, 0.5, 0.75, 1, 2.5,
                     5, 10)

PAGES_USED = Gauge("pagedkv_pages_used", "Device KV pages referenced by at least one request")
PAGES_FREE = Gauge("pagedkv_pages_free", "Device KV pages free")
PAGES_CAPACITY = Gauge("pagedkv_pages_capacity", "Device KV pages in the pools")
PAGES_CACHED = Gauge("pagedkv_pages_cached", "Device KV pages no request holds that the prefix cache can still serve")
HOST_PAGES_CAPACITY = Gauge("pagedkv_host_pages_capacity", "Host-tier (swap) pages in the pools")
HOST_PAGES_FREE = Gauge("pagedkv_host_pages_free", "Host-tier pages neither held nor cached")
KV_SLOT_UTILIZATION = Gauge("pagedkv_kv_slot_utilization",
                            "Token slots holding KV / token slots of the device pages in use (internal fragmentation "
                            "made visible; a page shared by several requests counts once)")
# The Gateway API Inference Extension's model-server protocol (llm-d, KServe): KV usage as a fraction, as vLLM's
# kv_cache_usage_perc, and the pool's shape as an info gauge (the queue and running gauges are the two below)
KV_CACHE_USAGE = Gauge("pagedkv_kv_cache_usage_perc", "Device KV pages in use / device KV pages (0-1; as vLLM's "
                       "kv_cache_usage_perc: cached pages no request holds count as free)")
CACHE_CONFIG_INFO = Gauge("pagedkv_cache_config_info", "The KV cache's shape (always 1): tokens a page holds and the "
                          "device pages of the executors that serve", ["block_size", "num_gpu_blocks"])
RUNNING = Gauge("pagedkv_requests_running", "Requests holding pages")
WAITING = Gauge("pagedkv_requests_waiting", "Requests queued for admission")
PREEMPTIONS = Counter("pagedkv_preemptions_total", "Requests preempted, by kind (swap or recompute)", ["kind"])
SWAPPED = Gauge("pagedkv_requests_swapped", "Requests whose pages are in the host tier")
HOST_PAGES_USED = Gauge("pagedkv_host_pages_used", "Host-tier pages held by swapped-out requests")
HOST_PAGES_CACHED = Gauge("pagedkv_host_pages_cached", "Host-tier pages findable by the prefix cache")
SWAP_PAGES = Counter("pagedkv_swap_pages_total", "Pages copied between tiers (out: device to host)", ["direction"])
SWAP_BYTES = Counter("pagedkv_swap_bytes_total", "Bytes copied between tiers (out: device to host)", ["direction"])
SPILLED_PAGES = Counter("pagedkv_prefix_spilled_pages_total", "Cached pages written to the host tier on eviction")
TENANT_PAGES = Gauge("pagedkv_tenant_pages_used", "Device KV pages held by a tenant's requests", ["tenant"])
TENANT_RETAINED_PAGES = Gauge("pagedkv_tenant_retained_kv_pages", "Device KV pages a tenant's retained conversations "
                              "hold (GenerateRequest.retain_kv; counted in pagedkv_tenant_pages_used too)", ["tenant"])
TENANT_RUNNING = Gauge("pagedkv_tenant_requests_running", "A tenant's requests holding pages", ["tenant"])
TENANT_WAITING = Gauge("pagedkv_tenant_requests_waiting", "A tenant's requests queued for admission", ["tenant"])
TENANT_SERVICE = Gauge("pagedkv_tenant_weighted_service", "A tenant's weighted virtual token counter (VTC)",
                       ["tenant"])
QUEUE_FULL = Counter("pagedkv_queue_full_total", "New requests refused because a queue bound was reached, by bound "
                     "(tenant: its max_queued_requests; total: --max-queued-total; constrained: its "
                     "max_constrained_requests)", ["bound"])
TENANT_BUDGET_HITS = Counter("pagedkv_tenant_budget_hits_total", "Requests that reached their page budget",
                             ["tenant"])
TENANT_FAIR_PREEMPTIONS = Counter("pagedkv_tenant_fair_share_preemptions_total",
                                  "A tenant's requests preempted to give another tenant its fair share", ["tenant"])
SPILL_HITS = Counter("pagedkv_prefix_spill_hits_total", "Prefix-cache pages served from the host tier")
FINISHED = Counter("pagedkv_requests_finished_total", "Requests finished", ["reason"])
GENERATED_TOKENS = Counter("pagedkv_generated_tokens_total", "Tokens sampled and streamed")
COALESCED_MESSAGES = Counter("pagedkv_stream_messages_coalesced_total",
                             "Messages sent inside an earlier one of their stream (the client stream fell behind)")
PROMPT_TOKENS = Counter("pagedkv_prompt_tokens_total", "Prompt tokens admitted")
RESUMED_REQUESTS = Counter("pagedkv_resumed_requests_total", "Requests admitted with a continuation (a client resumed "
                           "a stream that broke, here or on another scheduler)")
PREFIX_QUERY_TOKENS = Counter("pagedkv_prefix_cache_query_tokens_total",
                              "Prompt tokens of requests admitted for the first time (the prefix cache's lookups)")
PREFIX_HIT_TOKENS = Counter("pagedkv_prefix_cache_hit_tokens_total",
                            "Of those, tokens served from the prefix cache (hit rate = hits / queries)")
TTFT_SECONDS = Histogram("pagedkv_time_to_first_token_seconds", "Request received to first token sent", ["tenant"],
                         buckets=LATENCY_BUCKETS)
# Where a first token's time goes (ttft_trace.py): the parts add up to pagedkv_time_to_first_token_seconds (with the
# prepare part, validation and a constraint's compile, which is in the request_first_token DEBUG line only)
REQUEST_TOKENIZE_SECONDS = Histogram("pagedkv_request_tokenize_seconds", "Request received to its prompt's token ids "
                                     "(authentication, chat template, the tokenizer thread's queue)",
                                     buckets=TOKEN_GAP_BUCKETS)
REQUEST_QUEUE_SECONDS = Histogram("pagedkv_request_queue_seconds", "Request handed to the scheduler to the plan that "
                                  "first computes for it (as vLLM's vllm:request_queue_time_seconds)",
                                  buckets=LATENCY_BUCKETS)
REQUEST_PREFILL_SECONDS = Histogram("pagedkv_request_prefill_seconds", "The plan that first computes for a request to "
                                    "the result that holds its first token (as vLLM's "
                                    "vllm:request_prefill_time_seconds: first scheduled to first token, preemptions "
                                    "included)", buckets=LATENCY_BUCKETS)
REQUEST_PREFILL_STEPS = Histogram("pagedkv_request_prefill_steps", "Executor steps from the plan that first computes "
                                  "for a request to its first token, counting the plan in flight ahead of it (async "
                                  "scheduling's extra step)", buckets=(1, 2, 3, 4, 6, 8, 12, 16, 24, 32, 64, 128))
REQUEST_FIRST_TOKEN_SEND_SECONDS = Histogram("pagedkv_request_first_token_send_seconds", "The result holding a "
                                             "request's first token read to that token taken for its client stream",
                                             buckets=TOKEN_GAP_BUCKETS)
GRAMMAR_CPU_SECONDS = Counter("pagedkv_tenant_grammar_cpu_seconds_total", "CPU a tenant's constraints cost the "
                              "executors, by kind (compile: in the compile workers; match: the matchers' advances and "
                              "mask fills)", ["tenant", "kind"])
ITL_SECONDS = Histogram("pagedkv_inter_token_latency_seconds", "Gap between consecutive token messages of a stream",
                        buckets=TOKEN_GAP_BUCKETS)
E2E_SECONDS = Histogram("pagedkv_request_latency_seconds", "Request received to its last message", ["tenant"],
                        buckets=LATENCY_BUCKETS)
STEP_SECONDS = Histogram("pagedkv_step_seconds", "Wall time of one step by part: plan and process (the scheduler), "
                         "executor (plan sent to result read; with async scheduling it includes the wait behind the "
                         "plan before), forward (the executor's model time), rpc (that less the executor's own step "
                         "time), executor_idle (the executor waiting for this plan after its last result)", ["part"],
                         buckets=(1e-4, 5e-4, 1e-3, 2.5e-3, 5e-3, 1e-2, 2.5e-2, 5e-2, 0.1, 0.25, 0.5, 1, 2.5))
STEP_TOKEN_BUDGET = Histogram("pagedkv_step_token_budget", "With --target-tpot-ms: the token budget chosen for a step "
                              "that carries decode rows", buckets=(16, 32, 64, 128, 256, 512, 1024, 2048, 4096, 8192))
PLAN_HOLD_SECONDS = Histogram("pagedkv_plan_hold_seconds", "With async scheduling: how long the next plan was held "
                              "back so that requests arriving meanwhile join it (built just before the step in flight "
                              "should end)", buckets=(1e-4, 5e-4, 1e-3, 2.5e-3, 5e-3, 1e-2, 2.5e-2, 5e-2, 0.1, 0.25,
                                                      0.5, 1, 2.5))
PLANNED_AFTER_RESULT = Counter("pagedkv_plan_hold_late_total", "Holds cut short: the step in flight ended sooner than "
                               "predicted, so its result came first and the next plan was built after it (a sync step)")
EXECUTORS = Gauge("pagedkv_executors", "Executors this scheduler drives, by state", ["state"])
EXECUTOR_PAGES_USED = Gauge("pagedkv_executor_pages_used", "Device KV pages in use on one executor", ["executor"])
EXECUTOR_RUNNING = Gauge("pagedkv_executor_requests_running", "Requests running on one executor", ["executor"])
ADAPTER_PAGES = Gauge("pagedkv_adapter_pages", "Device pages a LoRA adapter's weights hold on one executor while in a "
                      "device slot (the pool's last pages, outside the KV pages; no row: in host memory only)",
                      ["executor", "adapter"])
ADAPTERS = Gauge("pagedkv_lora_adapters", "LoRA adapters served, by state: loaded (all, start-up and run-time), "
                 "resident (in a device slot of at least one executor), host (in host memory only)", ["state"])
ADAPTER_SLOTS = Gauge("pagedkv_lora_slots", "LoRA device slots of one executor (--max-loras), by state (used, free)",
                      ["executor", "state"])
ADAPTER_PAGE_INS = Counter("pagedkv_lora_page_ins_total", "LoRA adapters paged into a device slot from host memory "
                           "(all executors)")
MIGRATIONS = Counter("pagedkv_migrations_total", "Requests moved to another executor, by cause (failure or drain)",
                     ["cause"])
UNPLACED = Gauge("pagedkv_requests_unplaced", "Requests waiting for any executor to be up")
AUTH_FAILURES = Counter("pagedkv_auth_failures_total", "Public API calls refused as unauthenticated, by reason "
                        "(missing, malformed, multiple, unknown, revoked)", ["reason"])
HOP_REFUSALS = Counter("pagedkv_trusted_hop_refusals_total", "Public API calls refused for naming a tenant or "
                       "objective they may not (not_a_hop, no_hop_configured, wrong_secret, unknown_tenant) or badly "
                       "(multiple, conflict, unknown_objective)", ["reason"])
UNDECODABLE_REQUESTS = Counter("pagedkv_undecodable_requests_total",
                               "Public API requests that were not a valid protobuf message (or not UTF-8)")


def count_since(last: dict[str, int], snap) -> dict[str, int]:
    """Adds what one executor's cumulative counters (``snap``: its SchedulerSnapshot) grew by since ``last`` (what
    this returned the time before) to the Prometheus counters; returns what they are now."""
    c = snap.counters
    now = {"swap": c.swap_preemptions, "recompute": c.recompute_preemptions, "out": c.pages_swapped_out,
           "in": c.pages_swapped_in, "spilled": c.spilled_pages, "spill_hits": c.spill_hits,
           "query": c.prompt_tokens_queried, "hit": c.cached_prompt_tokens}
    if any(now[k] < last.get(k, 0) for k in now):  # counters never go back; if they did, start over
        last = {}
    for kind in ("swap", "recompute"):
        PREEMPTIONS.labels(kind).inc(now[kind] - last.get(kind, 0))
    for direction in ("out", "in"):
        SWAP_PAGES.labels(direction).inc(now[direction] - last.get(direction, 0))
        SWAP_BYTES.labels(direction).inc((now[direction] - last.get(direction, 0)) * snap.page_bytes)
    SPILLED_PAGES.inc(now["spilled"] - last.get("spilled", 0))
    SPILL_HITS.inc(now["spill_hits"] - last.get("spill_hits", 0))
    PREFIX_QUERY_TOKENS.inc(now["query"] - last.get("query", 0))
    PREFIX_HIT_TOKENS.inc(now["hit"] - last.get("hit", 0))
    return now


_adapter_rows: dict[str, list[tuple[str, int]]] = {}  # executor -> the (adapter, pages) rows ADAPTER_PAGES has


def adapter_pages(executor: str, resident: list[tuple[str, int]]) -> None:
    """ADAPTER_PAGES of one executor: (adapter, pages) of those in its device slots (none: its rows go, as when it is
    dropped)."""
    if _adapter_rows.get(executor) == resident:
        return
    for name, _ in _adapter_rows.pop(executor, []):
        try:
            ADAPTER_PAGES.remove(executor, name)
        except KeyError:
            pass
    for name, pages in resident:
        ADAPTER_PAGES.labels(executor, name).set(pages)
    if resident:
        _adapter_rows[executor] = list(resident)


def adapter_gauges(slots: dict, loaded: int) -> None:
    """The LoRA gauges from each executor's AdapterSlots (``slots``: address -> slots) and the adapters ``loaded``."""
    resident: set[str] = set()
    for executor, s in slots.items():
        names = [n for n in s.names if n is not None]
        resident.update(names)
        ADAPTER_SLOTS.labels(executor, "used").set(len(names))
        ADAPTER_SLOTS.labels(executor, "free").set(s.count - len(names))
        adapter_pages(executor, [(n, s.pages) for n in names])
    ADAPTERS.labels("loaded").set(loaded)
    ADAPTERS.labels("resident").set(len(resident))
    ADAPTERS.labels("host").set(max(0, loaded - len(resident)))
