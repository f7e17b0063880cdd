"""4-bit weights: AWQ (GEMM layout) and GPTQ checkpoints, kept 4-bit and run with our 4-bit product (float32 models
on an AVX-512 CPU: cpu_gemm.cpp ``linear_int4``, see OWN_CPU_KERNEL) or torch's int4 matmul.

What the tools write, per quantized linear with K inputs, N outputs and groups of ``g`` inputs:

=========  ===========================  ==============================================================
tensor     AWQ (AutoAWQ, version gemm)  GPTQ (AutoGPTQ / GPTQModel / optimum)
=========  ===========================  ==============================================================
qweight    int32 [K, N/8], 8 outputs    int32 [K/8, N], 8 inputs per word, nibble j = input 8i+j
           per word, interleaved
qzeros     int32 [K/g, N/8], as qweight int32 [K/g, N/8], nibble j = output 8c+j; format "gptq"
                                        stores zero - 1, "gptq_v2" the zero itself
scales     fp16 [K/g, N]                fp16 [K/g, N]
g_idx      (none: input i is in i // g) int32 [K]: the group of each input (desc_act shuffles it)
=========  ===========================  ==============================================================

AWQ's interleave: the 8 nibbles of a word, low to high, hold outputs 0, 2, 4, 6, 1, 3, 5, 7 of its 8.
Either way the weight is ``(q - zero[group]) * scale[group]``.

Our product keeps them in panels of 32 outputs (``pack_panels``: K x 16 bytes a panel, int8 zeros and fp16 scales
per group and output). Torch's keeps them in its int4 "tinygemm" layout (``_convert_weight_to_int4pack*``: N x K/2
bytes) with a [K/g, N, 2] table of (scale, offset) where ``w = (q - 8) * scale + offset``, i.e. offset = (8 - zero)
* scale. Both kernels want the inputs of a group next to each other; a desc_act checkpoint's inputs are
therefore sorted by group once at load and each activation row is gathered in the same order (as vLLM's
exllama path does). Where no kernel can run (CUDA without bf16, a group size torch's lacks where ours does not
serve, a g_idx whose groups are not all ``g`` long) the layer is dequantized at load and the log says so.

The checkpoint's quantization_config, read into a QuantSpec: quant_config.py.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch
import torch.nn.functional as F

from executor_svc.model.quant_config import QuantSpec

AWQ_ORDER = (0, 2, 4, 6, 1, 3, 5, 7)  # output held by nibble i of an AWQ word
AWQ_UNDO = tuple(AWQ_ORDER.index(j) for j in range(8))  # nibble holding output j
KERNEL_GROUP_SIZES = (32, 64, 128, 256)
# The dtype torch's CPU int4 matmul runs in. Only its bfloat16 path is vectorized (AVX-512/AVX2): one 4096 x
# 4096 linear, one row, one thread: 0.85 ms in bf16 against 29 ms in fp32 and 31 ms in fp16, and fp32 F.linear
# on the float weights takes 3.4 ms (bench/weights_4bit.py). So with --dtype float32 the 4-bit linears take
# bf16 activations and a bf16 scale table (logits within the tolerance tests/unit/test_weights_4bit.py states);
# None runs it in the compute dtype: exact against the dequantized weights but slow (tests use it to check
# the formats bit for bit).
CPU_KERNEL_DTYPE: torch.dtype | None = torch.bfloat16
# A float32 model on a CPU that builds our float32 product (executor_svc/model/cpu_gemm.cpp, AVX-512) runs its 4-bit
# linears through it instead: the weights dequantized exactly as Int4Weight.dequantize does, float32 activations,
# the same FMA chains as a float32 linear (bit for bit linear_f32 over the dequantized weights, whatever the batch).
# Tests turn it off to check torch's kernel.
OWN_CPU_KERNEL = True
_SHIFTS = torch.arange(0, 32, 4, dtype=torch.int32)


# ---- unpacking the checkpoint's tensors into (q [N, K], zeros [G, N], scales [G, N], g_idx [K]) --------


def unpack_cols(packed: torch.Tensor) -> torch.Tensor:
    """int32 [R, C] -> int32 [R, 8C]: nibble j of word c becomes column 8c + j."""
    return ((packed.unsqueeze(-1) >> _SHIFTS) & 0xF).reshape(packed.shape[0], -1)


def unpack_rows(packed: torch.Tensor) -> torch.Tensor:
    """int32 [R, C] -> int32 [8R, C]: nibble j of row r becomes row 8r + j."""
    return ((packed.unsqueeze(1) >> _SHIFTS[None, :, None]) & 0xF).reshape(-1, packed.shape[1])


@dataclass(slots=True)
class Int4Weight:
    """One linear's weight, unpacked: w[n, k] = (q[n, k] - zeros[g_idx[k], n]) * scales[g_idx[k], n]."""

    q: torch.Tensor  # int32 [N, K], 0..15
    zeros: torch.Tensor  # int32 [G, N]
    scales: torch.Tensor  # float32 [G, N]
    g_idx: torch.Tensor  # int64 [K]
    group_size: int

    def dequantize(self) -> torch.Tensor:
        z = self.zeros.index_select(0, self.g_idx).T.float()
        s = self.scales.index_select(0, self.g_idx).T
        return (self.q.float() - z) * s


