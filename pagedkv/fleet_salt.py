"""The salt a fleet router keys a tenant's KV blocks by, and the tenant assertion a trusted hop signs.

A fleet router (Dynamo's KV router, llm-d's precise-prefix scorer) must keep tenants apart: a request may match
only blocks its own tenant's requests left. It keys blocks by a salt the request carries (Dynamo:
``nvext.cache_salt``) and the same salt on the engine's KV events. Neither may name a tenant or a key, and a
client must not pick it (it could probe another tenant's residency). So the salt is derived on the server side,
by the edge gateway and by each scheduler, from the tenant under a secret they share (``--fleet-secret-file``):

    salt = hex(HMAC-SHA256(secret, "pagedkv/cache-salt/v1" 0 tenant [0 "window:" S ":" W]))[:32]

The default tenant (no API keys configured: one trust domain) gets no salt, so an unsalted Dynamo deployment
matches. A windowed request (sink + window, its own hash-chain root in the scheduler) gets a salt of its own.
"""

from __future__ import annotations

import hashlib
import hmac
import os
from pathlib import Path

FLEET_SECRET_ENV = "PAGEDKV_FLEET_SECRET"
FLEET_SECRET_FLAG = "--fleet-secret-file"
DEFAULT_TENANT = "default"  # (= scheduler_svc.tenancy.DEFAULT_TENANT: every caller's, when no tenants file is set)


def load_fleet_secret(path: str) -> bytes:
    """The secret from ``--fleet-secret-file PATH``, else ``$PAGEDKV_FLEET_SECRET``, else b'' (none). Raises
    ValueError naming the file or the variable when it is unreadable, blank or shorter than 16 bytes."""
    if path:
        try:
            text = Path(path).read_text(encoding="utf-8")
        except (OSError, UnicodeDecodeError) as err:
            raise ValueError(f"{FLEET_SECRET_FLAG} {path}: cannot read it: {err}") from err
        where = f"{FLEET_SECRET_FLAG} {path}"
    else:
        text, where = os.environ.get(FLEET_SECRET_ENV, ""), f"${FLEET_SECRET_ENV}"
        if not text:
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
