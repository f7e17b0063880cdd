"""The HTTP front under issue 29's probes (the adversarial suite), against one executor + scheduler + gateway on
loopback, unauthenticated: a big header, a head at the byte limit, slowloris, a slow body, deep JSON, prompts
over the scheduler's limits, a GET on a POST endpoint, two credentials, a request of many streams, and /metrics.
Each probe gets a documented status with a message naming what was too much and the limit, and the gateway keeps
answering. Timeouts are short here (--header-timeout 1, --body-timeout 2); the waits allow several times more.
"""

from __future__ import annotations

import http.client
import json
import socket
import threading
import time

import openai
import pytest

from pagedkv.gateway.guards import DEFAULT_MAX_HEADER_BYTES, MAX_JSON_DEPTH
from tests.support import procs

pytestmark = pytest.mark.e2e

HEADER_TIMEOUT_S, BODY_TIMEOUT_S, MAX_STREAMS = 1.0, 2.0, 8
MODEL = "tiny-llama"
CLOSE_BOUND_S = 15.0  # for a 1-2 s timeout: a loaded machine's slack, not a measurement


@pytest.fixture(scope="module")
def services():
    """(scheduler, gateway) over one executor."""
    started: list[procs.Proc] = []
    try:
        started.append(procs.executor("--num-pages", "1024"))
        started.append(procs.scheduler(started[0].address))
        started.append(procs.Proc("gateway", "--address", started[1].address, "--header-timeout",
                                  str(HEADER_TIMEOUT_S), "--body-timeout", str(BODY_TIMEOUT_S), "--max-streams",
                                  str(MAX_STREAMS)))
        yield started[1], started[2]
    finally:
        codes = [p.stop(60) for p in reversed(started)]
    assert codes == [0, 0, 0], "\n\n".join(p.log()[-3000:] for p in started)


@pytest.fixture
def stack(services):
    """The gateway."""
    return services[1]


# ---- raw HTTP/1.1 -------------------------------------------------------------------------------
def _send_quietly(sock: socket.socket, data: bytes, piece: int = 0) -> None:
    """Sends ``data``, ``piece`` bytes at a time with a pause between (so that the gateway reads them apart)."""
    piece = piece or len(data)
    try:
        for at in range(0, len(data), piece):
            sock.sendall(data[at:at + piece])
            if piece < len(data):
                time.sleep(0.001)
    except OSError:
        pass  # the gateway closed the connection


def read_answer(sock: socket.socket, timeout: float = 30.0) -> tuple[int | None, dict, bytes, float]:
    """(status, headers, body, seconds until the gateway closed the connection): everything it sends, to EOF."""
    sock.settimeout(timeout)
    t0, data = time.perf_counter(), b""
    try:
        while chunk := sock.recv(65536):
            data += chunk
    except ConnectionResetError:
        pass
    elapsed = time.perf_counter() - t0
    head, _, body = data.partition(b"\r\n\r\n")
    lines = head.decode("latin-1").split("\r\n")
    status = int(lines[0].split()[1]) if lines[0].startswith("HTTP/1.1 ") else None
    headers = {name.lower(): value for name, _, value in (line.partition(": ") for line in lines[1:])}
    return status, headers, body, elapsed


def exchange(gateway, data: bytes, piece: int = 0) -> tuple[int | None, dict, bytes, float]:
    """Sends ``data`` (from a thread, ``piece`` bytes at a time) while reading the answer."""
    with socket.create_connection(("127.0.0.1", gateway.port)) as sock:
        sock.setsockopt(socket.IPPROTO_TCP, socket.TCP_NODELAY, 1)
        sender = threading.Thread(target=_send_quietly, args=(sock, data, piece), daemon=True)
        sender.start()
        answer = read_answer(sock)
        sender.join(30)
        return answer


