"""LoRA adapters made by PEFT itself over a tiny random checkpoint, PEFT's reference outputs for them, and our
executor's runner serving them in process (tests/unit/test_lora*.py)."""

from __future__ import annotations

import contextlib
import json
from pathlib import Path

import torch

from executor_svc.model_config import ModelConfig


def make_adapter(model_dir: Path, out: Path, r: int, targets: list[str], seed: int, rslora: bool = False,
                 alpha: float | None = None, base=None, **extra) -> Path:
    """An adapter saved by PEFT's own save_pretrained, lora_B drawn at random (PEFT starts it at zero, where the
    adapter would change nothing). ``base``: transformers' model of ``model_dir`` already loaded (a copy is used)."""
    import copy

    from peft import LoraConfig, get_peft_model
    from transformers import AutoModelForCausalLM

    torch.manual_seed(seed)
    base = copy.deepcopy(base) if base is not None else AutoModelForCausalLM.from_pretrained(str(model_dir),
                                                                                             dtype=torch.float32)
    config = LoraConfig(r=r, lora_alpha=alpha if alpha is not None else r, target_modules=targets,
                        use_rslora=rslora, lora_dropout=0.0, **extra)
    model = get_peft_model(base, config)
    g = torch.Generator().manual_seed(seed + 1000)
    with torch.no_grad():
        for name, p in model.named_parameters():
            if "lora_" in name:  # (A too: a larger A makes the adapters' greedy choices differ from the base's)
                p.copy_(torch.randn(p.shape, generator=g) * (0.15 if "lora_B" in name else 0.3))
    model.save_pretrained(str(out))
    return out


def edit_config(src: Path, dst: Path, **changes) -> Path:
    """A copy of an adapter directory with adapter_config.json fields changed (None: removed)."""
    dst.mkdir()
    for f in src.iterdir():
        (dst / f.name).write_bytes(f.read_bytes())
    config = json.loads((src / "adapter_config.json").read_text())
    for k, v in changes.items():
        if v is None:
            config.pop(k, None)
        else:
            config[k] = v
    (dst / "adapter_config.json").write_text(json.dumps(config))
    return dst


def peft_reference(model_dir: Path, adapters: dict[str, Path], base=None):
    """transformers' model (eager attention, fp32) with every adapter loaded into one PeftModel. ``base``: that
    model already loaded (PEFT changes it: not for other uses after)."""
    from peft import PeftModel
    from transformers import AutoModelForCausalLM

    if base is None:
        base = AutoModelForCausalLM.from_pretrained(str(model_dir), dtype=torch.float32, attn_implementation="eager")
    names = list(adapters)
    model = PeftModel.from_pretrained(base, str(adapters[names[0]]), adapter_name=names[0])
    for name in names[1:]:
        model.load_adapter(str(adapters[name]), adapter_name=name)
    return model.eval()


def peft_logits(model, adapter: str | None, prompt: list[int]) -> torch.Tensor:
    """[len(prompt), vocab] logits PEFT gives ``prompt`` under ``adapter`` (None: the base model)."""
    ids = torch.tensor([prompt])
    with torch.inference_mode():
        if adapter is None:
            with model.disable_adapter():
                return model(input_ids=ids).logits[0].float()
        model.set_adapter(adapter)
        return model(input_ids=ids).logits[0].float()


@contextlib.contextmanager
def one_torch_thread():
    """torch on one thread meanwhile: beside a server on two cores, PEFT's many small ops run ~20x faster so (with
    torch's two threads every op waits for the slower one: 12 greedy runs of 40 tokens on tiny-llama, 29 s vs 1.5 s)."""
    threads = torch.get_num_threads()
    torch.set_num_threads(1)
    try:
        yield
    finally:
        torch.set_num_threads(threads)


def peft_greedy(model, adapter: str | None, prompt: list[int], n: int) -> list[int]:
    """PEFT's greedy ``n`` ids after ``prompt`` (generate), past the end-of-sequence id as ``ignore_eos``."""
    ids = torch.tensor([prompt])
    kw = dict(input_ids=ids, attention_mask=torch.ones_like(ids), max_new_tokens=n, do_sample=False, pad_token_id=0,
              eos_token_id=None)  # (the model's own would stop generate there)
    with torch.inference_mode():
        if adapter is None:
            with model.disable_adapter():
                return model.generate(**kw)[0, len(prompt):].tolist()
        model.set_adapter(adapter)
        return model.generate(**kw)[0, len(prompt):].tolist()


def lora_runner(model_dir: Path, adapters: dict[str, Path], num_pages: int = 64, block_size: int = 16,
                fused: bool = True, max_rank: int = 64):
    """Our ModelRunner (torch backend, fp32, CPU) serving ``adapters``, as startup.py builds it. ``fused``: False
    runs the layers with torch's ops instead of the fused CPU ops."""
    from executor_svc.attention.torch_backend import TorchPagedAttention
    from executor_svc.kv_quant import parse_kv_dtype
    from executor_svc.lora.stack import LoraStack, load_adapters
    from executor_svc.model import load_model
    from executor_svc.pages import DevicePagePool
    from executor_svc.runner import ModelRunner

    cfg = ModelConfig.from_dir(model_dir)
    cpu = torch.device("cpu")
    loaded = load_adapters(list(adapters.items()), cfg, max_rank)
    model = load_model(cfg, cpu, torch.float32)
    if not fused:
        model._fused = False
    if loaded:
        model.lora = LoraStack(loaded, cfg, cpu, torch.float32)
    attention = TorchPagedAttention(cfg.num_heads, cfg.num_kv_heads, cfg.head_dim, model.scale)
    pool = DevicePagePool(cfg, num_pages, block_size, torch.float32, cpu, parse_kv_dtype("auto", torch.float32))
    return ModelRunner(model, pool, attention, cpu)


def slot_runner(model_dir: Path, startup: dict[str, Path], root: Path | None, slots: int, max_rank: int = 64,
                num_pages: int = 64):
    """Our ModelRunner with ``slots`` device slots and an AdapterStore (run-time loads from under ``root``), the
    ``startup`` adapters held and paged into the first slots, as startup.py builds it; returns (runner, store)."""
    from executor_svc.attention.torch_backend import TorchPagedAttention
    from executor_svc.kv_quant import parse_kv_dtype
    from executor_svc.lora.stack import LoraStack, load_adapters, slot_shape
    from executor_svc.lora.store import AdapterStore
    from executor_svc.model import load_model
    from executor_svc.pages import DevicePagePool
    from executor_svc.runner import ModelRunner

    cfg = ModelConfig.from_dir(model_dir)
    cpu = torch.device("cpu")
    loaded = load_adapters(list(startup.items()), cfg, max_rank)
    model = load_model(cfg, cpu, torch.float32)
    model.lora = LoraStack([], cfg, cpu, torch.float32, shape=slot_shape(loaded, cfg, max_rank if root else None),
                           slots=slots)
    store = AdapterStore(model.lora, cfg, max_rank, root)
    for k, adapter in enumerate(loaded):
        store.hold(adapter, runtime=False)
        if k < slots:
            store.page_in(adapter.name, k)
    attention = TorchPagedAttention(cfg.num_heads, cfg.num_kv_heads, cfg.head_dim, model.scale)
    pool = DevicePagePool(cfg, num_pages, 16, torch.float32, cpu, parse_kv_dtype("auto", torch.float32))
    return ModelRunner(model, pool, attention, cpu, adapters=store), store
