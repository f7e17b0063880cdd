"""The ``--lora-modules NAME=PATH`` values: what an adapter name may be (the name a request asks for on the wire,
``NewRequest.adapter``), checked when the flag is parsed. No torch here: executor_svc/args.py imports it."""

from __future__ import annotations

import argparse
import re
from pathlib import Path
from typing import NamedTuple

MAX_NAME_CHARS = 128
NAME_RULE = re.compile(rf"[A-Za-z0-9._-]{{1,{MAX_NAME_CHARS}}}")
DEFAULT_MAX_RANK = 64


class LoraModule(NamedTuple):
    """One --lora-modules value; ``str()`` gives NAME=PATH back (pagedkv serve passes it on to its executor so)."""

    name: str
    path: Path

    def __str__(self) -> str:
        return f"{self.name}={self.path}"


def lora_module_arg(value: str) -> LoraModule:
    """One ``NAME=PATH`` of --lora-modules (argparse's ``type``)."""
    name, sep, path = value.partition("=")
    if not sep or not path:
        raise argparse.ArgumentTypeError(f"{value!r}: expected NAME=PATH (a PEFT adapter directory)")
    if not NAME_RULE.fullmatch(name):
        raise argparse.ArgumentTypeError(f"adapter name {name[:MAX_NAME_CHARS]!r}: must be 1 to {MAX_NAME_CHARS} "
                                         "characters of A-Z a-z 0-9 . _ -")
    return LoraModule(name, Path(path))


def check_unique(modules: list[tuple[str, Path]]) -> None:
    """Each adapter name once (argparse sees one value at a time: start-up checks the list)."""
    seen: set[str] = set()
    for name, _ in modules:
        if name in seen:
            raise ValueError(f"--lora-modules: adapter name {name!r} is given twice (names must be unique)")
        seen.add(name)