def request_head(path: str = "/health/live", method: str = "GET", pad: int = 0, *extra: str) -> bytes:
    lines = [f"{method} {path} HTTP/1.1", "Host: gateway", "Connection: close", *extra]
    if pad:
        lines.append("X-Pad: " + "p" * pad)
    return ("\r\n".join(lines) + "\r\n\r\n").encode()


def error_of(body: bytes) -> dict:
    return json.loads(body)["error"]


def post(gateway, path: str, body: bytes, *headers: str) -> tuple[int | None, dict, bytes, float]:
    head = request_head(path, "POST", 0, "Content-Type: application/json", f"Content-Length: {len(body)}", *headers)
    return exchange(gateway, head + body)


def assert_serving(gateway) -> None:
    status, _, body, _ = exchange(gateway, request_head())
    assert status == 200 and json.loads(body) == {"status": "ok"}, gateway.log()[-3000:]


# ---- the head ------------------------------------------------------------------------------------
def test_a_big_header_is_431_and_the_gateway_stays_responsive(stack):
    """Was: 64 MB headers read in full (RSS 57 -> 152 MB, a bystander's completion 11 ms -> 2.5-3.2 s)."""
    status, headers, body, _ = exchange(stack, request_head(pad=16 << 20))
    error = error_of(body)
    assert status == 431 and headers["connection"] == "close", (status, body[:200])
    assert error["type"] == "invalid_request_error" and error["code"] == "headers_too_large"
    assert str(DEFAULT_MAX_HEADER_BYTES) in error["message"] and "--max-header-bytes" in error["message"]
    assert_serving(stack)
    assert procs.wait_for(lambda: stack.saw("http_refused", reason="header_bytes"), timeout=10)


@pytest.mark.parametrize("piece", [0, 1000, 4093])
def test_the_head_limit_is_exact_however_the_bytes_arrive(stack, piece):
    """A head of exactly --max-header-bytes is served, one byte more is 431, sent at once or in pieces that put
    the head's end across two reads."""
    bare = len(request_head(pad=1))
    at_limit = request_head(pad=1 + DEFAULT_MAX_HEADER_BYTES - bare)
    assert len(at_limit) == DEFAULT_MAX_HEADER_BYTES
    assert exchange(stack, at_limit, piece)[0] == 200
    assert exchange(stack, request_head(pad=2 + DEFAULT_MAX_HEADER_BYTES - bare), piece)[0] == 431


def test_a_slowloris_head_is_408_and_closed_after_the_header_timeout(stack):
    """Was: 200 connections sending a header line every 0.5-1 s all still open after 30 s."""
    with socket.create_connection(("127.0.0.1", stack.port)) as sock:
        sock.sendall(b"GET /health/live HTTP/1.1\r\nHost: gateway\r\n")
        stop = threading.Event()

        def trickle() -> None:
            i = 0
            while not stop.wait(0.2):
                _send_quietly(sock, b"X-Slow-%d: x\r\n" % i)
                i += 1

        threading.Thread(target=trickle, daemon=True).start()
        status, _, body, elapsed = read_answer(sock, timeout=CLOSE_BOUND_S + 5)
        stop.set()
    assert status == 408 and error_of(body)["code"] == "header_timeout", (status, body[:200])
    assert "--header-timeout" in error_of(body)["message"] and elapsed < CLOSE_BOUND_S
    assert_serving(stack)


def test_a_connection_that_sends_nothing_is_closed(stack):
    with socket.create_connection(("127.0.0.1", stack.port)) as sock:
        status, _, _, elapsed = read_answer(sock, timeout=CLOSE_BOUND_S + 5)
    assert status is None and elapsed < CLOSE_BOUND_S  # closed, with nothing to answer


def test_an_idle_keep_alive_connection_is_not_cut_by_the_header_timeout(stack):
    """The head timer runs from a request's first byte: between requests --keep-alive-timeout (75 s) rules."""
    conn = http.client.HTTPConnection("127.0.0.1", stack.port, timeout=30)
    try:
        conn.request("GET", "/health/live")
        assert conn.getresponse().read() and conn.sock is not None
        sock = conn.sock
        time.sleep(HEADER_TIMEOUT_S * 2.5)
        conn.request("GET", "/health/live")
        r = conn.getresponse()
        assert r.status == 200 and r.read() and conn.sock is sock  # the same connection
    finally:
        conn.close()


