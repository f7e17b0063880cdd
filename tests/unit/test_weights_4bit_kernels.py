"""4-bit weights without a checkpoint of their own: the tools' packing checked by hand (AWQ's interleaved outputs,
GPTQ's consecutive inputs and v1 zeros), linears that stay four-bit in memory, a device with no int4 kernel, and our
4-bit product (executor_svc/model/cpu_gemm.cpp) against the float32 product over the dequantized weights. Checkpoints
decoded as transformers does: test_weights_4bit.py."""

from __future__ import annotations

import pytest
import torch
import torch.nn.functional as F

from executor_svc.model import quant
from executor_svc.model.cpu_linear import float32_kernel
from executor_svc.model.quant import (
    AWQ_ORDER,
    Int4Weight,
    build_int4,
    fits_panels,
    pack_panels,
    unpack_linear,
)
from executor_svc.model.quant_config import QuantSpec
from pagedkv.tools.random_model import build_random_model
from tests.support.weights_4bit import load, needs_own, quantized

pytestmark = pytest.mark.unit

torch.set_num_threads(1)


# ---- the tools' packing, checked by hand (independent of the packer) -------------------------------------


def test_awq_words_hold_outputs_interleaved():
    word = torch.tensor([[0x76543210]], dtype=torch.int32)  # nibble i holds value i
    t = {"qweight": word.repeat(8, 1), "qzeros": torch.zeros(1, 1, dtype=torch.int32),
         "scales": torch.ones(1, 8, dtype=torch.float16)}
    w = unpack_linear(QuantSpec("awq", 8), t, "m")
    # output j sits in nibble AWQ_ORDER.index(j): 0, 2, 4, 6, 1, 3, 5, 7 low to high
    assert w.q[:, 0].tolist() == [AWQ_ORDER.index(j) for j in range(8)] == [0, 4, 1, 5, 2, 6, 3, 7]


def test_gptq_words_hold_consecutive_inputs_and_v1_zeros_are_stored_minus_one():
    qweight = torch.tensor([[0x76543210]], dtype=torch.int32)
    qzeros = torch.tensor([[0x77777777]], dtype=torch.int32)  # AutoGPTQ's symmetric zeros: 8 stored as 7
    t = {"qweight": qweight.repeat(1, 8), "qzeros": qzeros, "scales": torch.ones(1, 8, dtype=torch.float16),
         "g_idx": torch.zeros(8, dtype=torch.int32)}
    v1 = unpack_linear(QuantSpec("gptq", 8, zero_offset=1), t, "m")
    assert v1.q[0].tolist() == list(range(8)) and v1.zeros.unique().tolist() == [8]
    assert v1.dequantize()[0].tolist() == [float(i - 8) for i in range(8)]
    v2 = unpack_linear(QuantSpec("gptq", 8, zero_offset=0), t, "m")
    assert v2.zeros.unique().tolist() == [7]


# ---- memory ------------------------------------------------------------------------------------------------


@pytest.mark.parametrize("own", [True, False], ids=["our product", "torch's kernel"])
@pytest.mark.parametrize("group,limit", [(128, 0.3), (64, 0.3), (32, 0.32)])
def test_linears_stay_four_bit_in_memory(group, limit, own, tmp_path, monkeypatch):
    """Linear weights held vs the same weights in fp16: half a byte a weight, and a table per group and output:
    our product's int8 zero and fp16 scale (3 bytes), torch's kernel's bf16 (scale, offset) (4 bytes). Group 128 is
    what the tools write by default."""

    if own and quant.own_kernel(torch.device("cpu"), torch.float32) is None:
        pytest.skip("no AVX-512 build of our product here")
    monkeypatch.setattr(quant, "OWN_CPU_KERNEL", own)
    src = build_random_model(tmp_path / "src", seed=3, hidden_size=512, intermediate_size=1024, num_layers=1,
                             num_heads=4, num_kv_heads=4)
    q, ref = quantized(src, tmp_path, method="gptq", group_size=group)
    model = load(q)
    assert (model.layers[0].o.ours is not None) == own
    held = model.weight_bytes()["linears"]
    fp16 = load(ref).weight_bytes()["linears"] // 2  # the reference holds them in float32
    assert held <= limit * fp16, (held, fp16, held / fp16)
    assert held == fp16 // 4 + (3 if own else 4) * fp16 // 2 // group  # exactly: half a byte a weight + the table


