"""Executes step plans: mirror per-request state, run one flat forward, sample.

The runner never allocates pages; it checks that a plan agrees with what it holds and refuses
the whole step otherwise (the scheduler then resends those requests in full).
"""

from __future__ import annotations

import math
import time
from dataclasses import dataclass

import torch

from executor_svc.attention.interface import PagedAttention
from executor_svc.attention.metadata import DECODE_SLACK, AttentionMetadata, DecodeGroup, PrefillSegment
from executor_svc.cuda_graphs import DecodeGraphs, DecodeRow
from executor_svc.pages import DevicePagePool, HostPagePool, PageMover
from executor_svc.sampler import SamplingParams, sample
from executor_svc.tensors import long_tensor
from pagedkv.executor.v1 import executor_pb2 as pb

# A page-table entry whose page a sliding window dropped (executor.proto: NewRequest.page_ids). Attention reads
# such an entry as page 0 and masks it; a step never writes it.
DROPPED_PAGE = -1


@dataclass(slots=True)
class RequestState:
    token_ids: list[int]
    num_computed: int
    page_ids: list[int]
    sampling: SamplingParams
    num_output: int  # draws made so far: the index of the next draw in the seed stream
    sink: int = 0  # attention sink + window (0: full attention); dropped pages are DROPPED_PAGE in page_ids
    window: int = 0


class PlanError(Exception):
    def __init__(self, message: str, request_ids: list[str]) -> None:
        super().__init__(message)
        self.request_ids = request_ids


@dataclass(slots=True)
class _Scheduled:
    request_id: str
    state: RequestState
    start: int  # first position computed this step
    count: int


def _group_by_length(num_pages: list[int], slack: float = DECODE_SLACK) -> list[tuple[list[int], int]]:
    """Indices grouped so that within a group the longest table is at most ``slack`` x the shortest
    (padding waste stays small); returns (members, padded width) pairs. An infinite slack: one group."""
    if slack == math.inf:
        return [(list(range(len(num_pages))), max(num_pages))] if num_pages else []
    order = sorted(range(len(num_pages)), key=num_pages.__getitem__)
    groups: list[tuple[list[int], int]] = []
    for i in order:
        if groups and num_pages[i] <= slack * num_pages[groups[-1][0][0]]:
            groups[-1][0].append(i)
            groups[-1] = (groups[-1][0], num_pages[i])
        else:
            groups.append(([i], num_pages[i]))
    return groups


def _padded_tables(tables: list[list[int]], width: int, device: torch.device) -> torch.Tensor:
    """[len(tables), width]: each table, padded with page 0 (the rows' own pages only cross from Python to
    torch; the padding is written by one masked scatter)."""
    flat: list[int] = []
    for t in tables:
        flat += t
    pages = long_tensor(flat)
    if len(flat) == len(tables) * width:
        return pages.view(len(tables), width).to(device)
    lens = long_tensor([len(t) for t in tables])
    out = torch.zeros(len(tables), width, dtype=torch.long)
    out.masked_scatter_(torch.arange(width) < lens[:, None], pages)
    return out.to(device)


def _sampling(rid: str, s: pb.SamplingParams) -> SamplingParams:
    """The plan's sampling values, refused unless finite and in range (NaN fails every comparison)."""
    top_p = s.top_p or 1.0  # 0: unset
    if not (math.isfinite(s.temperature) and s.temperature >= 0):
        bad = f"sampling.temperature = {s.temperature} (must be finite and >= 0)"
    elif not 0.0 < top_p <= 1.0:
        bad = f"sampling.top_p = {s.top_p} (must be in (0, 1])"
    elif s.top_k < 0:
        bad = f"sampling.top_k = {s.top_k} (must be >= 0)"
    else:
        return SamplingParams(s.temperature, top_p, s.top_k, s.seed, s.logprobs)
    raise PlanError(f"request {rid}: {bad}", [rid])


