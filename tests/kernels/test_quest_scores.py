"""quest's fused page scores against `quest_page_scores_ref`, and the quest selector through
the Triton backend (its page-score kernel and radix top-k) against the references."""

from __future__ import annotations

import pytest
import torch
from kernel_cases import DEVICE, DTYPES, generator

from vegas_spec.attention.torch_backend import quest_page_scores_ref
from vegas_spec.attention.triton_backend import TritonBackend
from vegas_spec.kernels.quest_scores import quest_page_scores
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


def test_selector_through_the_backend_picks_the_reference_pages() -> None:
    """The selector with the Triton backend (kernel scores, radix top-k) keeps the same
    positions as with the references, for continuous scores (no ties)."""
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
