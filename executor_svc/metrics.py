"""Prometheus metrics of an executor (its scheduler exports the page accounting; these are the GPU side)."""

from prometheus_client import Counter, Gauge, Histogram

STEP_BUCKETS = (1e-4, 5e-4, 1e-3, 2.5e-3, 5e-3, 1e-2, 2.5e-2, 5e-2, 0.1, 0.25, 0.5, 1, 2.5, 5)

STEP_SECONDS = Histogram("pagedkv_executor_step_seconds", "Executor time of one step, by part "
                         "(page_ops: swap and copy-on-write; prepare: the forward's inputs; forward; sample; total)",
                         ["part"], buckets=STEP_BUCKETS)
IDLE_SECONDS = Histogram("pagedkv_executor_idle_seconds", "Between two steps while requests are in progress: from the "
                         "end of one step to the start of the next (sending the result, reading the next plan, and "
                         "waiting for it). With async scheduling the next plan is already there", buckets=STEP_BUCKETS)
TOKENS = Counter("pagedkv_executor_tokens_total", "Tokens run through the model")
STEPS = Counter("pagedkv_executor_steps_total", "Step plans executed, by outcome (ok or rejected)", ["outcome"])
PAGE_COPIES = Counter("pagedkv_executor_page_copies_total", "Pages copied, by kind (swap_out, swap_in, copy)",
                      ["kind"])
REQUESTS = Gauge("pagedkv_executor_requests", "Requests whose state this executor holds")
DEVICE_PAGES = Gauge("pagedkv_executor_device_pages", "Device KV pages in this executor's pool")
HOST_PAGES = Gauge("pagedkv_executor_host_pages", "Host-tier pages in this executor's pool")
ADAPTER_PAGES = Gauge("pagedkv_executor_adapter_pages", "Device pages a LoRA adapter's weights hold in this "
                      "executor's pool (its last pages; not among the KV pages)", ["adapter"])
DRAINING = Gauge("pagedkv_executor_draining", "1 while the executor drains after SIGTERM")
EXACT_TAIL_SLOTS = Gauge("pagedkv_executor_kv_exact_tail_slots", "The exact tail's slab slots (--kv-exact-tail-slots), "
                         "by holder: device (a request's last pages), host (a swapped-out page's copy), free",
                         ["holder"])
EXACT_TAIL_SHORT = Counter("pagedkv_executor_kv_exact_tail_short_total", "Tail pages that found no free slab slot and "
                           "are read in 8 bits (raise --kv-exact-tail-slots if this grows)")
GRAMMAR_REFUSED = Counter("pagedkv_executor_grammar_refused_tokens_total", "Sampled tokens a constrained request's "
                          "matcher refused (0 unless the logits were NaN: the mask allows only what it accepts)")
GRAMMAR_WAIT_SECONDS = Histogram("pagedkv_executor_grammar_wait_seconds", "How long a step's sampling waited for its "
                                 "constrained rows' matcher work (which runs beside the forward), in steps with any",
                                 buckets=STEP_BUCKETS)
GRAMMAR_ENDED = Counter("pagedkv_executor_grammar_ended_requests_total", "Constrained requests the executor ended: "
                        "a matcher past its CPU budget (--grammar-step-budget-ms, --grammar-tenant-step-budget-ms), "
                        "a grammar not compiled here, output tokens that do not follow it")
GRAMMAR_COMPILES = Counter("pagedkv_executor_grammar_compiles_total", "Constraint compiles asked for, by outcome "
                           "(compiled, cached, invalid, limit: past --grammar-compile-timeout or "
                           "--grammar-compile-memory-mb)", ["outcome"])
GRAMMAR_COMPILE_CPU = Counter("pagedkv_executor_grammar_compile_cpu_seconds_total", "CPU the constraint compiles used "
                              "(in the compile workers)")


def observe_step(plan, result, num_requests: int, tail=None) -> None:
    """``tail``: the pool's exact tail (executor_svc/kv_tail.py), or None."""
    if tail is not None:
        for holder, n in zip(("device", "host", "free"), tail.used()):
            EXACT_TAIL_SLOTS.labels(holder).set(n)
        EXACT_TAIL_SHORT.inc(tail.take_short())
    if result.error:
        STEPS.labels("rejected").inc()
        return
    STEPS.labels("ok").inc()
    t = result.timings
    for part, ms in (("page_ops", t.page_ops_ms), ("prepare", t.prepare_ms), ("forward", t.forward_ms),
                     ("sample", t.sample_ms), ("total", t.total_ms)):
        STEP_SECONDS.labels(part).observe(ms / 1e3)
    TOKENS.inc(result.num_computed_tokens)
    ops = plan.page_ops
    for kind, items in (("swap_out", ops.swap_out), ("swap_in", ops.swap_in), ("copy", ops.copy)):
        if items:
            PAGE_COPIES.labels(kind).inc(len(items))
    REQUESTS.set(num_requests)
