"""How the runner turns a plan into tensors: Python ints to a long tensor (by way of an array), page tables padded
by one masked scatter, and decodes grouped by table length (or in one group, when the backend reads in place)."""

from __future__ import annotations

import math

import pytest
import torch
from hypothesis import given
from hypothesis import strategies as st

from executor_svc.batch import group_by_length, padded_tables
from executor_svc.tensors import long_tensor

pytestmark = pytest.mark.unit

ints = st.integers(min_value=-(2**63), max_value=2**63 - 1)


@given(st.lists(ints, max_size=300))
def test_long_tensor_equals_torch_tensor(values):
    got = long_tensor(values)
    assert got.dtype == torch.long and got.shape == (len(values),)
    assert torch.equal(got, torch.tensor(values, dtype=torch.long))
    assert got.tolist() == values


def test_long_tensor_keeps_its_values_after_the_list_is_gone():
    t = long_tensor(list(range(1000)))
    torch.zeros(10_000)  # (other allocations in between)
    assert t.tolist() == list(range(1000))


@given(st.lists(st.lists(st.integers(0, 10_000), min_size=1, max_size=40), min_size=1, max_size=30),
       st.integers(0, 5))
def test_padded_tables_equal_padding_by_hand(tables, extra):
    width = max(len(t) for t in tables) + extra
    want = torch.tensor([t + [0] * (width - len(t)) for t in tables], dtype=torch.long)
    assert torch.equal(padded_tables(tables, width, torch.device("cpu")), want)


@given(st.lists(st.integers(1, 200), max_size=60))
def test_decode_groups_cover_each_decode_once(num_pages):
    for slack in (1.25, 2.0, math.inf):
        groups = group_by_length(num_pages, slack)
        members = sorted(i for m, _ in groups for i in m)
        assert members == list(range(len(num_pages)))
        for m, width in groups:
            assert width == max(num_pages[i] for i in m)
            assert max(num_pages[i] for i in m) <= slack * min(num_pages[i] for i in m)
        if slack == math.inf:
            assert len(groups) == (1 if num_pages else 0)
