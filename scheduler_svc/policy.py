"""Preemption policy, in one place: which request gives up its pages, and whether it is swapped or recomputed.

Victims (seeds, practice note 3; docs/design.md decisions 6 and 7):
  0. a request of a tenant holding more than its fair share of pages first (tenants, fairness);
  1. cold first: not scheduled for >= ``cold_steps`` steps;
  2. never a hot one (scheduled within the last ``hot_steps`` steps) while another candidate exists;
  3. then the least important (highest ``priority`` value), then the newest, then the highest fork index.

Swap or recompute, per victim, by cost:
  recompute = tokens whose KV would have to be computed again x measured prefill seconds per token
  swap      = bytes copied out and back in / measured page copy bandwidth
Tokens in pages that other running requests share (and that stay cached) are not counted as recompute;
pages whose contents the host tier already caches are not copied. Without room in the host tier a victim
is always recomputed.
"""

from __future__ import annotations

import enum
from dataclasses import dataclass

from pagedkv.wire import DROPPED_PAGE
from scheduler_svc.pages import PagePool
from scheduler_svc.request import Request

# --scheduling-policy: a tenant's waiting requests in arrival order, or by priority with preemption of its less
# important running ones (priority.py)
SCHEDULING_POLICIES = ("fcfs", "priority")


class Mode(enum.Enum):
    AUTO = "auto"
    SWAP = "swap"
    RECOMPUTE = "recompute"


@dataclass(frozen=True, slots=True)
class PreemptionConfig:
    mode: Mode = Mode.AUTO
    hot_steps: int = 64
    cold_steps: int = 512
    swap_in_max_wait: int = 64  # steps a swapped request yields to new prefills before it goes first

    def __post_init__(self) -> None:
        if self.hot_steps < 0 or self.cold_steps < self.hot_steps:
            raise ValueError(f"--hot-steps {self.hot_steps}: must be in [0, --cold-steps {self.cold_steps}]")
        if self.swap_in_max_wait < 0:
            raise ValueError(f"--swap-in-max-wait {self.swap_in_max_wait}: must be >= 0 steps")


@dataclass(frozen=True, slots=True)
class PreemptionCosts:
    page_bytes: int = 0
    swap_bytes_per_second: float = 0.0
    prefill_seconds_per_token: float = 0.0

    @classmethod
    def of(cls, describe) -> PreemptionCosts:
        """From an executor's DescribeResponse (its start-up measurements)."""
        return cls(page_bytes=describe.page_bytes, swap_bytes_per_second=describe.swap_bytes_per_second,
                   prefill_seconds_per_token=describe.prefill_seconds_per_token)


class PreemptionPolicy:
    COLD, WARM, HOT = 0, 1, 2

    def __init__(self, config: PreemptionConfig, costs: PreemptionCosts) -> None:
        self._config = config
        self._costs = costs

    @property
    def config(self) -> PreemptionConfig:
        return self._config

    @property
    def costs(self) -> PreemptionCosts:
        return self._costs

    def temperature(self, req: Request, now: int) -> int:
        idle = now - req.last_scheduled
        if idle >= self._config.cold_steps:
            return self.COLD
        if idle >= self._config.hot_steps:
            return self.WARM
        return self.HOT

    def pick_victim(self, candidates: list[Request], now: int, requester: Request | None = None,
                    over_share: set[str] | frozenset = frozenset()) -> Request:
        """A request of a tenant above its fair share first, then the coldest, then the highest priority
        value, then the newest, then (forks of one request arrive together) the highest fork index. The request
        asking for pages is about to be scheduled: it counts as hot."""
        def key(r: Request):
            temperature = self.HOT if r is requester else self.temperature(r, now)
            # NOTE: without the fork index, two forks that each need the other's pages took turns preempting
            # each other (the first of equals in list order), and neither ever finished.
            return r.tenant in over_share, -temperature, r.priority, r.arrival, r.index

        return max(candidates, key=key)

    def recompute_seconds(self, tokens: int) -> float:
        return tokens * self._costs.prefill_seconds_per_token

    def swap_seconds(self, pages: int) -> float:
        if self._costs.swap_bytes_per_second <= 0:
            return float("inf")
        return 2 * pages * self._costs.page_bytes / self._costs.swap_bytes_per_second

    def should_swap(self, pages_to_copy: int | None, tokens_to_recompute: int) -> bool:
        """pages_to_copy is None when the host tier cannot take the victim."""
        if pages_to_copy is None or self._config.mode is Mode.RECOMPUTE:
            return False
        if self._config.mode is Mode.SWAP:
            return True
        return self.swap_seconds(pages_to_copy) < self.recompute_seconds(tokens_to_recompute)


def shared_cached_tokens(pool: PagePool, req: Request) -> int:
    """Tokens of req in published pages other requests hold too: a recompute would find them again."""
    n = 0
    for p in req.page_table[: pool.pages_for(req.num_computed)]:
        if p == DROPPED_PAGE or pool.refcount(p) < 2 or pool.hash_of(p) is None:
            break
        n += 1
    return min(n * pool.block_size, req.num_computed)
