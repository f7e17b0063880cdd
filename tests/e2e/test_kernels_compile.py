"""CI without a GPU: every kernel source compiles with nvcc for sm_90, with exactly the template instantiations
the NVRTC loader asks for (kernels_cuda/specs.py), and the decode and LoRA kernels do not spill to local memory.

The ptxas report (-Xptxas -v) of each source is saved under a temporary directory (or
$PAGEDKV_PTXAS_REPORT_DIR) and printed when a check fails. Skipped only when nvcc is not installed.
Also: NVRTC itself (through CuPy, without a GPU) builds each source with its name expressions, where CuPy and
the NVRTC library are installed.
"""

from __future__ import annotations

import os
import platform
import re
import shutil
import subprocess
import sysconfig
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass, field
from pathlib import Path

import pytest

from kernels_cuda import specs

pytestmark = pytest.mark.e2e  # builds every CUDA kernel with nvcc (about 15 s here, uncached): over the unit budget

NVCC = shutil.which("nvcc")
ARCH = "sm_90"


@dataclass(slots=True)
class KernelReport:
    registers: int = -1
    stack_bytes: int = -1
    spill_stores: int = -1
    spill_loads: int = -1
    smem_bytes: int = 0


@dataclass(slots=True)
class Build:
    source: str
    returncode: int
    log: str
    report_path: Path
    kernels: dict[str, KernelReport] = field(default_factory=dict)


_FUNC = re.compile(r"Function properties for (\S+)")
_SPILL = re.compile(r"(\d+) bytes stack frame, (\d+) bytes spill stores, (\d+) bytes spill loads")
_USED = re.compile(r"Used (\d+) registers(?:.*?(\d+) bytes smem)?")


def parse_ptxas(log: str) -> dict[str, KernelReport]:
    """Mangled kernel name -> its registers, stack frame, spills and shared memory."""
    kernels: dict[str, KernelReport] = {}
    current: KernelReport | None = None
    for line in log.splitlines():
        if m := _FUNC.search(line):
            current = kernels.setdefault(m.group(1), KernelReport())
        elif current is not None and (m := _SPILL.search(line)):
            current.stack_bytes, current.spill_stores, current.spill_loads = map(int, m.groups())
        elif current is not None and (m := _USED.search(line)):
            current.registers = int(m.group(1))
            current.smem_bytes = int(m.group(2) or 0)
    return kernels


def compile_source(source: str, out_dir: Path) -> Build:
    unit = out_dir / f"{source}.instantiations.cu"
    unit.write_text(specs.nvcc_unit(source))
    cubin = out_dir / f"{source}.cubin"
    cmd = [NVCC, *specs.NVCC_OPTIONS, f"-arch={ARCH}", "-cubin", "-Xptxas", "-v", "-o", str(cubin), str(unit)]
    proc = subprocess.run(cmd, capture_output=True, text=True, timeout=300)
    log = f"$ {' '.join(cmd)}\n{proc.stdout}{proc.stderr}"
    report = out_dir / f"{source}.ptxas.txt"
    report.write_text(log)
    return Build(source, proc.returncode, log, report, parse_ptxas(log))


@pytest.fixture(scope="module")
def builds(tmp_path_factory: pytest.TempPathFactory) -> dict[str, Build]:
    if NVCC is None:
        pytest.skip("nvcc is not installed")
    env_dir = os.environ.get("PAGEDKV_PTXAS_REPORT_DIR")
    out_dir = Path(env_dir) if env_dir else tmp_path_factory.mktemp("nvcc")
    out_dir.mkdir(parents=True, exist_ok=True)
    with ThreadPoolExecutor(max_workers=len(specs.SOURCES)) as pool:
        done = list(pool.map(lambda s: compile_source(s, out_dir), specs.SOURCES))
    return {b.source: b for b in done}


@pytest.mark.parametrize("source", specs.SOURCES)
def test_source_compiles_for_sm90(builds: dict[str, Build], source: str) -> None:
    build = builds[source]
    assert build.returncode == 0, f"nvcc failed for {source} (report {build.report_path}):\n{build.log}"


@pytest.mark.parametrize("source", specs.SOURCES)
def test_every_name_expression_is_a_compiled_kernel(builds: dict[str, Build], source: str) -> None:
    """As many entry points as name expressions: nothing the loader asks for is missing from the nvcc build."""
    build = builds[source]
    assert build.returncode == 0, build.log
    assert len(build.kernels) == len(specs.name_expressions(source)), (
        f"{len(build.kernels)} kernels compiled, {len(specs.name_expressions(source))} name expressions:\n"
        + "\n".join(build.kernels))


