"""The e2e tier (``pytest -m e2e``): real processes and sockets on loopback, and in-process runs too heavy for the
unit tier's budget. See tests/README.md."""
