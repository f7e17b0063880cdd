"""The fleet salt and the tenant assertion the edge gateway signs for the Dynamo sidecar (pagedkv/fleet_salt.py):
each verifies only as signed, names its tenant, and ends at its expiry (times given, never the clock's)."""

from __future__ import annotations

import pytest

from pagedkv.fleet_salt import (
    DEFAULT_TENANT,
    InvalidAssertion,
    cache_salt,
    make_assertion,
    verify_assertion,
)

pytestmark = pytest.mark.unit

SECRET = b"0123456789abcdef-fleet"
NOW = 1_800_000_000.0


def test_an_assertion_names_its_tenant_until_it_expires():
    token = make_assertion(SECRET, "acme.eu-1", ttl=30, now=NOW)
    assert token.startswith("acme.eu-1.1800000030.")
    assert verify_assertion(SECRET, token, now=NOW) == "acme.eu-1"  # (a tenant id with dots: split from the right)
    assert verify_assertion(SECRET, token, now=NOW + 30) == "acme.eu-1"
    with pytest.raises(InvalidAssertion, match="expired at 1800000030") as err:
        verify_assertion(SECRET, token, now=NOW + 31)
    assert err.value.reason == "expired"


@pytest.mark.parametrize("forge", [
    lambda t: "beta" + t[len("alpha"):],  # another tenant, the same MAC
    lambda t: t.replace(".1800000060.", ".1900000060."),  # a later expiry, the same MAC
    lambda t: t[:-1] + ("0" if t[-1] != "0" else "1"),  # the MAC altered
])
def test_a_forged_assertion_is_a_bad_mac(forge):
    token = make_assertion(SECRET, "alpha", ttl=60, now=NOW)
    with pytest.raises(InvalidAssertion, match="bad MAC") as err:
        verify_assertion(SECRET, forge(token), now=NOW)
    assert err.value.reason == "bad_mac"
    with pytest.raises(InvalidAssertion, match="bad MAC"):
        verify_assertion(b"another-secret-of-16+", token, now=NOW)


@pytest.mark.parametrize("token", ["", "alpha", "alpha.123", "alpha.12x.%s" % ("0" * 64), ".123.%s" % ("0" * 64),
                                   "alpha.123.abc", "a" * 300, "alpha.١٢٣.%s" % ("0" * 64)])
def test_a_malformed_assertion_says_so(token):
    with pytest.raises(InvalidAssertion, match="malformed") as err:
        verify_assertion(SECRET, token, now=NOW)
    assert err.value.reason == "malformed"


def test_no_secret_signs_or_checks_nothing():
    with pytest.raises(ValueError, match="--fleet-secret-file"):
        make_assertion(b"", "alpha")
    with pytest.raises(ValueError, match="--fleet-secret-file"):
        verify_assertion(b"", "alpha.1.%s" % ("0" * 64))
    with pytest.raises(ValueError, match="a tenant id is 1 to 64"):
        make_assertion(SECRET, "bad tenant")


def test_the_salt_is_per_tenant_and_per_window():
    a, b = cache_salt(SECRET, "alpha"), cache_salt(SECRET, "beta")
    assert len(a) == 32 and a != b and a == cache_salt(SECRET, "alpha")
    assert cache_salt(b"another-secret-of-16+", "alpha") != a  # (a secret no one else holds: no salt to guess)
    assert cache_salt(SECRET, "alpha", (16, 256)) not in (a, cache_salt(SECRET, "alpha", (16, 512)))
    assert cache_salt(SECRET, DEFAULT_TENANT) == ""  # one trust domain: unsalted, as an unsalted Dynamo
    with pytest.raises(ValueError, match="fleet secret"):
        cache_salt(b"", "alpha")
