"""Authenticated, encrypted links: the executor secret (UNAUTHENTICATED for everything but health and
reflection), TLS on the executor's and the scheduler's ports, clients with a CA, and pagedkv gen-certs.

One executor (TLS + the test secret) and one scheduler (TLS to its clients and to the executor) serve the
whole module."""

from __future__ import annotations

import asyncio
import ipaddress
import os
import stat
import subprocess
import sys

import grpc
import pytest
from grpc_health.v1 import health_pb2, health_pb2_grpc

from pagedkv import certs, security
from pagedkv.client import Client
from pagedkv.executor.v1 import executor_pb2 as pb
from pagedkv.executor.v1 import executor_pb2_grpc as pb_grpc
from pagedkv.local_server import TEST_EXECUTOR_SECRET
from scheduler_svc.executor_client import ExecutorAuthFailed, ExecutorClient, ExecutorLink
from tests.support import procs

pytestmark = pytest.mark.e2e

WRONG_SECRET = "not-the-executor-secret-0f1e2d3c"
PROMPT = [1, 40, 41, 42, 43]


@pytest.fixture(scope="module")
def cert_dir(tmp_path_factory):
    out = tmp_path_factory.mktemp("certs")
    code = subprocess.run([sys.executable, "-m", "pagedkv", "gen-certs", "--out", str(out), "--hosts",
                           "executors,10.1.2.3", "--executor-secret"], cwd=procs.ROOT, capture_output=True,
                          text=True, timeout=120)
    assert code.returncode == 0, code.stderr
    return out


@pytest.fixture(scope="module")
def executor(cert_dir, model_cache):
    ex = procs.executor("--num-pages", "64", "--tls-cert", str(cert_dir / "server.pem"),
                        "--tls-key", str(cert_dir / "server.key"))
    yield ex
    ex.stop()


@pytest.fixture(scope="module")
def scheduler(executor, cert_dir):
    s = procs.Proc("scheduler", "--executor", executor.address, "--executor-tls-ca", str(cert_dir / "ca.pem"),
                   "--executor-tls-server-name", "executors", "--tls-cert", str(cert_dir / "server.pem"),
                   "--tls-key", str(cert_dir / "server.key"), "--connect-timeout", "60")
    yield s
    s.stop()


def _tls_channel(address: str, cert_dir) -> grpc.Channel:
    return grpc.secure_channel(address, security.channel_credentials(str(cert_dir / "ca.pem")))


def _describe(address: str, cert_dir, metadata=()) -> pb.DescribeResponse:
    with _tls_channel(address, cert_dir) as channel:
        return pb_grpc.ExecutorStub(channel).Describe(pb.DescribeRequest(), metadata=metadata, timeout=30)


# ---- the executor secret -----------------------------------------------------------------------
def test_describe_without_the_secret_is_unauthenticated(executor, cert_dir):
    with pytest.raises(grpc.RpcError) as err:
        _describe(executor.address, cert_dir)
    assert err.value.code() == grpc.StatusCode.UNAUTHENTICATED
    assert "no authorization metadata" in err.value.details() and "--executor-secret-file" in err.value.details()
    assert _describe(executor.address, cert_dir, [("authorization", f"Bearer {TEST_EXECUTOR_SECRET}")]).vocab_size


@pytest.mark.parametrize("metadata", [(), (("authorization", f"Bearer {WRONG_SECRET}"),)], ids=["none", "wrong"])
def test_run_without_the_secret_is_unauthenticated(executor, cert_dir, metadata):
    """Run is refused before any plan is read: an outside caller can neither drive the executor nor take the
    stream while the scheduler reconnects."""

    async def run():
        async with grpc.aio.secure_channel(executor.address,
                                           security.channel_credentials(str(cert_dir / "ca.pem"))) as channel:
            call = pb_grpc.ExecutorStub(channel).Run(metadata=metadata, timeout=30)
            # NOTE: the refusal comes before the client writes anything. A write racing it may end in INTERNAL
            # instead of the server's status (grpc aio, grpc/grpc#36066), so the status is read, not written for.
            with pytest.raises(grpc.aio.AioRpcError) as err:
                await call.read()
            return err.value.code()

    assert asyncio.run(run()) == grpc.StatusCode.UNAUTHENTICATED


