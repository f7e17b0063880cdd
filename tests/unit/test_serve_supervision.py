"""``pagedkv serve``'s executor secret file is private to the user and removed at the end. (The supervisor and
its children: tests/e2e/test_serve_supervision.py.)"""

from __future__ import annotations

import os
import stat
from pathlib import Path

import pytest

from pagedkv.serve_probes import executor_secret_file

pytestmark = pytest.mark.unit


def test_executor_secret_file_is_private_and_removed():
    with executor_secret_file() as path:
        secret = Path(path).read_text()
        assert len(secret) == 64 and int(secret, 16) >= 0
        assert stat.S_IMODE(os.stat(path).st_mode) == 0o600
        assert stat.S_IMODE(os.stat(os.path.dirname(path)).st_mode) == 0o700
        with executor_secret_file() as other:
            assert Path(other).read_text() != secret
    assert not os.path.exists(os.path.dirname(path))
