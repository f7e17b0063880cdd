"""Model directories: resolve a name or path, and build small random HF checkpoints.

The built-in ``tiny-llama`` is generated from a fixed seed and saved once as an ordinary
Hugging Face directory (config.json, model.safetensors, tokenizer.json), so serving it goes
through the same loader as any real checkpoint. Nothing is ever downloaded.
"""

from __future__ import annotations

import os
import shutil
import tempfile
from pathlib import Path

BUILTIN_MODELS = {"tiny-llama"}
TINY_LLAMA_VERSION = "v1"
TINY_LLAMA_SEED = 1234

SPECIAL_TOKENS = ["<unk>", "<s>", "</s>"]  # ids 0, 1, 2 as in Llama


def cache_dir() -> Path:
    root = os.environ.get("PAGEDKV_CACHE_DIR") or os.path.join(
        os.environ.get("XDG_CACHE_HOME") or os.path.expanduser("~/.cache"), "pagedkv"
    )
    return Path(root)


def resolve_model(name_or_dir: str) -> Path:
    """Returns the local HF directory for a built-in name or an existing directory."""
    if name_or_dir in BUILTIN_MODELS:
        path = cache_dir() / f"{name_or_dir}-{TINY_LLAMA_VERSION}"
        if not (path / "config.json").exists():
            _build_atomically(path, lambda d: build_tiny_llama(d))
        return path
    path = Path(name_or_dir).expanduser()
    if not (path / "config.json").is_file():
        raise FileNotFoundError(
            f"--model {name_or_dir!r}: not a built-in model ({', '.join(sorted(BUILTIN_MODELS))}) "
            "and not a directory with config.json (hub downloads are not supported; pass a local HF directory)"
        )
    return path.resolve()


def _build_atomically(path: Path, build) -> None:
    path.parent.mkdir(parents=True, exist_ok=True)
    tmp = Path(tempfile.mkdtemp(prefix=path.name + ".", dir=path.parent))
    try:
        build(tmp)
        try:
            os.rename(tmp, path)
        except OSError:  # another process won the race; its copy is identical
            if not (path / "config.json").exists():
                raise
    finally:
        shutil.rmtree(tmp, ignore_errors=True)


def build_byte_tokenizer(out_dir: Path) -> None:
    """A byte-level tokenizer: 3 special tokens then one token per byte (vocab 259)."""
    from tokenizers import Tokenizer, decoders, models, pre_tokenizers, processors
    from transformers import PreTrainedTokenizerFast

    alphabet = [byte_to_char()[b] for b in range(256)]
    assert set(alphabet) == set(pre_tokenizers.ByteLevel.alphabet())
    vocab = {tok: i for i, tok in enumerate(SPECIAL_TOKENS)}
    for ch in alphabet:
        vocab[ch] = len(vocab)
    tok = Tokenizer(models.BPE(vocab=vocab, merges=[], unk_token="<unk>"))
    tok.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False, use_regex=False)
    tok.decoder = decoders.ByteLevel()
    tok.post_processor = processors.TemplateProcessing(
        single="<s> $A", pair="<s> $A <s> $B", special_tokens=[("<s>", 1)]
    )
    fast = PreTrainedTokenizerFast(
        tokenizer_object=tok, bos_token="<s>", eos_token="</s>", unk_token="<unk>", pad_token="<unk>"
    )
    fast.save_pretrained(str(out_dir))


def byte_to_char() -> dict[int, str]:
    """The byte-level BPE alphabet: printable bytes map to themselves, the rest to code points >= 256."""
    printable = [*range(ord("!"), ord("~") + 1), *range(ord("\xa1"), ord("\xac") + 1),
                 *range(ord("\xae"), ord("\xff") + 1)]
    table, extra = {}, 0
    for b in range(256):
        if b in printable:
            table[b] = chr(b)
        else:
            table[b] = chr(256 + extra)
            extra += 1
    return table


def build_random_model(
    out_dir: Path,
    *,
    arch: str = "llama",
    seed: int = TINY_LLAMA_SEED,
    hidden_size: int = 256,
    intermediate_size: int = 768,
    num_layers: int = 4,
    num_heads: int = 8,
    num_kv_heads: int = 4,
    max_position_embeddings: int = 2048,
    initializer_range: float = 0.1,
    tie_word_embeddings: bool | None = None,
    sliding_window: int | None = None,
    config_overrides: dict | None = None,
    generation_eos: list[int] | None = None,
) -> Path:
    """Builds a random Llama- or Qwen2-style model with the byte tokenizer and saves it as HF files.

    ``initializer_range`` is larger than usual so that greedy choices are not near-ties: token-exact
    comparisons against transformers must not hinge on the last bit of a float. ``config_overrides`` go
    into the transformers config as given (``hidden_act``, ``mlp_bias``, ``head_dim``, ...); every bias
    the model then has is drawn at random (transformers starts them at zero, where they would not matter).
    ``generation_eos`` writes generation_config.json's ``eos_token_id`` (as Llama-3-Instruct does).
    """
    import torch
    from transformers import (
        LlamaConfig,
        LlamaForCausalLM,
        MistralConfig,
        MistralForCausalLM,
        Qwen2Config,
        Qwen2ForCausalLM,
    )

    out_dir = Path(out_dir)
    out_dir.mkdir(parents=True, exist_ok=True)
    common = dict(
        vocab_size=len(SPECIAL_TOKENS) + 256,
        hidden_size=hidden_size,
        intermediate_size=intermediate_size,
        num_hidden_layers=num_layers,
        num_attention_heads=num_heads,
        num_key_value_heads=num_kv_heads,
        max_position_embeddings=max_position_embeddings,
        rms_norm_eps=1e-5,
        initializer_range=initializer_range,
        bos_token_id=1,
        eos_token_id=2,
        pad_token_id=0,
    )
    common.update(config_overrides or {})
    if arch == "llama":
        config = LlamaConfig(**common, tie_word_embeddings=bool(tie_word_embeddings), rope_theta=10000.0)
        cls = LlamaForCausalLM
    elif arch == "qwen2":
        tie = True if tie_word_embeddings is None else tie_word_embeddings
        config = Qwen2Config(**common, tie_word_embeddings=tie, rope_theta=1000000.0)
        cls = Qwen2ForCausalLM
    elif arch == "mistral":
        config = MistralConfig(**common, tie_word_embeddings=bool(tie_word_embeddings), rope_theta=10000.0,
                               sliding_window=sliding_window)
        cls = MistralForCausalLM
    else:
        raise ValueError(f"arch must be 'llama', 'qwen2' or 'mistral', got {arch!r}")
    torch.manual_seed(seed)
    model = cls(config).to(torch.float32)
    with torch.no_grad():  # HF initialises biases to zero; make them matter
        for module in model.modules():
            if isinstance(module, torch.nn.Linear) and module.bias is not None:
                module.bias.normal_(0.0, initializer_range)
    if generation_eos is not None:
        model.generation_config.eos_token_id = list(generation_eos)
    model.save_pretrained(str(out_dir), safe_serialization=True)
    build_byte_tokenizer(out_dir)
    return out_dir


def build_tiny_llama(out_dir: Path) -> Path:
    return build_random_model(out_dir, arch="llama", seed=TINY_LLAMA_SEED)
