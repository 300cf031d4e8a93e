"""quest's fused page scores against `quest_page_scores_ref`, and the quest selector through
the Triton backend (its page-score kernel and radix top-k) against the references."""

from __future__ import annotations

import pytest
import torch
from kernel_cases import DEVICE, DTYPES, generator

from vegas_spec.attention.torch_backend import quest_page_scores_ref
from vegas_spec.attention.triton_backend import TritonBackend
from vegas_spec.kernels import quest_scores, topk
from vegas_spec.kernels.quest_scores import one_kernel, quest_page_scores, quest_select
from vegas_spec.speculative.policies import QuestSelector

# (B, H, Hkv, D, NP, pages per sequence)
CASES = [
    (2, 8, 2, 64, 40, [40, 17]),
    (3, 9, 3, 64, 70, [1, 70, 0]),  # SmolLM2's group of 3 heads, a sequence with no pages
    (1, 4, 4, 128, 130, [129]),  # one head per kv head, a partial last block of pages
    (2, 6, 2, 80, 33, [33, 5]),  # head dim not a power of two
]


def bounds(bsz: int, pages: int, hkv: int, dim: int, dtype: torch.dtype,
           gen: torch.Generator) -> tuple[torch.Tensor, torch.Tensor]:
    """Random page bounds with lo <= hi, in the cache dtype."""
    a = torch.randn(bsz, pages, hkv, dim, generator=gen)
    b = torch.randn(bsz, pages, hkv, dim, generator=gen)
    return (torch.minimum(a, b).to(DEVICE, dtype), torch.maximum(a, b).to(DEVICE, dtype))


@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("case", CASES, ids=lambda c: f"b{c[0]}_h{c[1]}x{c[2]}_d{c[3]}_np{c[4]}")
def test_matches_reference(case: tuple, dtype: torch.dtype) -> None:
    bsz, heads, hkv, dim, num_pages, pages = case
    gen = generator(3)
    lo, hi = bounds(bsz, num_pages, hkv, dim, dtype, gen)
    q = torch.randn(bsz, 1, heads, dim, generator=gen).to(DEVICE, dtype)
    ranked = torch.tensor(pages, device=DEVICE)
    got = quest_page_scores(q, lo, hi, ranked)
    want = quest_page_scores_ref(q, lo, hi, ranked)
    assert got.shape == (bsz, hkv, num_pages) and got.dtype == torch.float32
    hidden = torch.arange(num_pages, device=DEVICE) >= ranked[:, None, None]
    assert torch.isneginf(got[hidden.expand_as(got)]).all()
    tol = {"atol": 1e-4, "rtol": 1e-5} if dtype == torch.float32 else {"atol": 2e-2, "rtol": 1e-2}
    torch.testing.assert_close(got[~hidden.expand_as(got)], want[~hidden.expand_as(want)], **tol)


@pytest.mark.parametrize("one", [True, False], ids=["one_kernel", "two_kernels"])
def test_selector_through_the_backend_picks_the_reference_pages(
        one: bool, monkeypatch: pytest.MonkeyPatch) -> None:
    """The selector with the Triton backend (kernel scores, radix top-k, in one kernel or in
    two) keeps the same positions as with the references, for continuous scores (no ties)."""
    monkeypatch.setattr(quest_scores, "QUEST_ONE_KERNEL", one)
    gen = generator(5)
    bsz, heads, hkv, dim, page, num_pages = 3, 8, 2, 64, 16, 24
    lo, hi = bounds(bsz, num_pages, hkv, dim, torch.float32, gen)
    rankable = torch.tensor([24 * 16, 100, 7 * 16], device=DEVICE)
    n_pages = torch.tensor([5, 3, 7], device=DEVICE)
    selector = QuestSelector([(lo, hi)], rankable, n_pages, page, 7)
    q = torch.randn(bsz, 1, heads, dim, generator=gen).to(DEVICE)
    want = selector(0, q, None)
    got = selector(0, q, None, TritonBackend())
    assert got.shape == want.shape
    assert torch.equal(got, want)


# (page, kmax, with a token limit)
SELECTIONS = [(16, 6, True), (1, None, False), (4, 40, True)]


@pytest.mark.parametrize("selection", SELECTIONS, ids=lambda c: f"page{c[0]}_kmax{c[1]}")
@pytest.mark.parametrize("case", CASES, ids=lambda c: f"b{c[0]}_h{c[1]}x{c[2]}_d{c[3]}_np{c[4]}")
def test_one_kernel_selects_what_the_two_kernels_select(
        case: tuple, selection: tuple, monkeypatch: pytest.MonkeyPatch) -> None:
    """Page scores and top-k in one program per row: the same positions, -1 padding and
    token limit included, as the page-score kernel followed by the top-k kernel."""
    bsz, heads, hkv, dim, num_pages, pages = case
    page, kmax, limited = selection
    gen = generator(len(pages) + num_pages)
    lo, hi = bounds(bsz, num_pages, hkv, dim, torch.float32, gen)
    q = torch.randn(bsz, 1, heads, dim, generator=gen).to(DEVICE)
    ranked = torch.tensor(pages, device=DEVICE)
    keep = torch.minimum(torch.tensor([5, 2, 9][:bsz], device=DEVICE), ranked)
    limit = ranked * page - page // 2 if limited else None
    got = {}
    for one in (True, False):
        monkeypatch.setattr(quest_scores, "QUEST_ONE_KERNEL", one)
        got[one] = quest_select(q, lo, hi, ranked, keep, kmax, page, limit)
    assert got[True].shape == got[False].shape and got[True].dtype == torch.int64
    assert torch.equal(got[True], got[False])
    assert (got[True] >= 0).any()


def test_one_kernel_rule(monkeypatch: pytest.MonkeyPatch) -> None:
    """auto: never past the resident top-k's width; rows of few bound bytes take one kernel;
    True / False force it."""
    cpu = torch.device("cpu")
    small = quest_scores.QUEST_ONE_KERNEL_ROW_BYTES
    assert one_kernel(4, 100, small, cpu)
    assert not one_kernel(4, 100, small + 1, cpu)
    assert not one_kernel(4, topk.RESIDENT_MAX_WIDTH + 1, 16, cpu)
    monkeypatch.setattr(quest_scores, "QUEST_ONE_KERNEL", True)
    assert one_kernel(4, 100, small + 1, cpu)
    monkeypatch.setattr(quest_scores, "QUEST_ONE_KERNEL", False)
    assert not one_kernel(4, 100, 16, cpu)
