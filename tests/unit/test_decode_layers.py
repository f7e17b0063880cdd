"""A decode step's layers in one call (executor_svc/model/cpu_decode.cpp, ``decode_layers``) against the Python loop
over the same ops (LlamaModel._forward_fused): the same logits and the same pages, bit for bit, on models with and
without biases, with a model-wide sliding window, and with 4-bit linears (AWQ; GPTQ with desc_act, whose inputs are
reordered); and where the one call does not apply, the loop runs."""

from __future__ import annotations

import pytest
import torch

from executor_svc.attention import cpu_kernel
from executor_svc.model.cpu_linear import float32_kernel

pytestmark = [pytest.mark.unit, pytest.mark.skipif(cpu_kernel.unavailable_reason() is not None or
                                                   float32_kernel() is None,
                                                   reason="no CPU kernel library with our float32 product here")]


def _model(path, dtype=torch.float32):
    from executor_svc.model import load_model
    from executor_svc.model_config import ModelConfig

    cfg = ModelConfig.from_dir(path)
    return cfg, load_model(cfg, torch.device("cpu"), dtype)


def _decode_step(cfg, model, ctx_lens: list[int], seed: int, one_call: bool, window: int | None = None,
                 shared: int = 0):
    """A decode-only step of len(ctx_lens) requests over a pool filled with random K/V (fresh values, each request
    its own pages in a shuffled order, after ``shared`` pages that begin every table); returns (logits, the pool
    after the step, whether the one call ran, the pages attended as a shared prefix)."""
    from executor_svc.attention.metadata import AttentionMetadata, DecodeGroup
    from executor_svc.attention.torch_backend import TorchPagedAttention
    from executor_svc.kv_quant import parse_kv_dtype
    from executor_svc.pages import DevicePagePool

    block = 16
    g = torch.Generator().manual_seed(seed)
    widths = [-(-n // block) - shared for n in ctx_lens]
    num_pages = shared + sum(widths) + 3
    pool = DevicePagePool(cfg, num_pages, block, torch.float32, torch.device("cpu"),
                          parse_kv_dtype("auto", torch.float32))
    pool.pages.copy_(torch.randn(pool.pages.shape, generator=g))
    order = torch.randperm(num_pages - 1, generator=g)[:shared + sum(widths)] + 1
    tables = torch.zeros(len(ctx_lens), shared + max(widths), dtype=torch.long)
    tables[:, :shared] = order[:shared]
    start = shared
    for i, w in enumerate(widths):
        tables[i, shared:shared + w] = order[start:start + w]
        start += w
    ctx = torch.tensor(ctx_lens)
    pos = ctx - 1
    slot_pages = tables[torch.arange(len(ctx_lens)), pos // block]
    meta = AttentionMetadata(slot_pages, pos % block, [DecodeGroup(torch.arange(len(ctx_lens)), tables, ctx,
                                                                   in_order=True)], [], sliding_window=window)
    ids = torch.randint(3, cfg.vocab_size, (len(ctx_lens),), generator=g)
    attention = TorchPagedAttention(cfg.num_heads, cfg.num_kv_heads, cfg.head_dim, model.scale)
    model.decode_in_one_call = one_call
    ran = model.decode_stack(meta, pool, attention) is not None
    cascade = meta.decodes[0].shared_pages
    meta.decodes[0].shared_pages = None
    logits = model.forward(ids, pos, meta, pool, attention, torch.arange(len(ctx_lens)))
    return logits, pool.pages.clone(), ran, cascade


@pytest.fixture(scope="module")
def four_bit_dirs(tmp_path_factory, tiny_llama_dir, qwen2_dir):
    from pagedkv.tools.quantize import quantize_checkpoint

    tmp = tmp_path_factory.mktemp("four-bit")
    out = {"awq": quantize_checkpoint(tiny_llama_dir, tmp / "awq", method="awq", group_size=64)}
    # desc_act: one activation order for the linears over the same inputs, as GPTQ's (one Hessian an input), so
    # that q/k/v and gate/up stay fused with their inputs reordered (the tool draws an order a module)
    randperm = torch.randperm
    with pytest.MonkeyPatch.context() as mp:
        mp.setattr(torch, "randperm", lambda k, generator=None: randperm(k, generator=torch.Generator().manual_seed(k)))
        out["gptq"] = quantize_checkpoint(qwen2_dir, tmp / "gptq", method="gptq", group_size=32, desc_act=True)
    return out


MODELS = ["tiny-llama", "qwen2 (qkv bias)", "sliding window 40", "4-bit awq", "4-bit gptq desc_act (qwen2)"]


@pytest.mark.parametrize("which", MODELS)
@pytest.mark.parametrize("ctx_lens", [[37], [1, 16, 17, 70, 5, 33, 48, 129, 2]], ids=["batch1", "batch9"])
def test_one_call_equals_the_python_loop_bit_for_bit(which, ctx_lens, tiny_llama_dir, qwen2_dir, four_bit_dirs):
    if which.startswith("4-bit"):
        path = four_bit_dirs[which.split()[1]]
    else:
        path = qwen2_dir if which.startswith("qwen2") else tiny_llama_dir
    cfg, model = _model(path)
    if which.startswith("4-bit"):
        assert any(k.startswith("int4-cpu") for k in model.linear_kinds), model.linear_kinds
        assert which.endswith("awq") or model.layers[0].qkv.perm is not None, "desc_act must reorder inputs"
    window = 40 if which.startswith("sliding") else None
    got, got_pages, ran, _ = _decode_step(cfg, model, ctx_lens, seed=len(ctx_lens), one_call=True, window=window)
    assert ran, "the one call must apply to this step (else this test compares the loop with itself)"
    want, want_pages, ran, _ = _decode_step(cfg, model, ctx_lens, seed=len(ctx_lens), one_call=False, window=window)
    assert not ran
    assert torch.equal(got, want)
    assert torch.equal(got_pages, want_pages), "the step's K/V written to the same slots, with the same bits"


@pytest.mark.parametrize("which", ["tiny-llama", "4-bit gptq desc_act (qwen2)"])
def test_one_call_with_a_shared_prefix_equals_the_loop(which, tiny_llama_dir, four_bit_dirs):
    """Rows whose tables begin with the same pages (a cached prompt): the one call attends them as the loop's cascade
    does (paged_attention_shared, then each row's own keys merged), with the same bits."""
    cfg, model = _model(four_bit_dirs["gptq"] if which.startswith("4-bit") else tiny_llama_dir)
    shared = 29  # 464 tokens, x 9 rows: enough for a cascade (cascade.CASCADE_MIN_WORK)
    ctx_lens = [shared * 16 + n for n in (1, 40, 7, 16, 70, 3, 33, 2, 17)]
    got, got_pages, ran, cascade = _decode_step(cfg, model, ctx_lens, seed=5, one_call=True, shared=shared)
    assert ran and cascade.numel() == shared, "the one call must take this step, its shared prefix as a cascade"
    want, want_pages, ran, _ = _decode_step(cfg, model, ctx_lens, seed=5, one_call=False, shared=shared)
    assert not ran
    assert torch.equal(got, want)
    assert torch.equal(got_pages, want_pages)


def test_it_does_not_apply_where_the_loop_must_run(tiny_llama_dir, tmp_path):
    """A bfloat16 model (its linears are oneDNN's), a 4-bit model whose fused linears were split (each part its own
    input order), a request with a window of its own, and a step with a prefill chunk keep the loop."""
    from executor_svc.attention.metadata import AttentionMetadata, DecodeGroup, PrefillSegment
    from executor_svc.attention.torch_backend import TorchPagedAttention
    from executor_svc.kv_quant import parse_kv_dtype
    from executor_svc.pages import DevicePagePool

    cfg, model = _model(tiny_llama_dir)
    attention = TorchPagedAttention(cfg.num_heads, cfg.num_kv_heads, cfg.head_dim, model.scale)
    pool = DevicePagePool(cfg, 8, 16, torch.float32, torch.device("cpu"), parse_kv_dtype("auto", torch.float32))
    tables = torch.tensor([[1, 2]])

    def decode(**group) -> AttentionMetadata:
        return AttentionMetadata(torch.tensor([2]), torch.tensor([3]),
                                 [DecodeGroup(torch.arange(1), tables, torch.tensor([20]), in_order=True, **group)], [])

    assert model.decode_stack(decode(), pool, attention) is not None
    assert model.decode_stack(decode(sinks=torch.tensor([4]), windows=torch.tensor([8])), pool, attention) is None
    mixed = AttentionMetadata(torch.tensor([2, 3]), torch.tensor([3, 0]),
                              [DecodeGroup(torch.arange(1), tables, torch.tensor([20]), in_order=True)],
                              [PrefillSegment(1, 1, 1, torch.tensor([3]))])
    assert model.decode_stack(mixed, pool, attention) is None
    assert model.decode_stack(decode(), pool, TorchPagedAttention(cfg.num_heads, cfg.num_kv_heads, cfg.head_dim,
                                                                  model.scale, reference=True)) is None
    _, bf16 = _model(tiny_llama_dir, torch.bfloat16)
    pool16 = DevicePagePool(cfg, 8, 16, torch.bfloat16, torch.device("cpu"), parse_kv_dtype("auto", torch.bfloat16))
    assert bf16.decode_stack(decode(), pool16, attention) is None
    from pagedkv.tools.quantize import quantize_checkpoint

    _, split = _model(quantize_checkpoint(tiny_llama_dir, tmp_path / "q", method="gptq", group_size=32, desc_act=True))
    assert any("unfused" in k for k in split.linear_kinds), split.linear_kinds
    assert split.decode_stack(decode(), pool, attention) is None


def test_bad_arguments_are_refused_by_name(tiny_llama_dir):
    cfg, model = _model(tiny_llama_dir)
    ops = model.fused_ops()
    x = torch.randn(1, cfg.hidden_size)
    caches = [torch.zeros(4, 16, cfg.num_kv_heads, cfg.head_dim)] * cfg.num_layers
    one = torch.zeros(1, dtype=torch.long)
    cos = sin = torch.zeros(1, cfg.head_dim)
    with pytest.raises(RuntimeError, match="22 tensors a layer"):
        ops.decode_layers(x, [x] * 3, caches, caches, one.view(1, 1), one, one[:0], cos, sin, one, one, cfg.num_heads,
                          cfg.num_kv_heads, cfg.intermediate_size, 0, 1e-5, 0.1)
    with pytest.raises(RuntimeError, match="contiguous float32"):
        ops.decode_layers(x.double(), [x] * (22 * cfg.num_layers), caches, caches, one.view(1, 1), one, one[:0], cos,
                          sin, one, one, cfg.num_heads, cfg.num_kv_heads, cfg.intermediate_size, 0, 1e-5, 0.1)
