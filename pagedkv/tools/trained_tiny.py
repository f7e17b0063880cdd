"""A tiny Llama that has learned something: trained for a few minutes on CPU on Python's own standard
library source (text already on every machine that runs pagedkv), for measuring what KV quantization costs.

A random-weight model's logits say little about quantization error; this one predicts Python source bytes
(see training.json in its directory for the loss reached). Byte tokenizer as tiny-llama; head_dim 64.
Built once and cached beside tiny-llama (``tiny-llama-trained-<version>``); deterministic for a given Python
stdlib and torch build (fixed seed, one thread, fixed step count).

    python -m pagedkv.tools.trained_tiny [--steps N]   # build (or find) it; prints the path
"""

from __future__ import annotations

import argparse
import json
import math
import os
import sysconfig
import time
import zlib
from pathlib import Path

import torch

VERSION = "v1"
NAME = f"tiny-llama-trained-{VERSION}"
SEED = 2024
SEQ = 128
BATCH = 16
STEPS = 240
LR = 3e-3


def persistent_cache_dir() -> Path:
    """The user cache even under the tests' hermetic PAGEDKV_CACHE_DIR: training takes minutes, so the model
    is built once per machine (PAGEDKV_TRAINED_CACHE_DIR overrides)."""
    root = os.environ.get("PAGEDKV_TRAINED_CACHE_DIR") or os.path.join(
        os.environ.get("XDG_CACHE_HOME") or os.path.expanduser("~/.cache"), "pagedkv")
    return Path(root)


def corpus() -> tuple[bytes, bytes]:
    """(train, held-out) bytes: the stdlib's top-level modules, split by file (a file in ten is held out)."""
    stdlib = Path(sysconfig.get_paths()["stdlib"])
    train, held = [], []
    for f in sorted(stdlib.glob("*.py")):
        text = f.read_bytes()
        (held if zlib.crc32(f.name.encode()) % 10 == 0 else train).append(text)
    return b"\n".join(train), b"\n".join(held)


def held_out_tokens(limit: int | None = None) -> list[int]:
    """Held-out text as token ids (byte b -> id b + 3, as the byte tokenizer maps it)."""
    data = corpus()[1]
    if limit is not None:
        data = data[:limit]
    return [b + 3 for b in data]


def build(out_dir: Path, steps: int = STEPS, log=print) -> Path:
    from transformers import LlamaConfig, LlamaForCausalLM

    from pagedkv.tools.random_model import build_byte_tokenizer

    threads = torch.get_num_threads()
    torch.set_num_threads(1)
    try:
        torch.manual_seed(SEED)
        config = LlamaConfig(vocab_size=259, hidden_size=256, intermediate_size=688, num_hidden_layers=3,
                             num_attention_heads=4, num_key_value_heads=2, max_position_embeddings=1024,
                             rms_norm_eps=1e-5, initializer_range=0.02, bos_token_id=1, eos_token_id=2,
                             pad_token_id=0, tie_word_embeddings=True, rope_theta=10000.0)
        model = LlamaForCausalLM(config).to(torch.float32)
        train, _ = corpus()
        data = torch.frombuffer(bytearray(train), dtype=torch.uint8).long() + 3
        opt = torch.optim.AdamW(model.parameters(), lr=LR, betas=(0.9, 0.95), weight_decay=0.01)
        gen = torch.Generator().manual_seed(SEED)
        t0 = time.monotonic()
        for step in range(steps):
            lr = LR * min(1.0, (step + 1) / 20) * (0.1 + 0.9 * 0.5 * (1 + math.cos(math.pi * step / steps)))
            for group in opt.param_groups:
                group["lr"] = lr
            starts = torch.randint(0, data.numel() - SEQ - 1, (BATCH,), generator=gen)
            x = torch.stack([data[s:s + SEQ + 1] for s in starts.tolist()])
            loss = model(input_ids=x[:, :-1], labels=x[:, :-1]).loss  # labels shift inside
            opt.zero_grad(set_to_none=True)
            loss.backward()
            torch.nn.utils.clip_grad_norm_(model.parameters(), 1.0)
            opt.step()
            if step % 40 == 0 or step == steps - 1:
                log(f"step {step} loss {loss.item():.3f} ({time.monotonic() - t0:.0f}s)")
        out_dir.mkdir(parents=True, exist_ok=True)
        model.save_pretrained(str(out_dir), safe_serialization=True)
        build_byte_tokenizer(out_dir)
        (out_dir / "training.json").write_text(json.dumps(dict(
            corpus="Python stdlib top-level *.py (crc32(name) % 10 != 0)", steps=steps, batch=BATCH, seq=SEQ,
            lr=LR, seed=SEED, final_loss=round(loss.item(), 4), seconds=round(time.monotonic() - t0, 1),
            torch=torch.__version__)))
    finally:
        torch.set_num_threads(threads)
    return out_dir


def trained_tiny_llama(steps: int = STEPS, log=print) -> Path:
    """The cached model directory, trained now when missing."""
    from pagedkv.models import build_atomically

    path = persistent_cache_dir() / NAME
    if not (path / "config.json").exists():
        build_atomically(path, lambda d: build(Path(d), steps, log))
    return path


if __name__ == "__main__":
    ap = argparse.ArgumentParser()
    ap.add_argument("--steps", type=int, default=STEPS)
    print(trained_tiny_llama(ap.parse_args().steps))
