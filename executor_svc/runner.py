"""Executes step plans: check a plan against the requests this executor mirrors (plan_check.py), move and copy
pages, build the batch (batch.py), run one flat forward (or replay a captured decode graph), sample. Rows of
requests with a LoRA adapter go into the forward as the step's LoraBatch (executor_svc/lora/batch.py).

The runner never allocates pages; it checks that a plan agrees with what it holds and refuses the whole step
otherwise (the scheduler then resends those requests in full).
"""

from __future__ import annotations

import time
from itertools import chain

import torch

from executor_svc import metrics
from executor_svc.attention.interface import PagedAttention
from executor_svc.attention.metadata import DECODE_SLACK
from executor_svc.batch import PromptRows, build_batch, decode_row, prompt_rows
from executor_svc.cuda_graphs import DecodeGraphs
from executor_svc.grammar_jobs import Matchers, StepGrammar
from executor_svc.grammar_mask import GrammarMask
from executor_svc.lora.batch import LoraBatch, lora_batch, step_row_slots
from executor_svc.lora.store import AdapterStore
from executor_svc.pages import DevicePagePool, HostPagePool, PageMover
from executor_svc.plan_check import PlanError, RequestMirror, RequestState, Scheduled
from executor_svc.sampler import sample, token_logprobs
from executor_svc.tensors import long_tensor
from pagedkv.executor.v1 import executor_pb2 as pb


