"""The multi-LoRA kernels' own source (kernels_cuda/lora_sgmv.cu) run on the CPU by tests/support/cuda_emulator, through
executor_svc/lora/cuda_sgmv.py, against the torch path (LoraBatch.delta) and a float64 reference: indexing, the
adapter runs of a row tile, split-K and its sum, rank chunks, module slices and rows of the base model, at
CPU-sized shapes. Cases and tolerances: tests/support/lora_sgmv_cases.py (shared with tests/gpu/test_lora_sgmv.py).
Skipped only without a C++ compiler.
"""

from __future__ import annotations

import pytest
import torch

from tests.support import lora_sgmv_cases as cases
from tests.support.cuda_emulator import EmulatedLibrary, unavailable_reason
from tests.support.lora_sgmv_cases import Case

SKIP = unavailable_reason()
# ~3 s here with the emulator built (its build, every kernel source under g++, ~10 s once per source version)
pytestmark = [pytest.mark.unit, pytest.mark.skipif(SKIP is not None, reason=SKIP or "")]
DTYPES = [torch.float32, torch.bfloat16, torch.float16]

# in 64 / 576, M 1 / 2 / 3, R 8 / 16 / 64, T 1 / 7 / 33, 2-5 adapters with base rows among them
CASES = [
    Case(1, 64, (64,), 8, adapters=2, seed=1),
    Case(7, 64, (64, 32), 16, seed=2),
    Case(33, 64, (64, 16, 16), 64, adapters=5, seed=3),
    Case(1, 576, (576, 192, 192), 64, seed=4),   # one row: k split into 5
    Case(7, 576, (1536, 1536), 8, seed=5),        # gate_up-like: 6 column tiles a module
    Case(33, 576, (576,), 16, adapters=4, seed=6),
    Case(33, 576, (576, 192, 192), 64, seed=7),
]
EDGES = [
    Case(1, 4096, (64,), 8, seed=8),              # 32 chunks of k in 16 splits: two chunks a split
    Case(20, 200, (40, 72), 80, seed=9),          # in not a multiple of a chunk; rank past one rank chunk (64)
    Case(70, 96, (8,), 1, adapters=7, seed=10),   # rank 1, 9 row tiles
]


@pytest.fixture(scope="module")
def emu() -> EmulatedLibrary:
    return EmulatedLibrary()


@pytest.mark.parametrize("dtype", DTYPES, ids=str)
@pytest.mark.parametrize("case", CASES, ids=str)
def test_kernels_match_the_torch_path(emu, case, dtype):
    errors = cases.check(case, dtype, "cpu", emu)
    print(f"{case} {dtype}: max error / max |delta|: {errors}")


@pytest.mark.parametrize("case", EDGES, ids=str)
def test_edge_shapes(emu, case):
    cases.check(case, torch.bfloat16, "cpu", emu)


def test_a_step_of_base_rows_only_is_untouched(emu):
    d = cases.draw(Case(9, 64, (64, 32), 8), torch.float16, "cpu")
    d.row_slots = [0] * 9
    assert torch.equal(cases.run_kernels(d, emu), d.y)
