"""Radix-select top-k against `vegas_spec.ops.topk_positions`, and against the kernel's tie
rule (the lowest positions at the threshold) written in plain PyTorch."""

from __future__ import annotations

import math

import pytest
import torch
from kernel_cases import DEVICE, generator, retune

from vegas_spec.kernels import topk
from vegas_spec.kernels.topk import topk_positions_triton
from vegas_spec.ops import expand_pages, topk_positions

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


def lowest_on_ties(scores: torch.Tensor, rankable: torch.Tensor,
                   k: torch.Tensor) -> torch.Tensor:
    """The kernel's choice in plain PyTorch: the k[b] largest 32-bit keys < rankable[b] (the
    float order, -0.0 below +0.0), the lowest positions first among equal keys, ascending,
    -1 padded to max(k) (at least 1, at most W)."""
    bits = scores.view(torch.int32)
    key = torch.where(bits >= 0, bits, bits ^ 0x7FFFFFFF).long()  # signed, in float order
    width = scores.shape[-1]
    visible = torch.arange(width, device=scores.device) < rankable[:, None, None]
    key = key.masked_fill(~visible, torch.iinfo(torch.int64).min)
    # a stable descending sort keeps equal keys in position order
    order = torch.sort(key, dim=-1, descending=True, stable=True).indices
    out_width = min(max(int(k.max()), 1), width)
    keep = torch.arange(out_width, device=scores.device) < k[:, None, None]
    chosen = torch.where(keep, order[..., :out_width], width).sort(dim=-1).values
    return torch.where(chosen == width, -1, chosen)


# (leading dims, B, G, W, rankable per sequence, k per sequence, page)
PATH_CASES = [
    ((), 1, 1, 40, [40], [7], 1),
    ((2,), 3, 1, 300, [300, 170, 9], [30, 170, 0], 1),
    ((), 2, 2, 1500, [1500, 1023], [103, 1023], 16),  # quest's shape, scaled down
    ((), 1, 2, 2048, [2048], [2000], 16),  # most of a row
    ((), 2, 1, 50, [50, 49], [10, 49], 3),
]


@pytest.mark.parametrize("kind", ["continuous", "ties", "few_values"])
@pytest.mark.parametrize("case", PATH_CASES, ids=lambda c: f"{c[1]}x{c[2]}x{c[3]}_page{c[6]}")
def test_selection_takes_the_lowest_positions_on_ties(case: tuple, kind: str) -> None:
    """The kernel chooses the k largest keys and, among keys equal to the threshold, the
    lowest positions (`lowest_on_ties`), then expands the chosen pages as `expand_pages`
    does."""
    lead, bsz, groups, width, rankable, k, page = case
    gen = generator(width + len(kind))
    shape = (*lead, bsz, groups, width)
    if kind == "continuous":
        scores = scores_for(shape, gen, True)
    elif kind == "ties":  # many keys equal to the threshold
        scores = torch.randint(0, 3, shape, generator=gen).float().to(DEVICE)
    else:  # keys that share most high bits: +-0, tiny and huge values, infinities
        values = torch.tensor([-0.0, 0.0, 1e-45, -1e-45, 1.0, 1.0000001, float("inf"),
                               float("-inf"), 3e38])
        scores = values[torch.randint(0, len(values), shape, generator=gen)].to(DEVICE)
    rank = torch.tensor(rankable, device=DEVICE)
    budget = torch.minimum(torch.tensor(k, device=DEVICE), rank)
    limit = rank * page - 1
    units = lowest_on_ties(scores, rank, budget)
    assert (units >= 0).sum() == budget.sum() * math.prod(lead) * groups  # k[b] chosen a row
    got = topk_positions_triton(scores, rank, budget, None, page, limit)
    assert torch.equal(got, expand_pages(units, page, limit))


def test_rows_of_the_resident_bound_match_the_reference() -> None:
    """The widest row the kernel takes (16 keys a thread on a GPU)."""
    width = topk.RESIDENT_MAX_WIDTH
    scores = scores_for((2, 1, width), generator(11), True)
    rank, k = torch.tensor([width, width - 2], device=DEVICE), torch.tensor([300, 2047],
                                                                            device=DEVICE)
    assert torch.equal(topk_positions_triton(scores, rank, k), topk_positions(scores, rank, k))