class ModelRunner:
    def __init__(self, model, pool: DevicePagePool, attention: PagedAttention, device: torch.device,
                 host_pool: HostPagePool | None = None, graphs: DecodeGraphs | None = None,
                 adapters: AdapterStore | None = None) -> None:
        """``graphs``: decode-only steps replay captured forwards (executor_svc.cuda_graphs); the pool's last
        page is then their scratch page, kept from the scheduler (``num_pages`` is one less). The pages the LoRA
        adapters hold (``pool.held``, right after the KV pages) are kept from it too."""
        self.model = model
        self.pool = pool
        self.graphs = graphs
        # what plans may use
        self.num_pages = pool.num_pages - (graphs is not None) - len(pool.held)
        if graphs is not None and graphs.scratch_page != pool.num_pages - 1:
            raise ValueError(f"the graphs' scratch page {graphs.scratch_page} is not the pool's last page "
                             f"{pool.num_pages - 1}")
        if pool.held and pool.held.start != self.num_pages:
            raise ValueError(f"the adapters' pages {pool.held.start}-{pool.held.stop - 1} are not the pool's last "
                             f"before the scratch page")
        self.host_pool = host_pool
        self.mover = PageMover(pool, host_pool) if host_pool is not None and host_pool.num_pages else None
        self.attention = attention
        self.device = device
        self.block_size = pool.block_size
        cfg = getattr(model, "cfg", None)  # None: a stand-in model in tests (no token or position limits)
        num_host = host_pool.num_pages if host_pool is not None else 0
        self.mirror = RequestMirror(self.num_pages, num_host, self.block_size,
                                    cfg.vocab_size if cfg is not None else None,
                                    cfg.max_position_embeddings if cfg is not None else None)
        self.lora = getattr(model, "lora", None)  # the LoRA adapters' device slots (None: none)
        self.adapters = adapters  # every adapter held, and the paging into slots (None: the slots are fixed)
        self._lora_kernels = getattr(attention, "name", "") == "cuda"  # (the deltas by kernels_cuda/lora_sgmv.cu)
        if self.lora is not None:
            held = adapters.held if adapters is not None else self.lora.slots.__contains__
            self.mirror.lora = (self.lora.names, held)
        self.matchers: Matchers | None = None  # structured outputs: the matcher threads and budgets (startup.py)
        self.device_written = False  # a page was written since the last wipe
        self.host_written: set[int] = set()  # host pages a swap-out wrote since the last wipe

    @property
    def requests(self) -> dict[str, RequestState]:
        """The requests this executor holds, by request id (the mirror's)."""
        return self.mirror.requests

    @property
    def exact_tail(self):
        """The pool's exact tail (executor_svc/kv_tail.py), or None: its slots are exported as metrics."""
        return self.pool.tail

    def reset(self) -> None:
        self.mirror.reset()

    def wipe_pages(self) -> bool:
        """Forgets every request and zeroes every page written since the last wipe; returns whether anything
        was zeroed. A new Run-stream session starts here, so it can read none of an earlier session's KV."""
        self.mirror.reset()
        wiped = self.device_written or bool(self.host_written)
        if self.mover is not None:
            self.mover.synchronize()
        if self.device_written:
            self.pool.wipe()
        if self.host_written and self.host_pool is not None:
            self.host_pool.wipe(sorted(self.host_written))
        self.device_written, self.host_written = False, set()
        return wiped
    # ---- state -> tensors ----------------------------------------------------------------------
    def _build_batch(self, scheduled: list[Scheduled]):
        return build_batch(scheduled, self.block_size, self.device, self._decode_slack, self.model.cfg.sliding_window)

    def _decode_slack(self) -> float:
        """The backend's grouping of decodes by table length (``decode_group_slack``, asked each step: cheap, and
        tests swap backends), else DECODE_SLACK."""
        ask = getattr(self.attention, "decode_group_slack", None)
        dtype = getattr(self.model, "dtype", None)
        if ask is None or not isinstance(dtype, torch.dtype):
            return DECODE_SLACK
        return ask(self.pool.layer(0)[0], dtype)

    # ---- the step ------------------------------------------------------------------------------
    def step(self, plan: pb.StepPlan) -> pb.StepResult:
        t0 = time.perf_counter()
        result = pb.StepResult(step_id=plan.step_id)
        try:
            scheduled = self.mirror.apply(plan)
        except PlanError as err:
            result.error = str(err)
            result.desynced_request_ids.extend(err.request_ids)
            return result
        t1 = time.perf_counter()
        ops = plan.page_ops
        if ops.swap_out:
            self.host_written.update(c.dst for c in ops.swap_out)
        if scheduled or ops.swap_in or ops.copy:
            self.device_written = True
        swap_out = [(c.src, c.dst) for c in ops.swap_out]
        if ops.zero:  # order: swap-out, zero, swap-in, copy-on-write, then the forward
            if self.mover is not None:
                self.mover.run(swap_out, [])
                swap_out = []
            self.pool.zero_pages(list(ops.zero))
        if self.mover is not None:
            self.mover.run(swap_out, [(c.src, c.dst) for c in ops.swap_in])
        if plan.page_ops.copy:
            self.pool.copy_pages([c.src for c in plan.page_ops.copy], [c.dst for c in plan.page_ops.copy])
        if self.pool.tail is not None:  # (the exact tail's slots follow the pages: executor_svc/kv_tail.py)
            self.pool.tail.page_ops([(c.src, c.dst) for c in ops.swap_out], ops.zero,
                                    [(c.src, c.dst) for c in ops.swap_in], [(c.src, c.dst) for c in ops.copy])
        for load in plan.adapter_loads:  # (checked by the mirror: held, and no running request on the slot)
            self.adapters.page_in(load.name, load.slot)
        t2 = time.perf_counter()
        prepared = t2
        if scheduled:
            grammar = self._start_grammar(scheduled)  # (the matchers' work runs beside the forward)
            extra = prompt_rows(scheduled) if self.mirror.prompt_logprobs else None
            logits, prepared = self._forward(scheduled, result, extra)
            t3 = time.perf_counter()
            if extra is not None:  # (their rows come after the sampled ones)
                self._prompt_logprobs(scheduled, extra, logits[logits.shape[0] - len(extra.flat):], result)
                logits = logits[:logits.shape[0] - len(extra.flat)]
            self._sample(scheduled, logits, result, grammar)
        else:
            t3 = time.perf_counter()
        t4 = time.perf_counter()
        result.timings.page_ops_ms = (t2 - t1) * 1e3
        result.timings.prepare_ms = (prepared - t2) * 1e3
        result.timings.forward_ms = (t3 - prepared) * 1e3
        result.timings.sample_ms = (t4 - t3) * 1e3
        result.timings.total_ms = (t4 - t0) * 1e3
        return result

    def _forward(self, scheduled: list[Scheduled], result: pb.StepResult,
                 extra: PromptRows | None = None) -> tuple[torch.Tensor, float]:
        """Logits of the step's finishing rows, then of ``extra``'s prompt rows: a captured graph for a decode-only
        step that fits one (and has no prompt rows), else eager; and when the inputs were ready (perf_counter; a
        graph's rows are built, its buffers filled in its run). A step with LoRA rows runs eager (a graph adds no
        deltas)."""
        lora = self._lora_batch(scheduled)
        if (self.graphs is not None and extra is None and lora is None and self.graphs.fits(len(scheduled))
                and all(i.count == 1 for i in scheduled)):
            result.num_computed_tokens = len(scheduled)
            rows = [decode_row(item, self.block_size) for item in scheduled]
            prepared = time.perf_counter()
            logits = self.graphs.run(rows)
            finishing = [i for i, item in enumerate(scheduled) if item.start + 1 == len(item.state.token_ids)]
            if len(finishing) == len(scheduled):
                return logits, prepared
            return logits[long_tensor(finishing, logits.device)], prepared
        ids, positions, meta, rows = self._build_batch(scheduled)
        if self.pool.tail is not None:
            self._prepare_tail(scheduled, meta)
        if extra is not None:
            rows = torch.cat([rows, long_tensor(extra.flat, rows.device)])
        result.num_computed_tokens = int(ids.numel())
        prepared = time.perf_counter()
        if lora is None:
            return self.model.forward(ids, positions, meta, self.pool, self.attention, rows), prepared
        return self.model.forward(ids, positions, meta, self.pool, self.attention, rows, lora), prepared

    def _prepare_tail(self, scheduled: list[Scheduled], meta) -> None:
        """The exact tail's slots for this step: every held request's last pages (at its length after the step)
        and the pages the step writes."""
        after = {id(item.state): item.start + item.count for item in scheduled}
        held = [(st.page_ids, after.get(id(st), st.num_computed)) for st in self.requests.values()]
        written = [(item.state.page_ids, item.start, item.count) for item in scheduled]
        self.pool.tail.prepare(held, written, meta.slot_pages, meta.slot_offsets)

    def _lora_batch(self, scheduled: list[Scheduled]) -> LoraBatch | None:
        """The step's adapter rows (None: no adapters served, or no request of this step uses one)."""
        if self.lora is None or not any(item.state.adapter for item in scheduled):
            return None
        return lora_batch(self.lora, step_row_slots([(i.count, i.state.adapter) for i in scheduled]), self.device,
                          kernels=self._lora_kernels)

    def _start_grammar(self, scheduled: list[Scheduled]) -> StepGrammar | None:
        """The matcher jobs of the constrained rows that sample this step, started (None: no such row)."""
        states = [item.state.grammar if item.start + item.count == len(item.state.token_ids) else None
                  for item in scheduled]
        if self.matchers is None or all(st is None for st in states):
            return None
        grammar = self.matchers.step()
        grammar.start(states)
        return grammar

    def _sample(self, scheduled: list[Scheduled], logits: torch.Tensor, result: pb.StepResult,
                grammar: StepGrammar | None = None) -> None:
        finishing, rows = [], []
        for row, item in enumerate(scheduled):  # (scheduled is in plan order: its index is the plan row)
            st = item.state
            st.num_computed = done = item.start + item.count
            if done == len(st.token_ids):
                finishing.append(st)
                rows.append(row)
        if not finishing:
            return
        mask, failed = self._grammar_masks(grammar, finishing, rows, result)
        params = [st.sampling for st in finishing]
        penalised = [st for st, p in zip(finishing, params) if p.penalised]
        history = self.mirror.penalty_history(penalised, logits.shape[-1], logits.device) if penalised else None

        def outputs(row: int, n: int) -> list[int]:  # (the last n of a row's output tokens, for its bad words)
            st = finishing[row]
            return st.token_ids[len(st.token_ids) - min(n, st.num_output):]

        tokens, logprobs, top = sample(logits, params, [st.num_output for st in finishing], history, outputs,
                                       grammar=mask)
        if penalised:
            self.mirror.count_samples(penalised, [t for t, p in zip(tokens, params) if p.penalised])
        for st, token in zip(finishing, tokens):  # (a failed row's token too: later plans may still compute it)
            st.token_ids.append(token)
            st.num_output += 1
            if st.grammar is not None and not st.grammar.failed and not st.grammar.terminated:
                st.grammar.pending.append(token)  # (accepted by its next job)
        keep = [i for i in range(len(rows)) if i not in failed]
        if len(keep) < len(rows):  # a request the executor ended takes no token
            rows, tokens, logprobs = [rows[i] for i in keep], [tokens[i] for i in keep], [logprobs[i] for i in keep]
            if top is not None:
                top = top._replace(top_ids=[top.top_ids[i] for i in keep],
                                   top_logprobs=[top.top_logprobs[i] for i in keep])
        result.sampled_rows.extend(rows)
        result.sampled_token_ids.extend(tokens)
        result.sampled_logprobs.extend(logprobs)
        if top is not None:  # (rows with top_logprobs k > 0: k entries each, in row order)
            result.sampled_top_token_ids.extend(chain.from_iterable(top.top_ids))
            result.sampled_top_logprobs.extend(chain.from_iterable(top.top_logprobs))

    @staticmethod
    def _grammar_masks(grammar: StepGrammar | None, finishing: list[RequestState], rows: list[int],
                       result: pb.StepResult) -> tuple[GrammarMask | None, set[int]]:
        """Waits for the step's matcher jobs (each within its budget): the mask of the rows they constrain, and the
        indices (into ``finishing``) of the rows whose request the executor ended, now or before (reported once,
        in ``result.failed_rows``), with the matchers' CPU into ``result.grammar_cpu_us``."""
        mask, failed = grammar.wait() if grammar is not None else (None, {})
        if grammar is not None:
            result.timings.grammar_wait_ms = grammar.wait_s * 1e3
            metrics.GRAMMAR_WAIT_SECONDS.observe(grammar.wait_s)
            for i, cpu_us in grammar.cpu_us():
                result.grammar_rows.append(rows[i])
                result.grammar_cpu_us.append(cpu_us)
            refused = sum(job.refused for job in grammar.jobs.values())
            if refused:  # (the mask allows only what the matcher accepts: NaN logits at most)
                metrics.GRAMMAR_REFUSED.inc(refused)
        ended = set()
        for i, st in enumerate(finishing):
            g = st.grammar
            if g is None or not g.failed:
                continue
            ended.add(i)
            if not g.reported:
                g.reported = True
                result.failed_rows.append(rows[i])
                result.failed_errors.append(g.failed)
                metrics.GRAMMAR_ENDED.inc()
        return mask, ended

    # Prompt rows whose log-probabilities are taken at once (each a log_softmax over the vocabulary: bounded memory)
    PROMPT_ROWS_AT_ONCE = 256

    def _prompt_logprobs(self, scheduled: list[Scheduled], extra: PromptRows, logits: torch.Tensor,
                         result: pb.StepResult) -> None:
        """The prompt log-probabilities of ``extra``'s rows (``logits``: theirs, in order) into the result."""
        targets, ks = [], []
        for row, first, count in extra.spans:
            st = scheduled[row].state
            targets += st.token_ids[first:first + count]
            ks += [st.sampling.prompt_top_logprobs] * count
        step = self.PROMPT_ROWS_AT_ONCE
        parts = [token_logprobs(logits[i:i + step], targets[i:i + step], ks[i:i + step], ranks=True)
                 for i in range(0, len(targets), step)]
        at = 0
        for row, first, count in extra.spans:
            entry = result.prompt_logprobs.add(row=row, first_token=first)
            for i in range(at, at + count):
                part = parts[i // step]
                j = i % step
                entry.logprobs.append(part.logprobs[j])
                entry.ranks.append(part.ranks[j])
                entry.top_token_ids.extend(part.top_ids[j])
                entry.top_logprobs.extend(part.top_logprobs[j])
            at += count
