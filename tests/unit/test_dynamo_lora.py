"""LoRA through NVIDIA Dynamo (#52): the frontend's ``routing.lora_name`` names the adapter that generates
(GenerateRequest.adapter), and the KV relay stores an adapter's pages with its ``lora_name``, as Dynamo's router
hashes them (docs: ../shared/research/fleet-dynamo.md; the base model's pages with none)."""

from __future__ import annotations

import pytest

from pagedkv.dynamo_kv_relay import StoredPages, events_of
from pagedkv.dynamo_request import Refused, generate_request
from pagedkv.kvevents.v1 import kv_events_pb2 as kv
from tests.unit.test_dynamo_request import dynamo_request
from tests.unit.test_dynamo_worker import relay

pytestmark = pytest.mark.unit


def test_routing_lora_name_is_the_adapter():
    assert generate_request(dynamo_request(routing={"lora_name": "sql"}), "r").adapter == "sql"
    assert generate_request(dynamo_request(routing={"lora_name": None}), "r").adapter == ""
    with pytest.raises(Refused) as err:
        generate_request(dynamo_request(routing={"lora_name": 7}), "r")
    assert err.value.field == "routing.lora_name"


def test_the_relay_stores_an_adapters_pages_with_its_lora_name():
    batch = kv.EventBatch(seq=0, block_size=2)
    batch.events.add().stored.CopyFrom(kv.Stored(hashes=[11], token_ids=[1, 2], medium="GPU", lora_name="sql"))
    batch.events.add().stored.CopyFrom(kv.Stored(hashes=[21], token_ids=[1, 2], medium="GPU"))
    events = events_of(batch)
    assert [e.lora_name for e in events if isinstance(e, StoredPages)] == ["sql", ""]
    r, pub = relay()
    r.apply_batch(0, events, False)
    assert pub.lora == {11: "sql", 21: None}