def test_a_slow_body_is_408_and_closed_after_the_body_timeout(stack):
    head = request_head("/v1/completions", "POST", 0, "Content-Type: application/json", "Content-Length: 1000")
    with socket.create_connection(("127.0.0.1", stack.port)) as sock:
        sock.sendall(head + b'{"model": "tiny')
        status, _, body, elapsed = read_answer(sock, timeout=CLOSE_BOUND_S + 5)
    assert status == 408 and error_of(body)["code"] == "body_timeout" and elapsed < CLOSE_BOUND_S, (status, body)
    assert_serving(stack)


# ---- the body ------------------------------------------------------------------------------------
def test_deep_json_is_400_naming_the_body(stack):
    """Was: a plain-text 500 and a RecursionError in the log."""
    status, _, body, _ = post(stack, "/v1/completions", b"[" * 100_000)
    error = error_of(body)
    assert status == 400 and error["type"] == "invalid_request_error" and error["code"] == "body_too_deep"
    assert error["message"].startswith("request body:") and str(MAX_JSON_DEPTH) in error["message"]
    assert "RecursionError" not in stack.log() and "Traceback" not in stack.log()


def _sdk(gateway) -> openai.OpenAI:
    return openai.OpenAI(base_url=f"http://127.0.0.1:{gateway.port}/v1", api_key="any", max_retries=3, timeout=60)


def _answered(gateway) -> tuple[int, int]:
    """(requests the gateway refused itself, requests it sent on and finished) so far."""
    events = [e.get("event") for e in list(gateway.events)]
    return events.count("request_refused"), events.count("request_finished")


def _refused_with(gateway, message: str) -> int:
    """Requests the gateway refused itself, before sending anything on, with this message."""
    return sum(e.get("event") == "request_refused" and e.get("error") == message for e in list(gateway.events))


@pytest.mark.parametrize("what, send", [
    ("1 MiB of text", lambda c: c.completions.create(model=MODEL, prompt="a" * (1 << 20), max_tokens=1)),
    ("200 KiB of text", lambda c: c.completions.create(model=MODEL, prompt="a" * (200 << 10), max_tokens=1)),
    ("100 kB of text", lambda c: c.completions.create(model=MODEL, prompt="a" * 100_000, max_tokens=1)),
    ("20,000 token ids", lambda c: c.completions.create(model=MODEL, prompt=[5] * 20_000, max_tokens=1)),
    ("chat of 100 kB", lambda c: c.chat.completions.create(model=MODEL, max_tokens=1, messages=[
        {"role": "user", "content": "a" * 50_000}, {"role": "user", "content": "b" * 50_000}])),
])
def test_an_oversize_prompt_is_400_or_413_naming_it_never_429(stack, what, send):
    """Was: 429 rate_limit_error for 128 KiB-4 MiB, which the openai SDK retried three times. Now the gateway
    refuses each itself, before sending anything on, once: the SDK does not retry a 400 or 413."""
    with pytest.raises(openai.APIStatusError) as e:
        send(_sdk(stack))
    error, chat = e.value.body, "chat" in what
    assert e.value.status_code in (400, 413), (what, e.value.status_code, error)
    assert error["param"] == ("messages" if chat else "prompt") and error["type"] == "invalid_request_error"
    assert "at most" in error["message"] or "max_model_len=" in error["message"], error  # the limit
    assert procs.wait_for(lambda: _refused_with(stack, error["message"]) >= 1, timeout=10)
    time.sleep(0.5)  # the log lines of retries, had there been any, were written before the last answer
    assert _refused_with(stack, error["message"]) == 1


