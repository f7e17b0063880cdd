"""The page-accounting state machine's bookkeeping (tests/adversarial/test_page_accounting_stateful.py): the outputs
a client would see, the pages each request holds, what the plans did, and the end of a run, where the machine drains
and every stream must have ended exactly once with every token it was owed, and no page is left used. A mixin: the
rules, the invariant and the state they read are the state machine's own."""

from __future__ import annotations

from pagedkv.executor.v1 import executor_pb2 as pb
from scheduler_svc.request import Finish, Status

DRAIN_STEPS = 5000


class AccountingChecks:
    # ---- outputs as a client would see them ----------------------------------------------------
    def _deliver(self, outputs) -> None:
        """The tokens on the streams (Scheduler.process puts them there), then ``outputs`` (what the engine's
        deliver would put there after them)."""
        for group in self.groups.values():
            box = group.outbox
            while not box.empty():
                self._see(group, box.get_nowait())
        for req, out in outputs:
            self._see(req, out)

    def _see(self, req, out) -> None:
        key = (req.group, out.index)
        assert self.finals[key] == 0, f"{key}: output after its stream ended"
        self.tokens[key] += len(out.token_ids)
        if out.finish is not None:
            self.finals[key] += 1
            self.final_outputs[key] = out
            self.max_len_at_end[key] = req.max_len  # (a reload may change it later)
            assert out.completion_tokens == self.tokens[key], (
                f"{key}: {self.tokens[key]} tokens streamed, final says {out.completion_tokens}")

    def _retained_pages(self) -> int:
        return sum(self.s.retained.pages_by_tenant.values())

    def _held(self):
        s = self.s
        yield from ((r, sum(1 for p in r.page_table if p >= 0)) for r in s.running)
        yield from ((r, sum(1 for p in r.host_table if p >= 0)) for r in s.swapped)

    def _note(self, plan: pb.StepPlan) -> None:
        ops = plan.page_ops
        self.events["zeroed"] += len(ops.zero)
        self.events["swap_out"] += len(ops.swap_out)
        self.events["swap_in"] += len(ops.swap_in)
        self.events["copies"] += len(ops.copy)
        self.events["dropped"] += sum(len(c.dropped_page_indices) for c in plan.continuing)
        self.events["forks"] += sum(1 for r in plan.new_requests if "/" in r.request_id)

    def _describe(self) -> str:
        s = self.s
        live = [(r.request_id, r.tenant, r.status.value, r.num_computed, r.compute_target, r.n, r.page_budget,
                 r.window_tokens, len(r.page_table), len(r.host_table)) for r in s.requests.values()]
        host = s.host.num_free if s.host is not None else None
        return (f"live (id, tenant, status, computed, target, n, budget, window, pages, host pages): {live}; "
                f"free pages {s.pool.num_free}/{s.pool.num_pages}, host free {host}, used by {dict(s.pool.used_by)}, "
                f"config {s.config}")

    # ---- the end: drain, nothing leaked, every stream ended once ---------------------------------
    def teardown(self) -> None:
        s = self.s
        if s is None:
            return
        for _ in range(DRAIN_STEPS):
            self.run_steps(1)
            if not self.pending and not s.has_work:
                break
            self.accounting_holds()
        while self.pending:
            self.complete()
        assert not s.has_work, f"not drained after {DRAIN_STEPS} steps: {self._describe()}"
        s.check_integrity()
        assert s.pool.num_used == self._retained_pages(), "pages held beyond the retentions after the drain"
        self.now += 10**6  # every retention expires: its pages are zeroed by the next plan, and freed
        self.run_steps(2)
        while self.pending:
            self.complete()
        assert not s.retained and not s.has_work
        s.check_integrity()
        assert s.pool.num_used == 0, f"{s.pool.num_used} device pages leaked"
        assert s.host is None or s.host.num_used == 0, f"{s.host.num_used} host pages leaked"
        assert not s.kv.inflight, "in-flight prefix claims left"
        for group, req in self.groups.items():
            ended = {i for (g, i), k in self.finals.items() if g == group and k}
            assert ended, f"{group}: stream never ended"
            assert all(self.finals[(group, i)] == 1 for i in ended)
            if group in self.cancelled:
                continue
            outs = [self.final_outputs[(group, i)] for i in sorted(ended)]
            if any(o.error for o in outs):  # e.g. a request rejected 3 times by the executor
                continue
            assert ended == set(range(req.n)), f"{group}: forks {sorted(ended)} of {req.n} ended"
            for i, o in enumerate(outs):
                assert o.finish in (Finish.LENGTH, Finish.STOP), f"{group}: ended {o.finish}"
                assert 1 <= o.completion_tokens <= req.sampling.max_tokens
                if o.finish is Finish.LENGTH and not o.stop_reason and o.completion_tokens < req.sampling.max_tokens:
                    max_len = self.max_len_at_end[(group, i)]
                    assert o.prompt_tokens + o.completion_tokens >= max_len, f"{group}: ended early"
        assert all(r.status is Status.FINISHED for r in self.groups.values() if r.n == 1)
