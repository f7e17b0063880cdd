"""The tenants file of the visibility tests (an admin, two tenants, a revoked key) and a key that is none."""

from __future__ import annotations

from pagedkv.tenancy import hash_key

WRONG_KEY = "sk-not-a-key-7f3a9c"

TENANTS = f"""
[tenants.alpha]
keys = ["{hash_key('key-alpha')}"]

[tenants.beta]
keys = ["{hash_key('key-beta')}"]

[tenants.ops]
keys = ["{hash_key('key-ops')}"]
revoked_keys = ["{hash_key('key-ops-old')}"]
admin = true
"""
