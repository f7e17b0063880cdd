"""Which tenant a request through ``pagedkv dynamo-worker`` runs as: the assertion the edge gateway signed
(``context.metadata['pagedkv-tenant']``) is checked with the fleet secret and the tenant asserted to the scheduler as
a trusted hop (``x-pagedkv-hop`` + ``x-pagedkv-tenant``); a request without one runs as the worker's own key's
tenant, or is refused with ``--require-tenant``."""

from __future__ import annotations

import argparse
from collections.abc import Sequence
from typing import Any

from dynamo.llm.exceptions import InvalidArgument

from pagedkv import fleet_salt, trusted_hop


class Tenancy:
    """Which tenant a Dynamo request runs as, and the metadata that tells the scheduler."""

    def __init__(self, base: Sequence[tuple[str, str]], fleet_secret: bytes, hop_secret: str,
                 require_tenant: bool) -> None:
        self.base = tuple(base)
        self.fleet_secret = fleet_secret
        self.hop_secret = hop_secret
        self.require_tenant = require_tenant

    @classmethod
    def from_args(cls, args: argparse.Namespace) -> Tenancy:
        """The worker's secrets read (its flags), and its own key as the base metadata (``--api-key``)."""
        hop_secret = trusted_hop.load_hop_secret(getattr(args, "trusted_hop_secret_file", ""))
        fleet_secret = fleet_salt.load_fleet_secret(getattr(args, "fleet_secret_file", ""))
        if fleet_secret and not hop_secret:
            raise ValueError(f"{fleet_salt.FLEET_SECRET_FLAG} needs {trusted_hop.HOP_SECRET_FLAG} (the scheduler's "
                             "trusted-hop secret): without it a tenant the edge gateway signed cannot be asserted")
        auth = (("authorization", f"Bearer {args.api_key}"),) if args.api_key else ()
        return cls(auth, fleet_secret, hop_secret, args.require_tenant)

    def metadata(self, context_metadata: Any) -> tuple[tuple[str, str], ...]:
        token = context_metadata.get(fleet_salt.TENANT_META_KEY) if context_metadata is not None else None
        if token is None:
            if self.require_tenant:
                raise InvalidArgument(f"{fleet_salt.TENANT_META_HEADER}: missing; this worker serves only requests "
                                      "the edge gateway signed a tenant for (--require-tenant)")
            return self.base
        if not self.fleet_secret:
            raise InvalidArgument(f"{fleet_salt.TENANT_META_HEADER}: this worker has no fleet secret to check it "
                                  f"({fleet_salt.FLEET_SECRET_FLAG})")
        try:
            tenant = fleet_salt.verify_assertion(self.fleet_secret, token)
        except fleet_salt.InvalidAssertion as err:
            raise InvalidArgument(str(err)) from None
        return (*self.base, *trusted_hop.hop_metadata(self.hop_secret, tenant))
