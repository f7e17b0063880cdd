"""Checks of the multi-LoRA kernels (kernels_cuda/lora_sgmv.cu through executor_svc/lora/cuda_sgmv.py), shared by the
GPU tests (tests/gpu/test_lora_sgmv.py: real kernels on CUDA) and the emulated ones (tests/unit/
test_lora_sgmv_emulated.py: the same kernel source on the CPU, tests/support/cuda_emulator).

Each case draws fresh random weights (never zeros) into a stack laid out as stack.py lays it out (one region per
adapter, every stacked tensor a strided view over the regions, blocks padded), a fused output with a column gap (a
module no adapter targets, left alone), and a step's rows: requests of random lengths, each of a random adapter or the
base model, plus single rows of alternating adapters (a tile of many runs). References, on the same values:

* ``exact``: float64 einsum of the delta, added to y in float64, rounded once to the dtype;
* ``torch``: the torch path itself, ``lora_batch(...).delta`` (batch.py), in the case's dtype.

Tolerances (stated once, here), with D = max |delta| over the case:

* against ``exact``: |out - exact| <= ULP[dtype] * |exact| + 1e-5 * D: one rounding of the output (the kernels add
  in fp32 and round y once) plus fp32 summation order;
* against ``torch``: fp32 1e-5 * D + 1e-6 * |y|; fp16 / bf16 TORCH_TOL[dtype] * D + ULP[dtype] * |y| (the torch
  path rounds the shrink, the expand and the scaled delta to the dtype, then the sum);
* rows of the base model and the columns no module covers: bit-exact (untouched).
"""

from __future__ import annotations

from dataclasses import dataclass
from types import SimpleNamespace

import torch

from executor_svc.lora.batch import lora_batch
from executor_svc.lora.cuda_sgmv import lora_delta_cuda
from executor_svc.lora.stack import LinearLora

ULP = {torch.float32: 2.0 ** -23, torch.bfloat16: 2.0 ** -7, torch.float16: 2.0 ** -10}
TORCH_TOL = {torch.bfloat16: 2.0 ** -5, torch.float16: 2.0 ** -8}
GAP = 24  # columns of the fused output between the first and second module (a module no adapter targets)


@dataclass(frozen=True, slots=True)
class Case:
    rows: int
    in_features: int
    widths: tuple[int, ...]  # per targeted module (M = len)
    rank: int
    adapters: int = 3
    seed: int = 0


@dataclass(slots=True)
class Drawn:
    lin: LinearLora
    x: torch.Tensor
    y: torch.Tensor
    row_slots: list[int]  # per row: 0 base model, k adapter k (stack row k - 1)
    scales: torch.Tensor


def _slices(widths: tuple[int, ...]) -> tuple[tuple[int, int], ...]:
    out, at = [], 0
    for i, w in enumerate(widths):
        out.append((at, w))
        at += w + (GAP if i == 0 else 0)
    return tuple(out)


