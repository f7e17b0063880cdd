"""The unit tier (``pytest -m unit``): every module here is marked unit, starts no process and opens no socket
(tests/conftest.py refuses both while a unit test runs). See tests/README.md."""
