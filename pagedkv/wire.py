"""What both ends of the scheduler ⇄ executor link agree on, each fact defined once (executor.proto holds the
messages; these are the values outside them)."""

# The link's version (DescribeResponse.protocol): raised when either end would misread the other's messages.
# 2: sampled tokens as packed lists by plan row (StepResult.sampled_rows, ...).
# 3: Describe's default_* are vLLM's request defaults (temperature 1 without generation_config.json, where 2 meant
#    greedy), with default_repetition_penalty and default_min_p.
# 4: top and prompt log-probabilities (SamplingParams.top_logprobs, prompt_logprobs; StepResult.sampled_top_*,
#    prompt_logprobs), and a fork parent that asks for prompt log-probabilities sent with its whole prompt.
# 5: structured outputs (NewRequest.constraint, the CheckConstraint RPC): an older executor would sample unconstrained.
# 6: grammar work bounded per request and per tenant (Constraint.scope; StepResult.failed_rows, grammar_cpu_us): an
#    older executor compiles on its step loop and never ends a request alone.
EXECUTOR_PROTOCOL = 6

# Run-stream metadata: the scheduler's session id, one per scheduler process and executor link. The executor keeps
# its page contents (the scheduler's prefix cache) when the same session re-attaches after a dropped stream, and
# starts any other session from zeroed pages. "Session" in the code means this and nothing else (a link's Run
# streams, not a client's requests; the test helper that drives a planner calls its StepStream ``stream``).
SESSION_HEADER = "x-pagedkv-session"
# The executor's answer, in Run's initial metadata: PAGES_KEPT (this session's pages as they were) or PAGES_FRESH
# (zeroed: another session attached meanwhile). The scheduler reads anything else as fresh: forgetting its prefix
# cache is always safe.
PAGES_HEADER = "x-pagedkv-pages"
PAGES_KEPT = "kept"
PAGES_FRESH = "fresh"

# A page-table entry whose page left the request's table (outside its attention window): NewRequest.page_ids
# carries it; the executor's attention reads such an entry as page 0 and masks it, and no step writes it.
DROPPED_PAGE = -1
