"""LoRA adapters on the scheduler's side (#52, scheduler_svc/adapters.py): the prefix cache keeps each adapter's KV
apart (its own chain root: two adapters, or an adapter and the base model, share no page; the same adapter hits), the
executor's NewRequest names the adapter (first sent, and rebuilt after a rejected plan), forks keep it, the KV events
name it (vLLM's lora_name / lora_id), retained KV is hit by its own adapter only, and executors serving other
adapters are refused when they join."""

from __future__ import annotations

import asyncio

import msgpack
import pytest

from pagedkv.executor.v1 import executor_pb2 as pb
from scheduler_svc import adapters
from scheduler_svc import engine as engine_mod
from scheduler_svc.detokenizer import IncrementalDetokenizer
from scheduler_svc.kv_events import KvEventLog, Stored
from scheduler_svc.kv_events_rpc import encode as rpc_encode
from scheduler_svc.kv_events_zmq import encode_batch
from scheduler_svc.kv_manager import KVManager
from scheduler_svc.pages import PagePool, tier_pools
from scheduler_svc.prefix_cache import request_root, tenant_root
from scheduler_svc.request import Request, Retain, Sampling, fork
from scheduler_svc.scheduler import SchedulerConfig
from tests.support.driven import driven
from tests.support.fake_cluster import Box, new_cluster, until
from tests.support.fake_executor import FakeExecutor, NullTokenizer, drive, make_request
from tests.support.scheduler_helpers import BS, new_prefix_scheduler, new_scheduler

pytestmark = pytest.mark.unit

SQL, CHAT = pb.Adapter(name="sql", rank=8, num_bytes=1 << 20), pb.Adapter(name="chat", rank=16, num_bytes=2 << 20)


def _adapter_request(i: int, prompt: list[int], adapter: str, tenant: str = "t") -> Request:
    return make_request(i, 0, 4, prompt=prompt, tenant=tenant, adapter=adapter,
                        hash_root=request_root(tenant, adapter))


def test_the_roots_keep_the_old_hashes_and_tag_adapter_and_window_apart():
    """The base model's unwindowed root is the tenant's, a windowed one the same as before adapters existed; an
    adapter's root differs from the base model's, from another adapter's and from another tenant's."""
    assert request_root("t") == tenant_root("t")
    assert request_root("t", "", (16, 64)) == tenant_root("t\x00window:16:64")
    roots = {request_root("t"), request_root("t", "sql"), request_root("t", "chat"), request_root("u", "sql"),
             request_root("t", "sql", (16, 64)), request_root("t", "", (16, 64))}
    assert len(roots) == 6


def test_the_same_prompt_under_two_adapters_and_the_base_shares_no_page_and_one_adapter_hits():
    s = new_prefix_scheduler()
    prompt = [7 + (i % 200) for i in range(100)]  # 6 full pages of 16 + 4 tokens

    def run(i: int, adapter: str) -> Request:
        req = _adapter_request(i, prompt, adapter)
        s.add(req)
        drive(s)
        return req
    first = {name: run(i, name) for i, name in enumerate(("", "sql", "chat"))}
    assert [r.num_cached_tokens for r in first.values()] == [0, 0, 0], "no adapter reads another's (or the base's) KV"
    hashes = [set(r.page_hashes) for r in first.values()]
    assert not (hashes[0] & hashes[1]) and not (hashes[0] & hashes[2]) and not (hashes[1] & hashes[2])
    again = run(3, "sql")
    assert again.num_cached_tokens == 96, "the same adapter's prompt hits its pages"
    assert set(again.page_hashes) == hashes[1]
    assert run(4, "").num_cached_tokens == 96  # (and the base model its own)


def test_new_request_names_the_adapter_first_and_when_rebuilt_after_a_rejected_plan():
    s = new_scheduler()
    req = make_request(0, 12, 4, adapter="sql", hash_root=request_root("default", "sql"))
    base = make_request(1, 12, 4)
    s.add(req)
    s.add(base)
    plan, _ = s.schedule()
    assert {r.request_id: r.adapter for r in plan.new_requests} == {req.request_id: "sql", base.request_id: ""}
    s.process(pb.StepResult(step_id=plan.step_id, error="desync", desynced_request_ids=[req.request_id]))
    again, _ = s.schedule()
    resent = [r for r in again.new_requests if r.request_id == req.request_id]
    assert resent and resent[0].adapter == "sql", "the resend (a NewRequest rebuilt from the Request) keeps it"
    ex = FakeExecutor(BS)
    s.process(ex.step(again))
    drive(s, executor=ex)


def test_forks_generate_with_their_parents_adapter():
    parent = make_request(0, 8, 4, adapter="sql", hash_root=request_root("default", "sql"), n=2)
    child = fork(parent, 1, parent.detokenizer.fresh())
    assert (child.adapter, child.hash_root) == ("sql", parent.hash_root)


