"""The command line: services started one by one (as docker-compose runs them), and `pagedkv generate`."""

from __future__ import annotations

import asyncio
import signal
import subprocess
import sys

from pagedkv.cli import free_port
from pagedkv.client import Client
from tests.conftest import ROOT


def _spawn(*args: str) -> subprocess.Popen:
    return subprocess.Popen([sys.executable, "-m", "pagedkv", *args, "--log-format", "json"], cwd=ROOT,
                            stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True)


def reflected_services(address: str) -> list[str]:
    import grpc
    from grpc_reflection.v1alpha.proto_reflection_descriptor_database import ProtoReflectionDescriptorDatabase

    with grpc.insecure_channel(address) as channel:
        return list(ProtoReflectionDescriptorDatabase(channel).get_services())


def test_services_alone_then_generate_streams_text(tiny_llama_dir):
    exec_port, sched_port = free_port(), free_port()
    executor = _spawn("executor", "--port", str(exec_port), "--num-pages", "128")
    scheduler = _spawn("scheduler", "--executor", f"127.0.0.1:{exec_port}", "--port", str(sched_port))
    try:
        address = f"127.0.0.1:{sched_port}"

        async def ready_and_generate():
            async with Client(address) as client:
                await client.wait_ready(timeout=120)
                ids = await client.tokenize("héllo", add_special_tokens=True)
                out = await client.complete("héllo wörld", max_tokens=24, ignore_eos=True)
                info = await client.model_info()
                return ids, out, info

        ids, out, info = asyncio.run(ready_and_generate())
        assert "pagedkv.api.v1.Generation" in reflected_services(address)
        assert "pagedkv.executor.v1.Executor" in reflected_services(f"127.0.0.1:{exec_port}")
        assert "grpc.health.v1.Health" in reflected_services(address)
        from transformers import AutoTokenizer

        tok = AutoTokenizer.from_pretrained(str(tiny_llama_dir))
        assert ids == tok("héllo")["input_ids"]
        assert out.text == tok.decode(out.token_ids, skip_special_tokens=True)
        assert out.prompt_tokens == len(tok("héllo wörld")["input_ids"])
        assert info.model == "tiny-llama" and info.block_size == 16 and info.num_pages == 128

        r = subprocess.run([sys.executable, "-m", "pagedkv", "generate", "héllo wörld", "--address", address,
                            "--max-tokens", "24", "--ignore-eos"], cwd=ROOT, capture_output=True, timeout=120)
        stdout, stderr = r.stdout.decode("utf-8"), r.stderr.decode("utf-8")  # bytes: keep \r as it is
        assert r.returncode == 0, stderr
        assert stdout == out.text + "\n"  # greedy: the same text as above, then a newline
        assert "finish=length" in stderr and "completion_tokens=24" in stderr

        r = subprocess.run([sys.executable, "-m", "pagedkv", "generate", "x", "--address", address,
                            "--temperature", "-1"], cwd=ROOT, capture_output=True, text=True, timeout=120)
        assert r.returncode == 1 and "INVALID_ARGUMENT" in r.stderr and "sampling.temperature" in r.stderr
    finally:
        for p in (scheduler, executor):
            p.send_signal(signal.SIGTERM)
        codes = [p.wait(timeout=30) for p in (scheduler, executor)]
    logs = scheduler.stdout.read()
    assert '"event": "scheduler_ready"' in logs and '"request_id"' in logs  # JSON logs with request ids
    assert codes == [0, 0]


def test_scheduler_without_executor_fails_clearly():
    r = subprocess.run([sys.executable, "-m", "pagedkv", "scheduler", "--executor", f"127.0.0.1:{free_port()}",
                        "--connect-timeout", "2"], cwd=ROOT, capture_output=True, text=True, timeout=120)
    assert r.returncode == 1 and "not reachable" in r.stderr


def test_serve_ctrl_c_stops_both_children(start_server):
    server = start_server("--num-pages", "64")
    children = subprocess.run(["pgrep", "-P", str(server.proc.pid)], capture_output=True, text=True).stdout.split()
    assert len(children) == 2, children  # executor and scheduler
    assert server.stop() == 0
    for pid in children:
        assert subprocess.run(["kill", "-0", pid], capture_output=True).returncode != 0, f"child {pid} still runs"