def test_wrong_secret_is_unauthenticated_and_logged_without_the_secret(executor, cert_dir):
    with pytest.raises(grpc.RpcError) as err:
        _describe(executor.address, cert_dir, [("authorization", f"Bearer {WRONG_SECRET}")])
    assert err.value.code() == grpc.StatusCode.UNAUTHENTICATED and "wrong secret" in err.value.details()
    assert procs.wait_for(lambda: executor.saw("executor_auth_failed", reason="wrong secret"), timeout=10)
    line = next(e for e in executor.events if e.get("event") == "executor_auth_failed"
                and e.get("reason") == "wrong secret")
    assert line["method"].startswith("/pagedkv.executor.v1.Executor/") and line["peer"].startswith("ipv4:127.0.0.1")
    assert WRONG_SECRET not in executor.log() and TEST_EXECUTOR_SECRET not in executor.log()


def test_health_and_reflection_answer_without_the_secret(executor, cert_dir):
    from grpc_reflection.v1alpha.proto_reflection_descriptor_database import ProtoReflectionDescriptorDatabase

    with _tls_channel(executor.address, cert_dir) as channel:
        status = health_pb2_grpc.HealthStub(channel).Check(health_pb2.HealthCheckRequest(), timeout=30).status
        services = list(ProtoReflectionDescriptorDatabase(channel).get_services())
    assert status == health_pb2.HealthCheckResponse.SERVING
    assert "pagedkv.executor.v1.Executor" in services


def test_a_scheduler_with_the_wrong_secret_is_told_it_is_authentication(executor, cert_dir):
    """What the scheduler logs (executor_unreachable, every few seconds) and exits with at start-up."""

    async def probe(secret: str) -> str:
        client = ExecutorClient(executor.address, 30, ExecutorLink(secret, str(cert_dir / "ca.pem"), "executors"))
        try:
            with pytest.raises(ExecutorAuthFailed) as err:
                await client.probe(30)
            return str(err.value)
        finally:
            await client.close()

    wrong, missing = asyncio.run(probe(WRONG_SECRET)), asyncio.run(probe(""))
    assert "refused this scheduler: authentication failed" in wrong and "executor's differs" in wrong
    assert "this scheduler has no executor secret" in missing and "--executor-secret-file" in missing
    r = subprocess.run([sys.executable, "-m", "pagedkv", "scheduler", "--executor", executor.address,
                        "--executor-tls-ca", str(cert_dir / "ca.pem"), "--port", "0", "--connect-timeout", "30"],
                       cwd=procs.ROOT, capture_output=True, text=True, timeout=120,
                       env={**os.environ, security.EXECUTOR_SECRET_ENV: WRONG_SECRET})
    assert r.returncode == 1 and "authentication failed" in r.stderr, r.stderr[-2000:]


def test_executor_without_a_secret_refuses_to_start():
    r = subprocess.run([sys.executable, "-m", "pagedkv", "executor", "--port", "0", "--num-pages", "8"],
                       cwd=procs.ROOT, capture_output=True, text=True, timeout=120,
                       env={**os.environ, security.EXECUTOR_SECRET_ENV: ""})
    assert r.returncode != 0
    assert "no executor secret" in r.stderr and "--executor-secret-file" in r.stderr and "--insecure" in r.stderr


def test_insecure_executor_beyond_loopback_warns_loudly_and_answers_anyone():
    ex = procs.Proc("executor", "--threads", "1", "--num-pages", "8", "--insecure", "--host", "0.0.0.0",
                    env={security.EXECUTOR_SECRET_ENV: ""})
    try:
        unauth = next(e for e in ex.events if e.get("event") == "executor_unauthenticated")
        assert unauth["level"] == "error" and unauth["exposed_beyond_loopback"] is True
        assert ex.saw("insecure_listener", role="executor")
        with grpc.insecure_channel(ex.address) as channel:
            assert pb_grpc.ExecutorStub(channel).Describe(pb.DescribeRequest(), timeout=30).vocab_size
    finally:
        ex.stop()


# ---- TLS ---------------------------------------------------------------------------------------
def test_tls_on_both_links_serves_a_greedy_prompt(scheduler, cert_dir):
    assert scheduler.saw("scheduler_ready", tls=True, executor_tls=True, executor_secret=True)
    ca = str(cert_dir / "ca.pem")

    async def run():
        async with Client(scheduler.address, tls_ca=ca) as client:
            first = await client.complete(PROMPT, max_tokens=8, ignore_eos=True, temperature=0)
            again = await client.complete(PROMPT, max_tokens=8, ignore_eos=True, temperature=0)
            return first, again

    first, again = asyncio.run(run())
    assert len(first.token_ids) == 8 and first.token_ids == again.token_ids


def test_plaintext_client_to_the_tls_port_fails(scheduler, executor):
    async def run(address: str):
        async with Client(address) as client:
            with pytest.raises(grpc.aio.AioRpcError) as err:
                await client.model_info()
            return err.value.code()

    assert asyncio.run(run(scheduler.address)) == grpc.StatusCode.UNAVAILABLE
    with grpc.insecure_channel(executor.address) as channel:
        with pytest.raises(grpc.RpcError) as err:
            health_pb2_grpc.HealthStub(channel).Check(health_pb2.HealthCheckRequest(), timeout=10)
    assert err.value.code() == grpc.StatusCode.UNAVAILABLE


