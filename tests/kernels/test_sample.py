"""The sampling kernel against `sampling.exponential_argmax_ref`: the same integer hash, so
the same uniforms and the same token per row (only log's last bit may differ, which moves no
argmax of these rows); a one-hot row (a greedy row of a sampled batch) gives its token."""

from __future__ import annotations

import pytest
import torch
from kernel_cases import DEVICE, generator

from vegas_spec.kernels.sample import exponential_argmax
from vegas_spec.sampling import DRAFT, draw_keys, exponential_argmax_ref


@pytest.mark.parametrize("vocab", [7, 2048, 5000, 49152])
def test_draws_the_references_tokens(vocab: int) -> None:
    rows = 24
    p = torch.softmax(torch.randn(rows, vocab, generator=generator(vocab)) * 3, -1)
    p[3] = torch.nn.functional.one_hot(torch.tensor(vocab - 1), vocab).float()
    keys = draw_keys(torch.arange(rows) * 977 - 5, torch.arange(rows) * 13, DRAFT)
    got = exponential_argmax(p.to(DEVICE), keys.to(DEVICE)).cpu()
    assert torch.equal(got, exponential_argmax_ref(p, keys))
    assert got[3] == vocab - 1


def test_rows_of_a_strided_view() -> None:
    """A row stride past the vocabulary (a slice of a wider buffer) reads the right rows."""
    wide = torch.softmax(torch.randn(6, 300, generator=generator(1)), -1)
    keys = draw_keys(torch.arange(6), torch.arange(6), DRAFT)
    got = exponential_argmax(wide[:, :200].to(DEVICE), keys.to(DEVICE)).cpu()
    assert torch.equal(got, exponential_argmax_ref(wide[:, :200].contiguous(), keys))


@pytest.mark.parametrize("width", [5, 64])
def test_candidates_draw_their_dense_rows_tokens(width: int) -> None:
    """Weights of listed token ids (a candidate row, ids in any order, one id repeated with
    weight 0) draw the token their vocabulary-wide row draws, on the kernel and the
    reference alike; equal ratios go to the lowest id."""
    rows, vocab = 40, 3000
    g = generator(width)
    index = torch.stack([torch.randperm(vocab, generator=g)[:width] for _ in range(rows)])
    values = torch.softmax(torch.randn(rows, width, generator=g) * 2, -1)
    values[:, -1] = 0.0
    index[:, -1] = index[:, 0]  # a repeated id of weight 0 changes nothing
    dense = torch.zeros(rows, vocab).scatter_add_(-1, index, values)
    keys = draw_keys(torch.arange(rows) * 31 + 7, torch.arange(rows), DRAFT)
    want = exponential_argmax_ref(dense, keys)
    assert torch.equal(exponential_argmax_ref(values, keys, index), want)
    got = exponential_argmax(values.to(DEVICE), keys.to(DEVICE), index.to(DEVICE)).cpu()
    assert torch.equal(got, want)
    # a tie of ratios (the same id listed twice with the same weight): the lowest id wins
    tie_v = torch.tensor([[0.5, 0.5, 0.0]])
    tie_i = torch.tensor([[9, 4, 2]])
    one = draw_keys(torch.tensor([3]), torch.tensor([0]), DRAFT)
    tie_i[0, 0] = 4
    assert exponential_argmax_ref(tie_v, one, tie_i).item() == 4
    assert exponential_argmax(tie_v.to(DEVICE), one.to(DEVICE), tie_i.to(DEVICE)).item() == 4