# (leading dims, B, R, G, W of the buffer, W ranked, rankable per sequence, k per sequence)
ROW_SUM_CASES = [
    ((3,), 2, 2, 1, 300, 300, [300, 120], [40, 120]),  # vegas's collect-2, whole rows
    ((2,), 3, 2, 2, 530, 500, [500, 499, 7], [60, 0, 7]),  # per kv head, a sliced width
    ((2,), 2, 1, 1, 64, 40, [40, 33], [5, 33]),  # one row (prefill): nothing to add
]


@pytest.mark.parametrize("case", ROW_SUM_CASES, ids=lambda c: f"R{c[2]}_G{c[3]}_W{c[5]}")
def test_rows_summed_as_loaded_match_the_sum_ranked(case: tuple) -> None:
    """The top-k of scores [..., B, R, G, W] summed over R as the kernel loads them (from a
    slice of a wider buffer, as vegas ranks below max_model_len) is the reference's top-k of
    `scores.sum(-3)`, bit for bit, with the same kmax."""
    lead, bsz, rows, groups, full, width, rankable, k = case
    buffer = scores_for((*lead, bsz, rows, groups, full), generator(full + rows), False)
    scores = buffer[..., :width]
    rank = torch.tensor(rankable, device=DEVICE)
    budget = torch.minimum(torch.tensor(k, device=DEVICE), rank)
    kmax = int(budget.max()) + 2
    got = topk.topk_row_sum_triton(scores, rank, budget, kmax)
    want = topk_positions(scores.sum(-3), rank, budget, kmax)
    assert got.shape == want.shape == (*lead, bsz, groups, min(kmax, width))
    assert torch.equal(got, want)
    assert (got >= 0).sum() == budget.sum() * math.prod(lead) * groups


def test_rows_summed_from_a_strided_copy_need_no_layout() -> None:
    """Scores whose dims do not step as a contiguous tensor's (a transposed buffer) are
    ranked as their contiguous copy."""
    base = scores_for((2, 1, 2, 3, 90), generator(5), False)  # [layers, G, R, B, W]
    scores = base.permute(0, 3, 2, 1, 4)  # [layers, B, R, G, W], not contiguous
    assert topk._row_stride(scores) is None
    rank, k = torch.tensor([90, 80, 70], device=DEVICE), torch.tensor([9, 8, 7], device=DEVICE)
    assert torch.equal(topk.topk_row_sum_triton(scores, rank, k, 9),
                       topk_positions(scores.sum(-3), rank, k, 9))


def test_rows_wider_than_the_resident_bound_are_refused(monkeypatch: pytest.MonkeyPatch,
                                                        ) -> None:
    """Wider rows are the reference's (through the backend's `topk`); the bound is read at
    each call."""
    rank, k = torch.tensor([10], device=DEVICE), torch.tensor([3], device=DEVICE)
    wide = torch.zeros(1, 1, topk.RESIDENT_MAX_WIDTH + 1, device=DEVICE)
    with pytest.raises(ValueError, match="RESIDENT_MAX_WIDTH"):
        topk_positions_triton(wide, rank, k)
    monkeypatch.setattr(topk, "RESIDENT_MAX_WIDTH", 16)
    with pytest.raises(ValueError, match="17 scores"):
        topk_positions_triton(torch.zeros(1, 1, 17, device=DEVICE), rank, k)
    scores = torch.arange(16.0, device=DEVICE)[None, None]
    assert topk_positions_triton(scores, rank, k).tolist() == [[[7, 8, 9]]]


def test_warps_by_row_width(monkeypatch: pytest.MonkeyPatch) -> None:
    """One warp per keys_per_warp scores, at least min_warps, at most max_warps."""
    retune(monkeypatch, topk, keys_per_warp=256, max_warps=16)
    widths = (64, 512, 2048, 8192)
    assert [topk.resident_warps(w, DEVICE) for w in widths] == [4, 4, 8, 16]
    retune(monkeypatch, topk, min_warps=1)
    assert [topk.resident_warps(w, DEVICE) for w in widths] == [1, 2, 8, 16]
    retune(monkeypatch, topk, min_warps=0)
    assert topk.resident_warps(64, DEVICE) == 1
