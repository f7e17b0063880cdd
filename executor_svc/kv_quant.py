"""KV cache data types: full precision, or 8-bit (FP8 E4M3, INT8) with scales stored inside the page.

The seeds' tiers: FP8 KV is the quality default (loss almost imperceptible, half the KV memory); INT8 KV
for maximum concurrency (1-3% loss on some long maths/code tasks); INT4 KV: don't (poor kernel support and a
clear loss in quality). Weight quantization and KV quantization are independent switches.

Quantized page layout (one contiguous block of ``page_bytes`` across layers, DESIGN decision 3)::

    page[num_layers, K region ++ V region] (uint8)
    V region (both formats), K region (fp8):  data[block_size, kv_heads, head_dim] (1 byte each)
                                              ++ scales[block_size, kv_heads] (bfloat16)
    K region (int8):                          data[block_size, kv_heads, head_dim]
                                              ++ scale exponents[kv_heads, head_dim] (uint8)

Scales are computed when a token is written (no calibration step). The granularity was chosen by measurement
(bench/kv_quant.py; bench/NOTES.md "KV quantization"), on K/V with outlier channels:

- Per (token, KV head), bfloat16: the head vector's absolute maximum over the format's largest value (448
  for E4M3, 127 for INT8), rounded to bfloat16; the data is quantized with the rounded scale, so
  ``data * scale`` is the dequantized value. FP8 K and V, and INT8 V, use it: a float format keeps its
  relative precision across a vector's outlier channels, and V's outliers are per token.
- INT8 K: per (page, KV head, channel) (as KIVI; the seeds' per-channel symmetric INT8), a power-of-two
  scale kept as its exponent byte (2^(e - 127); 0: nothing written yet). Integer steps would otherwise be
  set by K's outlier channels for every channel of a token (3x the attention error measured). When a new
  token exceeds a channel's range, the exponent grows and the page's earlier tokens are requantized (an exact
  power-of-two division, rounded); a token written at offset 0 starts a fresh page. One byte per channel
  and page: 1/block_size bytes per element (bfloat16 would take 2/16 at 16-token pages, above the 0.53x fp16
  byte target at head_dim 128).

FP8 keys are stored in a rotated basis (``key_rotation``): the model writes ``k @ S / b`` and attends with
``q @ S``, S a Walsh-Hadamard matrix of +-1 (block-diagonal, blocks of b: the largest power of two dividing
head_dim), so that ``(q S) . (k S / b) = q . k`` (S S^T = b I; both matrices exact in any float type). The
rotation spreads a key's few large channels over all channels of its block, so that E4M3's relative error no
longer lands on the channels that carry most of a score: on SmolLM2-135M, perplexity vs float32 KV +0.94% ->
+0.41%, mean KL 7.0e-3 -> 4.8e-3 (bench/NOTES.md "Session 25, #50"). Values are not rotated (no gain measured),
nor INT8 keys (their per-channel scales are the layout that helps them). The page layout is unchanged.

FP8 conversion saturates (values beyond +-448 become +-448, never NaN) and rounds to nearest even: the value
is clamped to [-448, 448] first, then converted by torch's ``float8_e4m3fn`` cast, which rounds to nearest
even (tests/unit/test_kv_quant.py checks it bit for bit against ``fp8_e4m3_reference`` below on every
representable value, every midpoint between neighbours and random values).
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import TYPE_CHECKING

import torch

if TYPE_CHECKING:
    from executor_svc.kv_tail import TailView

KV_CACHE_DTYPES = ("auto", "float32", "bfloat16", "float16", "fp8_e4m3", "int8")
FULL_PRECISION = {"float32": torch.float32, "bfloat16": torch.bfloat16, "float16": torch.float16}
ALIASES = {"fp32": "float32", "bf16": "bfloat16", "fp16": "float16", "half": "float16", "fp8": "fp8_e4m3",
           "fp8_e4m3fn": "fp8_e4m3", "float8_e4m3fn": "fp8_e4m3"}
REFUSED = {
    "int4": "INT4 KV cache is not supported",
    "fp4": "FP4 KV cache is not supported",
    "nf4": "NF4 KV cache is not supported",
}
REFUSAL_REASON = (
    "4-bit KV has poor kernel support and a clear loss in quality (long-context attention drifts, >10% more "
    "factual errors). Use fp8_e4m3 (the quality default: almost no loss, half the KV memory) or int8 (maximum "
    "concurrency, 1-3% loss on some long maths/code tasks). Weight quantization (AWQ/GPTQ 4-bit) is a separate "
    "switch: 4-bit weights do not need 4-bit KV"
)
FP8_MAX = 448.0
INT8_MAX = 127.0
SCALE_DTYPE = torch.bfloat16
SCALE_BYTES = 2


@dataclass(frozen=True, slots=True)
class KvFormat:
    """How a page pool stores K/V: ``name`` as reported (float32 ... fp8_e4m3, int8)."""

    name: str
    storage: torch.dtype  # element type of the data (the model dtype when not quantized)
    quantized: bool
    qmax: float = 0.0

    @property
    def rotates_keys(self) -> bool:
        """Keys stored as ``k @ S / b`` (``key_rotation``): FP8."""
        return self.storage == torch.float8_e4m3fn

    @property
    def k_channel_scales(self) -> bool:
        """K scaled per (page, head, channel) with exponent bytes (int8), not per (token, head)."""
        return self.storage == torch.int8

    def region_bytes(self, block_size: int, num_kv_heads: int, head_dim: int) -> tuple[int, int]:
        """(K, V) bytes of one layer of one quantized page."""
        data = block_size * num_kv_heads * head_dim
        token_scales = block_size * num_kv_heads * SCALE_BYTES
        k = data + (num_kv_heads * head_dim if self.k_channel_scales else token_scales)
        return k, data + token_scales

    def page_bytes(self, num_layers: int, num_kv_heads: int, head_dim: int, block_size: int) -> int:
        if not self.quantized:
            elem = torch.empty((), dtype=self.storage).element_size()
            return num_layers * 2 * block_size * num_kv_heads * head_dim * elem
        return num_layers * sum(self.region_bytes(block_size, num_kv_heads, head_dim))

    def bytes_per_token(self, num_layers: int, num_kv_heads: int, head_dim: int, block_size: int = 16) -> float:
        """K and V of one token over all layers, scales included (int8: K's per-page scales shared by
        block_size tokens)."""
        return self.page_bytes(num_layers, num_kv_heads, head_dim, block_size) / block_size


def parse_kv_dtype(name: str, model_dtype: torch.dtype) -> KvFormat:
    """``--kv-cache-dtype``: auto (the model dtype), a float dtype, fp8_e4m3 or int8; 4-bit is refused."""
    key = ALIASES.get(name.lower(), name.lower())
    if key in REFUSED:
        raise ValueError(f"--kv-cache-dtype {name}: {REFUSED[key]}. {REFUSAL_REASON}")
    if key == "auto":
        return KvFormat(str(model_dtype).removeprefix("torch."), model_dtype, False)
    if key in FULL_PRECISION:
        return KvFormat(key, FULL_PRECISION[key], False)
    if key == "fp8_e4m3":
        return KvFormat("fp8_e4m3", torch.float8_e4m3fn, True, FP8_MAX)
    if key == "int8":
        return KvFormat("int8", torch.int8, True, INT8_MAX)
    raise ValueError(f"--kv-cache-dtype {name!r}: choose one of {', '.join(KV_CACHE_DTYPES)}")


def rotation_block(head_dim: int) -> int:
    """The largest power of two that divides head_dim (the Hadamard blocks' size)."""
    return head_dim & -head_dim


def key_rotation(head_dim: int, dtype: torch.dtype, device: torch.device) -> tuple[torch.Tensor, torch.Tensor]:
    """(for queries, for keys): ``S`` and ``S / b``, S [head_dim, head_dim] block-diagonal with Sylvester
    Walsh-Hadamard blocks of +-1 of size b = rotation_block(head_dim); ``(q @ S) @ (k @ S / b).T == q @ k.T``."""
    b = rotation_block(head_dim)
    h = torch.ones(1, 1)
    while h.shape[0] < b:
        h = torch.cat([torch.cat([h, h], 1), torch.cat([h, -h], 1)])
    s = torch.block_diag(*[h] * (head_dim // b))
    return s.to(device=device, dtype=dtype), (s / b).to(device=device, dtype=dtype)


def to_fp8_e4m3(x: torch.Tensor) -> torch.Tensor:
    """Saturating, round-to-nearest-even conversion of a float tensor to float8_e4m3fn (NaN stays NaN)."""
    return x.float().clamp(-FP8_MAX, FP8_MAX).to(torch.float8_e4m3fn)


def quantize(x: torch.Tensor, fmt: KvFormat) -> tuple[torch.Tensor, torch.Tensor]:
    """x [..., D] -> (data [..., D] in fmt.storage, scale [...] bfloat16), one scale per vector."""
    xf = x.float()
    amax = xf.abs().amax(dim=-1)
    scale = (amax / fmt.qmax).to(SCALE_DTYPE)
    scale = torch.where(scale > 0, scale, torch.ones_like(scale))  # an all-zero vector: any scale
    y = xf / scale.float().unsqueeze(-1)
    if fmt.storage == torch.int8:
        data = torch.round(y).clamp_(-INT8_MAX, INT8_MAX).to(torch.int8)  # torch.round: half to even
    else:
        data = to_fp8_e4m3(y)
    return data, scale


# Every float8_e4m3fn bit pattern's value: on the CPU a table lookup is ~14x faster than torch's cast.
_FP8_TABLE = torch.arange(256, dtype=torch.int16).to(torch.uint8).view(torch.float8_e4m3fn).float()


def _to_float(data: torch.Tensor) -> torch.Tensor:
    if data.dtype == torch.float8_e4m3fn and data.device.type == "cpu":
        idx = data.view(torch.uint8).reshape(-1).int()
        return _FP8_TABLE.index_select(0, idx).view(data.shape)
    return data.float()


def dequantize(data: torch.Tensor, scale: torch.Tensor, dtype: torch.dtype) -> torch.Tensor:
    return (_to_float(data) * scale.float().unsqueeze(-1)).to(dtype)


def _dequantizer():
    """The CPU kernel library where it has the dequantizers (x86 with AVX2, FMA and F16C), else None."""
    from executor_svc.attention import cpu_kernel  # (here: the attention package imports this module)

    kernel = cpu_kernel.load()
    return kernel if kernel is not None and hasattr(kernel, "dequantize_pages_int8_channels") else None


_KERNEL_WRITE_DTYPES = (torch.float32, torch.bfloat16, torch.float16)


def _writer(data: torch.Tensor, x: torch.Tensor):
    """The CPU kernel library where it has the page writers (``write_q8``, ``write_int8_channels``:
    attention/kv_write_cpu.cpp, bit for bit the torch writes below) and the pool and rows are on the CPU, else None."""
    if data.device.type != "cpu" or x.device.type != "cpu" or x.dtype not in _KERNEL_WRITE_DTYPES:
        return None
    from executor_svc.attention import cpu_kernel  # (here: the attention package imports this module)

    kernel = cpu_kernel.load()
    return kernel if kernel is not None and hasattr(kernel, "write_int8_channels") else None


def _exact_args(view: TailView | None) -> tuple:
    """The dequantizers' optional (exact, exact_slots): the slab's rows for the pages that have a slot."""
    return () if view is None else (view.data, view.slots)


class QuantizedCache:
    """One layer's K (or V) of a quantized pool: ``data`` [num_pages, block_size, kv_heads, head_dim] and
    ``scale`` [num_pages, block_size, kv_heads], both views into the pool's bytes (no copy)."""

    __slots__ = ("data", "scale", "fmt", "exact_tail")

    def __init__(self, data: torch.Tensor, scale: torch.Tensor, fmt: KvFormat) -> None:
        self.data = data
        self.scale = scale
        self.fmt = fmt
        self.exact_tail: TailView | None = None  # this layer's K or V in the exact tail's slab (kv_tail.py)

    @property
    def shape(self) -> torch.Size:
        return self.data.shape

    def write(self, pages: torch.Tensor, offsets: torch.Tensor, x: torch.Tensor) -> None:
        if (kernel := _writer(self.data, x)) is not None:  # one call: the same bytes (~10 torch ops otherwise)
            kernel.write_q8(self.data.view(torch.uint8), self.scale, pages.long(), offsets.long(), x,
                            self.data.dtype == torch.float8_e4m3fn)
        else:
            data, scale = quantize(x, self.fmt)
            self.data[pages, offsets] = data
            self.scale[pages, offsets] = scale
        if self.exact_tail is not None:
            self.exact_tail.write(x)

    def gather(self, page_ids: torch.Tensor, dtype: torch.dtype) -> torch.Tensor:
        """Whole pages, dequantized: [len(page_ids), block_size, kv_heads, head_dim]. On the CPU the kernel
        library's ``dequantize_pages_q8`` (the same float32 products, the bytes widened in registers: ~7x
        torch's table lookup and scale), where it is built."""
        if self.data.device.type == "cpu" and (kernel := _dequantizer()) is not None:
            out = kernel.dequantize_pages_q8(self.data.view(torch.uint8), self.scale, page_ids.long().contiguous(),
                                             self.data.dtype == torch.float8_e4m3fn, *_exact_args(self.exact_tail))
            return out if dtype == torch.float32 else out.to(dtype)
        out = dequantize(self.data.index_select(0, page_ids), self.scale.index_select(0, page_ids), dtype)
        return out if self.exact_tail is None else self.exact_tail.overlay(out, page_ids)


class ChannelScaledCache:
    """One layer's K of an int8 pool: ``data`` [num_pages, block_size, kv_heads, head_dim] (int8) and ``exp``
    [num_pages, kv_heads, head_dim] (uint8): the page's power-of-two scale per (head, channel), 2^(exp - 127),
    0 before any token. Views into the pool's bytes."""

    __slots__ = ("data", "exp", "fmt", "exact_tail")

    def __init__(self, data: torch.Tensor, exp: torch.Tensor, fmt: KvFormat) -> None:
        self.data = data
        self.exp = exp
        self.fmt = fmt
        self.exact_tail: TailView | None = None

    @property
    def shape(self) -> torch.Size:
        return self.data.shape

    def write(self, pages: torch.Tensor, offsets: torch.Tensor, x: torch.Tensor) -> None:
        if (kernel := _writer(self.data, x)) is not None:  # one call: the same bytes and exponents
            kernel.write_int8_channels(self.data.view(torch.uint8), self.exp, pages.long(), offsets.long(), x)
        else:
            xf = x.float()
            touched, inv = torch.unique(pages, return_inverse=True)
            amax = torch.zeros(touched.numel(), *x.shape[1:], device=x.device)
            amax.scatter_reduce_(0, inv.view(-1, 1, 1).expand_as(xf), xf.abs(), "amax")
            # ceil(log2(amax / 127)) from the float's own exponent (exact; the CUDA write kernel does the same)
            mant, ex = torch.frexp(amax / INT8_MAX)
            need = torch.where(amax > 0, (ex - (mant == 0.5).int() + 127).clamp(1, 254), 0).to(torch.int16)
            fresh = torch.zeros(touched.numel(), dtype=torch.bool, device=x.device)
            fresh[inv[offsets == 0]] = True  # a page's first token: the previous owner's scales do not count
            old = torch.where(fresh.view(-1, 1, 1), 0, self.exp[touched].to(torch.int16))
            new = torch.maximum(old, need)
            grown = ((new > old) & (old > 0)).flatten(1).any(1)
            if bool(grown.any()):  # requantize the earlier tokens of those pages to the larger scales
                rows = touched[grown]
                shift = torch.pow(2.0, (old[grown] - new[grown]).float()).unsqueeze(1)  # [R, 1, H, D]
                requantized = torch.round(self.data[rows].float() * shift).clamp_(-INT8_MAX, INT8_MAX)
                self.data[rows] = requantized.to(torch.int8)
            self.exp[touched] = new.to(torch.uint8)
            scale = torch.pow(2.0, new[inv].float() - 127)
            self.data[pages, offsets] = torch.round(xf / scale).clamp_(-INT8_MAX, INT8_MAX).to(torch.int8)
        if self.exact_tail is not None:
            self.exact_tail.write(x)

    def gather(self, page_ids: torch.Tensor, dtype: torch.dtype) -> torch.Tensor:
        if self.data.device.type == "cpu" and (kernel := _dequantizer()) is not None:  # (the same products)
            out = kernel.dequantize_pages_int8_channels(self.data.view(torch.uint8), self.exp,
                                                        page_ids.long().contiguous(), *_exact_args(self.exact_tail))
            return out if dtype == torch.float32 else out.to(dtype)
        data = self.data.index_select(0, page_ids).float()
        scale = torch.pow(2.0, self.exp.index_select(0, page_ids).float() - 127).unsqueeze(1)
        out = (data * scale).to(dtype)
        return out if self.exact_tail is None else self.exact_tail.overlay(out, page_ids)


def fp8_e4m3_reference(x: torch.Tensor) -> torch.Tensor:
    """An independent E4M3 (fn variant: no inf, max 448) conversion in float64 arithmetic, saturating and
    rounding to nearest even, returning the float value. For tests: torch's cast must agree bit for bit."""
    x = x.double()
    sign = torch.sign(x)
    a = x.abs().clamp(max=FP8_MAX)
    # exponent of the binade, at least -6 (below that: subnormals, spacing 2^-9)
    e = torch.floor(torch.log2(torch.where(a > 0, a, torch.ones_like(a)))).clamp(min=-6)
    step = torch.pow(2.0, e - 3)  # 3 mantissa bits
    q = torch.round(a / step) * step  # round half to even on the mantissa grid (ties: even multiple of step)
    q = q.clamp(max=FP8_MAX)
    out = sign * q
    return torch.where(torch.isnan(x), x, out)