def test_kv_events_name_the_adapter_as_vllm_does():
    """An adapter's pages: Stored carries its name and number (1 up in the executors' order); vLLM's BlockStored
    lora_name / lora_id on the ZMQ wire; the base model's pages None for both."""
    log = KvEventLog(2, adapters=("chat", "sql"))
    kv = KVManager(tier_pools(8, 2, 0, log)[0])
    for adapter in ("sql", ""):
        tokens = [1, 2, 3, 4]
        req = Request(request_id=f"r{adapter}", prompt_ids=tokens, sampling=Sampling(max_tokens=1), arrival=0,
                      detokenizer=IncrementalDetokenizer(NullTokenizer(), tokens, [], False), adapter=adapter,
                      hash_root=request_root("default", adapter))
        kv.admit(req, [], req.num_tokens)
        req.num_computed = req.num_tokens
        kv.publish(req)
    batch = log.flush()
    stored = [e for e in batch.events if isinstance(e, Stored)]
    assert [(e.lora_name, e.lora_id) for e in stored] == [("sql", 2), ("", None)]
    _, events, _ = msgpack.unpackb(encode_batch(batch))
    wire = [(e["lora_name"], e["lora_id"]) for e in events if e["type"] == "BlockStored"]
    assert wire == [("sql", 2), (None, None)]
    rpc = [ev.stored.lora_name for ev in rpc_encode(batch, 2).events if ev.WhichOneof("event") == "stored"]
    assert rpc == ["sql", ""]  # (the KvEvents.Watch stream, which the Dynamo relay reads)
    assert log.snapshot()[1][0].lora_name in ("sql", "")


def test_adapter_mismatch_names_each_difference_and_ignores_order():
    ref = pb.DescribeResponse(adapters=[SQL, CHAT])
    assert adapters.mismatch(pb.DescribeResponse(adapters=[CHAT, SQL]), ref) == ""
    assert "does not serve chat" in adapters.mismatch(pb.DescribeResponse(adapters=[SQL]), ref)
    extra = adapters.mismatch(pb.DescribeResponse(adapters=[SQL, CHAT, pb.Adapter(name="x", rank=4)]), ref)
    assert "serves x, which the others do not" in extra
    ranks = adapters.mismatch(pb.DescribeResponse(adapters=[SQL, pb.Adapter(name="chat", rank=8)]), ref)
    assert "chat has rank 8, the others' rank 16" in ranks
    assert ranks.startswith("LoRA adapters (--lora-modules, --max-lora-rank, --lora-root)")
    slots = dict(lora_slots=2, lora_max_rank=16, lora_modules=["q_proj", "v_proj"])
    ref = pb.DescribeResponse(adapters=[SQL, CHAT], **slots)
    assert adapters.mismatch(pb.DescribeResponse(adapters=[CHAT, SQL], **{**slots, "lora_slots": 5}), ref) == ""
    other = adapters.mismatch(pb.DescribeResponse(adapters=[CHAT, SQL], **{**slots, "lora_max_rank": 64}), ref)
    assert "its adapter slots (rank, modules, --lora-root) (64," in other
    runtime = pb.Adapter(name="mine.t0123456789", rank=8, runtime=True)  # (run-time ones are synced, not compared)
    assert adapters.mismatch(pb.DescribeResponse(adapters=[CHAT, SQL, runtime], **slots), ref) == ""


def test_an_executor_serving_other_adapters_is_refused_when_it_joins(boxes):
    """Two executors with the cluster's adapters come up; one serving fewer is refused (check_compatible names the
    adapter it lacks) and never serves."""
    async def scenario():
        boxes.update({"a:1": Box(64), "b:1": Box(64), "c:1": Box(64)})
        boxes["a:1"].adapters = [SQL, CHAT]
        boxes["b:1"].adapters = [CHAT, SQL]
        boxes["c:1"].adapters = [SQL]
        c = new_cluster(adapters=[SQL, CHAT])
        assert "does not serve chat" in c.check_compatible(pb.DescribeResponse(
            protocol=c.reference.protocol, model="m", vocab_size=300, block_size=c.reference.block_size,
            max_position_embeddings=4096, adapters=[SQL]))
        c.start()
        c.set_addresses({"a:1", "b:1", "c:1"})
        up = engine_mod.State.UP
        await until(lambda: c.engines["a:1"].state is up and c.engines["b:1"].state is up)
        await asyncio.sleep(0.2)
        state = c.engines["c:1"].state
        await c.stop()
        return state
    assert asyncio.run(scenario()) is not engine_mod.State.UP


def test_a_retained_conversation_under_an_adapter_is_hit_by_that_adapter_only():
    """Retained KV (retain_kv) is findable by its hashes: a follow-up under another adapter, or the base model,
    reads none of it; one under the same adapter does."""
    cfg = SchedulerConfig(max_num_seqs=8, max_num_batched_tokens=256, max_model_len=256, watermark=0,
                          kv_retention_max_share=0.5)
    s = driven(PagePool(24, 4), cfg, [2])

    def run(i: int, adapter: str, tokens: list[int], retain: Retain | None = None) -> Request:
        req = make_request(i, 0, 3, prompt=tokens, adapter=adapter, hash_root=request_root("default", adapter),
                           retain=retain)
        s.add(req)
        drive(s)
        return req
    first = run(0, "sql", [10 + i for i in range(17)], Retain("conv", 60))
    assert s.retained.get("default", "conv") is not None
    follow_up = first.prompt_ids + first.output_ids + [99] * 6
    assert run(1, "chat", follow_up).num_cached_tokens == 0
    assert run(2, "", follow_up).num_cached_tokens == 0
    assert run(3, "sql", follow_up).num_cached_tokens == 16
