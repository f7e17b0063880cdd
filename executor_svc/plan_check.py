"""The executor's mirror of the scheduler's per-request state, and the check of every plan against it.

A plan is checked whole against what this executor holds (page ids in range, token ids in the vocabulary, positions
the model has, pages a step writes not dropped, sampling values finite and in range, no request twice) and only then
committed: a plan that fails a check changes nothing, and the scheduler resends its requests in full. What it
commits is each scheduled request's ``Scheduled`` row (state, first position, tokens), in plan order.
"""

from __future__ import annotations

import math
from collections.abc import Callable
from dataclasses import dataclass

import torch

from executor_svc.grammar import ConstraintError, GrammarEngine
from executor_svc.grammar_jobs import GrammarState
from executor_svc.sampler import History, SamplingParams
from executor_svc.token_counts import TokenCounts
from pagedkv.executor.v1 import executor_pb2 as pb
from pagedkv.wire import DROPPED_PAGE


@dataclass(slots=True)
class RequestState:
    token_ids: list[int]
    num_computed: int
    page_ids: list[int]
    sampling: SamplingParams
    num_output: int  # draws made so far: the index of the next draw in the seed stream
    sink: int = 0  # attention sink + window (0: full attention); dropped pages are DROPPED_PAGE in page_ids
    window: int = 0
    counts_slot: int = -1  # its row of the mirror's TokenCounts (-1: none yet; only a penalised request has one)
    grammar: GrammarState | None = None  # structured outputs: its matcher, rebuilt from its outputs when sent in full
    num_prompt: int = 0  # its prompt's tokens: token_ids[:num_prompt] (the NewRequest's tokens less its outputs)
    adapter: int = 0  # its LoRA adapter's slot (executor_svc/lora/stack.py; 0: the base model)


class PlanError(Exception):
    def __init__(self, message: str, request_ids: list[str]) -> None:
        super().__init__(message)
        self.request_ids = request_ids


@dataclass(slots=True)
class Scheduled:
    """One request of a step, in plan order (its index is the plan row)."""

    request_id: str
    state: RequestState
    start: int  # first position computed this step
    count: int


def check_sampling(rid: str, s: pb.SamplingParams, vocab: int | None = None) -> SamplingParams:
    """The plan's sampling values, refused unless finite and in range (NaN fails every comparison); ``vocab``: the
    model's vocabulary size when known (top_logprobs and prompt_top_logprobs at most that)."""
    top_p = s.top_p or 1.0  # 0: unset
    repetition = s.repetition_penalty or 1.0  # 0: unset
    if not (math.isfinite(s.temperature) and s.temperature >= 0):
        bad = f"sampling.temperature = {s.temperature} (must be finite and >= 0)"
    elif not 0.0 < top_p <= 1.0:
        bad = f"sampling.top_p = {s.top_p} (must be in (0, 1])"
    elif s.top_k < 0:
        bad = f"sampling.top_k = {s.top_k} (must be >= 0)"
    elif not (math.isfinite(s.presence_penalty) and math.isfinite(s.frequency_penalty)):
        bad = f"sampling.presence_penalty / frequency_penalty = {s.presence_penalty} / {s.frequency_penalty} " \
              "(must be finite)"
    elif not (math.isfinite(repetition) and repetition > 0):
        bad = f"sampling.repetition_penalty = {s.repetition_penalty} (must be finite and > 0)"
    elif not 0.0 <= s.min_p <= 1.0:
        bad = f"sampling.min_p = {s.min_p} (must be in [0, 1])"
    elif s.min_tokens < 0:
        bad = f"sampling.min_tokens = {s.min_tokens} (must be >= 0)"
    elif not all(math.isfinite(v) for v in s.logit_bias.values()):
        bad = "sampling.logit_bias: a value is not finite"
    elif not all(w.token_ids for w in s.bad_words):
        bad = "sampling.bad_words: an empty token sequence"
    elif not all(0 <= k <= (vocab if vocab is not None else k) for k in (s.top_logprobs, s.prompt_top_logprobs)):
        bad = (f"sampling.top_logprobs / prompt_top_logprobs = {s.top_logprobs} / {s.prompt_top_logprobs} (must be in "
               f"[0, {vocab if vocab is not None else 'the vocabulary size'}])")
    else:
        return SamplingParams(
            s.temperature, top_p, s.top_k, s.seed, s.logprobs, presence_penalty=s.presence_penalty,
            frequency_penalty=s.frequency_penalty, repetition_penalty=repetition, min_p=s.min_p,
            min_tokens=s.min_tokens, min_tokens_stop_ids=tuple(s.min_tokens_stop_ids),
            logit_bias=tuple(sorted(s.logit_bias.items())), allowed_token_ids=tuple(s.allowed_token_ids),
            bad_words=tuple(tuple(w.token_ids) for w in s.bad_words), top_logprobs=s.top_logprobs,
            prompt_logprobs=s.prompt_logprobs, prompt_top_logprobs=s.prompt_top_logprobs)
    raise PlanError(f"request {rid}: {bad}", [rid])


