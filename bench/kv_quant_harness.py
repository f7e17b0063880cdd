"""kv_quant.py part 3: quality against float32 KV through the executor's own model, page pool and torch backend
(``Harness``: hand-built step metadata), on a trained tiny Llama's held-out text or a real model's fixed text:
perplexity, top-1 agreement, KL and greedy continuations per KV dtype. bench/flagship.py uses the harness too."""

from __future__ import annotations

import math
from pathlib import Path

import torch
import torch.nn.functional as F

from executor_svc.attention.metadata import AttentionMetadata, DecodeGroup, PrefillSegment
from executor_svc.attention.torch_backend import TorchPagedAttention
from executor_svc.kv_quant import parse_kv_dtype
from executor_svc.kv_tail import ExactTail, tail_pages
from executor_svc.model import load_model
from executor_svc.model_config import ModelConfig
from executor_svc.pages import DevicePagePool
from pagedkv.tools.trained_tiny import held_out_tokens

# "+tailN": the exact tail's length in pages (executor_svc/kv_tail.py); without it, the executor's default for the
# format (FP8: 2 pages on the torch backend). "fp8_e4m3+tail0" is FP8 without it.
KV_DTYPES = ("float32", "bfloat16", "float16", "fp8_e4m3", "fp8_e4m3+tail0", "int8")


# ---- 3. quality on the trained model --------------------------------------------------------------------
class Harness:
    """The executor's model over a page pool of one KV dtype, driven with hand-built step metadata."""

    def __init__(self, model, cfg: ModelConfig, kv_dtype: str, num_pages: int, block: int = 16) -> None:
        self.model, self.block = model, block
        name, _, tail = kv_dtype.partition("+tail")
        fmt = parse_kv_dtype(name, torch.float32)
        self.pool = DevicePagePool(cfg, num_pages, block, torch.float32, torch.device("cpu"), fmt)
        pages = tail_pages(int(tail) if tail else None, fmt.name, "torch")
        if pages:  # (a slot for every page: the slab is never short here)
            self.pool.attach_tail(ExactTail(num_pages, cfg.num_layers, block, cfg.num_kv_heads, cfg.head_dim, pages,
                                            num_pages, torch.device("cpu")))
        self.attn = TorchPagedAttention(cfg.num_heads, cfg.num_kv_heads, cfg.head_dim, model.scale)
        self.held: dict[int, tuple[list[int], int]] = {}  # sequences by first page: (table, length), as the executor

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
        self.held[pages[0]] = (pages, ctx)
        if self.pool.tail is not None:  # (as the runner: every sequence held, and the step's rows)
            self.pool.tail.prepare(list(self.held.values()), [(pages, start, n)], sp, so)
        return self.model.forward(torch.tensor(tokens), torch.arange(start, ctx), meta, self.pool, self.attn,
                                  torch.arange(n))

    def decode(self, tokens: list[int], ctx_lens: list[int], tables: list[list[int]]) -> torch.Tensor:
        """One new token per sequence, at position ctx_len - 1."""
        b = len(tokens)
        sp = torch.tensor([t[(c - 1) // self.block] for t, c in zip(tables, ctx_lens)])
        so = torch.tensor([(c - 1) % self.block for c in ctx_lens])
        group = DecodeGroup(torch.arange(b), torch.tensor(tables), torch.tensor(ctx_lens))
        meta = AttentionMetadata(sp, so, [group], [])
        self.held.update((t[0], (t, c)) for t, c in zip(tables, ctx_lens))
        if self.pool.tail is not None:
            self.pool.tail.prepare(list(self.held.values()), [(t, c - 1, 1) for t, c in zip(tables, ctx_lens)], sp, so)
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
            gen_len: int, data: list[int] | None = None, kv_dtypes: tuple[str, ...] = KV_DTYPES) -> dict:
    """``kv_dtypes``: float32 first (the reference)."""
    cfg = ModelConfig.from_dir(model_dir)
    model = load_model(cfg, torch.device("cpu"), torch.float32)
    data = held_out_tokens() if data is None else data
    seqs = [data[i * seq_len:(i + 1) * seq_len] for i in range(num_seqs)]
    pages = list(range(seq_len // 16))
    if kv_dtypes[0] != "float32":
        raise ValueError(f"the KV dtypes must start with float32 (the reference), got {kv_dtypes}")
    harness = {name: Harness(model, cfg, name, len(pages)) for name in kv_dtypes}
    sums = {name: dict(nll=0.0, agree=0, kl=0.0, max_kl=0.0) for name in kv_dtypes}
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
    for name in kv_dtypes:
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
    for name in kv_dtypes:
        firsts = []
        for a, b in zip(gens[name], gens["float32"]):
            firsts.append(next((i for i, (x, y) in enumerate(zip(a, b)) if x != y), gen_len))
        out[name]["first_divergence"] = firsts
        out[name]["identical_continuations"] = sum(f == gen_len for f in firsts)
    return out
