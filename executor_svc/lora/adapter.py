"""One PEFT LoRA adapter read for serving (``load_adapter``): its adapter_config.json checked field by field against
what this executor implements, and its adapter_model.safetensors tensor by tensor against the served model's shapes.

Every field this executor does not implement is refused unless it is at its "off" value, and so is a field this code
has never heard of (a newer PEFT's): an adapter that would be served differently from how PEFT runs it is never
served. A refusal is a ValueError naming the adapter, the file, the field or tensor, and the limit, at start-up.
"""

from __future__ import annotations

import json
import math
import re
from dataclasses import dataclass
from pathlib import Path

import torch

from executor_svc.model_config import ModelConfig

CONFIG_FILE = "adapter_config.json"
WEIGHTS_FILE = "adapter_model.safetensors"
ATTENTION = ("q_proj", "k_proj", "v_proj", "o_proj")
MLP = ("gate_proj", "up_proj", "down_proj")
TARGETS = ATTENTION + MLP

# Fields that change nothing in a served forward, and why they may be ignored.
IGNORED = {
    "task_type": "names PEFT's wrapper class; the decoder's forward is the same",
    "inference_mode": "a training switch (frozen weights)",
    "base_model_name_or_path": "a label; the tensors' shapes are checked against the served model instead",
    "revision": "the base model's hub revision: a label, as above",
    "init_lora_weights": "how A and B started before training; the saved weights are what is served",
    "lora_dropout": "dropout is off at inference",
    "peft_version": "the PEFT release that saved the adapter",
    "auto_mapping": "the PEFT class to rebuild it with",
    "megatron_core": "a module name, read only with megatron_config (refused when set)",
    "qalora_group_size": "read only with use_qalora (refused when set)",
    "runtime_config": "PEFT's options for its own process (GPU offload of DoRA's weights)",
}
# Fields this executor implements (``_check_config`` reads them).
IMPLEMENTED = ("peft_type", "r", "lora_alpha", "use_rslora", "target_modules")
# Fields refused unless at this "off" value; any other field must be unset (None, False, empty) as well.
OFF = {"bias": "none"}


@dataclass(frozen=True, slots=True, eq=False)
class LoraAdapter:
    name: str
    path: Path
    rank: int
    scale: float  # lora_alpha / r (use_rslora: lora_alpha / sqrt(r))
    targets: tuple[str, ...]  # the modules it has weights for, in TARGETS order
    weights: dict[tuple[int, str], tuple[torch.Tensor, torch.Tensor]]  # (layer, module) -> (A [r, in], B [out, r])

    def num_bytes(self, dtype: torch.dtype) -> int:
        """Bytes its A and B weights take in ``dtype`` (the model's: how the stack holds them)."""
        size = torch.empty(0, dtype=dtype).element_size()
        return sum((a.numel() + b.numel()) * size for a, b in self.weights.values())


def module_shapes(cfg: ModelConfig) -> dict[str, tuple[int, int]]:
    """(in_features, out_features) of each targetable module of the served model."""
    q, kv, h, i = cfg.num_heads * cfg.head_dim, cfg.num_kv_heads * cfg.head_dim, cfg.hidden_size, cfg.intermediate_size
    return {"q_proj": (h, q), "k_proj": (h, kv), "v_proj": (h, kv), "o_proj": (q, h),
            "gate_proj": (h, i), "up_proj": (h, i), "down_proj": (i, h)}


def check_model(name: str, cfg: ModelConfig, targets: tuple[str, ...]) -> None:
    """Refuses a served model whose layout this executor cannot add LoRA deltas to."""
    why = None
    if cfg.fused_projections:
        why = ("it stores q/k/v and gate/up fused (Phi-3's qkv_proj, gate_up_proj): LoRA on fused projections is "
               "not supported")
    elif cfg.quantization is not None:
        why = (f"its linears are 4-bit ({cfg.quantization.describe()}): LoRA over quantized base linears is not "
               "supported")
    elif cfg.language_model_only:
        why = "it is a multimodal checkpoint (a language model inside): LoRA on it is not supported"
    elif cfg.moe is not None and set(targets) & set(MLP):
        why = (f"it is a mixture-of-experts model: target_modules {sorted(set(targets) & set(MLP))} would reach its "
               "experts, which this executor cannot add LoRA to (attention modules only)")
    if why is not None:
        raise ValueError(f"adapter {name!r}: the served model {cfg.path} cannot take it: {why}")


def _unset(value) -> bool:
    return value is None or value is False or value == "" or value == {} or value == []


