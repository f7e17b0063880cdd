"""gateway_attacks.py part 5, what the bounds cost, in this process: CPU per keep-alive request through uvicorn's
httptools protocol, the gateway's bounded one and h11, to a trivial ASGI app over a transport that goes nowhere."""

from __future__ import annotations

import asyncio
import json
import time

from common import percentile
from gateway_attacks_target import MODEL, PROMPT


# ---- 5.: the guard's cost --------------------------------------------------------------------------
class _Transport:
    def get_extra_info(self, name: str, default=None):
        return {"sockname": ("127.0.0.1", 8000), "peername": ("127.0.0.1", 5555)}.get(name, default)

    def write(self, data: bytes) -> None:
        pass

    def is_closing(self) -> bool:
        return False

    def close(self) -> None:
        pass

    def pause_reading(self) -> None:
        pass

    def resume_reading(self) -> None:
        pass


async def _trivial_app(scope, receive, send) -> None:
    await receive()
    await send({"type": "http.response.start", "status": 200, "headers": [(b"content-length", b"2")]})
    await send({"type": "http.response.body", "body": b"ok"})


async def _cpu_per_request(protocol_class, requests: int) -> float:
    from uvicorn.config import Config
    from uvicorn.server import ServerState

    body = json.dumps({"model": MODEL, "prompt": PROMPT, "max_tokens": 1, "temperature": 0}).encode()
    raw = (b"POST /v1/completions HTTP/1.1\r\nHost: 127.0.0.1:8000\r\nAccept: application/json\r\n"
           b"Content-Type: application/json\r\nUser-Agent: OpenAI/Python\r\nAuthorization: Bearer sk-0123456789\r\n"
           b"Connection: keep-alive\r\nContent-Length: %d\r\n\r\n%s" % (len(body), body))
    config = Config(_trivial_app, lifespan="off", log_config=None, access_log=False, timeout_keep_alive=75)
    config.load()
    state = ServerState()
    protocol = protocol_class(config=config, server_state=state, app_state={})
    protocol.connection_made(_Transport())
    t0 = time.process_time()
    for _ in range(requests):
        protocol.data_received(raw)
        await asyncio.sleep(0)  # the request's ASGI task runs
        await asyncio.sleep(0)
    seconds = time.process_time() - t0
    assert state.total_requests >= requests - 1, state.total_requests
    protocol.connection_lost(None)
    return seconds / requests


def guard_cost(requests: int = 5000, rounds: int = 8) -> dict:
    import uvloop
    from uvicorn.protocols.http.h11_impl import H11Protocol
    from uvicorn.protocols.http.httptools_impl import HttpToolsProtocol

    class Quiet:
        def info(self, *a, **k) -> None:
            pass

    stacks = {"httptools": HttpToolsProtocol, "h11": H11Protocol}
    try:
        from pagedkv.gateway.guards import bounded_protocol
    except ImportError:  # a checkout from before the gateway package, or before the bounds
        try:
            from pagedkv.gateway import bounded_protocol
        except ImportError:
            bounded_protocol = None
    if bounded_protocol is not None:
        stacks["httptools + bounds"] = bounded_protocol(Quiet())

    async def run() -> dict:
        seen: dict[str, list[float]] = {name: [] for name in stacks}
        for i in range(rounds):  # the order reversed every other round: a stack pays for its predecessor's garbage
            for name, cls in list(stacks.items())[::-1 if i % 2 else 1]:
                seen[name].append(await _cpu_per_request(cls, requests))
        return {name: percentile(v, 50) * 1e6 for name, v in seen.items()}

    return uvloop.run(run())
