"""One tenant's table of the tenants file (pagedkv/tenancy.py describes the file): the ``Tenant`` it gives, every
key checked (``parse_tenant``: an ``InvalidTenant`` names the table, the key, the value and the limit), page counts
resolved against the pool. ``FIELDS`` is the table's keys (docs/tenants.md documents each one)."""

from __future__ import annotations

import re
from dataclasses import dataclass, field

from pagedkv.bounds import MAX_PRIORITY

MAX_INT = 1 << 24  # bound for counts in the tenants file (they travel as int32)
OVERFLOW_POLICIES = ("window", "stop")
_TENANT_RE = re.compile(r"^[A-Za-z0-9._-]{1,64}$")
_HASH_RE = re.compile(r"^sha256:[0-9a-f]{64}$")


class InvalidTenant(ValueError):
    pass


@dataclass(frozen=True, slots=True)
class Tenant:
    id: str
    weight: float = 1.0
    page_quota: int = 0  # pages; 0: the whole pool
    reserved_pages: int = 0
    max_concurrent_requests: int = 0  # 0: no limit
    max_queued_requests: int | None = None  # waiting to start; 0: no limit; None: the scheduler's default
    page_budget: int = 0  # pages per request; 0: no limit
    overflow: str = "window"
    sliding_window: int = 0  # tokens; 0: off
    sink_tokens: int = 0
    admin: bool = False  # ModelInfo shows this tenant the cluster-wide figures and the executors
    structured_outputs: bool = True  # may send constraints
    max_constraint_bytes: int = 0  # a constraint's size at most; 0: the server's
    max_constrained_requests: int = 0  # constrained requests open at once; 0: no limit
    max_priority: int = 0  # the lowest (most important) priority its requests may ask for
    adapters: tuple[str, ...] | None = None  # the LoRA adapters it may use; None: every one served
    max_adapters: int = 0  # adapters it may load at run time (LoadAdapter) and own at once; 0: none
    key_hashes: tuple[bytes, ...] = field(default=(), repr=False)
    revoked_hashes: tuple[bytes, ...] = field(default=(), repr=False)

    def may_use(self, adapter: str) -> bool:
        """Whether its requests may select the LoRA adapter named ``adapter`` (one the executors serve)."""
        return self.adapters is None or adapter in self.adapters


def unless_fitting(fit: bool, message: str) -> None:
    """A setting that does not fit the pool: an error when the file is loaded; when it is fitted to the pages
    that serve now (``fit``, see ``Tenants.resolve``) the caller cuts the setting instead."""
    if not fit:
        raise InvalidTenant(message)


def _pages(value, name: str, num_pages: int, fit: bool = False) -> int:
    """A page count given as a fraction of the pool (float in (0, 1]) or a number of pages (int)."""
    if isinstance(value, bool) or not isinstance(value, int | float):
        raise InvalidTenant(f"{name}: must be a number of pages or a fraction of the pool, got {value!r}")
    if isinstance(value, float):
        if not 0 <= value <= 1:
            raise InvalidTenant(f"{name}: a fraction must be in [0, 1], got {value}")
        return int(value * num_pages)
    if not 0 <= value <= num_pages:
        unless_fitting(fit and value > 0, f"{name}: {value} pages; must be in [0, {num_pages}] (the device pool)")
        return num_pages
    return value


def _hashes(values, name: str) -> tuple[bytes, ...]:
    if not isinstance(values, list) or not all(isinstance(v, str) for v in values):
        raise InvalidTenant(f"{name}: must be a list of strings")
    for v in values:
        if not _HASH_RE.match(v):
            raise InvalidTenant(f"{name}: {v[:12]}... is not 'sha256:<64 hex digits>' (store hashed keys: "
                                "pagedkv hash-key KEY)")
    return tuple(bytes.fromhex(v.removeprefix("sha256:")) for v in values)


FIELDS = {"keys", "revoked_keys", "weight", "page_quota", "reserved_pages", "max_concurrent_requests",
           "max_queued_requests", "page_budget", "overflow", "sliding_window", "sink_tokens", "admin",
           "structured_outputs", "max_constraint_bytes", "max_constrained_requests", "max_priority", "adapters",
          "max_adapters"}


