"""CPU attention of the torch backend: the gather path (reference) against the in-place kernel.

The uniform workload of issue 17 (64 requests, 128-token prompts, 64 output tokens each, greedy, no early
stop) on tiny-llama, in one process: the real Scheduler plans each step and the real ModelRunner runs it
(tests/support/inprocess.py). For each path: the executor's step time, the attention time inside it (a timer around
every ``forward``), and a torch.profiler run of the same workload for the share of the KV gather
(``aten::index_select`` and the copies it feeds) in the executor's CPU time. Outputs of the two paths are
compared token by token.

    .venv/bin/python bench/attention_cpu.py [--threads 1] [--requests 64] [--prompt 128] [--output 64]
                                            [--micro-only]

It first times one layer's attention alone (a decode batch, prefill chunks) on both paths.
"""

from __future__ import annotations

import argparse
import sys
import tempfile
import time
from pathlib import Path

import torch

ROOT = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(ROOT))

from executor_svc.attention import cpu_kernel  # noqa: E402
from executor_svc.attention.torch_backend import TorchPagedAttention  # noqa: E402
from pagedkv.tools.random_model import build_tiny_llama  # noqa: E402
from tests.support.fake_executor import make_request  # noqa: E402
from tests.support.inprocess import InProcessServer  # noqa: E402

GATHER_OPS = ("aten::index_select",)


class TimedAttention:
    """The backend, with the wall time of its forward calls summed."""

    def __init__(self, inner: TorchPagedAttention) -> None:
        self.inner = inner
        self.seconds = 0.0
        self.decode_seconds = 0.0  # in steps without prefill chunks
        self.decode_calls = 0

    def __getattr__(self, name: str):
        return getattr(self.inner, name)

    def write_cache(self, *args) -> None:
        self.inner.write_cache(*args)

    def forward(self, *args) -> torch.Tensor:
        t = time.perf_counter()
        out = self.inner.forward(*args)
        dt = time.perf_counter() - t
        self.seconds += dt
        if not args[-1].prefills:
            self.decode_seconds += dt
            self.decode_calls += 1
        return out


