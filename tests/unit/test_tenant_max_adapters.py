"""The tenants file's ``max_adapters`` (#52): how many LoRA adapters a tenant may load at run time and own at once;
an integer in [0, 2^24], 0 (none) by default and on a server without a tenants file, [defaults] applying as to any
key; anything else refused at load naming ``tenants.ID.max_adapters``."""

from __future__ import annotations

from pathlib import Path

import pytest
import tomllib

from pagedkv.tenancy import MAX_INT, InvalidTenant, Tenants

pytestmark = pytest.mark.unit


def _parse(text: str) -> Tenants:
    return Tenants.parse(tomllib.loads(text), Path("tenants.toml"), num_pages=100)


def test_max_adapters_is_read_per_tenant_and_from_defaults():
    tenants = _parse("[defaults]\nmax_adapters = 1\n[tenants.acme]\nmax_adapters = 4\n[tenants.batch]\n"
                     "[tenants.ops]\nmax_adapters = 0\n")
    assert [tenants.get(t).max_adapters for t in ("acme", "batch", "ops")] == [4, 1, 0]
    assert _parse("[tenants.acme]\n").get("acme").max_adapters == 0, "default: none"
    assert _parse(f"[tenants.acme]\nmax_adapters = {MAX_INT}\n").get("acme").max_adapters == MAX_INT
    assert Tenants().get("default").max_adapters == 0, "a server without a tenants file: none"


@pytest.mark.parametrize("value", ["-1", "true", "1.5", '"2"', str(MAX_INT + 1), "[1]"])
def test_a_max_adapters_that_is_no_count_is_refused_naming_it(value):
    with pytest.raises(InvalidTenant) as err:
        _parse(f"[tenants.acme]\nmax_adapters = {value}\n")
    assert str(err.value).startswith("tenants.acme.max_adapters: must be an integer in [0, 16777216], got ")
