"""One e2e_peers.py run, as its own subprocess does it (``--run SYSTEM``): pagedkv through a ``pagedkv serve`` of its
own, Hugging Face ``generate`` in static batches, or transformers' continuous batching over a paged cache; each
returns its wall time, TTFTs and peak RSS."""

from __future__ import annotations

import asyncio
import math
import resource
import time
from pathlib import Path
from typing import Any

from common import Request, Server, timed_streams, warm_up

PAD_ID = 0


def _vm_hwm_kib(pid: int) -> int:
    try:
        for line in Path(f"/proc/{pid}/status").read_text().splitlines():
            if line.startswith("VmHWM:"):
                return int(line.split()[1])
    except OSError:
        pass
    return 0


def _children(pid: int) -> list[int]:
    out = []
    for d in Path("/proc").iterdir():
        if d.name.isdigit():
            try:
                if int((d / "stat").read_text().rsplit(")", 1)[1].split()[1]) == pid:
                    out.append(int(d.name))
            except (OSError, IndexError, ValueError):
                pass
    return out


def run_pagedkv(path: Path, reqs: list[Request], extra: list[str] = ()) -> dict[str, Any]:
    server = Server(["--model", str(path), "--max-num-seqs", "256", "--max-num-batched-tokens", "2048", *extra])

    async def go():
        from pagedkv.client import Client
        async with Client(server.address) as client:
            await warm_up(client)
            return await timed_streams(client, reqs)
    try:
        wall, results, _ = asyncio.run(go())
        rss = sum(_vm_hwm_kib(p) for p in _children(server.proc.pid))
    finally:
        server.stop()
    if [r.tokens for r in results] != [r.max_tokens for r in reqs]:
        raise RuntimeError("pagedkv returned other lengths than asked")
    return {"wall_s": wall, "ttfts_s": [r.ttft_s for r in results], "peak_rss_mib": rss / 1024}


def _hf_model(path: Path, attn: str):
    import torch
    from transformers import AutoModelForCausalLM

    model = AutoModelForCausalLM.from_pretrained(path, dtype=torch.float32, attn_implementation=attn).eval()
    model.generation_config.eos_token_id = None
    model.generation_config.pad_token_id = PAD_ID
    return model


def run_hf_static(path: Path, reqs: list[Request], batch_size: int) -> dict[str, Any]:
    import torch
    from transformers import LogitsProcessor, LogitsProcessorList

    class FirstToken(LogitsProcessor):  # the first call of a batch: its first token is being sampled
        def __init__(self) -> None:
            self.at = float("nan")

        def __call__(self, input_ids, scores):
            if math.isnan(self.at):
                self.at = time.perf_counter()
            return scores

    model = _hf_model(path, "sdpa")

    def generate(batch: list[Request], new: int, first: FirstToken | None = None) -> None:
        width = max(len(r.prompt) for r in batch)
        ids = torch.full((len(batch), width), PAD_ID, dtype=torch.long)
        mask = torch.zeros_like(ids)
        for row, r in enumerate(batch):
            ids[row, width - len(r.prompt):] = torch.tensor(r.prompt)
            mask[row, width - len(r.prompt):] = 1
        with torch.inference_mode():
            out = model.generate(input_ids=ids, attention_mask=mask, max_new_tokens=new, min_new_tokens=new,
                                 do_sample=False, logits_processor=LogitsProcessorList([first] if first else []))
        if out.shape[1] - width != new:
            raise RuntimeError("HF generated another length")

    generate([Request(-1, [1, 72, 105], 4)] * 2, 4)  # warm-up
    ttfts: list[float] = []
    t0 = time.perf_counter()
    for start in range(0, len(reqs), batch_size):
        batch = reqs[start:start + batch_size]
        first = FirstToken()
        generate(batch, max(r.max_tokens for r in batch), first)
        ttfts += [first.at - t0] * len(batch)
    wall = time.perf_counter() - t0
    return {"wall_s": wall, "ttfts_s": ttfts, "peak_rss_mib": resource.getrusage(resource.RUSAGE_SELF).ru_maxrss / 1024}


def run_hf_paged(path: Path, reqs: list[Request]) -> dict[str, Any]:
    from transformers import GenerationConfig

    model = _hf_model(path, "paged|sdpa")
    config = GenerationConfig(do_sample=False, eos_token_id=None, pad_token_id=PAD_ID,
                              max_new_tokens=max(r.max_tokens for r in reqs))
    manager = model.init_continuous_batching(generation_config=config)
    manager.start()
    try:
        warm = manager.add_request([1, 72, 105], max_new_tokens=4)
        while (r := manager.get_result(timeout=600)) is not None and not (r.request_id == warm and r.is_finished()):
            pass
        t0 = time.perf_counter()
        ids = [manager.add_request(r.prompt, max_new_tokens=r.max_tokens, record_timestamps=True) for r in reqs]
        done: dict[str, Any] = {}
        while len(done) < len(ids):
            res = manager.get_result(timeout=600)
            if res is None:
                raise RuntimeError("HF continuous batching stopped answering")
            if res.is_finished() and res.request_id in ids:
                done[res.request_id] = res
        wall = time.perf_counter() - t0
    finally:
        manager.stop(block=True)
    outs = [done[i] for i in ids]
    if [len(o.generated_tokens) for o in outs] != [r.max_tokens for r in reqs]:
        raise RuntimeError("HF continuous batching returned other lengths than asked")
    ttfts = [o.timestamps[0] - t0 if o.timestamps else float("nan") for o in outs]  # (perf_counter clock)
    return {"wall_s": wall, "ttfts_s": ttfts, "peak_rss_mib": resource.getrusage(resource.RUSAGE_SELF).ru_maxrss / 1024}
