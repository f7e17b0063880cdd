"""The gateway's Prometheus series, in a registry of its own: the CLI that starts it imports the scheduler's modules
(to build every subcommand's parser), and their module-level series showed, all at 0, on the gateway's /metrics."""

from __future__ import annotations

from prometheus_client import (
    CollectorRegistry,
    Counter,
    Gauge,
    GCCollector,
    Histogram,
    PlatformCollector,
    ProcessCollector,
)

REGISTRY = CollectorRegistry()
for _collector in (ProcessCollector, PlatformCollector, GCCollector):
    _collector(registry=REGISTRY)
REQUESTS = Counter("pagedkv_gateway_requests_total", "HTTP requests answered, by endpoint and status",
                   ["endpoint", "status"], registry=REGISTRY)
LATENCY = Histogram("pagedkv_gateway_request_seconds", "Time from request to last byte, by endpoint", ["endpoint"],
                    buckets=(0.005, 0.01, 0.025, 0.05, 0.1, 0.25, 0.5, 1, 2.5, 5, 10, 30, 60, 120, 300),
                    registry=REGISTRY)
TTFT = Histogram("pagedkv_gateway_ttft_seconds", "Time from request to the first streamed token",
                 buckets=(0.005, 0.01, 0.025, 0.05, 0.1, 0.25, 0.5, 1, 2.5, 5, 10, 30), registry=REGISTRY)
RELAY = Histogram("pagedkv_gateway_relay_seconds", "Time from a scheduler message read to its SSE chunk written",
                  buckets=(1e-5, 2.5e-5, 5e-5, 1e-4, 2.5e-4, 5e-4, 1e-3, 2.5e-3, 5e-3, 0.01, 0.025, 0.1),
                  registry=REGISTRY)
IN_FLIGHT = Gauge("pagedkv_gateway_requests_in_flight", "Generation requests being answered", registry=REGISTRY)
STREAMS = Gauge("pagedkv_gateway_streams_in_flight", "Streams (prompts x n) being answered; --max-streams bounds them",
                registry=REGISTRY)
DISCONNECTS = Counter("pagedkv_gateway_client_disconnects_total",
                      "Clients that went away before their answer ended (their gRPC calls were cancelled)",
                      registry=REGISTRY)
HTTP_BOUNDS = Counter("pagedkv_gateway_http_bounds_total", "Connections the HTTP bounds answered and closed: a "
                      "head over --max-header-bytes, a head or body not in within --header-timeout / --body-timeout",
                      ["reason"], registry=REGISTRY)
EDGE_STRIPPED = Counter("pagedkv_gateway_edge_stripped_total", "Routing fields clients sent that the edge mode dropped "
                        "or replaced, by kind (cache_salt: nvext.cache_salt; dynamo_meta: x-dynamo-meta-* headers; "
                        "trusted_hop: x-pagedkv-* and GIE headers)", ["kind"], registry=REGISTRY)
