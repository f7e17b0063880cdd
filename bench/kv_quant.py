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
import math
import sys
import time
from pathlib import Path
from types import SimpleNamespace

import torch
import torch.nn.functional as F

ROOT = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(ROOT))

from common import format_table, write_report  # noqa: E402

from executor_svc.attention.metadata import AttentionMetadata, DecodeGroup, PrefillSegment  # noqa: E402
from executor_svc.attention.torch_backend import TorchPagedAttention  # noqa: E402
from executor_svc.kv_quant import (  # noqa: E402
    FP8_MAX,
    INT8_MAX,
    SCALE_DTYPE,
    dequantize,
    key_rotation,
    parse_kv_dtype,
    quantize,
    to_fp8_e4m3,
)
from executor_svc.model import load_model  # noqa: E402
from executor_svc.model_config import ModelConfig  # noqa: E402
from executor_svc.pages import DevicePagePool  # noqa: E402
from pagedkv.models import resolve_model  # noqa: E402
from pagedkv.tools.trained_tiny import held_out_tokens, trained_tiny_llama  # noqa: E402

KV_DTYPES = ("float32", "bfloat16", "float16", "fp8_e4m3", "int8")
QUANT = ("fp8_e4m3", "int8")
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


# ---- 2. granularity on synthetic outlier K/V ---------------------------------------------------------------
def _q(y: torch.Tensor, fmt: str) -> torch.Tensor:
    """y already divided by its scale -> the quantized value, as a float."""
    if fmt == "int8":
        return torch.round(y).clamp(-INT8_MAX, INT8_MAX)
    return to_fp8_e4m3(y).float()


def _qmax(fmt: str) -> float:
    return INT8_MAX if fmt == "int8" else FP8_MAX


def token_head(x: torch.Tensor, fmt: str) -> torch.Tensor:
    return dequantize(*quantize(x, parse_kv_dtype(fmt, torch.float32)), torch.float32)


def token_head_e8m0(x: torch.Tensor, fmt: str) -> torch.Tensor:
    amax = x.abs().amax(-1, keepdim=True).clamp(min=1e-30)
    scale = torch.pow(2.0, torch.ceil(torch.log2(amax / _qmax(fmt))))
    return _q(x / scale, fmt) * scale


def _bf16(x: torch.Tensor) -> torch.Tensor:
    s = x.to(SCALE_DTYPE).float()
    return torch.where(s > 0, s, torch.ones_like(s))


def _e8m0(x: torch.Tensor) -> torch.Tensor:
    """A power-of-two scale >= x (one byte: the exponent)."""
    return torch.pow(2.0, torch.ceil(torch.log2(x.clamp(min=1e-30))))