class RequestMirror:
    """The requests a scheduler's plans have given this executor, by request id (never by batch), and the limits a
    plan is checked against: page ids below ``num_pages`` (and ``num_host_pages`` for the host tier), token ids
    below ``vocab_size`` and positions below ``max_positions`` when known (None: a stand-in model in tests)."""

    def __init__(self, num_pages: int, num_host_pages: int, block_size: int, vocab_size: int | None,
                 max_positions: int | None) -> None:
        self.num_pages, self.num_host_pages, self.block_size = num_pages, num_host_pages, block_size
        self.vocab_size, self.max_positions = vocab_size, max_positions
        self.requests: dict[str, RequestState] = {}
        self.token_counts = TokenCounts()  # the penalised requests' token counts (a slot each)
        self.grammars: GrammarEngine | None = None  # structured outputs (None: constrained requests are refused)
        self.prompt_logprobs: set[str] = set()  # the requests that ask for prompt log-probabilities
        # the LoRA slots (executor_svc/lora/stack.py's names: the adapter in each) and whether an adapter is held here
        self.lora: tuple[list[str | None], Callable[[str], bool]] | None = None
        self.adapters: dict[str, int] = {}  # this plan's: name -> adapter number (slot + 1), its loads applied

    def __len__(self) -> int:
        return len(self.requests)

    def reset(self) -> None:
        for rid in list(self.requests):
            self._drop(rid)
        self.token_counts.release_all()
        self.prompt_logprobs.clear()

    def _drop(self, rid: str) -> None:
        self.prompt_logprobs.discard(rid)
        st = self.requests.pop(rid, None)
        if st is not None and st.counts_slot >= 0:
            self.token_counts.release(st.counts_slot)
        if st is not None and st.grammar is not None and self.grammars is not None:
            self.grammars.unpin(st.grammar.key)

    def penalty_history(self, states: list[RequestState], vocab: int, device: torch.device) -> History:
        """The tokens of ``states`` (each a request about to sample: its tokens are its prompt and its num_output
        sampled ones) with their output counts, for the sampler's penalties. A request's counts are built from its
        tokens the first time (a new or resent request), then kept up by ``count_samples``."""
        counts = self.token_counts
        for st in states:
            if st.counts_slot < 0:
                st.counts_slot = counts.assign(st.token_ids, st.num_output, vocab, device)
        return counts.history([st.counts_slot for st in states])

    def count_samples(self, states: list[RequestState], tokens: list[int]) -> None:
        """The tokens ``states`` (those ``penalty_history`` gave rows) just sampled, counted into their output."""
        self.token_counts.add([st.counts_slot for st in states], tokens)

    def _check_pages(self, request_id: str, page_ids, dropped_ok: bool = False) -> None:
        for p in page_ids:
            if dropped_ok and p == DROPPED_PAGE:
                continue
            if not 0 <= p < self.num_pages:
                raise PlanError(f"request {request_id}: page id {p} outside [0, {self.num_pages})",
                                [request_id])

    def _check_page_ops(self, ops: pb.PageOps) -> None:
        num_host = self.num_host_pages
        for name, copies, (src_n, dst_n) in (("swap_out", ops.swap_out, (self.num_pages, num_host)),
                                            ("swap_in", ops.swap_in, (num_host, self.num_pages)),
                                            ("copy", ops.copy, (self.num_pages, self.num_pages))):
            for c in copies:
                if not (0 <= c.src < src_n and 0 <= c.dst < dst_n):
                    raise PlanError(f"page_ops.{name}: {c.src} -> {c.dst} outside [0, {src_n}) -> [0, {dst_n})", [])
        if ops.zero:
            bad = [p for p in ops.zero if not 0 <= p < self.num_pages]
            if bad or len(set(ops.zero)) != len(ops.zero):
                raise PlanError(f"page_ops.zero: page ids must be in [0, {self.num_pages}) and each listed once, got "
                                f"{bad or sorted(ops.zero)}", [])

    def _adapter_table(self, loads, forget: set[str]) -> dict[str, int]:
        """name -> adapter number once ``loads`` (StepPlan.adapter_loads) are applied: each names an adapter held
        here and a slot in range that no request left after ``forget`` runs with (unless it holds that adapter)."""
        if self.lora is None:
            if loads:
                raise PlanError("adapter_loads: this executor has no adapter slots (--lora-modules, --lora-root)", [])
            return {}
        names, held = self.lora
        after = list(names)
        for load in loads:
            if not 0 <= load.slot < len(after):
                raise PlanError(f"adapter_loads: slot {load.slot} outside [0, {len(after)})", [])
            if not held(load.name):
                raise PlanError(f"adapter_loads: adapter {load.name[:128]!r} is not loaded on this executor", [])
            if after[load.slot] == load.name:
                continue
            busy = [rid for rid, st in self.requests.items() if st.adapter == load.slot + 1 and rid not in forget]
            if busy:
                raise PlanError(f"adapter_loads: slot {load.slot} holds {after[load.slot]!r}, which request "
                                f"{busy[0]} still runs with", busy)
            after = [None if n == load.name else n for n in after]
            after[load.slot] = load.name
        return {n: k + 1 for k, n in enumerate(after) if n is not None}

    def _new_state(self, new: pb.NewRequest) -> RequestState:
        """A NewRequest checked field by field (nothing of the runner changes)."""
        rid = new.request_id
        self._check_pages(rid, new.page_ids, dropped_ok=new.window_tokens > 0)
        tokens = list(new.token_ids)
        vocab = self.vocab_size
        s = new.sampling
        if vocab is not None and not all(0 <= t < vocab for t in (*s.logit_bias, *s.min_tokens_stop_ids,
                                                                  *s.allowed_token_ids,
                                                                  *(t for w in s.bad_words for t in w.token_ids))):
            raise PlanError(f"request {rid}: sampling.logit_bias / min_tokens_stop_ids / allowed_token_ids / "
                            f"bad_words: an id outside the vocabulary [0, {vocab})", [rid])
        if tokens and self.vocab_size is not None and not 0 <= min(tokens) <= max(tokens) < self.vocab_size:
            bad = next(i for i, t in enumerate(tokens) if not 0 <= t < self.vocab_size)
            raise PlanError(f"request {rid}: token_ids[{bad}] = {tokens[bad]} outside the vocabulary "
                            f"[0, {self.vocab_size})", [rid])
        for name in ("num_computed_tokens", "num_output_tokens", "sink_tokens", "window_tokens"):
            if getattr(new, name) < 0:
                raise PlanError(f"request {rid}: {name} = {getattr(new, name)} is negative", [rid])
        adapter = self.adapters.get(new.adapter, -1) if new.adapter else 0
        if adapter < 0:
            raise PlanError(f"request {rid}: adapter {new.adapter[:128]!r} is in no slot of this executor (its slots "
                            f"hold {sorted(self.adapters) or 'none'}; StepPlan.adapter_loads pages one in)", [rid])
        return RequestState(
            token_ids=tokens, num_computed=new.num_computed_tokens, page_ids=list(new.page_ids),
            sampling=check_sampling(rid, new.sampling, vocab), num_output=new.num_output_tokens, sink=new.sink_tokens,
            window=new.window_tokens, num_prompt=len(tokens) - new.num_output_tokens,
            grammar=self._grammar(new) if new.HasField("constraint") else None, adapter=adapter,
        )

    def _grammar(self, new: pb.NewRequest) -> GrammarState:
        """A constrained request's matcher, to replay the output tokens the plan carries when it first runs (on the
        matcher threads: grammar_jobs.py). Its grammar must be cached: nothing compiles here. One that is not (or
        is unusable) ends this request alone (``GrammarState.failed``), never the plan."""
        rid, n = new.request_id, new.num_output_tokens
        if self.grammars is None:
            raise PlanError(f"request {rid}: sampling.constraint: this executor has no grammar engine", [rid])
        if n > len(new.token_ids):
            raise PlanError(f"request {rid}: num_output_tokens {n} exceeds its {len(new.token_ids)} tokens", [rid])
        words = (self.grammars.vocab_size + 31) // 32
        try:
            key, compiled = self.grammars.lookup(new.constraint)
        except ConstraintError as err:
            return GrammarState(None, None, (), words, failed=str(err))
        outputs = list(new.token_ids[len(new.token_ids) - n:])
        state = GrammarState(key, compiled, tuple(new.constraint.end_token_ids), words, pending=outputs, replay=n)
        if compiled is None:
            state.failed = ("sampling.constraint: its grammar is not compiled on this executor (it restarted, or the "
                            "grammar was let go of after its hold): send the request again")
        return state

    def _check_fit(self, rid: str, st: RequestState, n: int, page_at, table: int) -> None:
        """``n`` tokens from position ``st.num_computed`` must be known, have pages (none dropped among those
        written) and positions the model has."""
        start = st.num_computed
        end = start + n
        if n <= 0 or end > len(st.token_ids) or -(-end // self.block_size) > table:
            raise PlanError(f"request {rid}: num_scheduled_tokens {n} from position {start} does not fit "
                            f"{len(st.token_ids)} known tokens / {table} pages", [rid])
        if self.max_positions is not None and end > self.max_positions:
            raise PlanError(f"request {rid}: positions up to {end - 1} reach past the model's "
                            f"max_position_embeddings {self.max_positions}", [rid])
        for i in range(start // self.block_size, -(-end // self.block_size)):
            if page_at(i) == DROPPED_PAGE:
                raise PlanError(f"request {rid}: page {i} of its table is dropped but this step writes it", [rid])

    def apply(self, plan: pb.StepPlan) -> list[Scheduled]:
        """Checks the whole plan against what this executor holds, then commits it. A plan that fails a check
        changes nothing (the scheduler then resends every request of it in full)."""
        self._check_page_ops(plan.page_ops)
        forget = set(plan.forget)
        self.adapters = self._adapter_table(plan.adapter_loads, forget)
        scheduled: set[str] = set()

        def once(rid: str) -> None:
            if rid in scheduled:
                raise PlanError(f"request {rid} is scheduled twice in step {plan.step_id}", [rid])
            scheduled.add(rid)

        staged: list[tuple[str, RequestState, int]] = []
        for new in plan.new_requests:
            once(new.request_id)
            state = self._new_state(new)
            self._check_fit(new.request_id, state, new.num_scheduled_tokens, state.page_ids.__getitem__,
                            len(state.page_ids))
            staged.append((new.request_id, state, new.num_scheduled_tokens))
        decodes = list(plan.decodes)  # (read once: each read of a repeated string field builds new str objects)
        requests = self.requests
        missing = [c.request_id for c in plan.continuing if c.request_id not in requests or c.request_id in forget]
        decoding = [requests.get(rid) for rid in decodes]
        if None in decoding or (forget and not forget.isdisjoint(decodes)):
            missing += [rid for rid in decodes if rid not in requests or rid in forget]
        if missing:
            raise PlanError(f"continuing requests unknown to this executor: {missing}", missing)
        for c in plan.continuing:
            once(c.request_id)
            self._check_pages(c.request_id, c.new_page_ids)
            st = self.requests[c.request_id]
            old, added, dropped = len(st.page_ids), c.new_page_ids, set(c.dropped_page_indices)
            table = old + len(added)
            if dropped and not st.window:
                raise PlanError(f"request {c.request_id}: pages dropped but it has no attention window",
                                [c.request_id])
            if any(not 0 <= i < table for i in dropped):
                raise PlanError(f"request {c.request_id}: dropped page index outside its table of {table}",
                                [c.request_id])

            def page_at(i: int, st=st, old=old, added=added, dropped=dropped) -> int:
                return DROPPED_PAGE if i in dropped else st.page_ids[i] if i < old else added[i - old]

            self._check_fit(c.request_id, st, c.num_scheduled_tokens, page_at, table)
        if not scheduled.isdisjoint(decodes) or len(set(decodes)) != len(decodes):
            for rid in decodes:
                once(rid)
        bs, limit = self.block_size, self.max_positions
        for rid, st in zip(decodes, decoding):  # (the common case inline; _check_fit words a refusal)
            at = st.num_computed
            if (at >= len(st.token_ids) or at // bs >= len(st.page_ids) or st.page_ids[at // bs] == DROPPED_PAGE
                    or (limit is not None and at >= limit)):
                self._check_fit(rid, st, 1, st.page_ids.__getitem__, len(st.page_ids))
        # The plan is consistent: commit.
        for rid in forget:
            self._drop(rid)
        for rid, state, _ in staged:
            self._drop(rid)
            self.requests[rid] = state
            if state.grammar is not None and state.grammar.compiled is not None:
                self.grammars.pin(state.grammar.key)
            if state.sampling.prompt_logprobs:
                self.prompt_logprobs.add(rid)
        for c in plan.continuing:
            st = self.requests[c.request_id]
            st.page_ids.extend(c.new_page_ids)
            for i in c.dropped_page_indices:
                st.page_ids[i] = DROPPED_PAGE
        out = [Scheduled(rid, state, state.num_computed, n) for rid, state, n in staged]
        for c in plan.continuing:
            st = self.requests[c.request_id]
            out.append(Scheduled(c.request_id, st, st.num_computed, c.num_scheduled_tokens))
        out += [Scheduled(rid, st, st.num_computed, 1) for rid, st in zip(decodes, decoding)]
        return out
