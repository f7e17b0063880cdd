"""Samples the scheduler's Prometheus KV gauges while a benchmark runs (``--metrics-url``).

Every ``interval_s`` it fetches the text exposition and keeps the unlabelled gauges named ``pagedkv_kv_*``
plus pages used/free and requests running/waiting (``scheduler_svc/metrics.py``). A failed fetch is
counted and the run goes on.
"""

from __future__ import annotations

import asyncio
import http.client
import time
import urllib.request
from dataclasses import dataclass, field

from prometheus_client.parser import text_string_to_metric_families

KEPT = ("pagedkv_pages_used", "pagedkv_pages_free", "pagedkv_requests_running", "pagedkv_requests_waiting")
KEPT_PREFIX = "pagedkv_kv_"


def parse_gauges(text: str) -> dict[str, float]:
    """The kept unlabelled samples of one exposition, by metric name."""
    out: dict[str, float] = {}
    for family in text_string_to_metric_families(text):
        for s in family.samples:
            if not s.labels and (s.name in KEPT or s.name.startswith(KEPT_PREFIX)):
                out[s.name] = float(s.value)
    return out


def page_utilization(values: dict[str, float]) -> float | None:
    """Pages used / (used + free), when both gauges were there."""
    used, free = values.get("pagedkv_pages_used"), values.get("pagedkv_pages_free")
    if used is None or free is None or used + free <= 0:
        return None
    return used / (used + free)


@dataclass(slots=True)
class MetricsScraper:
    url: str
    interval_s: float = 0.5
    timeout_s: float = 2.0
    samples: list[dict] = field(default_factory=list)  # {"t_s": seconds since start, "values": {name: value}}
    errors: int = 0
    last_error: str = ""

    def fetch(self) -> dict[str, float]:
        with urllib.request.urlopen(self.url, timeout=self.timeout_s) as r:  # noqa: S310 - a user-given URL
            return parse_gauges(r.read().decode("utf-8"))

    async def scrape_once(self, t0: float) -> None:
        try:
            values = await asyncio.to_thread(self.fetch)
        except (OSError, ValueError, http.client.HTTPException) as err:
            self.errors += 1
            self.last_error = f"{type(err).__name__}: {err}"
            return
        self.samples.append({"t_s": time.perf_counter() - t0, "values": values})

    async def run(self, t0: float, stop: asyncio.Event) -> None:
        """Scrapes until ``stop`` is set, then once more (the state after the last request)."""
        while not stop.is_set():
            await self.scrape_once(t0)
            try:
                await asyncio.wait_for(stop.wait(), self.interval_s)
            except asyncio.TimeoutError:
                pass
        await self.scrape_once(t0)