def run(model_dir: Path, reference: bool, args, profile: bool) -> dict:
    server = InProcessServer(model_dir, num_pages=args.requests * (-(-(args.prompt + args.output) // 16)) + 16,
                             max_num_seqs=args.requests, max_num_batched_tokens=2048)
    cfg = server.cfg
    attention = TimedAttention(TorchPagedAttention(cfg.num_heads, cfg.num_kv_heads, cfg.head_dim,
                                                   server.runner.model.scale, reference=reference))
    server.runner.attention = attention
    steps = []
    inner_step = server.runner.step

    def timed_step(plan):
        t = time.perf_counter()
        result = inner_step(plan)
        steps.append(time.perf_counter() - t)
        return result

    server.runner.step = timed_step
    prompts = [[1] + [3 + (7 * i + 13 * j) % 250 for j in range(args.prompt - 1)] for i in range(args.requests)]
    reqs = []
    for i, prompt in enumerate(prompts):
        req = make_request(i, 0, args.output, prompt=prompt)
        req.sampling.ignore_eos = True
        server.scheduler.add(req)
        reqs.append(req)
    prof = None
    if profile:
        prof = torch.profiler.profile(activities=[torch.profiler.ProfilerActivity.CPU])
        prof.__enter__()
    t = time.perf_counter()
    from tests.support.fake_executor import drive

    drive(server.scheduler, executor=server)
    wall = time.perf_counter() - t
    shares = {}
    if prof is not None:
        prof.__exit__(None, None, None)
        stats = prof.key_averages()
        total = sum(e.self_cpu_time_total for e in stats)
        by_name = {e.key: e.self_cpu_time_total for e in stats}
        shares["gather"] = sum(by_name.get(k, 0) for k in GATHER_OPS) / total
        shares["sdpa"] = sum(v for k, v in by_name.items() if "scaled_dot_product" in k) / total
        shares["kernel"] = by_name.get("pagedkv_cpu::paged_attention", 0) / total
        shares["matmul"] = sum(v for k, v in by_name.items() if k in ("aten::mm", "aten::addmm", "aten::bmm",
                                                                         "aten::linear", "aten::matmul")) / total
        shares["profiled_us"] = total
    decode_steps = steps[-(args.output - 1):]  # the prompts all fit in the first steps
    return {"wall": wall, "steps": len(steps), "step_mean_ms": 1e3 * sum(steps) / len(steps),
            "decode_step_ms": 1e3 * sorted(decode_steps)[len(decode_steps) // 2],
            "attention_ms_per_step": 1e3 * attention.seconds / len(steps),
            "decode_attention_ms": 1e3 * attention.decode_seconds * cfg.num_layers / max(1, attention.decode_calls),
            "attention_share": attention.seconds / sum(steps), "tokens": [list(r.output_ids) for r in reqs],
            **shares}


def micro(repeats: int = 100) -> None:
    """One layer's attention alone, best of ``repeats`` (interleaved): a decode batch shaped like the uniform
    workload's (tiny-llama heads, 64 requests at context 129-192) and single prefill chunks."""
    from executor_svc.attention.metadata import AttentionMetadata, DecodeGroup, PrefillSegment

    g = torch.Generator().manual_seed(0)
    heads, kv_heads, dim, bs, num_pages = 8, 4, 32, 16, 64 * 13
    pool = torch.randn(num_pages, 4, 2, bs, kv_heads, dim, generator=g)  # layer 1 of 4: pages strided as served
    k, v = pool[:, 1, 0], pool[:, 1, 1]
    empty = torch.zeros(0, dtype=torch.long)
    perm = torch.randperm(num_pages, generator=g)
    cases = {"decode 64 x ctx 129-192": (torch.randn(64, heads, dim, generator=g), AttentionMetadata(
        empty, empty, [DecodeGroup(torch.arange(64), perm[:64 * 12].view(64, 12),
                                   torch.randint(129, 193, (64,), generator=g))], []))}
    for ctx, q_len in ((512, 4), (512, 16), (128, 128)):
        seg = PrefillSegment(0, q_len, ctx, perm[: ctx // bs])
        cases[f"prefill chunk {q_len} at ctx {ctx}"] = (torch.randn(q_len, heads, dim, generator=g),
                                                        AttentionMetadata(empty, empty, [], [seg]))
    paths = {"gather": TorchPagedAttention(heads, kv_heads, dim, dim ** -0.5, reference=True),
             "in place": TorchPagedAttention(heads, kv_heads, dim, dim ** -0.5)}
    print("| one layer | gather + SDPA ms | kernel ms |\n|---|---|---|")
    for name, (q, meta) in cases.items():
        best = {}
        for _ in range(repeats):
            for path, attention in paths.items():
                t = time.perf_counter()
                if meta.prefills and path == "in place":  # the backend itself gathers for prefills: the kernel
                    seg = meta.prefills[0]  # called directly, one query per position
                    pos = torch.arange(seg.ctx_len - seg.q_len, seg.ctx_len)
                    t = time.perf_counter()
                    cpu_kernel.load().paged_attention(q, k, v, seg.page_ids.view(1, -1), torch.zeros_like(pos), pos,
                                                      empty, empty, 0, dim ** -0.5)
                else:
                    attention.forward(q, k, v, meta)
                best[path] = min(best.get(path, 1e9), time.perf_counter() - t)
        print(f"| {name} | {1e3 * best['gather']:.3f} | {1e3 * best['in place']:.3f} |")
    groups_vs_one(repeats)


def groups_vs_one(repeats: int) -> None:
    """The kernel over 256 decodes of log-normal context lengths (30-2,000 tokens, as a mixed workload's), one
    layer: one call per group of similar length (slack 1.25, as the gather path groups them) against one call
    for all (what the runner now sends when decodes are read in place)."""
    import random

    from executor_svc.attention.metadata import AttentionMetadata, DecodeGroup
    from executor_svc.batch import group_by_length, padded_tables

    rng, g = random.Random(0), torch.Generator().manual_seed(1)
    heads, kv_heads, dim, bs, n = 8, 4, 32, 16, 256
    lens = [int(min(2000, max(30, rng.lognormvariate(5.5, 0.9)))) for _ in range(n)]
    num_pages = sum(-(-c // bs) for c in lens) + 8
    pool = torch.randn(num_pages, 4, 2, bs, kv_heads, dim, generator=g)
    k, v = pool[:, 1, 0], pool[:, 1, 1]
    perm, tables = torch.randperm(num_pages, generator=g).tolist(), []
    for c in lens:
        tables.append([perm.pop() for _ in range(-(-c // bs))])
    q = torch.randn(n, heads, dim, generator=g)
    empty = torch.zeros(0, dtype=torch.long)

    def meta(slack: float) -> AttentionMetadata:
        decodes = [DecodeGroup(torch.tensor(m), padded_tables([tables[i] for i in m], w, torch.device("cpu")),
                               torch.tensor([lens[i] for i in m]))
                   for m, w in group_by_length([len(t) for t in tables], slack)]
        return AttentionMetadata(empty, empty, decodes, [])
    metas = {"length groups": meta(1.25), "one group": meta(float("inf"))}
    attention = TorchPagedAttention(heads, kv_heads, dim, dim ** -0.5)
    torch.testing.assert_close(attention.forward(q, k, v, metas["length groups"]),
                               attention.forward(q, k, v, metas["one group"]))
    best = {}
    for _ in range(repeats):
        for name, m in metas.items():
            t = time.perf_counter()
            attention.forward(q, k, v, m)
            best[name] = min(best.get(name, 1e9), time.perf_counter() - t)
    groups = len(metas["length groups"].decodes)
    print(f"\n| kernel, 256 decodes at ctx {min(lens)}-{max(lens)} | {groups} length groups ms | one group ms |")
    print(f"|---|---|---|\n| one layer | {1e3 * best['length groups']:.3f} | {1e3 * best['one group']:.3f} |")


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--threads", type=int, default=1)
    p.add_argument("--requests", type=int, default=64)
    p.add_argument("--prompt", type=int, default=128)
    p.add_argument("--output", type=int, default=64)
    p.add_argument("--repeats", type=int, default=2, help="timed runs per path (best kept)")
    p.add_argument("--micro-only", action="store_true", help="only the one-layer table")
    args = p.parse_args()
    torch.set_num_threads(args.threads)
    t = time.perf_counter()
    kernel = cpu_kernel.load()
    print(f"kernel: {'loaded' if kernel else cpu_kernel.reason()} ({time.perf_counter() - t:.2f} s)")
    if kernel is not None:
        micro()
    if args.micro_only:
        return
    with tempfile.TemporaryDirectory() as d:
        model_dir = build_tiny_llama(Path(d) / "tiny-llama")
        results = {}
        for reference in (True, False):
            name = "gather (reference)" if reference else "in place (kernel)"
            timed = min((run(model_dir, reference, args, profile=False) for _ in range(args.repeats)),
                        key=lambda r: r["wall"])
            profiled = run(model_dir, reference, args, profile=True)
            timed.update({k: profiled[k] for k in ("gather", "sdpa", "kernel", "matmul")})
            results[name] = timed
    same = results["gather (reference)"]["tokens"] == results["in place (kernel)"]["tokens"]
    print(f"threads {args.threads}; {args.requests} x {args.prompt} -> {args.output}; tokens equal: {same}")
    print("| path | wall s | step ms (mean) | decode step ms (median) | attention ms/step | decode attention ms/step "
          "| attention share "
          "| gather share (profiler) | SDPA share | kernel share | matmul share |")
    print("|---|---|---|---|---|---|---|---|---|---|---|")
    for name, r in results.items():
        cells = [f"{r['wall']:.2f}", f"{r['step_mean_ms']:.2f}", f"{r['decode_step_ms']:.2f}",
                 f"{r['attention_ms_per_step']:.2f}", f"{r['decode_attention_ms']:.2f}",
                 *(f"{100 * r[k]:.1f}%" for k in ("attention_share", "gather", "sdpa", "kernel", "matmul"))]
        print(f"| {name} | " + " | ".join(cells) + " |")

if __name__ == "__main__":
    main()
