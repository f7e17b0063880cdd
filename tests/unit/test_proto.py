"""The checked-in stubs are exactly what the .proto files generate."""

from __future__ import annotations

from pathlib import Path

import pytest

from pagedkv.proto_gen import ROOT, generate

pytestmark = pytest.mark.unit


def test_generated_stubs_are_current(tmp_path: Path):
    generate(tmp_path)
    generated = sorted(p.relative_to(tmp_path) for p in tmp_path.rglob("*") if p.is_file())
    assert generated, "protoc produced nothing"
    for rel in generated:
        checked_in = ROOT / rel
        assert checked_in.exists(), f"{rel} is missing: run python -m pagedkv.proto_gen"
        assert checked_in.read_text() == (tmp_path / rel).read_text(), (
            f"{rel} differs from its .proto: run python -m pagedkv.proto_gen")


def test_services_are_versioned():
    from pagedkv.api.v1 import api_pb2
    from pagedkv.executor.v1 import executor_pb2
    from pagedkv.kvevents.v1 import kv_events_pb2

    assert api_pb2.DESCRIPTOR.package == "pagedkv.api.v1"
    assert executor_pb2.DESCRIPTOR.package == "pagedkv.executor.v1"
    assert kv_events_pb2.DESCRIPTOR.package == "pagedkv.kvevents.v1"
