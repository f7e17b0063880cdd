"""Shared set-up for the tests (and the in-process benchmarks under bench/): stand-in executors and clusters,
in-process servers, process helpers, reference implementations, shared check cases. Not test modules:
pytest collects nothing here (no ``test_*.py``)."""
