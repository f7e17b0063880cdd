"""Who a call on the public API is for: the tenant of its API key (tenancy.py), or the tenant a trusted hop
asserts (pagedkv/trusted_hop.py has the headers and the secret). ``TrustedHops.caller`` decides; the API servicer
turns its refusals into gRPC status codes."""

from __future__ import annotations

import hmac
from dataclasses import dataclass

from pagedkv.tenancy import Tenant, Tenants
from pagedkv.trusted_hop import (
    ASSERTION_HEADERS,
    FAIRNESS_ID_HEADER,
    HOP_HEADER,
    HOP_SECRET_FLAG,
    OBJECTIVE_HEADER,
    TENANT_HEADER,
)

MAX_VALUE_CHARS = 256  # an assertion header's value, echoed in a refusal at most this long


@dataclass(frozen=True, slots=True)
class Caller:
    tenant: Tenant
    key: bytes  # SHA-256 of the API key it sent (b"": none, a single-tenant server or an asserted tenant)
    asserted: bool = False  # the tenant was named by a trusted hop, not by a key
    priority: int | None = None  # set by a trusted hop's GIE objective: the request's priority


class HopRefused(Exception):
    """A call that names a tenant or objective it may not (PERMISSION_DENIED) or names one badly
    (``invalid``: INVALID_ARGUMENT). ``reason``: a metrics label."""

    def __init__(self, message: str, reason: str, invalid: bool = False) -> None:
        super().__init__(message)
        self.reason, self.invalid = reason, invalid


def _shown(value: str) -> str:
    return repr(value if len(value) <= MAX_VALUE_CHARS else value[:MAX_VALUE_CHARS] + "...")


class TrustedHops:
    """The scheduler's trusted-hop settings: the secret a hop presents ('' trusts none) and the GIE objectives'
    priorities (``--objective NAME=PRIORITY``)."""

    def __init__(self, secret: str = "", objectives: dict[str, int] | None = None) -> None:
        self._expected = secret.encode() if secret else b""
        self.objectives = dict(objectives or {})

    @property
    def enabled(self) -> bool:
        return bool(self._expected)

    def caller(self, tenants: Tenants, metadata) -> Caller:
        """The call's tenant. Without any of ``x-pagedkv-hop`` and the assertion headers, its API key's
        (Tenants.caller: Unauthenticated as before). With them: HopRefused unless the call presents the
        trusted-hop secret, once; then the tenant it names (which must be in the tenants file), else its key's,
        and the priority of the objective it names."""
        entries = [(key, value) for key, value in metadata or () if key == HOP_HEADER or key in ASSERTION_HEADERS]
        if not entries:
            t, key = tenants.caller(metadata)
            return Caller(t, key)
        sent: dict[str, list[str]] = {}
        for key, value in entries:
            sent.setdefault(key, []).append(value if isinstance(value, str) else "")
        self._check_hop(sent)
        for name, values in sent.items():
            if len(values) > 1:
                raise HopRefused(f"{name}: sent {len(values)} times; send it once", "multiple", invalid=True)
        named = {sent[h][0] for h in (TENANT_HEADER, FAIRNESS_ID_HEADER) if h in sent}
        if len(named) > 1:
            raise HopRefused(f"{TENANT_HEADER} and {FAIRNESS_ID_HEADER}: they name different tenants "
                             f"({', '.join(sorted(_shown(v) for v in named))}); send one, or the same in both",
                             "conflict", invalid=True)
        priority = self._priority(sent[OBJECTIVE_HEADER][0]) if OBJECTIVE_HEADER in sent else None
        if not named:  # a hop that names only an objective: the tenant is its client's key's
            t, key = tenants.caller(metadata)
            return Caller(t, key, priority=priority)
        tenant_id = named.pop()
        header = TENANT_HEADER if TENANT_HEADER in sent else FAIRNESS_ID_HEADER
        tenant = tenants.named(tenant_id)
        if tenant is None:
            raise HopRefused(f"{header}: tenant {_shown(tenant_id)} is not in the tenants file (a scheduler without "
                             "one knows only 'default')", "unknown_tenant")
        return Caller(tenant, b"", asserted=True, priority=priority)

    def _check_hop(self, sent: dict[str, list[str]]) -> None:
        presented = sent.get(HOP_HEADER)
        if presented is None:
            header = next(h for h in ASSERTION_HEADERS if h in sent)
            raise HopRefused(f"{header}: only a trusted hop may send it (a call with {HOP_HEADER} and the scheduler's "
                             f"{HOP_SECRET_FLAG} secret); authenticate with your API key alone", "not_a_hop")
        if not self._expected:
            raise HopRefused(f"{HOP_HEADER}: this scheduler trusts no hop (it was started without "
                             f"{HOP_SECRET_FLAG})", "no_hop_configured")
        if len(presented) != 1 or not hmac.compare_digest(presented[0].encode("utf-8", "surrogateescape"),
                                                          self._expected):
            raise HopRefused(f"{HOP_HEADER}: not this scheduler's trusted-hop secret (its {HOP_SECRET_FLAG}); "
                             "only a trusted hop may name a tenant", "wrong_secret")

    def _priority(self, objective: str) -> int:
        priority = self.objectives.get(objective)
        if priority is None:
            known = ", ".join(sorted(self.objectives)) or "none (the scheduler's --objective NAME=PRIORITY)"
            raise HopRefused(f"{OBJECTIVE_HEADER}: objective {_shown(objective)} is unknown here; known: {known}",
                             "unknown_objective", invalid=True)
        return priority