# ---- fallback: dequantize at load, and say so --------------------------------------------------------------


def test_no_kernel_for_the_device_dequantizes():
    from executor_svc.model.quant import Int4Weight, build_int4, kernel_for

    assert kernel_for(torch.device("cpu"), torch.float32) == "cpu"
    assert kernel_for(torch.device("cuda"), torch.float16) is None  # torch's CUDA int4 matmul is bf16 only
    w = Int4Weight(torch.randint(0, 16, (8, 32), dtype=torch.int32), torch.full((1, 8), 8, dtype=torch.int32),
                   torch.rand(1, 8), torch.zeros(32, dtype=torch.int64), 32)
    linear, kind = build_int4([w], None, torch.device("meta"), torch.float32)
    assert kind.startswith("dequantized (no int4 kernel for meta")


# ---- our 4-bit product (executor_svc/model/cpu_gemm.cpp, linear_int4) ---------------------------------------


@needs_own
@pytest.mark.parametrize("n,k,group", [(96, 64, 32), (50, 128, 64), (576, 576, 32), (37, 256, 256), (200, 384, 128)])
def test_our_product_is_the_float32_product_over_the_dequantized_weights_bit_for_bit(n, k, group):
    """Every row count (1-8 dequantize in registers, more into a buffer; 200+ span two blocks of rows), a last panel
    part empty, with and without a bias: linear_int4 equals linear_f32 over Int4Weight.dequantize's weights, bit for
    bit, and F.linear within float32 noise."""
    ops = float32_kernel()
    g = torch.Generator().manual_seed(n + k)
    groups = k // group
    w = Int4Weight(torch.randint(0, 16, (n, k), generator=g), torch.randint(0, 17, (groups, n), generator=g),
                   (torch.rand(groups, n, generator=g) * 0.02).half().float(), torch.arange(k) // group, group)
    packed, zeros, scales = pack_panels(w.q, w.zeros, w.scales)
    dense = w.dequantize()
    as_f32 = ops.pack_linear_f32(dense)
    bias = torch.randn(n, generator=g)
    for m in (1, 2, 3, 4, 5, 8, 9, 17, 200, 401):
        x = torch.randn(m, k, generator=g)
        for b in (None, bias):
            got = ops.linear_int4(x, packed, zeros, scales, n, b)
            assert torch.equal(got, ops.linear_f32(x, as_f32, n, b)), (m, b is None)
            torch.testing.assert_close(got, F.linear(x, dense, b), rtol=1e-4, atol=1e-4)


@needs_own
def test_scales_that_are_not_float16_values_keep_torch_s_kernel():
    g = torch.Generator().manual_seed(1)
    w = Int4Weight(torch.randint(0, 16, (32, 64), generator=g), torch.randint(0, 16, (2, 32), generator=g),
                   torch.rand(2, 32, generator=g) * 0.01, torch.arange(64) // 32, 32)
    assert not fits_panels(w)  # float32 scales: no float16 table holds them exactly
    linear, kind = build_int4([w], None, torch.device("cpu"), torch.float32)
    assert kind == "int4-cpu" and linear.ours is None and linear.kernel_dtype == torch.bfloat16
    packed, zeros, scales = pack_panels(w.q, w.zeros, w.scales.half().float())
    with pytest.raises(RuntimeError, match="scales must be float16"):
        float32_kernel().linear_int4(torch.randn(1, 64), packed, zeros, scales.float(), 32, None)