def unpack_linear(spec: QuantSpec, t: dict[str, torch.Tensor], name: str) -> Int4Weight:
    """The tool's tensors for one linear (keys qweight, qzeros, scales[, g_idx]) checked and unpacked."""
    qweight, qzeros, scales = t["qweight"], t["qzeros"], t["scales"]
    if qweight.dtype != torch.int32 or qzeros.dtype != torch.int32:
        raise ValueError(f"{name}: qweight/qzeros must be int32, got {qweight.dtype}/{qzeros.dtype}")
    if spec.method == "awq":
        k, n = qweight.shape[0], qweight.shape[1] * 8
        q = unpack_cols(qweight).view(k, n // 8, 8)[:, :, list(AWQ_UNDO)].reshape(k, n).T.contiguous()
        zeros = unpack_cols(qzeros)
        zeros = zeros.view(zeros.shape[0], n // 8, 8)[:, :, list(AWQ_UNDO)].reshape(-1, n)
    else:
        k, n = qweight.shape[0] * 8, qweight.shape[1]
        q = unpack_rows(qweight).T.contiguous()
        zeros = unpack_cols(qzeros) + spec.zero_offset
    group = k if spec.group_size == -1 else spec.group_size
    groups = -(-k // group)
    if zeros.shape != (groups, n) or scales.shape != (groups, n):
        raise ValueError(f"{name}: qzeros/scales unpack to {tuple(zeros.shape)}/{tuple(scales.shape)}, expected "
                         f"[{groups}, {n}] for {k} inputs in groups of {group}")
    g_idx = t.get("g_idx")
    if g_idx is None:
        g_idx = torch.arange(k) // group
    g_idx = g_idx.to(torch.int64)
    if g_idx.shape != (k,) or int(g_idx.min()) < 0 or int(g_idx.max()) >= groups:
        raise ValueError(f"{name}: g_idx must hold {k} group numbers in [0, {groups})")
    return Int4Weight(q, zeros, scales.float(), g_idx, group)


# ---- the kernel -----------------------------------------------------------------------------------------


def kernel_for(device: torch.device, dtype: torch.dtype) -> str | None:
    """Which torch int4 matmul serves this device and compute dtype (None: dequantize at load)."""
    if device.type == "cpu" and hasattr(torch.ops.aten, "_weight_int4pack_mm_for_cpu"):
        return "cpu"
    if device.type == "cuda" and dtype == torch.bfloat16 and hasattr(torch.ops.aten, "_weight_int4pack_mm"):
        return "cuda"
    return None


def kernel_layout(w: Int4Weight, kernel: str = "cpu", own: bool = False) -> tuple[torch.Tensor | None, int] | None:
    """(input permutation or None, kernel group size) when the kernel can take w, else None. Both torch
    kernels want N % 16 == 0 (CPU packing) and K in whole groups of 32..256; CUDA's wants K % 128 too. Our product
    (``own``) takes any N and K in whole groups of any size."""
    n, k = w.q.shape
    if k % w.group_size:
        return None
    if not own and (w.group_size not in KERNEL_GROUP_SIZES or n % 16 or (kernel == "cuda" and k % 128)):
        return None
    contiguous = torch.arange(k) // w.group_size
    if torch.equal(w.g_idx, contiguous):
        return None, w.group_size
    perm = torch.argsort(w.g_idx, stable=True)
    if not torch.equal(w.g_idx[perm], contiguous):  # some group is not exactly group_size inputs long
        return None
    return perm, w.group_size


def own_kernel(device: torch.device, dtype: torch.dtype):
    """``torch.ops.pagedkv_cpu`` when its 4-bit product serves this device and model dtype (OWN_CPU_KERNEL), else
    None."""
    if not OWN_CPU_KERNEL or device.type != "cpu" or dtype != torch.float32:
        return None
    from executor_svc.model.cpu_linear import float32_kernel

    ops = float32_kernel()
    return ops if ops is not None and hasattr(ops, "linear_int4") else None


PANEL = 32  # output columns a panel of our product (cpu_gemm.cpp)


def fits_panels(w: Int4Weight) -> bool:
    """Whether our product's tables hold w exactly: its scales float16 values (a checkpoint's are), its zeros int8."""
    return (torch.equal(w.scales.half().float(), w.scales) and int(w.zeros.min()) >= -128
            and int(w.zeros.max()) <= 127)


def pack_panels(q: torch.Tensor, zeros: torch.Tensor, scales: torch.Tensor
                ) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """q [N, K] (0..15), zeros [G, N], scales [G, N] float32 (fits_panels) -> (packed uint8 [P, K, 16], zeros int8
    [P, G, 32], scales float16 [P, G, 32]) for linear_int4, P = ceil(N / 32): byte j of input k holds column j of
    the panel (low nibble) and column j + 16 (high); padding columns are zero."""
    n, k = q.shape
    pad = -n % PANEL
    if pad:
        q = F.pad(q, (0, 0, 0, pad))
        zeros, scales = F.pad(zeros, (0, pad)), F.pad(scales, (0, pad))
    panels = q.shape[0] // PANEL
    qp = q.to(torch.uint8).view(panels, PANEL, k)
    packed = (qp[:, :PANEL // 2] | (qp[:, PANEL // 2:] << 4)).transpose(1, 2).contiguous()  # [P, K, 16]
    groups = zeros.shape[0]

    def by_panel(t: torch.Tensor, dtype: torch.dtype) -> torch.Tensor:
        return t.to(dtype).view(groups, panels, PANEL).transpose(0, 1).contiguous()

    return packed, by_panel(zeros, torch.int8), by_panel(scales, torch.float16)


class Int4Linear:
    """y = x @ W.T + b with W held as int4 (one or more fused linears): in our product's panels (a float32 model on
    an AVX-512 CPU: own_kernel), else in torch's tinygemm layout."""

    def __init__(self, weights: list[Int4Weight], biases: list[torch.Tensor] | None, kernel: str,
                 perm: torch.Tensor | None, group_size: int, device: torch.device, dtype: torch.dtype,
                 own: bool = False) -> None:
        if perm is not None:
            weights = [Int4Weight(w.q[:, perm], w.zeros, w.scales, w.g_idx[perm], w.group_size) for w in weights]
        q = torch.cat([w.q for w in weights])
        scales = torch.cat([w.scales for w in weights], dim=1)
        zeros = torch.cat([w.zeros for w in weights], dim=1)
        self.dtype = dtype  # in and out
        self.perm = None if perm is None else perm.to(device=device, dtype=torch.int32)
        self.group_size = group_size
        self.in_features = q.shape[1]
        self.out_features = q.shape[0]
        self.bias = None if biases is None else torch.cat(biases).to(device=device, dtype=dtype)
        self.ours = own_kernel(device, dtype) if own else None
        if self.ours is not None:
            self.packed, self.zeros, self.scales = pack_panels(q, zeros, scales)
            self.kernel_dtype = torch.float32
            self.mm = None
            return
        offsets = (8 - zeros.float()) * scales
        self.kernel_dtype = (CPU_KERNEL_DTYPE or dtype) if kernel == "cpu" else dtype
        self.scales_and_zeros = torch.stack([scales, offsets], dim=-1).to(
            device=device, dtype=self.kernel_dtype).contiguous()
        if kernel == "cpu":
            self.packed = torch.ops.aten._convert_weight_to_int4pack_for_cpu(q.to(torch.int32), 2).to(device)
            self.mm = torch.ops.aten._weight_int4pack_mm_for_cpu
        else:
            nibbles = (q[:, ::2] << 4 | q[:, 1::2]).to(torch.uint8).to(device)
            self.packed = torch.ops.aten._convert_weight_to_int4pack(nibbles, 8)
            self.mm = torch.ops.aten._weight_int4pack_mm

    def __call__(self, x: torch.Tensor) -> torch.Tensor:
        shape = x.shape
        x = x.reshape(-1, self.in_features)
        if self.perm is not None:
            x = x.index_select(1, self.perm)
        if self.ours is not None:
            y = self.ours.linear_int4(x, self.packed, self.zeros, self.scales, self.out_features, self.bias)
            return y.reshape(*shape[:-1], self.out_features)
        y = self.mm(x.to(self.kernel_dtype).contiguous(), self.packed, self.group_size,
                    self.scales_and_zeros).to(self.dtype)
        if self.bias is not None:
            y = y + self.bias
        return y.reshape(*shape[:-1], self.out_features)

    def nbytes(self) -> int:
        extra = 0 if self.perm is None else self.perm.numel() * self.perm.element_size()
        bias = 0 if self.bias is None else self.bias.numel() * self.bias.element_size()
        tables = (self.zeros, self.scales) if self.ours is not None else (self.scales_and_zeros,)
        return sum(t.numel() * t.element_size() for t in (self.packed, *tables)) + extra + bias


class DenseLinear:
    """y = x @ W.T + b with a float weight (unquantized checkpoints, and the dequantize fallback)."""

    def __init__(self, weight: torch.Tensor, bias: torch.Tensor | None) -> None:
        self.weight = weight
        self.bias = bias

    def __call__(self, x: torch.Tensor) -> torch.Tensor:
        return F.linear(x, self.weight, self.bias)

    def nbytes(self) -> int:
        bias = 0 if self.bias is None else self.bias.numel() * self.bias.element_size()
        return self.weight.numel() * self.weight.element_size() + bias


def build_int4(weights: list[Int4Weight], biases: list[torch.Tensor] | None, device: torch.device,
               dtype: torch.dtype) -> tuple[Int4Linear | DenseLinear, str]:
    """One fused linear over weights (same inputs): the int4 kernel when it can take them all with the same
    input order, else dequantized. Returns the linear and what was chosen ("int4-cpu", "dequantized: why")."""
    kernel = kernel_for(device, dtype)
    own = kernel == "cpu" and own_kernel(device, dtype) is not None and all(fits_panels(w) for w in weights)
    layouts = [kernel_layout(w, kernel or "cpu", own) for w in weights]
    why = None
    if kernel in _FAILED_SELF_CHECK:
        why = _FAILED_SELF_CHECK[kernel]
    elif kernel is None:
        why = f"no int4 kernel for {device.type} with {str(dtype).removeprefix('torch.')}"
    elif any(lay is None for lay in layouts):
        why = f"group size {weights[0].group_size} or g_idx the kernel cannot take"
    elif len({lay[1] for lay in layouts}) > 1 or not all(
            _same_perm(layouts[0][0], lay[0]) for lay in layouts[1:]):
        why = None  # each can run alone: split the fusion
        parts = [build_int4([w], None if biases is None else [b], device, dtype)[0]
                 for w, b in zip(weights, biases or [None] * len(weights))]
        return _Concat(parts), f"int4-{kernel} (unfused: different input orders)"
    if why is not None:
        weight = torch.cat([w.dequantize() for w in weights]).to(device=device, dtype=dtype)
        bias = None if biases is None else torch.cat(biases).to(device=device, dtype=dtype)
        return DenseLinear(weight, bias), f"dequantized ({why})"
    perm, group = layouts[0]
    linear = Int4Linear(weights, biases, kernel, perm, group, device, dtype, own)
    if kernel not in _PASSED_SELF_CHECK:
        failure = _self_check(linear, weights, device, dtype)
        if failure:
            _FAILED_SELF_CHECK[kernel] = f"the int4-{kernel} kernel failed its load-time check: {failure}"
            return build_int4(weights, biases, device, dtype)
        _PASSED_SELF_CHECK.add(kernel)
    return linear, f"int4-{kernel}"


_PASSED_SELF_CHECK: set[str] = set()
_FAILED_SELF_CHECK: dict[str, str] = {}


def _self_check(linear: Int4Linear, weights: list[Int4Weight], device: torch.device, dtype: torch.dtype) -> str:
    """The first linear built for a kernel, against its dequantized weight on random rows ("" when equal
    within the compute dtype's rounding). Guards a device whose kernel this code was not run on."""
    try:
        x = torch.randn(3, linear.in_features, generator=torch.Generator().manual_seed(0))
        want = x @ torch.cat([w.dequantize() for w in weights]).T
        got = linear(x.to(device=device, dtype=dtype)).float().cpu()
        if linear.bias is not None:
            got = got - linear.bias.float().cpu()
    except RuntimeError as err:
        return str(err).splitlines()[0][:200]
    tol = 1e-4 if linear.kernel_dtype == torch.float32 else 3e-2
    err = (got - want).abs().max().item() / max(want.abs().max().item(), 1e-6)
    return "" if err <= tol else f"relative error {err:.3g} > {tol}"


def _same_perm(a: torch.Tensor | None, b: torch.Tensor | None) -> bool:
    return (a is None and b is None) or (a is not None and b is not None and torch.equal(a, b))


class _Concat:
    """Several linears over the same input whose outputs are concatenated (a fusion the kernel could not do)."""

    def __init__(self, parts: list) -> None:
        self.parts = parts

    def __call__(self, x: torch.Tensor) -> torch.Tensor:
        return torch.cat([p(x) for p in self.parts], dim=-1)

    def nbytes(self) -> int:
        return sum(p.nbytes() for p in self.parts)
