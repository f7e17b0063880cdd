"""Stored responses (``store: true``, OpenAI's default): what ``GET /v1/responses/{id}`` answers and what a
follow-up's ``previous_response_id`` continues. ``ResponsesStore`` keeps them per tenant (the caller's key's tenant,
as the scheduler authenticates it: another tenant's id is not found), bounded per tenant by count and by bytes: a
response past either bound evicts that tenant's oldest ones first; one larger than the byte bound alone is not
stored (the answer says ``store: false``).

They are kept in memory and, unless ``--responses-dir memory``, also written to a file each under the cache
directory (``$PAGEDKV_CACHE_DIR/responses/<tenant hash>/<id>.json``, mode 0600), read back when the gateway starts:
a stored response, and a follow-up that names it, survive a gateway restart (the KV its turn retained survives only
while its scheduler runs and its TTL lasts: a follow-up after that recomputes its prompt). Files are written and
removed by one background thread, in order, so the event loop never waits on the disk."""

from __future__ import annotations

import argparse
import hashlib
import json
import os
from collections import OrderedDict
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass
from pathlib import Path

from pagedkv.gateway.responses_api import RESPONSE_ID, Item

DEFAULT_MAX_COUNT = 1000  # per tenant
DEFAULT_MAX_BYTES = 64 << 20  # per tenant: 64 MiB of JSON
DEFAULT_KV_TTL_S = 600
MEMORY = "memory"


@dataclass(slots=True)
class Stored:
    response: dict  # the response object as answered
    items: list[Item]  # its conversation: the previous items, its input, its output (canonical)
    size: int  # bytes of its JSON


def add_responses_args(p: argparse.ArgumentParser, whose: str = "") -> None:
    """The Responses API's flags (the gateway's, and serve's for its gateway child)."""
    g = p.add_argument_group("Responses API (/v1/responses)")
    g.add_argument("--responses-dir", default="", metavar="DIR",
                   help=f"{whose}where stored responses (store: true) are kept: in memory and a file each under DIR, "
                   "read back at start, so they survive a restart; 'memory': in memory only, lost on restart "
                   "(default: $PAGEDKV_CACHE_DIR/responses, else ~/.cache/pagedkv/responses)")
    g.add_argument("--responses-max-count", type=int, default=DEFAULT_MAX_COUNT, metavar="N",
                   help=f"{whose}stored responses kept per tenant; a new one past it evicts the tenant's oldest "
                   "(default: %(default)s)")
    g.add_argument("--responses-max-bytes", type=int, default=DEFAULT_MAX_BYTES, metavar="N",
                   help=f"{whose}bytes of stored responses (their JSON, conversation included) kept per tenant; a new "
                   "one past it evicts the tenant's oldest, one larger than N alone is not stored (default: "
                   "%(default)s = 64 MiB)")
    g.add_argument("--responses-kv-ttl", type=int, default=DEFAULT_KV_TTL_S, metavar="S",
                   help=f"{whose}seconds the scheduler keeps a stored response's KV (its prompt and output) for a "
                   "follow-up by previous_response_id, charged to the tenant's page quota and dropped first under "
                   "pressure; DELETE /v1/responses/{id} releases it (0: off; default: %(default)s)")


def check_responses_args(args) -> None:
    for flag, value in (("--responses-max-count", args.responses_max_count),
                        ("--responses-max-bytes", args.responses_max_bytes)):
        if value < 1:
            raise ValueError(f"{flag} {value}: at least 1")
    if not 0 <= args.responses_kv_ttl <= 7 * 86400:
        raise ValueError(f"--responses-kv-ttl {args.responses_kv_ttl}: must be in [0, {7 * 86400}] seconds (0: off)")


def responses_dir(flag: str) -> Path | None:
    """--responses-dir as a directory (None: memory only)."""
    if flag == MEMORY:
        return None
    if flag:
        return Path(flag)
    from pagedkv.models import cache_dir

    return cache_dir() / "responses"


def _tenant_dir(tenant: str) -> str:
    return hashlib.sha256(tenant.encode()).hexdigest()[:32]


