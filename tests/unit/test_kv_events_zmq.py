"""The KV events' vLLM wire format (decoded with vLLM's own structs, and byte for byte as vLLM's encoder writes
them) and --kv-events-config's checks. The sockets, replay and CURVE: tests/e2e/test_kv_events_zmq.py."""

from __future__ import annotations

import argparse
import json
import re

import msgpack
import msgspec
import pytest
import zmq.auth

from scheduler_svc import kv_events_config as kc
from scheduler_svc import kv_events_zmq as kz
from scheduler_svc.kv_events import Batch, Cleared, Removed, Stored
from tests.support import vllm_kv_events as vllm

pytestmark = pytest.mark.unit

SALT = "3f1c0d9a5b2e4f6a7c8d9e0f1a2b3c4d"
ROOT = Stored(hashes=(-5, 7), parent=None, token_ids=tuple(range(8)), block_size=4, medium="GPU", salt=SALT)
CHILD = Stored(hashes=(9,), parent=7, token_ids=(8, 9, 10, 11), block_size=4, medium="GPU", salt=SALT)
SPILLED = Stored(hashes=(-(2**63),), parent=None, token_ids=(1, 2, 3, 4), block_size=4, medium="CPU", salt="")
BATCH = Batch(seq=3, ts=1789095808.25, events=(Cleared(), ROOT, CHILD, SPILLED, Removed((7, 9), "GPU"),
                                               Removed((2**63 - 1,), "CPU")))


def test_decodes_with_vllms_structs() -> None:
    got = vllm.decoder().decode(kz.encode_batch(BATCH))
    assert got.ts == BATCH.ts and got.data_parallel_rank == 0
    cleared, root, child, spilled, removed, removed_cpu = got.events
    assert isinstance(cleared, vllm.AllBlocksCleared)
    assert isinstance(root, vllm.BlockStored)
    assert (root.block_hashes, root.parent_block_hash, root.token_ids, root.block_size, root.medium) == \
        ([-5, 7], None, list(range(8)), 4, "GPU")
    assert root.extra_keys == [(SALT,), None]  # the salt on a chain's first page, as vLLM's cache_salt
    assert (root.lora_id, root.lora_name, root.group_idx) == (None, None, None)
    assert child.parent_block_hash == 7 and child.extra_keys == [None]  # the chain carries the salt
    assert spilled.medium == "CPU" and spilled.block_hashes == [-(2**63)] and spilled.extra_keys == [None]
    assert isinstance(removed, vllm.BlockRemoved) and (removed.block_hashes, removed.medium) == ([7, 9], "GPU")
    assert removed_cpu.block_hashes == [2**63 - 1] and removed_cpu.medium == "CPU"


def test_bytes_equal_vllms_encoder() -> None:
    """The same batch built from vLLM's structs and encoded by msgspec (vLLM's publisher) gives the same bytes:
    field order, omitted defaults, the tag, the positional batch."""
    theirs = vllm.KVEventBatch(ts=BATCH.ts, data_parallel_rank=0, events=[
        vllm.AllBlocksCleared(),
        vllm.BlockStored(block_hashes=[-5, 7], parent_block_hash=None, token_ids=list(range(8)), block_size=4,
                         lora_id=None, medium="GPU", lora_name=None, extra_keys=[(SALT,), None]),
        vllm.BlockStored(block_hashes=[9], parent_block_hash=7, token_ids=[8, 9, 10, 11], block_size=4,
                         lora_id=None, medium="GPU", lora_name=None, extra_keys=[None]),
        vllm.BlockStored(block_hashes=[-(2**63)], parent_block_hash=None, token_ids=[1, 2, 3, 4], block_size=4,
                         lora_id=None, medium="CPU", lora_name=None, extra_keys=[None]),
        vllm.BlockRemoved(block_hashes=[7, 9], medium="GPU"),
        vllm.BlockRemoved(block_hashes=[2**63 - 1], medium="CPU"),
    ])
    assert kz.encode_batch(BATCH) == msgspec.msgpack.encode(theirs)


def test_wire_shape_names_no_tenant() -> None:
    """A tagged map per event inside a positional batch; the salt is the only tenant-derived value."""
    ts, events, rank = msgpack.unpackb(kz.encode_batch(BATCH))
    assert (ts, rank) == (BATCH.ts, 0)
    assert events[0] == {"type": "AllBlocksCleared"}
    assert list(events[1]) == ["type", "block_hashes", "parent_block_hash", "token_ids", "block_size", "lora_id",
                               "medium", "lora_name", "extra_keys"]
    assert list(events[4]) == ["type", "block_hashes", "medium"]


