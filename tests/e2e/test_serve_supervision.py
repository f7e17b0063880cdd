"""``pagedkv serve`` supervises its children (pagedkv/supervisor.py), through a real ``pagedkv serve``: SIGHUP reloads
the scheduler, a SIGKILLed executor is restarted and an in-flight stream completes identically, a SIGKILLed scheduler
is restarted and the client resumes its stream there, SIGTERM drains an in-flight stream, and a SIGKILLed serve takes
its children down. The supervisor alone, with small stand-in children: test_serve_supervision_standins.py.
"""

from __future__ import annotations

import asyncio
import os
import shutil
import signal
import stat
from pathlib import Path

import grpc
import pytest

from pagedkv.client import Client, Completion, accumulate
from pagedkv.local_server import TEST_EXECUTOR_SECRET, LocalServer
from pagedkv.tenancy import hash_key
from tests.conftest import wait_until
from tests.support.supervision import gone as _gone

pytestmark = pytest.mark.e2e


# ---- through a real pagedkv serve --------------------------------------------------------------
PROMPT = "Supervision keeps the stream going:"
STREAM = dict(max_tokens=400, ignore_eos=True, temperature=0)


def children(server: LocalServer) -> dict[str, int]:
    """serve's children by role, from /proc (not the ready lines: restarted children have new pids)."""
    found: dict[str, int] = {}
    for task in Path(f"/proc/{server.proc.pid}/task").iterdir():
        try:
            pids = (task / "children").read_text().split()
        except FileNotFoundError:
            continue
        for pid in pids:
            try:
                argv = Path(f"/proc/{pid}/cmdline").read_bytes().split(b"\0")
            except FileNotFoundError:
                continue
            role = next((a.decode() for a in argv if a in (b"executor", b"scheduler")), None)
            if role and not _gone(int(pid)):
                found[role] = int(pid)
    return found


async def _stream(address: str, on_first_token=None) -> Completion:
    out = Completion()
    async with Client(address, api_key="key-sup") as client:  # (it resumes a stream whose scheduler died)
        async for msg in client.generate(PROMPT, **STREAM):
            first = not out.token_ids
            accumulate(out, msg)
            if first and on_first_token is not None and not msg.finish_reason:
                on_first_token()
    return out


def _complete(address: str) -> Completion:
    return asyncio.run(_stream(address))


def _serve(tmp_path_factory) -> LocalServer:
    tenants = tmp_path_factory.mktemp("tenants") / "tenants.toml"
    tenants.write_text(f'[tenants.sup]\nkeys = ["{hash_key("key-sup")}"]\n')
    return LocalServer("--num-pages", "256", "--threads", "1", "--tenants-file", str(tenants), timeout=300)


@pytest.fixture(scope="module")
def server(tmp_path_factory):
    s = _serve(tmp_path_factory)
    yield s
    s.stop()


@pytest.fixture(scope="module")
def undisturbed(server) -> Completion:
    out = _complete(server.address)
    assert out.finish_reason == "length" and len(out.token_ids) == STREAM["max_tokens"]
    return out


def test_sighup_reloads_the_scheduler_and_serve_keeps_serving(server, undisturbed):
    before = children(server)
    assert set(before) == {"executor", "scheduler"}
    reloads = server.log().count("tenants_reloaded")
    server.proc.send_signal(signal.SIGHUP)
    assert wait_until(lambda: server.log().count("tenants_reloaded") > reloads, 60), server.log()
    assert server.proc.poll() is None and children(server) == before
    assert _complete(server.address).token_ids == undisturbed.token_ids


def test_killed_executor_restarts_and_the_stream_in_flight_completes(server, undisturbed):
    before = children(server)
    failures = server.log().count("executor_failed")
    out = asyncio.run(_stream(server.address, lambda: os.kill(before["executor"], signal.SIGKILL)))
    # The scheduler moved the request off the dead executor (to the unplaced queue) and, once serve had
    # restarted the executor at the same address, recomputed it there: the client saw no error and no change.
    assert "requests_moved=1" in "\n".join(server.log().splitlines()[-400:])
    assert server.log().count("executor_failed") > failures
    assert out.finish_reason == "length" and out.token_ids == undisturbed.token_ids
    after = children(server)
    assert server.proc.poll() is None and after["scheduler"] == before["scheduler"]
    assert after["executor"] != before["executor"] and "child_restarted" in server.log()
    assert _complete(server.address).token_ids == undisturbed.token_ids


def test_killed_scheduler_restarts_and_the_stream_in_flight_resumes(server, undisturbed):
    """The scheduler holds the client streams: its death breaks them (UNAVAILABLE) and serve restarts it; the client
    resumes the stream in flight there once it is back (with the tokens it had: GenerateRequest.continuation), and
    the stream is the undisturbed one (was: it ended with UNAVAILABLE)."""
    before = children(server)
    out = asyncio.run(_stream(server.address, lambda: os.kill(before["scheduler"], signal.SIGKILL)))
    assert out.finish_reason == "length" and out.token_ids == undisturbed.token_ids and out.text == undisturbed.text
    assert out.completion_tokens == STREAM["max_tokens"] and out.prompt_tokens == undisturbed.prompt_tokens
    after = children(server)
    assert server.proc.poll() is None and after["executor"] == before["executor"]
    assert after["scheduler"] != before["scheduler"] and "resumed=" in server.log()


