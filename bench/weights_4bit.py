"""4-bit weights (AWQ / GPTQ) measured against the float model on CPU, one thread:

1. One linear, 4096 x 4096, 1, 8, 64 and 512 rows: fp32 F.linear, our 4-bit product (cpu_gemm.cpp
   ``linear_int4``: what pagedkv runs for float32 models on an AVX-512 CPU), torch's int4 matmul
   (``_weight_int4pack_mm_for_cpu``) with bf16 inside (what pagedkv runs elsewhere) and in fp32 (exact, scalar
   code; 1 and 8 rows), and dequantize-then-matmul per call (what a hand-written fallback would do; 1 and 8 rows).
   torchao's int4 CPU layout calls the same aten op, so it is not a separate candidate.
2. A random Llama (hidden 1024, 4 layers) quantized by pagedkv.tools.quantize.quantize_checkpoint: the decoder
   linears' bytes held (vs the same weights in fp16 and fp32) and decode tokens/s through the executor's
   ModelRunner and paged KV, batch 1 and 8, for fp32 weights and each 4-bit format.

    python bench/weights_4bit.py            # -> bench/results/weights_4bit.json
    python bench/weights_4bit.py --quick    # fewer steps
"""

from __future__ import annotations

import argparse
import sys
import tempfile
import time
from pathlib import Path

import torch
import torch.nn.functional as F

ROOT = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(ROOT))

from common import write_report  # noqa: E402

from executor_svc.model import load_model, quant  # noqa: E402
from executor_svc.model.quant import Int4Weight, build_int4  # noqa: E402
from executor_svc.model_config import ModelConfig  # noqa: E402
from pagedkv.tools.quantize import quantize_checkpoint  # noqa: E402
from pagedkv.tools.random_model import build_random_model  # noqa: E402

SHAPE = dict(hidden_size=1024, intermediate_size=2816, num_layers=4, num_heads=16, num_kv_heads=4)
FORMATS = {  # name -> quantize_checkpoint keywords
    "awq g128": dict(method="awq", group_size=128),
    "gptq g128": dict(method="gptq", group_size=128),
    "gptq g128 desc_act asym": dict(method="gptq", group_size=128, desc_act=True, sym=False),
    "gptq g64": dict(method="gptq", group_size=64),
    "gptq g32": dict(method="gptq", group_size=32),
}


def timed(fn, reps: int) -> float:
    fn()
    start = time.perf_counter()
    for _ in range(reps):
        fn()
    return (time.perf_counter() - start) / reps