def _check_config(name: str, path: Path, config: dict, max_rank: int) -> tuple[int, float, tuple[str, ...]]:
    """(rank, scale, target modules) of a config every field of which is implemented or ignored."""
    where = f"adapter {name!r}: {path / CONFIG_FILE}"
    for field, value in config.items():
        if field in IMPLEMENTED or field in IGNORED:
            continue
        if field in OFF:
            if value != OFF[field]:
                raise ValueError(f"{where}: {field} = {value!r} is not supported (only {OFF[field]!r})")
        elif not _unset(value):
            raise ValueError(f"{where}: {field} = {json.dumps(value)[:200]} is not supported by this executor "
                             "(it serves plain LoRA: r, lora_alpha, use_rslora and target_modules)")
    if config.get("peft_type") != "LORA":
        raise ValueError(f"{where}: peft_type = {config.get('peft_type')!r} is not supported (only 'LORA')")
    rank = config.get("r")
    if not isinstance(rank, int) or isinstance(rank, bool) or not 1 <= rank <= max_rank:
        raise ValueError(f"{where}: r = {rank!r} is outside [1, {max_rank}] (--max-lora-rank)")
    alpha = config.get("lora_alpha", 8)
    if not isinstance(alpha, int | float) or isinstance(alpha, bool) or not math.isfinite(alpha):
        raise ValueError(f"{where}: lora_alpha = {alpha!r} must be a finite number")
    targets = config.get("target_modules")
    if isinstance(targets, str):  # (PEFT reads a string as a regular expression over whole module paths)
        raise ValueError(f"{where}: target_modules = {targets!r} is a regular expression (or 'all-linear'): give "
                         f"a list of module names from {list(TARGETS)}")
    if not isinstance(targets, list) or not targets or not all(isinstance(t, str) for t in targets):
        raise ValueError(f"{where}: target_modules = {targets!r} must be a non-empty list of module names")
    outside = sorted(set(targets) - set(TARGETS))
    if outside:
        raise ValueError(f"{where}: target_modules {outside} are not supported (only {list(TARGETS)})")
    scale = alpha / math.sqrt(rank) if config.get("use_rslora") else alpha / rank
    return rank, scale, tuple(t for t in TARGETS if t in targets)


_TENSOR = re.compile(r"base_model\.model\.model\.layers\.(\d+)\.(?:self_attn|mlp)\.(\w+)\.lora_([AB])\.weight")


def _read_weights(name: str, path: Path, cfg: ModelConfig, rank: int, targets: tuple[str, ...]
                  ) -> dict[tuple[int, str], tuple[torch.Tensor, torch.Tensor]]:
    """(layer, module) -> (A, B), each checked against the served model's shapes."""
    from safetensors.torch import load_file

    file = path / WEIGHTS_FILE
    where = f"adapter {name!r}: {file}"
    tensors = load_file(str(file))
    shapes = module_shapes(cfg)
    halves: dict[tuple[int, str], dict[str, torch.Tensor]] = {}
    for key, t in tensors.items():
        m = _TENSOR.fullmatch(key)
        module = m.group(2) if m else None
        group = "self_attn" if module in ATTENTION else "mlp"
        if m is None or module not in targets or f".{group}.{module}." not in key:
            raise ValueError(f"{where}: tensor {key!r} is not a LoRA weight of target_modules {list(targets)} "
                             "(base_model.model.model.layers.N.<self_attn|mlp>.<module>.lora_A/lora_B.weight)")
        layer = int(m.group(1))
        if layer >= cfg.num_layers:
            raise ValueError(f"{where}: tensor {key!r} is for layer {layer}, but the served model has "
                             f"{cfg.num_layers} layers (an adapter of another base model?)")
        fan_in, fan_out = shapes[module]
        want = (rank, fan_in) if m.group(3) == "A" else (fan_out, rank)
        if tuple(t.shape) != want:
            raise ValueError(f"{where}: tensor {key!r} has shape {list(t.shape)}, the served model needs "
                             f"{list(want)} (an adapter of another base model?)")
        if not t.is_floating_point():
            raise ValueError(f"{where}: tensor {key!r} is {t.dtype}, not a float tensor")
        halves.setdefault((layer, module), {})[m.group(3)] = t
    out = {}
    for (layer, module), pair in sorted(halves.items()):
        if len(pair) != 2:
            missing = "lora_B" if "A" in pair else "lora_A"
            raise ValueError(f"{where}: layer {layer} {module} has no {missing} weight")
        out[layer, module] = (pair["A"], pair["B"])
    if not out:
        raise ValueError(f"{where}: holds no LoRA weights")
    return out


def load_adapter(name: str, path: Path, cfg: ModelConfig, max_rank: int) -> LoraAdapter:
    """The adapter saved by PEFT in ``path`` (adapter_config.json, adapter_model.safetensors), checked for the
    served model ``cfg``."""
    path = Path(path)
    config_file = path / CONFIG_FILE
    if not config_file.is_file():
        raise ValueError(f"adapter {name!r}: {config_file} is missing (a PEFT adapter directory has "
                         f"{CONFIG_FILE} and {WEIGHTS_FILE})")
    if not (path / WEIGHTS_FILE).is_file():
        bin_only = (path / "adapter_model.bin").is_file()
        raise ValueError(f"adapter {name!r}: {path / WEIGHTS_FILE} is missing" + (
            ": only adapter_model.bin is there, and safetensors is required (a pickle may run code when loaded): "
            "save it with save_pretrained(..., safe_serialization=True)" if bin_only else ""))
    try:
        config = json.loads(config_file.read_text())
    except (OSError, ValueError) as err:
        raise ValueError(f"adapter {name!r}: {config_file} is not readable JSON: {err}") from None
    if not isinstance(config, dict):
        raise ValueError(f"adapter {name!r}: {config_file} is not a JSON object")
    rank, scale, targets = _check_config(name, path, config, max_rank)
    check_model(name, cfg, targets)
    weights = _read_weights(name, path, cfg, rank, targets)
    return LoraAdapter(name, path, rank, scale, tuple(t for t in TARGETS if any(m == t for _, m in weights)),
                       weights)