class ModelRunner:
    def __init__(self, model, pool: DevicePagePool, attention: PagedAttention, device: torch.device,
                 host_pool: HostPagePool | None = None, graphs: DecodeGraphs | None = None) -> None:
        """``graphs``: decode-only steps replay captured forwards (executor_svc.cuda_graphs); the pool's last
        page is then their scratch page, kept from the scheduler (``num_pages`` is one less)."""
        self.model = model
        self.pool = pool
        self.graphs = graphs
        self.num_pages = pool.num_pages - 1 if graphs is not None else pool.num_pages  # what plans may use
        if graphs is not None and graphs.scratch_page != self.num_pages:
            raise ValueError(f"the graphs' scratch page {graphs.scratch_page} is not the pool's last page "
                             f"{self.num_pages}")
        self.host_pool = host_pool
        self.mover = PageMover(pool, host_pool) if host_pool is not None and host_pool.num_pages else None
        self.attention = attention
        self.device = device
        self.block_size = pool.block_size
        self.requests: dict[str, RequestState] = {}
        cfg = getattr(model, "cfg", None)  # None: a stand-in model in tests (no token or position limits)
        self.vocab_size: int | None = cfg.vocab_size if cfg is not None else None
        self.max_positions: int | None = cfg.max_position_embeddings if cfg is not None else None
        self.device_written = False  # a page was written since the last wipe
        self.host_written: set[int] = set()  # host pages a swap-out wrote since the last wipe

    def reset(self) -> None:
        self.requests.clear()

    def wipe_pages(self) -> bool:
        """Forgets every request and zeroes every page written since the last wipe; returns whether anything
        was zeroed. A new Run-stream session starts here, so it can read none of an earlier session's KV."""
        self.requests.clear()
        wiped = self.device_written or bool(self.host_written)
        if self.mover is not None:
            self.mover.synchronize()
        if self.device_written:
            self.pool.wipe()
        if self.host_written and self.host_pool is not None:
            self.host_pool.wipe(sorted(self.host_written))
        self.device_written, self.host_written = False, set()
        return wiped

    # ---- plan -> state -------------------------------------------------------------------------
    def _check_pages(self, request_id: str, page_ids, dropped_ok: bool = False) -> None:
        for p in page_ids:
            if dropped_ok and p == DROPPED_PAGE:
                continue
            if not 0 <= p < self.num_pages:
                raise PlanError(f"request {request_id}: page id {p} outside [0, {self.num_pages})",
                                [request_id])

    def _check_page_ops(self, ops: pb.PageOps) -> None:
        num_host = self.host_pool.num_pages if self.host_pool is not None else 0
        for name, copies, (src_n, dst_n) in (("swap_out", ops.swap_out, (self.num_pages, num_host)),
                                            ("swap_in", ops.swap_in, (num_host, self.num_pages)),
                                            ("copy", ops.copy, (self.num_pages, self.num_pages))):
            for c in copies:
                if not (0 <= c.src < src_n and 0 <= c.dst < dst_n):
                    raise PlanError(f"page_ops.{name}: {c.src} -> {c.dst} outside [0, {src_n}) -> [0, {dst_n})", [])

    def _new_state(self, new: pb.NewRequest) -> RequestState:
        """A NewRequest checked field by field (nothing of the runner changes)."""
        rid = new.request_id
        self._check_pages(rid, new.page_ids, dropped_ok=new.window_tokens > 0)
        tokens = list(new.token_ids)
        if tokens and self.vocab_size is not None and not 0 <= min(tokens) <= max(tokens) < self.vocab_size:
            bad = next(i for i, t in enumerate(tokens) if not 0 <= t < self.vocab_size)
            raise PlanError(f"request {rid}: token_ids[{bad}] = {tokens[bad]} outside the vocabulary "
                            f"[0, {self.vocab_size})", [rid])
        for name in ("num_computed_tokens", "num_output_tokens", "sink_tokens", "window_tokens"):
            if getattr(new, name) < 0:
                raise PlanError(f"request {rid}: {name} = {getattr(new, name)} is negative", [rid])
        return RequestState(
            token_ids=tokens, num_computed=new.num_computed_tokens, page_ids=list(new.page_ids),
            sampling=_sampling(rid, new.sampling), num_output=new.num_output_tokens, sink=new.sink_tokens,
            window=new.window_tokens,
        )

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

    def _apply(self, plan: pb.StepPlan) -> list[_Scheduled]:
        """Checks the whole plan against what this executor holds, then commits it. A plan that fails a check
        changes nothing (the scheduler then resends every request of it in full)."""
        self._check_page_ops(plan.page_ops)
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
        forget = set(plan.forget)
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
            self.requests.pop(rid, None)
        for rid, state, _ in staged:
            self.requests[rid] = state
        for c in plan.continuing:
            st = self.requests[c.request_id]
            st.page_ids.extend(c.new_page_ids)
            for i in c.dropped_page_indices:
                st.page_ids[i] = DROPPED_PAGE
        out = [_Scheduled(rid, state, state.num_computed, n) for rid, state, n in staged]
        for c in plan.continuing:
            st = self.requests[c.request_id]
            out.append(_Scheduled(c.request_id, st, st.num_computed, c.num_scheduled_tokens))
        out += [_Scheduled(rid, st, st.num_computed, 1) for rid, st in zip(decodes, decoding)]
        return out

    # ---- state -> tensors ----------------------------------------------------------------------
    def _build_batch(self, scheduled: list[_Scheduled]):
        bs = self.block_size
        ids, positions, slot_pages, slot_offsets = [], [], [], []
        decode_idx, decode_tables, decode_lens, prefills, logits_rows = [], [], [], [], []
        decode_sinks, decode_windows = [], []
        for item in scheduled:
            st, start, n = item.state, item.start, item.count
            q_start = len(ids)
            if n == 1:  # (a decode: one position, no ranges)
                page = start // bs
                ids.append(st.token_ids[start])
                positions.append(start)
                slot_pages.append(st.page_ids[page])
                slot_offsets.append(start % bs)
                table = st.page_ids[:page + 1]
                if st.window:  # dropped pages are read as page 0 and masked
                    table = [0 if p == DROPPED_PAGE else p for p in table]
                decode_idx.append(q_start)
                decode_tables.append(table)
                decode_lens.append(start + 1)
                decode_sinks.append(st.sink)
                decode_windows.append(st.window)
                if start + 1 == len(st.token_ids):
                    logits_rows.append(q_start)
                continue
            ids.extend(st.token_ids[start:start + n])
            pos = range(start, start + n)
            positions.extend(pos)
            slot_pages.extend(st.page_ids[p // bs] for p in pos)
            slot_offsets.extend(p % bs for p in pos)
            ctx = start + n
            table = st.page_ids[: -(-ctx // bs)]
            if st.window:  # dropped pages are read as page 0 and masked
                table = [0 if p == DROPPED_PAGE else p for p in table]
            pages = long_tensor(table, self.device)
            prefills.append(PrefillSegment(q_start, n, ctx, pages, st.sink, st.window))
            if ctx == len(st.token_ids):
                logits_rows.append(len(ids) - 1)

        device = self.device

        def tensor(values) -> torch.Tensor:
            return long_tensor(values, device)

        groups = []
        slack = self._decode_slack() if decode_tables else DECODE_SLACK
        for members, width in _group_by_length([len(t) for t in decode_tables], slack):
            group = DecodeGroup(tensor([decode_idx[i] for i in members]),
                                _padded_tables([decode_tables[i] for i in members], width, device),
                                tensor([decode_lens[i] for i in members]),
                                in_order=all(a < b for a, b in zip(members, members[1:])))
            if any(decode_windows[i] for i in members):
                group.sinks = tensor([decode_sinks[i] for i in members])
                group.windows = tensor([decode_windows[i] for i in members])
            groups.append(group)
        meta = AttentionMetadata(
            slot_pages=tensor(slot_pages), slot_offsets=tensor(slot_offsets), decodes=groups,
            prefills=prefills, sliding_window=self.model.cfg.sliding_window,
        )
        return tensor(ids), tensor(positions), meta, tensor(logits_rows)

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
            scheduled = self._apply(plan)
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
        if self.mover is not None:  # order: swap-out, swap-in, copy-on-write, then the forward
            self.mover.run([(c.src, c.dst) for c in ops.swap_out], [(c.src, c.dst) for c in ops.swap_in])
        if plan.page_ops.copy:
            self.pool.copy_pages([c.src for c in plan.page_ops.copy], [c.dst for c in plan.page_ops.copy])
        t2 = time.perf_counter()
        prepared = t2
        if scheduled:
            logits, prepared = self._forward(scheduled, result)
            t3 = time.perf_counter()
            self._sample(scheduled, logits, result)
        else:
            t3 = time.perf_counter()
        t4 = time.perf_counter()
        result.timings.page_ops_ms = (t2 - t1) * 1e3
        result.timings.prepare_ms = (prepared - t2) * 1e3
        result.timings.forward_ms = (t3 - prepared) * 1e3
        result.timings.sample_ms = (t4 - t3) * 1e3
        result.timings.total_ms = (t4 - t0) * 1e3
        return result

    def _forward(self, scheduled: list[_Scheduled], result: pb.StepResult) -> tuple[torch.Tensor, float]:
        """Logits of the step's finishing rows: a captured graph for a decode-only step that fits one, else eager;
        and when the inputs were ready (perf_counter; a graph's rows are built, its buffers filled in its run)."""
        if self.graphs is not None and self.graphs.fits(len(scheduled)) and all(i.count == 1 for i in scheduled):
            result.num_computed_tokens = len(scheduled)
            rows = [self._decode_row(item) for item in scheduled]
            prepared = time.perf_counter()
            logits = self.graphs.run(rows)
            finishing = [i for i, item in enumerate(scheduled) if item.start + 1 == len(item.state.token_ids)]
            if len(finishing) == len(scheduled):
                return logits, prepared
            return logits[long_tensor(finishing, logits.device)], prepared
        ids, positions, meta, rows = self._build_batch(scheduled)
        result.num_computed_tokens = int(ids.numel())
        prepared = time.perf_counter()
        return self.model.forward(ids, positions, meta, self.pool, self.attention, rows), prepared

    def _decode_row(self, item: _Scheduled) -> DecodeRow:
        st, pos, bs = item.state, item.start, self.block_size
        table = st.page_ids[: pos // bs + 1]
        if st.window:  # dropped pages are read as page 0 and masked
            table = [0 if p == DROPPED_PAGE else p for p in table]
        return DecodeRow(st.token_ids[pos], pos, st.page_ids[pos // bs], pos % bs, table, st.sink, st.window)

    def _sample(self, scheduled: list[_Scheduled], logits: torch.Tensor, result: pb.StepResult) -> None:
        finishing, rows = [], []
        for row, item in enumerate(scheduled):  # (scheduled is in plan order: its index is the plan row)
            st = item.state
            st.num_computed = done = item.start + item.count
            if done == len(st.token_ids):
                finishing.append(st)
                rows.append(row)
        if not finishing:
            return
        tokens, logprobs = sample(logits, [st.sampling for st in finishing], [st.num_output for st in finishing])
        for st, token in zip(finishing, tokens):
            st.token_ids.append(token)
            st.num_output += 1
        result.sampled_rows.extend(rows)
        result.sampled_token_ids.extend(tokens)
        result.sampled_logprobs.extend(logprobs)
