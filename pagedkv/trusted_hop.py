"""A trusted hop: an internal caller (the Dynamo sidecar ``pagedkv dynamo-worker``, or the gateway told it is one)
that may name the tenant of a request on the scheduler's API instead of presenting that tenant's API key.

The hop proves itself with a secret it shares with the scheduler (``--trusted-hop-secret-file PATH``, else
``$PAGEDKV_TRUSTED_HOP_SECRET``), sent as gRPC metadata ``x-pagedkv-hop: <secret>`` and compared in constant time.
Only then may a call carry the assertion headers:

- ``x-pagedkv-tenant: <tenant id>``: the request is that tenant's (it must be in the scheduler's tenants file);
- ``x-gateway-inference-fairness-id: <tenant id>`` (Gateway API Inference Extension): the same, as GIE's
  endpoint picker names it; given both, they must agree;
- ``x-gateway-inference-objective: <name>``: the request's priority is the one the scheduler's
  ``--objective NAME=PRIORITY`` gives that name (pagedkv's: lower is more important).

From anyone else a call carrying any of them is refused (PERMISSION_DENIED, naming the header): a client cannot
claim another tenant's quota or prefix-cache namespace. The names are defined here once: the scheduler checks
them, the gateway and the sidecar send them.
"""

from __future__ import annotations

from pagedkv.bounds import MAX_PRIORITY
from pagedkv.security import read_secret

HOP_HEADER = "x-pagedkv-hop"
TENANT_HEADER = "x-pagedkv-tenant"
FAIRNESS_ID_HEADER = "x-gateway-inference-fairness-id"
OBJECTIVE_HEADER = "x-gateway-inference-objective"
TENANT_HEADERS = (TENANT_HEADER, FAIRNESS_ID_HEADER)  # name the tenant
ASSERTION_HEADERS = (TENANT_HEADER, FAIRNESS_ID_HEADER, OBJECTIVE_HEADER)  # a trusted hop's only
HOP_SECRET_ENV = "PAGEDKV_TRUSTED_HOP_SECRET"
HOP_SECRET_FLAG = "--trusted-hop-secret-file"
MIN_SECRET_CHARS = 16


def load_hop_secret(path: str) -> str:
    """The secret from ``--trusted-hop-secret-file PATH``, else ``$PAGEDKV_TRUSTED_HOP_SECRET``, else '' (no hop
    is trusted). Raises ValueError naming the file or the variable when it is unreadable, shorter than 16
    characters, or not printable ASCII without spaces (it travels as gRPC metadata)."""
    text, where = read_secret(path, HOP_SECRET_FLAG, HOP_SECRET_ENV)
    if not where:
        return ""
    secret = text.strip()
    if len(secret) < MIN_SECRET_CHARS or not all(0x21 <= ord(c) <= 0x7E for c in secret):
        raise ValueError(f"{where}: the trusted-hop secret must be at least {MIN_SECRET_CHARS} printable ASCII "
                         "characters without spaces (it travels as gRPC metadata), e.g. python -c 'import secrets; "
                         f"print(secrets.token_hex(32))'; got {len(secret)} characters")
    return secret


def hop_metadata(secret: str, tenant: str = "", objective: str = "") -> tuple[tuple[str, str], ...]:
    """The metadata a trusted hop sends: its secret, and the tenant (and GIE objective) it asserts."""
    out = [(HOP_HEADER, secret)]
    if tenant:
        out.append((TENANT_HEADER, tenant))
    if objective:
        out.append((OBJECTIVE_HEADER, objective))
    return tuple(out)


def parse_objectives(values: list[str]) -> dict[str, int]:
    """``--objective NAME=PRIORITY`` (repeated) as a table; ValueError naming the bad one."""
    table: dict[str, int] = {}
    for value in values:
        name, sep, number = value.partition("=")
        name = name.strip()
        try:
            priority = int(number)
        except ValueError:
            priority = None
        if not sep or not name or priority is None or not -MAX_PRIORITY <= priority <= MAX_PRIORITY:
            raise ValueError(f"--objective {value!r}: give NAME=PRIORITY, PRIORITY an integer in [-{MAX_PRIORITY}, "
                             f"{MAX_PRIORITY}] (lower is more important), e.g. --objective interactive=-10")
        if name in table:
            raise ValueError(f"--objective {name}: given twice")
        table[name] = priority
    return table
