"""The tenants file's admin flag, in one process. (What each caller may see through real processes:
tests/e2e/test_tenant_visibility.py.)"""

from __future__ import annotations

import pytest

from tests.support.tenant_visibility import TENANTS, WRONG_KEY

pytestmark = pytest.mark.unit


def test_admin_flag_in_the_tenants_file(tmp_path):
    from pagedkv.tenancy import InvalidTenant, Tenants, Unauthenticated

    path = tmp_path / "t.toml"
    path.write_text(TENANTS)
    tenants = Tenants.load(path, 64)
    assert [t.id for t in tenants if tenants.sees_cluster(t)] == ["ops"]
    assert Tenants().sees_cluster(Tenants().get("default")), "a single-tenant server's one caller sees all"
    path.write_text('[tenants.a]\nadmin = "yes"\n')
    with pytest.raises(InvalidTenant, match="tenants.a.admin: must be true or false"):
        Tenants.load(path, 64)
    with pytest.raises(Unauthenticated) as err:
        tenants.authenticate([("authorization", f"Bearer {WRONG_KEY}")])
    assert err.value.reason == "unknown" and WRONG_KEY not in str(err.value)
