"""Page hashes for the prefix cache (docs/design.md decision 4).

    h_0 = H(namespace root, tokens of page 0, extra keys)
    h_i = H(h_{i-1},        tokens of page i, extra keys)

The root is derived from the tenant (``tenant_root``), which the server derives from the caller
(``scheduler_svc.tenancy``); a client never sends a salt. A request whose KV is not the base model's full attention
gets a root of its own (``request_root``: its LoRA adapter, its attention window, each a tagged key in the root, which
the chain carries to every page). Extra keys are tagged ``(kind, value)``
pairs so two kinds can never collide. SHA-256 makes a hit on a different token sequence
practically impossible, so hits are not re-compared token by token.
"""

from __future__ import annotations

import hashlib
from array import array
from collections.abc import Sequence

ExtraKeys = tuple[tuple[str, str], ...]


def tenant_root(tenant: str) -> bytes:
    return hashlib.sha256(b"pagedkv/prefix/v1\x00tenant\x00" + tenant.encode("utf-8")).digest()


def request_root(tenant: str, adapter: str = "", window: tuple[int, int] | None = None) -> bytes:
    """The chain root of a request of ``tenant``: the tenant's own for the base model's unwindowed requests; one of
    its own for each LoRA adapter (its KV is the adapter's: two adapters, or an adapter and the base model, never
    share a page) and each (sink, window) of a windowed request (its KV depends on the window)."""
    namespace = tenant + (f"\x00adapter:{adapter}" if adapter else "")
    return tenant_root(namespace + (f"\x00window:{window[0]}:{window[1]}" if window else ""))


def page_hash(parent: bytes, tokens: Sequence[int], extra: ExtraKeys = ()) -> bytes:
    h = hashlib.sha256(parent)
    h.update(len(tokens).to_bytes(4, "little"))
    h.update(array("q", tokens).tobytes())
    for kind, value in extra:
        k, v = kind.encode("utf-8"), value.encode("utf-8")
        h.update(len(k).to_bytes(4, "little") + k + len(v).to_bytes(4, "little") + v)
    return h.digest()


def extend_chain(chain: list[bytes], root: bytes, token_ids: Sequence[int], block_size: int,
                 num_full_pages: int, extra: ExtraKeys = ()) -> None:
    """Appends hashes to ``chain`` until it covers ``num_full_pages`` full pages of ``token_ids``."""
    while len(chain) < num_full_pages:
        i = len(chain)
        parent = chain[-1] if chain else root
        chain.append(page_hash(parent, token_ids[i * block_size:(i + 1) * block_size], extra))