def page_channel(x: torch.Tensor, fmt: str, block: int = 16, streamed: bool = True, e8m0: bool = False
                 ) -> torch.Tensor:
    """x [T, H, D]; one scale per (page, head, channel). Streamed: tokens written one at a time; when a token
    exceeds a channel's range the scale grows and the page's earlier tokens are requantized."""
    t, h, d = x.shape
    pages = x.view(t // block, block, h, d)
    rnd = _e8m0 if e8m0 else _bf16
    if not streamed:
        scale = rnd(pages.abs().amax(1, keepdim=True) / _qmax(fmt))
        return (_q(pages / scale, fmt) * scale).view(t, h, d)
    q = torch.zeros_like(pages)
    scale = torch.zeros(t // block, 1, h, d)
    for i in range(block):
        new = rnd(torch.maximum(scale, pages[:, i:i + 1].abs() / _qmax(fmt)))
        grew = new != scale
        if i:  # requantize the earlier tokens of pages whose scale grew
            old = q[:, :i] * torch.where(scale > 0, scale, torch.ones_like(scale))
            q[:, :i] = torch.where(grew, _q(old / new, fmt), q[:, :i])
        q[:, i:i + 1] = _q(pages[:, i:i + 1] / new, fmt)
        scale = new
    return (q * scale).view(t, h, d)


def static_channel(x: torch.Tensor, fmt: str, calib: int = 256) -> torch.Tensor:
    scale = x[:calib].abs().amax(0, keepdim=True).clamp(min=1e-30) / _qmax(fmt)
    return _q(x / scale, fmt) * scale


def rotated_token_head(x: torch.Tensor, fmt: str) -> torch.Tensor:
    """token_head in the rotated basis FP8 keys are stored in (kv_quant.key_rotation), rotated back."""
    for_q, for_k = key_rotation(x.shape[-1], torch.float32, x.device)
    return token_head(x @ for_k, fmt) @ for_q.T


CANDIDATES = {
    # name: (K method, V method, scale bytes per element beyond the data byte, as a function of head_dim)
    "token-head bf16 (fp8's V)": (token_head, token_head, lambda d: 2 / d),
    "K rotated token-head, V token-head (fp8 default)": (rotated_token_head, token_head, lambda d: 2 / d),
    "token-head e8m0": (token_head_e8m0, token_head_e8m0, lambda d: 1 / d),
    "page-channel (streamed)": (page_channel, page_channel, lambda d: 2 / 16),
    "page-channel (whole page)": (lambda x, f: page_channel(x, f, streamed=False),
                                  lambda x, f: page_channel(x, f, streamed=False), lambda d: 2 / 16),
    "static channel (calibrated)": (static_channel, static_channel, lambda d: 0.0),
    "page-channel e8m0 (streamed)": (lambda x, f: page_channel(x, f, e8m0=True),
                                     lambda x, f: page_channel(x, f, e8m0=True), lambda d: 1 / 16),
    "KIVI: K page-channel, V token-head": (page_channel, token_head, lambda d: (2 / 16 + 2 / d) / 2),
    "KIVI, K e8m0 (int8 default)": (lambda x, f: page_channel(x, f, e8m0=True), token_head,
                                    lambda d: (1 / 16 + 2 / d) / 2),
}


def synthetic_kv(seed: int = 0, t: int = 2048, h: int = 8, d: int = 128, outliers: int = 4, factor: float = 15.0):
    g = torch.Generator().manual_seed(seed)
    k = torch.randn(t, h, d, generator=g)
    chans = torch.stack([torch.randperm(d, generator=g)[:outliers] for _ in range(h)])  # [h, outliers]
    gain = torch.ones(h, d)
    gain.scatter_(1, chans, factor)
    k = k * gain + gain * 0.3 * (gain > 1)  # outlier channels: large, with an offset, in every token
    v = torch.randn(t, h, d, generator=g) * torch.exp(0.5 * torch.randn(t, h, 1, generator=g))
    q = torch.randn(64, h, d, generator=g)
    return q, k, v


def _attend(q, k, v):
    s = torch.einsum("qhd,thd->hqt", q, k) / math.sqrt(q.shape[-1])
    return torch.einsum("hqt,thd->qhd", torch.softmax(s, -1), v)


def _rel(a, b) -> float:
    return float((a - b).norm() / b.norm())


def granularity_table(seed: int = 0) -> list[dict]:
    q, k, v = synthetic_kv(seed)
    exact = _attend(q, k, v)
    rows = []
    for fmt in QUANT:
        for name, (kf, vf, overhead) in CANDIDATES.items():
            kq, vq = kf(k, fmt), vf(v, fmt)
            rows.append(dict(kv_dtype=fmt, granularity=name, k_rel_err=_rel(kq, k), v_rel_err=_rel(vq, v),
                             attn_rel_err=_rel(_attend(q, kq, vq), exact),
                             scale_overhead_d128=overhead(128), scale_overhead_d64=overhead(64)))
    return rows


# ---- 3. quality on the trained model --------------------------------------------------------------------
class Harness:
    """The executor's model over a page pool of one KV dtype, driven with hand-built step metadata."""

    def __init__(self, model, cfg: ModelConfig, kv_dtype: str, num_pages: int, block: int = 16) -> None:
        self.model, self.block = model, block
        self.pool = DevicePagePool(cfg, num_pages, block, torch.float32, torch.device("cpu"),
                                   parse_kv_dtype(kv_dtype, torch.float32))
        self.attn = TorchPagedAttention(cfg.num_heads, cfg.num_kv_heads, cfg.head_dim, model.scale)

    def _slots(self, pages: list[int], positions: range):
        pos = torch.tensor(list(positions))
        return torch.tensor(pages)[pos // self.block], pos % self.block

    def prefill(self, tokens: list[int], start: int, pages: list[int]) -> torch.Tensor:
        """tokens at positions [start, start + n) of a sequence on ``pages``; logits of every position."""
        n = len(tokens)
        sp, so = self._slots(pages, range(start, start + n))
        ctx = start + n
        seg = PrefillSegment(0, n, ctx, torch.tensor(pages[: -(-ctx // self.block)]))
        meta = AttentionMetadata(sp, so, [], [seg])
        return self.model.forward(torch.tensor(tokens), torch.arange(start, ctx), meta, self.pool, self.attn,
                                  torch.arange(n))

    def decode(self, tokens: list[int], ctx_lens: list[int], tables: list[list[int]]) -> torch.Tensor:
        """One new token per sequence, at position ctx_len - 1."""
        b = len(tokens)
        sp = torch.tensor([t[(c - 1) // self.block] for t, c in zip(tables, ctx_lens)])
        so = torch.tensor([(c - 1) % self.block for c in ctx_lens])
        group = DecodeGroup(torch.arange(b), torch.tensor(tables), torch.tensor(ctx_lens))
        meta = AttentionMetadata(sp, so, [group], [])
        return self.model.forward(torch.tensor(tokens), torch.tensor(ctx_lens) - 1, meta, self.pool, self.attn,
                                  torch.arange(b))


def fixed_text_tokens(model_dir: Path) -> list[int]:
    """A fixed English text for a real model: the documentation topics that ship with CPython (pydoc_data), in
    their sorted order, tokenized with the model's own tokenizer."""
    from pydoc_data.topics import topics

    from transformers import AutoTokenizer

    text = "\n\n".join(topics[k] for k in sorted(topics))
    return AutoTokenizer.from_pretrained(str(model_dir))(text, add_special_tokens=False).input_ids


def quality(model_dir: Path, num_seqs: int, seq_len: int, chunk: int, num_greedy: int, prompt_len: int,
            gen_len: int, data: list[int] | None = None) -> dict:
    cfg = ModelConfig.from_dir(model_dir)
    model = load_model(cfg, torch.device("cpu"), torch.float32)
    data = held_out_tokens() if data is None else data
    seqs = [data[i * seq_len:(i + 1) * seq_len] for i in range(num_seqs)]
    pages = list(range(seq_len // 16))
    harness = {name: Harness(model, cfg, name, len(pages)) for name in KV_DTYPES}  # (float32 first: the reference)
    sums = {name: dict(nll=0.0, agree=0, kl=0.0, max_kl=0.0) for name in KV_DTYPES}
    tokens = 0
    for s in seqs:  # one sequence's logits at a time (a 49k vocabulary x 1,024 positions is 200 MB a dtype)
        target = torch.tensor(s)[1:]
        tokens += target.numel()
        for name, h in harness.items():
            lg = torch.cat([h.prefill(s[i:i + chunk], i, pages) for i in range(0, seq_len, chunk)])[:-1]
            logp = F.log_softmax(lg, -1)
            if name == "float32":
                ref, ref_logp = lg.argmax(-1), logp
            kl = (ref_logp.exp() * (ref_logp - logp)).sum(-1)
            acc = sums[name]
            acc["nll"] -= float(logp.gather(-1, target.unsqueeze(-1)).sum())
            acc["agree"] += int((lg.argmax(-1) == ref).sum())
            acc["kl"] += float(kl.sum())
            acc["max_kl"] = max(acc["max_kl"], float(kl.max()))
    out = {name: dict(perplexity=math.exp(acc["nll"] / tokens), top1_agreement=acc["agree"] / tokens,
                      mean_kl=acc["kl"] / tokens, max_kl=acc["max_kl"], tokens=tokens) for name, acc in sums.items()}
    # greedy continuations of held-out prompts, all sequences decoded together (one decode group)
    start = min(200_000, len(data) // 2)  # (past the perplexity sequences)
    prompts = [data[start + i * 997:start + i * 997 + prompt_len] for i in range(num_greedy)]
    per_seq_pages = -(-(prompt_len + gen_len) // 16)
    tables = [list(range(i * per_seq_pages, (i + 1) * per_seq_pages)) for i in range(num_greedy)]
    gens = {}
    for name in KV_DTYPES:
        h = Harness(model, cfg, name, num_greedy * per_seq_pages)
        nxt = [int(h.prefill(p, 0, t)[-1].argmax()) for p, t in zip(prompts, tables)]
        outs = [[x] for x in nxt]
        ctx = [prompt_len + 1] * num_greedy
        for _ in range(gen_len - 1):
            lg = h.decode(nxt, ctx, tables)
            nxt = [int(x) for x in lg.argmax(-1)]
            for o, x in zip(outs, nxt):
                o.append(x)
            ctx = [c + 1 for c in ctx]
        gens[name] = outs
    for name in KV_DTYPES:
        firsts = []
        for a, b in zip(gens[name], gens["float32"]):
            firsts.append(next((i for i, (x, y) in enumerate(zip(a, b)) if x != y), gen_len))
        out[name]["first_divergence"] = firsts
        out[name]["identical_continuations"] = sum(f == gen_len for f in firsts)
    return out


# ---- 4. CPU decode throughput ----------------------------------------------------------------------------
def decode_speed(model_dir: Path, batch: int, ctx: int, steps: int, kv_dtypes: tuple[str, ...] = KV_DTYPES) -> dict:
    cfg = ModelConfig.from_dir(model_dir)
    model = load_model(cfg, torch.device("cpu"), torch.float32)
    per_seq = -(-(ctx + steps) // 16)
    tables = [list(range(i * per_seq, (i + 1) * per_seq)) for i in range(batch)]
    out = {}
    for name in kv_dtypes:
        h = Harness(model, cfg, name, batch * per_seq)
        g = torch.Generator().manual_seed(0)
        for t in tables:  # fill the context (not timed)
            h.prefill(torch.randint(3, 259, (ctx,), generator=g).tolist(), 0, t)
        best = float("inf")
        for _ in range(2):
            lens = [ctx + 1] * batch
            t0 = time.perf_counter()
            for _ in range(steps):
                h.decode([5] * batch, lens, tables)
                lens = [c + 1 for c in lens]
            best = min(best, time.perf_counter() - t0)
        out[name] = dict(tokens_per_s=batch * steps / best, ms_per_step=1000 * best / steps)
    return out


# ---- 5. GPU: the torch backend's decode attention over 8-bit pages (the CUDA kernels do not read them yet) ----
def attention_decode(device: str, batch: int = 64, ctx: int = 4096, heads: int = 32, kv_heads: int = 8,
                     dim: int = 128, repeats: int = 5) -> dict:
    """One layer's paged decode (torch backend: gather + dequantize + SDPA), fp16 model, per KV dtype:
    time per call and the pool bytes it reads (data and scales of the visible pages) per second."""
    dev = torch.device(device)
    block = 16
    n_pages = -(-ctx // block)
    cfg = SimpleNamespace(num_layers=1, num_kv_heads=kv_heads, head_dim=dim)
    attn = TorchPagedAttention(heads, kv_heads, dim, dim ** -0.5)
    tables = torch.arange(batch * n_pages, device=dev).view(batch, n_pages)
    q = torch.randn(batch, heads, dim, device=dev, dtype=torch.float16)
    out = {}
    for name in ("float16", "fp8_e4m3", "int8"):
        pool = DevicePagePool(cfg, batch * n_pages, block, torch.float16, dev, parse_kv_dtype(name, torch.float16))
        kc, vc = pool.layer(0)
        g = torch.Generator(device=dev).manual_seed(0)
        x = torch.randn(batch * n_pages * block, kv_heads, dim, device=dev, generator=g, dtype=torch.float16)
        slots = torch.arange(x.shape[0], device=dev)
        meta = AttentionMetadata(slots // block, slots % block, [], [])
        attn.write_cache(kc, vc, x, x, meta)
        group = DecodeGroup(torch.arange(batch, device=dev), tables, torch.full((batch,), ctx, device=dev))
        meta = AttentionMetadata(slots[:batch], slots[:batch], [group], [])

        attn.forward(q, kc, vc, meta)  # warm-up
        best = float("inf")
        for _ in range(repeats):
            if dev.type == "cuda":
                torch.cuda.synchronize()
            t0 = time.perf_counter()
            attn.forward(q, kc, vc, meta)
            if dev.type == "cuda":
                torch.cuda.synchronize()
            best = min(best, time.perf_counter() - t0)
        read = batch * n_pages * pool.page_bytes
        out[name] = dict(ms=best * 1e3, gb_per_s=read / best / 1e9, tokens_per_s=batch / best, pool_bytes_read=read)
    base = out["float16"]["tokens_per_s"]
    for r in out.values():
        r["vs_fp16"] = r["tokens_per_s"] / base
    return out


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

    q = (dict(num_seqs=2, seq_len=512, chunk=128, num_greedy=2, prompt_len=128, gen_len=32) if args.quick else
         dict(num_seqs=16, seq_len=1024, chunk=128, num_greedy=16, prompt_len=256, gen_len=256))
    report["quality_setup"] = q
    if args.decode_only:
        model_dir = resolve_model(args.model) if args.model else trained_tiny_llama()
    elif args.model:
        model_dir = resolve_model(args.model)
        report["model"] = {"name": args.model, "text": "CPython's pydoc_data topics"}
        report["quality"] = quality(model_dir, **q, data=fixed_text_tokens(model_dir))
        what = f"{args.model}, on CPython's pydoc_data documentation text,"
    else:
        model_dir = trained_tiny_llama()
        report["model"] = json.loads((model_dir / "training.json").read_text())
        report["quality"] = quality(model_dir, **q)
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
