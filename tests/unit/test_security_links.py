"""The executor secret and listener checks without processes: a blank secret file is an error naming it, and an
insecure listener is warned about beyond loopback only. The authenticated, encrypted links themselves:
tests/e2e/test_security_links.py."""

from __future__ import annotations

import json

import pytest

from pagedkv import security

pytestmark = pytest.mark.unit


def test_blank_secret_file_is_an_error_naming_it(tmp_path):
    blank = tmp_path / "secret"
    blank.write_text(" \n\t\n")
    with pytest.raises(ValueError, match=f"--executor-secret-file {blank}: the executor secret is empty"):
        security.load_executor_secret(str(blank))
    blank.write_text("two words\n")
    with pytest.raises(ValueError, match="printable ASCII without spaces"):
        security.load_executor_secret(str(blank))
    blank.write_text("s3cret-value\n")
    assert security.load_executor_secret(str(blank)) == "s3cret-value"


@pytest.mark.parametrize("host, loopback", [("127.0.0.1", True), ("localhost", True), ("::1", True),
                                            ("[::1]", True), ("0.0.0.0", False), ("::", False),
                                            ("10.0.0.5", False), ("scheduler", False)])
def test_insecure_listener_warned_beyond_loopback_only(host, loopback):
    lines = []

    class Log:
        def warning(self, event, **fields):
            lines.append(json.dumps({"event": event, **fields}))

    security.warn_if_exposed(Log(), "scheduler", host, 50051, tls=False)
    security.warn_if_exposed(Log(), "scheduler", host, 50051, tls=True)
    assert len(lines) == (0 if loopback else 1)
    assert all('"insecure_listener"' in line for line in lines)
