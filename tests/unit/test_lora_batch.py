"""LoraBatch's ways through a step's rows (executor_svc/lora/batch.py), each against a float64 reference of every
row's delta: segments read through a view of the stacks (a range of adapters) or a copy of their rows, runs of a
prompt's rows in place, an adapter's many scattered rows as a run of its own, deltas added over a dense span of rows
(base rows between them included) or scattered. Rows of the base model stay bit-exact. The stacks are laid out as
stack.py lays them out: one region per adapter, every stacked tensor a strided view over the regions."""

from __future__ import annotations

from types import SimpleNamespace

import pytest
import torch

from executor_svc.lora.batch import RUN_ROWS, LoraBatch, lora_batch
from executor_svc.lora.stack import LinearLora

pytestmark = pytest.mark.unit

N, R, IN, WIDTHS, GAP = 8, 4, 24, (16, 8, 8), 4  # a qkv-like linear: 3 modules, a column gap after the first


def _stack(seed: int = 0, unit: bool = False) -> tuple[SimpleNamespace, LinearLora]:
    g = torch.Generator().manual_seed(seed)
    blocks = [IN * len(WIDTHS) * R] + [R * w for w in WIDTHS]
    memory = torch.randn(N, sum(blocks) + 12, generator=g)  # (padding past the blocks, as the pool's pages)
    at, views = 0, []
    for (rows, cols), size in zip([(IN, len(WIDTHS) * R)] + [(R, w) for w in WIDTHS], blocks):
        views.append(memory[:, at:at + size].view(N, rows, cols))
        at += size
    slices, at = [], 0
    for i, w in enumerate(WIDTHS):
        slices.append((at, w))
        at += w + (GAP if i == 0 else 0)
    stack = SimpleNamespace(rank=R, scales=torch.ones(N) if unit else 0.5 + torch.rand(N, generator=g))
    return stack, LinearLora(views[0], tuple(views[1:]), tuple(slices))


def _reference(stack, lin: LinearLora, x: torch.Tensor, y: torch.Tensor, row_slots: list[int]) -> torch.Tensor:
    out = y.double().clone()
    for t, slot in enumerate(row_slots):
        if slot:
            k = slot - 1
            h = x[t].double() @ lin.shrink[k].double()
            for j, ((offset, width), b) in enumerate(zip(lin.slices, lin.expand)):
                out[t, offset:offset + width] += h[j * R:(j + 1) * R] @ b[k].double() * float(stack.scales[k])
    return out


def _check(row_slots: list[int], seed: int = 0, unit: bool = False) -> LoraBatch:
    stack, lin = _stack(seed, unit)
    g = torch.Generator().manual_seed(100 + seed)
    x = torch.randn(len(row_slots), IN, generator=g)
    y = torch.randn(len(row_slots), sum(WIDTHS) + GAP + 3, generator=g)
    batch = lora_batch(stack, row_slots, torch.device("cpu"))
    assert (batch.scale is None) == unit and all((run.scale is None) == unit for run in batch.runs)
    got = batch.delta(lin, x, y.clone())
    want = _reference(stack, lin, x, y, row_slots)
    assert torch.allclose(got.double(), want, rtol=1e-5, atol=1e-5), float((got.double() - want).abs().max())
    untouched = [t for t, s in enumerate(row_slots) if not s]
    assert torch.equal(got[untouched], y[untouched])  # rows of the base model
    assert torch.equal(got[:, WIDTHS[0]:WIDTHS[0] + GAP], y[:, WIDTHS[0]:WIDTHS[0] + GAP])  # the gap's columns
    return batch


def test_a_decode_step_over_every_adapter_reads_the_stacks_in_place():
    batch = _check([1 + i % N for i in range(3 * N)])
    assert batch.first == 0 and batch.whole and not batch.runs and batch.gather.shape == (N, 3)
    assert (batch.span.lo, batch.span.hi, batch.span.zero_row) == (0, 3 * N, False)  # (a permutation of the rows)


