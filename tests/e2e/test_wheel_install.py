"""The wheel is the product: built from the sources (``pip wheel .``), installed into a fresh venv (no system site
packages, no checkout on the path) with torch==2.13.0 pinned first and xgrammar --no-deps as README says, it
imports every module its runtime dependencies allow, and its ``pagedkv serve`` answers ``pagedkv generate`` from
outside the checkout, then stops cleanly on Ctrl-C.

pip reads this machine's configuration (its wheel directory, indexes and cache), as a user's pip would.
"""

from __future__ import annotations

import os
import shutil
import subprocess
import sys
import zipfile
from pathlib import Path

import pytest

from pagedkv.local_server import LocalServer
from tests.conftest import ROOT

pytestmark = [pytest.mark.e2e, pytest.mark.slow]  # a venv, torch's wheel unpacked, a server: 1-3 minutes

PACKAGES = ("pagedkv", "scheduler_svc", "executor_svc", "kernels_cuda")
# Modules that need what the runtime leaves out: NVIDIA Dynamo (pagedkv[dynamo]), grpcio-tools (make proto),
# matplotlib (pagedkv[bench]), CuPy (pagedkv[cuda]); each is imported only by the command that needs it.
OPTIONAL = {"pagedkv.dynamo_worker", "pagedkv.dynamo_errors", "pagedkv.dynamo_tenancy", "pagedkv.dynamo_kv_relay",
            "pagedkv.dynamo_request", "pagedkv.proto_gen", "pagedkv.loadgen.plots"}
# What the code reads at run time besides Python: the CPU kernels' sources (built on first use), the CUDA kernels'.
DATA = ("executor_svc/attention/paged_attention_cpu.cpp", "executor_svc/attention/cpu_math.h",
        "executor_svc/attention/cpu_ops.h", "executor_svc/model/cpu_ops.cpp", "executor_svc/model/cpu_gemm.cpp",
        "executor_svc/model/cpu_decode.cpp", "kernels_cuda/decode.cu", "kernels_cuda/cache.cu",
        "kernels_cuda/common.cuh", "pagedkv/api/v1/api_pb2.py", "pagedkv/executor/v1/executor_pb2_grpc.py")


def _run(*cmd: str | Path, cwd: Path, env: dict[str, str], timeout: float = 600) -> str:
    done = subprocess.run([str(c) for c in cmd], cwd=cwd, env=env, capture_output=True, text=True, timeout=timeout)
    assert done.returncode == 0, f"{cmd} exited {done.returncode}:\n{done.stdout[-3000:]}\n{done.stderr[-3000:]}"
    return done.stdout + done.stderr


def _sources(dest: Path) -> Path:
    """A copy of what the wheel is built from (not the checkout itself: its build/ may hold files since removed)."""
    skip = shutil.ignore_patterns("__pycache__", "*.pyc", "*.egg-info")
    for name in PACKAGES:
        shutil.copytree(ROOT / name, dest / name, ignore=skip)
    for name in ("pyproject.toml", "README.md"):
        shutil.copy2(ROOT / name, dest / name)
    return dest


def _modules(wheel: Path) -> list[str]:
    with zipfile.ZipFile(wheel) as z:
        names = [n[:-3].replace("/", ".").removesuffix(".__init__") for n in z.namelist()
                 if n.endswith(".py") and n.split("/")[0] in PACKAGES]
    return sorted(n for n in names if n not in OPTIONAL and not n.endswith("__main__"))


@pytest.fixture(scope="module")
def installed(tmp_path_factory) -> Path:
    """A fresh venv with the wheel installed as README says; returns its bin/."""
    tmp = tmp_path_factory.mktemp("wheel")
    env = {k: v for k, v in os.environ.items() if k not in ("PYTHONPATH", "VIRTUAL_ENV", "PYTHONHOME")}
    dist = tmp / "dist"
    _run(sys.executable, "-m", "pip", "wheel", "-q", "--no-deps", "--no-build-isolation", "-w", dist,
         _sources(tmp / "src"), cwd=tmp, env=env)
    (wheel,) = dist.glob("pagedkv-*.whl")
    with zipfile.ZipFile(wheel) as z:
        missing = [d for d in DATA if d not in z.namelist()]
    assert not missing, f"the wheel lacks files read at run time: {missing}"
    base = getattr(sys, "_base_executable", sys.executable)  # the interpreter this venv was made from
    _run(base, "-m", "venv", tmp / "venv", cwd=tmp, env=env)
    py = tmp / "venv" / "bin" / "python"
    _run(py, "-m", "pip", "install", "-q", "torch==2.13.0", cwd=tmp, env=env)
    _run(py, "-m", "pip", "install", "-q", wheel, cwd=tmp, env=env)
    _run(py, "-m", "pip", "install", "-q", "--no-deps", "xgrammar==0.2.9", cwd=tmp, env=env)
    return py.parent


def test_wheel_holds_no_test_tools_and_imports(installed: Path) -> None:
    env = {k: v for k, v in os.environ.items() if k != "PYTHONPATH"}
    cwd = installed.parent.parent
    listed = _run(installed / "python", "-m", "pip", "list", "--format=freeze", cwd=cwd, env=env).lower()
    for tool in ("pytest", "hypothesis", "ruff", "langchain", "litellm", "ai-dynamo"):
        assert f"\n{tool}" not in f"\n{listed}", f"{tool} came with the runtime install"
    wheel = next((cwd / "dist").glob("pagedkv-*.whl"))
    code = ("import importlib, pagedkv, sys; assert 'site-packages' in pagedkv.__file__, pagedkv.__file__\n"
            f"for m in {_modules(wheel)!r}: importlib.import_module(m)\nprint('imported')")
    assert "imported" in _run(installed / "python", "-c", code, cwd=cwd, env=env)


def test_installed_serve_answers_generate(installed: Path, tmp_path: Path) -> None:
    env = {k: v for k, v in os.environ.items() if k != "PYTHONPATH"}
    env["PAGEDKV_CACHE_DIR"] = str(tmp_path / "cache")  # tiny-llama built by the installed code, here
    server = LocalServer("--model", "tiny-llama", "--threads", "1", command=(str(installed / "pagedkv"),),
                         cwd=tmp_path, env=env)
    try:
        out = subprocess.run([str(installed / "pagedkv"), "generate", "--address", server.address, "--max-tokens",
                              "8", "--temperature", "0", "Hello"], cwd=tmp_path, env=env, capture_output=True,
                             text=True, timeout=120)
        assert out.returncode == 0, out.stderr
        assert "finish=" in out.stderr and "completion_tokens=" in out.stderr, out.stderr
    finally:
        code = server.stop()
    assert code == 0, server.log()
