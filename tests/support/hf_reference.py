"""Reference outputs from Hugging Face transformers (eager attention, one prompt at a time, no padding)."""

from __future__ import annotations

from pathlib import Path

import torch


def hf_greedy(model_dir: Path, prompts: list[list[int]], max_new_tokens: list[int],
              dtype: torch.dtype = torch.float32, attn: str = "eager") -> list[list[int]]:
    from transformers import AutoModelForCausalLM

    model = AutoModelForCausalLM.from_pretrained(str(model_dir), attn_implementation=attn, dtype=dtype)
    model.eval()
    outs = []
    with torch.inference_mode():
        for prompt, n in zip(prompts, max_new_tokens):
            ids = torch.tensor([prompt])
            gen = model.generate(ids, attention_mask=torch.ones_like(ids), max_new_tokens=n, do_sample=False,
                                 pad_token_id=0)
            outs.append(gen[0, len(prompt):].tolist())
    return outs


def random_prompts(seed: int, lengths: list[int], vocab_size: int, first_id: int = 3) -> list[list[int]]:
    g = torch.Generator().manual_seed(seed)
    return [[1] + torch.randint(first_id, vocab_size, (n - 1,), generator=g).tolist() for n in lengths]


def hf_windowed_greedy(model_dir: Path, prompt: list[int], max_new_tokens: int, sink: int, window: int) -> list[int]:
    """Greedy decoding with dense attention under a sink + window mask, computed from scratch each step:
    token i attends to j when j <= i and (j < sink or j > i - window). No cache, nothing paged."""
    from transformers import AutoModelForCausalLM

    model = AutoModelForCausalLM.from_pretrained(str(model_dir), attn_implementation="eager", dtype=torch.float32)
    model.eval()
    ids = list(prompt)
    with torch.inference_mode():
        for _ in range(max_new_tokens):
            n = len(ids)
            i = torch.arange(n).view(-1, 1)
            j = torch.arange(n).view(1, -1)
            allowed = (j <= i) & ((j < sink) | (j > i - window))
            mask = torch.zeros(1, 1, n, n).masked_fill(~allowed, torch.finfo(torch.float32).min)
            logits = model(torch.tensor([ids]), attention_mask=mask).logits
            ids.append(int(logits[0, -1].argmax()))
    return ids[len(prompt):]



def hf_margins(model_dir: Path, cases: list[tuple[list[int], int, int]],
               dtype: torch.dtype) -> list[tuple[float, float]]:
    """For each (context, token a, token b), at the context's next position: |logit a - logit b| by transformers
    in fp32 (eager), and how far its ``dtype`` run's logits there stray from fp32 (max over the vocabulary): how
    close a tie a ``dtype`` run is entitled to break either way."""
    from transformers import AutoModelForCausalLM

    exact = AutoModelForCausalLM.from_pretrained(str(model_dir), attn_implementation="eager", dtype=torch.float32)
    low = AutoModelForCausalLM.from_pretrained(str(model_dir), attn_implementation="sdpa", dtype=dtype)
    out = []
    with torch.inference_mode():
        for context, a, b in cases:
            ids = torch.tensor([context])
            ref = exact(ids).logits[0, -1]
            noise = (low(ids).logits[0, -1].float() - ref).abs().max()
            out.append((abs(float(ref[a] - ref[b])), float(noise)))
    return out
