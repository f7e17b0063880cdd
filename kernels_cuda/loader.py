"""Compiles ``kernels_cuda/*.cu`` with NVRTC through CuPy and launches them on torch's current stream.

* One ``cupy.RawModule`` per kernel instantiation (a name expression of ``specs.name_expressions``),
  compiled on first use. CuPy keeps the compiled binaries on disk, keyed by source text, options and name
  expression: a second run (or process) loads them instead of compiling. The cache lives in
  ``$CUPY_CACHE_DIR``; when that is unset we point it at ``<pagedkv cache dir>/cupy-kernels``
  (``$PAGEDKV_CACHE_DIR``, default ``~/.cache/pagedkv``) before CuPy is imported. Local ``#include "..."``
  lines are expanded first (``specs.source_text``), so the cache key covers the headers too.
* Zero copy: kernels get torch tensors' device pointers (``tensor.data_ptr()``); nothing is converted.
* Launches go on ``torch.cuda.current_stream()`` (wrapped as ``cupy.cuda.ExternalStream``), so they are
  ordered with the torch work around them.
* ``PAGEDKV_CUDA_DEBUG=1``: every launch is followed by a synchronisation and an error check that names the
  kernel (slow; for finding a faulting kernel).

Importing this module does not import CuPy; ``cupy_import_error()`` says whether it can be.
"""

from __future__ import annotations

import os
import threading
import warnings
from collections.abc import Callable, Sequence
from pathlib import Path

import numpy as np
import torch

from kernels_cuda import specs

DEBUG_ENV = "PAGEDKV_CUDA_DEBUG"


def debug_enabled() -> bool:
    return os.environ.get(DEBUG_ENV, "") not in ("", "0")


def default_cache_dir() -> Path:
    from pagedkv.models import cache_dir

    return cache_dir() / "cupy-kernels"


def cupy_import_error() -> str | None:
    """None when CuPy imports; otherwise why not (for start-up errors)."""
    try:
        _import_cupy()
    except Exception as err:  # noqa: BLE001 - any failure means "not usable", and the message says why
        return f"{type(err).__name__}: {err}"
    return None


def _import_cupy():
    os.environ.setdefault("CUPY_CACHE_DIR", str(default_cache_dir()))
    import cupy

    return cupy


class Pointer:
    """A device pointer argument (0 for a null pointer)."""

    __slots__ = ("value",)

    def __init__(self, tensor: torch.Tensor | None) -> None:
        self.value = 0 if tensor is None else tensor.data_ptr()


def kernel_args(args: Sequence[object]) -> tuple[object, ...]:
    """Python values to the exact C types of the kernel parameters: Pointer -> 8-byte pointer,
    np.int32 / np.int64 / np.float32 pass through; bare Python ints and floats are refused (their width
    would be a guess)."""
    out: list[object] = []
    for i, a in enumerate(args):
        if isinstance(a, Pointer):
            out.append(np.uint64(a.value))
        elif isinstance(a, torch.Tensor):
            out.append(np.uint64(a.data_ptr()))
        elif isinstance(a, (np.int32, np.int64, np.float32, np.uint64)):
            out.append(a)
        else:
            raise TypeError(f"kernel argument {i}: {type(a).__name__} has no fixed C type; "
                            "use Pointer, a tensor, np.int32, np.int64 or np.float32")
    return tuple(out)


class KernelLibrary:
    """The compiled kernels of one CUDA device."""

    def __init__(self, device: torch.device) -> None:
        self.cupy = _import_cupy()
        self.device = device
        self.index = device.index if device.index is not None else torch.cuda.current_device()
        self.modules: dict[str, object] = {}
        self.functions: dict[str, object] = {}
        self.streams: dict[int, object] = {}
        self.debug = debug_enabled()

    def function(self, source: str, name: str):
        """The kernel ``name`` of ``source``, compiled on first use. Each instantiation is a module of its
        own: a process compiles (or loads from the cache) only the kernels it launches."""
        fn = self.functions.get(name)
        if fn is None:
            if name not in specs.name_expressions(source):
                raise KeyError(f"kernel {name} is not instantiated for {source} (see kernels_cuda/specs.py)")
            with self.cupy.cuda.Device(self.index):
                module = self.cupy.RawModule(code=specs.source_text(source), options=specs.OPTIONS,
                                             name_expressions=[name])
                fn = module.get_function(name)
            self.modules[name] = module
            self.functions[name] = fn
        return fn

    def _stream(self):
        handle = torch.cuda.current_stream(self.device).cuda_stream
        stream = self.streams.get(handle)
        if stream is None:
            with warnings.catch_warnings():  # deprecated in CuPy 14 in favour of Stream.from_external; same object
                warnings.simplefilter("ignore", DeprecationWarning)
                stream = self.cupy.cuda.ExternalStream(handle, self.index)
            self.streams[handle] = stream
        return stream

    def launch(self, source: str, name: str, grid: tuple[int, int, int], block: tuple[int, int, int],
               args: Sequence[object]) -> None:
        self.prepare(source, name, grid, block, args)()

    def prepare(self, source: str, name: str, grid: tuple[int, int, int], block: tuple[int, int, int],
                args: Sequence[object]) -> Callable[[], None]:
        """A launch with its arguments converted once; each call enqueues it on torch's current stream then.
        The caller keeps the argument tensors alive while it may call it."""
        if min(grid) < 1:
            return lambda: None  # nothing to do (an empty batch)
        fn = self.function(source, name)
        c_args = kernel_args(args)

        def run() -> None:
            stream = self._stream()
            with self.cupy.cuda.Device(self.index), stream:
                try:
                    fn(grid, block, c_args)
                    if self.debug:  # a bad launch raises in fn(); a fault while the kernel runs, here
                        stream.synchronize()
                except Exception as err:
                    raise RuntimeError(f"CUDA kernel {name} (grid {grid}, block {block}) failed: {err}") from err

        return run


_libraries: dict[int, KernelLibrary] = {}
_lock = threading.Lock()


def library(device: torch.device) -> KernelLibrary:
    index = device.index if device.index is not None else torch.cuda.current_device()
    with _lock:
        lib = _libraries.get(index)
        if lib is None:
            lib = _libraries[index] = KernelLibrary(torch.device("cuda", index))
        return lib