def test_base_rows_between_adapter_rows_take_a_zero_delta():
    batch = _check([0, 3, 0, 4, 4, 0, 5, 0, 0, 3])
    assert batch.first == 2 and not batch.whole and (batch.span.lo, batch.span.hi) == (1, 10)
    assert batch.span.zero_row and (batch.span.inv == 3 * 2).sum() == 4  # (3 segments of 2: the zero row is 6)


def test_adapters_far_apart_are_gathered_and_rows_far_apart_scattered():
    batch = _check([1] + [0] * 60 + [N, 1])
    assert batch.first is None and batch.seg.tolist() == [0, N - 1]  # (the 6 between would be read for nothing)
    assert batch.span is None


def test_prompts_are_runs_done_in_place():
    rows = [2] * RUN_ROWS + [0] * 3 + [5] * (RUN_ROWS + 7) + [1, 2, 3, 2]
    batch = _check(rows)
    assert [(r.adapter, r.start, r.count, r.rows) for r in batch.runs] == [
        (1, 0, RUN_ROWS, None), (4, RUN_ROWS + 3, RUN_ROWS + 7, None)]
    assert batch.seg.tolist() == [0, 1, 2] and batch.gather.shape == (3, 2)  # adapter 2's short rows: a segment


def test_an_adapter_with_many_scattered_rows_is_a_run_rather_than_everyone_s_padding():
    rows = [1 if t % 2 == 0 else 2 + t % 3 for t in range(90)]  # 45 rows of adapter 1, 15 each of 2, 3 and 4
    batch = _check(rows)
    (run,) = batch.runs
    assert run.adapter == 0 and run.rows is not None and run.rows.tolist() == list(range(0, 90, 2))
    assert batch.seg.tolist() == [1, 2, 3] and batch.gather.shape == (3, 15)


def test_scales_of_one_multiply_nothing():
    _check([1, 2, 0] + [3] * RUN_ROWS, unit=True)


def test_only_runs_and_a_single_row():
    _check([3] * (2 * RUN_ROWS))
    _check([0] * 5 + [7] + [0] * 5)
    assert lora_batch(_stack()[0], [0, 0, 0], torch.device("cpu")) is None


def test_on_a_gpu_the_deltas_go_through_the_sgmv_kernels(monkeypatch):
    """With the cuda backend on a CUDA device, lora_batch gives each row its stack row and delta hands the linear to
    kernels_cuda/lora_sgmv.cu: here the kernels run on the CPU emulator (as if usable) and give the reference's
    deltas; off a GPU, or with kernels off, the row index is not built and the torch path runs."""
    from executor_svc.lora import batch as batch_mod
    from executor_svc.lora import cuda_sgmv
    from tests.support.cuda_emulator import EmulatedLibrary, unavailable_reason

    slots = [0, 3, 3, 1, 0, 2] + [4] * RUN_ROWS
    stack, lin = _stack(7)
    assert lora_batch(stack, slots, torch.device("cpu"), kernels=True).row_adapter is None
    if unavailable_reason() is not None:
        pytest.skip(unavailable_reason())
    emu, kernel_delta = EmulatedLibrary(), cuda_sgmv.lora_delta_cuda
    calls = []

    def on_emulator(lin, x, y, row_adapter, scales, rank):
        calls.append(row_adapter.tolist())
        return kernel_delta(lin, x, y, row_adapter, scales, rank, library=emu)
    monkeypatch.setattr(batch_mod.cuda_sgmv, "usable", lambda x, lin: True)
    monkeypatch.setattr(batch_mod.cuda_sgmv, "lora_delta_cuda", on_emulator)
    batch = lora_batch(stack, slots, torch.device("cpu"))
    batch.row_adapter = torch.tensor(slots) - 1  # (what lora_batch builds on a CUDA device with kernels on)
    g = torch.Generator().manual_seed(9)
    x, y = torch.randn(len(slots), IN, generator=g), torch.randn(len(slots), sum(WIDTHS) + GAP + 3, generator=g)
    got = batch.delta(lin, x, y.clone())
    assert calls == [[s - 1 for s in slots]]
    want = _reference(stack, lin, x, y, slots)
    assert torch.allclose(got.double(), want, rtol=1e-5, atol=1e-5), float((got.double() - want).abs().max())
    assert torch.equal(got[[0, 4]], y[[0, 4]])  # rows of the base model
