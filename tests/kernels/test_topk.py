"""Radix-select top-k against `vegas_spec.speculative.policies.topk_positions`."""

from __future__ import annotations

import pytest
import torch
from kernel_cases import DEVICE, generator

from vegas_spec.kernels import topk
from vegas_spec.kernels.topk import topk_positions_triton
from vegas_spec.speculative.policies import expand_pages, topk_positions

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


# quest's pages: (leading dims, B, G, pages W, rankable tokens, k in pages, page)
PAGE_CASES = [
    ((), 2, 2, 40, [600, 37], [5, 3], 16),  # a partial last page; k covers every page
    ((2,), 3, 1, 300, [4800, 1000, 9], [30, 0, 7], 16),  # nothing wanted; k past the pages
    ((), 1, 4, 520, [8190], [256], 16),  # several blocks of pages, a partial last page
    ((), 2, 1, 50, [149, 150], [50, 10], 3),  # a page that is not a power of two
    ((), 2, 2, 64, [0, 64], [0, 0], 4),  # nothing rankable: one slot of -1s
    ((), 2, 1, 90, [70, 90], [20, 90], 1),  # tokens as units, bounded by the limit
]


def page_inputs(case: tuple, gen: torch.Generator, ties: bool,
                ) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor, torch.Tensor, int]:
    """(scores, ranked pages, pages to take, limit in tokens, page) of a PAGE_CASES case;
    ties: scores from three values only."""
    lead, bsz, groups, width, tokens, k, page = case
    shape = (*lead, bsz, groups, width)
    scores = (torch.randint(0, 3, shape, generator=gen).float().to(DEVICE) if ties
              else scores_for(shape, gen, True))
    limit = torch.tensor(tokens, device=DEVICE)
    ranked = torch.minimum(-(-limit // page), torch.tensor(width, device=DEVICE))
    return scores, ranked, torch.minimum(torch.tensor(k, device=DEVICE), ranked), limit, page


@pytest.mark.parametrize("bound", [False, True], ids=["kmax", "max_k"])
@pytest.mark.parametrize("case", PAGE_CASES, ids=lambda c: f"{c[1]}x{c[2]}x{c[3]}_page{c[6]}")
def test_pages_expand_as_the_reference(case: tuple, bound: bool) -> None:
    """Each chosen page's tokens in its slot, -1 past the rankable tokens and for the slots
    past k: the reference's output, bit for bit (continuous scores, no ties)."""
    scores, ranked, k, limit, page = page_inputs(case, generator(case[3]), ties=False)
    kmax = int(k.max()) + 3 if bound else None
    got = topk_positions_triton(scores, ranked, k, kmax, page, limit)
    want = topk_positions(scores, ranked, k, kmax, page, limit)
    assert got.shape == want.shape and got.shape[-1] % page == 0
    assert torch.equal(got, want)


@pytest.mark.parametrize("case", PAGE_CASES, ids=lambda c: f"{c[1]}x{c[2]}x{c[3]}_page{c[6]}")
def test_pages_with_ties_expand_the_unit_selection(case: tuple) -> None:
    """With ties (where torch.topk may pick other pages) the expansion in the kernel is
    `expand_pages` of the kernel's own choice of pages; without a limit nothing is cut."""
    scores, ranked, k, limit, page = page_inputs(case, generator(7), ties=True)
    units = topk_positions_triton(scores, ranked, k)
    got = topk_positions_triton(scores, ranked, k, None, page, limit)
    assert torch.equal(got, expand_pages(units, page, limit))
    whole = topk_positions_triton(scores, ranked, k, None, page)
    assert torch.equal(whole, expand_pages(units, page, None))


# (leading dims, B, G, W, rankable per sequence, k per sequence, page)
PATH_CASES = [
    ((), 1, 1, 40, [40], [7], 1),
    ((2,), 3, 1, 300, [300, 170, 9], [30, 170, 0], 1),
    ((), 2, 2, 1500, [1500, 1023], [103, 1023], 16),  # quest's shape, scaled down
    ((), 1, 2, 2048, [2048], [2000], 16),  # most of a row, every block of the old path
    ((), 2, 1, 50, [50, 49], [10, 49], 3),
]


@pytest.mark.parametrize("bits", [4, 8], ids=lambda b: f"radix{b}")
@pytest.mark.parametrize("kind", ["continuous", "ties", "few_values"])
@pytest.mark.parametrize("case", PATH_CASES, ids=lambda c: f"{c[1]}x{c[2]}x{c[3]}_page{c[6]}")
def test_resident_rows_select_as_the_chunked_kernel(case: tuple, kind: str, bits: int,
                                                    monkeypatch: pytest.MonkeyPatch) -> None:
    """Rows of at most RESIDENT_MAX_WIDTH scores (the row held in registers, one histogram per
    radix pass of 4 or 8 bits) choose exactly what the chunked kernel chooses, ties at the
    threshold to the lowest positions included."""
    monkeypatch.setattr(topk, "RESIDENT_RADIX_BITS", bits)
    lead, bsz, groups, width, rankable, k, page = case
    gen = generator(width + len(kind))
    shape = (*lead, bsz, groups, width)
    if kind == "continuous":
        scores = scores_for(shape, gen, True)
    elif kind == "ties":  # many keys equal to the threshold
        scores = torch.randint(0, 3, shape, generator=gen).float().to(DEVICE)
    else:  # keys that share most radix digits: +-0, tiny and huge values, infinities
        values = torch.tensor([-0.0, 0.0, 1e-45, -1e-45, 1.0, 1.0000001, float("inf"),
                               float("-inf"), 3e38])
        scores = values[torch.randint(0, len(values), shape, generator=gen)].to(DEVICE)
    rank = torch.tensor(rankable, device=DEVICE)
    budget = torch.minimum(torch.tensor(k, device=DEVICE), rank)
    limit = rank * page - 1
    assert width <= topk.RESIDENT_MAX_WIDTH
    resident = topk_positions_triton(scores, rank, budget, None, page, limit)
    monkeypatch.setattr(topk, "RESIDENT_MAX_WIDTH", 0)
    chunked = topk_positions_triton(scores, rank, budget, None, page, limit)
    assert torch.equal(resident, chunked)


def test_rows_wider_than_the_resident_bound_match_the_reference() -> None:
    width = topk.RESIDENT_MAX_WIDTH + 5
    scores = scores_for((1, 1, width), generator(11), True)
    rank, k = torch.tensor([width - 2], device=DEVICE), torch.tensor([300], device=DEVICE)
    assert torch.equal(topk_positions_triton(scores, rank, k), topk_positions(scores, rank, k))
