"""quest's fused page scores against `quest_page_scores_ref`, and the quest selector through
the Triton backend (its page-score kernel and top-k) against the references."""

from __future__ import annotations

import pytest
import torch
from kernel_cases import DEVICE, DTYPES, generator

from vegas_spec.attention.context import StepContext
from vegas_spec.attention.torch_backend import TorchBackend
from vegas_spec.attention.triton_backend import TritonBackend
from vegas_spec.kernels.quest_scores import quest_page_scores
from vegas_spec.kernels.rope_store import rope_store
from vegas_spec.ops import apply_rope, quest_page_scores_ref
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


def test_a_narrower_key_width_reads_a_view_of_the_bounds() -> None:
    """A graph at a narrower key width scores the first pages of the state's bounds, a view
    whose rows keep the whole width's stride: the kernel's scores are those of a contiguous
    copy of the same pages, bit for bit, and the reference's."""
    gen = generator(17)
    bsz, heads, hkv, dim, whole, narrow = 3, 8, 2, 64, 40, 13
    lo, hi = bounds(bsz, whole, hkv, dim, torch.float32, gen)
    q = torch.randn(bsz, 1, heads, dim, generator=gen).to(DEVICE)
    ranked = torch.tensor([13, 6, 9], device=DEVICE)
    view_lo, view_hi = lo[:, :narrow], hi[:, :narrow]
    assert not view_lo.is_contiguous()
    got = quest_page_scores(q, view_lo, view_hi, ranked)
    assert got.shape == (bsz, hkv, narrow)
    assert torch.equal(got, quest_page_scores(q, view_lo.contiguous(), view_hi.contiguous(),
                                              ranked))
    want = quest_page_scores_ref(q, view_lo, view_hi, ranked)
    shown = torch.arange(narrow, device=DEVICE) < ranked[:, None, None]
    torch.testing.assert_close(got[shown.expand_as(got)], want[shown.expand_as(want)],
                               atol=1e-4, rtol=1e-5)


def test_selector_through_the_backend_picks_the_reference_pages() -> None:
    """The selector with the Triton backend (kernel scores, the kernel top-k) keeps the same
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


def rope_inputs(case: tuple, dtype: torch.dtype, gen: torch.Generator,
                ) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor, torch.Tensor]:
    """(q before RoPE [B, 1, H, D] as a view into a fused qkv row, the same q rotated by
    `rope_store`, the table, positions [B, 1]) of a CASES case."""
    bsz, heads, hkv, dim, _, _ = case
    qkv = torch.randn(bsz, 1, (heads + 2 * hkv) * dim, generator=gen).to(DEVICE, dtype)
    q = qkv[..., : heads * dim].view(bsz, 1, heads, dim)
    k = qkv[..., heads * dim: (heads + hkv) * dim].view(bsz, 1, hkv, dim)
    table = (2 * torch.rand(300, dim, generator=gen) - 1).to(DEVICE)
    positions = torch.randint(0, 300, (bsz, 1), generator=gen).to(DEVICE)
    cache = torch.zeros(1, hkv, dim, device=DEVICE, dtype=dtype)
    slots = torch.full((bsz, 1), -1, device=DEVICE)  # nothing stored
    q_rot = rope_store(q, k, k, cache, cache.clone(), table, positions, slots)
    return q, q_rot, table, positions


@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("case", CASES, ids=lambda c: f"b{c[0]}_h{c[1]}x{c[2]}_d{c[3]}_np{c[4]}")
def test_rope_inside_scores_as_rope_store_then_the_kernel(case: tuple, dtype: torch.dtype,
                                                          ) -> None:
    """q before RoPE with the table and positions: the bits of the kernel on `rope_store`'s
    rotated q (the same rotation, rounded as apply_rope rounds it), and the torch backend's
    scores of apply_rope's q."""
    bsz, _, hkv, dim, num_pages, pages = case
    gen = generator(9)
    lo, hi = bounds(bsz, num_pages, hkv, dim, dtype, gen)
    q, q_rot, table, positions = rope_inputs(case, dtype, gen)
    assert torch.equal(q_rot, apply_rope(q, table, positions))
    ranked = torch.tensor(pages, device=DEVICE)
    got = quest_page_scores(q, lo, hi, ranked, table, positions)
    assert torch.equal(got, quest_page_scores(q_rot, lo, hi, ranked))
    want = TorchBackend().quest_page_scores(q, lo, hi, ranked, table, positions)
    assert torch.equal(want, quest_page_scores_ref(q_rot, lo, hi, ranked))


def test_selector_with_rope_picks_the_pages_of_the_rotated_q() -> None:
    """The selector handed the RoPE table (q before RoPE, rotated at ctx.positions) keeps the
    positions it keeps for the rotated q, through the Triton backend and the references."""
    gen = generator(13)
    case = (3, 8, 2, 64, 24, [24, 7, 13])
    bsz, heads, hkv, dim, num_pages, _ = case
    lo, hi = bounds(bsz, num_pages, hkv, dim, torch.float32, gen)
    q, q_rot, table, positions = rope_inputs(case, torch.float32, gen)
    rankable = torch.tensor([24 * 16, 100, 13 * 16], device=DEVICE)
    selector = QuestSelector([(lo, hi)], rankable, torch.tensor([5, 3, 7], device=DEVICE), 16, 7)
    ctx = StepContext(positions=positions,
                      slot_mapping=torch.full_like(positions, -1),
                      page_table=torch.zeros(bsz, 1, dtype=torch.int32, device=DEVICE),
                      page_size=16, kv_len_max=num_pages * 16)
    want = selector(0, q_rot, ctx)
    assert (want >= 0).sum() > 0
    assert torch.equal(selector(0, q, ctx, None, table), want)
    assert torch.equal(selector(0, q, ctx, TritonBackend(), table), want)