def test_client_checks_the_certificate_name(scheduler, cert_dir):
    """A certificate for other names is refused; --tls-server-name picks a name the certificate carries."""
    ca = str(cert_dir / "ca.pem")

    async def info(name: str):
        async with Client(scheduler.address, tls_ca=ca, tls_server_name=name) as client:
            return await client.model_info()

    assert asyncio.run(info("executors")).model == "tiny-llama"
    with pytest.raises(grpc.aio.AioRpcError) as err:
        asyncio.run(info("elsewhere.example"))
    assert err.value.code() == grpc.StatusCode.UNAVAILABLE


def test_cli_generate_and_health_take_a_ca(scheduler, executor, cert_dir):
    ca = str(cert_dir / "ca.pem")

    async def expected() -> str:
        async with Client(scheduler.address, tls_ca=ca) as client:
            return (await client.complete("héllo", max_tokens=6, ignore_eos=True, temperature=0)).text

    text = asyncio.run(expected())
    r = subprocess.run([sys.executable, "-m", "pagedkv", "generate", "héllo", "--address", scheduler.address,
                        "--max-tokens", "6", "--ignore-eos", "--temperature", "0", "--tls-ca", ca], cwd=procs.ROOT,
                       capture_output=True,
                       timeout=120)
    assert r.returncode == 0, r.stderr.decode()
    assert r.stdout.decode() == text + "\n"
    for address in (scheduler.address, executor.address):
        r = subprocess.run([sys.executable, "-m", "pagedkv", "health", "--address", address, "--tls-ca", ca],
                           cwd=procs.ROOT, capture_output=True, text=True, timeout=60)
        assert r.returncode == 0 and "SERVING" in r.stdout, r.stderr
    r = subprocess.run([sys.executable, "-m", "pagedkv", "health", "--address", scheduler.address],
                       cwd=procs.ROOT, capture_output=True, text=True, timeout=60)
    assert r.returncode == 1 and "UNAVAILABLE" in r.stderr


# ---- certificates ------------------------------------------------------------------------------
def test_gen_certs_writes_a_ca_and_a_server_pair(cert_dir):
    from cryptography import x509

    modes = {p.name: stat.S_IMODE(p.stat().st_mode) for p in cert_dir.iterdir()}
    assert modes == {"ca.pem": 0o644, "server.pem": 0o644, "server.key": 0o600, "executor.secret": 0o600}
    cert = x509.load_pem_x509_certificate((cert_dir / "server.pem").read_bytes())
    san = cert.extensions.get_extension_for_class(x509.SubjectAlternativeName).value
    assert set(san.get_values_for_type(x509.DNSName)) == {"executors", "localhost"}
    assert set(san.get_values_for_type(x509.IPAddress)) == {ipaddress.ip_address(a)
                                                           for a in ("10.1.2.3", "127.0.0.1", "::1")}
    ca = x509.load_pem_x509_certificate((cert_dir / "ca.pem").read_bytes())
    cert.verify_directly_issued_by(ca)
    assert len((cert_dir / "executor.secret").read_text().strip()) == 64


def test_gen_certs_keeps_or_refuses_existing_files(cert_dir):
    before = (cert_dir / "ca.pem").read_bytes()
    run = [sys.executable, "-m", "pagedkv", "gen-certs", "--out", str(cert_dir)]
    r = subprocess.run(run, cwd=procs.ROOT, capture_output=True, text=True, timeout=60)
    assert r.returncode == 1 and "--force" in r.stderr
    r = subprocess.run([*run, "--if-missing"], cwd=procs.ROOT, capture_output=True, text=True, timeout=60)
    assert r.returncode == 0 and "kept" in r.stdout
    assert (cert_dir / "ca.pem").read_bytes() == before


def test_mismatched_key_or_half_a_pair_is_refused(tmp_path, cert_dir):
    other = certs.generate(tmp_path / "other")
    with pytest.raises(ValueError, match="is not the key of --tls-cert"):
        security.server_credentials(str(cert_dir / "server.pem"), str(other["server.key"]))
    with pytest.raises(ValueError, match="--tls-cert and --tls-key go together"):
        security.server_credentials(str(cert_dir / "server.pem"), "")
    with pytest.raises(ValueError, match="not a PEM file"):
        security.server_credentials(str(cert_dir / "executor.secret"), str(cert_dir / "server.key"))
