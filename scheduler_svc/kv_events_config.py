"""``--kv-events-config`` (vLLM's ``KVEventsConfig`` keys) and the link's protection: the stream carries every tenant's
prompt tokens, so an endpoint beyond loopback needs CURVE keys (``--kv-events-curve-secret-key-file``,
``--kv-events-curve-clients``). Everything here is checked at start-up, before an executor is tried, and raises
ValueError naming the flag or the key and what it must be. The publisher: kv_events_zmq.py."""

from __future__ import annotations

import json
import socket
from dataclasses import dataclass, replace
from pathlib import Path
from typing import Any

from pagedkv import security

CONFIG_FLAG = "--kv-events-config"
CURVE_SECRET_FLAG = "--kv-events-curve-secret-key-file"
CURVE_CLIENTS_FLAG = "--kv-events-curve-clients"
DEFAULT_ENDPOINT = "tcp://127.0.0.1:5557"  # (vLLM's is tcp://*:5557: every interface, which needs CURVE here)
MAX_BUFFER_STEPS = 1_000_000
MAX_HWM = 10_000_000
MAX_QUEUE_SIZE = 10_000_000
MAX_TOPIC_BYTES = 1024


# ---- configuration --------------------------------------------------------------------------------------------
@dataclass(frozen=True, slots=True)
class KvEventsConfig:
    """``--kv-events-config``, with vLLM's ``KVEventsConfig`` keys and defaults (but ``endpoint``: loopback)."""

    enable_kv_cache_events: bool = False
    publisher: str = "null"
    endpoint: str = DEFAULT_ENDPOINT
    replay_endpoint: str | None = None
    buffer_steps: int = 10_000
    hwm: int = 100_000
    max_queue_size: int = 100_000
    topic: str | None = None  # None: not given, kv@<host>@<served model name> (``with_default_topic``)

    @property
    def enabled(self) -> bool:
        return self.enable_kv_cache_events and self.publisher == "zmq"

    def with_default_topic(self, model: str, host: str = "") -> KvEventsConfig:
        """This config, its topic ``kv@<host>@<model>`` unless the JSON gave one (vLLM's default is '')."""
        return self if self.topic is not None else replace(self, topic=default_topic(model, host))


_DEFAULTS = KvEventsConfig()
_INT_LIMITS = {"buffer_steps": MAX_BUFFER_STEPS, "hwm": MAX_HWM, "max_queue_size": MAX_QUEUE_SIZE}
_KEYS = ("enable_kv_cache_events", "publisher", "endpoint", "replay_endpoint", "buffer_steps", "hwm",
         "max_queue_size", "topic")


def default_topic(model: str, host: str = "") -> str:
    """``kv@<host>@<served model name>`` (the form llm-d's scorer reads: its pod, then its model)."""
    return f"kv@{host or socket.gethostname()}@{model}"


def parse_config(text: str) -> KvEventsConfig:
    """``--kv-events-config JSON`` checked key by key. Raises ValueError naming the key and what it must be."""
    try:
        raw = json.loads(text)
    except ValueError as err:
        raise ValueError(f"{CONFIG_FLAG}: not valid JSON ({err}); give an object such as "
                         '\'{"enable_kv_cache_events": true, "publisher": "zmq"}\'') from None
    if not isinstance(raw, dict):
        raise ValueError(f"{CONFIG_FLAG}: must be a JSON object with vLLM's KVEventsConfig keys, got "
                         f"{type(raw).__name__}")
    unknown = sorted(set(raw) - set(_KEYS))
    if unknown:
        raise ValueError(f"{CONFIG_FLAG}: unknown key {unknown[0]!r}; the keys are {', '.join(_KEYS)}")
    enable = raw.get("enable_kv_cache_events", False)
    if not isinstance(enable, bool):
        raise ValueError(f"{CONFIG_FLAG}: enable_kv_cache_events must be true or false, got {enable!r}")
    publisher = raw.get("publisher")
    if publisher is None:  # (vLLM: zmq when events are on, else null)
        publisher = "zmq" if enable else "null"
    if publisher not in ("zmq", "null"):
        raise ValueError(f"{CONFIG_FLAG}: publisher must be \"zmq\" or \"null\", got {publisher!r}")
    values: dict[str, Any] = {"enable_kv_cache_events": enable, "publisher": publisher}
    for key, limit in _INT_LIMITS.items():
        value = raw.get(key, getattr(_DEFAULTS, key))
        if isinstance(value, bool) or not isinstance(value, int) or not 1 <= value <= limit:
            raise ValueError(f"{CONFIG_FLAG}: {key} must be an integer in [1, {limit}], got {value!r}")
        values[key] = value
    topic = raw.get("topic")
    if topic is not None and (not isinstance(topic, str) or len(topic.encode("utf-8")) > MAX_TOPIC_BYTES):
        raise ValueError(f"{CONFIG_FLAG}: topic must be a string of at most {MAX_TOPIC_BYTES} bytes, got "
                         f"{str(topic)[:40]!r}")
    values["topic"] = topic
    values["endpoint"] = _checked_endpoint("endpoint", raw.get("endpoint", DEFAULT_ENDPOINT))
    replay = raw.get("replay_endpoint")
    values["replay_endpoint"] = None if replay is None else _checked_endpoint("replay_endpoint", replay)
    if values["replay_endpoint"] is not None and values["replay_endpoint"] == values["endpoint"]:
        raise ValueError(f"{CONFIG_FLAG}: replay_endpoint must differ from endpoint ({values['endpoint']})")
    return KvEventsConfig(**values)


