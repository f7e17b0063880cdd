"""A grammar compile worker: a child process of the executor that compiles constraints and can be killed.

``python -m executor_svc.grammar_worker``, driven over its stdin/stdout by ``grammar_compile.CompilePool``. Frames are
a 4-byte big-endian length and that many bytes. The first frame in is the set-up (JSON: the vocabulary as xgrammar's
serialized TokenizerInfo, the memory limit); the worker answers ``{"ready": true}``. Then each frame in is one compile
(JSON: the constraint's kind, text, strict and the CPU limit in seconds), answered by one JSON frame: the error, or
none, the CPU the compile used and the compiled grammar's size.

NOTE: the compiled grammar does not come back. xgrammar's JSON of a compiled grammar grows much faster than the
grammar (a 100-property schema with patterns: 1.5 MB compiled in 32 ms, 60 MB of JSON in 2.2 s; 800 properties did
not serialize in 2 minutes): compiling it again in the executor costs less. What the worker proves is that the
constraint compiles within the limits; only then does the executor compile it (grammar.py).

Limits the kernel enforces, so that no constraint can outlast them whatever xgrammar does inside one C++ call:

- CPU: the pool kills the worker once a compile has used its limit (grammar_compile._watch); as a backstop, before
  each compile RLIMIT_CPU's soft limit is set a second past the CPU used so far plus the compile's limit, where the
  kernel ends the process (SIGXCPU);
- memory: RLIMIT_AS is the address space after start-up plus ``memory_mb``; a compile past it fails (MemoryError, or
  the process dies), and the pool reports it as too large;
- no core files (RLIMIT_CORE 0).
"""

from __future__ import annotations

import json
import math
import os
import resource
import signal
import struct
import sys
import time

HEADER = struct.Struct(">I")
MAX_FRAME = 1 << 30


def read_frame(stream) -> bytes | None:
    """One frame from ``stream`` (a binary file), or None at its end."""
    head = stream.read(HEADER.size)
    if len(head) < HEADER.size:
        return None
    (size,) = HEADER.unpack(head)
    if size > MAX_FRAME:
        raise ValueError(f"frame of {size} bytes")
    body = stream.read(size)
    return body if len(body) == size else None


def write_frame(stream, body: bytes) -> None:
    stream.write(HEADER.pack(len(body)) + body)
    stream.flush()


def _cpu_seconds() -> float:
    usage = resource.getrusage(resource.RUSAGE_SELF)
    return usage.ru_utime + usage.ru_stime


def _address_space() -> int:
    with open("/proc/self/statm", encoding="ascii") as f:
        return int(f.read().split()[0]) * os.sysconf("SC_PAGE_SIZE")


def _limit_memory(memory_mb: int) -> None:
    if memory_mb > 0:
        limit = _address_space() + (memory_mb << 20)
        _, hard = resource.getrlimit(resource.RLIMIT_AS)
        resource.setrlimit(resource.RLIMIT_AS, (limit if hard == resource.RLIM_INFINITY else min(limit, hard), hard))


def _limit_cpu(seconds: float) -> None:
    _, hard = resource.getrlimit(resource.RLIMIT_CPU)
    soft = math.ceil(_cpu_seconds() + seconds) + 1  # (a backstop: the pool stops a compile at its limit first)
    resource.setrlimit(resource.RLIMIT_CPU, (soft if hard == resource.RLIM_INFINITY else min(soft, hard), hard))


def serve(stdin, stdout) -> None:
    """The worker's loop over its pipes (returns at the end of its input)."""
    import xgrammar

    from executor_svc.grammar import ConstraintError, build_grammar

    setup = json.loads(read_frame(stdin))
    info = xgrammar.TokenizerInfo.deserialize_json(setup["tokenizer_info"])
    compiler = xgrammar.GrammarCompiler(info, max_threads=1, cache_enabled=False)
    resource.setrlimit(resource.RLIMIT_CORE, (0, 0))
    _limit_memory(int(setup.get("memory_mb", 0)))
    write_frame(stdout, json.dumps({"ready": True}).encode())
    while (frame := read_frame(stdin)) is not None:
        ask = json.loads(frame)
        _limit_cpu(float(ask["timeout_s"]))
        started, wall = _cpu_seconds(), time.perf_counter()
        compiled, error, size = None, "", 0
        try:
            compiled = compiler.compile_grammar(build_grammar(ask["kind"], ask["text"], bool(ask["strict"])))
            size = compiled.memory_size_bytes
        except ConstraintError as err:
            error = str(err)
        except MemoryError:
            error = "memory"
        except Exception as err:  # noqa: BLE001 -- xgrammar's own errors (a std::bad_alloc among them)
            error = "memory" if "bad_alloc" in str(err) else f"{type(err).__name__}: {err}"
        header = {"error": error, "cpu_s": _cpu_seconds() - started, "wall_s": time.perf_counter() - wall,
                  "bytes": size}
        write_frame(stdout, json.dumps(header).encode())
        del compiled


def main() -> None:
    from executor_svc.grammar import COMPILE_NICE

    signal.signal(signal.SIGINT, signal.SIG_IGN)  # (a Ctrl-C reaches the whole group: the executor ends this one)
    os.nice(COMPILE_NICE)  # (compiles yield the cores to the executor's steps: bounded in CPU, not wall time)
    frames = os.fdopen(os.dup(1), "wb")  # (the frames go out on a copy of stdout: whatever a library prints to
    os.dup2(2, 1)                        # stdout goes to stderr instead, and cannot break a frame)
    serve(sys.stdin.buffer, frames)


if __name__ == "__main__":
    main()
