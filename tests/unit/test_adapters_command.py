"""``pagedkv adapters list | load NAME PATH [--public] | unload NAME`` (#52) against a stand-in scheduler: each
sends its request with the key given, prints the AdapterInfo (one line of its fields), and a refusal is one line on
stderr with exit 1; a command line that is no call exits 2 before connecting."""

from __future__ import annotations

import asyncio

import grpc
import pytest

from pagedkv.adapters_command import run
from pagedkv.api.v1 import api_pb2 as api
from pagedkv.cli import build_parser
from pagedkv.client import Client
from tests.support.gateway_stub import rpc_error

pytestmark = pytest.mark.unit

SQL = api.AdapterInfo(name="sql", rank=16, num_bytes=4096, num_pages=27, owner="acme", resident=1, num_page_ins=2)


class Stub:
    def __init__(self, fail: grpc.aio.AioRpcError | None = None) -> None:
        self.calls: list = []
        self.fail = fail

    def _call(self, req, metadata, timeout) -> None:
        self.calls.append((req, metadata, timeout))
        if self.fail:
            raise self.fail

    async def LoadAdapter(self, req, metadata, timeout):  # noqa: N802
        self._call(req, metadata, timeout)
        return SQL

    async def UnloadAdapter(self, req, metadata, timeout):  # noqa: N802
        self._call(req, metadata, timeout)
        return api.UnloadAdapterResponse()

    async def ModelInfo(self, req, metadata, timeout):  # noqa: N802
        self._call(req, metadata, timeout)
        return api.ModelInfoResponse(adapters=[SQL, api.AdapterInfo(name="pub", rank=8)])


class Channel:
    async def close(self) -> None:
        pass


def _pagedkv(argv: list[str], stub: Stub) -> int:
    """``pagedkv adapters ...`` with a Client whose stub is ``stub`` (the unit tier opens no channel)."""
    args = build_parser().parse_args(["adapters", *argv])
    connected = []

    def connect(a):
        client = Client.__new__(Client)
        client.stub, client.channel = stub, Channel()
        client.metadata = (("authorization", f"Bearer {a.api_key}"),)
        connected.append(a.address)
        return client
    code = asyncio.run(run(args, connect))
    assert connected == ([] if code == 2 else [args.address])
    return code


def test_load_sends_the_request_with_the_key_and_prints_the_adapter_info(capsys):
    stub = Stub()
    assert _pagedkv(["load", "sql", "adapters/sql", "--public", "--api-key", "k1", "--address", "h:1"], stub) == 0
    req, metadata, timeout = stub.calls[0]
    assert req == api.LoadAdapterRequest(name="sql", path="adapters/sql", public=True)
    assert metadata == (("authorization", "Bearer k1"),) and timeout > 0
    assert capsys.readouterr().out == ("name=sql rank=16 num_bytes=4096 num_pages=27 owner=acme resident=1 "
                                       "num_page_ins=2\n")


def test_unload_and_list(capsys):
    stub = Stub()
    assert _pagedkv(["unload", "sql"], stub) == 0
    assert stub.calls[0][0] == api.UnloadAdapterRequest(name="sql")
    assert capsys.readouterr().out == "unloaded sql\n"
    assert _pagedkv(["list"], stub) == 0
    out = capsys.readouterr().out.splitlines()
    assert [line.split()[0] for line in out] == ["name=sql", "name=pub"]
    assert "owner=(public)" in out[1]


def test_a_refusal_is_one_line_on_stderr_and_exit_1(capsys):
    stub = Stub(rpc_error(grpc.StatusCode.PERMISSION_DENIED, "tenant acme: max_adapters is 0"))
    assert _pagedkv(["load", "sql", "p"], stub) == 1
    captured = capsys.readouterr()
    assert captured.out == "" and captured.err == "error: PERMISSION_DENIED: tenant acme: max_adapters is 0\n"


@pytest.mark.parametrize("argv, words", [
    (["load", "sql"], "load takes NAME and PATH"),
    (["unload"], "unload takes NAME only"),
    (["unload", "sql", "p"], "unload takes NAME only"),
    (["list", "sql"], "list takes no NAME or PATH"),
    (["unload", "sql", "--public"], "--public goes with load"),
])
def test_a_command_line_that_is_no_call_exits_2_before_connecting(argv, words, capsys):
    stub = Stub()
    assert _pagedkv(argv, stub) == 2
    assert words in capsys.readouterr().err and stub.calls == []
