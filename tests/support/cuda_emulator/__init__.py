"""Runs the CUDA kernels' own source on the CPU, for tests on machines without a GPU.

``kernels_cuda/*.cu`` are compiled by g++ together with ``shim.h`` (CUDA built-ins in C++; the few PTX helpers
of common.cuh switch to C++ under ``PKV_HOST_EMULATION``) and ``emulator.cpp`` (each CTA's threads as fibers,
``__syncthreads`` and warp shuffles as cooperative barriers). ``EmulatedLibrary`` has the loader's
``launch``/``prepare`` interface, so ``CudaPagedAttention(..., library=EmulatedLibrary())`` runs the real
backend code and the real kernels on CPU tensors. What it cannot check: anything about the GPU itself (timing,
occupancy, memory ordering between CTAs, the PTX conversions and ``ex2.approx``).
"""

from __future__ import annotations

import ctypes
import hashlib
import os
import shutil
import subprocess
import tempfile
from collections.abc import Callable, Sequence
from pathlib import Path

import numpy as np

from kernels_cuda import specs
from kernels_cuda.loader import kernel_args

HERE = Path(__file__).resolve().parent
CXX = os.environ.get("CXX") or shutil.which("g++") or shutil.which("c++")
FLAGS = ("-std=c++17", "-O1", "-shared", "-fPIC", "-fno-strict-aliasing", "-w")


def unavailable_reason() -> str | None:
    if CXX is None:
        return "no C++ compiler (g++) to build the CUDA emulator"
    return None


def _unit() -> str:
    names = [n for s in specs.SOURCES for n in specs.name_expressions(s)]
    lines = ['#include "shim.h"', '#include "emulator.cpp"', *(f'#include "{s}"' for s in specs.SOURCES),
             "#include <cstring>",
             'extern "C" int pkv_emu_launch(const char* name, unsigned gx, unsigned gy, unsigned gz, unsigned bx,',
             "                              unsigned by, unsigned bz, void** params) {",
             "    const dim3 grid{gx, gy, gz}, block{bx, by, bz};"]
    for name in names:
        call = f"emu::launch(&{name}, grid, block, params)"
        lines.append(f'    if (!std::strcmp(name, "{name}")) {{ {call}; return 0; }}')
    lines += ["    return -1;", "}"]
    return "\n".join(lines) + "\n"


def build() -> Path:
    """The emulator library, built once per source version (cached under the temp directory)."""
    unit = _unit()
    digest = hashlib.sha256("\0".join([unit, *FLAGS, (HERE / "shim.h").read_text(),
                                       (HERE / "emulator.cpp").read_text(),
                                       *(specs.source_text(s) for s in specs.SOURCES)]).encode()).hexdigest()[:16]
    cache = Path(tempfile.gettempdir()) / "pagedkv-cuda-emulator"
    target = cache / f"emu-{digest}.so"
    if target.exists():
        return target
    cache.mkdir(parents=True, exist_ok=True)
    work = Path(tempfile.mkdtemp(dir=cache))
    try:
        (work / "unit.cpp").write_text(unit)
        cmd = [CXX, *FLAGS, f"-I{HERE}", f"-I{specs.KERNEL_DIR}", "-o", str(work / "emu.so"), str(work / "unit.cpp")]
        proc = subprocess.run(cmd, capture_output=True, text=True, timeout=600)
        if proc.returncode:
            raise RuntimeError(f"building the CUDA emulator failed:\n$ {' '.join(cmd)}\n{proc.stderr}")
        os.replace(work / "emu.so", target)
    finally:
        shutil.rmtree(work, ignore_errors=True)
    return target


class EmulatedLibrary:
    """``kernels_cuda.loader.KernelLibrary``'s interface over the emulator; tensors must be on the CPU."""

    emulated = True

    def __init__(self) -> None:
        self.lib = ctypes.CDLL(str(build()))
        self.lib.pkv_emu_launch.restype = ctypes.c_int
        self.lib.pkv_emu_launch.argtypes = [ctypes.c_char_p, *([ctypes.c_uint] * 6), ctypes.c_void_p]

    def prepare(self, source: str, name: str, grid: tuple[int, int, int], block: tuple[int, int, int],
                args: Sequence[object]) -> Callable[[], None]:
        if name not in specs.name_expressions(source):
            raise KeyError(f"kernel {name} is not instantiated for {source}")
        values = [np.array([a], dtype=a.dtype) for a in kernel_args(args)]
        params = (ctypes.c_void_p * len(values))(*[v.ctypes.data for v in values])

        def run() -> None:
            if min(grid) < 1:
                return
            rc = self.lib.pkv_emu_launch(name.encode(), *grid, *block, ctypes.cast(params, ctypes.c_void_p))
            if rc:
                raise KeyError(f"the emulator has no kernel {name}")

        run.keep = (values, params)  # type: ignore[attr-defined]
        return run

    def launch(self, source: str, name: str, grid: tuple[int, int, int], block: tuple[int, int, int],
               args: Sequence[object]) -> None:
        self.prepare(source, name, grid, block, args)()
