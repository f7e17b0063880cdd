"""Grammar engines for structured outputs, measured on this machine: xgrammar (what pagedkv uses) and llguidance
(only if installed; pagedkv does not need it). On the built-in real model's tokenizer (smollm2-135m-instruct, 49,152
tokens) and a nested JSON schema: the tokenizer's preparation, the schema's compile (first and cached), and per step
for 256 matchers the bitmask fill and the advance by one token; then the mask applied to [256, 49152] logits by
xgrammar's own CPU kernel, by llguidance's torch apply, and by pagedkv's batched torch op (grammar_mask.py).

    python bench/grammar_engines.py          # a table; JSON -> bench/results/grammar_engines.json
"""

from __future__ import annotations

import json
import statistics
import sys
import time
from pathlib import Path

import torch

ROOT = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(ROOT))

SCHEMA = {"type": "object", "properties": {
    "name": {"type": "string"}, "age": {"type": "integer"},
    "address": {"type": "object", "properties": {"city": {"type": "string"}, "zip": {"type": "string"}},
                "required": ["city", "zip"]},
    "tags": {"type": "array", "items": {"enum": ["a", "b", "c"]}, "maxItems": 4}},
    "required": ["name", "age", "address", "tags"]}
N = 256
PREFIX = '{"name": "Ada'  # every matcher mid-string: the widest masks (the costly state)


def timed(fn, repeat: int = 5) -> float:
    """Median ms of ``fn()``."""
    out = []
    for _ in range(repeat):
        t = time.perf_counter()
        fn()
        out.append((time.perf_counter() - t) * 1e3)
    return statistics.median(out)


def xgrammar_figures(tok, vocab: int, logits: torch.Tensor) -> dict:
    import xgrammar as xgr

    from executor_svc.grammar_mask import GrammarMask, constrain

    t = time.perf_counter()
    info = xgr.TokenizerInfo.from_huggingface(tok, vocab_size=vocab)
    info_ms = (time.perf_counter() - t) * 1e3
    compiler = xgr.GrammarCompiler(info, max_threads=2)
    t = time.perf_counter()
    compiled = compiler.compile_json_schema(json.dumps(SCHEMA))
    first = (time.perf_counter() - t) * 1e3
    cached = timed(lambda: compiler.compile_json_schema(json.dumps(SCHEMA)))
    matchers = [xgr.GrammarMatcher(compiled) for _ in range(N)]
    for m in matchers:
        for token in tok.encode(PREFIX, add_special_tokens=False):
            assert m.accept_token(token)
    bitmask = xgr.allocate_token_bitmask(N, vocab)
    batch = xgr.BatchGrammarMatcher(max_threads=2)
    fill = timed(lambda: batch.batch_fill_next_token_bitmask(matchers, bitmask))
    fill_loop = timed(lambda: [m.fill_next_token_bitmask(bitmask, i) for i, m in enumerate(matchers)])
    token = tok.encode("x", add_special_tokens=False)[0]

    def advance():
        for m in matchers:
            m.accept_token(token)
        for m in matchers:
            m.rollback(1)
    adv = timed(advance) / 2  # (accept and roll back: about half each)
    own = timed(lambda: xgr.apply_token_bitmask_inplace(logits.clone(), bitmask), repeat=3)
    ours = timed(lambda: constrain(logits, logits, GrammarMask(list(range(N)), bitmask)))
    return {"tokenizer_info_ms": round(info_ms, 1), "compile_first_ms": round(first, 2),
            "compile_cached_ms": round(cached, 3), "fill_256_ms": round(fill, 2),
            "fill_256_loop_ms": round(fill_loop, 2), "advance_256_ms": round(adv, 2),
            "apply_own_cpu_ms": round(own, 1), "apply_pagedkv_torch_ms": round(ours, 1)}


def llguidance_figures(tok, vocab: int, logits: torch.Tensor) -> dict | None:
    try:
        import llguidance
        import llguidance.hf
        import llguidance.torch
    except ImportError:
        return None
    t = time.perf_counter()
    lltok = llguidance.hf.from_tokenizer(tok, n_vocab=vocab)
    info_ms = (time.perf_counter() - t) * 1e3
    grammar = llguidance.LLMatcher.grammar_from_json_schema(json.dumps(SCHEMA))
    t = time.perf_counter()
    matchers = [llguidance.LLMatcher(lltok, grammar) for _ in range(N)]
    first = (time.perf_counter() - t) * 1e3 / N
    for m in matchers:
        m.consume_tokens(tok.encode(PREFIX, add_special_tokens=False))
    bitmask = llguidance.torch.allocate_token_bitmask(N, vocab)
    fill = timed(lambda: [llguidance.torch.fill_next_token_bitmask(m, bitmask, i) for i, m in enumerate(matchers)])
    apply = timed(lambda: llguidance.torch.apply_token_bitmask_inplace(logits.clone(), bitmask))
    return {"tokenizer_info_ms": round(info_ms, 1), "matcher_create_ms": round(first, 3),
            "fill_256_ms": round(fill, 2), "apply_torch_ms": round(apply, 1)}


def main() -> None:
    from transformers import AutoTokenizer

    from pagedkv.models import resolve_model

    torch.set_num_threads(2)
    path = resolve_model("smollm2-135m-instruct")
    tok = AutoTokenizer.from_pretrained(path)
    vocab = 49152
    logits = torch.randn(N, vocab)
    report = {"model": "smollm2-135m-instruct", "vocab": vocab, "matchers": N,
              "xgrammar": xgrammar_figures(tok, vocab, logits), "llguidance": llguidance_figures(tok, vocab, logits)}
    for engine in ("xgrammar", "llguidance"):
        figures = report[engine]
        print(f"{engine}: " + (", ".join(f"{k} {v}" for k, v in figures.items()) if figures else "not installed"))
    out = ROOT / "bench" / "results" / "grammar_engines.json"
    out.parent.mkdir(parents=True, exist_ok=True)
    out.write_text(json.dumps(report, indent=2))
    print(f"-> {out}")


if __name__ == "__main__":
    main()
