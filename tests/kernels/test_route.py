"""The routing kernel against `ops.route`: each token's top-k experts and their softmax
probabilities (renormalised or not), expert counts that are not powers of two, any k; experts
of equal probability taken in index order; no tokens."""

from __future__ import annotations

import pytest
import torch
from kernel_cases import DEVICE, DTYPES, generator, randn, tol

from vegas_spec import ops
from vegas_spec.kernels.route import route


@pytest.mark.parametrize("renormalize", [True, False])
@pytest.mark.parametrize("dtype", DTYPES, ids=str)
@pytest.mark.parametrize("t,e,k", [(1, 128, 8), (7, 32, 4), (5, 20, 6), (3, 8, 1), (64, 128, 8)])
def test_matches_the_reference(t: int, e: int, k: int, dtype: torch.dtype,
                               renormalize: bool) -> None:
    logits = randn(t, e, gen=generator(t * e + k), dtype=dtype) * 3
    weights, ids = route(logits, k, renormalize)
    want_w, want_ids = ops.route(logits, k, renormalize)
    assert ids.dtype == torch.int64 and weights.dtype == dtype and ids.shape == (t, k)
    assert torch.equal(ids, want_ids)
    torch.testing.assert_close(weights, want_w, **tol(dtype))
    if renormalize:
        torch.testing.assert_close(weights.float().sum(-1), torch.ones(t, device=DEVICE),
                                   **tol(dtype))


def test_equal_probabilities_go_in_index_order() -> None:
    logits = torch.zeros(2, 12, device=DEVICE)
    logits[1, 7] = logits[1, 3] = 1.0
    weights, ids = route(logits, 4, True)
    assert ids.tolist() == [[0, 1, 2, 3], [3, 7, 0, 1]]
    assert torch.equal(ops.route(logits, 4, True)[1], ids)
    torch.testing.assert_close(weights[0], torch.full((4,), 0.25, device=DEVICE))
    assert weights[1, 0] == weights[1, 1] > weights[1, 2] == weights[1, 3]


def test_no_tokens() -> None:
    weights, ids = route(torch.zeros(0, 16, device=DEVICE), 2, True)
    assert weights.shape == ids.shape == (0, 2)
