"""Malformed public requests (issue 13, the adversarial suite), against one shared ``pagedkv serve``.

Every numeric field of GenerateRequest and SamplingParams at its extremes (0, -1, int32/uint64 limits, NaN,
+-inf, 1e-45, 1e38), huge strings, raw bytes that are not the message (truncated, wrong wire types, invalid
UTF-8 in each string field), huge and many metadata entries, unknown methods, hypothesis-generated
SamplingParams, and raw bytes / HTTP/1.1 on the scheduler's and the executor's ports. Each case expects a
documented status with a message naming the field (or, where a value is legal, a correct answer: a tiny
temperature or top_p must sample what greedy does, not token 0). After every case the server still answers a
fixed greedy prompt with the same tokens, and ModelInfo shows no page used.
"""

from __future__ import annotations

import asyncio
import math
import random
import socket

import grpc
import pytest
from hypothesis import given
from hypothesis import strategies as st

from pagedkv.api.v1 import api_pb2 as api
from pagedkv.client import Client
from pagedkv.local_server import free_port
from tests.conftest import Server, wait_until
from tests.support.adversarial_profiles import profile

pytestmark = pytest.mark.e2e

MAX_LEN = 128
PROMPT = [1, 10, 20, 30]
I32_MAX, I32_MIN, U64_MAX = 2**31 - 1, -(2**31), 2**64 - 1
IA = grpc.StatusCode.INVALID_ARGUMENT
RE = grpc.StatusCode.RESOURCE_EXHAUSTED
OK = "ok"  # the request is legal: it must complete
GREEDY = "greedy"  # legal, and it must give exactly the greedy tokens
TINY = 1e-45  # rounds to the smallest float32 denormal
GENERATE = "/pagedkv.api.v1.Generation/Generate"


@pytest.fixture(scope="module")
def server(model_cache):
    executor_port = free_port()
    s = Server("--num-pages", "64", "--max-model-len", str(MAX_LEN), "--threads", "1", "--check-integrity",
               "--executor-port", str(executor_port))
    s.executor_port = executor_port
    yield s
    s.stop()


def gen(prompt=PROMPT, *, request_id: str = "", priority: int = 0, page_budget: int = 0, seed: int | None = None,
        **sampling) -> api.GenerateRequest:
    sampling.setdefault("max_tokens", 4)
    sampling.setdefault("ignore_eos", True)
    sampling.setdefault("temperature", 0.0)  # greedy (an unset temperature samples): the GREEDY outcome compares
    req = api.GenerateRequest(sampling=api.SamplingParams(**sampling), request_id=request_id, priority=priority,
                              page_budget=page_budget)
    if seed is not None:
        req.sampling.seed = seed
    if isinstance(prompt, str):
        req.text = prompt
    else:
        req.token_ids.ids.extend(prompt)
    return req


async def call(address: str, request, method: str = GENERATE, metadata=()) -> tuple[object, object]:
    """(OK, token ids) or (status code, details). ``request`` is a message or raw bytes."""
    raw = isinstance(request, bytes)
    async with grpc.aio.insecure_channel(address) as channel:
        ser = None if raw else (lambda m: m.SerializeToString())
        try:
            if method == GENERATE:
                rpc = channel.unary_stream(method, request_serializer=ser,
                                           response_deserializer=api.GenerateResponse.FromString)
                tokens = []
                async for msg in rpc(request, metadata=metadata, timeout=120):
                    tokens += msg.token_ids
                return OK, tokens
            rpc = channel.unary_unary(method, request_serializer=ser)
            return OK, await rpc(request, metadata=metadata, timeout=60)
        except grpc.aio.AioRpcError as err:
            return err.code(), err.details() or ""


def cont(forks: list[list[int]], finished=(), offsets=None, **sampling) -> api.GenerateRequest:
    """gen(**sampling) resumed: fork i received forks[i] (draw_offset: their count unless ``offsets`` says)."""
    req = gen(**sampling)
    req.continuation.SetInParent()  # (present on the wire even with no forks)
    for i, ids in enumerate(forks):
        req.continuation.forks.add(token_ids=ids, draw_offset=len(ids) if offsets is None else offsets[i],
                                   finished=i in finished)
    return req


def greedy(address: str) -> list[int]:
    status, tokens = asyncio.run(call(address, gen(max_tokens=8)))
    assert status == OK, tokens
    return tokens


@pytest.fixture(scope="module")
def baseline(server) -> list[int]:
    return greedy(server.address)


