"""Structured outputs on the scheduler's side: a request's ``sampling.constraint`` checked and sent on.

The scheduler loads no torch, so it neither parses grammars nor compiles them: it bounds a constraint's size and its
JSON nesting before anything parses it, checks what is cheap (one kind, JSON that parses, choices), tags it with its
tenant's scope, and then, once the request has passed its queue bounds, has the executors compile it
(``grammar_gate.GrammarGate``: ``CheckConstraint``, in their compile workers, off their step loops) before the request
is placed. An executor's refusal (an invalid schema, regex or grammar; a compile past its CPU or memory limit) ends the
call with INVALID_ARGUMENT naming the field, before any page is taken. The executor keeps the matcher
(executor_svc/grammar.py, grammar_jobs.py).
"""

from __future__ import annotations

import json
from collections.abc import Iterable

from pagedkv.api.v1 import api_pb2 as api
from pagedkv.bounds import InvalidRequest
from pagedkv.executor.v1 import executor_pb2 as pb
from pagedkv.grpc_common import QUEUE_FULL_PREFIX
from pagedkv.json_bounds import nests_deeper_than
from pagedkv.tenancy import Tenant
from scheduler_svc.grammar_gate import grammar_scope
from scheduler_svc.queue_bounds import QueueFull
from scheduler_svc.request import Sampling

FIELD = "sampling.constraint"
MAX_CONSTRAINT_BYTES = 65536  # UTF-8 bytes of a schema, regex or grammar, or of the choices together
MAX_CHOICES = 1024
MAX_SCHEMA_DEPTH = 64  # arrays and objects nested in a JSON schema (each level a recursion in every parser after)


def constraint_bytes(tenant: Tenant) -> int:
    """The largest constraint ``tenant`` may send: its max_constraint_bytes, at most the server's (0: the server's)."""
    return min(tenant.max_constraint_bytes or MAX_CONSTRAINT_BYTES, MAX_CONSTRAINT_BYTES)


def check_constraint(p: api.SamplingParams, sampling: Sampling, eos_token_ids: Iterable[int],
                     tools: api.Constraint | None = None, tools_field: str = "",
                     tenant: Tenant | None = None) -> pb.Constraint | None:
    """The executor's form of the request's constraint (None: unconstrained), checked as far as the scheduler can
    without a grammar library; InvalidRequest naming the field otherwise. ``tools``: the constraint a tool choice
    makes (``tools_field`` names it), which the request may not add its own to; ``tenant``: its structured_outputs
    and max_constraint_bytes apply."""
    if tenant is not None and not tenant.structured_outputs and (tools is not None or p.HasField("constraint")):
        what = tools_field if tools is not None else FIELD
        raise InvalidRequest(f"{what}: tenant {tenant.id} may not constrain its outputs (its structured_outputs is "
                             "false in the tenants file)")
    if tools is not None:
        if p.HasField("constraint"):
            raise InvalidRequest(f"{FIELD}: cannot be set with {tools_field} (the tool calls are the output's "
                                 "constraint)")
        c = tools
    elif not p.HasField("constraint"):
        return None
    else:
        c = p.constraint
    kind = c.WhichOneof("kind")
    if kind is None:
        raise InvalidRequest(f"{FIELD}: set one of json_schema, json_object, regex, choice or grammar")
    field = f"{FIELD}.{kind}"
    if c.strict and kind != "json_schema":
        raise InvalidRequest(f"{FIELD}.strict: only with {FIELD}.json_schema (the constraint is {kind})")
    if kind == "choice":
        choices = list(c.choice.choices)
        if not 1 <= len(choices) <= MAX_CHOICES or not all(choices):
            raise InvalidRequest(f"{field}: {len(choices)} choices; give 1 to {MAX_CHOICES}, none empty")
        size = sum(len(s.encode()) for s in choices)
    else:
        size = len(getattr(c, kind).encode()) if kind != "json_object" else 0
    limit = constraint_bytes(tenant) if tenant else MAX_CONSTRAINT_BYTES
    if size > limit:
        whose = f" (tenant {tenant.id}'s max_constraint_bytes)" if limit < MAX_CONSTRAINT_BYTES else ""
        if tools is not None:  # (the client sent tools, not this schema: name them)
            at = tools_field.partition(" ")[0].removesuffix("tool_choice") + "tools"
            raise InvalidRequest(f"{at}: the JSON schema {tools_field} makes of them is {size} bytes; at most "
                                 f"{limit}{whose}; send fewer tools or smaller parameters schemas")
        raise InvalidRequest(f"{field}: {size} bytes; at most {limit}{whose}")
    if kind in ("regex", "grammar") and not getattr(c, kind):
        raise InvalidRequest(f"{field}: must not be empty")
    if kind == "json_object" and not c.json_object:
        raise InvalidRequest(f"{field}: must be true when set")
    if kind == "json_schema":
        if nests_deeper_than(c.json_schema.encode(), MAX_SCHEMA_DEPTH):
            raise InvalidRequest(f"{field}: JSON nested more than {MAX_SCHEMA_DEPTH} levels deep (arrays and objects); "
                                 f"at most {MAX_SCHEMA_DEPTH}")
        try:
            schema = json.loads(c.json_schema)
        except (ValueError, RecursionError) as err:
            raise InvalidRequest(f"{field}: not JSON: {err}") from None
        if not isinstance(schema, (dict, bool)):
            raise InvalidRequest(f"{field}: a JSON Schema is an object (or true/false), not {type(schema).__name__}")
    if sampling.ignore_eos:
        raise InvalidRequest(f"sampling.ignore_eos: refused with {FIELD} (a complete output ends with EOS)")
    out = pb.Constraint.FromString(c.SerializeToString())  # (the same fields, numbered alike)
    out.end_token_ids.extend(sorted(set(eos_token_ids) | set(sampling.stop_token_ids)))
    out.scope = grammar_scope(tenant.id if tenant is not None else "")
    return out


def check_constrained_requests(tenant: Tenant, open_constrained: int) -> None:
    """QueueFull when the tenant already has its max_constrained_requests constrained requests open (each steps a
    grammar matcher on its executor, every step): a limit that clears as they end."""
    limit = tenant.max_constrained_requests
    if limit and open_constrained >= limit:
        raise QueueFull(f"{QUEUE_FULL_PREFIX}tenant {tenant.id} has {open_constrained} constrained requests open; its "
                        f"max_constrained_requests is {limit} (retry once one has ended)", "constrained")
