"""The multi-LoRA kernels (kernels_cuda/lora_sgmv.cu through executor_svc/lora/cuda_sgmv.py) on a GPU against the
torch path (LoraBatch.delta, on the same device) and a float64 reference, fp32 / bf16 / fp16, at Llama-8B-sized
linears: qkv (4096 -> 4096 + 1024 + 1024), gate_up (4096 -> 2 x 14336), down (14336 -> 4096), o; decode-sized and
prefill-sized steps, ranks 8 / 16 / 64, rows of several adapters and of the base model mixed.
Cases and tolerances: tests/support/lora_sgmv_cases.py (shared with the CPU-emulated tests/unit/
test_lora_sgmv_emulated.py). Skipped without CUDA or CuPy.
"""

from __future__ import annotations

import dataclasses

import pytest
import torch

from tests.support import lora_sgmv_cases as cases
from tests.support.lora_sgmv_cases import Case


def _skip_reason() -> str | None:
    if not torch.cuda.is_available():
        return "needs CUDA"
    from kernels_cuda.loader import cupy_import_error

    err = cupy_import_error()
    return f"needs CuPy ({err})" if err else None


SKIP = _skip_reason()
pytestmark = [pytest.mark.gpu, pytest.mark.skipif(SKIP is not None, reason=SKIP or "")]
DTYPES = [torch.float32, torch.bfloat16, torch.float16]

CASES = [
    Case(1, 4096, (4096, 1024, 1024), 16, adapters=4, seed=1),    # qkv, one decode row: k split 16 ways
    Case(64, 4096, (4096, 1024, 1024), 64, adapters=8, seed=2),   # qkv, a decode batch of 8 adapters
    Case(33, 4096, (14336, 14336), 8, adapters=3, seed=3),        # gate_up
    Case(7, 14336, (4096,), 64, adapters=2, seed=4),              # down: 112 chunks of k
    Case(1000, 4096, (4096,), 16, adapters=5, seed=5),            # o, a prefill-sized step
]


@pytest.mark.parametrize("dtype", DTYPES, ids=str)
@pytest.mark.parametrize("case", CASES, ids=str)
def test_kernels_match_the_torch_path(case, dtype):
    errors = cases.check(case, dtype, "cuda")
    print(f"{case} {dtype}: max error / max |delta|: {errors}")


def test_usable_on_cuda_for_every_dtype():
    from executor_svc.lora.cuda_sgmv import usable

    for dtype in DTYPES:
        d = cases.draw(Case(3, 64, (64,), 8), dtype, "cuda")
        assert usable(d.x, d.lin), dtype


def test_a_step_of_base_rows_only_is_untouched():
    d = cases.draw(Case(40, 256, (256, 64), 16), torch.bfloat16, "cuda")
    d.row_slots = [0] * 40
    out = cases.run_kernels(d, None)
    torch.cuda.synchronize()
    assert torch.equal(out, d.y)


def test_under_a_cuda_graph():
    """Decode steps replay CUDA graphs (executor_svc/cuda_graphs.py): the launches go on torch's current stream,
    so a capture records them, and a replay with other rows and adapters in the captured tensors gives their deltas."""
    from executor_svc.lora.cuda_sgmv import lora_delta_cuda

    case = Case(16, 1024, (1024, 256, 256), 16, adapters=4, seed=6)
    d = cases.draw(case, torch.float16, "cuda")
    row_adapter = torch.tensor(d.row_slots, device="cuda") - 1
    x, y = d.x.clone(), d.y.clone()
    lora_delta_cuda(d.lin, x, y, row_adapter, d.scales, 16)  # compiled (or loaded) before the capture
    torch.cuda.synchronize()
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        lora_delta_cuda(d.lin, x, y, row_adapter, d.scales, 16)
    other = cases.draw(dataclasses.replace(case, seed=7), torch.float16, "cuda")
    replayed = cases.Drawn(d.lin, other.x, other.y, other.row_slots, d.scales)
    x.copy_(other.x)
    y.copy_(other.y)
    row_adapter.copy_(torch.tensor(other.row_slots, device="cuda") - 1)
    graph.replay()
    torch.cuda.synchronize()
    assert other.row_slots != d.row_slots
    ref = cases.exact(replayed)
    big = float((ref - other.y.double().cpu()).abs().max())
    err = (y.double().cpu() - ref.to(torch.float16).double()).abs()
    assert float((err - cases.ULP[torch.float16] * ref.abs() - 1e-5 * big).max()) <= 0
