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