def test_decode_kernels_do_not_spill(builds: dict[str, Build]) -> None:
    build = builds["decode.cu"]
    assert build.returncode == 0, build.log
    decode = {name: r for name, r in build.kernels.items() if "paged_decode" in name}
    assert len(decode) == len(specs.name_expressions("decode.cu"))
    spilling = {name: r for name, r in decode.items() if r.spill_stores or r.spill_loads or r.stack_bytes}
    summary = "\n".join(f"{r.registers:4d} regs {r.smem_bytes:6d} B smem {r.stack_bytes} B stack "
                        f"{r.spill_stores}/{r.spill_loads} B spill st/ld  {name}" for name, r in decode.items())
    print(f"ptxas ({ARCH}), report {build.report_path}:\n{summary}")
    assert not spilling, f"decode kernels use local memory (report {build.report_path}):\n{summary}\n\n{build.log}"


def test_lora_kernels_do_not_spill(builds: dict[str, Build]) -> None:
    """lora_shrink / lora_expand (kernels_cuda/lora_sgmv.cu): one fp32 accumulator per tile row in registers."""
    build = builds["lora_sgmv.cu"]
    assert build.returncode == 0, build.log
    assert len(build.kernels) == len(specs.name_expressions("lora_sgmv.cu"))
    summary = "\n".join(f"{r.registers:4d} regs {r.smem_bytes:6d} B smem {r.stack_bytes} B stack "
                        f"{r.spill_stores}/{r.spill_loads} B spill st/ld  {name}" for name, r in build.kernels.items())
    print(f"ptxas ({ARCH}), report {build.report_path}:\n{summary}")
    assert all(r.registers > 0 for r in build.kernels.values()), f"no register report read:\n{build.log}"
    assert not any(r.spill_stores or r.spill_loads or r.stack_bytes for r in build.kernels.values()), (
        f"lora kernels use local memory (report {build.report_path}):\n{summary}\n\n{build.log}")


def test_ptxas_parser_reads_spills() -> None:
    log = ("ptxas info    : Function properties for _Zfoo\n"
           "    16 bytes stack frame, 8 bytes spill stores, 4 bytes spill loads\n"
           "ptxas info    : Used 255 registers, used 1 barriers, 1024 bytes smem\n")
    r = parse_ptxas(log)["_Zfoo"]
    assert (r.registers, r.stack_bytes, r.spill_stores, r.spill_loads, r.smem_bytes) == (255, 16, 8, 4, 1024)


def _nvrtc_error() -> str | None:
    try:
        from cupy.cuda import compiler, nvrtc  # noqa: F401

        nvrtc.getVersion()
    except Exception as err:  # noqa: BLE001 - any failure: NVRTC is not usable here
        return f"{type(err).__name__}: {err}"
    return None


@pytest.mark.parametrize("source", specs.SOURCES)
def test_nvrtc_builds_source_with_name_expressions(source: str) -> None:
    """The loader's path up to the device: CuPy's NVRTC front end compiles the expanded source text and lowers
    every name expression. (Without a device CuPy cannot pick the architecture itself, so this asks for
    LTO-IR for compute_90; on a GPU the loader builds a cubin for the device.)"""
    err = _nvrtc_error()
    if err is not None:
        pytest.skip(f"CuPy/NVRTC not usable here ({err})")
    from cupy.cuda import compiler

    names = specs.name_expressions(source)
    _, mapping = compiler.compile_using_nvrtc(specs.source_text(source), (*specs.OPTIONS, "-dlto"), arch="90",
                                              name_expressions=names, cache_in_memory=True, method="lto")
    assert sorted(mapping) == sorted(names)
    assert all(m.startswith("_ZN3pkv") for m in mapping.values())


# ---- the CPU kernel library (executor_svc/attention/cpu_kernel.py) for every x86-64 level ---------------------
@pytest.mark.parametrize("march", ["x86-64", "x86-64-v3", "x86-64-v4"])
def test_the_cpu_kernels_compile_on_every_x86_64_level(march):
    """The executor builds its CPU kernels with -march=native: a machine without AVX2 (x86-64), with AVX2
    (v3) and with AVX-512 (v4) each compile other branches of the same sources (a branch that does not build
    would leave such a machine on the slower torch path, unnoticed). -fsyntax-only: checked, not built."""
    from torch.utils import cpp_extension

    from executor_svc.attention import cpu_kernel

    cxx = shutil.which("g++") or shutil.which("c++")
    if cxx is None or platform.machine() not in ("x86_64", "AMD64"):
        pytest.skip("no C++ compiler, or not an x86-64 machine")
    includes = [f"-I{p}" for p in (*cpp_extension.include_paths(), sysconfig.get_paths()["include"],
                                    *{h.parent for h in cpu_kernel.HEADERS})]
    flags = [f for f in cpu_kernel.CFLAGS if f != "-march=native"]
    for source in cpu_kernel.SOURCES:
        done = subprocess.run([cxx, "-std=c++17", "-fsyntax-only", f"-march={march}", *flags, *includes, str(source)],
                              capture_output=True, text=True, timeout=600)
        assert done.returncode == 0, f"{source.name} for -march={march}:\n{done.stderr[-4000:]}"