def assert_still_serving(server, baseline) -> None:
    assert server.proc.poll() is None, "pagedkv serve exited:\n" + server.log()
    assert greedy(server.address) == baseline, "the fixed greedy prompt changed its answer"

    async def used() -> int:
        async with Client(server.address) as client:
            info = await client.model_info()
            return info.num_used_pages + info.num_used_host_pages

    assert wait_until(lambda: asyncio.run(used()) == 0, timeout=60.0), "pages left used after the case"


def pb_string(field: int, value: bytes) -> bytes:
    return bytes([field << 3 | 2, len(value)]) + value


VALID_PROMPT_BYTES = pb_string(2, pb_string(1, b"\x01\x0a"))  # token_ids {ids: [1, 10]}
rng = random.Random(13)

# (name, request, expected): expected is OK, GREEDY, (codes, text the message must contain), or a tuple of those
CASES = [
    # ---- SamplingParams.max_tokens (int32)
    ("max_tokens 0 (up to max_model_len)", gen(max_tokens=0), OK),
    ("max_tokens -1", gen(max_tokens=-1), (IA, "sampling.max_tokens")),
    ("max_tokens int32 max", gen(max_tokens=I32_MAX), (IA, "sampling.max_tokens")),
    ("max_tokens int32 min", gen(max_tokens=I32_MIN), (IA, "sampling.max_tokens")),
    # ---- temperature (float)
    ("temperature NaN", gen(temperature=math.nan), (IA, "sampling.temperature")),
    ("temperature +inf", gen(temperature=math.inf), (IA, "sampling.temperature")),
    ("temperature -inf", gen(temperature=-math.inf), (IA, "sampling.temperature")),
    ("temperature -1", gen(temperature=-1.0), (IA, "sampling.temperature")),
    ("temperature -1e-45", gen(temperature=-TINY), (IA, "sampling.temperature")),
    ("temperature 1e-45", gen(temperature=TINY, max_tokens=8), (GREEDY, (IA, "sampling.temperature"))),
    ("temperature 1e-38", gen(temperature=1e-38, max_tokens=8), (GREEDY, (IA, "sampling.temperature"))),
    ("temperature 1e38", gen(temperature=1e38, seed=1), OK),
    ("temperature -0.0", gen(temperature=-0.0, max_tokens=8), GREEDY),
    # ---- top_p (float)
    ("top_p NaN", gen(top_p=math.nan), (IA, "sampling.top_p")),
    ("top_p +inf", gen(top_p=math.inf), (IA, "sampling.top_p")),
    ("top_p -inf", gen(top_p=-math.inf), (IA, "sampling.top_p")),
    ("top_p -1", gen(top_p=-1.0), (IA, "sampling.top_p")),
    ("top_p 1e38", gen(top_p=1e38), (IA, "sampling.top_p")),
    ("top_p 1.5", gen(top_p=1.5), (IA, "sampling.top_p")),
    ("top_p 1e-45 at temperature 1", gen(top_p=TINY, temperature=1.0, max_tokens=8), (GREEDY, (IA, "sampling.top_p"))),
    ("top_p 0 (default 1)", gen(top_p=0.0, max_tokens=8), GREEDY),
    # ---- top_k (int32)
    ("top_k -1", gen(top_k=-1), (IA, "sampling.top_k")),
    ("top_k int32 min", gen(top_k=I32_MIN), (IA, "sampling.top_k")),
    ("top_k int32 max", gen(top_k=I32_MAX, max_tokens=8), GREEDY),
    ("top_k 1 at temperature 1", gen(top_k=1, temperature=1.0, max_tokens=8), GREEDY),
    # ---- seed (optional uint64)
    ("seed 0", gen(seed=0, temperature=0.8), OK),
    ("seed uint64 max", gen(seed=U64_MAX, temperature=0.8), OK),
    # ---- n (int32)
    ("n 0 (one)", gen(n=0, max_tokens=8), GREEDY),
    ("n -1", gen(n=-1), (IA, "sampling.n")),
    ("n int32 min", gen(n=I32_MIN), (IA, "sampling.n")),
    ("n 17", gen(n=17), (IA, "sampling.n")),
    ("n int32 max", gen(n=I32_MAX), (IA, "sampling.n")),
    # ---- stop_token_ids, stop
    ("stop token -1", gen(stop_token_ids=[-1]), (IA, "sampling.stop_token_ids")),
    ("stop token int32 max", gen(stop_token_ids=[I32_MAX]), (IA, "sampling.stop_token_ids")),
    ("stop token int32 min", gen(stop_token_ids=[I32_MIN]), (IA, "sampling.stop_token_ids")),
    ("10000 stop tokens", gen(stop_token_ids=[5] * 10000), (IA, "sampling.stop_token_ids")),
    ("17 stop strings", gen(stop=[f"s{i}" for i in range(17)]), (IA, "sampling.stop")),
    ("100k-char stop string", gen(stop=["x" * 100_000]), (IA, "sampling.stop")),
    # ---- GenerateRequest.priority, page_budget (int32)
    ("priority int32 max", gen(priority=I32_MAX), (IA, "priority")),
    ("priority int32 min", gen(priority=I32_MIN), (IA, "priority")),
    ("priority 1001", gen(priority=1001), (IA, "priority")),
    ("priority -1", gen(priority=-1, max_tokens=8), GREEDY),
    ("page_budget -1", gen(page_budget=-1), (IA, "page_budget")),
    ("page_budget int32 min", gen(page_budget=I32_MIN), (IA, "page_budget")),
    ("page_budget int32 max", gen(page_budget=I32_MAX), (IA, "page_budget")),
    ("page_budget 1", gen(page_budget=1), (IA, "page_budget")),
    # ---- the prompt
    ("token id int32 max", gen([1, I32_MAX]), (IA, "prompt.token_ids")),
    ("token id int32 min", gen([1, I32_MIN]), (IA, "prompt.token_ids")),
    ("token id -1", gen([1, -1]), (IA, "prompt.token_ids")),
    ("token id = vocab", gen([1, 259]), (IA, "prompt.token_ids")),
    ("no prompt", api.GenerateRequest(sampling=api.SamplingParams(max_tokens=4)), (IA, "prompt")),
    ("empty token ids", gen([]), (IA, "prompt")),
    ("prompt of max_model_len", gen([1] * MAX_LEN), (IA, "prompt")),
    ("100k token ids", gen([1] * 100_000), ((IA, "prompt"), (RE, ""))),
    ("empty text", gen(""), (IA, "prompt.text")),
    ("text of NULs", gen("\x00" * 10), OK),
    ("80 kB of 4-byte characters", gen("\U0001F600" * 20_000), ((IA, "prompt.text"), (RE, ""))),
    ("1 MB text", gen("x" * (1 << 20)), ((IA, "prompt.text"), (RE, ""))),
    ("8 MB text", gen("x" * (8 << 20)), ((IA, "prompt.text"), (RE, ""))),
    ("1000-char request_id", gen(request_id="r" * 1000), (IA, "request_id")),
    # ---- GenerateRequest.continuation (a resumed stream)
    ("continuation: nothing received yet", cont([[]], max_tokens=8), GREEDY),
    ("continuation: no forks", cont([]), (IA, "continuation.forks")),
    ("continuation: 2 forks for n=1", cont([[5], [6]]), (IA, "continuation.forks")),
    ("continuation: 17 forks for n=17", cont([[5]] * 17, n=17), (IA, "sampling.n")),
    ("continuation: draw_offset uint32 max", cont([[5]], offsets=[2**32 - 1]), (IA, "forks[0].draw_offset")),
    ("continuation: draw_offset 0 for one id", cont([[5]], offsets=[0]), (IA, "forks[0].draw_offset")),
    ("continuation: id int32 max", cont([[5, I32_MAX]]), (IA, "continuation.forks[0].token_ids")),
    ("continuation: id int32 min", cont([[I32_MIN]]), (IA, "continuation.forks[0].token_ids")),
    ("continuation: id = vocab", cont([[259]]), (IA, "continuation.forks[0].token_ids")),
    ("continuation: max_tokens ids", cont([[5] * 4], max_tokens=4), (IA, "sampling.max_tokens=4")),
    ("continuation: 100k ids", cont([[5] * 100_000]), ((IA, "continuation.forks[0].token_ids"), (RE, ""))),
    ("continuation: the context's worth", cont([[5] * (MAX_LEN - len(PROMPT))], max_tokens=0),
     (IA, "continuation.forks[0].token_ids")),
    ("continuation: EOS received", cont([[5, 2]], ignore_eos=False), (IA, "stop token")),
    ("continuation: stop string received", cont([[72, 105]], stop=["Ef"]), (IA, "stop string")),  # (id = byte + 3)
    ("continuation: every fork finished", cont([[5], [6]], finished=(0, 1), n=2), (IA, "continuation.forks")),
    # ---- bytes that are not a GenerateRequest
    ("invalid UTF-8 in text", pb_string(1, b"\xff\xfe\xfd"), (IA, "UTF-8")),
    ("invalid UTF-8 in request_id", VALID_PROMPT_BYTES + pb_string(4, b"\xc3\x28"), (IA, "UTF-8")),
    ("invalid UTF-8 in a stop string", VALID_PROMPT_BYTES + pb_string(3, pb_string(6, b"\xff\xff")), (IA, "UTF-8")),
    ("truncated varint", b"\x28\xff\xff\xff", (IA, "protobuf")),
    ("length past the end", b"\x0a\x05ab", (IA, "protobuf")),
    ("2 GB length prefix", b"\x0a\xff\xff\xff\xff\x07", (IA, "protobuf")),
    ("fixed32 where a string goes", b"\x0d\x00\x00\x00\x00", ((IA, "protobuf"), (IA, "prompt"))),  # (or unknown)
    ("100k nested groups", b"\x0b" * 100_000, (IA, "protobuf")),
    ("end-group without start", b"\x0c", (IA, "protobuf")),
    *[(f"random bytes #{i}", rng.randbytes(rng.choice([16, 256, 4096])), (IA, "")) for i in range(3)],
    # ---- other methods
    ("Tokenize 8 MB", ("/pagedkv.api.v1.Generation/Tokenize", api.TokenizeRequest(text="x" * (8 << 20))),
     ((IA, "text"), (RE, ""))),
    ("Tokenize invalid UTF-8", ("/pagedkv.api.v1.Generation/Tokenize", pb_string(1, b"\xff")), (IA, "UTF-8")),
    ("Detokenize 100k ids", ("/pagedkv.api.v1.Generation/Detokenize", api.DetokenizeRequest(token_ids=[1] * 100_000)),
     ((IA, "token_ids"), (RE, ""))),
    ("Detokenize id int32 min", ("/pagedkv.api.v1.Generation/Detokenize", api.DetokenizeRequest(token_ids=[I32_MIN])),
     (IA, "token_ids")),
    ("ModelInfo garbage", ("/pagedkv.api.v1.Generation/ModelInfo", b"\x0a\xff\xff"), (IA, "protobuf")),
    ("unknown method", ("/pagedkv.api.v1.Generation/Nope", b""), (grpc.StatusCode.UNIMPLEMENTED, "")),
    ("unknown service", ("/no.such.Service/Call", b""), (grpc.StatusCode.UNIMPLEMENTED, "")),
]

