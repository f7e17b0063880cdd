"""Start-up costs (executor_svc/costs.py) are measured once per key and kept: a later start reads them, a
damaged or foreign file is measured again, and a cache that cannot be written only costs a measurement."""

from __future__ import annotations

import stat

import pytest

from executor_svc import costs as costs_mod
from executor_svc.costs import Costs, cached_costs, cost_key

pytestmark = pytest.mark.unit


def _counting(monkeypatch, value: Costs) -> list[int]:
    calls: list[int] = []
    monkeypatch.setattr(costs_mod, "measure_costs", lambda runner: calls.append(1) or value)
    return calls


def test_measured_once_then_kept(tmp_path, monkeypatch):
    calls = _counting(monkeypatch, Costs(3e9, 2e-4))
    key = cost_key(["model", "float32", "cpu"])
    assert cached_costs(None, key, tmp_path) == (Costs(3e9, 2e-4), False)
    assert cached_costs(None, key, tmp_path) == (Costs(3e9, 2e-4), True)
    assert len(calls) == 1
    other = cost_key(["model", "bfloat16", "cpu"])  # anything else it depends on: another measurement
    assert other != key and cached_costs(None, other, tmp_path)[1] is False and len(calls) == 2


def test_a_damaged_file_is_measured_again(tmp_path, monkeypatch):
    calls = _counting(monkeypatch, Costs(1e9, 1e-4))
    key = cost_key(["x"])
    for text in ("{not json", '{"swap_bytes_per_second": 1}', '{"swap_bytes_per_second": 1, '
                 '"prefill_seconds_per_token": 0}'):
        (tmp_path / f"costs-{key}.json").write_text(text)
        assert cached_costs(None, key, tmp_path) == (Costs(1e9, 1e-4), False)
    assert len(calls) == 3 and cached_costs(None, key, tmp_path)[1] is True


def test_an_unwritable_cache_still_starts(tmp_path, monkeypatch):
    calls = _counting(monkeypatch, Costs(1e9, 1e-4))
    tmp_path.chmod(stat.S_IRUSR | stat.S_IXUSR)
    try:
        blocked = tmp_path / "costs"  # (root may write anyway: then the second call finds the file)
        assert cached_costs(None, "k", blocked)[0] == Costs(1e9, 1e-4)
    finally:
        tmp_path.chmod(stat.S_IRWXU)
    assert len(calls) == 1