def draw(case: Case, dtype: torch.dtype, device: str) -> Drawn:
    g = torch.Generator().manual_seed(1000 + case.seed)
    n, r, m = case.adapters, case.rank, len(case.widths)
    blocks = [case.in_features * m * r] + [r * w for w in case.widths]
    at, offsets = 0, []
    for size in blocks:  # each block 16-byte aligned, plus a little padding, as stack.py's _layout
        offsets.append(at)
        at += -(-(size + 5) // 8) * 8
    memory = (torch.randn(n, at + 8, generator=g)).to(dtype).to(device)
    memory[:, offsets[0]:offsets[0] + blocks[0]] *= case.in_features ** -0.5
    view = lambda o, rows, cols: memory[:, o:o + rows * cols].view(n, rows, cols)  # noqa: E731
    slices = _slices(case.widths)
    lin = LinearLora(view(offsets[0], case.in_features, m * r),
                     tuple(view(o, r, w) for o, w in zip(offsets[1:], case.widths)), slices)
    out_features = slices[-1][0] + slices[-1][1] + 7
    x = torch.randn(case.rows, case.in_features, generator=g).to(dtype).to(device)
    y = torch.randn(case.rows, out_features, generator=g).to(dtype).to(device)
    scales = (0.5 + 1.5 * torch.rand(n, generator=g)).to(device)
    return Drawn(lin, x, y, _row_slots(case, g), scales)


def _row_slots(case: Case, g: torch.Generator) -> list[int]:
    """Requests of 1-12 rows, each of a random adapter or the base model; the last up-to-9 rows alternate adapters
    row by row (every adapter used, and a base row among them where there is room)."""
    singles = min(case.rows, 9) if case.rows > 4 else 0
    out: list[int] = []
    while len(out) < case.rows - singles:
        count = min(int(torch.randint(1, 13, (1,), generator=g)), case.rows - singles - len(out))
        out += [int(torch.randint(0, case.adapters + 1, (1,), generator=g))] * count
    out += [(i % (case.adapters + 1)) if i % 4 != 3 else 0 for i in range(1, singles + 1)]
    if not any(out):
        out[0] = 1
    return out


def exact(d: Drawn) -> torch.Tensor:
    """y + each row's delta, in float64 on the CPU (a matmul per adapter: no [T, in, M * R] gather at GPU sizes)."""
    y, x = d.y.double().cpu(), d.x.double().cpu()
    slot = torch.tensor(d.row_slots)
    r = d.lin.shrink.shape[2] // len(d.lin.slices)
    for a in range(d.lin.shrink.shape[0]):
        rows = torch.nonzero(slot == a + 1, as_tuple=True)[0]
        if len(rows) == 0:
            continue
        shrink = x[rows] @ d.lin.shrink[a].double().cpu()
        scale = float(d.scales[a])
        for m, ((offset, width), b) in enumerate(zip(d.lin.slices, d.lin.expand)):
            y[rows, offset:offset + width] += (shrink[:, m * r:(m + 1) * r] @ b[a].double().cpu()) * scale
    return y


def run_kernels(d: Drawn, library: object | None) -> torch.Tensor:
    rank = d.lin.expand[0].shape[1]
    row_adapter = torch.tensor(d.row_slots, dtype=torch.int64, device=d.x.device) - 1
    y = d.y.clone()
    lora_delta_cuda(d.lin, d.x, y, row_adapter, d.scales, rank, library=library)
    return y


def run_torch_path(d: Drawn) -> torch.Tensor:
    stack = SimpleNamespace(rank=d.lin.expand[0].shape[1], scales=d.scales)
    return lora_batch(stack, d.row_slots, d.x.device).delta(d.lin, d.x, d.y.clone())


def check(case: Case, dtype: torch.dtype, device: str, library: object | None = None) -> dict[str, float]:
    """Runs the kernels on a fresh draw of ``case`` and asserts the tolerances above; returns the errors seen,
    relative to D (for reports)."""
    d = draw(case, dtype, device)
    out = run_kernels(d, library)
    if device == "cuda":
        torch.cuda.synchronize()
    out, y0 = out.double().cpu(), d.y.double().cpu()
    ref = exact(d)
    ref_rounded = ref.to(dtype).double()
    delta = ref - y0
    big = float(delta.abs().max())
    assert big > 1e-2, f"{case}: the drawn delta is too small to check anything ({big})"

    base = torch.tensor([s == 0 for s in d.row_slots])
    covered = torch.zeros(out.shape[1], dtype=torch.bool)
    for offset, width in d.lin.slices:
        covered[offset:offset + width] = True
    assert torch.equal(out[base], y0[base]), f"{case} {dtype}: rows of the base model changed"
    assert torch.equal(out[:, ~covered], y0[:, ~covered]), f"{case} {dtype}: columns outside the modules changed"
    assert (out[~base][:, covered] != y0[~base][:, covered]).float().mean() > 0.5, f"{case}: no delta was added"

    err_exact = (out - ref_rounded).abs()
    bound = ULP[dtype] * ref.abs() + 1e-5 * big
    worst = float((err_exact - bound).max())
    assert worst <= 0, (f"{case} {dtype}: |kernel - exact| up to {float(err_exact.max()):.3g} "
                        f"(bound {ULP[dtype]:.3g} * |exact| + 1e-5 * {big:.3g})")

    torch_out = run_torch_path(d).double().cpu()
    err_torch = (out - torch_out).abs()
    tol = (1e-5 * big + 1e-6 * y0.abs()) if dtype == torch.float32 else TORCH_TOL[dtype] * big + ULP[dtype] * y0.abs()
    over = float((err_torch - tol).max())
    assert over <= 0, f"{case} {dtype}: |kernel - torch path| up to {float(err_torch.max()):.3g} (D = {big:.3g})"
    return {"vs_exact": float(err_exact.max()) / big, "vs_torch": float(err_torch.max()) / big}
