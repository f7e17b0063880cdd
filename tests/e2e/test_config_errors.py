"""Configuration errors of `pagedkv serve` (#48): a KV size the machine cannot hold, a --max-model-len the pages
cannot hold. Each is checked before anything is allocated and ends serve with one line naming the flag, the value
and what fits, as the child said it (no traceback, no restart). Before, --kv-cache-gb 100 on a 24 GiB machine ended
in the allocator's 30-line torch traceback, and serve's own last line said only "(see its log above)"."""

from __future__ import annotations

import math
import subprocess
import sys

import pytest

from executor_svc.startup import available_host_memory
from pagedkv.cli import free_port
from tests.conftest import ROOT

pytestmark = pytest.mark.e2e


def _serve(*args: str) -> subprocess.CompletedProcess:
    return subprocess.run([sys.executable, "-m", "pagedkv", "serve", "--port", str(free_port()), "--threads", "1",
                           "--log-format", "json", *args], cwd=ROOT, capture_output=True, text=True, timeout=240)


def _plain_errors(r: subprocess.CompletedProcess) -> list[str]:
    return [line for line in (r.stdout + r.stderr).splitlines() if line.startswith("error: ")]


def test_a_kv_cache_larger_than_the_machine_is_one_line_naming_what_fits():
    gib = math.ceil(2 * available_host_memory() / 2**30)  # twice what this machine has available
    r = _serve("--kv-cache-gb", str(gib))
    out = r.stdout + r.stderr
    assert r.returncode == 1, out
    assert "Traceback" not in out and "child_restarted" not in out and "pagedkv ready" not in out, out
    said = f"--kv-cache-gb {gib}: {gib} GiB of KV pages, but this machine has "
    errors = _plain_errors(r)
    assert len(errors) == 2, errors  # the executor's line, and serve's last one repeating it
    assert errors[0].startswith(f"error: {said}") and "GiB fits: ask for less" in errors[0], errors
    assert errors[1].startswith(f"error: executor exited with code 1 during start-up: {said}"), errors


def test_a_max_model_len_the_pages_cannot_hold_names_what_fits():
    r = _serve("--num-pages", "4", "--max-model-len", "2048")
    out = r.stdout + r.stderr
    assert r.returncode == 1, out
    assert "Traceback" not in out and "pagedkv ready" not in out, out
    errors = _plain_errors(r)
    assert errors[-1] == (
        "error: scheduler exited with code 1 during start-up: --max-model-len 2048 needs 128 pages of 16 tokens but "
        "the executor has 4 (at most --max-model-len 64 fits); lower --max-model-len or give the executor more pages "
        "(--num-pages, --kv-cache-gb)"), errors
