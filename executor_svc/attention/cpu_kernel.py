"""Builds and loads the CPU paged attention kernel (``paged_attention_cpu.cpp``) with torch's extension tooling.

The build (g++ on ATen headers only, ~15-30 s on two busy cores) happens once per source version, compiler
flags, torch version and CPU, and is cached under ``~/.cache/pagedkv/cpu_attention`` (``cache_dir()``);
later loads take ~0.1 s. The first CPU forward of the torch backend loads it (in the executor: the prefill
probe of start-up, executor_svc/costs.py). ``load()`` returns ``torch.ops.pagedkv_cpu``, or None with the
reason when the kernel is not available (no compiler, the source not installed, a failed build,
``PAGEDKV_CPU_ATTENTION=reference``): the torch backend then gathers pages, as its reference path does, and
logs ``cpu_attention_kernel_unavailable`` with the reason."""

from __future__ import annotations

import hashlib
import os
import platform
import shutil
import tempfile
import threading
import time
from pathlib import Path
from typing import Any

import structlog
import torch

from pagedkv import start_phases
from pagedkv.proc_tree import remove_stale

log = structlog.get_logger("executor_svc.attention")

SOURCE = Path(__file__).with_name("paged_attention_cpu.cpp")
# The other ops of the same library (torch.ops.pagedkv_cpu): the fused decoder-layer ops of float32 models.
# And the float32 linears (cpu_gemm.cpp), and a decode step's layers in one call (cpu_decode.cpp).
# And decodes read from 8-bit pages (paged_attention_q8_cpu.cpp), and the writes of 8-bit pages (kv_write_cpu.cpp).
SOURCES = (SOURCE, Path(__file__).with_name("paged_attention_q8_cpu.cpp"), Path(__file__).with_name("kv_write_cpu.cpp"),
           *(Path(__file__).parent.parent / "model" / name
             for name in ("cpu_ops.cpp", "cpu_gemm.cpp", "cpu_decode.cpp")))
# included by the sources (found through the include path): shared math, and the ops as C++ functions
HEADERS = (Path(__file__).with_name("cpu_math.h"), Path(__file__).with_name("cpu_ops.h"))
# NOTE: -fno-trapping-math -fno-math-errno (as torch itself is built): without them GCC vectorizes no loop with a
# clamp or floor in it (the exp of the softmax and of SiLU ran one lane at a time on AVX2). Results are unchanged.
CFLAGS = ["-O3", "-march=native", "-fopenmp", "-fno-trapping-math", "-fno-math-errno"]
PROGRESS_EVERY = 10.0  # seconds between the build's progress lines
_lock = threading.Lock()
_state: dict[str, object] = {}  # "module" and "reason", once tried


def cache_dir() -> Path:
    """``PAGEDKV_KERNEL_CACHE_DIR``, else ``$XDG_CACHE_HOME/pagedkv/cpu_attention`` (~/.cache). Not under
    PAGEDKV_CACHE_DIR, the model cache, which each test session points at a fresh directory: one build
    (keyed by source, flags, torch and CPU) serves every session."""
    if os.environ.get("PAGEDKV_KERNEL_CACHE_DIR"):
        return Path(os.environ["PAGEDKV_KERNEL_CACHE_DIR"])
    root = Path(os.environ.get("XDG_CACHE_HOME") or Path.home() / ".cache")
    return root / "pagedkv" / "cpu_attention"


def cpu_signature() -> str:
    """What -march=native depends on: the CPU's model and flags (a cache shared between machines)."""
    try:
        info = Path("/proc/cpuinfo").read_text()
        lines = [ln for ln in info.splitlines() if ln.startswith(("model name", "flags"))][:2]
        return "\n".join(lines)
    except OSError:
        return platform.processor()


def build_name() -> str:
    h = hashlib.sha256()
    for part in (*(s.read_bytes() for s in SOURCES + HEADERS), " ".join(CFLAGS).encode(), torch.__version__.encode(),
                 cpu_signature().encode()):
        h.update(part)
    return f"pagedkv_attention_cpu_{h.hexdigest()[:16]}"


