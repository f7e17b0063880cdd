"""Issue 46's F4 against a real gateway, scheduler and executor (tiny-llama) on loopback: echo + logprobs=20 +
prompt_logprobs=20 + n=16 over 4 prompts of 2,000 characters asked for a 229 MB answer (gateway RSS 454 -> 1,981
MB, another tenant's request stalled 8.1 s). Now it is a 400 naming prompt_logprobs and --max-response-bytes, at
once, and the scheduler never sees it; and a large answer a gateway allows (--max-response-bytes raised) is built and
encoded off the event loop: a small request sent once the large one's tokens are all out is answered before the
large answer's first byte."""

from __future__ import annotations

import http.client
import json
import threading
import time

import pytest

from pagedkv.gateway.response_budget import DEFAULT_MAX_RESPONSE_BYTES
from tests.support import procs

pytestmark = pytest.mark.e2e

MODEL = "tiny-llama"
FINDING = {"model": MODEL, "prompt": [chr(97 + i) * 2000 for i in range(4)], "echo": True, "logprobs": 20,
           "prompt_logprobs": 20, "n": 16}


@pytest.fixture(scope="module")
def stack():
    """(scheduler, gateway with the default budget, gateway with --max-response-bytes 1 GiB), naming tokens with
    tiny-llama's tokenizer (as pagedkv serve's gateway does)."""
    started: list[procs.Proc] = []
    try:
        started.append(procs.executor("--num-pages", "1024"))
        started.append(procs.scheduler(started[0].address))
        for extra in ((), ("--max-response-bytes", str(1 << 30))):
            started.append(procs.Proc("gateway", "--address", started[1].address, "--tokenizer", MODEL, *extra))
        yield started[1], started[2], started[3]
    finally:
        codes = [p.stop(60) for p in reversed(started)]
    assert codes == [0, 0, 0, 0], "\n\n".join(p.log()[-3000:] for p in started)


def post(gateway, body: dict, request_id: str, timeout: float = 300) -> tuple[int, dict, bytes, float]:
    """(status, headers, body, when its status line and headers had come: time.perf_counter())."""
    conn = http.client.HTTPConnection("127.0.0.1", gateway.port, timeout=timeout)
    try:
        conn.request("POST", "/v1/completions", json.dumps(body),
                     {"content-type": "application/json", "x-request-id": request_id})
        r = conn.getresponse()
        head_at = time.perf_counter()
        return r.status, dict(r.getheaders()), r.read(), head_at
    finally:
        conn.close()


def admitted(scheduler, request_id: str) -> bool:
    return any(e.get("event") == "request_admitted" and str(e.get("request_id", "")).startswith(request_id)
               for e in list(scheduler.events))


@pytest.mark.parametrize("stream", [False, True])
def test_the_findings_shape_is_refused_before_any_work(stack, stream):
    scheduler, gateway, _ = stack
    rid = f"f4-refused-{int(stream)}"
    body = {**FINDING, **({"stream": True, "prompt_logprobs": None} if stream else {})}
    status, _, data, _ = post(gateway, body, rid, timeout=30)
    error = json.loads(data)["error"]
    assert status == 400 and error["type"] == "invalid_request_error" and error["code"] == "response_too_large"
    assert error["param"] == ("echo" if stream else "prompt_logprobs"), error
    assert f"at most {DEFAULT_MAX_RESPONSE_BYTES} bytes" in error["message"] and "--max-response-bytes" in \
        error["message"]
    assert procs.wait_for(lambda: gateway.saw("request_refused", error=error["message"]), timeout=10)
    post(gateway, {"model": MODEL, "prompt": "hi", "max_tokens": 1}, f"{rid}-after", timeout=60)  # (logged after)
    assert procs.wait_for(lambda: admitted(scheduler, f"{rid}-after"), timeout=30)
    upstream_ids = {rid, *(f"{rid}-{i}" for i in range(4))}  # (the request's id, and each prompt's)
    assert not any(e.get("request_id") in upstream_ids for e in list(scheduler.events)), "the scheduler saw it"


def test_a_large_answer_does_not_hold_up_a_small_request(stack):
    """An allowed answer of ~40 MB (1 prompt of 1,500 characters, echo, logprobs=20, prompt_logprobs=20, n=16):
    once the scheduler has sent all of its tokens, a one-token completion is sent to the same gateway; it is
    answered before the large answer's status line comes (which is sent once its JSON is all encoded). With the
    answer built and encoded on the event loop, the small request waited for all of it."""
    scheduler, _, gateway = stack
    big = {"model": MODEL, "prompt": "q" * 1500, "echo": True, "logprobs": 20, "prompt_logprobs": 20, "n": 16,
           "max_tokens": 4, "temperature": 0}
    got: dict = {}

    def send_big() -> None:
        got["status"], _, data, got["head_at"] = post(gateway, big, "f4-big")
        got["bytes"] = len(data)

    t0 = time.perf_counter()
    thread = threading.Thread(target=send_big, daemon=True)
    thread.start()
    finished = lambda: sum(e.get("event") == "request_finished" and e.get("request_id") == "f4-big"  # noqa: E731
                           for e in list(scheduler.events))
    assert procs.wait_for(lambda: finished() == 16, timeout=240, interval=0.005), scheduler.log()[-2000:]
    status, _, data, _ = post(gateway, {"model": MODEL, "prompt": "hi", "max_tokens": 1}, "f4-small", timeout=120)
    small_at = time.perf_counter()
    thread.join(300)
    assert status == 200 and json.loads(data)["choices"][0]["text"] is not None
    assert got["status"] == 200 and got["bytes"] > 8 << 20, got  # (large: its JSON takes a while to encode)
    assert small_at < got["head_at"], (small_at - t0, got["head_at"] - t0, got)
