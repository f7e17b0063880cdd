"""Every LoRA adapter an executor holds (#52): in host memory, each as its slot region ready to copy in
(``LoraStack.region``; pinned on a GPU), and which of them the device slots hold now.

The start-up adapters (--lora-modules) are held for the executor's life; with --lora-root, ``add`` holds more at
run time (the LoadAdapter RPC) and ``remove`` drops them (UnloadAdapter). Which adapter is in which device slot is
the scheduler's choice: a plan's ``adapter_loads`` (plan_check.py checks them with the rest of the plan; the runner
then calls ``page_in`` before the forward). A run-time path must lie inside --lora-root (symlinks resolved first),
and the adapter's files are bounded before they are read.

``add`` and ``remove`` run on the RPC threads while the step loop reads ``held`` and pages in: the lock covers the
table; a region is never changed once held.
"""

from __future__ import annotations

import threading
from dataclasses import dataclass
from pathlib import Path

import torch

from executor_svc.lora.adapter import CONFIG_FILE, WEIGHTS_FILE, LoraAdapter, load_adapter, module_shapes
from executor_svc.lora.names import MAX_NAME_CHARS, NAME_RULE
from executor_svc.lora.stack import LoraStack
from executor_svc.model_config import ModelConfig
from pagedkv.executor.v1 import executor_pb2 as pb

MAX_CONFIG_BYTES = 64 << 10
MAX_PATH_CHARS = 4096


class AdapterError(ValueError):
    """A LoadAdapter / UnloadAdapter refused; ``code``: the gRPC status name."""

    def __init__(self, code: str, message: str) -> None:
        super().__init__(message)
        self.code = code


@dataclass(frozen=True, slots=True, eq=False)
class Held:
    name: str
    rank: int
    scale: float
    num_bytes: int  # its A/B weights in the model dtype
    runtime: bool
    region: torch.Tensor  # its slot region in host memory


class AdapterStore:
    def __init__(self, stack: LoraStack, cfg: ModelConfig, max_rank: int, root: Path | None,
                 pin: bool = False) -> None:
        self.stack, self.cfg, self.max_rank, self.pin = stack, cfg, max_rank, pin
        self.root = root.resolve() if root is not None else None
        self._held: dict[str, Held] = {}
        self._lock = threading.Lock()

    def hold(self, adapter: LoraAdapter, runtime: bool) -> Held:
        """``adapter`` (read and checked) held in host memory; refused when it does not fit a slot."""
        if why := self.stack.shape.refusal(adapter):
            raise AdapterError("INVALID_ARGUMENT", f"adapter {adapter.name!r}: {why}")
        held = Held(adapter.name, adapter.rank, adapter.scale, adapter.num_bytes(self.stack.dtype), runtime,
                    self.stack.region(adapter, self.pin))
        with self._lock:
            if adapter.name in self._held:
                raise AdapterError("ALREADY_EXISTS", f"adapter {adapter.name!r} is already loaded")
            self._held[adapter.name] = held
        return held

    def add(self, name: str, path: str) -> pb.Adapter:
        """LoadAdapter: the PEFT directory ``path`` (inside --lora-root) read, checked and held as ``name``."""
        if self.root is None:
            raise AdapterError("FAILED_PRECONDITION", "this executor loads no adapters at run time: start it with "
                               "--lora-root DIR (run-time adapters are read from under DIR)")
        if not NAME_RULE.fullmatch(name):
            raise AdapterError("INVALID_ARGUMENT", f"name: {name[:MAX_NAME_CHARS]!r} must be 1 to {MAX_NAME_CHARS} "
                               "characters of A-Z a-z 0-9 . _ -")
        with self._lock:
            if name in self._held:
                raise AdapterError("ALREADY_EXISTS", f"adapter {name!r} is already loaded")
        where = self._inside_root(path)
        self._check_sizes(name, where)
        try:
            adapter = load_adapter(name, where, self.cfg, self.max_rank)
        except ValueError as err:
            raise AdapterError("INVALID_ARGUMENT", str(err).replace(str(self.root), "--lora-root")) from None
        return self._describe(self.hold(adapter, runtime=True), -1)

    def _inside_root(self, path: str) -> Path:
        if not path or len(path) > MAX_PATH_CHARS or "\0" in path:
            raise AdapterError("INVALID_ARGUMENT", f"path: must be 1 to {MAX_PATH_CHARS} characters (a directory "
                               "under the executor's --lora-root)")
        where = (self.root / path).resolve()
        if not where.is_relative_to(self.root):
            raise AdapterError("PERMISSION_DENIED", f"path: {path[:200]!r} is outside the executor's --lora-root "
                               "(after symlinks are resolved)")
        if not where.is_dir():
            raise AdapterError("INVALID_ARGUMENT", f"path: {path[:200]!r} is not a directory under --lora-root")
        return where

    def _check_sizes(self, name: str, where: Path) -> None:
        """The files' sizes bounded before anything is read: the config by MAX_CONFIG_BYTES, the weights by what
        an adapter of --max-lora-rank on every module takes in float32 (plus 1 MiB of header)."""
        shapes = module_shapes(self.cfg)
        most = self.max_rank * 4 * self.cfg.num_layers * sum(i + o for i, o in shapes.values()) + (1 << 20)
        for file, limit in ((CONFIG_FILE, MAX_CONFIG_BYTES), (WEIGHTS_FILE, most)):
            f = where / file
            if f.is_file() and f.stat().st_size > limit:
                raise AdapterError("INVALID_ARGUMENT", f"adapter {name!r}: {file} is {f.stat().st_size} bytes, more "
                                   f"than the {limit} an adapter of rank {self.max_rank} can take")

    def remove(self, name: str) -> None:
        """UnloadAdapter: a run-time adapter dropped, from its slot too (the scheduler sends it only with no request
        of it left here)."""
        with self._lock:
            held = self._held.get(name)
            if held is None:
                raise AdapterError("NOT_FOUND", f"adapter {name[:MAX_NAME_CHARS]!r} is not loaded")
            if not held.runtime:
                raise AdapterError("FAILED_PRECONDITION", f"adapter {name!r} was loaded at start-up "
                                   "(--lora-modules) and stays")
            del self._held[name]
        for k, n in enumerate(self.stack.names):
            if n == name:
                self.stack.clear(k)

    def held(self, name: str) -> bool:
        with self._lock:
            return name in self._held

    def page_in(self, name: str, slot: int) -> None:
        """Adapter ``name``'s weights into device slot ``slot`` (nothing to do when they are there)."""
        if self.stack.names[slot] == name:
            return
        with self._lock:
            held = self._held[name]
        self.stack.put(slot, name, held.scale, held.region)

    def _describe(self, h: Held, slot: int) -> pb.Adapter:
        return pb.Adapter(name=h.name, rank=h.rank, num_bytes=h.num_bytes, num_pages=self.slot_pages, slot=slot,
                          runtime=h.runtime)

    @property
    def slot_pages(self) -> int:
        return self.stack.pages[0] if self.stack.pages else 0

    def describe(self) -> list[pb.Adapter]:
        """Every adapter held, in the order they were loaded, with the slot each is in (-1: host memory only)."""
        where = {n: k for k, n in enumerate(self.stack.names) if n is not None}
        with self._lock:
            return [self._describe(h, where.get(h.name, -1)) for h in self._held.values()]
