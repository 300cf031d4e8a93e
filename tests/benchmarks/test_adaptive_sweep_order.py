"""adaptive_sweep's run order over repeats: every second pass reversed, so that over an even
number of repeats each run takes every place of the cell's list on average."""

from __future__ import annotations

from types import ModuleType

import pytest
from conftest import benchmark_script


@pytest.fixture(scope="module")
def sweep() -> ModuleType:
    return benchmark_script("adaptive_sweep")


def test_every_second_pass_is_reversed_and_places_even_out(sweep: ModuleType) -> None:
    cell = [(label, {"i": i}) for i, label in enumerate(["vanilla", "adaptive", "fixed 2",
                                                          "fixed 4", "fixed 6"])]
    passes = [sweep.order(cell, repeat) for repeat in range(4)]
    assert passes[0] == passes[2] == cell
    assert passes[1] == passes[3] == cell[::-1]
    places = {label: [p.index((label, spec)) for p in passes] for label, spec in cell}
    mean = (len(cell) - 1) / 2
    assert all(sum(at) / len(at) == mean for at in places.values())
    assert places["vanilla"] == [0, 4, 0, 4]