def test_sigterm_lets_the_stream_in_flight_finish(server, undisturbed):
    pids = children(server)
    out = asyncio.run(_stream(server.address, lambda: server.proc.send_signal(signal.SIGTERM)))
    assert out.finish_reason == "length" and out.token_ids == undisturbed.token_ids
    assert server.proc.wait(timeout=60) == 0, server.log()
    assert wait_until(lambda: all(_gone(p) for p in pids.values()), 60)
    stopped = [line for line in server.log().splitlines() if "child_stopped" in line]
    assert len(stopped) == 2 and "scheduler" in stopped[0] and "executor" in stopped[1], stopped
    assert all("exited with code 0" in line for line in stopped), stopped
    assert "child_killed" not in server.log()


def _argv(pid: int) -> list[str]:
    return [a.decode() for a in Path(f"/proc/{pid}/cmdline").read_bytes().split(b"\0")]


def _describe_executor(address: str, secret: str = "") -> grpc.StatusCode:
    from pagedkv.executor.v1 import executor_pb2 as pb
    from pagedkv.executor.v1 import executor_pb2_grpc as pb_grpc

    metadata = [("authorization", f"Bearer {secret}")] if secret else []
    with grpc.insecure_channel(address) as channel:
        try:
            pb_grpc.ExecutorStub(channel).Describe(pb.DescribeRequest(), metadata=metadata, timeout=30)
        except grpc.RpcError as err:
            return err.code()
    return grpc.StatusCode.OK


def test_tls_serve_with_its_own_secret_a_short_unplaced_timeout_and_a_sigkill(tmp_path_factory):
    """TLS and the per-run secret; an executor that is back only after --unplaced-timeout: the stream in flight
    ends with the documented error, later requests succeed; a SIGKILLed serve takes its children down."""
    from pagedkv import certs

    files = certs.generate(tmp_path_factory.mktemp("certs"))
    tenants = tmp_path_factory.mktemp("tenants") / "tenants.toml"
    tenants.write_text(f'[tenants.sup]\nkeys = ["{hash_key("key-sup")}"]\n')
    s = LocalServer("--num-pages", "64", "--threads", "1", "--tenants-file", str(tenants), "--tls-cert",
                    str(files[certs.CERT_FILE]), "--tls-key", str(files[certs.KEY_FILE]), "--unplaced-timeout", "0.5",
                    timeout=300)
    try:
        async def over_tls(on_first_token=None, resume=None) -> Completion:
            """(resume=None: the server's own error, not a resume once the executor is back)"""
            out = Completion()
            async with Client(s.address, api_key="key-sup", tls_ca=str(files[certs.CA_FILE]), resume=resume) as client:
                async for msg in client.generate(PROMPT, **STREAM):
                    first = not out.token_ids
                    accumulate(out, msg)
                    if first and on_first_token is not None and not msg.finish_reason:
                        on_first_token()
            return out

        assert asyncio.run(over_tls()).completion_tokens == STREAM["max_tokens"]  # serve passed on --tls-cert/key
        pids = children(s)
        assert set(pids) == {"executor", "scheduler"}
        # The executor listens on loopback and takes only this run's secret, from a private file.
        argv = _argv(pids["executor"])
        secret_file = Path(argv[argv.index("--executor-secret-file") + 1])
        assert argv[argv.index("--host") + 1] == "127.0.0.1"
        assert stat.S_IMODE(secret_file.stat().st_mode) == 0o600 and len(secret_file.read_text().strip()) == 64
        assert secret_file in [Path(p) for p in _argv(pids["scheduler"])]
        address = f"127.0.0.1:{argv[argv.index('--port') + 1]}"
        assert _describe_executor(address) == grpc.StatusCode.UNAUTHENTICATED
        assert _describe_executor(address, TEST_EXECUTOR_SECRET) == grpc.StatusCode.UNAUTHENTICATED
        assert _describe_executor(address, secret_file.read_text().strip()) == grpc.StatusCode.OK

        # the executor is back after >= 1 s of backoff and its start (~6 s here); the request gives up after 0.5 s
        # (at most 0.75 s: the check runs every 0.25 s)
        with pytest.raises(grpc.aio.AioRpcError) as err:
            asyncio.run(over_tls(lambda: os.kill(pids["executor"], signal.SIGKILL)))
        assert err.value.code() == grpc.StatusCode.UNAVAILABLE
        assert "no executor that can hold this request was available for 0.5s" in err.value.details()

        def serving() -> bool:  # new requests are refused until the restarted executor is up
            try:
                return asyncio.run(over_tls()).completion_tokens == STREAM["max_tokens"]
            except grpc.aio.AioRpcError as e:
                if "no executor is up" in (e.details() or ""):
                    return False
                raise

        assert wait_until(serving, 120, interval=0.5), s.log()
        assert "child_restarted" in s.log()
        pids = children(s)
        assert set(pids) == {"executor", "scheduler"}
        s.proc.kill()
        s.proc.wait()
        assert wait_until(lambda: all(_gone(p) for p in pids.values()), 60), "children outlived serve"
        shutil.rmtree(secret_file.parent)  # a SIGKILLed serve cannot remove it
    finally:
        s.stop()
