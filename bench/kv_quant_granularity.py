"""kv_quant.py part 2: scale granularity on synthetic K/V with outlier channels: each candidate (per token and head,
per page and channel, streamed or whole-page, calibrated, power-of-two, KIVI's mix) quantizes K and V, and the
table reports their errors, the attention output's and the scales' memory overhead."""

from __future__ import annotations

import math

import torch

from executor_svc.kv_quant import (
    FP8_MAX,
    INT8_MAX,
    SCALE_DTYPE,
    dequantize,
    key_rotation,
    parse_kv_dtype,
    quantize,
    to_fp8_e4m3,
)

QUANT = ("fp8_e4m3", "int8")


# ---- 2. granularity on synthetic outlier K/V ---------------------------------------------------------------
def _q(y: torch.Tensor, fmt: str) -> torch.Tensor:
    """y already divided by its scale -> the quantized value, as a float."""
    if fmt == "int8":
        return torch.round(y).clamp(-INT8_MAX, INT8_MAX)
    return to_fp8_e4m3(y).float()


def _qmax(fmt: str) -> float:
    return INT8_MAX if fmt == "int8" else FP8_MAX


def token_head(x: torch.Tensor, fmt: str) -> torch.Tensor:
    return dequantize(*quantize(x, parse_kv_dtype(fmt, torch.float32)), torch.float32)


def token_head_e8m0(x: torch.Tensor, fmt: str) -> torch.Tensor:
    amax = x.abs().amax(-1, keepdim=True).clamp(min=1e-30)
    scale = torch.pow(2.0, torch.ceil(torch.log2(amax / _qmax(fmt))))
    return _q(x / scale, fmt) * scale


def _bf16(x: torch.Tensor) -> torch.Tensor:
    s = x.to(SCALE_DTYPE).float()
    return torch.where(s > 0, s, torch.ones_like(s))


def _e8m0(x: torch.Tensor) -> torch.Tensor:
    """A power-of-two scale >= x (one byte: the exponent)."""
    return torch.pow(2.0, torch.ceil(torch.log2(x.clamp(min=1e-30))))


def page_channel(x: torch.Tensor, fmt: str, block: int = 16, streamed: bool = True, e8m0: bool = False
                 ) -> torch.Tensor:
    """x [T, H, D]; one scale per (page, head, channel). Streamed: tokens written one at a time; when a token
    exceeds a channel's range the scale grows and the page's earlier tokens are requantized."""
    t, h, d = x.shape
    pages = x.view(t // block, block, h, d)
    rnd = _e8m0 if e8m0 else _bf16
    if not streamed:
        scale = rnd(pages.abs().amax(1, keepdim=True) / _qmax(fmt))
        return (_q(pages / scale, fmt) * scale).view(t, h, d)
    q = torch.zeros_like(pages)
    scale = torch.zeros(t // block, 1, h, d)
    for i in range(block):
        new = rnd(torch.maximum(scale, pages[:, i:i + 1].abs() / _qmax(fmt)))
        grew = new != scale
        if i:  # requantize the earlier tokens of pages whose scale grew
            old = q[:, :i] * torch.where(scale > 0, scale, torch.ones_like(scale))
            q[:, :i] = torch.where(grew, _q(old / new, fmt), q[:, :i])
        q[:, i:i + 1] = _q(pages[:, i:i + 1] / new, fmt)
        scale = new
    return (q * scale).view(t, h, d)


def static_channel(x: torch.Tensor, fmt: str, calib: int = 256) -> torch.Tensor:
    scale = x[:calib].abs().amax(0, keepdim=True).clamp(min=1e-30) / _qmax(fmt)
    return _q(x / scale, fmt) * scale


def rotated_token_head(x: torch.Tensor, fmt: str) -> torch.Tensor:
    """token_head in the rotated basis FP8 keys are stored in (kv_quant.key_rotation), rotated back."""
    for_q, for_k = key_rotation(x.shape[-1], torch.float32, x.device)
    return token_head(x @ for_k, fmt) @ for_q.T


CANDIDATES = {
    # name: (K method, V method, scale bytes per element beyond the data byte, as a function of head_dim)
    "token-head bf16 (fp8's V)": (token_head, token_head, lambda d: 2 / d),
    "K rotated token-head, V token-head (fp8 default)": (rotated_token_head, token_head, lambda d: 2 / d),
    "token-head e8m0": (token_head_e8m0, token_head_e8m0, lambda d: 1 / d),
    "page-channel (streamed)": (page_channel, page_channel, lambda d: 2 / 16),
    "page-channel (whole page)": (lambda x, f: page_channel(x, f, streamed=False),
                                  lambda x, f: page_channel(x, f, streamed=False), lambda d: 2 / 16),
    "static channel (calibrated)": (static_channel, static_channel, lambda d: 0.0),
    "page-channel e8m0 (streamed)": (lambda x, f: page_channel(x, f, e8m0=True),
                                     lambda x, f: page_channel(x, f, e8m0=True), lambda d: 1 / 16),
    "KIVI: K page-channel, V token-head": (page_channel, token_head, lambda d: (2 / 16 + 2 / d) / 2),
    "KIVI, K e8m0 (int8 default)": (lambda x, f: page_channel(x, f, e8m0=True), token_head,
                                    lambda d: (1 / 16 + 2 / d) / 2),
}


def synthetic_kv(seed: int = 0, t: int = 2048, h: int = 8, d: int = 128, outliers: int = 4, factor: float = 15.0):
    g = torch.Generator().manual_seed(seed)
    k = torch.randn(t, h, d, generator=g)
    chans = torch.stack([torch.randperm(d, generator=g)[:outliers] for _ in range(h)])  # [h, outliers]
    gain = torch.ones(h, d)
    gain.scatter_(1, chans, factor)
    k = k * gain + gain * 0.3 * (gain > 1)  # outlier channels: large, with an offset, in every token
    v = torch.randn(t, h, d, generator=g) * torch.exp(0.5 * torch.randn(t, h, 1, generator=g))
    q = torch.randn(64, h, d, generator=g)
    return q, k, v


def _attend(q, k, v):
    s = torch.einsum("qhd,thd->hqt", q, k) / math.sqrt(q.shape[-1])
    return torch.einsum("hqt,thd->qhd", torch.softmax(s, -1), v)


def _rel(a, b) -> float:
    return float((a - b).norm() / b.norm())


def granularity_table(seed: int = 0) -> list[dict]:
    q, k, v = synthetic_kv(seed)
    exact = _attend(q, k, v)
    rows = []
    for fmt in QUANT:
        for name, (kf, vf, overhead) in CANDIDATES.items():
            kq, vq = kf(k, fmt), vf(v, fmt)
            rows.append(dict(kv_dtype=fmt, granularity=name, k_rel_err=_rel(kq, k), v_rel_err=_rel(vq, v),
                             attn_rel_err=_rel(_attend(q, kq, vq), exact),
                             scale_overhead_d128=overhead(128), scale_overhead_d64=overhead(64)))
    return rows