def parse_tenant(tid: str, raw: dict, num_pages: int, fit: bool = False) -> Tenant:
    where = f"tenants.{tid}"
    if not _TENANT_RE.match(tid):
        raise InvalidTenant(f"{where}: a tenant id is 1 to 64 characters of [A-Za-z0-9._-]")
    unknown = set(raw) - FIELDS
    if unknown:
        raise InvalidTenant(f"{where}: unknown field(s) {sorted(unknown)}; known: {sorted(FIELDS)}")
    weight = raw.get("weight", 1.0)
    if isinstance(weight, bool) or not isinstance(weight, int | float) or not 0 < weight <= 1e6:
        raise InvalidTenant(f"{where}.weight: must be a number in (0, 1e6], got {weight!r}")
    quota = _pages(raw.get("page_quota", num_pages), f"{where}.page_quota", num_pages, fit)
    reserved = _pages(raw.get("reserved_pages", 0), f"{where}.reserved_pages", num_pages, fit)
    if quota < 1:
        unless_fitting(fit, f"{where}.page_quota: {quota} pages; a tenant needs at least 1")
        quota = 1  # (0 would mean no quota)
    if reserved > quota:
        unless_fitting(fit, f"{where}.reserved_pages: {reserved} is above its page_quota {quota}")
        reserved = quota
    ints = {}
    for name in ("max_concurrent_requests", "page_budget", "sliding_window", "sink_tokens", "max_constraint_bytes",
                 "max_constrained_requests", "max_adapters"):
        value = raw.get(name, 0)
        if isinstance(value, bool) or not isinstance(value, int) or not 0 <= value <= MAX_INT:
            raise InvalidTenant(f"{where}.{name}: must be an integer in [0, {MAX_INT}], got {value!r}")
        ints[name] = value
    if ints["page_budget"] > quota:
        unless_fitting(fit, f"{where}.page_budget: {ints['page_budget']} pages is above its page_quota {quota}")
        ints["page_budget"] = quota
    overflow = raw.get("overflow", "window")
    if overflow not in OVERFLOW_POLICIES:
        raise InvalidTenant(f"{where}.overflow: {overflow!r}; must be one of {list(OVERFLOW_POLICIES)}")
    admin, structured = raw.get("admin", False), raw.get("structured_outputs", True)
    for name, value in (("admin", admin), ("structured_outputs", structured)):
        if not isinstance(value, bool):
            raise InvalidTenant(f"{where}.{name}: must be true or false, got {value!r}")
    max_priority = raw.get("max_priority", 0)
    if isinstance(max_priority, bool) or not isinstance(max_priority, int) or abs(max_priority) > MAX_PRIORITY:
        raise InvalidTenant(f"{where}.max_priority: must be an integer in [-{MAX_PRIORITY}, {MAX_PRIORITY}] (lower is "
                            f"more important), got {max_priority!r}")
    adapters = raw.get("adapters")
    if adapters is not None and (not isinstance(adapters, list) or not all(isinstance(a, str) for a in adapters)):
        raise InvalidTenant(f"{where}.adapters: must be a list of adapter names (strings), got {adapters!r}")
    queued = raw.get("max_queued_requests")
    if queued is not None and (isinstance(queued, bool) or not isinstance(queued, int) or not 0 <= queued <= MAX_INT):
        raise InvalidTenant(f"{where}.max_queued_requests: must be an integer in [0, {MAX_INT}], got {queued!r}")
    return Tenant(id=tid, weight=float(weight), page_quota=quota, reserved_pages=reserved, overflow=overflow,
                  admin=admin, max_queued_requests=queued, structured_outputs=structured, max_priority=max_priority,
                  adapters=None if adapters is None else tuple(adapters),
                  key_hashes=_hashes(raw.get("keys", []), f"{where}.keys"),
                  revoked_hashes=_hashes(raw.get("revoked_keys", []), f"{where}.revoked_keys"), **ints)

