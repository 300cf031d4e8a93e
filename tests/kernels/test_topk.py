"""Radix-select top-k against `vegas_spec.speculative.policies.topk_positions`."""

from __future__ import annotations

import pytest
import torch
from kernel_cases import DEVICE, generator

from vegas_spec.kernels.topk import topk_positions_triton
from vegas_spec.speculative.policies import topk_positions

# (leading dims, B, G, W, rankable per sequence, k per sequence)
CASES = [
    ((), 1, 1, 40, [40], [7]),
    ((2,), 3, 1, 300, [300, 170, 9], [30, 170, 0]),  # dense, nothing selected
    ((2,), 1, 4, 520, [515], [256]),  # per kv head, several blocks
    ((2,), 2, 2, 64, [0, 64], [0, 0]),  # nothing rankable, nothing wanted: width 1 of -1
    ((), 2, 1, 1000, [999, 600], [600, 999]),  # k beyond rankable: capped
]


def scores_for(shape: tuple[int, ...], gen: torch.Generator, mixed: bool) -> torch.Tensor:
    """Continuous scores (no ties); `mixed` gives both signs and several magnitudes, as
    raw logits have, else small positive softmax-like weights."""
    x = torch.rand(*shape, generator=gen)
    if mixed:
        x = torch.randn(*shape, generator=gen) * torch.exp(torch.randn(*shape, generator=gen))
    return x.to(DEVICE)


@pytest.mark.parametrize("mixed", [False, True], ids=["weights", "logits"])
@pytest.mark.parametrize("case", CASES, ids=lambda c: f"{c[0]}x{c[1]}x{c[2]}x{c[3]}")
def test_matches_reference(case: tuple, mixed: bool) -> None:
    lead, bsz, groups, width, rankable, k = case
    gen = generator(width)
    scores = scores_for((*lead, bsz, groups, width), gen, mixed)
    rank = torch.tensor(rankable, device=DEVICE)
    budget = torch.minimum(torch.tensor(k, device=DEVICE), rank)  # as policies.budget caps it
    got = topk_positions_triton(scores, rank, budget)
    want = topk_positions(scores, rank, budget)
    assert got.dtype == want.dtype and got.shape == want.shape
    assert torch.equal(got, want)


def test_ties_take_the_lowest_positions() -> None:
    scores = torch.zeros(1, 1, 50, device=DEVICE)
    scores[0, 0, [3, 17, 40]] = 1.0
    got = topk_positions_triton(scores, torch.tensor([45], device=DEVICE),
                                torch.tensor([5], device=DEVICE))
    assert got.tolist() == [[[0, 1, 3, 17, 40]]]


def test_negative_zero_and_infinities() -> None:
    scores = torch.tensor([[[-0.0, 0.0, float("-inf"), float("inf"), -1e30, 1e-30]]],
                          device=DEVICE)
    got = topk_positions_triton(scores, torch.tensor([6], device=DEVICE),
                                torch.tensor([3], device=DEVICE))
    assert got.tolist() == [[[1, 3, 5]]]
