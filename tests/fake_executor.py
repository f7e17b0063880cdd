"""A stand-in executor for scheduler tests: no model, exact bookkeeping, deterministic tokens."""

from __future__ import annotations

from pagedkv.executor.v1 import executor_pb2 as pb
from scheduler_svc.detokenizer import IncrementalDetokenizer
from scheduler_svc.prefix_cache import tenant_root
from scheduler_svc.request import Request, Sampling
from scheduler_svc.scheduler import Scheduler


class NullTokenizer:
    def decode(self, ids, **_):
        return "".join(chr(97 + i % 26) for i in ids)


def make_request(i: int, prompt_len: int, max_tokens: int, prompt: list[int] | None = None,
                 tenant: str = "default", **kw) -> Request:
    prompt = prompt if prompt is not None else [5] * prompt_len
    return Request(request_id=f"r{i}", prompt_ids=prompt, sampling=Sampling(max_tokens=max_tokens),
                   arrival=i, detokenizer=IncrementalDetokenizer(NullTokenizer(), [], [], False),
                   tenant=tenant, hash_root=tenant_root(tenant), **kw)


def fake_result(plan: pb.StepPlan, known: dict[str, list]) -> pb.StepResult:
    """A stand-in executor: tracks computed counts and 'samples' token 7 when a request is caught up."""
    result = pb.StepResult(step_id=plan.step_id)
    for rid in plan.forget:
        known.pop(rid, None)
    for new in plan.new_requests:
        known[new.request_id] = [len(new.token_ids), new.num_computed_tokens]
    for item in [*plan.new_requests, *plan.continuing]:
        result.num_computed_tokens += item.num_scheduled_tokens
        total, done = known[item.request_id]
        done += item.num_scheduled_tokens
        assert done <= total
        if done == total:
            total += 1
            result.sampled.add(request_id=item.request_id, token_id=7)
        known[item.request_id] = [total, done]
    return result


def drive(s: Scheduler, max_steps: int = 10_000, known: dict[str, list] | None = None) -> list:
    known = {} if known is None else known
    finished = []
    for _ in range(max_steps):
        plan, outs = s.schedule()
        if plan is None and not s.has_work:
            break
        assert plan is not None
        assert sum(r.num_scheduled_tokens for r in plan.new_requests) + sum(
            c.num_scheduled_tokens for c in plan.continuing) <= s.config.max_num_batched_tokens
        assert len(s.running) <= s.config.max_num_seqs
        outs = s.process(fake_result(plan, known))
        s.check_integrity()
        finished += [req for req, o in outs if o.finish is not None]
    return finished