def linear_kernels(reps: int) -> list[dict]:
    n = k = 4096
    g = torch.Generator().manual_seed(0)
    w = Int4Weight(torch.randint(0, 16, (n, k), dtype=torch.int32, generator=g),
                   torch.randint(0, 16, (k // 128, n), dtype=torch.int32, generator=g),
                   (torch.rand(k // 128, n, generator=g) * 0.01).half().float(), torch.arange(k) // 128, 128)
    ours, kind = build_int4([w], None, torch.device("cpu"), torch.float32)
    assert kind == "int4-cpu", kind
    quant.OWN_CPU_KERNEL = False
    int4, _ = build_int4([w], None, torch.device("cpu"), torch.float32)
    assert int4.kernel_dtype == torch.bfloat16
    quant.CPU_KERNEL_DTYPE = None
    exact, _ = build_int4([w], None, torch.device("cpu"), torch.float32)
    quant.CPU_KERNEL_DTYPE, quant.OWN_CPU_KERNEL = torch.bfloat16, True
    dense = w.dequantize()
    rows = []
    for m in (1, 8, 64, 512):
        x = torch.randn(m, k, generator=g)
        candidates = {
            "fp32 F.linear": lambda x=x: F.linear(x, dense),
            **({"our 4-bit product (default)": lambda x=x: ours(x)} if ours.ours is not None else {}),
            "int4 mm, bf16 inside": lambda x=x: int4(x),
            "int4 mm, fp32 (exact)": lambda x=x: exact(x),
            "dequantize per call + F.linear": lambda x=x: F.linear(x, w.dequantize()),
        }
        for name, fn in candidates.items():
            slow = "dequantize" in name or "exact" in name
            if slow and m > 8:
                continue
            rows.append({"rows": m, "path": name, "ms": 1e3 * timed(fn, 2 if slow else reps)})
    return rows


def decode_tokens_per_s(path: Path, batch: int, steps: int, prompt_len: int = 32) -> float:
    from executor_svc.attention.torch_backend import TorchPagedAttention
    from executor_svc.kv_quant import parse_kv_dtype
    from executor_svc.pages import DevicePagePool
    from executor_svc.runner import ModelRunner
    from pagedkv.executor.v1 import executor_pb2 as pb

    cfg = ModelConfig.from_dir(path)
    cpu = torch.device("cpu")
    model = load_model(cfg, cpu, torch.float32)
    attention = TorchPagedAttention(cfg.num_heads, cfg.num_kv_heads, cfg.head_dim, model.scale)
    block = 16
    pages_each = -(-(prompt_len + steps + 2) // block)
    pool = DevicePagePool(cfg, batch * pages_each + 1, block, torch.float32, cpu, parse_kv_dtype("auto", torch.float32))
    runner = ModelRunner(model, pool, attention, cpu)
    plan = pb.StepPlan(step_id=0)
    for i in range(batch):
        plan.new_requests.add(request_id=str(i), token_ids=[1] + [3 + (7 * i + j) % 250 for j in range(prompt_len - 1)],
                              num_scheduled_tokens=prompt_len,
                              page_ids=list(range(1 + i * pages_each, 1 + (i + 1) * pages_each)))
    assert not runner.step(plan).error
    start = None
    for step in range(1, steps + 2):
        if step == 2:
            start = time.perf_counter()  # the first decode step warms up
        plan = pb.StepPlan(step_id=step)
        for i in range(batch):
            plan.continuing.add(request_id=str(i), num_scheduled_tokens=1)
        assert not runner.step(plan).error
    return batch * steps / (time.perf_counter() - start)


def models(quick: bool, reps_steps: int, work: Path) -> list[dict]:
    base = build_random_model(work / "fp32", seed=7, initializer_range=0.02, **SHAPE)
    rows = []
    fp32_linears = None
    for name, kw in {"fp32": None, **FORMATS}.items():
        if quick and name not in ("fp32", "awq g128", "gptq g128 desc_act asym"):
            continue
        path = base if kw is None else quantize_checkpoint(base, work / name.replace(" ", "_"), **kw)
        model = load_model(ModelConfig.from_dir(path), torch.device("cpu"), torch.float32)
        held = model.weight_bytes()
        fp32_linears = fp32_linears or held["linears"]
        rows.append({
            "weights": name, "linear_kinds": model.linear_kinds, "linear_bytes": held["linears"],
            "other_bytes": held["other"], "vs_fp16_linears": held["linears"] / (fp32_linears / 2),
            "vs_fp32_linears": held["linears"] / fp32_linears,
            "decode_tok_s_b1": decode_tokens_per_s(path, 1, reps_steps),
            "decode_tok_s_b8": decode_tokens_per_s(path, 8, reps_steps),
        })
        del model
    return rows


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--quick", action="store_true")
    parser.add_argument("--threads", type=int, default=1)
    parser.add_argument("--out", default=str(ROOT / "bench/results/weights_4bit.json"))
    args = parser.parse_args()
    torch.set_num_threads(args.threads)
    torch.manual_seed(0)
    kernels = linear_kernels(5 if args.quick else 20)
    print(f"one 4096x4096 linear, fp32 activations, {args.threads} thread(s)")
    print(f"{'rows':>4}  {'path':<32} {'ms':>8}")
    for r in kernels:
        print(f"{r['rows']:>4}  {r['path']:<32} {r['ms']:>8.3f}")
    with tempfile.TemporaryDirectory() as tmp:
        rows = models(args.quick, 8 if args.quick else 24, Path(tmp))
    print(f"\nrandom Llama {SHAPE}, fp32 compute, {args.threads} thread(s)")
    print(f"{'weights':<24} {'linear MiB':>10} {'x fp16':>7} {'x fp32':>7} {'tok/s b1':>9} {'tok/s b8':>9}  kernel")
    for r in rows:
        print(f"{r['weights']:<24} {r['linear_bytes'] / 2**20:>10.2f} {r['vs_fp16_linears']:>7.3f} "
              f"{r['vs_fp32_linears']:>7.3f} {r['decode_tok_s_b1']:>9.1f} {r['decode_tok_s_b8']:>9.1f}  "
              f"{','.join(r['linear_kinds'])}")
    print()
    write_report(args.out, {"torch": torch.__version__, "threads": args.threads, "shape": SHAPE, "linear": kernels,
                            "models": rows, "quick": args.quick})


if __name__ == "__main__":
    main()