def test_unknown_event_and_medium_refused() -> None:
    with pytest.raises(TypeError, match="not a KV event: str"):
        kz.encode_batch(Batch(0, 0.0, ("Stored",)))
    bad = Stored((1,), None, (1,), 1, "DISK", "")
    with pytest.raises(ValueError, match="medium must be one of"):
        kz.encode_batch(Batch(0, 0.0, (bad,)))


# ---- --kv-events-config --------------------------------------------------------------------------------------
def parse(obj) -> kc.KvEventsConfig:
    return kc.parse_config(obj if isinstance(obj, str) else json.dumps(obj))


def test_vllm_keys_and_defaults() -> None:
    cfg = parse({"enable_kv_cache_events": True})
    assert cfg.enabled and cfg.publisher == "zmq"  # (vLLM: zmq when events are on and no publisher is named)
    assert (cfg.endpoint, cfg.replay_endpoint, cfg.topic) == ("tcp://127.0.0.1:5557", None, None)
    assert cfg.with_default_topic("tiny-llama", "pod-7").topic == "kv@pod-7@tiny-llama"
    assert (cfg.buffer_steps, cfg.hwm, cfg.max_queue_size) == (10_000, 100_000, 100_000)
    cfg = parse({"enable_kv_cache_events": True, "publisher": "zmq", "endpoint": "tcp://127.0.0.1:6000",
                 "replay_endpoint": "tcp://[::1]:6001", "buffer_steps": 5, "hwm": 7, "max_queue_size": 9,
                 "topic": ""})
    assert (cfg.endpoint, cfg.replay_endpoint, cfg.buffer_steps, cfg.hwm, cfg.max_queue_size, cfg.topic) == \
        ("tcp://127.0.0.1:6000", "tcp://[::1]:6001", 5, 7, 9, "")
    assert cfg.with_default_topic("tiny-llama").topic == ""  # (given: kept, even vLLM's default '')
    assert not parse({}).enabled and parse({}).publisher == "null"
    assert not parse({"enable_kv_cache_events": True, "publisher": "null"}).enabled
    assert kz.start(parse({"enable_kv_cache_events": False}), None, log=None) is None


@pytest.mark.parametrize(("text", "names"), [
    ("{not json", "not valid JSON"),
    ("[1, 2]", "must be a JSON object"),
    ({"enable_kv_cache_events": True, "endpiont": "tcp://127.0.0.1:1"}, "unknown key 'endpiont'"),
    ({"enable_kv_cache_events": "yes"}, "enable_kv_cache_events must be true or false"),
    ({"publisher": "kafka"}, 'publisher must be "zmq" or "null"'),
    ({"buffer_steps": 0}, r"buffer_steps must be an integer in \[1, 1000000\], got 0"),
    ({"hwm": True}, r"hwm must be an integer in \[1, 10000000\], got True"),
    ({"max_queue_size": "10"}, r"max_queue_size must be an integer"),
    ({"topic": 5}, "topic must be a string of at most 1024 bytes"),
    ({"topic": "t" * 1025}, "topic must be a string of at most 1024 bytes"),
    ({"endpoint": "udp://127.0.0.1:5"}, "endpoint 'udp://127.0.0.1:5' must be tcp://HOST:PORT"),
    ({"endpoint": "tcp://127.0.0.1"}, r"endpoint 'tcp://127.0.0.1' must be tcp://HOST:PORT with a port in"),
    ({"endpoint": "tcp://127.0.0.1:70000"}, r"port in \[1, 65535\]"),
    ({"replay_endpoint": 5558}, "replay_endpoint must be a string"),
    ({"endpoint": "tcp://127.0.0.1:9", "replay_endpoint": "tcp://127.0.0.1:9"}, "replay_endpoint must differ"),
])
def test_config_errors_name_the_key(text, names) -> None:
    with pytest.raises(ValueError, match=names) as err:
        parse(text)
    assert str(err.value).startswith("--kv-events-config: ")


@pytest.mark.parametrize("endpoint", ["tcp://*:5557", "tcp://0.0.0.0:5557", "tcp://10.1.2.3:5557",
                                      "tcp://router.internal:5557", "tcp://[::]:5557"])