def unavailable_reason() -> str | None:
    """Why the kernel cannot be built here (None: it can)."""
    if os.environ.get("PAGEDKV_CPU_ATTENTION", "").lower() == "reference":
        return "PAGEDKV_CPU_ATTENTION=reference"
    if not (os.environ.get("CXX") or shutil.which("c++") or shutil.which("g++")):
        return "no C++ compiler (g++)"
    for source in SOURCES + HEADERS:
        if not source.is_file():
            return f"kernel source {source} not installed"
    return None


def load() -> Any | None:
    """``torch.ops.pagedkv_cpu`` once the library is built (on first use, then cached) and loaded, or None;
    ``reason()`` then says why."""
    with _lock:
        if "reason" not in _state:
            _state["module"], _state["reason"] = _build()
            if _state["module"] is None:
                log.warning("cpu_attention_kernel_unavailable", reason=_state["reason"],
                            fallback="the torch backend gathers each decode's pages (index_select copy)")
        return _state["module"]  # type: ignore[return-value]


def reason() -> str | None:
    return _state.get("reason")  # type: ignore[return-value]


def _build() -> tuple[Any | None, str | None]:
    why = unavailable_reason()
    if why is not None:
        return None, why
    name = build_name()
    target = cache_dir() / f"{name}.so"
    start = time.perf_counter()
    built = not target.is_file()
    try:
        if built:
            with start_phases.phase("kernel_build", f"compiling the CPU kernels ({len(SOURCES)} files, once per "
                                    "torch version and CPU)", log, files=len(SOURCES), cache=str(target.parent)):
                _compile(name, target)
        else:
            with start_phases.phase("kernel_load", "loading the CPU kernels built earlier", log):
                torch.ops.load_library(str(target))
        module = torch.ops.pagedkv_cpu  # registered by the library's TORCH_LIBRARY block
    except Exception as exc:  # a failed build must not stop the executor: the gather path serves
        errors = [ln for ln in str(exc).splitlines() if "error" in ln.lower()] or [f"{type(exc).__name__}: {exc}"]
        return None, f"build of {target.name} failed: {errors[-1].strip()[:300]}"
    log.info("cpu_attention_kernel", path=str(target), built=built, seconds=round(time.perf_counter() - start, 2),
             note="decodes read KV pages in place")
    return module, None


def _compile(name: str, target: Path) -> None:
    """Builds (and loads) the library in a directory of this process's own, then renames it into the cache.
    NOTE: no shared build directory: torch's lock file there outlives a process killed mid-build, and every
    later build would wait on it for ever. Two processes building at once both compile; either rename wins
    (the same bytes)."""
    from torch.utils import cpp_extension

    target.parent.mkdir(parents=True, exist_ok=True)
    remove_stale(target.parent, "pagedkv_attention_cpu_")  # the build folders of processes SIGKILLed mid-build
    work = Path(tempfile.mkdtemp(prefix=f"{name}-{os.getpid()}-", dir=target.parent))
    done = threading.Event()
    threading.Thread(target=_progress, args=(work, done), daemon=True, name="kernel-build-progress").start()
    try:
        cpp_extension.load(name=name, sources=[str(s) for s in SOURCES], build_directory=str(work), extra_cflags=CFLAGS,
                           extra_include_paths=[str(SOURCE.parent)],
                           extra_ldflags=["-fopenmp"], is_python_module=False, verbose=False)
        os.replace(work / f"{name}.so", target)
    finally:
        done.set()
        shutil.rmtree(work, ignore_errors=True)


def _progress(work: Path, done: threading.Event) -> None:
    """While the build runs: a line every PROGRESS_EVERY seconds with the elapsed time and the files compiled."""
    expected, _ = start_phases.expected("kernel_build")
    start = time.perf_counter()
    while not done.wait(PROGRESS_EVERY):
        compiled = len(list(work.glob("*.o")))
        log.info("kernel_build_progress", elapsed_s=round(time.perf_counter() - start), expected_s=expected,
                 files_compiled=f"{compiled}/{len(SOURCES)}")
