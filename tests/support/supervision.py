"""What the tests of ``pagedkv serve``'s supervision share (tests/e2e/test_serve_supervision*.py)."""

from __future__ import annotations


def gone(pid: int) -> bool:
    """Exited (a zombie waiting for its reaper counts as gone: it runs no code and holds no port)."""
    try:
        with open(f"/proc/{pid}/stat") as f:
            return f.read().rsplit(")", 1)[1].split()[0] == "Z"
    except FileNotFoundError:
        return True
