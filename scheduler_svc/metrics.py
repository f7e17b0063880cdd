"""Prometheus metrics of the scheduler."""

from prometheus_client import Counter, Gauge, Histogram

PAGES_USED = Gauge("pagedkv_pages_used", "Device KV pages referenced by at least one request")
PAGES_FREE = Gauge("pagedkv_pages_free", "Device KV pages free")
KV_SLOT_UTILIZATION = Gauge("pagedkv_kv_slot_utilization", "Token slots holding KV / slots in used pages")
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
TENANT_RUNNING = Gauge("pagedkv_tenant_requests_running", "A tenant's requests holding pages", ["tenant"])
TENANT_WAITING = Gauge("pagedkv_tenant_requests_waiting", "A tenant's requests queued for admission", ["tenant"])
TENANT_SERVICE = Gauge("pagedkv_tenant_weighted_service", "A tenant's weighted virtual token counter (VTC)",
                       ["tenant"])
TENANT_BUDGET_HITS = Counter("pagedkv_tenant_budget_hits_total", "Requests that reached their page budget",
                             ["tenant"])
TENANT_FAIR_PREEMPTIONS = Counter("pagedkv_tenant_fair_share_preemptions_total",
                                  "A tenant's requests preempted to give another tenant its fair share", ["tenant"])
SPILL_HITS = Counter("pagedkv_prefix_spill_hits_total", "Prefix-cache pages served from the host tier")
FINISHED = Counter("pagedkv_requests_finished_total", "Requests finished", ["reason"])
GENERATED_TOKENS = Counter("pagedkv_generated_tokens_total", "Tokens sampled and streamed")
PROMPT_TOKENS = Counter("pagedkv_prompt_tokens_total", "Prompt tokens admitted")
STEP_SECONDS = Histogram("pagedkv_step_seconds", "Wall time of one step", ["part"],
                         buckets=(1e-4, 5e-4, 1e-3, 2.5e-3, 5e-3, 1e-2, 2.5e-2, 5e-2, 0.1, 0.25, 0.5, 1, 2.5))
EXECUTORS = Gauge("pagedkv_executors", "Executors this scheduler drives, by state", ["state"])
EXECUTOR_PAGES_USED = Gauge("pagedkv_executor_pages_used", "Device KV pages in use on one executor", ["executor"])
EXECUTOR_RUNNING = Gauge("pagedkv_executor_requests_running", "Requests running on one executor", ["executor"])
MIGRATIONS = Counter("pagedkv_migrations_total", "Requests moved to another executor, by cause (failure or drain)",
                     ["cause"])
UNPLACED = Gauge("pagedkv_requests_unplaced", "Requests waiting for any executor to be up")
