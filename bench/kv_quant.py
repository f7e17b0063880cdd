"""KV cache quantization measured, side by side in one run (bench/NOTES.md "KV quantization"):

1. Bytes per token, scales included, for each --kv-cache-dtype on three model shapes.
2. Scale granularity on synthetic K/V with injected outlier channels (K: a few channels per head 15x larger,
   as in real models' keys; V: per-token magnitudes spread log-normally): relative error of K, V and of the
   attention output, and the memory overhead of the scales, for each candidate:
     token-head bf16   one bf16 scale per (token, KV head), computed at write (fp8's default; int8's for V)
     token-head e8m0   the same with a power-of-two scale in one byte (as OCP MX formats)
     page-channel      one bf16 scale per (page, KV head, channel), raised when a new token exceeds the range:
                       the page's earlier tokens are requantized (streamed writes, one token at a time)
     page-channel/all  the same when the whole page is known at once (a prefill): the bound of the above
     static channel    per-channel scales measured once on the first 256 tokens (a start-up calibration);
                       later values beyond them clip
     page-channel e8m0 the same with power-of-two scales in one byte (the exponent)
     KIVI              K page-channel (streamed), V token-head
     KIVI, K e8m0      K page-channel e8m0 (streamed), V token-head bf16 (int8's default)
3. Quality on a small trained model (pagedkv.tools.trained_tiny: a tiny Llama trained on CPU on Python's
   stdlib source), through the executor's own model, page pool and torch backend, against float32 KV:
   held-out perplexity (1024-token sequences run as 128-token chunked prefills over the cache), top-1
   next-token agreement, mean KL(full || quantized), and greedy continuations (first divergent position).
4. CPU decode tokens/s per KV dtype (torch backend, one thread).

    python bench/kv_quant.py            # full run -> bench/results/kv_quant.json
    python bench/kv_quant.py --quick    # fewer sequences and steps (a smoke test)
    python bench/kv_quant.py --model smollm2-135m-instruct --threads 2 --out bench/results/kv_quant_smollm2.json
                                        # 3. and 4. on the built-in real model, over CPython's pydoc_data text
    python bench/kv_quant.py --gpu --out bench/results/kv_quant_gpu.json   # 5. only (bench/gpu_check.sh)

5. (--gpu) One layer's decode attention, 64 requests x 4096 tokens, through the torch backend on the GPU, per
   KV dtype: the unfused path (gather, dequantize, SDPA) that 8-bit pages take until the CUDA kernels read them.
"""

from __future__ import annotations

import argparse
import json
import sys
import time
from pathlib import Path

import torch

ROOT = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(ROOT))

# (Harness and fixed_text_tokens: bench/flagship.py and bench/vllm_kv_quality.py import them from here)
from common import format_table, write_report  # noqa: E402
from kv_quant_granularity import granularity_table  # noqa: E402
from kv_quant_harness import KV_DTYPES, Harness, fixed_text_tokens, quality  # noqa: E402, F401
from kv_quant_speed import attention_decode, decode_speed  # noqa: E402

from executor_svc.kv_quant import parse_kv_dtype  # noqa: E402
from pagedkv.models import resolve_model  # noqa: E402
from pagedkv.tools.trained_tiny import trained_tiny_llama  # noqa: E402

TARGETS = {"fp8_e4m3": (0.005, 0.98), "int8": (0.01, 0.985)}  # perplexity increase, top-1 agreement (#50: fp8 98%)


# ---- 1. bytes per token ------------------------------------------------------------------------------------
SHAPES = {"tiny-llama (4 x 4 x 32)": (4, 4, 32), "trained tiny (3 x 2 x 64)": (3, 2, 64),
          "Llama-3-8B shape (32 x 8 x 128)": (32, 8, 128)}


def bytes_table() -> list[dict]:
    rows = []
    for shape, (layers, kv_heads, dim) in SHAPES.items():
        fp16 = parse_kv_dtype("float16", torch.float16).bytes_per_token(layers, kv_heads, dim)
        for name in ("float32", "float16", "fp8_e4m3", "int8"):
            b = parse_kv_dtype(name, torch.float16).bytes_per_token(layers, kv_heads, dim)
            rows.append(dict(shape=shape, kv_dtype=name, bytes_per_token=b, vs_fp16=b / fp16))
    return rows