def _checked_endpoint(key: str, endpoint: object) -> str:
    if not isinstance(endpoint, str):
        raise ValueError(f"{CONFIG_FLAG}: {key} must be a string such as {DEFAULT_ENDPOINT!r}, got {endpoint!r}")
    scheme, sep, rest = endpoint.partition("://")
    if not sep or scheme not in ("tcp", "ipc", "inproc") or not rest:
        raise ValueError(f"{CONFIG_FLAG}: {key} {endpoint!r} must be tcp://HOST:PORT, ipc://PATH or inproc://NAME")
    if scheme == "tcp":
        host, colon, port = rest.rpartition(":")
        if not colon or not host or not port.isdigit() or not 1 <= int(port) <= 65535:
            raise ValueError(f"{CONFIG_FLAG}: {key} {endpoint!r} must be tcp://HOST:PORT with a port in [1, 65535]")
    return endpoint


def is_local(endpoint: str) -> bool:
    """Whether only this machine can reach ``endpoint``: a loopback tcp address, or ipc/inproc."""
    scheme, _, rest = endpoint.partition("://")
    if scheme != "tcp":
        return True
    return security.is_loopback(rest.rpartition(":")[0])


def binds(endpoint: str) -> bool:
    """vLLM's rule, which side listens: a wildcard, ipc and inproc bind, another host is connected to (a
    subscriber that listens, as llm-d's scorer can). Here a loopback address binds too (the default)."""
    return "*" in endpoint or "::" in endpoint or not endpoint.startswith("tcp://") or is_local(endpoint)


# ---- CURVE ----------------------------------------------------------------------------------------------------
@dataclass(frozen=True, slots=True)
class CurveKeys:
    """The publisher's CURVE keypair and the directory of the client public keys it accepts."""

    public: bytes
    secret: bytes
    clients_dir: str


def load_curve_keys(secret_file: str, clients_dir: str) -> CurveKeys | None:
    """The keys from ``--kv-events-curve-secret-key-file`` (a ZMQ certificate with its secret key, as
    ``zmq.auth.create_certificates`` writes) and ``--kv-events-curve-clients`` (their ``*.key`` public
    certificates); None when neither is given. Raises ValueError naming the flag."""
    if not secret_file and not clients_dir:
        return None
    import zmq.auth  # (here: the flags' module is imported by every command line, zmq only with CURVE keys)

    if not secret_file or not clients_dir:
        missing = CURVE_SECRET_FLAG if not secret_file else CURVE_CLIENTS_FLAG
        raise ValueError(f"{missing} is needed too: CURVE needs the publisher's secret key and the clients' "
                         "public keys")
    try:
        public, secret = zmq.auth.load_certificate(secret_file)
    except (OSError, ValueError) as err:
        raise ValueError(f"{CURVE_SECRET_FLAG} {secret_file}: cannot read a ZMQ certificate: {err}") from None
    if not secret:
        raise ValueError(f"{CURVE_SECRET_FLAG} {secret_file}: holds no secret key (give the .key_secret file)")
    directory = Path(clients_dir)
    if not directory.is_dir():
        raise ValueError(f"{CURVE_CLIENTS_FLAG} {clients_dir}: not a directory")
    try:
        allowed = zmq.auth.load_certificates(clients_dir)
    except (OSError, ValueError) as err:
        raise ValueError(f"{CURVE_CLIENTS_FLAG} {clients_dir}: cannot read its public keys: {err}") from None
    if not allowed:
        raise ValueError(f"{CURVE_CLIENTS_FLAG} {clients_dir}: holds no client public key (*.key)")
    return CurveKeys(public, secret, clients_dir)


def check_link(config: KvEventsConfig, keys: CurveKeys | None) -> None:
    """Refuse an endpoint beyond loopback without CURVE keys: the events carry every tenant's prompt tokens."""
    if keys is not None:
        return
    for key in ("endpoint", "replay_endpoint"):
        endpoint = getattr(config, key)
        if endpoint is not None and not is_local(endpoint):
            raise ValueError(f"{CONFIG_FLAG}: {key} {endpoint} is reachable beyond this machine and the KV events "
                             f"carry every tenant's prompt tokens: give {CURVE_SECRET_FLAG} and {CURVE_CLIENTS_FLAG} "
                             f"(CURVE encryption and client keys), or use a loopback address such as "
                             f"{DEFAULT_ENDPOINT}")


def from_args(args) -> tuple[KvEventsConfig, CurveKeys | None] | None:
    """The scheduler's ``--kv-events-*`` flags, checked at start-up before anything else runs (None: events off).
    Raises ValueError naming the flag or the config key."""
    keys = load_curve_keys(args.kv_events_curve_secret_key_file, args.kv_events_curve_clients)
    config = parse_config(args.kv_events_config) if args.kv_events_config else None
    if config is None or not config.enabled:
        if keys is not None:
            raise ValueError(f"{CURVE_SECRET_FLAG} and {CURVE_CLIENTS_FLAG} protect the KV events, which are off: "
                             f"give {CONFIG_FLAG} '{{\"enable_kv_cache_events\": true}}' too, or leave them out")
        return None
    check_link(config, keys)
    return config, keys