def test_a_request_over_the_schedulers_message_limit_is_413_not_429(services):
    """A gateway whose limits are set above the scheduler's sends the prompt on; gRPC refuses the message
    (RESOURCE_EXHAUSTED, as a full queue would be): still a 413 naming the prompt, never a retried 429."""
    gateway = procs.Proc("gateway", "--address", services[0].address, "--max-body-bytes", str(4 << 20),
                         "--max-prompt-bytes", str(4 << 20))
    try:
        with pytest.raises(openai.APIStatusError) as e:
            _sdk(gateway).completions.create(model=MODEL, prompt="a" * (1 << 20), max_tokens=1)
        assert e.value.status_code == 413 and e.value.body["param"] == "prompt", e.value.body
        assert "on the wire" in e.value.body["message"] and e.value.body["code"] == "request_too_large"
    finally:
        assert gateway.stop() == 0, gateway.log()
    assert procs.wait_for(lambda: gateway.saw("gateway_stopped"), timeout=10)  # its last line: the log is all in
    assert _answered(gateway) == (0, 1)  # sent on once, refused by the scheduler, not retried


def test_405_is_an_invalid_request(stack):
    status, headers, body, _ = exchange(stack, request_head("/v1/completions"))
    assert status == 405 and error_of(body)["type"] == "invalid_request_error" and headers["allow"] == "POST"


def test_two_credentials_are_401(stack):
    """Was: accepted, the first Authorization header winning."""
    body = json.dumps({"model": MODEL, "prompt": "hi", "max_tokens": 1}).encode()
    for pair in (("Authorization: Bearer a", "Authorization: Bearer b"), ("Authorization: Bearer a", "api-key: b")):
        status, _, answer, _ = post(stack, "/v1/completions", body, *pair)
        error = error_of(answer)
        assert status == 401 and error["code"] == "invalid_api_key" and "2 credentials" in error["message"]
    assert post(stack, "/v1/completions", body, "Authorization: Bearer a")[0] == 200


# ---- streams and metrics ----------------------------------------------------------------------------
def test_max_streams_counts_prompts_times_n(stack):
    """Was: --max-streams counted HTTP requests, so one request of 32 prompts x n=16 was 512 streams on one."""
    c = _sdk(stack)
    with pytest.raises(openai.BadRequestError) as e:  # alone over the limit: never fits
        c.completions.create(model=MODEL, prompt=["a", "b", "c"], n=3, max_tokens=1)
    assert e.value.body["param"] == "n" and "9 streams" in e.value.body["message"]
    stream = c.completions.create(model=MODEL, prompt="long", n=6, max_tokens=1900, stream=True,
                                  extra_body={"ignore_eos": True})
    try:
        next(iter(stream))
        with pytest.raises(openai.RateLimitError) as e:  # 6 running + 3 > 8
            c.with_options(max_retries=0).completions.create(model=MODEL, prompt="x", n=3, max_tokens=1)
        assert e.value.response.headers["retry-after"].isdigit() and "--max-streams" in e.value.body["message"]
    finally:
        stream.close()
    assert procs.wait_for(lambda: stack.saw("request_finished", n=6, client_disconnected=True), timeout=30)
    r = c.completions.create(model=MODEL, prompt="x", n=3, max_tokens=1)
    assert len(r.choices) == 3


def test_metrics_show_only_the_gateways_series(stack):
    """Was: the scheduler's series, all at 0, registered in the gateway's process by the CLI's imports."""
    assert_serving(stack)
    conn = http.client.HTTPConnection("127.0.0.1", stack.port, timeout=30)
    conn.request("GET", "/metrics")
    text = conn.getresponse().read().decode()
    conn.close()
    names = {line.split("{")[0].split()[0] for line in text.splitlines() if line and not line.startswith("#")}
    assert "pagedkv_gateway_requests_total" in names and "process_resident_memory_bytes" in names
    assert {n for n in names if n.startswith("pagedkv_") and not n.startswith("pagedkv_gateway_")} == set()
