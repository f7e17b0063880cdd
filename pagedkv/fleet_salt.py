"""The salt a fleet router keys a tenant's KV blocks by, and the tenant assertion a trusted hop signs.

A fleet router (Dynamo's KV router, llm-d's precise-prefix scorer) must keep tenants apart: a request may match
only blocks its own tenant's requests left. It keys blocks by a salt the request carries (Dynamo:
``nvext.cache_salt``) and the same salt on the engine's KV events. Neither may name a tenant or a key, and a
client must not pick it (it could probe another tenant's residency). So the salt is derived on the server side,
by the edge gateway and by each scheduler, from the tenant under a secret they share (``--fleet-secret-file``):

    salt = hex(HMAC-SHA256(secret, "pagedkv/cache-salt/v1" 0 tenant [0 "window:" S ":" W]))[:32]

The default tenant (no API keys configured: one trust domain) gets no salt, so an unsalted Dynamo deployment
matches. A windowed request (sink + window, its own hash-chain root in the scheduler) gets a salt of its own.

The edge gateway also tells the Dynamo sidecar whose request it is, through Dynamo's frontend (which
authenticates nobody: a client reaching it directly may send any header), as ``x-dynamo-meta-pagedkv-tenant``
(``TENANT_META_HEADER``) holding a tenant assertion signed under the same secret, valid for a short while::

    <tenant>.<expiry: unix seconds>.hex(HMAC-SHA256(secret, "pagedkv/tenant-assert/v1" 0 tenant 0 expiry))

(``make_assertion``; the sidecar checks it with ``verify_assertion`` and asserts the tenant to its scheduler as a
trusted hop, pagedkv/trusted_hop.py). Tenant ids may hold dots: the last two fields are split off from the right.
"""

from __future__ import annotations

import hashlib
import hmac
import time

from pagedkv.security import read_secret

FLEET_SECRET_ENV = "PAGEDKV_FLEET_SECRET"
FLEET_SECRET_FLAG = "--fleet-secret-file"
DEFAULT_TENANT = "default"  # (= scheduler_svc.tenancy.DEFAULT_TENANT: every caller's, when no tenants file is set)


def load_fleet_secret(path: str) -> bytes:
    """The secret from ``--fleet-secret-file PATH``, else ``$PAGEDKV_FLEET_SECRET``, else b'' (none). Raises
    ValueError naming the file or the variable when it is unreadable, blank or shorter than 16 bytes."""
    text, where = read_secret(path, FLEET_SECRET_FLAG, FLEET_SECRET_ENV)
    if not where:
        return b""
    secret = text.strip().encode("utf-8")
    if len(secret) < 16:
        raise ValueError(f"{where}: the fleet secret must hold at least 16 bytes (e.g. "
                         "python -c 'import secrets; print(secrets.token_hex(32))'), got "
                         f"{len(secret)}")
    return secret


def cache_salt(secret: bytes, tenant: str, window: tuple[int, int] | None = None) -> str:
    """The router salt of ``tenant`` (and of its windowed requests: ``window`` = (sink_tokens, window_tokens)).
    '' for the default tenant of unwindowed requests."""
    if tenant == DEFAULT_TENANT and window is None:
        return ""
    if not secret:
        raise ValueError(f"a fleet secret ({FLEET_SECRET_FLAG} or ${FLEET_SECRET_ENV}) is needed to salt tenant "
                         "events: without it a tenant's salt would be guessable")
    msg = b"pagedkv/cache-salt/v1\x00" + tenant.encode("utf-8")
    if window is not None:
        msg += b"\x00window:%d:%d" % window
    return hmac.new(secret, msg, hashlib.sha256).hexdigest()[:32]


def hash_id(page_hash: bytes) -> int:
    """A page's SHA-256 chain hash as the signed 64-bit block id the fleet protocols carry (its first 8 bytes,
    big-endian)."""
    return int.from_bytes(page_hash[:8], "big", signed=True)