def test_beyond_loopback_needs_curve(endpoint) -> None:
    for key in ("endpoint", "replay_endpoint"):
        cfg = parse({"enable_kv_cache_events": True, key: endpoint})
        with pytest.raises(ValueError) as err:
            kc.check_link(cfg, None)
        message = str(err.value)
        assert f"{key} {endpoint}" in message and kc.CURVE_SECRET_FLAG in message and kc.CURVE_CLIENTS_FLAG in message
        with pytest.raises(ValueError, match=re.escape(f"{key} {endpoint}")):
            kz.start(cfg, None, log=None)  # (refused before any socket)


@pytest.mark.parametrize("endpoint", ["tcp://127.0.0.1:5557", "tcp://localhost:5557", "tcp://[::1]:5557",
                                      "ipc:///tmp/kv-events", "inproc://kv-events"])
def test_local_endpoints_need_no_keys(endpoint) -> None:
    kc.check_link(parse({"enable_kv_cache_events": True, "endpoint": endpoint}), None)


def test_bind_or_connect_as_vllm() -> None:
    assert kc.binds("tcp://*:5557") and kc.binds("tcp://127.0.0.1:5557") and kc.binds("ipc:///tmp/x")
    assert not kc.binds("tcp://10.1.2.3:5557")  # (vLLM: another host is connected to, e.g. llm-d's scorer)


def test_curve_key_flags(tmp_path) -> None:
    server_dir, clients = tmp_path / "server", tmp_path / "clients"
    server_dir.mkdir()
    clients.mkdir()
    public_file, secret_file = zmq.auth.create_certificates(server_dir, "server")
    zmq.auth.create_certificates(clients, "client")
    keys = kc.load_curve_keys(secret_file, str(clients))
    assert keys is not None and len(keys.public) == len(keys.secret) == 40
    assert kc.load_curve_keys("", "") is None
    with pytest.raises(ValueError, match=f"^{kc.CURVE_CLIENTS_FLAG} is needed too"):
        kc.load_curve_keys(secret_file, "")
    with pytest.raises(ValueError, match=f"^{kc.CURVE_SECRET_FLAG} is needed too"):
        kc.load_curve_keys("", str(clients))
    with pytest.raises(ValueError, match="holds no secret key"):
        kc.load_curve_keys(public_file, str(clients))
    with pytest.raises(ValueError, match=f"{kc.CURVE_SECRET_FLAG} .*cannot read"):
        kc.load_curve_keys(str(tmp_path / "missing"), str(clients))
    (tmp_path / "empty").mkdir()
    with pytest.raises(ValueError, match=f"{kc.CURVE_CLIENTS_FLAG} .*holds no client public key"):
        kc.load_curve_keys(secret_file, str(tmp_path / "empty"))
    with pytest.raises(ValueError, match=f"{kc.CURVE_CLIENTS_FLAG} .*not a directory"):
        kc.load_curve_keys(secret_file, str(tmp_path / "absent"))


def flags(config: str = "", secret: str = "", clients: str = "") -> argparse.Namespace:
    return argparse.Namespace(kv_events_config=config, kv_events_curve_secret_key_file=secret,
                              kv_events_curve_clients=clients)


def test_flags_checked_at_start_up(tmp_path) -> None:
    assert kc.from_args(flags()) is None
    assert kc.from_args(flags('{"enable_kv_cache_events": false}')) is None
    config, keys = kc.from_args(flags('{"enable_kv_cache_events": true}'))
    assert config.enabled and keys is None
    with pytest.raises(ValueError, match=re.escape("endpoint tcp://*:5557 is reachable beyond this machine")):
        kc.from_args(flags('{"enable_kv_cache_events": true, "endpoint": "tcp://*:5557"}'))
    (tmp_path / "clients").mkdir()
    _, secret = zmq.auth.create_certificates(tmp_path, "server")
    zmq.auth.create_certificates(tmp_path / "clients", "client")
    config, keys = kc.from_args(flags('{"enable_kv_cache_events": true, "endpoint": "tcp://*:5557"}', secret,
                                      str(tmp_path / "clients")))
    assert keys is not None and config.endpoint == "tcp://*:5557"
    with pytest.raises(ValueError, match="protect the KV events, which are off"):
        kc.from_args(flags("", secret, str(tmp_path / "clients")))
