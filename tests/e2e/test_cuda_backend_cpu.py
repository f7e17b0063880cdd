"""The CUDA backend's CPU-side checks that need a fresh interpreter (a child process): the executor refuses
--attention-backend cuda without CUDA, and importing the backends does not import CuPy. (The rest:
tests/unit/test_cuda_backend_cpu.py.)"""

from __future__ import annotations

import subprocess
import sys

import pytest

from pagedkv.local_server import ROOT

pytestmark = pytest.mark.e2e


def test_importing_the_backends_does_not_import_cupy():
    code = ("import sys, executor_svc.server, executor_svc.attention.cuda_backend, kernels_cuda.loader; "
            "assert 'cupy' not in sys.modules, 'cupy imported'")
    subprocess.run([sys.executable, "-c", code], check=True, cwd=ROOT)


def test_executor_refuses_cuda_backend_without_cuda(model_cache):
    proc = subprocess.run([sys.executable, "-m", "pagedkv", "executor", "--device", "cpu", "--attention-backend",
                           "cuda", "--port", "0", "--num-pages", "8"], capture_output=True, text=True, cwd=ROOT,
                          timeout=300)
    assert proc.returncode == 1
    assert "error: --attention-backend cuda: it needs a CUDA device" in proc.stderr