METADATA_CASES = [
    ("64 kB metadata value", [("x-junk", "a" * 65536)], ((RE, ""), (grpc.StatusCode.INTERNAL, ""))),
    ("1000 metadata entries", [(f"x-k{i}", "v") for i in range(1000)],
     (OK, (RE, ""), (grpc.StatusCode.INTERNAL, ""))),
    ("binary metadata", [("x-junk-bin", bytes(range(256)) * 16)], OK),
    ("a 4 kB bearer key (single tenant)", [("authorization", "Bearer " + "k" * 4096)],
     (OK, (grpc.StatusCode.UNAUTHENTICATED, ""))),
]


def check_outcome(name: str, status, detail, expected, greedy_tokens: list[int]) -> None:
    options = expected if isinstance(expected, tuple) and not isinstance(expected[0], grpc.StatusCode) else (
        expected,)
    for want in options:
        if want in (OK, GREEDY) and status == OK:
            if want == GREEDY:
                assert detail == greedy_tokens, f"{name}: {detail} instead of the greedy {greedy_tokens}"
            return
        if isinstance(want, tuple) and status == want[0] and want[1] in detail:
            return
    pytest.fail(f"{name}: got {status} {str(detail)[:300]!r}; expected one of {options}")


@pytest.mark.parametrize("name,request_,expected", CASES, ids=[c[0] for c in CASES])
def test_malformed_request(server, baseline, name, request_, expected):
    method, request_ = request_ if isinstance(request_, tuple) else (GENERATE, request_)
    status, detail = asyncio.run(call(server.address, request_, method))
    check_outcome(name, status, detail, expected, baseline)
    assert_still_serving(server, baseline)


