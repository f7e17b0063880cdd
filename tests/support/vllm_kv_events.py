"""vLLM's KV-event wire structs, for decoding pagedkv's ZMQ events the way vLLM's own subscribers do
(``msgspec.msgpack.Decoder(KVEventBatch)``, as ``examples/online_serving/kv_events_subscriber.py``).

vLLM cannot be installed here as a test dependency, so its definitions are restated: the same struct names, field
names, field order, types, defaults and msgspec options as in

    https://github.com/vllm-project/vllm/blob/v0.26.0/vllm/distributed/kv_events.py

The event structs' fields were read from vllm-project/vllm at commit 0181ea3173e53eea8cf04a86891488e3dc89bb34
(``BlockStored``: block_hashes, parent_block_hash, token_ids, block_size, lora_id, medium, lora_name, extra_keys,
group_idx, kv_cache_spec_kind, kv_cache_spec_sliding_window; ``BlockRemoved``: block_hashes, medium, group_idx).
Since vLLM PR #42892 (merged 2026-06-09, in v0.26.0) the events are tagged *maps* (``tag=True`` without
``array_like``: the class name under ``"type"``), while ``EventBatch`` stays a positional array
(``array_like=True``), as a v0.26.0 capture shows (volcano-sh/kthena#1535: ``[ts, [{"type": "BlockStored", ...}],
0]``) and Dynamo's and llm-d's decoders expect. ``ExternalBlockHash`` is vLLM's ``bytes | int``
(``vllm/v1/core/kv_cache_utils.py``). NOTE: the stored copy at that commit declares ``EventBatch`` without
``array_like`` (a map); the release, Dynamo 1.6.1's guard test (``EventBatch`` fields ts, events,
data_parallel_rank, positional) and every consumer above read an array, so the array is what is matched here.
"""

from __future__ import annotations

from typing import Any

import msgspec

ExternalBlockHash = bytes | int


class EventBatch(msgspec.Struct, array_like=True, omit_defaults=True, gc=False):
    ts: float
    events: list[Any]
    data_parallel_rank: int | None = None


class KVCacheEvent(msgspec.Struct, omit_defaults=True, gc=False, tag=True):
    pass


class BlockStored(KVCacheEvent):
    block_hashes: list[ExternalBlockHash]
    parent_block_hash: ExternalBlockHash | None
    token_ids: list[int]
    block_size: int
    lora_id: int | None
    medium: str | None
    lora_name: str | None
    extra_keys: list[tuple[Any, ...] | None] | None = None
    group_idx: int | None = None
    kv_cache_spec_kind: str | None = None
    kv_cache_spec_sliding_window: int | None = None


class BlockRemoved(KVCacheEvent):
    block_hashes: list[ExternalBlockHash]
    medium: str | None
    group_idx: int | None = None


class AllBlocksCleared(KVCacheEvent):
    pass


class KVEventBatch(EventBatch):
    events: list[BlockStored | BlockRemoved | AllBlocksCleared]


def decoder() -> msgspec.msgpack.Decoder:
    return msgspec.msgpack.Decoder(KVEventBatch)
