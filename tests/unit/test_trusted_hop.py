"""Who a call is for (scheduler_svc/trusted_hop.py), in one process: an API key's tenant as before; the tenant a
trusted hop names; and the assertion headers refused, naming the header, from anyone else."""

from __future__ import annotations

import pytest

from pagedkv.tenancy import Tenants, Unauthenticated, hash_key
from pagedkv.trusted_hop import (
    FAIRNESS_ID_HEADER,
    HOP_HEADER,
    OBJECTIVE_HEADER,
    TENANT_HEADER,
    hop_metadata,
    load_hop_secret,
    parse_objectives,
)
from scheduler_svc.trusted_hop import HopRefused, TrustedHops

pytestmark = pytest.mark.unit

SECRET = "hop-secret-0123456789"
KEY = "key-alpha"
TENANTS = {"tenants": {"alpha": {"keys": [hash_key(KEY)]}, "beta": {"keys": [hash_key("key-beta")]}}}


@pytest.fixture
def tenants(tmp_path) -> Tenants:
    return Tenants.parse(TENANTS, tmp_path / "t.toml", 64)


HOPS = TrustedHops(SECRET, {"interactive": -10, "batch": 10})
BEARER = ("authorization", f"Bearer {KEY}")


def test_a_key_alone_is_its_tenant_as_before(tenants):
    c = HOPS.caller(tenants, [BEARER])
    assert (c.tenant.id, c.asserted, c.priority) == ("alpha", False, None) and c.key
    with pytest.raises(Unauthenticated, match="missing API key"):
        HOPS.caller(tenants, [])


@pytest.mark.parametrize("header", [TENANT_HEADER, FAIRNESS_ID_HEADER, OBJECTIVE_HEADER])
def test_an_assertion_header_from_anyone_but_a_hop_is_refused_naming_it(tenants, header):
    value = "interactive" if header == OBJECTIVE_HEADER else "beta"
    for hops in (HOPS, TrustedHops()):  # (whether or not this scheduler trusts a hop)
        with pytest.raises(HopRefused, match=f"^{header}: only a trusted hop may send it") as err:
            hops.caller(tenants, [BEARER, (header, value)])
        assert err.value.reason == "not_a_hop" and not err.value.invalid


def test_a_wrong_or_unconfigured_hop_secret_is_refused(tenants):
    with pytest.raises(HopRefused, match=f"^{HOP_HEADER}: not this scheduler's trusted-hop secret") as err:
        HOPS.caller(tenants, hop_metadata(SECRET + "x", "beta"))
    assert err.value.reason == "wrong_secret" and SECRET not in str(err.value)
    with pytest.raises(HopRefused, match="wrong_secret|not this scheduler"):
        HOPS.caller(tenants, [(HOP_HEADER, SECRET), (HOP_HEADER, SECRET), (TENANT_HEADER, "beta")])
    with pytest.raises(HopRefused, match="trusts no hop") as err:
        TrustedHops().caller(tenants, hop_metadata(SECRET, "beta"))
    assert err.value.reason == "no_hop_configured"


def test_a_trusted_hop_names_the_tenant(tenants):
    c = HOPS.caller(tenants, [BEARER, *hop_metadata(SECRET, "beta")])  # (the named tenant wins over a key)
    assert (c.tenant.id, c.key, c.asserted, c.priority) == ("beta", b"", True, None)
    c = HOPS.caller(tenants, [(HOP_HEADER, SECRET), (FAIRNESS_ID_HEADER, "beta"), (OBJECTIVE_HEADER, "batch")])
    assert (c.tenant.id, c.asserted, c.priority) == ("beta", True, 10)
    c = HOPS.caller(tenants, [BEARER, (HOP_HEADER, SECRET), (OBJECTIVE_HEADER, "interactive")])
    assert (c.tenant.id, c.asserted, c.priority) == ("alpha", False, -10)  # an objective alone: the key's tenant
    single = HOPS.caller(Tenants(), hop_metadata(SECRET, "default"))
    assert single.tenant.id == "default" and single.asserted


def test_a_hop_naming_badly_is_refused(tenants):
    with pytest.raises(HopRefused, match=f"^{TENANT_HEADER}: tenant 'gamma' is not in the tenants file") as err:
        HOPS.caller(tenants, hop_metadata(SECRET, "gamma"))
    assert err.value.reason == "unknown_tenant" and not err.value.invalid
    with pytest.raises(HopRefused, match="they name different tenants") as err:
        HOPS.caller(tenants, [*hop_metadata(SECRET, "alpha"), (FAIRNESS_ID_HEADER, "beta")])
    assert err.value.invalid
    with pytest.raises(HopRefused, match=f"^{OBJECTIVE_HEADER}: objective 'gold' is unknown here; known: batch, "
                       "interactive") as err:
        HOPS.caller(tenants, hop_metadata(SECRET, "alpha", "gold"))
    assert err.value.invalid
    with pytest.raises(HopRefused, match=f"^{TENANT_HEADER}: sent 2 times"):
        HOPS.caller(tenants, [*hop_metadata(SECRET, "alpha"), (TENANT_HEADER, "alpha")])


def test_objectives_and_the_secret_are_checked(tmp_path, monkeypatch):
    assert parse_objectives(["interactive=-10", " batch = 10"]) == {"interactive": -10, "batch": 10}
    for bad in ("interactive", "=1", "a=x", "a=1001"):
        with pytest.raises(ValueError, match="give NAME=PRIORITY"):
            parse_objectives([bad])
    with pytest.raises(ValueError, match="given twice"):
        parse_objectives(["a=1", "a=2"])
    monkeypatch.delenv("PAGEDKV_TRUSTED_HOP_SECRET", raising=False)
    assert load_hop_secret("") == ""
    path = tmp_path / "hop.secret"
    path.write_text(SECRET + "\n")
    assert load_hop_secret(str(path)) == SECRET
    path.write_text("short")
    with pytest.raises(ValueError, match=f"--trusted-hop-secret-file {path}: .* at least 16"):
        load_hop_secret(str(path))
    with pytest.raises(ValueError, match="cannot read it"):
        load_hop_secret(str(tmp_path / "missing"))
    monkeypatch.setenv("PAGEDKV_TRUSTED_HOP_SECRET", "with space in it, long enough")
    with pytest.raises(ValueError, match=r"\$PAGEDKV_TRUSTED_HOP_SECRET"):
        load_hop_secret("")