class ResponsesStore:
    """The stored responses of every tenant: each tenant's in insertion order (the oldest evicted first)."""

    def __init__(self, directory: Path | None, max_count: int = DEFAULT_MAX_COUNT,
                 max_bytes: int = DEFAULT_MAX_BYTES, log=None) -> None:
        self.directory, self.max_count, self.max_bytes, self.log = directory, max_count, max_bytes, log
        self._tenants: dict[str, OrderedDict[str, Stored]] = {}
        self._bytes: dict[str, int] = {}
        self._io = ThreadPoolExecutor(max_workers=1, thread_name_prefix="responses-store") if directory else None
        if directory is not None:
            self._load(directory)

    def get(self, tenant: str, rid: str) -> Stored | None:
        return self._tenants.get(tenant, {}).get(rid)

    def put(self, tenant: str, response: dict, items: list[Item]) -> bool:
        """Keeps ``response`` (and its conversation) for ``tenant``, evicting the tenant's oldest past the bounds;
        False when it alone is over the byte bound (not stored)."""
        record = {"tenant": tenant, "response": response, "items": items}
        data = json.dumps(record, separators=(",", ":"), ensure_ascii=False).encode()
        if not self._keep(tenant, response["id"], Stored(response, items, len(data))):
            return False
        self._submit(self._write, tenant, response["id"], data)
        return True

    def delete(self, tenant: str, rid: str) -> bool:
        kept = self._tenants.get(tenant)
        if kept is None or rid not in kept:
            return False
        self._bytes[tenant] -= kept.pop(rid).size
        self._submit(self._unlink, tenant, rid)
        return True

    def count(self, tenant: str) -> tuple[int, int]:
        """(responses, bytes) stored for ``tenant``."""
        return len(self._tenants.get(tenant, ())), self._bytes.get(tenant, 0)

    def close(self) -> None:
        """Waits for the files still being written."""
        if self._io is not None:
            self._io.shutdown(wait=True)

    # ---- bounds -------------------------------------------------------------------------------------------------
    def _keep(self, tenant: str, rid: str, stored: Stored) -> bool:
        if stored.size > self.max_bytes:
            if self.log is not None:
                self.log.warning("response_not_stored", response_id=rid, bytes=stored.size,
                                 limit=self.max_bytes, note="larger than --responses-max-bytes alone")
            return False
        kept = self._tenants.setdefault(tenant, OrderedDict())
        if rid in kept:
            self._bytes[tenant] -= kept.pop(rid).size
        used = self._bytes.get(tenant, 0)
        while kept and (len(kept) >= self.max_count or used + stored.size > self.max_bytes):
            old_id, old = kept.popitem(last=False)
            used -= old.size
            self._submit(self._unlink, tenant, old_id)
            if self.log is not None:
                self.log.debug("response_evicted", response_id=old_id, bytes=old.size)
        kept[rid] = stored
        self._bytes[tenant] = used + stored.size
        return True

    # ---- files --------------------------------------------------------------------------------------------------
    def _submit(self, fn, *args) -> None:
        if self._io is not None:
            self._io.submit(fn, *args)

    def _path(self, tenant: str, rid: str) -> Path:
        assert self.directory is not None and RESPONSE_ID.fullmatch(rid)
        return self.directory / _tenant_dir(tenant) / f"{rid}.json"

    def _write(self, tenant: str, rid: str, data: bytes) -> None:
        path = self._path(tenant, rid)
        try:
            path.parent.mkdir(mode=0o700, parents=True, exist_ok=True)
            tmp = path.with_suffix(".tmp")
            fd = os.open(tmp, os.O_WRONLY | os.O_CREAT | os.O_TRUNC, 0o600)
            with os.fdopen(fd, "wb") as f:
                f.write(data)
            os.replace(tmp, path)
        except OSError as err:
            if self.log is not None:
                self.log.warning("response_file_not_written", response_id=rid, error=str(err),
                                 note="kept in memory only: lost on restart")

    def _unlink(self, tenant: str, rid: str) -> None:
        try:
            self._path(tenant, rid).unlink(missing_ok=True)
        except OSError:
            pass

    def _load(self, directory: Path) -> None:
        """The files of an earlier run, oldest first, within the bounds (a file that does not read is skipped)."""
        found: list[tuple[float, int, str, Stored]] = []
        for path in directory.glob("*/resp_*.json"):
            try:
                data, mtime = path.read_bytes(), path.stat().st_mtime_ns
                record = json.loads(data)
                tenant, response, items = record["tenant"], record["response"], record["items"]
                ok = (isinstance(tenant, str) and path.parent.name == _tenant_dir(tenant)
                      and path.stem == response["id"] and isinstance(items, list))
            except (OSError, ValueError, KeyError, TypeError):
                ok = False
            if not ok:
                if self.log is not None:
                    self.log.warning("response_file_skipped", path=str(path), note="not a stored response")
                continue
            found.append((float(response.get("created_at") or 0), mtime, tenant, Stored(response, items, len(data))))
        found.sort(key=lambda f: f[:2])
        for *_, tenant, stored in found:
            self._keep(tenant, stored.response["id"], stored)
        if self.log is not None and found:
            self.log.info("responses_loaded", directory=str(directory), responses=len(found),
                          tenants=len(self._tenants))


def responses_child_args(args) -> list[str]:
    """serve's Responses flags passed on to its gateway child (those not at their defaults)."""
    out = []
    for flag, default in (("--responses-dir", ""), ("--responses-max-count", DEFAULT_MAX_COUNT),
                          ("--responses-max-bytes", DEFAULT_MAX_BYTES), ("--responses-kv-ttl", DEFAULT_KV_TTL_S)):
        value = getattr(args, flag[2:].replace("-", "_"), default)
        if value != default:
            out += [flag, str(value)]
    return out
