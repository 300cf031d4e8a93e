"""The step's slot kernel against `cache.slots_of`: one-row and γ+1-row steps, page sizes,
a page table that is a slice of a wider buffer (its row stride past its width), positions
that are a view (strides of their own), and an empty batch."""

from __future__ import annotations

import pytest
import torch
from kernel_cases import DEVICE, generator

from vegas_spec.cache import slots_of
from vegas_spec.kernels.slots import slots


@pytest.mark.parametrize("page_size", [8, 16])
@pytest.mark.parametrize("n", [1, 7])
def test_slots_are_the_references(page_size: int, n: int) -> None:
    g = generator(page_size * 10 + n)
    rows, pages = 5, 12
    wide = torch.randperm(rows * 20, generator=g)[: rows * 20].view(rows, 20).int()
    table = wide[:, :pages]  # row stride 20, width 12
    lengths = torch.randint(0, pages * page_size - n, (rows,), generator=g)
    positions = lengths[:, None] + torch.arange(n)
    want = slots_of(table, positions, page_size)
    got = slots(table.to(DEVICE), positions.to(DEVICE), page_size).cpu()
    assert torch.equal(got, want)
    view = positions.t().contiguous().t()  # the same values, column-major
    assert torch.equal(slots(table.to(DEVICE), view.to(DEVICE), page_size).cpu(), want)


def test_an_empty_batch_has_no_slots() -> None:
    table = torch.zeros(0, 4, dtype=torch.int32, device=DEVICE)
    out = slots(table, torch.zeros(0, 1, dtype=torch.long, device=DEVICE), 16)
    assert out.shape == (0, 1)