@pytest.mark.parametrize("cut", [1, 4, 7])
def test_a_continuation_goes_on_with_the_greedy_tokens(server, baseline, cut):
    """Resumed after ``cut`` of the 8 greedy tokens: exactly the rest."""
    status, tokens = asyncio.run(call(server.address, cont([baseline[:cut]], max_tokens=8)))
    assert status == OK and tokens == baseline[cut:], (status, tokens)


def test_forks_resume_with_their_own_draws(server, baseline):
    """n = 2, seeded: fork 0 resumed after 3 tokens gives its undisturbed rest; fork 1, finished, sends nothing."""
    params = dict(max_tokens=8, ignore_eos=True, temperature=0.9, seed=5)

    async def scenario():
        async with Client(server.address, resume=None) as client:
            whole = await client.complete_n(PROMPT, 2, **params)
            request = Client.build_request(PROMPT, n=2, **params)
            request.continuation.forks.add(token_ids=whole[0].token_ids[:3], draw_offset=3)
            request.continuation.forks.add(token_ids=whole[1].token_ids, draw_offset=8, finished=True)
            msgs = [m async for m in client.stream(request)]
        return whole, msgs
    whole, msgs = asyncio.run(scenario())
    assert [t for m in msgs for t in m.token_ids] == whole[0].token_ids[3:] and {m.index for m in msgs} == {0}
    assert msgs[-1].usage.completion_tokens == 8 and msgs[0].seed == 5
    assert_still_serving(server, baseline)


