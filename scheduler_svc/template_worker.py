"""The template worker: a process that renders requests' own chat templates for the scheduler
(``python -m scheduler_svc.template_worker MEMORY_BYTES CPU_SECONDS``; template_pool.py starts and drives it).

It reads jobs on stdin (JSON: template_sandbox.render_job's) and writes a reply to each on stdout, every message a
frame (``frame``: its length, then its JSON): first ``{"ready": true}``, then per job ``{"text": ...}``, or
``{"error": ..., "limit": kind}`` with kind ``template`` (the template's own error), ``output`` (RenderLimit: over
the job's max_bytes) or ``memory`` (then it exits: its heap may be in pieces). Its bounds do not depend on the
scheduler: its address space is capped at MEMORY_BYTES (RLIMIT_AS, hard: a template cannot raise it), each job may
take CPU_SECONDS of CPU (+1 s) before the kernel ends it (RLIMIT_CPU, SIGXCPU), it dies with the scheduler (Linux:
parent-death signal), ignores Ctrl-C (the scheduler ends it), and runs at a lower priority than the scheduler
(nice 10), so a template that burns its time takes CPU from no tenant's prompts.
"""

from __future__ import annotations

import faulthandler
import json
import math
import os
import resource
import signal
import sys

FRAME_HEADER = 4  # bytes of a message's length (big-endian) before its JSON, both ways
NICE = 10


def frame(message: dict) -> bytes:
    """``message`` as the worker and the pool send it: its JSON's length, then the JSON (UTF-8)."""
    data = json.dumps(message, ensure_ascii=False).encode("utf-8", "surrogatepass")
    return len(data).to_bytes(FRAME_HEADER, "big") + data


def _jobs(stream):
    """The jobs framed on ``stream``, until it ends (the scheduler closed it, or died)."""
    while len(header := stream.read(FRAME_HEADER)) == FRAME_HEADER:
        yield stream.read(int.from_bytes(header, "big"))


def _die_with_parent() -> None:
    """SIGKILL when the scheduler dies, however it dies (Linux's PR_SET_PDEATHSIG; elsewhere stdin's end)."""
    if sys.platform.startswith("linux"):
        import ctypes

        pr_set_pdeathsig = 1
        ctypes.CDLL(None, use_errno=True).prctl(pr_set_pdeathsig, signal.SIGKILL)
        if os.getppid() == 1:  # (the scheduler died before the call)
            raise SystemExit(1)


def _limit_cpu(seconds: float) -> None:
    """This job may use ``seconds`` of CPU (+1) from now: RLIMIT_CPU counts the process's whole life."""
    usage = resource.getrusage(resource.RUSAGE_SELF)
    used = usage.ru_utime + usage.ru_stime
    _, hard = resource.getrlimit(resource.RLIMIT_CPU)
    soft = math.ceil(used + seconds) + 1
    resource.setrlimit(resource.RLIMIT_CPU, (soft if hard == resource.RLIM_INFINITY else min(soft, hard), hard))


def reply(job: dict) -> dict:
    """The answer to one job."""
    from jinja2.exceptions import TemplateSyntaxError

    from scheduler_svc.template_sandbox import RenderLimit, render_job

    try:
        return {"text": render_job(job)}
    except RenderLimit as err:
        return {"error": str(err), "limit": "output"}
    except MemoryError:
        return {"error": "out of memory", "limit": "memory"}
    except TemplateSyntaxError as err:
        return {"error": f"{err.message} (line {err.lineno})", "limit": "template"}
    except Exception as err:  # noqa: BLE001 -- a template's raise_exception, or any error it hits
        return {"error": str(err) or type(err).__name__, "limit": "template"}


def main() -> None:
    memory, cpu_seconds = int(sys.argv[1]), float(sys.argv[2])
    faulthandler.enable()  # (a crash says where, on the scheduler's stderr)
    signal.signal(signal.SIGINT, signal.SIG_IGN)
    _die_with_parent()
    os.nice(NICE)
    from scheduler_svc import template_sandbox  # noqa: F401 -- jinja2 and the sandbox loaded before the first job

    resource.setrlimit(resource.RLIMIT_AS, (memory, memory))
    out = sys.stdout.buffer
    out.write(frame({"ready": True}))
    out.flush()
    for data in _jobs(sys.stdin.buffer):
        _limit_cpu(cpu_seconds)
        try:
            answer = reply(json.loads(data))
            message = frame(answer)
        except MemoryError:  # (the job's JSON, or the answer's, did not fit)
            answer = {"error": "out of memory", "limit": "memory"}
            message = frame(answer)
        out.write(message)
        out.flush()
        if answer.get("limit") == "memory":
            return


if __name__ == "__main__":
    main()
