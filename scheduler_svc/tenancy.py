"""Who is calling. For now the tenant comes from the ``x-tenant`` metadata (``default`` when absent);
the tenants issue replaces this with authenticated API keys. Keep the derivation here, in one place."""

from __future__ import annotations

import re

DEFAULT_TENANT = "default"
_TENANT_RE = re.compile(r"^[A-Za-z0-9._-]{1,64}$")


class InvalidTenant(ValueError):
    pass


def tenant_of(metadata) -> str:
    for key, value in metadata or ():
        if key == "x-tenant":
            if not _TENANT_RE.match(value):
                raise InvalidTenant("x-tenant metadata: must be 1 to 64 characters of [A-Za-z0-9._-]")
            return value
    return DEFAULT_TENANT
