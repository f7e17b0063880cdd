"""docs/tenants.md describes the tenants file pagedkv/tenancy.py reads: every key, with the defaults the code
has, and an example that loads and maps its keys to its tenants."""

from __future__ import annotations

import dataclasses
import re
from pathlib import Path

import pytest
import tomllib

from pagedkv import tenancy, tenant_table

pytestmark = pytest.mark.unit

ROOT = Path(__file__).resolve().parents[2]
PAGE = ROOT / "docs" / "tenants.md"
ROW = re.compile(r"^\| `([a-z_]+)` \| ([^|]+) \| ([^|]+) \|", re.M)


def _rows() -> dict[str, tuple[str, str]]:
    return {key: (kind.strip(), default.strip()) for key, kind, default in ROW.findall(PAGE.read_text())}


def test_every_key_the_code_reads_is_documented() -> None:
    assert set(_rows()) == tenant_table.FIELDS, "docs/tenants.md's table and pagedkv/tenant_table.py's FIELDS differ"


def test_documented_defaults_are_the_codes() -> None:
    fields = {f.name: f.default for f in dataclasses.fields(tenancy.Tenant)}
    checked = 0
    for key, (_, default) in _rows().items():
        literal = re.match(r"^`([^`]+)`", default)
        if key in fields and literal:
            assert tomllib.loads(f"v = {literal.group(1)}")["v"] == fields[key], (key, default)
            checked += 1
    assert checked >= 10


def test_example_file_loads_and_maps_keys_to_tenants() -> None:
    (example,) = re.findall(r"```toml\n(.*?)```", PAGE.read_text(), re.S)
    tenants = tenancy.Tenants.parse(tomllib.loads(example), Path("tenants.toml"), num_pages=4096)
    assert {t.id for t in tenants} == {"acme", "batch", "ops"}
    assert tenants.authenticate([("authorization", "Bearer sk-acme-1")]).id == "acme"
    assert tenants.authenticate([("authorization", "Bearer sk-batch-2")]).id == "batch"
    assert tenants.authenticate([("authorization", "Bearer sk-ops-1")]).id == "ops"
    with pytest.raises(tenancy.Unauthenticated) as revoked:
        tenants.authenticate([("authorization", "Bearer sk-batch-1")])
    assert revoked.value.reason == "revoked"
    acme, batch = tenants.get("acme"), tenants.get("batch")
    assert (acme.page_quota, acme.reserved_pages, acme.page_budget, acme.weight) == (2048, 64, 256, 2.0)
    assert (batch.page_quota, batch.page_budget, batch.overflow, batch.structured_outputs) == (1000, 64, "stop", False)
    assert tenants.get("ops").admin
    assert (acme.max_adapters, batch.max_adapters) == (2, 0)


def test_readme_links_the_docs() -> None:
    readme = (ROOT / "README.md").read_text()
    assert "(docs/tenants.md)" in readme and "(docs/configuration.md)" in readme
