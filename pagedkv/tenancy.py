"""Who is calling, and what they may hold: tenants, API keys, weights, page quotas, request limits. The scheduler
and the gateway's edge (pagedkv/gateway/edge.py) both read the tenants file, so its model lives here, in neither
(one tenant's table: pagedkv/tenant_table.py).

A tenants file (TOML, ``--tenants-file``) lists the tenants::

    [defaults]                      # optional: every tenant starts from these
    page_budget = 256               # pages one request may hold (0: no limit)
    overflow = "window"             # past the budget: "window" (sink + recent tokens) or "stop"

    [tenants.acme]
    keys = ["sha256:5e884898da28047151d0e56f8dc6292773603d0d6aabbdd62a11ef721d1542d8"]
    revoked_keys = []               # refused with "revoked", not "unknown"
    weight = 2.0                    # fair-share weight
    page_quota = 0.5                # most device pages held at once: a fraction of all pools or a count
    reserved_pages = 64             # pages kept free for this tenant (a fraction or a count)
    max_concurrent_requests = 128   # 0: no limit
    max_queued_requests = 256       # requests waiting to start; past it RESOURCE_EXHAUSTED (0: no limit;
                                    # unset: the scheduler's --max-queued-requests)
    sliding_window = 0              # attend to the sink plus the last N tokens (0: off)
    sink_tokens = 16
    admin = false                   # true: ModelInfo shows this key the whole cluster (see below)
    structured_outputs = true       # false: a request with a constraint (response_format, guided_*, a tool_choice
                                    # of required or a named function) is refused
    max_constraint_bytes = 0        # a constraint's schema, regex, grammar or choices at most (0: the server's
                                    # 65,536 bytes; more is cut to it)
    max_constrained_requests = 0    # its constrained requests open at once (each steps a grammar matcher on the
                                    # executor); past it RESOURCE_EXHAUSTED "queue full: ..." (0: no limit)
    max_priority = 0                # the most important priority it may ask for (lower is more important); a
                                    # request asking for less is refused (INVALID_ARGUMENT naming priority)
    adapters = ["sql-lora"]         # the LoRA adapters it may use (unset: every one served; []: none)
    max_adapters = 2                # adapters it may load at run time (LoadAdapter, POST /v1/load_lora_adapter)
                                    # and own at once; only it sees and uses them (0, the default: none)

Every limit is the scheduler's, summed over all its executors (``scheduler_svc/tenant_ledger.py``): a fraction is of the
device pages of every executor that serves (up or draining) together, and a tenant capped at 4 concurrent
requests runs 4 in total, not 4 on each. While fewer pages serve than the file was checked for (an executor down),
a count that no longer fits is cut to them (``Tenants.resolve``).

Keys are stored as ``sha256:<hex>`` of the key (``pagedkv hash-key KEY`` prints it) and compared in
constant time. Clients send ``authorization: Bearer <key>``, once: a call with two ``authorization`` entries
is refused, whatever they hold. Without a tenants file the server is single-tenant: every caller is
``default`` and no key is asked for, unless ``--api-key`` (or ``$PAGEDKV_API_KEY``) gives the one key every caller
must send (as vLLM's ``--api-key``); that key and a tenants file are refused together. The tenant decides the
prefix cache's namespace (``scheduler_svc.prefix_cache.tenant_root``): a client never chooses it. A reload (SIGHUP) that
revokes a key, or drops it, ends the streams opened with it (``UNAUTHENTICATED``; ``key_problem`` says which keys
no longer hold).

What a tenant sees (``ModelInfo``): the model's facts (model, max_model_len, block size, vocabulary, dtypes,
backend, prefix caching, pool sizes) and its own figures (``tenant``: settings, pages held, requests, budget
hits, the weighted tokens charged to it). Nothing in it depends on what other tenants do: its weighted
service is its own charges (not the fair scheduler's virtual counter, which a tenant back from idle starts at
the others' level), and its fair share of pages and the preemptions made to give other tenants theirs are left
0. Cluster-wide counts (pages used and cached, running and waiting requests of everyone, tokens computed,
prefix-cache hits, swaps, preemptions), the fair-share figures and the executors' addresses and states would
show one tenant another's activity: a tenant marked ``admin = true`` sees them (operators, dashboards,
benchmarks). A single-tenant server (no tenants file) has one caller, who sees everything.
"""

from __future__ import annotations

import hashlib
import hmac
from dataclasses import replace
from pathlib import Path