# ---- report ----------------------------------------------------------------------------------------------
def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--quick", action="store_true")
    ap.add_argument("--threads", type=int, default=1)
    ap.add_argument("--out", type=Path, default=ROOT / "bench" / "results" / "kv_quant.json")
    ap.add_argument("--gpu", action="store_true", help="only the GPU decode attention table (bench/gpu_check.sh)")
    ap.add_argument("--model", default="", help="3. and 4. on this model (a built-in name such as "
                    "smollm2-135m-instruct, or an HF directory) instead of the trained tiny Llama; its text is "
                    "CPython's pydoc_data documentation")
    ap.add_argument("--decode-ctx", type=int, default=512, help="4.'s context length (#50's target: 2048)")
    ap.add_argument("--decode-only", action="store_true", help="1. and 4. only (no quality run)")
    ap.add_argument("--decode-kv", default=",".join(KV_DTYPES), help="4.'s KV dtypes, float32 first (default: all)")
    ap.add_argument("--quality-kv", default=",".join(KV_DTYPES), help="3.'s KV dtypes, float32 first (default: all; "
                    "NAME+tailN: with an exact tail of N pages, executor_svc/kv_tail.py)")
    ap.add_argument("--chunk", type=int, default=128, help="3.'s prefill chunk in tokens (16, page-aligned: each "
                    "position reads what a decode there reads, the exact tail included)")
    args = ap.parse_args(argv)
    torch.set_num_threads(args.threads)
    if args.gpu:
        device = "cuda" if torch.cuda.is_available() else "cpu"
        shape = dict(batch=64, ctx=4096) if device == "cuda" else dict(batch=4, ctx=256, repeats=1)
        res = attention_decode(device, **shape)
        print(f"decode attention, torch backend on {device} ({shape}), fp16 model, one layer, 32/8 heads, d128\n")
        print(format_table(("kv dtype", "ms", "pool GB/s read", "tokens/s", "vs fp16"),
                     [(n, f"{r['ms']:.2f}", f"{r['gb_per_s']:.0f}", f"{r['tokens_per_s']:.0f}",
                       f"{r['vs_fp16']:.2f}x") for n, r in res.items()]))
        write_report(args.out, {"device": device, "shape": shape, "decode": res}, indent=1)
        return 0
    t0 = time.perf_counter()
    report: dict = {"threads": args.threads, "torch": torch.__version__}

    report["bytes"] = bytes_table()
    print("1. KV bytes per token (K and V, all layers, scales included)\n")
    print(format_table(("shape (layers x KV heads x head_dim)", "kv dtype", "bytes/token", "vs fp16"),
                 [(r["shape"], r["kv_dtype"], f"{r['bytes_per_token']:g}", f"{r['vs_fp16']:.3f}x")
                  for r in report["bytes"]]))

    report["granularity"] = granularity_table()
    print("\n2. Scale granularity on synthetic K/V (2048 tokens, 8 heads, head_dim 128; K: 4 outlier channels per "
          "head at 15x; V: log-normal token magnitudes); relative L2 errors\n")
    print(format_table(("kv dtype", "granularity", "K err", "V err", "attn out err", "scale bytes/elem d128", "d64"),
                 [(r["kv_dtype"], r["granularity"], f"{r['k_rel_err']:.4f}", f"{r['v_rel_err']:.4f}",
                   f"{r['attn_rel_err']:.4f}", f"{r['scale_overhead_d128']:.4f}", f"{r['scale_overhead_d64']:.4f}")
                  for r in report["granularity"]]))

    q = (dict(num_seqs=2, seq_len=512, chunk=args.chunk, num_greedy=2, prompt_len=128, gen_len=32) if args.quick else
         dict(num_seqs=16, seq_len=1024, chunk=args.chunk, num_greedy=16, prompt_len=256, gen_len=256))
    report["quality_setup"] = q
    kv_names = tuple(args.quality_kv.split(","))
    if args.decode_only:
        model_dir = resolve_model(args.model) if args.model else trained_tiny_llama()
    elif args.model:
        model_dir = resolve_model(args.model)
        report["model"] = {"name": args.model, "text": "CPython's pydoc_data topics"}
        report["quality"] = quality(model_dir, **q, data=fixed_text_tokens(model_dir), kv_dtypes=kv_names)
        what = f"{args.model}, on CPython's pydoc_data documentation text,"
    else:
        model_dir = trained_tiny_llama()
        report["model"] = json.loads((model_dir / "training.json").read_text())
        report["quality"] = quality(model_dir, **q, kv_dtypes=kv_names)
        what = (f"the trained tiny Llama ({report['model']['steps']} steps on Python's stdlib, final train loss "
                f"{report['model']['final_loss']}),")
    if not args.decode_only:
        print(f"\n3. Quality on {what} {q['num_seqs']} held-out sequences of {q['seq_len']} tokens "
              f"(chunked prefill of {q['chunk']}); greedy: {q['num_greedy']} prompts of {q['prompt_len']}, "
              f"{q['gen_len']} tokens\n")
    ref_ppl = report["quality"]["float32"]["perplexity"] if "quality" in report else 0.0
    rows = []
    for name, r in report.get("quality", {}).items():
        d = r["first_divergence"]
        target = TARGETS.get(name)
        met = ""
        if target:
            ok = r["perplexity"] <= ref_ppl * (1 + target[0]) and r["top1_agreement"] >= target[1]
            met = f"{'met' if ok else 'NOT met'} (ppl <= +{100 * target[0]:.1f}%, top-1 >= {100 * target[1]:.1f}%)"
        rows.append((name, f"{r['perplexity']:.4f}", f"{100 * (r['perplexity'] / ref_ppl - 1):+.3f}%",
                     f"{100 * r['top1_agreement']:.2f}%", f"{r['mean_kl']:.2e}",
                     f"{min(d)} / {sorted(d)[len(d) // 2]}", f"{r['identical_continuations']}/{len(d)}", met))
    if rows:
        print(format_table(("kv dtype", "perplexity", "vs fp32", "top-1 agree", "mean KL", "1st diverge min/med",
                            "identical", "target"), rows))

    s = dict(batch=8, ctx=128, steps=8) if args.quick else dict(batch=32, ctx=args.decode_ctx, steps=32)
    report["decode_setup"] = s
    report["decode"] = decode_speed(model_dir, **s, kv_dtypes=tuple(args.decode_kv.split(",")))
    base = report["decode"]["float32"]["tokens_per_s"]
    print(f"\n4. CPU decode, torch backend, {args.threads} thread(s): batch {s['batch']}, context {s['ctx']}, "
          f"{s['steps']} steps (best of 2)\n")
    print(format_table(("kv dtype", "tokens/s", "ms/step", "vs fp32"),
                 [(n, f"{r['tokens_per_s']:.0f}", f"{r['ms_per_step']:.1f}", f"{r['tokens_per_s'] / base:.2f}x")
                  for n, r in report["decode"].items()]))
    report["seconds"] = time.perf_counter() - t0
    print()
    write_report(args.out, report, indent=1)
    print(f"({report['seconds']:.0f}s in all)")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
