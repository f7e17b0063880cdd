"""The executor keeps the memory a step frees (executor_svc/host_memory.py): once its heap has grown to a step's
peak, a step like the last one takes no new page. Measured by page faults (not time) in a child process, since the
setting is process-wide; under glibc's defaults the same pattern is trimmed off the heap and faults afresh each step."""

from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path

import pytest

pytestmark = pytest.mark.e2e

ROOT = Path(__file__).resolve().parents[2]

CHILD = """
import ctypes, json, resource, sys
sys.path.insert(0, {root!r})
from executor_svc.host_memory import keep_freed_memory
why = keep_freed_memory() if sys.argv[1] == "keep" else "default"
libc = ctypes.CDLL("libc.so.6")
libc.posix_memalign.argtypes = (ctypes.POINTER(ctypes.c_void_p), ctypes.c_size_t, ctypes.c_size_t)
libc.free.argtypes = (ctypes.c_void_p,)
faults = []
for _ in range(6):  # a "step": 16 activations of 4 MiB, allocated as torch's CPU allocator does, written, all freed
    before = resource.getrusage(resource.RUSAGE_SELF).ru_minflt
    blocks = []
    for _ in range(16):
        p = ctypes.c_void_p()
        assert libc.posix_memalign(ctypes.byref(p), 64, 4 << 20) == 0
        ctypes.memset(p, 1, 4 << 20)
        blocks.append(p)
    for p in blocks:
        libc.free(p)
    faults.append(resource.getrusage(resource.RUSAGE_SELF).ru_minflt - before)
print(json.dumps({{"why": why, "faults": faults}}))
"""


def _rounds(mode: str) -> dict:
    done = subprocess.run([sys.executable, "-c", CHILD.format(root=str(ROOT)), mode], capture_output=True, text=True,
                          timeout=120, env={"OMP_NUM_THREADS": "1", "PATH": "/usr/bin:/bin"})
    assert done.returncode == 0, done.stderr[-2000:]
    return json.loads(done.stdout.strip().splitlines()[-1])


@pytest.mark.skipif(not sys.platform.startswith("linux"), reason="glibc's malloc only")
def test_a_repeated_step_takes_no_new_pages():
    kept = _rounds("keep")
    if kept["why"] is not None:
        pytest.skip(f"not applied here: {kept['why']}")
    step_pages = 16 * (4 << 20) // 4096
    assert kept["faults"][0] >= step_pages // 2  # the first step does take its pages
    assert max(kept["faults"][3:]) < step_pages // 50, kept["faults"]  # then the heap holds them
    default = _rounds("default")  # what the setting is for: glibc hands them back after every step
    assert min(default["faults"][3:]) > step_pages // 2, default["faults"]
