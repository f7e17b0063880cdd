"""FP8 KV quality if a request's most recent pages stay in full precision (#50 item 1: the scheme to pick).

A simulation through the executor's own model, page pool and torch backend (kv_quant_harness.Harness): every
token is written to the FP8 pool as today, and also to an exact float32 copy; attention reads the FP8 pages,
except a request's last ``tail`` pages (the open page being filled and the ``tail - 1`` sealed ones before it),
which it reads from the exact copy. Prefill runs in page-sized chunks aligned to the pages, so that each query
sees what a decode at its position would see: its own page and the ``tail - 1`` before it exact, the rest FP8.
(A 128-token chunk, as bench/kv_quant.py runs, gives the same FP8 figures within noise: compare its rows.)

Variants: the tail exact for K only, or K and V; optionally the first page too (the attention sinks, as
IntactKV keeps them). Targets (#50): perplexity <= +0.5% vs float32 KV, top-1 agreement >= 98%.

    python bench/kv_quant_tail.py --model smollm2-135m-instruct --tails 0,1,2,4 --seqs 16
        -> bench/results/kv_quant_tail.json
"""

from __future__ import annotations

import argparse
import math
import sys
import time
from pathlib import Path

import torch
import torch.nn.functional as F

ROOT = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(ROOT))
sys.path.insert(0, str(ROOT / "bench"))
from common import format_table, write_report  # noqa: E402
from kv_quant_harness import Harness, fixed_text_tokens  # noqa: E402

from executor_svc.kv_quant import QuantizedCache  # noqa: E402
from executor_svc.model import load_model  # noqa: E402
from executor_svc.model_config import ModelConfig  # noqa: E402
from pagedkv.models import resolve_model  # noqa: E402

BLOCK = 16
TARGET_PPL, TARGET_TOP1 = 0.005, 0.98


class TailExactCache(QuantizedCache):
    """An FP8 layer view that also keeps every written token exactly; ``gather`` returns the exact copy for the
    pages in ``exact`` (the last write's page and the ``tail - 1`` before it; page 0 too when ``first``)."""

    def __init__(self, cache: QuantizedCache, tail: int, first: bool) -> None:
        super().__init__(cache.data, cache.scale, cache.fmt)
        self.plain = QuantizedCache(cache.data, cache.scale, cache.fmt)
        self.copy = torch.zeros(cache.data.shape, dtype=torch.float32)
        self.tail, self.first, self.exact = tail, first, set()

    def write(self, pages: torch.Tensor, offsets: torch.Tensor, x: torch.Tensor) -> None:
        self.plain.write(pages, offsets, x)
        self.copy[pages, offsets] = x.float()
        last = int(pages[-1])  # (one sequence per harness, its pages numbered in order)
        self.exact = set(range(max(0, last - self.tail + 1), last + 1)) | ({0} if self.first else set())

    def gather(self, page_ids: torch.Tensor, dtype: torch.dtype) -> torch.Tensor:
        out = self.plain.gather(page_ids, dtype)
        for i, page in enumerate(page_ids.tolist()):
            if page in self.exact:
                out[i] = self.copy[page].to(dtype)
        return out