@pytest.mark.parametrize("name,metadata,expected", METADATA_CASES, ids=[c[0] for c in METADATA_CASES])
def test_malformed_metadata(server, baseline, name, metadata, expected):
    status, detail = asyncio.run(call(server.address, gen(max_tokens=8), metadata=metadata))
    check_outcome(name, status, detail, expected, baseline)
    assert_still_serving(server, baseline)


FLOATS = st.one_of(st.floats(width=32), st.sampled_from([0.0, -0.0, TINY, 1e-38, 1.0, 1e38]))
INT32 = st.one_of(st.integers(I32_MIN, I32_MAX), st.sampled_from([0, -1, 1, I32_MAX, I32_MIN]))
SAMPLING = st.builds(api.SamplingParams, max_tokens=st.one_of(INT32, st.integers(1, 8)), temperature=FLOATS,
                     top_p=FLOATS, top_k=INT32, seed=st.integers(0, U64_MAX), n=st.one_of(INT32, st.integers(0, 3)),
                     stop_token_ids=st.lists(INT32, max_size=3), ignore_eos=st.booleans(), logprobs=st.booleans())


@given(sampling=SAMPLING)
@profile(ci_examples=40, long_examples=500)
def test_generated_sampling_params(server, baseline, sampling):
    """Any SamplingParams: a complete answer within max_tokens, or INVALID_ARGUMENT naming a sampling field."""
    req = gen()
    req.sampling.CopyFrom(sampling)
    if 0 < sampling.max_tokens:
        req.sampling.max_tokens = min(sampling.max_tokens, 16)  # (legal lengths: keep the answers short)
    status, detail = asyncio.run(call(server.address, req))
    if status == OK:
        n = max(1, req.sampling.n)
        assert len(detail) <= n * (req.sampling.max_tokens or MAX_LEN), detail
    else:
        assert status == IA and detail.startswith("sampling."), (status, detail)
    assert_still_serving(server, baseline)


RAW_PAYLOADS = [
    ("HTTP/1.1 GET", b"GET / HTTP/1.1\r\nHost: localhost\r\n\r\n"),
    ("HTTP/1.1 POST", b"POST /pagedkv.api.v1.Generation/Generate HTTP/1.1\r\nHost: x\r\nContent-Length: 5\r\n\r\n"
                      b"hello"),
    ("HTTP/1.1 upgrade to h2c", b"GET / HTTP/1.1\r\nHost: x\r\nConnection: Upgrade, HTTP2-Settings\r\nUpgrade: h2c\r\n"
                                b"HTTP2-Settings: AAMAAABkAARAAAAAAAIAAAAA\r\n\r\n"),
    ("HTTP/2 preface then garbage frames", b"PRI * HTTP/2.0\r\n\r\nSM\r\n\r\n" + random.Random(1).randbytes(2048)),
    ("TLS ClientHello", bytes.fromhex("16030100a5010000a10303") + random.Random(2).randbytes(160)),
    ("random bytes", random.Random(3).randbytes(4096)),
    ("1 MB of zeros", bytes(1 << 20)),
    ("connect and close", b""),
]


@pytest.mark.parametrize("port_kind", ["scheduler", "executor"])
@pytest.mark.parametrize("name,payload", RAW_PAYLOADS, ids=[c[0] for c in RAW_PAYLOADS])
def test_raw_bytes_on_each_port(server, baseline, port_kind, name, payload):
    port = server.port if port_kind == "scheduler" else server.executor_port
    with socket.create_connection(("127.0.0.1", port), timeout=10) as sock:
        try:
            sock.sendall(payload)
            sock.shutdown(socket.SHUT_WR)
            while sock.recv(65536):  # whatever it answers, until it closes
                pass
        except OSError:  # reset, broken pipe, already closed, timed out: refusing is fine, surviving is the point
            pass
    assert_still_serving(server, baseline)
