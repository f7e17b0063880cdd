"""`pagedkv gateway --check-http`'s probe (check_http): a URL that is not http is refused, and a closed port on
loopback answers not ok, naming the health check. (Split from tests/unit/test_gateway_unit.py: it opens a socket.)"""

from __future__ import annotations

import pytest

pytestmark = pytest.mark.e2e


def test_check_http_refuses_what_is_not_an_http_url():
    from pagedkv.gateway.cli import check_http

    with pytest.raises(ValueError, match="--http"):
        check_http("127.0.0.1:8000/health")
    ok, said = check_http(f"http://127.0.0.1:{_closed_port()}/health", timeout=2)
    assert not ok and "health" in said


def _closed_port() -> int:
    import socket

    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]
