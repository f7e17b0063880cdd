"""``pagedkv bench``: a load generator over gRPC against a running scheduler.

``workload`` draws the requests (arrival times, lengths, shared prefixes, tenants) from a seed;
``runner`` sends them and times every streamed message; ``scrape`` samples the scheduler's Prometheus
KV gauges while it runs; ``report`` turns the timings into the table, the JSON and the plots;
``command`` is the argument parser and the entry point the ``pagedkv`` CLI calls.
"""