def harness(model, cfg: ModelConfig, kv: str, pages: int, tail: int, values: bool, first: bool) -> Harness:
    h = Harness(model, cfg, kv + "+tail0" if kv == "fp8_e4m3" else kv, pages)  # (the simulation, not the pool's tail)
    if tail or first:
        h.pool.k_views = [TailExactCache(c, tail, first) for c in h.pool.k_views]
        if values:
            h.pool.v_views = [TailExactCache(c, tail, first) for c in h.pool.v_views]
    return h


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--model", default="smollm2-135m-instruct", help="a built-in name or an HF directory")
    ap.add_argument("--seqs", type=int, default=16, help="held-out sequences (bench/kv_quant.py: 16)")
    ap.add_argument("--seq-len", type=int, default=1024)
    ap.add_argument("--tails", default="0,1,2,4", help="pages kept exact at the end of each request")
    ap.add_argument("--first", action="store_true", help="also rows with the first page exact")
    ap.add_argument("--threads", type=int, default=2)
    ap.add_argument("--out", type=Path, default=ROOT / "bench" / "results" / "kv_quant_tail.json")
    args = ap.parse_args(argv)
    torch.set_num_threads(args.threads)
    model_dir = resolve_model(args.model)
    cfg = ModelConfig.from_dir(model_dir)
    model = load_model(cfg, torch.device("cpu"), torch.float32)
    data = fixed_text_tokens(model_dir)
    seqs = [data[i * args.seq_len:(i + 1) * args.seq_len] for i in range(args.seqs)]
    pages = args.seq_len // BLOCK
    variants: dict[str, tuple[Harness, dict]] = {"float32": (harness(model, cfg, "float32", pages, 0, False, False),
                                                             dict(kv="float32", tail=0, values=False, first=False))}
    for tail in (int(t) for t in args.tails.split(",")):
        for first in (False, True) if args.first else (False,):
            for values in (False, True) if tail or first else (False,):
                name = f"fp8, tail {tail}" + (" + first" if first else "") + (" (K, V)" if values else
                                                                             " (K)" if tail or first else "")
                variants[name] = (harness(model, cfg, "fp8_e4m3", pages, tail, values, first),
                                  dict(kv="fp8_e4m3", tail=tail, values=values, first=first))
    sums = {name: dict(nll=0.0, agree=0, kl=0.0) for name in variants}
    tokens, t0 = 0, time.perf_counter()
    for n, s in enumerate(seqs):
        target = torch.tensor(s)[1:]
        tokens += target.numel()
        for name, (h, _) in variants.items():
            with torch.no_grad():
                lg = torch.cat([h.prefill(s[i:i + BLOCK], i, list(range(pages)))
                                for i in range(0, args.seq_len, BLOCK)])[:-1]
            logp = F.log_softmax(lg, -1)
            if name == "float32":
                ref, ref_logp = lg.argmax(-1), logp
            acc = sums[name]
            acc["nll"] -= float(logp.gather(-1, target.unsqueeze(-1)).sum())
            acc["agree"] += int((lg.argmax(-1) == ref).sum())
            acc["kl"] += float((ref_logp.exp() * (ref_logp - logp)).sum(-1).sum())
        print(f"sequence {n + 1}/{len(seqs)}: {time.perf_counter() - t0:.0f} s", flush=True)
    ref_ppl = math.exp(sums["float32"]["nll"] / tokens)
    rows, report = [], {"model": args.model, "seqs": args.seqs, "seq_len": args.seq_len, "tokens": tokens,
                        "block": BLOCK, "variants": {}}
    for name, (_, spec) in variants.items():
        acc = sums[name]
        ppl = math.exp(acc["nll"] / tokens)
        r = dict(spec, perplexity=ppl, vs_fp32=ppl / ref_ppl - 1, top1_agreement=acc["agree"] / tokens,
                 mean_kl=acc["kl"] / tokens)
        report["variants"][name] = r
        met = r["vs_fp32"] <= TARGET_PPL and r["top1_agreement"] >= TARGET_TOP1
        rows.append((name, f"{ppl:.4f}", f"{100 * r['vs_fp32']:+.3f}%", f"{100 * r['top1_agreement']:.2f}%",
                     f"{r['mean_kl']:.2e}", "" if name == "float32" else "met" if met else "NOT met"))
    print(f"\nFP8 KV with a request's last pages exact: {args.model}, {args.seqs} x {args.seq_len} tokens of "
          f"CPython's pydoc_data text, {BLOCK}-token page-aligned chunks\n")
    print(format_table(("kv", "perplexity", "vs fp32", "top-1 agree", "mean KL",
                        f"target (+{100 * TARGET_PPL:.1f}%, {100 * TARGET_TOP1:.0f}%)"), rows))
    report["seconds"] = time.perf_counter() - t0
    write_report(args.out, report, indent=1)
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