# ---- the tenant assertion ----------------------------------------------------------------------------------
TENANT_META_HEADER = "x-dynamo-meta-pagedkv-tenant"  # Dynamo's frontend hands it on as context.metadata[META_KEY]
TENANT_META_KEY = TENANT_META_HEADER.removeprefix("x-dynamo-meta-")
DEFAULT_ASSERTION_TTL_S = 300
_ASSERT_DOMAIN = b"pagedkv/tenant-assert/v1\x00"
MAX_ASSERTION_CHARS = 64 + 1 + 20 + 1 + 64  # a tenant id at most 64 characters ([A-Za-z0-9._-]), expiry, MAC


class InvalidAssertion(ValueError):
    """A tenant assertion refused; ``reason`` is one of malformed, expired, bad_mac (a metrics label)."""

    def __init__(self, message: str, reason: str) -> None:
        super().__init__(message)
        self.reason = reason


def _assertion_mac(secret: bytes, tenant: str, expiry: int) -> str:
    msg = _ASSERT_DOMAIN + tenant.encode("utf-8") + b"\x00%d" % expiry
    return hmac.new(secret, msg, hashlib.sha256).hexdigest()


def make_assertion(secret: bytes, tenant: str, ttl: float = DEFAULT_ASSERTION_TTL_S, now: float | None = None) -> str:
    """``tenant``'s assertion, valid ``ttl`` seconds from ``now`` (default: the clock)."""
    if not secret:
        raise ValueError(f"a fleet secret ({FLEET_SECRET_FLAG} or ${FLEET_SECRET_ENV}) is needed to sign a tenant "
                         "assertion")
    if not tenant or len(tenant) > 64 or not all(c.isascii() and (c.isalnum() or c in "._-") for c in tenant):
        raise ValueError(f"tenant {tenant[:80]!r}: a tenant id is 1 to 64 characters of [A-Za-z0-9._-]")
    expiry = int((time.time() if now is None else now) + ttl)
    return f"{tenant}.{expiry}.{_assertion_mac(secret, tenant, expiry)}"


def verify_assertion(secret: bytes, token: str, now: float | None = None) -> str:
    """The tenant ``token`` asserts; InvalidAssertion when it is malformed, expired (``now``: default the clock) or
    not signed with ``secret`` (bad_mac). The MAC is compared in constant time, before the expiry is looked at."""
    if not secret:
        raise ValueError(f"a fleet secret ({FLEET_SECRET_FLAG} or ${FLEET_SECRET_ENV}) is needed to check a tenant "
                         "assertion")
    if not isinstance(token, str) or len(token) > MAX_ASSERTION_CHARS:
        raise InvalidAssertion(f"{TENANT_META_HEADER}: malformed (not 'tenant.expiry.mac', or longer than "
                               f"{MAX_ASSERTION_CHARS} characters)", "malformed")
    parts = token.rsplit(".", 2)
    if len(parts) != 3 or not parts[0] or not parts[1].isdigit() or not parts[1].isascii() or len(parts[2]) != 64:
        raise InvalidAssertion(f"{TENANT_META_HEADER}: malformed (expected 'tenant.expiry.mac', the expiry in unix "
                               "seconds, the MAC 64 hex digits)", "malformed")
    tenant, expiry, mac = parts[0], int(parts[1]), parts[2]
    if not hmac.compare_digest(mac.encode("ascii", "replace"), _assertion_mac(secret, tenant, expiry).encode()):
        raise InvalidAssertion(f"{TENANT_META_HEADER}: bad MAC (not signed with this fleet secret: the edge gateway "
                               f"and this sidecar must share {FLEET_SECRET_FLAG})", "bad_mac")
    if expiry < (time.time() if now is None else now):
        raise InvalidAssertion(f"{TENANT_META_HEADER}: expired at {expiry} (unix seconds); the edge gateway signs "
                               "each request's anew: a replayed or long-queued request", "expired")
    return tenant
