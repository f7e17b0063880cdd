"""Random Hugging Face checkpoints of every supported family, with a byte-level tokenizer: tiny-llama (the tests'
model, ``pagedkv.models.resolve_model`` builds it once from a fixed seed) and the tests' and benchmarks' models."""

from __future__ import annotations

from pathlib import Path

TINY_LLAMA_SEED = 1234
SPECIAL_TOKENS = ["<unk>", "<s>", "</s>"]  # ids 0, 1, 2 as in Llama


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
    """Builds a random model of one of ARCHS (Llama, Qwen2, Qwen3, Mistral, Phi-3, Gemma 1/2, Gemma 3 text (alone
    or inside a multimodal Gemma 3 with a tiny vision tower),
    Mixtral, Qwen2-MoE, Qwen3-MoE style) with the byte tokenizer and saves it as HF files.

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
        Phi3Config,
        Phi3ForCausalLM,
        Qwen2Config,
        Qwen2ForCausalLM,
        Qwen3Config,
        Qwen3ForCausalLM,
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
    elif arch == "qwen3":  # head_dim is explicit in Qwen3 (its default, 128, ignores hidden_size)
        common.setdefault("head_dim", hidden_size // num_heads)
        config = Qwen3Config(**common, tie_word_embeddings=bool(tie_word_embeddings), rope_theta=1000000.0)
        cls = Qwen3ForCausalLM
    elif arch == "phi3":
        config = Phi3Config(**common, tie_word_embeddings=bool(tie_word_embeddings), rope_theta=10000.0,
                            sliding_window=sliding_window, original_max_position_embeddings=max_position_embeddings)
        cls = Phi3ForCausalLM
    elif arch == "gemma":  # Gemma 1: tied, gelu_pytorch_tanh, explicit head_dim (default 256)
        common.setdefault("head_dim", hidden_size // num_heads)
        common.setdefault("hidden_act", "gelu_pytorch_tanh")
        tie = True if tie_word_embeddings is None else tie_word_embeddings
        config = _family_config(arch)(**common, tie_word_embeddings=tie)
        cls = _family_class(arch)
    elif arch in ("gemma2", "gemma3", "gemma3_multimodal"):  # tied, gelu_pytorch_tanh, explicit head_dim
        common.setdefault("head_dim", hidden_size // num_heads)  # (Gemma's default is 256)
        common.setdefault("query_pre_attn_scalar", common["head_dim"])
        common.setdefault("hidden_activation", "gelu_pytorch_tanh")
        tie = True if tie_word_embeddings is None else tie_word_embeddings
        config = _family_config(arch)(**common, tie_word_embeddings=tie, sliding_window=sliding_window or 4096)
        if arch == "gemma3_multimodal":  # Gemma 3 4B+: the text model inside, with a tiny SigLIP vision tower
            config = _family_config(arch + "_outer")(
                text_config=config.to_dict(), tie_word_embeddings=tie, mm_tokens_per_image=4,
                vision_config=dict(hidden_size=32, intermediate_size=64, num_hidden_layers=1, num_attention_heads=2,
                                   image_size=28, patch_size=14))
        cls = _family_class(arch)
    elif arch in ("mixtral", "qwen2_moe", "qwen3_moe"):  # a few small experts, top-2
        common.setdefault("num_experts" if arch != "mixtral" else "num_local_experts", 4)
        common.setdefault("num_experts_per_tok", 2)
        if arch != "mixtral":
            common.setdefault("moe_intermediate_size", intermediate_size // 2)
        if arch == "qwen2_moe":
            common.setdefault("shared_expert_intermediate_size", intermediate_size)
        if arch == "qwen3_moe":
            common.setdefault("head_dim", hidden_size // num_heads)
        if arch == "mixtral":
            common["sliding_window"] = sliding_window
        config = _family_config(arch)(**common, tie_word_embeddings=bool(tie_word_embeddings))
        cls = _family_class(arch)
    else:
        raise ValueError(f"arch must be one of {', '.join(ARCHS)}, got {arch!r}")
    torch.manual_seed(seed)
    model = cls(config).to(torch.float32)
    with torch.no_grad():  # HF initialises biases to zero; make them matter
        for module in model.modules():
            if isinstance(module, torch.nn.Linear) and module.bias is not None:
                module.bias.normal_(0.0, initializer_range)
        for name, param in model.named_parameters():  # norms start at one (Gemma: zero); make them matter
            if arch.startswith("gemma") and name.endswith("norm.weight"):
                param.normal_(0.0, 0.3)
            elif name.endswith(("q_norm.weight", "k_norm.weight")):
                param.normal_(1.0, 0.3)
    if generation_eos is not None:
        model.generation_config.eos_token_id = list(generation_eos)
    model.save_pretrained(str(out_dir), safe_serialization=True)
    build_byte_tokenizer(out_dir)
    return out_dir


ARCHS = ("llama", "qwen2", "qwen3", "mistral", "phi3", "gemma", "gemma2", "gemma3", "gemma3_multimodal", "mixtral",
         "qwen2_moe", "qwen3_moe")


FAMILY_CLASSES = {  # arch -> transformers' (config class, causal-LM class), for the archs built generically
    "gemma": ("GemmaConfig", "GemmaForCausalLM"), "gemma2": ("Gemma2Config", "Gemma2ForCausalLM"),
    "gemma3": ("Gemma3TextConfig", "Gemma3ForCausalLM"),
    "gemma3_multimodal": ("Gemma3TextConfig", "Gemma3ForConditionalGeneration"),
    "gemma3_multimodal_outer": ("Gemma3Config", None), "mixtral": ("MixtralConfig", "MixtralForCausalLM"),
    "qwen2_moe": ("Qwen2MoeConfig", "Qwen2MoeForCausalLM"), "qwen3_moe": ("Qwen3MoeConfig", "Qwen3MoeForCausalLM"),
}


def _family_config(arch: str):
    import transformers

    return getattr(transformers, FAMILY_CLASSES[arch][0])


def _family_class(arch: str):
    import transformers

    return getattr(transformers, FAMILY_CLASSES[arch][1])


def build_tiny_llama(out_dir: Path) -> Path:
    return build_random_model(out_dir, arch="llama", seed=TINY_LLAMA_SEED)
