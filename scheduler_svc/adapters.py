"""The LoRA adapters a scheduler serves, and which of them a request may select (#52).

The adapters served are the executors' (their ``--lora-modules``, as Describe lists them): every executor of a
scheduler serves the same ones, by name and rank (``mismatch``: a join's check, cluster.py). A request selects one
by ``GenerateRequest.adapter`` ("" : the base model); ``select`` is that stage of its way in (intake.py, right after
the bounds): the name must be one served that the caller's tenant may use (its ``adapters`` in the tenants file,
pagedkv/tenancy.py), else ``AdapterNotFound`` (NOT_FOUND). An adapter the tenant may not use gets the same answer
as one that is not served, word for word: another tenant's adapters must look as if they did not exist.
``usable`` is what ModelInfo lists to the caller: with the pages each adapter's weights hold on every executor,
out of its pool before any tenant's quota (a start-up adapter is public; Describe's num_device_pages leaves them
out, so the page accounting never hands one to a request)."""

from __future__ import annotations

from pagedkv.api.v1 import api_pb2 as api
from pagedkv.executor.v1 import executor_pb2 as pb
from pagedkv.tenancy import Tenant

HINT = "ModelInfo lists the adapters this caller's tenant may use"


class AdapterNotFound(LookupError):
    """A request's adapter is not served, or not to its tenant (gRPC NOT_FOUND; the gateway's 404)."""


def served(describe: pb.DescribeResponse) -> dict[str, int]:
    """The adapters an executor serves: name -> rank."""
    return {a.name: a.rank for a in describe.adapters}


def mismatch(describe: pb.DescribeResponse, reference: pb.DescribeResponse) -> str:
    """Why an executor's adapters keep it from joining the executors of ``reference`` ('' : the same names and
    ranks; the order they were loaded in does not matter)."""
    mine, theirs = served(describe), served(reference)
    if mine == theirs:
        return ""
    problems = []
    if missing := sorted(theirs.keys() - mine.keys()):
        problems.append(f"it does not serve {', '.join(missing)}")
    if extra := sorted(mine.keys() - theirs.keys()):
        problems.append(f"it serves {', '.join(extra)}, which the others do not")
    for name in sorted(n for n in mine.keys() & theirs.keys() if mine[n] != theirs[n]):
        problems.append(f"its {name} has rank {mine[name]}, the others' rank {theirs[name]}")
    return (f"LoRA adapters (--lora-modules) differ from the other executors': {'; '.join(problems)} (every executor "
            "of a scheduler serves the same adapters)")


def select(name: str, describe: pb.DescribeResponse, tenant: Tenant) -> str:
    """The adapter a request of ``tenant`` selects by ``name`` ('' : the base model), one served
    (``describe``: the cluster's reference) that the tenant may use; else AdapterNotFound, the same for both."""
    if not name or (name in served(describe) and tenant.may_use(name)):
        return name
    shown = name if len(name) <= 64 else name[:61] + "..."
    raise AdapterNotFound(f"adapter: {shown!r} is not served; {HINT} (leave adapter empty for the base model)")


def usable(describe: pb.DescribeResponse, tenant: Tenant) -> list[api.AdapterInfo]:
    """The adapters ``tenant`` may use, in the executors' order (ModelInfoResponse.adapters)."""
    return [api.AdapterInfo(name=a.name, rank=a.rank, num_bytes=a.num_bytes, num_pages=a.num_pages)
            for a in describe.adapters if tenant.may_use(a.name)]