import tomllib

from pagedkv.bounds import MAX_PRIORITY
from pagedkv.tenant_table import MAX_INT as MAX_INT  # (re-exported: a tenant's table is read there)
from pagedkv.tenant_table import InvalidTenant as InvalidTenant
from pagedkv.tenant_table import Tenant as Tenant
from pagedkv.tenant_table import parse_tenant, unless_fitting

DEFAULT_TENANT = "default"
API_KEY_ENV = "PAGEDKV_API_KEY"  # --api-key's default (and the clients': pagedkv generate, bench, dynamo-worker)


class Unauthenticated(Exception):
    """``reason`` is one of missing, malformed, multiple, unknown, revoked (a metrics label); the message says what
    to do. Neither ever holds the key."""

    def __init__(self, message: str, reason: str) -> None:
        super().__init__(message)
        self.reason = reason


def hash_key(key: str) -> str:
    return "sha256:" + hashlib.sha256(key.encode("utf-8")).hexdigest()


class Tenants:
    """The tenant registry. ``authenticate`` maps a call's metadata to a Tenant."""

    def __init__(self, tenants: list[Tenant] | None = None, path: Path | None = None, api_key: str = "") -> None:
        """``tenants`` from a file; none: single-tenant, every caller ``default``, who must send ``api_key`` when
        one is given (--api-key)."""
        self.path = path
        self.raw: dict | None = None  # the parsed file (fractions are resolved again when the pools change)
        self.multi = tenants is not None
        # (the one tenant of a server without a file may ask for any priority: there is no other tenant to pass)
        single = Tenant(DEFAULT_TENANT, key_hashes=(bytes.fromhex(hash_key(api_key)[7:]),) if api_key else (),
                        max_priority=-MAX_PRIORITY)
        self.by_id = {t.id: t for t in tenants} if tenants is not None else {DEFAULT_TENANT: single}
        self.keyed = self.multi or bool(api_key)  # a call must send a key
        total_reserved = sum(t.reserved_pages for t in self.by_id.values())
        self.total_reserved = total_reserved

    @classmethod
    def from_flags(cls, tenants_file: str, api_key: str, num_pages: int) -> Tenants:
        """--tenants-file's tenants, or the single tenant with --api-key's key (or none); both: InvalidTenant."""
        if tenants_file and api_key:
            raise InvalidTenant(f"--api-key (or ${API_KEY_ENV}) and --tenants-file {tenants_file}: give one; with a "
                                "tenants file each tenant's keys are in it (pagedkv hash-key KEY)")
        return cls.load(tenants_file, num_pages) if tenants_file else cls(api_key=api_key)

    @classmethod
    def load(cls, path: str | Path, num_pages: int) -> Tenants:
        """The tenants file at path, page counts given as fractions resolved against num_pages."""
        path = Path(path)
        try:
            raw = tomllib.loads(path.read_text())
        except (OSError, tomllib.TOMLDecodeError) as err:
            raise InvalidTenant(f"--tenants-file {path}: {err}") from err
        return cls.parse(raw, path, num_pages)

    def resolve(self, num_pages: int) -> Tenants:
        """The same file's settings (as read then, not re-read) on a pool of num_pages: fractions resolved
        against it, and every count fitted to it. The file was checked when it was loaded; on fewer pages (an
        executor down or gone) a setting that no longer fits is cut instead of refused, so the settings always
        describe the pages that serve:

        - a page count (quota, reserve, budget) is at most the pool, and a quota at least 1 page;
        - a reserve is at most its tenant's quota, and reserves that add up to more than the pool are scaled
          down together, each in proportion (rounded down);
        - a page budget is at most what its tenant can hold (its quota, less the others' reserves).

        On pages where the file fits, this is what loading it there gives."""
        return self if self.raw is None else Tenants.parse(self.raw, self.path, num_pages, fit=True)

    @classmethod
    def parse(cls, raw: dict, path: Path, num_pages: int, fit: bool = False) -> Tenants:
        """The parsed file, page counts resolved against num_pages; fit: a count that does not fit is cut to
        the pool (``resolve``), not an InvalidTenant."""
        defaults = raw.get("defaults", {})
        tables = raw.get("tenants", {})
        if set(raw) - {"defaults", "tenants"}:
            raise InvalidTenant(f"--tenants-file {path}: unknown top-level table(s) "
                                f"{sorted(set(raw) - {'defaults', 'tenants'})}; expected [defaults] and [tenants.ID]")
        if not tables:
            raise InvalidTenant(f"--tenants-file {path}: no [tenants.ID] table")
        tenants = [parse_tenant(tid, {**defaults, **t}, num_pages, fit) for tid, t in tables.items()]
        reserved = sum(t.reserved_pages for t in tenants)
        if reserved > num_pages:
            unless_fitting(fit, f"--tenants-file {path}: reserved_pages add up to {reserved}, more than the "
                                 f"{num_pages} device pages")
            tenants = [replace(t, reserved_pages=t.reserved_pages * num_pages // reserved) for t in tenants]
            reserved = sum(t.reserved_pages for t in tenants)
        for i, t in enumerate(tenants):
            capacity = min(t.page_quota, num_pages - (reserved - t.reserved_pages))
            if t.page_budget > capacity:
                unless_fitting(fit, f"tenants.{t.id}.page_budget: {t.page_budget} pages; it can hold at most "
                                     f"{capacity} (its quota, less other tenants' reserved pages)")
                tenants[i] = replace(t, page_budget=capacity)  # (0 where it can hold nothing: none of it fits)
        seen: dict[bytes, str] = {}
        for t in tenants:
            for h in t.key_hashes:
                if h in seen:
                    raise InvalidTenant(f"--tenants-file {path}: tenants {seen[h]} and {t.id} share a key")
                seen[h] = t.id
        out = cls(tenants, path)
        out.raw = raw
        return out

    def authenticate(self, metadata) -> Tenant:
        return self.caller(metadata)[0]

    def caller(self, metadata) -> tuple[Tenant, bytes]:
        """The calling tenant and the SHA-256 of the key it sent (b"" on a single-tenant server): what
        ``key_problem`` checks again after a reload. Raises Unauthenticated."""
        if not self.keyed:
            return self.by_id[DEFAULT_TENANT], b""
        values = [value for key, value in metadata or () if key == "authorization"]
        if len(values) > 1:
            raise Unauthenticated(f"authorization metadata: sent {len(values)} times; send exactly one "
                                  "'Bearer <api key>' (more than one credential is refused)", "multiple")
        if not values:
            raise Unauthenticated("missing API key: send 'authorization: Bearer <api key>' metadata", "missing")
        scheme, _, token = values[0].partition(" ")
        if scheme.lower() != "bearer" or not token.strip():
            raise Unauthenticated("authorization metadata: expected 'Bearer <api key>'", "malformed")
        digest = hashlib.sha256(token.strip().encode("utf-8")).digest()
        found, revoked = self._lookup(digest)
        if revoked:
            raise Unauthenticated("API key revoked", "revoked")
        if found is None:
            raise Unauthenticated("unknown API key", "unknown")
        return found, digest

    def _lookup(self, digest: bytes) -> tuple[Tenant | None, bool]:
        """The tenant whose key hashes to ``digest`` (None: no tenant's), and whether it is revoked."""
        found, revoked = None, False
        for t in self.by_id.values():  # every hash is compared: the time does not depend on which matched
            for h in t.key_hashes:
                if hmac.compare_digest(h, digest):
                    found = t
            for h in t.revoked_hashes:
                if hmac.compare_digest(h, digest):
                    revoked = True
        return found, revoked

    def key_problem(self, tenant_id: str, digest: bytes) -> str:
        """Why a key that authenticated as ``tenant_id`` no longer does ('' when it still does): after a reload
        it may be revoked, gone from the file, or another tenant's."""
        if not self.multi:
            return ""
        found, revoked = self._lookup(digest)
        if revoked:
            return "API key revoked"
        if found is None:
            return "API key no longer in the tenants file"
        if found.id != tenant_id:
            return f"API key moved from tenant {tenant_id} to another"
        return ""

    def named(self, tenant_id: str) -> Tenant | None:
        """The tenant a trusted hop names (trusted_hop.py): one in the file (without a file: only ``default``),
        else None."""
        return self.by_id.get(tenant_id)

    def sees_cluster(self, tenant: Tenant) -> bool:
        """Whether ModelInfo shows this caller the cluster-wide figures: an admin tenant, or the only one."""
        return tenant.admin or not self.multi

    def __iter__(self):
        return iter(self.by_id.values())

    def get(self, tenant_id: str) -> Tenant:
        """The tenant's settings (a tenant unknown to the registry gets the defaults: no limits)."""
        t = self.by_id.get(tenant_id)
        return t if t is not None else Tenant(tenant_id)
